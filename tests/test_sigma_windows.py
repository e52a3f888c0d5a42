"""Which step each model call belongs to, for samplers that evaluate the model once or more per step.

In process on the CPU with the tiny Wan2.1-I2V model. The expected step of every model call is
written out from the sampler's code in ComfyUI (comfy/k_diffusion/sampling.py), never from Chorus.
"""

import pytest
import torch

from chorus_core.attention.mask_provider import DenseProvider, ObservedMasks

pytestmark = pytest.mark.comfy

STEPS = 4


class StepLog(ObservedMasks):
    """A dense mask source that logs the step of every layer-0 self-attention (one per model call)."""

    def __init__(self):
        self.block_size = (32, 32)
        self.steps = []

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device):
        return None

    def observe(self, layer, step, cond_or_uncond, q, k, heads, skip_reshape):
        if layer == 0:
            self.steps.append(step)


def sample(patcher, sampler_name, steps=STEPS, seed=1):
    import comfy.sample

    from chorus_core.testbed.workload import I2VRequest, generate_request, i2v_conditioning

    positive, negative, latent = i2v_conditioning(generate_request(I2VRequest()))
    noise = comfy.sample.prepare_noise(latent["samples"], seed)
    return comfy.sample.sample(patcher, noise, steps, 5.0, sampler_name, "simple", positive, negative,
                               latent["samples"], seed=seed, disable_pbar=True)


def logged_steps(tiny_wan_patcher, sampler_name):
    from chorus_core.attention.sparse_patch import get_sparse_state, install_sparse_attention

    provider = StepLog()
    patched = install_sparse_attention(tiny_wan_patcher, provider)
    closed = []
    get_sparse_state(patched).on_step(lambda step, run: closed.append(step.step))
    sample(patched, sampler_name)
    return provider.steps, closed


# heun: step i evaluates at sigma_i, reports, then its corrector at sigma_{i+1} (none on the last step).
HEUN = [0, 0, 1, 1, 2, 2, 3]
# dpmpp_sde: like heun, its second evaluation at a sigma between sigma_i and sigma_{i+1}.
DPMPP_SDE = [0, 0, 1, 1, 2, 2, 3]
ONCE_PER_STEP = [0, 1, 2, 3]


@pytest.mark.parametrize("sampler_name, expected", [
    ("heun", HEUN), ("dpmpp_sde", DPMPP_SDE), ("dpmpp_2m_sde", ONCE_PER_STEP), ("euler", ONCE_PER_STEP),
    ("ipndm", ONCE_PER_STEP),  # not in Chorus's table: stepped by its sigma
])
def test_every_model_call_maps_to_its_step(tiny_wan_patcher, sampler_name, expected):
    steps, closed = logged_steps(tiny_wan_patcher, sampler_name)
    assert steps == expected
    assert closed == list(range(STEPS))


def test_heun_corrector_keeps_the_bucket_of_its_step(tiny_wan_patcher):
    """Buckets change at the first evaluation of a step, not at the corrector that shares its sigma."""
    from chorus_core.attention.mask_provider import StaticBlockMapProvider
    from chorus_core.attention.sparse_patch import install_sparse_attention

    full = {layer: torch.ones(1, 2, 10, 10, dtype=torch.bool) for layer in range(2)}
    asked = []

    class Bucketed(StaticBlockMapProvider):
        def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device):
            if layer == 0:
                asked.append((step, self.step_bucket(step)))
            return super().block_map(layer, step, cond_or_uncond, num_heads, seq_len, device)

    provider = Bucketed([full, full], (32, 32), bucket_starts=(0, 2))
    sample(install_sparse_attention(tiny_wan_patcher, provider), "heun")
    assert asked == [(0, 0), (2, 1)]


def test_the_clock_of_a_listed_sampler_reads_no_sigma_from_the_device():
    from chorus_core.attention.hooks import StepClock

    clock = StepClock([1.0, 0.75, 0.5, 0.25, 0.0], evals_after_report=1)

    class Sigma:  # a stand-in that fails if anything reads its value
        def flatten(self):
            raise AssertionError("read")

    seen = []
    for report_after in (True, False, True, False, True, False, True):
        seen.append(clock.step_of(Sigma()))
        if report_after:
            clock.report(seen[-1])
    assert seen == HEUN and clock.host_reads == 0


def test_an_unlisted_sampler_is_stepped_by_the_interval_that_holds_its_sigma():
    from chorus_core.attention.hooks import StepClock

    clock = StepClock([1.0, 0.75, 0.5, 0.25, 0.0], evals_after_report=None)
    sigmas = [1.0, 0.8, 0.75, 0.6, 0.26, 0.25, 0.1]
    assert [clock.step_of(torch.tensor([s])) for s in sigmas] == [0, 0, 1, 1, 2, 3, 3]
    assert clock.host_reads == len(sigmas)


# --------------------------------------------------------------------------------------------
# Windows: fractions of the sigma schedule, as ComfyUI's percent_to_sigma reads them
# --------------------------------------------------------------------------------------------

# The tiny model's beta schedule of 10 steps (flow sampling, shift 8), rounded:
# 1.0, 0.9948, 0.9828, 0.9632, 0.9338, 0.8893, 0.8201, 0.7108, 0.531, 0.2549, 0.0.
# percent_to_sigma: 0.3 -> 0.9492, 0.6 -> 0.8421. So a 0.3..0.6 window holds steps 4 and 5 (a
# share of steps would have said 3, 4, 5), and 0.3..1.0 holds steps 4 to 9.
BETA_STEPS = 10


def beta_schedule(patcher):
    import comfy.samplers

    sampling = patcher.get_model_object("model_sampling")
    return sampling, comfy.samplers.calculate_sigmas(sampling, "beta", BETA_STEPS).tolist()


def test_windows_follow_core_percent_to_sigma_on_a_known_schedule(tiny_wan_patcher):
    from chorus_core.guidance.feature_reuse import FeatureReuseSettings
    from chorus_core.guidance.guidance import window_steps

    sampling, schedule = beta_schedule(tiny_wan_patcher)
    assert [round(s, 4) for s in schedule] == [1.0, 0.9948, 0.9828, 0.9632, 0.9338, 0.8893, 0.8201, 0.7108,
                                               0.531, 0.2549, 0.0]
    assert (round(sampling.percent_to_sigma(0.3), 4), round(sampling.percent_to_sigma(0.6), 4)) == (0.9492, 0.8421)
    inside = lambda flags: [i for i, yes in enumerate(flags) if yes]
    assert inside(window_steps(sampling, schedule, 0.3, 0.6)) == [4, 5]
    assert inside(window_steps(sampling, schedule, 0.0, 1.0)) == list(range(BETA_STEPS))
    reduced = FeatureReuseSettings(start_percent=0.3, end_percent=1.0).reduced_steps(sampling, schedule)
    assert inside(reduced) == [4, 5, 6, 7, 8, 9]


def sample_beta(patcher, sampler_name):
    from i2v_inputs import sample_request

    return sample_request(patcher, seed=1, steps=BETA_STEPS, sampler=sampler_name, scheduler="beta")


@pytest.mark.parametrize("sampler_name, evals_in_window", [("heun", 2 + 2), ("dpmpp_2m_sde", 1 + 1)])
def test_guidance_acts_on_every_evaluation_of_the_window_steps_only(tiny_wan_patcher, sampler_name, evals_in_window):
    from chorus_core.guidance.guidance import GuidanceSettings, get_guidance_stats, install_guidance

    layers = len(tiny_wan_patcher.model.diffusion_model.blocks)
    patched = install_guidance(tiny_wan_patcher, GuidanceSettings("cross_attention", 0.2, 0.3, 0.6))
    sample_beta(patched, sampler_name)
    # steps 4 and 5; two cross-attentions (CLIP image, text) per layer and model call
    assert get_guidance_stats(patched).scaled_cross_attention == evals_in_window * layers * 2


@pytest.mark.parametrize("sampler_name, evals_in_window", [("heun", 5 * 2 + 1), ("dpmpp_2m_sde", 6)])
def test_feature_reuse_runs_reduced_in_the_window_steps_only(tiny_wan_patcher, sampler_name, evals_in_window):
    from chorus_core.guidance.feature_reuse import FeatureReuseSettings, get_feature_reuse_state, install_feature_reuse

    region_map = torch.zeros(5, 4, 4, dtype=torch.bool)
    region_map[:, :2] = True
    settings = FeatureReuseSettings(layers=(0, 1), start_percent=0.3, rim=0)
    patched = install_feature_reuse(tiny_wan_patcher, region_map, (5, 8, 8), settings)
    sample_beta(patched, sampler_name)
    # steps 4 to 9 (heun: 4 to 8 evaluate twice, the last step once), both layers, cond+uncond in one batch
    assert get_feature_reuse_state(patched).stats.reduced_calls == evals_in_window * 2


class HostReads:
    """Counts tensor-to-host reads made from chorus_core while armed."""

    METHODS = ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        import os
        import sys

        self.armed, self.where = False, []
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, _name=name, **kwargs):
                caller = sys._getframe(1).f_code.co_filename
                if self.armed and f"{os.sep}chorus_core{os.sep}" in caller:
                    self.where.append(f"{_name} in {caller}:{sys._getframe(1).f_lineno}")
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)

    def around(self, owner, name, monkeypatch):
        real = getattr(owner, name)

        def armed(*args, **kwargs):
            self.armed = True
            try:
                return real(*args, **kwargs)
            finally:
                self.armed = False

        monkeypatch.setattr(owner, name, armed)


def test_stepping_a_model_call_reads_nothing_from_the_device(tiny_wan_patcher, monkeypatch):
    """The per-model-call step lookups of all three patches, over a whole heun run: no host read."""
    from chorus_core.guidance import feature_reuse, guidance
    from chorus_core.attention import sparse_patch
    from chorus_core.guidance.feature_reuse import FeatureReuseSettings, install_feature_reuse
    from chorus_core.guidance.guidance import GuidanceSettings, install_guidance
    from chorus_core.attention.sparse_patch import install_sparse_attention

    reads = HostReads(monkeypatch)
    calls = []
    for owner, name in ((sparse_patch.SparseRun, "step_of"), (feature_reuse._Run, "step_of"), (guidance._Run, "active")):
        reads.around(owner, name, monkeypatch)
    real = sparse_patch.SparseRun.step_of
    monkeypatch.setattr(sparse_patch.SparseRun, "step_of", lambda self, options: calls.append(1) or real(self, options))

    region_map = torch.zeros(5, 4, 4, dtype=torch.bool)
    region_map[:, :2] = True
    patched = install_sparse_attention(tiny_wan_patcher, StepLog())
    patched = install_feature_reuse(patched, region_map, (5, 8, 8), FeatureReuseSettings(layers=(0, 1), rim=0))
    patched = install_guidance(patched, GuidanceSettings("cross_attention", 0.2, 0.0, 1.0))
    sample_beta(patched, "heun")
    assert len(calls) > 0
    assert reads.where == []
