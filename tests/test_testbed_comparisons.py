"""The product path's paired comparisons and held-out family split (tests.testbed.comparisons)."""

import pytest

from tests.testbed.comparisons import (family_rows, held_out_templates, mean_ci, paired_differences,
                                             t_quantile_975, template_of, verdict)
from tests.testbed.product_path import markdown


def _row(kind, request, seed, psnr, rel_rms=0.1, section="matched"):
    return {"section": section, "mask_kind": kind, "request": request, "seed": seed, "psnr_db": psnr, "rel_rms": rel_rms}


def _rows():
    # The targets differ by up to 10 dB, the hit trails the oracle by 0.5 dB on every one: unpaired
    # intervals overlap, the paired difference does not.
    rows = []
    for i, base in enumerate([30.0, 35.0, 40.0, 32.0, 38.0, 33.0]):
        request = f"{'bounce' if i == 5 else 'pan'}/s{100 + i}/l0/detailed"
        rows += [_row("oracle", request, 0, base), _row("reused_similar_product", request, 0, base - 0.5 + 0.01 * i),
                 _row("static", request, 0, base - 10.0)]
    return rows


def test_paired_difference_separates_what_unpaired_intervals_cannot():
    rows = _rows()
    hit = [r["psnr_db"] for r in rows if r["mask_kind"] == "reused_similar_product"]
    oracle = [r["psnr_db"] for r in rows if r["mask_kind"] == "oracle"]
    (mh, ch), (mo, co) = mean_ci(hit), mean_ci(oracle)
    assert mh + ch > mo - co  # the unpaired intervals overlap
    entry = next(e for e in paired_differences(rows) if (e["a"], e["b"]) == ("reused_similar_product", "oracle"))
    assert entry["n"] == 6
    assert abs(entry["psnr_db"] - (-0.475)) < 1e-9
    assert entry["psnr_db_ci95"] < 0.05
    assert verdict(entry) == "oracle ahead"
    static = next(e for e in paired_differences(rows) if (e["a"], e["b"]) == ("oracle", "static"))
    assert verdict(static) == "oracle ahead" and abs(static["psnr_db"] - 10.0) < 1e-9


def test_pairs_only_where_both_sources_ran():
    rows = _rows()[:-1]  # the last request's static run is missing
    static = next(e for e in paired_differences(rows) if e["b"] == "static")
    assert static["n"] == 5
    assert not [e for e in paired_differences(rows) if e["b"] == "online"]


def test_verdict_not_separated_when_interval_spans_zero():
    assert verdict({"a": "x", "b": "y", "psnr_db": 0.3, "psnr_db_ci95": 0.5}) == "not separated"
    assert verdict({"a": "x", "b": "y", "psnr_db": 0.6, "psnr_db_ci95": 0.5}) == "x ahead"


def test_held_out_family_split():
    rows = _rows()
    assert template_of("bounce/s106/l0/detailed") == "bounce"
    assert held_out_templates(rows, ("pan", "zoom")) == ["bounce"]
    assert held_out_templates(rows, ("pan", "bounce")) == []
    oracle = next(e for e in family_rows(rows, "matched", ["oracle"], ["bounce"]))
    assert oracle["held_out_n"] == 1 and oracle["trained_n"] == 5
    assert oracle["held_out_psnr_db"] == 33.0 and abs(oracle["trained_psnr_db"] - 35.0) < 1e-9


def test_markdown_has_paired_and_held_out_sections():
    doc = {"N": 1024, "command": "x", "targets": 6, "seeds": 1, "options": {}, "threshold": 0.9, "summary": [],
           "notes": [], "rows": _rows(), "config": {"train_templates": ["pan", "zoom"]}}
    text = markdown(doc)
    assert "## Paired differences" in text and "oracle ahead" in text
    assert "## Workload families the checkpoint was not trained on (matched density): bounce" in text
    doc["config"]["train_templates"] = ["pan", "bounce"]
    assert "not trained on" not in markdown(doc)
    del doc["config"]["train_templates"]  # an older result: which families trained is not known
    assert "not trained on" not in markdown(doc)


def test_seeds_of_one_request_count_once():
    """Seeds of a request are not independent draws of the workload: the interval is over requests."""
    rows = []
    for i, gap in enumerate([1.0, 2.0, 3.0]):
        for seed, jitter in enumerate([-0.01, 0.01]):
            request = f"pan/s{100 + i}/l0/detailed"
            rows += [_row("oracle", request, seed, 30.0), _row("static", request, seed, 30.0 - gap + jitter)]
    entry = next(e for e in paired_differences(rows) if e["b"] == "static")
    assert (entry["n"], entry["requests"]) == (6, 3)
    assert entry["psnr_db"] == pytest.approx(2.0)
    # per-request means 1, 2, 3: sd 1, t(2) = 4.303, half-width 4.303 / sqrt(3)
    assert entry["psnr_db_ci95"] == pytest.approx(4.303 / 3 ** 0.5, rel=1e-3)
    assert verdict(entry) == "not separated"  # six runs, but only three requests


def test_t_quantiles_and_duplicate_rows():
    assert t_quantile_975(1) == 12.706 and t_quantile_975(23) == 2.069
    assert t_quantile_975(60) == pytest.approx(2.000, abs=0.003) and t_quantile_975(10**6) == pytest.approx(1.96, abs=1e-3)
    assert mean_ci([1.0]) == (1.0, 0.0) and mean_ci([]) == (None, None)
    rows = _rows()
    with pytest.raises(ValueError, match="merge each run once"):
        paired_differences(rows + rows[:1])
