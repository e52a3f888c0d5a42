"""In-process ComfyUI (CPU): the tiny checkpoint is a real Wan2.1-I2V model to ComfyUI."""

import pytest
import torch

pytestmark = pytest.mark.comfy


def test_tiny_checkpoint_is_detected_as_wan21_i2v(tiny_wan_patcher):
    import comfy.supported_models

    model = tiny_wan_patcher.model
    assert type(model.model_config) is comfy.supported_models.WAN21_I2V
    assert model.diffusion_model.model_type == "i2v"
    assert model.diffusion_model.num_heads == 2


def test_tiny_model_samples_an_i2v_request(tiny_wan_patcher):
    from i2v_inputs import sample_request

    latent = sample_request(tiny_wan_patcher, seed=3, steps=3)
    assert latent.shape == (1, 16, 5, 16, 16)
    assert torch.isfinite(latent).all()
    again = sample_request(tiny_wan_patcher, seed=3, steps=3)
    assert torch.equal(latent, again)
