"""Chorus Sparse Attention (the MODEL-patch node) in process (CPU), under ComfyUI's own samplers."""

import sys

import pytest
import torch

from test_nodes_inprocess import flush_writes, pack, request_outputs  # noqa: F401  (pack is a fixture)

pytestmark = pytest.mark.comfy

STEPS = 3


def match_node(pack, patcher, bank_name, outputs):
    bank_nodes = pack[0]
    positive, _, latent, clip, start = outputs
    (bank,) = bank_nodes.ChorusMaskBankLoader.execute(bank_nodes.NEW_BANK, bank_name, False).args
    match, _ = bank_nodes.ChorusSimilarityMatch.execute(bank, patcher, positive, latent, 0.9, 0.5, 0.3, 0.2, 32,
                                                        start_latent=start, clip_vision_output=clip).args
    return match


def sparse_attention_node(pack, patcher, match, tag="pan"):
    node = sys.modules[pack[1].__name__.replace("sampler_nodes", "sparse_attention_node")].ChorusSparseAttention
    (patched,) = node.execute(patcher, 1, "", "online", 0.9, 0.1, 0.6, True, tag, match=match).args
    return patched


def reuse_patch_of(pack, patched):
    package = pack[1].__name__.rpartition(".nodes.")[0]
    return sys.modules[f"{package}.chorus_core.reuse_run"].get_reuse_patch(patched)


def ksampler(patched, outputs, seed):
    import nodes as comfy_nodes

    positive, negative, latent, _, _ = outputs
    (out,) = comfy_nodes.KSampler().sample(patched, seed, STEPS, 5.0, "euler", "simple", positive, negative, latent)
    return out["samples"]


def sampler_custom_advanced(patched, outputs, seed):
    """What SamplerCustomAdvanced runs: a CFGGuider, a sampler object and a sigma schedule."""
    import comfy.sample
    import comfy.samplers

    positive, negative, latent, _, _ = outputs
    guider = comfy.samplers.CFGGuider(patched)
    guider.set_conds(positive, negative)
    guider.set_cfg(5.0)
    sigmas = comfy.samplers.calculate_sigmas(patched.get_model_object("model_sampling"), "simple", STEPS).cpu()
    noise = comfy.sample.prepare_noise(latent["samples"], seed)
    return guider.sample(noise, latent["samples"], comfy.samplers.sampler_object("dpmpp_2m"), sigmas, seed=seed,
                         disable_pbar=True)


@pytest.mark.parametrize("run_sampler", [ksampler, sampler_custom_advanced])
def test_a_sampler_run_through_the_patch_records_then_hits(pack, tiny_wan_patcher, run_sampler):
    bank_name = f"patch_{run_sampler.__name__}"
    first_request = request_outputs(pack[2], subject=0)
    patched = sparse_attention_node(pack, tiny_wan_patcher, match_node(pack, tiny_wan_patcher, bank_name,
                                                                       first_request))
    assert tiny_wan_patcher.get_attachment("chorus_reuse") is None  # the input model is unchanged
    run_sampler(patched, first_request, seed=1)
    flush_writes(pack[1])
    first = reuse_patch_of(pack, patched).last_report
    assert (first.mode, first.recording, first.steps) == ("miss", "queued", STEPS)
    assert first.layers and all(row["sparse_share"] > 0 for row in first.layers)

    second_request = request_outputs(pack[2], subject=2)
    patched = sparse_attention_node(pack, tiny_wan_patcher, match_node(pack, tiny_wan_patcher, bank_name,
                                                                       second_request))
    latent = run_sampler(patched, second_request, seed=2)
    second = reuse_patch_of(pack, patched).last_report
    assert (second.mode, second.entry_id, second.recording) == ("hit", first.recorded_entry_id, None)
    assert second.mask_source == f"bank entry {first.recorded_entry_id}"
    assert second.layers and all(row["sparse_share"] > 0 for row in second.layers)
    assert torch.isfinite(latent).all()


def test_without_a_match_each_run_is_an_online_miss_that_records_nothing(pack, tiny_wan_patcher):
    outputs = request_outputs(pack[2])
    patched = sparse_attention_node(pack, tiny_wan_patcher, None)
    ksampler(patched, outputs, seed=0)
    report = reuse_patch_of(pack, patched).last_report
    assert (report.mode, report.mask_source, report.recording) == ("miss", "online prediction", None)
    assert report.density is not None and report.density < 1.0


def test_the_sampler_node_refuses_a_model_patched_by_the_node(pack, tiny_wan_patcher):
    positive, negative, latent, _, _ = request_outputs(pack[2])
    patched = sparse_attention_node(pack, tiny_wan_patcher, None)
    with pytest.raises(ValueError, match="already went through Chorus Sparse Attention"):
        pack[1].ChorusSparseWanSampler.execute(patched, positive, negative, latent, 0, STEPS, 5.0, "euler", "simple",
                                               1.0, 1, "", "online", 0.9, 0.1, 0.6, True, "")


def test_the_node_shares_the_samplers_reuse_inputs(pack):
    node = sys.modules[pack[1].__name__.replace("sampler_nodes", "sparse_attention_node")].ChorusSparseAttention
    sampler_inputs = [i.id for i in pack[1].ChorusSparseWanSampler.define_schema().inputs]
    node_inputs = [i.id for i in node.define_schema().inputs]
    assert node_inputs == ["model", *sampler_inputs[sampler_inputs.index("match"):]]
    assert node.validate_inputs(0.6, 0.1) == pack[1].ChorusSparseWanSampler.validate_inputs(0.6, 0.1)
    assert node.validate_inputs(0.1, 0.6) is True
