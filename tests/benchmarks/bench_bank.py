"""Mask bank benchmarks: match latency vs bank size, and bytes of one Wan2.1-14B 720p entry.

Run: .venv/bin/python tests/benchmarks/bench_bank.py [--quick]
Writes tests/benchmarks/results/bank_match.{json,md} and bank_entry_size.{json,md};
``--part match-scale [--sizes ...]`` writes bank_match_1m.{json,md} (folder and PostgreSQL banks,
shortlist index against exact search).

Synthetic masks (per head, 720p 81 frames: 21 x 45 x 80 tokens, 591 blocks of 128 per side):
a local 3D window (|dt| <= wt frames, |dy| <= wy rows between block centroids; wt in 1..3,
wy in 3..14 rows, random per head), 2-7 global key columns, the first frame's keys for half of
the heads, and isolated random extras (``extras`` share of all blocks). Step buckets 1 and 2
keep the windows and columns of bucket 0 and redraw 20 % of the extras.

Synthetic attention for recall: block attention mass A = exp(N(0, 0.5)) on kept blocks and
0.02 * exp(N(0, 0.5)) elsewhere, per row normalised; recall = mean over (head, query block)
of the kept mass. ``recall_loss`` = recall(original) - recall(decoded), same A.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from safetensors.numpy import save as st_save

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from chorus_core.bank import (LatentLayout, MaskBank, ModelFingerprint, Signature,  # noqa: E402
                              compat_key, decode_block_map, encode_masks)
from chorus_core.bank import ann  # noqa: E402
from chorus_core.bank.signature import COMPONENTS, DEFAULT_WEIGHTS, DIM  # noqa: E402
from chorus_core.bank.rows import blob_metadata  # noqa: E402

RESULTS = ROOT / "tests" / "benchmarks" / "results"
T, HH, WW, BLOCK = 21, 45, 80, 128
LAYERS, HEADS, BUCKETS = 40, 40, 3


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor())
    import os
    return f"{model}, {os.cpu_count()} cores (CPU only)"


def header(name: str, command: str, rows: list) -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    return {"benchmark": name, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine(), "command": command, "git_commit": commit, "rows": rows}


def write(name: str, doc: dict, columns: list[str], notes: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [f"# {doc['benchmark']}: {name}", "", f"{doc['date']}, {doc['machine']}, "
             f"commit {doc['git_commit'][:10]}", "", f"`{doc['command']}`", "", notes, "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in doc["rows"]]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")


# ---- entry size ---------------------------------------------------------------------------
def block_geometry():
    tok = np.arange(T * HH * WW)
    t, y = tok // (HH * WW), (tok // WW) % HH
    blocks = tok // BLOCK
    count = np.bincount(blocks)
    return np.bincount(blocks, t) / count, np.bincount(blocks, y) / count, len(count)


def layer_masks(rng, extras: float, geo) -> np.ndarray:
    """[BUCKETS, HEADS, nb, nb] bool masks of one layer."""
    bt, by, nb = geo
    first_frame = int(np.ceil(HH * WW / BLOCK))
    out = np.empty((BUCKETS, HEADS, nb, nb), bool)
    for h in range(HEADS):
        wt, wy = rng.integers(1, 4), rng.uniform(3, 14)
        base = (np.abs(bt[:, None] - bt[None, :]) <= wt + 0.5) & \
               (np.abs(by[:, None] - by[None, :]) <= wy)
        base[:, rng.choice(nb, rng.integers(2, 8), replace=False)] = True
        if rng.random() < 0.5:
            base[:, :first_frame] = True
        extra = rng.random((nb, nb)) < extras
        for s in range(BUCKETS):
            if s:
                keep = rng.random((nb, nb)) < 0.8
                extra = (extra & keep) | ((rng.random((nb, nb)) < extras * 0.2) & ~extra)
            out[s, h] = base | extra
    return out


def recall(masks: np.ndarray, attn: np.ndarray) -> float:
    return float((attn * masks).sum(-1).mean())


def synthetic_attention(rng, masks: np.ndarray) -> np.ndarray:
    noise = np.exp(rng.normal(0, 0.5, masks.shape)).astype(np.float32)
    attn = np.where(masks, noise, 0.02 * noise)
    return attn / attn.sum(-1, keepdims=True)


def entry_size(extras: float, coarsen: int, layers: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    geo = block_geometry()
    tensors, meta, decode_ms = {}, None, []
    rec, rec_dec, density, density_dec = [], [], [], []
    for layer in range(layers):
        masks = layer_masks(rng, extras, geo)
        part, meta = encode_masks(masks[:, None], coarsen=coarsen)
        tensors.update({k.replace(".l0.", f".l{layer}."): v for k, v in part.items()})
        for s in range(BUCKETS):
            t0 = time.perf_counter()
            decoded = decode_block_map(part, meta, s, 0)
            decode_ms.append((time.perf_counter() - t0) * 1e3)
            if coarsen == 1:
                assert (decoded == masks[s]).all(), "lossless codec must round-trip"
            if layer < 2:  # recall on 2 layers x 3 buckets x 40 heads: enough rows
                attn = synthetic_attention(rng, masks[s])
                rec.append(recall(masks[s], attn))
                rec_dec.append(recall(decoded, attn))
                density.append(masks[s].mean())
                density_dec.append(decoded.mean())
    shape = meta["shape"].split(",")
    shape[1] = str(LAYERS)
    meta["shape"] = ",".join(shape)
    blob = st_save(tensors, metadata=blob_metadata(meta))
    scale = LAYERS / layers
    return {"shape": "720p", "model": "wan2.1-i2v-14b", "N": T * HH * WW,
            "mask_shape": f"[{BUCKETS}, {LAYERS}, {HEADS}, {geo[2]}, {geo[2]}]",
            "step_buckets": BUCKETS, "extras": extras, "coarsen": coarsen,
            "lossless": coarsen == 1, "layers_measured": layers,
            "entry_bytes": int(round(len(blob) * scale)),
            "raw_packed_bytes": BUCKETS * LAYERS * HEADS * geo[2] * ((geo[2] + 7) // 8),
            "density": round(float(np.mean(density)), 4),
            "stored_density": round(float(np.mean(density_dec)), 4),
            "recall": round(float(np.mean(rec)), 4),
            "recall_decoded": round(float(np.mean(rec_dec)), 4),
            "recall_loss": round(float(np.mean(rec) - np.mean(rec_dec)), 5),
            "decode_ms_per_layer_set": round(float(np.median(decode_ms)), 2),
            "decode_ms_p90": round(float(np.percentile(decode_ms, 90)), 2)}


# ---- match latency ------------------------------------------------------------------------
FP = ModelFingerprint("wan2.1-i2v", 5120, 40, 40, 36, "b" * 64)
LAYOUT = LatentLayout((21, 45, 80), "thw", (128, 128))


def unit_rows(rng, n):
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def fill_bank(bank: MaskBank, n: int, rng, vecs=None) -> list[Signature]:
    """Insert ``n`` compatible rows (sharing one dummy blob name) plus n/10 incompatible;
    ``vecs``: component -> ``[n, DIM]`` unit rows (random ones when not given)."""
    vecs = vecs or {c: unit_rows(rng, n) for c in COMPONENTS}
    base = {"created": time.time(), "hits": 0, "fingerprint": FP.key(), "grid_t": 21,
            "grid_h": 45, "grid_w": 80, "token_order": "thw", "block_q": 128, "block_k": 128,
            "steps": 40, "sampler": "uni_pc", "scheduler": "simple", "shift": 5.0,
            "step_buckets": "[[0,10],[10,24],[24,40]]", "density": 0.15, "tags": "[]",
            "status": "ok", "blob_name": "x.safetensors", "blob_bytes": 1, "blob_sha256": "x"}
    compat = compat_key(FP, LAYOUT)
    rows = ({**base, "id": f"e{i}", "compat": compat if i < n else "other",
             **{f"sig_{c}": vecs[c][i % n].tobytes() for c in COMPONENTS}}
            for i in range(n + n // 10))
    with bank._write():
        bank.db["entries"].insert_all(rows, batch_size=2000)
    return [Signature({c: vecs[c][i] for c in COMPONENTS}) for i in rng.integers(0, n, 200)]


def fill_pg_bank(bank, n: int, rng, vecs=None) -> list[Signature]:
    """The same rows as :func:`fill_bank`, streamed into PostgreSQL with COPY."""
    vecs = vecs or {c: unit_rows(rng, n) for c in COMPONENTS}
    compat = compat_key(FP, LAYOUT)
    cols = ("id", "created", "hits", "compat", "fingerprint", "grid_t", "grid_h", "grid_w",
            "token_order", "block_q", "block_k", "steps", "sampler", "scheduler", "shift",
            "step_buckets", "density", "tags", "status", "blob_name", "blob_bytes",
            "blob_sha256", *(f"sig_{c}" for c in COMPONENTS))
    fixed = (FP.key(), 21, 45, 80, "thw", 128, 128, 40, "uni_pc", "simple", 5.0,
             "[[0,10],[10,24],[24,40]]", 0.15, "[]", "ok", "x.safetensors", 1, "x")
    with bank._write():
        with bank._connection().cursor() as cur:
            cur.execute("SET LOCAL statement_timeout = 0")  # a 1M-row COPY on loaded cores outlasts the bank's 120 s
            with cur.copy(f"COPY entries ({', '.join(cols)}) FROM STDIN") as copy:
                for i in range(n + n // 10):
                    copy.write_row((f"e{i}", time.time(), 0, compat if i < n else "other", *fixed,
                                    *(vecs[c][i % n].tobytes() for c in COMPONENTS)))
    return [Signature({c: vecs[c][i] for c in COMPONENTS}) for i in rng.integers(0, n, 200)]


def match_latency(n: int, seed: int = 0, pg=None) -> dict:
    """Match latency at ``n`` entries in a folder bank, or (``pg``: a function giving a fresh
    bank URL) in a PostgreSQL bank."""
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        bank = MaskBank.open(pg() if pg else tmp)
        t0 = time.perf_counter()
        queries = (fill_pg_bank if pg else fill_bank)(bank, n, rng)
        fill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        bank.match(queries[0], FP, LAYOUT)  # loads the index
        load_s = time.perf_counter() - t0
        times, found = [], 0
        for q in queries:
            noisy = Signature({c: v + 0.02 * rng.standard_normal(DIM).astype(np.float32)
                               for c, v in q.components.items()})
            noisy = Signature({c: v / np.linalg.norm(v) for c, v in noisy.components.items()})
            t0 = time.perf_counter()
            result = bank.match(noisy, FP, LAYOUT, threshold=0.9)
            times.append((time.perf_counter() - t0) * 1e3)
            found += result.hit
        bank.close()
    return {"backend": "postgresql" if pg else "folder", "entries": n,
            "query_ms": round(float(np.median(times)), 3),
            "query_ms_p90": round(float(np.percentile(times, 90)), 3),
            "index_load_s": round(load_s, 3), "queries": len(queries), "near_duplicate_hits": found,
            "incompatible_rows": n // 10, "fill_s": round(fill_s, 1)}


# ---- match at scale: the shortlist index against exact search ----------------------------
QUERY_KINDS = ("resent", "new_photo", "new_photo", "new_kind")


def photos(model: dict, kinds: np.ndarray, rng) -> np.ndarray:
    """CLIP parts of new photos of ``kinds``: 0.9 x the kind's + 0.44 x the photo's own, as in
    bench_bank_lifecycle.py (two photos of one kind: cosine about 0.8)."""
    mixed = 0.9 * model["clip"][kinds] + 0.44 * unit_rows(rng, len(kinds))
    return mixed / np.linalg.norm(mixed, axis=1, keepdims=True)


def kind_vectors(n: int, rng, chunk: int = 100_000):
    """Signatures of ``n`` entries under the lifecycle stream's model (kinds of about 10 photos; a
    kind is a template's text at a layout; sqrt(kinds) templates): component -> ``[n, DIM]``."""
    kinds = max(2, n // 10)
    templates = max(2, int(np.sqrt(kinds)))
    model = {"clip": unit_rows(rng, kinds), "text": unit_rows(rng, templates),
             "layout": unit_rows(rng, -(-kinds // templates)), "templates": templates}
    kind = rng.integers(0, kinds, n)
    vecs = {c: np.empty((n, DIM), np.float32) for c in COMPONENTS}
    for start in range(0, n, chunk):
        k = kind[start:start + chunk]
        vecs["clip"][start:start + chunk] = photos(model, k, rng)
        vecs["text"][start:start + chunk] = model["text"][k % templates]
        vecs["layout"][start:start + chunk] = model["layout"][k // templates]
    return vecs, kind, model


def scale_queries(vecs: dict, kind: np.ndarray, model: dict, rng, count: int) -> list[Signature]:
    """A request sent again (its entry + 2 % noise), a new photo of a kind in the bank (half of
    them: the traffic the bank exists for), or a request of a kind it has never seen."""
    out = []
    for j in range(count):
        i = int(rng.integers(len(kind)))
        what = QUERY_KINDS[j % len(QUERY_KINDS)]
        if what == "resent":
            comps = {c: vecs[c][i] + 0.02 * unit_rows(rng, 1)[0] for c in COMPONENTS}
        elif what == "new_photo":
            k = kind[i]
            comps = {"clip": photos(model, np.array([k]), rng)[0],
                     "text": model["text"][k % model["templates"]],
                     "layout": model["layout"][k // model["templates"]]}
        else:
            comps = {"clip": unit_rows(rng, 1)[0],
                     "text": model["text"][rng.integers(len(model["text"]))],
                     "layout": model["layout"][rng.integers(len(model["layout"]))]}
        out.append(Signature({c: (v / np.linalg.norm(v)).astype(np.float32) for c, v in comps.items()}))
    return out


def exact_top1(vecs: dict, queries: list[Signature]) -> tuple[list[str], np.ndarray]:
    """Exact search done here, apart from the bank's code: ids and similarities of the best row."""
    total = sum(DEFAULT_WEIGHTS[c] for c in COMPONENTS)
    scores = sum(vecs[c] @ np.stack([q.components[c] * (DEFAULT_WEIGHTS[c] / total) for q in queries]).T
                 for c in COMPONENTS)
    best = scores.argmax(0)
    return [f"e{i}" for i in best], scores[best, np.arange(len(queries))]


@contextmanager
def timed_index_builds():
    """Seconds of each shortlist index built inside the block (the first match builds one)."""
    real, spent = ann.PQShortlist.__init__, []

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        real(self, *args, **kwargs)
        spent.append(time.perf_counter() - t0)

    ann.PQShortlist.__init__ = timed
    try:
        yield spent
    finally:
        ann.PQShortlist.__init__ = real


@contextmanager
def exact_search():
    """The bank's own exact path: no shortlist index at any size."""
    real, ann.ANN_MIN = ann.ANN_MIN, 10 ** 12
    try:
        yield
    finally:
        ann.ANN_MIN = real


def timed_matches(location, queries, exact_ids, exact_sims) -> dict:
    """Open the bank, match once (loads the index: ``first_match_s``), then time every query."""
    with timed_index_builds() as builds:
        bank = MaskBank.open(location)
        t0 = time.perf_counter()
        bank.match(queries[0], FP, LAYOUT)
        first = time.perf_counter() - t0
    times, got = [], []
    for q in queries:
        t0 = time.perf_counter()
        got.append(bank.match(q, FP, LAYOUT, threshold=0.9).entry_id)
        times.append((time.perf_counter() - t0) * 1e3)
    every = counters_every_match(bank, queries) if "://" in str(location) else {}
    bank.close()
    same = np.array(got) == np.array(exact_ids[:len(got)])
    hits = exact_sims[:len(got)] >= 0.9
    row = {"index": "pq_shortlist" if builds else "exact", "queries": len(queries),
           "p50_ms": round(float(np.median(times)), 3), "p99_ms": round(float(np.percentile(times, 99)), 3),
           "max_ms": round(max(times), 3), "recall_at_1": round(float(same.mean()), 4),
           "recall_at_1_exact_hits": round(float(same[hits].mean()), 4) if hits.any() else None,
           "index_build_s": round(sum(builds), 2) if builds else None, "first_match_s": round(first, 2)}
    for what in dict.fromkeys(QUERY_KINDS):
        pick = [i for i in range(len(got)) if QUERY_KINDS[i % len(QUERY_KINDS)] == what]
        row[f"recall_at_1_{what}"] = round(float(same[pick].mean()), 4)
    return {**row, **every}


def counters_every_match(bank, queries) -> dict:
    """The same queries with PostgreSQL's change counters read on every match, as before the
    notifications, and as a worker whose matches come more than COUNTERS_MAX_AGE_S apart pays."""
    from chorus_core.bank import pg_store

    real, pg_store.COUNTERS_MAX_AGE_S = pg_store.COUNTERS_MAX_AGE_S, -1.0
    try:
        times = []
        for q in queries:
            t0 = time.perf_counter()
            bank.match(q, FP, LAYOUT, threshold=0.9)
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        pg_store.COUNTERS_MAX_AGE_S = real
    return {"p50_ms_counters_every_match": round(float(np.median(times)), 3),
            "p99_ms_counters_every_match": round(float(np.percentile(times, 99)), 3)}


def match_at_scale(n: int, pg=None, queries: int = 400, exact_queries: int = 100, seed: int = 0) -> list[dict]:
    """Rows for one bank of ``n`` entries: the shipped path, then the exact path on the same bank."""
    rng = np.random.default_rng(seed)
    vecs, kind, model = kind_vectors(n, rng)
    qs = scale_queries(vecs, kind, model, rng, queries)
    exact_ids, exact_sims = exact_top1(vecs, qs)
    with tempfile.TemporaryDirectory() as tmp:
        location = pg() if pg else tmp
        with MaskBank.open(location) as bank:
            t0 = time.perf_counter()
            (fill_pg_bank if pg else fill_bank)(bank, n, rng, vecs)
            fill_s = time.perf_counter() - t0
            if pg:  # now, not during the timing: autovacuum's pass over the bulk load
                bank.db.execute("SET statement_timeout = 0")
                bank.db.execute("VACUUM (ANALYZE) entries")
        del vecs
        rows = [timed_matches(location, qs, exact_ids, exact_sims)]
        if rows[0]["index"] != "exact":  # below ann.ANN_MIN the shipped path is the exact one
            with exact_search():
                rows.append(timed_matches(location, qs[:exact_queries], exact_ids, exact_sims))
    common = {"entries": n, "backend": "postgresql" if pg else "folder", "fill_s": round(fill_s, 1),
              "shortlist": ann.SHORTLIST, "ann_min": ann.ANN_MIN, "incompatible_rows": n // 10}
    return [{**common, **row, "load_avg_1m": round(os.getloadavg()[0], 2)} for row in rows]


def run_match_scale(args, command: str) -> None:
    """Both backends at each size; PostgreSQL is a throwaway local server (tests/bank_pg_cluster.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from bank_pg_cluster import Cluster

    sizes = [int(x) for x in (args.sizes or "1000,10000,100000,1000000").split(",")]
    backends = (args.backends or "folder,postgresql").split(",")
    cluster = Cluster().start()
    rows = []
    try:
        version = cluster.sql("SHOW server_version").strip()
        makers = {"folder": None, "postgresql": lambda: cluster.url(cluster.fresh_schema())}
        for n in sizes:
            for pg in (makers[name] for name in backends):
                for row in match_at_scale(n, pg=pg):
                    row["server"] = f"PostgreSQL {version}, local (loopback TCP)" if pg else "SQLite file"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        cluster.remove()
    doc = {**header("bench_bank", command, rows), "note": args.note}
    write("bank_match_1m", doc, SCALE_COLUMNS, SCALE_NOTES + (f" {args.note}" if args.note else ""))


SCALE_COLUMNS = ["entries", "backend", "index", "queries", "p50_ms", "p99_ms", "max_ms", "recall_at_1",
                 "recall_at_1_new_photo", "recall_at_1_new_kind", "p50_ms_counters_every_match",
                 "p99_ms_counters_every_match", "index_build_s", "first_match_s", "fill_s", "load_avg_1m"]
SCALE_NOTES = (
    "Latency of `MaskBank.match` (top-1, threshold 0.9) with its compatibility filter and, on "
    "PostgreSQL, the change counters read from the server only when a write was announced (LISTEN/"
    "NOTIFY) or the last read is older than 1 s (the 400 queries run back to back, so 1-3 of them "
    "read the counters); `*_counters_every_match`: the same queries on the same open bank reading "
    "the counters on every match, as before, and as a worker whose matches come more than 1 s apart "
    "does. Signatures follow the "
    "lifecycle stream's model (kinds of about 10 photos sharing a template's text and a layout; two "
    "photos of a kind: CLIP cosine about 0.8); the bank also holds 10 % incompatible rows. Queries: "
    "a request sent again (1/4), a new photo of a kind in the bank (1/2), a kind never seen (1/4). "
    "`recall_at_1`: share of queries whose top-1 is exact search's (done by the benchmark in numpy, "
    "apart from the bank's code). `index pq_shortlist`: faiss's index (chorus_core/bank/ann.py: "
    "IVF256,PQ48x4fs searching 8 cells since 2026-12-06, a flat PQ48x4fs scan before) proposes "
    "`shortlist` rows, ranked exactly; `exact`: the same bank with the index turned off "
    "(fewer queries). `first_match_s`: the first match of a newly opened bank object (reads every "
    "signature, builds the index: `index_build_s`). Server on the same machine (fsync off); "
    "after the fill, `VACUUM (ANALYZE) entries`, as after any bulk import, so that autovacuum's "
    "pass over the freshly copied rows cannot overlap the timing (a bank grown entry by entry has no "
    "such pass; whether it overlapped in earlier runs was not checked). The "
    "machine has 2 cores shared with other jobs: `load_avg_1m` shows them; p99 of 400 queries is "
    "their 4th slowest.")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer layers, smaller banks")
    parser.add_argument("--part", choices=["all", "match", "size", "match-postgres", "match-scale"],
                        default="all")
    parser.add_argument("--sizes", help="match-postgres, match-scale: bank sizes, e.g. 1000,100000,1000000")
    parser.add_argument("--backends", help="match-scale: folder,postgresql (the default) or one of them")
    parser.add_argument("--note", help="match-scale: a sentence for the results (what else ran meanwhile)")
    args = parser.parse_args()
    command = " ".join(["python tests/benchmarks/bench_bank.py", *sys.argv[1:]])
    if args.part == "match-postgres":
        run_match_postgres(args, command)
        return
    if args.part == "match-scale":
        run_match_scale(args, command)
        return
    if args.part in ("all", "match"):
        run_match(args, command)
    if args.part in ("all", "size"):
        run_size(args, command)


def run_match(args, command: str) -> None:
    sizes = (1000, 10000) if args.quick else (1000, 10000, 100000)
    match_rows = [match_latency(n) for n in sizes]
    write("bank_match", header("bench_bank", command, match_rows),
          ["entries", "query_ms", "query_ms_p90", "index_load_s", "queries", "near_duplicate_hits"],
          "Median latency of `MaskBank.match` (SQL compatibility filter + in-memory numpy "
          "cosine, top-1) over 200 near-duplicate queries; the bank also holds 10 % "
          "incompatible rows. `index_load_s`: first query after a change (loads the matrix). "
          "The machine is shared with other jobs: p90 shows their interference.")
    print(json.dumps(match_rows, indent=1))


def run_match_postgres(args, command: str) -> None:
    """The match benchmark on a PostgreSQL bank: a throwaway local server (Debian's binaries,
    tests/bank_pg_cluster.py), one fresh schema per size."""
    sys.path.insert(0, str(ROOT / "tests"))
    from bank_pg_cluster import Cluster

    sizes = [int(x) for x in (args.sizes or "1000,10000,100000").split(",")]
    cluster = Cluster().start()
    try:
        version = cluster.sql("SHOW server_version").strip()
        rows = []
        for n in sizes:
            row = match_latency(n, pg=lambda: cluster.url(cluster.fresh_schema()))
            # other jobs on this shared 2-core machine: the load shows how much they took
            rows.append({**row, "load_avg_1m": round(__import__("os").getloadavg()[0], 2),
                         "server": f"PostgreSQL {version}, local (loopback TCP)"})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        cluster.remove()
    write("bank_match_postgres", header("bench_bank", command, rows),
          ["backend", "entries", "query_ms", "query_ms_p90", "index_load_s", "fill_s", "queries",
           "near_duplicate_hits", "load_avg_1m"],
          "Median latency of `MaskBank.match` on a PostgreSQL bank: the change counters are "
          "read from the server on every query (one round trip), the compatible rows were "
          "filtered in SQL and loaded into the in-process signature matrix on the first query "
          "(`index_load_s`), the similarity is one numpy product over the candidates (with a "
          "sketch shortlist above 4,096). 200 near-duplicate queries; the bank also holds 10 % "
          "incompatible rows; server on the same 2-core machine (started with fsync off: "
          "this measures reads). The machine is shared with other jobs: p90 shows their "
          "interference.")


def run_size(args, command: str) -> None:
    full = 4 if args.quick else LAYERS
    size_rows = [entry_size(0.004, 1, full), entry_size(0.004, 2, 4),
                 entry_size(0.01, 1, 4), entry_size(0.01, 2, 4)]
    write("bank_entry_size", header("bench_bank", command, size_rows),
          ["shape", "model", "extras", "coarsen", "lossless", "layers_measured", "entry_bytes",
           "density", "stored_density", "recall", "recall_loss", "decode_ms_per_layer_set"],
          __doc__.split("\n\n", 2)[2].strip() + " Rows with `layers_measured` < 40 scale "
          "the measured bytes by 40 / layers_measured.")
    print(json.dumps(size_rows, indent=1))


if __name__ == "__main__":
    main()
