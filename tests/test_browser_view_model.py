"""What the per-layer reuse view says for a report, run in Node.js on web/chorus_view_model.js."""

import json
import shutil
import subprocess

import pytest

from conftest import REPO_ROOT

SCRIPT = """
import { keptDensity, labelStride, layerBars, sourceKind, summarise } from "%s";
const layers = [
  { layer: 0, sparse_share: 0, density: null },      // a dense layer
  { layer: 1, sparse_share: 0.75, density: 0.2 },    // 3 of 4 steps sparse: warm-up not in density
  { layer: 2, sparse_share: 0.75, density: 0.4 },
];
const hit = { mode: "hit", entry_id: "0123456789abcdef", similarity: 0.95349, mask_source: "bank entry 0123",
              step: 3, steps: 4, layers };
console.log(JSON.stringify({
  hit: summarise(hit),
  bars: layerBars(hit),
  kept: keptDensity(hit),
  warmup: summarise({ mode: "miss", step: 1, steps: 4, layers: layers.map((l) => ({ ...l, sparse_share: 0, density: null })) }),
  empty_bank: summarise({ mode: "miss", mask_source: "online prediction", similarity: 0, components: {}, layers }).entry,
  below: summarise({ mode: "miss", mask_source: "population prior of 3 entries", similarity: 0.71,
                     components: { clip: 0.7 }, layers }),
  dense: sourceKind({ mode: "miss", mask_source: "dense" }),
  measured: summarise({ mode: "hit", layers, timings: { attention_saved_ms: 12345 } }).saved,
  strides: [labelStride(2), labelStride(10), labelStride(40)],
}));
"""


def test_the_view_says_source_entry_density_and_saving_at_a_glance():
    node = shutil.which("node")
    if node is None:
        pytest.fail("Node.js is needed for the web extension's unit test (install nodejs)")
    module = (REPO_ROOT / "web" / "chorus_view_model.js").as_uri()
    result = subprocess.run([node, "--input-type=module", "-e", SCRIPT % module], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["hit"] == {
        "kind": "hit", "badge": "HIT", "colour": "#2fb37a", "meaning": "reusing the masks of a similar earlier request",
        "entry": "entry 0123456789ab… · similarity 0.953", "step": "step 3/4",
        "density": "kept density 53% (warm-up excluded)",  # (1 + 0.2 + 0.4) / 3
        "saved": "attention blocks skipped 47% (time not measured)"}
    assert [(b["label"], b["kept"], b["dense"]) for b in out["bars"]] == [("L0", 1, True), ("L1", 0.2, False),
                                                                         ("L2", 0.4, False)]
    assert out["kept"] == pytest.approx(1.6 / 3)
    assert out["warmup"]["density"] == "kept density: warm-up (dense)" and out["warmup"]["saved"] == ""
    assert out["warmup"]["badge"] == "MISS"
    assert out["empty_bank"] == "bank: no entries yet to match"
    assert (out["below"]["badge"], out["below"]["entry"]) == ("MISS · prior", "best similarity 0.710, below threshold")
    assert out["dense"] == "dense"
    assert out["measured"] == "attention time saved 12.3 s"
    assert out["strides"] == [1, 1, 4]
