"""The bank-lifecycle simulation on a short stream: its schema, its seed, and what each policy keeps."""

import json
import sys

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests" / "benchmarks"))
import bench_bank_lifecycle as lifecycle  # noqa: E402

FINAL_KEYS = {"final", "policy", "entries", "kinds_seen", "hit_rate", "bytes", "served_recall"}


def run(tmp_path, *extra):
    lifecycle.main(["--requests", "2000", "--kinds", "12", "--policies", "none,prune_25", "--out", str(tmp_path), *extra])
    return json.loads((tmp_path / "bank_lifecycle.json").read_text())


def test_one_final_row_per_policy_and_a_row_per_thousand_requests(tmp_path):
    doc = run(tmp_path)
    finals = [row for row in doc["rows"] if row.get("final")]
    assert [row["policy"] for row in finals] == ["none", "prune_25"]
    assert all(FINAL_KEYS <= set(row) for row in finals)
    assert [row["requests"] for row in doc["rows"] if not row.get("final")] == [1000, 2000, 1000, 2000]
    assert {"benchmark", "date", "machine", "command", "git_commit"} <= set(doc)
    assert (tmp_path / "bank_lifecycle.md").read_text().count("| prune_25 |") == 1


def test_without_a_policy_the_bank_grows_past_its_kinds_and_a_budget_holds_it(tmp_path):
    doc = run(tmp_path)
    none, pruned = (row for row in doc["rows"] if row.get("final"))
    assert none["entries"] > none["kinds_seen"]  # near-copies of one kind pile up: what the issue is about
    assert 0.5 < none["hit_rate"] < 1.0 and 0.5 < none["served_recall"] <= 1.0
    budget = int(none["bytes"] * 25 / 100)
    assert all(row["bytes"] <= budget for row in doc["rows"] if row["policy"] == "prune_25")


def test_the_stream_is_the_same_for_a_seed_and_differs_for_another():
    first, again, other = (lifecycle.Stream(50, 5, seed) for seed in (3, 3, 4))
    draws = [[stream.draw(i) for i in range(50)] for stream in (first, again, other)]
    assert [d[0] for d in draws[0]] == [d[0] for d in draws[1]]
    assert all((a[2] == b[2]).all() for a, b in zip(draws[0], draws[1]))
    assert any((a[2] != b[2]).any() for a, b in zip(draws[0], draws[2]))


def test_a_budget_policy_never_holds_more_than_its_budget(tmp_path):
    lifecycle.main(["--requests", "2000", "--kinds", "12", "--policies", "none,budget_10,budget_50", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "bank_lifecycle.json").read_text())
    none, tight, loose = (row for row in doc["rows"] if row.get("final"))
    for row, share in ((tight, 10), (loose, 50)):
        assert FINAL_KEYS <= set(row) and row["budget_bytes"] == int(none["bytes"] * share / 100)
        assert row["within_budget"] and 0 < row["peak_bytes"] <= row["budget_bytes"]  # after every write
        assert all(w["bytes"] <= row["budget_bytes"] for w in doc["rows"] if w["policy"] == row["policy"])
    assert tight["entries"] < loose["entries"] < none["entries"]
    assert tight["hit_rate"] <= loose["hit_rate"] <= none["hit_rate"]
