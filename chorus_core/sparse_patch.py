"""Block-sparse self-attention for Wan 2.1 in ComfyUI, installed on a clone of a ModelPatcher.

How it hooks in (never by copying ``forward_orig``, never by module-level monkeypatching):

* ``("double_block", i)`` patches put the block index and the block's token count into the
  ``transformer_options`` handed down to block ``i`` (chained to a block patch already there);
* ``transformer_options["optimized_attention_override"]`` runs a block's self-attention
  block-sparse with the provider's mask; everything else (cross-attention, layers the provider
  leaves dense) goes to the override that was there before, or to ComfyUI's own function;
* a keyed ``DIFFUSION_MODEL`` wrapper counts the video tokens of each model call, so a block
  whose sequence carries extra tokens (a reference latent at the start, extra frames or context
  latents at the end) is recognised; its self-attention runs dense with one warning, since the
  masks cover the video tokens only;
* a keyed ``APPLY_MODEL`` wrapper, outside the diffusion model (and so outside what ComfyUI's
  TorchCompileModel compiles), steps the run and, when the masks of this model call are known
  before it runs (a bank hit, the prior, static maps; not online prediction or recording, which
  look at q and k), puts every layer's mask in a ``CallPlan``: the override then reads only
  tensors and constants, so a compiled model keeps one graph;
* a keyed ``OUTER_SAMPLE`` wrapper creates the per-run state (step tracking, mask cache,
  statistics) and drops it in ``finally``; it also refuses a model that core's "Model Sparse
  Attention" node patches too, and re-chains above a "Model Attention Backend" applied later.

Works with ComfyUI 0.3.64 and with the newer attention API (q/k/v in single-use
``AttentionTensorContainer`` objects; ``block_index`` and ``grid_sizes`` in
``transformer_options``): see ``hooks.AttentionCall``.

The model passed in is never changed. Statistics of the current or last run:
``get_run_stats(patched)``; per-step events: ``get_sparse_state(patched).on_step(callback)``.
"""

from __future__ import annotations

import functools
import logging
import math
import time
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from .hooks import (AttentionCall, StepClock, block_sparse, clock_outer_sample, container_function_of, is_container,
                    mark_own, schedule_step,
                    unwrap_own)
from ._siblings import import_sibling
from .mask_provider import (MaskProvider, PreparedMask, RunSource, SamplingCall, observes, serve_prepared_mask,
                            step_bucket_of)
from .model_checks import (ATTENTION_BACKEND_NODE, CompetingAttentionError, UnsupportedModelError,
                           check_no_competing_sparse_attention, check_supported_model, is_attention_backend_override)
from .run_keys import (APPLY_MODEL, DIFFUSION_MODEL, OUTER_SAMPLE, OVERRIDE_KEY, sparse_block_key, sparse_plan_key,
                       sparse_run_key, sparse_video_key)
from .run_stats import LayerStats, RunStats, StepCallback, StepStats

__all__ = [
    "UnsupportedModelError",
    "CompetingAttentionError",
    "LayerStats",
    "StepStats",
    "RunStats",
    "SparseAttentionState",
    "install_sparse_attention",
    "CallPlan",
    "DENSE_ATTENTION_MODES",
    "check_supported_model",
    "get_sparse_state",
    "get_run_stats",
]

# What the self-attention Chorus leaves dense runs on: "auto" = FlashAttention-4's dense forward
# where it applies (sm_90/sm_100, flash-attn-4 installed, bf16/fp16, head_dim 128), else
# ComfyUI's own function; "comfyui" = always ComfyUI's own function.
DENSE_ATTENTION_MODES = ("auto", "comfyui")
# --------------------------------------------------------------------------------------------
# State: one holder per patched model, one _Run per sampling run
# --------------------------------------------------------------------------------------------


class SparseAttentionState:
    """Attached to the patched clone: the mask source, the current/last run's stats, step callbacks.

    The source is a fixed provider, or a :class:`RunSource` that chooses each run's provider
    (Chorus Sparse Attention): one OUTER_SAMPLE wrapper asks it, runs, and tells it how it ended.
    """

    def __init__(self, source, key: str, dense_attention: str = "auto"):
        self.source = source
        self.key = key
        self.dense_attention = dense_attention
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

    def start_run(self, sampling: Optional[SamplingCall] = None) -> "_Run":
        """The per-run state; a RunSource chooses the run's provider from ``sampling``."""
        provider = self.source.begin_run(sampling) if isinstance(self.source, RunSource) else self.source
        run = _Run(provider, self.step_callbacks, self.dense_attention)
        self.stats = run.stats
        return run

    def end_run(self, succeeded: bool) -> None:
        if isinstance(self.source, RunSource):
            self.source.end_run(succeeded)


class _Run:
    """Per-run state: the current step, the masks of the current step bucket, statistics."""

    def __init__(self, provider: MaskProvider, step_callbacks: list[StepCallback], dense_attention: str = "auto"):
        self.provider = provider
        self.step_callbacks = step_callbacks
        self.dense_attention = dense_attention
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
        bucket = step_bucket_of(self.provider, step)
        if bucket != self._bucket:
            self._masks.clear()
            self._bucket = bucket
        key = (layer, tuple(cond_or_uncond), batch, heads, seq_len, str(device))
        if key not in self._masks:
            self._masks[key] = serve_prepared_mask(self.provider, layer, step, list(cond_or_uncond), heads, seq_len,
                                                   batch, device)
        return self._masks[key]

    # ---- the attention call

    def attend(self, layer: int, transformer_options: dict, call: "AttentionCall",
               fast_dense: bool = True) -> Optional[torch.Tensor]:
        """Block-sparse self-attention, the fast dense kernel where the mask source leaves the call
        dense (``fast_dense``), or None: ComfyUI's function runs it.

        Any failure on the sparse path (mask source, conversion, validation, kernel compile or
        launch) makes the rest of the run dense with one warning: it costs speed, never the generation.
        """
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
            out = block_sparse().block_sparse_attention(
                call.q, call.k, call.v, prepared.mask, call.heads,
                skip_reshape=call.skip_reshape, skip_output_reshape=call.skip_output_reshape,
            )
        except Exception as exc:
            self._disable(f"{stage} at layer {layer}, step {step} ({type(exc).__name__}: {exc}); "
                          "the rest of this run is dense")
            self.record(layer, None)
            return None
        self.record(layer, prepared.density)
        return out

    def dense_for_extra_tokens(self, layer: int, block: "_BlockCall") -> None:
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
            self._no_fast_dense(f"the dense FlashAttention-4 call failed ({type(exc).__name__}: {exc}); "
                                "dense calls use ComfyUI's attention for the rest of this run")
            return None

    def dense_kernel(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[Callable]:
        """``kernels.dense_attention.dense_attention`` when FA4 can run these calls and the user
        left ``dense_attention`` on "auto"; None: ComfyUI's own function. Decided once per run."""
        key = (str(device), dtype, head_dim)
        if key not in self._dense_kernels:
            kernel, why = None, "dense_attention='comfyui' was chosen"
            if self.dense_attention == "auto":
                dense = import_sibling("kernels.dense_attention")
                why = dense.dense_unsupported_for(device, dtype, head_dim)
                kernel = dense.dense_attention if why is None else None
            self._dense_kernels[key] = kernel
            if self.stats.dense_backend is None:
                self.stats.dense_backend = ("fa4 (FlashAttention-4 dense forward)" if kernel is not None
                                            else f"comfyui (ComfyUI's attention function; {why})")
        return self._dense_kernels[key]

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
        step = self.step_of(options)
        diffusion_model = getattr(model, "diffusion_model", None)
        if step is None or self._disabled or diffusion_model is None or observes(self.provider, step):
            return None
        if x.device.type not in ("cuda", "cpu") or not self._kernel_usable(x.device):
            return None  # the per-call path says why, once
        heads = int(diffusion_model.num_heads)
        seq_len = _video_token_count(x, diffusion_model)
        chunks = options.get("cond_or_uncond") or [0]
        try:
            prepared = [self.mask_for(layer, step, chunks, heads, seq_len, x.shape[0], x.device)
                        for layer in range(len(diffusion_model.blocks))]
        except Exception as exc:
            self._disable(f"masks unavailable at step {step} ({type(exc).__name__}: {exc}); the rest of this run "
                          "is dense")
            return None
        head_dim = int(diffusion_model.dim) // heads
        return CallPlan.build(seq_len, prepared, block_sparse().block_sparse_attention,
                              self.dense_kernel(x.device, _compute_dtype(model), head_dim))

    def record_plan(self, plan: "CallPlan") -> None:
        """Statistics of a planned call, read after the model ran (a compiled model cannot count)."""
        for layer, sparse in plan.answered:
            self.record(layer, plan.densities[layer] if sparse else None)
        for layer, seq_len, video_tokens in plan.extra_tokens:
            self.dense_for_extra_tokens(layer, _BlockCall(layer, seq_len, video_tokens))
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
        self._disable(f"block-sparse attention failed {where} ({type(exc).__name__}: {exc}); the rest of this "
                      "run is dense")

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
            self.stats.backend = str(block_sparse().select_backend(call.q, prepared.mask))

    def _disable(self, reason: str) -> None:
        self._disabled = True
        if reason not in self.stats.warnings:
            self.stats.warnings.append(reason)
            logging.warning("Chorus: %s", reason)

    def observe(self, layer, step, cond_or_uncond, call: "AttentionCall") -> None:
        """Show q and k to a provider that wants them (online prediction, recording) before it is asked."""
        observer = getattr(self.provider, "observe", None)
        if observer is not None:
            observer(layer, step, list(cond_or_uncond), call.q, call.k, call.heads, call.skip_reshape)

    def finish(self) -> None:
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
    and counted after the call by ``_Run.record_plan``.
    """

    seq_len: int  # video tokens of this call
    masks: tuple  # per layer: BlockSparseMask, or None (dense)
    densities: tuple  # per layer: the mask's density, or None; read after the call only
    sparse: Callable  # kernels.block_sparse.block_sparse_attention
    dense: Optional[Callable]  # kernels.dense_attention.dense_attention, or None: ComfyUI's function
    answered: list = field(default_factory=list)  # (layer, ran sparse) per self-attention answered
    extra_tokens: list = field(default_factory=list)  # (layer, seq_len, video tokens): ran dense

    @classmethod
    def build(cls, seq_len: int, prepared: list, sparse: Callable, dense: Optional[Callable]) -> "CallPlan":
        masks = tuple(None if p is None else p.mask for p in prepared)
        for mask in masks:  # outside any compiled region (the per-call path must not mark: it runs traced)
            if mask is not None:  # the live-list width changes per bucket: one graph for all widths
                torch._dynamo.maybe_mark_dynamic(mask.live_blocks, 3)
        return cls(seq_len, masks, tuple(None if p is None else p.density for p in prepared), sparse, dense)

    def mask_of(self, layer: int):
        return self.masks[layer] if 0 <= layer < len(self.masks) else None


def _video_token_count(x: torch.Tensor, diffusion_model) -> int:
    """Tokens of a video latent ``[B, C, T, H, W]`` after patchify (a plain loop: compiled
    models trace it without a graph break, a generator would break it)."""
    count = 1
    for size, patch in zip(x.shape[2:], getattr(diffusion_model, "patch_size", (1, 2, 2))):
        count *= -(-size // patch)
    return count


def _compute_dtype(model) -> torch.dtype:
    """The dtype ComfyUI runs the diffusion model in (BaseModel._apply_model casts to it)."""
    manual = getattr(model, "manual_cast_dtype", None)
    return manual if manual is not None else model.get_dtype()


# --------------------------------------------------------------------------------------------
# What one attention call is
# --------------------------------------------------------------------------------------------

@dataclass
class _BlockCall:
    """Handed down to one block call: its layer, token count and how many of them are video."""

    layer: int
    seq_len: int
    video_tokens: Optional[int] = None  # None: not known (no wrapper ran), taken as all of them
    self_attention_seen: bool = False

    @property
    def extra_tokens(self) -> int:
        return 0 if self.video_tokens is None else self.seq_len - self.video_tokens

    def claims(self, call: AttentionCall) -> bool:
        """True for the block's self-attention when it can run sparse.

        The first attention of a Wan block with q and k both over all of the block's tokens is
        its self-attention; the cross-attentions (257 CLIP tokens, 512 text tokens) come after
        it, so a video that happens to have 257 or 512 tokens is not mistaken for them.
        """
        if self.self_attention_seen or not (call.seq_len == call.kv_len == self.seq_len):
            return False
        self.self_attention_seen = True
        # An attention mask, a custom scale or grouped KV heads: the kernel would drop them.
        named = call.named
        return call.mask is None and "scale" not in named and not named.get("enable_gqa", False)


# --------------------------------------------------------------------------------------------
# The hooks (plain closures: ModelPatcher.clone deep-copies model_options, and functions are
# copied by reference, so clones of the patched model share one holder)
# --------------------------------------------------------------------------------------------


def _foreign_override_in(override: Optional[Callable]) -> bool:
    """True when the override chain holds a function that is not one of Chorus's own."""
    while override is not None:
        if getattr(override, "chorus_key", None) is None:
            return True
        override = getattr(override, "chorus_previous", None)
    return False


def _make_attention_override(key: str, previous: Optional[Callable]) -> Callable:
    """The override; it also declares ``container_function`` when ``previous`` has one.

    Newer ComfyUI calls an override's ``container_function`` with the q/k/v containers and no
    ``func``; so only an override whose fallback takes containers itself can declare one, and
    declaring it keeps that fallback's memory-saving container path (e.g. Model Attention
    Backend's int8 kernel). Without one, wrap_attn unwraps the containers before calling us.
    """
    run_key, block_key, plan_key = sparse_run_key(key), sparse_block_key(key), sparse_plan_key(key)
    # An override another node installed below ours (Model Attention Backend, another pack) is the
    # user's choice of dense attention: it keeps the dense calls, FA4 dense does not take them.
    fast_dense = not _foreign_override_in(previous)

    def sparse_answer(args, kwargs):
        """(block-sparse or fast dense output, or None; the parsed call or None)."""
        options = kwargs.get("transformer_options") or {}
        run, block = options.get(run_key), options.get(block_key)
        if run is None or block is None:
            return None, None
        call = AttentionCall.parse(args, kwargs)
        if call is None or not block.claims(call):
            return None, call
        plan = options.get(plan_key)
        if plan is not None:
            return _planned_answer(run, plan, block, call, fast_dense), call
        if block.extra_tokens:
            run.dense_for_extra_tokens(block.layer, block)
            return None, call
        return run.attend(block.layer, options, call, fast_dense), call

    def chorus_attention_override(func, *args, **kwargs):
        out, call = sparse_answer(args, kwargs)
        if call is None and is_container(args[0] if args else kwargs.get("q")):
            call = AttentionCall.parse(args, kwargs)
        if call is not None and call.containers is not None:
            # Containers reached the plain path (a caller that does not unwrap them): answer or
            # unwrap them here, as wrap_attn does for an override without container_function.
            args, kwargs = _unwrapped(args, kwargs, call)
            call.consume()
        if out is not None:
            return out
        if previous is not None:
            return previous(func, *args, **kwargs)
        return func(*args, **kwargs)

    previous_containers = container_function_of(previous)
    if previous_containers is not None:
        def chorus_attention_containers(*args, **kwargs):
            out, call = sparse_answer(args, kwargs)
            if out is None:
                return previous_containers(*args, **kwargs)  # containers still unconsumed
            call.consume()
            return out

        chorus_attention_override.container_function = chorus_attention_containers
    return mark_own(chorus_attention_override, key, previous)


def _planned_answer(run, plan: CallPlan, block: _BlockCall, call: AttentionCall, fast_dense: bool):
    """A self-attention call under its model call's plan: no Python state is read (see CallPlan)."""
    layer = block.layer
    if block.extra_tokens or call.seq_len != plan.seq_len:
        plan.extra_tokens.append((layer, block.seq_len, block.video_tokens))
        return None
    mask = plan.mask_of(layer)
    if mask is None:
        plan.answered.append((layer, False))
        return _planned_dense(run, plan, call) if fast_dense else None
    plan.answered.append((layer, True))
    sparse = functools.partial(plan.sparse, call.q, call.k, call.v, mask, call.heads,
                               skip_reshape=call.skip_reshape, skip_output_reshape=call.skip_output_reshape)
    if torch.compiler.is_compiling():
        return sparse()  # a failure raises out of the graph: the APPLY_MODEL wrapper handles it
    if run.disabled:  # an earlier layer of this call failed
        plan.answered[-1] = (layer, False)
        return None
    try:
        return sparse()
    except Exception as exc:
        run.fail_planned(layer, exc)
        plan.answered[-1] = (layer, False)
        return None


def _planned_dense(run, plan: CallPlan, call: AttentionCall):
    """The fast dense kernel of the plan, or None (ComfyUI's function runs the call)."""
    if plan.dense is None:
        return None
    if torch.compiler.is_compiling():
        return plan.dense(call.q, call.k, call.v, call.heads, call.skip_reshape, call.skip_output_reshape)
    return run.dense(call)  # eager: a failure goes back to ComfyUI's function for the run


def _unwrapped(args: tuple, kwargs: dict, call: AttentionCall) -> tuple[tuple, dict]:
    """The call's arguments with q, k, v as tensors, wherever (by position or name) they came."""
    tensors = {"q": call.q, "k": call.k, "v": call.v}
    positional = min(len(args), 3)
    args = tuple(tensors[name] for name in ("q", "k", "v")[:positional]) + tuple(args[3:])
    kwargs = {name: tensors.get(name, value) if name in tensors else value for name, value in kwargs.items()}
    return args, kwargs


def _make_block_patch(key: str, index: int, previous: Optional[Callable]) -> Callable:
    run_key, block_key, video_key = sparse_run_key(key), sparse_block_key(key), sparse_video_key(key)

    def chorus_block_patch(args, extra):
        options = args.get("transformer_options")
        if options is not None and run_key in options:
            layer = options.get("block_index", index)  # newer ComfyUI sets it; trust it first
            block = _BlockCall(layer, args["img"].shape[1], _video_tokens(options, video_key))
            options = {**options, "block_index": layer, block_key: block}
            args = {**args, "transformer_options": options}
        if previous is not None:
            return previous(args, extra)
        return extra["original_block"](args)

    return mark_own(chorus_block_patch, key, previous)


def _video_tokens(options: dict, video_key: str) -> Optional[int]:
    """Video tokens of this model call: counted by our wrapper, else newer ComfyUI's grid_sizes."""
    counted = options.get(video_key)
    if counted is not None:
        return counted
    grid = options.get("grid_sizes")
    return math.prod(int(g) for g in grid) if grid is not None else None


def _make_video_tokens_wrapper(key: str) -> Callable:
    """DIFFUSION_MODEL wrapper: the video latent's token count, before any extra token is added."""
    run_key, video_key = sparse_run_key(key), sparse_video_key(key)

    def chorus_video_tokens(executor, x, *args, **kwargs):
        options = kwargs.get("transformer_options", args[4] if len(args) > 4 else None)
        if isinstance(options, dict) and run_key in options:  # a per-call copy: safe to write
            options[video_key] = _video_token_count(x, executor.class_obj)
        return executor(x, *args, **kwargs)

    return chorus_video_tokens


def _make_apply_model_wrapper(key: str) -> Callable:
    """APPLY_MODEL wrapper: steps the run and plans the model call, outside the diffusion model.

    ComfyUI's TorchCompileModel compiles the diffusion model only, so this runs eager in every
    mode. Under compile a kernel failure cannot fall back inside the graph: it raises out of
    the model call, and the call runs again with the rest of the run dense (one warning).
    """
    run_key, plan_key = sparse_run_key(key), sparse_plan_key(key)

    def chorus_plan_model_call(executor, x, t, *args, **kwargs):
        options = kwargs.get("transformer_options", args[3] if len(args) > 3 else None)
        run = options.get(run_key) if isinstance(options, dict) else None
        if run is None:
            return executor(x, t, *args, **kwargs)
        plan = run.plan_call(options, x, executor.class_obj)  # also steps the run clock
        if plan is None:
            return executor(x, t, *args, **kwargs)
        options[plan_key] = plan
        try:
            out = executor(x, t, *args, **kwargs)
        except Exception as exc:
            if not _raised_in_kernels(exc):
                raise
            options.pop(plan_key, None)
            run.fail_planned(None, exc)  # a compiled graph replays plan.answered only when it completes
            return executor(x, t, *args, **kwargs)
        options.pop(plan_key, None)
        run.record_plan(plan)
        return out

    return chorus_plan_model_call


_KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"


def _raised_in_kernels(exc: BaseException) -> bool:
    """True when the exception came out of Chorus's kernels (FA4, Triton, the reference)."""
    return any(_is_kernels_file(frame.f_code.co_filename) for frame, _ in traceback.walk_tb(exc.__traceback__))


@functools.lru_cache(maxsize=256)
def _is_kernels_file(co_filename: str) -> bool:
    # co_filename is the path as imported: resolve it too, or a symlinked custom_nodes folder
    # (or a Docker mount) never matches and the compiled fallback is lost
    # (generated code has names like "<string>": not a file, never resolved against the cwd)
    return not co_filename.startswith("<") and Path(co_filename).resolve().is_relative_to(_KERNELS_DIR)


def _make_outer_sample_wrapper(holder: SparseAttentionState) -> Callable:
    run_key = sparse_run_key(holder.key)

    def chorus_outer_sample(executor, *args, **kwargs):
        # The guider's model_options are a per-sample copy here, so the run never leaks into
        # the patcher's own options.
        guider = executor.class_obj
        options = guider.model_options.setdefault("transformer_options", {})
        check_no_competing_sparse_attention(getattr(guider, "model_patcher", None), options)
        _chain_above_later_backend(options, holder.key)
        run = holder.start_run(_sampling_call(guider, args, kwargs))
        run.clock, args, kwargs = clock_outer_sample(args, kwargs)
        options[run_key] = run
        succeeded = False
        try:
            result = executor(*args, **kwargs)
            run.finish()
            succeeded = True
            return result
        finally:
            options.pop(run_key, None)
            run.release()
            holder.end_run(succeeded)

    return chorus_outer_sample


def _sampling_call(guider, args: tuple, kwargs: dict) -> SamplingCall:
    """``outer_sample(noise, latent_image, sampler, sigmas, ...)``'s arguments and the guider's model."""
    bound = dict(zip(("noise", "latent_image", "sampler", "sigmas"), args), **kwargs)
    return SamplingCall(getattr(guider, "model_patcher", None), bound.get("latent_image"), bound.get("sampler"),
                        bound.get("sigmas"))


def _chain_above_later_backend(options: dict, key: str) -> None:
    """A Model Attention Backend applied after Chorus replaced its override: put ours back on top.

    Its override only picks the dense function; chained below ours it still runs every call
    Chorus leaves dense, which is what the same two nodes in the other order do.
    """
    top = options.get(OVERRIDE_KEY)
    walk = top
    while walk is not None:
        if getattr(walk, "chorus_key", None) == key:
            return  # ours is in the chain
        walk = getattr(walk, "chorus_previous", None)
    if is_attention_backend_override(top):
        logging.info("Chorus: %s was applied after Chorus; Chorus runs above it and uses it for dense calls",
                     ATTENTION_BACKEND_NODE)
        options[OVERRIDE_KEY] = _make_attention_override(key, top)


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def install_sparse_attention(model_patcher, provider, key: str = "chorus", dense_attention: str = "auto"):
    """Return a clone of ``model_patcher`` whose Wan self-attention runs block-sparse.

    :param model_patcher: a ComfyUI ModelPatcher of a Wan 2.1 I2V/T2V model; never modified.
    :param provider: a MaskProvider (the block map per layer, step, batch chunks, for every run),
        or a RunSource that chooses each sampling run's provider.
    :param key: namespace of the wrapper, attachment and transformer_options entries; installing
        again with the same key replaces the earlier install instead of stacking on it.
    :param dense_attention: what the self-attention left dense (warm-up steps, dense layers) runs
        on: "auto" = FlashAttention-4's dense forward where it applies, else ComfyUI's function;
        "comfyui" = always ComfyUI's function. Speed only: results agree to bf16 rounding.
    :raises UnsupportedModelError: for any model other than Wan 2.1 I2V/T2V.
    :raises CompetingAttentionError: when core's Model Sparse Attention patches the model too.
    """
    check_supported_model(model_patcher)
    check_no_competing_sparse_attention(model_patcher, model_patcher.model_options.get("transformer_options", {}))
    _check_provider(provider)
    if dense_attention not in DENSE_ATTENTION_MODES:
        raise ValueError(f"dense_attention must be one of {', '.join(DENSE_ATTENTION_MODES)}, got {dense_attention!r}")
    _require_kernels()
    patched = model_patcher.clone()
    holder = SparseAttentionState(provider, key, dense_attention)

    existing_blocks = patched.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    for index in range(len(patched.model.diffusion_model.blocks)):
        previous = unwrap_own(existing_blocks.get(("double_block", index)), key)
        patched.set_model_patch_replace(_make_block_patch(key, index, previous), "dit", "double_block", index)

    options = patched.model_options["transformer_options"]
    options[OVERRIDE_KEY] = _make_attention_override(key, unwrap_own(options.get(OVERRIDE_KEY), key))

    patched.remove_wrappers_with_key(OUTER_SAMPLE, key)
    patched.add_wrapper_with_key(OUTER_SAMPLE, key, _make_outer_sample_wrapper(holder))
    patched.remove_wrappers_with_key(DIFFUSION_MODEL, key)
    patched.add_wrapper_with_key(DIFFUSION_MODEL, key, _make_video_tokens_wrapper(key))
    patched.remove_wrappers_with_key(APPLY_MODEL, key)
    patched.add_wrapper_with_key(APPLY_MODEL, key, _make_apply_model_wrapper(key))
    patched.set_attachments(key, holder)
    return patched


def _require_kernels() -> None:
    """Fail at the node, with what to do, rather than in the middle of sampling."""
    try:
        block_sparse()
    except ImportError as error:
        raise RuntimeError(
            f"Chorus could not import its block-sparse kernels ({error}); reinstall the Chorus pack "
            f"so that its kernels/ folder sits next to chorus_core/"
        ) from error


def _check_provider(provider) -> None:
    if not isinstance(provider, RunSource) and not callable(getattr(provider, "block_map", None)):
        raise TypeError(f"{type(provider).__name__} is not a MaskProvider: it has no block_map(...) method")
    block_size = getattr(provider, "block_size", None)
    if not (isinstance(block_size, (tuple, list)) and len(block_size) == 2
            and all(isinstance(b, int) and b > 0 for b in block_size)):
        raise TypeError(f"{type(provider).__name__}.block_size must be (block_q, block_k), got {block_size!r}")


def get_sparse_state(model_patcher, key: str = "chorus") -> Optional[SparseAttentionState]:
    """The holder attached by ``install_sparse_attention`` (None if not installed)."""
    holder = model_patcher.get_attachment(key)
    return holder if isinstance(holder, SparseAttentionState) else None


def get_run_stats(model_patcher, key: str = "chorus") -> Optional[RunStats]:
    """Statistics of the current or last sampling run of the patched model (None before any)."""
    holder = get_sparse_state(model_patcher, key)
    return None if holder is None else holder.stats
