"""comfy-kitchen's CUDA ``sol_attn`` (what core ComfyUI's Model Sparse Attention runs on a GPU) against
our float32 reproduction of its arithmetic, so that rows computed on the kernel and rows computed by
the reproduction are one method. Runs with CHORUS_TEST_GPU=1 on a CUDA machine with comfy-kitchen's
CUDA backend (tests/benchmarks/user_stack_env.sh puts it there on the device)::

    CHORUS_TEST_GPU=1 python -m pytest tests/test_core_sparse_gpu.py
"""

import os

import pytest
import torch

GPU = os.environ.get("CHORUS_TEST_GPU") == "1" and torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not GPU, reason="set CHORUS_TEST_GPU=1 on a CUDA machine")


def random_qkv(tokens=8192, heads=4, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, heads, tokens, 128, device="cuda", generator=g) for _ in range(3))
    k = k + 0.5 * q.roll(64, dims=2)  # some structure: scores not all alike
    return (t.to(torch.bfloat16).float() for t in (q, k, v))


@pytest.mark.parametrize("tau", [0.8, 1.3, 2.0])
def test_the_kernel_computes_what_the_reproduction_computes(tau):
    import comfy_kitchen as ck

    from tests.testbed.core_sparse import kernel_attention, route_tau, routing_of, sol_attention

    assert ck.sol_attn_is_available(torch.device("cuda")), "comfy-kitchen's CUDA sol_attn is not loaded"
    q, k, v = random_qkv()
    routing = routing_of(q, k)
    reference = sol_attention(q, k, v, route_tau(routing, tau), routing)
    kernel = kernel_attention(q, k, v, tau, extra_tokens=0)  # the reference has no extra tokens
    cosine = torch.nn.functional.cosine_similarity(kernel.flatten(), reference.flatten(), dim=0)
    worst = ((kernel - reference).abs().max() / reference.abs().max()).item()
    print(f"tau {tau}: cosine {cosine.item():.6f}, worst error {worst:.4f} of the largest output")
    assert cosine > 0.995 and worst < 0.1  # INT8 routing and bf16 products, not float32


def test_extra_tokens_bring_the_kernel_closer_to_dense():
    from tests.testbed.core_sparse import kernel_attention

    q, k, v = random_qkv(seed=1)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    errors = {extra: (kernel_attention(q, k, v, 1.3, extra) - dense).pow(2).mean().sqrt().item() for extra in (0, 256)}
    print(f"rms error against dense: {errors}")
    assert errors[256] < errors[0]
