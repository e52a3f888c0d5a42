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
    return sys.modules[f"{package}.chorus_core.reuse.reuse_run"].get_reuse_patch(patched)


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


def test_a_miss_uses_the_population_prior_by_default(pack):
    """The default chosen from the testbed tables (README, "Defaults"): the nodes, the options and
    the example workflows agree."""
    import json
    from pathlib import Path

    from chorus_core.reuse.reuse_run import ReuseOptions

    node = sys.modules[pack[1].__name__.replace("sampler_nodes", "sparse_attention_node")].ChorusSparseAttention
    for schema in (pack[1].ChorusSparseWanSampler.define_schema(), node.define_schema()):
        miss_mode = next(i for i in schema.inputs if i.id == "miss_mode")
        assert miss_mode.default == "prior" and set(miss_mode.options) == {"online", "prior", "dense"}
    assert ReuseOptions().miss_mode == "prior"
    api_files = sorted((Path(__file__).resolve().parent.parent / "example_workflows" / "api").glob("*_api.json"))
    modes = {n["inputs"]["miss_mode"] for f in api_files for n in json.loads(f.read_text()).values()
             if "miss_mode" in n.get("inputs", {})}
    assert api_files and modes == {"prior"}


def ksampler_advanced(patched, outputs, seed, start, end, add_noise, keep_noise):
    import nodes as comfy_nodes

    positive, negative, latent, _, _ = outputs
    (out,) = comfy_nodes.KSamplerAdvanced().sample(
        patched, "enable" if add_noise else "disable", seed, 4, 5.0, "euler", "simple", positive, negative, latent,
        start, end, "enable" if keep_noise else "disable")
    return out


def test_two_experts_in_two_ksampler_advanced_stages_get_their_own_entries(pack, tiny_wan_file, tmp_path):
    """Wan 2.2 A14B's layout: a high-noise expert for the first steps, a low-noise one for the rest,
    each its own MODEL with its own Chorus Sparse Attention; each records under its own weights and
    each hits its own entry on the next similar request."""
    import comfy.sd

    from chorus_core.testbed.tiny_wan import TinyWanConfig, save_tiny_wan_i2v

    low_noise_file = save_tiny_wan_i2v(tmp_path / "expert_low.safetensors", TinyWanConfig(seed=7))
    high, low = comfy.sd.load_diffusion_model(str(tiny_wan_file)), comfy.sd.load_diffusion_model(str(low_noise_file))
    reports = []
    for subject in (0, 2):  # a miss that records, then a similar request
        outputs = request_outputs(pack[2], subject=subject)
        stages = []
        for expert in (high, low):
            stages.append(sparse_attention_node(pack, expert, match_node(pack, expert, "experts", outputs)))
        first = ksampler_advanced(stages[0], outputs, subject, 0, 2, add_noise=True, keep_noise=True)
        ksampler_advanced(stages[1], (*outputs[:2], first, *outputs[3:]), subject, 2, 4, add_noise=False,
                          keep_noise=False)
        flush_writes(pack[1])
        reports.append([reuse_patch_of(pack, stage).last_report for stage in stages])
    (high_miss, low_miss), (high_hit, low_hit) = reports
    assert (high_miss.mode, low_miss.mode) == ("miss", "miss")
    assert high_miss.recorded_entry_id != low_miss.recorded_entry_id  # one entry per expert
    assert (high_hit.mode, high_hit.entry_id) == ("hit", high_miss.recorded_entry_id)
    assert (low_hit.mode, low_hit.entry_id) == ("hit", low_miss.recorded_entry_id)


def test_denoise_zero_samples_nothing_and_says_so(pack, tiny_wan_patcher):
    positive, negative, latent, _, _ = request_outputs(pack[2])
    output = pack[1].ChorusSparseWanSampler.execute(tiny_wan_patcher, positive, negative, latent, 0, STEPS, 5.0,
                                                    "euler", "simple", 0.0, 1, "", "online", 0.9, 0.1, 0.6, True, "")
    (report,) = output.ui["chorus_report"]
    assert (report["mode"], report["steps"], report["recorded_entry_id"]) == ("miss", 0, None)
    assert report["warnings"] == [f"nothing was sampled (0 of {STEPS} steps: denoise 0), so nothing was reused or "
                                  "recorded"]
    assert torch.equal(output.args[0]["samples"], latent["samples"])


def test_a_second_chorus_sparse_attention_replaces_the_first(pack, tiny_wan_patcher):
    outputs = request_outputs(pack[2])
    twice = sparse_attention_node(pack, sparse_attention_node(pack, tiny_wan_patcher, None, tag="first"), None,
                                  tag="second")
    ksampler(twice, outputs, seed=0)
    patch = reuse_patch_of(pack, twice)
    assert patch.options.tags == ("second",) and patch.last_report.mode == "miss"
