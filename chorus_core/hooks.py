"""Hook machinery shared by every Chorus patch (sparse attention, Feature Reuse, Guidance Enhance).

ComfyUI gives each hook one slot (``optimized_attention_override``, a block patch per index):
each Chorus hook marks itself (:func:`mark_own`) and chains to what was there before, and a
second install of the same hook unwraps its own earlier one (:func:`unwrap_own`) instead of
stacking on it. :class:`AttentionCall` reads an ``optimized_attention`` call's arguments and
:func:`schedule_step` the current step, the same way for every hook.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ._siblings import import_sibling

__all__ = ["schedule_step", "block_sparse", "AttentionCall", "mark_own", "unwrap_own"]


def schedule_step(sigmas: torch.Tensor, schedule: torch.Tensor) -> int:
    """Index of the current sigma in the sampler's schedule (closest match; one host sync).

    Shared by every Chorus hook; each calls it once per model call and caches the answer.
    """
    return int((schedule.to(sigmas.device) - sigmas.flatten()[0]).abs().argmin())


def block_sparse():
    """The kernels' block_sparse module, imported at call time (see _siblings)."""
    return import_sibling("kernels.block_sparse")


_ATTENTION_PARAMS = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")


@dataclass
class AttentionCall:
    """The arguments of an ``optimized_attention`` call that matter here."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    heads: int
    mask: Any
    skip_reshape: bool
    skip_output_reshape: bool
    named: dict = field(default_factory=dict, repr=False)  # every argument by name, to pass on changed

    @classmethod
    def parse(cls, args, kwargs) -> Optional["AttentionCall"]:
        named = dict(zip(_ATTENTION_PARAMS, args)) | kwargs
        if not all(name in named for name in ("q", "k", "v", "heads")):
            return None
        return cls(named["q"], named["k"], named["v"], int(named["heads"]), named.get("mask"),
                   bool(named.get("skip_reshape", False)), bool(named.get("skip_output_reshape", False)), named)

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
