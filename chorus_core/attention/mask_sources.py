"""The mask sources a reuse run chooses from: a prefetched bank entry (or prior), online
prediction, and the recorder that watches a miss; plus the step-bucket bookkeeping of recordings.

Known ahead: :class:`BankEntryProvider` serves masks decided before the run. Looking at q and k:
:class:`OnlinePredictionProvider` and :class:`RecordingProvider` observe every self-attention call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Optional

import torch

from .._siblings import import_sibling
from ..bank import Schedule
from ..reuse.entry_prefetch import EntryPrefetch
from .mask_provider import MaskSource, ObservedMasks, bucket_index
from .masks import MaskRecorder
from .online_predictor import predict_block_map

log = logging.getLogger("chorus")


def entry_buckets_for_run(schedule: Schedule, steps: int, run_sigmas=None) -> list[int]:
    """The entry's bucket serving each of this run's ``steps`` steps.

    By noise level when both the entry and the run know their sigma schedules: a 4-step run
    served from a 40-step entry, the later stage of a staged sampling (KSamplerAdvanced
    ``start_at_step``, SplitSigmas) and a run with denoise < 1 each get the masks recorded at
    their own sigmas. Entries recorded before sigmas were kept fall back to step indices,
    rescaled to this run's step count.
    """
    if run_sigmas is not None and schedule.sigmas is not None:
        return [schedule.bucket_for_sigma(sigma) for sigma in run_sigmas[:steps]]
    starts = scaled_bucket_starts(schedule, steps)
    return [bucket_index(starts, step) for step in range(steps)]


def scaled_bucket_starts(schedule: Schedule, steps: int) -> list[int]:
    """Bucket starts of a recorded schedule, rescaled to this run's step count."""
    starts = [round(a * steps / schedule.steps) for a, _ in schedule.step_buckets]
    unique = []
    for s in starts:
        unique.append(max(s, unique[-1] + 1) if unique else 0)
    return unique


class BankEntryProvider(MaskSource):
    """Serves a bank entry (or a population prior) prefetched by :class:`EntryPrefetch`.

    The kernel-ready masks of a step bucket are built once, at its first sparse call; a hit
    adds no host sync, conversion or validation per attention call. When the entry turns out
    unusable (corrupt, pruned meanwhile), every later call goes to ``fallback`` (a miss source).
    """

    def __init__(self, prefetch: EntryPrefetch, steps: int, block_size: tuple[int, int], fallback=None,
                 run_sigmas=None):
        self.prefetch, self.steps, self.fallback, self.run_sigmas = prefetch, steps, fallback, run_sigmas
        self.block_size = tuple(block_size)
        self.failure: Optional[str] = None  # why the entry could not serve, once known
        self.step_buckets: Optional[list[int]] = None  # the entry bucket of each step of this run

    def _source(self):
        """self while the entry serves, the fallback once it has failed (checked once: then cached)."""
        if self.failure is None and self.step_buckets is None:
            try:  # the entry's schedule: known once the worker has loaded it
                self.step_buckets = entry_buckets_for_run(self.prefetch.entry().schedule, self.steps, self.run_sigmas)
            except Exception as exc:
                self._fail(exc)
        if self.failure is not None and self.fallback is not None:
            return self.fallback
        if self.failure is not None:
            raise RuntimeError(self.failure)
        return self

    def unusable(self) -> bool:
        """True once the entry is known not to serve; the first call waits for the worker's load."""
        self._source()
        return self.failure is not None

    def _fail(self, exc: Exception) -> None:
        self.failure = str(exc.__cause__ or exc)
        log.warning("Chorus: %s; this run continues as a miss", self.failure)

    def step_bucket(self, step: int):
        source = self._source()
        if source is not self:
            return ("fallback", source.step_bucket(step))
        return self.step_buckets[min(step, len(self.step_buckets) - 1)]

    def observes(self, step: int) -> bool:
        source = self._source()
        return source is not self and source.observes(step)

    def observe(self, layer, step, cond_or_uncond, q, k, heads, skip_reshape) -> None:
        source = self._source()
        if source is not self:
            source.observe(layer, step, cond_or_uncond, q, k, heads, skip_reshape)

    def prepared_mask(self, layer, step, cond_or_uncond, num_heads, seq_len, batch, device):
        source = self._source()
        if source is not self:
            return source.prepared_mask(layer, step, cond_or_uncond, num_heads, seq_len, batch, device)
        try:  # a layer the worker could not decode: the rest of the run is a miss, like a failed load
            if layer >= self.prefetch.entry().shape[1]:
                return None
            prepared = self.prefetch.layer_mask(self.step_bucket(step), layer, self.block_size, seq_len, device)
        except Exception as exc:
            self._fail(exc)
            return self.prepared_mask(layer, step, cond_or_uncond, num_heads, seq_len, batch, device)
        if prepared.mask.heads != num_heads or prepared.mask.n_q_blocks != prepared.mask.live_counts.shape[2]:
            raise ValueError(f"bank entry masks have {prepared.mask.heads} heads and "
                             f"{prepared.mask.live_counts.shape[2]} query blocks; this run needs {num_heads} heads "
                             f"over {seq_len} tokens. The bank's compatibility filter should have excluded it")
        return prepared

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device):
        """A bool map for callers that want one (Feature Reuse maps it to its shorter sequence),
        made on the device from the uploaded masks: no second decode on the sampling thread."""
        source = self._source()
        if source is not self:
            return source.block_map(layer, step, cond_or_uncond, num_heads, seq_len, device)
        prepared = self.prepared_mask(layer, step, cond_or_uncond, num_heads, seq_len, 1, device)
        if prepared is None or self.failure is not None:  # failed just now: this call runs dense
            return None
        return import_sibling("kernels.block_sparse").mask_to_block_map(prepared.mask)


class OnlinePredictionProvider(ObservedMasks):
    """A miss without a usable entry: masks predicted from pooled q and k at every step."""

    def __init__(self, block_size: int, top_p: float, min_density: float, max_density: float):
        self.block_size = (block_size, block_size)
        self.settings = dict(block_size=block_size, top_p=top_p, min_density=min_density, max_density=max_density)
        self._predicted: dict[int, torch.Tensor] = {}

    def step_bucket(self, step: int) -> int:
        return step  # a fresh prediction every step

    def observes(self, step: int) -> bool:
        return True

    def observe(self, layer, step, cond_or_uncond, q, k, heads, skip_reshape) -> None:
        self._predicted[layer] = predict_block_map(q, k, None if skip_reshape else heads, **self.settings)

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device):
        return self._predicted.pop(layer, None)


class RecordingProvider(MaskSource):
    """Wraps a provider and shows every self-attention call's q and k to a MaskRecorder.

    A hit passes no recorder but ``late_start=(first_step, start)``: at ``first_step`` (its first
    sparse step) ``start(step)`` returns the recorder when the entry turned out unusable, else
    None and this run records nothing (see :meth:`ReuseRun.recorder_after_failure`).
    """

    def __init__(self, inner, recorder: MaskRecorder | None, late_start=None):
        self.inner, self.recorder = inner, recorder
        self.block_size = tuple(inner.block_size)
        self.error: str | None = None  # set when recording failed; nothing is stored then
        self._late_start = late_start

    def step_bucket(self, step: int):
        return self.inner.step_bucket(step)

    def _recording(self, step: int) -> bool:
        if self._late_start is not None and step >= self._late_start[0]:
            start, self._late_start = self._late_start[1], None  # decided once per run
            try:
                self.recorder = start(step)
            except Exception as exc:  # recording is a by-product: it must not stop the generation
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("Chorus: recording not started: %s", self.error)
        return self.error is None and self.recorder is not None

    def observes(self, step: int) -> bool:
        return (self._recording(step) and self.recorder.bucket(step) is not None) or self.inner.observes(step)

    def observe(self, layer, step, cond_or_uncond, q, k, heads, skip_reshape) -> None:
        if self._recording(step):
            try:
                self.recorder.record(layer, step, q, k, None if skip_reshape else heads)
            except Exception as exc:  # recording is a by-product: it must not stop the generation
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("Chorus: recording stopped: %s", self.error)
        self.inner.observe(layer, step, cond_or_uncond, q, k, heads, skip_reshape)

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device):
        return self.inner.block_map(layer, step, cond_or_uncond, num_heads, seq_len, device)

    def prepared_mask(self, layer, step, cond_or_uncond, num_heads, seq_len, batch, device):
        return self.inner.prepared_mask(layer, step, cond_or_uncond, num_heads, seq_len, batch, device)


def recorded_steps(step_buckets, per_bucket: Optional[int] = None, first_step: int = 0) -> list[list[int]]:
    """Which steps feed each bucket's recorded mass: every step of the bucket (``per_bucket`` None),
    else that many spread over its first half (2: the first and the middle one, what was recorded
    before every step was); only steps from ``first_step`` on, when the recording starts late.

    Every step is the default because a bucket's mask serves every step of it: masks selected from
    the first and middle steps only missed the blocks the later steps attend to and cost 1.0 to
    11 dB against the same rule over the whole bucket on the sharp16k testbed
    (tests/benchmarks/results/hit_stages_h200_before_fix_r*.md).
    """
    chosen = []
    for start, end in step_buckets:
        start = max(start, first_step)
        if per_bucket is None:
            chosen.append(list(range(start, end)))
        else:
            spread = 2 * max(1, per_bucket - 1)
            chosen.append(sorted({start + (i * (end - start - 1)) // spread for i in range(per_bucket)
                                  if start < end}))
    return chosen


def buckets_recordable_from(schedule: Schedule, step: int) -> Schedule:
    """The schedule with every bucket that ends at or before ``step`` merged into the next one:
    a recording that starts at ``step`` has no q and k of the steps before it."""
    buckets = [list(bucket) for bucket in schedule.step_buckets]
    while len(buckets) > 1 and buckets[0][1] <= step:
        merged = buckets.pop(0)
        buckets[0][0] = merged[0]
    return replace(schedule, step_buckets=[tuple(bucket) for bucket in buckets])


@dataclass(frozen=True)
class RecordingPlan:
    """What a recording miss records: how many steps of each bucket, and every how many queries.

    :param steps_per_bucket: None = every step of each bucket (see :func:`recorded_steps`)
    :param query_stride: block mass from every ``query_stride``-th query; None = 4 on a GPU
        (a quarter of the cost), 1 elsewhere
    """

    steps_per_bucket: Optional[int] = None
    query_stride: Optional[int] = None
