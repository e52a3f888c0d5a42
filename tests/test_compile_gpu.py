"""A compiled Wan model with Chorus on the GPU equals the eager one (FA4 sparse and dense).

Runs with CHORUS_TEST_GPU=1 on a CUDA machine, in a pytest process of its own (ComfyUI is
loaded here for the GPU, not with ``--cpu`` as the rest of the suite loads it):

    CHORUS_TEST_GPU=1 python -m pytest tests/test_compile_gpu.py

ComfyUI's WAN21_I2V ``WanModel`` at head_dim 128 (dim 1024, 8 heads, 2 blocks, random weights,
bf16), a 5 x 33 x 64 latent (5 x 17 x 32 = 2,720 tokens: the last 128-row block is ragged),
cond + uncond as one batch, 4 euler steps, one dense warm-up step; compiled as the core TorchCompileModel node
does it, with ``fullgraph=True`` so any graph break fails.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent / "benchmarks"  # the benchmark's model and request builders
if str(BENCHMARKS) not in sys.path:  # (conftest puts the repository and tests/ on the path)
    sys.path.insert(0, str(BENCHMARKS))

GPU = os.environ.get("CHORUS_TEST_GPU") == "1" and torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not GPU, reason="set CHORUS_TEST_GPU=1 on a CUDA machine")
LATENT = (5, 33, 64)
STEPS = 4


@pytest.fixture(scope="module")
def comfy_gpu():
    from chorus_core.comfy.comfyui_locator import prepare_in_process

    prepare_in_process(cpu=False)
    import comfy.model_management  # noqa: F401


def rel_rms(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def sample(patcher, req):
    import comfy.sample

    positive, negative, latent, _ = req
    noise = comfy.sample.prepare_noise(latent, 0)
    return comfy.sample.sample(patcher, noise, STEPS, 5.0, "euler", "simple", positive, negative, latent,
                               disable_pbar=True, seed=0)


def compiled_clone(patcher):
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    clone = patcher.clone()
    set_torch_compile_wrapper(model=clone, backend="inductor", fullgraph=True)
    return clone


@pytest.fixture(scope="module")
def wan(comfy_gpu):
    """(patcher, request, how far compiling moves the dense model's output: the control)."""
    import bench_end_to_end as e2e

    _, patcher = e2e.build_model(1024, 2048, 2, "cuda", torch.bfloat16)
    req = e2e.make_request(LATENT)
    torch._dynamo.reset()
    control = rel_rms(sample(compiled_clone(patcher), req), sample(patcher, req))
    return patcher, req, control


@pytest.mark.parametrize("backend", ["fa4", "triton"])
def test_compiled_wan_model_with_a_hit_equals_eager_without_graph_breaks(wan, backend, monkeypatch):
    import bench_end_to_end as e2e
    from torch._dynamo.utils import counters

    import kernels.fa4_block_sparse as fa4
    from chorus_core.attention.mask_provider import DenseWarmupProvider, StaticBlockMapProvider
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention
    from kernels.dense_attention import dense_route_for

    probe = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16, device="cuda")
    if backend == "fa4" and fa4.fa4_unsupported_reason(probe, 128, 128) is not None:
        pytest.skip(f"FA4: {fa4.fa4_unsupported_reason(probe, 128, 128)}")
    monkeypatch.setenv("CHORUS_BLOCK_SPARSE_BACKEND", backend)
    patcher, req, control = wan
    grid = e2e.token_grid(LATENT)
    maps = {layer: e2e.structured_block_map(grid, 8, 0.3, 7 + layer, "cuda").cpu() for layer in range(2)}

    def patched():
        provider = DenseWarmupProvider(StaticBlockMapProvider.for_all_steps(maps, (128, 128)), 1)
        return install_sparse_attention(patcher, provider)

    eager = patched()
    expected = sample(eager, req)
    torch._dynamo.reset()
    counters.clear()
    compiled = compiled_clone(patched())
    out = sample(compiled, req)

    assert torch.isfinite(out).all()
    # bf16: inductor fuses the other ops differently, and 4 steps of random weights amplify it;
    # the sparse patch may add no more than that (the dense model, compiled vs eager, is the control)
    assert rel_rms(out, expected) <= 1.25 * control + 1e-3, (rel_rms(out, expected), control)
    assert sum(counters["graph_break"].values()) == 0
    stats = get_run_stats(compiled)
    assert stats.backend.startswith(backend), stats.backend
    assert stats.sparse_calls == 2 * (STEPS - 1) and not stats.warnings
    expected_dense = dense_route_for(torch.device("cuda"), torch.bfloat16, 128)[0] or "comfyui"
    assert stats.dense_backend.startswith(expected_dense), stats.dense_backend
    assert get_run_stats(eager).backend == stats.backend
