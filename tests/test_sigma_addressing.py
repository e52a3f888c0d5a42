"""A hit addresses its entry's masks by noise level, not by step index (issue 24 item 2).

An entry keeps the sigma schedule it was recorded on; each step of a later run gets the bucket
recorded at its own sigma: a 4-step run served from an 8-step entry, the second stage of a
KSamplerAdvanced split, and a run with denoise < 1 all land on the full schedule's buckets.
Tiny Wan2.1-I2V in process, on the CPU.
"""

import pytest

from test_reuse_loop import BLOCK, match_for, request

pytestmark = pytest.mark.comfy


def schedule_sigmas(patcher, steps, scheduler="simple", denoise=1.0):
    """The sigmas ComfyUI's KSampler hands the sampler (denoise < 1: the tail of a longer schedule)."""
    import comfy.samplers

    sampling = patcher.get_model_object("model_sampling")
    if denoise >= 1.0:
        return [float(s) for s in comfy.samplers.calculate_sigmas(sampling, scheduler, steps)]
    full = comfy.samplers.calculate_sigmas(sampling, scheduler, int(steps / denoise))
    return [float(s) for s in full[-(steps + 1):]]


def reuse_patch(model, match, **options):
    """Every step of a hit sparse (dense_last_steps 0), so each step's bucket is the entry's."""
    from chorus_core.reuse.reuse_run import ReuseOptions, ReusePatch

    options = {"dense_warmup_steps": 1, "dense_last_steps": 0, **options}
    return ReusePatch(model, match, ReuseOptions(**options), block_size=BLOCK, scheduler="simple")


def ksampler(patched, steps, denoise=1.0, start=None, end=None, latent=None):
    """KSampler (or KSamplerAdvanced with start/end) on the default request; returns its latent dict."""
    import nodes as comfy_nodes

    positive, negative, default_latent = request()
    latent = latent or default_latent
    if start is None:
        (out,) = comfy_nodes.KSampler().sample(patched, 0, steps, 5.0, "euler", "simple", positive, negative, latent,
                                               denoise=denoise)
        return out
    (out,) = comfy_nodes.KSamplerAdvanced().sample(patched, "enable" if start == 0 else "disable", 0, steps, 5.0,
                                                   "euler", "simple", positive, negative, latent, start, end,
                                                   "enable" if end < steps else "disable")
    return out


@pytest.fixture()
def recorded(tmp_path, tiny_wan_patcher):
    """A bank holding one entry recorded by an 8-step miss, and that entry's schedule."""
    from chorus_core.reuse import bank_writer
    from chorus_core.bank import MaskBank

    bank = MaskBank.open(tmp_path / "bank")
    positive, _, latent = request()
    patch = reuse_patch(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent))
    ksampler(patch.install(), 8)
    assert patch.last_report.recording == "queued" and bank_writer.flush_all(timeout=60)
    entry = bank.load_masks(patch.last_report.recorded_entry_id, record_hit=False)
    yield bank, entry.schedule
    bank.close()


def hit_buckets(bank, patcher, **run):
    """The entry bucket each step of a hit used, and the run's report."""
    positive, _, latent = request()
    patch = reuse_patch(patcher, match_for(bank, patcher, positive, latent))
    ksampler(patch.install(), **run)
    assert patch.last_report.mode == "hit", patch.last_report.warnings
    return patch.last_run.entry_provider.step_buckets, patch.last_report


def test_an_entry_keeps_the_sigma_schedule_it_was_recorded_on(recorded, tiny_wan_patcher):
    bank, schedule = recorded
    assert schedule.steps == 8 and schedule.scheduler == "simple"
    assert schedule.sigmas == pytest.approx(schedule_sigmas(tiny_wan_patcher, 8), rel=1e-6)
    assert schedule.step_buckets == [(0, 2), (2, 5), (5, 8)]


def test_a_four_step_hit_gets_the_buckets_recorded_at_its_own_sigmas(recorded, tiny_wan_patcher):
    from chorus_core.reuse.entry_source import entry_buckets_for_run

    bank, schedule = recorded
    four = schedule_sigmas(tiny_wan_patcher, 4)
    buckets, report = hit_buckets(bank, tiny_wan_patcher, steps=4)
    assert buckets == [schedule.bucket_for_sigma(s) for s in four[:4]]
    assert buckets == entry_buckets_for_run(schedule, 4, tuple(four))
    assert buckets[0] == 0 and buckets[-1] == 2 and buckets == sorted(buckets)
    assert report.dense_steps == {}  # a hit is sparse from its first step


def test_the_second_stage_of_a_split_sampling_uses_the_full_schedules_late_buckets(recorded, tiny_wan_patcher):
    """KSamplerAdvanced 8 steps split at step 5: the second stage runs 3 steps whose sigmas are
    the full schedule's last three, so it gets the last bucket, not the first ones."""
    bank, schedule = recorded
    buckets, report = hit_buckets(bank, tiny_wan_patcher, steps=8, start=5, end=8)
    assert report.steps == 3 and buckets == [2, 2, 2]


def test_a_run_with_denoise_below_one_starts_at_its_own_noise_level(recorded, tiny_wan_patcher):
    bank, schedule = recorded
    sigmas = schedule_sigmas(tiny_wan_patcher, 4, denoise=0.5)
    buckets, _ = hit_buckets(bank, tiny_wan_patcher, steps=4, denoise=0.5)
    assert buckets == [schedule.bucket_for_sigma(s) for s in sigmas[:4]] and buckets[0] > 0


def test_an_entry_without_sigmas_is_served_by_rescaled_step_index():
    from chorus_core.bank import Schedule
    from chorus_core.reuse.entry_source import entry_buckets_for_run

    old = Schedule(steps=8, sampler="euler", scheduler="simple")  # recorded before sigmas were kept
    assert entry_buckets_for_run(old, 4, (1.0, 0.75, 0.5, 0.25, 0.0)) == [0, 1, 2, 2]  # starts 0, 2, 5 -> 0, 1, 2


@pytest.mark.parametrize("sigmas", [[0.2, 0.5, 0.9], [0.7]], ids=["rising (FlipSigmas)", "one sigma (a split's end)"])
def test_sigmas_an_entry_cannot_address_by_still_sample(tiny_wan_patcher, sigmas):
    """A schedule the bank cannot address by (unsampling, the end of a split) samples as before, by
    step index, and says so; it never fails the prompt."""
    import comfy.sample
    import comfy.samplers
    import torch

    from chorus_core.reuse.reuse_run import get_reuse_patch

    positive, negative, latent = request()
    patched = reuse_patch(tiny_wan_patcher, None).install()
    guider = comfy.samplers.CFGGuider(patched)
    guider.set_conds(positive, negative)
    guider.set_cfg(5.0)
    noise = comfy.sample.prepare_noise(latent["samples"], 0)
    out = guider.sample(noise, latent["samples"], comfy.samplers.sampler_object("euler"), torch.tensor(sigmas),
                        seed=0, disable_pbar=True)
    report = get_reuse_patch(patched).last_report
    assert torch.isfinite(out).all() and report.steps == max(1, len(sigmas) - 1)
    assert any("cannot address bank entries" in w for w in report.warnings)


def test_an_entry_serves_runs_sampled_at_most_as_finely_as_it_was_recorded():
    """Measured on the sharp16k weights (schedule_transfer_sharp16k_cpu.md): 4 steps from a 20-step
    entry lost nothing, 20 steps from a 4-step entry lost 7.1 dB. Counted inside the run's own
    noise range, so the late stage of a split run is served by the full schedule's entry."""
    from chorus_core.bank import Schedule
    from chorus_core.reuse.entry_source import schedule_shortfall

    def sigmas(steps):
        return tuple(1.0 - i / steps for i in range(steps + 1))

    twenty, four = Schedule(steps=20, sigmas=sigmas(20)), Schedule(steps=4, sigmas=sigmas(4))
    assert schedule_shortfall(twenty, 4, sigmas(4)) is None
    assert schedule_shortfall(four, 4, sigmas(4)) is None
    reason = schedule_shortfall(four, 20, sigmas(20))
    assert "recorded on 4 steps in this run's noise range" in reason and "samples 20" in reason
    assert schedule_shortfall(twenty, 5, sigmas(20)[15:]) is None  # the last 5 of the 20: recorded there
    assert schedule_shortfall(four, 5, sigmas(20)[15:]) is not None  # one recorded step in that range
    assert schedule_shortfall(Schedule(steps=8), 8) is None and schedule_shortfall(Schedule(steps=8), 9)  # no sigmas


def test_a_run_finer_than_its_entry_misses_records_and_the_next_one_hits_its_own(recorded, tiny_wan_patcher):
    from chorus_core.reuse import bank_writer

    bank, _ = recorded  # one entry recorded at 8 steps
    positive, _, latent = request()
    patch = reuse_patch(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent))
    ksampler(patch.install(), 16)
    finer = patch.last_report
    assert finer.mode == "miss" and finer.recording == "queued" and finer.entry_id is None
    assert list(finer.dense_steps) == ["0"]  # a plain miss, with its dense warm-up: the entry was never loaded
    assert any("recorded on 8 steps" in w and "samples 16" in w and w.endswith("for its own schedule")
               for w in finer.warnings), finer.warnings
    assert bank_writer.flush_all(timeout=60)

    patch = reuse_patch(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent))
    ksampler(patch.install(), 16)
    assert patch.last_report.mode == "hit" and patch.last_report.entry_id == finer.recorded_entry_id
    assert bank.entry_schedule(patch.last_report.entry_id).steps == 16

    buckets, report = hit_buckets(bank, tiny_wan_patcher, steps=4)  # coarser runs still hit either entry
    assert report.mode == "hit"


def test_a_finer_run_that_may_not_record_says_it_records_nothing(recorded, tiny_wan_patcher):
    bank, _ = recorded  # one entry recorded at 8 steps
    positive, _, latent = request()
    patch = reuse_patch(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent), record_on_miss=False)
    ksampler(patch.install(), 16)
    report = patch.last_report
    assert report.mode == "miss" and report.recorded_entry_id is None
    assert [w for w in report.warnings if "not served" in w and "it records nothing (record_on_miss off" in w
            and "so a run like it misses again" in w], report.warnings


def test_an_entry_whose_row_cannot_tell_its_schedule_is_still_checked_when_loaded(recorded, tiny_wan_patcher,
                                                                                  monkeypatch):
    """The match-time choice reads index rows; when one cannot be read, the loaded entry's own
    schedule is checked before it serves, and the run goes on as a miss that records."""
    bank, _ = recorded

    def unreadable(self, entry_id):
        raise ValueError("row unreadable (test)")

    monkeypatch.setattr(type(bank), "entry_schedule", unreadable)
    positive, _, latent = request()
    patch = reuse_patch(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent))
    ksampler(patch.install(), 16)
    report = patch.last_report
    assert report.mode == "miss" and report.recording == "queued"
    assert any("skipped" in w and "recorded on 8 steps" in w for w in report.warnings), report.warnings
