"""Feature reuse: redundant regions of a Wan 2.1 video computed at reduced token resolution.

Cells of ``cell = (ct, ch, cw)`` video tokens (default 1 x 2 x 2) that a region map selects are
mean-pooled into one token each before a Wan block runs; the block runs on the shorter
sequence (self-attention, cross-attention and FFN all see ``N' < N`` tokens); its *update*
(block output minus block input) of a pooled token is brought back to the cell's tokens while
the residual stream itself stays at full resolution::

    x [B, N, C] --pool--> x' [B, N', C] --block--> y' ;  y = x + restore(y' - x')

How it hooks in (never by copying ``forward_orig``, never by module-level monkeypatching):

* ``("double_block", i)`` patches reduce the tokens and the RoPE table (``pe``) and restore the
  output; chained to a block patch already in the slot, and usable under a later one;
* ``transformer_options["optimized_attention_override"]`` runs the reduced self-attention:
  block-sparse when Chorus's sparse attention (``sparse_patch``) is installed and its mask
  source has a map for this layer and step (see "Mask sources" below), else dense, where
  pooled keys weigh as much as the ``s`` tokens behind them (ToMe's proportional attention,
  ``softmax(q.k + log s)``), computed exactly without a float mask: each pooled key and value
  is repeated ``s`` times (``TokenLayout.expand_keys``), so SDPA keeps its fast kernels;
* a keyed ``OUTER_SAMPLE`` wrapper holds the per-run state, dropped in ``finally``.

Mask sources. The sparse patch's provider serves the reduced calls too, once per step bucket:
it is shown the reduced q and k (``observe``) and asked for its map. A source that predicts
from what it observes (online prediction) answers over the ``N'`` reduced tokens it was shown,
used as it is; a source of stored maps (a bank hit, the population prior, static maps)
answers over the full-resolution tokens, carried over with ``TokenLayout.map_block_map``. Reduced
calls never reach a recorder: steps that record stay at full resolution (so the bank only
stores masks of the full layout; a recording miss records every step, so none is reduced), and
on steps that do not record the recording wrapper's inner provider serves. Any error on that path (the mask source, the mapping, mask conversion or
validation, the kernel) makes the rest of the run's reduced calls dense, with one warning in
``FeatureReuseStats.warnings``; the generation never fails because of it. Sparse reduced
calls carry no size bias: the block-sparse kernel has no per-key bias.

Mask consistency. The reduced sequence keeps the (t, h, w) raster order (a pooled token sits
where its cell's first token was), so each reduced block overlaps few full-resolution blocks.
A reduced query block attends to a reduced key block iff some full-resolution query block
behind it attends to some full-resolution key block behind the other one (an OR over the
blocks each reduced block draws tokens from): a superset of the original map, so no key a
full-resolution query attended to is dropped. Reduced calls are taken out of the sparse
patch's hands (its per-run entries are removed from the ``transformer_options`` handed down)
and counted in its statistics here, so both install orders behave the same.

This module is the runtime patch (settings, per-run state, the hooks, install). The pooling,
RoPE and block-map bookkeeping is ``token_layout.TokenLayout``; picking the regions, their
preview and the seam and FLOPs measures are ``feature_regions``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .feature_regions import cell_grid, region_map_image, select_regions, token_grid
from ..attention.mask_provider import match_batch
from ..attention.hooks import (AttentionCall, StepClock, block_sparse, mark_own, sample_with_run, sigma_window,
                    steps_in_sigma_window, unwrap_own)
from ..attention.mask_sources import RecordingProvider
from ..attention.run_keys import (OUTER_SAMPLE, OVERRIDE_KEY, feature_reuse_call_key, feature_reuse_run_key, sparse_block_key,
                       sparse_run_key)
from .token_layout import TokenLayout

__all__ = [
    "FeatureReuseSettings",
    "FeatureReuseStats",
    "FeatureReuseState",
    "install_feature_reuse",
    "get_feature_reuse_state",
    "apply_feature_reuse",
]



# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FeatureReuseSettings:
    """Which cells, steps and layers run at reduced resolution, and how borders are handled.

    :param cell: (ct, ch, cw) tokens pooled into one; each 1, 2 or 4.
    :param start_percent: where the reduced window starts, as a fraction of the sigma schedule
        like ComfyUI's own nodes (``percent_to_sigma``): steps whose sigma is above
        ``percent_to_sigma(start_percent)`` run at full resolution (they set the layout of the video).
    :param end_percent: reduced while the step's sigma is above ``percent_to_sigma(end_percent)``.
    :param layers: block indices that run reduced; None = all but ``skip_first`` / ``skip_last``.
    :param skip_first: with ``layers=None``, the first blocks that stay at full resolution.
    :param skip_last: with ``layers=None``, the last blocks that stay at full resolution.
    :param rim: cells at each region's border kept at full resolution (erosion, spatial).
    :param blend: tent-filter upsampling of pooled updates instead of nearest.
    :param size_bias: pooled keys weigh ``cell size`` keys in dense reduced calls (``log(cell size)``
        logit bias, computed exactly by repeating them; see ``TokenLayout.expand_keys``).
    :param sparse_key: the key Chorus's sparse attention was installed with.
    """

    cell: tuple = (1, 2, 2)
    start_percent: float = 0.3
    end_percent: float = 1.0
    layers: Optional[tuple] = None
    skip_first: int = 1
    skip_last: int = 1
    rim: int = 1
    blend: bool = True
    size_bias: bool = True
    sparse_key: str = "chorus"

    def __post_init__(self):
        if len(self.cell) != 3 or any(c not in (1, 2, 4) for c in self.cell):
            raise ValueError(f"cell must be three of 1, 2 or 4 tokens (t, h, w), got {self.cell!r}")
        if math.prod(self.cell) < 2:
            raise ValueError("cell (1, 1, 1) pools nothing; use (1, 2, 2) or larger")
        if not 0.0 <= self.start_percent <= self.end_percent <= 1.0:
            raise ValueError(f"need 0 <= start_percent <= end_percent <= 1, got {self.start_percent}, {self.end_percent}")
        if self.rim < 0:
            raise ValueError(f"rim must be >= 0 cells, got {self.rim}")

    def runs_layer(self, layer: int, num_layers: int) -> bool:
        if self.layers is not None:
            return layer in self.layers
        return self.skip_first <= layer < num_layers - self.skip_last

    def reduced_steps(self, model_sampling, schedule: list) -> list:
        """Per step of the host ``schedule`` (sample_sigmas): does it run reduced?"""
        return steps_in_sigma_window(schedule, *sigma_window(model_sampling, self.start_percent, self.end_percent))

# --------------------------------------------------------------------------------------------
# Statistics and state
# --------------------------------------------------------------------------------------------


@dataclass
class FeatureReuseStats:
    """One sampling run: block calls run reduced / at full resolution, and the tokens they ran."""

    reduced_calls: int = 0
    full_calls: int = 0
    tokens_full: int = 0      # N of a full-resolution call
    tokens_reduced: int = 0   # N' of a reduced call
    sparse_reduced_calls: int = 0
    skipped_reason: str = ""  # why nothing ran reduced, when so
    warnings: list = field(default_factory=list)  # why reduced calls fell back to dense

    def as_dict(self) -> dict:
        return {**self.__dict__, "warnings": list(self.warnings)}


class FeatureReuseState:
    """Attached to the patched clone: settings, the region map, the last run's statistics."""

    def __init__(self, region_map: torch.Tensor, grid: Sequence[int], settings: FeatureReuseSettings, key: str):
        self.region_map = region_map.bool().cpu()
        self.grid = tuple(grid)
        self.settings = settings
        self.key = key
        self.layout = TokenLayout(self.region_map, self.grid, settings.cell)
        self.stats: Optional[FeatureReuseStats] = None

    def start_run(self, num_layers: int) -> "_Run":
        run = _Run(self, num_layers)
        self.stats = run.stats
        return run


class _Run:
    """Per-run state: the step, which calls run reduced, statistics."""

    def __init__(self, state: FeatureReuseState, num_layers: int):
        self.state, self.num_layers = state, num_layers
        self.stats = FeatureReuseStats(tokens_full=state.layout.n_full, tokens_reduced=state.layout.n_reduced)
        self.clock: Optional[StepClock] = None
        self._reduced_steps: list = []
        self._masks: dict = {}
        self._bucket: Any = object()
        self._sparse_failed = False  # set by the first failing sparse reduced call

    def start(self, clock: StepClock, model_sampling) -> None:
        """Called by the OUTER_SAMPLE wrapper: this run's steps and which of them run reduced."""
        self.clock = clock
        self._reduced_steps = self.state.settings.reduced_steps(model_sampling, clock.schedule)

    def step_of(self, options: dict) -> Optional[int]:
        sigmas = options.get("sigmas")
        if sigmas is None or self.clock is None or options.get("sample_sigmas") is None:
            return None
        return self.clock.step_of(sigmas)

    def runs_step(self, step: int) -> bool:
        return 0 <= step < len(self._reduced_steps) and self._reduced_steps[step]

    def layout_for(self, layer: int, args: dict, options: dict) -> Optional[TokenLayout]:
        """The layout when this block call runs reduced, else None."""
        settings, layout = self.state.settings, self.state.layout
        step = self.step_of(options)
        if step is None or not self.runs_step(step) or not settings.runs_layer(layer, self.num_layers):
            return None
        if layout.n_pooled_cells == 0:
            self.stats.skipped_reason = "the region map selects no cell"
            return None
        x, pe, vec = args["img"], args.get("pe"), args.get("vec")
        if x.shape[1] != layout.n_full:
            self.stats.skipped_reason = (f"the model runs {x.shape[1]} tokens, the region map was made for "
                                         f"{layout.n_full} (grid {layout.grid}); connect the LATENT that is sampled")
            return None
        if pe is None or pe.dim() != 6 or pe.shape[1] != layout.n_full:
            self.stats.skipped_reason = "unexpected RoPE table"
            return None
        if vec is not None and vec.dim() == 4 and vec.shape[1] != 1:
            self.stats.skipped_reason = "per-token timestep modulation (not Wan 2.1) is not supported"
            return None
        return layout

    # ---- sparse reduced calls

    def attend_sparse(self, reduced: "_ReducedCall", call: AttentionCall) -> Optional[torch.Tensor]:
        """Block-sparse reduced self-attention, or None when this call runs dense.

        Counted in the sparse run's statistics either way. Any exception (mask source, mapping,
        conversion, validation, kernel) turns this and every later reduced call of the run dense.
        """
        sparse_run, layer = reduced.sparse_run, reduced.layer
        out, density = None, None
        if self._sparse_usable(sparse_run, call):
            try:
                mask = self.sparse_mask(sparse_run, layer, reduced.options, call, reduced.layout)
                if mask is not None:
                    out = sparse_run.sparse_attention()(  # the run's attention_precision
                        call.q, call.k, call.v, mask, call.heads, skip_reshape=call.skip_reshape,
                        skip_output_reshape=call.skip_output_reshape)
                    density = mask.density
            except Exception as exc:  # sparse attention must cost speed, never the generation
                self._fail(layer, sparse_run.step_of(reduced.options), exc)
                out, density = None, None
        sparse_run.record(layer, density)
        if out is not None:
            self.stats.sparse_reduced_calls += 1
            sparse_run.note_last_backend()
        return out

    def _sparse_usable(self, sparse_run, call: AttentionCall) -> bool:
        """False once a reduced call failed, once the sparse run went dense (it says why), or on
        a GPU without a block-sparse kernel (the torch reference would be slower than dense attention)."""
        if self._sparse_failed or getattr(sparse_run, "disabled", False):
            return False
        return not call.q.is_cuda or block_sparse().gpu_kernel_available()

    def _fail(self, layer: int, step: Optional[int], exc: Exception) -> None:
        self._sparse_failed = True
        reason = (f"sparse attention failed on a reduced call at layer {layer}, step {step} "
                  f"({type(exc).__name__}: {exc}); the rest of this run's reduced calls are dense")
        self.stats.warnings.append(reason)
        logging.warning("Chorus feature reuse: %s", reason)

    def sparse_mask(self, sparse_run, layer, options, call, layout: TokenLayout):
        """The mask of this reduced call over the ``N'`` tokens, or None (dense); once per step bucket."""
        provider = getattr(sparse_run, "provider", None)
        step = sparse_run.step_of(options)
        if provider is None or step is None:
            return None
        bucket = provider.step_bucket(step)
        if bucket != self._bucket:
            self._masks.clear()
            self._bucket = bucket
        cond_or_uncond = tuple(options.get("cond_or_uncond") or [0])
        key = (layer, cond_or_uncond, call.batch, call.heads, str(call.q.device))
        if key not in self._masks:
            self._masks[key] = _reduced_mask(provider, layer, step, list(cond_or_uncond), call, layout)
        return self._masks[key]

    def release(self) -> None:
        self._masks.clear()


def _reduced_mask(provider, layer: int, step: int, cond_or_uncond: list, call: AttentionCall,
                  layout: TokenLayout):
    """Show the mask source this reduced call, ask for its map and convert it to a mask over ``N'`` tokens.

    The map's shape says what it covers. A source that predicts from what it observes (online
    prediction) answers over the reduced tokens it was just shown: used as it is. A source of
    stored maps (bank hit, population prior, static maps) answers over the full-resolution
    tokens: carried over with ``map_block_map``. When both shapes coincide (less than one block
    of tokens pooled) the map is carried over, which is exact for stored maps and still keeps
    every row live for a prediction. Recording wrappers are stepped over: a recorder never
    sees a reduced call.
    """
    serving = _without_recorders(provider)
    serving.observe(layer, step, cond_or_uncond, call.q, call.k, call.heads, call.skip_reshape)
    block_map = serving.block_map(layer, step, cond_or_uncond, call.heads, layout.n_full, call.q.device)
    if block_map is None:
        return None
    block_q, block_k = serving.block_size
    block_map = match_batch(block_map, len(cond_or_uncond), call.batch).to(call.q.device)
    full, reduced = ((call.heads, math.ceil(n / block_q), math.ceil(n / block_k)) for n in (layout.n_full, layout.n_reduced))
    shape = tuple(block_map.shape[1:]) if block_map.dim() == 4 else None
    if shape == full:
        block_map = layout.map_block_map(block_map.bool(), block_q, block_k)
    elif shape != reduced:
        raise ValueError(f"{type(_mask_source(serving)).__name__} returned a block map of shape "
                         f"{tuple(block_map.shape)} for layer {layer}; this call needs [*, {', '.join(map(str, full))}] "
                         f"over the {layout.n_full} full-resolution tokens or [*, {', '.join(map(str, reduced))}] "
                         f"over the {layout.n_reduced} reduced ones")
    return block_sparse().block_map_to_mask(block_map, block_q, block_k, layout.n_reduced)


def _wrapped(provider):
    """``provider`` and the providers it wraps (``.inner``), outermost first."""
    seen = 0
    while provider is not None and seen < 16:
        yield provider
        provider, seen = getattr(provider, "inner", None), seen + 1


def _mask_source(provider):
    """The innermost provider: the one that makes the maps (wrappers add warm-up, recording)."""
    *_, source = _wrapped(provider)
    return source


def _without_recorders(provider):
    """The provider below any recording wrappers on top of the stack (also one whose recorder has not
    started yet: a hit's, armed in case its entry fails, must not start on a reduced call)."""
    while isinstance(provider, RecordingProvider):
        provider = provider.inner
    return provider


def _recording_now(sparse_run, options) -> bool:
    """True when the sparse run records masks at this step: those steps stay at full resolution,
    so the bank only ever stores masks of the full token layout."""
    recorder = _recorder_of(getattr(sparse_run, "provider", None))
    if recorder is None:
        return False
    step = sparse_run.step_of(options)
    return step is not None and recorder.bucket(step) is not None


def _recorder_of(provider):
    return next((p.recorder for p in _wrapped(provider) if isinstance(p, RecordingProvider) and p.recorder is not None),
                None)


# --------------------------------------------------------------------------------------------
# The hooks
# --------------------------------------------------------------------------------------------

@dataclass
class _ReducedCall:
    """Handed down to a block that runs reduced: what its self-attention needs."""

    run: _Run
    layout: TokenLayout
    layer: int
    sparse_run: Any
    options: dict
    seen: bool = False

    def claims(self, call: AttentionCall) -> bool:
        """The block's first attention with q and k over all N' tokens is its self-attention."""
        if self.seen or not (call.seq_len == call.kv_len == self.layout.n_reduced):
            return False
        self.seen = True
        return call.mask is None


def _make_block_patch(key: str, index: int, previous: Optional[Callable], sparse_key: str) -> Callable:
    run_key, call_key = feature_reuse_run_key(key), feature_reuse_call_key(key)
    sparse_run_entry, sparse_block_entry = sparse_run_key(sparse_key), sparse_block_key(sparse_key)

    def call_next(args, extra):
        return previous(args, extra) if previous is not None else extra["original_block"](args)

    def chorus_feature_reuse_block_patch(args, extra):
        options = args.get("transformer_options")
        run = options.get(run_key) if options is not None else None
        if run is None:
            return call_next(args, extra)
        layer = options.get("block_index", index)
        sparse_run = options.get(sparse_run_entry)
        layout = None if _recording_now(sparse_run, options) else run.layout_for(layer, args, options)
        if layout is None:
            run.stats.full_calls += 1
            return call_next(args, extra)
        x = args["img"]
        x_reduced = layout.pool(x)
        # The sparse patch's per-run entries leave the options handed down: the reduced
        # self-attention is run (and counted in its statistics) by our override instead.
        down = {k: v for k, v in options.items() if k not in (sparse_run_entry, sparse_block_entry)}
        down["block_index"] = layer
        down[call_key] = _ReducedCall(run, layout, layer, options.get(sparse_run_entry), down)
        out = call_next({**args, "img": x_reduced, "pe": layout.pool_freqs(args["pe"]), "transformer_options": down},
                        extra)
        run.stats.reduced_calls += 1
        out = dict(out)
        out["img"] = layout.restore(x, x_reduced, out["img"], blend=run.state.settings.blend)
        return out

    return mark_own(chorus_feature_reuse_block_patch, key, previous)


def _make_attention_override(key: str, previous: Optional[Callable]) -> Callable:
    call_key = feature_reuse_call_key(key)

    def call_next(func, args, kwargs):
        return previous(func, *args, **kwargs) if previous is not None else func(*args, **kwargs)

    def chorus_feature_reuse_attention(func, *args, **kwargs):
        options = kwargs.get("transformer_options") or {}
        reduced = options.get(call_key)
        if reduced is None:
            return call_next(func, args, kwargs)
        call = AttentionCall.parse(args, kwargs)
        if call is None or not reduced.claims(call):
            return call_next(func, args, kwargs)
        run, layout = reduced.run, reduced.layout
        if reduced.sparse_run is not None:
            out = run.attend_sparse(reduced, call)
            if out is not None:
                return out
        if not run.state.settings.size_bias:
            return call_next(func, args, kwargs)
        # Dense with the size bias, exactly and with no float mask: pooled keys repeated.
        named = dict(call.named)
        q, heads = named.pop("q"), named.pop("heads")
        k, v = (layout.expand_keys(named.pop(n), call.skip_reshape) for n in ("k", "v"))
        return call_next(func, (q, k, v, heads), named)

    return mark_own(chorus_feature_reuse_attention, key, previous)


def _make_outer_sample_wrapper(holder: FeatureReuseState, num_layers: int) -> Callable:
    run_key = feature_reuse_run_key(holder.key)

    def chorus_feature_reuse_outer_sample(executor, *args, **kwargs):
        run = holder.start_run(num_layers)
        try:
            return sample_with_run(executor, args, kwargs, run_key, run)
        finally:
            run.release()
            if run.stats.reduced_calls == 0 and run.stats.skipped_reason:
                logging.warning("Chorus feature reuse ran nothing reduced: %s", run.stats.skipped_reason)

    return chorus_feature_reuse_outer_sample


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def install_feature_reuse(model_patcher, region_map: torch.Tensor, grid: Sequence[int],
                          settings: FeatureReuseSettings = FeatureReuseSettings(), key: str = "chorus_fr"):
    """Return a clone of ``model_patcher`` whose Wan blocks run the selected cells at reduced resolution.

    :param model_patcher: a ComfyUI ModelPatcher of a Wan 2.1 I2V/T2V model; never modified.
    :param region_map: bool ``[Tc, Hc, Wc]`` over ``cell_grid(grid, settings.cell)``; True = pooled.
    :param grid: (T, H, W) token grid of the latent that will be sampled (``token_grid``).
    :param settings: cells, steps, layers, border handling.
    :param key: namespace of the wrapper, attachment and options entries; installing again with
        the same key replaces the earlier install.
    :raises UnsupportedModelError: for any model other than Wan 2.1 I2V/T2V.
    """
    from ..attention.model_checks import check_supported_model

    check_supported_model(model_patcher)
    holder = FeatureReuseState(region_map, grid, settings, key)
    patched = model_patcher.clone()
    num_layers = len(patched.model.diffusion_model.blocks)
    existing = patched.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    for index in range(num_layers):
        previous = unwrap_own(existing.get(("double_block", index)), key)
        patched.set_model_patch_replace(_make_block_patch(key, index, previous, settings.sparse_key),
                                        "dit", "double_block", index)
    options = patched.model_options["transformer_options"]
    options[OVERRIDE_KEY] = _make_attention_override(key, unwrap_own(options.get(OVERRIDE_KEY), key))
    patched.remove_wrappers_with_key(OUTER_SAMPLE, key)
    patched.add_wrapper_with_key(OUTER_SAMPLE, key, _make_outer_sample_wrapper(holder, num_layers))
    patched.set_attachments(key, holder)
    return patched


def get_feature_reuse_state(model_patcher, key: str = "chorus_fr") -> Optional[FeatureReuseState]:
    """The holder attached by ``install_feature_reuse`` (None if not installed)."""
    holder = model_patcher.get_attachment(key)
    return holder if isinstance(holder, FeatureReuseState) else None


# --------------------------------------------------------------------------------------------
# One call for the node
# --------------------------------------------------------------------------------------------


def apply_feature_reuse(model_patcher, latent_samples: torch.Tensor, start_frame: Optional[torch.Tensor],
                        strength: float, settings: FeatureReuseSettings = FeatureReuseSettings(),
                        margin: int = 1, key: str = "chorus_fr"):
    """Region map from the start frame, then the patched clone; returns ``(patched, region_map, image)``.

    ``strength`` 0 returns the model unchanged (same object) and an empty map.
    :raises ValueError: when the latent is not a video latent or there is no start frame.
    """
    if latent_samples.ndim != 5:
        raise ValueError(f"Chorus feature reuse needs a video latent [B, 16, T, H, W]; got {tuple(latent_samples.shape)}. "
                         "Connect the latent from WanImageToVideo.")
    grid = token_grid(latent_samples.shape)
    if strength > 0 and start_frame is None:
        raise ValueError("Chorus feature reuse picks regions from the start frame: connect positive from "
                         "WanImageToVideo (it carries the start image) or a start_latent")
    if strength <= 0:
        region_map = torch.zeros(cell_grid(grid, settings.cell), dtype=torch.bool)
        return model_patcher, region_map, region_map_image(region_map, grid, settings.cell, start_frame)
    region_map = select_regions(start_frame, grid, strength, settings.cell, margin=margin, rim=settings.rim)
    patched = install_feature_reuse(model_patcher, region_map, grid, settings, key=key)
    return patched, region_map, region_map_image(region_map, grid, settings.cell, start_frame)
