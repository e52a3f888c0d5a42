"""Token layout of feature reuse: full-resolution Wan 2.1 tokens <-> the reduced sequence.

Cells a region map selects (``feature_regions``) are mean-pooled into one token each; a block
runs on the shorter sequence and its *update* of a pooled token is brought back to the cell's
tokens while the residual stream stays at full resolution::

    x [B, N, C] --pool--> x' [B, N', C] --block--> y' ;  y = x + restore(y' - x')

``TokenLayout`` holds that bookkeeping: pooling and restoring tokens, the RoPE table, the
pooled keys' size bias, and carrying block-sparse maps over to the reduced sequence. It knows
nothing about ComfyUI or the sampler; the runtime patch is ``feature_reuse``.

RoPE. A pooled token gets the rotation of its cell's centre (fractional position): the
normalised mean of the member tokens' rotation matrices. For members symmetric around the
centre, and offsets below pi / 2 rad (Wan's fastest RoPE frequency is 1 rad per position, so
cells up to 4 tokens per axis), that is exactly RoPE at the centre position.

Seams. ``blend`` replaces the piecewise-constant (nearest) upsampling of pooled updates by a
tent filter over neighbouring tokens (bilinear between cell centres, and towards the exact
updates of full-resolution neighbours at region borders).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .feature_regions import cell_grid

__all__ = ["TokenLayout"]


class TokenLayout:
    """Full-resolution tokens (t, h, w raster) <-> reduced sequence (kept tokens + one per pooled cell).

    :param region_map: bool ``[Tc, Hc, Wc]``; True = the cell is pooled.
    :param grid: (T, H, W) video token grid.
    :param cell: (ct, ch, cw) tokens per cell.
    """

    def __init__(self, region_map: torch.Tensor, grid: Sequence[int], cell: Sequence[int], device=None):
        grid, cell = tuple(int(g) for g in grid), tuple(int(c) for c in cell)
        if tuple(region_map.shape) != cell_grid(grid, cell):
            raise ValueError(f"region map {tuple(region_map.shape)} does not fit grid {grid} with cells {cell}: "
                             f"expected {cell_grid(grid, cell)}")
        self.grid, self.cell = grid, cell
        self.region_map = region_map.bool().cpu()
        t, h, w = grid
        ct, ch, cw = cell
        self.n_full = t * h * w
        index = torch.arange(self.n_full).view(t, h, w)
        tc, hc, wc = self.region_map.shape
        cells = index[:tc * ct, :hc * ch, :wc * cw].reshape(tc, ct, hc, ch, wc, cw).permute(0, 2, 4, 1, 3, 5)
        cells = cells.reshape(tc, hc, wc, ct * ch * cw)
        members = cells[self.region_map]                         # [P, s], ascending within a cell
        pooled = torch.zeros(self.n_full, dtype=torch.bool)
        pooled[members.flatten()] = True
        kept = torch.nonzero(~pooled).flatten()                  # [K]
        # reduced order: raster order of each new token's first full-resolution token
        first = torch.cat([kept, members[:, 0]])
        self.order = torch.argsort(first)                        # reduced position -> row of cat(kept, pooled)
        self.kept, self.members = kept, members
        self.pooled = pooled
        self.n_reduced = len(kept) + len(members)
        self.cell_size = ct * ch * cw
        self._device_cache: dict[str, dict] = {}
        self._membership_cache: dict[tuple, torch.Tensor] = {}

    @property
    def n_pooled_cells(self) -> int:
        return len(self.members)

    @property
    def pooled_token_share(self) -> float:
        return float(self.pooled.float().mean()) if self.n_full else 0.0

    def _on(self, device) -> dict:
        key = str(device)
        cached = self._device_cache.get(key)
        if cached is None:
            inverse = torch.empty_like(self.order)
            inverse[self.order] = torch.arange(len(self.order))
            size = torch.cat([torch.ones(len(self.kept)), torch.full((len(self.members),), float(self.cell_size))])
            # key_source: for each full-resolution token, the reduced token that stands for it
            key_source = torch.empty(self.n_full, dtype=torch.long)
            key_source[self.kept] = inverse[:len(self.kept)]
            key_source[self.members] = inverse[len(self.kept):, None].expand_as(self.members)
            cached = dict(kept=self.kept.to(device), members=self.members.to(device), order=self.order.to(device),
                          inverse=inverse.to(device), log_size=size[self.order].log().to(device),
                          pooled=self.pooled.to(device), key_source=key_source.to(device))
            self._device_cache = {key: cached}  # one device at a time: memory stays bounded
        return cached

    # ---- tokens

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, N, C]`` -> ``[B, N', C]``: kept tokens as they are, each pooled cell its mean."""
        d = self._on(x.device)
        parts = [x[:, d["kept"]], x[:, d["members"]].mean(2)] if len(self.members) else [x[:, d["kept"]]]
        return torch.cat(parts, 1)[:, d["order"]]

    def unpool(self, y: torch.Tensor, blend: bool = False) -> torch.Tensor:
        """``[B, N', C]`` -> ``[B, N, C]``: kept tokens back in place, a pooled value on every token of its cell.

        ``blend`` smooths the pooled tokens' values with a tent filter over their (h, w)
        neighbours, kept neighbours included (the kept tokens' values are never changed).
        """
        d = self._on(y.device)
        rows = y[:, d["inverse"]]  # rows of cat(kept, pooled)
        b, _, c = y.shape
        out = y.new_empty(b, self.n_full, c)
        k = len(self.kept)
        out[:, d["kept"]] = rows[:, :k]
        if len(self.members):
            out[:, d["members"]] = rows[:, k:, None].expand(-1, -1, self.cell_size, -1)
            if blend:
                out = torch.where(d["pooled"][None, :, None], _tent_hw(out, self.grid), out)
        return out

    def restore(self, x: torch.Tensor, x_reduced: torch.Tensor, y_reduced: torch.Tensor, blend: bool = True) -> torch.Tensor:
        """Block output at full resolution: ``x + unpool(y' - x')``; exact for kept tokens' updates."""
        return x + self.unpool(y_reduced - x_reduced, blend=blend).to(x.dtype)

    # ---- RoPE

    def pool_freqs(self, freqs: torch.Tensor) -> torch.Tensor:
        """RoPE table ``[1, N, 1, D/2, 2, 2]`` -> ``[1, N', 1, D/2, 2, 2]``: a cell's centre rotation per pooled token."""
        if freqs.shape[1] != self.n_full:
            raise ValueError(f"RoPE table has {freqs.shape[1]} positions, layout has {self.n_full} tokens")
        d = self._on(freqs.device)
        parts = [freqs[:, d["kept"]]]
        if len(self.members):
            mean = freqs[:, d["members"]].mean(2)  # mean of rotation matrices [[cos, -sin], [sin, cos]]
            norm = torch.sqrt(mean[..., 0, 0].square() + mean[..., 1, 0].square()).clamp_min(1e-12)
            parts.append(mean / norm[..., None, None])
        return torch.cat(parts, 1)[:, d["order"]]

    def key_bias(self, device, dtype) -> torch.Tensor:
        """``[1, 1, N']`` additive attention bias: ``log(tokens behind each key)`` (the float mask
        that ``expand_keys`` replaces; kept for benchmarks and tests)."""
        return self._on(device)["log_size"].to(dtype)[None, None]

    def expand_keys(self, x: torch.Tensor, skip_reshape: bool = False) -> torch.Tensor:
        """Reduced keys or values ``[B, N', C]`` (``[B, H, N', D]`` with ``skip_reshape``) -> ``N`` rows,
        each pooled one repeated once per token of its cell, in full-resolution raster order.

        ``softmax(q.k_j + log s_j)`` over the ``N'`` keys equals plain softmax attention over the
        expanded keys (``s_j`` equal terms are ``s_j`` times one), so the size-biased attention
        runs with no mask, through whatever attention function ComfyUI picked (SDPA: its flash
        kernel), for ``N / N'`` times the keys. On an H200 at 14B shapes with half the tokens
        pooled that is 1.11-1.15x the float-mask call it replaces (SDPA's flash kernel takes no
        float mask, so that one ran 1.41x the unbiased call);
        ``tests/benchmarks/results/feature_reuse_dense_fallback_h200.md``.
        """
        return x.index_select(2 if skip_reshape else 1, self._on(x.device)["key_source"])

    # ---- block maps

    def block_membership(self, block: int, device=None) -> torch.Tensor:
        """float ``[nb', nb]``: 1 where reduced block r' holds a token drawn from full-resolution block r."""
        nb, nbr = math.ceil(self.n_full / block), math.ceil(self.n_reduced / block)
        rows = torch.cat([self.kept[:, None].expand(-1, self.cell_size), self.members])[self.order]  # [N', s]
        new_block = (torch.arange(self.n_reduced) // block)[:, None].expand_as(rows)
        membership = torch.zeros(nbr, nb)
        membership[new_block.flatten(), (rows // block).flatten()] = 1.0
        return membership.to(device) if device is not None else membership

    def map_block_map(self, block_map: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
        """bool ``[B, H, nq, nk]`` over N tokens -> bool ``[B, H, nq', nk']`` over the reduced N'.

        A reduced (query, key) block pair is live iff any full-resolution pair behind it is.
        """
        aq = self._membership(block_q, block_map.device)
        ak = aq if block_k == block_q else self._membership(block_k, block_map.device)
        counts = aq @ block_map.float() @ ak.T
        return counts > 0

    def _membership(self, block: int, device) -> torch.Tensor:
        """``block_membership``, built once per (block, device): every layer and bucket maps with it."""
        key = (block, str(device))
        cached = self._membership_cache.get(key)
        if cached is None:
            cached = self._membership_cache[key] = self.block_membership(block, device)
        return cached


def _tent_hw(x: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
    """``[B, N, C]`` -> same, each token the [1 2 1] x [1 2 1] / 16 average of its (h, w) neighbourhood."""
    t, h, w = grid
    b, n, c = x.shape
    v = x.view(b, t, h, w, c).permute(0, 4, 1, 2, 3).reshape(b * c, t, h, w).float()
    v = F.pad(v, (1, 1, 1, 1), mode="replicate")
    v = (v[..., :-2] + 2 * v[..., 1:-1] + v[..., 2:]) / 4
    v = (v[..., :-2, :] + 2 * v[..., 1:-1, :] + v[..., 2:, :]) / 4
    return v.view(b, c, t, h, w).permute(0, 2, 3, 4, 1).reshape(b, n, c).to(x.dtype)
