"""In-memory signature index: cosine similarity over the compatible entries of a bank.

One float32 matrix per compatibility key (model fingerprint + grid + token order + blocks),
loaded from SQL on first use and refreshed when the bank's generation counter changes:
new rows are appended (a merged entry, renumbered, replaces its vector), and after a removal the
ids still present are read and the others' vectors dropped.
Similarity is one mat-vec: with unit components,
sum_c w_c cos_c = dot(concat(w_c q_c), concat(e_c)). Stored and query components are scaled to
unit length here whatever the bank holds, and weights are >= 0, so similarity lies in [-1, 1].
The full mat-vec is memory bound (about 16 ms for 100,000 x 768 on 2 cores): above
``ann.ANN_MIN`` rows a product-quantisation index (:mod:`.ann`, faiss, optional) shortlists rows
and the shortlist is ranked exactly here; without faiss the search stays exact.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from . import ann
from .signature import COMPONENTS, DIM, Signature, resolve_weights


@dataclass
class MatchResult:
    """Outcome of :meth:`MaskBank.match`.

    :param hit: True when the best entry's similarity reaches the threshold
    :param entry_id: the best entry (also on a miss, for diagnostics), or None without candidates
    :param similarity: weighted similarity of the best entry
    :param components: per-component cosine similarity of the best entry
    :param candidates: number of compatible entries searched
    :param top: ``[(entry_id, similarity), ...]`` best first, at most ``top_k``
    """

    hit: bool
    entry_id: str | None
    similarity: float
    components: dict[str, float]
    candidates: int
    top: list = field(default_factory=list)


def stack_vectors(rows) -> np.ndarray:
    """Rows with ``sig_<component>`` float32 blobs -> ``[n, len(COMPONENTS) * DIM]``, each
    component scaled to unit length (see :func:`unit_blocks`); a blob of another length
    (a hand-edited row) counts as absent rather than failing every match."""
    mat = np.zeros((len(rows), len(COMPONENTS) * DIM), np.float32)
    for i, row in enumerate(rows):
        for j, comp in enumerate(COMPONENTS):
            blob = row[f"sig_{comp}"]
            if blob and len(blob) == DIM * 4:
                mat[i, j * DIM:(j + 1) * DIM] = np.frombuffer(blob, np.float32)
    return unit_blocks(mat)


LOAD_CHUNK_ROWS = 50_000  # signature rows read from the bank at a time (150 MB of vectors)
UNIT_CHUNK_ROWS = 4096  # float64 rows normalised at a time: 25 MB, not a copy of a 100k-entry index


def unit_blocks(mat: np.ndarray) -> np.ndarray:
    """``[n, len(COMPONENTS) * DIM]`` with every component block at unit length, or zero where
    it is zero or not finite. Rows come from a bank that may be old, hand-edited or imported
    before imports checked norms: a vector 1000 times too long would score 1000 times too high
    and take every match, so the index never trusts a stored norm."""
    out = np.array(mat, dtype=np.float32)  # one float32 copy; float64 only per chunk of rows
    blocks = out.reshape(len(out), len(COMPONENTS), DIM)
    for start in range(0, len(blocks), UNIT_CHUNK_ROWS):
        chunk = blocks[start:start + UNIT_CHUNK_ROWS].astype(np.float64)  # a 1e30 entry's norm overflows in float32
        with np.errstate(over="ignore", invalid="ignore"):
            norms = np.linalg.norm(chunk, axis=2, keepdims=True)
            usable = np.isfinite(norms) & (norms > 1e-12)
            blocks[start:start + UNIT_CHUNK_ROWS] = np.where(usable, chunk / np.where(usable, norms, 1.0), 0.0)
    return out


class _Group:
    def __init__(self):
        self.ids: list[str] = []
        self.position: dict[str, int] = {}  # id -> its row in ``mat``
        self.rowid_of: dict[str, int] = {}  # id -> the rowid its vector was read at
        self._buf = np.zeros((0, len(COMPONENTS) * DIM), np.float32)  # rows beyond len(ids): spare
        self.ann: ann.PQShortlist | None = None
        self.max_rowid = 0

    @property
    def mat(self) -> np.ndarray:
        return self._buf[:len(self.ids)]

    def append(self, rows, reindex: bool = True) -> None:
        """New rows are appended; a row seen before (a merge moved it to a new rowid with a new
        signature) replaces its old vector, so an id is never listed twice. ``reindex`` False: the
        caller has more rows to append and builds the shortlist index once, after the last."""
        if not rows:
            return
        vectors = stack_vectors(rows)
        fresh, replaced = [], []
        for i, row in enumerate(rows):
            at = self.position.get(row["id"])
            if at is None:
                self.position[row["id"]] = len(self.ids) + len(fresh)
                fresh.append(i)
            else:
                self._buf[at] = vectors[i]
                replaced.append((i, at))
            self.rowid_of[row["id"]] = row["rowid"]
        start = len(self.ids)
        self._grow(start + len(fresh))
        self._buf[start:start + len(fresh)] = vectors[fresh]
        self.ids.extend(rows[i]["id"] for i in fresh)
        self.max_rowid = max(self.max_rowid, max(r["rowid"] for r in rows))
        if self.ann is not None:
            at = np.array([a for _, a in replaced] + list(range(start, len(self.ids))), np.int64)
            self.ann.add(vectors[[i for i, _ in replaced] + fresh], at)
        if reindex:
            self.reindex()

    def _grow(self, rows: int) -> None:
        """Room for ``rows`` rows, doubling: appending one entry must not copy a 3 GB matrix."""
        if rows > len(self._buf):
            bigger = np.zeros((max(rows, 2 * len(self._buf)), self._buf.shape[1]), np.float32)
            bigger[:len(self.ids)] = self.mat
            self._buf = bigger

    def keep_only(self, present: set) -> None:
        """Drop the rows whose ids are not in ``present`` (removed or quarantined)."""
        keep = [i for i, entry_id in enumerate(self.ids) if entry_id in present]
        if len(keep) == len(self.ids):
            return
        old_rows = len(self.ids)
        self._buf = self.mat[keep]
        self.ids = [self.ids[i] for i in keep]
        self.position = {entry_id: i for i, entry_id in enumerate(self.ids)}
        self.rowid_of = {entry_id: self.rowid_of[entry_id] for entry_id in self.ids}
        if self.ann is not None:
            self.ann.keep(np.array(keep, np.int64), old_rows)
        self.reindex()

    def reindex(self) -> None:
        """Build the shortlist index when the group is large enough and it has none or a stale one."""
        if not ann.wanted(len(self.ids)):
            self.ann = None
        elif self.ann is None or self.ann.stale():
            faiss = ann.faiss_module()
            self.ann = ann.PQShortlist(faiss, self.mat) if faiss is not None else None

    def scores(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row indices, similarities) of the rows worth ranking."""
        if self.ann is not None:
            rows = self.ann.shortlist(query)
            if len(rows):
                return rows, self.mat[rows] @ query
        return np.arange(len(self.ids)), self.mat @ query


class ReadWriteLock:
    """Many readers or one writer; a waiting writer holds back new readers (a stream of matches
    from several threads must not starve the refresh that would show them a new entry)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextmanager
    def reading(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._writing and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def writing(self):
        with self._cond:
            self._writers_waiting += 1
            self._cond.wait_for(lambda: not self._writing and not self._readers)
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


class SignatureIndex:
    """Per-compatibility-key matrices of entry signatures, kept fresh by generation.

    One index may serve the bank objects of several threads (:mod:`.open_banks` shares one per
    bank and process: 3 GB at 1,000,000 entries is too much to hold once per thread). Matches read
    it together; a refresh changes it alone, through the calling thread's own ``db``."""

    def __init__(self):
        self._groups: dict[str, _Group] = {}
        self._state = None  # (generation, removals) the groups reflect, at least
        self._lock = ReadWriteLock()

    def covers(self, generation: int, removals: int) -> bool:
        """Whether the index already reflects these counters (another thread's refresh may have
        read later ones: the counters only grow, and what it read then is still in the bank or
        was removed after the caller's counters were read)."""
        state = self._state
        return state is not None and state[0] >= generation and state[1] >= removals

    def refresh(self, db, generation: int, removals: int) -> None:
        """Bring the index up to the bank's counters ``(generation, removals)``, read by the caller
        on its own connection; a no-op when it is there already."""
        if self.covers(generation, removals):
            return
        with self._lock.writing():
            if not self.covers(generation, removals):
                self._refresh(db, generation, removals)

    def _refresh(self, db, generation: int, removals: int) -> None:
        """After a removal, drop the vectors of the rows that are gone (their ids are read, not
        every signature again: a bank that keeps a budget removes entries on nearly every write);
        after an addition, append the new rows."""
        if self._state is not None and removals > self._state[1]:
            for compat, group in self._groups.items():
                present = {r["id"]: r["rowid"] for r in db.query(
                    "SELECT rowid, id FROM entries WHERE compat = ? AND status = 'ok'", [compat])}
                group.keep_only(set(present))
                # SQLite hands a removed last row's rowid to the next insert, and a merge renumbers
                # its row: read again from the first row not held at its rowid, not only above the max
                unseen = [r for i, r in present.items() if group.rowid_of.get(i) != r]
                group.max_rowid = min([group.max_rowid] + [r - 1 for r in unseen])
        for compat in list(self._groups):
            self._load(db, compat)
        old = self._state or (generation, removals)
        self._state = (max(old[0], generation), max(old[1], removals))

    def _load(self, db, compat: str) -> _Group:
        """Rows of ``compat`` not held yet, read LOAD_CHUNK_ROWS at a time: a first load at 1,000,000
        entries holds one chunk's rows besides the matrix, not every row twice over (PostgreSQL's
        rows arrive as dicts, then as dicts of bytes)."""
        group = self._groups.setdefault(compat, _Group())
        while True:
            rows = list(db.query(
                "SELECT rowid, id, sig_clip, sig_text, sig_layout FROM entries "
                "WHERE compat = ? AND status = 'ok' AND rowid > ? ORDER BY rowid LIMIT ?",
                [compat, group.max_rowid, LOAD_CHUNK_ROWS]))
            group.append(rows, reindex=False)
            if len(rows) < LOAD_CHUNK_ROWS:
                break
        group.reindex()
        return group

    def _group(self, db, compat: str) -> None:
        """Load a key's rows on its first match (a change to the index: the writer's lock)."""
        if compat not in self._groups:
            with self._lock.writing():
                if compat not in self._groups:
                    self._load(db, compat)

    def match(self, db, compat: str, signature: Signature, threshold: float, top_k: int,
              weights=None) -> MatchResult:
        self._group(db, compat)
        with self._lock.reading():
            return self._match(self._groups[compat], signature, threshold, top_k, weights)

    @staticmethod
    def _match(group: _Group, signature: Signature, threshold: float, top_k: int,
               weights) -> MatchResult:
        n = len(group.ids)
        if n == 0:
            return MatchResult(False, None, 0.0, {}, 0, [])
        w = resolve_weights(weights)
        present = [c for c in COMPONENTS if c in signature.components]
        total = sum(w[c] for c in present) or 1.0
        unit = unit_blocks(np.concatenate([signature.vector(c) for c in COMPONENTS])[None])[0]
        query = np.concatenate([unit[j * DIM:(j + 1) * DIM] * (w[c] / total)
                                for j, c in enumerate(COMPONENTS)])
        rows, sims = group.scores(query.astype(np.float32))
        sims = np.clip(sims, -1.0, 1.0)  # unit vectors, weights >= 0 summing to 1: float rounding only
        k = min(top_k, len(rows))
        best = np.argpartition(sims, -k)[-k:]
        best = best[np.argsort(-sims[best])]
        top = [(group.ids[rows[i]], float(sims[i])) for i in best]
        row = group.mat[rows[best[0]]]
        comps = {c: float(np.clip(row[j * DIM:(j + 1) * DIM] @ unit[j * DIM:(j + 1) * DIM], -1, 1))
                 for j, c in enumerate(COMPONENTS) if c in present}
        sim = top[0][1]
        return MatchResult(sim >= threshold, top[0][0], sim, comps, n, top)
