"""FP8 block-sparse attention: the numerics of the planned Hopper kernel, in pure torch ([user-stack] item 2).

What the kernel will compute, so that its accuracy can be judged before it exists and so that it
has a reference to be tested against (and a CPU fallback), as ``block_sparse.py``'s reference is
for the bf16 kernels. The kernel is ``triton_fp8_block_sparse``; ``fp8_block_sparse_attention``
below dispatches to it (``attention_precision`` "fp8" in the nodes), or to the reference on CPU
tensors, or, where FP8 cannot run, to the bf16 dispatch with the reason in its ``BackendChoice``.

The scheme (SageAttention 2's: INT8 for QK^T, FP8 for PV):

- **K smoothed** by its mean over tokens, per (batch, head): ``q . (k - m) = q . k - q . m``, and
  ``q . m`` is the same for every key of a query row, so the softmax is unchanged, while the
  channel-wise offset that makes K hard to quantise is gone;
- **Q and K in int8**, one scale per (batch, head, block of ``block`` tokens): ``amax / 127``;
  ``QK^T`` accumulates exactly and is multiplied back by the two scales. e4m3 here (3 mantissa
  bits) was measured too: on ``tests/test_kernels_fp8_reference.py``'s data its output's cosine to
  the bf16 output was 0.9986, and it fell as attention sharpened (0.9975, 0.9962 with q scaled by 2
  and 4), while int8 held 0.9992 at all three (``qk_dtype`` chooses, for that comparison);
- **P in e4m3** at a fixed scale of 448 (its values lie in [0, 1] after the running maximum is
  subtracted), **V in e4m3** with one scale per (batch, head, channel) over the tokens; ``PV``
  accumulates in float32.

The softmax itself (maximum, exponent, row sums) stays in float32, as in the kernel.

The **int8** scheme (``attention_precision`` "int8", SageAttention 1's split) quantises QK^T alone,
as above, and keeps P and V in V's 16-bit type: on the testbed the e4m3 P and V carried most of the
scheme's error (``tests/testbed/fp8_ablation.py``). Its backends are ``triton_int8`` and
``reference_int8``; the dispatch below takes ``pv_fp8=False`` for it.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from . import fa4_block_sparse as fa4
from .block_sparse import (BACKEND_ENV, BackendChoice, BlockSparseMask, check_inputs, query_blocks,
                           record_backend_choice, run_backend, select_backend, triton_available,
                           triton_interpreting)
from .layouts import from_bhnd, output_views, to_bhnd
from .ops import define_fp8_block_sparse_op, define_int8_block_sparse_op

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
INT8_MAX = 127.0
P_SCALE = E4M3_MAX  # P in [0, 1] uses e4m3's whole range
SCORE_BUDGET = 1 << 26  # floats in one chunk of scores (256 MB): the reference as a CPU fallback stays memory-sane


def quantize_blocks(x: torch.Tensor, block: int, dtype: Optional[torch.dtype] = torch.int8
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, N, D]`` -> (values in ``dtype``, float32 scales ``[B, H, ceil(N / block)]``), one scale
    per ``block`` tokens, mapping the block's largest value to the type's largest (127, or 448 for e4m3).
    ``dtype`` None: ``x`` in float32 with unit scales (not quantised, for the comparisons)."""
    b, h, n, d = x.shape
    blocks = -(-n // block)
    if dtype is None:
        return x.float(), torch.ones(b, h, blocks, dtype=torch.float32, device=x.device)
    padded = torch.nn.functional.pad(x.float(), (0, 0, 0, blocks * block - n))
    grouped = padded.view(b, h, blocks, block, d)
    top = E4M3_MAX if dtype == E4M3 else INT8_MAX
    scale = grouped.abs().amax(dim=(-1, -2)).clamp_min(1e-12) / top
    scaled = grouped / scale[..., None, None]
    values = scaled.to(E4M3) if dtype == E4M3 else scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values.view(b, h, blocks * block, d)[:, :, :n], scale


def quantize_channels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, N, D]`` -> (e4m3 values, float32 scales ``[B, H, 1, D]``), one per channel over the tokens."""
    scale = x.float().abs().amax(dim=-2, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    return (x.float() / scale).to(E4M3), scale


def fp8_block_sparse_attention_reference(q, k, v, mask: BlockSparseMask, heads: int, skip_reshape=False,
                                         skip_output_reshape=False, qk_dtype: Optional[torch.dtype] = torch.int8,
                                         smooth_k: bool = True, quantize_pv: bool = True,
                                         pv_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Block-sparse attention with the scheme above; layouts as ``block_sparse_attention``
    (``qk_dtype``, ``smooth_k`` and ``quantize_pv`` vary the scheme, for the comparisons that chose
    it and that look for where its error comes from: ``qk_dtype`` None keeps Q and K in float32,
    ``quantize_pv`` False keeps P and V in float32, or with ``pv_dtype`` rounds them to it, as the
    int8 scheme's kernel does with V's 16-bit type).

    P is quantised against its row's final maximum here; the kernel's online softmax quantises each
    tile against the maximum so far, also in [0, 1]. Heads go in chunks whose scores fit
    ``SCORE_BUDGET`` floats, as in ``block_sparse_attention_reference``, so that Wan's 75,600 tokens
    fit as a CPU fallback."""
    qh, kh, vh = (to_bhnd(x, heads, skip_reshape) for x in (q, k, v))
    b, h, n, d = qh.shape
    if smooth_k:  # the softmax does not change
        kh = kh.float() - kh.float().mean(dim=-2, keepdim=True)
    q8, q_scale = quantize_blocks(qh, mask.block_q, qk_dtype)
    k8, k_scale = quantize_blocks(kh, mask.block_k, qk_dtype)
    v8, v_scale = quantize_channels(vh) if quantize_pv else (vh.float(), torch.ones_like(vh[..., :1, :], dtype=torch.float32))
    if not quantize_pv and pv_dtype is not None:
        v8 = v8.to(pv_dtype).float()
    q_rows = q_scale.repeat_interleave(mask.block_q, dim=-1)[..., :n, None]
    k_cols = k_scale.repeat_interleave(mask.block_k, dim=-1)[..., None, :n]
    out = torch.empty(b, h, n, d, dtype=q.dtype, device=q.device)
    chunk = max(1, SCORE_BUDGET // max(1, b * mask.block_q * n))
    for rows, cols in query_blocks(mask, b, n):
        for h0 in range(0, h, chunk):
            hs = slice(h0, min(h, h0 + chunk))
            s = q8[:, hs, rows].float() @ k8[:, hs].float().transpose(-1, -2) * q_rows[:, hs, rows] * k_cols[:, hs]
            s = (s * d**-0.5).masked_fill(~cols[:, hs, None, :], float("-inf"))
            p = torch.exp(s - s.amax(dim=-1, keepdim=True))
            row_sum = p.sum(dim=-1, keepdim=True)
            p_values = (p * P_SCALE).to(E4M3).float() if quantize_pv else unquantized_p(p, pv_dtype)
            pv = p_values @ v8[:, hs].float() * (v_scale[:, hs] / P_SCALE)
            out[:, hs, rows] = (pv / row_sum).to(q.dtype)
    return from_bhnd(out, skip_output_reshape)


def unquantized_p(p: torch.Tensor, pv_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """P at the reference's fixed scale without e4m3: in float32, or rounded to ``pv_dtype`` first."""
    return (p if pv_dtype is None else p.to(pv_dtype).float()) * P_SCALE


# --------------------------------------------------------------------------------------------
# Dispatch: the FP8 kernel, its reference on CPU tensors, or the bf16 dispatch with the reason
# --------------------------------------------------------------------------------------------


def fp8_unsupported_reason(q: torch.Tensor, mask: BlockSparseMask) -> Optional[str]:
    """Why the FP8 Triton kernel cannot run this call (``q`` in ``[B, H, N, D]``), or None. CPU
    tensors run it only in Triton's interpreter (TRITON_INTERPRET=1, the CPU tests)."""
    if not triton_available():
        return "triton is not installed"
    if not q.is_cuda:
        return None if triton_interpreting() else "CPU tensors"
    major, minor = fa4.device_capability(q.device)
    if (major, minor) < (8, 9):
        return f"FP8 tensor cores need sm_89 or newer, this GPU is sm_{major}{minor}"
    d = q.shape[-1]
    if d & (d - 1) or d < 16:
        return f"head_dim {d} is not a power of two >= 16"
    if any(blk & (blk - 1) or blk < 16 for blk in (mask.block_q, mask.block_k)):
        return f"mask blocks {mask.block_q}x{mask.block_k} are not powers of two >= 16"
    return None


SCHEMES = {True: ("fp8", "int8 QK^T, e4m3 PV"), False: ("int8", "int8 QK^T, 16-bit PV")}  # by pv_fp8
QUANTIZED_BACKENDS = {f"{kind}_{name}": pv_fp8 for pv_fp8, (name, _) in SCHEMES.items()
                      for kind in ("triton", "reference")}  # backend name -> pv_fp8


def select_fp8_backend(q: torch.Tensor, mask: BlockSparseMask, backend: str = "auto",
                       pv_fp8: bool = True) -> BackendChoice:
    """Which backend a quantised call runs and why: ``triton_fp8``, ``reference_fp8`` (CPU tensors)
    (``triton_int8``, ``reference_int8`` for the int8 scheme, ``pv_fp8`` False), or where it cannot
    run with ``backend="auto"``, the bf16 choice with why it was not used. An explicit ``backend`` it
    cannot honour raises; one forced by ``CHORUS_BLOCK_SPARSE_BACKEND`` (A/B runs) falls back to the
    bf16 dispatch instead, so it never costs a run its sparsity."""
    forced = os.environ.get(BACKEND_ENV, "").strip() if backend == "auto" else ""
    if not forced or forced == "auto":
        return _fp8_choice(q, mask, backend, pv_fp8)
    try:
        name, why = _fp8_choice(q, mask, forced, pv_fp8)
    except (RuntimeError, ValueError) as exc:
        name, why = select_backend(q, mask, "auto")  # honours the variable itself
        why = f"{why}; attention_precision {SCHEMES[pv_fp8][0]} not used: {exc}"
    return BackendChoice(name, why if why.startswith(BACKEND_ENV) else f"{BACKEND_ENV}={forced}; {why}")


def _fp8_choice(q: torch.Tensor, mask: BlockSparseMask, wanted: str, pv_fp8: bool = True) -> BackendChoice:
    qh = q if q.dim() == 4 else to_bhnd(q, mask.heads, False)
    name, scheme = SCHEMES[pv_fp8]
    if wanted == "reference" or (wanted == "auto" and not q.is_cuda):
        return BackendChoice(f"reference_{name}", f"the {name} scheme's pure-torch reference ({scheme})" +
                             ("" if wanted == "reference" else " (CPU tensors)"))
    why = fp8_unsupported_reason(qh, mask)
    if wanted == "triton":
        if why is not None:
            raise RuntimeError(f"the FP8 Triton kernel cannot run this call: {why}")
        return BackendChoice(f"triton_{name}", f"requested: the FP8 Triton kernel ({scheme})")
    if wanted != "auto":
        raise ValueError(f"attention_precision {name!r} runs on 'auto', 'triton' or 'reference', got {wanted!r} "
                         "(FlashAttention-4 has no FP8 block-sparse path here)")
    if why is None:
        return BackendChoice(f"triton_{name}", f"FP8 Triton kernel: {scheme}")
    bf16 = select_backend(q, mask, "auto")
    return BackendChoice(bf16.name, f"{bf16.reason}; attention_precision {name} not used: {why}")


def fp8_block_sparse_attention(q, k, v, mask: BlockSparseMask, heads: int, skip_reshape=False,
                               skip_output_reshape=False, *, out: Optional[torch.Tensor] = None,
                               backend: str = "auto", config: Optional[dict] = None, pv_fp8: bool = True
                               ) -> torch.Tensor:
    """``block_sparse_attention`` at attention precision "fp8" (``pv_fp8`` False: "int8"): same
    layouts, mask and arguments. Under ``torch.compile`` one ``chorus::fp8_block_sparse_attention``
    (``chorus::int8_block_sparse_attention``) op."""
    if torch.compiler.is_compiling():
        op = fp8_block_sparse_attention_op if pv_fp8 else int8_block_sparse_attention_op
        res = op(q, k, v, mask.live_blocks, mask.live_counts, mask.block_q, mask.block_k, mask.seq_len,
                 heads, skip_reshape, skip_output_reshape, backend)
        return res if out is None else out.copy_(res)
    choice = select_fp8_backend(q, mask, backend, pv_fp8)
    return run_fp8_backend(choice, q, k, v, mask, heads, skip_reshape, skip_output_reshape, out=out, config=config)


def run_fp8_backend(choice: BackendChoice, q, k, v, mask: BlockSparseMask, heads: int, skip_reshape=False,
                    skip_output_reshape=False, *, out=None, config=None, validate=True) -> torch.Tensor:
    """Run a quantised choice (its name says the scheme), or hand a bf16 fallback choice to
    ``block_sparse.run_backend``."""
    if choice.name not in QUANTIZED_BACKENDS:
        return run_backend(choice, q, k, v, mask, heads, skip_reshape, skip_output_reshape, out=out, config=config,
                           validate=validate)
    record_backend_choice(choice)
    qh, kh, vh = (to_bhnd(x, heads, skip_reshape) for x in (q, k, v))
    check_inputs(qh, kh, vh, mask, validate)
    pv_fp8 = QUANTIZED_BACKENDS[choice.name]
    if choice.name.startswith("reference_"):
        res = fp8_block_sparse_attention_reference(qh, kh, vh, mask, heads, True, skip_output_reshape,
                                                   quantize_pv=pv_fp8, pv_dtype=None if pv_fp8 else vh.dtype)
        return res if out is None else out.copy_(res)
    out, oh = output_views(qh, out, heads, skip_output_reshape)
    from . import triton_fp8_block_sparse as fp8_kernel  # imports triton

    fp8_kernel.fp8_block_sparse_attn_fwd(qh, kh, vh, oh, mask, config, pv_fp8=pv_fp8)
    return out


def quantized_op_impl(pv_fp8: bool):
    """The implementation of the scheme's op (``pv_fp8`` False: int8), ``block_sparse._op_impl``'s
    counterpart (kept apart: each looks its dispatch up when it runs). One op per scheme: the schema
    has no place for it."""

    def impl(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, live_blocks: torch.Tensor, live_counts: torch.Tensor,
        block_q: int, block_k: int, seq_len: int, heads: int, skip_reshape: bool, skip_output_reshape: bool,
        backend: str,
    ) -> torch.Tensor:
        mask = BlockSparseMask(live_blocks, live_counts, block_q, block_k, seq_len)
        choice = select_fp8_backend(q, mask, backend, pv_fp8)
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        return run_fp8_backend(choice, q, k, v, mask, heads, skip_reshape, skip_output_reshape, validate=False)

    return impl


fp8_block_sparse_attention_op = define_fp8_block_sparse_op(quantized_op_impl(pv_fp8=True))
int8_block_sparse_attention_op = define_int8_block_sparse_op(quantized_op_impl(pv_fp8=False))
# attention_precision "int8" as the 16-bit and fp8 dispatches are called (sparse_run picks by name)
int8_block_sparse_attention = functools.partial(fp8_block_sparse_attention, pv_fp8=False)
select_int8_backend = functools.partial(select_fp8_backend, pv_fp8=False)
