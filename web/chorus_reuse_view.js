// Chorus: a compact per-layer reuse view drawn on the Chorus Sparse Wan Sampler node.
// The server sends one "chorus.step" event per denoising step and "chorus.run_start" when a
// run begins; each carries the executing node id (a "parent:child" path inside subgraphs).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { resolveNodePath } from "./chorus_node_paths.js";

const EXTENSION = "chorus.reuse_view";
const SAMPLER_TYPE = "ChorusSparseWanSampler";
const VIEW_HEIGHT = 64;

// Last report per node id path, for tests and other extensions (window.chorusReuseReports).
const reports = new Map();

function resolveNode(idPath) {
  return resolveNodePath(app.graph, idPath);
}

function colourFor(share) {
  // dense = grey, fully sparse = teal
  const g = Math.round(120 + 80 * share);
  return `rgb(${Math.round(120 - 80 * share)}, ${g}, ${Math.round(120 + 40 * share)})`;
}

function drawView(node, ctx, report) {
  const layers = report.layers ?? [];
  if (!layers.length) return;
  const width = node.size[0] - 20;
  // Below the last widget; grow the node once if the view does not fit under it.
  const widgetsBottom = Math.max(0, ...(node.widgets ?? []).map((w) => (w.last_y ?? 0) + (w.computeSize?.(node.size[0])?.[1] ?? 22)));
  if (node.size[1] < widgetsBottom + VIEW_HEIGHT + 10) node.setSize?.([node.size[0], widgetsBottom + VIEW_HEIGHT + 10]);
  const top = Math.max(node.size[1] - VIEW_HEIGHT - 6, widgetsBottom + 4);
  const barWidth = Math.max(1, width / layers.length);
  ctx.save();
  ctx.fillStyle = "rgba(0,0,0,0.35)";
  ctx.fillRect(10, top, width, VIEW_HEIGHT);
  layers.forEach((layer, i) => {
    const share = layer.sparse_share ?? 0;
    const h = Math.max(2, (VIEW_HEIGHT - 18) * share);
    ctx.fillStyle = colourFor(share);
    ctx.fillRect(10 + i * barWidth, top + VIEW_HEIGHT - 16 - h, Math.max(1, barWidth - 1), h);
  });
  ctx.fillStyle = "#ddd";
  ctx.font = "11px sans-serif";
  const density = report.density == null ? "-" : `${Math.round(report.density * 100)}%`;
  ctx.fillText(`${report.mode ?? ""} step ${report.step ?? 0}/${report.steps ?? "?"} density ${density}`, 14, top + VIEW_HEIGHT - 4);
  ctx.restore();
}

function onStep(event) {
  const detail = event.detail;
  if (!detail?.node) return;
  reports.set(String(detail.node), detail);
  const node = resolveNode(detail.node);
  if (node) {
    node.chorusReport = detail;
    node.setDirtyCanvas?.(true, true);
  }
}

function onRunStart(event) {
  const detail = event.detail;
  if (!detail?.node) return;
  reports.delete(String(detail.node));
  const node = resolveNode(detail.node);
  if (node) {
    node.chorusReport = { mode: detail.mode, layers: [], step: 0, steps: detail.steps };
    node.setDirtyCanvas?.(true, true);
  }
}

// ComfyUI may serve this folder under two names (WEB_DIRECTORY and pyproject's [tool.comfy] web);
// the module then loads twice, and only the first copy registers.
if (!window.chorusReuseReports) {
  window.chorusReuseReports = reports;
  app.registerExtension({
    name: EXTENSION,
    async setup() {
      api.addEventListener("chorus.step", onStep);
      api.addEventListener("chorus.run_start", onRunStart);
    },
    async beforeRegisterNodeDef(nodeType, nodeData) {
      if (nodeData.name !== SAMPLER_TYPE) return;
      // Chain the existing hooks: other extensions may draw on this node too.
      const previousDraw = nodeType.prototype.onDrawForeground;
      nodeType.prototype.onDrawForeground = function (ctx, ...rest) {
        const result = previousDraw?.apply(this, [ctx, ...rest]);
        if (this.chorusReport && !this.flags?.collapsed) drawView(this, ctx, this.chorusReport);
        return result;
      };
      const previousCreated = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function (...args) {
        const result = previousCreated?.apply(this, args);
        this.size[1] += VIEW_HEIGHT + 8;
        return result;
      };
    },
  });
}
