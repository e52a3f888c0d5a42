"""The dense calls Chorus leaves dense, on a GPU without FlashAttention-4: torch SDPA with cuDNN's
attention first, against the float64 reference, eager and under torch.compile.

Runs with CHORUS_TEST_GPU=1 on an sm_80+ CUDA machine (the CPU routing tests are in
test_compile_patch.py):

    CHORUS_TEST_GPU=1 python -m pytest tests/test_dense_cudnn_gpu.py
"""

import os

import pytest
import torch

GPU = os.environ.get("CHORUS_TEST_GPU") == "1" and torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not GPU, reason="set CHORUS_TEST_GPU=1 on a CUDA machine")
D = 128


def rel_rms(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()


def wan_like(n: int, h: int, batch: int = 2, dtype=torch.float16):
    gen = torch.Generator(device="cuda").manual_seed(n)
    return [torch.randn(batch, n, h * D, device="cuda", generator=gen).to(dtype) for _ in range(3)]


def test_the_cudnn_first_order_makes_torch_pick_cudnn_at_wans_shapes():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.dense_attention import CUDNN_FIRST, cudnn_unsupported_for

    assert cudnn_unsupported_for(torch.device("cuda"), torch.float16, D) is None
    q, k, v = (x.view(2, 32760, 40, D).transpose(1, 2) for x in wan_like(32760, 40))  # 480p Wan 14B
    with sdpa_kernel(CUDNN_FIRST, set_priority=True):
        chosen = torch._fused_sdp_choice(q, k, v)
    assert SDPBackend(chosen) == SDPBackend.CUDNN_ATTENTION, SDPBackend(chosen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n", [1000, 4097, 32760])
def test_cudnn_first_sdpa_matches_fp64_reference_in_both_layouts(n, dtype):
    from kernels.dense_attention import cudnn_first_sdpa, cudnn_unsupported_for, dense_attention_reference

    h = 8
    assert cudnn_unsupported_for(torch.device("cuda"), dtype, D) is None
    q, k, v = wan_like(n, h, dtype=dtype)
    ref = dense_attention_reference(q.double(), k.double(), v.double(), h)
    assert rel_rms(cudnn_first_sdpa(q, k, v, h), ref) <= 1e-2
    views = [x.view(2, n, h, D).transpose(1, 2) for x in (q, k, v)]  # ComfyUI's [B, H, N, D] views
    out = cudnn_first_sdpa(*views, h, True, True)
    assert torch.isfinite(out).all() and out.is_contiguous()
    assert rel_rms(out, ref.view(2, n, h, D).transpose(1, 2)) <= 1e-2


def test_dense_attention_without_fa4_is_cudnn_under_compile_too(monkeypatch):
    import kernels.dense_attention as dense

    monkeypatch.setattr(dense, "dense_unsupported_for", lambda device, dtype, head_dim: "FA4 left out")
    calls, sdpa = [], dense.cudnn_first_sdpa
    monkeypatch.setattr(dense, "cudnn_first_sdpa", lambda *a: calls.append(1) or sdpa(*a))
    n, h = 4097, 8
    q, k, v = wan_like(n, h)

    def attn_then_scale(q, k, v):
        return dense.dense_attention(q * 1.0, k, v, h) * 0.5

    torch._dynamo.reset()
    got = torch.compile(attn_then_scale, fullgraph=True)(q, k, v)
    assert rel_rms(got, attn_then_scale(q, k, v)) < 1e-3
    ref = dense.dense_attention_reference(q.double(), k.double(), v.double(), h) * 0.5
    assert rel_rms(got, ref) <= 1e-2
    assert calls  # cuDNN-first SDPA ran, not the reference
