"""The merged-entry quality harness (issue 49, item 2) runs end to end on the tiny model: every
recording of the kind merges into one entry, and the target hits both banks."""

import json

import pytest

pytestmark = pytest.mark.comfy


def test_a_kind_merges_into_one_entry_and_the_target_hits_it_and_the_single_recording(comfy_runtime, tmp_path):
    from chorus_core.bank import MaskBank
    from tests.testbed.merge_quality import pair_rows, summary
    from tests.testbed.product_path import ProductPath, tiny_setup
    from tests.testbed.report import eval_requests

    patcher, config = tiny_setup(tmp_path)
    pp = ProductPath(patcher, config, tmp_path, 0.9, lambda *_: None)
    targets, similar, _, _ = eval_requests(config, config.long_size)
    rows, entries = pair_rows(pp, tmp_path, targets[0], similar[0], 0, recordings=3)
    assert entries == 1  # the second and third recordings merged into the first's entry
    merged_bank = next(p for p in tmp_path.iterdir() if p.name.startswith("merged-"))
    bank = MaskBank.open(merged_bank)
    try:
        assert bank.merge_status()["voted_entries"] == 1
    finally:
        bank.close()
    kinds = [r["mask_kind"] for r in rows]
    assert kinds == ["hit_single", "hit_merged"]
    assert all(20 < r["psnr_db"] < float("inf") and 0 < r["density"] < 1 for r in rows)
    s = summary(rows, [entries], 3)
    assert s["pairs"] == 1 and s["merged_minus_single_db"] == pytest.approx(rows[1]["psnr_db"] - rows[0]["psnr_db"])
    json.dumps(s)  # what the CLI writes
