"""Helpers for in-process tests: sample a procedural I2V request with a ModelPatcher."""

import torch

from chorus_core.testbed.workload import I2VRequest, generate_request, i2v_conditioning


def sample_request(patcher, seed=0, steps=4, cfg=5.0, request=I2VRequest(), sampler="euler",
                   scheduler="simple") -> torch.Tensor:
    """Run ComfyUI's own sampling path (comfy.sample.sample) and return the final latent."""
    import comfy.sample

    positive, negative, latent = i2v_conditioning(generate_request(request))
    noise = comfy.sample.prepare_noise(latent["samples"], seed)
    return comfy.sample.sample(patcher, noise, steps, cfg, sampler, scheduler, positive, negative,
                               latent["samples"], seed=seed, disable_pbar=True)
