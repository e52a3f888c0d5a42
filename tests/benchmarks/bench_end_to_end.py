"""End-to-end speed of Chorus: Wan2.1-I2V-14B shapes, through ComfyUI's own sampling path.

Run on a CUDA machine from the repo root (ComfyUI importable, e.g. ``COMFYUI_PATH`` set):

    python tests/benchmarks/bench_end_to_end.py --out DIR [--blocks 4] [--budget-s 240]

or locally, to debug the script on the CPU at a tiny size: ``--tiny``.

What runs: ComfyUI's ``WanModel`` (I2V: in_dim 36, CLIP-image projector) built through
``comfy.supported_models.WAN21_I2V`` at Wan2.1-I2V-14B width (dim 5120, 40 heads x 128, ffn
13824, bf16, random weights) but with a subset of its 40 blocks (``--blocks``, default 4), in
a ComfyUI ``ModelPatcher``. Every timed run is ``comfy.sample.sample`` (euler, simple schedule,
cfg 5, a real I2V conditioning: 512 text tokens, 257 CLIP-vision tokens, concat latent image
and mask), so ComfyUI batches cond and uncond as one batch of 2 and Chorus' patch runs as in
production (attention override, block patches, OUTER_SAMPLE wrapper). A sampler callback
(after a CUDA sync) stamps each step; step 0 (model load, condition processing) and, for
Chorus, step 1 (first sparse step: kernel compile, mask conversion) are not counted.

Scaling to 40 blocks: the same model is also run with no blocks at all (patch embedding,
text/CLIP embedding, head, sampler: the non-block time ``a``), so a mode's per-block time is
``(t_L - a) / L`` and its 40-block step is ``a + 40 * (t_L - a) / L``. Linearity is checked by
running dense cuDNN and a hit at density 0.15 with ``L/2`` blocks as well (predicted vs measured).

Modes (per shape):
- dense, attention forced to torch SDPA's cuDNN backend (``sdpa_kernel(CUDNN_ATTENTION)`` around
  the call and inside ComfyUI's SDPA wrapper, which would otherwise re-enable its own list);
- dense, torch's own SDPA backend choice (``comfy.ops.scaled_dot_product_attention`` swapped for
  plain ``F.scaled_dot_product_attention``: what ComfyUI gives on a torch without backend
  priorities);
- dense, ComfyUI as shipped (its SDPA backend priority list: cuDNN, flash, efficient, math);
- hit at densities 0.10 / 0.15 / 0.25: ``StaticBlockMapProvider`` with structured per-head masks
  (local 3D windows + a few global key columns; maps held on the CPU as a decoded bank entry is)
  behind ``DenseWarmupProvider`` (1 dense step), i.e. what ``BankEntryProvider`` serves, minus
  the decode, which is timed separately as per-request overhead;
- miss, online prediction (``OnlinePredictionProvider``, top-p 0.9 clamped to density 0.15);
- miss, online prediction + recording (``RecordingProvider`` + ``MaskRecorder(query_stride=4)``
  recording every step of the timed run).
Chorus modes keep ComfyUI's own SDPA setting for what they leave dense (warm-up step,
cross-attention).

Whole generation (40 steps, 1 dense warm-up step): dense = 40 x dense-cuDNN step; hit =
1 dense step + 39 hit steps + per-request overhead; miss = 1 dense step + 39 online steps
+ recording on the 6 steps a recording run records (``recorded_steps``) + overhead.

Per-request overhead (host side, timed here): signature, model fingerprint, bank match among
``--bank-entries`` entries, mask load + decode of a whole entry (3 step buckets x 40 layers;
measured on ``--entry-layers`` layers, scaled), live-block list conversion per (bucket, layer)
(block map to the GPU, ``block_map_to_mask``, validation, launch order; scaled to 3 x 40); on a
miss also ``MaskRecorder.finish`` and ``MaskBank.add_entry`` (encode + write), scaled.

Extra GPU memory: peak ``torch.cuda.max_memory_allocated`` of the mode's run minus the dense
cuDNN run's (same blocks), plus what grows with the layer count and was not all there with
``L`` blocks: converted masks of the other 40 - L layers, and for recording the float32 mass
accumulators of 3 buckets x 40 layers.

Writes ``end_to_end_h200.json`` and ``.md`` into ``--out`` (keys: tests/benchmarks/RESULTS.md;
``end_to_end_tiny`` with ``--tiny``); partial files are written after every measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from chorus_core.attention.mask_provider import MaskSource  # noqa: E402

HEAD_DIM, BLOCK, FULL_LAYERS = 128, 128, 40
GEN_STEPS, WARMUP_STEPS = 40, 1
CFG = 5.0
TEXT_TOKENS, CLIP_TOKENS, CLIP_DIM, TEXT_DIM = 512, 257, 1280, 4096
# latent (T, H, W) at 81 frames; tokens are (T, H/2, W/2)
SHAPES = {"480p": (21, 60, 104), "720p": (21, 90, 160)}
TINY_SHAPES = {"tiny": (5, 32, 32)}
DENSITIES = (0.10, 0.15, 0.25)
MISS_DENSITY = 0.15
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def elapsed() -> float:
    return time.perf_counter() - T0


# --------------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------------


def setup_comfy(cuda: bool, extra_site: str | None):
    if extra_site:  # carried pure-Python packages; appended, so the machine's own win
        sys.path.append(str(Path(extra_site).resolve()))
        CARRIED.append(extra_site)
    from chorus_core.comfy.comfyui_locator import prepare_in_process

    path = prepare_in_process(cpu=not cuda)
    import comfy.model_management  # noqa: F401  (reads --cpu once)

    return path


def token_grid(latent_thw):
    t, h, w = latent_thw
    return (t, math.ceil(h / 2), math.ceil(w / 2))


def build_model(dim, ffn, blocks, device, dtype, seed=0):
    """ComfyUI's WAN21 (I2V) around a WanModel with ``blocks`` blocks, random weights."""
    import comfy.model_patcher
    import comfy.supported_models

    unet_config = dict(image_model="wan2.1", model_type="i2v", in_dim=36, dim=dim, ffn_dim=ffn,
                       num_heads=dim // HEAD_DIM, num_layers=blocks, out_dim=16, patch_size=(1, 2, 2),
                       freq_dim=256, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)
    config = comfy.supported_models.WAN21_I2V(unet_config)
    config.set_inference_dtype(dtype, None)
    model = config.get_model({}, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.diffusion_model.named_parameters():
            if name.endswith("modulation"):
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * dim**-0.5)
            elif p.dim() >= 2:  # 1/sqrt(fan_in): activations keep their scale through the blocks
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * fan_in**-0.5)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=torch.device(device),
                                               offload_device=torch.device(device))
    return model, patcher


def set_blocks(model, all_blocks, n):
    model.diffusion_model.blocks = torch.nn.ModuleList(list(all_blocks)[:n])


def make_request(latent_thw, seed=0):
    """ComfyUI CONDITIONING as WanImageToVideo + CLIPVisionEncode make it (random contents)."""
    from comfy.clip_vision import Output

    g = torch.Generator().manual_seed(seed)
    t, h, w = latent_thw
    latent = torch.zeros(1, 16, t, h, w)
    concat = torch.zeros(1, 16, t, h, w)
    concat[:, :, :1] = torch.randn(1, 16, 1, h, w, generator=g)
    mask = torch.ones(1, 1, t, h, w)
    mask[:, :, :1] = 0.0
    clip = Output()
    clip.penultimate_hidden_states = torch.randn(1, CLIP_TOKENS, CLIP_DIM, generator=g)
    clip.image_embeds = clip.penultimate_hidden_states[:, 0, :1024]
    extras = {"concat_latent_image": concat, "concat_mask": mask, "clip_vision_output": clip}
    positive = [[torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=g) * 0.2, dict(extras)]]
    negative = [[torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=g) * 0.2, dict(extras)]]
    return positive, negative, latent, clip


# --------------------------------------------------------------------------------------------
# Structured masks (local 3D windows + global key columns, per head)
# --------------------------------------------------------------------------------------------


def block_centres(grid, nb, device):
    t, h, w = grid
    idx = torch.arange(t * h * w, device=device)
    pos = torch.stack([idx // (h * w), (idx // w) % h, idx % w], -1).float()
    pos = F.pad(pos, (0, 0, 0, nb * BLOCK - pos.shape[0]), value=float("nan"))
    return pos.view(nb, BLOCK, 3).nanmean(1)


def structured_block_map(grid, heads, density, seed, device):
    """bool ``[1, H, nb, nb]``: per head, the top ``density`` share of block pairs by negative
    anisotropic 3D distance + noise, with a few global key columns (first-frame blocks for about
    half of the heads, ~3 % random columns); the diagonal always kept."""
    nb = math.ceil(math.prod(grid) / BLOCK)
    g = torch.Generator(device=device).manual_seed(seed)
    c = block_centres(grid, nb, device)
    out = torch.empty(1, heads, nb, nb, dtype=torch.bool, device=device)
    keep = max(nb, int(density * nb * nb))
    first_frame = max(1, math.ceil(grid[1] * grid[2] / BLOCK))
    eye = torch.eye(nb, dtype=torch.bool, device=device)
    for h in range(heads):  # one head at a time: [nb, nb] temporaries only
        scale = 0.3 + 2.0 * torch.rand(3, device=device, generator=g)
        d2 = sum(((c[:, None, i] - c[None, :, i]) * scale[i]) ** 2 for i in range(3))
        score = -d2.sqrt() + 0.5 * torch.randn(nb, nb, device=device, generator=g)
        glob = torch.rand(1, nb, device=device, generator=g) < 0.03
        if float(torch.rand(1, device=device, generator=g)) < 0.5:
            glob[:, :first_frame] = True
        score = score + 4.0 * glob
        thresh = score.flatten().topk(keep).values[-1]
        out[0, h] = (score >= thresh) | eye
    return out


# --------------------------------------------------------------------------------------------
# Attention settings for the dense baselines
# --------------------------------------------------------------------------------------------

FALLBACKS = {"cudnn": 0}
CARRIED: list[str] = []


@contextlib.contextmanager
def dense_attention(kind: str, cuda: bool):
    """``cudnn``: SDPA forced to cuDNN; ``sdpa_default``: torch's own choice; ``comfyui``: as shipped."""
    import comfy.ops

    original = comfy.ops.scaled_dot_product_attention
    outer = contextlib.nullcontext()
    if kind == "cudnn" and cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def forced(q, k, v, *args, **kwargs):
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, *args, **kwargs)
            except RuntimeError:  # a shape cuDNN refuses: counted, then ComfyUI's own choice
                FALLBACKS["cudnn"] += 1
                return original(q, k, v, *args, **kwargs)

        comfy.ops.scaled_dot_product_attention = forced
        outer = sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
    elif kind == "sdpa_default":
        comfy.ops.scaled_dot_product_attention = F.scaled_dot_product_attention
    try:
        with outer:
            yield
    finally:
        comfy.ops.scaled_dot_product_attention = original


# --------------------------------------------------------------------------------------------
# Providers
# --------------------------------------------------------------------------------------------


class BatchProbe(MaskSource):
    """Wraps a provider; notes the batch chunks (cond/uncond) and sizes the patch asks for."""

    def __init__(self, inner):
        self.inner = inner
        self.block_size = tuple(inner.block_size)
        self.seen = set()

    def step_bucket(self, step):
        return self.inner.step_bucket(step)

    def observes(self, step):
        return self.inner.observes(step)

    def observe(self, layer, step, cond_or_uncond, q, k, heads, skip_reshape):
        self.inner.observe(layer, step, cond_or_uncond, q, k, heads, skip_reshape)

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device):
        self.seen.add((tuple(cond_or_uncond), num_heads, seq_len))
        return self.inner.block_map(layer, step, cond_or_uncond, num_heads, seq_len, device)


def make_provider(mode, layers, ctx):
    """(provider, recorder or None) for a Chorus mode."""
    from chorus_core.attention.mask_provider import DenseWarmupProvider, StaticBlockMapProvider
    from chorus_core.attention.masks import MaskRecorder
    from chorus_core.attention.mask_sources import OnlinePredictionProvider, RecordingProvider

    recorder = None
    if mode["mode"] == "hit":
        maps = {layer: ctx["hit_maps"][mode["density"]][layer] for layer in range(layers)}
        inner = StaticBlockMapProvider.for_all_steps(maps, (BLOCK, BLOCK))
        provider = DenseWarmupProvider(inner, WARMUP_STEPS)
    else:
        d = mode["density"]
        online = OnlinePredictionProvider(BLOCK, top_p=0.9, min_density=d, max_density=d)
        provider = DenseWarmupProvider(online, WARMUP_STEPS)
        if mode["kind"] == "recording":
            recorder = MaskRecorder(num_layers=layers, step_buckets=[list(range(ctx["steps"]))], block_size=BLOCK,
                                    top_p=0.9, min_density=0.05, max_density=0.5,
                                    query_stride=4 if ctx["cuda"] else 1)
            provider = RecordingProvider(provider, recorder)
    return BatchProbe(provider), recorder


# --------------------------------------------------------------------------------------------
# One timed sampling run
# --------------------------------------------------------------------------------------------


def sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def timed_sample(patcher, req, steps, cuda, attention="comfyui"):
    """comfy.sample.sample for ``steps`` euler steps; per-step wall times (ms) and peak bytes."""
    import comfy.sample

    positive, negative, latent, _ = req
    noise = comfy.sample.prepare_noise(latent, 0)
    stamps = []

    def callback(step, x0, x, total):
        sync(cuda)
        stamps.append(time.perf_counter())

    sync(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with dense_attention(attention, cuda):
        out = comfy.sample.sample(patcher, noise, steps, CFG, "euler", "simple", positive, negative, latent,
                                  callback=callback, disable_pbar=True, seed=0)
    sync(cuda)
    times = [(b - a) * 1e3 for a, b in zip([start] + stamps[:-1], stamps)]
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    finite = bool(torch.isfinite(out).all())
    return dict(step_ms_all=[round(t, 2) for t in times], peak_bytes=peak, base_bytes=base if cuda else 0,
                finite=finite)


def mask_bytes_of(mask):
    n = mask.live_blocks.numel() * 4 + mask.live_counts.numel() * 4
    return n + sum(o.numel() * o.element_size() for o in mask.__dict__.get("_launch_orders", {}).values())


def watch_mask_cache(patcher):
    """GPU bytes of the run's converted masks, read at every step boundary (benchmark-only look
    inside the patch's per-run state: the masks of all layers of the current step bucket)."""
    from chorus_core.attention.sparse_patch import get_sparse_state

    holder, seen, runs = get_sparse_state(patcher), [], []
    start_run = holder.start_run

    def capture():
        run = start_run()
        runs.append(run)
        return run

    holder.start_run = capture
    holder.on_step(lambda step, stats: seen.append(
        sum(mask_bytes_of(mk) for mk in runs[-1]._masks.values() if mk is not None) if runs else 0))
    return seen


def run_mode(ctx, mode, layers):
    """Time one mode with ``layers`` blocks; returns the measurement dict."""
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    set_blocks(ctx["model"], ctx["all_blocks"], layers)
    steps = ctx["steps"]
    recorder = None
    if mode["mode"] == "dense":
        patcher, skip, attention = ctx["patcher"], 1, mode["attention"]
    else:
        provider, recorder = make_provider(mode, layers, ctx)
        patcher, skip, attention = install_sparse_attention(ctx["patcher"], provider), 2, "comfyui"
        mask_bytes = watch_mask_cache(patcher)
    m = timed_sample(patcher, ctx["req"], steps, ctx["cuda"], attention)
    steady = m["step_ms_all"][skip:]
    m.update(layers=layers, step_ms=statistics.median(steady), step_ms_steady=steady)
    if mode["mode"] != "dense":
        stats = get_run_stats(patcher)
        m["sparse_calls"], m["dense_calls"] = stats.sparse_calls, stats.dense_calls
        dens = [s.mean_density for s in stats.layers.values() if s.mean_density is not None]
        m["measured_density"] = round(sum(dens) / len(dens), 4) if dens else None
        m["batches_seen"] = sorted({len(c) for c, _, _ in provider.seen})
        m["mask_cache_bytes"] = max(mask_bytes, default=0)
        m["mask_cache_bytes_per_layer"] = m["mask_cache_bytes"] / max(1, layers)
        if recorder is not None:
            t0 = time.perf_counter()
            recorded = recorder.finish()
            sync(ctx["cuda"])
            m["recorder_finish_ms"] = (time.perf_counter() - t0) * 1e3
            m["recorder_buckets"] = 1
            m["recorded_density"] = round(recorded.density, 4)
            del recorded
    del patcher
    gc.collect()  # the mask-cache watcher makes a reference cycle: free the run's GPU state now
    return m


# --------------------------------------------------------------------------------------------
# Per-request overhead
# --------------------------------------------------------------------------------------------


def median_ms(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_overheads(ctx, shape, entry_layers, bank_entries):
    """Host-side per-request costs for one shape; ms, with what each is scaled to."""
    import numpy as np

    from chorus_core.bank import LatentLayout, MaskBank, Schedule, build_signature
    from chorus_core.bank.signature import COMPONENTS, DIM
    from chorus_core.reuse.model_identity import fingerprint_patcher
    from kernels.block_sparse import block_map_to_mask
    from kernels import triton_block_sparse as tbs

    cuda, device, heads = ctx["cuda"], ctx["device"], ctx["heads"]
    positive, negative, latent, clip = ctx["req"]
    grid = token_grid(SHAPES.get(shape) or TINY_SHAPES[shape])
    out = {}
    start = positive[0][1]["concat_latent_image"][:, :, :1]
    out["signature_ms"] = median_ms(lambda: build_signature(clip_vision=clip, text=positive[0][0],
                                                            start_latent=start), 5)
    set_blocks(ctx["model"], ctx["all_blocks"], entry_layers)
    fingerprint = dataclasses.replace(fingerprint_patcher(ctx["patcher"]), heads=heads)  # same on the real model
    out["fingerprint_ms"] = median_ms(lambda: fingerprint_patcher(ctx["patcher"]), 3)
    out["fingerprint_blocks"] = entry_layers

    layout = LatentLayout(grid, "thw", (BLOCK, BLOCK))
    schedule = Schedule(steps=GEN_STEPS, sampler="uni_pc", scheduler="simple", shift=5.0)
    buckets = len(schedule.step_buckets)
    # entry masks [S, L, H, nb, nb]: bucket 0 structured at 0.15, later buckets re-drawn noise
    base = torch.cat([structured_block_map(grid, heads, MISS_DENSITY, 1000 + layer, device) for layer in range(entry_layers)])
    g = torch.Generator(device=device).manual_seed(5)
    drift = [torch.rand(base.shape, device=device, generator=g) < 0.01 * s for s in range(buckets)]
    eye = torch.eye(base.shape[-1], dtype=torch.bool, device=device)
    maps = torch.stack([(base ^ d) | eye for d in drift])  # later buckets: ~1-2 % of blocks flipped
    maps_np = maps.cpu().numpy()
    signature = build_signature(clip_vision=clip, text=positive[0][0], start_latent=start)
    with tempfile.TemporaryDirectory() as tmp:
        bank = MaskBank.open(tmp)
        t0 = time.perf_counter()
        entry_id = bank.add_entry(fingerprint=fingerprint, layout=layout, schedule=schedule, masks=maps_np,
                                  signature=signature, density=float(maps_np.mean()), recall=None)
        out["add_entry_ms_measured"] = (time.perf_counter() - t0) * 1e3
        row = bank._get_row(entry_id)
        out["entry_bytes_measured"] = int(row["blob_bytes"])
        rng = np.random.default_rng(0)
        fillers = []
        for i in range(bank_entries - 1):
            vec = {}
            for c in COMPONENTS:
                v = rng.standard_normal(DIM).astype(np.float32)
                vec[f"sig_{c}"] = (v / np.linalg.norm(v)).tobytes()
            fillers.append({**row, "id": f"filler{i}", **vec})
        with bank._write():
            bank.db["entries"].insert_all(fillers, batch_size=2000)
        t0 = time.perf_counter()
        first = bank.match(signature, fingerprint, layout, threshold=0.9)
        out["match_first_ms"] = (time.perf_counter() - t0) * 1e3  # loads the index
        out["match_ms"] = median_ms(lambda: bank.match(signature, fingerprint, layout, threshold=0.9), 20)
        out["match_hit"] = bool(first.hit and first.entry_id == entry_id)
        out["match_candidates"] = first.candidates
        out["bank_entries"] = bank_entries

        def load_decode():
            entry = bank.load_masks(entry_id)
            return [entry.block_map(s, layer) for s in range(buckets) for layer in range(entry_layers)]

        decoded = load_decode()
        assert all(bool((d == maps[s, layer].cpu()).all()) for d, (s, layer) in
                   zip(decoded, [(s, layer) for s in range(buckets) for layer in range(entry_layers)]))
        out["load_decode_ms_measured"] = median_ms(load_decode, 3)
        bank.close()
    out["entry_layers"] = entry_layers
    out["entry_buckets"] = buckets
    scale = FULL_LAYERS / entry_layers
    out["load_decode_ms"] = out["load_decode_ms_measured"] * scale
    out["add_entry_ms"] = out["add_entry_ms_measured"] * scale
    out["entry_bytes"] = int(out["entry_bytes_measured"] * scale)

    # live-block list conversion, as the patch's _convert + the kernel's first use do it
    n = math.prod(grid)
    cpu_maps = [maps[0, layer][None].cpu() for layer in range(entry_layers)]

    def convert(batch):
        masks = []
        for bm in cpu_maps:
            mask = block_map_to_mask(bm.to(device), BLOCK, BLOCK, n)
            mask.density  # noqa: B018  (cached host sync the patch pays once per mask)
            if cuda:
                mask.validate()
                cfg = tbs.pick_config(HEAD_DIM, BLOCK, BLOCK)
                tbs.launch_order(mask, batch, cfg["BLOCK_M"], cfg["order"])
            masks.append(mask)
        sync(cuda)
        return masks

    convert(2)
    out["convert_ms_per_layer"] = median_ms(lambda: convert(2), 3) / entry_layers
    out["convert_ms"] = out["convert_ms_per_layer"] * FULL_LAYERS * buckets
    masks = convert(2)
    out["mask_bytes_per_layer"] = int(statistics.mean(mask_bytes_of(mask) for mask in masks))
    out["accumulator_bytes_per_layer_bucket"] = heads * math.ceil(n / BLOCK) ** 2 * 4
    del maps, masks
    if cuda:
        torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------------------------
# Derived rows
# --------------------------------------------------------------------------------------------


def per_block(m, a):
    return (m["step_ms"] - a) / m["layers"]


def step40(m, a):
    return a + FULL_LAYERS * per_block(m, a)


def derive_rows(shape, res, ov):
    """Rows per RESULTS.md for one shape from the measurements ``res`` and overheads ``ov``."""
    rows = []
    n = math.prod(token_grid(SHAPES.get(shape) or TINY_SHAPES[shape]))
    a = res["nonblock"]["step_ms"]
    dense = res.get("dense_cudnn")
    if dense is None:
        return rows
    dense40 = step40(dense, a)
    dense_gen = GEN_STEPS * dense40 / 1e3
    base = dict(shape=shape, N=n, batch=2)

    def vram(m, extra_layers_bytes=0):
        if not m.get("peak_bytes"):
            return None, None
        # peak over what was allocated when the run started (weights, anything left over),
        # minus the same for dense cuDNN
        measured = ((m["peak_bytes"] - m["base_bytes"]) - (dense["peak_bytes"] - dense["base_bytes"])) / 2**30
        return round(measured + extra_layers_bytes / 2**30, 3), round(measured, 3)

    for key, attention in (("dense_cudnn", "cudnn"), ("dense_comfyui", "comfyui"), ("dense_sdpa_default", "sdpa_default")):
        m = res.get(key)
        if m is None:
            continue
        s40 = step40(m, a)
        gen = GEN_STEPS * s40 / 1e3
        rows.append({**base, "density": 1.0, "mode": "dense", "attention": attention,
                     "step_ms": round(s40, 1), "step_ms_measured": round(m["step_ms"], 1),
                     "blocks_measured": m["layers"], "block_ms": round(per_block(m, a), 2),
                     "generation_s": round(gen, 1), "speedup_whole_generation": round(dense_gen / gen, 3),
                     "overhead_share": 0.0, "extra_vram_gb": vram(m)[0] if key != "dense_cudnn" else 0.0,
                     "step_speedup": round(dense40 / s40, 3)})
    hit_overhead_ms = None
    if ov:
        hit_overhead_ms = ov["signature_ms"] + ov["fingerprint_ms"] + ov["match_ms"] + ov["load_decode_ms"] + ov["convert_ms"]
    for d in DENSITIES:
        m = res.get(f"hit_{d}")
        if m is None:
            continue
        s40 = step40(m, a)
        over_s = (hit_overhead_ms or 0.0) / 1e3
        gen = (WARMUP_STEPS * dense40 + (GEN_STEPS - WARMUP_STEPS) * s40) / 1e3 + over_s
        extra = (FULL_LAYERS - m["layers"]) * m.get("mask_cache_bytes_per_layer", 0)
        v, v_measured = vram(m, extra)
        rows.append({**base, "density": d, "mode": "hit", "attention": "block_sparse",
                     "measured_density": m.get("measured_density"),
                     "step_ms": round(s40, 1), "step_ms_measured": round(m["step_ms"], 1),
                     "blocks_measured": m["layers"], "block_ms": round(per_block(m, a), 2),
                     "generation_s": round(gen, 1), "speedup_whole_generation": round(dense_gen / gen, 3),
                     "overhead_s": round(over_s, 3) if ov else None,
                     "overhead_share": round(over_s / gen, 5) if ov else None,
                     "extra_vram_gb": v, "extra_vram_gb_measured": v_measured,
                     "step_speedup": round(dense40 / s40, 3), "batches_seen": m.get("batches_seen")})
    online, record = res.get("miss_online"), res.get("miss_recording")
    if online is not None:
        s40 = step40(online, a)
        over_ms = (ov["signature_ms"] + ov["fingerprint_ms"] + ov["match_ms"]) if ov else 0.0
        gen = (WARMUP_STEPS * dense40 + (GEN_STEPS - WARMUP_STEPS) * s40 + over_ms) / 1e3
        extra = (FULL_LAYERS - online["layers"]) * online.get("mask_cache_bytes_per_layer", 0)
        v, v_measured = vram(online, extra)
        rows.append({**base, "density": MISS_DENSITY, "mode": "miss", "kind": "online_prediction",
                     "attention": "block_sparse", "measured_density": online.get("measured_density"),
                     "step_ms": round(s40, 1), "step_ms_measured": round(online["step_ms"], 1),
                     "blocks_measured": online["layers"], "block_ms": round(per_block(online, a), 2),
                     "generation_s": round(gen, 1), "speedup_whole_generation": round(dense_gen / gen, 3),
                     "overhead_s": round(over_ms / 1e3, 3), "overhead_share": round(over_ms / 1e3 / gen, 5),
                     "extra_vram_gb": v, "extra_vram_gb_measured": v_measured,
                     "step_speedup": round(dense40 / s40, 3), "batches_seen": online.get("batches_seen"),
                     "note": "bank read-only or record_on_miss off: no recording"})
        if record is not None:
            from chorus_core.bank import default_step_buckets
            from chorus_core.attention.mask_sources import recorded_steps

            rec_steps = sum(len(s) for s in recorded_steps(default_step_buckets(GEN_STEPS)))
            r40 = step40(record, a)
            rec_extra = r40 - s40  # recording cost of one step, 40 blocks
            finish_ms = record.get("recorder_finish_ms", 0.0) * (FULL_LAYERS / record["layers"]) * 3
            rec_over_ms = over_ms + finish_ms + (ov["add_entry_ms"] if ov else 0.0)
            gen_r = (WARMUP_STEPS * dense40 + (GEN_STEPS - WARMUP_STEPS) * s40 + rec_steps * rec_extra
                     + rec_over_ms) / 1e3
            acc = ov["accumulator_bytes_per_layer_bucket"] if ov else 0
            extra = (FULL_LAYERS - record["layers"]) * record.get("mask_cache_bytes_per_layer", 0)
            extra += 3 * FULL_LAYERS * acc - record["layers"] * acc
            v, v_measured = vram(record, extra)
            rows.append({**base, "density": MISS_DENSITY, "mode": "miss", "kind": "recording",
                         "attention": "block_sparse", "measured_density": record.get("measured_density"),
                         "step_ms": round(r40, 1), "step_ms_measured": round(record["step_ms"], 1),
                         "blocks_measured": record["layers"], "block_ms": round(per_block(record, a), 2),
                         "recording_ms_per_step": round(rec_extra, 1), "recorded_steps": rec_steps,
                         "generation_s": round(gen_r, 1), "speedup_whole_generation": round(dense_gen / gen_r, 3),
                         "overhead_s": round(rec_over_ms / 1e3, 3), "overhead_share": round(rec_over_ms / 1e3 / gen_r, 5),
                         "extra_vram_gb": v, "extra_vram_gb_measured": v_measured,
                         "step_speedup": round(dense40 / r40, 3),
                         "note": f"online prediction every sparse step + recording on {rec_steps} of {GEN_STEPS} "
                                 "steps (query_stride 4) + finish + bank add"})
    # linearity check: L/2 blocks measured vs predicted from a and the L-block per-block time
    for key in ("dense_cudnn", "hit_0.15"):
        half, full = res.get(f"{key}_half"), res.get(key)
        if half and full:
            pred = a + half["layers"] * per_block(full, a)
            res.setdefault("linearity", {})[key] = dict(blocks=half["layers"], measured_ms=round(half["step_ms"], 1),
                                                        predicted_ms=round(pred, 1),
                                                        error=round(half["step_ms"] / pred - 1, 4))
    if ov:
        gen_hit = next((r["generation_s"] for r in rows if r["mode"] == "hit" and r["density"] == MISS_DENSITY), None)
        for kind, key, scaled in (("signature", "signature_ms", "one request"),
                                  ("fingerprint", "fingerprint_ms", f"model with {ov['fingerprint_blocks']} blocks"),
                                  ("bank_match", "match_ms", f"{ov['bank_entries']} entries, top-1"),
                                  ("mask_load_decode", "load_decode_ms",
                                   f"{ov['entry_buckets']} buckets x {FULL_LAYERS} layers, measured on {ov['entry_layers']} layers"),
                                  ("live_block_conversion", "convert_ms",
                                   f"{ov['entry_buckets']} buckets x {FULL_LAYERS} layers, {ov['convert_ms_per_layer']:.2f} ms per layer"),
                                  ("bank_add_entry", "add_entry_ms", "miss only: encode + write, scaled from "
                                   f"{ov['entry_layers']} layers")):
            rows.append({**base, "mode": "hit" if kind != "bank_add_entry" else "miss", "kind": kind,
                         "ms": round(ov[key], 3), "scope": scaled,
                         "overhead_share": round(ov[key] / 1e3 / gen_hit, 6) if gen_hit else None})
    return rows


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def machine_name(cuda):
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    cores = os.cpu_count()
    if cuda:
        return f"{torch.cuda.get_device_name()} ({cpu}, {cores} cores)"
    return f"{cpu}, {cores} cores (CPU only)"


def flash_attn_version() -> str | None:
    """The FA4 wheel's version (its module has no ``__version__``), or None when it does not import."""
    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001  (any import failure: the FA4 rows fall back, the report says so)
        return None
    from importlib import metadata

    try:
        return metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        return "installed"


COLUMNS = ["shape", "N", "batch", "density", "mode", "kind", "attention", "step_ms", "step_ms_measured",
           "generation_s", "speedup_whole_generation", "overhead_share", "extra_vram_gb"]
OVERHEAD_COLUMNS = ["shape", "mode", "kind", "ms", "overhead_share", "scope"]


def write_results(out_dir: Path, name: str, doc: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    main_rows = [r for r in doc["rows"] if "step_ms" in r]
    over_rows = [r for r in doc["rows"] if "step_ms" not in r]

    def table(rows, cols):
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |" for r in rows]
        return lines

    d = doc["details"]
    lines = [f"# End-to-end speed: Chorus on Wan2.1-I2V-14B shapes ({doc['machine']})", "",
             f"- date: {doc['date']}", f"- machine: {doc['machine']}", f"- command: `{doc['command']}`",
             f"- git commit: {doc['git_commit']}", f"- torch {d.get('torch')}, triton {d.get('triton')}, "
             f"ComfyUI {d.get('comfyui')}"]
    if d.get("rederived"):
        lines += [f"- rows re-derived from this run's measurements on {d['rederived']['date']}: "
                  f"`{d['rederived']['command']}`"]
    lines += ["",
             doc["method"], "",
             "Whole generation: 40 euler steps, cond + uncond as one batch of 2, 1 dense warm-up step; "
             "speedup over dense with torch SDPA's cuDNN backend. step_ms is extrapolated to 40 blocks "
             f"from {d.get('blocks')} measured blocks (step_ms_measured) and the non-block time; "
             "see details for both and the linearity check.", ""]
    lines += table(main_rows, COLUMNS)
    if over_rows:
        lines += ["", "Per-request overhead (host side, on the generation path); share of the hit generation "
                  "at density 0.15:", ""]
        lines += table(over_rows, OVERHEAD_COLUMNS)
    lines += ["", "Where a step's time goes (per block, batch 2, from the rows and details.attention_alone_ms):", ""]
    for shape, res in d.get("measurements", {}).items():
        alone = d.get("attention_alone_ms", {}).get(shape) or {}
        dense = next((r for r in main_rows if r["shape"] == shape and r["mode"] == "dense"
                      and r["attention"] == "cudnn"), None)
        hit = next((r for r in main_rows if r["shape"] == shape and r["mode"] == "hit" and r["density"] == MISS_DENSITY), None)
        if dense and hit and alone.get("cudnn"):
            other = dense["block_ms"] - alone["cudnn"]
            lines.append(f"- {shape}: dense block {dense['block_ms']} ms, of which cuDNN self-attention alone "
                         f"{alone['cudnn']} ms (flash {alone.get('flash')}, torch default {alone.get('default')}); "
                         f"everything else {other:.1f} ms; hit block at 0.15 {hit['block_ms']} ms, so its sparse "
                         f"self-attention takes about {hit['block_ms'] - other:.1f} ms")
        lin = res.get("linearity")
        if lin:
            parts = [f"{k}: {v['blocks']} blocks measured {v['measured_ms']} ms vs predicted {v['predicted_ms']} ms"
                     for k, v in lin.items()]
            lines.append(f"- {shape} linearity: " + "; ".join(parts))
    if doc.get("targets"):
        lines += ["", "Targets:", ""] + [f"- {t}" for t in doc["targets"]]
    if doc.get("not_measured"):
        lines += ["", "Not measured / caveats:", ""] + [f"- {t}" for t in doc["not_measured"]]
    lines += ["", "Measurements (per shape; ms per step with the blocks measured):", "", "```",
              json.dumps(d.get("measurements", {}), indent=1)[:20000], "```"]
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")


def caveats(doc) -> list[str]:
    """What the numbers do not cover, written from the run's own details."""
    d = doc["details"]
    out = ["image quality or mask recall: random weights (speed only)",
           f"all 40 blocks: {d.get('blocks')} were timed and scaled (a + 40 x per-block time); "
           "the linearity check in details.measurements.*.linearity compares half the blocks, measured vs predicted",
           "VAE encode/decode, text and CLIP-vision encoders (outside the sampler, equal in every mode)",
           "feature reuse and guidance enhancement",
           "timing repetitions: each mode is one sampling run; step_ms is the median of its 2-4 steady steps",
           "the hit's dense warm-up step is counted as one dense cuDNN step (Chorus leaves it to ComfyUI's own "
           "SDPA choice, which the dense_comfyui row measures equal)",
           "hit masks are synthetic (local 3D windows + global columns per head) and the same at every step; "
           "recorded masks of a trained model may differ in layout, density per layer and per step"]
    for shape, ov in sorted(d.get("overheads", {}).items()):
        out.append(f"{shape} mask load + decode depends on how well the entry compresses: the synthetic entry "
                   f"here is {ov['entry_bytes'] / 1e6:.1f} MB (3 buckets x 40 layers, scaled from "
                   f"{ov['entry_layers']} layers); bank_entry_size.md's synthetic 720p masks give 8.6 MB")
    if d.get("overheads"):
        ov = next(iter(d["overheads"].values()))
        out.append(f"fingerprint timed on the benchmark model with {ov['fingerprint_blocks']} blocks "
                   "(a state_dict walk + 4 sampled tensors; grows little with 40 blocks)")
    if d.get("carried_packages"):
        out.append(d["carried_packages"])
    out += [e for e in doc.get("skipped", [])]
    return out


def targets(rows):
    out = []
    hits = [r for r in rows if r.get("shape") == "720p" and r.get("mode") == "hit" and "step_ms" in r
            and r["density"] <= 0.15 + 1e-9]
    for r in hits:
        ok = r["speedup_whole_generation"] >= 2.5
        out.append(f"720p hit at density {r['density']}: whole-generation speedup {r['speedup_whole_generation']}x "
                   f"vs target >= 2.5x: {'MET' if ok else 'NOT MET'}")
    for r in rows:
        if r.get("mode") == "hit" and "step_ms" in r and r.get("overhead_share") is not None:
            ok = r["overhead_share"] <= 0.01
            out.append(f"{r['shape']} hit at {r['density']}: per-request overhead {100 * r['overhead_share']:.3f} % "
                       f"of the generation vs target <= 1 %: {'MET' if ok else 'NOT MET'}")
        if r.get("shape") == "720p" and r.get("mode") in ("hit", "miss") and r.get("extra_vram_gb") is not None \
                and "step_ms" in r:
            ok = r["extra_vram_gb"] <= 1.0
            out.append(f"720p {r['mode']} {r.get('kind') or ''} at {r['density']}: extra VRAM {r['extra_vram_gb']} GB "
                       f"(40 layers) vs target <= 1 GB: {'MET' if ok else 'NOT MET'}")
    return out


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def attention_microbench(shape, heads, cuda):
    """Dense self-attention alone, batch 2: cuDNN forced, flash forced, torch default (ms, 3 reps)."""
    if not cuda:
        return {}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n = math.prod(token_grid(SHAPES[shape]))
    q, k, v = (torch.randn(2, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION), ("default", None)):
        ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
        with ctx:
            F.scaled_dot_product_attention(q, k, v)
            torch.cuda.synchronize()
            times = []
            for _ in range(3):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                F.scaled_dot_product_attention(q, k, v)
                e1.record()
                torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1))
        out[name] = round(statistics.median(times), 2)
    del q, k, v
    return out


def rederive(path: Path, out_dir: Path, command: str) -> None:
    """Rows, targets and markdown again from the measurements of an earlier run (no timing)."""
    doc = json.loads(path.read_text())
    doc["rows"] = []
    for shape, res in doc["details"]["measurements"].items():
        if res and "nonblock" in res:
            doc["rows"] += derive_rows(shape, res, doc["details"]["overheads"].get(shape))
    doc["targets"] = targets(doc["rows"])
    doc.setdefault("skipped", [])
    doc["not_measured"] = caveats(doc)
    doc["details"]["rederived"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                   "command": command}
    name = path.stem
    write_results(out_dir, name, doc)
    for t in doc["targets"]:
        print(t)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO_ROOT / "tests" / "benchmarks" / "results"))
    p.add_argument("--tiny", action="store_true", help="dim 256, 2 blocks, a tiny latent: debug on the CPU")
    p.add_argument("--blocks", type=int, default=4, help="blocks built and timed (scaled to 40)")
    p.add_argument("--shapes", default="480p,720p")
    p.add_argument("--steps", default="480p=5,720p=4,tiny=4", help="sampling steps per timed run, per shape")
    p.add_argument("--budget-s", type=float, default=250.0, help="skip optional runs past this many seconds")
    p.add_argument("--bank-entries", type=int, default=1000)
    p.add_argument("--entry-layers", type=int, default=2, help="layers of the bank entry measured (scaled to 40)")
    p.add_argument("--extra-site", default=None, help="folder of carried pure-Python packages (appended to sys.path)")
    p.add_argument("--git-commit", default=None)
    p.add_argument("--command", default=None, help="the command line to record (default: argv)")
    p.add_argument("--rederive", default=None, metavar="JSON",
                   help="recompute rows and targets from a results file's measurements; write to --out")
    args = p.parse_args(argv)
    if args.rederive:
        return rederive(Path(args.rederive), Path(args.out), " ".join(["python"] + sys.argv))

    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    comfy_path = setup_comfy(cuda, args.extra_site)
    log(f"ComfyUI at {comfy_path}; device {device}")
    if args.tiny:
        dim, ffn, blocks, shapes, dtype = 256, 512, 2, ["tiny"], torch.float32
        global SHAPES
        SHAPES = {}
    else:
        dim, ffn, blocks, dtype = 5120, 13824, args.blocks, torch.bfloat16
        shapes = args.shapes.split(",")
    heads = dim // HEAD_DIM
    steps_of = dict(kv.split("=") for kv in args.steps.split(","))
    name = "end_to_end_tiny" if args.tiny else "end_to_end_h200"
    out_dir = Path(args.out)
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    import comfyui_version  # noqa: F401  (ComfyUI's own version module)

    doc = {"benchmark": "bench_end_to_end", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_name(cuda), "command": args.command or " ".join([Path(sys.executable).name] + sys.argv),
           "git_commit": args.git_commit or "unknown", "rows": [],
           "method": __doc__[__doc__.index("What runs:"):__doc__.index("Writes ``end")].strip(),
           "details": {"torch": torch.__version__, "triton": triton_version,
                       "comfyui": getattr(sys.modules.get("comfyui_version"), "__version__", None),
                       "blocks": blocks, "dim": dim, "ffn_dim": ffn, "heads": heads, "dtype": str(dtype),
                       "measurements": {}, "overheads": {}, "errors": [], "attention_alone_ms": {},
                       "carried_packages": (f"pure-Python packages the machine may lack (sqlite-utils and its "
                                            f"deps, einops, torchsde) came unpacked in {CARRIED[0]}, after its own "
                                            "on sys.path") if CARRIED else None},
           "not_measured": [], "skipped": []}

    t0 = time.perf_counter()
    model, patcher = build_model(dim, ffn, blocks, device, dtype)
    all_blocks = list(model.diffusion_model.blocks)
    log(f"model built: dim {dim}, {blocks} blocks, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params "
        f"in {time.perf_counter() - t0:.1f} s")

    def save():
        doc["rows"] = []
        for shape in shapes:
            res = doc["details"]["measurements"].get(shape)
            if res and "nonblock" in res:
                try:
                    doc["rows"] += derive_rows(shape, res, doc["details"]["overheads"].get(shape))
                except Exception as e:  # noqa: BLE001
                    doc["details"]["errors"].append(f"derive {shape}: {type(e).__name__}: {e}")
        doc["targets"] = targets(doc["rows"])
        doc["not_measured"] = caveats(doc)
        doc["details"]["cudnn_fallbacks"] = FALLBACKS["cudnn"]
        write_results(out_dir, name, doc)

    half = max(1, blocks // 2)
    dense_modes = [("dense_cudnn", dict(mode="dense", attention="cudnn"))]
    hit_modes = [(f"hit_{d}", dict(mode="hit", density=d)) for d in (0.15, 0.10, 0.25)]
    miss_modes = [("miss_online", dict(mode="miss", kind="online_prediction", density=MISS_DENSITY)),
                  ("miss_recording", dict(mode="miss", kind="recording", density=MISS_DENSITY))]
    optional = [("dense_sdpa_default", dict(mode="dense", attention="sdpa_default")),
                ("dense_comfyui", dict(mode="dense", attention="comfyui"))]

    for shape in shapes:
        latent_thw = SHAPES.get(shape) or TINY_SHAPES[shape]
        grid = token_grid(latent_thw)
        n = math.prod(grid)
        steps = int(steps_of.get(shape, 4))
        ctx = dict(cuda=cuda, device=device, heads=heads, model=model, patcher=patcher, all_blocks=all_blocks,
                   req=make_request(latent_thw), steps=steps)
        log(f"== {shape}: latent {latent_thw}, {n} tokens, {steps} steps per timed run")
        t1 = time.perf_counter()
        ctx["hit_maps"] = {d: [structured_block_map(grid, heads, d, 100 * layer + int(d * 100), device).cpu()
                               for layer in range(blocks)] for d in DENSITIES}
        log(f"hit masks made in {time.perf_counter() - t1:.1f} s (density per layer "
            f"{[round(float(m.float().mean()), 3) for m in ctx['hit_maps'][0.15]]})")
        res = doc["details"]["measurements"].setdefault(shape, {})
        doc["details"]["attention_alone_ms"][shape] = {}
        plan = [("nonblock", dict(mode="dense", attention="comfyui"), 0)]
        plan += [(k, m, blocks) for k, m in dense_modes + hit_modes + miss_modes]
        plan += [(f"{k}_half", m, half) for k, m in (dense_modes[0], hit_modes[0]) if half < blocks]
        plan += [(k, m, blocks) for k, m in optional]
        shape_budget = args.budget_s if shape == shapes[-1] else args.budget_s * 0.35
        for key, mode, layers in plan:
            required = key in ("nonblock", "dense_cudnn", "hit_0.15") or key.startswith("hit_")
            if not required and elapsed() > shape_budget:
                doc["skipped"].append(f"{shape} {key}: skipped, time budget")
                log(f"skip {key} (budget)")
                continue
            try:
                m = run_mode(ctx, mode, layers)
                res[key] = m
                log(f"{shape} {key:20s} L={layers}: step {m['step_ms']:.1f} ms (steps {m['step_ms_all']}), "
                    f"peak {m['peak_bytes'] / 2**30:.2f} GiB, finite {m['finite']}"
                    + (f", density {m.get('measured_density')}, batches {m.get('batches_seen')}" if "measured_density" in m else ""))
            except Exception as e:  # noqa: BLE001
                doc["details"]["errors"].append(f"{shape} {key}: {type(e).__name__}: {e}")
                log(f"FAILED {shape} {key}: {traceback.format_exc()}")
            if cuda:
                torch.cuda.empty_cache()
            save()
        set_blocks(model, all_blocks, blocks)
        try:
            t1 = time.perf_counter()
            ov = measure_overheads(ctx, shape, min(args.entry_layers, blocks), args.bank_entries)
            doc["details"]["overheads"][shape] = ov
            log(f"{shape} overheads in {time.perf_counter() - t1:.1f} s: "
                + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in ov.items()))
        except Exception as e:  # noqa: BLE001
            doc["details"]["errors"].append(f"{shape} overheads: {type(e).__name__}: {e}")
            log(f"FAILED {shape} overheads: {traceback.format_exc()}")
        set_blocks(model, all_blocks, blocks)
        if elapsed() < args.budget_s:
            try:
                doc["details"]["attention_alone_ms"][shape] = attention_microbench(shape, heads, cuda)
            except Exception as e:  # noqa: BLE001
                doc["details"]["errors"].append(f"{shape} attention alone: {type(e).__name__}: {e}")
        save()
        del ctx
        if cuda:
            torch.cuda.empty_cache()
    save()
    for r in doc["rows"]:
        if "step_ms" in r:
            log(f"{r['shape']} {r['mode']:5s} {str(r.get('kind') or r.get('attention')):18s} d={r['density']}: "
                f"step {r['step_ms']} ms (40 blocks), gen {r['generation_s']} s, speedup {r['speedup_whole_generation']}x, "
                f"overhead {r.get('overhead_share')}, extra VRAM {r.get('extra_vram_gb')} GB")
    for t in doc["targets"]:
        log(t)
    log(f"linearity: { {s: doc['details']['measurements'].get(s, {}).get('linearity') for s in shapes} }")
    log(f"errors: {doc['details']['errors']}")
    log("done")


if __name__ == "__main__":
    main()
