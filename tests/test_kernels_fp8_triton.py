"""The FP8 block-sparse Triton kernel (kernels/triton_fp8_block_sparse.py) and its dispatch.

On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1); its float32 -> e4m3 cast
there loses the carry into the next binade, so the kernel puts values on e4m3's grid first under the
interpreter (``_to_e4m3``): the dots themselves are exact there. With CHORUS_TEST_GPU=1 on a CUDA
machine the last tests run the compiled kernel on the GPU's int8 and FP8 tensor cores.
"""

import os

if os.environ.get("CHORUS_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

from kernels.block_sparse import (block_map_to_mask, block_sparse_attention, block_sparse_attention_reference,
                                  last_backend_choice, triton_available)
from kernels.fp8_block_sparse import (fp8_block_sparse_attention, fp8_block_sparse_attention_reference,
                                      quantize_blocks, quantize_channels, select_fp8_backend)

GPU = os.environ.get("CHORUS_TEST_GPU") == "1" and torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and triton_available()
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="needs triton and TRITON_INTERPRET=1")
needs_gpu = pytest.mark.skipif(not GPU, reason="set CHORUS_TEST_GPU=1 on a CUDA machine")

H, D, BLOCK = 2, 128, 128


def inputs(n=1000, batch=1, seed=0, sharp=1.0, device="cpu", dtype=torch.bfloat16):
    """[B, N, H*D] as ComfyUI passes them: keys offset per channel (what smoothing K is for)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, H * D, generator=g) * sharp
    k = torch.randn(batch, n, H * D, generator=g) + 4.0 * torch.randn(batch, 1, H * D, generator=g)
    v = torch.randn(batch, n, H * D, generator=g)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)]


def mask_for(n=1000, batch=1, density=0.3, seed=0, device="cpu"):
    blocks = -(-n // BLOCK)
    g = torch.Generator().manual_seed(seed)
    live = (torch.rand(batch, H, blocks, blocks, generator=g) < density) | torch.eye(blocks, dtype=torch.bool)
    return block_map_to_mask(live.to(device), BLOCK, BLOCK, n)


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@needs_interpreter
@pytest.mark.parametrize("density", [0.05, 0.3, 0.5])
def test_the_kernel_is_the_reference_scheme_and_within_the_issues_cosine_of_bf16(density):
    q, k, v = inputs()
    m = mask_for(density=density)
    kernel = fp8_block_sparse_attention(q, k, v, m, H, backend="triton")
    assert last_backend_choice().name == "triton_fp8"
    assert kernel.shape == q.shape and kernel.dtype == q.dtype
    assert cosine(kernel, fp8_block_sparse_attention_reference(q, k, v, m, H)) >= 0.9995
    assert cosine(kernel, block_sparse_attention_reference(q, k, v, m, H)) >= 0.999


@needs_interpreter
def test_with_p_and_v_kept_16_bit_the_kernel_is_the_int8_qk_reference_and_nearer_exact():
    """``pv_fp8=False`` (SageAttention 1's split): only QK^T in int8, P and V 16-bit, V read as
    given (a ragged 1000 tokens, the masked last tile included). It is nearer the exact output than
    the whole FP8 scheme, whose e4m3 P and V carry most of its error here as on the testbed
    (tests/testbed/fp8_ablation.py)."""
    from kernels.layouts import to_bhnd
    from kernels.triton_fp8_block_sparse import fp8_block_sparse_attn_fwd

    q, k, v = inputs(dtype=torch.float16)  # as ComfyUI computes Wan (the interpreter's bf16 dot is wrong)
    m = mask_for(density=0.3)
    qh, kh, vh = (to_bhnd(x, H, False) for x in (q, k, v))
    outs = {}
    for pv_fp8 in (True, False):
        o = torch.empty_like(qh)
        fp8_block_sparse_attn_fwd(qh, kh, vh, o, m, pv_fp8=pv_fp8)
        outs[pv_fp8] = o
    int8_qk = fp8_block_sparse_attention_reference(qh, kh, vh, m, H, True, True, quantize_pv=False)
    exact = block_sparse_attention_reference(qh.float(), kh.float(), vh.float(), m, H, True, True)
    assert cosine(outs[False], int8_qk) >= 0.9999
    error = {key: ((o.float() - exact).norm() / exact.norm()).item() for key, o in outs.items()}
    assert error[False] < 0.5 * error[True], error


@needs_interpreter
def test_a_batch_of_two_with_a_batch_one_mask_and_the_heads_first_layout():
    q, k, v = inputs(n=700, batch=2, seed=3)
    m = mask_for(n=700, batch=1, seed=3)
    heads_first = [x.view(2, 700, H, D).transpose(1, 2).contiguous() for x in (q, k, v)]
    out = fp8_block_sparse_attention(*heads_first, m, H, skip_reshape=True, skip_output_reshape=True, backend="triton")
    exact = block_sparse_attention_reference(*heads_first, m, H, skip_reshape=True, skip_output_reshape=True)
    assert out.shape == (2, H, 700, D)
    for b in range(2):
        assert cosine(out[b], exact[b]) >= 0.999


@needs_interpreter
def test_the_quantisation_kernels_write_what_the_reference_computes():
    from kernels.triton_fp8_block_sparse import quantize

    q, k, v = (x.view(1, 1000, H, D).transpose(1, 2) for x in inputs())
    got = quantize(q, k, v, BLOCK, BLOCK)
    q8, q_scale = quantize_blocks(q, BLOCK)
    k8, k_scale = quantize_blocks(k.float() - k.float().mean(dim=-2, keepdim=True), BLOCK)
    v8, v_scale = quantize_channels(v)
    assert torch.allclose(got.q_scale, q_scale) and torch.allclose(got.k_scale, k_scale, rtol=1e-5)
    assert torch.equal(got.q, q8)  # ties to even, as torch rounds
    assert (got.k.int() - k8.int()).abs().max() <= 1  # K's mean is summed in another order
    assert torch.allclose(got.v_scale, v_scale[:, :, 0])
    assert torch.equal(got.v_t[..., :1000].float(), v8.transpose(-1, -2).float())


def test_cpu_tensors_run_the_reference_and_fa4_is_refused_with_the_reason():
    q, k, v = inputs(n=300)
    m = mask_for(n=300)
    assert select_fp8_backend(q, m).name == "reference_fp8"
    out = fp8_block_sparse_attention(q, k, v, m, H)
    assert last_backend_choice().name == "reference_fp8"
    assert cosine(out, block_sparse_attention_reference(q, k, v, m, H)) >= 0.999
    with pytest.raises(ValueError, match="FlashAttention-4 has no FP8"):
        select_fp8_backend(q, m, "fa4")


def test_the_int8_scheme_on_cpu_tensors_is_its_reference_with_p_and_v_16_bit_and_nearer_exact_than_fp8():
    """``pv_fp8=False`` ("int8"): CPU tensors run ``reference_int8``, QK^T quantised and P and V
    rounded to V's 16-bit type as the kernel keeps them; nearer the float32 output than fp8."""
    q, k, v = inputs(n=300)
    m = mask_for(n=300)
    assert select_fp8_backend(q, m, pv_fp8=False).name == "reference_int8"
    out = fp8_block_sparse_attention(q, k, v, m, H, pv_fp8=False)
    choice = last_backend_choice()
    assert choice.name == "reference_int8" and "int8 QK^T, 16-bit PV" in choice.reason
    assert torch.equal(out, fp8_block_sparse_attention_reference(q, k, v, m, H, quantize_pv=False,
                                                                 pv_dtype=torch.bfloat16))
    assert not torch.equal(out, fp8_block_sparse_attention_reference(q, k, v, m, H, quantize_pv=False))
    exact = block_sparse_attention_reference(*(x.float() for x in (q, k, v)), m, H)
    error = lambda x: ((x.float() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert error(out) < error(fp8_block_sparse_attention(q, k, v, m, H)) / 1.5


def test_under_torch_compile_the_int8_call_is_its_own_op_with_the_eager_result():
    q, k, v = inputs(n=300)
    m = mask_for(n=300)
    eager = fp8_block_sparse_attention(q, k, v, m, H, backend="reference", pv_fp8=False)
    compiled = torch.compile(lambda q, k, v: fp8_block_sparse_attention(q, k, v, m, H, backend="reference",
                                                                        pv_fp8=False),
                             backend="eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)
    assert last_backend_choice().name == "reference_int8"


def test_the_environment_variable_forces_the_fp8_reference(monkeypatch):
    q, _, _ = inputs(n=300)
    monkeypatch.setenv("CHORUS_BLOCK_SPARSE_BACKEND", "reference")
    assert select_fp8_backend(q, mask_for(n=300)).name == "reference_fp8"


def test_under_torch_compile_the_fp8_call_is_one_op_with_the_eager_result():
    q, k, v = inputs(n=300)
    m = mask_for(n=300)
    eager = fp8_block_sparse_attention(q, k, v, m, H, backend="reference")
    compiled = torch.compile(lambda q, k, v: fp8_block_sparse_attention(q, k, v, m, H, backend="reference"),
                             backend="eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)


# ---- on the GPU (CHORUS_TEST_GPU=1): the compiled kernel on int8 and FP8 tensor cores


@needs_gpu
@pytest.mark.parametrize("density", [0.05, 0.15, 0.5])
def test_on_the_gpu_the_kernel_is_within_the_issues_cosine_of_the_bf16_kernel(density):
    n = 5000  # ragged: not a multiple of 128
    q, k, v = inputs(n=n, device="cuda", dtype=torch.float16)
    m = mask_for(n=n, density=density, device="cuda")
    fp8 = fp8_block_sparse_attention(q, k, v, m, H)
    assert last_backend_choice().name == "triton_fp8", last_backend_choice()
    bf16 = block_sparse_attention(q, k, v, m, H, backend="triton")
    assert cosine(fp8, bf16) >= 0.999
    assert cosine(fp8, fp8_block_sparse_attention_reference(q, k, v, m, H)) >= 0.9995
    assert torch.isfinite(fp8).all()


@needs_gpu
def test_on_the_gpu_the_int8_qk_variant_is_its_reference_and_nearer_exact_than_fp8():
    """``pv_fp8=False`` compiled for the GPU: int8 QK^T, P and V on the 16-bit tensor cores."""
    from kernels.layouts import to_bhnd
    from kernels.triton_fp8_block_sparse import fp8_block_sparse_attn_fwd

    n = 5000
    q, k, v = inputs(n=n, device="cuda", dtype=torch.float16)
    m = mask_for(n=n, density=0.15, device="cuda")
    qh, kh, vh = (to_bhnd(x, H, False) for x in (q, k, v))
    out = torch.empty_like(qh)
    fp8_block_sparse_attn_fwd(qh, kh, vh, out, m, pv_fp8=False)
    exact = block_sparse_attention_reference(qh.float(), kh.float(), vh.float(), m, H, True, True)
    fp8 = fp8_block_sparse_attention(qh, kh, vh, m, H, skip_reshape=True, skip_output_reshape=True)
    assert cosine(out, fp8_block_sparse_attention_reference(qh, kh, vh, m, H, True, True, quantize_pv=False)) >= 0.9999
    assert (out.float() - exact).norm() < (fp8.float() - exact).norm()


def test_the_reference_in_head_chunks_is_the_reference_whole(monkeypatch):
    import kernels.fp8_block_sparse as fp8

    q, k, v = inputs(n=400)
    m = mask_for(n=400)
    whole = fp8.fp8_block_sparse_attention_reference(q, k, v, m, H)
    monkeypatch.setattr(fp8, "SCORE_BUDGET", 128 * 400)  # one head at a time
    assert torch.equal(fp8.fp8_block_sparse_attention_reference(q, k, v, m, H), whole)


def test_a_forced_backend_fp8_cannot_honour_falls_back_to_the_16_bit_dispatch(monkeypatch):
    """An A/B run's CHORUS_BLOCK_SPARSE_BACKEND never costs an FP8 run its sparsity; an explicit
    backend argument FP8 cannot honour still raises."""
    import kernels.fp8_block_sparse as fp8

    q, _, _ = inputs(n=300)
    m = mask_for(n=300)
    monkeypatch.setattr(fp8, "fp8_unsupported_reason", lambda q, mask: "FP8 tensor cores need sm_89 or newer")
    monkeypatch.setenv("CHORUS_BLOCK_SPARSE_BACKEND", "triton")
    name, why = select_fp8_backend(q, m)
    assert name == "triton" and why.startswith("CHORUS_BLOCK_SPARSE_BACKEND=triton; ")
    assert why.endswith("attention_precision fp8 not used: the FP8 Triton kernel cannot run this call: "
                        "FP8 tensor cores need sm_89 or newer")
    with pytest.raises(RuntimeError, match="cannot run this call"):
        select_fp8_backend(q, m, "triton")


@needs_interpreter
def test_the_fp8_kernel_steps_down_to_a_config_a_smaller_card_holds(monkeypatch):
    """The FP8 tiles are tuned on Hopper; an Ada card (about 100 KB of shared memory a block)
    refuses the three-stage launch, and the kernel runs at fewer stages instead."""
    from triton.runtime.errors import OutOfResources

    import kernels.triton_block_sparse as tbs
    import kernels.triton_fp8_block_sparse as kernel

    real, launches = kernel._fp8_bsa_fwd_kernel, []

    class AdaCard:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs["num_stages"])
                if kwargs["num_stages"] > 2:
                    raise OutOfResources(120_000, 101_376, "shared memory")
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(kernel, "_fp8_bsa_fwd_kernel", AdaCard())
    monkeypatch.setattr(tbs, "_FITTED", {})
    q, k, v = inputs(n=300)
    m = mask_for(n=300)
    out = fp8_block_sparse_attention(q, k, v, m, H, backend="triton")
    assert launches == [3, 2]
    assert cosine(out, fp8_block_sparse_attention_reference(q, k, v, m, H)) >= 0.9995
