"""Where FP8 attention's error comes from on the testbed: each half of the scheme alone, per call.

The hit with ``attention_precision`` "fp8" was 0.90 dB under the 16-bit hit on the ``entropy16k``
product path (``tests/benchmarks/results/product_path_entropy16k_fp8_h100/``). The scheme has two
halves, QK^T in int8 (K smoothed, a scale per block) and PV in e4m3 (P at a fixed scale, V a scale
per channel). Here one dense run of one request records q, k and v of every (step, layer); each
call is then attended over its oracle blocks at the hit's density by the pure-torch references:

- ``16-bit``: the block-sparse reference on float16 inputs (what the 16-bit hit computes);
- ``fp8``: the whole scheme (what the kernel computes);
- ``int8 QK only``: QK^T quantised, P and V in float32;
- ``e4m3 PV only``: P and V quantised, QK^T in float32;

and each output's relative L2 error against the float32 output of the same blocks is reported per
call and as a mean, so the half that loses most is the one to change. Run on the CPU (minutes):

    python -m tests.testbed.train --join-parts tests/testbed/entropy16k --out /tmp/e16k
    python -m tests.testbed.fp8_ablation --checkpoint /tmp/e16k/chorus_testbed_wan21_i2v.safetensors \\
        --preset entropy16k --set sample_steps=4 --request fade/s109/l1/detailed --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

ARMS = {  # name -> the reference's scheme arguments (None: the 16-bit reference)
    "16-bit": None,
    "fp8": {},
    "int8 QK only": {"quantize_pv": False},
    "e4m3 PV only": {"qk_dtype": None},
}
HIT_DENSITY = 0.187  # the hit's density on this testbed at top-p 0.9 (product_path_entropy16k_fp8_h100)


def call_errors(q, k, v, heads: int, block_map: torch.Tensor, block_size: int) -> dict:
    """Relative L2 error of each arm's output against float32, for one call (``[1, N, H*D]`` inputs,
    a bool ``[H, nb, nb]`` map)."""
    from kernels.block_sparse import block_map_to_mask, block_sparse_attention_reference
    from kernels.fp8_block_sparse import fp8_block_sparse_attention_reference

    n = q.shape[1]
    mask = block_map_to_mask(block_map[None], block_size, block_size, n)
    exact = block_sparse_attention_reference(q.float(), k.float(), v.float(), mask, heads).float()
    half = [x.half() for x in (q, k, v)]  # as ComfyUI computes Wan
    errors = {}
    for name, scheme in ARMS.items():
        if scheme is None:
            out = block_sparse_attention_reference(*half, mask, heads)
        else:
            out = fp8_block_sparse_attention_reference(*half, mask, heads, **scheme)
        errors[name] = round(((out.float() - exact).norm() / exact.norm()).item(), 6)
    return errors


def ablate(model, config, request, device: str = "cpu", density: float = HIT_DENSITY, log=print) -> dict:
    """One dense run of ``request``; every (step, layer) call's errors and their means per arm."""
    from .report import Report, top_blocks

    # one bucket per step: the dense run's buckets are not used here, and the preset's are for 10 steps
    config = dataclasses.replace(config, step_buckets=tuple((s,) for s in range(config.sample_steps)))
    rep = Report(model, config, device, log)
    run = rep.dense_run(request, 0, qkv_steps=range(config.sample_steps))
    calls = []
    for (step, layer), (q, k, v, heads) in sorted(run["qkv"].items()):
        block_map = top_blocks(run["mass"][step, layer].float(), density)
        calls.append({"step": step, "layer": layer, **call_errors(q, k, v, heads, block_map, config.block_size)})
        log(f"step {step} layer {layer}: {calls[-1]}")
    means = {name: round(statistics.mean(c[name] for c in calls), 6) for name in ARMS}
    return {"density": density, "calls": calls, "mean_rel_err": means}


def write_markdown(path: Path, record: dict) -> None:
    lines = ["# FP8 attention's error by half of the scheme, one testbed request", "",
             f"- machine: {record['machine']}; date: {record['date']}; commit: `{record['git_commit']}`",
             f"- command: `{record['command']}`",
             f"- request `{record['request']}`, {len(record['calls'])} calls (every step and layer of one dense "
             f"run), oracle blocks at density {record['density']}", "",
             "Relative L2 error of each output against the float32 output over the same blocks:", "",
             "| step | layer | " + " | ".join(ARMS) + " |", "|---|---|" + "---|" * len(ARMS)]
    lines += [f"| {c['step']} | {c['layer']} | " + " | ".join(str(c[a]) for a in ARMS) + " |" for c in record["calls"]]
    lines += ["| mean | | " + " | ".join(str(record["mean_rel_err"][a]) for a in ARMS) + " |"]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="FP8 attention's error by half of its scheme on one testbed request")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="entropy16k")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--request", default=None, help="a target's name (template/sN/lN/texture); default the first")
    parser.add_argument("--density", type=float, default=HIT_DENSITY)
    args = parser.parse_args(argv)
    from chorus_core.comfy.comfyui_locator import prepare_in_process
    from .config import make_config
    from .report import eval_requests
    from .run_record import run_record
    from .sharpness import request_name
    from .train import load_checkpoint

    prepare_in_process(cpu=True)
    config = make_config(args.preset, args.set)
    targets = eval_requests(config, config.long_size)[0]
    named = {request_name(r): r for r in targets}
    if args.request is not None and args.request not in named:
        parser.error(f"--request {args.request!r} is not a target; the targets are: {', '.join(named)}")
    name = args.request or request_name(targets[0])
    result = ablate(load_checkpoint(args.checkpoint, config, "cpu"), config, named[name], "cpu", args.density)
    record = {**run_record("python -m tests.testbed.fp8_ablation " + " ".join(argv or sys.argv[1:]), on_gpu=False),
              "checkpoint": str(args.checkpoint), "request": name, **result}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_ablation.json").write_text(json.dumps(record, indent=1) + "\n")
    write_markdown(args.out / "fp8_ablation.md", record)
    print(f"mean relative error by arm: {result['mean_rel_err']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
