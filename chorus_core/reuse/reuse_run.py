"""One generation with mask reuse: choose a mask source, sample patched, record on a miss.

This is the library side of the Sparse Wan Sampler and Chorus Sparse Attention nodes (the
match itself: ``reuse_match``; the mask sources: ``mask_sources``). It knows
ComfyUI's data (a ModelPatcher, CONDITIONING lists, LATENT dicts) but none of its nodes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import weakref
from dataclasses import asdict, dataclass, field

from . import bank_writer, recording_queue
from ..bank import BankIncompatible, Schedule
from ..bank.budget import take_evictions
from ..bank.merge import merged_into
from ..bank.spool import Recording
from ..bank.encoding import PackedBlockMaps
from .entry_prefetch import EntryPrefetch
from ..attention.mask_provider import DenseProvider, DenseWarmupProvider, SamplingCall
from ..attention.mask_sources import (OnlinePredictionProvider, RecordingPlan, RecordingProvider,
                                     buckets_recordable_from, recorded_steps)
from ..attention.masks import MaskRecorder
from .entry_source import BankEntryProvider, schedule_shortfall, unserved_then
from .sampling_info import model_shift, sampler_name, sigma_schedule
from .model_identity import fingerprint_patcher
from .prior_store import PRIOR_ENTRIES, load_prior
from .reuse_match import ReuseMatch, bounded, match_grid_problem
from ..attention.step_times import earlier_dense_step, remember_dense_step
from ..attention.sparse_patch import (ATTENTION_PRECISIONS, DENSE_ATTENTION_MODES, get_sparse_state,
                                      install_sparse_attention)
from ..attention.sparse_run import SparseRun

log = logging.getLogger("chorus")
MISS_MODES = ("online", "prior", "dense")


@dataclass(frozen=True)
class ReuseOptions:
    """What the sampler does with a match. Defaults: see docs/quality.md, "Defaults, and what supports them"."""

    dense_warmup_steps: int = 1
    dense_layers: tuple[int, ...] = ()
    # the bank's population prior beat online prediction on every testbed table (docs/quality.md, Defaults)
    # and costs one decode instead of a prediction per step; online when the bank has no prior
    miss_mode: str = "prior"
    top_p: float = 0.9
    min_density: float = 0.05
    max_density: float = 0.5
    record_on_miss: bool = True
    tags: tuple[str, ...] = ()
    dense_attention: str = "auto"  # see sparse_patch.DENSE_ATTENTION_MODES
    # bf16 until FP8 is measured better on the product path ([user-stack] item 2; docs/quality.md, Defaults)
    attention_precision: str = "bf16"  # see sparse_patch.ATTENTION_PRECISIONS
    # A hit's entry holds every step's masks, recorded from dense attention, so a hit needs no dense
    # warm-up: it runs sparse from the first step (what step-distilled 4-step runs gain most from).
    hit_warmup_steps: int = 0
    # The last step of the denoising dense on every run: with it a 4-step hit beat core ComfyUI's sparse
    # attention in both speed and quality on the testbed; 0 is the speed setting (docs/quality.md, Defaults)
    dense_last_steps: int = 1
    model_files: tuple[str, ...] = ()  # files the model was loaded from, where known (a spooled recording
    # whose files are all gone is dropped at replay)

    def __post_init__(self):
        for name in ("dense_warmup_steps", "hit_warmup_steps", "dense_last_steps"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if self.miss_mode not in MISS_MODES:
            raise ValueError(f"miss_mode {self.miss_mode!r} is not one of {', '.join(MISS_MODES)}")
        if self.dense_attention not in DENSE_ATTENTION_MODES:
            raise ValueError(f"dense_attention {self.dense_attention!r} is not one of {', '.join(DENSE_ATTENTION_MODES)}")
        if self.attention_precision not in ATTENTION_PRECISIONS:
            raise ValueError(f"attention_precision {self.attention_precision!r} is not one of "
                             f"{', '.join(ATTENTION_PRECISIONS)}")
        if not 0.0 < self.min_density <= self.max_density <= 1.0:
            raise ValueError(f"need 0 < min_density <= max_density <= 1, got {self.min_density} and {self.max_density}")


@dataclass
class RunReport:
    """What one generation did; the sampler's UI output and ``/history`` carry it as JSON."""

    mode: str
    steps: int
    mask_source: str = ""
    entry_id: str | None = None
    similarity: float | None = None
    components: dict = field(default_factory=dict)
    density: float | None = None
    layers: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    recorded_entry_id: str | None = None  # known at once; the entry is written in the background
    recording: str | None = None  # "queued": spooled on disk, written in the background; "recorded": in the bank
    merged_into: str | None = None  # the entry a "recorded" recording merged into (queued: its recording state says)
    dense_steps: dict = field(default_factory=dict)  # step index (as text) -> why it ran dense on every layer
    backend: str | None = None  # block-sparse kernel backend and why (e.g. "fa4 (FlashAttention-4 ...)")
    dense_backend: str | None = None  # what the dense self-attention calls ran on, and why
    warnings: list = field(default_factory=list)
    # Entries this process's writes to the bank evicted to keep its budget since the last report on it
    # (a queued recording is written after its own run reports: its eviction shows in the next report).
    # Each: {"written", "evicted", "entry_ids", "bytes_freed", "quarantined_removed", "max_bytes", "max_entries", "line"}
    evictions: list = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SamplingSettings:
    steps: int
    sampler: str
    scheduler: str
    sigmas: tuple | None = None  # the run's sigma schedule (steps + 1 values), when known


class WeakModel:
    """A model attribute held by weak reference (None once the model is gone).

    The patched model holds its ReusePatch (an attachment and the hooks' state), so a patch or
    run holding that model, or a clone made from it, would close a reference cycle: the clones
    would then die only in a garbage collection, all at once, and ComfyUI, finding the loaded
    model's patchers gone, runs gc.collect() and empties the CUDA cache inside the next
    generation (tests/test_patch_lifetime.py). Whoever samples holds the model while it runs.
    """

    def __set_name__(self, owner, name):
        self.slot = f"_weak_{name}"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        ref = obj.__dict__.get(self.slot)
        return None if ref is None else ref()

    def __set__(self, obj, value):
        obj.__dict__[self.slot] = None if value is None else weakref.ref(value)


class ReuseRun(SparseRun):
    """One sampling run of a :class:`ReusePatch`, and its one holder of state: the step clock, masks
    and statistics of a :class:`SparseRun`, plus the choice of mask source, the report and a
    miss's recording.

    :param model_patcher: the model that samples (the guider's, with every LoRA and sampling patch
        applied after the Chorus node): a hit needs its identity to be the match's, and a recording
        is filed under it
    :param match: the Similarity Match output, or None to run online prediction without a bank
    """

    model_patcher = WeakModel()  # the guider's model: it holds our patch, so held weakly here
    patched = WeakModel()  # the model the patch installed (for Feature Reuse's warnings)

    def __init__(self, model_patcher, match: ReuseMatch | None, options: ReuseOptions,
                 sampling: SamplingSettings, block_size: int = 128, recording_plan: RecordingPlan = RecordingPlan(),
                 step_callbacks: list | None = None, dense_attention: str | None = None):
        super().__init__(None, step_callbacks if step_callbacks is not None else [],
                         dense_attention or options.dense_attention)
        self.model_patcher, self.match, self.options, self.sampling = model_patcher, match, options, sampling
        self.recording_plan = recording_plan
        self.block_size = match.request.layout.block_size[0] if match else block_size
        self.report = RunReport(mode="miss", steps=sampling.steps)
        self.schedule = self._recorded_schedule(sampling, model_shift(model_patcher))
        self.recording: RecordingProvider | None = None
        self.prefetch: EntryPrefetch | None = None
        self.entry_provider: BankEntryProvider | None = None
        self.patched = None
        self._fingerprint = None
        self.model_differs = False

    def _recorded_schedule(self, sampling: SamplingSettings, shift: float) -> Schedule:
        """The schedule this run records and is served by; sigmas a bank entry cannot address by
        (rising ones from FlipSigmas, a single sigma from a split at the last step) are left out:
        the run then goes by step index, with a warning."""
        common = dict(steps=sampling.steps, sampler=sampling.sampler, scheduler=sampling.scheduler, shift=shift)
        try:
            return Schedule(**common, sigmas=sampling.sigmas)
        except BankIncompatible as exc:
            self.report.warnings.append(f"this run's sigmas cannot address bank entries ({exc}); it is served and "
                                        "recorded by step index")
            return Schedule(**common)

    @property
    def fingerprint(self):
        """Identity of the model that samples (read once per run)."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint_patcher(self.model_patcher)
        return self._fingerprint

    def choose_provider(self):
        """This run's mask source: the hit's entry or a miss source, behind the dense warm-up, recorded on a miss."""
        self._check_sampling_model()
        provider = self._hit_provider() or self._miss_provider()
        warmup, dense_from = self.dense_step_plan()
        provider = DenseWarmupProvider(provider, warmup, self.options.dense_layers, dense_from)
        if self._can_record() and self.report.mode == "miss":
            self.recording = RecordingProvider(provider, self._make_recorder())
        elif self._can_record():  # a hit records only if its entry turns out unusable
            late_start = (warmup, self.recorder_after_failure)
            self.recording = RecordingProvider(provider, None, late_start=late_start)
        self.provider = self.recording or provider
        return self.provider

    def dense_step_plan(self) -> tuple[int, int | None]:
        """(dense warm-up steps, first of the dense last steps or None) for this run's mode; the
        report names each such step and why."""
        o, steps = self.options, self.sampling.steps
        hit = self.report.mode == "hit"
        warmup = o.hit_warmup_steps if hit else o.dense_warmup_steps
        why = (f"dense warm-up of a hit (hit_warmup_steps={warmup})" if hit else
               f"dense warm-up of a miss (dense_warmup_steps={warmup})")
        dense = {str(s): why for s in range(min(warmup, steps))}
        dense_from = steps - o.dense_last_steps if o.dense_last_steps and self.ends_denoising() else None
        for s in range(max(warmup, dense_from or steps), steps):
            dense[str(s)] = f"one of the last steps kept dense (dense_last_steps={o.dense_last_steps})"
        self.report.dense_steps = dense
        return warmup, dense_from

    def ends_denoising(self) -> bool:
        """False for a run stopping above sigma 0 (Wan 2.2's high-noise half): no last steps to keep dense."""
        sigmas = self.sampling.sigmas
        return not sigmas or sigmas[-1] <= 0.0

    def recorder_after_failure(self, step: int) -> MaskRecorder | None:
        """A hit's recorder when its entry cannot serve, asked at the hit's first sparse step.

        The run then goes on as a miss, so it records like one: the next similar request hits
        a fresh entry instead of missing every time. The dense warm-up steps before ``step`` were
        not recorded; the buckets they end in are merged into the first one still running.
        """
        if not self.entry_provider.unusable():  # waits for the worker's load, as the step would
            return None
        self.schedule = buckets_recordable_from(self.schedule, step)
        return self._make_recorder(first_step=step)

    def _hit_provider(self):
        if self.match is None:
            return None
        result = self.match.result
        if self.match.warning:
            self.report.warnings.append(self.match.warning)
        self.report.similarity, self.report.components = result.similarity, dict(result.components)
        self.report.timings["match_ms"] = round(self.match.match_ms, 2)
        if not result.hit or self.model_differs:
            return None
        bank, (entry_id, passed_over) = self.match.bank, self.serving_candidate(result)
        if entry_id is None:  # every similar entry is too coarse: a miss, with its dense warm-up, that records
            return None
        self.report.mode, self.report.entry_id = "hit", entry_id
        self.report.mask_source = f"bank entry {entry_id}" + (
            f" (similarity rank {passed_over + 1}: the {passed_over} more similar were recorded on "
            "coarser schedules than this run's)" if passed_over else "")
        # Loaded, verified and decoded in a worker while the dense warm-up step runs; a failure
        # there (corrupt, pruned meanwhile) turns the run into a miss from then on, with a warning.
        return self._prefetched(lambda: _own_connection(bank, lambda own: own.load_masks(entry_id)))

    def serving_candidate(self, result) -> tuple[str | None, int]:
        """(the most similar entry above the threshold recorded at least as finely as this run
        samples (``entry_source.schedule_shortfall``), how many more similar ones were passed
        over); the entry is None when every one is coarser: the run is then a miss that records an
        entry for its own schedule. One index read per candidate."""
        coarse = None  # (entry id, why) of the most similar entry, when it is too coarse
        for rank, (entry_id, similarity) in enumerate(result.top):
            if similarity < self.match.request.threshold:
                break
            try:
                schedule = bounded(self.match.bank, functools.partial(self.match.bank.entry_schedule, entry_id))
            except Exception:  # an unreadable row: the worker's load says why and makes it a miss
                return entry_id, rank
            shortfall = schedule_shortfall(schedule, self.sampling.steps, self.schedule.sigmas)
            if shortfall is None:
                self.report.similarity = similarity
                return entry_id, rank
            coarse = coarse or (entry_id, shortfall)
        if coarse is None:
            return result.entry_id, 0
        self.report.warnings.append(f"similar entry {coarse[0]} not served: {coarse[1]}{unserved_then(self._can_record())}")
        return None, 0

    def _prefetched(self, open_entry) -> BankEntryProvider:
        self.prefetch = EntryPrefetch(open_entry, pin=_on_cuda(self.model_patcher))
        o = self.options
        fallback = (DenseProvider((self.block_size, self.block_size)) if o.miss_mode == "dense" else
                    OnlinePredictionProvider(self.block_size, o.top_p, o.min_density, o.max_density))
        self.entry_provider = BankEntryProvider(self.prefetch, self.sampling.steps, (self.block_size, self.block_size),
                                                fallback, run_sigmas=self.schedule.sigmas)
        return self.entry_provider

    def _miss_provider(self):
        o = self.options
        if o.miss_mode == "dense":
            self.report.mask_source = "dense"
            return DenseProvider((self.block_size, self.block_size))
        if o.miss_mode == "prior":
            prior = self._prior_provider()
            if prior is not None:
                return prior
        self.report.mask_source = "online prediction"
        return OnlinePredictionProvider(self.block_size, o.top_p, o.min_density, o.max_density)

    def _prior_provider(self):
        """The bank's stored population prior (built once per bank content), or None (then online)."""
        if self.match is None:
            return None
        request, bank, o, fingerprint = self.match.request, self.match.bank, self.options, self.fingerprint
        try:
            compatible = bounded(bank, lambda: bank.compatible_entries(fingerprint, request.layout,
                                                                       limit=PRIOR_ENTRIES))
        except Exception as exc:  # an unreadable index: predict online instead
            self.report.warnings.append(f"population prior unavailable: {exc}")
            return None
        if not compatible:
            return None
        self.report.mask_source = f"population prior of {len(compatible)} entries"
        return self._prefetched(lambda: _own_connection(
            bank, lambda own: load_prior(own, fingerprint, request.layout, o.min_density, o.max_density)))

    def _check_sampling_model(self) -> None:
        """A match made with another model than the one that samples can neither serve nor file this
        run: its entries are another model's masks, and a recording filed under the sampling model
        would never be found by that match (every run would miss and add one more entry)."""
        self.model_differs = self.match is not None and self.fingerprint != self.match.request.fingerprint
        if self.model_differs:
            self.report.warnings.append(
                "the sampler's model differs from the one Similarity Match was given (a LoRA or other weight patch "
                "added or removed between them), so this run is a miss and records nothing: wire the same model "
                "(with its LoRAs) into Similarity Match and the sampler")

    def _can_record(self) -> bool:
        return bool(self.match and self.options.record_on_miss and not self.match.bank.read_only
                    and not self.model_differs)

    def _make_recorder(self, first_step: int = 0) -> MaskRecorder:
        o = self.options
        # Accumulators live on the model's device, one step bucket at a time (float16 on a GPU:
        # 1.1 GB at 720p-14B), and each layer's masks are selected there as its bucket ends.
        plan = self.recording_plan
        return MaskRecorder(num_layers=len(self.model_patcher.model.diffusion_model.blocks),
                            step_buckets=recorded_steps(self.schedule.step_buckets, plan.steps_per_bucket,
                                                        first_step=first_step),
                            block_size=self.block_size, top_p=o.top_p, min_density=o.min_density,
                            max_density=o.max_density,
                            query_stride=plan.query_stride or _recording_query_stride(self.model_patcher))

    def progress(self, step_stats, run_stats) -> dict:
        """A per-step event for the web view: per-layer share of attention run sparse, so far."""
        return {"mode": self.report.mode, "step": len(run_stats.steps), "steps": self.sampling.steps,
                "layers": _layer_rows(run_stats), "density": _mean_density(run_stats)}

    def finish(self) -> RunReport:
        """Fill the report from the run's statistics; on a recorded miss queue the masks for the bank."""
        started = time.perf_counter()
        stats = self.stats
        self.report.layers, self.report.density = _layer_rows(stats), _mean_density(stats)
        self.report.timings["sampling_s"] = round(stats.seconds or 0.0, 3)
        self._time_steps(stats)
        self.report.warnings.extend(stats.warnings)
        self.report.backend = stats.backend
        self.report.dense_backend = stats.dense_backend
        self.report.warnings.extend(_feature_reuse_warnings(self.patched))
        if self.entry_provider is not None and self.entry_provider.failure is not None:
            self._report_fallback(self.entry_provider.failure)
        if self.prefetch is not None:
            self.prefetch.join()
            self.report.timings.update({f"prefetch_{k}": round(v, 2) if isinstance(v, float) else v
                                        for k, v in asdict(self.prefetch.timings).items()})
        if self.recording is not None:
            self._record()
        if self.match is not None:
            self.report.evictions = [e.to_json() for e in take_evictions(self.match.bank.label)]
        self.report.timings["finish_ms"] = round((time.perf_counter() - started) * 1e3, 2)
        return self.report

    def _time_steps(self, stats) -> None:
        """The run's own step times; a run with no dense step of its own (a hit sparse from its
        first step) is timed against the dense step of an earlier run of the same work."""
        timings = stats.step_timings()
        self.report.timings.update(timings)
        if self.match is None or stats.batch is None:
            return
        try:
            key = (self.fingerprint.key(), tuple(self.match.request.layout.grid), stats.batch)
        except Exception as exc:  # timing is a by-product: the finished generation stands
            self.report.warnings.append(f"step times not compared with an earlier run: {exc}")
            return
        if "dense_step_s" in timings:
            remember_dense_step(key, timings["dense_step_s"])
        elif "sparse_step_s" in timings and earlier_dense_step(key) is not None:
            self.report.timings["earlier_dense_step_s"] = earlier_dense_step(key)

    def _report_fallback(self, failure: str) -> None:
        fallback = "dense" if isinstance(self.entry_provider.fallback, DenseProvider) else "online prediction"
        was = self.report.entry_id or self.report.mask_source
        self.report.warnings.append(f"{self.report.mask_source} skipped: {failure}; ran as a miss ({fallback})")
        self.report.mode, self.report.mask_source = "miss", f"{fallback} ({was} unusable)"

    def _record(self) -> None:
        """Select on the device, copy packed bits to the host, spool them (fsynced), queue the write: the
        prompt's thread goes on; the report says queued only once the recording is on disk."""
        if self.recording.recorder is None and self.recording.error is None:  # a hit: see recorder_after_failure
            if self.entry_provider.failure is not None:
                self.report.warnings.append("masks not recorded: the bank entry failed after this run's first sparse "
                                            "step; this request will be recorded next time it misses")
            return
        if self.recording.error is not None:
            self.report.warnings.append(f"masks not recorded: {self.recording.error}")
            return
        started = time.perf_counter()
        try:
            recording = self._recording(self.recording.recorder.finish())
            state, warning = recording_queue.hand_over(self.match.bank, recording, after=self._prior_refresh())
            if state is not None:
                self.report.recorded_entry_id, self.report.recording = recording.entry_id, state
                self.report.merged_into = merged_into(recording.entry_id)
            if warning is not None:
                self.report.warnings.append(warning)
        except Exception as exc:  # the generation itself succeeded: keep it whatever the recorder says
            # a run made dense part-way (its reason is in the warnings) leaves steps unrecorded
            why = "this run went dense before its masks were recorded" if self.disabled else str(exc)
            self.report.warnings.append(f"masks not recorded: {why}")
            log.warning("Chorus: masks from this run were not recorded: %s", exc)
        self.report.timings["record_ms"] = round((time.perf_counter() - started) * 1e3, 2)

    def _recording(self, recorded) -> Recording:
        request, o = self.match.request, self.options
        # the model that sampled, not necessarily the match's; masks stay packed bits, never unpacked whole
        return Recording(entry_id=bank_writer.new_entry_id(), fingerprint=self.fingerprint, layout=request.layout,
                         schedule=self.schedule, signature=request.signature,
                         masks=PackedBlockMaps(recorded.packed, recorded.nk), density=recorded.density,
                         recall=recorded.mean_recall, tags=tuple(o.tags), model_files=tuple(o.model_files))

    def _prior_refresh(self):
        """The follow-up after the entry is in (prior-mode misses): a similar request waiting for
        the entry is not held up by the rebuild."""
        if self.options.miss_mode != "prior":
            return None
        bank, fingerprint, layout, o = self.match.bank, self.fingerprint, self.match.request.layout, self.options

        def refresh_prior():
            with bank.reopen() as writer_bank:
                load_prior(writer_bank, fingerprint, layout, o.min_density, o.max_density)

        return refresh_prior


REUSE_KEY = "chorus_reuse"


class ReusePatch:
    """Mask reuse as a MODEL patch: each sampling run with the patched model is one :class:`ReuseRun`.

    Installed as the sparse patch's :class:`~chorus_core.attention.mask_provider.RunSource`: the patch's one
    OUTER_SAMPLE wrapper asks :meth:`begin_run` for the run (a :class:`ReuseRun`, the run's one
    holder of state, its mask source chosen from the guider's own model and sigmas) and calls
    :meth:`end_run` after it: a successful run fills the report and queues a miss's recording.
    Both reuse nodes use it (the Sparse Wan Sampler installs it, then runs ``common_ksampler``), so
    any sampler runs the same reuse.

    :param events: optional object with ``run_start(report)``, ``step(payload)`` and
        ``finished(report)``, called for the web view
    :param scheduler: the scheduler's name when the caller knows it (recorded with an entry);
        else "sigmas"
    """

    patched = WeakModel()  # the clone install() made: it holds this patch, so held weakly here

    def __init__(self, model_patcher, match: ReuseMatch | None, options: ReuseOptions, block_size: int = 128,
                 events=None, scheduler: str = "sigmas", recording_plan: RecordingPlan = RecordingPlan(),
                 sampler: str | None = None):
        self.model_patcher, self.match, self.options, self.events = model_patcher, match, options, events
        self.block_size = (match.request.layout.block_size[0] if match else block_size,) * 2
        self.scheduler, self.sampler, self.recording_plan = scheduler, sampler, recording_plan
        self.patched = None
        self.current: ReuseRun | None = None
        self.last_run: ReuseRun | None = None
        self.last_report: RunReport | None = None

    def install(self, refuse_patched: bool = False):
        """A clone of the model with the hooks; the input model is unchanged. A model that already
        went through Chorus Sparse Attention gets this patch in place of that one, unless
        ``refuse_patched`` (the Sparse Wan Sampler: two reuse nodes on one path is a wiring mistake)."""
        if refuse_patched and get_reuse_patch(self.model_patcher) is not None:
            raise ValueError("This model already went through Chorus Sparse Attention, which runs the reuse itself: "
                             "sample it with KSampler (or any sampler), or leave that node out and keep the "
                             "Chorus Sparse Wan Sampler.")
        patched = install_sparse_attention(self.model_patcher, self, dense_attention=self.options.dense_attention,
                                           attention_precision=self.options.attention_precision)
        get_sparse_state(patched).on_step(self._on_step)
        patched.set_attachments(REUSE_KEY, self)
        self.patched = patched
        return patched

    def begin_run(self, sampling: SamplingCall, step_callbacks: list, dense_attention: str) -> ReuseRun:
        """This sampling run, its mask source chosen: a hit's entry, or a miss source (recorded when
        it may be), with the installed patch's step callbacks and dense attention."""
        started = time.perf_counter()
        steps = max(1, len(sampling.sigmas) - 1) if sampling.sigmas is not None else 1
        # The patched model may reach a second sampler on another latent (an upscale pass): that
        # sampling runs without the match (an online miss, nothing recorded), and says why.
        problem = None if sampling.latent_image is None else match_grid_problem(self.match, sampling.latent_image)
        # The guider's model, not the node's input: a LoRA or ModelSamplingSD3 placed after this
        # node is part of what samples, so of the hit check, the recorded shift and the entry's model.
        run = ReuseRun(sampling.model_patcher or self.model_patcher, None if problem else self.match, self.options,
                       SamplingSettings(steps, self.sampler or sampler_name(sampling.sampler), self.scheduler,
                                        sigma_schedule(sampling.sigmas)),
                       block_size=self.block_size[0], recording_plan=self.recording_plan,
                       step_callbacks=step_callbacks, dense_attention=dense_attention)
        if problem is not None:
            run.report.warnings.append(f"ran without the match, as a miss that records nothing: {problem}")
            log.warning("Chorus Sparse Attention: %s", run.report.warnings[-1])
        run.patched = self.patched  # for Feature Reuse's warnings, attached there
        self.current = self.last_run = run  # set first: end_run releases it if choosing fails halfway
        run.choose_provider()
        run.report.timings["prepare_ms"] = round((time.perf_counter() - started) * 1e3, 2)
        if self.events is not None:
            self.events.run_start(run.report)
        return run

    def end_run(self, succeeded: bool) -> None:
        run, self.current = self.current, None
        if run is None:
            return
        if not succeeded:
            # A failed run records nothing: its worker stops and its pinned host memory is freed at
            # once, and its recorder's accumulators (GB on a GPU at 720p) dropped, though last_run stays readable.
            if run.prefetch is not None:
                run.prefetch.cancel()
            run.recording = None
            return
        self.last_report = run.finish()
        if self.events is not None:
            self.events.finished(self.last_report)
        log.info("Chorus: %s run, %s; density %s", self.last_report.mode, self.last_report.mask_source,
                 self.last_report.density)

    def _on_step(self, step_stats, run_stats) -> None:
        if self.current is not None and self.events is not None:
            self.events.step(self.current.progress(step_stats, run_stats))


def nothing_sampled(steps: int) -> RunReport:
    """The report of a sampling that ran no step (denoise 0: ComfyUI returns the latent as it is)."""
    return RunReport(mode="miss", steps=0, mask_source="none",
                     warnings=[f"nothing was sampled (0 of {steps} steps: denoise 0), so nothing was reused or recorded"])


def get_reuse_patch(model_patcher) -> ReusePatch | None:
    """The ReusePatch a Chorus Sparse Attention node attached to this model (or a clone of it)."""
    patch = model_patcher.get_attachment(REUSE_KEY)
    return patch if isinstance(patch, ReusePatch) else None


def _feature_reuse_warnings(patched) -> list[str]:
    from ..guidance.feature_reuse import get_feature_reuse_state  # the optional node's state, if it is installed

    state = get_feature_reuse_state(patched) if patched is not None else None
    stats = getattr(state, "stats", None)
    return list(getattr(stats, "warnings", None) or [])


def _layer_rows(stats) -> list[dict]:
    rows = []
    for layer, s in sorted(stats.layers.items()):
        total = s.sparse_calls + s.dense_calls
        rows.append({"layer": layer, "sparse_share": s.sparse_calls / total if total else 0.0,
                     "density": s.mean_density})
    return rows


def _mean_density(stats) -> float | None:
    densities = [s.effective_density for s in stats.layers.values() if s.effective_density is not None]
    return round(sum(densities) / len(densities), 4) if densities else None


@contextlib.contextmanager
def _own_connection(bank, load):
    """``load(bank)`` on a new connection of this bank, kept open while the caller uses the result.

    SQLite (and psycopg) connections must not run two threads' statements at once, so the
    prefetch worker never uses the prompt thread's connection.
    """
    with bank.reopen() as own:
        yield load(own)


def _on_cuda(model_patcher) -> bool:
    return getattr(getattr(model_patcher, "load_device", None), "type", "cpu") == "cuda"


def _recording_query_stride(model_patcher) -> int:
    """Every 4th query estimates the block mass on a GPU: a quarter of the recording cost
    (tests/benchmarks/results/mask_costs_h200.md) for a block-mass error under 4e-4."""
    return 4 if _on_cuda(model_patcher) else 1
