"""The state of a sparse run: one holder per patched model (:class:`SparseAttentionState`), one
:class:`SparseRun` per sampling run (the step, the current bucket's masks, statistics, the kernel
choice and its failures), and the :class:`CallPlan` of a model call whose masks are known ahead.

The hooks that ComfyUI calls live in ``sparse_patch``; they find this state in
``transformer_options`` and ask it what each attention call runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .._siblings import import_sibling
from .hooks import AttentionCall, StepClock, block_sparse, fp8_block_sparse, schedule_step
from .mask_provider import MaskSource, PreparedMask, RunSource, SamplingCall
from .run_stats import LayerStats, RunStats, StepCallback, StepStats

# What the self-attention Chorus leaves dense runs on: "auto" = FlashAttention-4's dense forward
# where it applies (sm_90/sm_100, flash-attn-4 installed, bf16/fp16, head_dim 128), else torch
# SDPA with cuDNN first on sm_90 (kernels.dense_attention.dense_route_for), else ComfyUI's own
# function; "comfyui" = always ComfyUI's own function.
DENSE_ATTENTION_MODES = ("auto", "comfyui")
# What the block-sparse calls compute in: "bf16" = the input's 16-bit type throughout; "fp8" = int8
# QK^T and e4m3 PV on FP8 tensor cores (kernels/fp8_block_sparse.py); "int8" = int8 QK^T with P and
# V in the input's 16-bit type (the same kernel, pv_fp8 False); bf16 where those cannot run.
ATTENTION_PRECISIONS = ("bf16", "fp8", "int8")
# the quantised precisions -> (block-sparse function, backend selection) in kernels/fp8_block_sparse.py
QUANTIZED_DISPATCH = {"fp8": ("fp8_block_sparse_attention", "select_fp8_backend"),
                      "int8": ("int8_block_sparse_attention", "select_int8_backend")}

# Set by newer ComfyUI's MultiGPU split in each worker thread's model call (comfy/samplers.py,
# _calc_cond_batch_multigpu; read in the 0.38 tree, not in 0.19.3).
MULTIGPU_DEVICE_KEY = "multigpu_thread_device"

# --------------------------------------------------------------------------------------------
# State: one holder per patched model, one SparseRun per sampling run
# --------------------------------------------------------------------------------------------


class SparseAttentionState:
    """Attached to the patched clone: the mask source, the current/last run's stats, step callbacks.

    The source is a fixed provider, or a :class:`RunSource` that chooses each run's provider
    (Chorus Sparse Attention): one OUTER_SAMPLE wrapper asks it, runs, and tells it how it ended.
    """

    def __init__(self, source, key: str, dense_attention: str = "auto", attention_precision: str = "bf16"):
        self.source = source
        self.key = key
        self.dense_attention = dense_attention
        self.attention_precision = attention_precision
        self.stats: Optional[RunStats] = None
        self.step_callbacks: list[StepCallback] = []

    def on_step(self, callback: StepCallback) -> StepCallback:
        """Call ``callback(step_stats, run_stats)`` after every sampling step (usable as a decorator)."""
        self.step_callbacks.append(callback)
        return callback

    @property
    def provider(self):
        """The fixed provider (None when a RunSource chooses one per run)."""
        return None if isinstance(self.source, RunSource) else self.source

    def start_run(self, sampling: Optional[SamplingCall] = None) -> "SparseRun":
        """The run's one holder of state: made by a RunSource from ``sampling`` (its own SparseRun,
        which also chooses the masks and records), else a SparseRun of the fixed provider."""
        if isinstance(self.source, RunSource):
            run = self.source.begin_run(sampling, self.step_callbacks, self.dense_attention)
        else:
            run = SparseRun(self.source, self.step_callbacks, self.dense_attention)
        run.attention_precision = self.attention_precision
        self.stats = run.stats
        return run

    def end_run(self, succeeded: bool) -> None:
        if isinstance(self.source, RunSource):
            self.source.end_run(succeeded)


class SparseRun:
    """One sampling run's state: the current step, the masks of the current step bucket, statistics.

    The run's one holder: a reuse run (``chorus_core.reuse.reuse_run.ReuseRun``) is a SparseRun
    that also chooses its mask source, reports and records, so no other object keeps run state.
    """

    def __init__(self, provider: Optional[MaskSource], step_callbacks: list[StepCallback],
                 dense_attention: str = "auto"):
        self.provider = provider
        self.step_callbacks = step_callbacks
        self.dense_attention = dense_attention
        self.attention_precision = "bf16"  # set by the holder that starts the run
        self._dense_kernels: dict[tuple, Optional[Callable]] = {}  # (device, dtype, head_dim) -> kernel
        self.stats = RunStats()
        self._started = time.perf_counter()
        self._masks: dict[tuple, Any] = {}  # current step bucket only, so memory stays bounded
        self._bucket: Hashable = _NO_BUCKET
        self._sigmas: Optional[torch.Tensor] = None  # the model call the current step was read from
        self.clock: Optional[StepClock] = None  # set by the OUTER_SAMPLE wrapper
        self._step: Optional[StepStats] = None
        self._step_started = 0.0
        self._disabled = False  # set when masks cannot be had: the rest of the run is dense
        self._triton: Optional[bool] = None
        self._multigpu_lock = threading.Lock()  # MultiGPU's worker threads may each find the run first

    @property
    def disabled(self) -> bool:
        """True once something on the sparse path failed: the rest of the run is dense."""
        return self._disabled

    # ---- steps

    def step_of(self, transformer_options: dict) -> Optional[int]:
        """The step of the current model call (see hooks.StepClock); None outside a sampler."""
        sigmas = transformer_options.get("sigmas")
        schedule = transformer_options.get("sample_sigmas")
        if sigmas is None or schedule is None:
            return None
        if sigmas is not self._sigmas:  # a new model call: stepped once, then reused by every layer
            self._sigmas = sigmas
            if self.clock is None:  # sampled without our OUTER_SAMPLE wrapper: the nearest sigma
                step = schedule_step(sigmas, schedule)
            else:
                step = self.clock.step_of(sigmas)
            self.stats.scheduled_steps = len(schedule) - 1
            self._enter_step(step)
        return self._step.step

    def _enter_step(self, step: int) -> None:
        if self._step is not None and self._step.step == step:
            return
        self._close_step()
        self._step = StepStats(step)
        self._step_started = time.perf_counter()

    def _close_step(self) -> None:
        if self._step is None:
            return
        closed, self._step = self._step, None
        closed.seconds = time.perf_counter() - self._step_started
        self.stats.steps.append(closed)
        for callback in list(self.step_callbacks):
            try:
                callback(closed, self.stats)
            except Exception:  # a progress event must not abort a generation
                logging.exception("Chorus: a per-step statistics callback failed; sampling continues")

    def record(self, layer: int, density: Optional[float]) -> None:
        self.stats.layers.setdefault(layer, LayerStats()).add(density)
        if self._step is not None:
            self._step.layers.setdefault(layer, LayerStats()).add(density)

    # ---- masks

    def mask_for(self, layer, step, cond_or_uncond, heads, seq_len, batch, device) -> Optional[PreparedMask]:
        """The kernel-ready mask for this call, or None for dense; prepared once per step bucket."""
        bucket = self.provider.step_bucket(step)
        if bucket != self._bucket:
            self._masks.clear()
            self._bucket = bucket
        key = (layer, tuple(cond_or_uncond), batch, heads, seq_len, str(device))
        if key not in self._masks:
            self._masks[key] = self.provider.prepared_mask(layer, step, list(cond_or_uncond), heads, seq_len,
                                                   batch, device)
        return self._masks[key]

    # ---- the attention call

    def attend(self, layer: int, transformer_options: dict, call: "AttentionCall",
               fast_dense: bool = True) -> Optional[torch.Tensor]:
        """Block-sparse self-attention, the fast dense kernel where the mask source leaves the call
        dense (``fast_dense``), or None: ComfyUI's function runs it. For calls without a CallPlan:
        observing sources (online prediction, recording), or a compiled call rerun after a failure.

        Any failure on the sparse path (mask source, conversion, validation, kernel compile or
        launch) makes the rest of the run dense with one warning: it costs speed, never the generation.
        """
        if self._disabled:  # traced: a compiled model call rerun dense after a failure stays one graph
            self.record(layer, None)
            return None
        return self._attend_eager(layer, transformer_options, call, fast_dense)

    # Eager inside a compiled model too: traced, dynamo would specialise this host-side mask
    # bookkeeping on the layer, one recompile per layer, and hit its recompile limit (8) on Wan's 40.
    @torch.compiler.disable
    def _attend_eager(self, layer: int, transformer_options: dict, call: "AttentionCall",
                      fast_dense: bool) -> Optional[torch.Tensor]:
        step = self.step_of(transformer_options)
        if step is None or self._disabled or not self._kernel_usable(call.q.device):
            self.record(layer, None)
            return None
        cond_or_uncond = transformer_options.get("cond_or_uncond") or [0]
        stage = "masks unavailable"
        try:
            self.observe(layer, step, cond_or_uncond, call)
            prepared = self.mask_for(layer, step, cond_or_uncond, call.heads, call.seq_len, call.batch, call.q.device)
            if prepared is None:
                self.record(layer, None)
                return self.dense(call) if fast_dense else None
            stage = "block-sparse attention failed"
            self._note_backend(call, prepared)
            out = self.sparse_attention()(
                call.q, call.k, call.v, prepared.mask, call.heads,
                skip_reshape=call.skip_reshape, skip_output_reshape=call.skip_output_reshape,
            )
        except Exception as exc:
            where = f"{stage} at layer {layer}, step {step} ({type(exc).__name__}: {exc})"
            if stage == "masks unavailable":
                self._disable(f"{where}; the rest of this run is dense")
            else:
                self.kernel_failed(where)
            self.record(layer, None)
            return None
        self.record(layer, prepared.density)
        return out

    def sparse_attention(self) -> Callable:
        """The block-sparse function of this run's ``attention_precision`` (same arguments either way)."""
        return self._dispatch()[0]

    def _dispatch(self) -> tuple[Callable, Callable]:
        """(block-sparse function, its backend selection) for this run's ``attention_precision``."""
        if self.attention_precision in QUANTIZED_DISPATCH:
            kernels = fp8_block_sparse()
            attend, select = QUANTIZED_DISPATCH[self.attention_precision]
            return getattr(kernels, attend), getattr(kernels, select)
        bf16 = block_sparse()
        return bf16.block_sparse_attention, bf16.select_backend

    def dense_for_extra_tokens(self, layer: int, block: "BlockCall") -> None:
        """A sequence with tokens besides the video's: the masks do not cover them, so dense."""
        reason = (f"the model's sequence holds {block.extra_tokens} tokens besides its {block.video_tokens} "
                  "video tokens (a reference latent, extra frames or context latents); Chorus masks cover the "
                  "video tokens only, so self-attention runs dense in this run")
        if reason not in self.stats.warnings:
            self.stats.warnings.append(reason)
            logging.warning("Chorus: %s", reason)
        self.record(layer, None)

    def dense(self, call: "AttentionCall") -> Optional[torch.Tensor]:
        """A call the mask source leaves dense: the fast dense kernel where it applies, else None
        (ComfyUI's own function runs it). Eager path; planned calls carry their kernel."""
        head_dim = call.q.shape[-1] if call.skip_reshape else call.q.shape[-1] // call.heads
        kernel = self.dense_kernel(call.q.device, call.q.dtype, head_dim)
        if kernel is None:
            return None
        try:
            return kernel(call.q, call.k, call.v, call.heads, call.skip_reshape, call.skip_output_reshape)
        except Exception as exc:  # speed only: ComfyUI's function gives the same result
            self.fast_dense_failed(exc)
            return None

    def dense_kernel(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[Callable]:
        """``kernels.dense_attention.dense_attention`` (FA4, else cuDNN-first SDPA) when one of them
        can run these calls and the user left ``dense_attention`` on "auto"; None: ComfyUI's own
        function. Decided once per run."""
        key = (str(device), dtype, head_dim)
        if key not in self._dense_kernels:
            kernel, route, why = None, None, "dense_attention='comfyui' was chosen"
            if self.dense_attention == "auto":
                dense = import_sibling("kernels.dense_attention")
                route, why = dense.dense_route_for(device, dtype, head_dim)
                kernel = dense.dense_attention if route is not None else None
            self._dense_kernels[key] = kernel
            if self.stats.dense_backend is None:
                self.stats.dense_backend = dense_backend_name(route, why)
        return self._dense_kernels[key]

    def leave_dense_to(self, backend: str) -> None:
        """The user chose the dense attention (``backend``: a Model Attention Backend node below
        Chorus, or the function ComfyUI was started with, e.g. ``--use-sage-attention``): ComfyUI's
        function runs every call left dense, FlashAttention-4 and cuDNN-first SDPA take none. Decided once
        per run."""
        self.dense_attention = "comfyui"
        self._dense_kernels.clear()
        self.stats.dense_backend = f"comfyui ({backend} runs the calls left dense)"

    def fast_dense_failed(self, exc: Exception) -> None:
        """The fast dense kernel raised (eager, or out of a compiled model call): ComfyUI's function
        runs the dense calls for the rest of the run, sparse calls stay sparse."""
        self._no_fast_dense(f"the fast dense call failed ({type(exc).__name__}: {exc}); "
                            "dense calls use ComfyUI's attention for the rest of this run")

    def _no_fast_dense(self, reason: str) -> None:
        self.dense_attention = "comfyui"
        self._dense_kernels.clear()  # decided again, now as "comfyui"
        self.stats.dense_backend = f"comfyui ({reason})"
        if reason not in self.stats.warnings:
            self.stats.warnings.append(reason)
            logging.warning("Chorus: %s", reason)

    # ---- planned model calls (see CallPlan)

    def plan_call(self, options: dict, x: torch.Tensor, model) -> Optional["CallPlan"]:
        """Every layer's mask (and the dense kernel) for this model call, before the model runs.

        None when the call is decided per attention call instead: outside a sampler, after a
        failure, or when the mask source looks at q and k (online prediction, recording).
        """
        self.stats.batch = max(self.stats.batch or 0, int(x.shape[0]))
        step = self.step_of(options)
        diffusion_model = getattr(model, "diffusion_model", None)
        if step is None or self._disabled or diffusion_model is None or self.provider.observes(step):
            return None
        if x.device.type not in ("cuda", "cpu") or not self._kernel_usable(x.device):
            return None  # the per-call path says why, once
        heads = int(diffusion_model.num_heads)
        seq_len = video_token_count(x, diffusion_model)
        chunks = options.get("cond_or_uncond") or [0]
        try:
            prepared = [self.mask_for(layer, step, chunks, heads, seq_len, x.shape[0], x.device)
                        for layer in range(len(diffusion_model.blocks))]
        except Exception as exc:
            self._disable(f"masks unavailable at step {step} ({type(exc).__name__}: {exc}); the rest of this run "
                          "is dense")
            return None
        head_dim = int(diffusion_model.dim) // heads
        return CallPlan.build(seq_len, prepared, self.sparse_attention(),
                              self.dense_kernel(x.device, compute_dtype(model), head_dim))

    def observing(self) -> bool:
        """True when the current model call's masks come from looking at its q and k (online
        prediction, recording): decided per attention call, with host work in each."""
        return self._step is not None and not self._disabled and bool(self.provider.observes(self._step.step))

    def record_plan(self, plan: "CallPlan") -> None:
        """Statistics of a planned call, read after the model ran (a compiled model cannot count)."""
        for layer, sparse in plan.answered:
            self.record(layer, plan.densities[layer] if sparse else None)
        for layer, seq_len, video_tokens in plan.extra_tokens:
            self.dense_for_extra_tokens(layer, BlockCall(layer, seq_len, video_tokens))
        if any(sparse for _, sparse in plan.answered):
            self.note_last_backend()

    def note_last_backend(self) -> None:
        """Name the backend of the latest block-sparse call in the run's statistics, once
        (for calls made where the choice is not at hand: compiled graphs, Feature Reuse)."""
        if self.stats.backend is None:
            choice = block_sparse().last_backend_choice()
            self.stats.backend = None if choice is None else str(choice)

    def fail_planned(self, layer: Optional[int], exc: Exception) -> None:
        step = self._step.step if self._step is not None else None
        where = f"at layer {layer}, step {step}" if layer is not None else "in a compiled model call"
        self.kernel_failed(f"block-sparse attention failed {where} ({type(exc).__name__}: {exc})")

    def kernel_failed(self, where: str) -> None:
        """A block-sparse call failed (``where`` says how): an fp8 or int8 run goes on with 16-bit
        block-sparse attention (the quantised kernel is the newer, less proven one), any other run goes dense."""
        if self.attention_precision in QUANTIZED_DISPATCH:
            was, self.attention_precision = self.attention_precision, "bf16"
            self.stats.backend = None  # named again by the next block-sparse call
            self._warn(f"{where}; the rest of this run uses 16-bit block-sparse attention instead of {was.upper()}")
        else:
            self._disable(f"{where}; the rest of this run is dense")

    def _kernel_usable(self, device: torch.device) -> bool:
        """On a GPU without a kernel (no Triton, no FA4), or on MPS/XPU, the torch reference would be
        slower than dense: stay dense."""
        if device.type not in ("cuda", "cpu"):
            self._disable(f"block-sparse attention has no kernel for {device.type.upper()} devices (the "
                          "per-block reference would be slower than dense); this run is dense")
            return False
        if device.type == "cpu":
            return True
        if self._triton is None:  # looked up once per run, not per call
            self._triton = block_sparse().gpu_kernel_available()
        if self._triton:
            return True
        self._disable("Triton is not available on this CUDA machine (nor FlashAttention-4), so block-sparse "
                      "attention would be slower than dense; this run is dense. Install triton (Linux) or "
                      "triton-windows.")
        return False

    def _note_backend(self, call: "AttentionCall", prepared: PreparedMask) -> None:
        """Name the kernel backend in the run's statistics (chosen again per call; probes are cached)."""
        if self.stats.backend is None:
            self.stats.backend = str(self._dispatch()[1](call.q, prepared.mask))

    def dense_under_multigpu(self, options: dict) -> bool:
        """True when ComfyUI's MultiGPU split makes this model call (newer ComfyUI: each GPU's share
        of the conds runs in a worker thread, its options carrying ``multigpu_thread_device``).
        A run's step clock, masks and recording are one sequence of calls, not several at once, so
        the whole run is dense, said once."""
        if MULTIGPU_DEVICE_KEY not in options:
            return False
        with self._multigpu_lock:
            self._disable("ComfyUI's MultiGPU split runs this model on several GPUs at once, which Chorus "
                          "does not support: this run is dense (sample on one GPU for block-sparse attention)")
        return True

    def _disable(self, reason: str) -> None:
        self._disabled = True
        self._warn(reason)

    def _warn(self, reason: str) -> None:
        if reason not in self.stats.warnings:
            self.stats.warnings.append(reason)
            logging.warning("Chorus: %s", reason)

    def observe(self, layer, step, cond_or_uncond, call: "AttentionCall") -> None:
        """Show q and k to a provider that wants them (online prediction, recording) before it is asked."""
        self.provider.observe(layer, step, list(cond_or_uncond), call.q, call.k, call.heads, call.skip_reshape)

    def end_sampling(self) -> None:
        """Sampling returned: close the last step and stamp the run."""
        self._close_step()
        self.stats.seconds = time.perf_counter() - self._started
        self.stats.finished = True

    def release(self) -> None:
        """Free the run's masks (GPU memory) whatever happened."""
        self._masks.clear()
        self._sigmas = None


_NO_BUCKET = object()


@dataclass
class CallPlan:
    """What each layer's video self-attention runs in one model call, decided before the call.

    The override reads only this: tensors (the masks), ints and the two kernel functions, all
    the same kind of value at every step of a step bucket. So a compiled diffusion model guards
    on their shapes, never on Python state that changes per step, and no graph breaks. What
    happened is appended to ``answered``/``extra_tokens`` (side effects a compiled graph replays)
    and counted after the call by ``SparseRun.record_plan``.
    """

    seq_len: int  # video tokens of this call
    masks: tuple  # per layer: BlockSparseMask, or None (dense)
    densities: tuple  # per layer: the mask's density, or None; read after the call only
    sparse: Callable  # the run's block-sparse function (bf16 or fp8 dispatch; same arguments)
    dense: Optional[Callable]  # kernels.dense_attention.dense_attention, or None: ComfyUI's function
    answered: list = field(default_factory=list)  # (layer, ran sparse) per self-attention answered
    extra_tokens: list = field(default_factory=list)  # (layer, seq_len, video tokens): ran dense

    @classmethod
    def build(cls, seq_len: int, prepared: list, sparse: Callable, dense: Optional[Callable]) -> "CallPlan":
        masks = tuple(None if p is None else p.mask for p in prepared)
        for mask in masks:  # outside any compiled region (the per-call path does not mark: it runs eager)
            if mask is not None:  # the live-list width changes per bucket: one graph for all widths
                torch._dynamo.maybe_mark_dynamic(mask.live_blocks, 3)
        return cls(seq_len, masks, tuple(None if p is None else p.density for p in prepared), sparse, dense)

    def mask_of(self, layer: int):
        return self.masks[layer] if 0 <= layer < len(self.masks) else None


def dense_backend_name(route: Optional[str], why: str) -> str:
    """The report's ``dense_backend``: what ran the calls Chorus left dense, and why that one."""
    if route == "fa4":
        return "fa4 (FlashAttention-4 dense forward)"
    if route == "cudnn_sdpa":
        return f"cudnn_sdpa (torch SDPA with cuDNN's attention first, as ComfyUI runs it on Windows; FA4: {why})"
    return f"comfyui (ComfyUI's attention function; {why})"


def declared_attention(diffusion_model) -> Optional[tuple]:
    """Per layer, (self-attention, cross-attention) functions that newer ComfyUI's layers declare
    (``comfy_attention.function``, set when a checkpoint names an attention method for the layer,
    e.g. comfy-kitchen INT8), or None when no layer declares one. ComfyUI runs a declared function
    unless an override is set; Chorus's override runs it for the calls it leaves dense."""
    pairs = tuple((_declared(getattr(block, "self_attn", None)), _declared(getattr(block, "cross_attn", None)))
                  for block in getattr(diffusion_model, "blocks", ()))
    return pairs if any(f is not None for pair in pairs for f in pair) else None


def _declared(module) -> Optional[Callable]:
    return getattr(getattr(module, "comfy_attention", None), "function", None)


def video_token_count(x: torch.Tensor, diffusion_model) -> int:
    """Tokens of a video latent ``[B, C, T, H, W]`` after patchify (a plain loop: compiled
    models trace it without a graph break, a generator would break it)."""
    count = 1
    for size, patch in zip(x.shape[2:], getattr(diffusion_model, "patch_size", (1, 2, 2))):
        count *= -(-size // patch)
    return count


def compute_dtype(model) -> torch.dtype:
    """The dtype ComfyUI runs the diffusion model in (BaseModel._apply_model casts to it)."""
    manual = getattr(model, "manual_cast_dtype", None)
    return manual if manual is not None else model.get_dtype()


# --------------------------------------------------------------------------------------------
# What one attention call is
# --------------------------------------------------------------------------------------------

@dataclass
class BlockCall:
    """Handed down to one block call: its layer, token count and how many of them are video."""

    layer: int
    seq_len: int
    video_tokens: Optional[int] = None  # None: not known (no wrapper ran), taken as all of them
    self_attention_seen: bool = False
    # the functions this layer's self- and cross-attention declare (newer ComfyUI's per-layer
    # ``comfy_attention``, set from the checkpoint), or None: what ComfyUI would run without Chorus
    declared: tuple = (None, None)
    last_call_self: bool = False

    @property
    def extra_tokens(self) -> int:
        return 0 if self.video_tokens is None else self.seq_len - self.video_tokens

    def claims(self, call: AttentionCall) -> bool:
        """True for the block's self-attention when it can run sparse.

        The first attention of a Wan block with q and k both over all of the block's tokens is
        its self-attention; the cross-attentions (257 CLIP tokens, 512 text tokens) come after
        it, so a video that happens to have 257 or 512 tokens is not mistaken for them.
        """
        self.last_call_self = not self.self_attention_seen and call.seq_len == call.kv_len == self.seq_len
        if not self.last_call_self:
            return False
        self.self_attention_seen = True
        # An attention mask, a custom scale or grouped KV heads: the kernel would drop them.
        named = call.named
        return call.mask is None and "scale" not in named and not named.get("enable_gqa", False)

    def declared_for_last_call(self) -> Optional[Callable]:
        """The function the layer declares for the call just seen by ``claims`` (self or cross)."""
        return self.declared[0 if self.last_call_self else 1]
