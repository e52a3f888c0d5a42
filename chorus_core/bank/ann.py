"""Shortlist for large signature groups: faiss's inverted file over 4-bit product-quantisation fast scan.

An exact match reads every stored vector (3 KB an entry): about 3 GB a query at 1,000,000
entries, far from milliseconds on a few cores. Above ``ANN_MIN`` rows, a faiss index
(``IVF256,PQ48x4fs``: 256 coarse cells, 24 bytes an entry scanned with SIMD lookup tables, the
``NPROBE`` cells nearest the query searched) proposes ``SHORTLIST`` rows, and :mod:`.matching`
ranks those exactly against its float32 matrix, so every similarity it reports is exact and only
the candidate set is approximate.

Why the inverted file: in the match-scale benchmark's quiet runs at 1,000,000 entries on 2 cores
(tests/benchmarks/results/bank_match_1m_flat_pq.md, then bank_match_1m.md), the flat PQ scan read
every code on every match, p99 6.449 ms (folder bank) and 4.288 ms (PostgreSQL), over or near the
5 ms target; searching 8 of 256 cells gave 0.859 and 0.994 ms, recall@1 0.995 then 0.9975, for a
longer index build (13 s against 7 s: the 256 centroids). While choosing (one core, the benchmark's data, not a
committed run) 4 cells gave recall@1 0.995 and 2 cells 0.985.

Why this and not a graph index (HNSW): measured once while choosing (2 cores, 100,000 random 768-d
signatures; not a committed benchmark), HNSW in usearch 2.26 and faiss took 37-92 s to build and
found a near-duplicate's own entry for 52-63 % of queries (hnswlib has had no release since 2023);
the inverted PQ index builds 1,000,000 in 13 s, keeps a near-duplicate in the query's own
cells, and takes additions without retraining (new rows go to their nearest cell; it is rebuilt
once the group has doubled). faiss (Meta's, released on PyPI as
``faiss-cpu``) is optional: without it matching stays exact, and says so once in the log.

Row positions of the matrix change when removed rows are dropped; the index's labels do not.
``label_pos`` maps a label to its row (-1: removed or replaced), so a removed entry can never come
back from the index even before it is rebuilt.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("chorus")

ANN_MIN = 20_000  # rows: below, the exact mat-vec (60 MB) is about as fast as the scan
SHORTLIST = 256  # candidates ranked exactly: at 1M, recall@1 0.9975 (1.0 at 512, for 1-2 ms more)
# 48 sub-vectors of 16 dims, 16 centroids each: 24 bytes an entry. 64 sub-vectors scanned 1.5-3x
# slower at 1M on 2 cores for no measured gain in recall@1 after the exact ranking.
PQ = "PQ48x4fs"
CELLS = 256  # coarse cells of the inverted file (fewer for a smaller training set)
ROWS_PER_CELL = 39  # faiss's minimum training rows per cell
NPROBE = 8  # cells searched: recall@1 0.9975 at 1M, as the flat scan (module docstring)
TRAIN_ROWS = 16_384  # 64 rows per coarse cell, plenty for 16 centroids per sub-vector
MIN_TRAIN = 1_024  # fewer rows cannot train 16 centroids per sub-vector well
DEAD_SHARE = 0.2  # rebuild when this share of labels point at nothing (they crowd the shortlist)
missing_logged = False


def faiss_module():
    """faiss, or None (logged once per process) when it is not installed or cannot load."""
    global missing_logged
    try:
        import faiss
        return faiss
    except (ImportError, OSError) as exc:
        if not missing_logged:
            missing_logged = True
            log.warning("Chorus: faiss is not available (%s): mask bank matching above %d entries "
                        "stays exact (about 0.15 s a match at 1,000,000 on 2 cores); "
                        "pip install faiss-cpu for the fast shortlist", exc, ANN_MIN)
        return None


def wanted(rows: int) -> bool:
    """Whether a group of ``rows`` vectors should have a shortlist index."""
    return rows >= max(ANN_MIN, MIN_TRAIN)


class PQShortlist:
    """A faiss inverted-file PQ fast-scan index over a group's rows, with its label -> row map."""

    def __init__(self, faiss, mat: np.ndarray, seed: int = 0):
        rng = np.random.default_rng(seed)
        sample = mat if len(mat) <= TRAIN_ROWS else mat[np.sort(rng.choice(len(mat), TRAIN_ROWS, replace=False))]
        cells = max(1, min(CELLS, len(sample) // ROWS_PER_CELL))
        self.index = faiss.index_factory(mat.shape[1], f"IVF{cells},{PQ}", faiss.METRIC_INNER_PRODUCT)
        self.index.train(np.ascontiguousarray(sample))
        faiss.extract_index_ivf(self.index).nprobe = NPROBE
        self.trained_rows = len(mat)
        self.label_pos = np.zeros(0, np.int64)
        self.pos_label = np.zeros(0, np.int64)
        self.add(mat, np.arange(len(mat)))

    def add(self, vectors: np.ndarray, positions: np.ndarray) -> None:
        """New rows at ``positions`` (appended to the matrix, or replacing a row's vector)."""
        if not len(positions):
            return
        labels = np.arange(self.index.ntotal, self.index.ntotal + len(positions))
        self.index.add(np.ascontiguousarray(vectors, dtype=np.float32))
        self.label_pos = np.concatenate([self.label_pos, positions])
        grow = max(0, int(positions.max()) + 1 - len(self.pos_label))
        self.pos_label = np.concatenate([self.pos_label, np.full(grow, -1, np.int64)])
        replaced = self.pos_label[positions]
        self.label_pos[replaced[replaced >= 0]] = -1  # a replaced vector's old label points nowhere
        self.pos_label[positions] = labels

    def keep(self, keep: np.ndarray, old_rows: int) -> None:
        """The matrix kept rows ``keep`` (old positions, in order) of ``old_rows``."""
        new_of_old = np.full(old_rows, -1, np.int64)
        new_of_old[keep] = np.arange(len(keep))
        alive = self.label_pos >= 0
        self.label_pos[alive] = new_of_old[self.label_pos[alive]]
        self.pos_label = self.pos_label[keep]

    def stale(self) -> bool:
        """Rebuild when dead labels crowd it, or it has doubled since its codebooks were trained
        (new kinds of request may lie where the old codebooks quantise coarsely)."""
        live = len(self.pos_label)
        return (self.index.ntotal - live > DEAD_SHARE * self.index.ntotal
                or live > 2 * self.trained_rows)

    def shortlist(self, query: np.ndarray, k: int = SHORTLIST) -> np.ndarray:
        """Row positions of (about) the ``k`` best rows by the quantised inner product."""
        labels = self.index.search(query[None].astype(np.float32), k)[1][0]
        rows = self.label_pos[labels[labels >= 0]]
        return np.unique(rows[rows >= 0])
