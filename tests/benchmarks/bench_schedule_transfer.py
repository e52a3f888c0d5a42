"""Does a bank entry recorded on one sigma schedule serve a run on another? (issue 24 item 2)

    .venv/bin/python tests/benchmarks/bench_schedule_transfer.py [--preset cpu2k] [--targets 2] [--long 20]
    .venv/bin/python tests/benchmarks/bench_schedule_transfer.py --checkpoint SHARP16K --preset sharp16k \
        --set long_size=[8,32,32] --set block_size=64 --targets 4     # its weights, its workload, 2,048 tokens
    python tests/benchmarks/bench_schedule_transfer.py --checkpoint ENTROPY16K --preset entropy16k \
        --long 40 --short 4 --targets 8 --name schedule_transfer_entropy16k_h200   # on a GPU, 16,384 tokens

On the committed testbed model (``tests/testbed/``; ``--checkpoint`` for another), at the preset's
size (cpu2k: 2,048 tokens, block 64, a 2-core CPU is enough). For each target request, its similar
source request is recorded as shipped (a Chorus Sparse Attention miss: online prediction, every
step recorded) once at ``--long`` steps and once at ``--short`` steps (euler, simple, cfg 1, the
product-path harness's sampling). The target then runs at both step counts:

- ``dense``: the reference (PSNR etc. are against it, same steps and seed);
- ``hit_same_schedule``: a hit on the entry recorded at its own step count;
- ``hit_by_sigma``: a hit on the entry of the other step count, each step served the bucket
  recorded at its sigma (what ships);
- ``hit_by_step_index``: the same entry addressed by step index rescaled to the run (entries
  without sigmas, and every entry before this change);
- ``shipped``: the other step count's entry as the product decides: served by sigma when it was
  recorded at least as finely as the run, else a miss (``entry_source.schedule_shortfall``, chosen
  from this benchmark's first two modes; they serve the entry whatever its schedule);
- ``online_miss``: online prediction with the miss's dense warm-up (what a miss runs).

Runs on the GPU when there is one. Writes ``NAME.json`` and ``.md`` into ``--out`` (default
tests/benchmarks/results; NAME is ``--name``, else ``schedule_transfer_cpu`` or ``_gpu``) after
every target, with a paired table (the same requests and seeds) beside the per-mode one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

TESTBED = REPO_ROOT / "tests" / "testbed" / "chorus_testbed_wan21_i2v.safetensors"
MODES = ("hit_same_schedule", "hit_by_sigma", "hit_by_step_index", "shipped", "online_miss")


def log(msg: str) -> None:
    print(f"[bench_schedule_transfer] {msg}", flush=True)


@contextlib.contextmanager
def step_index_addressing():
    """Serve entries as before sigmas were kept: by step index rescaled to the run."""
    from chorus_core.reuse import entry_source

    shipped = entry_source.entry_buckets_for_run
    entry_source.entry_buckets_for_run = lambda schedule, steps, run_sigmas=None: shipped(schedule, steps, None)
    try:
        yield
    finally:
        entry_source.entry_buckets_for_run = shipped


@contextlib.contextmanager
def serving_any_schedule():
    """Serve the entry whatever its schedule: what a hit across schedules would give, which the
    shipped rule (``entry_source.schedule_shortfall``) was chosen from."""
    from chorus_core.reuse import entry_source, reuse_run

    shipped = entry_source.schedule_shortfall
    entry_source.schedule_shortfall = reuse_run.schedule_shortfall = lambda *args, **kwargs: None
    try:
        yield
    finally:
        entry_source.schedule_shortfall = reuse_run.schedule_shortfall = shipped


def addressing(mode: str):
    """The serving rule of a mode: forced by sigma or by step index, or as shipped."""
    if mode == "shipped":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(serving_any_schedule())
    if mode == "hit_by_step_index":
        stack.enter_context(step_index_addressing())
    return stack


def run_target(pps: dict, banks: dict, target, seed: int) -> list[dict]:
    """Every mode of one target at every step count; rows with PSNR etc. against dense."""
    from chorus_core.attention.mask_provider import DenseProvider
    from chorus_core.reuse.reuse_run import ReuseOptions
    from tests.testbed.product_path import final_quality
    from tests.testbed.sharpness import request_name
    from chorus_core.testbed.workload import generate_request, i2v_conditioning

    conds = i2v_conditioning(generate_request(target))
    rows = []
    for steps, pp in pps.items():
        other = next(s for s in pps if s != steps)
        dense = pp.with_provider(DenseProvider((pp.bs, pp.bs)), conds, seed, warmup=0)
        runs = {}
        for mode in MODES:
            entry_steps = steps if mode == "hit_same_schedule" else other
            if mode == "online_miss":
                runs[mode] = pp.reuse_run(None, conds, seed, ReuseOptions(record_on_miss=False, dense_last_steps=0))
                continue
            match = pp.match(banks[entry_steps], conds, pp.threshold)
            with addressing(mode):
                runs[mode] = pp.reuse_run(match, conds, seed, ReuseOptions(record_on_miss=False, dense_last_steps=0))
        for mode, (final, report) in runs.items():
            rows.append({"request": request_name(target), "seed": seed, "N": pp.seq_len, "run_steps": steps,
                         "entry_steps": None if mode == "online_miss" else (steps if mode == "hit_same_schedule" else other),
                         "mode": mode, "report_mode": report.mode, "density": report.density,
                         "dense_steps": len(report.dense_steps), **final_quality(dense, final)})
            log(f"{rows[-1]['request']} {steps} steps {mode}: {rows[-1]['psnr_db']:.2f} dB ({report.mode})")
    return rows


def measure(patcher, config, workdir: Path, steps_pair: tuple, targets: int, seeds: int, save=None) -> list[dict]:
    """Every target's rows; ``save(rows)`` after each target, so a run cut off keeps what it measured."""
    from chorus_core.bank import MaskBank
    from tests.testbed.config import tokens_of
    from tests.testbed.product_path import ProductPath
    from tests.testbed.report import eval_requests, spread_picks
    from chorus_core.testbed.workload import generate_request, i2v_conditioning

    pps = {}
    for steps in steps_pair:
        pps[steps] = ProductPath(patcher, replace(config, sample_steps=steps), workdir, log=log)
        pps[steps].seq_len = tokens_of(config.long_size)
    tgts, similar, _, _ = eval_requests(config, config.long_size)
    rows = []
    for seed in range(seeds):
        for ti in spread_picks(len(tgts), min(targets, len(tgts))):
            banks = {s: MaskBank.open(workdir / f"bank-{ti}-{seed}-{s}") for s in steps_pair}
            for steps, pp in pps.items():
                pp.record(banks[steps], i2v_conditioning(generate_request(similar[ti])), seed)
            rows += run_target(pps, banks, tgts[ti], seed)
            for bank in banks.values():
                bank.close()
            if save is not None:
                save(rows)
    return rows


# The pairs that decide the serving rule: an entry of the other step count served by sigma, set
# against the run's own entry, an online miss, and the same entry addressed by step index
PAIRED = (("hit_by_sigma", "hit_same_schedule"), ("hit_by_sigma", "online_miss"), ("hit_by_sigma", "hit_by_step_index"))


def paired_table(rows: list[dict]) -> list[str]:
    """A - B on the same (request, seed), averaged over each request's seeds, 95 % t over requests."""
    from tests.testbed.comparisons import paired_difference, plus_minus

    lines = ["| run steps | A | B | PSNR A - B (dB) | pairs | requests |", "|---|---|---|---|---|---|"]
    for steps in sorted({r["run_steps"] for r in rows}):
        by_mode = {}
        for r in rows:
            if r["run_steps"] == steps:
                by_mode.setdefault(r["mode"], {})[(r["request"], r["seed"])] = r
        for a, b in PAIRED:
            if a in by_mode and b in by_mode:
                d = paired_difference(by_mode[a], by_mode[b], "psnr_db")
                # one request has no interval: print none rather than a misleading ± 0.00
                cell = plus_minus(d["mean"], d["ci95"] if d["requests"] >= 2 else None)
                lines.append(f"| {steps} | {a} | {b} | {cell} | {d['pairs']} | {d['requests']} |")
    return lines


def table(rows: list[dict]) -> list[str]:
    from tests.testbed.comparisons import mean_ci

    lines = ["| run steps | mode | entry steps | hits | PSNR dB | SSIM | rel RMS | density | n |",
             "|---|---|---|---|---|---|---|---|---|"]
    for steps in sorted({r["run_steps"] for r in rows}):
        for mode in MODES:
            sel = [r for r in rows if r["run_steps"] == steps and r["mode"] == mode]
            if not sel:
                continue
            cells = []
            for key, fmt in (("psnr_db", "{:.2f}"), ("ssim", "{:.4f}"), ("rel_rms", "{:.4f}"), ("density", "{:.3f}")):
                mean, half = mean_ci([r[key] for r in sel])
                cells.append("-" if mean is None else f"{fmt.format(mean)} ± {fmt.format(half)}")
            hits = sum(r["report_mode"] == "hit" for r in sel)
            lines.append(f"| {steps} | {mode} | {sel[0]['entry_steps'] or '-'} | {hits}/{len(sel)} | "
                         + " | ".join(cells) + f" | {len(sel)} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=str(TESTBED))
    parser.add_argument("--preset", default="cpu2k", help="the checkpoint's own preset (sharp16k for its weights)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="vary the preset, e.g. long_size=[8,32,32] block_size=64 for 2,048 tokens on a CPU")
    parser.add_argument("--long", type=int, default=20)
    parser.add_argument("--short", type=int, default=4)
    parser.add_argument("--targets", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "benchmarks" / "results")
    parser.add_argument("--name", help="result file stem (default schedule_transfer_cpu, or _gpu on a GPU)")
    args = parser.parse_args(argv)
    if args.long == args.short:
        parser.error("--long and --short must differ: the benchmark serves each one's entry to the other")
    from chorus_core.comfy.comfyui_locator import locate_comfyui, prepare_in_process

    # the GPU when there is one: entropy16k's own 16,384 tokens are too many for a 2-core CPU
    on_gpu = torch.cuda.is_available()
    prepare_in_process(locate_comfyui(allow_clone=False), cpu=not on_gpu)
    import comfy.sd

    from tests.testbed.config import make_config, size_name
    from tests.testbed.run_record import run_record

    config = make_config(args.preset, args.set)
    started = time.time()
    command = "python tests/benchmarks/bench_schedule_transfer.py " + " ".join(argv if argv is not None else sys.argv[1:])
    stem = args.name or ("schedule_transfer_gpu" if on_gpu else "schedule_transfer_cpu")

    def save(rows: list[dict]) -> None:
        doc = {"benchmark": "bench_schedule_transfer", **run_record(command.strip(), on_gpu), "preset": args.preset,
               "shape": size_name(config.long_size), "block": config.block_size,
               "seconds": round(time.time() - started, 1), "rows": rows}
        write_results(args.out, stem, doc)

    with tempfile.TemporaryDirectory(prefix="chorus-schedule-transfer-") as tmp:
        patcher = comfy.sd.load_diffusion_model(args.checkpoint)
        rows = measure(patcher, config, Path(tmp), (args.long, args.short), args.targets, args.seeds, save)
    save(rows)
    print("\n".join(table(rows) + [""] + paired_table(rows)))
    return 0


def write_results(out: Path, stem: str, doc: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    rows = doc["rows"]
    md = [f"# A bank entry served to a run on another sigma schedule ({doc['shape']}, block {doc['block']})", "",
          f"- machine: {doc['machine']}", f"- command: `{doc['command']}`", f"- git commit: {doc['git_commit']}",
          f"- date: {doc['date']}, {doc['seconds']} s", "",
          "Final latents against the dense run of the same steps and seed (mean ± 95 % CI).", "", *table(rows), "",
          "Paired on (request, seed), averaged over each request's seeds, mean ± 95 % t over requests.", "",
          *paired_table(rows)]
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    sys.exit(main())
