"""Region maps for feature reuse: which cells of a Wan 2.1 video's token grid run at reduced resolution.

Pure tensor math with no ComfyUI in it, shared by the Feature Reuse node, the runtime patch
(``feature_reuse``) and the benchmarks:

* the token and cell grids of a latent (``token_grid``, ``cell_grid``, ``CELL_CHOICES``);
* picking redundant cells from the start frame (``region_scores``, ``select_regions``), with
  ``rim`` cells at the border of every region kept at full resolution (``erode_regions``);
* a preview of the map for the node's IMAGE output (``region_map_image``);
* how a reduced run is judged: ``seam_measure`` compares gradient energy across region borders
  with the dense run, ``flops_estimate`` gives the analytic saving.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "PATCH_SIZE",
    "CELL_CHOICES",
    "token_grid",
    "cell_grid",
    "region_scores",
    "erode_regions",
    "select_regions",
    "region_map_image",
    "seam_measure",
    "flops_estimate",
]

PATCH_SIZE = (1, 2, 2)  # Wan 2.1 patchify (t, h, w) in latent pixels
CELL_CHOICES = {"1x2x2": (1, 2, 2), "2x2x2": (2, 2, 2), "1x4x4": (1, 4, 4)}


# --------------------------------------------------------------------------------------------
# Region selection
# --------------------------------------------------------------------------------------------


def token_grid(latent_shape: Sequence[int]) -> tuple[int, int, int]:
    """(T, H, W) token grid of a latent ``[B, C, T, H, W]`` after Wan's (1, 2, 2) patchify (padded)."""
    t, h, w = latent_shape[-3:]
    return tuple(math.ceil(n / p) for n, p in zip((t, h, w), PATCH_SIZE))


def cell_grid(grid: Sequence[int], cell: Sequence[int]) -> tuple[int, int, int]:
    """Whole cells that fit in the token grid (partial cells at the far edges are never pooled)."""
    return tuple(g // c for g, c in zip(grid, cell))


def region_scores(start_latent: torch.Tensor, cell: Sequence[int], margin: int = 1) -> torch.Tensor:
    """Redundancy score per spatial cell of a start frame: lower = smoother = more redundant.

    The start frame ``[B, C, T, H, W]`` (frame 0 is used) or ``[C, H, W]`` is patchified to
    tokens; a cell's score is the largest within-cell token variance over the cell and its
    ``margin``-cell neighbourhood (so cells next to detail, where things move, are not picked),
    over the frame's token variance. Returns float ``[Hc, Wc]``.
    """
    frame = start_latent.detach().float()
    if frame.dim() == 5:
        frame = frame[0, :, 0]
    elif frame.dim() == 4:
        frame = frame[0] if frame.shape[1] != 1 else frame[:, 0]
    if frame.dim() != 3:
        raise ValueError(f"start latent must be [B, C, T, H, W] or [C, H, W], got {tuple(start_latent.shape)}")
    c, h, w = frame.shape
    ph, pw = PATCH_SIZE[1:]
    frame = F.pad(frame, (0, (-w) % pw, 0, (-h) % ph), mode="replicate")
    tokens = F.avg_pool2d(frame[None], (ph, pw))[0]  # [C, Ht, Wt]: what a token sees, roughly
    ch, cw = cell[1], cell[2]
    hc, wc = tokens.shape[1] // ch, tokens.shape[2] // cw
    tokens = tokens[:, :hc * ch, :wc * cw]
    mean = F.avg_pool2d(tokens[None], (ch, cw))[0]                          # [C, Hc, Wc]
    within = F.avg_pool2d(tokens[None].square(), (ch, cw))[0] - mean.square()
    # detail inside the cell, plus the step to neighbouring cells (edges between cells)
    step = torch.zeros_like(mean)
    step[:, 1:] += (mean[:, 1:] - mean[:, :-1]).square()
    step[:, :-1] += (mean[:, 1:] - mean[:, :-1]).square()
    step[:, :, 1:] += (mean[:, :, 1:] - mean[:, :, :-1]).square()
    step[:, :, :-1] += (mean[:, :, 1:] - mean[:, :, :-1]).square()
    score = (within.clamp_min(0) + 0.25 * step).sum(0)  # [Hc, Wc]
    if margin > 0:
        score = F.max_pool2d(score[None, None], 2 * margin + 1, stride=1, padding=margin)[0, 0]
    scale = tokens.var(dim=(1, 2)).sum().clamp_min(1e-12)
    return score / scale


def erode_regions(region_map: torch.Tensor, rim: int) -> torch.Tensor:
    """Drop ``rim`` cells at the border of every region (spatially, per frame); frame edges do not erode."""
    if rim <= 0 or not region_map.any():
        return region_map.clone()
    outside = (~region_map).float()[:, None]  # [Tc, 1, Hc, Wc]
    near_outside = F.max_pool2d(outside, 2 * rim + 1, stride=1, padding=rim)[:, 0] > 0
    return region_map & ~near_outside


def select_regions(start_latent: torch.Tensor, grid: Sequence[int], strength: float,
                   cell: Sequence[int] = (1, 2, 2), margin: int = 1, rim: int = 1,
                   skip_first_frame: bool = False) -> torch.Tensor:
    """Region map bool ``[Tc, Hc, Wc]``: the ``strength`` share of cells with the lowest score.

    :param start_latent: the I2V start frame latent (``[B, C, T, H, W]``, frame 0 used).
    :param grid: (T, H, W) token grid of the video being generated.
    :param strength: share of cells (0..1) picked before the ``rim`` erosion.
    :param margin: cells around detail that are never picked (see ``region_scores``).
    :param rim: border cells of each region kept at full resolution (``erode_regions``).
    :param skip_first_frame: keep the first latent frame (the start image) at full resolution.
    """
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"strength must be in 0..1, got {strength}")
    tc, hc, wc = cell_grid(grid, cell)
    scores = region_scores(start_latent, cell, margin)
    if scores.shape != (hc, wc):  # the start frame may be at another size than the video grid
        scores = F.interpolate(scores[None, None], size=(hc, wc), mode="bilinear", align_corners=False)[0, 0]
    picked = torch.zeros(hc * wc, dtype=torch.bool)
    count = int(round(strength * hc * wc))
    if count > 0:
        picked[torch.argsort(scores.flatten().cpu(), stable=True)[:count]] = True
    region_map = picked.view(1, hc, wc).expand(tc, hc, wc).clone()
    if skip_first_frame and tc > 0:
        region_map[0] = False
    return erode_regions(region_map, rim)


def region_map_image(region_map: torch.Tensor, grid: Sequence[int], cell: Sequence[int],
                     start_latent: Optional[torch.Tensor] = None, scale: int = 8) -> torch.Tensor:
    """ComfyUI IMAGE ``[Tc, H*16/scale.., W.., 3]`` per cell-frame: reduced cells tinted orange.

    Each token is ``scale`` pixels wide. With a start latent, its first three channels
    (normalised) show underneath so the user sees what was reduced.
    """
    t, h, w = grid
    tc = region_map.shape[0]
    token_map = region_map.repeat_interleave(cell[1], 1).repeat_interleave(cell[2], 2).float()
    full = torch.zeros(tc, h, w)
    full[:, :token_map.shape[1], :token_map.shape[2]] = token_map
    base = torch.full((tc, h, w, 3), 0.35)
    if start_latent is not None:
        frame = start_latent.detach().float().cpu()
        frame = frame[0, :3, 0] if frame.dim() == 5 else frame[:3]
        frame = F.adaptive_avg_pool2d(frame[None], (h, w))[0]
        lo, hi = frame.amin(), frame.amax()
        base = ((frame - lo) / (hi - lo).clamp_min(1e-6)).permute(1, 2, 0)[None].expand(tc, h, w, 3) * 0.8
    orange = torch.tensor([1.0, 0.55, 0.1])
    image = base * (1 - 0.6 * full[..., None]) + 0.6 * full[..., None] * orange
    image = image.repeat_interleave(scale, 1).repeat_interleave(scale, 2)
    # thin dark grid lines between cells
    cell_px = (cell[1] * scale, cell[2] * scale)
    image[:, ::cell_px[0]] *= 0.7
    image[:, :, ::cell_px[1]] *= 0.7
    return image.clamp(0, 1).contiguous()


# --------------------------------------------------------------------------------------------
# Measures
# --------------------------------------------------------------------------------------------


def _latent_cell_labels(region_map: torch.Tensor, cell: Sequence[int], latent_shape: Sequence[int]) -> torch.Tensor:
    """int ``[T, H, W]`` over latent pixels: a cell id for pooled pixels, -1 for full-resolution ones."""
    t, h, w = latent_shape[-3:]
    tc, hc, wc = region_map.shape
    ids = torch.arange(tc * hc * wc).view(tc, hc, wc).masked_fill(~region_map.cpu(), -1)
    scale = [c * p for c, p in zip(cell, PATCH_SIZE)]
    ids = ids.repeat_interleave(scale[0], 0).repeat_interleave(scale[1], 1).repeat_interleave(scale[2], 2)
    labels = torch.full((t, h, w), -1, dtype=torch.long)
    tt, hh, ww = min(t, ids.shape[0]), min(h, ids.shape[1]), min(w, ids.shape[2])
    labels[:tt, :hh, :ww] = ids[:tt, :hh, :ww]
    return labels


def seam_measure(dense: torch.Tensor, test: torch.Tensor, region_map: torch.Tensor, cell: Sequence[int]) -> dict:
    """Gradient energy across borders of pooled cells, ``test`` vs ``dense`` latents ``[B, C, T, H, W]``.

    Pairs of horizontally / vertically adjacent latent pixels are split into *region borders*
    (one pixel pooled, the other full resolution), *cell borders* (two different pooled cells)
    and the rest. Returns:

    * ``seam_ratio``: mean squared gradient of ``test`` over region borders / the same for ``dense``
      (1.0 = borders as sharp as in the dense run; > 1 = added edges, < 1 = smoothed);
    * ``cell_seam_ratio``: the same over borders between pooled cells;
    * ``seam_excess``: mean squared error of the gradient (test - dense) on region borders / on
      pairs inside the pooled regions (1.0 = the border is no worse than the reduced area itself).
    """
    labels = _latent_cell_labels(region_map, cell, dense.shape)
    out = {}
    sums = {name: [0.0, 0.0, 0.0, 0] for name in ("region", "cell", "inside")}
    for dim in (3, 4):  # H, W of [B, C, T, H, W]
        ld = labels.diff(dim=dim - 2) != 0
        a, b = labels.narrow(dim - 2, 0, labels.shape[dim - 2] - 1), labels.narrow(dim - 2, 1, labels.shape[dim - 2] - 1)
        region = ld & ((a < 0) != (b < 0))
        cellb = ld & (a >= 0) & (b >= 0)
        inside = (a >= 0) & (b >= 0)
        gd, gt = dense.double().diff(dim=dim), test.double().diff(dim=dim)
        for name, sel in (("region", region), ("cell", cellb), ("inside", inside)):
            m = sel[None, None].expand_as(gd)
            sums[name][0] += float(gt[m].square().sum())
            sums[name][1] += float(gd[m].square().sum())
            sums[name][2] += float((gt - gd)[m].square().sum())
            sums[name][3] += int(m.sum())
    ratio = lambda s: s[0] / s[1] if s[1] > 0 else float("nan")  # noqa: E731
    out["seam_ratio"] = ratio(sums["region"])
    out["cell_seam_ratio"] = ratio(sums["cell"])
    region_err = sums["region"][2] / max(sums["region"][3], 1)
    inside_err = sums["inside"][2] / max(sums["inside"][3], 1)
    out["seam_excess"] = region_err / inside_err if inside_err > 0 else float("nan")
    out["border_pairs"] = sums["region"][3]
    return out


def flops_estimate(grid: Sequence[int], pooled_token_share: float, cell_size: int, *, dim: int = 5120,
                   ffn_dim: int = 13824, layers: int = 40, reduced_layers: int = 38, steps: int = 40,
                   reduced_steps: int = 28, context: int = 257 + 512, density: float = 1.0) -> dict:
    """Analytic FLOPs of the Wan 2.1 blocks with and without feature reuse (an estimate, not a timing).

    Per block and token count n: q/k/v/o and cross-attention q/o GEMMs ``2 n d^2`` each, FFN
    ``4 n d f``, self-attention ``4 n^2 d x density``, cross-attention ``4 n L d``; cross k/v on
    the context do not depend on n and are left out of both.
    """
    n = math.prod(grid)
    n_red = n - pooled_token_share * n * (1 - 1 / cell_size)

    def block(tokens):
        gemm = 6 * 2 * tokens * dim * dim + 4 * tokens * dim * ffn_dim
        attn = 4 * tokens * tokens * dim * density + 4 * tokens * context * dim
        return gemm, attn

    g_full, a_full = block(n)
    g_red, a_red = block(n_red)
    full = steps * layers * (g_full + a_full)
    reduced = full - reduced_steps * reduced_layers * ((g_full + a_full) - (g_red + a_red))
    return dict(N=n, N_reduced=round(n_red), gemm_share_saved_per_block=1 - g_red / g_full,
                attention_share_saved_per_block=1 - a_red / a_full,
                block_flops_full=g_full + a_full, block_flops_reduced=g_red + a_red,
                generation_flops_saved=1 - reduced / full, ideal_speedup=full / reduced)
