"""Guidance enhancement: the math on tensors, and the wiring in real in-process ComfyUI sampling.

Expected results never come from the code under test: the CFG boost over the whole schedule
must equal plain ComfyUI sampling at cfg ``s (1 + strength)``, and the cross-attention scaling
must equal a clone whose cross-attention output projections carry ``(1 + strength) W`` (a
ComfyUI weight patch); the output projection is linear, so both scale what the attention gave.
"""

import importlib.util
import logging
import sys

import pytest
import torch

from chorus_core.guidance.guidance import (METHODS, GuidanceSettings, _is_cross_attention, boosted_cfg, content_adherence,
                                  first_frame_error, scale_cross_attention, template_adherence, window_steps)
from chorus_core.testbed.workload import I2VRequest, generate_request
from conftest import REPO_ROOT

STEPS = 3
CLOSE = dict(rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------
# The math
# --------------------------------------------------------------------------------------------


def test_boosted_cfg_scales_the_guidance_term():
    g = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(2, 16, 3, 4, 4, generator=g), torch.randn(2, 16, 3, 4, 4, generator=g)
    cfg = uncond + 5.0 * (cond - uncond)
    torch.testing.assert_close(boosted_cfg(cfg, cond, uncond, 5.0, 0.4), uncond + 5.0 * 1.4 * (cond - uncond))
    assert boosted_cfg(cfg, cond, uncond, 5.0, 0.0) is cfg


def test_cross_attention_scaling():
    out = torch.randn(2, 10, 8)
    torch.testing.assert_close(scale_cross_attention(out, 0.25), out * 1.25)
    assert scale_cross_attention(out, 0.0) is out


class LinearSampling:
    """A model sampling whose percent_to_sigma is 1 - percent, as ComfyUI's flow sampling at shift 1."""

    @staticmethod
    def percent_to_sigma(percent):
        return 1.0 if percent <= 0.0 else 0.0 if percent >= 1.0 else 1.0 - percent


def test_step_window_is_half_open_fractions_of_the_sigma_schedule():
    schedule = torch.linspace(1, 0, 11).tolist()  # 10 steps, sigma_i = 1 - i / 10 (float32)
    inside = lambda start, end: [i for i, yes in enumerate(window_steps(LinearSampling, schedule, start, end)) if yes]
    assert inside(0.1, 1.0) == list(range(1, 10))
    assert inside(0.3, 0.6) == [3, 4, 5]
    assert inside(0.0, 1.0) == list(range(10))
    assert inside(0.5, 0.5) == []
    # A schedule that is not uniform in sigma: the window follows the sigmas, not the step count.
    uneven = [1.0, 0.98, 0.95, 0.9, 0.8, 0.6, 0.3, 0.0]  # 7 steps
    assert [i for i, yes in enumerate(window_steps(LinearSampling, uneven, 0.1, 0.5)) if yes] == [3, 4, 5]


def test_cross_attention_calls_are_those_with_another_key_length():
    q, k_self, k_img = torch.randn(1, 320, 256), torch.randn(1, 320, 256), torch.randn(1, 257, 256)
    assert _is_cross_attention((q, k_img, k_img, 2), {})
    assert not _is_cross_attention((q, k_self, k_self, 2), {})
    assert _is_cross_attention((), {"q": q, "k": k_img, "v": k_img, "heads": 2})
    bhnd_q, bhnd_k = torch.randn(1, 2, 320, 128), torch.randn(1, 2, 16, 128)  # skip_reshape layout
    assert _is_cross_attention((bhnd_q, bhnd_k, bhnd_k, 2), {"skip_reshape": True})
    assert not _is_cross_attention((bhnd_q, bhnd_q, bhnd_q, 2), {"skip_reshape": True})


def test_settings_refuse_bad_values():
    with pytest.raises(ValueError, match="not one of"):
        GuidanceSettings(method="pag")
    with pytest.raises(ValueError, match="start <= end"):
        GuidanceSettings(start=0.8, end=0.2)
    with pytest.raises(ValueError, match="strength"):
        GuidanceSettings(strength=-1.0)


def test_adherence_measures_on_the_template_video():
    tensors = generate_request(I2VRequest("pan", 1, 1))
    video = tensors.video[None]
    assert float(first_frame_error(video, tensors.first_frame)[0]) == 0.0
    assert float(first_frame_error(video + 0.1, tensors.first_frame)[0]) > 0
    assert float(template_adherence(video, tensors.video)[0]) == pytest.approx(1.0)
    assert float(content_adherence(video, tensors.video)[0]) == pytest.approx(1.0)
    still = tensors.first_frame[None].expand_as(video)  # copies the first frame, never moves
    assert abs(float(template_adherence(still + 1e-3 * torch.randn_like(video), tensors.video)[0])) < 0.1
    other = generate_request(I2VRequest("orbit", 1, 1)).video[None]  # same subject and layout, other motion
    assert float(template_adherence(other, tensors.video)[0]) < 0.5
    assert float(template_adherence(torch.cat([video, other]), tensors.video)[1]) < 0.5  # per batch element


# --------------------------------------------------------------------------------------------
# Wiring in real ComfyUI sampling (tiny random Wan2.1-I2V, CPU)
# --------------------------------------------------------------------------------------------


def sample(patcher, cfg=5.0, steps=STEPS, seed=3):
    from i2v_inputs import sample_request

    return sample_request(patcher, seed=seed, steps=steps, cfg=cfg, request=I2VRequest("orbit", 1, 2))


class Reference:
    """The unpatched tiny model and its reference latents, each sampled once (lazily) per module."""

    def __init__(self, patcher):
        self.patcher, self._cache = patcher, {}

    def dense(self, cfg):
        if cfg not in self._cache:
            self._cache[cfg] = sample(self.patcher, cfg=cfg)
        return self._cache[cfg]

    def cross_oracle(self, cfg):
        key = ("cross", cfg)
        if key not in self._cache:
            self._cache[key] = sample(cross_attention_weight_oracle(self.patcher, 0.3), cfg=cfg)
        return self._cache[key]


@pytest.fixture(scope="module")
def base(tiny_wan_file):
    import comfy.sd

    return Reference(comfy.sd.load_diffusion_model(str(tiny_wan_file)))


def options_snapshot(patcher):
    o = patcher.model_options
    return (list(o.get("sampler_post_cfg_function", [])), dict(o.get("transformer_options", {})),
            {k: dict(v) for k, v in patcher.wrappers.items()}, dict(patcher.attachments))


def cross_attention_weight_oracle(patcher, strength):
    """A clone whose every cross-attention output projection is (1 + strength) W."""
    oracle = patcher.clone()
    weights = {k: v for k, v in patcher.model.state_dict().items() if ".cross_attn.o.weight" in k}
    assert weights, "no cross-attention output projections found"
    oracle.add_patches({k: (strength * w.clone(),) for k, w in weights.items()}, 1.0)
    return oracle


@pytest.mark.comfy
def test_strength_zero_is_bit_identical_and_the_input_model_is_never_changed(base):
    from chorus_core.guidance.guidance import install_guidance

    patcher, dense = base.patcher, base.dense(5.0)
    before = options_snapshot(patcher)
    off = install_guidance(patcher, GuidanceSettings("cross_attention", 0.0, 0.0, 1.0))
    assert off is not patcher and torch.equal(sample(off), dense)
    for method in METHODS:  # the changed latents themselves are checked against oracles below
        install_guidance(patcher, GuidanceSettings(method, 0.5, 0.0, 1.0))
    assert options_snapshot(patcher) == before
    assert torch.equal(sample(patcher), dense)


@pytest.mark.comfy
def test_cfg_boost_over_the_whole_schedule_equals_sampling_at_a_higher_cfg(base):
    from chorus_core.guidance.guidance import get_guidance_stats, install_guidance

    patcher = base.patcher
    boosted = install_guidance(patcher, GuidanceSettings("cfg_boost", 0.2, 0.0, 1.0))
    torch.testing.assert_close(sample(boosted, cfg=5.0), base.dense(6.0), **CLOSE)
    assert get_guidance_stats(boosted).boosted_steps == STEPS


@pytest.mark.comfy
def test_cross_attention_scaling_equals_scaled_output_projections(base):
    from chorus_core.guidance.guidance import get_guidance_stats, install_guidance

    patcher = base.patcher
    scaled = install_guidance(patcher, GuidanceSettings("cross_attention", 0.3, 0.0, 1.0))
    torch.testing.assert_close(sample(scaled), base.cross_oracle(5.0), **CLOSE)
    layers = len(patcher.model.diffusion_model.blocks)
    # cond and uncond run as one batch: 2 cross-attentions (CLIP image, text) per layer per step
    assert get_guidance_stats(scaled).scaled_cross_attention == STEPS * layers * 2
    assert not torch.equal(base.cross_oracle(5.0), base.dense(5.0))


@pytest.mark.comfy
def test_step_window_limits_both_methods(base):
    from chorus_core.guidance.guidance import get_guidance_stats, install_guidance

    patcher, dense = base.patcher, base.dense(5.0)
    layers = len(patcher.model.diffusion_model.blocks)
    late = install_guidance(patcher, GuidanceSettings("cross_attention", 0.3, 0.3, 1.0))  # steps 1, 2 of 3
    out = sample(late)
    assert get_guidance_stats(late).scaled_cross_attention == 2 * layers * 2
    assert not torch.equal(out, dense)
    late_cfg = install_guidance(patcher, GuidanceSettings("cfg_boost", 0.3, 0.3, 1.0))
    sample(late_cfg)
    assert get_guidance_stats(late_cfg).boosted_steps == 2
    empty = install_guidance(patcher, GuidanceSettings("cfg_boost", 0.3, 0.5, 0.5))
    assert torch.equal(sample(empty), dense)


@pytest.mark.comfy
def test_cfg_one_boost_does_nothing_and_says_so_cross_attention_still_acts(base, caplog):
    from chorus_core.guidance.guidance import NO_UNCOND_NOTE, get_guidance_stats, install_guidance

    patcher, dense_cfg1 = base.patcher, base.dense(1.0)
    boosted = install_guidance(patcher, GuidanceSettings("cfg_boost", 0.5, 0.0, 1.0))
    with caplog.at_level(logging.INFO, logger="chorus"):
        assert torch.equal(sample(boosted, cfg=1.0), dense_cfg1)
    stats = get_guidance_stats(boosted)
    assert stats.skipped_no_uncond == STEPS and stats.boosted_steps == 0 and stats.notes == [NO_UNCOND_NOTE]
    assert sum(NO_UNCOND_NOTE in r.getMessage() for r in caplog.records) == 1  # once per run
    scaled = install_guidance(patcher, GuidanceSettings("cross_attention", 0.3, 0.0, 1.0))
    out = sample(scaled, cfg=1.0)
    torch.testing.assert_close(out, base.cross_oracle(1.0), **CLOSE)
    assert not torch.equal(out, dense_cfg1)


@pytest.mark.comfy
def test_composes_with_sparse_attention_in_either_order(base):
    from chorus_core.guidance.guidance import get_guidance_stats, install_guidance
    from chorus_core.attention.mask_provider import StaticBlockMapProvider
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    patcher = base.patcher
    layers, heads, nb = len(patcher.model.diffusion_model.blocks), 2, 10
    g = torch.Generator().manual_seed(5)
    maps = {layer: (torch.rand(1, heads, nb, nb, generator=g) < 0.3) | torch.eye(nb, dtype=torch.bool)
            for layer in range(layers)}
    provider = StaticBlockMapProvider.for_all_steps(maps, (32, 32))
    settings = GuidanceSettings("cross_attention", 0.3, 0.0, 1.0)
    sparse = install_sparse_attention(patcher, provider)
    sparse_only = sample(sparse)
    outer = install_guidance(sparse, settings)
    inner = install_sparse_attention(install_guidance(patcher, settings), provider)
    a, b = sample(outer), sample(inner)
    assert torch.equal(a, b)
    assert not torch.equal(a, sparse_only)
    assert get_run_stats(inner).sparse_calls == STEPS * layers  # self-attention still sparse
    assert get_guidance_stats(inner).scaled_cross_attention == STEPS * layers * 2
    # the sparse run with scaled cross-attention is the sparse run of the weight-scaled model
    oracle = install_sparse_attention(cross_attention_weight_oracle(patcher, 0.3), provider)
    torch.testing.assert_close(a, sample(oracle), **CLOSE)
    # CFG boost on top of a sparse model: the sparse run at the higher cfg
    boosted = install_guidance(sparse, GuidanceSettings("cfg_boost", 0.2, 0.0, 1.0))
    torch.testing.assert_close(sample(boosted), sample(sparse, cfg=6.0), **CLOSE)


@pytest.mark.comfy
def test_installing_twice_replaces_instead_of_stacking(base):
    from chorus_core.guidance.guidance import install_guidance

    patcher = base.patcher
    once = install_guidance(patcher, GuidanceSettings("cross_attention", 0.3, 0.0, 1.0))
    twice = install_guidance(once, GuidanceSettings("cross_attention", 0.3, 0.0, 1.0))
    switched = install_guidance(once, GuidanceSettings("cfg_boost", 0.2, 0.0, 1.0))
    assert torch.equal(sample(twice), sample(once))
    torch.testing.assert_close(sample(switched), base.dense(6.0), **CLOSE)


# --------------------------------------------------------------------------------------------
# The node, loaded through the pack as ComfyUI loads it
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guidance_nodes(comfy_runtime):
    name = str(REPO_ROOT).replace(".", "_x_") + "_guidance_inprocess"
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    from importlib import import_module

    return import_module(f"{name}.nodes.guidance_nodes")


@pytest.mark.comfy
def test_node_schema_and_validation(guidance_nodes):
    node = guidance_nodes.ChorusGuidanceEnhance
    schema = node.define_schema()
    assert schema.node_id == "ChorusGuidanceEnhance" and schema.category == "Chorus"
    assert guidance_nodes.METHOD_OPTIONS == list(METHODS)
    assert [i.id for i in schema.inputs] == ["model", "method", "strength", "start", "end"]
    assert "cfg 1" in schema.inputs[1].tooltip
    assert (schema.inputs[1].default, schema.inputs[2].default) == ("cross_attention", 0.1)
    assert GuidanceSettings() == GuidanceSettings("cross_attention", 0.1, 0.1, 1.0)
    assert node.validate_inputs(0.1, 1.0) is True
    assert "must not be after" in node.validate_inputs(0.9, 0.2)
    assert guidance_nodes.NODES == [node]


@pytest.mark.comfy
def test_node_returns_a_patched_clone(guidance_nodes, base):
    from chorus_core.guidance.guidance import get_guidance_stats

    patcher, dense = base.patcher, base.dense(5.0)
    before = options_snapshot(patcher)
    (model,) = guidance_nodes.ChorusGuidanceEnhance.execute(patcher, "cfg_boost", 0.2, 0.0, 1.0).args
    assert model is not patcher and options_snapshot(patcher) == before
    torch.testing.assert_close(sample(model), base.dense(6.0), **CLOSE)
    (off,) = guidance_nodes.ChorusGuidanceEnhance.execute(patcher, "cross_attention", 0.0, 0.1, 1.0).args
    assert torch.equal(sample(off), dense)
    assert get_guidance_stats(off) is None


def test_strength_zero_turns_an_earlier_install_off(comfy_runtime, tiny_wan_patcher):
    from chorus_core.guidance.guidance import GuidanceSettings, install_guidance
    from i2v_inputs import sample_request

    boosted = install_guidance(tiny_wan_patcher, GuidanceSettings("cross_attention", 0.5, 0.0, 1.0))
    off = install_guidance(boosted, GuidanceSettings("cross_attention", 0.0, 0.0, 1.0))
    assert torch.equal(sample_request(off, seed=2, steps=2), sample_request(tiny_wan_patcher, seed=2, steps=2))
