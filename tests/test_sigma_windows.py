"""Which step each model call belongs to, for samplers that evaluate the model once or more per step.

In process on the CPU with the tiny Wan2.1-I2V model. The expected step of every model call is
written out from the sampler's code in ComfyUI (comfy/k_diffusion/sampling.py), never from Chorus.
"""

import pytest
import torch

from chorus_core.mask_provider import DenseProvider

pytestmark = pytest.mark.comfy

STEPS = 4


class StepLog(DenseProvider):
    """A dense mask source that logs the step of every layer-0 self-attention (one per model call)."""

    def __init__(self):
        super().__init__(block_size=(32, 32))
        self.steps = []

    def observe(self, layer, step, cond_or_uncond, q, k, heads, skip_reshape):
        if layer == 0:
            self.steps.append(step)


def sample(patcher, sampler_name, steps=STEPS, seed=1):
    import comfy.sample

    from chorus_core.workload import I2VRequest, generate_request, i2v_conditioning

    positive, negative, latent = i2v_conditioning(generate_request(I2VRequest()))
    noise = comfy.sample.prepare_noise(latent["samples"], seed)
    return comfy.sample.sample(patcher, noise, steps, 5.0, sampler_name, "simple", positive, negative,
                               latent["samples"], seed=seed, disable_pbar=True)


def logged_steps(tiny_wan_patcher, sampler_name):
    from chorus_core.sparse_patch import get_sparse_state, install_sparse_attention

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
    from chorus_core.mask_provider import StaticBlockMapProvider
    from chorus_core.sparse_patch import install_sparse_attention

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
    from chorus_core.hooks import StepClock

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
    from chorus_core.hooks import StepClock

    clock = StepClock([1.0, 0.75, 0.5, 0.25, 0.0], evals_after_report=None)
    sigmas = [1.0, 0.8, 0.75, 0.6, 0.26, 0.25, 0.1]
    assert [clock.step_of(torch.tensor([s])) for s in sigmas] == [0, 0, 1, 1, 2, 3, 3]
    assert clock.host_reads == len(sigmas)
