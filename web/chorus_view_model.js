// What the per-layer reuse view shows, computed from a Chorus report (the "chorus.step" event
// payload or the sampler's final "chorus_report"). No imports and no DOM, so it is unit-tested
// in Node.js (tests/test_browser_view_model.py); chorus_reuse_view.js only renders it.

// How the masks of this run were chosen; each kind has its own colour in the view.
export const SOURCE_KINDS = {
  hit: { label: "HIT", colour: "#2fb37a", meaning: "reusing the masks of a similar earlier request" },
  online: { label: "MISS · online", colour: "#e0a030", meaning: "no similar entry: masks predicted each step" },
  prior: { label: "MISS · prior", colour: "#9a6cf0", meaning: "no similar entry: the bank's population prior" },
  dense: { label: "MISS · dense", colour: "#8a8f98", meaning: "no similar entry: dense attention" },
  miss: { label: "MISS", colour: "#e0a030", meaning: "no similar entry" },
};
export const DENSE_COLOUR = "#5b606a";

export function sourceKind(report) {
  if (report?.mode === "hit") return "hit";
  const source = String(report?.mask_source ?? "");
  if (source.startsWith("online")) return "online";
  if (source.startsWith("population prior")) return "prior";
  if (source === "dense") return "dense";
  return "miss";
}

// Share of key blocks each layer kept on its sparse calls. The report's per-layer "density"
// averages sparse calls only, so dense warm-up steps are not in it; a layer with no sparse call
// so far (warm-up, or a dense layer) is shown dense.
export function layerBars(report) {
  return (report?.layers ?? []).map((row) => {
    const sparse = (row.sparse_share ?? 0) > 0 && row.density != null;
    const kept = sparse ? row.density : 1;
    return {
      label: `L${row.layer}`,
      kept,
      dense: !sparse,
      title: sparse
        ? `layer ${row.layer}: keeps ${percent(kept)} of key blocks on its sparse steps (${percent(row.sparse_share)} of its calls sparse)`
        : `layer ${row.layer}: dense so far`,
    };
  });
}

// Mean kept density over the layers' sparse calls (warm-up excluded); dense layers count as 1.
export function keptDensity(report) {
  const bars = layerBars(report);
  if (!bars.some((bar) => !bar.dense)) return null;
  return bars.reduce((sum, bar) => sum + bar.kept, 0) / bars.length;
}

// Every sparse layer kept the same share, within one key block of max_density: the cap chose
// how much each layer kept, not its attention (masks.density_bounds floors max_density x blocks,
// so a capped layer sits up to one block below it; ten blocks at least on the tiny model).
const CAP_SLACK = 0.1;
const SAME_SHARE = 0.005;

export function cappedByMaxDensity(report) {
  const cap = report?.max_density;
  const kept = layerBars(report).filter((bar) => !bar.dense).map((bar) => bar.kept);
  if (cap == null || kept.length === 0) return false;
  const low = Math.min(...kept);
  return Math.max(...kept) - low < SAME_SHARE && low > cap - CAP_SLACK;
}

// Labels under the bars: every layer when few, else every step-th so they stay readable.
export function labelStride(count, maxLabels = 10) {
  return Math.max(1, Math.ceil(count / maxLabels));
}

export function percent(value) {
  return value == null ? "–" : `${Math.round(value * 100)}%`;
}

// The lines of text the view shows; each line answers one question at a glance.
export function summarise(report) {
  const kind = sourceKind(report);
  const density = keptDensity(report);
  const lines = {
    kind,
    badge: SOURCE_KINDS[kind].label,
    colour: SOURCE_KINDS[kind].colour,
    meaning: SOURCE_KINDS[kind].meaning,
    entry: entryLine(report),
    step: report?.steps ? `step ${report.step ?? 0}/${report.steps}` : "",
    density: densityLine(report, density),
    saved: savedLine(report, density),
    savedMeaning: "Mean wall time of this run's sparse steps against its dense warm-up step (usually the " +
      "first, so it also carries one-time costs); without both, the share of attention blocks skipped.",
    recording: [recordingLine(report), evictionLine(report)].filter(Boolean).join(" · "),
  };
  return lines;
}

// The bank keeps its own size budget: a write that evicted entries says so once, in short (the
// report's evictions[].line has the ids and the budget).
function evictionLine(report) {
  const evictions = report?.evictions ?? [];
  const entries = evictions.reduce((n, e) => n + (e.evicted ?? 0), 0);
  if (!entries) return "";
  const freed = evictions.reduce((n, e) => n + (e.bytes_freed ?? 0), 0);
  return `bank budget: ${entries} ${entries === 1 ? "entry" : "entries"} evicted (${humanBytes(freed)} freed)`;
}

function humanBytes(n) {
  for (const [unit, size] of [["TB", 1e12], ["GB", 1e9], ["MB", 1e6], ["kB", 1e3]]) {
    if (n >= size) return `${(n / size).toFixed(1)} ${unit}`;
  }
  return `${n} bytes`;
}

function entryLine(report) {
  const similarity = report?.similarity == null ? null : Number(report.similarity).toFixed(3);
  if (report?.mode === "hit") return `entry ${shortId(report.entry_id)} · similarity ${similarity ?? "–"}`;
  // The final report says what was compared: no components means no compatible entry existed.
  if (report?.components && Object.keys(report.components).length === 0) return "bank: no entries yet to match";
  if (similarity != null) return `best similarity ${similarity}, below threshold`;
  return report?.mask_source ? `source: ${report.mask_source}` : "";
}

// States of a queued recording that may still change: the view keeps asking the server.
export const RECORDING_PENDING = new Set(["queued", "retrying"]);

// Where this run's recording is: "queued" is on disk in the bank's spool (it survives a stop or a
// crash) and goes into the bank in the background. The report is sent before that write, so the
// view asks the server (/chorus/api/recordings/<id>, kept as report.recording_state) until the
// write is recorded or has failed.
function recordingLine(report) {
  const id = shortId(report?.recorded_entry_id);
  const polled = report?.recording === "queued" ? report?.recording_state?.state : null;
  if (polled === "recorded") return `recorded as entry ${id}`;
  if (polled === "failed") return `recording ${id} failed: ${failureReason(report.recording_state)}`;
  if (polled === "retrying") return `recording ${id} queued: its write failed, trying again (try ${report.recording_state.attempts + 1})`;
  if (polled === "unknown") return `recording ${id} queued: this server no longer tracks it (restarted?)`;
  if (report?.recording === "queued") return `recording ${id} queued: on disk, going into the bank`;
  if (report?.recording === "recorded") return `recorded as entry ${id}`;
  const dropped = (report?.warnings ?? []).find((w) => String(w).startsWith("masks not recorded"));
  return dropped ? "not recorded (see warnings)" : "";
}

// The server's short reason (never a server path), else the error's kind.
function failureReason(state) {
  return state?.reason ?? state?.error ?? "the ComfyUI log says why";
}

function shortId(id) {
  const text = String(id ?? "–");
  return text.length > 12 ? `${text.slice(0, 12)}…` : text;
}

function densityLine(report, density) {
  if (density == null) return "kept density: warm-up (dense)";
  const line = `kept density ${percent(density)} (warm-up excluded)`;
  return cappedByMaxDensity(report) ? `${line}, capped by max_density` : line;
}

// The run times its own steps (timings.sparse_step_s against dense_step_s, the dense warm-up);
// a hit sparse from its first step has no dense step, and is timed against the dense step of an
// earlier run of the same model, grid and batch in this server (earlier_dense_step_s). Else only
// the share of attention blocks skipped.
function savedLine(report, density) {
  const own = report?.timings?.dense_step_s;
  const earlier = report?.timings?.earlier_dense_step_s;
  const dense = own ?? earlier;
  const sparse = report?.timings?.sparse_step_s;
  if (dense > 0 && sparse != null) {
    const change = 1 - sparse / dense;
    const verdict = change >= 0 ? `${percent(change)} faster` : `${percent(-change)} slower`;
    const which = own != null ? "dense step" : "an earlier run's dense step";
    return `sparse step ${seconds(sparse)} vs ${which} ${seconds(dense)}: ${verdict}`;
  }
  if (density == null) return "";
  const why = (report?.step ?? 0) < (report?.steps ?? 0) ? "step times come at the end" : "no dense step to time against";
  return `attention blocks skipped ${percent(1 - density)} (${why})`;
}

function seconds(value) {
  return `${value < 10 ? value.toFixed(2) : value.toFixed(1)} s`;
}
