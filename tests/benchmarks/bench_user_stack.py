"""The user's stack: Wan 14B loaded as ComfyUI users load it (fp8_scaled files, UNETLoader's
``fp8_e4m3fn_fast``, bf16), dense attention against Chorus Sparse Attention, whole generations.

Issue 50 (`[user-stack]`), items 1 and a first slice of 3. Run on a CUDA machine from the repo root,
ComfyUI importable (``COMFYUI_PATH``; ``tests/benchmarks/user_stack_env.sh`` sets up 0.19.3 on the
device)::

    python tests/benchmarks/bench_user_stack.py --out DIR --shape 640x640 [--rows ROW,ROW] [--budget-s 520]
    python tests/benchmarks/bench_user_stack.py --build-only --weights-dir /tmp/us-weights   # files only
    python tests/benchmarks/bench_user_stack.py --merge A.json,B.json --out DIR              # calls -> one table

A dense run longer than a device call (720p at 40 steps, cfg 5: about 870 s) runs in stages,
``--stage 0:20`` in one call and ``--stage 20:40`` in the next (dense and core rows; a compiled
dense row's warm-up on a short schedule with ``--warmup-steps``), and ``--merge`` joins each row's stages.
A compiled Chorus row whose steps after the first few run the same graphs (``STOPPED_WARMUP_ARMS``)
warms up on its own schedule stopped after ``--warmup-steps`` steps, so that a 720p 40-step compiled
hit (a whole warm-up and the timed run: longer than a call) fits one call; the timed run's ``graphs``
says whether it still compiled.

On the CPU at a tiny width and grid, ``--tiny`` tests the script end to end. A row is
``WEIGHTS:ARM:eager|compiled``, with ``:sage`` at the end for ComfyUI's ``--use-sage-attention``
(``sageattention`` 1.0.6) on the row's dense calls, or ``:flash`` for torch SDPA with its flash
kernel first instead of cuDNN, or ``:torch`` for torch's own SDPA order (none set: what ComfyUI runs
on Linux, where it puts cuDNN first on Windows only): a dense baseline like the cuDNN rows, and for a
Chorus row the attention of its dense steps and layers.

What runs: a Wan 2.1 I2V model at 14B width (dim 5120, 40 heads x 128, ffn 13824, 40 blocks, with
the CLIP-image projector; 16.4 B parameters) with random weights, written once (each file when a
row first loads it) to two files in ``--weights-dir`` the way the files users download are laid
out: ``bf16`` (every tensor bf16) and
``fp8_scaled`` (Comfy-Org's layout: every linear layer of the blocks as ``float8_e4m3fn`` with its own
float32 ``scale_weight`` = amax / 448, an empty ``scaled_fp8`` marker, the rest bf16; what
``tests/checkpoint_formats.fp8_scaled_state`` writes for a small state dict). The tensors are drawn
on the GPU one at a time from a per-tensor seed and streamed into the files, so the host holds one
tensor at a time and both files hold the same model. Each model is loaded by ComfyUI's own
UNETLoader (``fp8_scaled`` file at ``default``; the ``bf16`` file at ``fp8_e4m3fn_fast`` and at
``default``), then ModelSamplingSD3 shift 5 (the official Wan 2.2 I2V template's), and sampled by
``comfy.sample.sample`` (KSampler's path) with euler / simple at ``--steps`` and ``--cfg`` (cfg 1: cond
alone, batch 1) on a 640x640x81 (33,600 tokens) or 1280x720x81 (75,600 tokens) I2V request.

Arms (``role``):
- ``dense``: the loaded model as is, every attention through torch SDPA with cuDNN first in its
  priority order (``attention`` ``cudnn_sdpa``; ``details.sdpa_choice`` says what torch picked for
  the self- and cross-attention shapes; ComfyUI's own pick on Linux is torch's default order);
- ``miss``: Chorus Sparse Attention (``ReusePatch.install()``, the MODEL-patch node's code) on an
  empty bank for this model: online prediction after one dense step, density clamped to
  ``--density``, the recording written to the bank in the background and waited for (the wait is
  outside ``seconds``; ``flush_s`` says how long it took). Compiled, a miss is ``online``: threshold
  1.01, nothing recorded;
- ``hit``: the same request again through Similarity Match and the node: the entry the miss
  recorded, every step sparse (``hit_warmup_steps`` 0), Chorus's bf16 block-sparse attention;
- ``core`` (role ``peer``): core ComfyUI's Model Sparse Attention at its node's defaults (method
  sol-attn, tau 1.3, dense before 20 % of the schedule, min_tokens 12,288, extra_tokens 256),
  comfy-kitchen's ``sol_attn`` kernel as ``core_sparse_arm.py`` calls it (the node is newer than
  ComfyUI 0.19.3; its override is reproduced there); ``routed_share`` estimates the share of 64-token
  key blocks it computed exactly, the rest entering its softmax pooled;
- ``hit_last1`` (role ``hit``): the same hit with its last step dense (``dense_last_steps`` 1, the
  testbed's quality option: docs/quality.md, Defaults);
- ``hit_fp8`` and ``hit_last1_fp8`` (role ``hit``): those two hits with ``attention_precision`` "fp8"
  (int8 QK^T, e4m3 PV: ``kernels/triton_fp8_block_sparse.py``); ``hit_int8`` the first with "int8"
  (int8 QK^T, 16-bit PV: the same kernel);
- ``core_topk`` (role ``peer``): the same kernel with the node's top-k method keeping ``--density``
  of the key blocks from the first step, as the hit does: core's sparse attention at Chorus's density.
Every Chorus generation makes a new match and a new install, as a new prompt does; its dense steps
run cuDNN SDPA as the dense rows do. ``compiled``: ComfyUI's TorchCompileModel node (inductor) on the
model that samples (after the Chorus patch); its first generation is a warm-up whose seconds
(compile included) are ``compile_s``, not ``seconds``. ``seconds``: the whole sampling call, from the
match (Chorus rows) to the sampler's return after a CUDA sync; ``load_s``: the UNETLoader call that
loaded the row's model (once per model, not in ``seconds``); ``model_load_s``: ComfyUI moving weights
to the GPU inside the generation (part of ``seconds``); ``warm_seconds``: for the first generation
after a load only, ``seconds`` with its first step counted at the median of its other steps (a
running server has moved the weights and met every kernel before), or less ``model_load_s`` for
a miss, whose first step is dense by design; every ``vs_*`` ratio divides by
a baseline's ``warm_seconds`` where it has one, so no ratio is flattered by a cold baseline.
``memory``: ComfyUI's model memory manager. In process ComfyUI keeps the legacy ModelPatcher
(the whole model on the GPU); with ``--dynamic-vram`` models load through DynamicVRAM
(``ModelPatcherDynamic``: weights memory-mapped from the file and cast into comfy-aimdo's virtual
VRAM buffer as layers run), what a 0.19.3+ server on Linux with an NVIDIA GPU runs by default
(``details.memory``, each model's ``patcher``); those rows end in ``_dynamic_vram`` and their
ratios are to rows of the same manager only.

Writes ``user_stack_<shape>.json`` and ``.md`` into ``--out`` after every row (``user_stack_tiny``
with ``--tiny``); keys: ../shared/RESULTS.md and issue 50 item 3.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import shlex
import statistics
import struct
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent))  # tests/: checkpoint_formats
sys.path.insert(0, str(BENCH_DIR.parents[1]))  # the repository: chorus_core

import core_sparse_arm as core  # noqa: E402  (core ComfyUI's Model Sparse Attention, as its node runs it)
import bench_end_to_end as e2e  # noqa: E402  (request, machine name, cuDNN SDPA; puts the repo on sys.path,
import bench_reuse_loop as loop  # noqa: E402  so both are imported before ComfyUI's folder goes in front)
from bench_few_step import graphs_compiled, timed_model_loads  # noqa: E402  (compile count, weight moves)
import few_step_stages as stages  # noqa: E402  (a dense run longer than one call, timed in stages)
import torch  # noqa: E402

HEAD_DIM, BLOCK = 128, 128
FP8_MAX = 448.0
SAMPLER, SCHEDULER, SHIFT = "euler", "simple", 5.0
HIT_THRESHOLD, NO_MATCH_THRESHOLD = 0.9, 1.01
FLUSH_TIMEOUT_S = 300.0
# latent (T, H, W) at 81 frames; tokens (T, H/2, W/2)
SHAPES = {"640x640": (21, 80, 80), "720p": (21, 90, 160), "480p": (21, 60, 104), "tiny": (5, 32, 32)}
RESULT_NAMES = {"640x640": "user_stack_640", "720p": "user_stack_720p", "480p": "user_stack_480p",
                "tiny": "user_stack_tiny"}
FILES = {"bf16": "wan21_i2v_14b_bf16.safetensors", "fp8_scaled": "wan21_i2v_14b_fp8_scaled.safetensors"}
TINY_FILES = {"bf16": "wan_tiny_bf16.safetensors", "fp8_scaled": "wan_tiny_fp8_scaled.safetensors"}
# weights name -> (file, UNETLoader weight_dtype)
WEIGHTS = {"fp8_scaled": ("fp8_scaled", "default"), "fp8_e4m3fn_fast": ("bf16", "fp8_e4m3fn_fast"),
           "bf16": ("bf16", "default")}
DEFAULT_ROWS = ("fp8_scaled:dense:eager,fp8_scaled:miss:eager,fp8_scaled:hit:eager,"
                "fp8_e4m3fn_fast:dense:eager,fp8_e4m3fn_fast:miss:eager,fp8_e4m3fn_fast:hit:eager,"
                "bf16:dense:eager,bf16:miss:eager,bf16:hit:eager,"
                "fp8_scaled:hit:compiled,fp8_scaled:online:compiled,fp8_scaled:dense:compiled,"
                "fp8_e4m3fn_fast:hit:compiled,fp8_e4m3fn_fast:dense:compiled,bf16:hit:compiled,bf16:dense:compiled")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# Checkpoint files, streamed tensor by tensor
# --------------------------------------------------------------------------------------------


def wan_i2v_spec(dim: int, ffn: int, blocks: int, in_dim: int = 36, text_dim: int = 4096, freq_dim: int = 256,
                 out_dim: int = 16, clip_dim: int = 1280) -> list[tuple[str, tuple[int, ...]]]:
    """(key, shape) of every tensor of ComfyUI's Wan 2.1 I2V ``WanModel`` state dict, in its order."""
    spec: list[tuple[str, tuple[int, ...]]] = [
        ("patch_embedding.weight", (dim, in_dim, 1, 2, 2)), ("patch_embedding.bias", (dim,)),
        ("text_embedding.0.weight", (dim, text_dim)), ("text_embedding.0.bias", (dim,)),
        ("text_embedding.2.weight", (dim, dim)), ("text_embedding.2.bias", (dim,)),
        ("time_embedding.0.weight", (dim, freq_dim)), ("time_embedding.0.bias", (dim,)),
        ("time_embedding.2.weight", (dim, dim)), ("time_embedding.2.bias", (dim,)),
        ("time_projection.1.weight", (dim * 6, dim)), ("time_projection.1.bias", (dim * 6,))]
    for i in range(blocks):
        b = f"blocks.{i}."
        spec.append((b + "modulation", (1, 6, dim)))
        for name in ("q", "k", "v", "o"):
            spec += [(f"{b}self_attn.{name}.weight", (dim, dim)), (f"{b}self_attn.{name}.bias", (dim,))]
        spec += [(b + "self_attn.norm_q.weight", (dim,)), (b + "self_attn.norm_k.weight", (dim,)),
                 (b + "norm3.weight", (dim,)), (b + "norm3.bias", (dim,))]
        for name in ("q", "k", "v", "o"):
            spec += [(f"{b}cross_attn.{name}.weight", (dim, dim)), (f"{b}cross_attn.{name}.bias", (dim,))]
        spec += [(b + "cross_attn.norm_q.weight", (dim,)), (b + "cross_attn.norm_k.weight", (dim,))]
        for name in ("k_img", "v_img"):
            spec += [(f"{b}cross_attn.{name}.weight", (dim, dim)), (f"{b}cross_attn.{name}.bias", (dim,))]
        spec += [(b + "cross_attn.norm_k_img.weight", (dim,)),
                 (b + "ffn.0.weight", (ffn, dim)), (b + "ffn.0.bias", (ffn,)),
                 (b + "ffn.2.weight", (dim, ffn)), (b + "ffn.2.bias", (dim,))]
    spec += [("head.modulation", (1, 2, dim)), ("head.head.weight", (out_dim * 4, dim)), ("head.head.bias", (out_dim * 4,)),
             ("img_emb.proj.0.weight", (clip_dim,)), ("img_emb.proj.0.bias", (clip_dim,)),
             ("img_emb.proj.1.weight", (clip_dim, clip_dim)), ("img_emb.proj.1.bias", (clip_dim,)),
             ("img_emb.proj.3.weight", (dim, clip_dim)), ("img_emb.proj.3.bias", (dim,)),
             ("img_emb.proj.4.weight", (dim,)), ("img_emb.proj.4.bias", (dim,))]
    return spec


def is_block_linear(key: str) -> bool:
    """A weight fp8_scaled stores in fp8 (``checkpoint_formats.block_linear_layers``' rule)."""
    from checkpoint_formats import _BLOCK_LINEAR

    return key.endswith(".weight") and bool(_BLOCK_LINEAR.match(key[:-len(".weight")]))


def random_tensor(key: str, shape, index: int, seed: int, device: str, dim: int) -> torch.Tensor:
    """bench_end_to_end.build_model's initialisation, drawn from a per-tensor seed (bf16)."""
    gen = torch.Generator(device=device).manual_seed(seed * 100_003 + index)
    if key.endswith("modulation"):
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * dim**-0.5
    elif len(shape) >= 2:  # 1/sqrt(fan_in): activations keep their scale through the blocks
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * math.prod(shape[1:]) ** -0.5
    elif "norm" in key or key.startswith("img_emb.proj.0.") and key.endswith("weight") or key == "img_emb.proj.4.weight":
        t = torch.ones(shape, device=device, dtype=torch.float32)
    else:
        t = torch.zeros(shape, device=device, dtype=torch.float32)
    return t.to(torch.bfloat16)


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32"}


def checkpoint_tensors(spec, fmt: str, seed: int, device: str, dim: int):
    """(key, dtype, shape, producer) in file order; ``fmt`` is ``bf16`` or ``fp8_scaled``."""
    out = []
    for index, (key, shape) in enumerate(spec):
        if fmt == "fp8_scaled" and is_block_linear(key):
            out.append((key, torch.float8_e4m3fn, shape, ("fp8", key, shape, index)))
            out.append((key[:-len("weight")] + "scale_weight", torch.float32, (), ("scale", key, shape, index)))
        else:
            out.append((key, torch.bfloat16, shape, ("plain", key, shape, index)))
    if fmt == "fp8_scaled":
        out.append(("scaled_fp8", torch.float8_e4m3fn, (0,), ("marker", None, None, None)))
    return out


def write_checkpoint(path: Path, spec, fmt: str, seed: int, device: str, dim: int) -> dict:
    """Stream a safetensors file: header first (sizes are known from the spec), then each tensor as
    it is drawn on ``device``. fp8_scaled: scale = amax / 448 (at least 1e-12), weight = w / scale."""
    items = checkpoint_tensors(spec, fmt, seed, device, dim)
    header, offset = {"__metadata__": {"format": "pt", "chorus": f"bench_user_stack random weights seed {seed}"}}, 0
    for key, dtype, shape, _ in items:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_suffix(".partial")
    started = time.perf_counter()
    scales: dict[str, torch.Tensor] = {}
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for key, dtype, shape, (kind, wkey, wshape, index) in items:
            if kind == "marker":
                continue
            if kind == "scale":
                t = scales.pop(wkey)
            else:
                t = random_tensor(wkey, wshape, index, seed, device, dim)
                if kind == "fp8":
                    w = t.float()
                    scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
                    scales[wkey] = scale.reshape(()).to(torch.float32)
                    t = (w / scale).to(torch.float8_e4m3fn)
                    del w
            f.write(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
            del t
    os.replace(tmp, path)
    return dict(file=path.name, bytes=path.stat().st_size, seconds=round(time.perf_counter() - started, 1))


def files_for_rows(files: dict, rows: str) -> dict:
    """The checkpoint files the rows load, by format (``fp8_e4m3fn_fast`` loads the bf16 file): a
    14B file takes 35 to 70 s to write on the device, time a call is better spending on its rows."""
    needed = {WEIGHTS[parse_row(spec)[0]][0] for spec in rows.split(",") if spec}
    return {fmt: name for fmt, name in files.items() if fmt in needed}


def ensure_weights(folder: Path, files: dict, spec, seed: int, device: str, dim: int) -> list[dict]:
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for fmt, name in files.items():
        path = folder / name
        if path.exists():
            continue
        made.append(dict(format=fmt, **write_checkpoint(path, spec, fmt, seed, device, dim)))
        log(f"wrote {made[-1]}")
    return made


# --------------------------------------------------------------------------------------------
# ComfyUI
# --------------------------------------------------------------------------------------------


LEGACY_PATCHER = "legacy ModelPatcher (each model loaded whole to its device)"


def setup_comfy(cuda: bool, dynamic_vram: bool) -> str:
    """ComfyUI in this process; with ``dynamic_vram`` its models load as a 0.19.3+ server on Linux
    with an NVIDIA GPU loads them by default (DynamicVRAM). Returns which memory manager runs."""
    from chorus_core.comfy.comfyui_locator import DynamicVRAMUnavailable, enable_dynamic_vram, prepare_in_process

    try:
        prepare_in_process(cpu=not cuda, dynamic_vram=dynamic_vram)
        import comfy.model_management  # noqa: F401  (reads --cpu once)

        return enable_dynamic_vram() if dynamic_vram else LEGACY_PATCHER
    except DynamicVRAMUnavailable as exc:
        raise SystemExit(f"--dynamic-vram: {exc}") from exc


def make_request(latent_thw, seed=0):
    return e2e.make_request(latent_thw, seed)


def comfy_nodes():
    """ComfyUI's ``nodes`` module: this pack's own ``nodes/`` package has the same top-level name, and
    whichever folder is first on sys.path wins (test modules put the repository there)."""
    import importlib

    import folder_paths  # ComfyUI's: prepare_in_process put its folder on sys.path

    root = str(Path(folder_paths.__file__).resolve().parent)
    if root in sys.path:
        sys.path.remove(root)
    sys.path.insert(0, root)
    found = sys.modules.get("nodes")
    if found is not None and not str(getattr(found, "__file__", "")).startswith(root):
        del sys.modules["nodes"]
    return importlib.import_module("nodes")


@torch.inference_mode()
def load_model(folder: Path, files: dict, weights: str):
    """UNETLoader (the node's own code) then ModelSamplingSD3 shift 5, as the official template."""
    import folder_paths
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3

    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    fmt, weight_dtype = WEIGHTS[weights]
    (model,) = comfy_nodes().UNETLoader().load_unet(files[fmt], weight_dtype)
    patched = ModelSamplingSD3().patch(model, SHIFT)
    patched = patched[0] if isinstance(patched, tuple) else patched.result[0]
    return patched


def weight_summary(patcher) -> dict:
    """What the loaded model's block linear layers are made of (dtype, comfy-kitchen tensor, ops class)."""
    dm = patcher.model.diffusion_model
    layer = dm.blocks[0].self_attn.q
    w = layer.weight
    return dict(weight_type=type(w).__name__, weight_dtype=str(getattr(w, "dtype", None)),
                qdata_dtype=str(getattr(getattr(w, "_qdata", None), "dtype", None)),
                layout=str(getattr(layer, "layout_type", None) or getattr(w, "_layout_cls", None) or ""),
                ops_class=type(layer).__module__ + "." + type(layer).__qualname__,
                manual_cast_dtype=str(patcher.model.manual_cast_dtype),
                storage_dtype=str(patcher.model.get_dtype()), patcher=type(patcher).__name__)


def compiled(model):
    """ComfyUI's TorchCompileModel node (inductor), or its helper where the node class differs."""
    try:
        from comfy_extras.nodes_torch_compile import TorchCompileModel

        out = TorchCompileModel.execute(model, "inductor")
        return out.result[0] if hasattr(out, "result") else out[0]
    except (ImportError, AttributeError, TypeError):
        from comfy_api.torch_helpers import set_torch_compile_wrapper

        m = model.clone()
        set_torch_compile_wrapper(model=m, backend="inductor")
        return m


SDPA_ORDER = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
# ``:flash`` rows: torch's flash kernel first (FlashAttention-2 in torch 2.11), as a user gets where
# cuDNN's attention is not picked; the others only for a shape flash refuses
FLASH_SDPA_ORDER = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
# ``:torch`` rows: no order set, torch's own, which is what ComfyUI leaves on Linux (it sets cuDNN
# first on Windows only): ComfyUI's default attention for a Linux GPU server
TORCH_SDPA_ORDER = None
SDPA_ORDERS = {"sdpa": SDPA_ORDER, "sage": SDPA_ORDER, "flash": FLASH_SDPA_ORDER, "torch": TORCH_SDPA_ORDER,
               "fa4": SDPA_ORDER}
OTHER_ORDER_KEYS = {"flash": "sdpa_choice_flash_first", "torch": "sdpa_choice_torch_order"}  # results' keys


@contextlib.contextmanager
def sdpa_priority(cuda: bool, order: tuple = SDPA_ORDER):
    """torch SDPA's priority order for the row: cuDNN first by default (as ComfyUI sets it on Windows),
    the others after it for a shape cuDNN refuses, or flash first for ``:flash`` rows; a global
    setting, so compiled code traces the same choice and nothing in the model is patched (no graph
    break)."""
    if not cuda or order is None:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, n) for n in order], set_priority=True):
        yield


def sdpa_choices(cuda: bool, tokens: int, order: tuple = SDPA_ORDER) -> dict:
    """The backend torch picks under ``sdpa_priority(cuda, order)`` for the model's attention shapes (batch 1)."""
    if not cuda:
        return {}
    from torch.nn.attention import SDPBackend

    out = {}
    with sdpa_priority(cuda, order):
        for name, kv in (("self", tokens), ("cross_text", 512), ("cross_image", 257)):
            q = torch.randn(1, 40, tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, 40, kv, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            try:
                out[name] = SDPBackend(torch._fused_sdp_choice(q, k, k)).name
            except Exception as exc:  # noqa: BLE001
                out[name] = f"unknown ({type(exc).__name__}: {exc})"
            del q, k
    torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------------------------
# One generation
# --------------------------------------------------------------------------------------------


def chorus_patched(ctx, model, arm: str):
    """Similarity Match, then Chorus Sparse Attention's install (what a new prompt runs)."""
    from chorus_core.reuse.reuse_match import build_match_request, match_request
    from chorus_core.reuse.reuse_run import ReuseOptions, ReusePatch

    positive, _, latent, clip = ctx["req"]
    threshold = NO_MATCH_THRESHOLD if arm == "online" else HIT_THRESHOLD
    request = build_match_request(model, clip, positive, {"samples": latent}, None, threshold, {}, BLOCK)
    options = ReuseOptions(dense_warmup_steps=1, hit_warmup_steps=0, min_density=ctx["density"],
                           max_density=ctx["density"], miss_mode="online", record_on_miss=arm == "miss",
                           dense_last_steps=1 if arm.startswith("hit_last1") else 0,
                           attention_precision=arm_precision(arm))
    patch = ReusePatch(model, match_request(ctx["bank"], request), options, scheduler=SCHEDULER, sampler=SAMPLER)
    return patch.install(), patch


def generate(ctx, model, arm: str, is_compiled: bool, warm_up: bool = False) -> dict:
    """One timed sampling call of the row: its whole schedule, or with ``--stage`` (A, B) its steps
    A..B-1, whose output latent the next stage starts from; a compiled row's warm-up runs
    ``--warmup-steps`` of a schedule that long, whole, when given (the graphs do not depend on it)."""
    import comfy.sample

    cuda = ctx["cuda"]
    positive, negative, latent, _ = ctx["req"]
    noise = comfy.sample.prepare_noise(latent, 0)
    steps, stage, staged, stop_after = ctx["steps"], ctx["stage"], {}, None
    if warm_up and ctx["warmup_steps"]:
        stage, stop_after = None, warmup_stop_after(ctx, arm)
        if stop_after is None:  # a dense row: a short whole schedule (a Chorus row: its own, cut short)
            steps = ctx["warmup_steps"]
    if stage is not None:
        latent, noise, staged = stages.staged_sampling(stage, steps, ctx["stage_latent"], ctx["label"], latent, noise)
    stamps, patch = [], None

    def callback(step, x0, x, total):
        e2e.sync(cuda)
        stamps.append(time.perf_counter())
        if stop_after is not None and len(stamps) >= stop_after:
            raise WarmUpDone  # ComfyUI's sampling ends as on a user's cancel; Chorus's run records nothing

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    e2e.sync(cuda)
    graphs_before = graphs_compiled()
    start = time.perf_counter()
    order = SDPA_ORDERS[ctx["attention"]]
    with timed_model_loads(cuda) as loads, sdpa_priority(cuda, order), comfyui_attention(ctx["attention"]), \
            torch.inference_mode():
        sampled, core_stats = model, None
        if arm in CORE_ARMS:
            sampled, core_stats = core.apply_core_sparse(model, core_settings(ctx, arm))
        elif arm != "dense":
            sampled, patch = chorus_patched(ctx, model, arm)
        if is_compiled:
            sampled = compiled(sampled)
        try:
            out = comfy.sample.sample(sampled, noise, steps, ctx["cfg"], SAMPLER, SCHEDULER, positive, negative,
                                      latent, callback=callback, disable_pbar=True, seed=0, **staged)
        except WarmUpDone:
            out = None
    e2e.sync(cuda)
    end = time.perf_counter()
    if out is None:  # a stopped warm-up: its compile time and steps, no output and no run report
        return dict(seconds=round(end - start, 3), step_ms=step_durations_ms(start, stamps),
                    graphs=graphs_compiled() - graphs_before, stopped_after=stop_after)
    if stage is not None:
        stages.keep_stage_output(stage, steps, ctx["stage_latent"], ctx["label"], out)
    m = dict(seconds=round(end - start, 3), step_ms=step_durations_ms(start, stamps),
             graphs=graphs_compiled() - graphs_before, model_load_s=round(sum(loads), 3),
             finite=bool(torch.isfinite(out).all()))
    if cuda:
        m["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if core_stats is not None:
        m.update(core_stats.summary(), routed_share=core.routed_share(core_stats, core_settings(ctx, arm)))
    if patch is not None:
        rep = patch.last_report.to_json()
        kept = [layer["density"] for layer in rep["layers"] if layer.get("density") is not None]
        m.update(run_mode=rep["mode"], mask_source=rep["mask_source"], entry_id=rep["entry_id"],
                 recorded_entry_id=rep["recorded_entry_id"], dense_steps=len(rep["dense_steps"]),
                 measured_density=round(statistics.mean(kept), 4) if kept else None,
                 backend=rep["backend"], dense_backend=rep["dense_backend"], warnings=rep["warnings"],
                 report_timings=rep["timings"])  # match, prefetch load/decode/wait: what a first step holds
    return m


def warmup_stop_after(ctx, arm: str) -> int | None:
    """After how many steps of its own schedule a compiled row's warm-up stops (None: it runs whole)."""
    return ctx["warmup_steps"] if ctx["warmup_steps"] and arm in STOPPED_WARMUP_ARMS else None


class WarmUpDone(Exception):
    """Raised from the sampling callback to stop a compiled Chorus row's warm-up after its graphs compiled."""


def step_durations_ms(start: float, stamps: list[float]) -> list[float]:
    return [round((b - a) * 1e3, 1) for a, b in zip([start] + stamps[:-1], stamps)]


def core_settings(ctx, arm: str) -> core.CoreSettings:
    """The node's defaults, or its top-k at the hit's density from the first step; on the CPU (the
    --tiny test) comfy-kitchen's eager reference on every self-attention call, however short."""
    cpu = {} if ctx["cuda"] else dict(eager_on_cpu=True, min_tokens=0)
    if arm == "core":
        return core.CoreSettings(**cpu)
    return core.CoreSettings(topk_ratio=ctx["density"], start_percent=0.0, **cpu)


def check_path(arm: str, m: dict, cuda: bool = True) -> None:
    if arm == "dense":
        return
    if arm in CORE_ARMS:
        if cuda and not m["sparse_calls"]:  # every call fell back to ComfyUI's attention
            raise RuntimeError(f"{arm}: no call reached sol_attn (dense calls by reason: {m['dense_calls']})")
        return
    expect = "hit" if arm in HIT_ARMS else "miss"
    if m["run_mode"] != expect:
        raise RuntimeError(f"{arm}: the run was a {m['run_mode']} ({m['mask_source']}; {m['warnings']})")
    if not m["finite"]:
        raise RuntimeError(f"{arm}: the output is not finite")
    precision = arm_precision(arm)
    if precision != "bf16" and cuda and not (m.get("backend") or "").startswith(f"triton_{precision}"):
        raise RuntimeError(f"{arm}: {precision} attention did not run (backend {m.get('backend')})")
    if not m.get("backend"):  # seen: a compiled hit reusing a dense model's graph (TorchCompileModel's guard
        # filter drops transformer_options, where the attention override lives) ran every call dense
        raise RuntimeError(f"{arm}: reported a {m['run_mode']} but ran no block-sparse attention call "
                           f"(backend None, density {m.get('measured_density')}, {m['seconds']} s)")


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


COMFYUI_ATTENTIONS = ("sdpa", "sage", "flash", "torch", "fa4")
DENSE_ATTENTION_NAMES = {"sdpa": "cudnn_sdpa", "sage": "sageattention_1.0.6", "flash": "flash_sdpa",
                         "torch": "torch_sdpa_default_order", "fa4": "fa4_dense"}
CORE_ARMS = ("core", "core_topk")
HIT_ARMS = ("hit", "hit_last1", "hit_fp8", "hit_last1_fp8", "hit_int8")  # last1: the last step dense; fp8, int8:
# attention_precision (arm_precision)
# Chorus arms whose steps after the first few all run the graphs those compiled (every step sparse, or
# one dense first step then sparse ones): a compiled warm-up may stop early (--warmup-steps)
STOPPED_WARMUP_ARMS = ("hit", "hit_fp8", "hit_int8", "online")
ARMS = ("dense", "miss", "online") + HIT_ARMS + CORE_ARMS


def arm_precision(arm: str) -> str:
    """The Chorus arm's ``attention_precision``: its name's ending (``_fp8``, ``_int8``), else bf16."""
    return next((p for p in ("fp8", "int8") if arm.endswith(f"_{p}")), "bf16")


def parse_row(spec: str) -> tuple[str, str, bool]:
    weights, arm, how = (spec.split(":") + ["", ""])[:3]
    if weights not in WEIGHTS or arm not in ARMS or how not in ("eager", "compiled") \
            or row_attention(spec) not in COMFYUI_ATTENTIONS or spec.count(":") > 3:
        raise SystemExit(f"bad row {spec!r}: WEIGHTS:{'|'.join(ARMS)}:eager|compiled[:sage|:flash|:torch|:fa4]")
    return weights, arm, how == "compiled"


def row_attention(spec: str) -> str:
    """ComfyUI's own attention for the row: ``sdpa`` (torch SDPA, cuDNN first) unless ``:sage`` or
    ``:flash`` ends it."""
    parts = spec.split(":")
    return parts[3] if len(parts) > 3 else "sdpa"


def attention_name(arm: str, m: dict, comfyui_attention: str = "sdpa", core_sparse: core.CoreSettings | None = None) -> str:
    dense = DENSE_ATTENTION_NAMES[comfyui_attention]
    if arm == "dense":
        return dense
    if core_sparse is not None:
        return f"core_sol_attn ({core_sparse.describe()}; dense calls: {dense})"
    backend = (m.get("backend") or "").split(" ")[0] or "none"
    precision = backend.rsplit("_", 1)[-1] if backend.endswith(("_fp8", "_int8")) else "bf16"
    return f"chorus_block_sparse_{precision} ({backend}; dense steps: {m.get('dense_backend') or dense})"


@contextlib.contextmanager
def comfyui_attention(name: str):
    """The attention ComfyUI runs for the whole model, as its start-up flag picks it: ``sdpa`` leaves
    ComfyUI's own pick; ``sage`` is what ``--use-sage-attention`` runs (ComfyUI's attention_sage over
    ``sageattention`` 1.0.6, the Triton one on the package index, carried by user_stack_env.sh).
    In process there is no start-up flag, so the module attributes the flag sets are set here, and
    put back after the row. ``flash`` and ``torch`` are ComfyUI's own attention too (their SDPA order
    is ``generate``'s); ``fa4`` puts FlashAttention-4's dense forward in its place (``fa4_attention``)."""
    if name in ("sdpa", "flash", "torch"):
        yield
        return
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.wan.model as wan

    saved = attention.optimized_attention, wan.optimized_attention, getattr(attention, "sageattn", None)
    if name == "fa4":
        attention.optimized_attention = wan.optimized_attention = fa4_attention(attention.optimized_attention)
    else:
        import sageattention

        attention.sageattn = sageattention.sageattn  # imported by attention.py only under the flag
        attention.optimized_attention = wan.optimized_attention = attention.attention_sage
    try:
        yield
    finally:
        attention.optimized_attention, wan.optimized_attention, attention.sageattn = saved


def fa4_attention(comfyui_function):
    """ComfyUI's attention function with FlashAttention-4's dense forward in its place (``:fa4``
    rows): ComfyUI has no start-up flag for FA4 (``--use-flash-attention`` is FlashAttention 2), so
    this is what a node that swaps the function in would run. Every attention of this model is
    fp16 at head size 128, which FA4 takes: on a GPU where it cannot, the row fails rather than time
    something else under FA4's name (checked once, so compiled code has no probe in it); a masked
    call goes to ComfyUI's function. On the CPU (``--tiny``) the reference runs. Under torch.compile
    FA4 is the ``chorus::dense_attention`` custom op."""
    from kernels.dense_attention import dense_attention, dense_unsupported_for

    if torch.cuda.is_available():
        why = dense_unsupported_for(torch.device("cuda"), torch.float16, HEAD_DIM)
        if why is not None:
            raise RuntimeError(f"a :fa4 row needs FlashAttention-4's dense forward: {why}")

    def attention_fa4(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                      skip_output_reshape=False, **kwargs):
        if mask is not None:
            return comfyui_function(q, k, v, heads, mask=mask, attn_precision=attn_precision,
                                    skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape, **kwargs)
        return dense_attention(q, k, v, heads, skip_reshape, skip_output_reshape)

    return attention_fa4


def recorded_key(ctx, weights: str) -> str:
    """What an entry recorded by a miss row serves: these weights at this shape and step count. Not
    the cfg: the bank matches none (an entry recorded at cfg 1 serves cond and uncond alike), and a
    720p miss at 40 steps and cfg 5 is longer than a device call, so a cfg-5 hit may be served by a
    cfg-1 recording made in an earlier call; the hit row's ``entry_recorded_cfg`` says so."""
    return entry_key(weights, ctx["shape"], ctx["steps"])


def entry_key(weights: str, shape: str, steps: int) -> str:
    return f"{weights}@{shape}@{steps}steps"


def recorded_store(bank_dir: str) -> Path:
    """Where the entries this bench recorded are kept between calls (beside the bank they are in)."""
    return Path(bank_dir) / "user_stack_recorded.json"


def read_recorded(bank_dir: str) -> dict:
    store = recorded_store(bank_dir)
    return json.loads(store.read_text()) if store.exists() else {}


def hits_no_entry_serves(rows: list[str], recorded: dict, shape: str, steps: int) -> list[str]:
    """The hit rows of a call that nothing will serve: no entry recorded in an earlier call for their
    weights at this shape and step count, and no miss row of those weights before them in this call.
    Checked before anything is built: on the device, weights are written and loaded first (a 720p
    call asked for a hit before its miss on 2026-12-07 and spent 84 s to learn it)."""
    unserved, will_record, earlier = [], set(), dict(recorded=recorded, shape=shape, steps=steps)
    for spec in rows:
        weights, arm, _ = parse_row(spec)
        if arm == "miss":
            will_record.add(weights)
        elif arm in HIT_ARMS and weights not in will_record and not recorded_entry(earlier, weights):
            unserved.append(spec)
    return unserved


def recorded_entry(ctx, weights: str) -> dict | None:
    """{"entry": id, "cfg": the miss's cfg} recorded for these weights at this shape and step count,
    or None (a bank kept from before the cfg was stored holds the id alone: its cfg is unknown)."""
    got = ctx["recorded"].get(recorded_key(ctx, weights))
    if isinstance(got, str):
        got = dict(entry=got, cfg=None)
    return got if got and got.get("entry") else None


def entry_cfg(ctx, weights: str, served_entry: str | None):
    """The cfg that recorded the entry a hit was served: known only for the entry this bench recorded."""
    recorded = recorded_entry(ctx, weights)
    return recorded["cfg"] if recorded and recorded["entry"] == served_entry else None


def run_row(ctx, doc, spec: str, save) -> None:
    weights, arm, is_compiled = parse_row(spec)
    ctx["attention"], ctx["label"] = row_attention(spec), spec.replace(":", "_") + MEMORY_SUFFIX[ctx["memory"]]
    if arm in HIT_ARMS and not recorded_entry(ctx, weights):
        # a 4-step entry does not serve a 40-step run, nor a 720p one a 640x640 run: refused before
        # the model's load rather than timed as a miss (2026-12-06 lost two device calls so)
        raise RuntimeError(f"{spec}: no entry recorded for {recorded_key(ctx, weights)} in this bank "
                           f"(run {weights}:miss:eager first at this shape and step count)")
    model = ctx_model(ctx, doc, weights)
    compile_s, warm = None, {}
    if is_compiled and ctx["reset_dynamo"]:
        torch._dynamo.reset()  # each compiled row compiles afresh, as in a newly started server
    if is_compiled:
        warm = generate(ctx, model, arm, True, warm_up=True)
        if not warm.get("stopped_after"):  # a stopped warm-up has no run report; the timed run is checked
            check_path(arm, warm, ctx["cuda"])
        compile_s = warm["seconds"]
        log(f"{spec}: warm-up (compile) {compile_s:.1f} s, steps {warm['step_ms']}, graphs {warm['graphs']}")
    m = generate(ctx, model, arm, is_compiled)
    check_path(arm, m, ctx["cuda"])
    if is_compiled and warm.get("stopped_after"):
        m["warmup_stopped_after"] = warm["stopped_after"]
    if is_compiled and m["graphs"]:  # a short warm-up missed a graph: this row's seconds hold a compile
        doc["details"]["notes"].append(f"{spec}: its warm-up ({len(warm['step_ms'])} steps) left the timed run "
                                       f"{m['graphs']} graph(s) to compile: its seconds hold them, its "
                                       "warm_seconds count its slowest steps at the median of the others")
    if arm == "miss":
        from chorus_core.reuse import bank_writer

        began = time.perf_counter()
        if not bank_writer.flush_all(FLUSH_TIMEOUT_S):
            raise RuntimeError(f"the bank writer had not finished after {FLUSH_TIMEOUT_S:.0f} s")
        m["flush_s"] = round(time.perf_counter() - began, 2)
        if not m["recorded_entry_id"]:  # before the store: a hit row must not find it
            raise RuntimeError(f"{spec}: the miss recorded nothing ({m['warnings']})")
        ctx["recorded"][recorded_key(ctx, weights)] = dict(entry=m["recorded_entry_id"], cfg=ctx["cfg"])
    row = dict(name=ctx["label"], role=row_role(arm), weights=weights,
               attention=attention_name(arm, m, ctx["attention"], core_settings(ctx, arm) if arm in CORE_ARMS else None),
               compiled=is_compiled, steps=ctx["steps"], cfg=ctx["cfg"],
               shape=ctx["shape"], blocks=ctx["blocks"], seconds=m["seconds"], compile_s=compile_s,
               arm=arm, load_s=ctx["load_s"][weights], density=None if arm in ("dense", "core") else ctx["density"],
               session=ctx["session"], run=ctx["run_id"], stage=list(ctx["stage"]) if ctx["stage"] else None,
               memory=ctx["memory"],
               **({"entry_recorded_cfg": entry_cfg(ctx, weights, m.get("entry_id"))} if arm in HIT_ARMS else {}),
               **{k: v for k, v in m.items() if k != "seconds"})
    doc["rows"].append(row)
    log(f"{spec}: {m['seconds']:.2f} s, steps {m['step_ms']}, graphs {m['graphs']}, mode {m.get('run_mode')}, "
        f"density {m.get('measured_density')}, backend {m.get('backend')} / {m.get('dense_backend')}")
    save()


def row_role(arm: str) -> str:
    return "hit" if arm in HIT_ARMS else {"online": "miss", "core": "peer", "core_topk": "peer"}.get(arm, arm)


def row_estimate_s(ctx, doc, spec: str) -> float:
    """A row's seconds before it starts: a load unless its model is loaded, a compile when compiled
    (the first of the process compiles longest), and two generations as long as the longest seen."""
    weights, arm, is_compiled = parse_row(spec)
    seen = [r["seconds"] for r in doc["rows"] if r["weights"] == weights and r["arm"] == arm] or \
        [r["seconds"] for r in doc["rows"]] or [40.0]
    load = 0.0 if ctx["model_name"] == weights else 60.0
    compile_s, warm_up = 0.0, 0.0
    if is_compiled:
        earlier = [r["compile_s"] for r in doc["rows"] if r.get("compile_s")]
        compile_s = 1.2 * max(earlier) if earlier else 240.0
        stop_after = warmup_stop_after(ctx, arm)
        warm_up = min(1.0, stop_after / ctx["steps"]) if stop_after else 1.0
    return load + compile_s + (1 + warm_up) * 1.3 * max(seen) + (20.0 if arm == "miss" else 0.0)


def ctx_model(ctx, doc, weights: str):
    """The row's model, loaded once; the previous one is dropped first (one 14B model on the GPU at a time)."""
    if ctx["model_name"] == weights:
        return ctx["model"]
    import comfy.model_management as mm

    ctx["model"], ctx["model_name"] = None, None
    mm.unload_all_models()
    gc.collect()
    mm.soft_empty_cache()
    began = time.perf_counter()
    model = load_model(ctx["weights_dir"], ctx["files"], weights)
    ctx["load_s"][weights] = round(time.perf_counter() - began, 2)
    doc["details"]["models"][weights] = dict(load_s=ctx["load_s"][weights], **weight_summary(model))
    log(f"loaded {weights} in {ctx['load_s'][weights]} s: {doc['details']['models'][weights]}")
    ctx["model"], ctx["model_name"] = model, weights
    return model


FIRST_AFTER_LOAD_S = 0.5  # model_load_s above this: the generation moved the weights to the GPU
# arms whose first step is dense while the others are sparse (the online miss's dense step): the
# median of the others is no warm first step. Core at its defaults also starts dense but stays on the
# median, which counts it faster: it is a baseline, and a baseline's warm count must not flatter Chorus
FIRST_STEP_DENSE_ARMS = ("miss", "online")


def warm_seconds(row: dict, moved_in_first_step: bool = False) -> float | None:
    """For the first generation after a model load (it moved the weights to the GPU and met every
    kernel for the first time, which a running server has done before): its seconds with the first
    step counted at the median of the others, or, where the first step is dense by design
    (``FIRST_STEP_DENSE_ARMS``), less the weights' move only. None for any other row.
    ``moved_in_first_step``: the weights moved inside the first step (DynamicVRAM), so no
    ``model_load_s`` says so; a miss's dense first step then has no move to take off: None."""
    steps = row.get("step_ms") or []
    if row.get("stages"):  # joined stages: each stage's sampling call has a first step of its own
        firsts = [p["stage"][0] for p in row["stages"]]  # the stages cover steps 0.. in order
        others = [t for i, t in enumerate(steps) if i not in firsts]
        if not others:  # one-step stages: no step to count a first one at
            return None
        rest = statistics.median(others)
        return round(row["seconds"] - sum(max(0.0, steps[i] - rest) for i in firsts) / 1e3, 3)
    if row.get("compiled") and row.get("graphs") and len(steps) > row["graphs"]:
        return compiled_in_timed_run_warm(row, steps)
    moved = moved_in_first_step or (row.get("model_load_s") or 0) > FIRST_AFTER_LOAD_S
    if not moved or len(steps) < 2:
        return None
    if row.get("arm") in FIRST_STEP_DENSE_ARMS:  # that step is longer by design: only the weights' move comes off
        return None if moved_in_first_step else round(row["seconds"] - row["model_load_s"], 3)
    excess = steps[0] - statistics.median(steps[1:])
    return round(row["seconds"] - max(0.0, excess) / 1e3, 3)


def compiled_in_timed_run_warm(row: dict, steps: list[float]) -> float:
    """A compiled row whose timed run still compiled ``graphs`` graphs (a warm-up too short to meet
    them all: session 554e70201614's FA4 dense row, warmed up on one step, compiled again in its first
    timed step, 42 s against 4.6): its ``graphs`` slowest steps count at the median of the others, as
    a server that has compiled them runs them."""
    slowest = sorted(range(len(steps)), key=steps.__getitem__)[-row["graphs"]:]
    rest = statistics.median(t for i, t in enumerate(steps) if i not in slowest)
    return round(row["seconds"] - sum(max(0.0, steps[i] - rest) for i in slowest) / 1e3, 3)


# rows name their memory manager where it is not the legacy one (rows before it was recorded ran legacy)
MEMORY_SUFFIX = {"legacy": "", "dynamic_vram": "_dynamic_vram"}


def memory_of(row: dict) -> str:
    return row.get("memory") or "legacy"


def first_dynamic_vram_generations(rows: list[dict]) -> set[int]:
    """ids of the DynamicVRAM rows that were their model's first generation in their run.

    DynamicVRAM moves the weights to the GPU inside the first step (``model_load_s`` stays near 0),
    so the row order says which: a run loads a model before its first row of those weights and
    again after a row of other weights (a row that failed after loading another model is not seen).
    """
    firsts, last_weights = set(), {}
    for r in rows:
        if memory_of(r) == "dynamic_vram" and not stages.is_partial(r):
            if last_weights.get(r["run"]) != r["weights"]:
                firsts.add(id(r))
            last_weights[r["run"]] = r["weights"]
    return firsts


RATIO_KEYS = ("vs_dense_same_weights", "vs_fastest_dense_fp8", "vs_dense_bf16", "vs_core_same_weights")


def ratios(rows: list[dict]) -> None:
    """Within one machine session and one memory manager only: each row against the fastest dense
    row of the same weights, the fastest dense fp8-weight row, the bf16 dense row (eager or compiled), and core's
    Model Sparse Attention at its defaults with the same weights (the faster of its eager and
    compiled rows, like every baseline here). A baseline that was the first
    generation after its model's load counts at its ``warm_seconds`` (lower: the ratios against it
    are the smaller ones)."""
    whole = [r for r in rows if not stages.is_partial(r)]  # a stage alone is no generation
    moved_in_first_step = first_dynamic_vram_generations(rows)
    for r in rows:
        r["warm_seconds"] = None if stages.is_partial(r) else warm_seconds(r, id(r) in moved_in_first_step)
        r.update(dict.fromkeys(RATIO_KEYS))
    for r in whole:
        same = [x for x in whole if x.get("session") == r.get("session") and x["shape"] == r["shape"]
                and x["steps"] == r["steps"] and x["cfg"] == r["cfg"] and memory_of(x) == memory_of(r)]

        def best(pick):
            s = [x["warm_seconds"] or x["seconds"] for x in same if pick(x)]
            return min(s) if s else None

        dense = lambda x: x["role"] == "dense"  # noqa: E731
        for key, base in (("vs_dense_same_weights", best(lambda x: dense(x) and x["weights"] == r["weights"])),
                          ("vs_fastest_dense_fp8", best(lambda x: dense(x) and x["weights"].startswith("fp8"))),
                          ("vs_dense_bf16", best(lambda x: dense(x) and x["weights"] == "bf16")),
                          ("vs_core_same_weights", best(lambda x: x.get("arm") == "core" and x["weights"] == r["weights"]))):
            r[key] = round(base / r["seconds"], 3) if base else None


COLUMNS = ["name", "role", "weights", "compute_dtype", "attention", "compiled", "steps", "cfg", "stage", "seconds",
           "warm_seconds", "compile_s",
           "step_ms", "load_s",
           "model_load_s", "measured_density", "routed_share", "graphs", "peak_gib", "flush_s", "vs_dense_same_weights",
           "vs_fastest_dense_fp8", "vs_dense_bf16", "vs_core_same_weights", "run"]


def compute_dtype(summary: dict | None) -> str | None:
    """The dtype ComfyUI computes the loaded model in (its manual cast dtype, else its weights')."""
    if not summary:
        return None
    cast = summary.get("manual_cast_dtype")
    return (cast if cast and cast != "None" else summary.get("storage_dtype") or "").replace("torch.", "") or None


def label_rows(doc: dict) -> None:
    """Each row's compute dtype, and its attention named with it: ComfyUI 0.19.3 runs Wan in float16
    on this GPU whatever the file holds (WAN21 lists float16 first among its inference dtypes)."""
    for r in doc["rows"]:
        r["compute_dtype"] = compute_dtype(doc["details"]["models"].get(r["weights"]))
        short = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(r["compute_dtype"] or "", "bf16")
        r["attention"] = r["attention"].replace("chorus_block_sparse_bf16", f"chorus_block_sparse_{short}")


def schedules(doc: dict) -> str:
    """The step counts and cfgs the rows ran, each once: a merged file holds 4-step and 40-step rows,
    and the first call's settings alone would mislabel the others."""
    d = doc["details"]
    ran = sorted({(r["steps"], r["cfg"]) for r in doc["rows"]}) or [(d["steps"], d["cfg"])]
    return "; ".join(f"{steps} steps, cfg {cfg}" for steps, cfg in ran)


def write_results(out_dir: Path, name: str, doc: dict) -> None:
    label_rows(doc)
    ratios(doc["rows"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    d = doc["details"]
    lines = [f"# The user's stack: whole generations ({doc['machine']})", "",
             f"- date: {doc['date']}", f"- machine: {doc['machine']}", f"- command: `{doc['command']}`",
             f"- git commit: {doc['git_commit']}",
             *[f"- run {r['run']}: {r['date']}, {r['machine']}, `{r['command']}`" for r in d.get("runs", [])],
             f"- torch {d['torch']}, ComfyUI {d['comfyui']}, comfy-kitchen {d['comfy_kitchen']}; shape {d['shape']} "
             f"({d['tokens']} tokens), {d['blocks']} blocks, {schedules(doc)}, density {d['density']}",
             "", doc["method"], "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in doc["rows"]:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in COLUMNS) + " |")
    lines += ["", "Models as loaded:", ""] + [f"- {k}: {v}" for k, v in d["models"].items()]
    if d.get("invalid_rows"):
        lines += ["", "Rows that did not run their arm (kept out of the table):", ""]
        lines += [f"- {r['name']} (run {r['run']}): {r['seconds']} s; {r['invalid']}" for r in d["invalid_rows"]]
    lines += ["", "Notes:", ""] + [f"- {n}" for n in d["notes"] + [f"error: {e}" for e in d["errors"]]]
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")


def comfy_kitchen_info() -> str | None:
    try:
        from importlib import metadata

        version = metadata.version("comfy-kitchen")
    except Exception:  # noqa: BLE001
        return None
    try:
        import comfy_kitchen as ck

        backends = {k: (v.get("available") if isinstance(v, dict) else v) for k, v in ck.list_backends().items()}
    except Exception as exc:  # noqa: BLE001
        backends = f"list_backends failed: {exc}"
    return f"{version} (backends: {backends})"


def machine_session() -> str:
    """One id per machine (kept in its /tmp): rows of calls on one warm machine compare, others don't."""
    path = Path(tempfile.gettempdir()) / "chorus-user-stack-session"
    if not path.exists():
        path.write_text(uuid.uuid4().hex[:12])
    return path.read_text().strip()


def new_doc(args, cuda, shape, blocks, tokens) -> dict:
    try:
        import comfyui_version

        comfyui = comfyui_version.__version__
    except ImportError:
        comfyui = None
    return {"benchmark": "bench_user_stack", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": e2e.machine_name(cuda), "command": args.command or shlex.join(["python"] + sys.argv),
            "git_commit": loop.git_commit(args.git_commit), "rows": [],
            "method": __doc__[__doc__.index("What runs:"):__doc__.index("Writes ``user")].strip(),
            "details": {"torch": torch.__version__, "comfyui": comfyui, "comfy_kitchen": comfy_kitchen_info(),
                        "av": getattr(sys.modules.get("av"), "__version__", None), "shape": shape, "tokens": tokens,
                        "blocks": blocks, "steps": args.steps, "cfg": args.cfg, "density": args.density,
                        "weights_files": [], "models": {}, "notes": list(args.note), "errors": []}}


def merge(paths: list[Path], out_dir: Path, command: str, notes: list[str], invalid: list[str]) -> None:
    """One table from several calls' files; ``invalid`` (NAME@RUN=REASON) moves rows that did not run
    their arm out of the table into ``details.invalid_rows``, with the reason."""
    docs = [json.loads(p.read_text()) for p in paths]
    for d in docs:  # a row keeps its card: a merged file may hold several machines' runs
        for r in d["rows"] + d["details"].get("stage_rows", []):
            r.setdefault("machine", d["machine"])
    merged = docs[0]
    merged["details"]["runs"] = [dict(run=r, date=d["date"], machine=d["machine"], command=d["command"],
                                      git_commit=d["git_commit"]) for d in docs for r in sorted({x["run"] for x in d["rows"]})]
    for d in docs[1:]:
        if d["details"]["shape"] != merged["details"]["shape"]:
            raise SystemExit("merge runs of one shape")
        merged["rows"] += d["rows"]
        for k, v in d["details"]["models"].items():
            merged["details"]["models"].setdefault(k, v)
        merged["details"]["errors"] += d["details"]["errors"]
        merged["details"]["notes"] += [n for n in d["details"]["notes"] if n not in merged["details"]["notes"]]
        merged["details"]["weights_files"] += d["details"]["weights_files"]
    merged["details"]["notes"] += notes
    kept_stages = [r for d in docs for r in d["details"].get("stage_rows", [])]  # an input merged before
    merged["rows"], merged["details"]["stage_rows"] = join_staged_rows(merged["rows"] + kept_stages,
                                                                       merged["details"]["notes"])
    merged["details"].setdefault("invalid_rows", [])
    for spec in invalid:
        key, reason = spec.split("=", 1)
        row_name, run = key.split("@", 1)
        moved = [r for r in merged["rows"] if r["name"] == row_name and r["run"] == run]
        if not moved:
            raise SystemExit(f"--invalid {spec}: no row {row_name} in run {run}")
        merged["rows"] = [r for r in merged["rows"] if r not in moved]
        merged["details"]["invalid_rows"] += [dict(r, invalid=reason) for r in moved]
    merged["command"], merged["date"] = command, max(d["date"] for d in docs)
    merged["machine"] = " and ".join(dict.fromkeys(r["machine"] for r in merged["details"]["runs"]))
    write_results(out_dir, RESULT_NAMES[merged["details"]["shape"]], merged)


def join_staged_rows(rows: list[dict], notes: list[str]) -> tuple[list[dict], list[dict]]:
    """(rows, the stages they hold): the stages of a row (same name, schedule, cfg and shape) that
    cover its schedule joined into one row, their seconds added (each stage's own model load and
    first step included: what a user who splits the run waits); a row still missing a stage stays
    out of the table, with a note that says which. A machine session whose own stages cover the
    schedule gets a row of its own (its ratios stay within it); the others' stages join across
    sessions. A stage timed twice: the first file's counts."""
    whole = [r for r in rows if not stages.is_partial(r)]
    staged = [r for r in rows if stages.is_partial(r)]
    groups: dict[tuple, list[dict]] = {}
    for r in staged:
        groups.setdefault((r["name"], r["steps"], r["cfg"], r["shape"]), []).append(r)
    for (name, steps, *_), group in groups.items():
        whole += join_row_stages(name, steps, group, notes)
    return whole, staged


def join_row_stages(name: str, steps: int, group: list[dict], notes: list[str]) -> list[dict]:
    """One row's stages as rows: one per session whose own stages cover the schedule, and one of
    the other sessions' stages together when they cover it (else a note says what is missing)."""
    by_session: dict[str, list[dict]] = {}
    for r in group:
        by_session.setdefault(r["session"], []).append(r)
    rows, rest = [], []
    for parts in by_session.values():
        joined = join_stage_set(name, steps, parts, notes)
        if isinstance(joined, str):
            rest += parts  # joined across sessions below
        else:
            rows.append(joined)
    if rest:
        joined = join_stage_set(name, steps, rest, notes)
        if isinstance(joined, str):
            notes.append(f"{name} at {steps} steps: not in the table, {joined}")
        else:
            rows.append(joined)
    return rows


def join_stage_set(name: str, steps: int, parts: list[dict], notes: list[str]) -> dict | str:
    """The row those stages make, or a string that says which steps are missing; a row whose stages
    ran on several machine sessions gets a note that says so."""
    firsts, _ = stages.first_of_each_stage(parts)
    firsts.sort(key=lambda r: r["stage"][0])
    joined = stages.join_stages([dict(r, generation_s=r["seconds"]) for r in firsts], steps)
    if isinstance(joined, str):
        return joined
    seconds = joined.pop("generation_s")
    sessions = dict.fromkeys(r["session"] for r in firsts)  # in stage order, each once
    if len(sessions) > 1:
        notes.append(f"{name} at {steps} steps: its stages ran on machine sessions {', '.join(sessions)}, so "
                     "its row has no ratios to other rows, nor they to it (ratios stay within one machine)")
    return dict(joined, seconds=seconds, session="+".join(sessions), run="+".join(r["run"] for r in firsts),
                compile_s=None, stages=[dict(p, seconds=p.pop("generation_s")) for p in joined["stages"]])


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(BENCH_DIR / "results"))
    p.add_argument("--tiny", action="store_true", help="dim 256, 2 blocks, a tiny latent, on the CPU")
    p.add_argument("--shape", default="640x640", choices=[s for s in SHAPES if s != "tiny"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cfg", type=float, default=1.0)
    p.add_argument("--density", type=float, default=0.15)
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--rows", default=DEFAULT_ROWS,
                   help="WEIGHTS:ARM:eager|compiled[:sage|:flash|:torch|:fa4], comma-separated, in order (:sage: "
                        "ComfyUI's --use-sage-attention for the row's dense calls; :flash: torch SDPA's flash kernel "
                        "first; :torch: torch's own SDPA order, ComfyUI's on Linux; :fa4: FlashAttention-4's dense "
                        "forward in ComfyUI's attention's place)")
    p.add_argument("--weights-dir", default=str(Path(tempfile.gettempdir()) / "us-weights"))
    p.add_argument("--bank", default=str(Path(tempfile.gettempdir()) / "us-bank"),
                   help="the bank folder: a later call on the same machine serves hits from the entries recorded here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dynamic-vram", action="store_true",
                   help="load models through ComfyUI's DynamicVRAM (ModelPatcherDynamic), as a 0.19.3+ server "
                        "on Linux with an NVIDIA GPU does by default; its rows end in _dynamic_vram and compare "
                        "only with each other (needs comfy-aimdo's native library)")
    p.add_argument("--reset-dynamo", action="store_true",
                   help="torch._dynamo.reset() before each compiled row: no row reuses another's graphs (a compiled "
                        "dense model's graph served a later compiled hit, which then ran dense) or its dynamic shapes")
    p.add_argument("--build-only", action="store_true", help="write the two checkpoint files and stop (no ComfyUI)")
    p.add_argument("--stage", default=None, metavar="A:B",
                   help="dense and core rows only: time steps A..B-1 of the --steps schedule (a run longer than one "
                        "device call, e.g. 720p at 40 steps, cfg 5: 0:20 in one call, 20:40 in the next); --merge "
                        "joins a row's stages into one")
    p.add_argument("--stage-latent", default=str(Path(tempfile.gettempdir()) / "us-stage-latent"),
                   help="where a stage leaves the latent the next one starts from (carry it to another machine)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="compiled rows: a dense row's warm-up (its compile) samples a schedule this long instead of "
                        "the row's; a Chorus row of STOPPED_WARMUP_ARMS warms up on its own schedule, stopped "
                        "after this many steps")
    p.add_argument("--budget-s", type=float, default=520.0, help="start no row after this many seconds")
    p.add_argument("--call-limit-s", type=float, default=None,
                   help="seconds this process may still run (the device call's limit less what ran before it): a "
                        "row whose estimate (load, compile, two generations) would end past it is not started")
    p.add_argument("--tag", default="", help="suffix of the results file names (one file per device call)")
    p.add_argument("--git-commit", default=None)
    p.add_argument("--command", default=None)
    p.add_argument("--note", action="append", default=[])
    p.add_argument("--merge", default=None, metavar="JSON,JSON")
    p.add_argument("--invalid", action="append", default=[], metavar="NAME@RUN=REASON",
                   help="with --merge: a row that did not run its arm, moved out of the table with the reason")
    return p.parse_args(argv)


def refuse_unserved_hits(args) -> None:
    shape = "tiny" if args.tiny else args.shape
    unserved = hits_no_entry_serves([s for s in args.rows.split(",") if s], read_recorded(args.bank), shape, args.steps)
    if unserved:
        raise SystemExit(f"{', '.join(unserved)}: no entry recorded for {shape} at {args.steps} steps in "
                         f"{recorded_store(args.bank)} and no miss row of those weights before them: run "
                         "WEIGHTS:miss:eager first at this shape and step count (any cfg), in this call or an "
                         "earlier one on this machine")


def main(argv=None):
    args = parse_args(argv)
    stage = stages.parse_stage(args.stage, [args.steps]) if args.stage else None
    for spec_row in [s for s in args.rows.split(",") if s]:
        _, arm, is_compiled = parse_row(spec_row)  # a bad row stops the call here, not after minutes of set-up
        if args.warmup_steps == 1 and is_compiled:
            raise SystemExit("--warmup-steps 1: on ComfyUI 0.19.3 dynamo compiled a model again on its second call "
                             "(session 554e70201614: a compiled hit's second warm-up step, and the first timed step, "
                             "42 s, of an FA4 dense row warmed up on one step): give --warmup-steps 2 or more")
        if args.warmup_steps and is_compiled and arm not in ("dense",) + STOPPED_WARMUP_ARMS:  # eager: no warm-up
            raise SystemExit(f"--warmup-steps: {spec_row} needs its whole schedule to warm up on (a last dense "
                             "step is a graph of its own; core's sparse calls start at 20 % of the schedule): "
                             "warm it up on its whole run, without --warmup-steps")
        if stage and arm not in ("dense",) + CORE_ARMS:
            raise SystemExit(f"--stage {args.stage}: {spec_row} is a Chorus row, which records or serves a whole "
                             "run: time it whole (only dense and core rows run in stages)")
    if not (args.merge or args.build_only):  # those two run no row
        refuse_unserved_hits(args)
    if stage and stage[0] > 0 and not args.merge:
        stages.check_stage_latents(Path(args.stage_latent), [s.replace(":", "_") for s in args.rows.split(",") if s],
                                   args.steps, stage[0])
    if args.merge:
        command = shlex.join(["python", sys.argv[0]] + (sys.argv[1:] if argv is None else list(argv)))
        return merge([Path(p) for p in args.merge.split(",")], Path(args.out), command, args.note, args.invalid)
    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    if args.tiny:
        dim, ffn, blocks, shape, files = 256, 512, 2, "tiny", TINY_FILES
    else:
        dim, ffn, blocks, shape, files = 5120, 13824, args.blocks, args.shape, FILES
    weights_dir = Path(args.weights_dir)
    spec = wan_i2v_spec(dim, ffn, blocks)
    if args.build_only:
        ensure_weights(weights_dir, files, spec, args.seed, device, dim)
        return
    memory = setup_comfy(cuda, args.dynamic_vram)  # first: a refusal costs no weights written
    files = files_for_rows(files, args.rows)
    made = ensure_weights(weights_dir, files, spec, args.seed, device, dim)
    latent_thw = SHAPES[shape]
    tokens = latent_thw[0] * math.ceil(latent_thw[1] / 2) * math.ceil(latent_thw[2] / 2)
    doc = new_doc(args, cuda, shape, blocks, tokens)
    doc["details"]["memory"] = memory
    doc["details"]["weights_files"] = made or [dict(file=n, bytes=(weights_dir / n).stat().st_size, seconds=None)
                                               for n in files.values()]
    name = RESULT_NAMES[shape] + (f"_{args.tag}" if args.tag else "")
    out_dir = Path(args.out)
    from chorus_core.bank import open_bank

    bank = open_bank(args.bank)
    recorded = {}
    ctx = dict(cuda=cuda, req=make_request(latent_thw), steps=args.steps, cfg=args.cfg, density=args.density,
               bank=bank, shape=shape, blocks=blocks, weights_dir=weights_dir, files=files, model=None,
               model_name=None, load_s={}, recorded=recorded, session=machine_session(), reset_dynamo=args.reset_dynamo,
               attention="sdpa", label=None, stage=stage, stage_latent=Path(args.stage_latent),
               warmup_steps=args.warmup_steps, memory="dynamic_vram" if args.dynamic_vram else "legacy", run_id=f"{machine_session()}-{uuid.uuid4().hex[:6]}")
    doc["details"]["sdpa_choice"] = sdpa_choices(cuda, tokens)
    for attention, key in OTHER_ORDER_KEYS.items():  # what torch picked under the rows' other orders
        if any(row_attention(s) == attention for s in args.rows.split(",") if s):
            doc["details"][key] = sdpa_choices(cuda, tokens, SDPA_ORDERS[attention])
    log(f"torch SDPA picks, cuDNN first: {doc['details']['sdpa_choice']}")
    doc["details"]["bank_entries_at_start"] = len(bank.entries())  # recorded by an earlier call on this machine
    ctx["recorded"].update(read_recorded(args.bank))
    save = lambda: write_results(out_dir, name, doc)  # noqa: E731
    try:
        for spec_row in [s for s in args.rows.split(",") if s]:
            late = time.perf_counter() - T0 > args.budget_s
            estimate = row_estimate_s(ctx, doc, spec_row)
            if late or (args.call_limit_s and time.perf_counter() - T0 + estimate > args.call_limit_s):
                why = f"time budget ({args.budget_s:.0f} s)" if late else \
                    f"its estimate {estimate:.0f} s would end past --call-limit-s {args.call_limit_s:.0f}"
                doc["details"]["notes"].append(f"{spec_row}: not started, {why}")
                log(f"{spec_row}: not started, {why}")
                save()
                continue
            try:
                run_row(ctx, doc, spec_row, save)
            except Exception as exc:  # noqa: BLE001  (one row's failure is a result; the others still run)
                doc["details"]["errors"].append(f"{spec_row}: {type(exc).__name__}: {exc}")
                log(f"FAILED {spec_row}: {traceback.format_exc()}")
                save()
            recorded_store(args.bank).write_text(json.dumps(ctx["recorded"]))
    finally:
        bank.close()
    save()
    for r in doc["rows"]:
        log(" ".join(f"{c}={r.get(c)}" for c in COLUMNS))


if __name__ == "__main__":
    main()
