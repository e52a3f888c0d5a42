"""Triton forward kernel for FP8 block-sparse attention (imported only when triton is).

The scheme of ``fp8_block_sparse.py`` (its pure-torch reference is this kernel's test oracle and
CPU fallback): K smoothed by its mean over tokens, Q and K in int8 with one scale per mask block,
QK^T on the int8 tensor cores into int32, the online softmax in float32 (base 2, as in
``triton_block_sparse``), P in e4m3 at a fixed scale of 448 and V in e4m3 with one scale per
channel, PV on the fp8 tensor cores into float32. The per-channel V scale and P's 448 are the same
for every key, so they are applied once, to the finished row.

Two steps per call:

1. ``quantize`` (two small Triton kernels): Q and K to int8 per block (K less its mean), V to e4m3
   written transposed, ``[B, H, D, N]``: Hopper's fp8 tensor cores read their second operand
   K-major, and for PV that operand's K is the key axis;
2. ``fp8_block_sparse_attn_fwd``: one program per ``BLOCK_M`` query tile of one (batch element,
   head), walking its live key blocks as the bf16 kernel does, in one flat loop over
   (live block, sub-tile) that Triton pipelines.

With ``pv_fp8=False`` only QK^T is quantised: P goes to V's 16-bit type and V is read as given
(SageAttention 1's split), for the measurement that decides whether it is worth a node option.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .block_sparse import triton_interpreting
from .triton_block_sparse import (LOG2E, check_launch, launch_fitting, launch_order, live_lists, online_softmax,
                                  pick_config)

E4M3_MAX = 448.0  # e4m3's largest value: V's channel maxima map to it, and P in [0, 1] is stored as P * 448

# Tile configs per head_dim. 128: the best of seven at 720p, density 0.15 on an H100 (27.7 ms against
# 33.9 ms for this kernel with 8 warps, the bf16 kernel's count; tests/benchmarks/results/fp8_block_sparse.json,
# "sweep"). Only Hopper measured: a card with less shared memory per block may need fewer stages.
_DEFAULTS = {
    64: dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3, order="heavy_first"),
    128: dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3, order="heavy_first"),
}


class QuantizedQKV(NamedTuple):
    """What the attention kernel reads: int8 Q and K with per-block scales, e4m3 V^T with per-channel scales."""

    q: torch.Tensor  # int8 [B, H, N, D]
    q_scale: torch.Tensor  # float32 [B, H, ceil(N / block_q)]
    k: torch.Tensor  # int8 [B, H, N, D], K less its mean over tokens
    k_scale: torch.Tensor  # float32 [B, H, ceil(N / block_k)]
    v_t: Optional[torch.Tensor]  # e4m3 [B, H, D, N padded to 16]; None when V stays 16-bit
    v_scale: Optional[torch.Tensor]  # float32 [B, H, D]; None when V stays 16-bit


@triton.jit
def _round_half_even(y):
    """``y`` rounded to the nearest integer, ties to even: as torch's ``round`` and the GPU's casts."""
    r = tl.floor(y + 0.5)
    tie_to_odd = ((r - y) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0)
    return tl.where(tie_to_odd, r - 1.0, r)


@triton.jit
def _to_e4m3(x, ROUND_FIRST: tl.constexpr):
    """``x`` (within +-448) as e4m3. Triton's CPU interpreter (TRITON_INTERPRET=1,
    the CPU tests) drops the carry when a value rounds up into the next binade (127.9 becomes 64):
    there ROUND_FIRST puts x on e4m3's grid in float32 first, so the cast itself is exact."""
    if ROUND_FIRST:
        mag = tl.abs(x)
        binade = tl.maximum(tl.floor(tl.log2(tl.maximum(mag, 1e-30))), -6.0)  # below 2^-6: subnormal steps
        step = tl.exp2(binade - 3.0)  # 3 mantissa bits
        x = tl.where(x >= 0, 1.0, -1.0) * _round_half_even(mag / step) * step
    return x.to(tl.float8e4nv)


@triton.jit
def _token_block(X, stride_b, stride_h, stride_n, H, N, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """This program's ``BLOCK`` tokens of one (b, h) of ``X`` in float32 (rows past N read as 0), with
    b, h, the token and channel offsets and the in-range mask."""
    b = (tl.program_id(1) // H).to(tl.int64)
    h = (tl.program_id(1) % H).to(tl.int64)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    inside = rows[:, None] < N
    x = tl.load(X + b * stride_b + h * stride_h + rows[:, None] * stride_n + cols[None, :], mask=inside, other=0.0)
    return x.to(tl.float32), b, h, rows, cols, inside


@triton.jit
def _quantize_int8_kernel(X, MEAN, OUT, SCALE, stride_xb, stride_xh, stride_xn, stride_ob, stride_oh, stride_on,
                          stride_sb, stride_sh, H, N,
                          HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SUBTRACT_MEAN: tl.constexpr):
    """One block of ``BLOCK`` tokens of one (b, h): its largest magnitude maps to 127."""
    x, b, h, rows, cols, inside = _token_block(X, stride_xb, stride_xh, stride_xn, H, N, HEAD_DIM, BLOCK)
    blk = tl.program_id(0)
    if SUBTRACT_MEAN:  # the mean is [B, H, D], contiguous
        x = tl.where(inside, x - tl.load(MEAN + (b * H + h) * HEAD_DIM + cols)[None, :], 0.0)
    scale = tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), 1e-12) / 127.0
    scaled = x / scale
    values = tl.minimum(tl.maximum(_round_half_even(scaled), -127.0), 127.0).to(tl.int8)
    tl.store(OUT + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + cols[None, :], values, mask=inside)
    tl.store(SCALE + b * stride_sb + h * stride_sh + blk, scale)


@triton.jit
def _quantize_v_kernel(V, SCALE, OUT, stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_od, H, N,
                       HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """``BLOCK`` tokens of V of one (b, h), divided by their channel's scale, stored transposed as e4m3."""
    v, b, h, rows, cols, inside = _token_block(V, stride_vb, stride_vh, stride_vn, H, N, HEAD_DIM, BLOCK)
    v = v / tl.load(SCALE + (b * H + h) * HEAD_DIM + cols)[None, :]
    t_ptrs = OUT + b * stride_ob + h * stride_oh + cols[None, :] * stride_od + rows[:, None]
    tl.store(t_ptrs, _to_e4m3(v, ROUND_FIRST), mask=inside)


def quantize(q, k, v, block_q: int, block_k: int, pv_fp8: bool = True) -> QuantizedQKV:
    """Q, K, V as ``[B, H, N, D]`` views (unit stride on D) -> what the kernel reads (see the module
    docstring); V only with ``pv_fp8``."""
    b, h, n, d = q.shape
    k_mean = k.mean(dim=-2, dtype=torch.float32).contiguous()  # [B, H, D]; the softmax does not change
    q8, q_scale = _int8_blocks(q, None, block_q)
    k8, k_scale = _int8_blocks(k, k_mean, block_k)
    if not pv_fp8:
        return QuantizedQKV(q8, q_scale, k8, k_scale, None, None)
    # the largest |v| per channel, without the full-size temporary v.abs() would make
    v_scale = (torch.linalg.vector_norm(v, float("inf"), dim=-2).float().clamp_min(1e-12) / E4M3_MAX).contiguous()
    v_t = torch.empty(b, h, d, -(-n // 16) * 16, dtype=torch.float8_e4m3fn, device=v.device)
    block = 64
    _quantize_v_kernel[(triton.cdiv(n, block), b * h)](
        v, v_scale, v_t, v.stride(0), v.stride(1), v.stride(2), v_t.stride(0), v_t.stride(1), v_t.stride(2), h, n,
        HEAD_DIM=d, BLOCK=block, ROUND_FIRST=triton_interpreting(), num_warps=4)
    return QuantizedQKV(q8, q_scale, k8, k_scale, v_t, v_scale)


def _int8_blocks(x, mean, block: int):
    b, h, n, d = x.shape
    values = torch.empty(b, h, n, d, dtype=torch.int8, device=x.device)
    scale = torch.empty(b, h, triton.cdiv(n, block), dtype=torch.float32, device=x.device)
    _quantize_int8_kernel[(scale.shape[-1], b * h)](
        x, mean if mean is not None else scale, values, scale, x.stride(0), x.stride(1), x.stride(2),
        values.stride(0), values.stride(1), values.stride(2), scale.stride(0), scale.stride(1), h, n,
        HEAD_DIM=d, BLOCK=block, SUBTRACT_MEAN=mean is not None, num_warps=8 if block >= 128 else 4)
    return values, scale


@triton.jit
def _fp8_tile(acc, l_i, m_i, q, qs, k_base, v_base, KS, kb, start, offs_n, offs_d, stride_kn, stride_vn, stride_vd,
              N, qk_scale, MASKED: tl.constexpr, ROUND_FIRST: tl.constexpr, PV_FP8: tl.constexpr):
    """Fold keys ``start .. start+BLOCK_N`` (in key block ``kb``) into the running (acc, l_i, m_i).
    ``PV_FP8``: P and V (e4m3, transposed) on the fp8 tensor cores; else P in V's 16-bit type and V
    as given, on the 16-bit ones (SageAttention 1's split: only QK^T quantised)."""
    cols = start + offs_n
    if PV_FP8:
        v_ptrs = v_base + offs_d[:, None] * stride_vd + cols[None, :]  # V^T: [HEAD_DIM, BLOCK_N]
    else:
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :]  # V: [BLOCK_N, HEAD_DIM]
    if MASKED:
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=cols[:, None] < N, other=0)
        if PV_FP8:
            v = tl.load(v_ptrs, mask=cols[None, :] < N, other=0.0)
        else:
            v = tl.load(v_ptrs, mask=cols[:, None] < N, other=0.0)
    else:
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :])
        v = tl.load(v_ptrs)
    qk = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * (qs * tl.load(KS + kb))
    if MASKED:
        qk = tl.where(cols[None, :] < N, qk, float("-inf"))
    p, alpha, l_i, m_ij = online_softmax(qk, m_i, l_i, qk_scale)
    if PV_FP8:
        acc = tl.dot(_to_e4m3(p * 448.0, ROUND_FIRST), tl.trans(v), acc * alpha[:, None])
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_ij


@triton.jit
def _fp8_bsa_fwd_kernel(Q, QS, K, KS, VT, VS, O, LIVE, COUNT, ORDER,
                        stride_qb, stride_qh, stride_qn, stride_qsb, stride_qsh,
                        stride_kb, stride_kh, stride_kn, stride_ksb, stride_ksh,
                        stride_vb, stride_vh, stride_vn, stride_vd,
                        stride_ob, stride_oh, stride_on,
                        stride_lb, stride_lh, stride_lq, stride_cb, stride_ch,
                        H, N, n_tiles, qk_scale,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        TILES_PER_QB: tl.constexpr, SUBS_PER_KB: tl.constexpr, RAGGED: tl.constexpr,
                        ROUND_FIRST: tl.constexpr, PV_FP8: tl.constexpr):
    flat = tl.load(ORDER + tl.program_id(0))  # heaviest tiles of each head first, as in the bf16 kernel
    tile = flat % n_tiles
    b = (flat // n_tiles // H).to(tl.int64)
    h = (flat // n_tiles % H).to(tl.int64)
    row = tile // TILES_PER_QB
    count = tl.load(COUNT + b * stride_cb + h * stride_ch + row)
    live = LIVE + b * stride_lb + h * stride_lh + row * stride_lq
    k_base = K + b * stride_kb + h * stride_kh
    v_base = VT + b * stride_vb + h * stride_vh  # V^T in e4m3 (PV_FP8), else V itself
    k_scales = KS + b * stride_ksb + h * stride_ksh

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :],
                mask=offs_m[:, None] < N, other=0)
    qs = tl.load(QS + b * stride_qsb + h * stride_qsh + row)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    KB: tl.constexpr = BLOCK_N * SUBS_PER_KB
    n_full = count
    if RAGGED:  # ids ascend, so the ragged last key block, when live, is the last entry
        last_kb = (N - 1) // KB
        n_full = count - (tl.load(live + count - 1) == last_kb).to(tl.int32)
    for j in range(0, n_full * SUBS_PER_KB):  # one flat loop over (live block, sub-tile): pipelined
        kb = tl.load(live + j // SUBS_PER_KB)
        acc, l_i, m_i = _fp8_tile(acc, l_i, m_i, q, qs, k_base, v_base, k_scales, kb,
                                  kb * KB + (j % SUBS_PER_KB) * BLOCK_N, offs_n, offs_d, stride_kn, stride_vn,
                                  stride_vd, N, qk_scale, False, ROUND_FIRST, PV_FP8)
    if RAGGED:
        if n_full < count:
            for s in tl.static_range(SUBS_PER_KB):
                start = last_kb * KB + s * BLOCK_N
                if start < N:  # sub-tiles wholly past N are skipped, never all -inf
                    acc, l_i, m_i = _fp8_tile(acc, l_i, m_i, q, qs, k_base, v_base, k_scales, last_kb, start,
                                              offs_n, offs_d, stride_kn, stride_vn, stride_vd, N, qk_scale, True,
                                              ROUND_FIRST, PV_FP8)
    if PV_FP8:
        v_scale = tl.load(VS + (b * H + h) * HEAD_DIM + offs_d) / 448.0  # V's channel scales and P's 448, once
        acc = acc * v_scale[None, :]
    acc = acc / l_i[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=offs_m[:, None] < N)


def fp8_pick_config(head_dim: int, block_q: int, block_k: int, config: Optional[dict] = None) -> dict:
    """Tile config: the default for ``head_dim``, overridden, clipped to the mask blocks (as the bf16 kernel's)."""
    cfg = pick_config(head_dim, block_q, block_k, dict(_DEFAULTS.get(head_dim, {}), **(config or {})))
    cfg.pop("tma", None)  # the bf16 kernel's TMA loads: this kernel has none
    return cfg


def fp8_block_sparse_attn_fwd(q, k, v, o, mask, config: Optional[dict] = None, pv_fp8: bool = True):
    """Quantise ``[B, H, N, D]`` views (any strides, unit stride on D) and attend into ``o``.

    ``pv_fp8`` False keeps P and V 16-bit (QK^T alone in int8): on the testbed the e4m3 P and V
    were most of the scheme's error (``tests/testbed/fp8_ablation.py``); not yet a node option.
    Returns the launched kernel handle, as ``block_sparse_attn_fwd`` does."""
    b, h, n, d = q.shape
    check_launch(q, k, v, o, "the FP8 kernel")
    cfg = fp8_pick_config(d, mask.block_q, mask.block_k, config)
    bm = cfg["BLOCK_M"]
    qq = quantize(q, k, v, mask.block_q, mask.block_k, pv_fp8)
    # V as the kernel reads it, strides in (b, h, token, channel) order either way: e4m3 V^T seen
    # through its transpose, or V itself (then the scale argument is unread)
    v_in, v_scale = (qq.v_t.transpose(2, 3), qq.v_scale) if pv_fp8 else (v, qq.q_scale)
    order = launch_order(mask, b, bm, cfg["order"])
    lb, lc, lb_sb, lc_sb = live_lists(mask)
    def launch(block_n: int, stages: int):
        return _fp8_bsa_fwd_kernel[(order.numel(),)](
            qq.q, qq.q_scale, qq.k, qq.k_scale, v_in, v_scale, o, lb, lc, order,
            qq.q.stride(0), qq.q.stride(1), qq.q.stride(2), qq.q_scale.stride(0), qq.q_scale.stride(1),
            qq.k.stride(0), qq.k.stride(1), qq.k.stride(2), qq.k_scale.stride(0), qq.k_scale.stride(1),
            *v_in.stride(),
            o.stride(0), o.stride(1), o.stride(2),
            lb_sb, lb.stride(1), lb.stride(2), lc_sb, lc.stride(1),
            h, n, math.ceil(n / bm), d**-0.5 * LOG2E,
            HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=block_n, TILES_PER_QB=mask.block_q // bm,
            SUBS_PER_KB=mask.block_k // block_n, RAGGED=n % mask.block_k != 0, ROUND_FIRST=triton_interpreting(),
            PV_FP8=pv_fp8,
            num_warps=cfg["num_warps"], num_stages=stages,
        )

    return launch_fitting(launch, cfg, ("fp8" if pv_fp8 else "int8", str(q.device), q.dtype, d))
