"""A penalty on self-attention entropy while the testbed trains (issue 23's probe candidates).

Trained on its workloads alone, every design probed so far levels off near half of the
attention mass at density 0.15 (``sharp16k`` 0.44, ``probe_shift05`` 0.49-0.51), where real
video DiTs keep about 0.9: the denoising task does not ask this small model for concentrated
attention. This penalty asks for it directly. It is a design lever, not a measurement trick: the
masks are still learnt from content, but the concentration is imposed, so a design chosen with
it must say so where its numbers are quoted.

The penalty is the mean entropy of sampled self-attention rows divided by ``log(N)`` (uniform
attention scores 1, attention on one key 0), computed in fp32 beside the real attention call,
which it does not change.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch


def row_entropy(q: torch.Tensor, k: torch.Tensor, heads: int, rows: torch.Tensor) -> torch.Tensor:
    """Mean normalised entropy of the attention rows ``rows`` of q ``[B, N, H*D]`` against k ``[B, N, H*D]``."""
    b, n, hd = k.shape
    d = hd // heads
    qs = q[:, rows].float().reshape(b, len(rows), heads, d).transpose(1, 2)
    ks = k.float().reshape(b, n, heads, d).transpose(1, 2)
    with torch.autocast(device_type=q.device.type, enabled=False):  # training autocasts matmuls to bf16
        logp = torch.log_softmax(qs @ ks.transpose(-1, -2) * d ** -0.5, dim=-1)  # [B, H, S, N]
    entropy = -(logp.exp() * logp).sum(-1)
    return entropy.mean() / math.log(n)


class EntropyPenalty:
    """An ``optimized_attention_override`` that runs ``inner`` (or ComfyUI's attention) unchanged and
    records the entropy of ``queries`` random rows of every self-attention call.

    Rows are drawn from ``generator`` (a CPU generator), so a resumed training run stays exact.
    """

    def __init__(self, inner: Optional[Callable], queries: int, generator: torch.Generator):
        self.inner, self.queries, self.generator = inner, queries, generator
        self._terms: list[torch.Tensor] = []

    def __call__(self, func, *args, **kwargs):
        out = self.inner(func, *args, **kwargs) if self.inner is not None else func(*args, **kwargs)
        q, k = args[:2]
        heads = kwargs.get("heads", args[3] if len(args) > 3 else None)
        if self._is_plain_self_attention(q, k, heads, kwargs):
            rows = torch.randint(q.shape[1], (min(self.queries, q.shape[1]),), generator=self.generator)
            self._terms.append(row_entropy(q, k, heads, rows.to(q.device)))
        return out

    @staticmethod
    def _is_plain_self_attention(q, k, heads, kwargs) -> bool:
        return (heads is not None and q.dim() == 3 and q.shape[1] == k.shape[1] and kwargs.get("mask") is None
                and not kwargs.get("skip_reshape"))

    def take(self) -> torch.Tensor:
        """The mean over the calls since the last ``take`` (0 when there were none), and forget them."""
        terms, self._terms = self._terms, []
        return torch.stack(terms).mean() if terms else torch.zeros(())


def with_entropy_penalty(options: dict, queries: int, generator: torch.Generator) -> tuple[dict, EntropyPenalty]:
    """``transformer_options`` whose attention override also records the penalty, and the penalty."""
    penalty = EntropyPenalty(options.get("optimized_attention_override"), queries, generator)
    return {**options, "optimized_attention_override": penalty}, penalty
