"""Hook machinery shared by every Chorus patch (sparse attention, Feature Reuse, Guidance Enhance).

ComfyUI gives each hook one slot (``optimized_attention_override``, a block patch per index):
each Chorus hook marks itself (:func:`mark_own`) and chains to what was there before, and a
second install of the same hook unwraps its own earlier one (:func:`unwrap_own`) instead of
stacking on it. :class:`AttentionCall` reads an ``optimized_attention`` call's arguments and
:func:`schedule_step` the current step, the same way for every hook.

Newer ComfyUI (from about 0.35) hands q, k and v to attention wrapped in single-use
``AttentionTensorContainer`` objects (``peek()`` reads, ``take()`` consumes). Its ``wrap_attn``
unwraps them before calling an override, unless the override has a ``container_function``;
then that function gets the containers and *no* ``func``. :class:`AttentionCall` reads both
forms without consuming anything, so a call it declines is passed on exactly as it came.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .._siblings import import_sibling

__all__ = ["schedule_step", "StepClock", "clock_outer_sample", "sigma_window", "steps_in_sigma_window", "block_sparse", "AttentionCall", "mark_own", "unwrap_own", "is_container",
           "container_function_of"]


def schedule_step(sigmas: torch.Tensor, schedule: torch.Tensor) -> int:
    """Index of the current sigma in the sampler's schedule (closest match; one host sync).

    Shared by every Chorus hook; each calls it once per model call and caches the answer.
    """
    return int((schedule.to(sigmas.device) - sigmas.flatten()[0]).abs().argmin())


# Model evaluations a k-diffusion sampler makes in a step *after* reporting it (callback ``i``),
# read from ComfyUI's comfy/k_diffusion/sampling.py (0.3.64). The first evaluation of every step
# comes before its report; heun's corrector (at sigma_{i+1}) and the SDE/2S midpoints come after.
# A sampler not listed is stepped by its sigma (one host read per model call).
_EVALS_AFTER_REPORT = {
    "sample_euler": 0, "sample_euler_ancestral": 0, "sample_dpmpp_2m": 0, "sample_dpmpp_2m_sde": 0,
    "sample_dpmpp_2m_sde_gpu": 0, "sample_dpmpp_3m_sde": 0, "sample_dpmpp_3m_sde_gpu": 0, "sample_lcm": 0,
    "sample_heun": 1, "sample_dpm_2": 1, "sample_dpm_2_ancestral": 1, "sample_dpmpp_2s_ancestral": 1,
    "sample_dpmpp_sde": 1, "sample_dpmpp_sde_gpu": 1,
}


class StepClock:
    """The step of each model call of one sampling run, read without a host sync.

    Steps come from the sampler's own progress reports (its callback ``i``) and, for samplers
    that evaluate the model again after reporting a step (heun, dpm_2, dpmpp_sde ...), from how
    many evaluations each step makes after its report: so heun's corrector at ``sigma_{i+1}``
    belongs to step ``i``, not to step ``i + 1`` whose sigma it shares. ``schedule`` is the
    run's ``sample_sigmas`` on the host (read once per run, at the start).
    """

    def __init__(self, schedule: list, evals_after_report: Optional[int]):
        self.schedule = schedule
        self.evals_after_report = evals_after_report
        self.host_reads = 0  # model calls stepped by reading their sigma (unknown samplers only)
        self._reported = -1
        self._since_report = 0
        self._sigmas = None
        self._step: Optional[int] = None

    @property
    def steps(self) -> int:
        return len(self.schedule) - 1

    def report(self, step: int) -> None:
        """The sampler's callback: step ``step`` made its first evaluation."""
        self._reported, self._since_report = int(step), 0

    def step_of(self, sigmas) -> int:
        """The step of the model call whose ``transformer_options["sigmas"]`` is ``sigmas``."""
        if sigmas is self._sigmas:  # the same model call (every layer, cond and uncond)
            return self._step
        self._sigmas = sigmas
        if self.evals_after_report is None:
            self._step = self._step_by_sigma(sigmas)
        elif self._step is None:
            self._step = 0  # the run's first model call
        elif self._step > self._reported:
            pass  # the current step is not reported yet: this call is still part of it
        else:
            self._since_report += 1
            own = self._since_report <= self.evals_after_report
            self._step = min(self._reported + (0 if own else 1), max(self.steps - 1, 0))
        return self._step

    def _step_by_sigma(self, sigmas) -> int:
        """Step ``i`` whose interval ``(sigma_{i+1}, sigma_i]`` holds the call's sigma (one host read)."""
        self.host_reads += 1
        sigma = float(sigmas.flatten()[0])
        for i in range(self.steps):
            if sigma > self.schedule[i + 1] * (1 + 1e-6):
                return i
        return max(self.steps - 1, 0)

    def sigma_at(self, step: int) -> float:
        return self.schedule[step]


def sample_with_run(executor, args: tuple, kwargs: dict, run_key: str, run):
    """Run one OUTER_SAMPLE call with ``run`` where the hooks read it (``transformer_options[run_key]``
    of the guider's per-sample options), started on this sampling's step clock and the guider's
    model sampling; the run is taken out again however the sampling ends."""
    guider = executor.class_obj
    options = guider.model_options.setdefault("transformer_options", {})
    clock, args, kwargs = clock_outer_sample(args, kwargs)
    run.start(clock, guider.model_patcher.get_model_object("model_sampling"))
    options[run_key] = run
    try:
        return executor(*args, **kwargs)
    finally:
        options.pop(run_key, None)


def clock_outer_sample(args: tuple, kwargs: dict) -> tuple:
    """(clock, args, kwargs) for an OUTER_SAMPLE wrapper: the clock of this run, and the call's
    arguments with the sampler's callback wrapped so that the clock hears every step report.

    ``outer_sample(noise, latent_image, sampler, sigmas, denoise_mask, callback, disable_pbar, seed)``.
    """
    names = ("noise", "latent_image", "sampler", "sigmas", "denoise_mask", "callback", "disable_pbar", "seed")
    bound = dict(zip(names, args), **kwargs)
    sigmas, sampler = bound.get("sigmas"), bound.get("sampler")
    schedule = [float(s) for s in sigmas.detach().float().cpu().tolist()] if sigmas is not None else []
    function = getattr(sampler, "sampler_function", None)
    clock = StepClock(schedule, _EVALS_AFTER_REPORT.get(getattr(function, "__name__", None)))
    previous = bound.get("callback")

    def chorus_step_callback(step, *rest, **named):
        clock.report(step)
        if previous is not None:
            return previous(step, *rest, **named)

    if len(args) > 5:
        args = args[:5] + (chorus_step_callback,) + args[6:]
    else:
        kwargs = {**kwargs, "callback": chorus_step_callback}
    return clock, args, kwargs


def sigma_window(model_sampling, start: float, end: float) -> tuple:
    """(start_sigma, end_sigma) of a window given as fractions ``start``/``end`` of the sigma
    schedule, read the way ComfyUI's own nodes read them (``model_sampling.percent_to_sigma``)."""
    return float(model_sampling.percent_to_sigma(start)), float(model_sampling.percent_to_sigma(end))


def steps_in_sigma_window(schedule: list, start_sigma: float, end_sigma: float) -> list:
    """Per step of ``schedule`` (host sigmas): is it inside the window?

    Like core's EasyCache: a step runs in the window from the first step whose sigma is at or
    below ``start_sigma`` until the sigma falls to ``end_sigma`` (``end_sigma < sigma <= start_sigma``).
    A whole step is in or out, judged by the sigma it starts from, so every evaluation of one step
    (heun's corrector, an SDE midpoint) is treated alike. Equal within 1e-5 counts as equal: the
    schedule is float32, percent_to_sigma a Python float.
    """
    slack = 1e-5
    return [end_sigma * (1 + slack) + 1e-12 < sigma <= start_sigma * (1 + slack) + 1e-12 for sigma in schedule[:-1]]


def block_sparse():
    """The kernels' block_sparse module, imported at call time (see _siblings)."""
    return import_sibling("kernels.block_sparse")


def fp8_block_sparse():
    """The kernels' fp8_block_sparse module (attention_precision "fp8"), imported at call time."""
    return import_sibling("kernels.fp8_block_sparse")


_ATTENTION_PARAMS = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")


def is_container(value) -> bool:
    """True for newer ComfyUI's ``AttentionTensorContainer`` (duck-typed: 0.3.64 has none)."""
    return not isinstance(value, torch.Tensor) and callable(getattr(value, "peek", None)) \
        and callable(getattr(value, "take", None))


def container_function_of(override) -> Optional[Callable]:
    """The override's ``container_function``, as newer ComfyUI's ``wrap_attn`` looks it up."""
    return getattr(override, "container_function", None) if override is not None else None


@dataclass
class AttentionCall:
    """The arguments of an ``optimized_attention`` call that matter here.

    q, k and v are tensors; when the call came with containers, ``containers`` holds them
    (unconsumed) and the tensors are their peeked contents.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    heads: int
    mask: Any
    skip_reshape: bool
    skip_output_reshape: bool
    named: dict = field(default_factory=dict, repr=False)  # every argument by name, to pass on changed
    containers: Optional[tuple] = field(default=None, repr=False)

    @classmethod
    def parse(cls, args, kwargs) -> Optional["AttentionCall"]:
        """Read a call given as tensors or as containers (newer Wan passes ``heads`` by name)."""
        named = dict(zip(_ATTENTION_PARAMS, args)) | kwargs
        if not all(name in named for name in ("q", "k", "v", "heads")):
            return None
        qkv = (named["q"], named["k"], named["v"])
        containers = None
        if any(is_container(x) for x in qkv):
            if not all(is_container(x) for x in qkv):
                return None  # a mix no ComfyUI produces: leave it to the function it was meant for
            containers = qkv
            qkv = tuple(x.peek() for x in qkv)
        return cls(*qkv, int(named["heads"]), named.get("mask"),
                   bool(named.get("skip_reshape", False)), bool(named.get("skip_output_reshape", False)), named,
                   containers)

    def consume(self) -> None:
        """Mark the containers used (their single-use contract) once this call has been answered."""
        for container in self.containers or ():
            container.take()

    @property
    def seq_len(self) -> int:
        return self.q.shape[2] if self.skip_reshape else self.q.shape[1]

    @property
    def kv_len(self) -> int:
        return self.k.shape[2] if self.skip_reshape else self.k.shape[1]

    @property
    def batch(self) -> int:
        return self.q.shape[0]


def mark_own(function, key: str, previous):
    function.chorus_key = key
    function.chorus_previous = previous
    return function


def unwrap_own(function, key: str):
    """What our own earlier install chained to, so installing twice does not stack two patches."""
    while function is not None and getattr(function, "chorus_key", None) == key:
        function = function.chorus_previous
    return function
