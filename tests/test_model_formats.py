"""One model identity however ComfyUI loads the checkpoint: bf16, fp16, fp8_scaled, UNETLoader's fp8 dtypes, LoRAs.

The server keeps a loaded model between prompts, so the second request is matched on a patcher that
has already sampled once (its LoRA written into the weights, the originals in ``backup``). On ComfyUI
0.19.3 an fp8_scaled layer's weight is a comfy-kitchen ``QuantizedTensor``: its ``state_dict`` gives
the raw fp8 data and its scale, while ``backup`` held the tensor object itself, so a model that had
sampled once got another fingerprint and the entry it had recorded was never found again
(`[current-comfy]`). Each case here runs the server's order on one patcher: match, sample (a miss that
records), match again (a hit), then a fresh load of the same files (a hit), then another checkpoint
and another LoRA strength (no candidates). In process on the CPU, on whichever ComfyUI the run uses.
"""

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_formats import fp8_scaled_state, lightx2v_lora_state
from test_reuse_loop import match_for, request
from test_sampled_model_identity import reuse_patch, sample

pytestmark = pytest.mark.comfy

# (file format, UNETLoader weight_dtype): the official templates load fp8_scaled files at "default";
# users with bf16 or fp16 files pick an fp8 weight_dtype to fit a 14B model.
CASES = [("bf16", "default"), ("fp16", "default"), ("fp8_scaled", "default"),
         ("bf16", "fp8_e4m3fn"), ("bf16", "fp8_e4m3fn_fast"), ("bf16", "fp8_e5m2")]
LORA_STRENGTH = 1.0


@pytest.fixture(scope="module")
def model_files(comfy_runtime, tmp_path_factory):
    """Each format of one tiny checkpoint, another checkpoint of the same shape, and a LightX2V-style LoRA."""
    import folder_paths

    from chorus_core.testbed.tiny_wan import TinyWanConfig, save_tiny_wan_i2v

    folder = tmp_path_factory.mktemp("model_formats")
    base = load_file(str(save_tiny_wan_i2v(folder / "base.safetensors", TinyWanConfig(seed=3))))
    other = load_file(str(save_tiny_wan_i2v(folder / "other.safetensors", TinyWanConfig(seed=4))))
    files = {
        "bf16": {k: v.to(torch.bfloat16) for k, v in base.items()},
        "fp16": base,
        "fp8_scaled": fp8_scaled_state(base),
        "other_fp8_scaled": fp8_scaled_state(other),
        "other_bf16": {k: v.to(torch.bfloat16) for k, v in other.items()},
    }
    for name, state in files.items():
        save_file(state, str(folder / f"{name}.safetensors"))
    (folder / "lora").mkdir()
    save_file(lightx2v_lora_state(base, seed=5), str(folder / "lora" / "lightx2v.safetensors"))
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    folder_paths.add_model_folder_path("loras", str(folder / "lora"))
    return folder


@torch.inference_mode()  # as the server runs every node
def load(name, weight_dtype="default", lora_strength=None):
    """UNETLoader, then LoraLoaderModelOnly when ``lora_strength`` is given: the nodes' own code."""
    import nodes

    (model,) = nodes.UNETLoader().load_unet(f"{name}.safetensors", weight_dtype)
    if lora_strength is not None:
        (model,) = nodes.LoraLoaderModelOnly().load_lora_model_only(model, "lightx2v.safetensors", lora_strength)
    return model


def run(bank, model):
    """One request as the server runs it: Similarity Match on ``model``, then sampling with its patch."""
    positive, _, latent = request()
    with torch.inference_mode():
        return sample(reuse_patch(model, match_for(bank, model, positive, latent)), cfg=1.0)


def candidates(bank, model) -> int:
    positive, _, latent = request()
    return match_for(bank, model, positive, latent).result.candidates


@pytest.fixture()
def bank(tmp_path):
    from chorus_core.bank import MaskBank

    bank = MaskBank.open(tmp_path / "bank")
    yield bank
    bank.close()


@pytest.mark.parametrize("lora", [None, LORA_STRENGTH], ids=["no_lora", "lightx2v_lora"])
@pytest.mark.parametrize("file_format, weight_dtype", CASES, ids=[f"{f}-{d}" for f, d in CASES])
def test_the_same_request_again_hits_on_the_model_that_recorded_it(model_files, bank, file_format, weight_dtype,
                                                                    lora):
    from chorus_core.reuse.model_identity import fingerprint_patcher

    model = load(file_format, weight_dtype, lora)
    before = fingerprint_patcher(model)
    first = run(bank, model)
    assert (first.mode, first.recording) == ("miss", "queued")
    assert fingerprint_patcher(model) == before  # sampling patched the weights in place: same model

    again = run(bank, model)
    assert (again.mode, again.entry_id) == ("hit", first.recorded_entry_id)
    fresh = run(bank, load(file_format, weight_dtype, lora))
    assert (fresh.mode, fresh.entry_id) == ("hit", first.recorded_entry_id)


@pytest.mark.parametrize("file_format", ["bf16", "fp8_scaled"])
def test_another_checkpoint_or_lora_strength_finds_no_entry(model_files, bank, file_format):
    model = load(file_format, lora_strength=LORA_STRENGTH)
    assert run(bank, model).mode == "miss"
    assert candidates(bank, model) == 1
    assert candidates(bank, load(f"other_{file_format}", lora_strength=LORA_STRENGTH)) == 0
    assert candidates(bank, load(file_format, lora_strength=0.5)) == 0
    assert candidates(bank, load(file_format)) == 0


def test_an_fp8_load_of_a_bf16_file_has_entries_of_its_own(model_files, bank):
    """fp8 rounding changes the weights; until a testbed measures that masks carry over, they do not."""
    from chorus_core.reuse.model_identity import fingerprint_patcher

    as_bf16, as_fp8 = load("bf16"), load("bf16", "fp8_e4m3fn")
    assert fingerprint_patcher(as_bf16) == fingerprint_patcher(load("fp16"))  # bf16 and fp16 files of one model
    assert fingerprint_patcher(as_fp8) != fingerprint_patcher(as_bf16)
    assert fingerprint_patcher(load("bf16", "fp8_e4m3fn_fast")) == fingerprint_patcher(as_fp8)


@pytest.mark.parametrize("file_format", ["bf16", "fp8_scaled"])
def test_a_lora_left_unmerged_keeps_the_key(model_files, file_format):
    """A low-VRAM load applies the LoRA on the fly (a LowVramPatch per weight), as dynamic VRAM does on a
    GPU: the weights stay as loaded, and the model is the same one as with the LoRA merged in."""
    from chorus_core.reuse.model_identity import fingerprint_patcher

    model = load(file_format, lora_strength=LORA_STRENGTH)
    key = fingerprint_patcher(model)
    with torch.inference_mode():
        model.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1)  # 1 byte: all low-VRAM
    try:
        assert model.model.model_lowvram is True and model.backup == {}
        assert fingerprint_patcher(model) == key
    finally:
        model.unpatch_model(device_to=torch.device("cpu"))
