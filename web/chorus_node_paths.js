// Resolve the node id paths ComfyUI sends for nodes inside subgraphs ("12:5:3": node 3 of the
// subgraph of node 5 of the subgraph of node 12) to the node object. No imports, so it is
// testable on its own (tests/test_web_node_paths.py).
export function resolveNodePath(rootGraph, idPath) {
  let graph = rootGraph;
  let node = null;
  for (const part of String(idPath).split(":")) {
    node = graph?.getNodeById?.(Number(part)) ?? graph?.getNodeById?.(part) ?? null;
    if (!node) return null;
    graph = node.subgraph ?? null;
  }
  return node;
}
