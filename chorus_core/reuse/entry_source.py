"""The mask source of a hit: a bank entry (or a population prior), prefetched, served by sigma.

Known ahead (:class:`~chorus_core.attention.mask_provider.KnownMasks` in kind): the entry was
recorded from a similar request's dense attention, so every step's masks exist before the run.
"""

from __future__ import annotations

import logging
from typing import Optional

from .._siblings import import_sibling
from ..attention.mask_provider import MaskSource, bucket_index
from ..bank import Schedule
from .entry_prefetch import EntryPrefetch

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


# Relative tolerance when counting recorded sigmas inside a run's sigma range (float rounding only).
_SIGMA_TOLERANCE = 1e-6


def schedule_shortfall(schedule: Schedule, steps: int, run_sigmas=None) -> Optional[str]:
    """Why an entry recorded on ``schedule`` should not serve a run of ``steps`` steps, or None.

    An entry serves runs sampled at most as finely as it was recorded: measured on the sharp16k
    testbed weights (tests/benchmarks/results/schedule_transfer_sharp16k_cpu.md), a 4-step run
    served from a 20-step entry lost nothing, while a 20-step run served from a 4-step entry lost
    6.7 dB against its own schedule's entry and 8.2 dB against an online miss: its low-noise
    steps got masks recorded at high noise. With sigmas on both sides, "as finely" counts the
    entry's recorded steps inside the run's own sigma range (the later stage of a staged run
    covers part of the range); without, it compares step counts.
    """
    if run_sigmas is not None and schedule.sigmas is not None:
        run = [float(s) for s in run_sigmas[:steps]]
        low, high = min(run) * (1 - _SIGMA_TOLERANCE), max(run) * (1 + _SIGMA_TOLERANCE)
        recorded = sum(1 for s in schedule.sigmas[:schedule.steps] if low <= s <= high)
        where = f" in this run's noise range (sigma {min(run):.3g} to {max(run):.3g})"
    else:
        recorded, where = schedule.steps, ""
    if recorded >= steps:
        return None
    return (f"the bank entry was recorded on {recorded} steps{where} and this run samples {steps}: served to a "
            "finer schedule an entry's masks lost 6-8 dB on the testbed, so this run is a miss")


def unserved_then(records: bool) -> str:
    """What a run whose similar entry was too coarse does instead, for its warning."""
    if records:
        return "; it records an entry for its own schedule"
    return "; it records nothing (record_on_miss off, a read-only bank or another model), so a run like it misses again"


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
                schedule = self.prefetch.entry().schedule
                shortfall = schedule_shortfall(schedule, self.steps, self.run_sigmas)
                if shortfall is not None:
                    raise ValueError(shortfall)
                self.step_buckets = entry_buckets_for_run(schedule, self.steps, self.run_sigmas)
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
