"""The storage interface of the mask bank: what every backend offers, and what they share.

:class:`BankStorage` holds the logic that is the same whichever engine stores the rows and
blobs (checking an entry, adding, matching, loading, deleting, pruning, export and import);
a backend (:mod:`.sqlite_store` for a folder, :mod:`.pg_store` for PostgreSQL) subclasses it
and provides the storage hooks listed in its docstring. This module imports neither backend:
:func:`chorus_core.bank.open_bank` chooses one from the location.
"""

from __future__ import annotations

import functools
import hashlib
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from . import budget as budgets
from . import transfer, validation
from .encoding import PackedBlockMaps, encode_masks
from .entry_masks import EntryMasks
from .errors import BankEntryCorrupt, BankError, BankIncompatible, BankInvalidArgument, BankReadOnly
from .faults import fault
from .fingerprint import ModelFingerprint
from .matching import MatchResult, stack_vectors
from .merge_store import MergeStore
from .records import LatentLayout, Schedule
from .rows import blob_metadata, build_row, compat_key, decode_row, entry_label, signature_columns
from .signature import COMPONENTS, DIM, Signature, cosine

# Entries found damaged in read-only banks: {bank's skip key: {entry id: reason}}.
# Kept for the whole process so a bad entry is tried once, not on every request.
_READ_ONLY_SKIPS: dict[str, dict[str, str]] = {}


def guarded(method):
    """Turn database and OS errors escaping a public method into a BankError (each backend's
    ``_guard`` knows its own errors): callers treat every BankError as "no masks from the
    bank" and never see a traceback."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._guard(method.__name__.strip("_").replace("_", " ")):
            return method(self, *args, **kwargs)

    return wrapper


class BankStorage(MergeStore):
    """What every mask bank backend offers, and the logic they share.

    Public API (the same on every backend): ``open`` (usually through
    :func:`chorus_core.bank.open_bank`, which picks the backend from the location),
    ``add_entry``, ``has_entry``, ``match``, ``load_masks``, ``compatible_entries``, ``quarantine``,
    ``verify``, ``delete``, ``prune``, ``eviction_order``, ``budget``, ``set_budget``,
    ``budget_status``, ``stats``, ``entries``, ``recent``,
    ``show``, ``export``, ``import_file``, ``content_token``, ``close``, ``reopen``; for
    export and import (:mod:`.transfer`) also ``check_writable``, ``read_entry_blob``,
    ``stage_blob`` and ``add_imported_rows``; attributes ``read_only``, ``label`` (the
    location as it may be shown: never a password), ``root`` (the bank folder, or None for a bank
    without one, such as PostgreSQL: caches that need files keep them in memory then) and
    ``signature_index`` (:mod:`.open_banks` gives one bank's objects in all threads the same).

    A backend provides: ``db`` (``query(sql, params)`` with ``?`` placeholders over its own
    connection), ``_guard(what)`` (turns its errors into BankError), ``_write(bump, removal)``
    (one serialised write transaction), ``_bump``, ``_meta``, ``_get_row``, ``_has_entry``,
    ``_read_blob(sha, size) -> (data, reason)``, ``_store_entry(row, data)``,
    ``stage_blob(data, sha)``, ``_import_row(row, read_data)``, ``_record_hit``,
    ``_quarantine_row``, ``_skip_key``, ``_delete_rows(ids) -> (count, blobs to release)``,
    ``_quarantined_blobs()`` and ``_remove_quarantined(keys)`` (the kept quarantined blobs, which
    count against the budget), for merges (merge_store.py) ``_put_merged_blob(data, sha)`` (durable
    before the row names it) and ``_renumber(id)`` (the next rowid: signature indexes append by
    rowid) and, where blobs live outside the database, ``_release_blobs``.
    """

    root: Path | None
    read_only: bool

    def reopen(self) -> "BankStorage":
        """The same bank on a new connection (e.g. for a writer thread), same read_only."""
        raise NotImplementedError

    def check_writable(self) -> None:
        """:raises BankReadOnly: the bank was opened read-only"""
        if self.read_only:
            raise BankReadOnly(f"The bank at {self.label} was opened read-only; "
                               "open it with read_only=False to change it.")

    # ---- removal (the same on every backend) ---------------------------------------------
    @guarded
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
            count, released = self._drop_rows(ids)
            fault("delete-before-commit")
        fault("delete-after-commit")
        self._release_blobs(released)
        return count

    @guarded
    def eviction_order(self) -> list[dict]:
        """Rows in the order :meth:`prune` removes them: quarantined first, then least
        recently used (creation time counts as a use), fewer hits first on ties."""
        return list(self.db.query(
            "SELECT id, blob_bytes, hits, COALESCE(last_hit, created) AS last_use FROM entries "
            "ORDER BY status = 'ok', last_use, hits, created"))

    @guarded
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
            self.check_writable()
        max_bytes = budgets.check_prune_limit("max_bytes", max_bytes)
        max_entries = budgets.check_prune_limit("max_entries", max_entries)
        if dry_run:
            return budgets.prune_order_cut(self.eviction_order(), max_bytes, max_entries)
        with self._write(bump=False):  # choose and delete in one transaction
            doomed = budgets.prune_order_cut(self.eviction_order(), max_bytes, max_entries)
            released = self._drop_rows(doomed)[1] if doomed else []
            if doomed:
                self._bump("generation")
                self._bump("removals")
            fault("prune-before-commit")
        fault("prune-after-commit")
        self._release_blobs(released)
        return doomed

    # ---- the budget (budget.py: what it is and which entries are worth least) -------------
    @guarded
    def budget(self) -> budgets.Budget:
        """The budget stored in this bank (every process writing it keeps the same one)."""
        rows = self.db.query("SELECT key, value FROM meta WHERE key IN (?, ?)",
                             [budgets.BYTES_KEY, budgets.ENTRIES_KEY])
        return budgets.budget_from_meta({r["key"]: r["value"] for r in rows})

    @guarded
    def set_budget(self, max_bytes: int | None = None, max_entries: int | None = None) -> budgets.Eviction:
        """Store the bank's budget and evict at once what no longer fits; every later write keeps it.

        :param max_bytes: most bytes of blobs (healthy entries with their merge votes, and kept quarantined
            blobs); None: no limit
        :param max_entries: most healthy entries; None: no limit (both None removes the budget)
        :return: what was evicted to fit
        :raises BankInvalidArgument: a limit that is not a positive whole number
        """
        self.check_writable()
        wanted = budgets.check_budget(max_bytes, max_entries)
        with self._write(bump=False):
            for key, value in ((budgets.BYTES_KEY, wanted.max_bytes), (budgets.ENTRIES_KEY, wanted.max_entries)):
                self.db.execute("DELETE FROM meta WHERE key = ?", [key])
                if value is not None:
                    self.db.execute("INSERT INTO meta (key, value) VALUES (?, ?)", [key, str(value)])
            eviction, released = self._keep_budget()
        self._release_blobs(released)
        if eviction:
            budgets.note_eviction(self.label, eviction)
        return eviction

    @guarded
    def budget_status(self) -> dict:
        """The budget and what counts against it: ``max_bytes``, ``max_entries``, ``bytes`` (healthy
        entries' blobs and merge votes, plus kept quarantined blobs), ``entries``, ``quarantined_blobs``,
        ``quarantined_bytes``."""
        held = self.db.query(budgets.HELD_SQL)
        held = next(iter(held))
        quarantined = self._quarantined_blobs()
        q_bytes = sum(q["bytes"] for q in quarantined)
        limit = self.budget()
        return {"max_bytes": limit.max_bytes, "max_entries": limit.max_entries,
                "bytes": int(held["b"]) + q_bytes, "entries": int(held["n"]),
                "quarantined_blobs": len(quarantined), "quarantined_bytes": q_bytes}

    def _keep_budget(self, protect=(), written: str | None = None) -> tuple[budgets.Eviction, list]:
        """Inside a write transaction (the bank's lock held, so the budget and the rows are those
        every other writer sees): evict the entries worth least until the bank fits its budget,
        and quarantined blobs past their keeping time. Returns (what went, blobs to release after
        the commit). The rows and their blobs go in this transaction, or (folder bank) the blobs
        after it: a crash leaves unreferenced blobs, never a row without its blob."""
        limit = self.budget()
        quarantined = self._quarantined_blobs()
        if not limit.limited and not quarantined:
            return budgets.Eviction(budget=limit, written=written), []
        rows = list(self.db.query(budgets.ENTRY_COSTS_SQL))
        doomed, drop_q = budgets.choose_evictions(rows, quarantined, limit, time.time(), protect=set(protect))
        gone, gone_q = set(doomed), set(drop_q)
        freed = sum(r["blob_bytes"] or 0 for r in rows if r["id"] in gone)
        freed += sum(q["bytes"] for q in quarantined if q["key"] in gone_q)
        self._remove_quarantined(drop_q)
        released = self._drop_rows(doomed)[1] if doomed else []
        if doomed:
            self._bump("generation")
            self._bump("removals")
        fault("evict-before-commit")
        return budgets.Eviction(doomed, freed, len(drop_q), limit, written), released

    def _release_blobs(self, keys: list) -> None:
        """After a deletion commits: remove blobs kept outside the database (none by default)."""

    def _skip_for_this_process(self, row: dict, reason: str, warn: bool) -> None:
        """A read-only bank cannot quarantine: say so, and skip the entry for the rest of the process."""
        _READ_ONLY_SKIPS.setdefault(self._skip_key, {})[row.get("id")] = reason
        if warn:
            warnings.warn(f"Chorus mask bank: would quarantine entry {entry_label(row)}: {reason}. The "
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
    @guarded
    def add_entry(self, fingerprint: ModelFingerprint, layout: LatentLayout, schedule: Schedule,
                  masks, signature: Signature, density: float, recall: float | None = None,
                  tags=(), coarsen: int = 1, entry_id: str | None = None) -> str:
        """Store recorded masks and return the new entry's id, or, when the bank has a merge policy
        (:meth:`set_merge_policy`) and a compatible entry is close in signature and masks, merge them
        into that entry and return its id (``merge.merged_into(entry_id)`` then names it).

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
        self.check_writable()
        if entry_id is not None and not validation.is_entry_id(entry_id):
            raise BankInvalidArgument(f"entry_id must be 32 lowercase hex characters, got {entry_id!r}; "
                                      "leave it out to get a new one.")
        try:
            signature_columns(signature)  # checked before any encoding (_row stores them)
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
        entry_id = entry_id or uuid.uuid4().hex  # a background write names its entry up front
        if coarsen == 1:  # a coarsened entry cannot vote block by block with full-size recordings
            merged = self._merge_if_close(entry_id, fingerprint, layout, schedule, masks, signature)
            if merged is not None:
                return merged
        tensors, meta = encode_masks(masks, coarsen=coarsen)
        data = st_save(tensors, metadata=blob_metadata(meta))
        sha = hashlib.sha256(data).hexdigest()
        row = self._row(entry_id, fingerprint, layout, schedule, signature, density, recall,
                        tags, validation.blob_name(sha), len(data), sha)
        eviction = self._store_entry(row, data)  # keeps the budget in the same transaction
        if eviction:
            budgets.note_eviction(self.label, eviction)
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

    # ---- merging instead of adding (merge.py: when; merge_store.py: how) ----------------
    merge_policy = guarded(MergeStore.merge_policy)
    set_merge_policy = guarded(MergeStore.set_merge_policy)
    merge_status = guarded(MergeStore.merge_status)

    def _drop_rows(self, ids: list[str]) -> tuple[int, list]:
        """Inside a write: delete rows (the backend's ``_delete_rows``) and the votes they kept."""
        count, released = self._delete_rows(ids)
        self._forget_votes(ids)
        return count, released

    def _unused_after_switch(self, sha: str) -> list:
        """Inside a merge's write: the old blob, to release after the commit (if no row uses it)."""
        return [sha]

    # Kept as a method: hostile-bank tests build rows for hand-made entries through it.
    _row = staticmethod(build_row)

    @guarded
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
        index = self.signature_index
        if (counters := self._counters_if_moved()) is not None:
            index.refresh(self.db, *counters)
        compat, top_k = compat_key(fingerprint, layout), max(1, top_k)
        skipped = self._skipped()
        if not skipped:
            return index.match(self.db, compat, signature, threshold, top_k, weights)
        result = index.match(self.db, compat, signature, threshold, top_k + len(skipped), weights)
        return self._without_skipped(result, skipped, signature, threshold, top_k)

    def _counters_if_moved(self) -> tuple[int, int] | None:
        """(generation, removals) to refresh the signature index by; None: known not to have moved."""
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

    @guarded
    def compatible_entries(self, fingerprint: ModelFingerprint, layout: LatentLayout, limit: int = 8) -> list[str]:
        """Ids of healthy entries interchangeable with this model and layout, most recently used first.

        :param limit: at most this many ids
        """
        skipped = self._skipped()
        rows = self.db.query("SELECT id FROM entries WHERE compat = ? AND status = 'ok' "
                             "ORDER BY COALESCE(last_hit, created) DESC LIMIT ?",
                             [compat_key(fingerprint, layout), int(limit) + len(skipped)])
        return [row["id"] for row in rows if row["id"] not in skipped][:int(limit)]

    @guarded
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
        row, reason, loaded = self._read_through_merges(row)
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

    @guarded
    def has_entry(self, entry_id: str) -> bool:
        """Whether the bank holds a row of this id, healthy or quarantined, or a recording of this id
        merged into an entry lately (a spool replay asks: it must not add or merge it twice)."""
        return self._has_entry(str(entry_id)) or self._was_merged(str(entry_id))

    @guarded
    def entry_schedule(self, entry_id: str) -> Schedule:
        """The schedule an entry was recorded under (steps, buckets, sigmas), from its index row:
        no blob read. :raises BankError: no such entry; ValueError: the row's schedule is unreadable"""
        return validation.entry_spec(self._get_row(entry_id)).schedule

    @guarded
    def show(self, entry_id: str) -> dict:
        """One entry as a dict, without signature vectors."""
        row = self._get_row(entry_id)
        return decode_row({k: v for k, v in row.items() if not k.startswith("sig_") and k != "rowid"})

    # ---- export and import (the file format is transfer.py's) -----------------------------
    @guarded
    def export(self, out_path, tag=None, ids=None) -> int:
        """Write entries (all, one ``tag``'s, or ``ids``) and their blobs to one tar file.

        :param out_path: tar file to write (its folder must exist)
        :param tag: only entries carrying this tag
        :param ids: only these entry ids
        :return: number of entries exported
        """
        return transfer.export_entries(self, out_path, tag=tag, ids=ids)

    @guarded
    def import_file(self, in_path) -> dict:
        """Add the entries of an export file that this bank lacks, all or nothing.

        :param in_path: a tar written by :meth:`export`
        :return: ``{"added": n, "skipped": n}``
        """
        return transfer.import_entries(self, in_path)

    @guarded
    def read_entry_blob(self, entry_id: str) -> tuple[dict, bytes] | None:
        """An entry's row and its blob's bytes, checked as :meth:`load_masks` checks them;
        None when the blob fails a check (the entry is quarantined first; read-only: it is
        skipped for the rest of the process).

        :raises BankError: no such entry
        """
        row = self._get_row(entry_id)
        reason, loaded = self._problem(row)
        if reason is not None:
            self._quarantine_row(row, reason, recheck=True)
            return None
        return row, loaded[1]

    @guarded
    def add_imported_rows(self, rows: list[dict], read_data) -> dict:
        """Insert the ``rows`` this bank lacks (by id) in short write transactions, so a large
        import never holds the write lock long (recordings and hits of every process go on
        meanwhile). Every row and blob was checked before (nothing is added from a
        bad file); an import stopped half-way leaves whole entries, and running it again adds the rest.

        :param rows: checked rows, as :func:`.transfer.rebuild_row` builds them
        :param read_data: ``read_data(row)`` gives the row's blob bytes, read and checked again
            (the backend stores them: PostgreSQL always, read before its transaction; a folder
            when the blob staged by :meth:`stage_blob` was removed or damaged meanwhile)
        :return: ``{"added": n, "skipped": n}`` (skipped: id already present)
        """
        pending = [row for row in rows if not self._has_entry(row["id"])]  # reruns skip without the lock
        added, skipped = 0, len(rows) - len(pending)
        while pending:
            handled, present = self._import_batch(pending, read_data)
            pending = pending[handled:]
            added, skipped = added + handled - present, skipped + present
            if pending:
                time.sleep(self._import_pause_s)  # a writer waiting for the lock gets it now
        return {"added": added, "skipped": skipped}

    # A folder bank's waiting writer polls for the lock (SQLite's busy handler sleeps up to 100 ms):
    # an import commits at least every 0.25 s and then pauses for it. PostgreSQL queues the waiters
    # of its advisory lock: one row per transaction, no pause.
    _import_transaction_s, _import_pause_s = 0.25, 0.12

    def _import_batch(self, rows: list[dict], read_data) -> tuple[int, int]:
        """Rows from the front of ``rows`` in one write transaction (one row, more while it stays
        under ``_import_transaction_s``): (rows handled, how many of them were present already)."""
        started, handled, present = time.monotonic(), 0, 0
        reader = self._import_reader(rows[0], functools.partial(read_data, rows[0]))
        with self._write(bump=False):
            for row in rows:
                if handled and time.monotonic() - started > self._import_transaction_s:
                    break
                if handled:
                    reader = self._import_reader(row, functools.partial(read_data, row))
                if self._has_entry(row["id"]):  # under the lock: another import may have added it
                    present += 1
                else:
                    self._import_row(row, reader)
                handled += 1
            fault("import-before-commit")
            eviction, released = budgets.Eviction(), []
            if handled > present:
                self._bump("generation")
                eviction, released = self._keep_budget()  # an import is a write: it keeps the budget too
        self._release_blobs(released)
        if eviction:
            budgets.note_eviction(self.label, eviction)
        return handled, present

    def _import_reader(self, row: dict, read_data):
        """What :meth:`_import_row` gets to read the blob with; a backend that always stores it
        reads it here, before its transaction (PostgreSQL)."""
        return read_data


def warn_quarantined(label: str, reason: str) -> None:
    """The one warning both backends give when they quarantine an entry (pointing at the caller
    of the bank method that found it)."""
    warnings.warn(f"Chorus mask bank: quarantining entry {label}: {reason}. "
                  "Requests that matched it run as an online-prediction miss (dense with "
                  "miss_mode \"dense\") and record a fresh entry when record_on_miss is on.", stacklevel=5)


def _as_bool_array(masks):
    if isinstance(masks, PackedBlockMaps):  # a recording: unpacked layer by layer by the encoder
        return masks
    if hasattr(masks, "detach"):  # torch tensor, without importing torch here
        masks = masks.detach().cpu().numpy()
    masks = np.asarray(masks)
    return masks if masks.dtype == bool else masks != 0
