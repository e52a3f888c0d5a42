"""The web view's subgraph id-path resolution, run in Node.js against small fake graphs."""

import json
import shutil
import subprocess

import pytest

from conftest import REPO_ROOT

SCRIPT = """
import { resolveNodePath } from "%s";
const graph = (nodes) => ({ getNodeById: (id) => nodes[id] ?? null });
const inner = { id: 3, title: "inner sampler" };
const sub = { id: 5, subgraph: graph({ 3: inner }) };
const top = { id: 7, title: "top sampler" };
const root = graph({ 5: sub, 7: top, 12: { id: 12, subgraph: graph({ 5: { id: 5, subgraph: graph({ 3: inner }) } }) } });
console.log(JSON.stringify({
  top: resolveNodePath(root, "7")?.title ?? null,
  nested: resolveNodePath(root, "5:3")?.title ?? null,
  deeper: resolveNodePath(root, "12:5:3")?.title ?? null,
  missing: resolveNodePath(root, "5:9"),
  not_a_subgraph: resolveNodePath(root, "7:3"),
}));
"""


def test_subgraph_id_paths_resolve_to_the_node():
    node = shutil.which("node")
    if node is None:
        pytest.fail("Node.js is needed for the web extension's unit test (install nodejs)")
    module = (REPO_ROOT / "web" / "chorus_node_paths.js").as_uri()
    result = subprocess.run([node, "--input-type=module", "-e", SCRIPT % module], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"top": "top sampler", "nested": "inner sampler", "deeper": "inner sampler",
                                         "missing": None, "not_a_subgraph": None}
