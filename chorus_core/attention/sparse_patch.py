"""Block-sparse self-attention for Wan 2.1 in ComfyUI, installed on a clone of a ModelPatcher.

How it hooks in (never by copying ``forward_orig``, never by module-level monkeypatching):

* ``("double_block", i)`` patches put the block index and the block's token count into the
  ``transformer_options`` handed down to block ``i`` (chained to a block patch already there);
* ``transformer_options["optimized_attention_override"]`` runs a block's self-attention
  block-sparse with the provider's mask; everything else (cross-attention, layers the provider
  leaves dense) goes to the override that was there before, or to what ComfyUI would run without
  Chorus: the function the layer declares (newer ComfyUI's per-layer ``comfy_attention``, which
  wrap_attn drops before calling an override), else ComfyUI's own function. FlashAttention-4 or
  cuDNN-first SDPA (``dense_attention="auto"``) takes dense calls only from ComfyUI's default
  functions, never from a backend the user chose (Model Attention Backend, ``--use-sage-attention``, a layer's);
* a keyed ``DIFFUSION_MODEL`` wrapper counts the video tokens of each model call, so a block
  whose sequence carries extra tokens (a reference latent at the start, extra frames or context
  latents at the end) is recognised; its self-attention runs dense with one warning, since the
  masks cover the video tokens only;
* a keyed ``APPLY_MODEL`` wrapper, outside the diffusion model (and so outside what ComfyUI's
  TorchCompileModel compiles), steps the run and, when the masks of this model call are known
  before it runs (a bank hit, the prior, static maps; not online prediction or recording, which
  look at q and k), puts every layer's mask in a ``CallPlan``: the override then reads only
  tensors and constants, so a compiled model keeps one graph; any other call's masks are made
  eager (``SparseRun.attend``: a compiled model never traces that bookkeeping);
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

import dataclasses
import functools
import logging
import math
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch

from .graph_keys import graph_kwarg
from .hooks import (AttentionCall, block_sparse, clock_outer_sample, container_function_of, is_container, mark_own,
                    unwrap_own)
from .mask_provider import MaskSource, RunSource, SamplingCall
from .model_checks import (ATTENTION_BACKEND_NODE, CompetingAttentionError, UnsupportedModelError,
                           check_no_competing_sparse_attention, check_supported_model, is_attention_backend_override)
from .run_keys import (APPLY_MODEL, DIFFUSION_MODEL, OUTER_SAMPLE, OVERRIDE_KEY, sparse_block_key, sparse_declared_key,
                       sparse_plan_key, sparse_run_key, sparse_video_key)
from .run_stats import LayerStats, RunStats, StepStats
from .sparse_run import (ATTENTION_PRECISIONS, DENSE_ATTENTION_MODES, BlockCall, CallPlan, SparseAttentionState,
                         SparseRun, declared_attention, video_token_count)

__all__ = [
    "UnsupportedModelError",
    "CompetingAttentionError",
    "LayerStats",
    "StepStats",
    "RunStats",
    "SparseAttentionState",
    "SparseRun",
    "install_sparse_attention",
    "CallPlan",
    "DENSE_ATTENTION_MODES",
    "ATTENTION_PRECISIONS",
    "check_supported_model",
    "get_sparse_state",
    "get_run_stats",
]

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
    # user's choice of dense attention: it keeps the dense calls, FA4 or cuDNN-first do not take them.
    fast_dense = not _foreign_override_in(previous)

    def sparse_answer(args, kwargs):
        """(block-sparse or fast dense output, or None; the parsed call or None; the function the
        layer declares for this call, or None)."""
        options = kwargs.get("transformer_options") or {}
        run, block = options.get(run_key), options.get(block_key)
        if run is None or block is None:
            return None, None, None
        call = AttentionCall.parse(args, kwargs)
        if call is None:
            return None, None, None
        claimed = block.claims(call)
        declared = block.declared_for_last_call()
        if not claimed:
            return None, call, declared
        plan = options.get(plan_key)
        if plan is not None:
            return _planned_answer(run, plan, block, call, fast_dense), call, declared
        if block.extra_tokens:
            run.dense_for_extra_tokens(block.layer, block)
            return None, call, declared
        return run.attend(block.layer, options, call, fast_dense), call, declared

    def chorus_attention_override(func, *args, **kwargs):
        out, call, declared = sparse_answer(args, kwargs)
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
            return previous(func, *args, **kwargs)  # an override wins over a layer's own choice, as in ComfyUI
        # newer wrap_attn drops the layer's preferred_attention before calling an override: run it here
        return (declared or func)(*args, **kwargs)

    previous_containers = container_function_of(previous)
    if previous_containers is not None:
        def chorus_attention_containers(*args, **kwargs):
            out, call, _ = sparse_answer(args, kwargs)
            if out is None:
                return previous_containers(*args, **kwargs)  # containers still unconsumed
            call.consume()
            return out

        chorus_attention_override.container_function = chorus_attention_containers
    return mark_own(chorus_attention_override, key, previous)


def _planned_answer(run, plan: CallPlan, block: BlockCall, call: AttentionCall, fast_dense: bool):
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
    args = (call.q, call.k, call.v, mask, call.heads)
    layouts = dict(skip_reshape=call.skip_reshape, skip_output_reshape=call.skip_output_reshape)
    if torch.compiler.is_compiling():
        return plan.sparse(*args, **layouts)  # a failure raises out of the graph: the APPLY_MODEL wrapper handles it
    if run.disabled:  # an earlier layer of this call failed
        plan.answered[-1] = (layer, False)
        return None
    try:
        # the run's function, not the plan's: an FP8 failure earlier in this call made it the 16-bit one
        return run.sparse_attention()(*args, **layouts)
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
    declared_key = sparse_declared_key(key)

    def chorus_block_patch(args, extra):
        options = args.get("transformer_options")
        if options is not None and run_key in options:
            layer = options.get("block_index", index)  # newer ComfyUI sets it; trust it first
            block = BlockCall(layer, args["img"].shape[1], _video_tokens(options, video_key))
            declared = options.get(declared_key)
            if declared is not None and 0 <= layer < len(declared):
                block.declared = declared[layer]
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
            options[video_key] = video_token_count(x, executor.class_obj)
        return executor(x, *args, **kwargs)

    return chorus_video_tokens


def _make_apply_model_wrapper(key: str) -> Callable:
    """APPLY_MODEL wrapper: steps the run and plans the model call, outside the diffusion model.

    ComfyUI's TorchCompileModel compiles the diffusion model only, so this runs eager in every
    mode. Under compile a kernel failure cannot fall back inside the graph: it raises out of
    the model call, and the call runs again (one warning): with ComfyUI's attention for the dense
    calls when the fast dense kernel failed (:func:`fast_dense_failed`), else with the rest of the
    run dense; so does an error torch.compile raises while it traces the planned call
    (:func:`planned_path_failed`).
    """
    run_key, plan_key, declared_key = sparse_run_key(key), sparse_plan_key(key), sparse_declared_key(key)

    def chorus_plan_model_call(executor, x, t, *args, **kwargs):
        options = kwargs.get("transformer_options", args[3] if len(args) > 3 else None)
        run = options.get(run_key) if isinstance(options, dict) else None
        if run is None or run.dense_under_multigpu(options):
            return executor(x, t, *args, **kwargs)
        declared = declared_attention(getattr(executor.class_obj, "diffusion_model", None))
        if declared is not None:
            options[declared_key] = declared
            if any(own is not None for own, _ in declared) and run.dense_attention != "comfyui":
                run.leave_dense_to(f"the attention the model's layers declare ({_declared_name(declared)})")
        plan = run.plan_call(options, x, executor.class_obj)  # also steps the run clock
        if plan is None:
            if run.observing():
                return _call_uncompiled(executor, x, t, *args, **kwargs)
            return executor(x, t, *args, **kwargs)
        return _run_planned(run, plan, (options, plan_key, declared), executor, x, t, *args, **kwargs)

    return chorus_plan_model_call


def _run_planned(run, plan: CallPlan, where: tuple, executor, x, t, *args, **kwargs):
    """The model call under ``plan``. Under compile a kernel failure raises out of the graph: when
    the fast dense kernel failed, the call runs again with ComfyUI's attention for the dense calls
    and its sparse calls still sparse; any other failure of the planned path runs it again without
    the plan (the rest of the run dense, or 16-bit after an FP8 failure). ``where``: the call's
    transformer_options, the key the plan goes under there, the layers' declared attention."""
    options, plan_key, declared = where
    options[plan_key] = plan
    retry = None
    try:  # the extra keyword gives this plan its own compiled graph (see graph_keys)
        out = executor(x, t, *args, **kwargs, **{graph_kwarg(plan, options, declared): True})
    except Exception as exc:
        options.pop(plan_key, None)
        if not planned_path_failed(exc):
            raise
        if plan.dense is not None and fast_dense_failed(exc):
            run.fast_dense_failed(exc)  # the run's later plans get no fast dense kernel either
            # a fresh plan: a compiled graph replays plan.answered only when it completes
            retry = dataclasses.replace(plan, dense=None, answered=[], extra_tokens=[])
        else:
            run.fail_planned(None, exc)
    else:
        options.pop(plan_key, None)
        run.record_plan(plan)
        return out
    # called again outside the handler: the failed call's traceback (and the GPU buffers its
    # frames hold) is freed first, and the new call's errors are not chained to the old one
    if retry is not None:
        return _run_planned(run, retry, where, executor, x, t, *args, **kwargs)
    return executor(x, t, *args, **kwargs)


def _declared_name(declared: tuple) -> str:
    names = sorted({getattr(f, "__name__", repr(f)) for pair in declared for f in pair if f is not None})
    return ", ".join(names)


def _call_uncompiled(executor, *args, **kwargs):
    """Run this model call on the model's uncompiled modules, and only this call.

    Masks decided per call (online prediction, recording) need host work in every layer: traced,
    each such call breaks the graph and the pieces recompile per layer, per step count and per
    request (H200: 17 graphs and a 40 s first step), so such a model call runs eager and planned
    calls keep the compiled graph. Not by ``torch.compiler.set_stance("force_eager")``: the stance
    is process-global, so every other thread's compiled code would run eager meanwhile. An
    innermost APPLY_MODEL wrapper (after TorchCompileModel's, whichever order they were added in)
    swaps each compiled module for its original for the call. Inside code being traced (a caller
    compiled more than the model) nothing can be swapped: the call runs as it comes.
    """
    if torch.compiler.is_compiling():
        return executor(*args, **kwargs)
    chain = type(executor).new_class_executor(executor.original, executor.class_obj,
                                              [*executor.wrappers, _uncompiled_modules], executor.idx)
    return chain(*args, **kwargs)


def _uncompiled_modules(executor, *args, **kwargs):
    """APPLY_MODEL wrapper, innermost: the model's compiled modules are their originals for this call."""
    from torch._dynamo.eval_frame import OptimizedModule  # what torch.compile(module) returns

    swapped = [(parent, name, child) for parent in executor.class_obj.modules()
               for name, child in parent.named_children() if isinstance(child, OptimizedModule)]
    for parent, name, child in swapped:
        setattr(parent, name, child._orig_mod)
    try:
        return executor(*args, **kwargs)
    finally:
        for parent, name, child in reversed(swapped):
            setattr(parent, name, child)


_KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"
_DENSE_ATTENTION_FILE = _KERNELS_DIR / "dense_attention.py"


def fast_dense_failed(exc: BaseException) -> bool:
    """Whether the fast dense kernel (``kernels/dense_attention.py``: FA4's dense forward or
    cuDNN-first SDPA) raised ``exc`` or an exception it was raised from."""
    return any(_raised_in(link, _DENSE_ATTENTION_FILE) for link in _exception_chain(exc))


def planned_path_failed(exc: BaseException) -> bool:
    """Whether the planned sparse call itself failed, judged by what failed: an error raised in
    Chorus's kernels, or by torch.compile while it traced or compiled the planned override (then
    no frame of kernels/ need be on the traceback). Anything else is another node's error."""
    return _raised_in_kernels(exc) or raised_by_compiler(exc)


_COMPILER_MODULES = ("torch._dynamo", "torch._inductor")


def raised_by_compiler(exc: BaseException) -> bool:
    """Whether ``exc`` or an exception it was raised from is one of torch.compile's own."""
    return any(type(link).__module__.startswith(_COMPILER_MODULES) for link in _exception_chain(exc))


def _exception_chain(exc: Optional[BaseException]):
    """``exc`` and the exceptions it was raised from or during, innermost last."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _raised_in_kernels(exc: BaseException) -> bool:
    """True when the exception came out of Chorus's kernels (FA4, Triton, the reference)."""
    return _raised_in(exc, _KERNELS_DIR)


def _raised_in(exc: BaseException, place: Path) -> bool:
    """True when a frame of ``exc``'s traceback ran code in ``place`` (a folder or a file)."""
    return any(_is_in(frame.f_code.co_filename, place) for frame, _ in traceback.walk_tb(exc.__traceback__))


@functools.lru_cache(maxsize=512)
def _is_in(co_filename: str, place: Path) -> bool:
    # co_filename is the path as imported: resolve it too, or a symlinked custom_nodes folder
    # (or a Docker mount) never matches and the compiled fallback is lost
    # (generated code has names like "<string>": not a file, never resolved against the cwd)
    return not co_filename.startswith("<") and Path(co_filename).resolve().is_relative_to(place)


def _make_outer_sample_wrapper(holder: SparseAttentionState) -> Callable:
    run_key = sparse_run_key(holder.key)

    def chorus_outer_sample(executor, *args, **kwargs):
        # The guider's model_options are a per-sample copy here, so the run never leaks into
        # the patcher's own options.
        guider = executor.class_obj
        options = guider.model_options.setdefault("transformer_options", {})
        check_no_competing_sparse_attention(getattr(guider, "model_patcher", None), options)
        _chain_above_later_backend(options, holder.key)
        run, succeeded = None, False
        try:  # whatever the run source started (a prefetch worker) is released, however this ends
            run = holder.start_run(_sampling_call(guider, args, kwargs))
            chosen = _chosen_dense_attention(options, holder.key)
            if chosen is not None:
                run.leave_dense_to(chosen)
            run.clock, args, kwargs = clock_outer_sample(args, kwargs)
            options[run_key] = run
            result = executor(*args, **kwargs)
            run.end_sampling()
            succeeded = True
            return result
        finally:
            options.pop(run_key, None)
            if run is not None:
                run.release()
            holder.end_run(succeeded)

    return chorus_outer_sample


def _sampling_call(guider, args: tuple, kwargs: dict) -> SamplingCall:
    """``outer_sample(noise, latent_image, sampler, sigmas, ...)``'s arguments and the guider's model."""
    bound = dict(zip(("noise", "latent_image", "sampler", "sigmas"), args), **kwargs)
    return SamplingCall(getattr(guider, "model_patcher", None), bound.get("latent_image"), bound.get("sampler"),
                        bound.get("sigmas"))


# ComfyUI's own attention functions, picked by device rather than by the user: FlashAttention-4
# or cuDNN-first SDPA may take the dense calls from them (dense_attention="auto"). Each maps to the
# start-up flag (an attribute of comfy.cli_args.args) that makes it the user's choice instead:
# split and sub-quadratic attention are ComfyUI's picks on devices without SDPA, but the user's own
# when started with their flag. Any other function ComfyUI dispatches to was chosen at start-up
# and keeps the dense calls, as a Model Attention Backend node does.
_COMFYUI_DEFAULT_ATTENTION = {
    "attention_pytorch": None,
    "attention_basic": None,
    "attention_sub_quad": "use_quad_cross_attention",
    "attention_split": "use_split_cross_attention",
}
_STARTUP_ATTENTION = {
    "attention_sage": "SageAttention (--use-sage-attention)",
    "attention3_sage": "SageAttention 3",
    "attention_flash": "FlashAttention (--use-flash-attention)",
    "attention_xformers": "xformers attention",
    "attention_comfy_kitchen_int8": "comfy-kitchen INT8 attention (--use-ck-attention)",
}


def _chosen_dense_attention(options: dict, key: str) -> Optional[str]:
    """The dense attention the user chose for this run, named, or None (ComfyUI's default).

    Chosen: an override below ours that is not Chorus's (Model Attention Backend, another
    pack's), or the function ComfyUI was started with (its ``optimized_attention``, which every
    model imports: SageAttention, comfy-kitchen INT8, FlashAttention, xformers).
    """
    walk = options.get(OVERRIDE_KEY)
    while walk is not None and getattr(walk, "chorus_key", None) != key:
        walk = getattr(walk, "chorus_previous", None)
    below = getattr(walk, "chorus_previous", None)
    while below is not None:
        if getattr(below, "chorus_key", None) is None:
            return ATTENTION_BACKEND_NODE if is_attention_backend_override(below) else \
                "the attention override of another node"
        below = getattr(below, "chorus_previous", None)
    try:
        import comfy.ldm.modules.attention as attention
    except ImportError:
        return None
    name = getattr(getattr(attention, "optimized_attention", None), "__name__", None)
    if name is None:
        return None
    if name not in _COMFYUI_DEFAULT_ATTENTION:
        return _STARTUP_ATTENTION.get(name, f"ComfyUI's attention function {name}")
    flag = _COMFYUI_DEFAULT_ATTENTION[name]
    return f"ComfyUI's {name} (--{flag.replace('_', '-')})" if flag and _started_with(flag) else None


def _started_with(flag: str) -> bool:
    """Whether ComfyUI was started with this flag (an attribute of its parsed arguments)."""
    try:
        from comfy.cli_args import args
    except ImportError:
        return False
    return bool(getattr(args, flag, False))


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


def install_sparse_attention(model_patcher, provider, key: str = "chorus", dense_attention: str = "auto",
                             attention_precision: str = "bf16"):
    """Return a clone of ``model_patcher`` whose Wan self-attention runs block-sparse.

    :param model_patcher: a ComfyUI ModelPatcher of a Wan 2.1 I2V/T2V model; never modified.
    :param provider: a MaskSource (KnownMasks or ObservedMasks: the masks of every run), or a
        RunSource that chooses each sampling run's source.
    :param key: namespace of the wrapper, attachment and transformer_options entries; installing
        again with the same key replaces the earlier install instead of stacking on it.
    :param dense_attention: what the self-attention left dense (warm-up steps, dense layers) runs
        on: "auto" = FlashAttention-4's dense forward where it applies, else torch SDPA with cuDNN
        first on sm_90, else ComfyUI's function;
        "comfyui" = always ComfyUI's function. Speed only: results agree to bf16 rounding.
    :param attention_precision: what the block-sparse calls compute in (``ATTENTION_PRECISIONS``):
        "bf16", or "fp8" (int8 QK^T, e4m3 PV; falls back to bf16, saying why, where FP8 cannot run).
    :raises UnsupportedModelError: for any model other than Wan 2.1 I2V/T2V.
    :raises CompetingAttentionError: when core's Model Sparse Attention patches the model too.
    """
    check_supported_model(model_patcher)
    check_no_competing_sparse_attention(model_patcher, model_patcher.model_options.get("transformer_options", {}))
    _check_provider(provider)
    if dense_attention not in DENSE_ATTENTION_MODES:
        raise ValueError(f"dense_attention must be one of {', '.join(DENSE_ATTENTION_MODES)}, got {dense_attention!r}")
    if attention_precision not in ATTENTION_PRECISIONS:
        raise ValueError(f"attention_precision must be one of {', '.join(ATTENTION_PRECISIONS)}, "
                         f"got {attention_precision!r}")
    _require_kernels()
    patched = model_patcher.clone()
    holder = SparseAttentionState(provider, key, dense_attention, attention_precision)

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
    if not isinstance(provider, (MaskSource, RunSource)):
        raise TypeError(f"{type(provider).__name__} is not a Chorus mask source: derive it from "
                        "chorus_core.attention.mask_provider.KnownMasks (masks decided before the model runs) or ObservedMasks "
                        "(masks made from each call's q and k)")
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
