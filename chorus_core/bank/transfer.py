"""Export and import a set of entries between banks as one tar file (rows JSON + blobs).

Works on any backend through its public interface (``entries``, ``read_entry_blob``,
``check_writable``, ``stage_blob``, ``add_imported_rows``); it imports no backend, so the
storage base class can offer ``export`` and ``import_file`` on top of it without a circle.

An export file is untrusted input. Import never extracts anything: it reads two kinds of
member by exact name (``entries.json`` and ``blobs/<sha256>.safetensors`` for digests the
rows declare), only regular, non-sparse members (so a file never costs more reading than its
own size), each size-checked before it is read. Every row is rebuilt from a whitelist of
columns (its compatibility key recomputed, hits reset), every blob is checked (its header
against the row's layout first, then its digest streamed in bounded memory, then every layer
set decoded, no empty query row), and all rows go in one transaction: a bad file adds nothing.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import json
import os
import stat
import tarfile
import time
import uuid
from pathlib import Path

from safetensors.numpy import load as st_load

from . import validation
from .encoding import CODECS, decode_block_map
from .errors import BankError, BankInvalidArgument
from .faults import fault
from .rows import compat_key, schedule_columns

FORMAT = "chorus-bank-export-v1"
ROWS_NAME = "entries.json"
MAX_ROWS_BYTES = 512 * 2 ** 20  # entries.json of ~100,000 entries
MAX_MEMBERS = 1_000_000
CHUNK = 1 << 20  # bytes per read while a blob's digest is streamed
EXPORT_COLUMNS = (
    "id", "created", "fingerprint", "grid_t", "grid_h", "grid_w", "token_order",
    "block_q", "block_k", "steps", "sampler", "scheduler", "shift", "step_buckets",
    "sigmas", "density", "recall", "tags", "codec", "blob_sha256", "blob_bytes",
    *validation.SIGNATURE_COLUMNS,
)


def _row_to_json(row: dict) -> dict:
    # .get: a bank read at an older schema version has no sigmas column (exported as null)
    return {k: (base64.b64encode(row[k]).decode() if isinstance(row.get(k), bytes) else row.get(k))
            for k in EXPORT_COLUMNS}


# ---- export -----------------------------------------------------------------------------
def export_entries(bank, out_path, tag: str | None = None, ids=None) -> int:
    """Write the chosen healthy entries (all, by ``tag`` or by ``ids``) and their blobs to a
    tar. The file appears complete or not at all (written aside, then renamed). An entry
    whose blob fails its checks is left out and quarantined (read-only: reported).

    :return: number of entries written
    """
    out = Path(out_path).expanduser()
    _check_export_target(out)
    wanted = [r["id"] for r in bank.entries(tag=tag) if r["status"] == "ok"]
    if ids is not None:
        chosen = set(ids)
        for entry_id in chosen:
            if not validation.is_entry_id(entry_id):
                raise BankInvalidArgument(f"{str(entry_id)[:80]!r} is not an entry id (32 hex "
                                          "digits); list them with `python -m chorus_core.bank list PATH`.")
        wanted = [i for i in wanted if i in chosen]
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex}"
    try:
        # a new file of our own: never opened through a link someone placed under that name
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as fh:
            count = _write_tar(bank, fh, wanted)
        os.replace(tmp, out)  # replaces a link at ``out`` itself, never its target
    except OSError as exc:
        raise BankError(f"Cannot write the export file {out} ({exc.strerror or exc}); check the "
                        "folder's permissions and free space.") from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return count


def _check_export_target(out: Path) -> None:
    if not out.parent.is_dir():
        raise BankError(f"Cannot export to {out}: the folder {out.parent} does not exist. "
                        "Create it first, or pick a file in an existing folder.")
    if os.path.lexists(out) and not stat.S_ISREG(os.lstat(out).st_mode):
        raise BankError(f"Cannot export to {out}: it exists and is not a regular file. "
                        "Pick a file name (e.g. pan.tar).")


def _write_tar(bank, fh, wanted: list[str]) -> int:
    rows, written = [], set()
    with tarfile.open(fileobj=fh, mode="w") as tar:
        for entry_id in wanted:
            found = bank.read_entry_blob(entry_id)
            if found is None:  # damaged: quarantined (read-only: skipped) by the bank
                continue
            row, data = found
            row = _with_codec(row, data)
            if row["blob_sha256"] not in written:
                _add_member(tar, f"blobs/{validation.blob_name(row['blob_sha256'])}", data)
                written.add(row["blob_sha256"])
            rows.append(_row_to_json(row))
        payload = json.dumps({"format": FORMAT, "rows": rows}).encode()
        _add_member(tar, ROWS_NAME, payload)
    return len(rows)


def _with_codec(row: dict, data: bytes) -> dict:
    """The row as a current bank would export it: an entry of a bank migrated from schema 1 has no
    codec in its row (import refuses that), so it is read from its blob, checked a moment ago."""
    if row.get("codec") is not None:
        return row
    meta = validation.check_header(validation.read_header(data), validation.entry_spec(row).shape)
    return {**row, "codec": meta["codec"]}


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
    tar.addfile(info, io.BytesIO(data))


# ---- import -----------------------------------------------------------------------------
class _ExportFile:
    """Read-only view of an export tar: regular members by exact name, bounded reads."""

    def __init__(self, path: Path):
        self.path = path
        try:
            info = os.stat(path)
        except OSError as exc:
            raise BankError(f"Cannot read export file {path} ({exc.strerror}); check the "
                            "path.") from exc
        if not stat.S_ISREG(info.st_mode):
            raise BankError(f"Export file {path} is a {_kind(info.st_mode)}, not a file; "
                            "pass a tar made by `python -m chorus_core.bank export BANK FILE`.")
        try:
            self.tar = tarfile.open(path, "r:")  # plain tar only: no decompression work
        except (OSError, EOFError, tarfile.TarError) as exc:
            raise self._bad(f"not an uncompressed tar ({exc})") from exc
        try:
            self.members = self._index()
        except (OSError, EOFError, tarfile.TarError) as exc:
            self.tar.close()
            raise self._bad(f"not an uncompressed tar ({exc})") from exc
        except BaseException:
            self.tar.close()
            raise

    def _index(self) -> dict:
        members = {}
        for count, info in enumerate(self.tar, start=1):
            if count > MAX_MEMBERS:
                raise self._bad(f"more than {MAX_MEMBERS} members")
            if info.name in members:
                raise self._bad(f"two members are named {info.name[:100]!r}")
            members[info.name] = info
        self.tar.members = []  # the index above is all we keep
        return members

    def _bad(self, why: str) -> BankError:
        return BankError(f"{self.path} is not a valid Chorus bank export: {why}. Nothing was "
                         "imported. Export it again with `python -m chorus_core.bank export BANK FILE`.")

    def open(self, name: str, size: int | None, limit: int):
        """A binary file over regular member ``name``, after checking its tar header: not a
        link, special or sparse member, no larger than ``limit``, ``size`` bytes when given.
        (Its bytes lie inside the file: ``tarfile`` refuses a file cut short while indexing.)"""
        info = self.members.get(name)
        if info is None:
            raise self._bad(f"member {name} is missing")
        if not info.isreg():
            raise self._bad(f"member {name} is a link or special file, not a regular file")
        if info.issparse():  # its holes would read as zeros: a 10 kB file could yield GBs
            raise self._bad(f"member {name} is a sparse file (Chorus exports never hold one)")
        if info.size > limit or (size is not None and info.size != size):
            raise self._bad(f"member {name} declares {info.size} bytes, expected "
                            f"{size if size is not None else f'at most {limit}'}")
        try:
            return self.tar.extractfile(info)
        except (OSError, EOFError, tarfile.TarError) as exc:
            raise self._bad(f"member {name} is unreadable ({exc})") from exc

    def read(self, name: str, size: int | None, limit: int) -> bytes:
        """Bytes of regular member ``name`` (checked as :meth:`open` does)."""
        with self.open(name, size, limit) as fh:
            data = self._read(fh, name, self.members[name].size)
        if len(data) != self.members[name].size:
            raise self._bad(f"member {name} is truncated ({len(data)} of "
                            f"{self.members[name].size} bytes)")
        return data

    def _read(self, fh, name: str, count: int) -> bytes:
        try:
            return fh.read(count)
        except (OSError, EOFError, tarfile.TarError) as exc:
            raise self._bad(f"member {name} is unreadable ({exc})") from exc

    def precheck_blob(self, name: str, size: int, sha: str, spec: validation.EntrySpec) -> None:
        """Header against the row's layout, then the digest, in bounded memory: a blob that
        fails either is refused before it is held whole (:func:`check_blob` then decodes).

        :raises ValueError: why the blob is unfit (the caller names the entry)
        """
        with self.open(name, size, spec.max_blob_bytes) as fh:
            head = self._read(fh, name, 8)
            head += self._read(fh, name, validation.header_length(head, size))
            header = validation.read_header(head, size)
            meta = validation.check_header(header, spec.shape)
            validation.check_part_sizes(header, spec.shape, meta)
            digest, seen = hashlib.sha256(head), len(head)
            while seen < size:
                chunk = self._read(fh, name, min(CHUNK, size - seen))
                if not chunk:
                    raise self._bad(f"member {name} is truncated ({seen} of {size} bytes)")
                digest.update(chunk)
                seen += len(chunk)
        if digest.hexdigest() != sha:
            raise ValueError("fails its sha256")

    def close(self) -> None:
        self.tar.close()


def _kind(mode: int) -> str:
    return "directory" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode) else "special file"


def _signature(value, key) -> bytes | None:
    if value is None:
        return None
    try:
        raw = base64.b64decode(value, validate=True) if isinstance(value, str) else None
    except (binascii.Error, ValueError):
        raw = None
    if raw is None:
        raise ValueError(f"{key} is not base64 text")
    return validation.signature_bytes(raw, key)


def rebuild_row(raw) -> tuple[dict, validation.EntrySpec]:
    """A row fit for insertion, built only from checked whitelisted values of ``raw``."""
    if not isinstance(raw, dict):
        raise ValueError("row is not a JSON object")
    if not validation.is_entry_id(raw.get("id")):
        raise ValueError(f"id {str(raw.get('id'))[:80]!r} is not 32 lowercase hex digits")
    spec = validation.entry_spec(raw)
    sha = raw.get("blob_sha256")
    if not validation.is_sha256(sha):
        raise ValueError(f"blob_sha256 {str(sha)[:80]!r} is not 64 lowercase hex digits")
    size = raw.get("blob_bytes")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= spec.max_blob_bytes:
        raise ValueError(f"blob_bytes {str(size)[:40]!r} is not within 1..{spec.max_blob_bytes} "
                         "(the most its layout allows)")
    if raw.get("codec") not in CODECS:  # the blob's own header is checked against its codec later
        raise ValueError(f"codec {str(raw.get('codec'))[:40]!r} is not one of {', '.join(CODECS)}")
    created = validation.finite(raw.get("created", time.time()), "created", 0.0)
    layout, schedule = spec.layout, spec.schedule
    row = {
        "id": raw["id"], "created": min(created, time.time()), "last_hit": None, "hits": 0,
        "compat": compat_key(spec.fingerprint, layout), "fingerprint": spec.fingerprint.key(),
        "grid_t": layout.grid[0], "grid_h": layout.grid[1], "grid_w": layout.grid[2],
        "token_order": layout.token_order,
        "block_q": layout.block_size[0], "block_k": layout.block_size[1],
        **schedule_columns(schedule),
        "density": validation.finite(raw.get("density"), "density", 0.0, 1.0),
        "recall": validation.finite(raw.get("recall"), "recall", 0.0, 1.0, optional=True),
        "tags": validation.tags_json(raw.get("tags")), "status": "ok", "status_reason": None,
        "codec": raw["codec"], "blob_name": validation.blob_name(sha), "blob_bytes": size,
        "blob_sha256": sha,
        **{k: _signature(raw.get(k), k) for k in validation.SIGNATURE_COLUMNS},
    }
    return row, spec


def check_blob(data: bytes, sha: str, spec: validation.EntrySpec) -> None:
    """Digest, header and every decoded layer set of a blob, against its row's records."""
    if hashlib.sha256(data).hexdigest() != sha:
        raise ValueError("fails its sha256")
    meta = validation.check_header(validation.read_header(data), spec.shape)
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors' own error types
        raise ValueError(f"is not a readable safetensors file ({exc})") from None
    s_count, layers = spec.shape[:2]
    for bucket in range(s_count):
        for layer in range(layers):
            try:
                maps = decode_block_map(tensors, meta, bucket, layer)
            except Exception as exc:  # bounded decode's ValueError, zlib.error, IndexError
                raise ValueError(f"bucket {bucket} layer {layer} does not decode "
                                 f"({type(exc).__name__}: {exc})") from None
            try:
                validation.check_block_map(maps, spec.shape[2:])
            except ValueError as exc:
                raise ValueError(f"bucket {bucket} layer {layer}: {exc}") from None


def _load_rows(export: _ExportFile) -> list[tuple[dict, validation.EntrySpec]]:
    try:
        doc = validation.load_json(export.read(ROWS_NAME, None, MAX_ROWS_BYTES), ROWS_NAME)
    except ValueError as exc:
        raise export._bad(str(exc)) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise export._bad(f"format is {str(found)[:60]!r}, not {FORMAT!r}")
    if not isinstance(doc.get("rows"), list):
        raise export._bad(f"{ROWS_NAME} has no list of rows")
    rows, seen = [], set()
    for i, raw in enumerate(doc["rows"]):
        try:
            row, spec = rebuild_row(raw)
        except ValueError as exc:
            label = raw.get("id") if isinstance(raw, dict) else None
            raise export._bad(f"row {i} ({str(label)[:80]!r}): {exc}") from None
        if row["id"] in seen:
            raise export._bad(f"entry {row['id']} appears twice")
        seen.add(row["id"])
        rows.append((row, spec))
    return rows


def import_entries(bank, in_path) -> dict:
    """Add the entries of an export file that the bank lacks, in one transaction.

    :return: ``{"added": n, "skipped": n}`` (skipped: id already present)
    :raises BankError: the file is not a valid export, or any row or blob in it fails its
        checks (then nothing is added)
    """
    bank.check_writable()
    export = _ExportFile(Path(in_path).expanduser())
    try:
        rows = _load_rows(export)
        sizes = {}
        for row, spec in rows:  # check every blob before anything is written (no orphans on refusal)
            sha = row["blob_sha256"]
            if sizes.setdefault(sha, row["blob_bytes"]) != row["blob_bytes"]:
                raise export._bad(f"rows give blob {sha} two different sizes")
            name = f"blobs/{row['blob_name']}"
            try:
                export.precheck_blob(name, row["blob_bytes"], sha, spec)
                check_blob(export.read(name, row["blob_bytes"], spec.max_blob_bytes), sha, spec)
            except ValueError as exc:
                raise export._bad(f"the blob of entry {row['id']} {exc}") from None
        for row, spec in rows:  # read again rather than hold every blob in memory at once
            # a folder writes it now (content-addressed: harmless)
            bank.stage_blob(_read_again(export, row), row["blob_sha256"])
        fault("import-blobs-staged")
        return _insert_rows(bank, export, rows)
    finally:
        export.close()


def _read_again(export: _ExportFile, row: dict) -> bytes:
    """A blob checked earlier, read again: refused when the file changed under us since."""
    data = export.read(f"blobs/{row['blob_name']}", row["blob_bytes"], row["blob_bytes"])
    if hashlib.sha256(data).hexdigest() != row["blob_sha256"]:
        raise export._bad(f"the blob of entry {row['id']} changed while it was imported")
    return data


def _insert_rows(bank, export: _ExportFile, rows) -> dict:
    # the backend stores row and blob (PostgreSQL: always; a folder: a blob removed
    # meanwhile), each read again and digest-checked, as the file may have changed
    return bank.add_imported_rows([row for row, _ in rows],
                                  lambda row: _read_again(export, row))
