"""Block-sparse attention: converters, the pure-torch reference, and the Triton kernel.

On the CPU the Triton kernel runs in its interpreter (TRITON_INTERPRET=1, float32: the
interpreter's bf16 dot is wrong). With CHORUS_TEST_GPU=1 on a CUDA machine the GPU cases run
in fp16/bf16 at block sizes 64 and 128.
"""

import os

if os.environ.get("CHORUS_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before torch/triton import

import math
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kernels.block_sparse import (  # noqa: E402
    BlockSparseMask,
    block_map_to_element_mask,
    block_map_to_mask,
    block_sparse_attention,
    block_sparse_attention_reference,
    mask_to_block_map,
    select_backend,
    triton_available,
)

GPU = os.environ.get("CHORUS_TEST_GPU") == "1" and torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="set CHORUS_TEST_GPU=1 on a CUDA machine")
# Triton on CPU tensors needs its interpreter; under CHORUS_TEST_GPU=1 the GPU cases cover it
needs_triton = pytest.mark.skipif(
    not triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton and TRITON_INTERPRET=1 (CPU interpreter)",
)


# --------------------------------------------------------------------------------------------
# helpers (fixtures live here, not in a shared conftest)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def gen(request):
    """A generator seeded per test id: fresh inputs for every case, reproducible on failure."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def rel_rms(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def assert_close(out, ref, rms_tol, max_tol):
    """Relative RMS and max-abs checks; any NaN/inf in out (an unwritten tile) fails."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} non-finite outputs"
    rms, mx = rel_rms(out, ref), (out.double() - ref.double()).abs().max().item()
    assert rms < rms_tol and mx < max_tol, f"rel_rms={rms:.3g} (tol {rms_tol}), max_abs={mx:.3g} (tol {max_tol})"


def ensure_rows(live, gen):
    """Give every empty query-block row one random live key block."""
    empty = ~live.any(-1)
    pick = torch.randint(0, live.shape[-1], live.shape[:-1], generator=gen)
    live[empty, pick[empty]] = True
    return live


def random_map(b, h, nq, nk, density, gen):
    return ensure_rows(torch.rand(b, h, nq, nk, generator=gen) < density, gen)


def one_per_row_map(b, h, nq, nk, gen):
    ids = torch.randint(0, nk, (b, h, nq), generator=gen)
    return F.one_hot(ids, nk).bool()


def all_live_map(b, h, nq, nk, gen):
    return torch.ones(b, h, nq, nk, dtype=torch.bool)


def structured_map(b, h, nq, nk, gen, grid=(4, 6, 8)):
    """Local 3D windows over a (t, y, x) token grid plus a few global key columns.

    Block centres are placed on the grid by raster order (as Wan's tokens are); the window
    radius differs per head, so rows keep uneven numbers of live blocks.
    """
    t, y, x = grid

    def centres(n):
        pos = (torch.arange(n) + 0.5) / n * (t * y * x)
        return torch.stack([pos // (y * x), (pos // x) % y, pos % x], -1)

    dist = torch.cdist(centres(nq), centres(nk), p=float("inf"))  # [nq, nk]
    radius = 1.0 + torch.rand(b, h, 1, 1, generator=gen) * 2.5
    live = dist < radius
    glob = torch.randint(0, nk, (b, h, 1, 2), generator=gen)
    live = live | F.one_hot(glob, nk).bool().any(-2)
    return ensure_rows(live, gen)


MAPS = {
    "random10": lambda b, h, nq, nk, g: random_map(b, h, nq, nk, 0.10, g),
    "random35": lambda b, h, nq, nk, g: random_map(b, h, nq, nk, 0.35, g),
    "random70": lambda b, h, nq, nk, g: random_map(b, h, nq, nk, 0.70, g),
    "one_per_row": one_per_row_map,
    "all_live": all_live_map,
    "structured": structured_map,
}


def make_case(b, h, n, d, block, kind, gen, dtype=torch.float32, device="cpu"):
    nq = nk = math.ceil(n / block)
    block_map = MAPS[kind](b, h, nq, nk, gen)
    q, k, v = (torch.randn(b, n, h * d, generator=gen, dtype=torch.float32).to(device, dtype) for _ in range(3))
    return q, k, v, block_map


def dense_masked_fp64(q, k, v, block_map, block_q, block_k, heads):
    """Float64 dense softmax with the element mask: the reference's reference. [B, N, H*D]."""
    b, n, hd = q.shape
    qh, kh, vh = (x.double().view(b, n, heads, hd // heads).transpose(1, 2) for x in (q, k, v))
    em = block_map_to_element_mask(block_map, block_q, block_k, n).expand(b, heads, n, n)
    s = (qh @ kh.transpose(-1, -2)) * (hd // heads) ** -0.5
    o = s.masked_fill(~em, float("-inf")).softmax(-1) @ vh
    return o.transpose(1, 2).reshape(b, n, hd)


def run_triton(q, k, v, mask, heads, config=None, skip_reshape=False, skip_output_reshape=False):
    """Triton path into a NaN-poisoned output buffer, so unwritten tiles show up."""
    if skip_reshape:
        b, h, n, d = q.shape
    else:
        b, n, hd = q.shape
        h, d = heads, hd // heads
    shape = (b, h, n, d) if skip_output_reshape else (b, n, h * d)
    out = torch.full(shape, float("nan"), dtype=q.dtype, device=q.device)
    res = block_sparse_attention(
        q, k, v, mask, heads, skip_reshape, skip_output_reshape, out=out, backend="triton", config=config
    )
    assert res is out
    return out


# --------------------------------------------------------------------------------------------
# converters
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(MAPS))
@pytest.mark.parametrize("n,bq,bk", [(100, 16, 16), (130, 32, 16), (257, 16, 64)], ids=lambda x: str(x))
def test_converters_round_trip(kind, n, bq, bk, gen):
    nq, nk = math.ceil(n / bq), math.ceil(n / bk)
    block_map = MAPS[kind](2, 3, nq, nk, gen)
    mask = block_map_to_mask(block_map, bq, bk, n)
    assert mask.live_blocks.dtype == mask.live_counts.dtype == torch.int32
    assert (mask.block_q, mask.block_k, mask.seq_len, mask.batch_size) == (bq, bk, n, 2)
    assert torch.equal(mask.live_counts, block_map.sum(-1).int())
    assert torch.equal(mask_to_block_map(mask), block_map)
    assert mask.density == pytest.approx(block_map.float().mean().item())
    mask.validate()  # ascending ids, counts in range


def test_element_mask_matches_block_map(gen):
    block_map = random_map(1, 2, 4, 3, 0.5, gen)
    em = block_map_to_element_mask(block_map, 5, 7, 19)
    assert em.shape == (1, 2, 19, 19)
    for i in range(19):
        for j in range(19):
            assert em[0, 1, i, j] == block_map[0, 1, i // 5, j // 7]


def test_padding_never_reads_as_live():
    block_map = torch.zeros(1, 1, 2, 4, dtype=torch.bool)
    block_map[0, 0, 0, [1, 3]] = True
    block_map[0, 0, 1, 2] = True  # row 1 shorter: padded
    mask = block_map_to_mask(block_map, 16, 8, 32)
    assert mask.live_blocks.shape[-1] == 2
    assert mask.live_blocks[0, 0, 0].tolist() == [1, 3]
    assert mask.live_blocks[0, 0, 1, 0].item() == 2
    assert torch.equal(mask_to_block_map(mask), block_map)


# --------------------------------------------------------------------------------------------
# input errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_empty_query_block_is_a_value_error(backend, gen):
    block_map = random_map(1, 2, 4, 4, 0.5, gen)
    block_map[0, 1, 2] = False
    mask = block_map_to_mask(block_map, 16, 16, 60)
    q, k, v = (torch.randn(1, 60, 2 * 16, generator=gen) for _ in range(3))
    with pytest.raises(ValueError, match=r"no live key block.*batch 0, head 1, query block 2"):
        block_sparse_attention(q, k, v, mask, 2, backend=backend)


def test_mismatched_inputs_are_value_errors(gen):
    block_map = random_map(1, 2, 4, 4, 0.5, gen)
    mask = block_map_to_mask(block_map, 16, 16, 60)
    q = torch.randn(1, 61, 32, generator=gen)
    with pytest.raises(ValueError, match="seq_len=60"):
        block_sparse_attention_reference(q, q, q, mask, 2)
    q = torch.randn(1, 60, 48, generator=gen)
    with pytest.raises(ValueError, match="heads"):
        block_sparse_attention_reference(q, q, q, mask, 3)
    unsorted = BlockSparseMask(mask.live_blocks.flip(-1).contiguous(), torch.full_like(mask.live_counts, mask.live_blocks.shape[-1]), 16, 16, 60)
    with pytest.raises(ValueError, match="ascending"):
        unsorted.validate()


def test_block_map_shape_is_checked():
    with pytest.raises(ValueError, match=r"\[B, H, 4, 4\]"):
        block_map_to_mask(torch.ones(1, 1, 3, 4, dtype=torch.bool), 16, 16, 60)


# --------------------------------------------------------------------------------------------
# reference vs float64 dense masked softmax
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["one_per_row", "random35", "structured", "all_live"])
@pytest.mark.parametrize("n,block", [(96, 16), (203, 32)], ids=lambda x: str(x))
def test_reference_matches_float64_dense(kind, n, block, gen):
    q, k, v, block_map = make_case(2, 3, n, 16, block, kind, gen)
    mask = block_map_to_mask(block_map, block, block, n)
    out = block_sparse_attention_reference(q, k, v, mask, 3)
    assert out.dtype == torch.float32
    assert_close(out, dense_masked_fp64(q, k, v, block_map, block, block, 3), 1e-6, 1e-5)
    # float64 in, float64 out: the reference is exact up to float64 rounding
    out64 = block_sparse_attention_reference(q.double(), k.double(), v.double(), mask, 3)
    assert_close(out64, dense_masked_fp64(q, k, v, block_map, block, block, 3), 1e-12, 1e-12)


def test_reference_all_live_equals_sdpa(gen):
    q, k, v, block_map = make_case(1, 2, 77, 32, 16, "all_live", gen)
    mask = block_map_to_mask(block_map, 16, 16, 77)
    ref = block_sparse_attention_reference(q, k, v, mask, 2, skip_output_reshape=True)
    qh, kh, vh = (x.view(1, 77, 2, 32).transpose(1, 2) for x in (q, k, v))
    assert_close(ref, F.scaled_dot_product_attention(qh, kh, vh), 1e-6, 1e-5)


def test_reference_falls_back_without_triton():
    """Importing with triton absent works, and dispatch runs the reference."""
    code = (
        "import sys; sys.modules['triton'] = None; sys.path.insert(0, %r)\n"
        "import torch\n"
        "from kernels.block_sparse import *\n"
        "assert not triton_available()\n"
        "bm = torch.ones(1, 1, 2, 2, dtype=torch.bool)\n"
        "m = block_map_to_mask(bm, 8, 8, 16)\n"
        "q = torch.randn(1, 16, 8)\n"
        "o = block_sparse_attention(q, q, q, m, 1)\n"
        "r = torch.nn.functional.scaled_dot_product_attention(q[:, None], q[:, None], q[:, None])[:, 0]\n"
        "assert torch.allclose(o, r, atol=1e-5)\n"
    ) % str(REPO_ROOT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_kernels_package_has_no_comfy_imports():
    for path in (REPO_ROOT / "kernels").glob("*.py"):
        text = path.read_text()
        assert "import comfy" not in text and "from comfy" not in text, path


# --------------------------------------------------------------------------------------------
# Triton kernel (interpreter on CPU, float32)
# --------------------------------------------------------------------------------------------

TILES16 = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, tma=False)
TMA16 = dict(TILES16, tma=True)  # K/V full tiles through tensor descriptors
PIPE16 = dict(TILES16, pipeline_qk=True)  # next QK^T issued before this softmax
# (B, H, N, D, mask block, map kind, tile config): ragged N everywhere but one case
KERNEL_CASES = [
    (1, 2, 256, 32, 32, "random35", TILES16),
    (2, 2, 203, 32, 32, "random35", TILES16),
    (1, 2, 200, 32, 32, "random10", TILES16),
    (1, 3, 150, 32, 16, "one_per_row", TILES16),
    (1, 2, 190, 32, 32, "all_live", TILES16),
    (2, 2, 300, 16, 32, "structured", TILES16),
    (1, 2, 177, 64, 32, "random70", TILES16),
    (1, 2, 161, 32, 32, "structured", dict(BLOCK_M=32, BLOCK_N=32)),  # tiles = mask blocks
    (1, 2, 100, 32, 64, "random35", TILES16),  # 4x4 tiles per mask block, half-empty tail
    (2, 2, 203, 32, 32, "structured", TMA16),
    (1, 2, 100, 32, 64, "one_per_row", TMA16),
    (2, 2, 203, 32, 32, "structured", PIPE16),
    (1, 2, 100, 32, 64, "one_per_row", dict(PIPE16, tma=True)),
    (1, 2, 150, 32, 32, "all_live", dict(PIPE16, tma=True)),
]


def _case_id(case):
    b, h, n, d, block, kind, cfg = case
    return f"B{b}-H{h}-N{n}-D{d}-blk{block}-{kind}-tile{cfg['BLOCK_M']}" + ("-tma" if cfg.get("tma") else "") + ("-pipe" if cfg.get("pipeline_qk") else "")


@needs_triton
@pytest.mark.parametrize("case", KERNEL_CASES, ids=_case_id)
def test_triton_matches_reference(case, gen):
    b, h, n, d, block, kind, cfg = case
    q, k, v, block_map = make_case(b, h, n, d, block, kind, gen)
    mask = block_map_to_mask(block_map, block, block, n)
    out = run_triton(q, k, v, mask, h, cfg)
    assert_close(out, block_sparse_attention_reference(q, k, v, mask, h), 1e-5, 1e-4)


@needs_triton
def test_a_gpu_with_less_shared_memory_gets_a_smaller_config_that_fits(gen, monkeypatch):
    """Tuned on Hopper (227 KB of shared memory a block); an RTX 4090 has about 100 KB, where
    Triton refuses the launch (OutOfResources). The kernel steps down to fewer stages, then
    narrower key tiles, and keeps what fitted for the next calls."""
    from triton.runtime.errors import OutOfResources

    import kernels.triton_block_sparse as tbs

    real, launches = tbs._bsa_fwd_kernel, []

    class SmallCard:  # refuses every launch with a 32-key tile or more than one stage
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((kwargs["BLOCK_N"], kwargs["num_stages"]))
                if kwargs["BLOCK_N"] > 16 or kwargs["num_stages"] > 1:
                    raise OutOfResources(200_000, 101_376, "shared memory")
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(tbs, "_bsa_fwd_kernel", SmallCard())
    monkeypatch.setattr(tbs, "_FITTED", {})
    config = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=3)
    assert tbs.fitting_candidates(config) == [(32, 3), (32, 2), (32, 1), (16, 2), (16, 1)]
    q, k, v, block_map = make_case(1, 2, 150, 32, 32, "random35", gen)
    mask = block_map_to_mask(block_map, 32, 32, 150)
    out = run_triton(q, k, v, mask, 2, config)
    assert_close(out, block_sparse_attention_reference(q, k, v, mask, 2), 1e-5, 1e-4)
    assert launches == [(32, 3), (32, 2), (32, 1), (16, 2), (16, 1)]
    run_triton(q, k, v, mask, 2, config)
    assert launches[5:] == [(16, 1)]  # the next call goes straight to what fitted

    class TinyCard:  # refuses every launch
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(200_000, 1_024, "shared memory")
            return launch

    monkeypatch.setattr(tbs, "_bsa_fwd_kernel", TinyCard())
    with pytest.raises(OutOfResources):  # nothing fits: the error reaches the caller (the run goes dense)
        run_triton(q, k, v, mask, 2, dict(config, num_warps=8))


@needs_triton
def test_triton_all_live_equals_dense_sdpa(gen):
    q, k, v, block_map = make_case(1, 2, 150, 32, 32, "all_live", gen)
    mask = block_map_to_mask(block_map, 32, 32, 150)
    out = run_triton(q, k, v, mask, 2, TILES16)
    qh, kh, vh = (x.view(1, 150, 2, 32).transpose(1, 2) for x in (q, k, v))
    dense = F.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2).reshape(1, 150, 64)
    assert_close(out, dense, 1e-5, 1e-4)


@needs_triton
@pytest.mark.parametrize("cfg", [TILES16, TMA16], ids=["ptr", "tma"])
@pytest.mark.parametrize(
    "skip_reshape,skip_output_reshape", [(False, False), (True, True), (True, False), (False, True)],
    ids=["bnhd_in-bnhd_out", "bhnd_in-bhnd_out", "bhnd_in-bnhd_out", "bnhd_in-bhnd_out"],
)
def test_triton_layouts(skip_reshape, skip_output_reshape, cfg, gen):
    b, h, n, d = 2, 2, 140, 32
    q, k, v, block_map = make_case(b, h, n, d, 32, "random35", gen)
    mask = block_map_to_mask(block_map, 32, 32, n)
    ref = block_sparse_attention_reference(q, k, v, mask, h)  # [B, N, H*D]
    if skip_reshape:
        q, k, v = (x.view(b, n, h, d).permute(0, 2, 1, 3).contiguous() for x in (q, k, v))
    out = run_triton(q, k, v, mask, h, cfg, skip_reshape, skip_output_reshape)
    if skip_output_reshape:
        ref = ref.view(b, n, h, d).transpose(1, 2)
    assert_close(out, ref, 1e-5, 1e-4)


@needs_triton
def test_triton_batch2_masks_differ_per_element(gen):
    """cond and uncond with their own masks: each half must match its own single-batch run."""
    b, h, n, d = 2, 2, 170, 32
    q, k, v, _ = make_case(b, h, n, d, 32, "random35", gen)
    maps = torch.cat([one_per_row_map(1, h, 6, 6, gen), random_map(1, h, 6, 6, 0.6, gen)])
    mask = block_map_to_mask(maps, 32, 32, n)
    out = run_triton(q, k, v, mask, h, TILES16)
    for i in range(b):
        mask_i = block_map_to_mask(maps[i : i + 1], 32, 32, n)
        ref_i = block_sparse_attention_reference(q[i : i + 1], k[i : i + 1], v[i : i + 1], mask_i, h)
        assert_close(out[i : i + 1], ref_i, 1e-5, 1e-4)


@needs_triton
def test_triton_batch1_mask_broadcasts(gen):
    b, h, n, d = 2, 2, 120, 32
    q, k, v, block_map = make_case(1, h, n, d, 32, "random35", gen)
    q, k, v = (torch.cat([x, torch.randn(x.shape, generator=gen)]) for x in (q, k, v))
    mask = block_map_to_mask(block_map, 32, 32, n)
    out = run_triton(q, k, v, mask, h, TILES16)
    assert_close(out, block_sparse_attention_reference(q, k, v, mask, h), 1e-5, 1e-4)


@needs_triton
def test_triton_heavy_first_and_natural_order_agree(gen):
    q, k, v, block_map = make_case(1, 2, 200, 32, 32, "structured", gen)
    mask = block_map_to_mask(block_map, 32, 32, 200)
    a = run_triton(q, k, v, mask, 2, dict(TILES16, order="heavy_first"))
    b = run_triton(q, k, v, mask, 2, dict(TILES16, order="natural"))
    assert_close(a, b, 1e-6, 1e-5)


@needs_triton
def test_triton_fp16_in_interpreter(gen):
    q, k, v, block_map = make_case(1, 2, 130, 32, 32, "random35", gen, dtype=torch.float16)
    mask = block_map_to_mask(block_map, 32, 32, 130)
    out = run_triton(q, k, v, mask, 2, TILES16)
    assert out.dtype == torch.float16
    assert_close(out, dense_masked_fp64(q, k, v, block_map, 32, 32, 2), 1e-2, 2e-2)


# --------------------------------------------------------------------------------------------
# GPU (CHORUS_TEST_GPU=1): the real kernel at sm_90 tiles, half precision
# --------------------------------------------------------------------------------------------

GPU_CASES = [
    (2, 4, 4000, 128, 128, "structured", torch.bfloat16),
    (1, 4, 3001, 128, 128, "random10", torch.float16),
    (1, 4, 2500, 128, 64, "random35", torch.bfloat16),
    (2, 3, 1000, 64, 128, "one_per_row", torch.bfloat16),
    (1, 2, 2049, 128, 128, "all_live", torch.bfloat16),
    (1, 2, 1333, 64, 64, "random70", torch.float16),
]


@needs_gpu
@pytest.mark.parametrize(
    "cfg", [None, {"tma": True}, {"tma": False}, {"tma": True, "pipeline_qk": True}, {"pipeline_qk": True, "BLOCK_N": 64}],
    ids=["default", "tma", "ptr", "tma-pipe", "pipe-n64"],
)
@pytest.mark.parametrize(
    "case", GPU_CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-N{c[2]}-D{c[3]}-blk{c[4]}-{c[5]}-{str(c[6])[6:]}"
)
def test_gpu_matches_reference(case, cfg, gen):
    b, h, n, d, block, kind, dtype = case
    q, k, v, block_map = make_case(b, h, n, d, block, kind, gen, dtype=dtype, device="cuda")
    mask = block_map_to_mask(block_map.cuda(), block, block, n)
    out = run_triton(q, k, v, mask, h, cfg)
    assert_close(out, block_sparse_attention_reference(q, k, v, mask, h), 1e-2, 5e-2)
    if b == 1:  # the [B, H, N, D] layout in and out, too (the heads-as-rows TMA view)
        q4, k4, v4 = (x.view(b, n, h, d).transpose(1, 2).contiguous() for x in (q, k, v))
        out4 = run_triton(q4, k4, v4, mask, h, cfg, True, True)
        assert_close(out4, out.view(b, n, h, d).transpose(1, 2), 1e-6, 1e-6)
    if cfg is None:  # auto dispatch picks a GPU kernel: FA4 where it applies, else Triton's defaults
        choice = select_backend(q, mask)
        assert choice.name in ("fa4", "triton"), choice
        auto = block_sparse_attention(q, k, v, mask, h)
        if choice.name == "triton":
            assert_close(auto, out, 1e-6, 1e-6)
        else:  # another kernel: bf16 rounding apart
            assert_close(auto, out, 1e-2, 5e-2)
