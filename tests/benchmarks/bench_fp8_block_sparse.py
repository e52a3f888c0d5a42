"""FP8 block-sparse attention at Wan2.1-14B shapes: accuracy against the bf16 kernel, speed per kept block.

Run on a CUDA machine from the repo root ([user-stack] item 2):

    python tests/benchmarks/bench_fp8_block_sparse.py --out DIR [--sweep]

For 480p and 720p (81 frames, 40 heads x 128, batch 1, float16 as ComfyUI computes Wan, ComfyUI's
``[B, N, H*D]`` layout) and densities 0.05-0.5 of structured masks (``bench_block_sparse``'s):

- **accuracy**: the FP8 output (``kernels.fp8_block_sparse.fp8_block_sparse_attention``, the path a
  node with ``attention_precision`` "fp8" runs) against the bf16 block-sparse output (the Triton
  kernel) on two kinds of data: ``spread`` (unit-normal q, k, v, keys offset per channel, the case
  smoothing K is for) and ``sharp`` (q scaled by 4: peaked attention, where quantising QK^T hurts
  most). Cosine similarity over the whole output and the worst row's relative L2 error;
- **speed**: cuDNN dense SDPA, the bf16 Triton block-sparse kernel, and the FP8 call (quantisation
  included) with its quantisation timed apart; per kept block, each sparse call's time per kept
  query-key block pair divided by cuDNN's time per block pair (below 1: a kept block costs less
  than one of cuDNN's).

- **int8 QK^T with 16-bit P and V** (``int8qk``: ``fp8_block_sparse_attn_fwd(..., pv_fp8=False)``,
  SageAttention 1's split, not yet a node option): the same accuracy and speed columns, because on
  the testbed the e4m3 P and V carried most of the FP8 scheme's error (``tests/testbed/fp8_ablation.py``).

``--sweep`` first tries FP8 tile configs at 720p, density 0.15, and times the table with the best.
Writes fp8_block_sparse.json and .md into DIR (keys: RESULTS.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_block_sparse import HEAD_DIM, HEADS, SHAPES, bench, kept_flops, structured_block_map  # noqa: E402

from kernels.block_sparse import block_map_to_mask, block_sparse_attention, last_backend_choice  # noqa: E402
from kernels.fp8_block_sparse import fp8_block_sparse_attention  # noqa: E402
from kernels.layouts import output_buffer, to_bhnd  # noqa: E402
from kernels.triton_fp8_block_sparse import fp8_block_sparse_attn_fwd  # noqa: E402

BLOCK = 128
DENSITIES = [0.05, 0.10, 0.15, 0.25, 0.50]
DTYPE = torch.float16
SWEEP = [
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3),
]


def make_qkv(n: int, kind: str, seed: int = 0):
    """[1, N, H*D] float16: ``spread`` (keys offset per channel) or ``sharp`` (q scaled by 4 too)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (1, n, HEADS * HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", generator=g) for _ in range(3))
    k = k + 4.0 * torch.randn(1, 1, HEADS * HEAD_DIM, device="cuda", generator=g)
    if kind == "sharp":
        q = q * 4.0
    return [x.to(DTYPE) for x in (q, k, v)]


def accuracy(fp8_out, bf16_out) -> dict:
    a, b = fp8_out.float().flatten(0, 1), bf16_out.float().flatten(0, 1)  # [N, H*D] rows per head below
    a, b = a.view(-1, HEADS, HEAD_DIM), b.view(-1, HEADS, HEAD_DIM)
    row_err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)
    cosine = F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
    return dict(cosine=round(cosine, 6), worst_row_rel_err=round(row_err.max().item(), 5),
                median_row_rel_err=round(row_err.median().item(), 5))


def sweep(log) -> tuple[dict, list]:
    n = math.prod(SHAPES["720p"])
    q, k, v = make_qkv(n, "spread")
    mask = block_map_to_mask(structured_block_map(SHAPES["720p"], 1, 0.15, 0), BLOCK, BLOCK, n)
    rows = []
    for cfg in SWEEP:
        try:
            ms = bench(lambda: fp8_block_sparse_attention(q, k, v, mask, HEADS, config=cfg))
        except Exception as exc:  # noqa: BLE001  (a config that does not compile is a result)
            rows.append(dict(config=cfg, ms=None, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            log(f"sweep {cfg}: {rows[-1]['error']}")
            continue
        rows.append(dict(config=cfg, ms=round(ms, 3)))
        log(f"sweep {cfg}: {ms:.3f} ms")
    best = min((r for r in rows if r["ms"] is not None), key=lambda r: r["ms"])
    return best["config"], rows


def shape_rows(shape: str, config, log) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.triton_fp8_block_sparse import quantize

    def int8qk(qx, kx, vx, mask):  # the kernel with P and V 16-bit, on [B, N, H*D] inputs
        heads_first = [to_bhnd(x, HEADS, False) for x in (qx, kx, vx)]
        out, oh = output_buffer(heads_first[0], False)
        fp8_block_sparse_attn_fwd(*heads_first, oh, mask, config, pv_fp8=False)
        return out

    n = math.prod(SHAPES[shape])
    nb = math.ceil(n / BLOCK)
    data = {kind: make_qkv(n, kind) for kind in ("spread", "sharp")}
    q, k, v = data["spread"]
    q4, k4, v4 = (x.view(1, n, HEADS, HEAD_DIM).transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn_ms = bench(lambda: F.scaled_dot_product_attention(q4, k4, v4))
    dense_flops = 4 * HEAD_DIM * n * n * HEADS
    per_block_cudnn = cudnn_ms / (HEADS * nb * nb)
    quant_ms = bench(lambda: quantize(q4, k4, v4, BLOCK, BLOCK))
    log(f"{shape}: {n} tokens, cuDNN dense {cudnn_ms:.2f} ms ({dense_flops / cudnn_ms / 1e9:.0f} TFLOP/s), "
        f"FP8 quantisation {quant_ms:.2f} ms")
    rows = []
    for density in DENSITIES:
        block_map = structured_block_map(SHAPES[shape], 1, density, 0)
        mask = block_map_to_mask(block_map, BLOCK, BLOCK, n)
        kept = int(block_map.sum().item())
        row = dict(shape=shape, tokens=n, density=round(kept / (HEADS * nb * nb), 4), kept_blocks=kept,
                   cudnn_dense_ms=round(cudnn_ms, 3), quantize_ms=round(quant_ms, 3))
        for kind, (qx, kx, vx) in data.items():
            exact = block_sparse_attention(qx, kx, vx, mask, HEADS, backend="triton")
            row[f"accuracy_{kind}"] = accuracy(fp8_block_sparse_attention(qx, kx, vx, mask, HEADS, config=config), exact)
            row[f"int8qk_accuracy_{kind}"] = accuracy(int8qk(qx, kx, vx, mask), exact)
        row["fp8_backend"] = str(last_backend_choice())
        bf16_ms = bench(lambda: block_sparse_attention(q, k, v, mask, HEADS, backend="triton"))
        fp8_ms = bench(lambda: fp8_block_sparse_attention(q, k, v, mask, HEADS, config=config))
        int8qk_ms = bench(lambda: int8qk(q, k, v, mask))
        row.update(bf16_sparse_ms=round(bf16_ms, 3), fp8_sparse_ms=round(fp8_ms, 3),
                   fp8_vs_bf16_sparse=round(bf16_ms / fp8_ms, 3), fp8_vs_cudnn_dense=round(cudnn_ms / fp8_ms, 3),
                   bf16_per_kept_block_vs_cudnn=round(bf16_ms / kept / per_block_cudnn, 3),
                   fp8_per_kept_block_vs_cudnn=round(fp8_ms / kept / per_block_cudnn, 3),
                   fp8_kernel_per_kept_block_vs_cudnn=round((fp8_ms - quant_ms) / kept / per_block_cudnn, 3),
                   fp8_tflops=round(kept_flops(block_map.expand(1, HEADS, nb, nb), n) / fp8_ms / 1e9, 1),
                   int8qk_sparse_ms=round(int8qk_ms, 3), int8qk_vs_bf16_sparse=round(bf16_ms / int8qk_ms, 3))
        rows.append(row)
        log(json.dumps(row))
    return rows


COLUMNS = ["shape", "density", "cudnn_dense_ms", "bf16_sparse_ms", "fp8_sparse_ms", "quantize_ms", "fp8_vs_bf16_sparse",
           "fp8_vs_cudnn_dense", "bf16_per_kept_block_vs_cudnn", "fp8_per_kept_block_vs_cudnn",
           "fp8_kernel_per_kept_block_vs_cudnn", "fp8_tflops", "int8qk_sparse_ms", "int8qk_vs_bf16_sparse"]


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    lines = [f"# FP8 block-sparse attention ({meta['machine']})", ""]
    lines += [f"- {key}: `{meta[key]}`" for key in ("date", "command", "git_commit", "torch", "triton", "config")]
    lines += ["", "Speed (ms; per kept block: the call's time per kept block pair over cuDNN's per block pair):", "",
              "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    lines += ["", "Accuracy against the bf16 block-sparse output (cosine; worst and median row relative L2 error):", "",
              "| shape | density | spread cosine | spread worst | spread median | sharp cosine | sharp worst | sharp median |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for label, prefix in (("fp8", ""), ("int8qk", "int8qk_")):
            s, p = r[f"{prefix}accuracy_spread"], r[f"{prefix}accuracy_sharp"]
            lines.append(f"| {r['shape']} | {r['density']} ({label}) | {s['cosine']} | {s['worst_row_rel_err']} | "
                         f"{s['median_row_rel_err']} | {p['cosine']} | {p['worst_row_rel_err']} | "
                         f"{p['median_row_rel_err']} |")
    path.write_text("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO_ROOT / "tests" / "benchmarks" / "results"))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shapes", default="480p,720p")
    ap.add_argument("--git-commit", default=os.environ.get("CHORUS_GIT_COMMIT", "unknown"))
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import triton

    def log(msg):
        print(msg, flush=True)

    config, sweep_rows = sweep(log) if args.sweep else (None, [])
    rows = [r for shape in args.shapes.split(",") for r in shape_rows(shape, config, log)]
    from kernels.triton_fp8_block_sparse import fp8_pick_config

    meta = dict(benchmark="bench_fp8_block_sparse", machine=torch.cuda.get_device_name(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python " + " ".join([os.path.relpath(sys.argv[0], REPO_ROOT)] + sys.argv[1:]),
                git_commit=args.git_commit, torch=torch.__version__, triton=triton.__version__,
                config=fp8_pick_config(HEAD_DIM, BLOCK, BLOCK, config))
    (out_dir / "fp8_block_sparse.json").write_text(json.dumps(dict(meta, sweep=sweep_rows, rows=rows), indent=1) + "\n")
    write_markdown(out_dir / "fp8_block_sparse.md", meta, rows)
    print((out_dir / "fp8_block_sparse.md").read_text())


if __name__ == "__main__":
    main()
