"""Triton forward kernel for block-sparse flash attention (imported only when triton is).

One program computes one ``BLOCK_M`` query tile of one (batch element, head): it walks that
tile's live key blocks (ascending ids from the mask), ``BLOCK_N`` keys at a time, with the
FlashAttention-2 online softmax in base 2 (the ``1/sqrt(D)`` scale folded into ``log2(e)``).
Mask blocks may be coarser than the tiles: ``BLOCK_M`` divides ``block_q`` and ``BLOCK_N``
divides ``block_k``. Only the ragged last key block is masked, in a separate tail step, so
full blocks pay no masking work.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

LOG2E = 1.4426950408889634

# Chosen on an H200 (tests/benchmarks/KERNEL_NOTES.md); keys: head_dim.
_DEFAULTS = {
    64: dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, tma=True),
    128: dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, tma=True),
}
_FALLBACK = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


@triton.jit
def online_softmax(qk, m_i, l_i, qk_scale):
    """One tile of the online softmax (base 2): its probabilities, the rescale of what came before,
    and the new row sums and maxima. Inlined where it is called, so the pipelined loop keeps its order."""
    m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_ij


@triton.jit
def _attend_tile(acc, l_i, m_i, q, k_base, v_base, KD, VD, kv_row0, kv_col0, start, offs_n, offs_d,
                 stride_kn, stride_vn, N, qk_scale, MASKED: tl.constexpr, USE_TMA: tl.constexpr):
    """Fold keys ``start .. start+BLOCK_N`` into the running (acc, l_i, m_i).

    Full tiles load through the tensor-copy engine (TMA descriptors KD, VD) when USE_TMA,
    which frees the warps from address math; the ragged tail always uses masked pointer
    loads so that rows past N (the next batch element's) are never read.
    """
    cols = start + offs_n
    if MASKED:
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
    elif USE_TMA:
        k = KD.load([kv_row0 + start, kv_col0])
        v = VD.load([kv_row0 + start, kv_col0])
    else:
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :])
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :])
    qk = tl.dot(q, tl.trans(k))
    if MASKED:
        qk = tl.where(cols[None, :] < N, qk, float("-inf"))
    p, alpha, l_i, m_ij = online_softmax(qk, m_i, l_i, qk_scale)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_ij


@triton.jit
def _load_tile(base, desc, row0, col0, start, offs_n, offs_d, stride_n, USE_TMA: tl.constexpr):
    """A full [BLOCK_N, D] tile of K or V starting at key ``start``."""
    if USE_TMA:
        return desc.load([row0 + start, col0])
    return tl.load(base + (start + offs_n)[:, None] * stride_n + offs_d[None, :])


@triton.jit
def _main_loop_pipelined(acc, l_i, m_i, q, k_base, v_base, KD, VD, kv_row0, kv_col0, live, n_full,
                         offs_n, offs_d, stride_kn, stride_vn, qk_scale,
                         BLOCK_N: tl.constexpr, SUBS_PER_KB: tl.constexpr, USE_TMA: tl.constexpr):
    """Full tiles with QK^T of step j+1 issued before the softmax of step j (FA3's overlap).

    The asynchronous wgmma of the next scores can then run on the tensor cores while the
    exp2 of the current ones run on the special-function units. Steps j walk the flattened
    (live block, sub-tile) pairs.
    """
    KB: tl.constexpr = BLOCK_N * SUBS_PER_KB
    n_steps = n_full * SUBS_PER_KB
    if n_steps > 0:
        start = tl.load(live) * KB
        qk = tl.dot(q, tl.trans(_load_tile(k_base, KD, kv_row0, kv_col0, start, offs_n, offs_d, stride_kn, USE_TMA)))
        for j in range(1, n_steps):
            nxt = tl.load(live + j // SUBS_PER_KB) * KB + (j % SUBS_PER_KB) * BLOCK_N
            k = _load_tile(k_base, KD, kv_row0, kv_col0, nxt, offs_n, offs_d, stride_kn, USE_TMA)
            qk_next = tl.dot(q, tl.trans(k))
            p, alpha, l_i, m_ij = online_softmax(qk, m_i, l_i, qk_scale)
            v = _load_tile(v_base, VD, kv_row0, kv_col0, start, offs_n, offs_d, stride_vn, USE_TMA)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i, qk, start = m_ij, qk_next, nxt
        p, alpha, l_i, m_ij = online_softmax(qk, m_i, l_i, qk_scale)
        v = _load_tile(v_base, VD, kv_row0, kv_col0, start, offs_n, offs_d, stride_vn, USE_TMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _bsa_fwd_kernel(Q, K, V, O, KD, VD, LIVE, COUNT, ORDER,
                    stride_qb, stride_qh, stride_qn,
                    stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn,
                    stride_ob, stride_oh, stride_on,
                    stride_lb, stride_lh, stride_lq,
                    stride_cb, stride_ch,
                    H, N, n_tiles, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    TILES_PER_QB: tl.constexpr, SUBS_PER_KB: tl.constexpr, RAGGED: tl.constexpr,
                    PIPELINE_QK: tl.constexpr, USE_TMA: tl.constexpr):
    # ORDER maps launch slots to tiles: heaviest tiles of each head launch first, so the
    # last wave is made of light tiles (load balance over uneven rows), while the tiles
    # of one head still run together and share its K/V in L2.
    flat = tl.load(ORDER + tl.program_id(0))
    tile = flat % n_tiles
    bh = flat // n_tiles
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    row = tile // TILES_PER_QB
    count = tl.load(COUNT + b * stride_cb + h * stride_ch + row)
    live = LIVE + b * stride_lb + h * stride_lh + row * stride_lq
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    # TMA coordinates of this (b, h) in the 2D [rows, stride_n] view of K and V (same strides)
    kv_row0 = ((b * stride_kb + h * stride_kh) // stride_kn).to(tl.int32)
    kv_col0 = ((b * stride_kb + h * stride_kh) % stride_kn).to(tl.int32)

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :],
                mask=offs_m[:, None] < N, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    KB: tl.constexpr = BLOCK_N * SUBS_PER_KB
    n_full = count
    if RAGGED:
        # ids ascend, so the ragged last key block, when live, is the last entry
        last_kb = (N - 1) // KB
        n_full = count - (tl.load(live + count - 1) == last_kb).to(tl.int32)
    if PIPELINE_QK:
        acc, l_i, m_i = _main_loop_pipelined(acc, l_i, m_i, q, k_base, v_base, KD, VD, kv_row0, kv_col0, live,
                                             n_full, offs_n, offs_d, stride_kn, stride_vn, qk_scale,
                                             BLOCK_N, SUBS_PER_KB, USE_TMA)
    else:
        for i in range(0, n_full):
            kb = tl.load(live + i)
            for s in tl.static_range(SUBS_PER_KB):
                acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_base, v_base, KD, VD, kv_row0, kv_col0,
                                             kb * KB + s * BLOCK_N, offs_n, offs_d, stride_kn, stride_vn,
                                             N, qk_scale, False, USE_TMA)
    if RAGGED:
        if n_full < count:
            for s in tl.static_range(SUBS_PER_KB):
                start = last_kb * KB + s * BLOCK_N
                if start < N:  # sub-tiles wholly past N are skipped, never all -inf
                    acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_base, v_base, KD, VD, kv_row0, kv_col0,
                                                 start, offs_n, offs_d, stride_kn, stride_vn,
                                                 N, qk_scale, True, False)
    acc = acc / l_i[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=offs_m[:, None] < N)


def _pow2_divisor(x: int, cap: int) -> int:
    """Largest power of two dividing ``x``, at most ``cap``."""
    return min(x & -x, cap)


def pick_config(head_dim: int, block_q: int, block_k: int, config: Optional[dict] = None) -> dict:
    """Tile config: the tuned default for ``head_dim``, overridden, clipped to the mask blocks."""
    cfg = dict(_DEFAULTS.get(head_dim, _FALLBACK))
    cfg["order"] = "heavy_first"
    cfg.update(config or {})
    # tiles must nest inside the mask's blocks
    cfg["BLOCK_M"] = _pow2_divisor(block_q, cfg["BLOCK_M"])
    cfg["BLOCK_N"] = _pow2_divisor(block_k, cfg["BLOCK_N"])
    if min(cfg["BLOCK_M"], cfg["BLOCK_N"]) < 16:
        raise ValueError(
            f"mask blocks {block_q}x{block_k} need a power-of-two factor of at least 16 for the Triton "
            f"kernel; use backend='reference' or blocks such as 64 or 128"
        )
    return cfg


def launch_order(mask, batch: int, block_m: int, order: str) -> torch.Tensor:
    """int32 launch order over (b, h, tile), cached on the mask (computed once per mask)."""
    cache = mask.__dict__.setdefault("_launch_orders", {})
    key = (batch, block_m, order)
    if key not in cache:
        tiles_per_qb = mask.block_q // block_m
        n_tiles = math.ceil(mask.seq_len / block_m)
        counts = mask.live_counts.expand(batch, -1, -1)
        counts = counts.repeat_interleave(tiles_per_qb, dim=-1)[..., :n_tiles]  # [B, H, n_tiles]
        if order == "heavy_first":
            idx = torch.argsort(-counts, dim=-1, stable=True)
        elif order == "natural":
            idx = torch.arange(n_tiles, device=counts.device).expand_as(counts)
        else:
            raise ValueError(f"order must be 'heavy_first' or 'natural', got {order!r}")
        bh = torch.arange(counts.shape[0] * counts.shape[1], device=counts.device).view(*counts.shape[:2], 1)
        cache[key] = (bh * n_tiles + idx).to(torch.int32).flatten().contiguous()
    return cache[key]


def _kv_descriptors(k, v, block_n):
    """TMA descriptors over the 2D ``[rows, stride_n]`` views of K and V, or (k, v) if unfit.

    Fits both ComfyUI layouts: ``[B, N, H*D]`` (a head is a column offset in a row) and a
    contiguous ``[B, H, N, D]`` (a head is a row offset). TMA wants 16-byte aligned rows.
    """
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return k, v
    b, h, n, d = k.shape
    sb, sh, sn, _ = k.stride()
    heads_in_row = sb % sn == 0 and (h - 1) * sh + d <= sn
    heads_as_rows = sb % sn == 0 and sh % sn == 0
    same = v.stride() == k.stride()
    aligned = all(x.data_ptr() % 16 == 0 for x in (k, v)) and (sn * k.element_size()) % 16 == 0
    if not (same and aligned and (heads_in_row or heads_as_rows)):
        return k, v
    rows = ((b - 1) * sb + (h - 1) * sh + (n - 1) * sn) // sn + 1
    return tuple(
        TensorDescriptor(x.as_strided((rows, sn), (sn, 1)), [rows, sn], [sn, 1], [block_n, d]) for x in (k, v)
    )


_FITTED: dict = {}  # (kernel, device, dtype, head_dim, tile config) -> the (BLOCK_N, num_stages) that fit


def fitting_candidates(cfg: dict) -> list[tuple[int, int]]:
    """(BLOCK_N, num_stages) to try, from the tuned config down: fewer stages (one K and V tile
    less each), then half as many keys per tile at two stages and one."""
    block_n, stages = cfg["BLOCK_N"], cfg["num_stages"]
    smaller = [(block_n // 2, s) for s in range(min(stages, 2), 0, -1)] if block_n >= 32 else []
    return [(block_n, s) for s in range(stages, 0, -1)] + smaller


def launch_fitting(launch, cfg: dict, key: tuple):
    """``launch(block_n, num_stages)`` at the tuned config, or the first smaller one the GPU's shared
    memory holds. The configs are tuned on Hopper (227 KB a block); consumer and Ada cards have about
    100 KB, A100 164 KB, and Triton refuses a launch that needs more (OutOfResources) rather than
    spilling. What fitted is remembered per device and config, so later calls go straight to it."""
    key = key + (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"])
    refused = None
    for block_n, stages in ([_FITTED[key]] if key in _FITTED else fitting_candidates(cfg)):
        try:
            handle = launch(block_n, stages)
        except OutOfResources as exc:
            refused = exc
            continue
        _FITTED[key] = (block_n, stages)
        return handle
    raise refused


def check_launch(q, k, v, o, kernel: str) -> None:
    """``[B, H, N, D]`` views a kernel of this package can launch on: ValueError saying what is wrong."""
    d = q.shape[-1]
    if d & (d - 1) or d < 16:
        raise ValueError(f"{kernel} needs a power-of-two head_dim >= 16, got {d}")
    for name, x in (("q", q), ("k", k), ("v", v), ("out", o)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride on head_dim (make it contiguous)")
    if o.shape != q.shape or o.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} in [B, H, N, D] view, got {tuple(o.shape)} {o.dtype}")


def live_lists(mask):
    """The mask's live ids and counts with a unit last stride (the kernels step ids and rows by one),
    and their batch strides: 0 for a batch-1 mask, which broadcasts over the batch."""
    lb, lc = mask.live_blocks, mask.live_counts
    if lb.stride(-1) != 1 or lc.stride(-1) != 1:
        lb, lc = lb.contiguous(), lc.contiguous()
    return lb, lc, lb.stride(0) if lb.shape[0] > 1 else 0, lc.stride(0) if lc.shape[0] > 1 else 0


def block_sparse_attn_fwd(q, k, v, o, mask, config: Optional[dict] = None):
    """Launch the kernel on ``[B, H, N, D]`` views (any strides, unit stride on D) into ``o``.

    Returns the launched kernel handle (its ``n_regs`` / ``n_spills`` feed the benchmark notes).
    """
    b, h, n, d = q.shape
    check_launch(q, k, v, o, "the Triton kernel")
    cfg = pick_config(d, mask.block_q, mask.block_k, config)
    bm = cfg["BLOCK_M"]
    order = launch_order(mask, b, bm, cfg["order"])
    lb, lc, lb_sb, lc_sb = live_lists(mask)

    def launch(block_n: int, stages: int):
        kd, vd = _kv_descriptors(k, v, block_n) if cfg.get("tma") else (k, v)
        return _bsa_fwd_kernel[(order.numel(),)](
            q, k, v, o, kd, vd, lb, lc, order,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            o.stride(0), o.stride(1), o.stride(2),
            lb_sb, lb.stride(1), lb.stride(2),
            lc_sb, lc.stride(1),
            h, n, math.ceil(n / bm), d**-0.5 * LOG2E,
            HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=block_n,
            TILES_PER_QB=mask.block_q // bm, SUBS_PER_KB=mask.block_k // block_n,
            RAGGED=n % mask.block_k != 0, PIPELINE_QK=bool(cfg.get("pipeline_qk", False)),
            USE_TMA=kd is not k,
            num_warps=cfg["num_warps"], num_stages=stages,
        )

    return launch_fitting(launch, cfg, ("bf16", str(q.device), q.dtype, d))
