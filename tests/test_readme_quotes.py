"""The README quotes its results files: every number is the file's."""

import json
import re

from conftest import REPO_ROOT

RESULTS = REPO_ROOT / "tests" / "benchmarks" / "results"
SESSION = "1bef3161b301"  # one warm H100: every quoted speed row
# README row label start -> the results row each shape column quotes (None: not measured there)
QUOTED = {
    "ComfyUI's default: bf16 file": ("bf16_dense_eager", "bf16_dense_eager"),
    "dense, fp8, eager": ("fp8_e4m3fn_fast_dense_eager", "fp8_e4m3fn_fast_dense_eager"),
    "dense, fp8, SageAttention": ("fp8_e4m3fn_fast_dense_eager_sage", "fp8_e4m3fn_fast_dense_eager_sage"),
    "dense, fp8, TorchCompileModel": (None, "fp8_e4m3fn_fast_dense_compiled"),
    "core's Model Sparse Attention at its defaults, eager": ("fp8_e4m3fn_fast_core_eager", "fp8_e4m3fn_fast_core_eager"),
    "core's Model Sparse Attention at its defaults, TorchCompileModel": ("fp8_e4m3fn_fast_core_compiled",
                                                                          "fp8_e4m3fn_fast_core_compiled"),
    "**Chorus hit**, eager": ("fp8_e4m3fn_fast_hit_eager", "fp8_e4m3fn_fast_hit_eager"),
    "**Chorus hit**, TorchCompileModel": ("fp8_e4m3fn_fast_hit_compiled", "fp8_e4m3fn_fast_hit_compiled"),
    "Chorus miss that records, eager": ("fp8_e4m3fn_fast_miss_eager", "fp8_e4m3fn_fast_miss_eager"),
}
SHAPES = ("user_stack_720p.json", "user_stack_640.json")


def _readme() -> str:
    return (REPO_ROOT / "README.md").read_text()


def _session_rows(name: str) -> dict:
    return {r["name"]: r for r in json.loads((RESULTS / name).read_text())["rows"] if r.get("session") == SESSION}


def _counted(row: dict) -> float:
    """What the README quotes for a row: a cold first generation after a load counted warm."""
    return row.get("warm_seconds") or row["seconds"]


def _readme_cells() -> dict:
    cells = {}
    for line in _readme().splitlines():
        for label in QUOTED:
            if line.startswith(f"| {label}"):
                cells[label] = [c.strip().strip("*") for c in line.strip("|").split("|")][1:]
    return cells


def test_the_speed_table_quotes_one_machines_rows_and_their_ratios():
    cells = _readme_cells()
    assert set(cells) == set(QUOTED)
    for column, shape in enumerate(SHAPES):
        rows = _session_rows(shape)
        fastest = min(_counted(r) for r in rows.values() if r["role"] == "dense" and r["weights"].startswith("fp8"))
        for label, names in QUOTED.items():
            seconds, ratio = cells[label][2 * column], cells[label][2 * column + 1]
            if names[column] is None:
                assert (seconds, ratio) == ("-", "-"), label
                continue
            row = rows[names[column]]
            assert float(seconds) == _counted(row), (shape, label)
            assert float(ratio.rstrip("x")) == round(fastest / _counted(row), 3), (shape, label)


def test_the_text_quotes_the_hit_against_core_and_the_fp8_scaled_hit():
    text = " ".join(_readme().split())
    for shape, words in (("user_stack_720p.json", "at 720p"), ("user_stack_640.json", "at 640x640")):
        rows = _session_rows(shape)
        ratio = rows["fp8_e4m3fn_fast_core_eager"]["seconds"] / rows["fp8_e4m3fn_fast_hit_eager"]["seconds"]
        assert f"{ratio:.2f}x core's Model Sparse Attention {words}" in text or f"and {ratio:.2f}x {words}" in text, shape
    scaled = _session_rows("user_stack_640.json")["fp8_scaled_hit_eager"]["seconds"]
    assert f"a hit in {scaled} s at 640x640" in text


def test_the_core_quality_table_is_the_files():
    row = json.loads((RESULTS / "product_path_entropy16k_core_sparse_h100" / "core_sparse.json").read_text())["rows"][0]
    text = _readme()
    assert f"| {row['hit_psnr_db']:.2f} ± {row['hit_psnr_db_ci95']:.2f} |" in text
    for arm in ("defaults", "matched"):
        psnr, diff = row[f"core_{arm}_psnr_db"], row[f"hit_minus_core_{arm}_db"]
        assert f"| {psnr:.2f} ± {row[f'core_{arm}_psnr_db_ci95']:.2f} | {diff:.2f} ± " \
               f"{row[f'hit_minus_core_{arm}_db_ci95']:.2f} |" in text, arm
        assert f"{-diff:.2f} dB" in text, arm  # the limits line


def test_the_last_step_dense_figure_is_the_quality_tables():
    table = (RESULTS / "product_path_entropy16k_step9159_h200" / "quality_table.md").read_text()
    line = next(x for x in table.splitlines() if x.startswith("| natural_4step_last1 |"))
    psnr = [c.strip() for c in line.strip("|").split("|")][5]
    assert f"{psnr.replace(' ± ', ' ±')}" in " ".join(_readme().split()).replace(" ± ", " ±")


def test_how_the_bank_grows_quotes_the_lifecycle_results():
    rows = {r["policy"]: r for r in json.loads((RESULTS / "bank_lifecycle.json").read_text())["rows"]
            if r.get("final")}
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("## How the bank grows"):text.index("## ComfyUI versions")]
    none, merge = rows["none"], rows["merge"]
    assert f"left alone, {none['entries']} entries\nand a {none['hit_rate']:.3f} hit rate" in section
    assert f"merging near-copies, {merge['entries']} entries" in section
    assert f"over {none['kinds_seen']} kinds of request" in section.replace("\n", " ")
    assert round(merge["hit_rate"], 3) == round(none["hit_rate"], 3)  # "at the same hit rate"
    for policy, words in (("budget_50", "at half the unbounded size"), ("budget_25", "at a quarter"),
                          ("budget_10", "at a tenth")):
        assert f"{rows[policy]['hit_rate']:.3f} {words}" in section.replace("\n  ", " "), policy
