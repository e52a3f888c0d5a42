"""A hit's prefetch worker on a real bank entry: how soon bucket 0 is ready, by decode threads.

    python tests/benchmarks/bench_prefetch.py [--shape 720p] [--layers 40] [--threads 1,2,4] [--repeats 3] [--out DIR]

A hit that runs sparse from its first step needs every layer of step bucket 0 before that step
can finish, so the first step waits for the worker (``prefetch_wait_ms`` in a run's report; 0.82 s
of a 4-step 720p hit's 17.5 s on the H200, ``few_step_h200_720p.md``). This runs the shipped
``EntryPrefetch`` exactly as a hit does (its own connection to a real ``MaskBank`` in a temporary
folder, the entry's load and digest check, then inflating each layer set to packed bits and row
counts), on one entry of ``bench_end_to_end.structured_block_map`` masks at density 0.15, 3 step
buckets, 40 heads and ``--layers`` layers at Wan2.1-14B's ``--shape``, for each ``--threads``
count in turn (``--repeats`` each, after one uncounted run that warms the page cache; the median
is reported). No GPU: the host work is what is measured (uploads are not pinned here).

Columns: ``load_ms`` (row, blob read, digest, parse), ``first_bucket_ms`` (worker start until
bucket 0 is ready: what a hit's first step can wait for), ``decode_ms`` (all buckets). Writes
``prefetch_<name>.json`` / ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "benchmarks"))

from chorus_core.bank import LatentLayout, MaskBank, ModelFingerprint, Schedule, Signature  # noqa: E402
from chorus_core.bank.signature import COMPONENTS, DIM  # noqa: E402
from chorus_core.reuse.entry_prefetch import DECODE_THREADS, EntryPrefetch  # noqa: E402
from tests.testbed.run_record import run_record  # noqa: E402

HEADS, DENSITY, BUCKETS = 40, 0.15, 3  # what bench_codec.synthetic_maps makes


def synthetic_entry(bank: MaskBank, shape: str, layers: int) -> str:
    """One entry of structured masks at ``shape`` with ``layers`` layers; its id."""
    from bench_codec import synthetic_maps  # the codec benchmark's entry: structured masks, 40 heads, 3 buckets
    from bench_end_to_end import SHAPES, token_grid

    grid = token_grid(SHAPES[shape])
    maps = synthetic_maps(shape, layers)
    rng = np.random.default_rng(0)
    signature = Signature({c: (v := rng.standard_normal(DIM).astype(np.float32)) / np.linalg.norm(v) for c in COMPONENTS})
    layout = LatentLayout(grid, "thw", (128, 128))
    schedule = Schedule(steps=4, sampler="euler", scheduler="simple")
    fingerprint = ModelFingerprint("wan2.1-i2v", 5120, layers, HEADS, 36, "b" * 64)  # 14B width, --layers deep
    return bank.add_entry(fingerprint, layout, schedule, maps, signature, density=float(maps.mean()))


def prefetch_once(folder: Path, entry_id: str, threads: int) -> dict:
    """The hit's worker on its own connection, as ``reuse_run`` opens it; its timings."""
    @contextlib.contextmanager
    def open_entry():
        with MaskBank.open(folder) as own:
            yield own.load_masks(entry_id, record_hit=False)

    prefetch = EntryPrefetch(open_entry, pin=False, decode_threads=threads)
    prefetch.join(timeout=600)
    t = prefetch.timings
    return {"load_ms": t.load_ms, "first_bucket_ms": t.first_bucket_ms, "decode_ms": t.decode_ms}


def measure(folder: Path, entry_id: str, threads: list, repeats: int) -> list:
    prefetch_once(folder, entry_id, 1)  # not counted: the blob into the page cache, first-use imports
    rows = []
    for n in threads:
        runs = [prefetch_once(folder, entry_id, n) for _ in range(repeats)]
        rows.append({"threads": n, **{k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]},
                     "first_bucket_ms_all": [round(r["first_bucket_ms"], 1) for r in runs]})
    serial = next((r for r in rows if r["threads"] == 1), None)
    for row in rows:
        row["first_bucket_vs_1_thread"] = round(serial["first_bucket_ms"] / row["first_bucket_ms"], 2) if serial else None
    return rows


def markdown(doc: dict) -> str:
    lines = [f"# A hit's prefetch worker by decode threads ({doc['name']})", "",
             f"{doc['machine']}; `{doc['command']}`; {doc['date']}; commit {doc['git_commit']}", "",
             f"One entry: {doc['shape']}, {doc['layers']} layers x {HEADS} heads, {BUCKETS} step buckets, "
             f"density {DENSITY}, {doc['entry_bytes']:,} bytes; the shipped default here is {doc['default_threads']} "
             f"decode thread(s). Median of {doc['repeats']} runs.", "",
             "| decode threads | load ms | bucket 0 ready ms | all buckets decoded ms | bucket 0 vs 1 thread | runs (bucket 0 ms) |",
             "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['threads']} | {r['load_ms']} | {r['first_bucket_ms']} | {r['decode_ms']} | "
                     f"{r['first_bucket_vs_1_thread']}x | {', '.join(map(str, r['first_bucket_ms_all']))} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="720p", choices=["480p", "720p"])
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default=None)
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "benchmarks" / "results")
    args = parser.parse_args(argv)
    threads = [int(x) for x in args.threads.split(",")]
    command = "python tests/benchmarks/bench_prefetch.py " + " ".join(argv if argv is not None else sys.argv[1:])
    import torch

    record = run_record(command, torch.cuda.is_available())
    name = args.name or f"{args.shape}_{'gpu_host' if torch.cuda.is_available() else 'cpu'}"
    with tempfile.TemporaryDirectory(prefix="chorus-bench-prefetch-") as tmp:
        folder = Path(tmp) / "bank"
        started = time.perf_counter()
        with MaskBank.open(folder) as bank:
            entry_id = synthetic_entry(bank, args.shape, args.layers)
            entry_bytes = int(bank.show(entry_id)["blob_bytes"])
        print(f"entry written in {time.perf_counter() - started:.0f} s ({entry_bytes:,} bytes)")
        rows = measure(folder, entry_id, threads, args.repeats)
    doc = {**record, "name": name, "shape": args.shape, "layers": args.layers, "repeats": args.repeats,
           "entry_bytes": entry_bytes, "default_threads": DECODE_THREADS, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"prefetch_{name}.json").write_text(json.dumps(doc, indent=1))
    (args.out / f"prefetch_{name}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
