"""Sigma schedules in the mask bank: a Schedule records the sigmas it was recorded on, so a run
with other steps (a 4-step distilled run, a staged KSamplerAdvanced, denoise < 1) addresses
an entry's step buckets by noise level. Stored on both backends (SQLite v3, PostgreSQL v2),
read from banks of the version before, carried by export and checked on import."""

import json
import sqlite3

import numpy as np
import pytest
from bank_fixtures import FP, LAYOUT, SCHEDULE, add_toy, toy_masks, toy_signature
from bank_pg_cluster import location, pg  # noqa: F401  (fixtures: a folder, or a PostgreSQL schema)
from test_bank_hostile import exported, target, write_tar

from chorus_core.bank import BankError, BankIncompatible, MaskBank, Schedule

pytestmark = pytest.mark.timeout(120)


def simple_sigmas(steps: int, shift: float = 5.0) -> list[float]:
    """A flow-matching "simple" schedule with shift: t from 1 to 0, sigma = s*t / (1 + (s-1)*t)."""
    t = np.linspace(1.0, 0.0, steps + 1)
    return [float(x) for x in shift * t / (1 + (shift - 1) * t)]


SIGMAS_8 = simple_sigmas(8)
SCHEDULE_S = Schedule(steps=8, sampler="uni_pc", scheduler="simple", shift=5.0,
                      step_buckets=[(0, 2), (2, 5), (5, 8)], sigmas=SIGMAS_8)


def add_with_sigmas(bank, seed=0, schedule=SCHEDULE_S):
    return bank.add_entry(fingerprint=FP, layout=LAYOUT, schedule=schedule, masks=toy_masks(seed),
                          signature=toy_signature(seed), density=0.3, recall=0.95)


# ---- Schedule ---------------------------------------------------------------------------
def test_schedule_normalises_sigmas_to_python_floats():
    s = Schedule(steps=4, step_buckets=[(0, 1), (1, 4)],
                 sigmas=np.array([1.0, 0.75, 0.5, 0.25, 0.0], dtype=np.float32))
    assert s.sigmas == (1.0, 0.75, 0.5, 0.25, 0.0)
    assert [type(x) for x in s.sigmas] == [float] * 5
    assert s.to_dict() == {"steps": 4, "sampler": "", "scheduler": "", "shift": 0.0,
                           "step_buckets": [[0, 1], [1, 4]], "sigmas": [1.0, 0.75, 0.5, 0.25, 0.0]}
    assert Schedule(steps=4, sigmas=[2, 2, 1, 1, 0]).sigmas == (2.0, 2.0, 1.0, 1.0, 0.0)  # flat runs are fine
    old = Schedule(steps=8)
    assert (old.sigmas, old.to_dict()["sigmas"], old.bucket_start_sigmas()) == (None, None, None)


@pytest.mark.parametrize("sigmas, message", [
    ([1.0, 0.5, 0.0], "Schedule sigmas hold 3 values, a 4-step schedule has 5"),
    ([1.0, 0.8, float("nan"), 0.2, 0.0], "Schedule sigma 2 is nan"),
    ([float("inf"), 0.8, 0.5, 0.2, 0.0], "Schedule sigma 0 is inf"),
    ([1.0, 0.8, 0.5, 0.2, -0.1], r"Schedule sigma 4 is -0\.1"),
    ([1.0, 0.8, 0.9, 0.2, 0.0], r"Schedule sigmas rise at step 2 \(0\.8 then 0\.9\)"),
    ("1.0 0.8 0.5 0.2 0", "Schedule sigmas must be a sequence of numbers, not text"),
    ([1.0, "0.8", 0.5, 0.2, 0.0], "Schedule sigmas must be a sequence of numbers"),
    ([1.0, [0.8], 0.5, 0.2, 0.0], "Schedule sigmas must be a sequence of numbers"),
    ([1.0, True, 0.5, 0.2, 0.0], "Schedule sigmas must be a sequence of numbers"),
    (5, "Schedule sigmas must be a sequence of numbers"),
])
def test_schedule_refuses_bad_sigmas_saying_what_to_pass(sigmas, message):
    with pytest.raises(BankIncompatible, match=message) as caught:
        Schedule(steps=4, step_buckets=[(0, 1), (1, 4)], sigmas=sigmas)
    assert "pass the 5 sigmas of the 4-step recording run" in str(caught.value)


def test_schedule_refuses_buckets_beyond_the_sigmas():
    with pytest.raises(BankIncompatible, match=r"reach outside the 4 steps the sigmas cover"):
        Schedule(steps=4, step_buckets=[(0, 2), (2, 6)], sigmas=[1.0, 0.8, 0.5, 0.2, 0.0])


def test_bucket_start_sigmas_and_bucket_for_sigma():
    s = Schedule(steps=4, step_buckets=[(0, 1), (1, 3), (3, 4)], sigmas=[1.0, 0.8, 0.5, 0.2, 0.0])
    assert s.bucket_start_sigmas() == (1.0, 0.8, 0.2)
    probes = [5.0, 1.0, 0.9, 0.8, 0.79999, 0.7, 0.5, 0.2, 0.1, 0.0]
    assert [s.bucket_for_sigma(x) for x in probes] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert s.bucket_for_sigma(float("inf")) == 0  # noisier than the recording: its first bucket
    assert s.bucket_for_sigma(np.float32(0.8)) == 1  # float32 0.8 is a little above or below 0.8
    assert s.bucket_for_sigma(0.8 * (1 - 5e-5)) == 1  # within the tolerance: still bucket 1
    assert s.bucket_for_sigma(0.8 * (1 + 5e-5)) == 1  # the boundary call is bucket 1 either side
    assert s.bucket_for_sigma(0.8 * (1 + 5e-4)) == 0  # beyond it: the bucket before
    with pytest.raises(ValueError, match="sigma is NaN"):
        s.bucket_for_sigma(float("nan"))
    with pytest.raises(ValueError, match="has no sigmas .* bucket_for_step"):
        Schedule(steps=4).bucket_for_sigma(0.5)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_40_step_recording_serves_a_4_step_run_by_sigma(dtype):
    recorded = Schedule(steps=40, sampler="uni_pc", scheduler="simple", shift=5.0,
                        sigmas=simple_sigmas(40))
    assert recorded.step_buckets == [(0, 10), (10, 24), (24, 40)]
    starts = recorded.bucket_start_sigmas()
    assert starts == tuple(simple_sigmas(40)[i] for i in (0, 10, 24))
    # a step-distilled 4-step run on the same shift: its calls are at t = 1, .75, .5, .25, i.e.
    # the 40-step run's steps 0, 10 (exactly bucket 1's start), 20 and 30
    run = np.asarray(simple_sigmas(4), dtype=dtype)[:-1]  # the model is called at all but the last
    assert [recorded.bucket_for_sigma(x) for x in run] == [0, 1, 1, 2]
    assert [recorded.bucket_for_step(i) for i in range(4)] == [0, 0, 0, 0]  # by step: all wrong
    # the second half of a staged run (start_at_step 2 of 4) and a denoise 0.5 run
    assert [recorded.bucket_for_sigma(x) for x in run[2:]] == [1, 2]
    half = simple_sigmas(8)[4:-1]  # denoise 0.5: the last 4 of 8 steps, t = .5, .375, .25, .125
    assert [recorded.bucket_for_sigma(x) for x in half] == [1, 2, 2, 2]  # 40-step: 20, 25, 30, 35


# ---- storage, both backends -------------------------------------------------------------
def test_sigmas_round_trip_through_the_bank(location):
    with MaskBank.open(location) as bank:
        with_sigmas, without = add_with_sigmas(bank, seed=1), add_toy(bank, seed=2)
        loaded = bank.load_masks(with_sigmas)
        assert loaded.schedule == SCHEDULE_S
        assert loaded.schedule.bucket_for_sigma(SIGMAS_8[3]) == 1
        assert (loaded.block_map_numpy(2, 1) == toy_masks(1)[2, 1]).all()
        assert bank.load_masks(without).schedule == SCHEDULE
        assert bank.show(with_sigmas)["sigmas"] == SIGMAS_8
        assert bank.show(without)["sigmas"] is None
        assert {r["id"]: r["sigmas"] for r in bank.entries()} == {with_sigmas: SIGMAS_8, without: None}
        assert bank.stats()["schema_version"] == (3 if bank.root is not None else 2)
        assert bank.verify()["ok"] == 2


def test_damaged_sigmas_in_a_row_quarantine_the_entry(location):
    with MaskBank.open(location) as bank:
        entry = add_with_sigmas(bank)
        bank.db.execute("UPDATE entries SET sigmas = ? WHERE id = ?", [json.dumps(SIGMAS_8[::-1]), entry])
        report = bank.verify()
        assert (report["ok"], [q["id"] for q in report["quarantined"]]) == (0, [entry])
        assert "Schedule sigmas rise at step 1" in report["quarantined"][0]["reason"]


def downgrade(location) -> None:
    """Make the bank at ``location`` look as the version before sigmas left it."""
    if not location.startswith("postgresql"):
        conn = sqlite3.connect(f"{location}/bank.sqlite")
        conn.execute("ALTER TABLE entries DROP COLUMN sigmas")
        conn.execute("PRAGMA user_version = 2")
        conn.commit()
        conn.close()
        return
    with MaskBank.open(location) as bank:
        bank.db.execute("ALTER TABLE entries DROP COLUMN sigmas")
        bank.db.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")


def test_a_bank_of_the_previous_version_reads_then_migrates(location, tmp_path):
    old = 1 if location.startswith("postgresql") else 2
    with MaskBank.open(location) as bank:
        ids = sorted([add_toy(bank, seed=1), add_toy(bank, seed=2)])
    downgrade(location)
    # read-only (a shared read-only mount, a read-only role): read as it is, sigmas None
    reader = MaskBank.open(location, read_only=True)
    again = reader.reopen()
    for r in (reader, again):
        assert r.stats()["schema_version"] == old
        assert sorted((e["id"], e["sigmas"]) for e in r.entries()) == [(i, None) for i in ids]
        assert r.show(ids[0])["sigmas"] is None
        assert r.load_masks(ids[0]).schedule == SCHEDULE
        assert r.verify()["ok"] == 2
    assert [row["sigmas"] for row in exported(reader, tmp_path)[0]] == [None, None]
    again.close()
    reader.close()
    # writable: migrated in place, entries kept (sigmas None), new ones store theirs
    with MaskBank.open(location) as bank:
        assert bank.stats()["schema_version"] == old + 1
        assert sorted((e["id"], e["sigmas"]) for e in bank.entries()) == [(i, None) for i in ids]
        assert bank.load_masks(ids[1]).schedule == SCHEDULE
        assert bank.match(toy_signature(2), FP, LAYOUT).similarity > 0.99
        new = add_with_sigmas(bank, seed=3)
        assert bank.load_masks(new).schedule == SCHEDULE_S
        assert bank.verify()["ok"] == 3


def test_a_bank_two_versions_old_is_not_read_read_only(tmp_path):
    with MaskBank.open(tmp_path / "b") as bank:
        add_toy(bank)
    conn = sqlite3.connect(tmp_path / "b" / "bank.sqlite")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    with pytest.raises(BankError, match="has schema version 1, this Chorus reads 2 to 3; open it "
                                        "once without read_only to migrate it"):
        MaskBank.open(tmp_path / "b", read_only=True)


# ---- export and import ------------------------------------------------------------------
def test_export_carries_sigmas(tmp_path, location):
    src = MaskBank.open(tmp_path / "src")
    with_sigmas, without = add_with_sigmas(src, seed=1), add_toy(src, seed=2)
    rows, members = exported(src, tmp_path)
    assert {r["id"]: r["sigmas"] for r in rows} == {with_sigmas: json.dumps(SIGMAS_8), without: None}
    with target(location) as dst:
        assert dst.import_file(tmp_path / "export.tar") == {"added": 2, "skipped": 0}
        assert dst.load_masks(with_sigmas).schedule == SCHEDULE_S
        assert dst.load_masks(without).schedule == SCHEDULE
        assert dst.show(with_sigmas)["sigmas"] == SIGMAS_8


def test_an_export_from_before_sigmas_imports_with_none(tmp_path, location):
    src = MaskBank.open(tmp_path / "src")
    entry = add_toy(src, seed=1)
    rows, members = exported(src, tmp_path)
    del rows[0]["sigmas"]  # as Chorus wrote exports before the sigmas column
    with target(location) as dst:
        assert dst.import_file(write_tar(tmp_path / "old.tar", rows, members.items())) == {
            "added": 1, "skipped": 0}
        assert dst.load_masks(entry).schedule == SCHEDULE
        assert dst.show(entry)["sigmas"] is None


@pytest.mark.parametrize("value, message", [
    (json.dumps([0.5] * 20_000), r"sigmas must be a list of 1 to 10001 numbers"),
    ("[" + "0.5, " * 100_000 + "0]", r"sigmas text is 500003 characters long, more than the 10001"),
    ("[" * 200_000 + "]" * 200_000, r"sigmas text is 400000 characters long"),
    ("[" * 50_000 + "]" * 50_000, r"sigmas is not valid JSON \(nested more than"),
    (json.dumps(["a"] * 9), r"sigmas\[0\] must be a finite number"),
    (json.dumps([1.0, True] + [0.0] * 7), r"sigmas\[1\] must be a finite number"),
    ("[1.0, NaN, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.0]", r"sigmas\[1\] must be a finite number"),
    ("[1.0, 0.9, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, -1]", r"sigmas\[8\] must be a finite number in \[0\.0, inf\]"),
    ("[1e999, 0.9, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0]", r"sigmas\[0\] must be a finite number"),
    ("[1" + "0" * 5000 + ", 0.9, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0]", r"sigmas is not valid JSON \(holds a number"),
    (json.dumps([1.0, 0.5, 0.0]), "Schedule sigmas hold 3 values, a 8-step schedule has 9"),
    (json.dumps(SIGMAS_8[::-1]), r"Schedule sigmas rise at step 1"),
    ("{}", "sigmas must be a list of 1 to 10001 numbers"),
    ("[]", "sigmas must be a list of 1 to 10001 numbers"),
    ("not json", "sigmas is not valid JSON"),
    (SIGMAS_8, r"sigmas must be JSON text of a list of numbers \(or null\)"),
    (7, r"sigmas must be JSON text of a list of numbers \(or null\)"),
])
def test_import_refuses_hostile_sigmas(tmp_path, location, value, message):
    src = MaskBank.open(tmp_path / "src")
    add_with_sigmas(src)
    rows, members = exported(src, tmp_path)
    rows[0]["sigmas"] = value
    with target(location) as dst:
        with pytest.raises(BankError, match=r"is not a valid Chorus bank export: row 0 .*" + message):
            dst.import_file(write_tar(tmp_path / "t.tar", rows, members.items()))
        assert dst.stats()["entries"] == 0
