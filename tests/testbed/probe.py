"""Probe testbed designs before training one (issue 23): which design concentrates attention?

    python -m tests.testbed.probe --candidates sharp16k,probe_heads8x64 --seconds-each 110 --out DIR

In one process each candidate (a preset of ``config.PROBE_CANDIDATES``) is trained from scratch
for a fixed wall-clock budget, and its sharpness (``sharpness.measure_sharpness``: the oracle
mask's share of the attention mass at density 0.15, per layer) is measured at step 0 and every
``--every`` steps, so candidates compare at equal step counts (level) and by their rise (slope).
Measuring does not count against the training budget. A whole-call deadline shortens the later
candidates' budgets (and skips what no longer fits), so the call ends in time.

One workload family, the template ``--hold-out`` (default ``bounce``), is removed from every
candidate's training and measurement: the quality table can later use it as the family that did
not choose the design.

Writes ``DIR/probe.json`` (after every candidate, so a cut-off run keeps what it measured) and
``DIR/probe.md``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from chorus_core.testbed.workload import TEMPLATES
from .config import PROBE_CANDIDATES, TestbedConfig, config_with_overrides, tokens_of
from .run_record import git_commit
from .sharpness import SHARPNESS_DENSITY

HELD_OUT_DEFAULT = "bounce"
MIN_BUDGET_S = 20.0        # a candidate with less training time left than this is skipped
FIRST_OVERHEAD_S = 30.0    # data, gradient check and measurements of a candidate, before one is measured

WHAT_IT_TESTS = {
    "sharp16k": "baseline: 3 heads x 128, 6 layers, 64 x 64 latents, detailed workload",
    "probe_heads8x48": "8 heads x 48 at the same width and depth (more, narrower heads)",
    "probe_heads8x64": "8 heads x 64, width 512, 4 layers (more heads, fewer layers)",
    "probe_heads6x128": "6 heads x 128, width 768, 3 layers (more heads of Wan's own width)",
    "probe_wide": "latents 32 x 128: rows of 64 tokens, a block is a 2-row patch, not a 4-row strip",
    "probe_multi": "multi workload: 3 objects moving differently, far travel, occlusion and reappearance",
    "probe_frames32": "32 frames (32,768 tokens): a frame is 8 of 256 blocks",
    "probe_curriculum": "short 4-frame clips first, long share ramping to 0.7 over 600 steps",
    "probe_combo": "8 x 64 heads, 4 layers, wide latents and the multi workload together",
    "probe_qk_lr10": "q/k norm gains (attention temperature) at 10x the learning rate",
    "probe_qk_lr30": "q/k norm gains at 30x the learning rate",
    "probe_qk_init2": "q/k norm gains starting at 1.5 (logits x 2.25), 10x the learning rate",
    "probe_qk_heads6x128": "6 heads x 128, 3 layers, q/k norm gains at 10x the learning rate",
    "probe_shift1": "trained at flow shift 1 (half the steps at low noise) instead of 5",
    "probe_shift05": "trained at flow shift 0.5 (most steps at low noise)",
    "probe_shift1_multi": "flow shift 1 and the multi workload",
    "probe_shift025": "trained at flow shift 0.25",
    "probe_shift05_curriculum": "flow shift 0.5 and short clips first",
    "probe_shift05_entropy": "flow shift 0.5, attention entropy penalised (weight 0.02)",
    "probe_shift05_entropy_strong": "flow shift 0.5, attention entropy penalised (weight 0.1)",
    "probe_shift05_heads6x128": "flow shift 0.5, 6 heads x 128, 3 layers",
    "tiny_sharp": "CPU-test size of sharp16k",
    "tiny_probe_heads": "CPU-test size, 4 heads x 32, multi workload",
}


def candidate_config(name: str, held_out: str, overrides=None) -> TestbedConfig:
    """The candidate's preset without the held-out template (training and measurement), then ``--set``."""
    if name not in PROBE_CANDIDATES:
        raise SystemExit(f"unknown candidate {name!r}; choose from {', '.join(PROBE_CANDIDATES)}")
    config = PROBE_CANDIDATES[name]()
    if held_out:
        kept = tuple(t for t in config.train_templates if t != held_out)
        config = replace(config, train_templates=kept,
                         eval_templates=tuple(t for t in (config.eval_templates or TEMPLATES) if t != held_out))
    return config_with_overrides(config, overrides)


def probe_requests(config: TestbedConfig, count: int) -> list:
    """The sharpness CLI's choice: ``count`` of the report's targets spread over the list."""
    from .report import eval_requests, spread_picks

    targets = eval_requests(config, config.long_size)[0]
    return [targets[i] for i in spread_picks(len(targets), min(count, len(targets)))]


def least_squares_slope(xs, ys) -> float:
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else float("nan")


def slope_per_1k(checkpoints: list, every: int) -> float:
    """Rise of the mean oracle mass per 1,000 steps: least squares over the checkpoints from step ``every`` on
    (step 0, the untrained model, is left out: it measures the initialisation, not learning)."""
    rows = [c for c in checkpoints if c["step"] >= every]
    return 1000.0 * least_squares_slope([c["step"] for c in rows], [c["mean"] for c in rows])


def run_candidate(name: str, config: TestbedConfig, device: str, every: int, requests: int, log=print) -> dict:
    """Train one candidate from scratch for ``config.time_budget_s``, measuring at step 0, every ``every`` steps
    and at the end."""
    from .models import build_model, is_qk_gain
    from .sharpness import measure_sharpness
    from .train import train

    wall0 = time.time()
    chosen = probe_requests(config, requests)
    checkpoints = []

    def measure(step, model):
        t0 = time.time()
        with torch.no_grad():
            result = measure_sharpness(model, config, device, chosen, log=lambda *_: None)
        checkpoints.append({"step": step, "mean": round(result["mean"], 4), "per_layer": result["per_layer"],
                            "per_step": result["per_step"], "seconds": round(time.time() - t0, 2)})
        log(f"[{name}] step {step}: oracle mass at {SHARPNESS_DENSITY} = {result['mean']:.4f} "
            f"(per layer {result['per_layer']})")

    model = build_model(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    measure(0, model.eval())
    result = train(config, device, log=log, model=model, on_checkpoint=measure, checkpoint_every=every)
    if checkpoints[-1]["step"] != result["steps"]:
        measure(result["steps"], result["model"])
    history = result["log"]
    final = checkpoints[-1]
    gains = [p.detach().float().mean().item() for n, p in result["model"].named_parameters() if is_qk_gain(n)]
    row = {"name": name, "tests": WHAT_IT_TESTS.get(name, ""), "config": asdict(config), "params": params,
           "heads": config.num_heads, "N": tokens_of(config.long_size), "steps": result["steps"],
           "budget_s": round(config.time_budget_s, 1), "seconds": round(result["seconds"], 1), "data_seconds": round(result["data_seconds"], 1),
           "steps_per_s": round(result["steps"] / max(result["seconds"], 1e-9), 2),
           "wall_seconds": round(time.time() - wall0, 1), "attention": result["attention"],
           "requests": [f"{r.template}/s{r.subject}/l{r.layout}/{r.texture}" for r in chosen],
           "checkpoints": checkpoints, "final": final["mean"], "final_step": final["step"],
           "final_per_layer": final["per_layer"], "slope_per_1k": round(slope_per_1k(checkpoints, every), 4),
           "final_loss_long": _final_loss(history, "long"), "qk_gain_mean": round(sum(gains) / len(gains), 3),
           "loss_curve": history}
    del model, result
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()
    return row


def _final_loss(history: list, size: str, last: int = 10):
    values = [h["loss"] for h in history if h["size"] == size][-last:]
    return round(sum(values) / len(values), 4) if values else None


def budget_for(seconds_each: float, time_left: float, candidates_left: int, overhead: float) -> float:
    """Training seconds for the next candidate: ``seconds_each``, or less so that every candidate left
    (each with ``overhead`` seconds of data, check and measurements) ends before the deadline."""
    return min(seconds_each, (time_left - candidates_left * overhead) / candidates_left)


def render_markdown(doc: dict) -> str:
    rows = [c for c in doc["candidates"] if "checkpoints" in c]
    steps = sorted({c["step"] for row in rows for c in row["checkpoints"] if c["step"] % doc["every"] == 0})
    lines = [f"# Testbed probe: oracle mass at density {doc['density']} by design\n",
             f"`{doc['command']}` on {doc['machine']}, {doc['date']}, commit {doc['git_commit']}.",
             f"Held-out workload family (no candidate trained or measured on it): template `{doc['held_out']}`.",
             f"Each candidate trained from scratch for up to {doc['seconds_each']:.0f} s (less where the call's deadline "
             f"needed it; measuring not counted: column `train s`); "
             f"sharpness = `sharpness.measure_sharpness` on {doc['requests']} held-out-subject request(s) of its "
             f"own workload. Slope: least squares over the checkpoints from step {doc['every']} on, per 1,000 steps.\n"]
    head = ["candidate", "tests", "params (M)", "N", "heads x dim x layers", "train s", "steps/s", "steps"]
    head += [f"@{s}" for s in steps] + ["final", "slope /1k", "loss (long)", "q/k gain"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        at = {c["step"]: c["mean"] for c in row["checkpoints"]}
        cells = [row["name"], row["tests"], f"{row['params'] / 1e6:.2f}", str(row["N"]),
                 f"{row['heads']} x {row['config']['head_dim']} x {row['config']['num_layers']}",
                 f"{row['seconds']:.0f}", f"{row['steps_per_s']:.2f}", str(row["steps"])]
        cells += [f"{at[s]:.3f}" if s in at else "" for s in steps]
        cells += [f"{row['final']:.3f} (@{row['final_step']})", f"{row['slope_per_1k']:+.3f}", str(row["final_loss_long"]),
                  str(row.get("qk_gain_mean", ""))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Final oracle mass per layer:", ""]
    lines += [f"- {row['name']}: {row['final_per_layer']}" for row in rows]
    skipped = [c for c in doc["candidates"] if "skipped" in c]
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{c['name']} ({c['skipped']})" for c in skipped)]
    return "\n".join(lines) + "\n"


def write_outputs(doc: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(doc, indent=1))
    (out / "probe.md").write_text(render_markdown(doc))


def main(argv=None) -> int:
    started = time.time()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", required=True, help=f"comma-separated, from {', '.join(PROBE_CANDIDATES)}")
    parser.add_argument("--seconds-each", type=float, default=110.0, help="training seconds per candidate")
    parser.add_argument("--every", type=int, default=200, help="measure sharpness every this many steps")
    parser.add_argument("--requests", type=int, default=2, help="requests per sharpness measurement")
    parser.add_argument("--hold-out", default=HELD_OUT_DEFAULT, choices=list(TEMPLATES) + [""],
                        help="template no candidate trains or is measured on ('' = none)")
    parser.add_argument("--deadline-s", type=float, default=515.0, help="the whole call ends within this many seconds")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override for every candidate")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    names = [n for n in args.candidates.split(",") if n]
    configs = {n: candidate_config(n, args.hold_out, args.set) for n in names}  # bad names fail before any work
    from chorus_core.comfy.comfyui_locator import prepare_in_process

    prepare_in_process(cpu=args.device == "cpu")
    doc = {"machine": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
           "command": "python -m tests.testbed.probe " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "git_commit": git_commit(), "torch": torch.__version__, "held_out": args.hold_out,
           "density": SHARPNESS_DENSITY, "every": args.every, "requests": args.requests,
           "seconds_each": args.seconds_each, "candidates": []}
    overhead = FIRST_OVERHEAD_S
    for i, name in enumerate(names):
        budget = budget_for(args.seconds_each, args.deadline_s - (time.time() - started), len(names) - i, overhead)
        if budget < MIN_BUDGET_S:
            doc["candidates"].append({"name": name, "skipped": f"out of time: {budget:.0f} s of training left"})
            print(f"[{name}] skipped: out of time")
            continue
        row = run_candidate(name, replace(configs[name], time_budget_s=budget), args.device, args.every, args.requests)
        overhead = max(overhead, row["wall_seconds"] - row["seconds"])
        doc["candidates"].append(row)
        write_outputs(doc, args.out)
    doc["wall_seconds"] = round(time.time() - started, 1)
    write_outputs(doc, args.out)
    print(render_markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
