"""The mask sources that look at q and k: online prediction, and the recorder that watches a
miss; plus the step-bucket bookkeeping of recordings. (A bank entry, known ahead, is served by
``chorus_core.reuse.entry_source``.)

:class:`OnlinePredictionProvider` and :class:`RecordingProvider` observe every self-attention call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..bank import Schedule
from .mask_provider import MaskSource, ObservedMasks
from .masks import MaskRecorder
from .online_predictor import predict_block_map

log = logging.getLogger("chorus")


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
