"""Online block-mask prediction from mean-pooled Q and K (the cheap per-call predictor).

Pool queries and keys per block, score block pairs with a softmax over the pooled keys, and
select blocks as recorded masks are selected (``masks.select_blocks``). Summing exp(q . k) over a
key block of n tokens is approximated by n * exp(q_mean . k_mean), hence the log(n) term for the
ragged last block. The miss path's fallback when no recorded mask fits.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .._siblings import import_sibling
from .masks import select_blocks

__all__ = ["pool_blocks", "block_scores", "predict_block_map"]


def pool_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean per block of tokens: ``[B, H, N, D]`` (any strides) -> float32 ``[B, H, nb, D]``.

    Full blocks are a view (splitting N never copies) reduced in one call; the ragged tail apart.
    """
    n = x.shape[2]
    full = n // block_size
    parts = []
    if full:
        parts.append(x[:, :, : full * block_size].unflatten(2, (full, block_size)).mean(3, dtype=torch.float32))
    if n % block_size:
        parts.append(x[:, :, full * block_size :].mean(2, keepdim=True, dtype=torch.float32))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 2)


def block_scores(
    q: torch.Tensor, k: torch.Tensor, heads: Optional[int] = None, block_size: int = 128, scale: Optional[float] = None
) -> torch.Tensor:
    """Predicted block attention mass: q, k ``[B, H, N, D]`` or ``[B, N, H*D]`` -> float32 ``[B, H, nb, nb]``.

    ``softmax_j(mean(Q_i) . mean(K_j) * scale + log |K_j|)``; rows sum to 1. Exact when Q and K
    are constant within each block.
    """
    to_bhnd = import_sibling("kernels.block_mass").to_bhnd
    qh, kh = to_bhnd(q, heads), to_bhnd(k, heads)
    n, d = qh.shape[2], qh.shape[3]
    scale = d**-0.5 if scale is None else scale
    pq, pk = pool_blocks(qh, block_size), pool_blocks(kh, block_size)
    logits = pq @ pk.transpose(-1, -2) * scale  # [B, H, nb, nb]
    tail = n - (math.ceil(n / block_size) - 1) * block_size
    if tail != block_size:  # only the last key block has fewer keys: log(tail / block_size) there
        logits[..., -1] += math.log(tail / block_size)
    return logits.softmax(-1)


def predict_block_map(
    q: torch.Tensor,
    k: torch.Tensor,
    heads: Optional[int] = None,
    block_size: int = 128,
    top_p: float = 0.9,
    min_density: float = 0.0,
    max_density: float = 1.0,
    keep_diagonal: bool = True,
    sink_blocks: Optional[Sequence[int]] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Online mask: q, k ``[B, H, N, D]`` or ``[B, N, H*D]`` -> bool block map ``[B, H, nb, nb]``."""
    scores = block_scores(q, k, heads, block_size, scale)
    return select_blocks(scores, top_p, min_density, max_density, keep_diagonal, sink_blocks)
