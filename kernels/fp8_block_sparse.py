"""FP8 block-sparse attention: the numerics of the planned Hopper kernel, in pure torch ([user-stack] item 2).

What the kernel will compute, so that its accuracy can be judged before it exists and so that it
has a reference to be tested against (and a CPU fallback), as ``block_sparse.py``'s reference is
for the bf16 kernels. Not wired into the nodes yet: no ``attention_precision`` input selects it.

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
"""

from __future__ import annotations

import torch

from .block_sparse import BlockSparseMask, query_blocks
from .layouts import from_bhnd, to_bhnd

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
INT8_MAX = 127.0
P_SCALE = E4M3_MAX  # P in [0, 1] uses e4m3's whole range


def quantize_blocks(x: torch.Tensor, block: int, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, N, D]`` -> (values in ``dtype``, float32 scales ``[B, H, ceil(N / block)]``), one scale
    per ``block`` tokens, mapping the block's largest value to the type's largest (127, or 448 for e4m3)."""
    b, h, n, d = x.shape
    blocks = -(-n // block)
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
                                         skip_output_reshape=False, qk_dtype: torch.dtype = torch.int8,
                                         smooth_k: bool = True) -> torch.Tensor:
    """Block-sparse attention with the scheme above; layouts as ``block_sparse_attention``
    (``qk_dtype`` and ``smooth_k`` vary the scheme, for the comparisons that chose it).

    P is quantised against its row's final maximum here; the kernel's online softmax quantises each
    tile against the maximum so far, also in [0, 1]. One query block's scores for all heads are held
    at once (no head chunks as in ``block_sparse_attention_reference``): sized for tests, not yet
    for a CPU fallback at Wan's 75,600 tokens."""
    qh, kh, vh = (to_bhnd(x, heads, skip_reshape) for x in (q, k, v))
    b, h, n, d = qh.shape
    if smooth_k:  # the softmax does not change
        kh = kh.float() - kh.float().mean(dim=-2, keepdim=True)
    q8, q_scale = quantize_blocks(qh, mask.block_q, qk_dtype)
    k8, k_scale = quantize_blocks(kh, mask.block_k, qk_dtype)
    v8, v_scale = quantize_channels(vh)
    q_rows = q_scale.repeat_interleave(mask.block_q, dim=-1)[..., :n, None]
    k_cols = k_scale.repeat_interleave(mask.block_k, dim=-1)[..., None, :n]
    out = torch.empty(b, h, n, d, dtype=q.dtype, device=q.device)
    for rows, cols in query_blocks(mask, b, n):
        s = q8[:, :, rows].float() @ k8.float().transpose(-1, -2) * q_rows[:, :, rows] * k_cols * d**-0.5
        s = s.masked_fill(~cols[:, :, None, :], float("-inf"))
        p = torch.exp(s - s.amax(dim=-1, keepdim=True))
        row_sum = p.sum(dim=-1, keepdim=True)
        p8 = (p * P_SCALE).to(E4M3)
        pv = p8.float() @ v8.float() * (v_scale / P_SCALE)
        out[:, :, rows] = (pv / row_sum).to(q.dtype)
    return from_bhnd(out, skip_output_reshape)
