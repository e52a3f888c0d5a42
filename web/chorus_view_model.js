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
    density: density == null ? "kept density: warm-up (dense)" : `kept density ${percent(density)} (warm-up excluded)`,
    saved: savedLine(report, density),
  };
  return lines;
}

function entryLine(report) {
  const similarity = report?.similarity == null ? null : Number(report.similarity).toFixed(3);
  if (report?.mode === "hit") return `entry ${shortId(report.entry_id)} · similarity ${similarity ?? "–"}`;
  // The final report says what was compared: no components means no compatible entry existed.
  if (report?.components && Object.keys(report.components).length === 0) return "bank: no entries yet to match";
  if (similarity != null) return `best similarity ${similarity}, below threshold`;
  return report?.mask_source ? `source: ${report.mask_source}` : "";
}

function shortId(id) {
  const text = String(id ?? "–");
  return text.length > 12 ? `${text.slice(0, 12)}…` : text;
}

// The report measures sampling time, not attention time alone: show the measured saving when
// the report carries it (timings.attention_saved_ms), else the share of attention blocks skipped.
function savedLine(report, density) {
  const saved = report?.timings?.attention_saved_ms;
  if (saved != null) return `attention time saved ${(saved / 1000).toFixed(1)} s`;
  if (density == null) return "";
  return `attention blocks skipped ${percent(1 - density)} (time not measured)`;
}
