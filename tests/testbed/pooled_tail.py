"""A hit's stored masks with Sol-Attn's pooled tail: how much of the hit's gap to core's sparse
attention is the dropped blocks' missing softmax mass, not the choice of blocks? (experiment)

A Chorus hit attends exactly over the kept 128-token key blocks of its stored mask and drops the
rest. Core's Sol-Attn (``core_sparse.py``) keeps every other block in the softmax as one pooled
term. Here the hit's own mask (per (step, layer), the product path's ``hit_maps``) is computed
with such a tail, at the hit's block size (no expansion to 64-token blocks: the kept set is the
hit's exactly, and the tail has one term per dropped hit block):

* kept blocks: token by token, as the hit does;
* each dropped key block ``j`` of query block ``i``: one term, value the block's mean value,
  logit the block's mean key (centred over the blocks, as Sol-Attn centres) against
  - ``centroid``: the query block's centroid (Sol-Attn's arithmetic: one logit for the block's rows),
  - ``rows``: each query row itself (the exact first-order term of the block, a row at a time),
  plus ``log(count)``: a block of ``count`` keys all scored alike;
* ``none``: no tail, the hit's block-sparse attention again (the harness's and the tests' control).

One softmax over both, in float32, one query block at a time (like ``core_sparse.sol_attention``).
"""

from __future__ import annotations

import math

import torch

from .core_sparse import CoreSparseSettings, CoreSparseSource, install_core_sparse

FORMS = ("centroid", "rows", "none")
KIND_OF_FORM = {"centroid": "reused_similar_pooled_tail", "rows": "reused_similar_pooled_tail_rows",
                "none": "reused_similar_replayed"}


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B, H, n, block, D]``, the last block zero-padded."""
    b, h, t, d = x.shape
    n = math.ceil(t / block)
    return torch.nn.functional.pad(x, (0, 0, 0, n * block - t)).view(b, h, n, block, d)


def _lengths(tokens: int, block: int, device) -> torch.Tensor:
    n = math.ceil(tokens / block)
    lengths = torch.full((n,), float(block), device=device)
    lengths[-1] = tokens - (n - 1) * block
    return lengths


def pooled_tail_attention(q, k, v, kept: torch.Tensor, block: int, form: str = "centroid",
                          scale: float | None = None) -> torch.Tensor:
    """Attention ``[B, H, T, D]`` (float32) over the kept blocks of ``kept`` (bool ``[H, n, n]`` or
    ``[B, H, n, n]``, ``block``-token blocks), each dropped block one pooled term (``form``)."""
    if form not in FORMS:
        raise ValueError(f"form {form!r}: one of {FORMS}")
    b, h, t, d = q.shape
    n = math.ceil(t / block)
    kept = kept.to(q.device).bool().expand(b, h, n, n)
    scale = d ** -0.5 if scale is None else scale
    lengths = _lengths(t, block, q.device)
    keys, values = _blocked(k, block), _blocked(v, block)
    mean_k = keys.sum(3) / lengths.view(1, 1, -1, 1)
    # Sol-Attn's centring: a constant per row for token logits, but not for the centroid's pooled
    # ones (the centroid is not the row), so it is part of the centroid form's arithmetic
    shift = mean_k.mean(2, keepdim=True)
    keys, mean_k = keys - shift.unsqueeze(3), mean_k - shift
    mean_v = values.sum(3) / lengths.view(1, 1, -1, 1)
    centroid = _blocked(q, block).sum(3) / lengths.view(1, 1, -1, 1)
    live = (torch.arange(n * block, device=q.device) < t).view(n, block)
    log_count = lengths.log()
    out = torch.empty_like(q)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                rows = slice(i * block, min((i + 1) * block, t))
                sel = kept[bi, hi, i]
                qi = q[bi, hi, rows]
                logits = (qi @ keys[bi, hi][sel].reshape(-1, d).T * scale).masked_fill(~live[sel].reshape(1, -1), -math.inf)
                pooled = ~sel if form != "none" else torch.zeros_like(sel)  # the blocks given a term
                tail = _tail_logits(qi, centroid[bi, hi, i], mean_k[bi, hi][pooled], form, scale) + log_count[pooled]
                weights = torch.softmax(torch.cat([logits, tail], -1), -1)
                out[bi, hi, rows] = weights @ torch.cat([values[bi, hi][sel].reshape(-1, d), mean_v[bi, hi][pooled]])
    return out


def _tail_logits(qi, centroid, pooled_k, form: str, scale: float) -> torch.Tensor:
    """``[rows, pooled blocks]`` logits of the pooled terms (before ``log(count)``)."""
    if form == "centroid":
        return (centroid @ pooled_k.T * scale).expand(qi.shape[0], -1)
    return qi @ pooled_k.T * scale


class PooledTailSource(CoreSparseSource):
    """Serves the hit's maps through core's attention override (``install_core_sparse``): every
    self-attention call with a map is computed by ``pooled_tail_attention``; one without (a step
    the hit ran dense) is exact dense attention (every block kept)."""

    def __init__(self, hit_maps: dict, block: int, form: str, num_layers: int):
        super().__init__(CoreSparseSettings(start_percent=0.0), num_layers)
        self.hit_maps, self.block, self.form = hit_maps, block, form
        self.block_size = (block, block)

    def dense_reason(self, options, q_len, k_len, head_dim, has_mask, sigma_window):
        # the hit has no sigma window, token minimum or head width gate: only what it never serves
        return "mask" if has_mask else "cross-attention" if q_len != k_len else None

    def attend(self, layer: int, step: int, q, k, v) -> torch.Tensor:
        kept = self.hit_maps.get((step, layer))
        if kept is None:
            n = math.ceil(q.shape[2] / self.block)
            return pooled_tail_attention(q, k, v, torch.ones(n, n, dtype=torch.bool), self.block, "none")
        self.sparse_calls += 1
        self.maps[(step, layer)] = kept
        return pooled_tail_attention(q, k, v, kept, self.block, self.form)


def pooled_tail_rows(pp, conds, seed: int, hit_maps: dict, row, forms) -> None:
    """A matched-density row per form (``KIND_OF_FORM``): the hit's maps, the tail added."""
    for form in forms:
        source = PooledTailSource(hit_maps, pp.bs, form, pp.L)
        # float32 as the hit computes (core's bfloat16 cast would be a second difference)
        final = pp.sample(install_core_sparse(pp.patcher, source, bf16_inputs=False), conds, seed)
        row("matched", KIND_OF_FORM[form], final, dict(source.maps), pooled_form=form)


def parse_forms(text: str) -> tuple:
    """``--hit-pooled-tail centroid,rows`` -> ``("centroid", "rows")``."""
    forms = tuple(f.strip() for f in text.split(",") if f.strip())
    bad = [f for f in forms if f not in FORMS]
    if bad or not forms:
        raise ValueError(f"--hit-pooled-tail wants forms among {FORMS}, not {text!r}")
    return forms
