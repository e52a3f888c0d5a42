"""Block attention mass: how much of each query block's softmax attention lands in each key block.

``mass[b, h, i, j]`` = (1 / |Q_i|) * sum over queries q in block i of sum over keys k in block j
of softmax_k(q . k * scale). Rows sum to 1. This is the quantity a block mask is chosen from
(keep the heaviest key blocks of a row) and the one its recall is measured against.

Layouts follow ComfyUI's ``optimized_attention``: ``q, k`` are ``[B, N, H*D]`` with ``heads=H``,
or ``[B, H, N, D]`` (4-D input; ``heads`` may then be omitted). Any N: the last block may be
ragged. Query and key blocks have the same size.

Two implementations:
- ``block_mass_reference``: pure torch, chunked over query blocks and heads so its scores chunk
  stays under a fixed budget. The CPU path and the test oracle.
- ``_block_mass_triton``: two passes, as in flash attention's backward: pass 1 computes each
  row's log-sum-exp with an online softmax, pass 2 re-computes the scores one (query block,
  key block) tile at a time and sums exp(s - lse) over the tile. Costs two QK^T products and no
  N x N memory. Pass 1 is skipped when the caller already has the row log-sum-exp (``lse``).

``query_stride`` s > 1 estimates each query block's mass from its queries 0, s, 2s, ... only:
recording needs block means, not every query, and pays 1/s of the cost.

Importing this module never needs triton.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .block_sparse import triton_interpreting

try:  # optional: without triton (or with a broken install) only the reference runs
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001
    triton = None

__all__ = ["block_mass", "block_mass_reference", "to_bhnd", "block_row_counts", "triton_available"]

_REF_SCORE_BUDGET = 1 << 26  # floats in one reference scores chunk (256 MB fp32)
_LOG2E = 1.4426950408889634


def triton_available() -> bool:
    """True when triton imported (the kernel still needs CUDA tensors, or TRITON_INTERPRET=1)."""
    return triton is not None


def to_bhnd(x: torch.Tensor, heads: Optional[int]) -> torch.Tensor:
    """``[B, N, H*D]`` (with ``heads``) or ``[B, H, N, D]`` -> a ``[B, H, N, D]`` view, no copy."""
    if x.dim() == 4:
        if heads is not None and x.shape[1] != heads:
            raise ValueError(f"4-D input is read as [B, H, N, D] with H={heads}, got {tuple(x.shape)}")
        return x
    if x.dim() != 3 or heads is None or x.shape[-1] % heads:
        raise ValueError(f"wants [B, H, N, D], or [B, N, H*D] with heads=H; got {tuple(x.shape)}, heads={heads}")
    b, n, hd = x.shape
    return x.view(b, n, heads, hd // heads).transpose(1, 2)


def block_row_counts(seq_len: int, block_size: int, device=None) -> torch.Tensor:
    """Tokens in each of the ``ceil(seq_len / block_size)`` blocks (the last may be ragged); int64."""
    nb = math.ceil(seq_len / block_size)
    counts = torch.full((nb,), block_size, dtype=torch.int64, device=device)
    counts[-1] = seq_len - (nb - 1) * block_size
    return counts


def _check_qk(qh: torch.Tensor, kh: torch.Tensor, block_size: int, query_stride: int) -> None:
    if qh.shape != kh.shape:
        raise ValueError(f"q and k must have equal [B, H, N, D] shapes (self-attention), got {qh.shape}, {kh.shape}")
    if block_size < 1 or query_stride < 1 or block_size % query_stride:
        raise ValueError(f"need block_size >= 1 and query_stride dividing it, got {block_size}, {query_stride}")


def block_mass_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    heads: Optional[int] = None,
    block_size: int = 128,
    scale: Optional[float] = None,
    query_stride: int = 1,
) -> torch.Tensor:
    """Pure-torch block attention mass. q, k ``[B, H, N, D]`` or ``[B, N, H*D]`` -> ``[B, H, nb, nb]``.

    With ``query_stride`` s > 1, each query block's mass is the mean over its queries
    0, s, 2s, ... only (an estimate at 1/s of the cost). Computes in float32 (float64 for
    float64 inputs); returns that dtype.
    """
    qh, kh = to_bhnd(q, heads), to_bhnd(k, heads)
    _check_qk(qh, kh, block_size, query_stride)
    b, h, n, d = qh.shape
    cdt = torch.promote_types(q.dtype, torch.float32)
    scale = d**-0.5 if scale is None else scale
    nb = math.ceil(n / block_size)
    sampled = block_size // query_stride  # sampled queries of a full block
    counts = block_row_counts(n, block_size, q.device).add(query_stride - 1).div(query_stride, rounding_mode="floor")
    counts = counts.to(cdt)
    mass = torch.empty(b, h, nb, nb, dtype=cdt, device=q.device)
    heads_per_chunk = min(h, max(1, _REF_SCORE_BUDGET // (b * block_size * n)))
    blocks_per_chunk = max(1, _REF_SCORE_BUDGET // (b * heads_per_chunk * block_size * n))
    kpad = nb * block_size - n
    for h0 in range(0, h, heads_per_chunk):
        hs = slice(h0, min(h, h0 + heads_per_chunk))
        kt = kh[:, hs].to(cdt).transpose(-1, -2)
        for i0 in range(0, nb, blocks_per_chunk):
            i1 = min(nb, i0 + blocks_per_chunk)
            rows = slice(i0 * block_size, min(n, i1 * block_size), query_stride)
            p = (qh[:, hs, rows].to(cdt) @ kt * scale).softmax(-1)  # [B, h, r, N]
            p = torch.nn.functional.pad(p, (0, kpad)).unflatten(-1, (nb, block_size)).sum(-1)  # [B, h, r, nb]
            rpad = (i1 - i0) * sampled - p.shape[2]
            p = torch.nn.functional.pad(p, (0, 0, 0, rpad)).unflatten(2, (i1 - i0, sampled)).sum(3)
            mass[:, hs, i0:i1] = p / counts[i0:i1, None]
    return mass


def block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    heads: Optional[int] = None,
    block_size: int = 128,
    scale: Optional[float] = None,
    *,
    query_stride: int = 1,
    lse: Optional[torch.Tensor] = None,
    backend: str = "auto",
    config: Optional[dict] = None,
) -> torch.Tensor:
    """Block attention mass ``[B, H, nb, nb]`` (float32) of q, k in ComfyUI's layouts.

    :param query_stride: estimate each block's mass from every ``query_stride``-th query only
        (1/stride of the cost; for recording, where a block's mean over 32 of 128 queries is
        plenty). 1 = exact.
    :param lse: optional natural-log row log-sum-exp of the scaled scores, ``[B, H, N]``
        (what flash/cuDNN attention can return); the Triton path then skips its first pass.
    :param backend: ``"auto"`` (Triton on CUDA tensors when available, else the reference),
        ``"triton"`` (also CPU tensors under ``TRITON_INTERPRET=1``) or ``"reference"``.
    :param config: Triton launch overrides (``num_warps``, ``num_stages``, ``lse_block_n``).
    """
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    use_triton = backend == "triton" or (backend == "auto" and q.is_cuda and triton_available())
    if not use_triton:
        return block_mass_reference(q, k, heads, block_size, scale, query_stride).float()
    if not triton_available():
        raise RuntimeError("backend='triton' needs the triton package (pip install triton)")
    qh, kh = to_bhnd(q, heads), to_bhnd(k, heads)
    _check_qk(qh, kh, block_size, query_stride)
    if block_size < 16 or block_size & (block_size - 1) or query_stride & (query_stride - 1):
        raise ValueError(
            f"the Triton path needs a power-of-two block_size >= 16 and a power-of-two query_stride, "
            f"got block_size={block_size}, query_stride={query_stride}"
        )
    scale = qh.shape[-1] ** -0.5 if scale is None else scale
    return _block_mass_triton(qh, kh, block_size, scale, query_stride, lse, config or {})


# --------------------------------------------------------------------------------------------
# Triton
# --------------------------------------------------------------------------------------------


def _block_mass_triton(qh, kh, block_size, scale, stride, lse, config) -> torch.Tensor:
    """q, k ``[B, H, N, D]`` views -> mass ``[B, H, nb, nb]`` float32 (see module docstring)."""
    kern = _kernels()
    b, h, n, d = qh.shape
    nb = math.ceil(n / block_size)
    block_d = max(16, 1 << (d - 1).bit_length())
    # The interpreter's tl.dot is wrong for bf16/fp16 operands: upcast there (CPU tests only).
    upcast = triton_interpreting() or qh.dtype == torch.float32
    # A tile is always block_size query rows: with stride s, every s-th row of s query blocks,
    # so sampling cuts the work without shrinking the matrix-unit tiles.
    tiles = math.ceil(nb / stride)
    qk_scale = scale * _LOG2E  # the kernels work in base 2 (exp2 is the fast instruction)
    warps = config.get("num_warps", 8 if block_size >= 128 else 4)
    stages = config.get("num_stages", 2)
    strides = (*qh.stride(), *kh.stride())
    if lse is None:
        lse2 = torch.empty(b * h, n, dtype=torch.float32, device=qh.device)
        block_n = config.get("lse_block_n", min(block_size, 128))
        kern.row_lse[(tiles, b * h)](
            qh, kh, lse2, *strides, h, n, d, qk_scale,
            BLOCK=block_size, STRIDE=stride, BLOCK_N=block_n, BLOCK_D=block_d, UPCAST=upcast,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    else:
        if tuple(lse.shape) != (b, h, n):
            raise ValueError(f"lse must be [B, H, N] = {(b, h, n)}, got {tuple(lse.shape)}")
        lse2 = (lse.float() * _LOG2E).reshape(b * h, n).contiguous()
    # NaN-poisoned: a tile the kernel failed to write shows up in every check.
    mass = torch.full((b, h, nb, nb), float("nan"), dtype=torch.float32, device=qh.device)
    kern.block_mass[(tiles, b * h)](
        qh, kh, lse2, mass, *strides, h, n, d, nb, qk_scale,
        BLOCK=block_size, STRIDE=stride, BLOCK_D=block_d, UPCAST=upcast, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return mass



def _kernels():
    if triton is None:
        raise RuntimeError("the Triton block-mass kernel needs the triton package (pip install triton)")
    return _KERNELS


if triton is not None:

    @triton.jit
    def _sampled_rows(pid_m, BLOCK: tl.constexpr, STRIDE: tl.constexpr):
        """A tile of BLOCK query rows: every STRIDE-th row of STRIDE consecutive query blocks."""
        r = tl.arange(0, BLOCK)
        rows_per_block: tl.constexpr = BLOCK // STRIDE
        return (pid_m * STRIDE + r // rows_per_block) * BLOCK + (r % rows_per_block) * STRIDE

    @triton.jit
    def _load_q(Q, b, h, rows, dims, sqb, sqh, sqn, sqd, N, D, UPCAST: tl.constexpr):
        ptr = Q + b * sqb + h * sqh + rows[:, None].to(tl.int64) * sqn + dims[None, :] * sqd
        q = tl.load(ptr, mask=(rows[:, None] < N) & (dims[None, :] < D), other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        return q

    @triton.jit
    def _scores(q, K, b, h, cols, dims, skb, skh, skn, skd, N, D, qk_scale, UPCAST: tl.constexpr):
        """Scaled scores of a q tile against the key tile ``cols`` (K loaded as ``[BLOCK_D, BLOCK_N]``)."""
        ptr = K + b * skb + h * skh + cols[None, :].to(tl.int64) * skn + dims[:, None] * skd
        kt = tl.load(ptr, mask=(cols[None, :] < N) & (dims[:, None] < D), other=0.0)
        if UPCAST:  # fp32 math: ask for exact fp32 dots, not tf32
            s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        return s * qk_scale

    @triton.jit
    def _row_lse_kernel(
        Q, K, LSE2, sqb, sqh, sqn, sqd, skb, skh, skn, skd, H, N, D, qk_scale,
        BLOCK: tl.constexpr, STRIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        UPCAST: tl.constexpr,
    ):  # fmt: skip
        """Pass 1: base-2 log-sum-exp of each sampled query row, online over key tiles."""
        pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
        b, h = (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)
        rows = _sampled_rows(pid_m, BLOCK, STRIDE)
        dims = tl.arange(0, BLOCK_D)
        q = _load_q(Q, b, h, rows, dims, sqb, sqh, sqn, sqd, N, D, UPCAST)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK], tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            s = _scores(q, K, b, h, cols, dims, skb, skh, skn, skd, N, D, qk_scale, UPCAST)
            s = tl.where(cols[None, :] < N, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            l = l * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
            m = m_new
        tl.store(LSE2 + pid_bh.to(tl.int64) * N + rows, m + tl.log2(l), mask=rows < N)

    @triton.jit
    def _block_mass_kernel(
        Q, K, LSE2, MASS, sqb, sqh, sqn, sqd, skb, skh, skn, skd, H, N, D, NB, qk_scale,
        BLOCK: tl.constexpr, STRIDE: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        """Pass 2: STRIDE query blocks (BLOCK sampled rows) against every key block, one tile each."""
        pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
        b, h = (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)
        rows = _sampled_rows(pid_m, BLOCK, STRIDE)
        dims = tl.arange(0, BLOCK_D)
        q = _load_q(Q, b, h, rows, dims, sqb, sqh, sqn, sqd, N, D, UPCAST)
        # Rows past N get lse = +inf, so their probabilities are exp2(-inf) = 0.
        lse2 = tl.load(LSE2 + pid_bh.to(tl.int64) * N + rows, mask=rows < N, other=float("inf"))
        qblocks = pid_m * STRIDE + tl.arange(0, STRIDE)  # the query blocks of this tile
        n_rows = (tl.minimum(N - qblocks * BLOCK, BLOCK) + STRIDE - 1) // STRIDE  # their sampled rows < N
        inv_rows = 1.0 / tl.maximum(n_rows, 1).to(tl.float32)
        out = MASS + (pid_bh.to(tl.int64) * NB + qblocks) * NB
        for j in range(0, NB):
            cols = j * BLOCK + tl.arange(0, BLOCK)
            s = _scores(q, K, b, h, cols, dims, skb, skh, skn, skd, N, D, qk_scale, UPCAST)
            p = tl.where(cols[None, :] < N, tl.exp2(s - lse2[:, None]), 0.0)
            per_block = tl.sum(tl.reshape(tl.sum(p, 1), [STRIDE, BLOCK // STRIDE]), 1)  # [STRIDE]
            tl.store(out + j, per_block * inv_rows, mask=qblocks < NB)

    class _KERNELS:  # noqa: N801  (a namespace)
        row_lse = _row_lse_kernel
        block_mass = _block_mass_kernel
