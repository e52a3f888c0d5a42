"""FlashAttention-4 (``flash-attn-4``, CuTe DSL) as a block-sparse backend, when installed,
and its dense forward for the self-attention Chorus leaves dense (``fa4_dense_fwd``).

FA4's forward takes block sparsity as per-(batch, head, query block) lists of key blocks:
"full" blocks are attended without any mask, "mask" blocks through a mask function. Chorus
blocks are all-or-nothing, so the live blocks go in as full blocks and the mask lists are
empty. FA4 walks each list from its last entry and applies the sequence-length mask to the
first block it processes; the mask's ids ascend, so that block is the ragged last key block
whenever it is live, which is what makes ragged N exact without padding.

Layouts: FA4 wants ``[B, N, H, D]`` with a unit stride on D; ComfyUI's ``[B, N, H*D]`` is that
shape as a view, and ``[B, H, N, D]`` is its transpose, so neither input nor output is copied.

This module imports nothing from ``flash_attn`` at import time: ``fa4_import_error()`` probes
once, lazily, and ``fa4_unsupported_reason()`` says why a call cannot take this path.
Compilation: the first call of each FA4 compile key (dtype, head_dim, which mask dims
broadcast, ...) JIT-compiles for a few seconds; the sequence length is not in FA4's key, so
ragged N and new resolutions reuse the compiled kernel (FA4 keeps the cache).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

FA4_BLOCK = 128  # FA4's sm_90 tile for head_dim 128; key blocks must equal it
FA4_HEAD_DIMS = (128,)  # the head_dim measured and tested (Wan 2.1: 128)
FA4_DTYPES = (torch.bfloat16, torch.float16)

_probe: dict = {}  # "error": None or the reason FA4 is unusable; filled on first use


def fa4_import_error() -> Optional[str]:
    """None when ``flash_attn.cute`` imports with block sparsity, else why not (cached)."""
    if "error" not in _probe:
        if os.environ.get("CHORUS_DISABLE_FA4") == "1":
            _probe["error"] = "CHORUS_DISABLE_FA4=1 is set"
        else:
            try:
                from flash_attn.cute import interface  # noqa: F401
                from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: F401
            except Exception as exc:  # ImportError, or a broken CUDA/cutlass install
                _probe["error"] = (
                    f"flash-attn-4 is not importable ({type(exc).__name__}: {str(exc)[:160]}); "
                    "install it with: pip install 'chorus-sparse-reuse[fa4]'"
                )
            else:
                _probe["error"] = None
    return _probe["error"]


def device_capability(device: torch.device) -> tuple:
    """(major, minor) of a CUDA device, cached per device index."""
    key = ("cc", device.index if device.index is not None else torch.cuda.current_device())
    if key not in _probe:
        _probe[key] = torch.cuda.get_device_capability(key[1])
    return _probe[key]


def fa4_dense_unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """Why FA4's dense forward cannot run calls like these, or None if it can (probes cached)."""
    if device.type != "cuda":
        return f"inputs are on the {device.type.upper()}"
    major, minor = device_capability(device)
    if major not in (9, 10):
        return f"FA4 is used on sm_90 and sm_100 only, this GPU is sm_{major}{minor}"
    if dtype not in FA4_DTYPES:
        return f"FA4 needs bf16 or fp16 inputs, got {dtype}"
    if head_dim not in FA4_HEAD_DIMS:
        return f"the FA4 path is used at head_dim 128, got {head_dim}"
    return fa4_import_error()


def fa4_unsupported_reason(q_bhnd: torch.Tensor, block_q: int, block_k: int) -> Optional[str]:
    """Why FA4 cannot run this call (``q`` as a ``[B, H, N, D]`` view), or None if it can.

    Cheap checks first, the import probe last, so a CPU or consumer-GPU call never imports FA4.
    """
    if not q_bhnd.is_cuda:
        return "inputs are on the CPU"
    major, minor = device_capability(q_bhnd.device)
    if major == 9 and minor == 0:
        if (block_q, block_k) != (FA4_BLOCK, FA4_BLOCK):
            return f"FA4 on sm_90 needs 128x128 mask blocks, this mask has {block_q}x{block_k}"
    elif major == 10:
        # sm_100 runs two 128-row query tiles per CTA (q_stage 2): a sparse query block must
        # cover both, and 128-row Chorus blocks would have to be merged, changing the mask.
        if block_q % (2 * FA4_BLOCK) or block_k % FA4_BLOCK:
            return (
                f"FA4 on sm_{major}{minor} needs query blocks of a multiple of 256 rows and key "
                f"blocks of a multiple of 128, this mask has {block_q}x{block_k}"
            )
    else:
        return f"FA4 block sparsity is used on sm_90 and sm_100 only, this GPU is sm_{major}{minor}"
    if q_bhnd.dtype not in FA4_DTYPES:
        return f"FA4 needs bf16 or fp16 inputs, got {q_bhnd.dtype}"
    if q_bhnd.shape[-1] not in FA4_HEAD_DIMS:
        return f"the FA4 path is used at head_dim 128, got {q_bhnd.shape[-1]}"
    return fa4_import_error()


_EMPTY_LISTS: dict = {}  # (shape, device) -> zero mask lists; a few shapes per process


def _empty_mask_lists(shape, device) -> tuple[torch.Tensor, torch.Tensor]:
    """No partially masked blocks: empty mask lists, made once per shape, not per attention call
    (FA4 requires them; a one-column index tensor is allowed, it reads only ``count`` entries)."""
    key = (tuple(shape), str(device))
    if key not in _EMPTY_LISTS:
        if len(_EMPTY_LISTS) >= 16:  # bounded: a new resolution must not grow memory forever
            _EMPTY_LISTS.clear()
        _EMPTY_LISTS[key] = (torch.zeros(shape, dtype=torch.int32, device=device),
                             torch.zeros((*shape, 1), dtype=torch.int32, device=device))
    return _EMPTY_LISTS[key]


def _sparse_tensors(live_blocks: torch.Tensor, live_counts: torch.Tensor, block_q: int, block_k: int):
    """Chorus live lists -> FA4's ``BlockSparseTensorsTorch`` (all live blocks as full blocks)."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    mask_cnt, mask_idx = _empty_mask_lists(live_counts.shape, live_counts.device)
    return BlockSparseTensorsTorch(
        mask_block_cnt=mask_cnt,
        mask_block_idx=mask_idx,
        full_block_cnt=live_counts.contiguous(),
        full_block_idx=live_blocks.contiguous(),
        block_size=(int(block_q), int(block_k)),  # explicit: ragged N makes it ambiguous
    )


def fa4_block_sparse_fwd(q, k, v, o, live_blocks, live_counts, block_q: int, block_k: int) -> torch.Tensor:
    """Block-sparse attention on ``[B, H, N, D]`` views into ``o`` (same shape, any strides).

    ``live_blocks``/``live_counts`` are the ``BlockSparseMask`` tensors (batch 1 broadcasts:
    FA4 expands it with a zero stride). Returns ``o``.
    """
    from flash_attn.cute import interface as fa4

    qn, kn, vn, on = (x.transpose(1, 2) for x in (q, k, v, o))  # [B, N, H, D] views
    sparse = _sparse_tensors(live_blocks, live_counts, block_q, block_k)
    fwd = getattr(fa4, "_flash_attn_fwd", None)
    if fwd is not None:  # writes into o, no autograd node
        fwd(qn, kn, vn, block_sparse_tensors=sparse, out=on)
    else:  # a later FA4 without the private entry point: the public one, one copy
        res = fa4.flash_attn_func(qn, kn, vn, block_sparse_tensors=sparse)
        on.copy_(res[0] if isinstance(res, tuple) else res)  # (out, lse) in 4.0.0b36
    return o


def fa4_dense_fwd(q, k, v, o) -> torch.Tensor:
    """Dense attention on ``[B, H, N, D]`` views into ``o`` (same shape, any strides); returns ``o``.

    Same numerics as the block-sparse path with every block live (bf16 in, fp32 softmax).
    """
    from flash_attn.cute import interface as fa4

    qn, kn, vn, on = (x.transpose(1, 2) for x in (q, k, v, o))  # [B, N, H, D] views
    fwd = getattr(fa4, "_flash_attn_fwd", None)
    if fwd is not None:
        fwd(qn, kn, vn, out=on)
    else:
        res = fa4.flash_attn_func(qn, kn, vn)
        on.copy_(res[0] if isinstance(res, tuple) else res)
    return o
