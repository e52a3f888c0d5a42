"""Chorus Sparse Attention on fp8 Wan models on the GPU: a miss records, the same request hits, eager and compiled.

Runs with CHORUS_TEST_GPU=1 on a CUDA machine, in a pytest process of its own (ComfyUI is loaded
for the GPU here, not with ``--cpu`` as the rest of the suite loads it)::

    CHORUS_TEST_GPU=1 python -m pytest tests/test_fp8_gpu.py
    CHORUS_TEST_GPU=1 CHORUS_TEST_DYNAMIC_VRAM=1 python -m pytest tests/test_fp8_gpu.py   # DynamicVRAM (0.19.3+)

The two ways users run Wan 14B in fp8 (issue 50, item 1): an ``fp8_scaled`` file (Comfy-Org's layout,
what the official Wan 2.2 I2V template loads; written by ``checkpoint_formats.fp8_scaled_state``)
loaded at ``default``, and a bf16 file loaded with UNETLoader's ``fp8_e4m3fn_fast`` (fp8 weights and
fp8 matrix products). Each is loaded by ComfyUI's own UNETLoader from a small Wan 2.1 I2V model at
head_dim 128 (dim 1024, 8 heads, 2 blocks, random weights), then sampled at 4 euler steps, cfg 1, on
a 5 x 33 x 64 latent (2,720 tokens) through Chorus Sparse Attention (``ReusePatch.install()``, the
MODEL-patch node's code) after Similarity Match: eager, a miss on an empty bank records an entry and
the same request then hits it; compiled (ComfyUI's TorchCompileModel node, inductor), the same on a
bank of its own. The 40-block runs at Wan 14B shapes are tests/benchmarks/bench_user_stack.py's.

Seen on the device (H100, ComfyUI 0.19.3, torch 2.11, comfy-kitchen 0.2.40; 2026-12-05), in this
file's first form (one test doing eager then compiled, commit f5444ce): on the fp8_scaled load the
eager miss recorded and the eager hit served it, the compiled miss (first compile after
``torch._dynamo.reset()``) ran, and the compiled hit (a new install, so a recompile) failed in dynamo
with ``AssertionError: vr must not be None for symbol s31`` (comfy/ops.py:214, cast_bias_weight;
tests/benchmarks/results/user_stack_runs/test_fp8_gpu_log.txt); ``-x`` stopped the fp8_e4m3fn_fast
case. This form (eager and compiled apart, that dynamo failure an xfail) ran on an H100 under
DynamicVRAM (2026-12-07, tests/benchmarks/results/user_stack_runs/test_fp8_gpu_dynamic_vram_*_log.txt):
at first the hits ran as misses, the model's fingerprint changing at its load and then after each
Chorus run (both fixed; the hit test says which tensors changed). After the fixes (call v5, commit
4b88315, ..._v5_log.txt) every test passed but the compiled fp8_scaled one (that dynamo failure), and
the compiled hit after a compiled dense run, an xfail until then (the dense-graph reuse seen at 40
blocks in user_stack_640.md, call c7, which graph_keys fixed), passed, so it is no longer marked.
Not yet run on the legacy loader (--disable-dynamic-vram).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

GPU = os.environ.get("CHORUS_TEST_GPU") == "1" and torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not GPU, reason="set CHORUS_TEST_GPU=1 on a CUDA machine")
LATENT = (5, 33, 64)
STEPS = 4
DENSITY = 0.3
# (file, UNETLoader weight_dtype)
LOADS = [("fp8_scaled", "default"), ("bf16", "fp8_e4m3fn_fast")]


# CHORUS_TEST_DYNAMIC_VRAM=1: every model loads through ComfyUI's DynamicVRAM (ModelPatcherDynamic), as a
# 0.19.3+ server on Linux with an NVIDIA GPU loads it by default; a process of its own (it is process-wide)
DYNAMIC_VRAM = os.environ.get("CHORUS_TEST_DYNAMIC_VRAM") == "1"


@pytest.fixture(scope="module")
def comfy_gpu():
    import bench_end_to_end  # noqa: F401  (puts the repository on sys.path before ComfyUI's folder goes in front)
    from chorus_core.comfy.comfyui_locator import enable_dynamic_vram, prepare_in_process

    prepare_in_process(cpu=False, dynamic_vram=DYNAMIC_VRAM)
    import comfy.model_management  # noqa: F401

    if DYNAMIC_VRAM:
        print("memory:", enable_dynamic_vram())


@pytest.fixture(scope="module")
def model_files(comfy_gpu, tmp_path_factory):
    import bench_end_to_end as e2e
    import folder_paths
    from safetensors.torch import save_file

    from checkpoint_formats import fp8_scaled_state

    model, _ = e2e.build_model(1024, 2048, 2, "cuda", torch.bfloat16)
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.diffusion_model.state_dict().items()}
    del model
    torch.cuda.empty_cache()
    folder = tmp_path_factory.mktemp("fp8_gpu")
    save_file(state, str(folder / "bf16.safetensors"))
    save_file(fp8_scaled_state(state), str(folder / "fp8_scaled.safetensors"))
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    return folder


@torch.inference_mode()
def load(file_format, weight_dtype):
    import bench_user_stack as us

    (model,) = us.comfy_nodes().UNETLoader().load_unet(f"{file_format}.safetensors", weight_dtype)
    assert (type(model).__name__ == "ModelPatcherDynamic") == DYNAMIC_VRAM, type(model)
    return model


def rel_rms(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def sample(model, req):
    import comfy.sample

    positive, negative, latent, _ = req
    noise = comfy.sample.prepare_noise(latent, 0)
    with torch.inference_mode():
        return comfy.sample.sample(model, noise, STEPS, 1.0, "euler", "simple", positive, negative, latent,
                                   disable_pbar=True, seed=0).float()


def chorus_run(model, bank, req, compile_it: bool, requests: list | None = None):
    """Similarity Match, the node's install, (TorchCompileModel), one sampling: (output, report)."""
    import bench_user_stack as us

    from chorus_core.reuse import bank_writer
    from chorus_core.reuse.reuse_match import build_match_request, match_request
    from chorus_core.reuse.reuse_run import ReuseOptions, ReusePatch

    positive, _, latent, clip = req
    with torch.inference_mode():
        request = build_match_request(model, clip, positive, {"samples": latent}, None, 0.9, {}, 128)
        patch = ReusePatch(model, match_request(bank, request),
                           ReuseOptions(dense_warmup_steps=1, hit_warmup_steps=0, dense_last_steps=0,
                                        min_density=DENSITY, max_density=DENSITY, miss_mode="online"),
                           scheduler="simple", sampler="euler")
        patched = patch.install()
    out = sample(us.compiled(patched) if compile_it else patched, req)
    assert bank_writer.flush_all(timeout=120)
    if requests is not None:  # what it matched with (the model's fingerprint), for a failure's message
        requests.append(request)
    return out, patch.last_report


def check_fp8(model, weight_dtype):
    layer = model.model.diffusion_model.blocks[0].self_attn.q
    weight = layer.weight
    if weight_dtype == "default":  # fp8_scaled: comfy-kitchen's QuantizedTensor over fp8 data (0.19.3)
        data = getattr(weight, "_qdata", weight)
        assert data.dtype == torch.float8_e4m3fn, (type(weight), data.dtype)
    else:  # fp8_e4m3fn_fast: fp8 weights and ComfyUI's fp8 matrix-product ops; under DynamicVRAM the
        # weights stay as the file holds them until a layer runs, cast then to the dtype ComfyUI archived
        assert getattr(layer, "weight_comfy_model_dtype", weight.dtype) == torch.float8_e4m3fn
        assert "fp8_ops" in type(layer).__qualname__, type(layer).__qualname__


# torch 2.11 + comfy-kitchen 0.2.40 on ComfyUI 0.19.3: compiling an fp8_scaled model (QuantizedTensor
# weights) a second time in a process fails in dynamo, ComfyUI's own dense model too (device runs of
# 2026-12-05, tests/benchmarks/results/user_stack_640.md); not Chorus's to fix, so said, not hidden
DYNAMO_FP8_SCALED = "vr must not be None for symbol"


def check_hit_ran_sparse(report):
    assert report.mode == "hit", report.warnings
    assert report.backend is not None, "the hit ran no block-sparse call"  # e.g. a dense graph reused
    assert report.backend.split(" ")[0] in ("triton", "fa4"), report.backend  # the GPU kernels
    assert not report.dense_steps  # a hit runs every step sparse


def weights_seen(model) -> dict:
    """name -> (dtype, device, type, made under inference_mode, a few values) of what the fingerprint
    reads, and the patch list's digest and the dtypes it reads tensors as: what differs says why two
    fingerprints of one model differ."""
    from chorus_core.reuse.model_identity import base_weights, computed_dtypes, patches_digest

    weights = base_weights(model)
    read_as = computed_dtypes(model.model.diffusion_model, weights)
    seen = {"(patch list)": patches_digest(model), "(read as)": sorted((n, str(d)) for n, d in read_as.items())}
    for name, t in weights.items():
        seen[name] = (str(t.dtype), str(t.device), type(t).__name__, t.data.is_inference(), sample_values(t))
    return seen


def sample_values(t):
    """8 values spread over ``t``, or why they cannot be read."""
    try:
        with torch.inference_mode():
            raw = t.data.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t
            flat = raw.clone().reshape(-1)  # a copy: some tensors have no version counter for a view
            return "meta" if raw.is_meta else flat[::max(1, flat.numel() // 8)][:8].float().tolist()
    except RuntimeError as exc:
        return f"unreadable: {exc}"


def check_same_model(miss_request, hit_request, seen_at_miss, seen_at_hit):
    """The hit's match must fingerprint the model as the miss's did, or the entry is never found;
    on failure, say which part differs (weights or patch list) and which tensors changed."""
    before, after = miss_request.fingerprint, hit_request.fingerprint
    changed = {n: (seen_at_miss.get(n), seen_at_hit.get(n)) for n in seen_at_miss.keys() | seen_at_hit.keys()
               if seen_at_miss.get(n) != seen_at_hit.get(n)}
    assert before == after, (f"the model's fingerprint changed between the miss and the hit: {before} -> {after}; "
                             f"{len(changed)} tensors changed: {dict(list(sorted(changed.items()))[:6])}")
    assert miss_request.layout == hit_request.layout


@pytest.mark.parametrize("file_format, weight_dtype", LOADS, ids=[f"{f}-{d}" for f, d in LOADS])
def test_the_models_fingerprint_is_the_same_before_and_after_comfyui_loads_it(model_files, file_format,
                                                                               weight_dtype):
    """Similarity Match fingerprints the model before the sampler loads it; the next request's
    match comes after. Under DynamicVRAM (2026-12-07, H100) the hit after a miss found no entry:
    the two must agree, or no request ever hits."""
    from chorus_core.reuse.model_identity import fingerprint_patcher

    import bench_end_to_end as e2e

    model = load(file_format, weight_dtype)
    before, seen_before = fingerprint_patcher(model), weights_seen(model)
    sample(model, e2e.make_request(LATENT))
    after, seen_after = fingerprint_patcher(model), weights_seen(model)
    changed = {n: (seen_before.get(n), seen_after.get(n)) for n in seen_before.keys() | seen_after.keys()
               if seen_before.get(n) != seen_after.get(n)}
    assert before == after, f"{len(changed)} tensors changed: {dict(list(sorted(changed.items()))[:6])}"


@pytest.mark.parametrize("file_format, weight_dtype", LOADS, ids=[f"{f}-{d}" for f, d in LOADS])
def test_a_miss_records_and_the_same_request_hits_on_an_fp8_model(model_files, tmp_path, file_format,
                                                                  weight_dtype):
    import bench_end_to_end as e2e

    from chorus_core.bank import MaskBank

    model = load(file_format, weight_dtype)
    check_fp8(model, weight_dtype)
    req = e2e.make_request(LATENT)
    assert torch.isfinite(sample(model, req)).all()
    bank = MaskBank.open(tmp_path / "bank")
    try:
        requests, seen_at_miss = [], weights_seen(model)
        miss, miss_report = chorus_run(model, bank, req, False, requests)
        seen_at_hit = weights_seen(model)
        hit, hit_report = chorus_run(model, bank, req, False, requests)
    finally:
        bank.close()
    assert (miss_report.mode, miss_report.recording) == ("miss", "queued"), miss_report.warnings
    check_same_model(*requests, seen_at_miss, seen_at_hit)
    assert miss_report.recorded_entry_id and hit_report.entry_id == miss_report.recorded_entry_id, \
        (hit_report.similarity, hit_report.components, hit_report.warnings)
    check_hit_ran_sparse(hit_report)
    assert torch.isfinite(miss).all() and torch.isfinite(hit).all()


@pytest.mark.parametrize("file_format, weight_dtype", LOADS, ids=[f"{f}-{d}" for f, d in LOADS])
def test_compiled_a_miss_records_and_the_same_request_hits_on_an_fp8_model(model_files, tmp_path, file_format,
                                                                           weight_dtype):
    """TorchCompileModel on the patched model: the compiled miss records, the compiled hit runs the
    entry's masks, and served the eager hit's entry it gives the eager hit's output up to compiling."""
    import bench_end_to_end as e2e
    import bench_user_stack as us
    from torch._dynamo.utils import counters

    from chorus_core.bank import MaskBank

    model = load(file_format, weight_dtype)
    req = e2e.make_request(LATENT)
    dense = sample(model, req)
    banks = {how: MaskBank.open(tmp_path / f"bank_{how}") for how in ("eager", "compiled")}
    try:
        chorus_run(model, banks["eager"], req, False)
        eager_hit, _ = chorus_run(model, banks["eager"], req, False)
        torch._dynamo.reset()
        counters.clear()
        try:
            miss, miss_report = chorus_run(model, banks["compiled"], req, True)
            hit, hit_report = chorus_run(model, banks["compiled"], req, True)
            same_entry, same_report = chorus_run(model, banks["eager"], req, True)
        except AssertionError as exc:
            if file_format == "fp8_scaled" and DYNAMO_FP8_SCALED in str(exc):
                pytest.xfail(f"dynamo fails recompiling an fp8_scaled model: {str(exc).splitlines()[0]}")
            raise
    finally:
        for bank in banks.values():
            bank.close()
    assert counters["stats"]["unique_graphs"] > 0  # TorchCompileModel compiled the fp8 model
    assert (miss_report.mode, miss_report.recording) == ("miss", "queued"), miss_report.warnings
    assert hit_report.entry_id == miss_report.recorded_entry_id
    check_hit_ran_sparse(hit_report)
    check_hit_ran_sparse(same_report)
    assert torch.isfinite(miss).all() and torch.isfinite(hit).all()
    torch._dynamo.reset()
    control = rel_rms(sample(us.compiled(model), req), dense)  # how far compiling moves the dense fp8 model
    assert rel_rms(same_entry, eager_hit) <= 2.0 * control + 0.02, (rel_rms(same_entry, eager_hit), control)


def test_a_compiled_hit_after_a_compiled_dense_run_of_the_same_model_runs_sparse(model_files, tmp_path):
    import bench_end_to_end as e2e
    import bench_user_stack as us

    from chorus_core.bank import MaskBank

    model = load("bf16", "fp8_e4m3fn_fast")
    req = e2e.make_request(LATENT)
    bank = MaskBank.open(tmp_path / "bank")
    try:
        chorus_run(model, bank, req, False)  # records the entry, eager
        torch._dynamo.reset()
        sample(us.compiled(model), req)  # the user's compiled dense run first
        _, report = chorus_run(model, bank, req, True)
    finally:
        bank.close()
    check_hit_ran_sparse(report)
