"""Core ComfyUI's Model Sparse Attention as a row of bench_user_stack.py (issue 50, item 3).

Newer ComfyUI ships a node, Model Sparse Attention (``BlockSparseAttention`` in
``comfy_extras/nodes_sparse_attention.py``), that puts an attention override on the model and sends
each eligible self-attention call to comfy-kitchen's ``sol_attn`` kernel. ComfyUI 0.19.3, the release
the benchmark runs, has comfy-kitchen 0.2.40 (with ``sol_attn``) but not the node, so this module does
what the node does for a Wan model with method ``sol-attn`` (or ``sla``, a top-k share), written from
its behaviour, not its code:

* the override is put on a clone of the model, on top of any override already there;
* a call stays dense (the attention ComfyUI would run) when it has a mask, when its sigma lies
  outside ``percent_to_sigma(start_percent)``..``percent_to_sigma(end_percent)``, when it has fewer
  than ``min_tokens`` tokens, for cross-attention (q and k of different lengths), for heads other
  than 128 wide, off CUDA, or when comfy-kitchen has no compiled ``sol_attn`` for the card;
* otherwise q, k, v go to ``comfy_kitchen.sol_attn`` as ``[B, T, H, D]`` with ``tau``,
  ``topk_ratio``, no sink blocks (a Wan model has none) and ``token_aug`` = ``extra_tokens``
  (256 by the node's default), float32 cast to bfloat16 first.

Defaults are the node's: tau 1.3, start 0.2, end 1.0, min_tokens 12,288, extra_tokens 256.

``CoreSparseStats`` counts the calls each way and keeps q and k of the first sparse call of up to
``capture_steps`` steps; ``routed_share`` estimates afterwards, outside the timed generation, the share
of 64-token key blocks a ``tau`` routes on them, with the float32 reproduction in
``tests/testbed/core_sparse.py`` (the kernel routes in INT8, so this is an estimate).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

HEAD_DIM = 128  # the only head width the node sends to the kernel


@dataclass(frozen=True)
class CoreSettings:
    """The node's inputs that matter on a Wan model; ``topk_ratio`` > 0 is its ``sla`` method."""

    tau: float = 1.3
    topk_ratio: float = 0.0
    start_percent: float = 0.2
    end_percent: float = 1.0
    min_tokens: int = 12288
    extra_tokens: int = 256
    # the benchmark's CPU test only: comfy-kitchen's eager reference on CPU tensors, which the node
    # never calls (it keeps every call off CUDA dense)
    eager_on_cpu: bool = False

    def describe(self) -> str:
        how = f"topk {self.topk_ratio:g}" if self.topk_ratio > 0 else f"tau {self.tau:g}"
        return f"{how}, start {self.start_percent:g}, extra_tokens {self.extra_tokens}"


@dataclass
class CoreSparseStats:
    sparse_calls: int = 0
    dense_calls: Counter = field(default_factory=Counter)  # reason -> calls
    captured: list = field(default_factory=list)  # (sigma, q, k) as [B, H, T, D]
    capture_steps: int = 4
    _sigmas_seen: set = field(default_factory=set)

    def capture(self, sigma: float | None, q: torch.Tensor, k: torch.Tensor) -> None:
        """q, k of the first sparse call of each step (a clone: the model reuses its buffers)."""
        if sigma in self._sigmas_seen or len(self.captured) >= self.capture_steps:
            return
        self._sigmas_seen.add(sigma)
        self.captured.append((sigma, q.transpose(1, 2).clone(), k.transpose(1, 2).clone()))

    def summary(self) -> dict:
        return dict(sparse_calls=self.sparse_calls, dense_calls=dict(self.dense_calls))


def dense_reason(settings: CoreSettings, window: tuple[float, float], options: dict, tokens: int) -> str | None:
    """Why a call stays dense whatever its tensors hold, or None."""
    sigmas = options.get("sigmas")
    if sigmas is not None:
        sigma = float(sigmas[0])
        if sigma > window[0] or sigma < window[1]:
            return "sigma outside start/end"
    if tokens < settings.min_tokens:
        return "fewer than min_tokens"
    return None


def tensor_reason(settings: CoreSettings, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  head_dim: int) -> str | None:
    """Why these ``[B, T, H, D]`` tensors cannot go to the kernel, or None."""
    import comfy_kitchen as ck

    on_cpu = q.device.type == "cpu" and settings.eager_on_cpu
    if q.device.type != "cuda" and not on_cpu:
        return "not on CUDA"
    if not on_cpu and not ck.sol_attn_is_available(q.device):
        return "no compiled sol_attn for this card"
    if head_dim != HEAD_DIM:
        return f"head_dim {head_dim}"
    if q.shape != k.shape or q.shape != v.shape:
        return "cross-attention"
    return None


def as_bthd(t: torch.Tensor, heads: int, skip_reshape: bool) -> torch.Tensor:
    if skip_reshape:  # [B, H, T, D]
        return t.transpose(1, 2)
    b, tokens, width = t.shape
    return t.view(b, tokens, heads, width // heads)


def make_override(settings: CoreSettings, window: tuple[float, float], stats: CoreSparseStats, previous):
    import comfy_kitchen as ck

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        options = kwargs.get("transformer_options") or {}

        def dense(reason: str):
            stats.dense_calls[reason] += 1
            kw = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                      skip_output_reshape=skip_output_reshape, **kwargs)
            return func(q, k, v, heads, **kw) if previous is None else previous(func, q, k, v, heads, **kw)

        if mask is not None:
            return dense("mask")
        tokens = q.shape[2] if skip_reshape else q.shape[1]
        reason = dense_reason(settings, window, options, tokens)
        if reason is not None:
            return dense(reason)
        qs, ks, vs = (as_bthd(t, heads, skip_reshape) for t in (q, k, v))
        reason = tensor_reason(settings, qs, ks, vs, qs.shape[-1])
        if reason is not None:
            return dense(reason)
        if qs.dtype == torch.float32:  # the kernel takes half precision; bf16 keeps float32's range
            qs, ks, vs = (t.to(torch.bfloat16) for t in (qs, ks, vs))
        sigmas = options.get("sigmas")
        stats.capture(None if sigmas is None else float(sigmas[0]), qs, ks)
        out = ck.sol_attn(qs, ks, vs, tau=settings.tau, scale=kwargs.get("scale"), sink_blocks=[0, 0],
                          sink_q=[0, 0], topk_ratio=settings.topk_ratio, token_aug=settings.extra_tokens)
        stats.sparse_calls += 1
        out = out.to(q.dtype)
        if skip_output_reshape:
            return out.transpose(1, 2)
        b = out.shape[0]
        return out.reshape(b, -1, out.shape[2] * out.shape[3])

    return override


def apply_core_sparse(model, settings: CoreSettings, capture_steps: int = 4):
    """A clone of ``model`` (a ComfyUI ModelPatcher) with the override on top, and its stats."""
    sampling = model.get_model_object("model_sampling")
    window = (float(sampling.percent_to_sigma(settings.start_percent)),
              float(sampling.percent_to_sigma(settings.end_percent)))
    stats = CoreSparseStats(capture_steps=capture_steps)
    patched = model.clone()
    options = patched.model_options.setdefault("transformer_options", {})
    options["optimized_attention_override"] = make_override(
        settings, window, stats, options.get("optimized_attention_override"))
    return patched, stats


def routed_share(stats: CoreSparseStats, settings: CoreSettings) -> float | None:
    """Mean share of 64-token key blocks routed exactly over the captured calls (band included);
    for the top-k method, the nominal ratio. Frees the captured tensors."""
    if settings.topk_ratio > 0:
        stats.captured.clear()
        return settings.topk_ratio
    from testbed.core_sparse import route_tau, routing_of

    shares = []
    for _, q, k in stats.captured:
        routing = routing_of(q.float(), k.float())
        shares.append(float(route_tau(routing, settings.tau).float().mean()))
        del routing
    stats.captured.clear()
    return round(sum(shares) / len(shares), 4) if shares else None
