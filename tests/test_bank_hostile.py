"""The mask bank against hostile files, faults and bad arguments (issue 13).

Flat tests over temporary banks. Each asserts the exact outcome: counts, the files on disk
(nothing written, moved or deleted outside the bank) and the message text. Faults are
injected with CHORUS_BANK_FAULT (faults.fault SIGKILLs the process at a named point).
"""

import hashlib
import io
import json
import os
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import tarfile
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from bank_fixtures import (FP, LAYOUT, SCHEDULE, add_toy, corrupt, python_command, toy_masks,
                           toy_signature)
from bank_pg_cluster import location, pg  # noqa: F401  (fixtures: a folder, or a PostgreSQL schema)
from safetensors.numpy import save as st_save

from chorus_core.bank import (BankEntryCorrupt, BankError, BankIncompatible, BankReadOnly,
                              MaskBank, compat_key, encode_masks)
from chorus_core.bank.__main__ import main
from chorus_core.bank.errors import BankInvalidArgument
from chorus_core.bank.rows import blob_metadata
from chorus_core.bank.sqlite_store import STALE_TEMP_S

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)


# ---- helpers ----------------------------------------------------------------------------
def new_bank(tmp_path, n=2, name="bank"):
    bank = MaskBank.open(tmp_path / name)
    return bank, [add_toy(bank, seed=s) for s in range(n)]


def blob_of(bank, entry) -> Path:
    return bank.blob_path(bank.show(entry)["blob_name"])


def tree(path) -> list[str]:
    """Every path under ``path``, relative, sorted (files, folders, links)."""
    return sorted(str(p.relative_to(path)) for p in Path(path).rglob("*"))


def age(path, seconds=2 * STALE_TEMP_S):
    old = time.time() - seconds
    os.utime(path, (old, old), follow_symlinks=False)


def exported(bank, tmp_path):
    """(rows, {member name: bytes}) of an export of the whole bank."""
    tar_path = tmp_path / "export.tar"
    bank.export(tar_path)
    with tarfile.open(tar_path) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}
    return json.loads(members.pop("entries.json"))["rows"], members


def write_tar(path, rows=None, members=(), doc=None, extra=()):
    """A tar with ``entries.json`` (``doc`` or the rows), blob members and extra TarInfos."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info, data in extra:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
        payload = doc if doc is not None else json.dumps(
            {"format": "chorus-bank-export-v1", "rows": rows}).encode()
        info = tarfile.TarInfo("entries.json")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    return path


def target(location):
    """The bank an import goes into: a folder, or a schema of the test server (``location``)."""
    return MaskBank.open(location)


def stored_blobs(bank) -> int:
    """How many blobs the bank holds where its backend keeps them (files, or bytea rows)."""
    if bank.root is not None:
        return len(list((bank.root / "blobs").rglob("*.safetensors")))
    return bank.db.query("SELECT COUNT(*) AS n FROM blobs")[0]["n"]


def raw_entry(bank, masks=None, data=None, **row):
    """Insert an entry by hand (as an old or hand-made bank has it): blob bytes + row."""
    if data is None:
        tensors, meta = encode_masks(toy_masks(0) if masks is None else masks)
        data = st_save(tensors, metadata=blob_metadata(meta))
    sha = hashlib.sha256(data).hexdigest()
    path = bank.blob_path(f"{sha}.safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    entry = row.pop("id", os.urandom(16).hex())
    values = bank._row(entry, FP, LAYOUT, SCHEDULE, toy_signature(0), 0.3, 0.9, [],
                       f"{sha}.safetensors", len(data), sha)
    values.update(row)
    from chorus_core.bank.sqlite_index import insert_row
    with bank._write():
        insert_row(bank.conn, values)
    return entry, path


def cli(*argv):
    """Run the CLI in a subprocess: (exit code, stdout, stderr)."""
    done = subprocess.run([sys.executable, "-m", "chorus_core.bank", *map(str, argv)],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    return done.returncode, done.stdout, done.stderr


# ---- 1. nothing outside the bank --------------------------------------------------------
def test_import_rebuilds_rows_and_ignores_row_blob_name(tmp_path, location):
    src, ids = new_bank(tmp_path, n=1, name="src")
    rows, members = exported(src, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    rows[0].update(blob_name="../../victim.txt", compat="forged", hits=999, status="quarantined",
                   rowid=5, evil_column="x")
    dst = target(location)
    assert dst.import_file(write_tar(tmp_path / "t.tar", rows, members.items())) == {
        "added": 1, "skipped": 0}
    row = dst.show(ids[0])
    assert (row["blob_name"], row["compat"], row["hits"], row["status"]) == (
        f"{row['blob_sha256']}.safetensors", compat_key(FP, LAYOUT), 0, "ok")
    assert dst.prune(max_entries=1) == [] and dst.delete(ids) == 1
    dst.verify()
    assert victim.read_text() == "keep me"
    assert stored_blobs(dst) == 0
    if dst.root is not None:
        assert tree(dst.root / "blobs") == [row["blob_sha256"][:2]]  # blob deleted, shard folder kept


@pytest.mark.parametrize("bad_id", ["../../../../X", "A" * 32, "0" * 31, "../" + "0" * 29])
def test_import_refuses_bad_ids_and_adds_nothing(tmp_path, location, bad_id):
    src, ids = new_bank(tmp_path, n=2, name="src")
    rows, members = exported(src, tmp_path)
    rows[1]["id"] = bad_id
    dst = target(location)
    tar_path = write_tar(tmp_path / "t.tar", rows, members.items())
    before = tree(tmp_path)
    with pytest.raises(BankError, match=r"row 1 .*is not 32 lowercase hex digits.*Nothing was imported"):
        dst.import_file(tar_path)
    assert dst.stats()["entries"] == 0
    assert tree(tmp_path) == before  # not one file more (the failing row's blob neither)


def test_import_never_extracts_member_names(tmp_path, location):
    src, ids = new_bank(tmp_path, n=1, name="src")
    rows, members = exported(src, tmp_path)
    evil = [("../../evil.txt", b"x"), ("/tmp/evil-abs.txt", b"x"), ("blobs/../../../evil2", b"x")]
    dst = target(location)
    assert dst.import_file(write_tar(tmp_path / "t.tar", rows, [*members.items(), *evil])) == {
        "added": 1, "skipped": 0}
    assert not (tmp_path.parent / "evil.txt").exists() and not Path("/tmp/evil-abs.txt").exists()
    assert [p for p in tree(tmp_path) if "evil" in p] == []


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_import_refuses_link_members(tmp_path, location, kind):
    src, ids = new_bank(tmp_path, n=1, name="src")
    rows, members = exported(src, tmp_path)
    (name, _), = members.items()
    link = tarfile.TarInfo(name)
    link.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
    link.linkname = "/etc/passwd"
    dst = target(location)
    with pytest.raises(BankError, match=f"member {name} is a link or special file"):
        dst.import_file(write_tar(tmp_path / "t.tar", rows, extra=[(link, None)]))
    assert dst.stats()["entries"] == 0


def test_import_with_a_missing_blob_adds_nothing(tmp_path, location):
    src, ids = new_bank(tmp_path, n=2, name="src")
    rows, members = exported(src, tmp_path)
    missing = f"blobs/{rows[1]['blob_sha256']}.safetensors"
    dst = target(location)
    with pytest.raises(BankError, match=f"member {missing} is missing. Nothing was imported"):
        dst.import_file(write_tar(tmp_path / "t.tar", rows,
                                  [(k, v) for k, v in members.items() if k != missing]))
    assert dst.stats()["entries"] == 0


def test_a_refused_import_leaves_no_blob_behind(tmp_path, location):
    """The first entry's blob is fine, the second's is damaged: nothing is staged at all."""
    src, ids = new_bank(tmp_path, n=2, name="src")
    rows, members = exported(src, tmp_path)
    bad = f"blobs/{rows[1]['blob_sha256']}.safetensors"
    members[bad] = members[bad][:-1] + bytes([members[bad][-1] ^ 1])
    dst = target(location)
    with pytest.raises(BankError, match=f"the blob of entry {rows[1]['id']} fails its sha256"):
        dst.import_file(write_tar(tmp_path / "t.tar", rows, list(members.items())))
    assert dst.stats()["entries"] == 0 and stored_blobs(dst) == 0


@pytest.mark.parametrize("doc, message", [
    (b"{not json", "entries.json is not valid JSON"),
    (b'{"format": "something-else", "rows": []}', "format is 'something-else'"),
    (b'{"format": "chorus-bank-export-v1", "rows": {}}', "has no list of rows"),
    (b'[1, 2]', "format is 'list'"),
    (b'{"format": "chorus-bank-export-v1", "rows": [7]}', r"row 0 \('None'\): row is not a JSON object"),
])
def test_import_refuses_malformed_rows_json(tmp_path, location, doc, message):
    dst = target(location)
    with pytest.raises(BankError, match=message):
        dst.import_file(write_tar(tmp_path / "t.tar", doc=doc))
    assert dst.stats()["entries"] == 0


def test_import_refuses_non_tar_and_compressed_files(tmp_path, location):
    dst = target(location)
    junk = tmp_path / "junk.tar"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(BankError, match="not an uncompressed tar"):
        dst.import_file(junk)
    src, _ = new_bank(tmp_path, n=1, name="src")
    src.export(tmp_path / "plain.tar")
    with tarfile.open(tmp_path / "gz.tar", "w:gz") as gz, tarfile.open(tmp_path / "plain.tar") as plain:
        for member in plain:
            gz.addfile(member, plain.extractfile(member))
    with pytest.raises(BankError, match="not an uncompressed tar"):
        dst.import_file(tmp_path / "gz.tar")
    with pytest.raises(BankError, match="Cannot read export file .*No such file"):
        dst.import_file(tmp_path / "absent.tar")
    os.mkfifo(tmp_path / "fifo.tar")
    with pytest.raises(BankError, match="is a FIFO, not a file"):
        dst.import_file(tmp_path / "fifo.tar")
    assert dst.stats()["entries"] == 0


def test_import_refuses_huge_members_without_reading_them(tmp_path, location):
    """A 10 GiB entries.json and a 3 GiB blob member, declared in truncated tar headers."""
    src, ids = new_bank(tmp_path, n=1, name="src")
    rows, members = exported(src, tmp_path)
    dst = target(location)
    for name in ("entries.json", f"blobs/{rows[0]['blob_sha256']}.safetensors"):
        path = tmp_path / f"huge-{name.replace('/', '_')}.tar"
        with open(path, "wb") as fh:
            if name != "entries.json":  # a valid rows member first, then the huge blob
                payload = json.dumps({"format": "chorus-bank-export-v1", "rows": rows}).encode()
                info = tarfile.TarInfo("entries.json")
                info.size = len(payload)
                fh.write(info.tobuf() + payload + b"\0" * (-len(payload) % 512))
            info = tarfile.TarInfo(name)
            info.size = 10 * 2 ** 30 if name == "entries.json" else 3 * 2 ** 30
            fh.write(info.tobuf())
            fh.truncate(fh.tell() + info.size)  # sparse: no real GiBs written
        started = time.monotonic()
        with pytest.raises(BankError, match=f"member {name} declares {info.size} bytes, expected"):
            dst.import_file(path)
        assert time.monotonic() - started < 5
    assert dst.stats()["entries"] == 0


@pytest.mark.parametrize("field, value, message", [
    ("blob_sha256", "../../x", "blob_sha256 '../../x' is not 64 lowercase hex"),
    ("blob_bytes", 10 ** 12, r"blob_bytes '1000000000000' is not within 1\.\.1052032 \(the most its layout allows\)"),
    ("grid_t", 4000, "larger than Chorus stores"),
    ("step_buckets", "[[0, 5], [3, 8]]", "must be contiguous"),
    ("density", float("nan"), "density must be a finite number"),
    ("fingerprint", "{}", "architecture must be text"),
    ("fingerprint", "[1]", "fingerprint is not a JSON model fingerprint"),
    ("sig_clip", "AAAA", "sig_clip must be 256 float32 values"),
    ("codec", "pickle", "codec 'pickle' is not one of packbits-xor-zlib-v1, rowshift-zlib-v1"),
])
def test_import_refuses_bad_row_values(tmp_path, location, field, value, message):
    src, ids = new_bank(tmp_path, n=1, name="src")
    rows, members = exported(src, tmp_path)
    rows[0][field] = value
    dst = target(location)
    with pytest.raises(BankError, match=message):
        dst.import_file(write_tar(tmp_path / "t.tar", rows, members.items()))
    assert dst.stats()["entries"] == 0


def test_import_refuses_blob_with_wrong_digest_or_empty_row(tmp_path, location):
    src, ids = new_bank(tmp_path, n=1, name="src")
    rows, members = exported(src, tmp_path)
    (name, data), = members.items()
    flipped = data[:-1] + bytes([data[-1] ^ 1])
    dst = target(location)
    with pytest.raises(BankError, match=f"the blob of entry {ids[0]} fails its sha256"):
        dst.import_file(write_tar(tmp_path / "a.tar", rows, [(name, flipped)]))
    masks = toy_masks(0)
    masks[1, 1, 0, 3] = False  # bucket 1, layer 1, head 0, query block 3 keeps nothing
    tensors, meta = encode_masks(masks)
    empty = st_save(tensors, metadata=blob_metadata(meta))
    sha = hashlib.sha256(empty).hexdigest()
    rows[0].update(blob_sha256=sha, blob_bytes=len(empty))
    with pytest.raises(BankError, match=r"bucket 1 layer 1: block map has 1 empty query rows "
                                        r"\(first: head 0, query block 3\)"):
        dst.import_file(write_tar(tmp_path / "b.tar", rows, [(f"blobs/{sha}.safetensors", empty)]))
    assert dst.stats()["entries"] == 0 and stored_blobs(dst) == 0


def test_three_parallel_imports_of_one_file(tmp_path, location):
    src, ids = new_bank(tmp_path, n=3, name="src")
    src.export(tmp_path / "all.tar")
    MaskBank.open(location).close()
    procs = [subprocess.Popen([sys.executable, "-m", "chorus_core.bank", "import",
                               location, str(tmp_path / "all.tar"), "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for _ in range(3)]
    outs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e for _, e in outs]
    assert all("Traceback" not in err for _, err in outs)
    # each entry goes in once, in a short transaction of its own (imports may interleave)
    counts = [json.loads(out) for out, _ in outs]
    assert sum(c["added"] for c in counts) == 3 and all(c["added"] + c["skipped"] == 3 for c in counts)
    with MaskBank.open(location) as dst:
        assert sorted(r["id"] for r in dst.entries()) == sorted(ids)
        assert dst.verify()["ok"] == 3


def test_hand_made_rows_with_traversal_never_touch_outside(tmp_path):
    bank, ids = new_bank(tmp_path, n=1)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    sha = bank.show(ids[0])["blob_sha256"]
    with bank._write():  # a row as an old import stored it: traversal in id, name and digest
        bank.conn.execute("INSERT INTO entries (id, created, compat, blob_name, blob_sha256, "
                          "blob_bytes, status) VALUES (?, 0, 'x', ?, ?, 10, 'ok')",
                          ["../../../../X", "../../victim.txt", "../../victim.txt"])
    report = bank.verify()
    assert report["quarantined"] == [{"id": "../../../../X",
                                      "reason": "invalid entry id (not 32 lowercase hex digits)"}]
    assert report["ok"] == 1
    assert bank.prune(max_entries=1) == ["../../../../X"]
    assert victim.read_text() == "keep me"
    assert not (tmp_path.parent.parent / "X").exists()
    assert tree(bank.root / "quarantine") == []
    assert blob_of(bank, ids[0]).name == f"{sha}.safetensors" and blob_of(bank, ids[0]).exists()


def test_symlinked_shard_folder_is_never_written_through(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    bank = MaskBank.open(tmp_path / "bank")
    tensors, meta = encode_masks(toy_masks(3))
    sha = hashlib.sha256(st_save(tensors, metadata=blob_metadata(meta))).hexdigest()
    (bank.root / "blobs" / sha[:2]).symlink_to(outside)
    with pytest.raises(BankError, match="its path would leave"):
        add_toy(bank, seed=3)
    assert tree(outside) == [] and bank.stats()["entries"] == 0


def decoy_models(folder: Path) -> dict:
    """A folder of the user's "checkpoints" (one named like a prior): {name: bytes} as written."""
    folder.mkdir()
    files = {"wan2.1_i2v_14b.safetensors": os.urandom(4096), "vae.safetensors": os.urandom(512),
             "0123456789abcdef-0123456789abcdef01234567.safetensors": os.urandom(64)}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def contents(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_linked_priors_folder_never_reaches_the_models_behind_it(tmp_path):
    """A received bank whose priors/ links to ../checkpoints: prior-mode use stores its prior in
    memory and says why; prune, export and verify leave the checkpoints as they were."""
    from chorus_core.reuse.prior_store import load_prior
    decoys = decoy_models(tmp_path / "checkpoints")
    bank, ids = new_bank(tmp_path, n=2)
    (bank.root / "priors").symlink_to("../checkpoints")
    for max_density in (0.5, 0.4):  # two priors, each built once
        with pytest.warns(UserWarning, match=r"priors is a symbolic link \(to '\.\./checkpoints'\)\. "
                                             "Chorus never reads, writes or deletes through a link .*stay in memory"):
            prior = load_prior(bank, FP, LAYOUT, 0.05, max_density)
        assert prior.block_map_numpy(0, 0).shape == (2, 8, 8)
        assert load_prior(bank, FP, LAYOUT, 0.05, max_density) is prior  # from memory, no new warning
    assert bank.prune(max_entries=1) == [ids[0]]
    assert bank.export(tmp_path / "out.tar") == 1 and bank.verify()["problems"] == []
    assert contents(tmp_path / "checkpoints") == decoys
    assert (bank.root / "priors").is_symlink()


def test_a_priors_folder_of_links_or_a_file_is_never_followed(tmp_path):
    from chorus_core.reuse.prior_store import load_prior, prior_key
    decoys = decoy_models(tmp_path / "checkpoints")
    bank, ids = new_bank(tmp_path, n=1)
    (bank.root / "priors").mkdir()
    name = f"{prior_key(bank, FP, LAYOUT, 0.05, 0.5)}.safetensors"
    (bank.root / "priors" / name).symlink_to(tmp_path / "checkpoints" / "vae.safetensors")
    stale = bank.root / "priors" / "fedcba9876543210-0123456789abcdef01234567.safetensors"
    stale.symlink_to(tmp_path / "checkpoints" / "wan2.1_i2v_14b.safetensors")
    assert load_prior(bank, FP, LAYOUT, 0.05, 0.5).block_map_numpy(2, 1).shape == (2, 8, 8)
    assert (bank.root / "priors" / name).is_file() and not (bank.root / "priors" / name).is_symlink()
    assert stale.is_symlink()  # another content's prior name, but a link: left alone
    assert contents(tmp_path / "checkpoints") == decoys
    other, _ = new_bank(tmp_path, n=1, name="other")
    (other.root / "priors").write_bytes(b"not a folder")
    with pytest.warns(UserWarning, match="priors is not a folder"):
        assert load_prior(other, FP, LAYOUT, 0.05, 0.5) is not None


@pytest.mark.parametrize("name", ["blobs", "quarantine", "bank.sqlite", "bank.sqlite-wal", "bank.sqlite-shm",
                                  "bank.sqlite-journal"])
def test_a_bank_with_a_linked_folder_or_index_file_is_refused(tmp_path, name):
    decoys = decoy_models(tmp_path / "checkpoints")
    bank, ids = new_bank(tmp_path, n=2)
    bank.close()
    path = bank.root / name
    if name == "bank.sqlite":  # the index itself lives elsewhere: it would be changed there
        path.rename(tmp_path / "checkpoints" / "index.sqlite")
        decoys["index.sqlite"] = (tmp_path / "checkpoints" / "index.sqlite").read_bytes()
        path.symlink_to(tmp_path / "checkpoints" / "index.sqlite")
    elif name == "blobs":  # the real blobs behind the link: the bank would work through it
        for blob in path.rglob("*.safetensors"):
            blob.rename(tmp_path / "checkpoints" / blob.name)
            decoys[blob.name] = (tmp_path / "checkpoints" / blob.name).read_bytes()
        shutil.rmtree(path)
        path.symlink_to("../checkpoints")
    elif name == "quarantine":
        path.rmdir()
        path.symlink_to(tmp_path / "checkpoints")
    else:  # SQLite would write its log through the link, over the model
        path.symlink_to(tmp_path / "checkpoints" / "wan2.1_i2v_14b.safetensors")
    for read_only in (False, True):
        with pytest.raises(BankError, match=f"{name} is a symbolic link .*Chorus never follows a "
                                            "link in a bank folder.*nothing was opened or changed"):
            MaskBank.open(bank.root, read_only=read_only)
    for command in ("prune", "verify", "export", "stats"):
        extra = {"prune": ["--max-entries", "1"], "export": [tmp_path / "x.tar"]}.get(command, [])
        code, _, err = cli(command, bank.root, *extra)
        assert (code, "Traceback" in err, "symbolic link" in err) == (2, False, True), (command, err)
    assert contents(tmp_path / "checkpoints") == decoys and path.is_symlink()


def test_a_linked_shard_folder_is_never_read_or_emptied(tmp_path):
    bank, ids = new_bank(tmp_path, n=2)
    shard = blob_of(bank, ids[0]).parent
    copy = tmp_path / "elsewhere"
    shutil.copytree(shard, copy)
    shutil.rmtree(shard)
    shard.symlink_to(copy)  # the right blob, behind a link
    with pytest.warns(UserWarning, match="quarantining"), pytest.raises(
            BankEntryCorrupt, match="blob path leaves the bank folder"):
        bank.load_masks(ids[0])
    assert bank.delete([ids[0]]) == 1 and bank.prune(max_entries=1) == [] and bank.verify()["ok"] == 1
    assert len(list(copy.iterdir())) == 1 and shard.is_symlink()


# ---- 2. no command loses data by itself -------------------------------------------------
def damage_index(bank_root: Path, how: str) -> None:
    db = bank_root / "bank.sqlite"
    if how == "zero bytes":
        db.write_bytes(b"")
    elif how == "truncated":
        db.write_bytes(db.read_bytes()[:1024])
    elif how == "random bytes":
        db.write_bytes(os.urandom(8192))
    elif how == "foreign tables":
        db.unlink()
        conn = sqlite3.connect(db)
        conn.execute("CREATE TABLE users (name TEXT)")
        conn.commit()
        conn.close()
    elif how == "no meta table":
        conn = sqlite3.connect(db)
        conn.execute("DROP TABLE meta")
        conn.commit()
        conn.close()


@pytest.mark.parametrize("how, message", [
    ("zero bytes", "is empty, but blobs/ holds 2 recorded mask file"),
    ("truncated", "but blobs/ holds 2 recorded mask file"),
    ("random bytes", r"cannot be read \(file is not a database\), but blobs/ holds 2"),
    ("foreign tables", r"is not a Chorus bank: it holds other tables \(users\)"),
    ("no meta table", "is not a Chorus bank: it lacks the meta table"),
])
def test_damaged_or_foreign_index_is_never_migrated_over_blobs(tmp_path, how, message):
    bank, ids = new_bank(tmp_path, n=2)
    bank.close()
    damage_index(bank.root, how)
    before = {p: p.read_bytes() for p in (bank.root / "blobs").rglob("*.safetensors")}
    db_before = (bank.root / "bank.sqlite").read_bytes()
    for read_only in (False, True):
        with pytest.raises(BankError, match=message):
            MaskBank.open(bank.root, read_only=read_only)
    for command in ("init", "stats", "list", "verify", "prune", "import", "export"):
        extra = {"prune": ["--max-entries", "1"], "import": [tmp_path / "x.tar"],
                 "export": [tmp_path / "x.tar"]}.get(command, [])
        code, out, err = cli(command, bank.root, *extra)
        assert (code, "Traceback" in err) == (2, False), (command, err)
        assert "Restore" in err or "restore" in err, (command, err)
    assert {p: p.read_bytes() for p in (bank.root / "blobs").rglob("*.safetensors")} == before
    assert (bank.root / "bank.sqlite").read_bytes() == db_before  # nothing "migrated"


def test_empty_index_without_blobs_is_a_new_bank(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bank.sqlite").write_bytes(b"")
    with MaskBank.open(tmp_path / "b") as bank:
        assert bank.stats()["schema_version"] == 3


def test_match_on_a_bank_that_lost_its_table_raises_bank_error(tmp_path):
    bank, ids = new_bank(tmp_path, n=1)
    other = sqlite3.connect(bank.root / "bank.sqlite")
    other.execute("DROP TABLE entries")
    other.commit()
    other.close()
    with pytest.raises(BankError, match="is damaged or is not a Chorus bank .*no such table: entries"):
        bank.match(toy_signature(0), FP, LAYOUT)
    for call in (lambda: bank.load_masks(ids[0]), bank.stats, bank.verify,
                 lambda: bank.compatible_entries(FP, LAYOUT)):
        with pytest.raises(BankError, match="no such table"):
            call()


def test_orphans_are_kept_when_the_index_has_no_entries(tmp_path):
    bank, ids = new_bank(tmp_path, n=2)
    blobs = [blob_of(bank, i) for i in ids]
    with bank._write():
        bank.conn.execute("DELETE FROM entries")  # an index that lost its rows
    for path in blobs:
        age(path)
    report = bank.verify()
    assert report["orphans_removed"] == 0 and all(p.exists() for p in blobs)
    assert report["problems"] == ["the index has no entries but blobs/ holds 2 blob(s): the index "
                                  "looks lost, so no orphan was removed. Restore bank.sqlite from "
                                  "a backup."]
    code, _, err = cli("verify", bank.root)
    assert code == 2 and "looks lost" in err and all(p.exists() for p in blobs)


def test_orphan_removal_only_touches_old_unreferenced_blobs(tmp_path):
    bank, ids = new_bank(tmp_path, n=1)
    orphan, _ = raw_entry(bank, masks=toy_masks(7))
    orphan_path = blob_of(bank, orphan)
    bank.conn.execute("DELETE FROM entries WHERE id = ?", [orphan])
    young, _ = raw_entry(bank, masks=toy_masks(8))
    young_path = blob_of(bank, young)
    bank.conn.execute("DELETE FROM entries WHERE id = ?", [young])
    tmp_blob = bank.root / "blobs" / ".tmp-0123"
    tmp_blob.write_bytes(b"partial")
    strays = [bank.root / "blobs" / "notes.txt", bank.root / "priors" / "prior.safetensors",
              bank.root / "quarantine" / "old.safetensors"]
    for path in strays:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"user file")
        age(path)
    for path in (orphan_path, tmp_blob, blob_of(bank, ids[0])):
        age(path)
    report = bank.verify()
    assert (report["orphans_removed"], report["ok"], report["problems"]) == (2, 1, [])
    assert not orphan_path.exists() and not tmp_blob.exists()
    assert young_path.exists() and blob_of(bank, ids[0]).exists()
    assert all(p.read_bytes() == b"user file" for p in strays)


@pytest.mark.parametrize("kwargs", [
    {"max_bytes": -5}, {"max_bytes": 0}, {"max_bytes": float("nan")}, {"max_bytes": float("inf")},
    {"max_bytes": 1.5}, {"max_bytes": True}, {"max_entries": -1}, {"max_entries": 0},
    {"max_entries": "3"},
])
def test_prune_refuses_meaningless_limits(location, kwargs):
    bank = MaskBank.open(location)
    for seed in range(2):
        add_toy(bank, seed=seed)
    with pytest.raises(BankInvalidArgument, match="must be a positive whole number.*to empty a bank"):
        bank.prune(**kwargs)
    assert bank.stats()["entries"] == 2
    bank.close()


@pytest.mark.parametrize("flag, value", [
    ("--max-bytes", "-5"), ("--max-bytes", "-1G"), ("--max-bytes", "infG"), ("--max-bytes", "nan"),
    ("--max-bytes", "0"), ("--max-bytes", "1e9"), ("--max-entries", "-1"), ("--max-entries", "0"),
    ("--max-entries", "2.5"),
])
def test_prune_cli_refuses_meaningless_limits(tmp_path, capsys, flag, value):
    bank, ids = new_bank(tmp_path, n=2)
    with pytest.raises(SystemExit) as exit_info:
        main(["prune", str(bank.root), f"{flag}={value}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "is not a positive" in err and value in err
    assert bank.stats()["entries"] == 2 and len(list((bank.root / "blobs").rglob("*.s*"))) == 2


def test_prune_cli_sizes(tmp_path, capsys):
    bank, ids = new_bank(tmp_path, n=2)
    size = bank.show(ids[1])["blob_bytes"]
    assert main(["prune", str(bank.root), "--max-bytes", f"{size}B", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == [ids[0]]
    assert main(["prune", str(bank.root), "--max-bytes", "1.5K", "--json"]) == 0


# ---- 3. bounded work per bad blob -------------------------------------------------------
def spoil(path: Path, kind: str, outside: Path):
    data = path.read_bytes()
    path.unlink()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "sha mismatch":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif kind == "directory":
        path.mkdir()
        (path / "inner").write_text("x")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink outside":
        outside.write_bytes(data)  # even a correct copy outside is not followed
        path.symlink_to(outside)
    elif kind == "2 GB sparse":
        with open(path, "wb") as fh:
            fh.truncate(2 * 2 ** 30)


BAD_BLOBS = {
    "missing": "blob missing",
    "truncated": "blob truncated or resized",
    "sha mismatch": "blob sha256 mismatch",
    "directory": "blob is a directory, not a regular file",
    "fifo": "blob is a FIFO, not a regular file",
    "symlink outside": "blob is a symlink, not a regular file",
    "2 GB sparse": "blob truncated or resized (2147483648 of",
}


@pytest.mark.parametrize("kind", list(BAD_BLOBS))
def test_bad_blob_is_quarantined_on_load_quickly(tmp_path, kind):
    bank, ids = new_bank(tmp_path, n=2)
    path, outside = blob_of(bank, ids[0]), tmp_path / "outside.safetensors"
    spoil(path, kind, outside)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    with pytest.warns(UserWarning, match="quarantining entry"):
        with pytest.raises(BankEntryCorrupt, match="it was moved to quarantine") as info:
            bank.load_masks(ids[0])
    assert time.monotonic() - started < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 50_000  # KiB: never read
    assert info.value.reason.startswith(BAD_BLOBS[kind])
    assert bank.show(ids[0])["status"] == "quarantined" and not os.path.lexists(path)
    moved = tree(bank.root / "quarantine")
    assert len([m for m in moved if "/" not in m]) == (0 if kind == "missing" else 1)
    if kind == "symlink outside":
        assert outside.exists() and Path(bank.root / "quarantine" / moved[0]).is_symlink()
    if kind == "directory":
        assert moved[1].endswith("/inner")
    assert bank.load_masks(ids[1]).block_map_numpy(0, 0).shape == (2, 8, 8)


@pytest.mark.parametrize("kind", ["directory", "fifo", "2 GB sparse", "symlink outside"])
def test_verify_quarantines_each_bad_blob_kind(tmp_path, kind):
    bank, ids = new_bank(tmp_path, n=2)
    spoil(blob_of(bank, ids[1]), kind, tmp_path / "outside.safetensors")
    started = time.monotonic()
    report = bank.verify()
    assert time.monotonic() - started < 5
    assert (report["checked"], report["ok"], [q["id"] for q in report["quarantined"]]) == (
        2, 1, [ids[1]])
    assert report["quarantined"][0]["reason"].startswith(BAD_BLOBS[kind])
    code, out, err = cli("verify", bank.root)
    assert code == 0 and "Traceback" not in err


def test_read_only_bank_reports_would_quarantine_and_skips(tmp_path, location):
    """On both backends: the damaged entry is skipped for the rest of the process, and every
    later match (which then looks past it) still works."""
    with MaskBank.open(location) as bank:
        ids = [add_toy(bank, seed=s) for s in range(2)]
        corrupt(bank, ids[0], "truncate")
        blobs = stored_blobs(bank)
    sig = toy_signature(0)
    reader = MaskBank.open(location, read_only=True)
    assert reader.match(sig, FP, LAYOUT).entry_id == ids[0]
    with pytest.warns(UserWarning, match="would quarantine entry .*nothing was moved") as caught:
        with pytest.raises(BankEntryCorrupt) as info:
            reader.load_masks(ids[0])
    assert "it was moved" not in str(info.value) and "nothing was moved" in str(info.value)
    assert all("quarantining" not in str(w.message) for w in caught)
    again = MaskBank.open(location, read_only=True)  # same process: still skipped
    for _ in range(2):  # not only the first request after the damage
        result = again.match(sig, FP, LAYOUT, threshold=0.0)
        assert result.entry_id == ids[1] and result.candidates == 2
        assert set(result.components) == {"clip", "text", "layout"}
    assert again.compatible_entries(FP, LAYOUT) == [ids[1]]
    started = time.monotonic()
    with pytest.raises(BankEntryCorrupt, match="nothing was moved"):
        again.load_masks(ids[0])
    assert time.monotonic() - started < 0.05
    reader.close()
    again.close()
    code, _, err = cli("export", location, tmp_path / "out.tar")  # read-only by itself
    assert code == 0 and "would quarantine" in err
    with MaskBank.open(location) as bank:
        assert stored_blobs(bank) == blobs and bank.show(ids[0])["status"] == "ok"
    if bank.root is not None:
        assert tree(bank.root / "quarantine") == []


def test_shape_mismatch_and_huge_declared_shape_are_quarantined(tmp_path):
    bank, ids = new_bank(tmp_path, n=1)
    other = toy_masks(0)[:, :, :, :4, :4] | True  # 4x4 blocks in a blob whose row says 8x8
    tensors, meta = encode_masks(other)
    wrong, _ = raw_entry(bank, data=st_save(tensors, metadata=blob_metadata(meta)))
    with pytest.warns(UserWarning), pytest.raises(BankEntryCorrupt) as info:
        bank.load_masks(wrong)
    assert info.value.reason == ("blob cannot serve its layout: blob declares mask shape "
                                 "'3,2,2,4,4', its row's model, layout and schedule say '3,2,2,8,8'")
    huge, _ = raw_entry(bank, masks=toy_masks(4), grid_t=4000, grid_h=4000, grid_w=4000)
    started = time.monotonic()
    with pytest.warns(UserWarning), pytest.raises(BankEntryCorrupt, match="larger than Chorus stores"):
        bank.load_masks(huge)
    assert time.monotonic() - started < 1
    assert bank.stats()["quarantined"] == 2


def test_entry_with_an_empty_row_is_quarantined_when_used(tmp_path):
    bank = MaskBank.open(tmp_path / "bank")
    masks = toy_masks(0)
    masks[2, 0, 1, 5] = False
    with pytest.raises(BankIncompatible, match=r"1 query rows keep no key block \(first: bucket 2, "
                                               r"layer 0, head 1, query block 5\)"):
        bank.add_entry(FP, LAYOUT, SCHEDULE, masks, toy_signature(0), 0.3)
    entry, path = raw_entry(bank, masks=masks)  # as a hand-made bank would hold it
    loaded = bank.load_masks(entry)
    assert loaded.block_map_numpy(0, 0).shape == (2, 8, 8)
    with pytest.warns(UserWarning, match="quarantining"), pytest.raises(
            BankEntryCorrupt, match="bucket 2 layer 0 unusable: ValueError: block map has 1 empty"):
        loaded.block_map(2, 0)
    assert bank.show(entry)["status"] == "quarantined" and not path.exists()


BOMB_SCRIPT = """
import resource, sys
sys.path.insert(0, 'tests')
from chorus_core.bank import MaskBank, BankEntryCorrupt
bank = MaskBank.open(sys.argv[1])
masks = bank.load_masks(sys.argv[2])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    masks.block_map_numpy(0, 0)
    outcome = 'decoded'
except BankEntryCorrupt as exc:
    outcome = 'corrupt: ' + exc.reason
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
print(outcome)
"""


@pytest.mark.parametrize("codec, part", [("packbits-xor-zlib-v1", "b0.l0.p"), ("rowshift-zlib-v1", "b0.l0.d")])
def test_zlib_bomb_is_quarantined_with_bounded_memory(tmp_path, codec, part):
    bank = MaskBank.open(tmp_path / "bank")
    tensors, meta = encode_masks(toy_masks(0), codec=codec)
    tensors[part] = np.frombuffer(zlib.compress(b"\0" * (64 * 2 ** 20), 9), np.uint8)
    data = st_save(tensors, metadata=blob_metadata(meta))
    assert len(data) < 200_000
    entry, path = raw_entry(bank, data=data)
    bank.close()
    done = subprocess.run([sys.executable, "-c", BOMB_SCRIPT, str(tmp_path / "bank"), entry],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    grown_kib, outcome = done.stdout.split("\n")[:2]
    assert outcome.startswith("corrupt: bucket 0 layer 0 unusable: ValueError"), done.stderr
    assert int(grown_kib) < 32_000  # a 64 MiB inflation never happened
    with MaskBank.open(tmp_path / "bank") as bank:
        assert bank.show(entry)["status"] == "quarantined"


# ---- faults: SIGKILL at the critical moments --------------------------------------------
def run_victim(path, action, point, arg=""):
    env = {**os.environ, "CHORUS_BANK_FAULT": point}
    body = (f"from bank_fixtures import victim_main; "
            f"victim_main({action!r}, {str(path)!r}, {str(arg)!r})")
    done = subprocess.run(python_command(body), env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, (point, done.stdout, done.stderr)


def healthy(bank) -> list[str]:
    """Ids of entries whose masks load; asserts no row points at a missing blob."""
    ids = [r["id"] for r in bank.entries() if r["status"] == "ok"]
    for entry in ids:
        bank.load_masks(entry, record_hit=False).block_map_numpy(2, 1)
    return ids


@pytest.mark.parametrize("point", ["add-blob-written", "add-before-commit"])
def test_writer_killed_before_commit_leaves_an_orphan_only(tmp_path, point):
    bank, ids = new_bank(tmp_path, n=2)
    run_victim(bank.root, "add", point, arg=9)
    assert sorted(healthy(bank)) == sorted(ids)
    blobs = sorted((bank.root / "blobs").rglob("*.safetensors"))
    assert len(blobs) == 3 and list((bank.root / "blobs").glob(".tmp-*")) == []
    for blob in blobs:
        age(blob)
    report = bank.verify()
    assert (report["ok"], report["orphans_removed"], report["quarantined"]) == (2, 1, [])


@pytest.mark.parametrize("point, rows_left", [
    ("prune-before-commit", 3), ("prune-after-commit", 1), ("delete-mid-unlink", 1)])
def test_prune_killed_never_leaves_rows_without_blobs(tmp_path, point, rows_left):
    bank, ids = new_bank(tmp_path, n=3)
    run_victim(bank.root, "prune", point, arg=1)
    assert len(healthy(bank)) == rows_left
    report = bank.verify()
    assert (report["ok"], report["quarantined"]) == (rows_left, [])
    for blob in (bank.root / "blobs").rglob("*.safetensors"):
        age(blob)
    bank.verify()
    assert len(list((bank.root / "blobs").rglob("*.safetensors"))) == rows_left


def test_quarantine_killed_after_the_move_loses_nothing(tmp_path):
    bank, ids = new_bank(tmp_path, n=2)
    path = blob_of(bank, ids[0])
    data = path.read_bytes()
    run_victim(bank.root, "quarantine", "quarantine-moved", arg=ids[0])
    assert bank.show(ids[0])["status"] == "ok" and not path.exists()  # rolled back; file moved
    (kept,) = (bank.root / "quarantine").iterdir()
    assert kept.read_bytes() == data
    with pytest.warns(UserWarning), pytest.raises(BankEntryCorrupt, match="blob missing"):
        bank.load_masks(ids[0])
    assert healthy(bank) == [ids[1]]


def test_import_killed_before_commit_adds_nothing_and_can_be_rerun(tmp_path, location):
    src, ids = new_bank(tmp_path, n=2, name="src")
    src.export(tmp_path / "all.tar")
    dst = target(location)
    run_victim(location, "import", "import-before-commit", arg=tmp_path / "all.tar")
    assert dst.stats()["entries"] == 0
    assert dst.import_file(tmp_path / "all.tar") == {"added": 2, "skipped": 0}
    assert sorted(healthy(dst)) == sorted(ids)


# ---- concurrency --------------------------------------------------------------------------
def test_writers_readers_prune_and_verify_in_parallel(tmp_path):
    bank, _ = new_bank(tmp_path, n=4)
    bank.close()
    roles = ["writer1", "writer2", "pruner", "reader", "verifier"]
    procs = []
    for role in roles:
        body = (f"from bank_fixtures import role_main; role_main({role!r}, "
                f"{str(tmp_path / 'bank')!r}, 4.0, {str(tmp_path / role)!r})")
        procs.append(subprocess.Popen(python_command(body), cwd=REPO, stderr=subprocess.PIPE,
                                      text=True))
    for proc in procs:
        assert proc.wait(timeout=90) == 0, proc.stderr.read()
    results = {role: json.loads((tmp_path / role).read_text()) for role in roles}
    assert {role: (r["corrupt"], r["errors"]) for role, r in results.items()} == {
        role: ([], []) for role in roles}
    assert all(r["ops"] > 0 for r in results.values())
    with MaskBank.open(tmp_path / "bank") as bank:
        report = bank.verify()
        assert report["quarantined"] == [] and report["ok"] == report["checked"]
        assert len(healthy(bank)) == report["checked"]


def pause_at(monkeypatch, module, point):
    """Hold the bank operation that reaches fault ``point`` of ``module`` (in another thread)
    until the returned ``go_on`` is set; ``reached`` is set when it is there."""
    reached, go_on, real = threading.Event(), threading.Event(), module.fault

    def pause(name):
        if name == point:
            reached.set()
            assert go_on.wait(60)
        real(name)

    monkeypatch.setattr(module, "fault", pause)
    return reached, go_on


@pytest.mark.parametrize("writer", ["import", "add"])
def test_verify_raises_no_alarm_while_an_import_or_a_writer_is_midway(tmp_path, monkeypatch, writer):
    """Into an empty bank: the blobs are written, the rows not yet committed. verify (another
    process) must neither say the index looks lost nor remove those blobs."""
    from chorus_core.bank import sqlite_store, transfer
    src, ids = new_bank(tmp_path, n=3, name="src")
    src.export(tmp_path / "all.tar")
    dst = MaskBank.open(tmp_path / "dst")
    module, point = (transfer, "import-blobs-staged") if writer == "import" else (sqlite_store, "add-blob-written")
    reached, go_on = pause_at(monkeypatch, module, point)
    work = (lambda: dst.import_file(tmp_path / "all.tar")) if writer == "import" else (lambda: add_toy(dst, seed=0))
    done = {}
    worker = threading.Thread(target=lambda: done.update(result=work()))
    worker.start()
    try:
        assert reached.wait(30)
        code, out, err = cli("verify", dst.root, "--json")
    finally:
        go_on.set()
        worker.join(60)
    assert (code, json.loads(out)["problems"], json.loads(out)["orphans_removed"]) == (0, [], 0), err
    added = sorted(ids) if writer == "import" else [done["result"]]
    assert done["result"] == {"added": 3, "skipped": 0} or writer == "add"
    assert sorted(healthy(dst)) == added
    assert dst.verify() == {"checked": len(added), "ok": len(added), "quarantined": [],
                            "orphans_removed": 0, "problems": [], "read_only": False}
    dst.close()


def test_an_export_changed_during_its_import_adds_nothing(tmp_path, location, monkeypatch):
    """After every check, the file changes in place (same size, one byte) before the rows go
    in: the blob read again in the transaction is checked again, so nothing is added."""
    from chorus_core.bank import transfer
    src, ids = new_bank(tmp_path, n=2, name="src")
    rows, members = exported(src, tmp_path)
    (one, two), padding = members.items(), ("padding", bytes(2 ** 20))  # no read buffer spans both
    tar_path = write_tar(tmp_path / "all.tar", rows, [one, padding, two])
    with tarfile.open(tar_path) as tar:
        first = next(m for m in tar if m.name.startswith("blobs/"))
    dst = target(location)
    real = transfer.fault

    def change_the_file(point):
        if point == "import-blobs-staged":
            with open(tar_path, "r+b") as fh:
                fh.seek(first.offset_data + first.size - 1)
                last = fh.read(1)
                fh.seek(-1, os.SEEK_CUR)
                fh.write(bytes([last[0] ^ 0xFF]))
            if dst.root is not None:  # the folder's staged copy is gone too: it reads the file again
                (dst.root / "blobs" / first.name[6:8] / first.name[6:]).unlink()
        real(point)

    monkeypatch.setattr(transfer, "fault", change_the_file)
    with pytest.raises(BankError, match=r"the blob of entry [0-9a-f]{32} changed while it was imported\. "
                                        "Nothing was imported"):
        dst.import_file(tar_path)
    assert dst.stats()["entries"] == 0
    if dst.root is None:
        assert stored_blobs(dst) == 0
    for blob in (dst.root or tmp_path / "none").rglob("*.safetensors"):  # only intact content
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name[:64]
    dst.close()


# ---- full disk ----------------------------------------------------------------------------
def test_full_database_reports_the_real_error(tmp_path):
    bank, ids = new_bank(tmp_path, n=1)
    pages = bank.conn.execute("PRAGMA page_count").fetchone()[0]
    bank.conn.execute(f"PRAGMA max_page_count = {pages}")
    with pytest.raises(BankError) as info:
        for seed in range(1, 40):
            add_toy(bank, seed=seed)
    assert "database or disk is full" in str(info.value) and "Free some space" in str(info.value)
    assert "cannot rollback" not in str(info.value)
    bank.conn.execute(f"PRAGMA max_page_count = {10 ** 6}")
    assert len(healthy(bank)) == bank.stats()["entries"] >= 1
    add_toy(bank, seed=99)


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here ({done.stderr.strip()}): needs root "
                    "and CAP_SYS_ADMIN")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_on_a_small_tmpfs(small_tmpfs):
    bank, ids = new_bank(small_tmpfs, n=1)
    filler = small_tmpfs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\1" * 4096):
            pass
    except OSError as exc:
        assert exc.errno == 28  # ENOSPC: the disk is full now
    finally:
        os.close(fd)
    with pytest.raises(BankError) as info:
        for seed in range(1, 20):
            add_toy(bank, seed=seed)
    text = str(info.value)
    assert ("No space left on device" in text or "database or disk is full" in text), text
    assert "cannot rollback" not in text and "disk holding the mask bank" in text
    assert list((bank.root / "blobs").glob(".tmp-*")) == []
    filler.unlink()
    assert len(healthy(bank)) == bank.stats()["entries"]


def test_read_only_mount_opens_read_only(small_tmpfs):
    bank, ids = new_bank(small_tmpfs, n=1)
    bank.close()
    assert not (small_tmpfs / "bank" / "bank.sqlite-wal").exists()
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    reader = MaskBank.open(small_tmpfs / "bank", read_only=True)
    assert reader.match(toy_signature(0), FP, LAYOUT).entry_id == ids[0]
    assert reader.load_masks(ids[0]).block_map_numpy(1, 1).shape == (2, 8, 8)
    assert reader.verify()["ok"] == 1
    reader.close()
    with pytest.raises(BankReadOnly, match="read_only=True"):
        MaskBank.open(small_tmpfs / "bank")


def test_read_only_folder_uses_immutable(tmp_path, monkeypatch):
    from chorus_core.bank import sqlite_index
    bank, ids = new_bank(tmp_path, n=1)
    bank.close()
    monkeypatch.setattr(sqlite_index, "folder_writable", lambda root: False)
    uri = MaskBank._read_only_uri(bank.root, bank.root / "bank.sqlite")
    assert uri.endswith("?mode=ro&immutable=1")
    with MaskBank.open(bank.root, read_only=True) as reader:
        assert reader.load_masks(ids[0]).block_map_numpy(0, 0).shape == (2, 8, 8)
    (bank.root / "bank.sqlite-wal").write_bytes(b"")  # a live writer may exist: no immutable
    assert MaskBank._read_only_uri(bank.root, bank.root / "bank.sqlite").endswith("?mode=ro")


# ---- 5. clear errors from every command ---------------------------------------------------
def test_cli_errors_name_what_to_do(tmp_path):
    bank, ids = new_bank(tmp_path, n=1)
    bank.close()
    cases = [
        (("export", bank.root, tmp_path / "no" / "such" / "dir.tar"), "folder .* does not exist"),
        (("export", bank.root, tmp_path), "is not a regular file"),
        (("export", bank.root, tmp_path / "x.tar", "--id", "../x"), "is not an entry id"),
        (("show", bank.root, "../../etc"), "is not an entry id"),
        (("show", bank.root, "0" * 32), "No entry 0{32}"),
        (("list", bank.root, "--limit", "-1"), "is not a positive whole number"),
        (("import", bank.root, tmp_path / "absent.tar"), "Cannot read export file"),
        (("stats", tmp_path / "nothing"), "No mask bank at"),
        (("prune", bank.root), "prune needs --max-bytes"),
    ]
    for argv, message in cases:
        code, out, err = cli(*argv)
        assert code == 2 and "Traceback" not in err, (argv, err)
        assert __import__("re").search(message, err), (argv, err)
    assert not (tmp_path / "no").exists()


def test_verify_exit_codes(tmp_path):
    bank, ids = new_bank(tmp_path, n=2)
    assert cli("verify", bank.root)[0] == 0
    blob_of(bank, ids[0]).write_bytes(b"short")
    code, out, err = cli("verify", bank.root, "--json")
    assert code == 1 and json.loads(out)["quarantined"][0]["id"] == ids[0]
    assert cli("verify", bank.root)[0] == 0
    bank.close()  # checkpoints the WAL: the damage below is then all SQLite sees
    (bank.root / "bank.sqlite").write_bytes(os.urandom(4096))
    code, out, err = cli("verify", bank.root)
    assert code == 2 and "Restore bank.sqlite" in err and "Traceback" not in err


def test_prune_racing_a_writer_of_the_same_masks_keeps_the_new_entry(tmp_path, monkeypatch):
    """The writer has written blob X (same masks as entry A) but not yet committed its row
    when a prune removes A: X is unlinked as unreferenced, and the writer, under the lock,
    writes it again before committing, so the new entry is healthy and never quarantined."""
    from chorus_core.bank import sqlite_store
    bank, (old,) = new_bank(tmp_path, n=1)
    pruner = MaskBank.open(tmp_path / "bank")
    add_toy(pruner, seed=5)  # newer entry: prune keeps it, evicts `old`
    path = blob_of(bank, old)
    real_fault = sqlite_store.fault

    def prune_between_blob_and_row(point):
        if point == "add-blob-written":
            assert pruner.prune(max_entries=1) == [old] and not path.exists()
        real_fault(point)

    monkeypatch.setattr(sqlite_store, "fault", prune_between_blob_and_row)
    new = add_toy(bank, seed=0)  # the same masks as `old`: the same blob X
    assert bank.show(new)["blob_name"] == path.name and path.exists()
    report = pruner.verify()
    assert (report["ok"], report["quarantined"]) == (2, [])
    assert (bank.load_masks(new).block_map_numpy(2, 1) == toy_masks(0)[2, 1]).all()
