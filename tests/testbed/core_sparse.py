"""Core ComfyUI's Model Sparse Attention (comfy-kitchen's Sol-Attn) as a product-path source (issue 50, item 3).

Core's node (``comfy_extras/nodes_sparse_attention.py`` of the newer ComfyUI, method ``sol-attn``)
puts an attention override on the model that, per self-attention call, keeps attention dense
when a mask is given, when the call's sigma lies outside ``start_percent``..``end_percent`` of the
schedule (dense before 20 % by default), when the sequence is shorter than ``min_tokens`` (12,288
by default), for cross-attention (q and k of different lengths) and for heads other than 128
wide; otherwise it casts float32 q, k, v to bfloat16 and calls ``comfy_kitchen.sol_attn`` with
``tau`` (1.3 by default), no sink blocks on a Wan model, and 64-token blocks. What Sol-Attn
computes (comfy-kitchen's pure-torch reference, ``backends/eager/sol_attn.py``):

* each 64-token query block ``i`` scores key block ``j`` by its centroid against the block's mean
  key, centred over the blocks: ``c_ij``; a block is *routed* (attended token by token) when
  ``c_ij`` exceeds ``tau`` standard deviations of that proxy row (or, with ``topk_ratio``, when it
  is among the row's top ``k``); the diagonal and its two neighbours are always routed;
* every other key block still enters the softmax as one pooled term: logit ``c_ij``, weight its
  token count, value the sum of its values. So this is not block-sparse attention with the rest
  dropped, and its ``density`` here is the share of routed blocks (what is computed exactly).

This module reproduces that arithmetic in float32 (as the eager reference does), one query block
at a time over its routed keys only, so a 16,384-token layer takes seconds on a CPU instead of the
reference's minutes (it materialises every T x T score); ``tests/test_testbed_core_sparse.py``
holds it to ``comfy_kitchen``'s eager ``sol_attn`` on random tensors. Not reproduced: the CUDA
kernel's INT8 arithmetic and its ``extra_tokens`` (256 extra top-scoring tokens per query block,
the node's default), which the eager reference ignores too; both are the GPU kernel's.

The source looks at q and k (an :class:`ObservedMasks`): ``observe`` routes the call, ``attend``
computes it, ``block_map`` answers the routed 64-token map that ``maps`` keeps per (step, layer).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from chorus_core.attention.mask_provider import ObservedMasks

BLOCK = 64  # Sol-Attn's block, queries and keys
CORE_HEAD_DIM = 128  # the only head width core's node sends to the kernel
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class CoreSparseSettings:
    """The node's inputs that matter on a Wan model (its defaults), plus the harness's matching.

    ``density_of(step, layer)``: when set, each sparse call's ``tau`` is chosen so that the routed
    share equals it (the harness's matched density); ``tau`` is then unused.
    """

    tau: float = 1.3
    start_percent: float = 0.2
    end_percent: float = 1.0
    min_tokens: int = 12288
    density_of: Callable[[int, int], float] | None = None
    # compute each sparse call with comfy-kitchen's CUDA kernel (its INT8 routing and ``extra_tokens``
    # top-scoring tokens per query block, as a user's GPU runs it) instead of the float32 reproduction;
    # routing, maps and tau still come from the reproduction
    kernel: bool = False
    extra_tokens: int = 256


@dataclass
class Routing:
    """One call's proxy scores and pooled keys/values, all ``[B, H, ...]`` float32."""

    colmean: torch.Tensor    # [B, H, n, n] centroid score of query block i on key block j (log2 units)
    row_sigma: torch.Tensor  # [B, H, n] standard deviation of each proxy row (log2 units)
    lengths: torch.Tensor    # [n] tokens per block (the last may be short)
    k_centred: torch.Tensor  # [B, H, T, D] keys minus the mean of the block-mean keys
    log2_scale: float


def block_lengths(tokens: int, device) -> torch.Tensor:
    n = math.ceil(tokens / BLOCK)
    lengths = torch.full((n,), float(BLOCK), device=device)
    lengths[-1] = tokens - (n - 1) * BLOCK
    return lengths


def pool_blocks(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, D]`` -> per-block sums ``[B, H, n, D]``."""
    b, h, t, d = x.shape
    n = lengths.numel()
    padded = torch.nn.functional.pad(x, (0, 0, 0, n * BLOCK - t))
    return padded.view(b, h, n, BLOCK, d).sum(3)


def routing_of(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> Routing:
    """The proxy scores Sol-Attn routes on, for q, k ``[B, H, T, D]`` (float32)."""
    t, d = q.shape[-2:]
    lengths = block_lengths(t, q.device)
    log2_scale = (d ** -0.5 if scale is None else scale) * LOG2E
    mean_k = pool_blocks(k, lengths) / lengths.view(1, 1, -1, 1)
    shift = mean_k.mean(2, keepdim=True)  # a constant per row of scores: the softmax does not see it
    centred = mean_k - shift
    centroid = pool_blocks(q, lengths) / lengths.view(1, 1, -1, 1)
    colmean = centroid @ centred.transpose(-1, -2) * log2_scale
    variance = (centroid.pow(2) * centred.pow(2).mean(2, keepdim=True)).sum(-1)
    return Routing(colmean, torch.sqrt(variance * log2_scale ** 2 + 1e-6), lengths, k - shift, log2_scale)


def with_band(routed: torch.Tensor) -> torch.Tensor:
    """The diagonal block and its two neighbours are always attended exactly."""
    n = routed.shape[-1]
    idx = torch.arange(n, device=routed.device)
    return routed | ((idx.view(-1, 1) - idx.view(1, -1)).abs() <= 1)


def route_tau(r: Routing, tau: float) -> torch.Tensor:
    """bool ``[B, H, n, n]``: blocks whose proxy score clears ``tau`` row sigmas, plus the band."""
    return with_band(r.colmean > tau * r.row_sigma.unsqueeze(-1))


def tau_for_density(r: Routing, density: float, iterations: int = 40) -> float:
    """The ``tau`` whose routed share (band included) is nearest ``density`` (bisection; the share
    falls as tau rises)."""
    lo, hi = -8.0, 8.0
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if float(route_tau(r, mid).float().mean()) > density:
            lo = mid
        else:
            hi = mid
    a, b = (float(route_tau(r, x).float().mean()) for x in (lo, hi))
    return lo if abs(a - density) <= abs(b - density) else hi


def sol_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, routed: torch.Tensor, r: Routing) -> torch.Tensor:
    """Sol-Attn's output ``[B, H, T, D]`` (float32): routed blocks token by token, every other
    block one pooled term, one softmax over both."""
    b, h, t, d = q.shape
    n = r.lengths.numel()
    pad = n * BLOCK - t
    keys = torch.nn.functional.pad(r.k_centred, (0, 0, 0, pad)).view(b, h, n, BLOCK, d)
    values = torch.nn.functional.pad(v, (0, 0, 0, pad)).view(b, h, n, BLOCK, d)
    live = (torch.arange(n * BLOCK, device=q.device) < t).view(n, BLOCK)
    pooled_v = pool_blocks(v, r.lengths)  # a pooled term's value: the sum of its block's values
    out = torch.empty_like(q)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                rows = slice(i * BLOCK, min((i + 1) * BLOCK, t))
                sel = routed[bi, hi, i]
                logits = q[bi, hi, rows] @ keys[bi, hi][sel].reshape(-1, d).T * r.log2_scale
                logits = logits.masked_fill(~live[sel].reshape(1, -1), float("-inf"))
                tail = r.colmean[bi, hi, i][~sel]
                top = torch.maximum(logits.amax(-1), tail.max() if tail.numel() else logits.new_tensor(-math.inf))
                p = torch.exp2(logits - top[:, None])
                pt = torch.exp2(tail[None] - top[:, None])
                num = p @ values[bi, hi][sel].reshape(-1, d) + pt @ pooled_v[bi, hi][~sel]
                den = p.sum(-1) + pt @ r.lengths[~sel]
                out[bi, hi, rows] = num / den[:, None]
    return out


class CoreSparseSource(ObservedMasks):
    """Core's Model Sparse Attention on one sampling run: routes each self-attention call from its
    q and k and computes it as Sol-Attn; ``maps`` keeps the routed map per (step, layer)."""

    def __init__(self, settings: CoreSparseSettings, num_layers: int):
        self.settings, self.num_layers = settings, num_layers
        self.block_size = (BLOCK, BLOCK)
        self.maps, self.taus = {}, {}
        self.dense_self_calls = self.sparse_calls = 0
        self._routing = self._routed = None

    def observe(self, layer, step, cond_or_uncond, q, k, heads=None, skip_reshape=True) -> None:
        """Route one call from its q and k (``[B, H, T, D]`` float32): at ``tau``, or at the tau
        that gives the matched density of (step, layer)."""
        self._routing = routing_of(q, k)
        target = self.settings.density_of
        tau = self.settings.tau if target is None else tau_for_density(self._routing, target(step, layer))
        self._routed = route_tau(self._routing, tau)
        self.maps[(step, layer)] = self._routed.any(0).cpu()  # cfg 1: one batch element
        self.taus[(step, layer)] = tau

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device):
        return self._routed

    def attend(self, layer: int, step: int, q, k, v) -> torch.Tensor:
        """Sol-Attn over one self-attention call (``[B, H, T, D]`` float32)."""
        self.observe(layer, step, None, q, k)
        self.sparse_calls += 1
        if self.settings.kernel:
            return kernel_attention(q, k, v, self.taus[(step, layer)], self.settings.extra_tokens)
        return sol_attention(q, k, v, self._routed, self._routing)

    # --- the node's decisions ------------------------------------------------------------------
    def dense_reason(self, options: dict, q_len: int, k_len: int, head_dim: int, has_mask: bool, sigma_window):
        if has_mask:
            return "mask"
        if q_len != k_len:
            return "cross-attention"
        sigmas = options.get("sigmas")
        if sigmas is not None and sigma_window is not None:
            sigma = float(sigmas[0])
            if sigma > sigma_window[0] or sigma < sigma_window[1]:
                return "outside start/end"
        if q_len < self.settings.min_tokens:
            return "min_tokens"
        if head_dim != CORE_HEAD_DIM:
            return "head_dim"
        return None


def kernel_attention(q, k, v, tau: float, extra_tokens: int) -> torch.Tensor:
    """comfy-kitchen's ``sol_attn`` on ``[B, H, T, D]`` tensors, in bfloat16 as core's node sends
    float32 ones; float32 ``[B, H, T, D]`` back."""
    import comfy_kitchen as ck

    if q.device.type != "cuda" or not ck.sol_attn_is_available(q.device):
        raise RuntimeError("core's sparse attention on the kernel needs comfy-kitchen's CUDA sol_attn on this card")
    qs, ks, vs = (t.transpose(1, 2).to(torch.bfloat16).contiguous() for t in (q, k, v))
    out = ck.sol_attn(qs, ks, vs, tau=tau, sink_blocks=[0, 0], sink_q=[0, 0], token_aug=extra_tokens)
    return out.float().transpose(1, 2)


def step_of(options: dict) -> int:
    """The sampling step of a model call: the index of its sigma in the run's schedule."""
    sigma, schedule = float(options["sigmas"][0]), options["sample_sigmas"]
    return int((schedule[:-1].float() - sigma).abs().argmin())


def install_core_sparse(patcher, source: CoreSparseSource, bf16_inputs: bool = True):
    """A clone of ``patcher`` whose attention runs as core's node runs it (``source`` decides and computes);
    ``bf16_inputs``: float32 q, k, v rounded to bfloat16 first, as the node does (``pooled_tail`` turns it off)."""
    sampling = patcher.get_model_object("model_sampling")
    window = (float(sampling.percent_to_sigma(source.settings.start_percent)),
              float(sampling.percent_to_sigma(source.settings.end_percent)))
    calls = {"count": 0}

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        options = kwargs.get("transformer_options") or {}
        b = q.shape[0]
        if skip_reshape:
            qs, ks, vs = q, k, v
        else:
            qs, ks, vs = (t.view(b, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
        reason = source.dense_reason(options, qs.shape[2], ks.shape[2], qs.shape[-1], mask is not None, window)
        if qs.shape[2] == ks.shape[2]:
            calls["count"] += 1  # self-attention calls, in layer order within a model call
        if reason is not None:
            source.dense_self_calls += reason not in ("cross-attention", "mask")
            return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **kwargs)
        layer = options.get("block_index", (calls["count"] - 1) % source.num_layers)
        # core casts float32 to bfloat16 for the kernel; the reference then computes in float32
        qf, kf, vf = (t.to(torch.bfloat16).float() if t.dtype == torch.float32 and bf16_inputs else t.float()
                      for t in (qs, ks, vs))
        out = source.attend(layer, step_of(options), qf, kf, vf).to(q.dtype)
        if skip_output_reshape:
            return out
        return out.transpose(1, 2).reshape(b, -1, heads * out.shape[-1])

    clone = patcher.clone()
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = override
    return clone


def run_core_sparse(pp, conds, seed: int, settings: CoreSparseSettings):
    """(final latents, routed maps per (step, layer), the source) of one run with core's sparse attention."""
    source = CoreSparseSource(settings, pp.L)
    return pp.sample(install_core_sparse(pp.patcher, source), conds, seed), source.maps, source


def whole_run_density(source: CoreSparseSource) -> float:
    """Share of blocks computed exactly over every self-attention call, dense calls counting 1."""
    sparse = sum(float(m.float().mean()) for m in source.maps.values())
    return (sparse + source.dense_self_calls) / max(1, len(source.maps) + source.dense_self_calls)


def core_sparse_rows(pp, conds, seed: int, hit_maps: dict, row, min_tokens: int = 12288, kernel: bool = False) -> None:
    """The two rows of one target and seed: ``core_sparse_defaults`` (natural: the node's defaults)
    and ``core_sparse_matched`` (matched: sparse from the first step, each (step, layer) routed at
    the tau that gives the hit's density there). ``row``: the product path's row maker;
    ``min_tokens``: the node's gate (its default; a model with shorter sequences needs it lower);
    ``kernel``: computed by comfy-kitchen's CUDA kernel (extra_tokens 256, the node's default)."""
    target = {key: float(m.float().mean()) for key, m in hit_maps.items()}
    arms = (("natural", "core_sparse_defaults", CoreSparseSettings(min_tokens=min_tokens, kernel=kernel)),
            ("matched", "core_sparse_matched", CoreSparseSettings(start_percent=0.0, min_tokens=min_tokens, kernel=kernel,
                                                                  density_of=lambda s, l: target[(s, l)])))
    for section, kind, settings in arms:
        final, maps, source = run_core_sparse(pp, conds, seed, settings)
        if not maps:
            raise RuntimeError(f"{kind}: every self-attention call ran dense ({source.dense_self_calls} calls)")
        row(section, kind, final, maps, block_size=BLOCK, density_whole_run=whole_run_density(source),
            sparse_steps=len({s for s, _ in maps}), mean_tau=sum(source.taus.values()) / len(source.taus),
            target_density=sum(target.values()) / len(target) if settings.density_of else None,
            core_compute="comfy_kitchen.sol_attn (CUDA, extra_tokens 256)" if kernel else "float32 reproduction")


# --------------------------------------------------------------------------------------------
# The short table: the hit against core's sparse attention, from product-path runs
# --------------------------------------------------------------------------------------------


def table_row(doc: dict) -> dict:
    """One run's (a product_path.json) hit-vs-core summary: densities, PSNRs, paired differences."""
    from .comparisons import mean_ci, paired_difference, rows_by_pair

    rows = doc["rows"]
    hit = rows_by_pair(rows, "natural", "reused_similar_product")
    defaults, matched = rows_by_pair(rows, "natural", "core_sparse_defaults"), rows_by_pair(rows, "matched", "core_sparse_matched")
    out = {"sampling": f"{doc['config']['sample_steps']} steps, cfg {doc['config']['sample_cfg']}", "pairs": len(hit),
           "requests": len({r for r, _ in hit}), "command": doc["command"], "machine": doc["machine"], "date": doc["date"],
           "git_commit": doc["git_commit"]}
    for name, group in (("hit", hit), ("core_defaults", defaults), ("core_matched", matched)):
        for metric in ("density", "psnr_db") + (("density_whole_run",) if name != "hit" else ()):
            out[f"{name}_{metric}"], out[f"{name}_{metric}_ci95"] = mean_ci([r[metric] for r in group.values()])
    for name, group in (("defaults", defaults), ("matched", matched)):
        diff = paired_difference(hit, group, "psnr_db")
        out[f"hit_minus_core_{name}_db"], out[f"hit_minus_core_{name}_db_ci95"] = diff["mean"], diff["ci95"]
    if out["requests"] < 2:  # one request: no interval (mean_ci's 0 would read as a certainty)
        out.update({key: None for key in out if key.endswith("_ci95")})
    return out


def table_markdown(entries: list) -> str:
    from .comparisons import plus_minus
    from .report import md_table

    def cell(e, key, digits=2):  # signed for differences only
        text = plus_minus(e[key], e[f"{key}_ci95"], digits)
        return text if key.startswith("hit_minus") else text.lstrip("+")

    table = [{"sampling": e["sampling"], "pairs": f"{e['pairs']} ({e['requests']} requests)",
              "hit": f"{cell(e, 'hit_density', 3)}; {cell(e, 'hit_psnr_db')} dB",
              "defaults": f"{cell(e, 'core_defaults_density', 3)} ({cell(e, 'core_defaults_density_whole_run', 3)} whole run); "
                          f"{cell(e, 'core_defaults_psnr_db')} dB",
              "d_defaults": cell(e, "hit_minus_core_defaults_db"),
              "matched": f"{cell(e, 'core_matched_density', 3)}; {cell(e, 'core_matched_psnr_db')} dB",
              "d_matched": cell(e, "hit_minus_core_matched_db")} for e in entries]
    columns = [("sampling", "sampling"), ("pairs", "pairs"), ("Chorus hit: density; PSNR", "hit"),
               ("core defaults (tau 1.3, start 0.2): density of sparse calls (whole run); PSNR", "defaults"),
               ("hit - core defaults (dB)", "d_defaults"), ("core matched (tau per step and layer): density; PSNR", "matched"),
               ("hit - core matched (dB)", "d_matched")]
    lines = ["# The Chorus hit against core ComfyUI's Model Sparse Attention (Sol-Attn), entropy16k testbed", ""]
    for e in entries:
        lines.append(f"- {e['sampling']}: `{e['command']}` ({e['machine']}, {e['date']}, commit {e['git_commit']})")
    lines += ["", ("PSNR of the final latents' previews against the dense run of the same seed; differences paired per "
              "(request, seed), averaged over each request's seeds, mean ± 95 % t interval over requests. Density: "
              "share of key blocks computed exactly (the hit: 128-token blocks; core: 64-token routed blocks, the "
              "rest entering its softmax as one pooled term each)."), "", md_table(table, columns), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description="the hit-vs-core table from product-path runs (--core-sparse or --core-only)")
    parser.add_argument("runs", type=Path, nargs="+", help="folders holding a product_path.json")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    entries = [table_row(json.loads((d / "product_path.json").read_text())) for d in args.runs]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "core_sparse.json").write_text(json.dumps({"benchmark": "tests.testbed.core_sparse", "rows": entries}, indent=1))
    (args.out / "core_sparse.md").write_text(table_markdown(entries))
    print(f"{len(entries)} rows -> {args.out / 'core_sparse.md'}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
