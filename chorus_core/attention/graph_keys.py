"""A name that tells a compiled diffusion model's graphs apart by what Chorus's override does.

A compiled model call reads its masks and kernels from ``transformer_options``. ComfyUI's own
TorchCompileModel node (0.19.3 here; not 0.3.64) compiles with a guard filter that drops every guard
whose source is under ``transformer_options``, so that per-step patches do not recompile. Then
dynamo cannot tell a Chorus call from a plain one: a model compiled and run without Chorus first
reuses that dense graph for a later hit (which then runs dense while reporting a hit), and one
plan's layer pattern or sequence length would be replayed for another.

So each planned call passes one extra keyword argument to the diffusion model, whose *name*
carries a digest of everything the traced override branches on. Wan's ``forward`` and
``forward_orig`` take ``**kwargs`` and ignore it; dynamo guards on the keys of ``**kwargs`` (a
source the filter keeps), so a call with another digest, or with none, gets its own graph, and
calls with the same digest share one whatever their mask values (tensors are read afresh).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Optional

from ..names import callable_name

GRAPH_KWARG_PREFIX = "chorus_graph_"
OVERRIDE_OPTION = "optimized_attention_override"


def graph_kwarg(plan, options: dict, declared: Optional[tuple]) -> str:
    """The keyword argument's name for a model call under ``plan`` (a ``CallPlan``)."""
    parts = (plan.seq_len, _name(plan.sparse), _name(plan.dense),
             tuple(_mask_shape(mask) for mask in plan.masks),
             _override_chain(options.get(OVERRIDE_OPTION)),
             tuple(tuple(_name(f) for f in pair) for pair in declared or ()))
    return GRAPH_KWARG_PREFIX + hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def _mask_shape(mask) -> Optional[tuple]:
    """What a traced call specialises on: the ints and the tensors' fixed dims (the live-list
    width, dim 3, is marked dynamic when the plan is made)."""
    if mask is None:
        return None
    blocks = mask.live_blocks
    return (mask.block_q, mask.block_k, mask.seq_len, tuple(blocks.shape[:3]), str(blocks.dtype), str(blocks.device))


def _override_chain(override: Optional[Callable]) -> tuple:
    """Names of the override and of those it chains to (Chorus's marks ``chorus_previous``)."""
    chain = []
    while override is not None and len(chain) < 8:
        chain.append(_name(override))
        override = getattr(override, "chorus_previous", None)
    return tuple(chain)


def _name(function: Optional[Callable]) -> Optional[str]:
    return None if function is None else callable_name(function)
