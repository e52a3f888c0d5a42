"""Feature reuse on the testbed: quality cost (PSNR, SSIM, seam measure) vs the dense run, and
an analytic FLOPs estimate at Wan2.1-14B shapes.

Run: .venv/bin/python tests/benchmarks/bench_feature_reuse.py [--steps 8]
Writes tests/benchmarks/results/feature_reuse_testbed.{json,md}.

Model: the trained testbed checkpoint ``tests/testbed/chorus_testbed_wan21_i2v.safetensors``
when it exists, else the random tiny Wan2.1-I2V (4 layers, width 256; ``model`` says which).
Requests: procedural I2V (static background, moving sprite), latent 5 x 32 x 32 = 1,280 tokens,
euler / simple, cfg 5, same seed for every mode. Quality is final latents vs the dense run.
Rows with ``selection: random`` pick the same number of cells at random (the criterion's
evidence: smoothest-first vs chance at equal token savings). ``hit`` rows run a static
block-sparse map (same frame + first frame + neighbouring frames) standing in for a bank hit.
The ``flops_estimate`` rows are arithmetic, not timings.

``--dense-fallback`` (CUDA) times one reduced self-attention call at Wan2.1-14B shapes instead
(40 heads of 128, bf16, batch 1, half the tokens pooled in 1x2x2 cells): the size-biased dense
call as it ran before (a float ``log(cell size)`` mask, which keeps SDPA off its flash kernel),
as it runs now (pooled keys repeated, no mask), the unbiased floor, the full-resolution call and
a block-sparse reduced call at density 0.15; plus each biased variant's error against a float64
reference. Writes ``feature_reuse_dense_fallback_h200.{json,md}`` (or into ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

if "--dense-fallback" not in sys.argv:  # the GPU timing must run the compiled kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "tests"):
    sys.path.insert(0, str(path))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

RESULTS = ROOT / "tests" / "benchmarks" / "results"
TESTBED = ROOT / "tests" / "testbed" / "chorus_testbed_wan21_i2v.safetensors"
NAME = "feature_reuse_testbed"


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor())
    return f"{model}, {os.cpu_count()} cores (CPU only)"


def load_model(tmp: Path):
    import comfy.sd

    from chorus_core.testbed.tiny_wan import TinyWanConfig, save_tiny_wan_i2v

    if TESTBED.exists():
        return comfy.sd.load_diffusion_model(str(TESTBED)), "testbed (trained)"
    path = save_tiny_wan_i2v(tmp / "tiny4.safetensors", TinyWanConfig(num_layers=4))
    return comfy.sd.load_diffusion_model(str(path)), "tiny random Wan2.1-I2V (4 layers, dim 256; testbed checkpoint absent)"


def hit_provider(grid, block=128):
    from chorus_core.attention.mask_provider import StaticBlockMapProvider

    t, h, w = grid
    n = t * h * w
    nb = math.ceil(n / block)
    frame = (torch.arange(nb) * block + block // 2).clamp(max=n - 1) // (h * w)
    keep = ((frame[:, None] - frame[None]).abs() <= 1) | (frame[None] == 0)
    return StaticBlockMapProvider.for_all_steps({layer: keep[None, None].expand(1, 2, nb, nb)
                                                 for layer in range(64)}, (block, block)), float(keep.float().mean())


# --------------------------------------------------------------------------------------------
# --dense-fallback: one reduced self-attention call on the GPU
# --------------------------------------------------------------------------------------------

FALLBACK_NAME = "feature_reuse_dense_fallback_h200"
SHAPES_14B = (("480p", (21, 30, 52)), ("720p", (21, 45, 80)))
HEADS_14B, HEAD_DIM = 40, 128


def half_pooled_layout(grid):
    """Every other column of 1x2x2 cells pooled: half the tokens, N' = 5/8 N."""
    from chorus_core.guidance.feature_regions import cell_grid
    from chorus_core.guidance.token_layout import TokenLayout

    region_map = torch.zeros(cell_grid(grid, (1, 2, 2)), dtype=torch.bool)
    region_map[:, :, ::2] = True
    return TokenLayout(region_map, grid, (1, 2, 2))


def cuda_ms(fn, warmup=3, reps=10) -> tuple[float, float, float]:
    """Median, min and max milliseconds of ``fn()`` over ``reps`` runs (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], times[0], times[-1]


def flash_takes_a_float_mask(q, k, v, bias) -> bool:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return True
    except RuntimeError:
        return False


def fallback_rows(name, grid, density=0.15):
    """Timings and errors of one reduced call's variants at one 14B shape."""
    from kernels.block_sparse import block_map_to_mask, block_sparse_attention

    layout = half_pooled_layout(grid)
    n, n_red, dev = layout.n_full, layout.n_reduced, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (1, HEADS_14B, n_red, HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
    qf, kf, vf = (torch.randn((1, HEADS_14B, n, HEAD_DIM), generator=g, device=dev, dtype=torch.bfloat16)
                  for _ in range(3))
    bias = layout.key_bias(dev, q.dtype)[None]  # [1, 1, 1, N'], as ComfyUI's attention_pytorch passes it
    variants = {
        "full_resolution_dense": lambda: F.scaled_dot_product_attention(qf, kf, vf),
        "reduced_unbiased": lambda: F.scaled_dot_product_attention(q, k, v),
        "reduced_float_bias_before": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
        "reduced_repeated_keys_now": lambda: F.scaled_dot_product_attention(
            q, layout.expand_keys(k, True), layout.expand_keys(v, True)),
    }
    nb = math.ceil(n_red / 128)
    live = torch.rand(1, HEADS_14B, nb, nb, generator=g, device=dev) < density
    mask = block_map_to_mask(live | torch.eye(nb, dtype=torch.bool, device=dev), 128, 128, n_red)
    variants[f"reduced_sparse_{density}"] = lambda: block_sparse_attention(q, k, v, mask, HEADS_14B, True, True)
    rows = []
    for variant, fn in variants.items():
        median, low, high = cuda_ms(fn)
        rows.append(dict(shape=name, N=n, N_reduced=n_red, variant=variant, ms=round(median, 3),
                         ms_min=round(low, 3), ms_max=round(high, 3)))
    # error of the biased variants on 256 queries against a float64 softmax with the bias written out
    rows_q = slice(0, 256)
    sizes = layout.key_bias(dev, torch.float64)[0, 0]
    scores = q[:, :, rows_q].double() @ k.double().transpose(-1, -2) / math.sqrt(HEAD_DIM) + sizes
    reference = scores.softmax(-1) @ v.double()
    for row in rows:
        if row["variant"] in ("reduced_float_bias_before", "reduced_repeated_keys_now", "reduced_unbiased"):
            got = variants[row["variant"]]()[:, :, rows_q].double()
            row["max_abs_error_vs_biased_fp64"] = float((got - reference).abs().max())
    rows[0]["flash_takes_a_float_mask"] = flash_takes_a_float_mask(q, k, v, bias)
    rows[0]["extra_bytes_repeated_kv"] = 2 * (n - n_red) * HEADS_14B * HEAD_DIM * 2
    return rows


def dense_fallback(out_dir: Path) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("--dense-fallback needs a CUDA GPU")
    rows = [row for name, grid in SHAPES_14B for row in fallback_rows(name, grid)]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    doc = dict(benchmark="bench_feature_reuse --dense-fallback", date=datetime.datetime.now().isoformat(timespec="seconds"),
               machine=f"{torch.cuda.get_device_name()}, torch {torch.__version__}", git_commit=commit,
               heads=HEADS_14B, head_dim=HEAD_DIM, dtype="bfloat16", batch=1, pooled_token_share=0.5, cell="1x2x2",
               timing="CUDA events, median of 10 after 3 warm-ups", rows=rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{FALLBACK_NAME}.json").write_text(json.dumps(doc, indent=2) + "\n")
    cols = ["shape", "N", "N_reduced", "variant", "ms", "ms_min", "ms_max", "max_abs_error_vs_biased_fp64"]
    lines = [f"# bench_feature_reuse --dense-fallback: {FALLBACK_NAME}", "",
             f"{doc['date']}, {doc['machine']}, commit {commit[:10]}", "",
             "`python tests/benchmarks/bench_feature_reuse.py --dense-fallback`", "",
             "One reduced self-attention call at Wan2.1-14B shapes: 40 heads x 128, bf16, batch 1, every other "
             "column of 1x2x2 cells pooled (half the tokens, N' = 5/8 N). `float_bias_before`: the float "
             "log(cell size) mask Feature Reuse passed until now; `repeated_keys_now`: pooled keys and values "
             "repeated once per token of their cell, no mask (what it passes now; the gather is timed too). "
             "Errors: 256 queries against a float64 softmax with the bias written out.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join("" if row.get(c) is None else str(row.get(c)) for c in cols) + " |")
    for row in rows:
        if "flash_takes_a_float_mask" in row:
            lines.append(f"\n{row['shape']}: SDPA's flash kernel takes a float mask: {row['flash_takes_a_float_mask']}; "
                         f"repeated keys and values add {row['extra_bytes_repeated_kv'] / 2**30:.2f} GiB per call "
                         "(transient, batch 1).")
    (out_dir / f"{FALLBACK_NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--template", default="pan")
    parser.add_argument("--dense-fallback", action="store_true", help="time one reduced attention call on CUDA")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.dense_fallback:
        return dense_fallback(args.out)

    from chorus_core.comfy.comfyui_locator import locate_comfyui, prepare_in_process

    prepare_in_process(locate_comfyui(allow_clone=False), cpu=True)
    import tempfile

    from i2v_inputs import sample_request

    from chorus_core.guidance import feature_regions as regions
    from chorus_core.guidance import feature_reuse as fr
    from chorus_core.quality import psnr, ssim
    from chorus_core.attention.sparse_patch import install_sparse_attention
    from chorus_core.guidance.token_layout import TokenLayout
    from chorus_core.testbed.workload import I2VRequest, generate_request

    tmp = Path(tempfile.mkdtemp())
    patcher, model_name = load_model(tmp)
    layers = len(patcher.model.diffusion_model.blocks)
    request = I2VRequest(template=args.template, height=32, width=32)
    start = generate_request(request).first_frame[None]
    steps, seed = args.steps, 0
    started = time.perf_counter()
    dense = sample_request(patcher, seed, steps, 5.0, request)
    dense_s = time.perf_counter() - started
    grid = regions.token_grid(dense.shape)
    shape = f"testbed-{math.prod(grid)}"
    rows = [dict(shape=shape, N=math.prod(grid), mode="dense", model=model_name, psnr_db=float("inf"), ssim=1.0,
                 generation_s=round(dense_s, 2))]
    provider, hit_density = hit_provider(grid)
    hit_out = sample_request(install_sparse_attention(patcher, provider), seed, steps, 5.0, request)
    rows.append(dict(shape=shape, N=math.prod(grid), mode="hit", model=model_name, density=round(hit_density, 3),
                     mask_kind="static", psnr_db=round(psnr(dense, hit_out).item(), 2),
                     ssim=round(ssim(dense, hit_out).item(), 5)))

    def case(strength, selection="smoothest", hit=False, **changes):
        settings = fr.FeatureReuseSettings(**changes)
        region_map = regions.select_regions(start, grid, strength, settings.cell, rim=settings.rim)
        if selection == "random":
            count = int(region_map.sum())
            g = torch.Generator().manual_seed(7)
            flat = torch.zeros(region_map.numel(), dtype=torch.bool)
            flat[torch.randperm(region_map.numel(), generator=g)[:count]] = True
            region_map = flat.view_as(region_map)
        model = fr.install_feature_reuse(patcher, region_map, grid, settings)
        if hit:
            model = install_sparse_attention(model, provider)
        t0 = time.perf_counter()
        out = sample_request(model, seed, steps, 5.0, request)
        stats = fr.get_feature_reuse_state(model).stats
        layout = TokenLayout(region_map, grid, settings.cell)
        seams = regions.seam_measure(dense, out, region_map, settings.cell)
        row = dict(shape=shape, N=math.prod(grid), mode="hit+feature_reuse" if hit else "feature_reuse",
                   model=model_name, strength=strength, selection=selection,
                   cell="x".join(map(str, settings.cell)), rim=settings.rim, blend=settings.blend,
                   start_percent=settings.start_percent, size_bias=settings.size_bias,
                   pooled_token_share=round(layout.pooled_token_share, 3), N_reduced=layout.n_reduced,
                   reduced_block_calls=stats.reduced_calls, block_calls=stats.reduced_calls + stats.full_calls,
                   psnr_db=round(psnr(dense, out).item(), 2), ssim=round(ssim(dense, out).item(), 5),
                   seam_ratio=round(seams["seam_ratio"], 4), cell_seam_ratio=round(seams["cell_seam_ratio"], 4),
                   seam_excess=round(seams["seam_excess"], 3), generation_s=round(time.perf_counter() - t0, 2))
        if hit:
            row["density"] = round(hit_density, 3)
        print(row, flush=True)
        rows.append(row)
        return layout

    layouts = {strength: case(strength) for strength in (0.25, 0.5, 0.75)}
    default = layouts[0.5]
    case(0.5, rim=0)
    case(0.5, rim=0, selection="random")
    case(0.5, rim=0, blend=False)
    case(0.5, rim=0, size_bias=False)
    case(0.5, rim=0, start_percent=0.0)
    case(0.5, rim=0, cell=(2, 2, 2))
    case(0.5, rim=0, hit=True)

    # analytic estimate at Wan2.1-14B shapes (40 layers, dim 5120, ffn 13824), 40 steps, default steps/layers
    import comfy.samplers

    s = fr.FeatureReuseSettings()
    sampling = patcher.model.model_sampling  # the windows are fractions of the sigma schedule, as in core
    sigmas = comfy.samplers.calculate_sigmas(sampling, "simple", 40).tolist()
    reduced_steps = sum(s.reduced_steps(sampling, sigmas))
    for name, grid14 in (("480p", (21, 30, 52)), ("720p", (21, 45, 80))):
        for share in (default.pooled_token_share, 0.5):
            for density in (1.0, 0.15):
                est = regions.flops_estimate(grid14, share, 4, reduced_steps=reduced_steps, reduced_layers=38,
                                             density=density)
                rows.append(dict(shape=name, N=est["N"], kind="flops_estimate", estimate=True, density=density,
                                 pooled_token_share=round(share, 3), cell="1x2x2", N_reduced=est["N_reduced"],
                                 reduced_steps=reduced_steps, reduced_layers=38,
                                 attention_share_saved_per_block=round(est["attention_share_saved_per_block"], 3),
                                 gemm_share_saved_per_block=round(est["gemm_share_saved_per_block"], 3),
                                 generation_flops_saved=round(est["generation_flops_saved"], 3),
                                 ideal_speedup_whole_generation=round(est["ideal_speedup"], 3)))

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    command = "python tests/benchmarks/bench_feature_reuse.py" + (f" --steps {steps}" if steps != 8 else "")
    doc = dict(benchmark="bench_feature_reuse", date=datetime.datetime.now().isoformat(timespec="seconds"),
               machine=machine(), command=command, git_commit=commit, steps=steps, seed=seed, cfg=5.0,
               template=args.template, model=model_name, layers=layers, rows=rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{NAME}.json").write_text(json.dumps(doc, indent=2) + "\n")
    quality_cols = ["mode", "strength", "selection", "cell", "rim", "blend", "size_bias", "start_percent",
                    "pooled_token_share", "N_reduced", "psnr_db", "ssim", "seam_ratio", "cell_seam_ratio", "seam_excess"]
    est_cols = ["shape", "N", "density", "pooled_token_share", "N_reduced", "attention_share_saved_per_block",
                "gemm_share_saved_per_block", "generation_flops_saved", "ideal_speedup_whole_generation"]
    fmt = lambda v: "" if v is None else str(v)  # noqa: E731
    lines = [f"# bench_feature_reuse: {NAME}", "",
             f"{doc['date']}, {doc['machine']}, commit {commit[:10]}", "", f"`{command}`", "",
             f"Model: {model_name}. Request: template {args.template}, latent 5 x 32 x 32 ({math.prod(grid)} tokens), "
             f"{steps} euler steps, cfg 5, seed {seed}. Quality: final latents vs the dense run. "
             "Defaults: cell 1x2x2, start_percent 0.3, all blocks but the first and last, rim 1, blend, size bias. "
             "seam_ratio: squared gradient across region borders / dense (1 = unchanged); seam_excess: gradient "
             "error at region borders / inside the reduced regions (1 = border no worse than the region).", "",
             "## Quality (measured)", "", "| " + " | ".join(quality_cols) + " |", "|" + "---|" * len(quality_cols)]
    for row in rows:
        if "kind" not in row:
            lines.append("| " + " | ".join(fmt(row.get(c)) for c in quality_cols) + " |")
    lines += ["", "## FLOPs at Wan2.1-14B shapes (ESTIMATE, arithmetic only, not a measurement)", "",
              f"40 steps, steps {s.start_percent:.0%}..{s.end_percent:.0%} reduced ({reduced_steps}), 38 of 40 "
              "blocks; attention at the given density on kept and reduced tokens alike.", "",
              "| " + " | ".join(est_cols) + " |", "|" + "---|" * len(est_cols)]
    for row in rows:
        if row.get("kind") == "flops_estimate":
            lines.append("| " + " | ".join(fmt(row.get(c)) for c in est_cols) + " |")
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
