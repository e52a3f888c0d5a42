"""Mask bank store: round trip, compatibility, thresholds, corruption, migration, eviction."""

import json
import os
import sqlite3
import tarfile
import time
from dataclasses import replace

import numpy as np
import pytest
from bank_fixtures import FP, LAYOUT, SCHEDULE, add_toy, prune_least_recently_used, toy_masks, toy_signature
from safetensors.numpy import save as st_save

from chorus_core.bank import (BankEntryCorrupt, BankError, BankIncompatible, BankReadOnly,
                              CODEC, LatentLayout, MaskBank, encode_masks)


@pytest.fixture
def bank(tmp_path):
    with MaskBank.open(tmp_path / "bank") as b:
        yield b


def test_round_trip(bank):
    entry = add_toy(bank, seed=1, tags=["pan", "zoom"])
    masks = bank.load_masks(entry)
    got = np.stack([np.stack([masks.block_map(s, l).numpy() for l in range(2)])
                    for s in range(3)])
    assert (got == toy_masks(1)).all()
    assert masks.step_buckets == [(0, 2), (2, 5), (5, 8)]
    assert masks.schedule == SCHEDULE
    assert masks.layout == LAYOUT
    row = bank.show(entry)
    assert {k: row[k] for k in ("hits", "tags", "density", "recall", "status", "steps",
                                "sampler", "scheduler", "shift", "step_buckets")} == {
        "hits": 1, "tags": ["pan", "zoom"], "density": 0.3, "recall": 0.95, "status": "ok",
        "steps": 8, "sampler": "uni_pc", "scheduler": "simple", "shift": 5.0,
        "step_buckets": [[0, 2], [2, 5], [5, 8]]}
    assert row["fingerprint"] == FP.to_dict()
    assert row["last_hit"] is not None


def test_add_checks_mask_shape(bank):
    with pytest.raises(BankIncompatible, match="record one block map per step bucket"):
        bank.add_entry(fingerprint=FP, layout=LAYOUT, schedule=SCHEDULE,
                       masks=toy_masks(0)[:2], signature=toy_signature(0), density=0.3)


def test_match_only_compatible_entries(bank):
    other_fp = replace(FP, digest="1" * 64)
    other_layout = LatentLayout(grid=(2, 8, 16), token_order="thw", block_size=(64, 64))
    sig = toy_signature(5)
    mine = add_toy(bank, seed=5, sig=sig)
    add_toy(bank, seed=5, sig=sig, fp=other_fp)
    result = bank.match(sig, FP, LAYOUT, threshold=0.9)
    assert (result.hit, result.entry_id, result.candidates) == (True, mine, 1)
    assert bank.match(sig, replace(FP, digest="2" * 64), LAYOUT).candidates == 0
    miss = bank.match(sig, FP, other_layout)
    assert (miss.hit, miss.entry_id, miss.similarity, miss.candidates) == (False, None, 0.0, 0)


def test_match_picks_nearest_and_reports_components(bank):
    ids = [add_toy(bank, seed=s) for s in range(4)]
    near = toy_signature(seed=77, noise=0.3, base_seed=2)
    result = bank.match(near, FP, LAYOUT, threshold=0.5, top_k=3)
    assert result.entry_id == ids[2] and result.hit
    assert [t[0] for t in result.top][0] == ids[2] and len(result.top) == 3
    assert set(result.components) == {"clip", "text", "layout"}
    weighted = 0.5 * result.components["clip"] + 0.3 * result.components["text"] \
        + 0.2 * result.components["layout"]
    assert result.similarity == pytest.approx(weighted, abs=1e-5)


def test_threshold_edges(bank):
    add_toy(bank, seed=3)
    sig = toy_signature(seed=9, noise=0.5, base_seed=3)
    sim = bank.match(sig, FP, LAYOUT, threshold=0.0).similarity
    assert 0.5 < sim < 0.99
    assert bank.match(sig, FP, LAYOUT, threshold=sim).hit is True
    assert bank.match(sig, FP, LAYOUT, threshold=float(np.nextafter(sim, 2.0))).hit is False
    assert bank.match(sig, FP, LAYOUT, threshold=1.01).hit is False


def test_weights_change_similarity(bank):
    add_toy(bank, seed=3)
    sig = toy_signature(seed=9, noise=0.5, base_seed=3)
    clip_only = bank.match(sig, FP, LAYOUT, weights={"clip": 1, "text": 0, "layout": 0})
    assert clip_only.similarity == pytest.approx(clip_only.components["clip"], abs=1e-6)
    with pytest.raises(ValueError, match="Unknown signature component"):
        bank.match(sig, FP, LAYOUT, weights={"colour": 1})


def test_index_refreshes_when_bank_changes(tmp_path):
    first = MaskBank.open(tmp_path / "b")
    second = MaskBank.open(tmp_path / "b")
    sig = toy_signature(4)
    token = first.content_token()
    assert first.match(sig, FP, LAYOUT).candidates == 0
    entry = add_toy(second, seed=4)  # another connection writes
    assert first.content_token() != token
    assert first.match(sig, FP, LAYOUT).entry_id == entry
    second.delete([entry])
    assert first.match(sig, FP, LAYOUT).candidates == 0


def test_hits_do_not_change_content_token(bank):
    entry = add_toy(bank, seed=1)
    token = bank.content_token()
    bank.load_masks(entry)
    assert bank.content_token() == token
    assert bank.stats()["hits"] == 1


def _corrupt(bank, entry, how):
    path = bank.blob_path(bank.show(entry)["blob_name"])
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:  # same size, one byte flipped: only the digest catches it
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))


def test_verify_quarantines_truncated_and_wrong_digest(bank):
    good, short, flipped = (add_toy(bank, seed=s) for s in range(3))
    _corrupt(bank, short, "truncate")
    _corrupt(bank, flipped, "flip")
    report = bank.verify()
    assert {k: report[k] for k in ("checked", "ok", "orphans_removed")} == {
        "checked": 3, "ok": 1, "orphans_removed": 0}
    assert {q["id"]: q["reason"].split(" (")[0] for q in report["quarantined"]} == {
        short: "blob truncated or resized", flipped: "blob sha256 mismatch"}
    assert len(list((bank.root / "quarantine").iterdir())) == 2
    assert bank.stats()["entries"] == 1 and bank.stats()["quarantined"] == 2
    assert bank.match(toy_signature(1), FP, LAYOUT).entry_id == good  # skipped, not crashing
    assert bank.verify()["quarantined"] == []


@pytest.mark.parametrize("how", ["truncate", "flip", "missing"])
def test_load_of_corrupt_blob_raises_after_quarantine(bank, how):
    entry = add_toy(bank, seed=1)
    if how == "missing":
        bank.blob_path(bank.show(entry)["blob_name"]).unlink()
    else:
        _corrupt(bank, entry, how)
    with pytest.warns(UserWarning, match="quarantining entry"):
        with pytest.raises(BankEntryCorrupt, match="fall back|dense") as info:
            bank.load_masks(entry)
    assert isinstance(info.value, BankError) and info.value.entry_id == entry
    assert bank.show(entry)["status"] == "quarantined"
    assert bank.match(toy_signature(1), FP, LAYOUT).candidates == 0


def test_prune_evicts_least_recently_used_then_fewest_hits(bank):
    prune_least_recently_used(bank)
    assert sum(1 for p in (bank.root / "blobs").rglob("*.safetensors")) == 1


def test_identical_masks_share_one_blob(bank):
    a, b = add_toy(bank, seed=1), add_toy(bank, seed=1)
    assert bank.show(a)["blob_name"] == bank.show(b)["blob_name"]
    bank.delete([a])
    assert bank.load_masks(b).block_map(0, 0).shape == (2, 8, 8)


V1_SQL = """CREATE TABLE entries (id TEXT PRIMARY KEY NOT NULL, created FLOAT NOT NULL,
 last_hit FLOAT, hits INTEGER, compat TEXT NOT NULL, fingerprint TEXT, grid_t INTEGER,
 grid_h INTEGER, grid_w INTEGER, token_order TEXT, block_q INTEGER, block_k INTEGER,
 steps INTEGER, sampler TEXT, scheduler TEXT, shift FLOAT, step_buckets TEXT, density FLOAT,
 sig_clip BLOB, sig_text BLOB, sig_layout BLOB, blob_name TEXT, blob_bytes INTEGER,
 blob_sha256 TEXT)"""


OLD_ID = "0123456789abcdef0123456789abcdef"  # ids are uuid4().hex: 32 lowercase hex digits


def test_v1_bank_opens_after_migration(tmp_path):
    import hashlib

    from chorus_core.bank import compat_key
    from chorus_core.bank.rows import blob_metadata
    root = tmp_path / "old"
    tensors, meta = encode_masks(toy_masks(2))
    data = st_save(tensors, metadata=blob_metadata(meta))
    sha = hashlib.sha256(data).hexdigest()
    (root / "blobs" / sha[:2]).mkdir(parents=True)
    (root / "blobs" / sha[:2] / f"{sha}.safetensors").write_bytes(data)
    sig = toy_signature(2)
    conn = sqlite3.connect(root / "bank.sqlite")
    conn.execute(V1_SQL)
    conn.execute("INSERT INTO entries VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", [
        OLD_ID, time.time(), None, 0, compat_key(FP, LAYOUT), FP.key(), 2, 8, 16, "thw", 32, 32,
        8, "uni_pc", "simple", 5.0, json.dumps(SCHEDULE.step_buckets), 0.3,
        sig.components["clip"].tobytes(), sig.components["text"].tobytes(),
        sig.components["layout"].tobytes(), f"{sha}.safetensors", len(data), sha])
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    bank = MaskBank.open(root)
    assert bank.stats()["schema_version"] == 3
    row = bank.show(OLD_ID)
    assert (row["tags"], row["status"], row["recall"]) == ([], "ok", None)
    assert bank.match(sig, FP, LAYOUT).entry_id == OLD_ID
    assert (bank.load_masks(OLD_ID).block_map(1, 1).numpy() == toy_masks(2)[1, 1]).all()
    assert bank.verify()["ok"] == 1


def test_a_v1_bank_migrated_exports_what_a_current_bank_would_and_imports(tmp_path):
    """Its rows have no codec (the column came with v2): the export takes it from the blob."""
    test_v1_bank_opens_after_migration(tmp_path)
    bank = MaskBank.open(tmp_path / "old")
    assert bank.export(tmp_path / "old.tar") == 1
    with tarfile.open(tmp_path / "old.tar") as tar:
        rows = json.loads(tar.extractfile("entries.json").read())["rows"]
    assert [r["codec"] for r in rows] == [CODEC]
    fresh = MaskBank.open(tmp_path / "fresh")
    assert fresh.import_file(tmp_path / "old.tar") == {"added": 1, "skipped": 0}
    assert (fresh.load_masks(OLD_ID).block_map(1, 1).numpy() == toy_masks(2)[1, 1]).all()


def test_newer_schema_is_refused(tmp_path):
    MaskBank.open(tmp_path / "b").close()
    conn = sqlite3.connect(tmp_path / "b" / "bank.sqlite")
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(BankError, match="upgrade Chorus"):
        MaskBank.open(tmp_path / "b")


def test_bank_under_a_file_is_refused_clearly(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    with pytest.raises(BankReadOnly, match="Choose a writable folder"):
        MaskBank.open(blocker / "bank")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores folder permissions")
def test_bank_in_read_only_folder_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(BankReadOnly, match="read_only=True"):
            MaskBank.open(ro / "bank")
    finally:
        ro.chmod(0o755)


def test_read_only_mode_reads_and_refuses_writes(tmp_path):
    with pytest.raises(BankError, match="Create one with"):
        MaskBank.open(tmp_path / "none", read_only=True)
    with MaskBank.open(tmp_path / "b") as writer:
        entry = add_toy(writer, seed=1)
    reader = MaskBank.open(tmp_path / "b", read_only=True)
    assert reader.match(toy_signature(1), FP, LAYOUT).entry_id == entry
    assert reader.load_masks(entry).block_map(0, 0).shape == (2, 8, 8)
    assert reader.stats()["hits"] == 0  # read-only: no hit recorded
    with pytest.raises(BankReadOnly, match="open it with read_only=False"):
        add_toy(reader, seed=2)
    with pytest.raises(BankReadOnly):
        reader.prune(max_entries=0)


def test_a_removal_drops_only_the_removed_vectors_from_the_index(bank, monkeypatch):
    """A bank that keeps a budget removes entries on nearly every write: the index reads the ids
    still present, not every signature again (which the next match in every worker paid)."""
    from chorus_core.bank import MaskBank

    ids = [add_toy(bank, seed=s) for s in range(6)]
    assert bank.match(toy_signature(seed=2), FP, LAYOUT).entry_id == ids[2]
    with MaskBank.open(bank.label) as other_process:
        other_process.delete([ids[2], ids[4]])
        added = add_toy(other_process, seed=9)
    signatures_read = []
    real_query = bank.db.query

    def counting_query(sql, *args, **kwargs):
        rows = list(real_query(sql, *args, **kwargs))
        if "sig_clip" in sql:
            signatures_read.extend(row["id"] for row in rows)
        return rows

    monkeypatch.setattr(bank.db, "query", counting_query)
    result = bank.match(toy_signature(seed=2), FP, LAYOUT)
    assert result.entry_id != ids[2] and result.candidates == 5
    assert bank.match(toy_signature(seed=9), FP, LAYOUT).entry_id == added
    assert bank.match(toy_signature(seed=5), FP, LAYOUT).entry_id == ids[5]
    assert signatures_read == [added]  # the new row, appended; the four kept were not read again
