"""ComfyUI's attention layouts, shared by every kernel in this package.

``optimized_attention`` passes q, k, v as ``[B, N, H*D]`` (``heads=H``), or ``[B, H, N, D]``
with ``skip_reshape=True``; it wants the output as ``[B, N, H*D]``, or ``[B, H, N, D]`` with
``skip_output_reshape=True``. The kernels work on ``[B, H, N, D]`` views of either, never copies.
"""

from __future__ import annotations

import torch

__all__ = ["to_bhnd", "from_bhnd", "output_buffer", "output_views"]


def to_bhnd(x: torch.Tensor, heads: int, skip_reshape: bool) -> torch.Tensor:
    """``[B, N, H*D]`` (or ``[B, H, N, D]`` already) -> a ``[B, H, N, D]`` view, no copy."""
    if skip_reshape:
        if x.dim() != 4 or x.shape[1] != heads:
            raise ValueError(f"skip_reshape=True wants [B, H={heads}, N, D], got {tuple(x.shape)}")
        return x
    if x.dim() != 3 or x.shape[-1] % heads:
        raise ValueError(f"wants [B, N, H*D] with H={heads}, got {tuple(x.shape)}")
    b, n, hd = x.shape
    return x.view(b, n, heads, hd // heads).transpose(1, 2)


def from_bhnd(o_bhnd: torch.Tensor, skip_output_reshape: bool) -> torch.Tensor:
    """A ``[B, H, N, D]`` result in the caller's output layout (``[B, N, H*D]`` is a copy)."""
    if skip_output_reshape:
        return o_bhnd
    b, h, n, d = o_bhnd.shape
    return o_bhnd.transpose(1, 2).reshape(b, n, h * d)


def output_buffer(q_bhnd: torch.Tensor, skip_output_reshape: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty output in the caller's layout and its ``[B, H, N, D]`` view, for kernels that
    write into their output (FA4, Triton): nothing is copied on return."""
    b, h, n, d = q_bhnd.shape
    if skip_output_reshape:
        out = q_bhnd.new_empty(b, h, n, d)
        return out, out
    out = q_bhnd.new_empty(b, n, h * d)
    return out, out.view(b, n, h, d).transpose(1, 2)


def output_views(q_bhnd: torch.Tensor, out, heads: int, skip_output_reshape: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's output buffer (a new one when ``out`` is None) and its ``[B, H, N, D]`` view."""
    if out is None:
        return output_buffer(q_bhnd, skip_output_reshape)
    return out, out if skip_output_reshape else to_bhnd(out, heads, False)
