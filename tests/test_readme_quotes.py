"""The README quotes its results files: every number is the file's."""

import json
import re

from conftest import REPO_ROOT

RESULTS = REPO_ROOT / "tests" / "benchmarks" / "results" / "user_stack_640.json"
# README row label start -> the results row it quotes (all from one warm machine)
QUOTED = {
    "dense, fp8_scaled file as loaded": "fp8_scaled_dense_eager",
    "dense, fp8_e4m3fn_fast + TorchCompileModel": "fp8_e4m3fn_fast_dense_compiled",
    "**Chorus hit**, fp8_scaled file, eager": "fp8_scaled_hit_eager",
    "Chorus hit, fp8_e4m3fn_fast, eager": "fp8_e4m3fn_fast_hit_eager",
}
SESSION = "fc9ff923c942"


def _readme_rows() -> dict:
    rows = {}
    for line in (REPO_ROOT / "README.md").read_text().splitlines():
        for label in QUOTED:
            if line.startswith(f"| {label}"):
                cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
                rows[label] = (float(cells[1]), float(cells[2].rstrip("x")))
    return rows


def test_the_user_stack_table_quotes_one_machines_rows():
    results = {row["name"]: row for row in json.loads(RESULTS.read_text())["rows"]
               if row.get("run", "").startswith(SESSION)}
    quoted = _readme_rows()
    assert set(quoted) == set(QUOTED)
    for label, (seconds, ratio) in quoted.items():
        row = results[QUOTED[label]]
        assert seconds == row["seconds"], label
        assert ratio == row["vs_fastest_dense_fp8"], label


def test_the_same_model_ratio_in_the_text_is_the_files():
    text = (REPO_ROOT / "README.md").read_text()
    ratio = re.search(r"A hit is ([\d.]+)x the dense run of the same fp8_scaled model", text).group(1)
    hit = next(r for r in json.loads(RESULTS.read_text())["rows"] if r["name"] == "fp8_scaled_hit_eager")
    assert float(ratio) == hit["vs_dense_same_weights"]


def test_how_the_bank_grows_quotes_the_lifecycle_results():
    rows = {r["policy"]: r for r in json.loads((RESULTS.parent / "bank_lifecycle.json").read_text())["rows"]
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
