"""Does an entry that absorbed several recordings serve a better hit than one recording? (issue 49, item 2)

The lifecycle simulation (``tests/benchmarks/bench_bank_lifecycle.py``) measured served-hit recall of
merged entries on synthetic masks; this runs the product path on the testbed model instead. Per
(target, seed), two banks:

* ``single``: one similar request (same template and layout, another subject) recorded as a miss;
* ``merged``: a merge policy set (the thresholds measured on the lifecycle stream, 0.65 / 0.55),
  then the same similar request and ``recordings - 1`` more of its kind recorded, each merging
  into the first entry (the bank's entry count says whether they all did);

then the target served as a hit from each bank with the shipped settings, and the dense run of the
same seed. Rows are product-path rows (``section`` ``natural``, ``mask_kind`` ``hit_single`` or
``hit_merged``), so ``comparisons.paired_difference`` gives merged - single in dB over requests.

    python -m tests.testbed.merge_quality --checkpoint CK --preset entropy16k --set sample_steps=4 \\
        --targets 8 --seeds 3 --recordings 5 --out DIR
    python -m tests.testbed.merge_quality --tiny --targets 1 --seeds 1 --recordings 3 --out DIR  # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from chorus_core.testbed.workload import generate_request, i2v_conditioning

from .comparisons import mean_ci, paired_difference, rows_by_pair
from .product_path import ProductPath, add_model_arguments, final_quality, load_model, request_name, tokens_of
from .report import eval_requests, git_commit, spread_picks

SIMILARITY, AGREEMENT = 0.65, 0.55  # chorus_core/bank/merge.py's measured thresholds (README: How the bank grows)
SUBJECT_STRIDE = 1000  # further subjects of a kind: far from every subject eval_requests hands out


def kind_members(similar, count: int) -> list:
    """``similar`` and ``count - 1`` more requests of its kind (its template and layout, other subjects)."""
    return [similar] + [dataclasses.replace(similar, subject=similar.subject + SUBJECT_STRIDE * k)
                        for k in range(1, count)]


def record_kind(pp: ProductPath, bank, members: list, seed: int) -> None:
    for request in members:
        pp.record(bank, i2v_conditioning(generate_request(request)), seed)


def hit_row(pp: ProductPath, bank, conds, seed: int, dense_final, kind: str, base: dict) -> dict:
    match = pp.match(bank, conds, pp.threshold)
    final, report = pp.reuse_run(match, conds, seed)
    if report.mode != "hit":
        raise RuntimeError(f"{kind}: the target did not hit (similarity {match.result.similarity:.3f})")
    maps = pp.entry_maps(bank.load_masks(report.entry_id, record_hit=False))
    density = sum(float(m.float().mean()) for m in maps.values()) / len(maps)
    return {"section": "natural", "mask_kind": kind, **base, "density": density,
            "similarity": round(match.result.similarity, 4), **final_quality(dense_final, final)}


def pair_rows(pp: ProductPath, workdir: Path, target, similar, seed: int, recordings: int) -> tuple[list, int]:
    """The two hit rows of one (target, seed), and how many entries the merged bank ended with."""
    from chorus_core.bank import MaskBank

    tag = f"{request_name(target).replace('/', '_')}-seed{seed}"
    single = MaskBank.open(workdir / f"single-{tag}")
    merged = MaskBank.open(workdir / f"merged-{tag}")
    merged.set_merge_policy(similarity=SIMILARITY, agreement=AGREEMENT)
    try:
        record_kind(pp, single, [similar], seed)
        record_kind(pp, merged, kind_members(similar, recordings), seed)
        conds = i2v_conditioning(generate_request(target))
        dense_final = pp.sample(pp.patcher, conds, seed)
        base = {"N": tokens_of(pp.config.long_size), "seed": seed, "request": request_name(target)}
        rows = [hit_row(pp, single, conds, seed, dense_final, "hit_single", base),
                hit_row(pp, merged, conds, seed, dense_final, "hit_merged", base)]
        return rows, len(merged.entries())
    finally:
        single.close()
        merged.close()


def summary(rows: list, entries: list, recordings: int) -> dict:
    single, merged = rows_by_pair(rows, "natural", "hit_single"), rows_by_pair(rows, "natural", "hit_merged")
    diff = paired_difference(merged, single, "psnr_db")
    out = {"recordings": recordings, "pairs": diff["pairs"], "requests": diff["requests"],
           "merged_minus_single_db": diff["mean"], "merged_minus_single_db_ci95": diff["ci95"],
           "merged_bank_entries": entries}
    for name, group in (("single", single), ("merged", merged)):
        for metric in ("psnr_db", "density"):
            out[f"{name}_{metric}"], out[f"{name}_{metric}_ci95"] = mean_ci([r[metric] for r in group.values()])
    return out


def markdown(doc: dict) -> str:
    s = doc["summary"]
    fmt = lambda m, c: "n/a" if m is None else f"{m:.2f} ± {c:.2f}"  # noqa: E731
    return "\n".join([
        "# A hit from a merged entry against a hit from one recording (testbed product path)", "",
        f"- command: `{doc['command']}`", f"- machine: {doc['machine']}", f"- date: {doc['date']}",
        f"- commit: {doc['git_commit']}", f"- sampling: {doc['config']}", "",
        f"Each merged bank absorbed {s['recordings']} recordings of the target's kind (entries at the end, "
        f"per pair: {s['merged_bank_entries']}; 1 means every recording merged). PSNR against the dense run "
        "of the same seed; difference paired per (request, seed), mean ± 95 % t interval over requests.", "",
        "| pairs (requests) | single: density; PSNR (dB) | merged: density; PSNR (dB) | merged - single (dB) |",
        "|---|---|---|---|",
        f"| {s['pairs']} ({s['requests']}) | {s['single_density']:.3f}; {fmt(s['single_psnr_db'], s['single_psnr_db_ci95'])} "
        f"| {s['merged_density']:.3f}; {fmt(s['merged_psnr_db'], s['merged_psnr_db_ci95'])} "
        f"| {fmt(s['merged_minus_single_db'], s['merged_minus_single_db_ci95'])} |", ""])


def write(out: Path, doc: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "merge_quality.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "merge_quality.md").write_text(markdown(doc))


def machine() -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return gpu or f"{platform.processor() or platform.machine()} (CPU)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--targets", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--recordings", type=int, default=5, help="recordings each merged entry absorbs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    command = shlex.join(["python", "-m", "tests.testbed.merge_quality"] + list(sys.argv[1:] if argv is None else argv))
    rows, entries, started = [], [], time.time()
    with tempfile.TemporaryDirectory(prefix="chorus-merge-quality-") as tmp:
        patcher, config = load_model(args, Path(tmp))
        pp = ProductPath(patcher, config, Path(tmp), 0.9, print)
        targets, similar, _, _ = eval_requests(config, config.long_size)
        for seed in range(args.seeds):
            for ti in spread_picks(len(targets), min(args.targets, len(targets))):
                pair, count = pair_rows(pp, Path(tmp), targets[ti], similar[ti], seed, args.recordings)
                rows += pair
                entries.append(count)
                doc = {"benchmark": "merge_quality", "command": command, "machine": machine(),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "git_commit": git_commit(), "seconds": round(time.time() - started, 1),
                       "config": f"{pp.steps} steps, cfg {config.sample_cfg}", "rows": rows,
                       "summary": summary(rows, entries, args.recordings)}
                write(args.out, doc)  # after every pair: a run stopped by a time limit keeps its pairs
                print(f"{request_name(targets[ti])} seed {seed}: {pair[0]['psnr_db']:.2f} / {pair[1]['psnr_db']:.2f} dB, "
                      f"{count} merged entries, {time.time() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
