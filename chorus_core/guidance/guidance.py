"""Guidance enhancement after mask reuse: reinforce the image/text conditioning in chosen steps.

Reused block-sparse masks drop a little attention mass in every self-attention, and what a
request is *about* (its first frame, its template's motion) is what drifts first. Two
training-free ways to push the prediction back toward the conditioning, both installed on a
clone of a ComfyUI ModelPatcher (never on the model passed in):

* ``cfg_boost`` (post-CFG hook, ``sampler_post_cfg_function``, a list, so it composes with
  other packs): in the window's steps the guidance term is scaled by ``1 + strength``::

      out = denoised + strength * cond_scale * (cond_denoised - uncond_denoised)

  i.e. ``uncond + cond_scale * (1 + strength) * (cond - uncond)`` when nothing else changed the
  CFG result. Needs an uncond pass: at cfg 1 ComfyUI skips it, and this method does nothing
  (logged once per run). No extra model pass.
* ``cross_attention`` (attention override, chained to the override already there, e.g. the
  Chorus sparse patch): in the window's steps every cross-attention output (calls whose key
  length differs from the query length: Wan I2V's 257 CLIP-image tokens and its text tokens) is
  multiplied by ``1 + strength`` before the block's output projection. Works at any cfg.

Default: ``cross_attention`` at strength 0.1 (tests/benchmarks/results/guidance_testbed.md: on the
testbed it recovered most of the content correlation lost to reuse, and ``cfg_boost`` made every
measure worse there; that testbed never trained an unconditional branch, so CFG changes act on an
out-of-distribution uncond prediction).

The step window ``[start, end)`` is given as fractions of the sigma schedule, as in ComfyUI's own
nodes: ``percent_to_sigma(start)`` and ``percent_to_sigma(end)`` of the model's sampling, and step
``i`` is in the window when ``percent_to_sigma(end) < sigma_i <= percent_to_sigma(start)``
(hooks.steps_in_sigma_window); a step's every model evaluation is in or out with it, and the step
of each call comes from the sampler's step reports (hooks.StepClock, no host sync for the samplers
it knows). Per-run state (current step, counters) lives in a keyed
``OUTER_SAMPLE`` wrapper and is dropped in ``finally``; ``get_guidance_stats(patched)`` reads the
current or last run's counters.

Condition-adherence measures for the procedural workload (``chorus_core.testbed.workload``) are here
too: first-frame error, motion correlation with the template's video, content correlation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..attention.run_keys import OUTER_SAMPLE, OVERRIDE_KEY
from ..attention.hooks import StepClock, mark_own, sample_with_run, sigma_window, steps_in_sigma_window, unwrap_own

__all__ = [
    "METHODS",
    "GuidanceSettings",
    "GuidanceStats",
    "boosted_cfg",
    "scale_cross_attention",
    "window_steps",
    "install_guidance",
    "get_guidance_stats",
    "first_frame_error",
    "template_adherence",
    "content_adherence",
]

log = logging.getLogger("chorus")

METHODS = ("cfg_boost", "cross_attention")
DEFAULT_KEY = "chorus_guidance"


# --------------------------------------------------------------------------------------------
# The math
# --------------------------------------------------------------------------------------------


def boosted_cfg(denoised: torch.Tensor, cond_denoised: torch.Tensor, uncond_denoised: torch.Tensor,
                cond_scale: float, strength: float) -> torch.Tensor:
    """CFG with its guidance term scaled by ``1 + strength``: ``denoised + strength * s * (c - u)``.

    All tensors are denoised predictions ``[B, C, T, H, W]``; ``denoised`` is the CFG result so far
    (``u + s (c - u)`` unless an earlier post-CFG hook changed it).
    """
    if strength == 0:
        return denoised
    return denoised + (strength * cond_scale) * (cond_denoised - uncond_denoised)


def scale_cross_attention(out: torch.Tensor, strength: float) -> torch.Tensor:
    """A cross-attention output ``[B, N, H*D]`` (or ``[B, H, N, D]``) times ``1 + strength``."""
    return out if strength == 0 else out * (1.0 + strength)


def window_steps(model_sampling, schedule: list, start: float, end: float) -> list:
    """Per step of the host ``schedule``: inside the ``[start, end)`` window of sigma-schedule fractions."""
    return steps_in_sigma_window(schedule, *sigma_window(model_sampling, start, end))


def _is_cross_attention(args, kwargs) -> bool:
    """True for an ``optimized_attention(q, k, v, heads, ...)`` call whose key length != query length."""
    q = kwargs["q"] if "q" in kwargs else (args[0] if len(args) > 0 else None)
    k = kwargs["k"] if "k" in kwargs else (args[1] if len(args) > 1 else None)
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
        return False
    skip_reshape = kwargs.get("skip_reshape", args[6] if len(args) > 6 else False)
    dim = 2 if skip_reshape else 1
    return q.dim() > dim and k.dim() > dim and q.shape[dim] != k.shape[dim]


# --------------------------------------------------------------------------------------------
# Settings and per-run state
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GuidanceSettings:
    """What to install: ``method`` (one of METHODS), ``strength`` (0 = off), window ``[start, end)``."""

    method: str = "cross_attention"
    strength: float = 0.1
    start: float = 0.1
    end: float = 1.0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"guidance method {self.method!r} is not one of {', '.join(METHODS)}")
        if not 0.0 <= self.start <= self.end <= 1.0:
            raise ValueError(f"need 0 <= start <= end <= 1 (fractions of the schedule), got {self.start} and {self.end}")
        if not -1.0 < self.strength <= 10.0:
            raise ValueError(f"strength must be in (-1, 10], got {self.strength}")


@dataclass
class GuidanceStats:
    """One sampling run: how many CFG combinations / cross-attention calls were changed."""

    boosted_steps: int = 0           # post-CFG calls inside the window that changed the result
    skipped_no_uncond: int = 0       # post-CFG calls in the window at cfg 1 (nothing to act on)
    scaled_cross_attention: int = 0  # cross-attention calls scaled
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"boosted_steps": self.boosted_steps, "skipped_no_uncond": self.skipped_no_uncond,
                "scaled_cross_attention": self.scaled_cross_attention, "notes": list(self.notes)}


class _Run:
    """Per-run state: which steps are in the window, the step of each model call, counters."""

    def __init__(self, settings: GuidanceSettings):
        self.settings = settings
        self.stats = GuidanceStats()
        self.clock: Optional[StepClock] = None
        self.inside: list = []  # per step, set with the clock by the OUTER_SAMPLE wrapper

    def start(self, clock: StepClock, model_sampling) -> None:
        self.clock = clock
        self.inside = window_steps(model_sampling, clock.schedule, self.settings.start, self.settings.end)

    def active(self, sigmas) -> bool:
        """Is the model call of ``sigmas`` in the window? (stepped once per model call, no host sync)"""
        if sigmas is None or self.clock is None or not self.inside:
            return self.settings.start <= 0.0 and self.settings.end >= 1.0  # unknown step: only a full window
        return self.inside[self.clock.step_of(sigmas)]

    def note(self, text: str) -> None:
        if text not in self.stats.notes:
            self.stats.notes.append(text)
            log.info("Chorus guidance: %s", text)


class GuidanceState:
    """Attached to the patched clone: settings and the current/last run's statistics."""

    def __init__(self, settings: GuidanceSettings, key: str):
        self.settings, self.key = settings, key
        self.stats: Optional[GuidanceStats] = None

    def start_run(self) -> _Run:
        run = _Run(self.settings)
        self.stats = run.stats
        return run


NO_UNCOND_NOTE = ("cfg_boost has nothing to act on at cfg 1 (ComfyUI skips the uncond pass); "
                  "guidance left unchanged. Use method cross_attention, or cfg > 1.")


# --------------------------------------------------------------------------------------------
# The hooks (plain closures; clones of the patched model share them, the run lives in options)
# --------------------------------------------------------------------------------------------


def _run_key(key: str) -> str:
    return f"{key}_run"


def _make_post_cfg(key: str, strength: float) -> Callable:
    run_key = _run_key(key)

    def chorus_guidance_post_cfg(args):
        denoised = args["denoised"]
        options = args.get("model_options", {}).get("transformer_options", {})
        run = options.get(run_key)
        if run is None:
            return denoised
        if not run.active(args["sigma"]):
            return denoised
        if args.get("uncond") is None:  # cfg 1: uncond_denoised is zeros, not a prediction
            run.stats.skipped_no_uncond += 1
            run.note(NO_UNCOND_NOTE)
            return denoised
        run.stats.boosted_steps += 1
        return boosted_cfg(denoised, args["cond_denoised"], args["uncond_denoised"], args["cond_scale"], strength)

    chorus_guidance_post_cfg.chorus_key = key
    return chorus_guidance_post_cfg


def _make_attention_override(key: str, strength: float, previous: Optional[Callable]) -> Callable:
    run_key = _run_key(key)

    def chorus_guidance_attention(func, *args, **kwargs):
        out = previous(func, *args, **kwargs) if previous is not None else func(*args, **kwargs)
        options = kwargs.get("transformer_options") or {}
        run = options.get(run_key)
        if run is None or not _is_cross_attention(args, kwargs):
            return out
        if not run.active(options.get("sigmas")):
            return out
        run.stats.scaled_cross_attention += 1
        return scale_cross_attention(out, strength)

    return mark_own(chorus_guidance_attention, key, previous)


def _make_outer_sample_wrapper(holder: GuidanceState) -> Callable:
    run_key = _run_key(holder.key)

    def chorus_guidance_outer_sample(executor, *args, **kwargs):
        return sample_with_run(executor, args, kwargs, run_key, holder.start_run())

    return chorus_guidance_outer_sample


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def install_guidance(model_patcher, settings: GuidanceSettings, key: str = DEFAULT_KEY):
    """Return a clone of ``model_patcher`` with guidance enhancement; the input is never modified.

    Strength 0 returns a plain clone (bit-identical sampling). Installing again with the same
    ``key`` replaces the earlier install. Composes with ``install_sparse_attention`` in either
    order (both chain the attention override) and with other packs' post-CFG hooks.
    """
    patched = model_patcher.clone()
    _remove_earlier_install(patched, key)  # so strength 0 also turns an upstream install off
    if settings.strength == 0:
        return patched
    holder = GuidanceState(settings, key)
    options = patched.model_options.setdefault("transformer_options", {})
    if settings.method == "cfg_boost":
        patched.set_model_sampler_post_cfg_function(_make_post_cfg(key, settings.strength))
    else:
        options[OVERRIDE_KEY] = _make_attention_override(key, settings.strength, options.get(OVERRIDE_KEY))
    patched.add_wrapper_with_key(OUTER_SAMPLE, key, _make_outer_sample_wrapper(holder))
    patched.set_attachments(key, holder)
    return patched


def _remove_earlier_install(patched, key: str) -> None:
    """Take out a previous install with this key (post-CFG hook, attention override, wrapper)."""
    post = patched.model_options.get("sampler_post_cfg_function", [])
    if post:
        patched.model_options["sampler_post_cfg_function"] = [f for f in post if getattr(f, "chorus_key", None) != key]
    options = patched.model_options.get("transformer_options", {})
    if OVERRIDE_KEY in options:
        options[OVERRIDE_KEY] = unwrap_own(options[OVERRIDE_KEY], key)
        if options[OVERRIDE_KEY] is None:
            del options[OVERRIDE_KEY]
    patched.remove_wrappers_with_key(OUTER_SAMPLE, key)
    patched.remove_attachments(key)


def get_guidance_stats(model_patcher, key: str = DEFAULT_KEY) -> Optional[GuidanceStats]:
    """Counters of the current or last sampling run of a model from ``install_guidance`` (None before any)."""
    holder = model_patcher.get_attachment(key)
    return holder.stats if isinstance(holder, GuidanceState) else None


# --------------------------------------------------------------------------------------------
# Condition adherence on the procedural workload
# --------------------------------------------------------------------------------------------


def first_frame_error(latent: torch.Tensor, first_frame: torch.Tensor) -> torch.Tensor:
    """RMS error of the generated first latent frame vs the conditioning frame: ``[B, C, T, H, W]``,
    ``[C, 1, H, W]`` -> ``[B]`` (float64), divided by the condition's RMS (0 = exact)."""
    ref = first_frame.double().reshape(1, -1)
    gen = latent[:, :, :1].double().flatten(1)
    return (gen - ref).square().mean(1).sqrt() / ref.square().mean().sqrt()


def _pearson(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pearson correlation over the last dim: ``[B, M]``, ``[1 or B, M]`` -> ``[B]`` (float64)."""
    a, b = a.double(), b.double()
    a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-12)


def template_adherence(latent: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Template following: correlation of the generated motion with the template's, ``[B]``.

    Motion is each frame minus the first, ``x[:, t] - x[:, 0]`` for t = 1..T-1 (all channels), so a
    video that copies its first frame and never moves scores about 0 whatever it looks like.
    ``latent [B, C, T, H, W]``, ``target [C, T, H, W]`` (the request's own rendered video).
    """
    motion = (latent[:, :, 1:] - latent[:, :, :1]).flatten(1)
    reference = (target[:, 1:] - target[:, :1]).flatten()[None]
    return _pearson(motion, reference)


def content_adherence(latent: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Correlation of the generated frames 1..T-1 with the request's rendered video: ``[B]``."""
    return _pearson(latent[:, :, 1:].flatten(1), target[:, 1:].flatten()[None])
