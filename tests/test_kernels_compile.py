"""The block-sparse custom op under torch.compile, and backend selection, on the CPU.

``chorus::block_sparse_attention`` must compile into one graph (fullgraph=True), equal eager,
and have a fake implementation with the right output shape in both ComfyUI layouts. Backend
selection is tested with the GPU facts (capability, FA4 importability) stubbed, since the
CPU machine has neither; the real GPU runs are in test_kernels_fa4.py.
"""

import math
import os
import subprocess
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kernels import block_sparse as bs  # noqa: E402
from kernels import fa4_block_sparse as fa4  # noqa: E402
from kernels.block_sparse import (  # noqa: E402
    BlockSparseMask,
    block_map_to_mask,
    block_sparse_attention,
    block_sparse_attention_op,
    block_sparse_attention_reference,
    last_backend_choice,
    select_backend,
)
from kernels.ops import OP_NAME  # noqa: E402


@pytest.fixture
def gen(request):
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def case(b, h, n, d, block, density, gen, mask_batch=None):
    nb = math.ceil(n / block)
    live = torch.rand(mask_batch or b, h, nb, nb, generator=gen) < density
    live |= torch.eye(nb, dtype=torch.bool)
    mask = block_map_to_mask(live, block, block, n)
    q, k, v = (torch.randn(b, n, h * d, generator=gen) for _ in range(3))
    return q, k, v, mask


def heads_first(x, h):
    b, n, hd = x.shape
    return x.view(b, n, h, hd // h).transpose(1, 2).contiguous()


# --------------------------------------------------------------------------------------------
# the custom op under torch.compile
# --------------------------------------------------------------------------------------------

LAYOUTS = [(False, False), (True, True), (True, False), (False, True)]


@pytest.mark.parametrize("skip_reshape,skip_output_reshape", LAYOUTS, ids=["bnhd-bnhd", "bhnd-bhnd", "bhnd-bnhd", "bnhd-bhnd"])
@pytest.mark.parametrize("mask_batch", [2, 1], ids=["per-batch-masks", "broadcast-mask"])
def test_compiled_fullgraph_equals_eager(skip_reshape, skip_output_reshape, mask_batch, gen):
    h = 3
    q, k, v, mask = case(2, h, 75, 16, 16, 0.4, gen, mask_batch)  # ragged: 75 = 4 x 16 + 11
    if skip_reshape:
        q, k, v = (heads_first(x, h) for x in (q, k, v))

    def attention_block(q, k, v, mask):
        # something before and after the op, as in a transformer block
        o = block_sparse_attention(q * 0.5, k, v, mask, h, skip_reshape, skip_output_reshape)
        return o.float().sin() + 1.0

    eager = attention_block(q, k, v, mask)
    compiled = torch.compile(attention_block, fullgraph=True)(q, k, v, mask)
    assert last_backend_choice().name == "reference"
    assert compiled.shape == eager.shape
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_compiled_graph_is_one_graph_and_a_new_mask_of_another_width_recompiles_once(gen):
    """A new mask object each step bucket: only its max_live width can change; one recompile."""
    h = 2
    q, k, v, mask_a = case(2, h, 64, 16, 16, 0.3, gen)
    graphs = []

    def count_graphs(gm, example_inputs):
        graphs.append(gm)
        ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert torch.ops.chorus.block_sparse_attention.default in ops
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, m: block_sparse_attention(q, k, v, m, h) + 1, backend=count_graphs, fullgraph=True)
    fn(q, k, v, mask_a)
    assert len(graphs) == 1
    _, _, _, mask_b = case(2, h, 64, 16, 16, 0.3, gen)  # same width? then no recompile at all
    full = block_map_to_mask(torch.ones(2, h, 4, 4, dtype=torch.bool), 16, 16, 64)  # max_live 4
    for m in (mask_b, full, mask_a, full):
        out = fn(q, k, v, m)
        torch.testing.assert_close(out, block_sparse_attention_reference(q, k, v, m, h) + 1)
    assert len(graphs) <= 2, f"{len(graphs)} graphs for masks of two widths"


def test_op_is_registered_with_a_fake_impl_that_passes_opcheck(gen):
    q, k, v, mask = case(2, 2, 40, 8, 16, 0.5, gen)
    args = (q, k, v, mask.live_blocks, mask.live_counts, 16, 16, 40, 2, False, False, "reference")
    assert str(block_sparse_attention_op._schema).startswith(OP_NAME + "(")
    torch.library.opcheck(torch.ops.chorus.block_sparse_attention.default, args)


@pytest.mark.parametrize("skip_reshape,skip_output_reshape,expected", [
    (False, False, (2, 75, 48)),
    (True, True, (2, 3, 75, 16)),
    (True, False, (2, 75, 48)),
    (False, True, (2, 3, 75, 16)),
])
def test_fake_impl_output_shapes_in_both_layouts(skip_reshape, skip_output_reshape, expected, gen):
    from torch._subclasses.fake_tensor import FakeTensorMode

    h = 3
    q, k, v, mask = case(2, h, 75, 16, 16, 0.4, gen)
    if skip_reshape:
        q, k, v = (heads_first(x, h) for x in (q, k, v))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv, flb, flc = (mode.from_tensor(x) for x in (q, k, v, mask.live_blocks, mask.live_counts))
        out = block_sparse_attention_op(fq, fk, fv, flb, flc, 16, 16, 75, h, skip_reshape, skip_output_reshape, "auto")
    assert tuple(out.shape) == expected
    assert out.dtype == q.dtype
    real = block_sparse_attention_op(q, k, v, mask.live_blocks, mask.live_counts, 16, 16, 75, h,
                                     skip_reshape, skip_output_reshape, "auto")
    assert tuple(real.shape) == expected and real.stride() == out.stride()


def test_op_equals_the_reference_and_skips_the_validation_eager_runs(gen):
    """The op trusts its mask tensors (no host syncs in a compiled graph); eager validates."""
    h = 2
    q, k, v, mask = case(1, h, 50, 8, 16, 0.5, gen)
    op_args = (16, 16, 50, h, False, False, "auto")
    got = block_sparse_attention_op(q, k, v, mask.live_blocks, mask.live_counts, *op_args)
    torch.testing.assert_close(got, block_sparse_attention_reference(q, k, v, mask, h), rtol=0, atol=0)
    counts = mask.live_counts.clone()
    counts[0, 1, 2] = 0  # query block 2 of head 1 attends to nothing
    bad = BlockSparseMask(mask.live_blocks, counts, 16, 16, 50)
    with pytest.raises(ValueError, match=r"no live key block, first at batch 0, head 1, query block 2"):
        block_sparse_attention(q, k, v, bad, h)
    out = block_sparse_attention_op(q, k, v, bad.live_blocks, bad.live_counts, *op_args).view(1, 50, h, 8)
    assert torch.isnan(out[:, 32:48, 1]).all() and torch.isfinite(out[:, :32]).all()


# --------------------------------------------------------------------------------------------
# backend selection (GPU facts stubbed)
# --------------------------------------------------------------------------------------------


def gpu_q(dtype=torch.bfloat16, head_dim=128, heads=40, n=1000):
    """A stand-in for a CUDA q in the [B, H, N, D] layout: only what selection reads."""
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=dtype,
                           shape=(2, heads, n, head_dim), dim=lambda: 4)


def mask_for(block=128, heads=40, n=1000):
    nb = math.ceil(n / block)
    return BlockSparseMask(torch.zeros(1, heads, nb, 1, dtype=torch.int32), torch.ones(1, heads, nb, dtype=torch.int32),
                           block, block, n)


@pytest.fixture
def gpu(monkeypatch):
    """Stub the device capability and FA4's import probe; returns a setter."""
    state = SimpleNamespace(cc=(9, 0), fa4_error=None, triton=True)
    monkeypatch.setattr(fa4, "device_capability", lambda device: state.cc)
    monkeypatch.setattr(fa4, "fa4_import_error", lambda: state.fa4_error)
    monkeypatch.setattr(bs, "triton_available", lambda: state.triton)
    monkeypatch.delenv(bs.BACKEND_ENV, raising=False)
    return state


def test_h200_with_fa4_picks_fa4(gpu):
    assert select_backend(gpu_q(), mask_for()) == ("fa4", "FlashAttention-4 block-sparse forward (sm_90, torch.bfloat16)")
    gpu.cc = (10, 0)
    assert select_backend(gpu_q(), mask_for(block=256)).name == "fa4"


def test_fa4_absent_falls_back_to_triton_with_the_install_hint(gpu):
    gpu.fa4_error = "flash-attn-4 is not importable (ModuleNotFoundError: No module named 'flash_attn'); install it with: pip install 'chorus-sparse-reuse[fa4]'"
    name, reason = select_backend(gpu_q(), mask_for())
    assert name == "triton"
    assert reason == "Triton kernel; FA4 not used: " + gpu.fa4_error
    gpu.triton = False
    assert select_backend(gpu_q(), mask_for()) == (
        "reference", "pure-torch reference (triton is not installed); FA4 not used: " + gpu.fa4_error)


@pytest.mark.parametrize("q,mask,why", [
    (gpu_q(head_dim=64), mask_for(), "the FA4 path is used at head_dim 128, got 64"),
    (gpu_q(dtype=torch.float32), mask_for(), "FA4 needs bf16 or fp16 inputs, got torch.float32"),
    (gpu_q(), mask_for(block=64), "FA4 on sm_90 needs 128x128 mask blocks, this mask has 64x64"),
], ids=["head_dim64", "float32", "blocks64"])
def test_fa4_present_but_unsupported_shape_falls_back(gpu, q, mask, why):
    assert select_backend(q, mask) == ("triton", "Triton kernel; FA4 not used: " + why)


@pytest.mark.parametrize("cc,why", [
    ((8, 9), "FA4 block sparsity is used on sm_90 and sm_100 only, this GPU is sm_89"),
    ((12, 0), "FA4 block sparsity is used on sm_90 and sm_100 only, this GPU is sm_120"),
    ((8, 0), "FA4 block sparsity is used on sm_90 and sm_100 only, this GPU is sm_80"),
    ((10, 0), "FA4 on sm_100 needs query blocks of a multiple of 256 rows and key blocks of a multiple of 128, "
              "this mask has 128x128"),
], ids=["ada", "consumer-blackwell", "ampere", "b200-128-row-blocks"])
def test_unsupported_gpu_falls_back_to_triton(gpu, cc, why):
    gpu.cc = cc
    assert select_backend(gpu_q(), mask_for()) == ("triton", "Triton kernel; FA4 not used: " + why)


def test_explicit_fa4_that_cannot_run_raises_with_the_reason(gpu):
    gpu.cc = (8, 9)
    with pytest.raises(RuntimeError, match=r"backend='fa4' cannot run this call: FA4 block sparsity is used on sm_90"):
        select_backend(gpu_q(), mask_for(), "fa4")
    with pytest.raises(ValueError, match="backend must be 'auto', 'fa4', 'triton' or 'reference', got 'cudnn'"):
        select_backend(gpu_q(), mask_for(), "cudnn")


def test_environment_forces_the_auto_choice(gpu, monkeypatch):
    monkeypatch.setenv(bs.BACKEND_ENV, "triton")
    assert select_backend(gpu_q(), mask_for()) == (
        "triton", "CHORUS_BLOCK_SPARSE_BACKEND=triton; requested: the Triton kernel")
    assert select_backend(gpu_q(), mask_for(), "fa4").name == "fa4"  # an explicit backend wins


def test_cpu_tensors_take_the_reference(gen):
    q, k, v, mask = case(1, 2, 40, 8, 16, 0.5, gen)
    assert select_backend(q, mask) == ("reference", "CPU tensors: the pure-torch reference")
    assert str(select_backend(q, mask)) == "reference (CPU tensors: the pure-torch reference)"


def test_importing_and_running_kernels_never_imports_flash_attn():
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "import torch\n"
        "from kernels.block_sparse import block_map_to_mask, block_sparse_attention, select_backend\n"
        "m = block_map_to_mask(torch.ones(1, 1, 2, 2, dtype=torch.bool), 8, 8, 16)\n"
        "q = torch.randn(1, 16, 8)\n"
        "block_sparse_attention(q, q, q, m, 1)\n"
        "torch.compile(lambda q: block_sparse_attention(q, q, q, m, 1), fullgraph=True)(q)\n"
        "assert select_backend(q, m).name == 'reference'\n"
        "assert not [k for k in sys.modules if k.startswith(('flash_attn', 'cutlass'))], 'FA4 imported'\n"
    ) % str(REPO_ROOT)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300,
                   env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
