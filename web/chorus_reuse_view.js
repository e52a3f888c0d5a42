// Chorus: the per-layer reuse view, a DOM widget on the node that runs a Chorus generation.
// The server sends "chorus.run_start" when a run begins and one "chorus.step" event per step,
// each with the executing node id (a "parent:child" path inside subgraphs); the node's final
// "executed" output carries the whole report (entry, similarity, mask source, timings); for the
// Chorus Sparse Attention node the report comes as a "chorus.report" event.
// A DOM widget, not canvas drawing: both of the frontend's renderers show it, the LiteGraph
// canvas and the Vue nodes ("Nodes 2.0", setting Comfy.VueNodes.Enabled).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { chorusErrorsOnce } from "./chorus_node_errors.js";
import { resolveNodePath } from "./chorus_node_paths.js";
import { DENSE_COLOUR, RECORDING_PENDING, labelStride, layerBars, percent, summarise } from "./chorus_view_model.js";

const EXTENSION = "chorus.reuse_view";
const VIEW_TYPES = new Set(["ChorusSparseWanSampler", "ChorusSparseAttention"]);
const WIDGET_NAME = "chorus_reuse_view";
const VIEW_HEIGHT = 132;
// A queued recording's write happens after the report: its state is asked for every POLL_MS until
// it is recorded or failed, at most POLL_LIMIT times (ten minutes, past the writer's back-offs).
const POLL_MS = 2000;
const POLL_LIMIT = 300;

// Last report per node id path, for tests and other extensions (window.chorusReuseReports).
const reports = new Map();
// "node path, entry id" of the recordings whose state is being asked for.
const following = new Set();

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text != null) el.textContent = text;
  return el;
}

function buildView() {
  const root = element("div", "chorus-reuse-view");
  // flex:none and min-height: the Vue renderer puts widgets in a column whose children all get
  // flex:1 (basis 0), which squashed the view to a strip. The view takes the pointer (no
  // pointer-events:none), or its per-layer tooltips never show.
  root.style.cssText = `box-sizing:border-box;width:100%;height:${VIEW_HEIGHT}px;min-height:${VIEW_HEIGHT}px;` +
    "flex:none;padding:4px 6px;background:rgba(0,0,0,0.35);border-radius:6px;font:11px sans-serif;" +
    "color:#ddd;overflow:hidden;display:flex;flex-direction:column;gap:2px";
  root.innerHTML =
    '<div class="chorus-head" style="display:flex;gap:6px;align-items:center;white-space:nowrap">' +
    '<span class="chorus-badge" style="padding:0 5px;border-radius:3px;color:#111;font-weight:bold"></span>' +
    '<span class="chorus-entry" style="overflow:hidden;text-overflow:ellipsis"></span>' +
    '<span class="chorus-step" style="margin-left:auto"></span></div>' +
    '<div class="chorus-bars" style="flex:1;display:flex;align-items:flex-end;gap:1px;min-height:30px;' +
    'border-bottom:1px solid #666"></div>' +
    '<div class="chorus-labels" style="display:flex;gap:1px;height:12px;font-size:9px;color:#aaa"></div>' +
    '<div class="chorus-density" style="white-space:nowrap"></div>' +
    '<div class="chorus-saved" style="white-space:nowrap;color:#aaa"></div>' +
    '<div class="chorus-recording" style="white-space:nowrap;color:#aaa"></div>';
  root.querySelector(".chorus-entry").textContent = "waiting for a run";
  return root;
}

function render(view, report) {
  const summary = summarise(report);
  const badge = view.querySelector(".chorus-badge");
  badge.textContent = summary.badge;
  badge.style.background = summary.colour;
  badge.title = summary.meaning;
  view.dataset.kind = summary.kind;
  view.querySelector(".chorus-entry").textContent = summary.entry;
  view.querySelector(".chorus-step").textContent = summary.step;
  view.querySelector(".chorus-density").textContent = summary.density;
  view.querySelector(".chorus-saved").textContent = summary.saved;
  view.querySelector(".chorus-saved").title = summary.savedMeaning;
  view.querySelector(".chorus-recording").textContent = summary.recording;
  view.querySelector(".chorus-recording").title = (report.evictions ?? []).map((e) => e.line).join("\n");
  const bars = layerBars(report);
  const stride = labelStride(bars.length);
  view.querySelector(".chorus-bars").replaceChildren(...bars.map((bar) => {
    const el = element("div", "chorus-bar");
    el.title = bar.title;
    el.dataset.layer = bar.label;
    el.style.cssText = `flex:1;height:${Math.max(2, Math.round(bar.kept * 100))}%;` +
      `background:${bar.dense ? DENSE_COLOUR : summary.colour}`;
    return el;
  }));
  view.querySelector(".chorus-labels").replaceChildren(...bars.map((bar, i) =>
    element("span", "chorus-label", i % stride === 0 ? bar.label : "")));
  view.querySelectorAll(".chorus-label").forEach((el) => { el.style.cssText = "flex:1;overflow:visible"; });
  view.title = `${summary.badge}: ${summary.meaning}. Bars: share of key blocks each layer keeps ` +
    `(${percent(1)} = dense, grey = dense so far).`;
}

function ensureView(node) {
  if (node.chorusView) return node.chorusView;
  const view = buildView();
  node.chorusView = view;
  if (typeof node.addDOMWidget === "function") {
    node.addDOMWidget(WIDGET_NAME, "chorus_reuse_view", view, {
      serialize: false, // a display only: never in widgets_values nor in the prompt
      getMinHeight: () => VIEW_HEIGHT,
      getMaxHeight: () => VIEW_HEIGHT,
    });
  }
  return view;
}

function show(idPath, report) {
  reports.set(String(idPath), report);
  const node = resolveNodePath(app.graph, idPath);
  if (!node) return;
  node.chorusReport = report;
  render(ensureView(node), report);
  node.setDirtyCanvas?.(true, true);
}

function onRunStart({ detail }) {
  if (!detail?.node) return;
  show(detail.node, { ...detail, layers: [], step: 0 });
}

function onStep({ detail }) {
  if (!detail?.node) return;
  // Keep what only the run start or the final report knows (entry, similarity, source).
  const previous = reports.get(String(detail.node)) ?? {};
  show(detail.node, { ...previous, ...detail });
}

function showFinal(node, report) {
  const previous = reports.get(String(node)) ?? {};
  show(node, { ...previous, ...report, step: report.steps });
  if (report.recording === "queued" && report.recorded_entry_id) followRecording(node, report.recorded_entry_id);
}

// Ask for the recording's state until it settles; stops by itself, and as soon as the node shows
// another run (its report then names another recording, or none).
function followRecording(idPath, entryId) {
  const key = `${idPath} ${entryId}`;
  if (following.has(key)) return;
  following.add(key);
  const current = () => reports.get(String(idPath));
  let left = POLL_LIMIT;
  const tick = async () => {
    const state = current()?.recorded_entry_id === entryId && left-- > 0 ? await recordingState(entryId) : null;
    if (current()?.recorded_entry_id !== entryId || left < 0) return following.delete(key);
    if (state) show(idPath, { ...current(), recording_state: state });
    if (state && !RECORDING_PENDING.has(state.state)) return following.delete(key);
    setTimeout(tick, POLL_MS);
  };
  setTimeout(tick, POLL_MS);
}

async function recordingState(entryId) {
  try {
    const answer = await api.fetchApi(`/chorus/api/recordings/${encodeURIComponent(entryId)}`);
    return answer.ok ? await answer.json() : null;
  } catch {
    return null; // the server is restarting: asked again at the next tick
  }
}

function onExecuted({ detail }) {
  const report = detail?.output?.chorus_report?.[0];
  if (report && detail.node) showFinal(detail.node, report);
}

// The Chorus Sparse Attention node patches a MODEL, so its run ends inside another node's
// sampling: its report comes as an event rather than as that node's output.
function onReport({ detail }) {
  if (detail?.chorus_report && detail.node) showFinal(detail.node, detail.chorus_report);
}

// The app queues through api.queuePrompt and shows the node_errors of its answer (or of the
// error it throws): list each Chorus problem once there (see chorus_node_errors.js).
function listChorusErrorsOnce() {
  const queuePrompt = api.queuePrompt.bind(api);
  api.queuePrompt = async (...args) => {
    try {
      const answer = await queuePrompt(...args);
      chorusErrorsOnce(answer?.node_errors);
      return answer;
    } catch (error) {
      chorusErrorsOnce(error?.response?.node_errors);
      throw error;
    }
  };
}

// ComfyUI may serve this folder under two names (WEB_DIRECTORY and pyproject's [tool.comfy] web);
// the module then loads twice, and only the first copy registers.
if (!window.chorusReuseReports) {
  window.chorusReuseReports = reports;
  app.registerExtension({
    name: EXTENSION,
    async setup() {
      listChorusErrorsOnce();
      api.addEventListener("chorus.run_start", onRunStart);
      api.addEventListener("chorus.step", onStep);
      api.addEventListener("executed", onExecuted);
      api.addEventListener("chorus.report", onReport);
    },
    async beforeRegisterNodeDef(nodeType, nodeData) {
      if (!VIEW_TYPES.has(nodeData.name)) return;
      // Chain the existing hook: other extensions may add to this node too.
      const previousCreated = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function (...args) {
        const result = previousCreated?.apply(this, args);
        ensureView(this);
        return result;
      };
    },
  });
}
