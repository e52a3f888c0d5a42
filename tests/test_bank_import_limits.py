"""The mask bank against hostile signatures and export files (issue 26, items 2, 3 and 14).

* A signature that is not a unit vector (a real one scaled by 1000) must not take over
  matching: import refuses it, ``add_entry`` normalises it, and a row already stored with one
  (an old or hand-edited bank) scores a similarity within [-1, 1], on both backends.
* A small export must not make import read or hold gigabytes: sparse or truncated members are
  refused, a blob's header is checked before the rest is read, its digest is streamed.
* Deeply nested or huge-number JSON in an export is a clean BankError, in the API and the CLI.
"""

import base64
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from bank_fixtures import FP, LAYOUT, add_toy, toy_signature
from bank_pg_cluster import bank, location, pg  # noqa: F401  (the shared fixtures)

from chorus_core.bank import BankEntryCorrupt, BankError, MaskBank, Signature
from chorus_core.bank.errors import BankInvalidArgument
from chorus_core.bank.signature import COMPONENTS, DIM

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def source(tmp_path):
    """A folder bank holding one entry (seed 0), exported: (rows, {member name: bytes})."""
    with MaskBank.open(tmp_path / "src") as src:
        add_toy(src, seed=0)
        src.export(tmp_path / "export.tar")
    with tarfile.open(tmp_path / "export.tar") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}
    return json.loads(members.pop("entries.json"))["rows"], members


def write_tar(path, rows=None, members=(), doc=None):
    """A tar with the blob members and ``entries.json`` (``doc`` bytes, or the rows)."""
    payload = doc if doc is not None else json.dumps(
        {"format": "chorus-bank-export-v1", "rows": rows}).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in [*members, ("entries.json", payload)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def scaled(signature: Signature, factor: float) -> Signature:
    return Signature({c: (v * factor).astype(np.float32) for c, v in signature.components.items()})


# A request, the entry recorded for it, and a distant relative of that entry (cosine about
# 0.1: a miss on its own, but 1000 times that beats any honest similarity).
REQUEST = dict(seed=7, noise=0.3, base_seed=1)
RELATIVE = dict(seed=8, noise=3.0, base_seed=1)


# ---- item 2: one entry cannot take over matching ----------------------------------------
def test_import_refuses_a_signature_that_is_not_a_unit_vector(bank, source, tmp_path):
    rows, members = source
    vec = np.frombuffer(base64.b64decode(rows[0]["sig_clip"]), np.float32) * 1000
    rows[0]["sig_clip"] = base64.b64encode(vec.astype(np.float32).tobytes()).decode()
    with pytest.raises(BankError, match=r"row 0 .*sig_clip has norm 1000, not 1: signatures "
                                        r"are unit vectors"):
        bank.import_file(write_tar(tmp_path / "scaled.tar", rows, members.items()))
    assert bank.stats()["entries"] == 0


def test_add_normalises_a_scaled_signature(bank):
    relative = toy_signature(**RELATIVE)
    scaled_id = add_toy(bank, seed=0, sig=scaled(relative, 1000.0))
    honest = add_toy(bank, seed=1)
    result = bank.match(toy_signature(**REQUEST), FP, LAYOUT, threshold=0.9, top_k=2)
    assert (result.entry_id, result.hit) == (honest, True)
    assert 0.0 < dict(result.top)[scaled_id] < 0.5
    same = bank.match(relative, FP, LAYOUT, threshold=0.99)
    assert same.entry_id == scaled_id and same.similarity == pytest.approx(1.0, abs=1e-5)
    for component in COMPONENTS:
        stored = bank.db.query(f"SELECT sig_{component} AS v FROM entries WHERE id = ?", [scaled_id])
        vec = np.frombuffer(list(stored)[0]["v"], np.float32)
        assert float(np.linalg.norm(vec)) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("bad, message", [
    ({"clip": np.zeros(DIM, np.float32)}, "clip is a zero vector"),
    ({"text": np.full(DIM, np.nan, np.float32)}, "text holds NaN or infinite values"),
    ({"layout": np.ones(DIM + 1, np.float32)}, f"layout must be {DIM} float32 values, got shape"),
])
def test_add_refuses_a_signature_it_cannot_normalise(bank, bad, message):
    with pytest.raises(BankInvalidArgument, match=message):
        add_toy(bank, seed=0, sig=Signature({**toy_signature(0).components, **bad}))
    assert bank.stats()["entries"] == 0


def test_a_stored_scaled_signature_scores_within_the_metric(bank):
    """A row written with a scaled signature before this fix (or by hand) cannot take over."""
    poisoned = add_toy(bank, seed=0, sig=toy_signature(**RELATIVE))
    honest = add_toy(bank, seed=1)
    for component in COMPONENTS:
        stored = list(bank.db.query(f"SELECT sig_{component} AS v FROM entries WHERE id = ?",
                                    [poisoned]))[0]["v"]
        big = (np.frombuffer(stored, np.float32) * 1000).astype(np.float32).tobytes()
        bank.db.execute(f"UPDATE entries SET sig_{component} = ? WHERE id = ?", [big, poisoned])
    bank.db.execute("UPDATE meta SET value = '99' WHERE key = 'generation'")  # reload the index
    near = toy_signature(**REQUEST)
    result = bank.match(near, FP, LAYOUT, threshold=0.9, top_k=2)
    assert (result.entry_id, result.hit) == (honest, True)
    assert 0.0 < dict(result.top)[poisoned] < 0.5
    big_query = bank.match(scaled(near, 1000.0), FP, LAYOUT, top_k=2)
    assert big_query.entry_id == honest and big_query.similarity <= 1.0
    assert all(-1.0 <= v <= 1.0 for v in big_query.components.values())


def test_weights_that_would_unbound_similarity_are_refused(bank):
    add_toy(bank, seed=0)
    with pytest.raises(ValueError, match="weight of text must be a finite number >= 0"):
        bank.match(toy_signature(0), FP, LAYOUT, weights={"clip": 2.0, "text": -1.0})


# ---- item 3: a small export cannot make import read gigabytes ---------------------------
# A row may declare a layout large enough that its blob may legitimately be GBs: 3 buckets x
# 40 layers x 40 heads x 2560 x 2560 blocks. Its blob must still be in the file, be what its
# header says, and have its header checked before the rest is read.
BIG_FP = {"architecture": "wan2.1-i2v", "dim": 5120, "layers": 40, "heads": 40, "in_dim": 36,
          "digest": "0" * 64}
BIG_SHAPE = (3, 40, 40, 2560, 2560)


def big_row(row: dict, blob: bytes | None = None, size: int | None = None) -> dict:
    """``row`` (a real export row) declaring the large layout and the given blob."""
    row = dict(row, fingerprint=json.dumps(BIG_FP, sort_keys=True), grid_t=16, grid_h=40,
               grid_w=40, block_q=10, block_k=10)
    if blob is not None:
        row.update(blob_sha256=hashlib.sha256(blob).hexdigest(), blob_bytes=len(blob))
    if size is not None:
        row["blob_bytes"] = size
    return row


def big_header(part_bytes: int, shape=BIG_SHAPE) -> bytes:
    """The first bytes of a packbits blob of ``shape`` whose every part has ``part_bytes``."""
    s_count, layers = shape[:2]
    names = sorted(f"b{s}.l{layer}.{'p' if s == 0 else 'q'}"
                   for s in range(s_count) for layer in range(layers))
    header = {name: {"dtype": "U8", "shape": [part_bytes],
                     "data_offsets": [i * part_bytes, (i + 1) * part_bytes]}
              for i, name in enumerate(names)}
    meta = {"codec": "packbits-xor-zlib-v1", "shape": ",".join(map(str, shape)),
            "stored_blocks": f"{shape[3]},{shape[4]}", "coarsen": "1"}
    header["__metadata__"] = {"chorus": json.dumps(meta, sort_keys=True)}
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text


def tar_with_huge_member(path, rows, name: str, head: bytes, size: int) -> Path:
    """entries.json, then member ``name`` of ``size`` bytes starting with ``head`` and then
    zeros; the zeros are a hole in the file (truncate), so no disk space is used."""
    payload = json.dumps({"format": "chorus-bank-export-v1", "rows": rows}).encode()
    with open(path, "wb") as fh:
        for member, data in (("entries.json", payload), (name, None)):
            info = tarfile.TarInfo(member)
            info.size = len(data) if data is not None else size
            fh.write(info.tobuf())
            if data is not None:
                fh.write(data + b"\0" * (-len(data) % 512))
        fh.write(head)
        fh.truncate(fh.tell() - len(head) + size + (-size % 512) + 1024)
    return path


# Runs one import in a fresh interpreter whose address space may grow by at most 256 MiB
# past what importing the bank takes: reading a member whole would raise MemoryError.
BOUNDED_IMPORT = """
import resource, sys, time
from chorus_core.bank import BankError, MaskBank
bank = MaskBank.open(sys.argv[1])
with open('/proc/self/statm') as fh:
    used = int(fh.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + 256 * 2 ** 20, resource.RLIM_INFINITY))
started = time.monotonic()
try:
    bank.import_file(sys.argv[2])
    print('imported')
except BankError as exc:
    print('refused:', exc)
except MemoryError:
    print('MemoryError')
print(time.monotonic() - started)
"""


def bounded_import(bank_path, tar_path) -> tuple[str, float]:
    done = subprocess.run([sys.executable, "-c", BOUNDED_IMPORT, str(bank_path), str(tar_path)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    lines = done.stdout.strip().split("\n")
    assert len(lines) == 2, done.stdout + done.stderr
    return lines[0], float(lines[1])


def test_a_sparse_member_is_refused_unread(source, tmp_path):
    """A 10 kB tar whose blob member is a 1 GiB sparse file (holes read back as zeros)."""
    rows, _ = source
    size = 2 ** 30
    path = tmp_path / "sparse.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        payload = json.dumps({"format": "chorus-bank-export-v1",
                              "rows": [big_row(rows[0], size=size)]}).encode()
        member = tarfile.TarInfo(f"blobs/{rows[0]['blob_sha256']}.safetensors")
        member.pax_headers = {"GNU.sparse.map": f"{size - 1},0", "GNU.sparse.size": str(size)}
        tar.addfile(member, io.BytesIO(b""))
        info = tarfile.TarInfo("entries.json")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    assert path.stat().st_size < 16_384
    MaskBank.open(tmp_path / "dst").close()
    outcome, seconds = bounded_import(tmp_path / "dst", path)
    assert outcome.startswith("refused:") and "is a sparse file (Chorus exports never hold one)" \
        in outcome and "Nothing was imported" in outcome, outcome
    assert seconds < 5


def test_a_huge_blob_with_a_wrong_header_is_refused_before_it_is_read(source, tmp_path):
    """1 GiB member (a hole on disk) whose header declares the toy layout, not its row's."""
    rows, _ = source
    size = 2 ** 30
    name = f"blobs/{rows[0]['blob_sha256']}.safetensors"
    path = tar_with_huge_member(tmp_path / "big.tar", [big_row(rows[0], size=size)], name,
                                big_header(4, shape=(3, 2, 2, 8, 8)), size)
    MaskBank.open(tmp_path / "dst").close()
    outcome, seconds = bounded_import(tmp_path / "dst", path)
    assert outcome.startswith("refused:") and "blob declares mask shape '3,2,2,8,8', its row's " \
        "model, layout and schedule say '3,40,40,2560,2560'" in outcome, outcome
    assert seconds < 5


def test_a_huge_blob_with_a_wrong_digest_is_refused_in_bounded_memory(source, tmp_path):
    """480 MiB member with a header that fits its row's layout: the digest is streamed."""
    rows, _ = source
    part = 4 * 2 ** 20
    head = big_header(part)
    size = len(head) + 120 * part
    name = f"blobs/{rows[0]['blob_sha256']}.safetensors"
    path = tar_with_huge_member(tmp_path / "big.tar", [big_row(rows[0], size=size)], name,
                                head, size)
    MaskBank.open(tmp_path / "dst").close()
    outcome, seconds = bounded_import(tmp_path / "dst", path)
    assert outcome.startswith("refused:") and f"the blob of entry {rows[0]['id']} fails its " \
        "sha256" in outcome, outcome


def test_a_part_larger_than_its_layout_needs_is_refused(bank, source, tmp_path):
    """A toy-layout blob whose p part is 100 kB: one 2 x 8 x 8 layer set packs into 16 bytes."""
    rows, _ = source
    head = big_header(100_000, shape=(3, 2, 2, 8, 8))
    blob = head + bytes(6 * 100_000)
    row = dict(rows[0], blob_sha256=hashlib.sha256(blob).hexdigest(), blob_bytes=len(blob))
    with pytest.raises(BankError, match=r"tensor b0\.l0\.p declares 100000 bytes; that part of "
                                        r"one layer set needs at most 29 for this layout"):
        bank.import_file(write_tar(tmp_path / "fat.tar", [row],
                                   [(f"blobs/{row['blob_sha256']}.safetensors", blob)]))
    assert bank.stats()["entries"] == 0


# ---- item 14: deeply nested or huge-number JSON is a clean BankError --------------------
DEEP = "[" * 100_000  # deeper than any JSON parser's recursion limit
LONG_INT = "9" * 5000  # more digits than Python converts to an int (4300)


def rows_doc(rows) -> bytes:
    return json.dumps({"format": "chorus-bank-export-v1", "rows": rows}).encode()


def hostile_json_cases(rows):
    """(entries.json bytes, what the refusal must say) for each hostile document."""
    row = rows[0]
    return [
        (DEEP.encode(), r"entries\.json is not valid JSON \(nested more than"),
        (rows_doc([]).replace(b'"rows": []', b'"rows": [' + LONG_INT.encode() + b"]"),
         r"entries\.json is not valid JSON \(holds a number of more than"),
        (rows_doc([dict(row, fingerprint=DEEP)]), r"row 0 .*fingerprint is not valid JSON \(nested"),
        (rows_doc([dict(row, fingerprint=json.dumps(dict(BIG_FP, dim=0)).replace(
            '"dim": 0', f'"dim": {LONG_INT}'))]), r"row 0 .*fingerprint is not valid JSON \(holds a number"),
        (rows_doc([dict(row, tags=DEEP)]), r"row 0 .*tags is not valid JSON \(nested"),
        (rows_doc([dict(row, step_buckets=DEEP)]), r"row 0 .*step buckets unreadable"),
        (rows_doc([dict(row, created=10 ** 4000)]), r"row 0 .*created must be a finite number"),
        (rows_doc([dict(row, density=-10 ** 4000)]), r"row 0 .*density must be a finite number"),
    ]


def test_hostile_json_in_an_export_is_a_bank_error(bank, source, tmp_path):
    rows, members = source
    for i, (doc, message) in enumerate(hostile_json_cases(rows)):
        path = write_tar(tmp_path / f"j{i}.tar", members=members.items(), doc=doc)
        with pytest.raises(BankError, match=message) as caught:
            bank.import_file(path)
        assert "Nothing was imported. Export it again" in str(caught.value)
    assert bank.stats()["entries"] == 0


def test_hostile_json_in_an_export_is_a_clean_cli_error(source, tmp_path):
    rows, members = source
    MaskBank.open(tmp_path / "dst").close()
    for i, (doc, message) in enumerate(hostile_json_cases(rows)[:3]):
        path = write_tar(tmp_path / f"j{i}.tar", members=members.items(), doc=doc)
        done = subprocess.run([sys.executable, "-m", "chorus_core.bank", "import",
                               str(tmp_path / "dst"), str(path)],
                              capture_output=True, text=True, cwd=REPO, timeout=60)
        assert done.returncode == 2 and "Chorus bug" not in done.stderr, done.stderr
        assert done.stderr.startswith("error: ") and "Export it again" in done.stderr
        assert len(done.stderr) < 2000  # the message, not a dump of the document


def test_a_stored_row_with_deep_json_is_quarantined_not_fatal(tmp_path):
    """The same parsers read a bank's own rows: a hand-edited one is damage, not a crash."""
    with MaskBank.open(tmp_path / "bank") as bank:
        entry = add_toy(bank, seed=0)
        bank.db.execute("UPDATE entries SET fingerprint = ?, tags = ? WHERE id = ?",
                        [DEEP, DEEP, entry])
        assert bank.show(entry)["tags"] == DEEP  # listed as stored
        with pytest.warns(UserWarning, match="quarantining"), pytest.raises(
                BankEntryCorrupt, match="fingerprint is not valid JSON"):
            bank.load_masks(entry)
