"""Population prior: the block map most requests agree on, from several recorded block maps.

Much of a video DiT's attention pattern is positional and shared by all requests; the prior is
that shared part (a static mask, and the baseline the bank's request-specific masks must beat).
Maps must come from the same model, latent grid, block size and step bucket.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..attention.masks import density_bounds, forced_blocks, keep_top_counts

__all__ = ["keep_frequency", "population_prior"]


def keep_frequency(block_maps: Union[torch.Tensor, Sequence[torch.Tensor]]) -> torch.Tensor:
    """Share of maps keeping each block: M bool maps ``[..., nq, nk]`` (a list or stacked ``[M, ...]``) -> float32 ``[..., nq, nk]``."""
    stacked = torch.stack(list(block_maps)) if not isinstance(block_maps, torch.Tensor) else block_maps
    if stacked.dtype != torch.bool or stacked.dim() < 3 or stacked.shape[0] == 0:
        raise ValueError(f"wants M >= 1 bool block maps of one shape, got {stacked.dtype} {tuple(stacked.shape)}")
    return stacked.float().mean(0)


def population_prior(
    block_maps: Union[torch.Tensor, Sequence[torch.Tensor]],
    density: float,
    keep_diagonal: bool = True,
    sink_blocks: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Per row, the ``round(density * nk)`` (at least 1) most often kept blocks -> bool ``[..., nq, nk]``.

    The diagonal and sink blocks are always kept (they count towards the row's blocks). Ties in
    frequency go to the lower key-block id (stable sort), so the prior is deterministic.
    """
    freq = keep_frequency(block_maps)
    nq, nk = freq.shape[-2:]
    count = max(1, round(density * nk))
    density_bounds(nk, density, density)  # validates density
    forced = forced_blocks(nq, nk, keep_diagonal, sink_blocks, freq.device)
    counts = torch.full(freq.shape[:-1], count, dtype=torch.long, device=freq.device)
    return keep_top_counts(freq, counts, forced)
