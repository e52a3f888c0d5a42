"""Cost of making masks at full Wan2.1-14B attention shapes, against the sparse attention they feed.

Per layer and CFG branch (batch 1, bf16, 40 heads x 128, ComfyUI layout ``[B, N, H*D]``):
- ``online_prediction``: pool Q/K per 128-token block, block softmax, top-p selection;
- ``recording``: the Triton block-mass kernel (two passes) plus top-p selection; also with
  ``query_stride`` 4 and with the row log-sum-exp given (pass 2 only);
- the pieces of each (``block_scores``, ``selection``, ``block_mass``).
``share_of_sparse_attention`` = ms / (0.15 x torch SDPA cuDNN dense ms, same run): the ideal
sparse attention at density 0.15. Before timing, the kernel is checked against the torch
reference at full N on two heads.

Run on the GPU:  python tests/benchmarks/bench_mask_costs.py --out DIR [--git-commit SHA]
Writes ``mask_costs_h200.json`` and ``.md`` into DIR (see RESULTS.md for the keys).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from chorus_core.attention.masks import first_frame_blocks, select_blocks  # noqa: E402
from chorus_core.attention.online_predictor import block_scores, predict_block_map  # noqa: E402
from kernels.block_mass import block_mass, block_mass_reference  # noqa: E402

HEADS, HEAD_DIM, BLOCK, DENSITY, TOP_P = 40, 128, 128, 0.15, 0.9
DEVICE = "cuda"
SHAPES = {"480p": (32760, 1560), "720p": (75600, 3600)}  # N, tokens per latent frame (81 frames)
CONFIGS = [dict(num_warps=8, num_stages=2), dict(num_warps=4, num_stages=2), dict(num_warps=8, num_stages=3), dict(num_warps=4, num_stages=3)]


def time_ms(fn, budget_ms=400.0, min_iters=5, max_iters=50) -> float:
    """Median of CUDA-event timings; warmed up, with as many runs as fit the budget."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    iters = max(min_iters, min(max_iters, int(budget_ms / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cudnn_dense_ms(q, k, v) -> float:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh = (x.view(1, -1, HEADS, HEAD_DIM).transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh))


def check_kernel(n: int) -> dict:
    """Triton vs torch reference at full N, two heads, bf16 inputs (reference in fp32)."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k = (torch.randn(1, n, 2 * HEAD_DIM, device=DEVICE, generator=g).mul(1.5).bfloat16() for _ in range(2))
    out = {}
    for stride in (1, 4):
        got = block_mass(q, k, heads=2, block_size=BLOCK, query_stride=stride, backend="triton")
        ref = block_mass_reference(q, k, heads=2, block_size=BLOCK, query_stride=stride)
        diff = (got.double() - ref.double())
        out[f"stride{stride}_rel_rms"] = float(diff.square().mean().sqrt() / ref.double().square().mean().sqrt())
        out[f"stride{stride}_max_abs"] = float(diff.abs().max())
        out[f"stride{stride}_nan"] = bool(torch.isnan(got).any())
        out[f"stride{stride}_row_sum_err"] = float((got.double().sum(-1) - 1).abs().max())
    return out


def measure_shape(shape: str, config: dict | None) -> tuple[list[dict], dict]:
    n, frame_tokens = SHAPES[shape]
    sinks = first_frame_blocks(frame_tokens, BLOCK)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    q, k, v = (torch.randn(1, n, HEADS * HEAD_DIM, device=DEVICE, generator=g, dtype=torch.bfloat16) for _ in range(3))
    dense = cudnn_dense_ms(q, k, v)
    sparse_ms = DENSITY * dense
    sel = dict(top_p=TOP_P, sink_blocks=sinks)

    if config is None:  # pick the block-mass launch config on this shape
        trials = [(time_ms(lambda c=c: block_mass(q, k, HEADS, BLOCK, config=c)), c) for c in CONFIGS]
        config = min(trials, key=lambda t: t[0])[1]
        print("config sweep:", [(round(t, 2), c) for t, c in trials], flush=True)
    scores = block_scores(q, k, HEADS, BLOCK)
    mass = block_mass(q, k, HEADS, BLOCK, config=config)
    lse = _row_lse(q, k)
    cases = {
        "online_prediction": lambda: predict_block_map(q, k, HEADS, BLOCK, **sel),
        "block_scores": lambda: block_scores(q, k, HEADS, BLOCK),
        "selection": lambda: select_blocks(scores, **sel),
        "recording": lambda: select_blocks(block_mass(q, k, HEADS, BLOCK, config=config), **sel),
        "block_mass": lambda: block_mass(q, k, HEADS, BLOCK, config=config),
        "recording_query_stride4": lambda: select_blocks(block_mass(q, k, HEADS, BLOCK, query_stride=4, config=config), **sel),
        "recording_given_lse": lambda: select_blocks(block_mass(q, k, HEADS, BLOCK, lse=lse, config=config), **sel),
    }
    rows = []
    for kind, fn in cases.items():
        ms = time_ms(fn)
        rows.append(dict(shape=shape, N=n, batch=1, heads=HEADS, head_dim=HEAD_DIM, block_size=BLOCK, top_p=TOP_P,
                         kind=kind, ms=round(ms, 3), share_of_sparse_attention=round(ms / sparse_ms, 4),
                         dense_cudnn_ms=round(dense, 3), sparse_attention_ms=round(sparse_ms, 3)))  # fmt: skip
        print(f"{shape} {kind:26s} {ms:9.3f} ms  share {ms / sparse_ms:7.3f}", flush=True)
    stats = dict(
        online_density=float(predict_block_map(q, k, HEADS, BLOCK, **sel).float().mean()),
        recorded_density=float(select_blocks(mass, **sel).float().mean()),
        stride4_vs_full_max_abs=float((block_mass(q, k, HEADS, BLOCK, query_stride=4) - mass).abs().max()),
        lse_vs_full_max_abs=float((block_mass(q, k, HEADS, BLOCK, lse=lse) - mass).abs().max()),
    )
    return rows, dict(config=config, dense_cudnn_ms=dense, **stats)


def _row_lse(q, k) -> torch.Tensor:
    """Natural-log row log-sum-exp ``[1, H, N]`` as flash attention would return it (chunked)."""
    qh, kh = (x.view(1, -1, HEADS, HEAD_DIM).transpose(1, 2) for x in (q, k))
    out = torch.empty(qh.shape[:3], device=q.device)
    kt = kh.float().transpose(-1, -2)
    for i in range(0, qh.shape[2], 512):  # 512 rows x 40 heads x 75,600 keys fp32 = 6 GB
        out[:, :, i : i + 512] = (qh[:, :, i : i + 512].float() @ kt * HEAD_DIM**-0.5).logsumexp(-1)
    return out


def git_commit(given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001  (the device copy has no .git)
        return "unknown"


def write_markdown(path: Path, result: dict) -> None:
    lines = [
        "# Mask costs per layer (one CFG branch), Wan2.1-14B attention shapes",
        "",
        f"- machine: {result['machine']}",
        f"- date: {result['date']}",
        f"- command: `{result['command']}`",
        f"- git commit: {result['git_commit']}",
        f"- share_of_sparse_attention = ms / ({DENSITY} x torch SDPA cuDNN dense ms, same run)",
        "",
        "| shape | N | kind | ms | share of sparse attention | dense cuDNN ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['shape']} | {r['N']} | {r['kind']} | {r['ms']:.3f} | {r['share_of_sparse_attention']:.3f} | {r['dense_cudnn_ms']:.1f} |")
    lines += ["", "Kernel check and per-shape details:", "", "```", json.dumps(result["details"], indent=1), "```", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "tests" / "benchmarks" / "results"))
    ap.add_argument("--shapes", default="480p,720p")
    ap.add_argument("--git-commit", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mask_costs needs a CUDA GPU")
    import triton

    details = {"torch": torch.__version__, "triton": triton.__version__, "check_full_480p_2heads": check_kernel(SHAPES["480p"][0])}
    print("kernel check:", details["check_full_480p_2heads"], flush=True)
    rows, config = [], None
    for shape in args.shapes.split(","):
        shape_rows, info = measure_shape(shape, config)
        config = info["config"]
        rows += shape_rows
        details[shape] = info
    result = dict(
        benchmark="bench_mask_costs",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=torch.cuda.get_device_name(),
        command="python " + " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
        git_commit=git_commit(args.git_commit),
        rows=rows,
        details=details,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mask_costs_h200.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(out / "mask_costs_h200.md", result)
    print(f"\n{'shape':5s} {'kind':26s} {'ms':>9s} {'share':>7s}")
    for r in rows:
        print(f"{r['shape']:5s} {r['kind']:26s} {r['ms']:9.3f} {r['share_of_sparse_attention']:7.3f}")


if __name__ == "__main__":
    main()
