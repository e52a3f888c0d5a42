"""Quality measures of a block mask and of a sparse run: recall, output error, PSNR, SSIM.

- ``attention_recall``: mean over queries of the exact softmax mass the mask keeps.
- ``sparse_output_error``: relative RMS of block-sparse vs dense attention output, computed
  here with an element mask (independent of the block-sparse kernel, so it can check it).
- ``psnr`` / ``ssim``: final latents ``[B, C, T, H, W]`` of a sparse run vs the dense run.

Attention inputs use ComfyUI's layouts: ``[B, N, H*D]`` with ``heads``, or ``[B, H, N, D]``.
Block maps are bool ``[B or 1, H, nq, nk]``; a batch of 1 is broadcast.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ._siblings import import_sibling

__all__ = ["Measure", "attention_recall", "mass_recall", "sparse_output_error", "psnr", "ssim"]

_SCORE_BUDGET = 1 << 25  # floats in one scores chunk of sparse_output_error


class Measure(NamedTuple):
    per_head: torch.Tensor  # [B, H]
    overall: float


def mass_recall(mass: torch.Tensor, block_map: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Recall of ``block_map`` against block mass: mass, block_map ``[..., nq, nk]`` -> ``[...]``.

    The mean over queries: each query block's kept mass weighted by its token count (the last
    block may be ragged).
    """
    rows = import_sibling("kernels.block_mass").block_row_counts(seq_len, block_size, mass.device)
    kept = (mass * block_map).sum(-1)  # [..., nq]
    return kept @ (rows.to(kept.dtype) / seq_len)


def attention_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    block_map: torch.Tensor,
    heads: Optional[int] = None,
    block_size: int = 128,
    scale: Optional[float] = None,
) -> Measure:
    """Share of the exact softmax attention mass kept by ``block_map``, averaged over queries.

    q, k ``[B, H, N, D]`` or ``[B, N, H*D]``; block_map bool ``[B or 1, H, nq, nk]`` ->
    ``Measure(per_head [B, H], overall = mean over batch, heads and queries)``. Uses the block-mass
    kernel on CUDA, its torch reference elsewhere.
    """
    bm = import_sibling("kernels.block_mass")
    n = bm.to_bhnd(q, heads).shape[2]
    mass = bm.block_mass(q, k, heads, block_size, scale)  # [B, H, nq, nk]
    _check_map(block_map, mass.shape)
    per_head = mass_recall(mass, block_map, n, block_size)
    return Measure(per_head, float(per_head.mean()))


def _check_map(block_map: torch.Tensor, mass_shape) -> None:
    b, h, nq, nk = mass_shape
    if block_map.dim() != 4 or block_map.shape[0] not in (1, b) or tuple(block_map.shape[1:]) != (h, nq, nk):
        raise ValueError(f"block_map must be [{b} or 1, {h}, {nq}, {nk}], got {tuple(block_map.shape)}")


def sparse_output_error(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_map: torch.Tensor,
    heads: Optional[int] = None,
    block_size: int = 128,
    scale: Optional[float] = None,
) -> Measure:
    """Relative RMS error of block-sparse attention against dense attention.

    ``per_head[b, h] = ||O_sparse - O_dense|| / ||O_dense||`` over that head's ``[N, D]`` output;
    ``overall`` is the same ratio over the whole output. Float32 (float64 for float64 inputs),
    chunked over query blocks so memory stays bounded.
    """
    bm = import_sibling("kernels.block_mass")
    qh, kh, vh = (bm.to_bhnd(x, heads) for x in (q, k, v))
    b, h, n, d = qh.shape
    nb = math.ceil(n / block_size)
    _check_map(block_map, (b, h, nb, nb))
    cdt = torch.promote_types(q.dtype, torch.float32)
    scale = d**-0.5 if scale is None else scale
    kt, vc = kh.to(cdt).transpose(-1, -2), vh.to(cdt)
    err2 = torch.zeros(b, h, dtype=cdt, device=q.device)
    ref2 = torch.zeros(b, h, dtype=cdt, device=q.device)
    blocks_per_chunk = max(1, _SCORE_BUDGET // (b * h * block_size * n))
    for i0 in range(0, nb, blocks_per_chunk):
        i1 = min(nb, i0 + blocks_per_chunk)
        rows = slice(i0 * block_size, min(n, i1 * block_size))
        s = qh[:, :, rows].to(cdt) @ kt * scale  # [B, H, r, N]
        keep = block_map[:, :, i0:i1].repeat_interleave(block_size, 2)[:, :, : s.shape[2]]
        keep = keep.repeat_interleave(block_size, 3)[..., :n]
        dense = s.softmax(-1) @ vc
        sparse = s.masked_fill(~keep, -torch.inf).softmax(-1) @ vc
        err2 += (sparse - dense).square().sum((-1, -2))
        ref2 += dense.square().sum((-1, -2))
    return Measure((err2 / ref2).sqrt(), math.sqrt(float(err2.sum() / ref2.sum())))


# --------------------------------------------------------------------------------------------
# Latents
# --------------------------------------------------------------------------------------------


def _data_range(ref: torch.Tensor, data_range: Optional[float]) -> torch.Tensor:
    """Per-sample data range ``[B]``: given, or the peak-to-peak of the reference latents.

    Latents have no fixed range (unlike 8-bit images), so by default the reference sample's own
    spread (max - min over C, T, H, W) plays the role of the peak value.
    """
    if data_range is not None:
        return torch.full((ref.shape[0],), float(data_range), dtype=torch.float64, device=ref.device)
    flat = ref.flatten(1)
    return flat.amax(1) - flat.amin(1)


def _check_latents(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape or a.dim() != 5:
        raise ValueError(f"wants two latents of equal shape [B, C, T, H, W], got {tuple(a.shape)} and {tuple(b.shape)}")


def psnr(ref: torch.Tensor, test: torch.Tensor, data_range: Optional[float] = None) -> torch.Tensor:
    """PSNR in dB of ``test`` against ``ref``, latents ``[B, C, T, H, W]`` -> float64 ``[B]``; inf if equal.

    ``10 log10(R^2 / MSE)`` with R from ``_data_range`` (the reference's peak-to-peak by default).
    """
    _check_latents(ref, test)
    a, b = ref.double(), test.double()
    mse = (a - b).square().flatten(1).mean(1)
    r = _data_range(a, data_range)
    return 10 * torch.log10(r.square() / mse)  # mse = 0 gives +inf


def _gaussian_window(size: int, sigma: float, device) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64, device=device) - (size - 1) / 2
    w = torch.exp(-(x**2) / (2 * sigma**2))
    return w / w.sum()


def ssim(
    ref: torch.Tensor, test: torch.Tensor, data_range: Optional[float] = None, window: int = 7, sigma: float = 1.5
) -> torch.Tensor:
    """SSIM (Wang et al. 2004) of latents ``[B, C, T, H, W]`` -> float64 ``[B]``; 1.0 if equal.

    Gaussian windows (``window`` taps, ``sigma``) over each frame's H x W plane, per channel and
    frame, valid positions only (no padding); the mean over windows, channels and frames.
    ``C1 = (0.01 R)^2``, ``C2 = (0.03 R)^2`` with R as in ``psnr``. The window shrinks to the
    plane when the latent is smaller than it (tiny test latents).
    """
    _check_latents(ref, test)
    bsz, c, t, h, w = ref.shape
    size = min(window, h, w)
    g = _gaussian_window(size, sigma, ref.device)
    kernel = (g[:, None] * g[None, :])[None, None]  # [1, 1, size, size]
    x, y = (z.double().reshape(bsz * c * t, 1, h, w) for z in (ref, test))  # one plane per (b, c, t)
    mx, my = F.conv2d(x, kernel), F.conv2d(y, kernel)
    vx = F.conv2d(x * x, kernel) - mx**2
    vy = F.conv2d(y * y, kernel) - my**2
    cxy = F.conv2d(x * y, kernel) - mx * my
    r = _data_range(ref.double(), data_range).repeat_interleave(c * t)[:, None, None, None]
    c1, c2 = (0.01 * r) ** 2, (0.03 * r) ** 2
    smap = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return smap.reshape(bsz, -1).mean(1)
