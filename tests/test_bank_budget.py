"""A bank's budget holds itself: stored in the bank, kept by every write on both backends, least
worth evicted first, safe with several writer processes and a writer killed mid-eviction.

The folder bank and the PostgreSQL bank run the same tests (``location``; PostgreSQL skips without
its server binaries, as in test_bank_postgres.py).
"""

import os
import subprocess
import sys
import threading
import time

import pytest
from bank_fixtures import FP, LAYOUT, add_toy, corrupt, python_command, toy_signature
from bank_pg_cluster import bank, location, pg  # noqa: F401  (fixtures)

from chorus_core.bank import BankError, MaskBank
from chorus_core.bank.errors import BankInvalidArgument
from chorus_core.bank import budget as budgets
from chorus_core.bank.__main__ import main as cli

DAY = 24 * 3600.0


def entry_bytes(bank) -> int:
    """The blob size of one toy entry (they differ by a few bytes): a budget of N of them holds N."""
    probe = add_toy(bank, seed=999)
    size = bank.show(probe)["blob_bytes"]
    bank.delete([probe])
    return size


def set_use(bank, entry, hits, last_use_ago, now):
    bank.db.execute("UPDATE entries SET hits = ?, last_hit = ?, created = ? WHERE id = ?",
                    [hits, now - last_use_ago, now - last_use_ago - 60, entry])


# ---- the stored budget -------------------------------------------------------------------
def test_the_budget_is_stored_in_the_bank_for_every_connection(location, capsys):
    with MaskBank.open(location) as first, MaskBank.open(location) as second:
        assert first.budget() == budgets.Budget()
        first.set_budget(max_bytes=5_000_000, max_entries=40)
        assert second.budget() == budgets.Budget(5_000_000, 40)
    assert cli(["budget", location, "--json"]) == 0
    assert '"max_bytes": 5000000' in capsys.readouterr().out
    assert cli(["budget", location, "--max-bytes", "2M"]) == 0  # a limit not given is removed
    with MaskBank.open(location, read_only=True) as reader:
        assert reader.budget() == budgets.Budget(2 * 2**20, None)
    assert cli(["budget", location, "--unlimited"]) == 0
    with MaskBank.open(location) as again:
        assert again.budget() == budgets.Budget()


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "20G"])
def test_a_budget_that_is_no_positive_whole_number_is_refused(bank, bad):
    with pytest.raises(BankInvalidArgument, match="positive whole number"):
        bank.set_budget(max_bytes=bad)
    assert bank.budget() == budgets.Budget()


def test_a_damaged_stored_budget_means_no_limit_not_evict_all():
    assert budgets.budget_from_meta({"budget_bytes": "-1", "budget_entries": "x"}) == budgets.Budget()
    assert budgets.budget_from_meta({"budget_bytes": "0"}) == budgets.Budget()


# ---- writes keep it ------------------------------------------------------------------------
def test_every_write_keeps_the_budget(bank):
    size = entry_bytes(bank)
    limit = 3 * size + size // 2
    bank.set_budget(max_bytes=limit)
    added = []
    for seed in range(8):
        added.append(add_toy(bank, seed=seed))
        status = bank.budget_status()
        assert status["bytes"] <= limit and status["entries"] <= 3
        assert bank.has_entry(added[-1])  # the entry just written is never its own write's victim
    lines = [e.line() for e in budgets.take_evictions(bank.label)]
    assert len(lines) == 5 and all(line.startswith("bank budget: writing entry ") for line in lines)
    assert "evicted 1 entry (" in lines[0]
    assert bank.verify()["quarantined"] == []  # every kept row has its blob
    assert len(bank.entries()) == 3


def test_max_entries_alone_is_kept_too(bank):
    bank.set_budget(max_entries=2)
    for seed in range(5):
        add_toy(bank, seed=seed)
    assert bank.stats()["entries"] == 2


def test_an_entry_larger_than_the_whole_budget_is_not_kept(bank):
    add_toy(bank, seed=1)
    assert len(bank.set_budget(max_bytes=100).entry_ids) == 1  # setting it evicts at once
    entry = add_toy(bank, seed=2)
    (eviction,) = budgets.take_evictions(bank.label)[-1:]
    assert eviction.entry_ids == [entry] and eviction.written == entry  # protected only while others can go
    assert bank.stats()["entries"] == 0


def test_an_import_keeps_the_budget(bank, tmp_path):
    with MaskBank.open(tmp_path / "source") as source:
        for seed in range(6):
            add_toy(source, seed=seed)
        source.export(tmp_path / "all.tar")
    bank.set_budget(max_entries=2)
    assert bank.import_file(tmp_path / "all.tar")["added"] == 6
    assert bank.stats()["entries"] == 2


# ---- what goes first -----------------------------------------------------------------------
def test_eviction_follows_hits_per_byte_and_recency(bank):
    now = time.time()
    popular, fresh, stale, warm = (add_toy(bank, seed=s) for s in range(4))
    set_use(bank, popular, hits=10, last_use_ago=3600, now=now)   # 11 / size
    set_use(bank, fresh, hits=0, last_use_ago=7200, now=now)      # 1 / size
    set_use(bank, stale, hits=10, last_use_ago=42 * DAY, now=now)  # 11 / size / 64: six half-lives idle
    set_use(bank, warm, hits=2, last_use_ago=0, now=now)          # 3 / size
    eviction = bank.set_budget(max_entries=2)
    assert eviction.entry_ids == [stale, fresh]
    assert {r["id"] for r in bank.entries()} == {popular, warm}


def test_worth_is_per_byte_and_halves_per_half_life():
    now = 1e9
    assert budgets.worth(3, 1000, now, now) == pytest.approx(2 * budgets.worth(3, 2000, now, now))
    assert budgets.worth(3, 1000, now - budgets.RECENCY_HALF_LIFE_S, now) == pytest.approx(
        budgets.worth(3, 1000, now, now) / 2)
    rows = [{"id": "big", "blob_bytes": 2000, "hits": 3, "last_use": now, "created": now},
            {"id": "small", "blob_bytes": 1000, "hits": 3, "last_use": now, "created": now}]
    assert [r["id"] for r in budgets.least_worth_first(rows, now)] == ["big", "small"]


# ---- quarantined blobs ---------------------------------------------------------------------
def test_quarantined_blobs_count_go_first_and_age_out(bank, monkeypatch):
    size = entry_bytes(bank)
    good, bad = add_toy(bank, seed=1), add_toy(bank, seed=2)
    corrupt(bank, bad, "flip")
    assert [q["id"] for q in bank.verify()["quarantined"]] == [bad]
    status = bank.budget_status()
    assert status["quarantined_blobs"] == 1 and status["quarantined_bytes"] >= size // 2
    assert status["bytes"] == bank.show(good)["blob_bytes"] + status["quarantined_bytes"]
    eviction = bank.set_budget(max_bytes=status["bytes"] - 1)  # over only by the quarantined blob
    assert eviction.entry_ids == [] and eviction.quarantined_removed == 1
    assert bank.budget_status()["quarantined_blobs"] == 0 and bank.has_entry(good)

    corrupt(bank, good, "truncate")
    bank.verify()
    bank.set_budget()  # no budget at all: aged quarantine still goes at the next write
    add_toy(bank, seed=3)
    assert bank.budget_status()["quarantined_blobs"] == 1  # young: kept for inspection
    monkeypatch.setattr(budgets, "QUARANTINE_KEEP_S", -1.0)
    add_toy(bank, seed=4)
    assert bank.budget_status()["quarantined_blobs"] == 0


# ---- a reader of an evicted entry ----------------------------------------------------------
def test_loading_an_entry_evicted_meanwhile_is_a_bank_error(bank):
    entry = add_toy(bank, seed=1)
    assert bank.match(toy_signature(1), FP, LAYOUT).entry_id == entry
    with bank.reopen() as writer:
        writer.set_budget(max_entries=1)
        add_toy(writer, seed=2)  # evicts the matched entry
    with pytest.raises(BankError, match="No entry"):
        bank.load_masks(entry)


def test_an_entry_evicted_between_its_row_and_its_blob_is_a_bank_error(bank, monkeypatch):
    entry = add_toy(bank, seed=1)
    real_read_blob = type(bank)._read_blob

    def evict_then_read(self, sha, size):  # the reader has the row; a writer evicts before the blob read
        if not self.budget().limited:
            with self.reopen() as writer:
                writer.set_budget(max_entries=1)
                add_toy(writer, seed=2)
        return real_read_blob(self, sha, size)

    monkeypatch.setattr(type(bank), "_read_blob", evict_then_read)
    with pytest.raises(BankError, match="removed or quarantined it while it was being read"):
        bank.load_masks(entry)
    monkeypatch.undo()
    assert bank.verify()["quarantined"] == [] and bank.stats()["entries"] == 1


# ---- several writer processes --------------------------------------------------------------
WRITER = """
import sys
sys.path.insert(0, 'tests')
from bank_fixtures import add_toy
from chorus_core.bank import MaskBank, budget
bank = MaskBank.open(sys.argv[1])
for i in range(int(sys.argv[3])):
    entry = add_toy(bank, seed=int(sys.argv[2]) * 1000 + i)
    print('added', entry, flush=True)
    for eviction in budget.take_evictions(bank.label):
        print('evicted', *eviction.entry_ids, flush=True)
"""


def test_concurrent_writers_stay_within_budget_and_lose_no_kept_entry(location):
    with MaskBank.open(location) as bank:
        size = entry_bytes(bank)
        limit = 5 * size + size // 2
        bank.set_budget(max_bytes=limit)
    seen, stop = [], threading.Event()

    def watch():  # every committed state a reader can see is within the budget
        with MaskBank.open(location, read_only=True) as reader:
            while not stop.is_set():
                seen.append(reader.budget_status()["bytes"])
                time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, location, str(seed), "12"], stdout=subprocess.PIPE,
                                text=True, cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": "."})
               for seed in range(3)]
    outputs = [w.communicate(timeout=300)[0] for w in writers]
    stop.set()
    watcher.join()
    assert [w.returncode for w in writers] == [0, 0, 0]
    added = {line.split()[1] for out in outputs for line in out.splitlines() if line.startswith("added")}
    evicted = {i for out in outputs for line in out.splitlines() if line.startswith("evicted") for i in line.split()[1:]}
    assert len(added) == 36 and evicted <= added
    with MaskBank.open(location) as bank:
        kept = {r["id"] for r in bank.entries()}
        assert kept == added - evicted  # nothing lost that no writer evicted, nothing evicted kept
        assert bank.budget_status()["bytes"] <= limit and len(kept) == 5
        assert bank.verify()["quarantined"] == []
    assert seen and max(seen) <= limit


# ---- a writer killed mid-eviction ----------------------------------------------------------
@pytest.mark.parametrize("point", ["evict-before-commit", "evict-after-commit"])
def test_a_writer_killed_mid_eviction_leaves_a_consistent_bank(tmp_path, point):
    path = tmp_path / "bank"
    with MaskBank.open(path) as bank:
        old = [add_toy(bank, seed=s) for s in range(3)]
        for entry in old[1:]:  # old[0] is worth least
            bank.db.execute("UPDATE entries SET hits = 5 WHERE id = ?", [entry])
        bank.set_budget(max_entries=3)
    code = ("import sys; sys.path.insert(0, 'tests'); from bank_fixtures import add_toy; "
            f"from chorus_core.bank import MaskBank; add_toy(MaskBank.open({str(path)!r}), seed=7)")
    done = subprocess.run(python_command(code), env={**os.environ, "CHORUS_BANK_FAULT": point, "PYTHONPATH": "."},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    with MaskBank.open(path) as bank:
        kept = [r["id"] for r in bank.entries()]
        report = bank.verify()
        assert report["quarantined"] == [] and report["problems"] == []  # every row still has its blob
        if point == "evict-before-commit":  # rolled back: the new entry and the eviction, together
            assert sorted(kept) == sorted(old)
        else:  # committed: the evicted entry's blob is an orphan, not a row, and counts for nothing
            assert len(kept) == 3 and old[0] not in kept
            assert bank.budget_status()["bytes"] == sum(bank.show(i)["blob_bytes"] for i in kept)
            assert bank._files.count() == 4
            aged = time.time() - 2 * 3600
            for blob in (path / "blobs").rglob("*.safetensors"):
                os.utime(blob, (aged, aged))
            add_toy(bank, seed=8)  # a later eviction sweeps old orphans (once an hour per bank)
            assert bank._files.count() == 3
