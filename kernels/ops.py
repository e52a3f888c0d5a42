"""``chorus::block_sparse_attention`` and ``chorus::dense_attention`` as ``torch.library`` custom ops.

``torch.compile`` sees one opaque op with a fake (meta) implementation instead of Python-side
dispatch (backend probes, mask objects, launch-order caches), so a compiled Wan block keeps
one graph. The mask travels as its two int32 tensors plus ints; the backend is chosen when
the op runs, exactly as in eager (``block_sparse.select_backend``), and recorded in
``block_sparse.last_backend_choice()``.

This module imports only torch; the implementation imports ``block_sparse`` when it runs.
"""

from __future__ import annotations

import torch

__all__ = ["block_sparse_attention_op", "dense_attention_op", "OP_NAME", "DENSE_OP_NAME"]

OP_NAME = "chorus::block_sparse_attention"
DENSE_OP_NAME = "chorus::dense_attention"


def _output_shape(q: torch.Tensor, heads: int, skip_reshape: bool, skip_output_reshape: bool):
    if skip_reshape:
        b, h, n, d = q.shape
    else:
        b, n, hd = q.shape
        h, d = heads, hd // heads
    return (b, h, n, d) if skip_output_reshape else (b, n, h * d)


def _impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, live_blocks: torch.Tensor, live_counts: torch.Tensor,
    block_q: int, block_k: int, seq_len: int, heads: int, skip_reshape: bool, skip_output_reshape: bool,
    backend: str,
) -> torch.Tensor:
    from . import block_sparse as bs

    mask = bs.BlockSparseMask(live_blocks, live_counts, block_q, block_k, seq_len)
    choice = bs.select_backend(q, mask, backend)
    # Compiled graphs may hand over non-contiguous views; the kernels need a unit stride on D.
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return bs.run_backend(choice, q, k, v, mask, heads, skip_reshape, skip_output_reshape, validate=False)


def _fake(q, k, v, live_blocks, live_counts, block_q, block_k, seq_len, heads, skip_reshape, skip_output_reshape,
          backend):
    return q.new_empty(_output_shape(q, heads, skip_reshape, skip_output_reshape))


def _dense_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, skip_reshape: bool,
                skip_output_reshape: bool) -> torch.Tensor:
    from . import dense_attention as da

    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return da.run_dense(q, k, v, heads, skip_reshape, skip_output_reshape)


def _dense_fake(q, k, v, heads, skip_reshape, skip_output_reshape):
    return q.new_empty(_output_shape(q, heads, skip_reshape, skip_output_reshape))


def _define(qualified_name: str, impl, fake):
    """Register an op once per process (a second copy of this package reuses it)."""
    namespace, name = qualified_name.split("::")
    if getattr(getattr(torch.ops, namespace), name, None) is None:
        try:
            op = torch.library.custom_op(qualified_name, mutates_args=())(impl)
        except RuntimeError:  # registered meanwhile under another import name of this package
            return getattr(getattr(torch.ops, namespace), name).default
        op.register_fake(fake)
    return getattr(getattr(torch.ops, namespace), name).default


block_sparse_attention_op = _define(OP_NAME, _impl, _fake)
dense_attention_op = _define(DENSE_OP_NAME, _dense_impl, _dense_fake)
