"""Hook machinery shared by every Chorus patch (sparse attention, Feature Reuse, Guidance Enhance).

ComfyUI gives each hook one slot (``optimized_attention_override``, a block patch per index):
each Chorus hook marks itself (:func:`mark_own`) and chains to what was there before, and a
second install of the same hook unwraps its own earlier one (:func:`unwrap_own`) instead of
stacking on it. :class:`AttentionCall` reads an ``optimized_attention`` call's arguments and
:func:`schedule_step` the current step, the same way for every hook.

Newer ComfyUI (from about 0.35) hands q, k and v to attention wrapped in single-use
``AttentionTensorContainer`` objects (``peek()`` reads, ``take()`` consumes). Its ``wrap_attn``
unwraps them before calling an override, unless the override has a ``container_function``;
then that function gets the containers and *no* ``func``. :class:`AttentionCall` reads both
forms without consuming anything, so a call it declines is passed on exactly as it came.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ._siblings import import_sibling

__all__ = ["schedule_step", "block_sparse", "AttentionCall", "mark_own", "unwrap_own", "is_container",
           "container_function_of"]


def schedule_step(sigmas: torch.Tensor, schedule: torch.Tensor) -> int:
    """Index of the current sigma in the sampler's schedule (closest match; one host sync).

    Shared by every Chorus hook; each calls it once per model call and caches the answer.
    """
    return int((schedule.to(sigmas.device) - sigmas.flatten()[0]).abs().argmin())


def block_sparse():
    """The kernels' block_sparse module, imported at call time (see _siblings)."""
    return import_sibling("kernels.block_sparse")


_ATTENTION_PARAMS = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")


def is_container(value) -> bool:
    """True for newer ComfyUI's ``AttentionTensorContainer`` (duck-typed: 0.3.64 has none)."""
    return not isinstance(value, torch.Tensor) and callable(getattr(value, "peek", None)) \
        and callable(getattr(value, "take", None))


def container_function_of(override) -> Optional[Callable]:
    """The override's ``container_function``, as newer ComfyUI's ``wrap_attn`` looks it up."""
    return getattr(override, "container_function", None) if override is not None else None


@dataclass
class AttentionCall:
    """The arguments of an ``optimized_attention`` call that matter here.

    q, k and v are tensors; when the call came with containers, ``containers`` holds them
    (unconsumed) and the tensors are their peeked contents.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    heads: int
    mask: Any
    skip_reshape: bool
    skip_output_reshape: bool
    named: dict = field(default_factory=dict, repr=False)  # every argument by name, to pass on changed
    containers: Optional[tuple] = field(default=None, repr=False)

    @classmethod
    def parse(cls, args, kwargs) -> Optional["AttentionCall"]:
        """Read a call given as tensors or as containers (newer Wan passes ``heads`` by name)."""
        named = dict(zip(_ATTENTION_PARAMS, args)) | kwargs
        if not all(name in named for name in ("q", "k", "v", "heads")):
            return None
        qkv = (named["q"], named["k"], named["v"])
        containers = None
        if any(is_container(x) for x in qkv):
            if not all(is_container(x) for x in qkv):
                return None  # a mix no ComfyUI produces: leave it to the function it was meant for
            containers = qkv
            qkv = tuple(x.peek() for x in qkv)
        return cls(*qkv, int(named["heads"]), named.get("mask"),
                   bool(named.get("skip_reshape", False)), bool(named.get("skip_output_reshape", False)), named,
                   containers)

    def consume(self) -> None:
        """Mark the containers used (their single-use contract) once this call has been answered."""
        for container in self.containers or ():
            container.take()

    @property
    def seq_len(self) -> int:
        return self.q.shape[2] if self.skip_reshape else self.q.shape[1]

    @property
    def kv_len(self) -> int:
        return self.k.shape[2] if self.skip_reshape else self.k.shape[1]

    @property
    def batch(self) -> int:
        return self.q.shape[0]


def mark_own(function, key: str, previous):
    function.chorus_key = key
    function.chorus_previous = previous
    return function


def unwrap_own(function, key: str):
    """What our own earlier install chained to, so installing twice does not stack two patches."""
    while function is not None and getattr(function, "chorus_key", None) == key:
        function = function.chorus_previous
    return function
