"""Export and import a set of entries between banks as one tar file (rows JSON + blobs)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
from pathlib import Path

from .errors import BankError

FORMAT = "chorus-bank-export-v1"
ROWS_NAME = "entries.json"


def _row_to_json(row: dict) -> dict:
    return {k: (base64.b64encode(v).decode() if isinstance(v, bytes) else v)
            for k, v in row.items() if k != "rowid"}


def _row_from_json(row: dict) -> dict:
    return {k: (base64.b64decode(v) if k.startswith("sig_") and v else v) for k, v in row.items()}


def export_entries(bank, out_path, tag: str | None = None, ids=None) -> int:
    """Write the chosen ok entries (all, by ``tag`` or by ``ids``) and their blobs to a tar.

    :return: number of entries written
    """
    wanted = [r["id"] for r in bank.entries(tag=tag) if r["status"] == "ok"]
    if ids is not None:
        wanted = [i for i in wanted if i in set(ids)]
    rows = [bank._get_row(i) for i in wanted]
    with tarfile.open(out_path, "w") as tar:
        for name in sorted({r["blob_name"] for r in rows}):
            tar.add(bank.blob_path(name), arcname=f"blobs/{name}")
        payload = json.dumps({"format": FORMAT, "rows": [_row_to_json(r) for r in rows]}).encode()
        info = tarfile.TarInfo(ROWS_NAME)
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    return len(rows)


def import_entries(bank, in_path) -> dict:
    """Add the entries of an export file that the bank lacks; blobs are checked first.

    :return: ``{"added": n, "skipped": n}`` (skipped: id already present)
    """
    path = Path(in_path)
    try:
        tar = tarfile.open(path, "r")
    except (OSError, tarfile.TarError) as exc:
        raise BankError(f"Cannot read export file {path} ({exc}); "
                        "make it with `python -m chorus_core.bank export BANK FILE`.") from exc
    with tar:
        doc = json.loads(tar.extractfile(ROWS_NAME).read())
        if doc.get("format") != FORMAT:
            raise BankError(f"{path} is not a Chorus bank export ({doc.get('format')!r}).")
        added = skipped = 0
        for row in map(_row_from_json, doc["rows"]):
            if bank.db.execute("SELECT 1 FROM entries WHERE id = ?", [row["id"]]).fetchone():
                skipped += 1
                continue
            data = tar.extractfile(f"blobs/{row['blob_name']}").read()
            if hashlib.sha256(data).hexdigest() != row["blob_sha256"]:
                raise BankError(f"Blob of entry {row['id']} in {path} fails its sha256; "
                                "export it again from a bank that verifies.")
            bank._write_blob(data, row["blob_sha256"])
            row.update(hits=0, last_hit=None)
            with bank._write():
                bank.db["entries"].insert(row)
            added += 1
    return {"added": added, "skipped": skipped}
