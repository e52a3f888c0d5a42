"""The reuse loop's critical path, on the tiny Wan2.1-I2V model in process (CPU).

A hit is prefetched in a worker and served in the kernel's format with no host sync per call;
a recording miss hands its masks to a background writer and returns at once; the population
prior is a stored artefact rebuilt when the bank's content changes.
"""

import dataclasses
import math
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from conftest import REPO_ROOT

pytestmark = pytest.mark.comfy

BLOCK = 32
STEPS = 4  # default buckets at 4 steps: [0, 1), [1, 2), [2, 4)


def request(subject=0, template="pan"):
    from chorus_core.testbed.workload import I2VRequest, generate_request, i2v_conditioning

    return i2v_conditioning(generate_request(I2VRequest(template=template, subject=subject)))


def match_for(bank, patcher, positive, latent, threshold=0.9):
    from chorus_core.bank.signature import resolve_weights
    from chorus_core.reuse.reuse_match import build_match_request, match_request

    clip = positive[0][1]["clip_vision_output"]
    req = build_match_request(patcher, clip, positive, latent, None, threshold, resolve_weights(None), BLOCK)
    return match_request(bank, req)


def entry_masks(layers, heads, nq, buckets=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    maps = torch.rand(buckets, layers, heads, nq, nq, generator=generator) < 0.3
    return maps | torch.eye(nq, dtype=torch.bool)


@pytest.fixture()
def bank_with_entry(tmp_path, tiny_wan_patcher):
    """A bank holding one entry recorded for the default request, and that entry's masks."""
    from chorus_core.bank import MaskBank, Schedule

    positive, _, latent = request()
    bank = MaskBank.open(tmp_path / "bank")
    miss = match_for(bank, tiny_wan_patcher, positive, latent)
    req = miss.request
    model = tiny_wan_patcher.model.diffusion_model
    masks = entry_masks(len(model.blocks), model.num_heads, req.layout.blocks[0])
    bank.add_entry(req.fingerprint, req.layout, Schedule(steps=STEPS, sampler="euler", scheduler="simple"), masks,
                   req.signature, density=float(masks.float().mean()))
    yield bank, masks
    bank.close()


def run_generation(patcher, match, options=None, steps=STEPS, **segment):
    """``segment``: comfy.sample.sample's start_step / last_step, as KSamplerAdvanced passes them."""
    import comfy.sample

    from chorus_core.reuse.reuse_run import ReuseOptions, ReusePatch

    positive, negative, latent = request()
    # unless a test says otherwise, every step of a hit sparse (dense_last_steps 0), as the masks it compares
    options = options or ReuseOptions(dense_warmup_steps=1, dense_last_steps=0)
    patch = ReusePatch(patcher, match, options, block_size=BLOCK, scheduler="simple")
    patched = patch.install()
    noise = comfy.sample.prepare_noise(latent["samples"], 0)
    out = comfy.sample.sample(patched, noise, steps, 5.0, "euler", "simple", positive, negative, latent["samples"],
                              seed=0, disable_pbar=True, **segment)
    return out, patch.last_report, patch.last_run


# --------------------------------------------------------------------------------------------
# A hit
# --------------------------------------------------------------------------------------------


def test_each_sampling_run_has_one_holder_of_its_state(bank_with_entry, tiny_wan_patcher, monkeypatch):
    """The state every hook reads during a run (step, masks, statistics) and the reuse run that chose
    the masks, reports and records are one object, made anew for each sampling (EasyCache's pattern)."""
    from chorus_core.attention.sparse_run import SparseRun
    from chorus_core.reuse.reuse_run import ReuseRun

    seen = []
    real_record = SparseRun.record

    def recorded(self, layer, density):  # every attention call's statistics, planned or per call
        seen.append(self)
        return real_record(self, layer, density)

    monkeypatch.setattr(SparseRun, "record", recorded)
    bank, _ = bank_with_entry
    positive, _, latent = request()
    match = match_for(bank, tiny_wan_patcher, positive, latent)
    _, first, run = run_generation(tiny_wan_patcher, match)
    assert first.mode == "hit" and isinstance(run, ReuseRun)
    assert seen and all(holder is run for holder in seen)  # the hooks' run is the reuse run
    assert run.stats.finished and first.layers  # the report is read from the holder's own statistics
    _, _, again = run_generation(tiny_wan_patcher, match)
    assert again is not run and again.stats is not run.stats  # a new holder per sampling


def test_a_hit_is_decoded_by_the_worker_before_its_sparse_calls(bank_with_entry, tiny_wan_patcher, monkeypatch):
    """The worker thread decodes every layer (bucket by bucket, in order); each sparse call of the
    sampling thread gets its layer only once the worker has decoded it, never decoding itself."""
    from chorus_core.reuse import reuse_run
    from chorus_core.reuse.entry_prefetch import HostLayer

    bank, _ = bank_with_entry
    events, lock = [], threading.Lock()

    def log(*event):
        with lock:
            events.append((*event, threading.current_thread().name))

    real_from_packed = HostLayer.from_packed

    def logged_from_packed(packed, nk, pin):
        host = real_from_packed(packed, nk, pin)
        log("decoded layer")  # after the decode, before the worker publishes it
        return host

    real_prepared = reuse_run.BankEntryProvider.prepared_mask

    def logged_prepared(self, layer, step, *args):
        prepared = real_prepared(self, layer, step, *args)
        log("sparse call", self.step_bucket(step), layer)  # after any wait for the worker
        return prepared

    monkeypatch.setattr(HostLayer, "from_packed", staticmethod(logged_from_packed))
    monkeypatch.setattr(reuse_run.BankEntryProvider, "prepared_mask", logged_prepared)
    positive, _, latent = request()
    _, report, run = run_generation(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent))

    assert report.mode == "hit"
    layers = len(tiny_wan_patcher.model.diffusion_model.blocks)
    decoded = [e for e in events if e[0] == "decoded layer"]
    assert len(decoded) == 3 * layers and all(e[-1].startswith("chorus-entry-") for e in decoded)  # worker or its pool
    calls = [(i, e) for i, e in enumerate(events) if e[0] == "sparse call"]
    assert calls and {e[-1] for _, e in calls} == {"MainThread"}
    assert sorted({e[1] for _, e in calls}) == [0, 1, 2]  # a hit runs sparse from step 0 (hit_warmup_steps=0)
    for i, (_, bucket, layer, _) in calls:  # layer l of bucket b is the (b * layers + l + 1)-th decode
        assert sum(1 for e in events[:i] if e[0] == "decoded layer") >= bucket * layers + layer + 1
    assert len(report.timings["prefetch_buckets"]) == 3 and "prefetch_wait_ms" in report.timings


def test_a_prefetched_hit_computes_what_the_same_masks_give_as_block_maps(bank_with_entry, tiny_wan_patcher):
    """The worker's live-block lists are the entry's masks: same latents as a plain block-map provider."""
    import comfy.sample

    from chorus_core.attention.mask_provider import DenseWarmupProvider, StaticBlockMapProvider
    from chorus_core.attention.sparse_patch import install_sparse_attention

    bank, masks = bank_with_entry
    positive, negative, latent = request()
    hit_latent, report, _ = run_generation(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent))
    assert report.mode == "hit" and report.warnings == []

    starts = [0, 1, 2]  # the entry's buckets at 4 steps
    maps = [{layer: masks[b, layer][None] for layer in range(masks.shape[1])} for b in range(3)]
    provider = DenseWarmupProvider(StaticBlockMapProvider(maps, (BLOCK, BLOCK), starts), warmup_steps=0)
    patched = install_sparse_attention(tiny_wan_patcher, provider)
    noise = comfy.sample.prepare_noise(latent["samples"], 0)
    expected = comfy.sample.sample(patched, noise, STEPS, 5.0, "euler", "simple", positive, negative,
                                   latent["samples"], seed=0, disable_pbar=True)
    assert torch.equal(hit_latent, expected)


class HostSyncCounter:
    """Counts tensor-to-host conversions made by Chorus code (chorus_core/, kernels/) while armed."""

    METHODS = ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__")

    def __init__(self, monkeypatch):
        self.armed, self.count, self.where = False, 0, []
        for name in self.METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name), name))

    def _counting(self, original, name):
        counter = self

        def counted(tensor, *args, **kwargs):
            if counter.armed:
                caller = sys._getframe(1).f_code.co_filename
                if f"{os.sep}chorus_core{os.sep}" in caller or f"{os.sep}kernels{os.sep}" in caller:
                    counter.count += 1
                    counter.where.append(f"{name} in {caller}:{sys._getframe(1).f_lineno}")
            return original(tensor, *args, **kwargs)

        return counted


def test_a_hit_makes_no_host_sync_inside_its_model_calls(bank_with_entry, tiny_wan_patcher, monkeypatch):
    """A hit's masks are planned before each model call (APPLY_MODEL wrapper): inside the
    diffusion model (block patches, attention override, kernels) Chorus reads nothing back."""
    from chorus_core.attention import sparse_patch

    bank, _ = bank_with_entry
    counter = HostSyncCounter(monkeypatch)
    per_call, planned = [], []
    real_wrapper, real_plan = sparse_patch._make_video_tokens_wrapper, sparse_patch.SparseRun.plan_call

    def counted_wrapper(key):
        inner = real_wrapper(key)

        def counted(executor, *args, **kwargs):
            counter.armed, before = True, counter.count
            try:
                return inner(executor, *args, **kwargs)
            finally:
                counter.armed = False
                per_call.append(counter.count - before)

        return counted

    def noted_plan(self, options, x, model):
        plan = real_plan(self, options, x, model)
        planned.append(plan is not None)
        return plan

    monkeypatch.setattr(sparse_patch, "_make_video_tokens_wrapper", counted_wrapper)
    monkeypatch.setattr(sparse_patch.SparseRun, "plan_call", noted_plan)
    positive, _, latent = request()
    _, report, _ = run_generation(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent))
    assert report.mode == "hit"
    assert len(per_call) == len(planned) > 0 and all(planned)
    assert sum(per_call) == 0, counter.where


def test_an_entry_that_cannot_serve_turns_the_run_into_an_online_miss(bank_with_entry, tiny_wan_patcher):
    bank, _ = bank_with_entry
    positive, _, latent = request()
    match = match_for(bank, tiny_wan_patcher, positive, latent)
    blob = bank.blob_path(bank.show(match.result.entry_id)["blob_name"])
    blob.write_bytes(blob.read_bytes()[:50])  # damaged after the match, before the worker reads it
    out, report, _ = run_generation(tiny_wan_patcher, match)
    assert report.mode == "miss" and report.mask_source.startswith("online prediction")
    assert len([w for w in report.warnings if "skipped" in w]) == 1
    assert torch.isfinite(out).all()
    sparse = sum(row["sparse_share"] > 0 for row in report.layers)
    assert sparse == len(report.layers)  # online prediction served the steps after the warm-up


@pytest.mark.parametrize("hit_warmup_steps, recorded_buckets", [
    (0, [[0, 1], [1, 2], [2, 4]]),  # a hit sparse from step 0 finds the damage there and records it all
    (1, [[0, 2], [2, 4]]),  # its dense warm-up step ran before the load failed: bucket [0, 1) joins the next
])
def test_a_hit_on_a_damaged_entry_records_the_request_again(tmp_path, tiny_wan_patcher, hit_warmup_steps,
                                                            recorded_buckets):
    """The run that finds its entry damaged goes on as a miss and records it: the next one hits."""
    from chorus_core.reuse import bank_writer
    from chorus_core.bank import MaskBank
    from chorus_core.reuse.reuse_run import ReuseOptions

    options = ReuseOptions(dense_warmup_steps=1, hit_warmup_steps=hit_warmup_steps)

    positive, _, latent = request()
    with MaskBank.open(tmp_path / "bank") as bank:
        _, first, _ = run_generation(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent))
        assert first.mode == "miss" and bank_writer.flush_all(timeout=60)
        match = match_for(bank, tiny_wan_patcher, positive, latent)
        assert match.result.entry_id == first.recorded_entry_id
        blob = bank.blob_path(bank.show(first.recorded_entry_id)["blob_name"])
        blob.write_bytes(blob.read_bytes()[:50])  # damaged after the match, before the worker reads it
        with pytest.warns(UserWarning, match="quarantining entry .*run as an online-prediction miss"):
            _, second, _ = run_generation(tiny_wan_patcher, match, options)
        assert second.mode == "miss" and second.recording == "queued", second.warnings
        assert bank_writer.flush_all(timeout=60) and bank.stats()["entries"] == 1
        assert bank.show(second.recorded_entry_id)["step_buckets"] == recorded_buckets
        _, third, _ = run_generation(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent))
    assert third.mode == "hit" and third.entry_id == second.recorded_entry_id and third.warnings == []


# --------------------------------------------------------------------------------------------
# A recording miss
# --------------------------------------------------------------------------------------------


def test_a_recording_miss_returns_before_its_entry_is_written(tmp_path, tiny_wan_patcher, monkeypatch):
    """A deliberately stuck disk: finish() returns, the next (dissimilar) request matches at once,
    a similar request waits for the write and then hits it."""
    from chorus_core.reuse import bank_writer
    from chorus_core.bank import MaskBank
    from chorus_core.bank import sqlite_store

    gate = threading.Event()
    real_write_blob = sqlite_store.SQLiteBank._write_blob

    def slow_write_blob(self, *args, **kwargs):
        assert gate.wait(60), "the test never opened the gate"
        return real_write_blob(self, *args, **kwargs)

    monkeypatch.setattr(sqlite_store.SQLiteBank, "_write_blob", slow_write_blob)
    try:
        bank = MaskBank.open(tmp_path / "bank")
        positive, _, latent = request()
        _, report, _ = run_generation(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent))
        assert report.mode == "miss" and report.recording == "queued"
        writer = bank_writer.default_writer()
        assert [p.entry_id for p in writer.pending(bank.label)] == [report.recorded_entry_id]
        assert bank.stats()["entries"] == 0

        other_positive, _, other_latent = request(subject=3, template="orbit")
        other = match_for(bank, tiny_wan_patcher, other_positive, other_latent, threshold=0.999)
        assert not other.result.hit and writer.pending(bank.label)  # matched without waiting for the write

        found = {}
        waiter = threading.Thread(target=lambda: found.update(m=match_for(bank, tiny_wan_patcher, positive, latent)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # a similar request waits for the pending entry...
        gate.set()
        waiter.join(60)
        assert found["m"].result.hit and found["m"].result.entry_id == report.recorded_entry_id  # ...then hits it
        assert writer.outcome(report.recorded_entry_id).error is None
    finally:
        gate.set()  # never leave the process's writer stuck for the tests after this one
        assert bank_writer.flush_all(timeout=60)


def test_a_finished_write_releases_its_masks(tmp_path, tiny_wan_patcher):
    import gc
    import weakref

    from chorus_core.reuse import bank_writer
    from chorus_core.bank import MaskBank
    from chorus_core.bank.encoding import PackedBlockMaps

    created = []
    real_init = PackedBlockMaps.__init__

    def tracked_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        created.append(weakref.ref(self))

    PackedBlockMaps.__init__ = tracked_init
    try:
        bank = MaskBank.open(tmp_path / "bank")
        positive, _, latent = request()
        _, report, _ = run_generation(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent))
    finally:
        PackedBlockMaps.__init__ = real_init
    assert bank_writer.flush_all(timeout=60) and bank.stats()["entries"] == 1
    del report
    gc.collect()
    assert created and all(ref() is None for ref in created)  # 210 MB per 720p recording must not pile up


_KILLED_WRITER = r"""
import sys
sys.path[:0] = [{repo!r}, {tests!r}]
from bank_fixtures import FP, LAYOUT, SCHEDULE, toy_masks, toy_signature
from chorus_core.reuse import bank_writer
from chorus_core.bank import MaskBank
def write():
    with MaskBank.open({bank!r}) as bank:
        bank.add_entry(FP, LAYOUT, SCHEDULE, toy_masks(), toy_signature(), 0.3, entry_id="ab" * 16)
item = bank_writer.PendingWrite({bank!r}, "ab" * 16, "x", None, write)
bank_writer.default_writer().submit(item)
item.done.wait(60)
print("not killed", item.error)
"""


def test_a_writer_killed_mid_write_leaves_no_partial_entry(tmp_path):
    from chorus_core.bank import MaskBank

    bank_dir = tmp_path / "bank"
    MaskBank.open(bank_dir).close()
    code = _KILLED_WRITER.format(repo=str(REPO_ROOT), tests=str(REPO_ROOT / "tests"), bank=str(bank_dir))
    env = {**os.environ, "CHORUS_BANK_FAULT": "add-before-commit"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr
    with MaskBank.open(bank_dir) as bank:
        assert bank.stats()["entries"] == 0 and bank.entries() == []
        report = bank.verify()
        assert report["quarantined"] == []


# --------------------------------------------------------------------------------------------
# The population prior
# --------------------------------------------------------------------------------------------


def test_the_prior_is_stored_once_and_rebuilt_after_add_and_prune(bank_with_entry, tiny_wan_patcher, monkeypatch):
    from chorus_core.reuse import prior_store
    from chorus_core.bank import Schedule
    from chorus_core.reuse.population_prior import population_prior
    from chorus_core.reuse.prior_store import PRIORS_DIR, load_prior

    bank, masks = bank_with_entry
    positive, _, latent = request()
    req = match_for(bank, tiny_wan_patcher, positive, latent).request
    prior = load_prior(bank, req.fingerprint, req.layout, 0.05, 0.9)
    files = sorted((bank.root / PRIORS_DIR).glob("*.safetensors"))
    assert len(files) == 1
    only = [masks[0, 0]]
    assert torch.equal(prior.block_map(0, 0), population_prior(only, only[0].float().mean().item()))

    builds = []
    real_build = prior_store.build_prior
    monkeypatch.setattr(prior_store, "build_prior", lambda *a: builds.append(a) or real_build(*a))
    again = load_prior(bank, req.fingerprint, req.layout, 0.05, 0.9)
    other_clamp = load_prior(bank, req.fingerprint, req.layout, 0.1, 0.5)
    assert load_prior(bank, req.fingerprint, req.layout, 0.05, 0.9) is not None
    assert len(builds) == 1  # the first prior was read back; only the other clamp was built
    assert len(list((bank.root / PRIORS_DIR).glob("*.safetensors"))) == 2  # priors of one content coexist
    assert torch.equal(again.block_map(2, 1), prior.block_map(2, 1)) and other_clamp is not None
    files = sorted((bank.root / PRIORS_DIR).glob("*.safetensors"))

    # a write that leaves the members as they were (an entry of another model) keeps the prior
    other_model = dataclasses.replace(req.fingerprint, digest="0" * 64)
    bank.add_entry(other_model, req.layout, Schedule(steps=STEPS), masks, req.signature, density=0.3)
    load_prior(bank, req.fingerprint, req.layout, 0.05, 0.9)
    assert len(builds) == 1 and sorted((bank.root / PRIORS_DIR).glob("*.safetensors")) == files

    second = entry_masks(masks.shape[1], masks.shape[2], masks.shape[3], seed=1)
    bank.add_entry(req.fingerprint, req.layout, Schedule(steps=STEPS), second, req.signature, density=0.3)
    rebuilt = load_prior(bank, req.fingerprint, req.layout, 0.05, 0.9)
    after_add = sorted((bank.root / PRIORS_DIR).glob("*.safetensors"))
    # a new member: a new file replaces this clamp's; the other clamp's waits until it is asked for
    assert len(after_add) == 2 and len(set(after_add) - set(files)) == 1
    both = [masks[1, 0], second[1, 0]]
    density = sum(m.float().mean().item() for m in both) / 2
    assert torch.equal(rebuilt.block_map(1, 0), population_prior(both, density))

    bank.prune(max_entries=1)
    load_prior(bank, req.fingerprint, req.layout, 0.05, 0.9)
    after_prune = sorted((bank.root / PRIORS_DIR).glob("*.safetensors"))
    assert len(after_prune) == 2 and after_prune != after_add


def test_prior_mode_serves_the_stored_prior_through_the_prefetch(bank_with_entry, tiny_wan_patcher):
    from chorus_core.reuse.reuse_run import ReuseOptions

    bank, _ = bank_with_entry
    positive, _, latent = request(subject=3, template="orbit")
    match = match_for(bank, tiny_wan_patcher, positive, latent, threshold=0.9999)
    assert not match.result.hit
    _, report, run = run_generation(tiny_wan_patcher, match,
                                    ReuseOptions(dense_warmup_steps=1, miss_mode="prior", record_on_miss=False))
    assert report.mode == "miss" and report.mask_source == "population prior of 1 entries"
    assert report.warnings == [] and run.prefetch is not None
    assert all(row["sparse_share"] > 0 for row in report.layers)


# --------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------


def test_a_host_layer_uploads_to_the_kernels_own_mask_of_the_same_map():
    """Packed bits + host row counts -> live lists on the device: the mask block_map_to_mask makes."""
    from chorus_core.reuse.entry_prefetch import HostLayer
    from kernels.block_sparse import block_map_to_mask

    maps = entry_masks(1, 3, 7, buckets=1)[0, 0]  # [H, nq, nk]
    host = HostLayer.from_packed(np.packbits(maps.numpy(), axis=-1), 7, pin=False)
    expected = block_map_to_mask(maps[None], 16, 16, 7 * 16)
    got = host.to_device(7, (16, 16), 7 * 16, "cpu").mask
    assert torch.equal(got.live_counts, expected.live_counts)
    assert torch.equal(got.live_blocks, expected.live_blocks)
    assert host.density == pytest.approx(float(maps.float().mean()))
    with pytest.raises(ValueError, match="no key block"):
        HostLayer.from_packed(np.zeros((1, 2, 1), dtype=np.uint8), 2, pin=False)


def _entry_of(maps, on_corrupt=None, damaged_layer=None):
    """A real EntryMasks of ``maps`` (bool [S, L, H, nq, nk]) through the bank's codec; with
    ``damaged_layer``, that layer of bucket 0 inflates to a map whose rows keep nothing."""
    import zlib

    from chorus_core.bank.encoding import encode_masks
    from chorus_core.bank.entry_masks import EntryMasks
    from chorus_core.bank.records import LatentLayout, Schedule

    tensors, meta = encode_masks(maps)
    if damaged_layer is not None:
        heads, nq, nk = maps.shape[2:]
        empty = zlib.compress(bytes(heads * nq * -(-nk // 8)))
        tensors[f"b0.l{damaged_layer}.p"] = np.frombuffer(empty, dtype=np.uint8).copy()
    schedule = Schedule(steps=STEPS, sampler="euler", scheduler="simple")
    return EntryMasks("e1", schedule, LatentLayout((2, 4, 4)), tensors, meta, on_corrupt)


def _prefetched_masks(entry, threads):
    from contextlib import nullcontext

    from chorus_core.reuse.entry_prefetch import EntryPrefetch

    prefetch = EntryPrefetch(lambda: nullcontext(entry), decode_threads=threads)
    layers = entry.shape[1]
    got = [[prefetch.layer_mask(b, layer, (16, 16), entry.shape[-1] * 16, "cpu").mask for layer in range(layers)]
           for b in range(entry.shape[0])]
    prefetch.join()
    return got, prefetch.timings


@pytest.mark.parametrize("threads", [2, 5])
def test_a_pool_of_decode_threads_serves_what_one_thread_serves(threads):
    """Several layer sets decoded at once: the same masks, each bucket timed, bucket 0's readiness recorded."""
    maps = entry_masks(layers=6, heads=3, nq=9, buckets=3, seed=4).numpy()
    serial, _ = _prefetched_masks(_entry_of(maps), 1)
    pooled, timings = _prefetched_masks(_entry_of(maps), threads)
    for one, many in zip(sum(serial, []), sum(pooled, [])):
        assert torch.equal(one.live_blocks, many.live_blocks) and torch.equal(one.live_counts, many.live_counts)
    assert timings.decode_threads == threads and len(timings.buckets) == 3
    assert 0 < timings.first_bucket_ms and timings.load_ms <= timings.first_bucket_ms


def test_a_damaged_layer_found_by_the_pool_quarantines_once_from_the_worker_thread():
    """The pool's threads never touch the bank: the worker reports the damage, once, and the
    sampling thread is told the entry cannot serve (the run goes on as a miss)."""
    from chorus_core.bank.errors import BankEntryCorrupt

    reports = []

    def on_corrupt(reason):
        reports.append((reason, threading.current_thread().name))
        raise BankEntryCorrupt("e1", reason)

    maps = entry_masks(layers=6, heads=3, nq=9, buckets=3, seed=5).numpy()
    with pytest.raises(RuntimeError, match="could not be loaded: .*bucket 0 layer 3 unusable"):
        _prefetched_masks(_entry_of(maps, on_corrupt, damaged_layer=3), 4)
    assert [name for _, name in reports] == ["chorus-entry-prefetch"]


def test_packed_bits_round_trip_and_match_numpy():
    from chorus_core.attention.masks import pack_bits, unpack_bits

    maps = torch.rand(2, 3, 5, 13) < 0.4
    packed = pack_bits(maps)
    assert packed.shape == (2, 3, 5, 2)
    assert np.array_equal(packed.numpy(), np.packbits(maps.numpy(), axis=-1))
    assert torch.equal(unpack_bits(packed, 13), maps)


def test_the_recorder_keeps_only_the_bucket_in_flight():
    from chorus_core.attention.masks import MaskRecorder

    recorder = MaskRecorder(num_layers=2, step_buckets=[[0, 1], [2]], block_size=16)
    q = torch.randn(1, 64, 2 * 8)
    for step in (0, 1, 2):
        for layer in (0, 1):
            recorder.record(layer, step, q, q, heads=2)
        in_flight = {bucket for bucket, _ in recorder._sums}
        assert in_flight == ({0} if step == 0 else set())
    out = recorder.finish()
    assert out.packed.shape == (2, 2, 2, 4, 1) and out.block_maps.shape == (2, 2, 2, 4, 4)
    assert out.density == pytest.approx(float(out.block_maps.float().mean()))
    assert math.isfinite(out.mean_recall)


# --------------------------------------------------------------------------------------------
# Which steps run dense, and why (issue [few-step])
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, dense_steps", [
    ({"dense_last_steps": 0}, {}),  # a hit's entry holds step 0's masks: sparse from the first step
    ({"hit_warmup_steps": 1, "dense_last_steps": 0}, {"0": "dense warm-up of a hit (hit_warmup_steps=1)"}),
    ({}, {"3": "one of the last steps kept dense (dense_last_steps=1)"}),  # the default
])
def test_a_hit_runs_sparse_from_its_first_step_unless_told_otherwise(bank_with_entry, tiny_wan_patcher, options,
                                                                      dense_steps):
    from chorus_core.reuse.reuse_run import ReuseOptions

    bank, _ = bank_with_entry
    positive, _, latent = request()
    _, report, _ = run_generation(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent),
                                  ReuseOptions(dense_warmup_steps=1, **options))
    assert report.mode == "hit" and report.dense_steps == dense_steps
    share = (STEPS - len(dense_steps)) / STEPS
    assert [layer["sparse_share"] for layer in report.layers] == [share] * len(report.layers)


def test_a_miss_keeps_its_dense_warm_up_and_the_last_steps_asked_for(tiny_wan_patcher):
    from chorus_core.reuse.reuse_run import ReuseOptions

    _, report, _ = run_generation(tiny_wan_patcher, None, ReuseOptions(dense_warmup_steps=1, dense_last_steps=2))
    assert report.mode == "miss"
    assert report.dense_steps == {"0": "dense warm-up of a miss (dense_warmup_steps=1)",
                                  "2": "one of the last steps kept dense (dense_last_steps=2)",
                                  "3": "one of the last steps kept dense (dense_last_steps=2)"}
    assert [layer["sparse_share"] for layer in report.layers] == [0.25] * len(report.layers)


def test_only_the_run_that_ends_the_denoising_keeps_its_last_step_dense(tiny_wan_patcher):
    """Wan 2.2's two experts split one schedule (KSamplerAdvanced: steps 0-1, then 2-3): the
    high-noise half stops at a sigma above 0 and has no last step to keep dense; the low-noise half
    ends the denoising, so its last step (the schedule's last) runs dense: one dense step in four,
    as with one sampler, not two."""
    from chorus_core.reuse.reuse_run import ReuseOptions

    options = ReuseOptions(dense_warmup_steps=1, dense_last_steps=1)
    _, high, _ = run_generation(tiny_wan_patcher, None, options, last_step=2)
    _, low, _ = run_generation(tiny_wan_patcher, None, options, start_step=2)
    warm_up = {"0": "dense warm-up of a miss (dense_warmup_steps=1)"}
    assert (high.mode, high.steps) == ("miss", 2) and high.dense_steps == warm_up
    assert low.dense_steps == {**warm_up, "1": "one of the last steps kept dense (dense_last_steps=1)"}


def test_the_last_step_runs_dense_unless_told_otherwise():
    from chorus_core.reuse.reuse_run import ReuseOptions

    assert ReuseOptions().dense_last_steps == 1


@pytest.mark.parametrize("name", ["dense_warmup_steps", "hit_warmup_steps", "dense_last_steps"])
def test_negative_dense_step_counts_are_refused(name):
    from chorus_core.reuse.reuse_run import ReuseOptions

    with pytest.raises(ValueError, match=f"{name} must be 0 or more"):
        ReuseOptions(**{name: -1})


def test_a_waiting_request_is_released_before_the_prior_refresh():
    """The entry's write sets ``done`` (what wait_for_similar waits for); the prior's refresh runs
    after it, and flush waits for both."""
    import threading

    from chorus_core.reuse import bank_writer

    writer = bank_writer.BankWriter()
    release, order = threading.Event(), []
    item = bank_writer.PendingWrite("bank", "cd" * 16, "x", None, write=lambda: order.append("entry"),
                                    after=lambda: (release.wait(30), order.append("prior")))
    assert writer.submit(item)
    assert item.done.wait(30) and order == ["entry"]  # released while the refresh is still running
    assert not item.settled.is_set() and writer.pending() == []
    assert writer.flush(timeout=0.2) is False  # the refresh is not finished
    release.set()
    assert writer.flush(timeout=30) and item.settled.is_set() and order == ["entry", "prior"]

    failing = bank_writer.PendingWrite("bank", "ef" * 16, "x", None, write=lambda: 1 / 0,
                                       after=lambda: order.append("never"))
    assert writer.submit(failing) and writer.flush(timeout=30)
    assert failing.error.startswith("ZeroDivisionError") and "never" not in order  # no refresh without an entry
