"""Dense self-attention for the calls Chorus leaves dense: dense warm-up steps and dense layers.

On Hopper and datacenter Blackwell with ``flash-attn-4`` installed, FlashAttention-4's dense
forward is faster than torch SDPA's cuDNN backend (0.83-0.87x its time per call in
``tests/benchmarks/results/block_sparse_h200.md``; a whole dense generation 1.12x faster in
``fast_path_h200_*.md``). It changes speed, not results beyond bf16
rounding: both compute softmax(QK^T / sqrt(d)) V in fp32 with bf16 inputs and output.

``dense_unsupported_reason`` says whether FA4 can take a call; where it cannot, the caller
hands the call to ComfyUI's own attention function (whatever backend the user chose there),
never to a different one. The pure-torch reference (``dense_attention_reference``) is the
CPU fallback and the test oracle. Under ``torch.compile`` the call is the
``chorus::dense_attention`` custom op, one opaque node in the graph: this module registers
``run_dense`` as its implementation through ``kernels.ops``.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import fa4_block_sparse as fa4
from .layouts import from_bhnd, output_buffer, to_bhnd
from .ops import define_dense_op

__all__ = ["dense_attention", "dense_attention_reference", "dense_unsupported_reason", "dense_unsupported_for"]


def dense_unsupported_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """None when FA4's dense forward can run calls on ``device`` in ``dtype`` at ``head_dim``."""
    return fa4.fa4_dense_unsupported_reason(torch.device(device), dtype, int(head_dim))


def dense_unsupported_reason(q: torch.Tensor, heads: int, skip_reshape: bool = False) -> Optional[str]:
    """None when FA4's dense forward can run this call, else why not (cheap: probes are cached)."""
    if not skip_reshape and (q.dim() != 3 or q.shape[-1] % heads):
        return f"q is not [B, N, H*D] with H={heads}"
    if skip_reshape and q.dim() != 4:
        return "q is not [B, H, N, D]"
    return dense_unsupported_for(q.device, q.dtype, q.shape[-1] if skip_reshape else q.shape[-1] // heads)


_REF_SCORE_BUDGET = 1 << 26  # scores per chunk (256 MB in fp32): the fallback stays memory-sane at 720p


def dense_attention_reference(q, k, v, heads: int, skip_reshape=False, skip_output_reshape=False) -> torch.Tensor:
    """Plain softmax attention in float32 (float64 for float64 inputs), query rows in chunks:
    the test oracle and the CPU fallback."""
    qh, kh, vh = (to_bhnd(x, heads, skip_reshape) for x in (q, k, v))
    cdt = torch.promote_types(q.dtype, torch.float32)
    kc, vc = kh.to(cdt), vh.to(cdt)
    b, h, n, _ = qh.shape
    rows = max(1, _REF_SCORE_BUDGET // max(1, b * h * kh.shape[2]))
    o = torch.empty(qh.shape, dtype=q.dtype, device=q.device)
    for start in range(0, n, rows):
        part = slice(start, min(n, start + rows))
        o[:, :, part] = torch.nn.functional.scaled_dot_product_attention(qh[:, :, part].to(cdt), kc, vc).to(q.dtype)
    return from_bhnd(o, skip_output_reshape)


def run_dense(q, k, v, heads: int, skip_reshape=False, skip_output_reshape=False) -> torch.Tensor:
    """Eager dispatch: FA4 where it applies, else the reference (what the custom op runs)."""
    if dense_unsupported_reason(q, heads, skip_reshape) is not None:
        return dense_attention_reference(q, k, v, heads, skip_reshape, skip_output_reshape)
    qh, kh, vh = (to_bhnd(x, heads, skip_reshape) for x in (q, k, v))
    out, out_bhnd = output_buffer(qh, skip_output_reshape)
    fa4.fa4_dense_fwd(qh, kh, vh, out_bhnd)
    return out


def _op_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, skip_reshape: bool,
             skip_output_reshape: bool) -> torch.Tensor:
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return run_dense(q, k, v, heads, skip_reshape, skip_output_reshape)


dense_attention_op = define_dense_op(_op_impl)  # the chorus::dense_attention custom op (see kernels.ops)


def dense_attention(q, k, v, heads: int, skip_reshape=False, skip_output_reshape=False) -> torch.Tensor:
    """Dense self-attention in ComfyUI's layouts (``[B, N, H*D]`` or ``[B, H, N, D]`` with
    ``skip_reshape``); FA4 where ``dense_unsupported_reason`` is None, else the reference."""
    if torch.compiler.is_compiling():
        return dense_attention_op(q, k, v, heads, skip_reshape, skip_output_reshape)
    return run_dense(q, k, v, heads, skip_reshape, skip_output_reshape)
