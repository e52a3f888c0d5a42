"""Merge instead of add: when a recording joins an existing entry, and what the entry then serves.

A bank that adds an entry per miss grows with its traffic's volume; most of those entries are
near-copies of one kind of request (one effect template at one layout). With a merge policy set
(stored in the bank's ``meta`` table, like the budget, so every writer of a shared bank merges
alike), a recording whose signature is within ``similarity`` of a compatible entry and whose masks
agree with that entry's by at least ``agreement`` (Jaccard over every block) is absorbed by it:

* the entry counts one more use (``hits + 1``, ``last_hit`` now): the recording was a request of its kind;
* once it holds :data:`MEAN_SIGNATURE_FROM` recordings, its signature becomes their mean (the kind's
  centre, closer to the next photo of the kind than any one photo is: more later requests hit);
  before that it keeps its first signature, so it still misses, records and learns;
* its masks become the consensus of the absorbed recordings: per block, how many of them kept it
  (the *votes*, kept with the entry), re-thresholded per query row at the mean number of blocks the
  recordings kept in that row. Blocks one photo happened to need drop out and blocks the kind needs
  stay, so an entry that has seen more requests serves better masks.

Votes and signature sums live in the ``meta`` row ``votes:<entry id>`` (per layer set, zlib), so no
schema change is needed and older readers read a merged entry as any other: its blob is an ordinary
mask blob. Nothing here touches storage; :meth:`BankStorage.add_entry` does the read-modify-write
under the bank's write lock.
"""

from __future__ import annotations

import base64
import json
import threading
import zlib
from dataclasses import dataclass

import numpy as np

from .errors import BankInvalidArgument
from .signature import COMPONENTS, DIM, Signature

SIMILARITY_KEY, AGREEMENT_KEY = "merge_similarity", "merge_agreement"
VOTES_PREFIX, MERGED_PREFIX = "votes:", "merged:"
# Votes are uint8: when an entry has absorbed this many recordings every count is halved, so the
# consensus follows a kind that drifts and counts never overflow.
MAX_ABSORBED = 254
# An entry keeps its first recording's signature until it holds this many recordings, then moves to
# their mean. At the mean an entry hits nearly every request of its kind, so it records, and learns,
# no more; measured on the lifecycle stream, a consensus of 2 recordings serves no better than one
# (recall 0.8897 vs 0.8895), of 3 0.8951, of 5 0.8991. Moving at 5 kept the hit rate of never merging
# (0.9862 vs 0.9859) with served recall 0.8987 vs 0.8898; moving at once: 0.9941 and 0.8877.
MEAN_SIGNATURE_FROM = 5
# A recording id stays answerable by has_entry this long after it merged (a spool replay after a
# crash between the merge's commit and the spool file's removal must not merge it twice).
MERGED_ID_KEEP_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class MergePolicy:
    """When a recording merges into an entry instead of adding one; None values: merging is off."""

    similarity: float | None = None
    agreement: float | None = None

    @property
    def on(self) -> bool:
        return self.similarity is not None and self.agreement is not None


def check_policy(similarity, agreement) -> MergePolicy:
    """A policy from user values: both None (off) or both numbers in (0, 1].

    :raises BankInvalidArgument: one given without the other, or out of range
    """
    if similarity is None and agreement is None:
        return MergePolicy()
    for name, value in (("similarity", similarity), ("agreement", agreement)):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < float(value) <= 1
        if not ok:
            raise BankInvalidArgument(f"merge {name} must be a number in (0, 1], got {value!r}; give both "
                                      "thresholds (e.g. similarity=0.8, agreement=0.6), or neither to turn "
                                      "merging off.")
    return MergePolicy(float(similarity), float(agreement))


def policy_from_meta(values: dict) -> MergePolicy:
    """The policy stored in a bank's meta rows; a damaged value means off, never "merge everything"."""
    try:
        return check_policy(float(values[SIMILARITY_KEY]), float(values[AGREEMENT_KEY]))
    except (KeyError, TypeError, ValueError, BankInvalidArgument):
        return MergePolicy()


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard agreement of two bool block maps of one shape: blocks both keep / blocks either keeps."""
    union = np.count_nonzero(a | b)
    return float(np.count_nonzero(a & b)) / union if union else 1.0


@dataclass
class Votes:
    """What an entry has absorbed: ``n`` recordings, per-block keep counts ``[S, L, H, nq, nk]``
    (uint8) and the sum of their unit signature components."""

    n: int
    counts: np.ndarray
    signature_sum: dict

    @classmethod
    def start(cls, masks: np.ndarray, signature: Signature) -> "Votes":
        """The votes of an entry that has absorbed nothing yet: its own masks and signature, once."""
        return cls(1, masks.astype(np.uint8), _unit_components(signature))

    def absorb(self, masks: np.ndarray, signature: Signature) -> None:
        if self.n >= MAX_ABSORBED:  # forget half: uint8 never overflows, a drifting kind is followed
            self.counts //= 2
            self.n //= 2
            self.signature_sum = {c: v / 2 for c, v in self.signature_sum.items()}
        self.counts += masks.astype(np.uint8)
        self.n += 1
        for comp, vec in _unit_components(signature).items():
            self.signature_sum[comp] = self.signature_sum.get(comp, np.zeros(DIM, np.float64)) + vec

    def signature(self) -> Signature:
        """The mean signature of the absorbed recordings (each component normalised by the bank)."""
        return Signature({c: (v / max(np.linalg.norm(v), 1e-12)).astype(np.float32)
                          for c, v in self.signature_sum.items() if np.linalg.norm(v) > 1e-12})

    def consensus(self, newest: np.ndarray) -> np.ndarray:
        """Per query row, the blocks most recordings kept, as many as they kept on average there;
        ties go to the newest recording's blocks. Every row keeps at least one block."""
        counts = self.counts.astype(np.float32)
        keep = np.maximum(1, np.rint(counts.sum(-1, keepdims=True) / self.n)).astype(np.int64)
        score = counts + 0.5 * newest  # votes are whole numbers: the newest only breaks ties
        order = np.argsort(-score, axis=-1, kind="stable")
        ranks = np.empty_like(order)
        np.put_along_axis(ranks, order, np.arange(score.shape[-1])[None], -1)
        return ranks < keep

    # ---- stored form (a meta row's text) ----------------------------------------------------
    def to_text(self) -> str:
        return json.dumps({
            "n": self.n, "shape": list(self.counts.shape),
            "counts": base64.b64encode(zlib.compress(self.counts.tobytes(), 6)).decode(),
            "sig": {c: base64.b64encode(v.astype(np.float32).tobytes()).decode()
                    for c, v in self.signature_sum.items()}})

    @classmethod
    def from_text(cls, text: str, shape: tuple) -> "Votes | None":
        """The stored votes, or None when they are unreadable or of another shape (then the
        entry starts its votes again from its current masks: a vote lost, never a bad mask)."""
        try:
            doc = json.loads(text)
            if tuple(doc["shape"]) != tuple(shape) or not 1 <= int(doc["n"]) <= MAX_ABSORBED:
                return None
            size = int(np.prod(shape))
            raw = zlib.decompressobj().decompress(base64.b64decode(doc["counts"]), size + 1)
            if len(raw) != size:
                return None
            sig = {c: np.frombuffer(base64.b64decode(doc["sig"][c]), np.float32).astype(np.float64)
                   for c in doc["sig"] if c in COMPONENTS}
            if any(v.shape != (DIM,) or not np.isfinite(v).all() for v in sig.values()):
                return None
            counts = np.frombuffer(raw, np.uint8).reshape(shape).copy()
            return cls(int(doc["n"]), counts, sig)
        except (ValueError, KeyError, TypeError, zlib.error):
            return None


def _unit_components(signature: Signature) -> dict:
    out = {}
    for comp in COMPONENTS:
        if comp in signature.components:
            vec = np.asarray(signature.vector(comp), np.float64)
            out[comp] = vec / max(np.linalg.norm(vec), 1e-12)
    return out


# ---- which recordings of this process merged, for the recording's report -------------------
_merged: dict[str, str] = {}
_merged_lock = threading.Lock()
_MERGED_MAX = 256  # a process that never reports keeps no more


def note_merge(recording_id: str, entry_id: str) -> None:
    """Remember that ``recording_id`` merged into ``entry_id`` (the report's ``merged_into``)."""
    with _merged_lock:
        _merged[recording_id] = entry_id
        while len(_merged) > _MERGED_MAX:
            _merged.pop(next(iter(_merged)))


def merged_into(recording_id: str) -> str | None:
    """The entry this process merged ``recording_id`` into, or None (added, or not written here)."""
    with _merged_lock:
        return _merged.get(recording_id)
