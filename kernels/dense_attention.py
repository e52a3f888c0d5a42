"""Dense self-attention for the calls Chorus leaves dense: dense warm-up steps and dense layers.

On Hopper and datacenter Blackwell with ``flash-attn-4`` installed, FlashAttention-4's dense
forward is faster than torch SDPA's cuDNN backend (0.83-0.87x its time per call in
``tests/benchmarks/results/block_sparse_h200.md``; a whole dense generation 1.12x faster in
``fast_path_h200_*.md``). It changes speed, not results beyond bf16
rounding: both compute softmax(QK^T / sqrt(d)) V in fp32 with bf16 inputs and output.

Without FA4, on Hopper (sm_90), torch SDPA with cuDNN's attention first (``cudnn_sdpa``) runs
the calls, as ComfyUI itself runs SDPA on Windows. On Linux ComfyUI leaves torch's own order, which picks the
flash kernel: 15.95 s a Wan 14B 720p dense step on an H100 against 10.86 s with cuDNN first
(``tests/benchmarks/results/user_stack_720p.md``). Same softmax attention, same inputs: only the
rounding differs. ``dense_route_for`` says which of the two takes a run's calls; where neither can,
the caller hands the calls to ComfyUI's own attention function (whatever backend the user chose
there), never to a different one. The pure-torch reference (``dense_attention_reference``) is the
CPU fallback and the test oracle. Under ``torch.compile`` the call is the
``chorus::dense_attention`` custom op, one opaque node in the graph: this module registers
``run_dense`` as its implementation through ``kernels.ops``.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import fa4_block_sparse as fa4
from .layouts import from_bhnd, output_buffer, to_bhnd
from .ops import define_dense_op

__all__ = ["dense_attention", "dense_attention_reference", "dense_unsupported_reason", "dense_unsupported_for",
           "cudnn_unsupported_for", "dense_route_for"]

CUDNN_SDPA_DTYPES = (torch.float16, torch.bfloat16)
CUDNN_SDPA_MAX_HEAD_DIM = 128  # cuDNN's SDPA on sm_80/sm_90 takes head dims up to 128, in steps of 8
_SDPA_ORDER_SETTABLE = "set_priority" in inspect.signature(sdpa_kernel).parameters  # torch 2.6+


def dense_unsupported_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """None when FA4's dense forward can run calls on ``device`` in ``dtype`` at ``head_dim``."""
    return fa4.fa4_dense_unsupported_reason(torch.device(device), dtype, int(head_dim))


def cudnn_unsupported_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """None when torch's cuDNN attention can run calls on ``device`` in ``dtype`` at ``head_dim``."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"inputs are on the {device.type.upper()}"  # FA4's words: the report then says it once
    if torch.version.cuda is None:
        return "torch's cuDNN attention needs a CUDA build of torch"
    if dtype not in CUDNN_SDPA_DTYPES:
        return f"torch's cuDNN attention needs bf16 or fp16 inputs, got {dtype}"
    if head_dim > CUDNN_SDPA_MAX_HEAD_DIM or head_dim % 8:
        return f"torch's cuDNN attention is used at head dims up to 128 in steps of 8, got {head_dim}"
    major, minor = fa4.device_capability(device)
    if major != 9:  # measured faster than torch's own pick on an H100 only; elsewhere ComfyUI's choice stands
        return f"cuDNN first is used on sm_90 (measured on an H100), this GPU is sm_{major}{minor}"
    if not torch.backends.cudnn.is_available() or not torch.backends.cuda.cudnn_sdp_enabled():
        return "torch's cuDNN attention is unavailable or switched off in this process"
    if not _SDPA_ORDER_SETTABLE:
        return "this torch cannot put one SDPA backend first (torch 2.6 or newer can)"
    return None


def dense_route_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[Optional[str], str]:
    """(route, why FA4 does not take the calls): ``"fa4"`` where FA4's dense forward can run calls
    like these, else ``"cudnn_sdpa"`` where torch's cuDNN attention can, else None (ComfyUI's own
    function runs them; the why then also says why cuDNN cannot)."""
    why_not_fa4 = dense_unsupported_for(device, dtype, head_dim)
    if why_not_fa4 is None:
        return "fa4", ""
    why_not_cudnn = cudnn_unsupported_for(device, dtype, head_dim)
    if why_not_cudnn is None:
        return "cudnn_sdpa", why_not_fa4
    return None, "; ".join(dict.fromkeys((why_not_fa4, why_not_cudnn)))


def dense_unsupported_reason(q: torch.Tensor, heads: int, skip_reshape: bool = False) -> Optional[str]:
    """None when FA4's dense forward can run this call, else why not (cheap: probes are cached)."""
    if not skip_reshape and (q.dim() != 3 or q.shape[-1] % heads):
        return f"q is not [B, N, H*D] with H={heads}"
    if skip_reshape and q.dim() != 4:
        return "q is not [B, H, N, D]"
    return dense_unsupported_for(q.device, q.dtype, q.shape[-1] if skip_reshape else q.shape[-1] // heads)


CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
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


def cudnn_first_sdpa(q, k, v, heads: int, skip_reshape=False, skip_output_reshape=False) -> torch.Tensor:
    """torch SDPA with cuDNN's attention first in its order (the rest in torch's order after it, so
    a call cuDNN turns down still runs), as ComfyUI's ``comfy.ops`` runs SDPA on Windows."""
    qh, kh, vh = (to_bhnd(x, heads, skip_reshape) for x in (q, k, v))
    with sdpa_kernel(CUDNN_FIRST, set_priority=True):
        o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh)
    # contiguous [B, H, N, D] as the custom op declares it (SDPA may follow q's memory order)
    return o.contiguous() if skip_output_reshape else from_bhnd(o, False)


def run_dense(q, k, v, heads: int, skip_reshape=False, skip_output_reshape=False) -> torch.Tensor:
    """Eager dispatch: FA4 where it applies, else cuDNN-first SDPA where cuDNN applies, else the
    reference (what the custom op runs)."""
    if dense_unsupported_reason(q, heads, skip_reshape) is not None:
        head_dim = q.shape[-1] if skip_reshape else q.shape[-1] // heads
        if cudnn_unsupported_for(q.device, q.dtype, head_dim) is None:
            return cudnn_first_sdpa(q, k, v, heads, skip_reshape, skip_output_reshape)
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
    ``skip_reshape``): FA4 where ``dense_unsupported_reason`` is None, else cuDNN-first SDPA where
    ``cudnn_unsupported_for`` is None, else the reference."""
    if torch.compiler.is_compiling():
        return dense_attention_op(q, k, v, heads, skip_reshape, skip_output_reshape)
    return run_dense(q, k, v, heads, skip_reshape, skip_output_reshape)
