"""The mask bank: one SQLite index (WAL, sqlite-utils) plus content-addressed safetensors blobs.

Layout of a bank folder::

    <bank>/bank.sqlite          index rows (schema in schema.py)
    <bank>/blobs/ab/abcd....safetensors   encoded masks, named by their sha256
    <bank>/quarantine/          blobs that failed verification

Safety rules: a blob is written to a temporary file, fsynced and renamed before its row is
committed, so a row never points at a partial blob; rows are written in ``BEGIN IMMEDIATE``
transactions with a busy timeout, so several processes can share a bank.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
import sqlite_utils
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from . import schema
from .encoding import CODEC, decode_block_map, encode_masks
from .errors import BankEntryCorrupt, BankError, BankIncompatible, BankReadOnly
from .fingerprint import ModelFingerprint
from .matching import MatchResult, SignatureIndex
from .records import LatentLayout, Schedule
from .signature import COMPONENTS, Signature

DB_NAME = "bank.sqlite"
BUSY_TIMEOUT_S = 60.0
STALE_TEMP_S = 3600.0  # temp/orphan blobs younger than this may belong to a live writer


def compat_key(fingerprint: ModelFingerprint, layout: LatentLayout) -> str:
    """What two entries must share to be interchangeable: model, grid, token order, blocks."""
    text = json.dumps([fingerprint.key(), layout.to_dict()], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class EntryMasks:
    """Decoded-on-demand masks of one entry.

    :param entry_id: the entry
    :param schedule: the schedule the masks were recorded under
    :param layout: the latent layout
    """

    def __init__(self, entry_id: str, schedule: Schedule, layout: LatentLayout,
                 tensors: dict, meta: dict):
        self.entry_id, self.schedule, self.layout = entry_id, schedule, layout
        self._tensors, self._meta = tensors, meta
        self.shape = tuple(int(x) for x in meta["shape"].split(","))  # (S, L, H, nq, nk)

    @property
    def step_buckets(self) -> list[tuple[int, int]]:
        return self.schedule.step_buckets

    def block_map(self, bucket_index: int, layer: int):
        """Bool torch tensor ``[H, nq, nk]`` for one step bucket and layer (about 15 ms CPU).

        :param bucket_index: index into :attr:`step_buckets`
        :param layer: transformer block index
        """
        import torch

        return torch.from_numpy(decode_block_map(self._tensors, self._meta, bucket_index, layer))


class MaskBank:
    """A folder of recorded block-sparse attention masks, indexed by request signature."""

    def __init__(self, root: Path, db: sqlite_utils.Database, read_only: bool):
        self.root, self.db, self.read_only = root, db, read_only
        self.blobs = root / "blobs"
        self.quarantine_dir = root / "quarantine"
        self._index = SignatureIndex()

    # ---- opening -------------------------------------------------------------------------
    @classmethod
    def open(cls, path, read_only: bool = False, create: bool = True) -> "MaskBank":
        """Open (and by default create) the bank in folder ``path``.

        :param path: folder holding ``bank.sqlite`` and ``blobs/``
        :param read_only: open without ever writing (no hit counts either)
        :param create: create the folder and database when missing
        :raises BankError: when the bank is missing, unreadable or from a newer Chorus
        :raises BankReadOnly: when a writable bank was asked for on a read-only location
        """
        root = Path(path).expanduser()
        db_path = root / DB_NAME
        if not db_path.exists() and (read_only or not create):
            raise BankError(f"No mask bank at {root}. Create one with "
                            f"`python -m chorus_core.bank init {root}` or open with create=True.")
        if read_only:
            conn = cls._connect(f"file:{db_path}?mode=ro", root, uri=True)
        else:
            cls._make_dirs(root)
            conn = cls._connect(str(db_path), root)
        bank = cls(root, sqlite_utils.Database(conn), read_only)
        bank._prepare()
        return bank

    @staticmethod
    def _make_dirs(root: Path) -> None:
        try:
            for sub in ("blobs", "quarantine"):
                (root / sub).mkdir(parents=True, exist_ok=True)
            probe = root / f".write-probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise BankReadOnly(
                f"Cannot write the mask bank folder {root} ({exc.strerror or exc}). Choose a "
                "writable folder, or open it with read_only=True to match against it only."
            ) from exc

    @staticmethod
    def _connect(target: str, root: Path, uri: bool = False) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(target, timeout=BUSY_TIMEOUT_S, uri=uri,
                                   isolation_level=None, check_same_thread=False)
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            return conn
        except sqlite3.Error as exc:
            raise BankError(f"Cannot open the mask bank database in {root} ({exc}). "
                            "Check the path and its permissions.") from exc

    def _prepare(self) -> None:
        try:
            if self.read_only:
                found = schema.schema_version(self.db)
                if found != schema.SCHEMA_VERSION:
                    raise BankError(
                        f"The bank at {self.root} has schema version {found}, this Chorus reads "
                        f"{schema.SCHEMA_VERSION}; open it once without read_only to migrate it.")
                return
            self.db.execute("PRAGMA journal_mode = WAL")
            self.db.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL is durable at commit
            with self._write(bump=False):
                found = schema.schema_version(self.db)
                if found > schema.SCHEMA_VERSION:
                    raise BankError(
                        f"The bank at {self.root} has schema version {found}, newer than this "
                        f"Chorus ({schema.SCHEMA_VERSION}); upgrade Chorus to use it.")
                schema.migrate(self.db)
        except sqlite3.DatabaseError as exc:
            raise BankError(f"The mask bank database in {self.root} cannot be used ({exc}). "
                            "Move it away and create a new bank, or restore a backup.") from exc

    def close(self) -> None:
        """Close the database connection."""
        self.db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- transactions and counters -------------------------------------------------------
    @contextlib.contextmanager
    def _write(self, bump: bool = True, removal: bool = False):
        """One ``BEGIN IMMEDIATE`` transaction; bumps the generation counter when asked."""
        if self.read_only:
            raise BankReadOnly(f"The bank at {self.root} was opened read-only; "
                               "open it with read_only=False to change it.")
        conn = self.db.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise BankReadOnly(f"Cannot write the bank at {self.root} ({exc}); check that the "
                               "folder is writable, or open with read_only=True.") from exc
        try:
            yield
            if bump:
                self._bump("generation")
            if removal:
                self._bump("removals")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _bump(self, key: str) -> None:
        self.db.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = ?", [key])

    def _meta(self, key: str) -> str:
        return self.db.execute("SELECT value FROM meta WHERE key = ?", [key]).fetchone()[0]

    def content_token(self) -> str:
        """A string that changes whenever entries are added, removed or quarantined."""
        return f"{self._meta('bank_id')}:{self._meta('generation')}"

    # ---- blobs ---------------------------------------------------------------------------
    def blob_path(self, name: str) -> Path:
        return self.blobs / name[:2] / name

    def _write_blob(self, data: bytes, sha: str) -> str:
        """Write ``data`` to its content address via temp file + fsync + rename."""
        name = f"{sha}.safetensors"
        final = self.blob_path(name)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.blobs / f".tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        return name

    def _read_blob(self, row: dict) -> bytes:
        """Blob bytes of ``row``, or raise BankEntryCorrupt after quarantining the entry."""
        reason = self._blob_problem(row)
        if reason is None:
            return self.blob_path(row["blob_name"]).read_bytes()
        self.quarantine(row["id"], reason)
        raise BankEntryCorrupt(row["id"], reason)

    def _blob_problem(self, row: dict) -> str | None:
        path = self.blob_path(row["blob_name"])
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return "blob missing"
        if len(data) != row["blob_bytes"]:
            return f"blob truncated or resized ({len(data)} of {row['blob_bytes']} bytes)"
        if hashlib.sha256(data).hexdigest() != row["blob_sha256"]:
            return "blob sha256 mismatch"
        return None

    # ---- adding --------------------------------------------------------------------------
    def add_entry(self, fingerprint: ModelFingerprint, layout: LatentLayout, schedule: Schedule,
                  masks, signature: Signature, density: float, recall: float | None = None,
                  tags=(), coarsen: int = 1) -> str:
        """Store recorded masks and return the new entry's id.

        :param fingerprint: model the masks were recorded on (:func:`fingerprint_model`)
        :param layout: latent layout (grid, token order, block size)
        :param schedule: sampling schedule; one mask set per step bucket
        :param masks: bool ``[S, L, H, nq, nk]`` torch tensor or numpy array
        :param signature: request signature (:func:`build_signature`)
        :param density: share of key blocks kept (0..1)
        :param recall: measured attention recall of the masks, if known
        :param tags: user tags, e.g. the effect template's name
        :param coarsen: store at ``coarsen`` x coarser blocks (OR-pooled; 1 = lossless)
        :raises BankIncompatible: when the masks' shape does not fit the other arguments
        """
        self._check_shape(masks, fingerprint, layout, schedule)
        tensors, meta = encode_masks(masks, coarsen=coarsen)
        data = st_save(tensors, metadata=_blob_metadata(meta))
        sha = hashlib.sha256(data).hexdigest()
        name = self._write_blob(data, sha)
        entry_id = uuid.uuid4().hex
        row = self._row(entry_id, fingerprint, layout, schedule, signature, density, recall,
                        tags, name, len(data), sha)
        with self._write():
            if not self.blob_path(name).exists():  # a concurrent prune removed a shared blob
                self._write_blob(data, sha)
            self.db["entries"].insert(row)
        return entry_id

    @staticmethod
    def _check_shape(masks, fingerprint, layout, schedule) -> None:
        want = (len(schedule.step_buckets), fingerprint.layers, fingerprint.heads, *layout.blocks)
        if tuple(masks.shape) != want:
            raise BankIncompatible(
                f"masks have shape {tuple(masks.shape)} but the fingerprint, layout and schedule "
                f"ask for {want} (buckets, layers, heads, query blocks, key blocks); record one "
                "block map per step bucket, layer and head.")

    @staticmethod
    def _row(entry_id, fingerprint, layout, schedule, signature, density, recall, tags,
             name, size, sha) -> dict:
        now = time.time()
        sigs = {f"sig_{c}": (signature.components[c].astype(np.float32).tobytes()
                             if c in signature.components else None) for c in COMPONENTS}
        return {
            "id": entry_id, "created": now, "last_hit": None, "hits": 0,
            "compat": compat_key(fingerprint, layout), "fingerprint": fingerprint.key(),
            "grid_t": layout.grid[0], "grid_h": layout.grid[1], "grid_w": layout.grid[2],
            "token_order": layout.token_order,
            "block_q": layout.block_size[0], "block_k": layout.block_size[1],
            "steps": schedule.steps, "sampler": schedule.sampler,
            "scheduler": schedule.scheduler, "shift": schedule.shift,
            "step_buckets": json.dumps(schedule.step_buckets),
            "density": float(density), "recall": None if recall is None else float(recall),
            "tags": json.dumps(sorted(set(tags))), "status": "ok", "status_reason": None,
            "codec": CODEC, "blob_name": name, "blob_bytes": size, "blob_sha256": sha, **sigs,
        }

    # ---- matching and loading ------------------------------------------------------------
    def match(self, signature: Signature, fingerprint: ModelFingerprint, layout: LatentLayout,
              threshold: float = 0.9, top_k: int = 1, weights=None) -> MatchResult:
        """Most similar compatible entry; a hit when its similarity >= ``threshold``.

        :param signature: the request's signature
        :param fingerprint: the model about to run
        :param layout: the request's latent layout
        :param threshold: least weighted cosine similarity for a hit
        :param top_k: how many best entries to list in ``MatchResult.top``
        :param weights: per-component weights, e.g. ``{"clip": 0.5, "text": 0.3, "layout": 0.2}``
        """
        self._index.refresh(self.db, int(self._meta("generation")), int(self._meta("removals")))
        return self._index.match(self.db, compat_key(fingerprint, layout), signature,
                                 threshold, max(1, top_k), weights)

    def _get_row(self, entry_id: str) -> dict:
        rows = list(self.db.query("SELECT * FROM entries WHERE id = ?", [entry_id]))
        if not rows:
            raise BankError(f"No entry {entry_id} in the bank at {self.root}; "
                            "list entries with `python -m chorus_core.bank list PATH`.")
        return rows[0]

    def compatible_entries(self, fingerprint: ModelFingerprint, layout: LatentLayout, limit: int = 8) -> list[str]:
        """Ids of healthy entries interchangeable with this model and layout, most recently used first.

        :param limit: at most this many ids
        """
        rows = self.db.query("SELECT id FROM entries WHERE compat = ? AND status = 'ok' "
                             "ORDER BY COALESCE(last_hit, created) DESC LIMIT ?",
                             [compat_key(fingerprint, layout), int(limit)])
        return [row["id"] for row in rows]

    def load_masks(self, entry_id: str, record_hit: bool = True) -> EntryMasks:
        """Load an entry's masks and, unless ``record_hit`` is False, record a hit.

        :param entry_id: an id from :meth:`match` or :meth:`add_entry`
        :param record_hit: count this load as a hit (a population prior's reads are not hits)
        :raises BankEntryCorrupt: blob missing or damaged (the entry is quarantined first)
        :raises BankError: no such entry, or it is quarantined
        """
        row = self._get_row(entry_id)
        if row["status"] != "ok":
            raise BankError(f"Entry {entry_id} is quarantined ({row['status_reason']}); "
                            "run dense for this request and record it again.")
        data = self._read_blob(row)
        try:
            tensors = st_load(data)
            meta = _safetensors_metadata(data)
        except Exception as exc:  # safetensors raises its own error types
            self.quarantine(entry_id, f"blob unreadable: {exc}")
            raise BankEntryCorrupt(entry_id, f"blob unreadable: {exc}") from exc
        if record_hit and not self.read_only:
            with self._write(bump=False):  # hits do not change content: no new cache key
                self.db.execute("UPDATE entries SET hits = hits + 1, last_hit = ? WHERE id = ?",
                                [time.time(), entry_id])
        return EntryMasks(entry_id, _schedule(row), _layout(row), tensors, meta)

    # ---- maintenance ---------------------------------------------------------------------
    def quarantine(self, entry_id: str, reason: str) -> None:
        """Move an entry's blob to ``quarantine/`` and mark every row that uses it."""
        row = self._get_row(entry_id)
        warnings.warn(f"Chorus mask bank: quarantining entry {entry_id}: {reason}. "
                      "Requests that matched it fall back to dense attention.", stacklevel=3)
        if self.read_only:
            return
        with self._write(removal=True):
            self.db.execute("UPDATE entries SET status = 'quarantined', status_reason = ? "
                            "WHERE blob_name = ?", [reason, row["blob_name"]])
            src = self.blob_path(row["blob_name"])
            if src.exists():
                os.replace(src, self.quarantine_dir / f"{entry_id}-{row['blob_name']}")

    def verify(self) -> dict:
        """Recompute every blob digest; quarantine failures; drop stale temp and orphan blobs.

        :return: ``{"checked", "ok", "quarantined": [{"id", "reason"}], "orphans_removed"}``
        """
        report = {"checked": 0, "ok": 0, "quarantined": [], "orphans_removed": 0}
        for row in list(self.db.query("SELECT * FROM entries WHERE status = 'ok'")):
            report["checked"] += 1
            reason = self._blob_problem(row)
            if reason is None:
                report["ok"] += 1
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the report carries it
                self.quarantine(row["id"], reason)
            report["quarantined"].append({"id": row["id"], "reason": reason})
        if not self.read_only:
            report["orphans_removed"] = self._remove_orphans()
        return report

    def _remove_orphans(self) -> int:
        """Blobs no row names, left by writers killed before their commit (if old enough)."""
        known = {r["blob_name"] for r in self.db.query("SELECT blob_name FROM entries")}
        cutoff = time.time() - STALE_TEMP_S
        removed = 0
        for path in self.blobs.rglob("*"):
            orphan = path.name.startswith(".tmp-") or (path.suffix == ".safetensors"
                                                       and path.name not in known)
            if path.is_file() and orphan and path.stat().st_mtime < cutoff:
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def delete(self, entry_ids) -> int:
        """Delete entries and the blobs no other entry uses; returns how many rows went."""
        ids = list(entry_ids)
        if not ids:
            return 0
        with self._write(removal=True):
            marks = ",".join("?" * len(ids))
            names = [r["blob_name"] for r in self.db.query(
                f"SELECT DISTINCT blob_name FROM entries WHERE id IN ({marks})", ids)]
            count = self.db.execute(f"DELETE FROM entries WHERE id IN ({marks})", ids).rowcount
            for name in names:  # unlink under the write lock: add_entry re-checks its blob
                if not self.db.execute("SELECT 1 FROM entries WHERE blob_name = ?",
                                       [name]).fetchone():
                    self.blob_path(name).unlink(missing_ok=True)
        return count

    def eviction_order(self) -> list[dict]:
        """Rows in the order :meth:`prune` removes them: quarantined first, then least
        recently used (creation time counts as a use), fewer hits first on ties."""
        return list(self.db.query(
            "SELECT id, blob_bytes, hits, COALESCE(last_hit, created) AS last_use FROM entries "
            "ORDER BY status = 'ok', last_use, hits, created"))

    def prune(self, max_bytes: int | None = None, max_entries: int | None = None,
              dry_run: bool = False) -> list[str]:
        """Evict entries until the bank fits ``max_bytes`` and ``max_entries``.

        :param max_bytes: most blob bytes to keep (None: no limit)
        :param max_entries: most entries to keep (None: no limit)
        :param dry_run: only return what would be removed
        :return: ids removed (or to remove), in eviction order
        """
        rows = self.eviction_order()
        total, count = sum(r["blob_bytes"] for r in rows), len(rows)
        doomed = []
        for row in rows:
            over_bytes = max_bytes is not None and total > max_bytes
            over_count = max_entries is not None and count > max_entries
            if not (over_bytes or over_count):
                break
            doomed.append(row["id"])
            total, count = total - row["blob_bytes"], count - 1
        if not dry_run:
            self.delete(doomed)
        return doomed

    # ---- reading -------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counts and sizes: ``entries``, ``quarantined``, ``bytes``, ``hits``, ``schema_version``."""
        ok = self.db.execute("SELECT COUNT(*), COALESCE(SUM(blob_bytes), 0), "
                             "COALESCE(SUM(hits), 0) FROM entries WHERE status = 'ok'").fetchone()
        bad = self.db.execute("SELECT COUNT(*) FROM entries WHERE status != 'ok'").fetchone()[0]
        return {"path": str(self.root), "entries": ok[0], "bytes": ok[1], "hits": ok[2],
                "quarantined": bad, "schema_version": schema.schema_version(self.db),
                "content_token": self.content_token()}

    def entries(self, tag: str | None = None, limit: int | None = None,
                order: str = "created DESC") -> list[dict]:
        """Entry rows (without signature vectors), optionally only those carrying ``tag``."""
        sql = f"SELECT {_SUMMARY} FROM entries"
        params = []
        if tag is not None:
            sql += " WHERE EXISTS (SELECT 1 FROM json_each(entries.tags) WHERE value = ?)"
            params.append(tag)
        sql += f" ORDER BY {order}" + (f" LIMIT {int(limit)}" if limit else "")
        return [_decode_row(r) for r in self.db.query(sql, params)]

    def recent(self, n: int = 20) -> list[dict]:
        """The ``n`` most recently added entries, newest first."""
        return self.entries(limit=n)

    def show(self, entry_id: str) -> dict:
        """One entry as a dict, without signature vectors."""
        row = self._get_row(entry_id)
        return _decode_row({k: v for k, v in row.items() if not k.startswith("sig_")})


_SUMMARY = ("id, created, last_hit, hits, status, status_reason, tags, density, recall, "
            "steps, sampler, scheduler, shift, step_buckets, grid_t, grid_h, grid_w, "
            "token_order, block_q, block_k, fingerprint, compat, codec, blob_name, blob_bytes, "
            "blob_sha256")


def _decode_row(row: dict) -> dict:
    row = dict(row)
    for key in ("tags", "step_buckets", "fingerprint"):
        if isinstance(row.get(key), str):
            row[key] = json.loads(row[key])
    return row


def _schedule(row: dict) -> Schedule:
    return Schedule(steps=row["steps"], sampler=row["sampler"], scheduler=row["scheduler"],
                    shift=row["shift"], step_buckets=json.loads(row["step_buckets"]))


def _layout(row: dict) -> LatentLayout:
    return LatentLayout(grid=(row["grid_t"], row["grid_h"], row["grid_w"]),
                        token_order=row["token_order"], block_size=(row["block_q"], row["block_k"]))


def _blob_metadata(meta: dict) -> dict:
    """One JSON value: safetensors writes several metadata keys in random order, which would
    break content addressing (equal masks must give equal bytes)."""
    return {"chorus": json.dumps(meta, sort_keys=True)}


def _safetensors_metadata(data: bytes) -> dict:
    size = int.from_bytes(data[:8], "little")
    return json.loads(json.loads(data[8:8 + size])["__metadata__"]["chorus"])


def _export(self, out_path, tag=None, ids=None) -> int:
    """Write entries (all, one ``tag``'s, or ``ids``) and their blobs to one tar file.

    :param out_path: tar file to write
    :param tag: only entries carrying this tag
    :param ids: only these entry ids
    :return: number of entries exported
    """
    from .transfer import export_entries

    return export_entries(self, out_path, tag=tag, ids=ids)


def _import(self, in_path) -> dict:
    """Add the entries of an export file that this bank lacks.

    :param in_path: a tar written by :meth:`MaskBank.export`
    :return: ``{"added": n, "skipped": n}``
    """
    from .transfer import import_entries

    return import_entries(self, in_path)


MaskBank.export = _export
MaskBank.import_file = _import
