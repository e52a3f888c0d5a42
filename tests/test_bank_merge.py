"""Merge instead of add: a recording close to an entry in signature and masks updates it.

The decision at both thresholds, consensus masks that get better with absorbed recordings (on a
synthetic ground truth), writers in several processes merging into one entry without losing a vote,
and a writer killed at each point of a merge, on the folder bank and PostgreSQL (``location``).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from bank_fixtures import FP, LAYOUT, SCHEDULE, python_command, toy_masks, toy_signature
from bank_pg_cluster import bank, location, pg  # noqa: F401  (fixtures)
from conftest import REPO_ROOT

from chorus_core.bank import MaskBank
from chorus_core.bank import merge as merging
from chorus_core.bank.errors import BankInvalidArgument

sys.path.insert(0, str(REPO_ROOT / "tests" / "benchmarks"))
import bench_bank_lifecycle as lifecycle  # noqa: E402


def record(bank, masks, signature, entry_id=None):
    return bank.add_entry(fingerprint=FP, layout=LAYOUT, schedule=SCHEDULE, masks=masks, signature=signature,
                          density=float(masks.mean()), entry_id=entry_id)


def flipped(masks, seed, count=6):
    """``masks`` with ``count`` off-diagonal blocks flipped: a close recording of the same kind."""
    rng = np.random.default_rng(seed)
    out = masks.copy()
    flat = out.reshape(-1, 8, 8)
    for _ in range(count):
        i, q, k = rng.integers(len(flat)), rng.integers(8), rng.integers(8)
        if q != k:
            flat[i, q, k] = ~flat[i, q, k]
    return out


def stored_votes(bank, entry_id, shape):
    text = list(bank.db.query("SELECT value FROM meta WHERE key = ?", [merging.VOTES_PREFIX + entry_id]))
    return merging.Votes.from_text(text[0]["value"], shape) if text else None


def all_masks(bank, entry_id):
    entry = bank.load_masks(entry_id, record_hit=False)
    return np.stack([np.stack([entry.block_map_numpy(s, layer) for layer in range(2)]) for s in range(3)])


# ---- the decision ------------------------------------------------------------------------
def test_merging_is_off_until_a_policy_is_set(bank):
    first = record(bank, toy_masks(0), toy_signature(0))
    second = record(bank, toy_masks(0), toy_signature(0))
    assert second != first and bank.stats()["entries"] == 2
    assert bank.merge_policy() == merging.MergePolicy()


@pytest.mark.parametrize("bad", [(0.8, None), (0.0, 0.5), (0.8, 1.5), (float("nan"), 0.5), (True, 0.5)])
def test_a_policy_needs_both_thresholds_in_range(bank, bad):
    with pytest.raises(BankInvalidArgument):
        bank.set_merge_policy(*bad)


@pytest.mark.parametrize("which", ["similarity", "agreement"])
def test_a_recording_merges_only_at_or_above_both_thresholds(bank, which):
    base_masks, base_sig = toy_masks(0), toy_signature(0)
    entry = record(bank, base_masks, base_sig)
    masks, sig = flipped(base_masks, 1), toy_signature(5, noise=0.5, base_seed=0)
    sim = bank.match(sig, FP, LAYOUT).similarity
    agree = merging.agreement(all_masks(bank, entry), masks)
    assert 0.3 < sim < 0.999 and 0.5 < agree < 0.999  # the recording is close, not equal
    just_above = {"similarity": (sim + 1e-4, agree - 1e-4), "agreement": (sim - 1e-4, agree + 1e-4)}[which]
    bank.set_merge_policy(*just_above)
    added = record(bank, masks, sig, entry_id="a" * 32)
    assert added == "a" * 32 and bank.stats()["entries"] == 2 and merging.merged_into("a" * 32) is None
    bank.delete([added])
    bank.set_merge_policy(sim - 1e-4, agree - 1e-4)
    merged = record(bank, masks, sig, entry_id="b" * 32)
    assert merged == entry and merging.merged_into("b" * 32) == entry
    assert bank.stats()["entries"] == 1 and bank.show(entry)["hits"] == 1
    assert bank.has_entry("b" * 32)  # a spool replay of this recording does not merge it again
    assert stored_votes(bank, entry, base_masks.shape).n == 2
    assert bank.verify()["quarantined"] == []


def test_an_entry_moves_to_its_mean_signature_once_it_holds_enough_recordings(bank, location):
    entry = record(bank, toy_masks(0), toy_signature(20, noise=0.5, base_seed=0))  # a photo, not the centre
    with MaskBank.open(location, read_only=True) as reader:
        probe = toy_signature(9, noise=0.5, base_seed=0)
        before = reader.match(probe, FP, LAYOUT).similarity
        bank.set_merge_policy(0.3, 0.3)
        for seed in range(1, merging.MEAN_SIGNATURE_FROM):
            assert reader.match(probe, FP, LAYOUT).similarity == pytest.approx(before)  # still its first photo's
            assert record(bank, flipped(toy_masks(0), seed), toy_signature(seed, noise=0.5, base_seed=0)) == entry
        after = reader.match(probe, FP, LAYOUT, top_k=3)
        assert after.top == [(entry, pytest.approx(after.similarity))]  # one id, its new vector
        assert after.similarity > before  # the mean of several photos is closer to another than one photo
        assert reader.load_masks(entry, record_hit=False).shape == (3, 2, 2, 8, 8)


def test_a_reader_that_read_the_row_before_a_merge_is_served_the_merged_masks(bank, location):
    entry = record(bank, toy_masks(0), toy_signature(0))
    with MaskBank.open(location) as reader:
        stale = reader._get_row(entry)  # read just before another process merges into it
        bank.set_merge_policy(0.3, 0.3)
        assert record(bank, flipped(toy_masks(0), 1), toy_signature(1, noise=0.5, base_seed=0)) == entry
        assert reader._problem(stale)[0] == "blob missing"  # the old blob went with the merge
        row, reason, _ = reader._read_through_merges(stale)
        assert reason is None and row["blob_sha256"] == bank.show(entry)["blob_sha256"] != stale["blob_sha256"]
        assert reader.stats()["quarantined"] == 0


def test_a_reader_sees_a_merge_and_an_insert_made_after_the_last_row_was_removed(bank, location):
    """SQLite gives a removed last row's rowid to the next row: a reader's index, which appends rows
    above the highest rowid it read, must still see the new entry and the merged row's new signature."""
    entry = record(bank, toy_masks(0), toy_signature(20, noise=0.5, base_seed=0))
    bank.set_merge_policy(0.3, 0.3)
    for seed in range(1, merging.MEAN_SIGNATURE_FROM - 1):  # the next merge moves it to the mean
        assert record(bank, flipped(toy_masks(0), seed), toy_signature(seed, noise=0.5, base_seed=0)) == entry
    with MaskBank.open(location, read_only=True) as reader:
        probe = toy_signature(21, noise=0.5, base_seed=0)
        for seed in (7, 8):
            last = record(bank, toy_masks(seed), toy_signature(seed))
            assert reader.match(toy_signature(seed), FP, LAYOUT).entry_id == last  # read at the top rowid
            bank.delete([last])
        newest = record(bank, toy_masks(9), toy_signature(9))  # SQLite: the removed row's rowid
        assert reader.match(toy_signature(9), FP, LAYOUT).entry_id == newest
        before = reader.match(probe, FP, LAYOUT).similarity
        bank.delete([newest])
        seed = merging.MEAN_SIGNATURE_FROM
        assert record(bank, flipped(toy_masks(0), seed), toy_signature(seed, noise=0.5, base_seed=0)) == entry
        after = bank.match(probe, FP, LAYOUT).similarity
        assert after != pytest.approx(before) and reader.match(probe, FP, LAYOUT).similarity == pytest.approx(after)


def test_deleting_a_merged_entry_drops_its_votes(bank):
    entry = record(bank, toy_masks(0), toy_signature(0))
    bank.set_merge_policy(0.3, 0.3)
    record(bank, flipped(toy_masks(0), 1), toy_signature(1, noise=0.5, base_seed=0))
    assert bank.merge_status()["voted_entries"] == 1
    bank.delete([entry])
    assert bank.merge_status()["voted_entries"] == 0


def test_a_merged_entrys_votes_count_against_the_budget(bank):
    """The votes live in ``meta``, outside the blob: uncounted, a budget would bound the blobs and
    let the votes grow. Set at the blobs' size alone, the budget has to evict."""
    entry = record(bank, toy_masks(0), toy_signature(0))
    bank.set_merge_policy(0.3, 0.3)
    record(bank, flipped(toy_masks(0), 1), toy_signature(1, noise=0.5, base_seed=0))
    votes = len(next(iter(bank.db.query("SELECT value FROM meta WHERE key = ?", [merging.VOTES_PREFIX + entry])))["value"])
    blob = bank.show(entry)["blob_bytes"]
    assert bank.budget_status()["bytes"] == blob + votes and votes > 0
    eviction = bank.set_budget(max_bytes=blob)
    assert eviction.entry_ids == [entry] and bank.budget_status()["bytes"] == 0


# ---- consensus masks get better with use ----------------------------------------------------
def test_consensus_masks_serve_better_with_more_absorbed_recordings(tmp_path):
    """Synthetic ground truth (the lifecycle simulation's): one kind, each request a new photo; masks
    are scored by recall on 200 held-out requests of the kind. After 5 absorbed recordings the entry
    serves better than the average single recording, after 30 better than the best one, at no more
    than their mean density (so not by keeping more blocks)."""
    stream = lifecycle.Stream(1000, 1, seed=3)
    requests = [stream.draw(i) for i in range(230)]
    held_out = [attention for _, _, attention in requests[30:]]
    singles = [lifecycle.oracle_mask(attention) for _, _, attention in requests[:30]]

    def served_recall(masks):
        return np.mean([lifecycle.recall(masks, attention) for attention in held_out])

    served = {}
    with MaskBank.open(tmp_path / "bank") as bank:
        bank.set_merge_policy(0.5, 0.3)
        for n, ((_, signature, _), mask) in enumerate(zip(requests, singles), start=1):
            entry = bank.add_entry(lifecycle.FINGERPRINT, lifecycle.LAYOUT, lifecycle.SCHEDULE, mask[None],
                                   signature, density=float(mask.mean()))
            if n in (5, 30):
                loaded = bank.load_masks(entry, record_hit=False)
                masks = np.stack([loaded.block_map_numpy(0, layer) for layer in range(lifecycle.LAYERS)])
                served[n] = (served_recall(masks), masks.mean())
        assert bank.stats()["entries"] == 1
    single_recalls = [served_recall(mask) for mask in singles]
    assert served[5][0] > np.mean(single_recalls)
    assert served[30][0] > max(single_recalls) and served[30][0] > served[5][0]
    assert served[30][1] <= np.mean([mask.mean() for mask in singles])


# ---- concurrency and crashes ------------------------------------------------------------------
MERGER = """
import sys
sys.path.insert(0, 'tests')
import numpy as np
from test_bank_merge import flipped, record
from bank_fixtures import toy_masks, toy_signature
from chorus_core.bank import MaskBank
from chorus_core.bank import merge
location, worker, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
bank = MaskBank.open(location)
for i in range(count):
    seed = 100 * worker + i
    rid = f"{worker:016x}{i:016x}"
    got = record(bank, flipped(toy_masks(0), seed), toy_signature(seed, noise=0.5, base_seed=0), entry_id=rid)
    print('merged' if merge.merged_into(rid) else 'added', rid, got, flush=True)
"""


def test_concurrent_merges_from_several_processes_lose_no_vote(location):
    with MaskBank.open(location) as bank:
        entry = record(bank, toy_masks(0), toy_signature(0))
        bank.set_merge_policy(0.3, 0.3)
    workers, count = 3, 6
    procs = [subprocess.Popen([sys.executable, "-c", MERGER, location, str(w), str(count)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=str(REPO_ROOT),
                              env={**os.environ, "PYTHONPATH": "."}) for w in range(workers)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * workers, [err[-2000:] for _, err in outputs]
    lines = [line.split() for out, _ in outputs for line in out.splitlines()]
    assert len(lines) == workers * count and all(kind == "merged" and got == entry for kind, _, got in lines)
    expected = toy_masks(0).astype(int) + sum(flipped(toy_masks(0), 100 * w + i).astype(int)
                                              for w in range(workers) for i in range(count))
    with MaskBank.open(location) as bank:
        votes = stored_votes(bank, entry, toy_masks(0).shape)
        assert votes.n == 1 + workers * count
        np.testing.assert_array_equal(votes.counts, expected)  # every process's every vote is in
        assert bank.show(entry)["hits"] == workers * count and bank.stats()["entries"] == 1
        assert bank.verify()["quarantined"] == []


@pytest.mark.parametrize("point", ["merge-blob-written", "merge-before-commit", "merge-after-commit"])
def test_a_writer_killed_mid_merge_leaves_the_old_entry_or_the_new(location, point):
    with MaskBank.open(location) as bank:
        entry = record(bank, toy_masks(0), toy_signature(0))
        bank.set_merge_policy(0.3, 0.3)
        old = bank.show(entry)
    code = ("from test_bank_merge import flipped, record; from bank_fixtures import toy_masks, toy_signature; "
            f"from chorus_core.bank import MaskBank; record(MaskBank.open({location!r}), flipped(toy_masks(0), 1), "
            "toy_signature(1, noise=0.5, base_seed=0))")
    done = subprocess.run(python_command(code), env={**os.environ, "CHORUS_BANK_FAULT": point, "PYTHONPATH": "."},
                          capture_output=True, text=True, timeout=120, cwd=str(REPO_ROOT))
    assert done.returncode == -9, done.stderr
    with MaskBank.open(location) as bank:
        report = bank.verify()
        assert report["quarantined"] == [] and report["problems"] == []  # the row's blob is whole
        now = bank.show(entry)
        votes = stored_votes(bank, entry, toy_masks(0).shape)
        assert bank.stats()["entries"] == 1
        if point == "merge-after-commit":  # the new entry: masks, votes and use together
            assert now["blob_sha256"] != old["blob_sha256"] and now["hits"] == 1 and votes.n == 2
            np.testing.assert_array_equal(all_masks(bank, entry), votes.consensus(flipped(toy_masks(0), 1)))
        else:  # the old entry, unchanged
            assert (now["blob_sha256"], now["hits"], votes) == (old["blob_sha256"], 0, None)
            np.testing.assert_array_equal(all_masks(bank, entry), toy_masks(0))
        # the bank goes on merging after the crash
        assert record(bank, flipped(toy_masks(0), 2), toy_signature(2, noise=0.5, base_seed=0)) == entry


# ---- what a recording's state says ------------------------------------------------------------
def test_a_queued_recording_that_merged_says_into_which_entry_and_is_not_replayed_twice(tmp_path):
    from chorus_core.bank import spool
    from chorus_core.reuse import bank_writer, recording_queue
    from test_bank_spool import recording

    with MaskBank.open(tmp_path / "bank") as bank:
        entry = record(bank, toy_masks(4), toy_signature(4))
        bank.set_merge_policy(0.9, 0.9)
        rec = recording(seed=4)  # the same request again, as packed recorded masks

        assert recording_queue.hand_over(bank, rec) == ("queued", None)
        item = bank_writer.default_writer().outcome(rec.entry_id)
        assert item is not None and item.done.wait(30) and item.error is None
        state = bank_writer.recording_state(rec.entry_id)
        assert (state["state"], state["merged_into"]) == ("recorded", entry)
        assert [r["id"] for r in bank.entries()] == [entry] and bank.show(entry)["hits"] == 1

        spool.write_spool(spool.spool_folder(bank), rec)  # as if killed before its spool file went
        spool.replay_spool(bank)
        assert bank.show(entry)["hits"] == 1 and stored_votes(bank, entry, toy_masks(4).shape).n == 2


# ---- the simulation's targets -----------------------------------------------------------------
def merge_targets_hold(doc):
    finals = {row["policy"]: row for row in doc["rows"] if row.get("final")}
    none, merged = finals["none"], finals["merge"]
    assert merged["entries"] <= 2 * merged["kinds_seen"] < none["entries"]
    assert merged["hit_rate"] >= none["hit_rate"] - 0.01
    assert merged["served_recall"] >= none["served_recall"]
    study = doc["threshold_study"]
    for key, used in (("similarity", merged["merge_similarity"]), ("agreement", merged["merge_agreement"])):
        # the thresholds separate the kinds of pairs the study measured
        assert study[key]["nearest_other_kind"]["max"] < used < study[key]["same_kind"]["p1"]


def test_merging_on_a_short_stream_meets_the_issue_targets(tmp_path):
    lifecycle.main(["--requests", "3000", "--kinds", "20", "--policies", "none,merge", "--out", str(tmp_path)])
    merge_targets_hold(json.loads((tmp_path / "bank_lifecycle.json").read_text()))


def test_the_committed_lifecycle_results_meet_the_merge_targets():
    doc = json.loads((REPO_ROOT / "tests" / "benchmarks" / "results" / "bank_lifecycle.json").read_text())
    merge_targets_hold(doc)
    assert "merge" in doc["command"]  # every policy ran under the one recorded command


def test_the_cli_shows_sets_and_turns_off_the_merge_policy(location, capsys):
    from chorus_core.bank.__main__ import main as cli

    MaskBank.open(location).close()
    assert cli(["merge", location, "--json"]) == 0
    assert '"similarity": null' in capsys.readouterr().out
    assert cli(["merge", location, "--similarity", "0.65", "--agreement", "0.55"]) == 0
    with MaskBank.open(location, read_only=True) as reader:
        assert (reader.merge_policy().similarity, reader.merge_policy().agreement) == (0.65, 0.55)
    assert cli(["merge", location, "--similarity", "0.65"]) == 2  # both or neither
    assert "needs both" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["merge", location, "--similarity", "1.5", "--agreement", "0.5"])
    assert cli(["merge", location, "--off"]) == 0
    with MaskBank.open(location, read_only=True) as reader:
        assert not reader.merge_policy().on
