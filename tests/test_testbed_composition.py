"""The product path's composed rows (issue 23, item 3): Guidance Enhance and core's EasyCache on
a bank hit, each against its control arm, on the tiny random model."""

import pytest

pytestmark = pytest.mark.comfy


def test_composed_rows_compare_each_composition_with_its_control(comfy_runtime, tmp_path, monkeypatch):
    from tests.testbed import composition
    from tests.testbed.product_path import markdown, run_product_path, summarize, tiny_setup

    # EasyCache's own defaults skip nothing in 4 tiny steps; its largest threshold skips, so the
    # skipped count is seen to come through
    monkeypatch.setitem(composition.EASYCACHE_DEFAULTS, "reuse_threshold", 3.0)
    patcher, config = tiny_setup(tmp_path)
    results = run_product_path(patcher, config, tmp_path, 1, 1, log=lambda *_: None, compose=True)
    composed = {r["mask_kind"]: r for r in results["rows"] if r["section"] == "composed"}
    assert list(composed) == list(composition.COMPOSED_KINDS)
    assert [composed[k]["against"] for k in composition.COMPOSED_KINDS] == ["dense", "dense+guidance", "dense", "dense"]
    hit = next(r for r in results["rows"] if r["section"] == "natural" and r["mask_kind"] == "reused_similar_product")
    assert composed["hit+guidance"]["density"] == pytest.approx(hit["density"], abs=0.05)  # the hit's own masks
    assert composed["easycache_alone"]["steps_skipped"] > 0 and composed["hit+easycache"]["steps_skipped"] > 0
    for row in composed.values():  # every composition changes the output it is compared with
        assert 0 < row["psnr_db"] < float("inf") and 0 < row["rel_rms"] < 1
    # the hit under guidance is compared with dense + guidance, not plain dense: not the hit's own error
    assert composed["hit+guidance"]["psnr_db"] != pytest.approx(hit["psnr_db"], abs=1e-6)
    doc = {"N": results["N"], "command": "x", "targets": 1, "seeds": 1, "options": {}, "threshold": 0.9,
           "notes": [], "summary": summarize(results)}
    md = markdown(doc)
    assert "## Composed: Guidance Enhance and core's EasyCache, each against its control" in md
    assert "| hit+easycache | dense |" in md


def test_the_skipped_steps_are_read_from_easycache_s_own_log_line():
    import logging

    from tests.testbed.composition import easycache_log

    with easycache_log() as log:
        logging.getLogger().info("EasyCache - skipped 3/10 steps (1.43x speedup).")
    assert log.skipped == 3
    with easycache_log() as other:
        logging.getLogger().info("LazyCache - skipped 2/10 steps")
    assert other.skipped is None
