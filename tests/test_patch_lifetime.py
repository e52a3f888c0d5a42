"""A patched model dies with its last reference, not at the next garbage collection.

ComfyUI keeps a loaded model under the patcher that sampled it and, when that patcher dies,
switches to its parent. A patched clone caught in a reference cycle (the patch holding the
patched model that holds the patch) dies only in a garbage collection, together with its
clones, so ComfyUI finds the loaded model's patchers gone, logs "memory leak with model WAN21",
and runs gc.collect() and empties the CUDA cache inside the next generation's model load (the likely
cause of the 2.9 s that the 720p 4-step hit's first step lost on the H200, where ComfyUI logged
it), and Chorus makes a new clone for every request (a new match). Tiny Wan2.1-I2V in process,
on the CPU.
"""

import gc
import weakref

import pytest

from test_reuse_loop import match_for, request

pytestmark = pytest.mark.comfy


@pytest.fixture()
def no_automatic_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def sample_once(patched, steps=2):
    import comfy.sample

    positive, negative, latent = request()
    noise = comfy.sample.prepare_noise(latent["samples"], 0)
    comfy.sample.sample(patched, noise, steps, 1.0, "euler", "simple", positive, negative, latent["samples"],
                        seed=0, disable_pbar=True)


@pytest.mark.parametrize("compile_clone", [False, True], ids=["chorus", "chorus+clone after it"])
def test_a_request_s_patched_model_is_freed_by_reference_counting(tmp_path, tiny_wan_patcher, no_automatic_gc,
                                                                  compile_clone):
    from chorus_core.bank import MaskBank
    from chorus_core.reuse.reuse_run import ReuseOptions, ReusePatch

    bank = MaskBank.open(tmp_path / "bank")
    positive, _, latent = request()
    patch = ReusePatch(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent),
                       ReuseOptions(record_on_miss=False), scheduler="simple")
    patched = patch.install()
    sampled = patched.clone() if compile_clone else patched  # what TorchCompileModel after the node makes
    sample_once(sampled)
    assert patch.last_report.mode == "miss"
    gone = [weakref.ref(patched), weakref.ref(sampled)]
    del patch, patched, sampled  # the patch itself may wait for a collection: it holds no model
    assert [ref() is None for ref in gone] == [True, True]
    bank.close()


def test_comfyui_finds_no_dead_model_after_requests(tmp_path, tiny_wan_patcher, no_automatic_gc):
    """What ComfyUI's cleanup_models_gc checks before each model load: no loaded model whose
    patchers are all gone while its weights live on."""
    import comfy.model_management as mm

    from chorus_core.bank import MaskBank
    from chorus_core.reuse.reuse_run import ReuseOptions, ReusePatch

    bank = MaskBank.open(tmp_path / "bank")
    positive, _, latent = request()
    for _ in range(2):
        patch = ReusePatch(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent),
                           ReuseOptions(record_on_miss=False), scheduler="simple")
        sample_once(patch.install().clone())
        del patch
    gc.collect()  # what Python does on its own sooner or later: it must not leave a dead model
    assert mm.current_loaded_models and not any(loaded.is_dead() for loaded in mm.current_loaded_models)
    bank.close()


def _feature_reuse(patcher):
    import torch

    from chorus_core.guidance.feature_regions import cell_grid
    from chorus_core.guidance.feature_reuse import FeatureReuseSettings, install_feature_reuse

    grid = (5, 8, 8)  # the default request's token grid
    region_map = torch.zeros(cell_grid(grid, (1, 2, 2)), dtype=torch.bool)
    region_map[:, :2] = True
    return install_feature_reuse(patcher, region_map, grid, FeatureReuseSettings(layers=(0, 1), start_percent=0.0, rim=0))


def _feature_reuse_ran(patched) -> bool:
    from chorus_core.guidance.feature_reuse import get_feature_reuse_state

    return get_feature_reuse_state(patched).stats.reduced_calls > 0


def _guidance(patcher):
    from chorus_core.guidance.guidance import GuidanceSettings, install_guidance

    return install_guidance(patcher, GuidanceSettings(strength=0.5, start=0.0, end=1.0))


def _guidance_ran(patched) -> bool:
    from chorus_core.guidance.guidance import get_guidance_stats

    stats = get_guidance_stats(patched)
    return stats.scaled_cross_attention > 0  # the default method scales cross-attention calls


@pytest.mark.parametrize("install, ran", [(_feature_reuse, _feature_reuse_ran), (_guidance, _guidance_ran)],
                         ids=["feature reuse", "guidance enhance"])
def test_feature_reuse_and_guidance_clones_are_freed_by_reference_counting(tiny_wan_patcher, no_automatic_gc,
                                                                            install, ran):
    """The same check for the other two holders (their state rides on the clone as an attachment)."""
    patched = install(tiny_wan_patcher)
    sample_once(patched)
    assert ran(patched)
    gone = weakref.ref(patched)
    del patched
    assert gone() is None
