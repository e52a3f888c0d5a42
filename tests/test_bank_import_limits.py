"""The mask bank against hostile signatures and export files (issue 26, items 2, 3 and 14).

* A signature that is not a unit vector (a real one scaled by 1000) must not take over
  matching: import refuses it, ``add_entry`` normalises it, and a row already stored with one
  (an old or hand-edited bank) scores a similarity within [-1, 1], on both backends.
* A small export must not make import read or hold gigabytes: sparse or truncated members are
  refused, a blob's header is checked before the rest is read, its digest is streamed.
* Deeply nested or huge-number JSON in an export is a clean BankError, in the API and the CLI.
"""

import base64
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from bank_fixtures import FP, LAYOUT, add_toy, toy_signature
from bank_pg_cluster import running_cluster

from chorus_core.bank import BankError, MaskBank, Signature
from chorus_core.bank.errors import BankInvalidArgument
from chorus_core.bank.signature import COMPONENTS, DIM

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pg():
    yield from running_cluster()


@pytest.fixture(params=["folder", "postgres"])
def location(request, tmp_path):
    """Where a fresh bank lives: a folder, or a new schema of the test server."""
    if request.param == "folder":
        return str(tmp_path / "bank")
    cluster = request.getfixturevalue("pg")
    return cluster.url(cluster.fresh_schema())


@pytest.fixture
def bank(location):
    with MaskBank.open(location) as opened:
        yield opened


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
