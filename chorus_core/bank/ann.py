"""Shortlist for large signature groups: faiss's 4-bit product-quantisation fast scan.

An exact match reads every stored vector (3 KB an entry): about 3 GB a query at 1,000,000
entries, far from milliseconds on a few cores. Above ``ANN_MIN`` rows, a faiss product-quantisation
index (``PQ48x4fs``: 24 bytes an entry, scanned with SIMD lookup tables) proposes ``SHORTLIST``
rows, and :mod:`.matching` ranks those exactly against its float32 matrix, so every similarity it
reports is exact and only the candidate set is approximate.

Why this and not a graph index (HNSW): measured once while choosing (2 cores, 100,000 random 768-d
signatures; not a committed benchmark), HNSW in usearch 2.26 and faiss took 37-92 s to build and
found a near-duplicate's own entry for 52-63 % of queries (hnswlib has had no release since 2023);
the PQ scan builds 1,000,000 in about 5 s, scans it in about 2 ms, assumes nothing
about clusters, and takes additions without retraining. faiss (Meta's, released on PyPI as
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
PQ_SPEC = "PQ48x4fs"
TRAIN_ROWS = 65_536  # enough for 16 centroids per sub-vector; more only slows the build
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
    """A faiss PQ fast-scan index over a group's rows, with its label -> row map."""

    def __init__(self, faiss, mat: np.ndarray, seed: int = 0):
        self.index = faiss.index_factory(mat.shape[1], PQ_SPEC, faiss.METRIC_INNER_PRODUCT)
        rng = np.random.default_rng(seed)
        sample = mat if len(mat) <= TRAIN_ROWS else mat[np.sort(rng.choice(len(mat), TRAIN_ROWS, replace=False))]
        self.index.train(np.ascontiguousarray(sample))
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
