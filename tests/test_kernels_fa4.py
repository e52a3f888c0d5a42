"""FlashAttention-4 block-sparse backend on the GPU, against the float64 reference.

Runs with CHORUS_TEST_GPU=1 on an sm_90 / sm_100 CUDA machine where flash-attn-4 imports;
skipped elsewhere (the CPU selection tests live in test_kernels_compile.py). Inputs are
drawn fresh per case; outputs are NaN-poisoned so an unwritten tile fails.
"""

import math
import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kernels import fa4_block_sparse as fa4  # noqa: E402
from kernels.block_sparse import (  # noqa: E402
    block_map_to_mask,
    block_sparse_attention,
    block_sparse_attention_reference,
    last_backend_choice,
    select_backend,
)


def _skip_reason():
    if os.environ.get("CHORUS_TEST_GPU") != "1" or not torch.cuda.is_available():
        return "set CHORUS_TEST_GPU=1 on a CUDA machine"
    probe = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16, device="cuda")
    return fa4.fa4_unsupported_reason(probe, 128, 128)


SKIP = _skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=f"FA4 GPU tests: {SKIP}")
BLOCK, D = 128, 128


@pytest.fixture
def gen(request):
    g = torch.Generator(device="cuda")
    return g.manual_seed(zlib.crc32(request.node.name.encode()))


def rel_rms(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def random_block_map(b, h, nb, density, gen):
    """Each row keeps ~density of the key blocks, always its diagonal block (never empty)."""
    live = torch.rand(b, h, nb, nb, device="cuda", generator=gen) < density
    return live | torch.eye(nb, dtype=torch.bool, device="cuda")


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def check_against_fp64(q, k, v, mask, heads, skip_reshape, skip_output_reshape):
    """FA4 into a NaN-poisoned buffer vs the float64 reference; returns rel RMS."""
    if skip_reshape:
        b, h, n, d = q.shape
    else:
        b, n, hd = q.shape
        h, d = heads, hd // heads
    shape = (b, h, n, d) if skip_output_reshape else (b, n, h * d)
    out = poisoned(shape, q.dtype)
    res = block_sparse_attention(q, k, v, mask, heads, skip_reshape, skip_output_reshape, out=out, backend="fa4")
    assert res is out
    assert last_backend_choice().name == "fa4"
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} unwritten/non-finite outputs"
    ref = block_sparse_attention_reference(
        q.double(), k.double(), v.double(), mask, heads, skip_reshape, skip_output_reshape
    )
    err = rel_rms(out, ref)
    assert err <= 1e-2, f"rel RMS {err:.3g} > 1e-2"
    return err


# (N, heads, density, dtype): ragged N (1,000 / 4,097 / 16,385) and 720p's 75,600 tokens
CASES = [
    (1000, 4, 0.05, torch.bfloat16),
    (1000, 4, 1.0, torch.float16),
    (4097, 4, 0.15, torch.bfloat16),
    (4097, 4, 0.50, torch.float16),
    (16385, 4, 0.25, torch.bfloat16),
    (16385, 2, 1.0, torch.bfloat16),
    (75600, 2, 0.10, torch.bfloat16),
]
LAYOUTS = [(False, False), (True, True), (True, False), (False, True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}-H{c[1]}-d{c[2]}-{str(c[3])[6:]}")
def test_fa4_matches_fp64_reference_batch2_both_layouts(case, gen):
    n, h, density, dtype = case
    nb = math.ceil(n / BLOCK)
    block_map = random_block_map(2, h, nb, density, gen)  # cond and uncond masks differ
    mask = block_map_to_mask(block_map, BLOCK, BLOCK, n)
    q, k, v = (torch.randn(2, n, h * D, device="cuda", generator=gen).to(dtype) for _ in range(3))
    layouts = LAYOUTS if n <= 4097 else LAYOUTS[:2]  # all four where the reference is cheap
    for skip_reshape, skip_output_reshape in layouts:
        qq, kk, vv = (x.view(2, n, h, D).transpose(1, 2).contiguous() if skip_reshape else x for x in (q, k, v))
        check_against_fp64(qq, kk, vv, mask, h, skip_reshape, skip_output_reshape)


def test_fa4_batch1_mask_broadcasts_over_cond_uncond(gen):
    n, h = 4097, 4
    mask = block_map_to_mask(random_block_map(1, h, math.ceil(n / BLOCK), 0.3, gen), BLOCK, BLOCK, n)
    q, k, v = (torch.randn(2, n, h * D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    check_against_fp64(q, k, v, mask, h, False, False)


def test_fa4_each_batch_element_uses_its_own_mask(gen):
    """cond gets one block per row, uncond a dense-ish mask: each half equals its own run."""
    n, h = 2000, 4
    nb = math.ceil(n / BLOCK)
    maps = torch.cat([random_block_map(1, h, nb, 0.0, gen), random_block_map(1, h, nb, 0.7, gen)])
    mask = block_map_to_mask(maps, BLOCK, BLOCK, n)
    q, k, v = (torch.randn(2, n, h * D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    both = block_sparse_attention(q, k, v, mask, h, backend="fa4")
    for i in range(2):
        mask_i = block_map_to_mask(maps[i : i + 1], BLOCK, BLOCK, n)
        one = block_sparse_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], mask_i, h, backend="fa4")
        assert rel_rms(both[i : i + 1], one) < 1e-6


def test_auto_picks_fa4_and_says_why(gen):
    n, h = 1000, 2
    mask = block_map_to_mask(random_block_map(2, h, 8, 0.5, gen), BLOCK, BLOCK, n)
    q = torch.randn(2, n, h * D, device="cuda", generator=gen).to(torch.bfloat16)
    choice = select_backend(q, mask)
    assert choice.name == "fa4", choice
    assert choice.reason.startswith("FlashAttention-4 block-sparse forward (sm_")
    block_sparse_attention(q, q, q, mask, h)
    assert last_backend_choice() == choice
    q64 = torch.randn(2, n, h * 64, device="cuda", generator=gen).to(torch.bfloat16)
    assert select_backend(q64, mask).name == "triton"
    assert "head_dim 128, got 64" in select_backend(q64, mask).reason


def test_fa4_under_torch_compile_fullgraph_equals_eager(gen):
    n, h = 4097, 4
    mask = block_map_to_mask(random_block_map(2, h, math.ceil(n / BLOCK), 0.2, gen), BLOCK, BLOCK, n)
    q, k, v = (torch.randn(2, n, h * D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))

    def attn_then_scale(q, k, v, mask):
        return block_sparse_attention(q * 1.0, k, v, mask, h) * 0.5

    compiled = torch.compile(attn_then_scale, fullgraph=True)
    got = compiled(q, k, v, mask)
    assert last_backend_choice().name == "fa4"
    assert rel_rms(got, attn_then_scale(q, k, v, mask)) < 1e-6


# --------------------------------------------------------------------------------------------
# FA4 dense: the calls Chorus leaves dense (warm-up steps, dense layers)
# --------------------------------------------------------------------------------------------

DENSE_CASES = [(1000, 4), (4097, 4), (16385, 2), (75600, 2)]


@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: f"N{c[0]}-H{c[1]}")
def test_fa4_dense_matches_fp64_reference_batch2(case, gen):
    from kernels.dense_attention import dense_attention, dense_attention_reference, dense_unsupported_reason
    from kernels.fa4_block_sparse import fa4_dense_fwd

    n, h = case
    q, k, v = (torch.randn(2, n, h * D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    assert dense_unsupported_reason(q, h) is None
    ref = dense_attention_reference(q.double(), k.double(), v.double(), h)
    assert rel_rms(dense_attention(q, k, v, h), ref) <= 1e-2
    layouts = LAYOUTS if n <= 4097 else LAYOUTS[:2]
    for skip_reshape, skip_output_reshape in layouts:
        qq, kk, vv = (x.view(2, n, h, D).transpose(1, 2).contiguous() if skip_reshape else x for x in (q, k, v))
        out = dense_attention(qq, kk, vv, h, skip_reshape, skip_output_reshape)
        expected = ref.view(2, n, h, D).transpose(1, 2) if skip_output_reshape else ref
        assert torch.isfinite(out).all()
        assert rel_rms(out, expected) <= 1e-2
    o = poisoned((2, h, n, D), torch.bfloat16)  # every element written
    fa4_dense_fwd(*(x.view(2, n, h, D).transpose(1, 2) for x in (q, k, v)), o)
    assert torch.isfinite(o).all()


def test_fa4_dense_under_torch_compile_fullgraph_equals_eager(gen):
    from kernels.dense_attention import dense_attention

    n, h = 4097, 4
    q, k, v = (torch.randn(2, n, h * D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))

    def attn_then_scale(q, k, v):
        return dense_attention(q * 1.0, k, v, h) * 0.5

    got = torch.compile(attn_then_scale, fullgraph=True)(q, k, v)
    assert rel_rms(got, attn_then_scale(q, k, v)) < 1e-6


def test_fa4_dense_refuses_what_it_cannot_run_with_the_reason():
    from kernels.dense_attention import dense_unsupported_reason

    q64 = torch.empty(1, 10, 2 * 64, device="cuda", dtype=torch.bfloat16)
    assert dense_unsupported_reason(q64, 2) == "the FA4 path is used at head_dim 128, got 64"
    q32 = torch.empty(1, 10, 128, device="cuda", dtype=torch.float32)
    assert dense_unsupported_reason(q32, 1) == "FA4 needs bf16 or fp16 inputs, got torch.float32"
