"""The model that samples, not the model the node was given, is the run's model (issue 25).

A LoRA (LoraLoaderModelOnly runs ``load_lora_for_models``) or ModelSamplingSD3 placed after
Chorus Sparse Attention is part of what samples: the hit check, the recorded shift and the
model an entry is filed under all follow it. Tiny Wan2.1-I2V in process, on the CPU.
"""

import pytest

from test_fingerprint import with_lora
from test_reuse_loop import BLOCK, STEPS, match_for, request

pytestmark = pytest.mark.comfy

LORA_KEYS = ("blocks.1.self_attn.q", "blocks.0.ffn.0")  # the tiny model has 2 blocks


def reuse_patch(model, match):
    from chorus_core.reuse.reuse_run import ReuseOptions, ReusePatch

    # every step of a hit sparse (dense_last_steps 0): a hit with no dense step of its own is timed
    # against an earlier one
    return ReusePatch(model, match, ReuseOptions(dense_warmup_steps=1, dense_last_steps=0), block_size=BLOCK).install()


def model_sampling_sd3(model, shift):
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3

    (patched,) = ModelSamplingSD3().patch(model, shift)
    return patched


def sample(model, cfg=5.0):
    """KSampler's path (comfy.sample.sample); returns the run's report."""
    import comfy.sample

    from chorus_core.reuse import bank_writer
    from chorus_core.reuse.reuse_run import get_reuse_patch

    positive, negative, latent = request()
    noise = comfy.sample.prepare_noise(latent["samples"], 0)
    comfy.sample.sample(model, noise, STEPS, cfg, "euler", "simple", positive, negative, latent["samples"], seed=0,
                        disable_pbar=True)
    assert bank_writer.flush_all(timeout=60)
    return get_reuse_patch(model).last_report


@pytest.fixture()
def bank(tmp_path):
    from chorus_core.bank import MaskBank

    bank = MaskBank.open(tmp_path / "bank")
    yield bank
    bank.close()


def test_model_sampling_after_the_node_is_the_shift_an_entry_records(bank, tiny_wan_patcher):
    from chorus_core.reuse.model_identity import fingerprint_patcher

    positive, _, latent = request()
    match = match_for(bank, tiny_wan_patcher, positive, latent)
    sampled = model_sampling_sd3(reuse_patch(tiny_wan_patcher, match), 3.0)
    report = sample(sampled)

    assert (report.mode, report.recording, report.warnings) == ("miss", "queued", [])
    assert fingerprint_patcher(sampled) == match.request.fingerprint  # a sampling patch is no weight patch
    assert bank.compatible_entries(match.request.fingerprint, match.request.layout) == [report.recorded_entry_id]
    assert bank.show(report.recorded_entry_id)["shift"] == 3.0  # ModelSamplingSD3's, not the base model's 5.0


def test_base_model_matched_lora_sampled_records_nothing_and_later_base_requests_never_get_lora_masks(
        bank, tiny_wan_patcher):
    positive, _, latent = request()
    base_match = match_for(bank, tiny_wan_patcher, positive, latent)
    first = sample(with_lora(reuse_patch(tiny_wan_patcher, base_match), 3, 1.0, LORA_KEYS))
    assert (first.mode, first.recording, first.recorded_entry_id) == ("miss", None, None)
    assert any("records nothing: wire the same model" in w for w in first.warnings)
    assert bank.stats()["entries"] == 0  # filed under neither model: the match could never find it again

    # a base-model request: nothing recorded by the LoRA'd run to hit
    base_again = match_for(bank, tiny_wan_patcher, positive, latent)
    assert base_again.result.candidates == 0 and not base_again.result.hit
    # the LoRA'd model into both nodes (LoRA before Chorus): a miss that records, then a hit of it
    lora_model = with_lora(tiny_wan_patcher, 3, 1.0, LORA_KEYS)
    recorded = sample(reuse_patch(lora_model, match_for(bank, lora_model, positive, latent)))
    assert (recorded.mode, recorded.recording) == ("miss", "queued")
    hit = sample(reuse_patch(lora_model, match_for(bank, lora_model, positive, latent)))
    assert (hit.mode, hit.entry_id, hit.warnings) == ("hit", recorded.recorded_entry_id, [])
    assert match_for(bank, tiny_wan_patcher, positive, latent).result.candidates == 0  # still not the base's


def test_a_hit_matched_on_the_base_model_but_sampled_with_a_lora_runs_as_a_miss_and_says_so(bank, tiny_wan_patcher):
    positive, _, latent = request()
    first = sample(reuse_patch(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent)))
    assert first.mode == "miss"
    base_match = match_for(bank, tiny_wan_patcher, positive, latent)
    assert base_match.result.hit
    report = sample(with_lora(reuse_patch(tiny_wan_patcher, base_match), 3, 1.0, LORA_KEYS))
    assert report.mode == "miss" and report.entry_id is None
    assert any("differs from the one Similarity Match was given" in w for w in report.warnings)
    assert report.recording is None


def test_a_hit_with_no_dense_step_is_timed_against_an_earlier_dense_step_of_the_same_work(bank, tiny_wan_patcher):
    from chorus_core.attention.step_times import forget_dense_steps

    forget_dense_steps()  # dense steps are remembered per process: earlier tests ran the same work
    positive, _, latent = request()
    miss = sample(reuse_patch(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent)))
    hit = sample(reuse_patch(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent)))
    assert "dense_step_s" not in hit.timings and hit.timings["earlier_dense_step_s"] == miss.timings["dense_step_s"]
    # cfg 1 runs half the batch: other work, so no earlier dense step to compare with
    cfg1 = sample(reuse_patch(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent)), cfg=1.0)
    assert cfg1.mode == "hit" and "dense_step_s" not in cfg1.timings and "earlier_dense_step_s" not in cfg1.timings
