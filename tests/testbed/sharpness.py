"""How concentrated a model's attention is: the share of the attention mass the oracle block mask
keeps at a given density (issue 16's sharpness target: >= 0.70 at density 0.15, N >= 16k).

The oracle mask of one (step, layer, head) keeps, in every query-block row, the
``round(density * nk)`` key blocks with the most exact softmax mass (the diagonal forced, as
every mask source in the report); its recall is the mean over queries of the mass it keeps.
Real video DiTs keep ~0.9 of the mass in 10-20 % of the blocks; a diffuse model keeps little
more than the density itself (uniform attention keeps exactly ``round(density * nk) / nk``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from chorus_core._siblings import import_sibling
from chorus_core.quality import mass_recall
from .report import top_blocks
from .run_record import run_record

SHARPNESS_DENSITY = 0.15


def oracle_mass(mass: torch.Tensor, density: float, seq_len: int, block_size: int) -> torch.Tensor:
    """Share of the mass the oracle mask keeps: block mass ``[..., nb, nb]`` (rows sum to 1) -> ``[...]``."""
    return mass_recall(mass, top_blocks(mass, density), seq_len, block_size)


def qk_oracle_mass(q: torch.Tensor, k: torch.Tensor, heads: int, block_size: int,
                   density: float = SHARPNESS_DENSITY) -> torch.Tensor:
    """Oracle mass of one attention call from its q, k (ComfyUI's ``[B, N, H*D]``) -> per head ``[H]`` (batch 0)."""
    bm = import_sibling("kernels.block_mass")
    mass = bm.block_mass(q, k, heads, block_size)[0].float()
    return oracle_mass(mass, density, q.shape[1], block_size)


def summarize_mass(step_layer_mass: torch.Tensor, density: float, seq_len: int, block_size: int) -> dict:
    """Sharpness of a dense run's block mass ``[S, L, H, nb, nb]``: mean over steps, layers and heads,
    per layer (mean over steps and heads) and per step (mean over layers and heads)."""
    kept = oracle_mass(step_layer_mass, density, seq_len, block_size)  # [S, L, H]
    return {"density": density, "mean": float(kept.mean()),
            "per_layer": [round(float(v), 4) for v in kept.mean((0, 2))],
            "per_step": [round(float(v), 4) for v in kept.mean((1, 2))]}


PROFILE_DENSITIES = (0.05, 0.10, 0.15, 0.25)
PROFILE_TOP_PS = (0.8, 0.9, 0.95)


def density_profile(step_layer_mass: torch.Tensor, seq_len: int, block_size: int) -> dict:
    """What the defaults see in a dense run's block mass ``[S, L, H, nb, nb]``: the oracle's kept
    mass at several densities, and the density top-p selection (the recorder's and online
    prediction's rule) keeps at several ``top_p``, without clamps and within the shipped ones."""
    from chorus_core.attention.masks import select_blocks
    from chorus_core.reuse.reuse_run import ReuseOptions

    profile = {"mass_at_density": {str(d): round(float(oracle_mass(step_layer_mass, d, seq_len, block_size).mean()), 4)
                                   for d in PROFILE_DENSITIES},
               "top_p_density": {}}
    shipped = ReuseOptions()
    lo, hi = shipped.min_density, shipped.max_density
    for top_p in PROFILE_TOP_PS:
        free = select_blocks(step_layer_mass, top_p).float().mean()
        clamped = select_blocks(step_layer_mass, top_p, lo, hi).float().mean()
        profile["top_p_density"][str(top_p)] = {"unclamped": round(float(free), 4),
                                                "shipped_bounds": round(float(clamped), 4)}
    return profile


def measure_sharpness(model, config, device: str = "cpu", requests=None, density: float = SHARPNESS_DENSITY,
                      log=print) -> dict:
    """Sharpness of any checkpoint: dense sampling runs of ``requests`` (default: the report's targets
    at ``config.long_size``), oracle mass at ``density`` over every step, layer and head.

    Returns ``{"density", "mean", "per_layer", "per_step", "per_request", "N"}``; the mean is over
    requests too.
    """
    from .config import tokens_of
    from .report import Report, eval_requests

    if requests is None:
        requests = eval_requests(config, config.long_size)[0]
    rep = Report(model, config, device, log)
    seq_len = tokens_of((requests[0].frames, requests[0].height, requests[0].width))
    masses, per_request = [], []
    for i, request in enumerate(requests):
        run = rep.dense_run(request, i)
        summary = summarize_mass(run["mass"], density, seq_len, config.block_size)
        per_request.append({"request": request_name(request), **summary})
        masses.append(run["mass"])
    overall = summarize_mass(torch.cat(masses), density, seq_len, config.block_size)  # requests x steps as steps
    overall["per_step"] = [round(sum(r["per_step"][s] for r in per_request) / len(per_request), 4)
                           for s in range(len(per_request[0]["per_step"]))]
    overall.update({"N": seq_len, "per_request": per_request,
                    **density_profile(torch.cat(masses), seq_len, config.block_size)})
    return overall


def request_name(request) -> str:
    return f"{request.template}/s{request.subject}/l{request.layout}/{request.texture}"


def main(argv=None) -> int:
    """``python -m tests.testbed.sharpness --checkpoint FILE --out DIR [--preset sharp16k] [--requests 4]``:
    the sharpness of a checkpoint (e.g. between training chunks) -> ``DIR/sharpness.json``."""
    parser = argparse.ArgumentParser(description="oracle mass at density 0.15 of a testbed checkpoint")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="sharp16k")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--requests", type=int, default=4, help="held-out targets (spread over the list)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    from chorus_core.comfy.comfyui_locator import prepare_in_process
    from .config import make_config
    from .report import eval_requests, spread_picks
    from .train import load_checkpoint

    prepare_in_process(cpu=args.device == "cpu")
    config = make_config(args.preset, args.set)
    targets = eval_requests(config, config.long_size)[0]
    requests = [targets[i] for i in spread_picks(len(targets), min(args.requests, len(targets)))]
    result = measure_sharpness(load_checkpoint(args.checkpoint, config, args.device), config, args.device, requests)
    args.out.mkdir(parents=True, exist_ok=True)
    run = run_record("python -m tests.testbed.sharpness " + " ".join(argv or sys.argv[1:]),
                     on_gpu=args.device.startswith("cuda"))
    record = {**run, "checkpoint": str(args.checkpoint), **result}
    (args.out / "sharpness.json").write_text(json.dumps(record, indent=1))
    print(f"oracle mass at {result['density']}: {result['mean']:.3f} (per layer {result['per_layer']}) at N={result['N']}")
    print(f"oracle mass by density {result['mass_at_density']}; density top-p selects {result['top_p_density']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
