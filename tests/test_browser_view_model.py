"""What the per-layer reuse view says for a report, run in Node.js on web/chorus_view_model.js."""

import json
import shutil
import subprocess

import pytest

from conftest import REPO_ROOT

SCRIPT = """
import { cappedByMaxDensity, keptDensity, labelStride, layerBars, sourceKind, summarise } from "%s";
import { chorusErrorsOnce } from "%s";
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
  measured: summarise({ mode: "hit", layers, step: 4, steps: 4, timings: { dense_step_s: 0.5, sparse_step_s: 0.2 } }).saved,
  slower: summarise({ mode: "hit", layers, step: 4, steps: 4, timings: { dense_step_s: 0.2, sparse_step_s: 0.25 } }).saved,
  untimed: summarise({ mode: "hit", layers, step: 4, steps: 4 }).saved,
  earlier: summarise({ mode: "hit", layers, step: 4, steps: 4, timings: { earlier_dense_step_s: 0.5, sparse_step_s: 0.2 } }).saved,
  capped: summarise({ mode: "miss", mask_source: "online prediction", max_density: 0.6, layers: [
    { layer: 0, sparse_share: 0.75, density: 0.6 }, { layer: 1, sparse_share: 0.75, density: 0.6 }] }).density,
  capped_one_block_below: cappedByMaxDensity({ max_density: 0.65, layers: [{ layer: 0, sparse_share: 1, density: 0.6 }] }),
  not_capped: [cappedByMaxDensity(hit), cappedByMaxDensity({ ...hit, max_density: 0.4 })],
  errors: chorusErrorsOnce({
    "5": { class_type: "ChorusMaskBankLoader", errors: ["bank", "new_bank_name", "read_only"].map((name) => ({
      type: "custom_validation_failed", details: `${name} - Chorus Mask Bank Loader: new_bank_name 'a/b' must be plain`,
      extra_info: { input_name: name } })) },
    "3": { class_type: "ChorusSparseWanSampler", errors: [
      { type: "custom_validation_failed", details: "max_density - min_density (0.7) must not exceed max_density (0.6).",
        extra_info: { input_name: "max_density" } },
      { type: "custom_validation_failed", details: "min_density - min_density (0.7) must not exceed max_density (0.6).",
        extra_info: { input_name: "min_density" } },
      { type: "value_bigger_than_max", details: "top_p", extra_info: { input_name: "top_p" } }] },
    "9": { class_type: "KSampler", errors: [1, 2].map(() => ({ type: "custom_validation_failed", details: "x - same",
      extra_info: { input_name: "x" } })) },
  }),
  strides: [labelStride(2), labelStride(10), labelStride(40)],
  evicted: [[], [{ evicted: 1, bytes_freed: 8600000 }], [{ evicted: 2, bytes_freed: 2.5e9 }, { evicted: 1, bytes_freed: 1e9 }],
            [{ evicted: 0, bytes_freed: 0, quarantined_removed: 1 }]].map((evictions) =>
    summarise({ mode: "miss", layers, recording: "recorded", recorded_entry_id: "0123456789abcdef", evictions }).recording),
  recordings: [{ recording: "queued", recorded_entry_id: "0123456789abcdef" },
               { recording: "recorded", recorded_entry_id: "0123456789abcdef" },
               { recording: null, warnings: ["masks not recorded: the disk is full"] },
               ...[{ state: "recorded" }, { state: "retrying", attempts: 1 }, { state: "unknown" },
                   { state: "failed", reason: "the bank refused it (BankIncompatible); its spool file was quarantined" },
                   { state: "failed", error: "BankError (the ComfyUI log says why)" }].map((polled) => (
                 { recording: "queued", recorded_entry_id: "0123456789abcdef", recording_state: polled }))].map((r) =>
    summarise({ mode: "miss", layers, ...r }).recording),
}));
"""


def test_the_view_says_source_entry_density_and_saving_at_a_glance():
    node = shutil.which("node")
    if node is None:
        pytest.fail("Node.js is needed for the web extension's unit test (install nodejs)")
    module, errors = ((REPO_ROOT / "web" / name).as_uri() for name in ("chorus_view_model.js", "chorus_node_errors.js"))
    result = subprocess.run([node, "--input-type=module", "-e", SCRIPT % (module, errors)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["hit"] == {
        "kind": "hit", "badge": "HIT", "colour": "#2fb37a", "meaning": "reusing the masks of a similar earlier request",
        "entry": "entry 0123456789ab… · similarity 0.953", "step": "step 3/4",
        "density": "kept density 53% (warm-up excluded)",  # (1 + 0.2 + 0.4) / 3
        "saved": "attention blocks skipped 47% (step times come at the end)",
        "savedMeaning": "Mean wall time of this run's sparse steps against its dense warm-up step (usually the first, "
                        "so it also carries one-time costs); without both, the share of attention blocks skipped.",
        "recording": ""}
    assert out["recordings"] == [
        "recording 0123456789ab… queued: on disk, going into the bank", "recorded as entry 0123456789ab…",
        "not recorded (see warnings)",
        # what the view's poll of /chorus/api/recordings/<id> found after the report
        "recorded as entry 0123456789ab…", "recording 0123456789ab… queued: its write failed, trying again (try 2)",
        "recording 0123456789ab… queued: this server no longer tracks it (restarted?)",
        "recording 0123456789ab… failed: the bank refused it (BankIncompatible); its spool file was quarantined",
        "recording 0123456789ab… failed: BankError (the ComfyUI log says why)"]
    # a write that kept the bank's budget by evicting entries says so once (quarantined blobs alone: nothing)
    assert out["evicted"] == [
        "recorded as entry 0123456789ab…", "recorded as entry 0123456789ab… · bank budget: 1 entry evicted (8.6 MB freed)",
        "recorded as entry 0123456789ab… · bank budget: 3 entries evicted (3.5 GB freed)", "recorded as entry 0123456789ab…"]
    assert [(b["label"], b["kept"], b["dense"]) for b in out["bars"]] == [("L0", 1, True), ("L1", 0.2, False),
                                                                         ("L2", 0.4, False)]
    assert out["kept"] == pytest.approx(1.6 / 3)
    assert out["warmup"]["density"] == "kept density: warm-up (dense)" and out["warmup"]["saved"] == ""
    assert out["warmup"]["badge"] == "MISS"
    assert out["empty_bank"] == "bank: no entries yet to match"
    assert (out["below"]["badge"], out["below"]["entry"]) == ("MISS · prior", "best similarity 0.710, below threshold")
    assert out["dense"] == "dense"
    assert out["measured"] == "sparse step 0.20 s vs dense step 0.50 s: 60% faster"
    assert out["slower"] == "sparse step 0.25 s vs dense step 0.20 s: 25% slower"
    assert out["untimed"] == "attention blocks skipped 47% (no dense step to time against)"
    assert out["earlier"] == "sparse step 0.20 s vs an earlier run's dense step 0.50 s: 60% faster"
    assert out["capped"] == "kept density 60% (warm-up excluded), capped by max_density"
    assert out["capped_one_block_below"] is True and out["not_capped"] == [False, False]
    errors = out["errors"]
    assert [e["extra_info"]["input_name"] for e in errors["5"]["errors"]] == ["new_bank_name"]
    assert [e["extra_info"]["input_name"] for e in errors["3"]["errors"]] == ["min_density", "top_p"]
    assert len(errors["9"]["errors"]) == 2  # not a Chorus node: as the server sent it
    assert out["strides"] == [1, 1, 4]
