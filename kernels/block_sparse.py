"""Block-sparse attention: mask object, converters, pure-torch reference and dispatch.

Block-sparse flash attention (FlashAttention-2 over the live key blocks of each query block,
as in SpargeAttn / Sparse VideoGen). Layouts follow ComfyUI's ``optimized_attention``:
``q, k, v`` are ``[B, N, H*D]`` (``heads=H``), or ``[B, H, N, D]`` with ``skip_reshape=True``;
the output is ``[B, N, H*D]``, or ``[B, H, N, D]`` with ``skip_output_reshape=True``.

Backends (``select_backend`` picks one and says why): FlashAttention-4's block-sparse
forward (``fa4_block_sparse``) on sm_90/sm_100 when ``flash-attn-4`` imports and the call fits
it, else the Triton kernel (``triton_block_sparse``) on CUDA tensors when triton imports, else
the pure-torch reference (always on CPU tensors). Importing this module needs neither triton
nor flash-attn-4. Under ``torch.compile`` the call goes through the ``chorus::block_sparse_attention``
custom op, so it never breaks the graph: this module registers its eager dispatch as the op's
implementation through ``kernels.ops`` (which holds the op's name and fake implementation).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from . import fa4_block_sparse as fa4
from .layouts import from_bhnd, output_views, to_bhnd
from .ops import define_block_sparse_op

__all__ = [
    "BlockSparseMask",
    "block_map_to_mask",
    "live_lists_to_mask",
    "mask_to_block_map",
    "block_map_to_element_mask",
    "block_sparse_attention",
    "block_sparse_attention_reference",
    "query_blocks",
    "check_inputs",
    "record_backend_choice",
    "triton_available",
    "triton_interpreting",
    "BackendChoice",
    "BACKENDS",
    "select_backend",
    "last_backend_choice",
]

BACKENDS = ("fa4", "triton", "reference")
BACKEND_ENV = "CHORUS_BLOCK_SPARSE_BACKEND"  # forces what backend="auto" picks (A/B runs)

_triton_ok: list = []  # one entry once probed: a plain module cache, not functools (see below)


def triton_interpreting() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1: the CPU tests), where the kernels
    work around its arithmetic faults (bf16 dots, e4m3 casts)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    """True when triton imports (the kernel still needs CUDA tensors, or TRITON_INTERPRET=1).

    Cached in a module list rather than ``functools.lru_cache``: compiled code never calls it
    (dispatch runs inside the custom op), and a plain cache stays traceable if it ever is.
    """
    if not _triton_ok:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
        except Exception:  # ImportError, or a broken install: fall back to the reference
            _triton_ok.append(False)
        else:
            _triton_ok.append(True)
    return _triton_ok[0]


# --------------------------------------------------------------------------------------------
# The mask
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockSparseMask:
    """Live key blocks of each query block, per (batch element, head).

    ``live_blocks[b, h, r, :live_counts[b, h, r]]`` are the key-block ids that query block
    ``r`` attends to, ascending (the kernel relies on the ragged last key block coming last);
    entries past the count are padding and never read. A batch size of 1 is broadcast over
    the batch of ``q``.
    """

    live_blocks: torch.Tensor  # int32 [B, H, n_q_blocks, max_live]
    live_counts: torch.Tensor  # int32 [B, H, n_q_blocks]
    block_q: int
    block_k: int
    seq_len: int

    @property
    def batch_size(self) -> int:
        return self.live_blocks.shape[0]

    @property
    def heads(self) -> int:
        return self.live_blocks.shape[1]

    @property
    def n_q_blocks(self) -> int:
        return math.ceil(self.seq_len / self.block_q)

    @property
    def n_k_blocks(self) -> int:
        return math.ceil(self.seq_len / self.block_k)

    @property
    def device(self) -> torch.device:
        return self.live_blocks.device

    @functools.cached_property
    def density(self) -> float:
        """Share of (query block, key block) pairs kept; one host sync, cached."""
        total = self.live_counts.numel() * self.n_k_blocks
        return float(self.live_counts.sum().item()) / total

    def to(self, device) -> "BlockSparseMask":
        return BlockSparseMask(
            self.live_blocks.to(device), self.live_counts.to(device), self.block_q, self.block_k, self.seq_len
        )

    @functools.cached_property
    def _validated(self) -> bool:
        # Runs once per mask object (masks are reused for many layers and steps), so the
        # host syncs it costs are not paid per attention call.
        _validate_mask(self)
        return True

    def assume_valid(self) -> "BlockSparseMask":
        """Skip :meth:`validate` for this mask: for masks valid by construction (a bank entry's
        live-block lists, checked on the host before upload), whose check would cost host syncs."""
        self.__dict__["_validated"] = True  # pre-fills the cached property
        return self

    def validate(self) -> None:
        """Raise ValueError if the mask is malformed (empty query block, bad ids, unsorted)."""
        self._validated  # noqa: B018  (the cached property raises; evaluated once per mask)


def _validate_mask(mask: BlockSparseMask) -> None:
    lb, lc = mask.live_blocks, mask.live_counts
    if lb.dim() != 4 or lc.dim() != 3 or lb.shape[:3] != lc.shape:
        raise ValueError(
            f"BlockSparseMask wants live_blocks [B, H, nq, max_live] and live_counts [B, H, nq]; "
            f"got {tuple(lb.shape)} and {tuple(lc.shape)}"
        )
    if lb.dtype != torch.int32 or lc.dtype != torch.int32:
        raise ValueError(f"BlockSparseMask tensors must be int32, got {lb.dtype} and {lc.dtype}")
    if lc.shape[2] != mask.n_q_blocks:
        raise ValueError(
            f"mask has {lc.shape[2]} query blocks but seq_len={mask.seq_len} with block_q={mask.block_q} "
            f"needs {mask.n_q_blocks}"
        )
    if lb.device != lc.device:
        raise ValueError(f"live_blocks on {lb.device} but live_counts on {lc.device}")
    empty = (lc <= 0).nonzero()
    if len(empty):
        b, h, r = (int(x) for x in empty[0])
        raise ValueError(
            f"block-sparse mask has {len(empty)} query block(s) with no live key block, first at "
            f"batch {b}, head {h}, query block {r}: every query block needs at least one live key "
            f"block (keep the diagonal block, or fall back to dense attention)"
        )
    if int(lc.max()) > lb.shape[3]:
        raise ValueError(f"live_counts exceed max_live={lb.shape[3]}")
    valid = torch.arange(lb.shape[3], device=lb.device) < lc[..., None]
    ids = lb.masked_fill(~valid, 0)
    if bool(((ids < 0) | (ids >= mask.n_k_blocks)).any()):
        raise ValueError(f"live key-block ids must lie in [0, {mask.n_k_blocks})")
    rising = ids[..., 1:] > ids[..., :-1]
    if not bool((rising | ~valid[..., 1:]).all()):
        raise ValueError("live key-block ids must be strictly ascending in each row (see block_map_to_mask)")


# --------------------------------------------------------------------------------------------
# Converters
# --------------------------------------------------------------------------------------------


def block_map_to_mask(block_map: torch.Tensor, block_q: int, block_k: int, seq_len: int) -> BlockSparseMask:
    """bool ``[B, H, nq, nk]`` block map -> ``BlockSparseMask`` (ascending ids, padded with 0).

    Whole-tensor ops and one host sync (for the row counts' min, max and sum), so it is cheap per
    layer on the GPU. The mask comes back with its density known and, when no row is empty,
    already validated (ids from the sort are ascending and in range by construction); a mask
    with an empty row is left for :meth:`BlockSparseMask.validate` to reject with details.
    """
    nq, nk = math.ceil(seq_len / block_q), math.ceil(seq_len / block_k)
    if block_map.dim() != 4 or tuple(block_map.shape[2:]) != (nq, nk):
        raise ValueError(
            f"block_map must be [B, H, {nq}, {nk}] for seq_len={seq_len}, blocks {block_q}x{block_k}; "
            f"got {tuple(block_map.shape)}"
        )
    live = block_map.bool()
    counts = live.sum(-1, dtype=torch.int32)
    fewest, most, kept = (torch.stack([counts.min(), counts.max(), counts.sum(dtype=torch.int32)]).tolist()
                          if counts.numel() else (0, 0, 0))
    mask = live_lists_to_mask(live, counts, most, block_q, block_k, seq_len)
    mask.__dict__["density"] = kept / max(1, counts.numel() * nk)  # pre-fills the cached property
    return mask.assume_valid() if fewest > 0 else mask


def live_lists_to_mask(live: torch.Tensor, counts: torch.Tensor, most: int, block_q: int, block_k: int,
                       seq_len: int) -> BlockSparseMask:
    """bool ``[B, H, nq, nk]`` with its row counts (int32 ``[B, H, nq]``) and their known maximum
    -> ``BlockSparseMask``, with no host sync: whole-tensor ops queued on the map's device. Not
    validated: the caller knows whether a row can be empty."""
    max_live = max(1, int(most))
    # A stable sort of "not live" puts the live ids first, in ascending order.
    order = torch.sort((~live).to(torch.uint8), dim=-1, stable=True).indices[..., :max_live]
    valid = torch.arange(max_live, device=live.device) < counts[..., None]
    ids = order.masked_fill(~valid, 0).to(torch.int32).contiguous()
    return BlockSparseMask(ids, counts.contiguous(), int(block_q), int(block_k), int(seq_len))


def mask_to_block_map(mask: BlockSparseMask) -> torch.Tensor:
    """``BlockSparseMask`` -> bool ``[B, H, nq, nk]``."""
    lb, lc = mask.live_blocks, mask.live_counts
    valid = torch.arange(lb.shape[-1], device=lb.device) < lc[..., None]
    hits = torch.zeros(*lc.shape, mask.n_k_blocks, dtype=torch.int32, device=lb.device)
    # scatter_add, not scatter: padding entries (index 0, value 0) must not clear a live block 0.
    hits.scatter_add_(-1, lb.long().clamp(0, mask.n_k_blocks - 1), valid.to(torch.int32))
    return hits > 0


def block_map_to_element_mask(block_map: torch.Tensor, block_q: int, block_k: int, seq_len: int) -> torch.Tensor:
    """bool ``[B, H, nq, nk]`` -> bool ``[B, H, N, N]`` (True = attend). For tests and small N."""
    rows = block_map.bool().repeat_interleave(block_q, dim=2)[:, :, :seq_len]
    return rows.repeat_interleave(block_k, dim=3)[..., :seq_len]


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def check_inputs(q, k, v, mask: BlockSparseMask, validate: bool = True) -> None:
    """q, k, v as [B, H, N, D] views against the mask; raises ValueError on any mismatch.

    ``validate=False`` skips the mask's content check (host syncs): the custom op path,
    whose masks come from ``block_map_to_mask``.
    """
    if q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must have equal shapes (self-attention), got {q.shape}, {k.shape}, {v.shape}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    b, h, n, _ = q.shape
    if mask.seq_len != n:
        raise ValueError(f"mask was made for seq_len={mask.seq_len}, inputs have N={n}")
    if mask.heads != h:
        raise ValueError(f"mask has {mask.heads} heads, inputs have {h}")
    if mask.batch_size not in (1, b):
        raise ValueError(f"mask batch {mask.batch_size} must be 1 or the input batch {b}")
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device} but q is on {q.device}: move it once with mask.to(device)")
    if validate:
        mask.validate()


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------

_REF_SCORE_BUDGET = 1 << 26  # floats in one scores chunk (256 MB fp32): keeps the fallback memory-sane


def query_blocks(mask: BlockSparseMask, batch: int, n: int):
    """Per query block: (its rows as a slice of the N tokens, bool ``[B, H, N]`` of the keys it attends)."""
    block_map = mask_to_block_map(mask).expand(batch, -1, -1, -1)  # [B, H, nq, nk]
    for r in range(mask.n_q_blocks):
        rows = slice(r * mask.block_q, min(n, (r + 1) * mask.block_q))
        yield rows, block_map[:, :, r].repeat_interleave(mask.block_k, dim=-1)[..., :n]


def block_sparse_attention_reference(
    q, k, v, mask: BlockSparseMask, heads: int, skip_reshape=False, skip_output_reshape=False, *, validate=True
) -> torch.Tensor:
    """Pure-torch block-sparse attention: the test oracle and the CPU fallback.

    Loops over query blocks and head chunks, scoring a query block against all keys with the
    block map expanded to columns; computes in float32 (float64 for float64 inputs).
    """
    qh, kh, vh = (to_bhnd(x, heads, skip_reshape) for x in (q, k, v))
    check_inputs(qh, kh, vh, mask, validate)
    b, h, n, d = qh.shape
    cdt = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty(b, h, n, d, dtype=q.dtype, device=q.device)
    scale = d**-0.5
    chunk = max(1, _REF_SCORE_BUDGET // max(1, b * mask.block_q * n))
    for rows, cols in query_blocks(mask, b, n):
        for h0 in range(0, h, chunk):
            hs = slice(h0, min(h, h0 + chunk))
            s = qh[:, hs, rows].to(cdt) @ kh[:, hs].to(cdt).transpose(-1, -2) * scale
            s = s.masked_fill(~cols[:, hs, None, :], float("-inf"))
            out[:, hs, rows] = (s.softmax(-1) @ vh[:, hs].to(cdt)).to(q.dtype)
    return from_bhnd(out, skip_output_reshape)


# --------------------------------------------------------------------------------------------
# Backend selection
# --------------------------------------------------------------------------------------------


class BackendChoice(NamedTuple):
    """The backend a call runs on and why (``name, reason = choice`` also works)."""

    name: str  # "fa4", "triton" or "reference"
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


_last_choice: list = []  # the latest dispatch's BackendChoice, for run reports


def record_backend_choice(choice: BackendChoice) -> None:
    """Note ``choice`` as the latest block-sparse call's (the FP8 dispatch in ``fp8_block_sparse`` does too)."""
    _last_choice[:] = [choice]


def last_backend_choice() -> Optional[BackendChoice]:
    """The ``BackendChoice`` of the most recent block-sparse call in this process (or None)."""
    return _last_choice[-1] if _last_choice else None


def _head_dim_view(q: torch.Tensor, mask: BlockSparseMask) -> torch.Tensor:
    """A ``[B, H, N, D]`` view of q in either ComfyUI layout (4D = already heads-first)."""
    return q if q.dim() == 4 else to_bhnd(q, mask.heads, False)


def select_backend(q: torch.Tensor, mask: BlockSparseMask, backend: str = "auto") -> BackendChoice:
    """Which backend ``block_sparse_attention(q, ..., mask, backend=backend)`` runs, and why.

    ``q`` in either ComfyUI layout. ``"auto"``: FA4 where it applies (sm_90/sm_100, bf16/fp16,
    head_dim 128, 128-row blocks on sm_90), else Triton on CUDA, else the reference; the
    ``CHORUS_BLOCK_SPARSE_BACKEND`` environment variable forces one. An explicit backend that
    cannot run raises RuntimeError with the reason. Cheap: probes are cached per process.
    """
    if backend == "auto":
        forced = os.environ.get(BACKEND_ENV, "").strip()
        if forced and forced != "auto":
            name, why = _explicit(q, mask, forced)
            return BackendChoice(name, f"{BACKEND_ENV}={forced}; {why}")
        return _auto(q, mask)
    name, why = _explicit(q, mask, backend)
    return BackendChoice(name, why)


def _auto(q: torch.Tensor, mask: BlockSparseMask) -> BackendChoice:
    if not q.is_cuda:
        return BackendChoice("reference", "CPU tensors: the pure-torch reference")
    not_fa4 = fa4.fa4_unsupported_reason(_head_dim_view(q, mask), mask.block_q, mask.block_k)
    if not_fa4 is None:
        return BackendChoice("fa4", f"FlashAttention-4 block-sparse forward ({_gpu_name(q)}, {q.dtype})")
    if triton_available():
        return BackendChoice("triton", f"Triton kernel; FA4 not used: {not_fa4}")
    return BackendChoice("reference", f"pure-torch reference (triton is not installed); FA4 not used: {not_fa4}")


def _explicit(q: torch.Tensor, mask: BlockSparseMask, backend: str):
    if backend == "reference":
        return "reference", "requested: the pure-torch reference"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' needs the triton package (pip install triton)")
        return "triton", "requested: the Triton kernel"
    if backend == "fa4":
        not_fa4 = fa4.fa4_unsupported_reason(_head_dim_view(q, mask), mask.block_q, mask.block_k)
        if not_fa4 is not None:
            raise RuntimeError(f"backend='fa4' cannot run this call: {not_fa4}")
        return "fa4", "requested: FlashAttention-4 block-sparse forward"
    raise ValueError(f"backend must be 'auto', 'fa4', 'triton' or 'reference', got {backend!r}")


def gpu_kernel_available() -> bool:
    """True when some block-sparse GPU kernel can run here (Triton, or FlashAttention-4)."""
    return triton_available() or fa4.fa4_import_error() is None


def _gpu_name(q: torch.Tensor) -> str:
    major, minor = fa4.device_capability(q.device)
    return f"sm_{major}{minor}"


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


def block_sparse_attention(
    q,
    k,
    v,
    mask: BlockSparseMask,
    heads: int,
    skip_reshape=False,
    skip_output_reshape=False,
    *,
    out: Optional[torch.Tensor] = None,
    backend: str = "auto",
    config: Optional[dict] = None,
) -> torch.Tensor:
    """Block-sparse attention in ComfyUI's layouts (see the module docstring).

    :param mask: live key blocks per (batch element, head, query block); batch 1 broadcasts.
    :param out: optional output buffer in the output layout (FA4 and Triton write into it).
    :param backend: ``"auto"`` (see ``select_backend``), ``"fa4"``, ``"triton"`` (also on CPU
        tensors under ``TRITON_INTERPRET=1``) or ``"reference"``.
    :param config: Triton tile overrides (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``,
        ``order``); for benchmarks.

    Under ``torch.compile`` this is one ``chorus::block_sparse_attention`` op in the graph
    (backend chosen when the op runs); the mask's content is then trusted, not re-validated.
    """
    if torch.compiler.is_compiling():
        res = block_sparse_attention_op(
            q, k, v, mask.live_blocks, mask.live_counts, mask.block_q, mask.block_k, mask.seq_len,
            heads, skip_reshape, skip_output_reshape, backend,
        )
        return res if out is None else out.copy_(res)
    choice = select_backend(q, mask, backend)
    return run_backend(choice, q, k, v, mask, heads, skip_reshape, skip_output_reshape, out=out, config=config)


def run_backend(
    choice: BackendChoice, q, k, v, mask: BlockSparseMask, heads: int, skip_reshape=False,
    skip_output_reshape=False, *, out=None, config=None, validate=True,
) -> torch.Tensor:
    """Run the chosen backend (eager; the custom op's implementation calls this too)."""
    record_backend_choice(choice)
    if choice.name == "reference":
        res = block_sparse_attention_reference(
            q, k, v, mask, heads, skip_reshape, skip_output_reshape, validate=validate
        )
        return res if out is None else out.copy_(res)
    qh, kh, vh = (to_bhnd(x, heads, skip_reshape) for x in (q, k, v))
    check_inputs(qh, kh, vh, mask, validate)
    out, oh = output_views(qh, out, heads, skip_output_reshape)
    if choice.name == "fa4":
        fa4.fa4_block_sparse_fwd(qh, kh, vh, oh, mask.live_blocks, mask.live_counts, mask.block_q, mask.block_k)
        return out
    from . import triton_block_sparse as tbs

    tbs.block_sparse_attn_fwd(qh, kh, vh, oh, mask, config)
    return out


# --------------------------------------------------------------------------------------------
# The custom op (what ``torch.compile`` sees; see ``kernels.ops``)
# --------------------------------------------------------------------------------------------


def _op_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, live_blocks: torch.Tensor, live_counts: torch.Tensor,
    block_q: int, block_k: int, seq_len: int, heads: int, skip_reshape: bool, skip_output_reshape: bool,
    backend: str,
) -> torch.Tensor:
    mask = BlockSparseMask(live_blocks, live_counts, block_q, block_k, seq_len)
    choice = select_backend(q, mask, backend)
    # Compiled graphs may hand over non-contiguous views; the kernels need a unit stride on D.
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return run_backend(choice, q, k, v, mask, heads, skip_reshape, skip_output_reshape, validate=False)


block_sparse_attention_op = define_block_sparse_op(_op_impl)
