"""Block attention mass: the torch reference against float64 softmax, the Triton kernel against the reference."""

import os

if os.environ.get("CHORUS_TEST_GPU") != "1":  # as conftest: the interpreter unless a GPU run
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.block_mass import block_mass, block_mass_reference, to_bhnd, triton_available  # noqa: E402

CASES = [  # (B, H, N, D, block): ragged and exact last blocks, D not a power of two
    (1, 2, 64, 16, 16),
    (2, 3, 50, 16, 16),
    (1, 2, 37, 24, 16),
    (1, 1, 100, 32, 32),
]
IDS = [f"B{b}-H{h}-N{n}-D{d}-blk{bs}" for b, h, n, d, bs in CASES]


def float64_block_mass(q, k, block, stride=1):
    """Independent oracle: the full float64 softmax matrix, summed per block pair by loops."""
    q, k = q.double(), k.double()
    p = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)  # [B, H, N, N]
    n = q.shape[2]
    nb = math.ceil(n / block)
    out = torch.zeros(*q.shape[:2], nb, nb, dtype=torch.float64)
    for i in range(nb):
        for j in range(nb):
            tile = p[:, :, i * block : (i + 1) * block : stride, j * block : (j + 1) * block]
            out[:, :, i, j] = tile.sum((-1, -2)) / tile.shape[2]
    return out


def rel_rms(x, ref):
    return float((x.double() - ref.double()).square().mean().sqrt() / ref.double().square().mean().sqrt())


def check_close(x, ref, rel, abs_):
    assert not torch.isnan(x).any(), "NaN in output (an unwritten tile?)"
    assert rel_rms(x, ref) < rel
    assert float((x.double() - ref.double()).abs().max()) < abs_


def qk(b, h, n, d, dtype=torch.float32, spread=2.0):
    # Scaled inputs so the softmax is peaked, as in trained attention, not near-uniform.
    return (torch.randn(b, h, n, d) * spread).to(dtype), (torch.randn(b, h, n, d) * spread).to(dtype)


@pytest.mark.parametrize("b,h,n,d,bs", CASES, ids=IDS)
def test_reference_matches_float64_and_rows_sum_to_one(b, h, n, d, bs):
    q, k = qk(b, h, n, d)
    mass = block_mass_reference(q, k, block_size=bs)
    assert mass.shape == (b, h, math.ceil(n / bs), math.ceil(n / bs)) and mass.dtype == torch.float32
    check_close(mass, float64_block_mass(q, k, bs), rel=1e-5, abs_=1e-6)
    torch.testing.assert_close(mass.sum(-1), torch.ones(mass.shape[:-1]), rtol=0, atol=1e-5)


def test_reference_float64_in_float64_out():
    q, k = qk(1, 2, 45, 16, torch.float64)
    mass = block_mass_reference(q, k, block_size=16)
    assert mass.dtype == torch.float64
    torch.testing.assert_close(mass, float64_block_mass(q, k, 16), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("n", [64, 70, 65])
def test_reference_query_stride_matches_sampled_float64(n):
    q, k = qk(1, 2, n, 16)
    mass = block_mass_reference(q, k, block_size=16, query_stride=4)
    check_close(mass, float64_block_mass(q, k, 16, stride=4), rel=1e-5, abs_=1e-6)
    torch.testing.assert_close(mass.sum(-1), torch.ones(mass.shape[:-1]), rtol=0, atol=1e-5)


def test_reference_chunking_matches_one_chunk(monkeypatch):
    import kernels.block_mass as bm

    q, k = qk(2, 3, 70, 16)
    whole = bm.block_mass_reference(q, k, block_size=16)
    monkeypatch.setattr(bm, "_REF_SCORE_BUDGET", 16 * 70)  # one head and one query block per chunk
    torch.testing.assert_close(bm.block_mass_reference(q, k, block_size=16), whole, rtol=1e-6, atol=1e-7)


def test_comfy_layout_matches_bhnd():
    q, k = qk(2, 3, 40, 16)
    comfy = lambda x: x.transpose(1, 2).reshape(2, 40, 48)  # noqa: E731  [B, N, H*D]
    assert torch.equal(to_bhnd(comfy(q), 3), q)
    torch.testing.assert_close(block_mass(comfy(q), comfy(k), heads=3, block_size=16), block_mass(q, k, block_size=16))


def test_bad_layouts_raise():
    q = torch.randn(1, 10, 48)
    with pytest.raises(ValueError, match="heads"):
        block_mass(q, q, block_size=16)
    with pytest.raises(ValueError, match="equal"):
        block_mass(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 12, 8), block_size=16)


needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
# CPU tensors run in the Triton interpreter; CHORUS_TEST_GPU=1 runs the compiled kernel instead.
DEVICE = "cuda" if os.environ.get("CHORUS_TEST_GPU") == "1" else "cpu"
TOL = 1e-4 if DEVICE == "cuda" else 1e-5  # fp32 inputs use exact (ieee) dots on the GPU too


@needs_triton
@pytest.mark.parametrize("b,h,n,d,bs", CASES, ids=IDS)
def test_triton_matches_reference_fp32(b, h, n, d, bs):
    q, k = (x.to(DEVICE) for x in qk(b, h, n, d))
    out = block_mass(q, k, block_size=bs, backend="triton")
    check_close(out.cpu(), block_mass_reference(q, k, block_size=bs).cpu(), rel=TOL, abs_=TOL)


@needs_triton
def test_triton_comfy_layout_bf16_and_given_lse():
    b, h, n, d = 1, 2, 48, 16
    q, k = (x.to(DEVICE) for x in qk(b, h, n, d, torch.bfloat16))
    comfy = lambda x: x.transpose(1, 2).reshape(b, n, h * d)  # noqa: E731
    ref = block_mass_reference(q, k, block_size=16)
    out = block_mass(comfy(q), comfy(k), heads=h, block_size=16, backend="triton")
    check_close(out.cpu(), ref.cpu(), rel=max(TOL, 1e-4), abs_=max(TOL, 1e-5))  # bf16 products are exact in fp32
    lse = (q.float() @ k.float().transpose(-1, -2) / math.sqrt(d)).logsumexp(-1)
    with_lse = block_mass(comfy(q), comfy(k), heads=h, block_size=16, lse=lse, backend="triton")
    check_close(with_lse.cpu(), ref.cpu(), rel=max(TOL, 1e-4), abs_=max(TOL, 1e-5))


@needs_triton
@pytest.mark.parametrize("n,bs,stride", [(64, 16, 2), (81, 32, 2), (150, 16, 4), (100, 32, 4)])
def test_triton_query_stride_matches_reference(n, bs, stride):
    # A tile holds `stride` query blocks; N=150, bs=16: 10 blocks, the last tile has 2 past the end.
    q, k = (x.to(DEVICE) for x in qk(1, 2, n, 16))
    out = block_mass(q, k, block_size=bs, query_stride=stride, backend="triton")
    ref = block_mass_reference(q, k, block_size=bs, query_stride=stride)
    check_close(out.cpu(), ref.cpu(), rel=TOL, abs_=TOL)


@needs_triton
def test_triton_rejects_block_sizes_it_cannot_tile():
    q, k = qk(1, 1, 40, 16)
    with pytest.raises(ValueError, match="power-of-two"):
        block_mass(q, k, block_size=24, backend="triton")
    with pytest.raises(ValueError, match="power-of-two query_stride"):
        block_mass(q, k, block_size=48, query_stride=3, backend="triton")
