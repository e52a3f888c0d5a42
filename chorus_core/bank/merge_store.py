"""How a merge is stored: the read-modify-write of one entry under its bank's write lock.

:mod:`.merge` says when a recording merges and what a merged entry serves; :class:`MergeStore`, a
base class of :class:`.storage.BankStorage`, does it on any backend through the storage's own hooks
(``_write``, ``_problem``, ``_bump``, ``_keep_budget``, ``_release_blobs``, ``_put_merged_blob``,
``_renumber``, ``_unused_after_switch``).
Votes and remembered recording ids are ``meta`` rows, so both backends keep them in the same
transaction as the entry's row.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from . import budget as budgets
from . import merge as merging
from . import validation
from .encoding import CODEC, PackedBlockMaps, encode_masks
from .entry_masks import EntryMasks
from .errors import BankError
from .faults import fault
from .records import Schedule
from .rows import blob_metadata, schedule_columns, signature_columns
from .signature import COMPONENTS, DIM, Signature


class MergeStore:
    """The merge half of :class:`.storage.BankStorage` (one of its base classes): its methods use
    the storage's own hooks through ``self``."""

    def merge_policy(self) -> merging.MergePolicy:
        """The merge policy stored in this bank (off unless set: every writer of the bank follows it)."""
        rows = self.db.query("SELECT key, value FROM meta WHERE key IN (?, ?)",
                             [merging.SIMILARITY_KEY, merging.AGREEMENT_KEY])
        return merging.policy_from_meta({r["key"]: r["value"] for r in rows})

    def set_merge_policy(self, similarity: float | None = None,
                         agreement: float | None = None) -> merging.MergePolicy:
        """Store when a recording merges into an entry instead of adding one (both None: never).

        :param similarity: least signature similarity to a compatible entry (weighted cosine)
        :param agreement: least Jaccard agreement of the recording's masks with the entry's
        :raises BankInvalidArgument: only one given, or a value outside (0, 1]
        """
        self.check_writable()
        wanted = merging.check_policy(similarity, agreement)
        with self._write(bump=False):
            self._put_meta(merging.SIMILARITY_KEY, None if wanted.similarity is None else repr(wanted.similarity))
            self._put_meta(merging.AGREEMENT_KEY, None if wanted.agreement is None else repr(wanted.agreement))
        return wanted

    def merge_status(self) -> dict:
        """The policy and what merging keeps: ``similarity``, ``agreement``, ``voted_entries`` (entries
        that absorbed recordings), ``votes_bytes`` (their kept votes, stored outside the blobs and not
        counted by the budget)."""
        policy = self.merge_policy()
        rows = list(self.db.query("SELECT value FROM meta WHERE key LIKE ?", [merging.VOTES_PREFIX + "%"]))
        return {"similarity": policy.similarity, "agreement": policy.agreement, "voted_entries": len(rows),
                "votes_bytes": sum(len(r["value"]) for r in rows)}

    def _merge_if_close(self, recording_id, fingerprint, layout, schedule, masks, signature) -> str | None:
        """The entry this recording merged into, or None when it is to be added: merging off,
        nothing close enough, or the entry went or changed in a way that forbids it meanwhile."""
        policy = self.merge_policy()
        if not policy.on:
            return None
        masks = unpacked(masks)
        target = self._merge_target(policy, fingerprint, layout, schedule, masks, signature)
        if target is None:
            return None
        merged, eviction = self._merge_into(target, recording_id, masks, signature, schedule)
        if eviction:
            budgets.note_eviction(self.label, eviction)
        if merged is not None:
            merging.note_merge(recording_id, merged)
        return merged

    def _merge_target(self, policy, fingerprint, layout, schedule, masks, signature) -> str | None:
        """Without the write lock (cheap, and a miss's write should not block hits): the most similar
        compatible entry, if its signature and its masks are both close enough to the recording's."""
        found = self.match(signature, fingerprint, layout, threshold=policy.similarity)
        if not found.hit:
            return None
        try:
            if schedule_columns(self.entry_schedule(found.entry_id)) != schedule_columns(schedule):
                return None  # another step count or sigmas: its buckets do not line up with ours
            entry = self.load_masks(found.entry_id, record_hit=False)
            current = all_block_maps(entry)
        except (BankError, ValueError):  # removed, quarantined or unreadable meanwhile: add instead
            return None
        if current.shape != masks.shape or merging.agreement(current, masks) < policy.agreement:
            return None
        return found.entry_id

    def _merge_into(self, target: str, recording_id: str, masks: np.ndarray, signature: Signature,
                  schedule: Schedule) -> tuple[str | None, budgets.Eviction]:
        """Read-modify-write of one entry under the bank's write lock, so concurrent merges into it
        all count. The new blob is stored before the row points at it, and the row, its votes and the
        old blob's removal commit together (the folder bank unlinks the old file after the commit):
        a crash leaves the old entry or the new one. Returns (entry id or None, eviction)."""
        now = time.time()
        with self._write(bump=False):  # bumped below, only when the entry changes
            current, row = self._current_masks(target, schedule)
            if current is None or current.shape != masks.shape:
                return None, budgets.Eviction()
            stored = self._meta_value(merging.VOTES_PREFIX + target)
            votes = (merging.Votes.from_text(stored, current.shape) if stored else None) \
                or merging.Votes.start(current, row_signature(row))
            votes.absorb(masks, signature)
            consensus = votes.consensus(masks)
            tensors, meta = encode_masks(consensus)
            data = st_save(tensors, metadata=blob_metadata(meta))
            sha = hashlib.sha256(data).hexdigest()
            self._put_merged_blob(data, sha)
            fault("merge-blob-written")
            moved = votes.signature() if votes.n >= merging.MEAN_SIGNATURE_FROM else row_signature(row)
            self._switch_entry(target, sha, len(data), float(consensus.mean()), moved, now)
            self._bump("generation")  # its masks and signature changed: caches keyed by content refresh
            self._put_meta(merging.VOTES_PREFIX + target, votes.to_text())
            self._note_merged_id(recording_id, target, now, sweep=votes.n % 32 == 0)
            released = [] if row["blob_sha256"] == sha else self._unused_after_switch(row["blob_sha256"])
            eviction, evicted = self._keep_budget(protect=[target], written=target)
            fault("merge-before-commit")
        fault("merge-after-commit")
        self._release_blobs(released + list(evicted))
        return target, eviction

    def _current_masks(self, entry_id: str, schedule: Schedule):
        """Inside the write: (the entry's masks ``[S, L, H, nq, nk]``, its row) as committed now, or
        (None, row) when it is gone, quarantined, coarsened, damaged or of another schedule."""
        rows = list(self.db.query("SELECT * FROM entries WHERE id = ?", [entry_id]))
        row = rows[0] if rows else None
        if row is None or row["status"] != "ok":
            return None, row
        reason, loaded = self._problem(row)
        if reason is not None:
            return None, row  # a reader quarantines it; a recording never builds on a damaged entry
        spec, data, meta = loaded
        if schedule_columns(spec.schedule) != schedule_columns(schedule) or meta.get("coarsen", "1") != "1":
            return None, row
        try:
            return all_block_maps(EntryMasks(entry_id, spec.schedule, spec.layout, st_load(data), meta)), row
        except Exception:  # an undecodable layer set: add instead, verify quarantines it
            return None, row

    def _switch_entry(self, entry_id: str, sha: str, size: int, density: float, signature: Signature,
                     now: float) -> None:
        """Point the row at its merged masks and mean signature; one more use; moved to the newest
        rowid so every process's signature index (which appends rows by rowid) picks it up."""
        cols = {"blob_sha256": sha, "blob_name": validation.blob_name(sha), "blob_bytes": size,
                "density": density, "recall": None, "codec": CODEC, **signature_columns(signature)}
        sets = ", ".join(f"{name} = ?" for name in cols)
        self.db.execute(f"UPDATE entries SET {sets}, hits = COALESCE(hits, 0) + 1, "
                        "last_hit = ? WHERE id = ?", [*cols.values(), now, entry_id])
        self._renumber(entry_id)

    def _note_merged_id(self, recording_id: str, target: str, now: float, sweep: bool) -> None:
        """Remember the recording's id (has_entry answers True: a spool replay does not merge it
        twice); now and then forget those older than ``MERGED_ID_KEEP_S``. Values start with a
        fixed-width time so that text order is time order on both backends."""
        self._put_meta(merging.MERGED_PREFIX + recording_id, f"{now:013.0f} {target}")
        if sweep:
            self.db.execute("DELETE FROM meta WHERE key LIKE ? AND value < ?",
                            [merging.MERGED_PREFIX + "%", f"{now - merging.MERGED_ID_KEEP_S:013.0f}"])

    def _was_merged(self, entry_id: str) -> bool:
        """Whether a recording of this id merged into an entry in the last ``MERGED_ID_KEEP_S``."""
        return validation.is_entry_id(entry_id) and self._meta_value(merging.MERGED_PREFIX + entry_id) is not None

    def _read_through_merges(self, row: dict, tries: int = 3) -> tuple:
        """``(row, reason, loaded)`` as ``self._problem`` gives for the entry of ``row``; when its blob
        fails because a merge switched the row to a new blob meanwhile (the old one is released after
        that commit), the row is read again and its new blob checked, so a reader racing a merge is
        served the merged masks instead of taking the entry for damaged."""
        reason, loaded = self._problem(row)
        while reason is not None and tries > 0:
            tries -= 1
            try:
                fresh = self._get_row(row["id"])
            except BankError:  # evicted or deleted meanwhile: the caller sees the first failure
                break
            if fresh.get("blob_sha256") == row.get("blob_sha256") or fresh.get("status") != "ok":
                break  # the same blob, really damaged: quarantine it as before
            row = fresh
            reason, loaded = self._problem(row)
        return row, reason, loaded

    def _meta_value(self, key: str) -> str | None:
        rows = list(self.db.query("SELECT value FROM meta WHERE key = ?", [key]))
        return rows[0]["value"] if rows else None

    def _put_meta(self, key: str, value: str | None) -> None:
        """Inside a write: set (or, None, remove) one meta row."""
        self.db.execute("DELETE FROM meta WHERE key = ?", [key])
        if value is not None:
            self.db.execute("INSERT INTO meta (key, value) VALUES (?, ?)", [key, value])

    def _forget_votes(self, ids: list[str]) -> None:
        """Inside the write that deletes these entries: the votes they kept go with them."""
        for start in range(0, len(ids), 500):  # stay under SQLite's variable limit
            chunk = ids[start:start + 500]
            self.db.execute(f"DELETE FROM meta WHERE key IN ({','.join('?' * len(chunk))})",
                            [merging.VOTES_PREFIX + i for i in chunk])


def unpacked(masks) -> np.ndarray:
    """Bool ``[S, L, H, nq, nk]`` from a recording (packed or not): what votes are counted on."""
    if not isinstance(masks, PackedBlockMaps):
        return masks
    s_count, layers = masks.shape[:2]
    return np.stack([np.stack([masks.layer_set(s, layer) for layer in range(layers)]) for s in range(s_count)])


def all_block_maps(entry: EntryMasks) -> np.ndarray:
    """Every layer set of an entry, checked, as bool ``[S, L, H, nq, nk]``."""
    s_count, layers = entry.shape[:2]
    return np.stack([np.stack([entry.block_map_numpy(s, layer) for layer in range(layers)])
                     for s in range(s_count)])


def row_signature(row: dict) -> Signature:
    """The signature stored in a row (components of the right length only)."""
    return Signature({c: np.frombuffer(bytes(row[f"sig_{c}"]), np.float32).copy() for c in COMPONENTS
                      if row.get(f"sig_{c}") is not None and len(bytes(row[f"sig_{c}"])) == DIM * 4})
