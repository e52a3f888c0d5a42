"""``chorus::block_sparse_attention`` and ``chorus::dense_attention`` as ``torch.library`` custom ops.

``torch.compile`` sees one opaque op with a fake (meta) implementation instead of Python-side
dispatch (backend probes, mask objects, launch-order caches), so a compiled Wan block keeps
one graph. The mask travels as its two int32 tensors plus ints; the backend is chosen when
the op runs, exactly as in eager (``block_sparse.select_backend``), and recorded in
``block_sparse.last_backend_choice()``.

This module holds what the compiler sees of the two ops (their names and fake implementations)
and registers them; it imports only torch. The real implementations live with the eager code
they run: ``block_sparse`` and ``dense_attention`` call ``define_block_sparse_op`` and
``define_dense_op`` with them when they are imported (they import this module, never the
other way round).
"""

from __future__ import annotations

import torch

__all__ = ["define_block_sparse_op", "define_fp8_block_sparse_op", "define_int8_block_sparse_op", "define_dense_op",
           "OP_NAME", "FP8_OP_NAME", "INT8_OP_NAME", "DENSE_OP_NAME"]

OP_NAME = "chorus::block_sparse_attention"
FP8_OP_NAME = "chorus::fp8_block_sparse_attention"  # attention_precision "fp8": same schema, own dispatch
INT8_OP_NAME = "chorus::int8_block_sparse_attention"  # attention_precision "int8": the same again
DENSE_OP_NAME = "chorus::dense_attention"


def _output_shape(q: torch.Tensor, heads: int, skip_reshape: bool, skip_output_reshape: bool):
    if skip_reshape:
        b, h, n, d = q.shape
    else:
        b, n, hd = q.shape
        h, d = heads, hd // heads
    return (b, h, n, d) if skip_output_reshape else (b, n, h * d)


def _fake(q, k, v, live_blocks, live_counts, block_q, block_k, seq_len, heads, skip_reshape, skip_output_reshape,
          backend):
    return q.new_empty(_output_shape(q, heads, skip_reshape, skip_output_reshape))


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


def define_block_sparse_op(impl):
    """``chorus::block_sparse_attention`` with ``impl`` as its implementation (the first one registered
    in this process wins). ``impl`` takes ``(q, k, v, live_blocks, live_counts, block_q, block_k,
    seq_len, heads, skip_reshape, skip_output_reshape, backend)``, annotated, and returns the output."""
    return _define(OP_NAME, impl, _fake)


def define_fp8_block_sparse_op(impl):
    """``chorus::fp8_block_sparse_attention``, the FP8 dispatch of ``fp8_block_sparse``: the schema of
    ``define_block_sparse_op``'s op."""
    return _define(FP8_OP_NAME, impl, _fake)


def define_int8_block_sparse_op(impl):
    """``chorus::int8_block_sparse_attention``, the int8 scheme's dispatch (QK^T alone quantised): the
    schema of ``define_block_sparse_op``'s op."""
    return _define(INT8_OP_NAME, impl, _fake)


def define_dense_op(impl):
    """``chorus::dense_attention`` with ``impl`` as its implementation (the first one registered in this
    process wins). ``impl`` takes ``(q, k, v, heads, skip_reshape, skip_output_reshape)``, annotated."""
    return _define(DENSE_OP_NAME, impl, _dense_fake)
