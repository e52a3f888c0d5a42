"""The mask bank: one SQLite index (WAL) plus content-addressed safetensors blobs.

Layout of a bank folder::

    <bank>/bank.sqlite          index rows (schema in schema.py)
    <bank>/blobs/ab/abcd....safetensors   encoded masks, named by their sha256
    <bank>/quarantine/          blobs that failed verification
    <bank>/priors/              cached population priors (not touched by this module)

Safety rules:

* Only files inside ``blobs/`` and ``quarantine/`` are ever written, moved or deleted, and
  only under names Chorus derives itself (the sha256 of the content, an entry id of 32 hex
  digits); every path is resolved and checked to lie inside its folder first.
* A bank folder may come from someone else: a bank whose index files, ``blobs/`` or
  ``quarantine/`` are symbolic links is refused at open, before SQLite or anything else opens
  a file through them; a shard folder that is a link is never written, read or emptied.
* A blob is written to a temporary file, fsynced and renamed before its row is committed,
  so a row never points at a partial blob. Writes are ``BEGIN IMMEDIATE`` transactions of
  plain ``sqlite3`` statements with a busy timeout, so several processes can share a bank.
* Nothing is unlinked before the transaction that stops referencing it has committed; the
  unlink then happens under the write lock after re-checking that no row (for example one a
  concurrent writer just added with the same masks) references the blob.
* A blob is stat-ed before it is opened, only regular files are opened (non-blocking, no
  symlinks), no more bytes than its row declares are read, and its safetensors header is
  checked against the row's model, layout and schedule before any tensor is loaded.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import re
import signal
import sqlite3
import stat
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from . import schema, validation
from .encoding import CODEC, PackedBlockMaps, decode_block_map, encode_masks
from .bank_url import is_bank_url
from .errors import (BankEntryCorrupt, BankError, BankIncompatible, BankInvalidArgument,
                     BankReadOnly)
from .fingerprint import ModelFingerprint
from .matching import MatchResult, SignatureIndex, stack_vectors
from .records import LatentLayout, Schedule
from .signature import COMPONENTS, DIM, Signature, cosine, unit_component

DB_NAME = "bank.sqlite"
# What this module opens in a bank folder: SQLite's files (SQLite would write through a link at
# -wal or -journal) and the folders of blobs. priors/ is prior_store.py's: it never follows a link
# there either, and keeps the priors in memory instead, so a bad priors/ fails no generation.
INDEX_FILES = (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm", f"{DB_NAME}-journal")
BANK_FOLDERS = ("blobs", "quarantine")
BUSY_TIMEOUT_S = 60.0
STALE_TEMP_S = 3600.0  # temp/orphan blobs younger than this may belong to a live writer
FAULT_ENV = "CHORUS_BANK_FAULT"  # test seam: SIGKILL this process at a named point

# Entries found damaged in read-only banks: {resolved bank folder: {entry id: reason}}.
# Kept for the whole process so a bad entry is tried once, not on every request.
_READ_ONLY_SKIPS: dict[str, dict[str, str]] = {}


def _fault(point: str) -> None:
    """Die here, as a power cut or OOM kill would, when ``CHORUS_BANK_FAULT`` names ``point``."""
    if os.environ.get(FAULT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


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


def _folder_writable(root: Path) -> bool:
    """False on a read-only mount or folder (``access`` reports EROFS even to root)."""
    return os.access(root, os.W_OK)


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISLNK, "symlink"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def read_regular_file(path, size: int) -> tuple[bytes | None, str | None]:
    """Exactly ``size`` bytes of the regular file ``path``, or ``(None, reason)``.

    Bounded work whatever sits at ``path``: it is lstat-ed first (a directory, FIFO, device
    or symlink is refused unopened, a file of another size unread), opened non-blocking
    without following symlinks, and at most ``size + 1`` bytes are read.
    """
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        return None, "blob missing"
    except OSError as exc:
        return None, f"blob unreadable ({exc.strerror or exc})"
    if not stat.S_ISREG(before.st_mode):
        return None, f"blob is a {_file_kind(before.st_mode)}, not a regular file"
    if before.st_size != size:
        return None, f"blob truncated or resized ({before.st_size} of {size} bytes)"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return None, f"blob unreadable ({exc.strerror or exc})"
    try:
        now = os.fstat(fd)
        if (now.st_ino, now.st_dev) != (before.st_ino, before.st_dev) or not stat.S_ISREG(now.st_mode):
            return None, "blob replaced while being read"
        chunks, left = [], size + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        return None, f"blob unreadable ({exc.strerror or exc})"
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) != size:
        return None, f"blob truncated or resized ({len(data)} of {size} bytes)"
    return data, None


class _Database:
    """The few calls other modules make on ``bank.db`` (``query``, ``execute``, ``conn``),
    over the store's own connection; no statement here commits by itself."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def execute(self, sql: str, params=()):
        return self.conn.execute(sql, params)

    def query(self, sql: str, params=()):
        cursor = self.conn.execute(sql, params)
        keys = [d[0] for d in cursor.description]
        return (dict(zip(keys, row)) for row in cursor)

    def table_names(self) -> list[str]:
        return sorted(schema.table_names(self.conn))

    def __getitem__(self, table: str):
        import sqlite_utils  # only for callers that want sqlite-utils' table helpers

        return sqlite_utils.Database(self.conn)[table]

    def close(self) -> None:
        self.conn.close()


def _database_error(root: Path, exc: sqlite3.Error) -> BankError:
    """A sqlite3 error as a BankError that says what happened and what to do."""
    text = str(exc)
    if "full" in text:
        return BankError(f"The disk holding the mask bank {root} is full ({text}); nothing was "
                         "stored. Free some space, or prune the bank (`python -m chorus_core.bank "
                         f"prune {root} --max-bytes 20G`), and retry.")
    if "locked" in text or "busy" in text:
        return BankError(f"The mask bank {root} stayed locked by another process for more than "
                         f"{BUSY_TIMEOUT_S:.0f} s ({text}); retry when that process has finished.")
    if "readonly" in text or "read-only" in text:
        return BankReadOnly(f"Cannot write the bank at {root} ({text}); check that the folder "
                            "and bank.sqlite are writable, or open with read_only=True.")
    return BankError(f"The mask bank index {root / DB_NAME} is damaged or is not a Chorus bank "
                     f"({text}); nothing was changed. Restore bank.sqlite from a backup, or move "
                     "the folder away and start a new bank.")


def _os_error(root: Path, exc: OSError, what: str) -> BankError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return BankError(f"The disk holding the mask bank {root} is full ({exc.strerror}) while "
                         f"trying to {what}; nothing was stored. Free some space, or prune the "
                         "bank, and retry.")
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return BankReadOnly(f"Cannot {what} in the mask bank {root} ({exc.strerror}); make the "
                            "folder writable, or open the bank with read_only=True.")
    return BankError(f"Cannot {what} in the mask bank {root} ({exc.strerror or exc}); check the "
                     "folder, its permissions and free space, then retry.")


def _guarded(method):
    """Turn database and OS errors escaping a public method into a BankError (each backend's
    ``_guard`` knows its own errors): callers treat every BankError as "no masks from the
    bank" and never see a traceback."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._guard(method.__name__.strip("_").replace("_", " ")):
            return method(self, *args, **kwargs)

    return wrapper


class EntryMasks:
    """Decoded-on-demand masks of one entry.

    :param entry_id: the entry
    :param schedule: the schedule the masks were recorded under
    :param layout: the latent layout
    :param on_corrupt: called with a reason when a layer set cannot be decoded or is
        invalid (shape, empty query row); the bank's callback quarantines the entry and
        raises BankEntryCorrupt. Without it (a cached prior) decoding errors propagate as is.
    """

    def __init__(self, entry_id: str, schedule: Schedule, layout: LatentLayout,
                 tensors: dict, meta: dict, on_corrupt=None):
        self.entry_id, self.schedule, self.layout = entry_id, schedule, layout
        self._tensors, self._meta, self._on_corrupt = tensors, meta, on_corrupt
        self.shape = tuple(int(x) for x in meta["shape"].split(","))  # (S, L, H, nq, nk)

    @property
    def step_buckets(self) -> list[tuple[int, int]]:
        return self.schedule.step_buckets

    def block_map_numpy(self, bucket_index: int, layer: int) -> np.ndarray:
        """Bool numpy ``[H, nq, nk]`` for one step bucket and layer, checked (no empty row).

        :raises IndexError: bucket or layer out of range
        :raises BankEntryCorrupt: the stored map cannot be decoded or is invalid
        """
        s_count, layers = self.shape[:2]
        if not (0 <= bucket_index < s_count and 0 <= layer < layers):
            raise IndexError(f"bucket {bucket_index} / layer {layer} out of range for an entry "
                             f"with {s_count} buckets and {layers} layers.")
        if self._on_corrupt is None:  # not a bank entry (e.g. a cached prior): decode as is
            return decode_block_map(self._tensors, self._meta, bucket_index, layer)
        try:
            maps = decode_block_map(self._tensors, self._meta, bucket_index, layer)
            validation.check_block_map(maps, self.shape[2:])
            return maps
        except Exception as exc:  # ValueError (bounded decode, checks), zlib.error, IndexError
            reason = f"bucket {bucket_index} layer {layer} unusable: {type(exc).__name__}: {exc}"
        self._on_corrupt(reason)  # quarantines (or skips, read-only) and raises BankEntryCorrupt
        raise AssertionError("on_corrupt must raise")

    def block_map(self, bucket_index: int, layer: int):
        """Bool torch tensor ``[H, nq, nk]`` for one step bucket and layer (about 15 ms CPU).

        :param bucket_index: index into :attr:`step_buckets`
        :param layer: transformer block index
        """
        import torch

        return torch.from_numpy(self.block_map_numpy(bucket_index, layer))


class BankStorage:
    """What every mask bank backend offers, and the logic they share.

    Public API (the same on every backend): ``open`` (via :meth:`MaskBank.open`, which picks
    the backend from the location), ``add_entry``, ``match``, ``load_masks``,
    ``compatible_entries``, ``quarantine``, ``verify``, ``delete``, ``prune``,
    ``eviction_order``, ``stats``, ``entries``, ``recent``, ``show``, ``export``,
    ``import_file``, ``content_token``, ``close``; attributes ``read_only``, ``label`` (the
    location as it may be shown: never a password) and ``root`` (the bank folder, or None for
    a bank without one, such as PostgreSQL: caches that need files keep them in memory then).

    A backend provides: ``db`` (``query(sql, params)`` with ``?`` placeholders over its own
    connection), ``_guard(what)`` (turns its errors into BankError), ``_write(bump, removal)``
    (one serialised write transaction), ``_bump``, ``_meta``, ``_get_row``,
    ``_read_blob(sha, size) -> (data, reason)``, ``_store_entry(row, data)``, ``_record_hit``,
    ``_quarantine_row``, ``_skip_key``, ``_delete_rows(ids) -> (count, blobs to release)`` and,
    where blobs live outside the database, ``_release_blobs``.
    """

    root: Path | None
    read_only: bool

    def reopen(self) -> "BankStorage":
        """The same bank on a new connection (e.g. for a writer thread), same read_only."""
        raise NotImplementedError

    def _check_writable(self) -> None:
        if self.read_only:
            raise BankReadOnly(f"The bank at {self.label} was opened read-only; "
                               "open it with read_only=False to change it.")

    # ---- removal (the same on every backend) ---------------------------------------------
    @_guarded
    def delete(self, entry_ids) -> int:
        """Delete entries and the blobs no other entry uses; returns how many rows went.

        The rows go in one committed transaction first; a backend whose blobs live outside the
        database (the folder bank) removes them afterwards, under the write lock, only if still
        no row references them. A crash in between leaves orphan blobs (``verify`` removes
        them), never rows without blobs.
        """
        ids = [str(i) for i in entry_ids]
        if not ids:
            return 0
        with self._write(removal=True):
            count, released = self._delete_rows(ids)
            _fault("delete-before-commit")
        _fault("delete-after-commit")
        self._release_blobs(released)
        return count

    @_guarded
    def eviction_order(self) -> list[dict]:
        """Rows in the order :meth:`prune` removes them: quarantined first, then least
        recently used (creation time counts as a use), fewer hits first on ties."""
        return list(self.db.query(
            "SELECT id, blob_bytes, hits, COALESCE(last_hit, created) AS last_use FROM entries "
            "ORDER BY status = 'ok', last_use, hits, created"))

    @_guarded
    def prune(self, max_bytes: int | None = None, max_entries: int | None = None,
              dry_run: bool = False) -> list[str]:
        """Evict entries until the bank fits ``max_bytes`` and ``max_entries``.

        :param max_bytes: most blob bytes to keep, a positive whole number (None: no limit)
        :param max_entries: most entries to keep, a positive whole number (None: no limit)
        :param dry_run: only return what would be removed
        :return: ids removed (or to remove), in eviction order
        :raises BankInvalidArgument: a limit that is negative, zero, NaN, infinite or not whole
        """
        if not dry_run:
            self._check_writable()
        max_bytes = _check_limit("max_bytes", max_bytes)
        max_entries = _check_limit("max_entries", max_entries)
        if dry_run:
            return _doomed(self.eviction_order(), max_bytes, max_entries)
        with self._write(bump=False):  # choose and delete in one transaction
            doomed = _doomed(self.eviction_order(), max_bytes, max_entries)
            released = self._delete_rows(doomed)[1] if doomed else []
            if doomed:
                self._bump("generation")
                self._bump("removals")
            _fault("prune-before-commit")
        _fault("prune-after-commit")
        self._release_blobs(released)
        return doomed

    def _release_blobs(self, keys: list) -> None:
        """After a deletion commits: remove blobs kept outside the database (none by default)."""

    def _skip_for_this_process(self, row: dict, reason: str, warn: bool) -> None:
        """A read-only bank cannot quarantine: say so, and skip the entry for the rest of the process."""
        _READ_ONLY_SKIPS.setdefault(self._skip_key, {})[row.get("id")] = reason
        if warn:
            warnings.warn(f"Chorus mask bank: would quarantine entry {_entry_label(row)}: {reason}. The "
                          "bank is read-only, so nothing was moved; this process skips the entry: "
                          "requests that matched it run as an online-prediction miss (dense with "
                          "miss_mode \"dense\") and record nothing.", stacklevel=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _problem(self, row: dict):
        """``(None, (spec, data, meta))`` for a healthy entry, else ``(reason, None)``.

        Checks, cheapest first: id, digest and records of the row; size against the row and
        the layout; the blob's type (a file's), size and digest; the safetensors header against the shape
        the row's model, layout and schedule imply.
        """
        if not validation.is_entry_id(row.get("id")):
            return "invalid entry id (not 32 lowercase hex digits)", None
        sha = row.get("blob_sha256")
        if not validation.is_sha256(sha):
            return "invalid blob sha256 in its row", None
        try:
            spec = validation.entry_spec(row)
        except ValueError as exc:
            return f"row unreadable: {exc}", None
        if row.get("compat") != compat_key(spec.fingerprint, spec.layout):
            return "row's compatibility key does not match its model and layout", None
        size = row.get("blob_bytes")
        if not isinstance(size, int) or not 0 < size <= spec.max_blob_bytes:
            return (f"row declares a blob of {size} bytes; its layout allows at most "
                    f"{spec.max_blob_bytes}"), None
        data, reason = self._read_blob(sha, size)
        if reason is not None:
            return reason, None
        if hashlib.sha256(data).hexdigest() != sha:
            return "blob sha256 mismatch", None
        try:
            meta = validation.check_header(validation.read_header(data), spec.shape)
        except ValueError as exc:
            return f"blob cannot serve its layout: {exc}", None
        return None, (spec, data, meta)

    # ---- adding --------------------------------------------------------------------------
    @_guarded
    def add_entry(self, fingerprint: ModelFingerprint, layout: LatentLayout, schedule: Schedule,
                  masks, signature: Signature, density: float, recall: float | None = None,
                  tags=(), coarsen: int = 1, entry_id: str | None = None) -> str:
        """Store recorded masks and return the new entry's id.

        :param fingerprint: model the masks were recorded on (:func:`fingerprint_model`)
        :param layout: latent layout (grid, token order, block size)
        :param schedule: sampling schedule; one mask set per step bucket
        :param masks: bool ``[S, L, H, nq, nk]`` torch tensor or numpy array, or ``PackedBlockMaps``
        :param signature: request signature (:func:`build_signature`)
        :param density: share of key blocks kept (0..1)
        :param recall: measured attention recall of the masks, if known
        :param tags: user tags, e.g. the effect template's name
        :param coarsen: store at ``coarsen`` x coarser blocks (OR-pooled; 1 = lossless)
        :param entry_id: the id to use (32 hex characters, as ``uuid.uuid4().hex`` makes); new by default
        :raises BankIncompatible: when the masks' shape does not fit the other arguments, or a
            query row keeps no key block
        :raises BankError: when the disk is full or the bank cannot be written (the
            database's or the OS's own message is in the text)
        """
        self._check_writable()
        if entry_id is not None and not validation.is_entry_id(entry_id):
            raise BankInvalidArgument(f"entry_id must be 32 lowercase hex characters, got {entry_id!r}; "
                                      "leave it out to get a new one.")
        try:
            _signature_columns(signature)  # checked before any encoding (_row stores them)
        except ValueError as exc:
            raise BankInvalidArgument(f"signature not stored: {exc}; build it with "
                                      "build_signature() from the request's inputs.") from None
        masks = _as_bool_array(masks)
        self._check_shape(masks, fingerprint, layout, schedule)
        try:
            validation.check_masks(masks)
        except ValueError as exc:
            raise BankIncompatible(f"masks not stored: {exc}; every query block must attend to "
                                   "at least one key block (keep the diagonal).") from None
        tensors, meta = encode_masks(masks, coarsen=coarsen)
        data = st_save(tensors, metadata=_blob_metadata(meta))
        sha = hashlib.sha256(data).hexdigest()
        entry_id = entry_id or uuid.uuid4().hex  # a background write names its entry up front
        row = self._row(entry_id, fingerprint, layout, schedule, signature, density, recall,
                        tags, validation.blob_name(sha), len(data), sha)
        self._store_entry(row, data)
        return entry_id

    @staticmethod
    def _check_shape(masks, fingerprint, layout, schedule) -> None:
        want = validation.expected_shape(schedule, fingerprint, layout)
        if tuple(masks.shape) != want:
            raise BankIncompatible(
                f"masks have shape {tuple(masks.shape)} but the fingerprint, layout and schedule "
                f"ask for {want} (buckets, layers, heads, query blocks, key blocks); record one "
                "block map per step bucket, layer and head.")
        try:
            validation.check_shape_bounds(want)
        except ValueError as exc:
            raise BankIncompatible(f"masks not stored: {exc}.") from None

    @staticmethod
    def _row(entry_id, fingerprint, layout, schedule, signature, density, recall, tags,
             name, size, sha) -> dict:
        now = time.time()
        sigs = _signature_columns(signature)
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

    @_guarded
    def match(self, signature: Signature, fingerprint: ModelFingerprint, layout: LatentLayout,
              threshold: float = 0.9, top_k: int = 1, weights=None) -> MatchResult:
        """Most similar compatible entry; a hit when its similarity >= ``threshold``.

        :param signature: the request's signature
        :param fingerprint: the model about to run
        :param layout: the request's latent layout
        :param threshold: least weighted cosine similarity for a hit
        :param top_k: how many best entries to list in ``MatchResult.top``
        :param weights: per-component weights, e.g. ``{"clip": 0.5, "text": 0.3, "layout": 0.2}``
        :raises BankError: the index is damaged or not a Chorus bank (treat as a miss)
        """
        self._index.refresh(self.db, *self._counters())
        compat, top_k = compat_key(fingerprint, layout), max(1, top_k)
        skipped = self._skipped()
        if not skipped:
            return self._index.match(self.db, compat, signature, threshold, top_k, weights)
        result = self._index.match(self.db, compat, signature, threshold,
                                   top_k + len(skipped), weights)
        return self._without_skipped(result, skipped, signature, threshold, top_k)

    def _counters(self) -> tuple[int, int]:
        """(generation, removals): what the in-process signature matrices are refreshed by."""
        return int(self._meta("generation")), int(self._meta("removals"))

    def _verify_entries(self, rows: list[dict], report: dict) -> None:
        """Check each healthy row's blob; quarantine failures (read-only: report them)."""
        for row in rows:
            report["checked"] += 1
            reason = self._problem(row)[0]
            outcome = None if reason is None else self._quarantine_row(row, reason, recheck=True,
                                                                        warn=False)
            if outcome is True or (reason is not None and outcome is None):  # None: read-only
                report["quarantined"].append({"id": row["id"], "reason": reason})
            elif outcome == "gone":
                report["checked"] -= 1  # pruned or quarantined by another process meanwhile
            else:
                report["ok"] += 1

    def _skipped(self) -> dict[str, str]:
        return _READ_ONLY_SKIPS.get(self._skip_key, {}) if self.read_only else {}

    def _without_skipped(self, result, skipped, signature, threshold, top_k) -> MatchResult:
        """``result`` without the entries this process found damaged in a read-only bank."""
        top = [(i, s) for i, s in result.top if i not in skipped]
        if not top:
            return MatchResult(False, None, 0.0, {}, result.candidates, [])
        best, sim = top[0]
        comps = result.components
        if best != result.entry_id:
            # list(): the folder bank's query yields rows lazily, PostgreSQL's returns a list
            rows = list(self.db.query("SELECT sig_clip, sig_text, sig_layout FROM entries "
                                      "WHERE id = ?", [best]))
            vec = stack_vectors(rows[:1])[0] if rows else None  # None: removed meanwhile
            comps = {} if vec is None else {
                c: cosine(vec[j * DIM:(j + 1) * DIM], signature.vector(c))
                for j, c in enumerate(COMPONENTS) if c in signature.components}
        return MatchResult(sim >= threshold, best, sim, comps, result.candidates, top[:top_k])

    @_guarded
    def compatible_entries(self, fingerprint: ModelFingerprint, layout: LatentLayout, limit: int = 8) -> list[str]:
        """Ids of healthy entries interchangeable with this model and layout, most recently used first.

        :param limit: at most this many ids
        """
        skipped = self._skipped()
        rows = self.db.query("SELECT id FROM entries WHERE compat = ? AND status = 'ok' "
                             "ORDER BY COALESCE(last_hit, created) DESC LIMIT ?",
                             [compat_key(fingerprint, layout), int(limit) + len(skipped)])
        return [row["id"] for row in rows if row["id"] not in skipped][:int(limit)]

    @_guarded
    def load_masks(self, entry_id: str, record_hit: bool = True) -> EntryMasks:
        """Load an entry's masks and, unless ``record_hit`` is False, record a hit.

        :param entry_id: an id from :meth:`match` or :meth:`add_entry`
        :param record_hit: count this load as a hit (a population prior's reads are not hits)
        :raises BankEntryCorrupt: blob missing, damaged or unfit for its layout (the entry is
            quarantined first; in a read-only bank it is skipped for the rest of the process)
        :raises BankError: no such entry, or it is quarantined
        """
        if entry_id in self._skipped():
            raise BankEntryCorrupt(entry_id, self._skipped()[entry_id], moved=False)
        row = self._get_row(entry_id)
        if row["status"] != "ok":
            raise BankError(f"Entry {entry_id} is quarantined ({row['status_reason']}); "
                            "run dense for this request and record it again.")
        reason, loaded = self._problem(row)
        if reason is not None:
            self._found_corrupt(row, reason, recheck=True)
        spec, data, meta = loaded
        try:
            tensors = st_load(data)
        except Exception as exc:  # safetensors raises its own error types
            self._found_corrupt(row, f"blob unreadable: {exc}", recheck=False)
        if record_hit and not self.read_only:
            self._record_hit(entry_id)
        return EntryMasks(entry_id, spec.schedule, spec.layout, tensors, meta,
                          on_corrupt=functools.partial(self._found_corrupt, row, recheck=False))

    def _found_corrupt(self, row: dict, reason: str, recheck: bool):
        """Quarantine (or, read-only, skip) the entry of ``row`` and raise BankEntryCorrupt."""
        outcome = self._quarantine_row(row, reason, recheck)
        if outcome == "gone":
            raise BankError(f"No entry {row['id']} any more: another process removed or "
                            "quarantined it while it was being read; run this request as a miss.")
        if outcome is False:
            raise BankError(f"Entry {row['id']} could not be read ({reason}), but its blob is "
                            "healthy again (another process rewrote it); retry the request.")
        raise BankEntryCorrupt(row["id"], reason, moved=outcome is True)

    def recent(self, n: int = 20) -> list[dict]:
        """The ``n`` most recently added entries, newest first."""
        return self.entries(limit=n)

    @_guarded
    def show(self, entry_id: str) -> dict:
        """One entry as a dict, without signature vectors."""
        row = self._get_row(entry_id)
        return _decode_row({k: v for k, v in row.items() if not k.startswith("sig_") and k != "rowid"})


class MaskBank(BankStorage):
    """A folder of recorded block-sparse attention masks, indexed by request signature (the
    embedded default backend); :meth:`open` also opens PostgreSQL banks (``postgresql://``)."""

    def __init__(self, root: Path, conn: sqlite3.Connection, read_only: bool):
        self.root, self.conn, self.read_only = root, conn, read_only
        self.db = _Database(conn)
        self.blobs = root / "blobs"
        self.quarantine_dir = root / "quarantine"
        self._real_root = os.path.realpath(root)
        self._real_blobs = os.path.realpath(self.blobs)
        self._real_quarantine = os.path.realpath(self.quarantine_dir)
        self._index = SignatureIndex()

    # ---- opening -------------------------------------------------------------------------
    @classmethod
    def open(cls, path, read_only: bool = False, create: bool = True) -> "BankStorage":
        """Open (and by default create) the bank in folder ``path``, or at a PostgreSQL URL.

        :param path: folder holding ``bank.sqlite`` and ``blobs/``, or a bank URL
            ``postgresql://USER@HOST:PORT/DATABASE?schema=NAME`` (see :mod:`.bank_url`); a
            URL gives a :class:`~chorus_core.bank.pg_store.PostgresBank`
        :param read_only: open without ever writing (no hit counts either); a bank on a
            read-only folder or mount opens this way
        :param create: create the folder and database when missing
        :raises BankError: when the bank is missing, damaged, not a Chorus bank, or newer
        :raises BankReadOnly: when a writable bank was asked for on a read-only location
        """
        if is_bank_url(path):
            return _open_postgres(path, read_only, create)
        root = Path(path).expanduser()
        db_path = root / DB_NAME
        cls._refuse_links(root)
        exists = cls._check_db_file(db_path)
        if not exists and (read_only or not create):
            raise BankError(f"No mask bank at {root}. Create one with "
                            f"`python -m chorus_core.bank init {root}` or open with create=True.")
        if read_only:
            conn = cls._connect(cls._read_only_uri(root, db_path), root, uri=True)
        else:
            cls._make_dirs(root)
            conn = cls._connect(str(db_path), root)
        bank = cls(root, conn, read_only)
        try:
            cls._refuse_links(root)  # again: _make_dirs and SQLite made files since the first look
            bank._prepare()
        except BaseException:
            conn.close()
            raise
        return bank

    @staticmethod
    def _refuse_links(root: Path) -> None:
        """Refuse a bank whose own files or folders are links (or folders that are files): a
        received bank's ``blobs`` linked to ``../../checkpoints`` must not reach the models."""
        for name in INDEX_FILES + BANK_FOLDERS:
            path = root / name
            try:
                mode = os.lstat(path).st_mode
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                raise BankError(f"Cannot read {path} ({exc.strerror}); check its permissions.") from exc
            if stat.S_ISLNK(mode):
                what = f"a symbolic link (to {os.readlink(path)[:200]!r})"
            elif name in BANK_FOLDERS and not stat.S_ISDIR(mode):
                what = f"a {_file_kind(mode)}, not a folder"
            else:
                continue
            raise BankError(
                f"{path} is {what}. Chorus never follows a link in a bank folder, so that nothing "
                "outside the bank is read, written or deleted; nothing was opened or changed. "
                "Replace it with a real folder or file holding its content (or remove it), then "
                "open the bank again.")

    @staticmethod
    def _check_db_file(db_path: Path) -> bool:
        try:
            info = os.stat(db_path)
        except (FileNotFoundError, NotADirectoryError):  # the folder is made (or refused) later
            return False
        except OSError as exc:
            raise BankError(f"Cannot read {db_path} ({exc.strerror}); check its permissions.") from exc
        if not stat.S_ISREG(info.st_mode):
            raise BankError(f"{db_path} is a {_file_kind(info.st_mode)}, not a database file; "
                            "move it away, or restore bank.sqlite from a backup.")
        return True

    @staticmethod
    def _read_only_uri(root: Path, db_path: Path) -> str:
        """``mode=ro``; also ``immutable=1`` when nothing can change the file: no WAL or
        shared-memory file exists and the folder is not writable (a read-only mount), where
        SQLite could not create the ``-shm`` file a WAL database otherwise needs."""
        uri = db_path.resolve().as_uri() + "?mode=ro"
        live = any(os.path.lexists(f"{db_path}{s}") for s in ("-wal", "-shm"))
        if not live and not _folder_writable(root):
            uri += "&immutable=1"
        return uri

    @staticmethod
    def _make_dirs(root: Path) -> None:
        try:
            for sub in ("blobs", "quarantine"):
                (root / sub).mkdir(parents=True, exist_ok=True)
            probe = root / f".write-probe-{uuid.uuid4().hex}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
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

    def _blob_files(self, limit: int | None = None) -> int:
        """How many content-addressed blob files ``blobs/`` holds (stops at ``limit``)."""
        count = 0
        for shard in _scandir(self.blobs):
            if _is_shard(shard):
                for entry in _scandir(shard.path):
                    count += _is_blob_file(shard.name, entry)
                    if limit is not None and count >= limit:
                        return count
        return count

    def _index_lost(self, detail: str) -> BankError:
        count = self._blob_files()
        return BankError(
            f"The index {self.root / DB_NAME} {detail}, but blobs/ holds {count} recorded "
            "mask file(s); Chorus will not create a new index over them. Restore bank.sqlite "
            "from a backup, or move the whole folder away and create a new bank (the blobs alone "
            "cannot rebuild the index: they hold masks, not the signatures that find them).")

    def _prepare(self) -> None:
        try:
            found = schema.schema_version(self.conn)
            tables = schema.table_names(self.conn)
        except sqlite3.DatabaseError as exc:
            raise self._damaged(exc) from exc
        if found == 0 and not tables:
            if self.read_only or self._blob_files(limit=1):
                raise self._index_lost("is empty") if self._blob_files(limit=1) else BankError(
                    f"{self.root / DB_NAME} is empty: not a Chorus bank yet. Create it with "
                    f"`python -m chorus_core.bank init {self.root}`.")
        else:
            self._check_known(found, tables)
        if self.read_only:
            if found != schema.SCHEMA_VERSION:
                raise BankError(
                    f"The bank at {self.root} has schema version {found}, this Chorus reads "
                    f"{schema.SCHEMA_VERSION}; open it once without read_only to migrate it.")
            return
        try:
            self.conn.execute("PRAGMA journal_mode = WAL")
            self.conn.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL is durable at commit
            with self._write(bump=False):
                found = schema.schema_version(self.conn)  # another process may have migrated
                self._check_known(found, schema.table_names(self.conn), fresh_ok=True)
                schema.migrate(self.conn)
        except sqlite3.DatabaseError as exc:
            raise self._damaged(exc) from exc

    def _check_known(self, found: int, tables: set, fresh_ok: bool = False) -> None:
        """Refuse a database that is not a Chorus bank, or one from a newer Chorus."""
        if found == 0 and not tables and fresh_ok:
            return
        if found > schema.SCHEMA_VERSION:
            raise BankError(
                f"The bank at {self.root} has schema version {found}, newer than this "
                f"Chorus ({schema.SCHEMA_VERSION}); upgrade Chorus to use it.")
        missing = schema.TABLES.get(found, {"entries"}) - set(tables)
        if found == 0 or missing:
            what = (f"holds other tables ({', '.join(sorted(tables))[:200]})" if found == 0
                    else f"lacks the {', '.join(sorted(missing))} table(s)")
            raise BankError(
                f"{self.root / DB_NAME} is not a Chorus bank: it {what}. Nothing was changed. "
                "Point Chorus at a bank folder (or an empty one to create a bank); if this "
                "folder held a bank, restore bank.sqlite from a backup.")

    def _damaged(self, exc: sqlite3.Error) -> BankError:
        if self._blob_files(limit=1):
            return self._index_lost(f"cannot be read ({exc})")
        return BankError(f"The mask bank database {self.root / DB_NAME} cannot be used ({exc}); "
                         "nothing was changed. Restore it from a backup, or move the folder "
                         "away and create a new bank.")

    def close(self) -> None:
        """Close the database connection."""
        self.conn.close()

    # ---- backend hooks (see BankStorage) -------------------------------------------------
    @property
    def label(self) -> str:
        return str(self.root)

    def reopen(self) -> "MaskBank":
        return MaskBank.open(self.root, read_only=self.read_only, create=False)

    @property
    def _skip_key(self) -> str:
        return self._real_root

    @contextlib.contextmanager
    def _guard(self, what: str):
        try:
            yield
        except sqlite3.Error as exc:
            raise _database_error(self.root, exc) from exc
        except OSError as exc:
            raise _os_error(self.root, exc, what) from exc

    def _read_blob(self, sha: str, size: int) -> tuple[bytes | None, str | None]:
        path = self._blob_path(sha)
        if path is None:
            return None, "blob path leaves the bank folder"
        return read_regular_file(path, size)

    def _store_entry(self, row: dict, data: bytes) -> None:
        """Blob file first (temp + fsync + rename), then the row in one transaction."""
        self._write_blob(data, row["blob_sha256"])
        _fault("add-blob-written")
        with self._write():
            self._ensure_blob(data, row["blob_sha256"])
            _insert(self.conn, row)
            _fault("add-before-commit")

    def _has_entry(self, entry_id: str) -> bool:
        return self.conn.execute("SELECT 1 FROM entries WHERE id = ?", [entry_id]).fetchone() is not None

    def _stage_blob(self, data: bytes, sha: str) -> None:
        """Before an import's transaction: content-addressed, harmless if the import fails."""
        self._write_blob(data, sha)

    def _import_row(self, row: dict, read_data) -> None:
        """Inside an import's transaction: the row, its blob re-written from ``read_data()``
        when it was removed or damaged since :meth:`_stage_blob`."""
        data, _ = read_regular_file(self._blob_path(row["blob_sha256"]), row["blob_bytes"])
        if data is None or hashlib.sha256(data).hexdigest() != row["blob_sha256"]:
            self._write_blob(read_data(), row["blob_sha256"])
        _insert(self.conn, row)

    # ---- transactions and counters -------------------------------------------------------

    @contextlib.contextmanager
    def _write(self, bump: bool = True, removal: bool = False):
        """One ``BEGIN IMMEDIATE`` transaction; bumps the generation counter when asked.

        A failed statement or commit is re-raised as itself (the caller's guard turns it into
        a BankError with SQLite's message, e.g. "database or disk is full"); the rollback is
        only attempted while a transaction is still open, because SQLite ends it by itself
        on some errors and a second error would hide the real one.
        """
        self._check_writable()
        conn = self.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise _database_error(self.root, exc) from exc
        try:
            yield
            if bump:
                self._bump("generation")
            if removal:
                self._bump("removals")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise

    def _bump(self, key: str) -> None:
        self.conn.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = ?", [key])

    def _meta(self, key: str) -> str:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", [key]).fetchone()
        if row is None:
            raise BankError(f"The index {self.root / DB_NAME} lacks its {key!r} record: it is "
                            "damaged. Restore bank.sqlite from a backup.")
        return row[0]

    @_guarded
    def content_token(self) -> str:
        """A string that changes whenever entries are added, removed or quarantined."""
        return f"{self._meta('bank_id')}:{self._meta('generation')}"

    # ---- paths ---------------------------------------------------------------------------
    def _blob_path(self, sha) -> Path | None:
        """Where the blob of digest ``sha`` lives, or None when ``sha`` is not a digest, its
        shard folder is a symlink, or the path would leave ``blobs/``."""
        if not validation.is_sha256(sha):
            return None
        path = self.blobs / sha[:2] / validation.blob_name(sha)
        if os.path.islink(path.parent):  # even a link to another shard: never followed
            return None
        return path if validation.inside(self._real_blobs, path) else None

    def blob_path(self, name: str) -> Path:
        """Path of blob ``<sha256>.safetensors`` (names are never taken as paths)."""
        sha = name[:-len(validation.BLOB_SUFFIX)] if isinstance(name, str) \
            and name.endswith(validation.BLOB_SUFFIX) else None
        path = self._blob_path(sha)
        if path is None:
            raise BankInvalidArgument(f"{str(name)[:100]!r} is not a blob name of this bank "
                                      "(blobs are named <sha256>.safetensors).")
        return path

    def _quarantine_target(self, row: dict) -> Path | None:
        label = row["id"] if validation.is_entry_id(row.get("id")) else f"row{int(row['rowid'])}"
        sha = row["blob_sha256"] if validation.is_sha256(row.get("blob_sha256")) else "no-sha"
        path = self.quarantine_dir / f"{label}-{uuid.uuid4().hex[:8]}-{sha}{validation.BLOB_SUFFIX}"
        return path if validation.inside(self._real_quarantine, path) else None

    # ---- blobs ---------------------------------------------------------------------------
    def _write_blob(self, data: bytes, sha: str) -> str:
        """Write ``data`` to its content address via temp file + fsync + rename."""
        final = self._blob_path(sha)
        if final is None:
            raise BankError(f"Refusing to write blob {sha[:80]!r}: its path would leave "
                            f"{self.blobs}. Replace the symlinked shard folder with a real one.")
        final.parent.mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(os.lstat(final).st_mode):  # something squats the name
                self._move_aside(final, {"id": None, "rowid": 0, "blob_sha256": sha})
        tmp = self.blobs / f".tmp-{uuid.uuid4().hex}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(final.parent)
        return validation.blob_name(sha)

    def _ensure_blob(self, data: bytes, sha: str) -> None:
        """Under the write lock: the blob holds ``data``, or is written again (a concurrent
        prune may have removed it between our write and our lock)."""
        path = self._blob_path(sha)
        current, _ = read_regular_file(path, len(data)) if path else (None, None)
        if current != data:
            self._write_blob(data, sha)

    def _move_aside(self, path: Path, row: dict) -> bool:
        """Rename whatever is at ``path`` (file, directory, FIFO, symlink) into quarantine/
        without opening it; False when it cannot be moved (it is then left in place)."""
        target = self._quarantine_target(row)
        if target is None:
            return False
        try:
            self.quarantine_dir.mkdir(exist_ok=True)
            if not stat.S_ISDIR(os.lstat(self.quarantine_dir).st_mode):  # replaced by a link since open
                raise OSError(errno.ELOOP, "quarantine/ is no longer a real folder")
            os.replace(path, target)
            return True
        except OSError as exc:
            warnings.warn(f"Chorus mask bank: could not move {path} to quarantine "
                          f"({exc.strerror or exc}); it stays where it is.", stacklevel=4)
            return False

    # ---- matching and loading ------------------------------------------------------------
    def _get_row(self, entry_id: str) -> dict:
        if not validation.is_entry_id(entry_id):
            raise BankInvalidArgument(
                f"{str(entry_id)[:80]!r} is not an entry id (32 lowercase hex digits); list "
                f"entries with `python -m chorus_core.bank list {self.root}`.")
        rows = list(self.db.query("SELECT rowid, * FROM entries WHERE id = ?", [entry_id]))
        if not rows:
            raise BankError(f"No entry {entry_id} in the bank at {self.root}; "
                            "list entries with `python -m chorus_core.bank list PATH`.")
        return rows[0]

    def _record_hit(self, entry_id: str) -> None:
        """Hit counters are statistics: a locked or full database must not fail the load."""
        try:
            with self._write(bump=False):  # hits do not change content: no new cache key
                self.conn.execute("UPDATE entries SET hits = hits + 1, last_hit = ? WHERE id = ?",
                                  [time.time(), entry_id])
        except (sqlite3.Error, BankError) as exc:
            warnings.warn(f"Chorus mask bank: hit of {entry_id} not counted ({exc}).", stacklevel=3)

    # ---- maintenance ---------------------------------------------------------------------
    @_guarded
    def quarantine(self, entry_id: str, reason: str) -> None:
        """Move an entry's blob to ``quarantine/`` and mark every row that uses it.

        In a read-only bank nothing moves: a warning says it would be quarantined and this
        process skips the entry from now on.
        """
        self._quarantine_row(self._get_row(entry_id), reason, recheck=False)

    def _quarantine_row(self, row: dict, reason: str, recheck: bool, warn: bool = True):
        """True: quarantined; None: read-only, skipped in this process; False: ``recheck``
        found the blob healthy under the lock (a writer re-added the same masks meanwhile);
        "gone": the row was deleted or quarantined meanwhile (e.g. by a concurrent prune)."""
        label = _entry_label(row)
        if self.read_only:
            return self._skip_for_this_process(row, reason, warn)
        with self._write(bump=False):
            # rowid and id: a deleted row's rowid can be reused by a newer entry
            current = next(self.db.query(f"SELECT rowid, {_SUMMARY} FROM entries WHERE rowid = ? "
                                         "AND id IS ?", [row["rowid"], row.get("id")]), None)
            if current is None or current["status"] != "ok":
                return "gone"
            if recheck and self._problem(current)[0] is None:
                return False
            sha = current["blob_sha256"]
            if validation.is_sha256(sha):  # every row sharing the blob shares its damage
                self.conn.execute("UPDATE entries SET status = 'quarantined', status_reason = ? "
                                  "WHERE blob_sha256 = ? AND status = 'ok'", [reason, sha])
            else:
                self.conn.execute("UPDATE entries SET status = 'quarantined', status_reason = ? "
                                  "WHERE rowid = ?", [reason, row["rowid"]])
            self._bump("generation")
            self._bump("removals")
            src = self._blob_path(sha)
            if src is not None and os.path.lexists(src):
                self._move_aside(src, current)
            _fault("quarantine-moved")
        if warn:
            warnings.warn(f"Chorus mask bank: quarantining entry {label}: {reason}. "
                          "Requests that matched it run as an online-prediction miss (dense with "
                          "miss_mode \"dense\") and record a fresh entry when record_on_miss is on.", stacklevel=4)
        return True

    @_guarded
    def verify(self) -> dict:
        """Recompute every blob digest and check every header; quarantine failures; drop
        stale temp and orphan blobs when the index can be trusted.

        :return: ``{"checked", "ok", "quarantined": [{"id", "reason"}], "orphans_removed",
            "problems": [text], "read_only"}``; ``problems`` lists what could not be done
            (then nothing was removed)
        """
        report = {"checked": 0, "ok": 0, "quarantined": [], "orphans_removed": 0,
                  "problems": [], "read_only": self.read_only}
        check = [r[0] for r in self.conn.execute("PRAGMA quick_check").fetchall()]
        if check != ["ok"]:
            report["problems"].append(
                f"the index fails SQLite's quick_check ({'; '.join(check)[:300]}); orphan blobs "
                "were not removed. Restore bank.sqlite from a backup.")
        rows = list(self.db.query(f"SELECT rowid, {_SUMMARY} FROM entries WHERE status = 'ok'"))
        self._verify_entries(rows, report)
        if not self.read_only and not report["problems"]:
            report["orphans_removed"] = self._remove_orphans(report["problems"])
        return report

    def _remove_orphans(self, problems: list) -> int:
        """Blobs no row names, left by writers killed before their commit (if old enough).

        Refused when the index looks wrong (no rows but blobs present, or most blobs unknown):
        removing "orphans" of a lost or foreign index would delete the user's masks. Only blobs
        older than ``STALE_TEMP_S`` count: a live writer or importer writes its blobs before its
        rows commit, and those are neither orphans nor a sign of a lost index.
        """
        cutoff = time.time() - STALE_TEMP_S
        old_blobs, candidates = self._old_files(cutoff)  # old files stay old: scanned unlocked
        with self._write(bump=False):  # the rows as committed now; a writer re-checks under it too
            known = {r[0] for r in self.conn.execute("SELECT DISTINCT blob_sha256 FROM entries")}
            rows = self.conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
            orphans = [(path, sha) for path, sha in candidates if sha is None or sha not in known]
            unknown = sum(1 for _, sha in orphans if sha)
            if old_blobs and rows == 0:
                problems.append(f"the index has no entries but blobs/ holds {old_blobs} blob(s): the "
                                "index looks lost, so no orphan was removed. Restore bank.sqlite from "
                                "a backup.")
                return 0
            if unknown > 16 and unknown * 2 > old_blobs:
                problems.append(f"{unknown} of {old_blobs} blobs are not in the index: it looks like an "
                                "old or another bank's bank.sqlite, so no orphan was removed. Restore "
                                "the right index from a backup.")
                return 0
            removed = 0
            for path, _ in orphans:
                with contextlib.suppress(FileNotFoundError):
                    info = os.lstat(path)
                    if stat.S_ISREG(info.st_mode) and info.st_mtime < cutoff:
                        os.unlink(path)
                        removed += 1
            return removed

    def _old_files(self, cutoff: float) -> tuple[int, list]:
        """(how many blob files are older than ``cutoff``, [(path, sha or None)] of those and of
        old temp files), from a scan that follows no link."""
        blobs, found = 0, []
        for shard in _scandir(self.blobs):
            if shard.name.startswith(".tmp-") and shard.is_file(follow_symlinks=False):
                if _mtime(shard) < cutoff:
                    found.append((Path(shard.path), None))
            elif _is_shard(shard):
                for entry in _scandir(shard.path):
                    if _is_blob_file(shard.name, entry) and _mtime(entry) < cutoff:
                        blobs += 1
                        found.append((Path(entry.path), entry.name[:64]))
        return blobs, found

    def _delete_rows(self, ids: list[str]) -> tuple[int, list[str]]:
        shas, count = set(), 0
        for start in range(0, len(ids), 500):  # stay under SQLite's variable limit
            chunk = ids[start:start + 500]
            marks = ",".join("?" * len(chunk))
            shas.update(r[0] for r in self.conn.execute(
                f"SELECT DISTINCT blob_sha256 FROM entries WHERE id IN ({marks})", chunk))
            count += self.conn.execute(f"DELETE FROM entries WHERE id IN ({marks})", chunk).rowcount
        return count, sorted(s for s in shas if validation.is_sha256(s))

    def _release_blobs(self, shas: list[str]) -> None:
        """After the commit: unlink the blobs no row uses any more (under the write lock)."""
        try:
            with self._write(bump=False):
                for sha in shas:
                    if self.conn.execute("SELECT 1 FROM entries WHERE blob_sha256 = ?",
                                         [sha]).fetchone():
                        continue  # shared, or re-added by a concurrent writer
                    path = self._blob_path(sha)
                    with contextlib.suppress(FileNotFoundError):
                        if path is not None and stat.S_ISREG(os.lstat(path).st_mode):
                            os.unlink(path)
                    _fault("delete-mid-unlink")
        except (sqlite3.Error, OSError, BankError) as exc:  # rows are gone already: say so
            warnings.warn(f"Chorus mask bank: entries deleted, but their blobs were not removed "
                          f"({exc}); `python -m chorus_core.bank verify {self.root}` removes "
                          "them later.", stacklevel=4)

    # ---- reading -------------------------------------------------------------------------
    @_guarded
    def stats(self) -> dict:
        """Counts and sizes: ``entries``, ``quarantined``, ``bytes``, ``hits``, ``schema_version``."""
        ok = self.conn.execute("SELECT COUNT(*), COALESCE(SUM(blob_bytes), 0), "
                               "COALESCE(SUM(hits), 0) FROM entries WHERE status = 'ok'").fetchone()
        bad = self.conn.execute("SELECT COUNT(*) FROM entries WHERE status != 'ok'").fetchone()[0]
        return {"path": str(self.root), "backend": "folder", "entries": ok[0], "bytes": ok[1], "hits": ok[2],
                "quarantined": bad, "schema_version": schema.schema_version(self.conn),
                "content_token": self.content_token()}

    @_guarded
    def entries(self, tag: str | None = None, limit: int | None = None,
                order: str = "created DESC") -> list[dict]:
        """Entry rows (without signature vectors), optionally only those carrying ``tag``.

        :param order: ``<column> [ASC|DESC]`` over created, last_hit, hits, density, recall,
            blob_bytes
        """
        if not _ORDER.fullmatch(order):
            raise BankInvalidArgument(f"order {order[:60]!r} must be one of created, last_hit, "
                                      "hits, density, recall, blob_bytes, optionally ASC/DESC.")
        sql = f"SELECT {_SUMMARY} FROM entries"
        params = []
        if tag is not None:
            sql += " WHERE EXISTS (SELECT 1 FROM json_each(entries.tags) WHERE value = ?)"
            params.append(tag)
        sql += f" ORDER BY {order}" + (f" LIMIT {int(limit)}" if limit else "")
        return [_decode_row(r) for r in self.db.query(sql, params)]


_SUMMARY = ("id, created, last_hit, hits, status, status_reason, tags, density, recall, "
            "steps, sampler, scheduler, shift, step_buckets, grid_t, grid_h, grid_w, "
            "token_order, block_q, block_k, fingerprint, compat, codec, blob_name, blob_bytes, "
            "blob_sha256")
_ORDER = re.compile(r"(created|last_hit|hits|density|recall|blob_bytes)( (ASC|DESC))?", re.I)


def _open_postgres(url: str, read_only: bool, create: bool) -> "BankStorage":
    try:
        from .pg_store import PostgresBank  # psycopg is needed only for PostgreSQL banks
    except ImportError as exc:
        raise BankError(f"PostgreSQL mask banks need psycopg 3 ({exc}); install it with "
                        "`pip install 'psycopg[binary]>=3.1'` in ComfyUI's Python.") from None
    return PostgresBank.open(url, read_only=read_only, create=create)


def _scandir(path):
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _mtime(entry) -> float:
    """Modification time of a scanned entry; +inf (never stale) when a concurrent prune or
    writer removed or renamed it since the scan."""
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return float("inf")


def _is_shard(entry) -> bool:
    return (len(entry.name) == 2 and all(c in "0123456789abcdef" for c in entry.name)
            and entry.is_dir(follow_symlinks=False))


def _is_blob_file(shard: str, entry) -> bool:
    name = entry.name
    return (name.endswith(validation.BLOB_SUFFIX) and name[:2] == shard
            and validation.is_sha256(name[:-len(validation.BLOB_SUFFIX)])
            and entry.is_file(follow_symlinks=False))


def _insert(conn: sqlite3.Connection, row: dict) -> None:
    cols = ", ".join(f"[{c}]" for c in row)
    conn.execute(f"INSERT INTO entries ({cols}) VALUES ({', '.join('?' * len(row))})",
                 list(row.values()))


def _signature_columns(signature: Signature) -> dict:
    """``sig_<component>`` values of a row: unit float32 bytes, or None where absent.

    :raises ValueError: a component that cannot be made a unit vector of length DIM
    """
    return {f"sig_{c}": (unit_component(c, signature.components[c]).tobytes()
                         if c in signature.components else None) for c in COMPONENTS}


def _entry_label(row: dict) -> str:
    """An entry's id when it is a valid one, else its row number (never a hostile string)."""
    return row.get("id") if validation.is_entry_id(row.get("id")) else f"(row {row['rowid']})"


def _as_bool_array(masks):
    if isinstance(masks, PackedBlockMaps):  # a recording: unpacked layer by layer by the encoder
        return masks
    if hasattr(masks, "detach"):  # torch tensor, without importing torch here
        masks = masks.detach().cpu().numpy()
    masks = np.asarray(masks)
    return masks if masks.dtype == bool else masks != 0


def _check_limit(name: str, value):
    """A prune limit: None, or a positive whole number; anything else would delete all."""
    if value is None:
        return None
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if ok and isinstance(value, (float, np.floating)):
        ok = bool(np.isfinite(value)) and float(value).is_integer()
    if not ok or value <= 0:
        flag = "--" + name.replace("_", "-")
        raise BankInvalidArgument(
            f"prune: {name} must be a positive whole number, got {value!r}; e.g. {flag} 20G "
            f"or {flag} 5000. A zero, negative, NaN or infinite limit is refused because it would "
            "delete every entry or none; to empty a bank, delete its folder.")
    return int(value)


def _doomed(rows: list[dict], max_bytes, max_entries) -> list[str]:
    total, count = sum(r["blob_bytes"] or 0 for r in rows), len(rows)
    doomed = []
    for row in rows:
        over_bytes = max_bytes is not None and total > max_bytes
        over_count = max_entries is not None and count > max_entries
        if not (over_bytes or over_count):
            break
        doomed.append(row["id"])
        total, count = total - (row["blob_bytes"] or 0), count - 1
    return doomed


def _decode_row(row: dict) -> dict:
    row = dict(row)
    for key in ("tags", "step_buckets", "fingerprint"):
        if isinstance(row.get(key), str):
            with contextlib.suppress(ValueError):  # a damaged row still lists
                row[key] = validation.load_json(row[key], key)
    return row


def _blob_metadata(meta: dict) -> dict:
    """One JSON value: safetensors writes several metadata keys in random order, which would
    break content addressing (equal masks must give equal bytes)."""
    return {"chorus": json.dumps(meta, sort_keys=True)}


def _export(self, out_path, tag=None, ids=None) -> int:
    """Write entries (all, one ``tag``'s, or ``ids``) and their blobs to one tar file.

    :param out_path: tar file to write (its folder must exist)
    :param tag: only entries carrying this tag
    :param ids: only these entry ids
    :return: number of entries exported
    """
    from .transfer import export_entries

    return export_entries(self, out_path, tag=tag, ids=ids)


def _import(self, in_path) -> dict:
    """Add the entries of an export file that this bank lacks, all or nothing.

    :param in_path: a tar written by :meth:`MaskBank.export`
    :return: ``{"added": n, "skipped": n}``
    """
    from .transfer import import_entries

    return import_entries(self, in_path)


BankStorage.export = _guarded(_export)
BankStorage.import_file = _guarded(_import)
