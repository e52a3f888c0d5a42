"""The quality table (issue 23, items 3 and 5): runs of one checkpoint side by side, and the paired
comparisons between runs that choose the defaults."""

import json

import pytest

from tests.testbed.quality_table import compare_pair, main, setting

REQUESTS = ("pan/s100/l0/detailed", "zoom/s103/l1/detailed", "fade/s101/l0/detailed")
SHIPPED = {"top_p": 0.9, "min_density": 0.05, "max_density": 0.5, "dense_layers": [], "dense_warmup_steps": 1,
           "hit_warmup_steps": 0, "dense_last_steps": 1, "miss_mode": "prior"}


def _row(section, kind, request, seed, psnr, density=0.15):
    return {"section": section, "mask_kind": kind, "request": request, "seed": seed, "psnr_db": psnr,
            "rel_rms": 1 / psnr, "density": density}


def _run(folder, hit_psnr, options=None, seeds=(0, 1), steps=10, trained=()):
    """A run whose hit is ``hit_psnr(request_index, seed)`` dB, its oracle 1 dB above, online 4 below."""
    rows = []
    for i, request in enumerate(REQUESTS):
        for seed in seeds:
            hit = hit_psnr(i, seed)
            for section in ("matched", "natural"):
                rows += [_row(section, "reused_similar_product", request, seed, hit),
                         _row(section, "oracle", request, seed, hit + 1.0 + 0.1 * seed),
                         _row(section, "online", request, seed, hit - 4.0 - 0.2 * i)]
            rows += [_row("matched", "static", request, seed, 20.0 + seed),
                     _row("matched", "reused_dissimilar", request, seed, hit - 0.5 * i)]
    folder.mkdir(parents=True)
    doc = {"rows": rows, "options": {**SHIPPED, **(options or {})}, "machine": "NVIDIA H200",
           "config": {"sample_steps": steps, "sample_cfg": 1.0, "train_templates": list(trained)}}
    (folder / "product_path.json").write_text(json.dumps(doc))


def test_each_run_shows_the_paired_differences_its_targets_read(tmp_path):
    _run(tmp_path / "d015", lambda i, s: 35.0 + i + 0.3 * s, {"min_density": 0.15, "max_density": 0.15},
         trained=("pan", "zoom"))
    _run(tmp_path / "parts" / "piece", lambda i, s: 30.0)  # a merged run's pieces are not runs
    assert main(["--results", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "quality_table.json").read_text())
    (run,) = doc["runs"]
    assert run["run"] == "d015" and run["pairs"] == 6 and run["requests"] == 3
    assert run["setting"] == "max_density=0.15, min_density=0.15" and run["sampling"] == "10 steps, cfg 1"
    assert run["hit - oracle"]["psnr_db"] == pytest.approx(-1.05)  # -1 - 0.1 x mean seed
    assert run["hit - oracle"]["ci95"] == pytest.approx(0.0, abs=1e-9)  # the same per request
    assert run["hit - oracle"]["verdict"] == "oracle ahead"
    assert run["hit - online"]["psnr_db"] == pytest.approx(4.2) and run["hit - online"]["ci95"] > 0
    assert run["oracle - static"]["verdict"] == "oracle ahead"
    assert run["hit - prior"]["verdict"] == "-"  # the run has no prior rows: said, not invented
    held = run["held_out"]  # fade was never trained on: its request's two seeds
    assert held["families"] == ["fade"] and held["runs"] == 2
    assert held["reused_similar_product"] == pytest.approx(37.15) and held["oracle"] == pytest.approx(38.2)
    assert "population_prior" not in held
    md = (tmp_path / "quality_table.md").read_text()
    assert "| d015 | 10 steps, cfg 1 | max_density=0.15, min_density=0.15 | 6 (3 requests) |" in md
    assert "Command: `python -m tests.testbed.quality_table --results" in md
    assert "| d015 | fade | 2 | 37.15 | 38.20 | - |" in md


def test_a_comparison_pairs_two_runs_on_the_pairs_both_have(tmp_path):
    _run(tmp_path / "natural", lambda i, s: 37.0 + i)
    _run(tmp_path / "dense0", lambda i, s: 38.0 + i + (1.0 if i == 2 else 0.0), {"dense_layers": [0]}, seeds=(1,))
    assert main(["--results", str(tmp_path), "--compare", "dense0:natural", "--out", str(tmp_path / "table")]) == 0
    (entry,) = json.loads((tmp_path / "table" / "quality_table.json").read_text())["comparisons"]
    assert (entry["pairs"], entry["requests"]) == (3, 3)  # seed 1 only: the pairs both runs have
    assert entry["psnr_db"] == pytest.approx(4.0 / 3)  # per request +1, +1, +2
    assert entry["psnr_db_ci95"] > 0
    assert (entry["a_setting"], entry["b_setting"]) == ("dense_layers=[0]", "dense_layers=[]")


def test_infinite_pairs_older_runs_and_runs_without_hits_are_handled(tmp_path):
    """A pair with identical latents (PSNR +inf) is left out of a comparison and of its count;
    a run made before the cfg setting reads as cfg 1; a run with no hit shows no numbers."""
    _run(tmp_path / "a", lambda i, s: float("inf") if i == 0 else 30.0 + i)
    _run(tmp_path / "b", lambda i, s: 29.0 + i)
    old = json.loads((tmp_path / "b" / "product_path.json").read_text())
    del old["config"]["sample_cfg"]
    (tmp_path / "b" / "product_path.json").write_text(json.dumps(old))
    _run(tmp_path / "c", lambda i, s: 30.0)
    none = json.loads((tmp_path / "c" / "product_path.json").read_text())
    none["rows"] = [r for r in none["rows"] if r["mask_kind"] != "reused_similar_product"]
    (tmp_path / "c" / "product_path.json").write_text(json.dumps(none))
    assert main(["--results", str(tmp_path), "--compare", "a:b"]) == 0
    doc = json.loads((tmp_path / "quality_table.json").read_text())
    (entry,) = doc["comparisons"]
    assert (entry["pairs"], entry["requests"]) == (4, 2) and entry["psnr_db"] == pytest.approx(1.0)
    runs = {r["run"]: r for r in doc["runs"]}
    assert runs["b"]["sampling"] == "10 steps, cfg 1" and runs["c"]["hit_density"] is None
    assert "| c | 10 steps, cfg 1 | shipped | 0 | - | - |" in (tmp_path / "quality_table.md").read_text()


def test_the_table_refuses_what_it_cannot_compare(tmp_path):
    _run(tmp_path / "a", lambda i, s: 30.0)
    with pytest.raises(SystemExit, match="--compare names 'b', which is not a run"):
        main(["--results", str(tmp_path), "--compare", "a:b"])
    with pytest.raises(SystemExit, match="no product_path.json under"):
        main(["--results", str(tmp_path / "a")])
    for bad in ("a", "a:", ":b"):
        with pytest.raises(Exception, match="--compare wants RUN_A:RUN_B"):
            compare_pair(bad)
    assert setting({"options": dict(SHIPPED)}) == "shipped"
