"""Mask-quality report on the trained testbed model.

    python -m tests.testbed.report --checkpoint FILE --out DIR [--preset full|smoke] [--set name=value ...]

At the long size, for target requests of every template (held-out subjects), compares block
masks of six sources at matched densities (same kept-block count per query-block row, the
diagonal always kept):

- ``oracle``: the target's own block attention mass (``kernels.block_mass`` on its dense run,
  mean over the steps of each step bucket), top blocks per row;
- ``reused_similar``: the same, from another request with the same template and layout
  (another subject): what a bank hit reuses;
- ``reused_dissimilar``: from a request of another template and another layout;
- ``online``: mean-pooled Q/K block scores of the current call (``online_predictor``);
- ``population``: the population prior (``population_prior``) of masks recorded from requests
  of other layouts and every template;
- ``static``: local 3D windows (key blocks nearest the query block in (t, h, w)).

Measures: attention recall per layer against the target's dense run; relative output error
of sparse vs dense attention; PSNR/SSIM of the final latents of a sparse Euler sampling run vs
the dense run from the same noise (attention is swapped through ComfyUI's
``optimized_attention_override`` directly, no ModelPatcher: ``models.AttentionHook``). Plus
recall vs density at several sequence lengths, the common/request-specific split of the
masks, dense warm-up, dense-layers (``--only dense_layers`` runs it alone), top-p and signature-threshold
sweeps.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import math
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch

from chorus_core._siblings import import_sibling
from chorus_core.attention.masks import forced_blocks, keep_top_counts, select_blocks
from chorus_core.attention.online_predictor import block_scores
from chorus_core.reuse.population_prior import population_prior
from chorus_core.quality import mass_recall, psnr, sparse_output_error, ssim
from chorus_core.testbed.workload import TEMPLATES, I2VRequest, generate_request
from .config import TestbedConfig, config_from_dict, make_config, size_name, tokens_of
from .models import SDPAAttention, AttentionHook, block_grid_coords, make_batch, predict_velocity, sample, sigma_schedule

KINDS = ("oracle", "reused_similar", "reused_dissimilar", "online", "population", "static")


# --------------------------------------------------------------------------------------------
# Mask helpers (pure; tested on tiny inputs)
# --------------------------------------------------------------------------------------------


def keep_count(density: float, nk: int) -> int:
    return max(1, round(density * nk))


def top_blocks(scores: torch.Tensor, density: float) -> torch.Tensor:
    """Per row keep the ``round(density * nk)`` highest-scoring blocks, the diagonal forced. scores ``[..., nq, nk]``."""
    nq, nk = scores.shape[-2:]
    forced = forced_blocks(nq, nk, True, None, scores.device)
    counts = torch.full(scores.shape[:-1], keep_count(density, nk), dtype=torch.long, device=scores.device)
    return keep_top_counts(scores, counts, forced)


def static_window_scores(size, block_size: int, heads: int, frame_weight: float = 4.0) -> torch.Tensor:
    """Scores of local 3D windows: minus the distance between block centres -> ``[H, nb, nb]``.

    A frame step counts ``frame_weight`` token rows (a 128-token block spans about 4 rows of a
    32-token-wide frame, so the neighbour block in the next frame ranks with the neighbour rows).
    """
    c = block_grid_coords(size, block_size)
    c = c * torch.tensor([frame_weight, 1.0, 1.0])
    d = torch.cdist(c, c)
    return (-d)[None].expand(heads, -1, -1).contiguous()


def recall_of(mass: torch.Tensor, block_map: torch.Tensor, seq_len: int, block_size: int) -> float:
    """Mean recall over heads of a map against block mass (both ``[H, nb, nb]``)."""
    return float(mass_recall(mass, block_map, seq_len, block_size).mean())


def split_common_specific(oracle: torch.Tensor, prior: torch.Tensor, mass: torch.Tensor, seq_len: int,
                          block_size: int) -> dict:
    """How much of the oracle mask is the common (prior) part and what the rest adds in recall."""
    common = oracle & prior
    return {"common_share": float(common.sum() / oracle.sum().clamp(min=1)),
            "recall_oracle": recall_of(mass, oracle, seq_len, block_size),
            "recall_common_part": recall_of(mass, common, seq_len, block_size),
            "recall_prior": recall_of(mass, prior, seq_len, block_size)}


def first_density_reaching(rows: list, value_key: str, target: float):
    """Smallest density whose mean ``value_key`` reaches ``target`` (rows: dicts with density), or None."""
    ok = sorted(r["density"] for r in rows if r.get(value_key) is not None and r[value_key] >= target)
    return ok[0] if ok else None


def load_signature_module():
    """``chorus_core.bank.signature`` without the bank's optional imports (sqlite-utils)."""
    try:
        from chorus_core.bank import signature  # noqa: PLC0415

        return signature
    except Exception:  # noqa: BLE001
        path = Path(__file__).resolve().parents[2] / "chorus_core" / "bank" / "signature.py"
        spec = importlib.util.spec_from_file_location("chorus_bank_signature_standalone", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


def eval_requests(config: TestbedConfig, size, templates=None):
    """targets, similar[i], dissimilar[i] (indices into sources), population requests."""
    templates = list(templates or config.eval_templates or TEMPLATES)
    f, h, w = size
    base = config.eval_subject_base
    targets, similar = [], []
    for ti, template in enumerate(templates):
        for li, layout in enumerate(config.eval_layouts):
            i = len(targets)
            targets.append(I2VRequest(template, base + i, layout, f, h, w, texture=config.texture))
            similar.append(I2VRequest(template, base + 100 + i, layout, f, h, w, texture=config.texture))
    dissimilar = []
    for ti, template in enumerate(templates):
        for li, layout in enumerate(config.eval_layouts):
            other_t = (ti + 1) % len(templates)
            other_l = (li + 1) % len(config.eval_layouts)
            dissimilar.append(other_t * len(config.eval_layouts) + other_l)  # index into `similar`
    population = [I2VRequest(t, base + 200 + j, layout, f, h, w, texture=config.texture)
                  for j, (t, layout) in enumerate((t, l) for t in templates for l in config.population_layouts)]
    return targets, similar, dissimilar, population


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


class Recorder:
    """Observes a dense run: block mass (and optionally online scores, q/k/v) per (step, layer)."""

    def __init__(self, steps: int, layers: int, block_size: int, keep_scores=False, qkv_steps=()):
        self.step = 0
        self.block_size = block_size
        self.mass = [[None] * layers for _ in range(steps)]
        self.scores = [[None] * layers for _ in range(steps)] if keep_scores else None
        self.qkv = {}
        self.qkv_steps = set(qkv_steps)

    def __call__(self, layer, q, k, v, heads):
        bm = import_sibling("kernels.block_mass")
        self.mass[self.step][layer] = bm.block_mass(q, k, heads, self.block_size)[0].float()
        if self.scores is not None:
            self.scores[self.step][layer] = block_scores(q, k, heads, self.block_size)[0]
        if self.step in self.qkv_steps:
            self.qkv[(self.step, layer)] = (q.detach().clone(), k.detach().clone(), v.detach().clone(), heads)

    def stacked_mass(self) -> torch.Tensor:
        return torch.stack([torch.stack(row) for row in self.mass])  # [S, L, H, nb, nb]


class CPUMaskedHook(AttentionHook):
    """``AttentionHook`` whose sparse calls on CPU tensors run SDPA with the block map expanded to a
    token mask: the same result as ``kernels.block_sparse``'s reference (a query block's softmax
    over its kept key blocks), several times faster on a CPU than its per-query-block loop."""

    def __call__(self, func, *args, **kwargs):
        q, k, v = args[:3]
        if q.is_cuda or self.block_map_for is None or kwargs.get("skip_reshape") or q.dim() != 3 \
                or q.shape[1] != k.shape[1]:
            return super().__call__(func, *args, **kwargs)
        heads = kwargs.get("heads", args[3] if len(args) > 3 else None)
        layer = self.calls % self.num_layers
        self.calls += 1
        if self.observe is not None:
            self.observe(layer, q, k, v, heads)
        block_map = self.block_map_for(layer, q, k, heads)
        if block_map is None:
            return self.dense_override(func, *args, **kwargs) if self.dense_override else func(*args, **kwargs)
        b, n, hd = q.shape
        d = hd // heads
        qh, kh, vh = (x.float().reshape(b, n, heads, d).transpose(1, 2) for x in (q, k, v))
        bm = block_map.bool().expand(b, heads, -1, -1)
        mask = bm.repeat_interleave(self.block_size, -2)[..., :n, :].repeat_interleave(self.block_size, -1)[..., :n]
        o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        return o.transpose(1, 2).reshape(b, n, hd).to(q.dtype)


def noise_for(request: I2VRequest, index: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + index)
    return torch.randn((1, 16, request.frames, request.height, request.width), generator=g).to(device)


class Report:
    def __init__(self, model, config: TestbedConfig, device: str, log=print):
        self.model, self.config, self.device, self.log = model, config, device, log
        self.autocast = device != "cpu"
        self.L, self.H = config.num_layers, config.num_heads
        self.bs = config.block_size
        self.sigmas = sigma_schedule(config.sample_steps, config.sample_shift)
        self.bucket_of = {s: b for b, steps in enumerate(config.step_buckets) for s in steps}
        self.deadline = time.time() + config.report_budget_s
        self.skipped = []
        self.dense_override = None  # set when ComfyUI's own attention failed the training gradient check

    def hook(self) -> AttentionHook:
        h = (CPUMaskedHook if self.device == "cpu" else AttentionHook)(self.L, self.bs)
        h.dense_override = self.dense_override
        return h

    def time_left(self) -> float:
        return self.deadline - time.time()

    # --- dense runs ------------------------------------------------------------------------
    def dense_run(self, request, index, keep_scores=False, qkv_steps=()):
        batch = make_batch([request]).to(self.device)
        rec = Recorder(self.config.sample_steps, self.L, self.bs, keep_scores, qkv_steps)
        hook = self.hook()
        hook.observe = rec

        def on_step(i):
            rec.step = i

        with torch.no_grad():
            final = sample(self.model, batch, noise_for(request, index, self.config.seed_report, self.device),
                           self.sigmas, hook, on_step, self.autocast)
        mass = rec.stacked_mass()
        buckets = torch.stack([mass[list(steps)].mean(0) for steps in self.config.step_buckets])  # [Bk, L, H, nb, nb]
        return {"request": request, "batch": batch, "final": final, "mass": mass, "bucket_mass": buckets,
                "scores": rec.scores, "qkv": rec.qkv, "index": index}

    # --- sparse runs -----------------------------------------------------------------------
    def sparse_run(self, run: dict, maps_per_element: list, warmups: list):
        """One batched sampling run; element e uses ``maps_per_element[e](step, layer, q, k, heads, e)``
        (a bool [H, nb, nb] map) after ``warmups[e]`` dense steps. Returns final latents [E, ...]."""
        e_count = len(maps_per_element)
        base = run["batch"]
        batch = base.select(torch.zeros(e_count, dtype=torch.long, device=base.x0.device))
        noise = noise_for(run["request"], run["index"], self.config.seed_report, self.device).expand(e_count, -1, -1, -1, -1)
        hook = self.hook()
        state = {"step": 0}

        def block_map_for(layer, q, k, heads):
            step = state["step"]
            maps = []
            for e, fn in enumerate(maps_per_element):
                if step < warmups[e]:
                    n = q.shape[1]
                    nbk = math.ceil(n / self.bs)
                    maps.append(torch.ones(self.H, nbk, nbk, dtype=torch.bool, device=q.device))
                else:
                    qe, ke = q[e:e + 1], k[e:e + 1]
                    maps.append(fn(step, layer, qe, ke, heads, e).to(q.device))
            return torch.stack(maps)

        hook.block_map_for = block_map_for

        def on_step(i):
            state["step"] = i

        with torch.no_grad():
            return sample(self.model, batch, noise.contiguous(), self.sigmas, hook, on_step, self.autocast)

    # --- mask sources ----------------------------------------------------------------------
    def source_maps(self, runs, targets_idx, similar_idx, dissimilar_of, population_idx, density, size):
        """Per target: dict kind -> [Bk, L, H, nb, nb] bool (online is per call, None here)."""
        static = top_blocks(static_window_scores(size, self.bs, self.H).to(self.device), density)
        pop_maps = torch.stack([top_blocks(runs[p]["bucket_mass"], density) for p in population_idx])
        prior = population_prior(pop_maps, density)
        out = []
        for t, s, d in zip(targets_idx, similar_idx, dissimilar_of):
            out.append({"oracle": top_blocks(runs[t]["bucket_mass"], density),
                        "reused_similar": top_blocks(runs[s]["bucket_mass"], density),
                        "reused_dissimilar": top_blocks(runs[d]["bucket_mass"], density),
                        "population": prior,
                        "static": static[None, None].expand(len(self.config.step_buckets), self.L, -1, -1, -1)})
        return out


def _mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _fmt(v, digits=3):
    if v is None:
        return "–"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return f"{v:.{digits}f}"
    return str(v)


def md_table(rows: list, columns: list) -> str:
    head = "| " + " | ".join(c for c, _ in columns) + " |\n| " + " | ".join("---" for _ in columns) + " |\n"
    return head + "".join("| " + " | ".join(_fmt(r.get(k)) if not callable(k) else k(r) for _, k in columns) + " |\n"
                          for r in rows)


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


def run_report(model, config: TestbedConfig, device: str, log=print, dense_attention: str = "comfyui") -> dict:
    rep = Report(model, config, device, log)
    if dense_attention != "comfyui":
        rep.dense_override = SDPAAttention()
    size = tuple(config.long_size)
    n_tok = tokens_of(size)
    shape = size_name(size)
    t_start = time.time()
    targets, similar, dissimilar, population = eval_requests(config, size)
    # dense runs: similar sources and population first, then targets (with scores and q/k/v)
    runs = []
    for r in similar + population:
        runs.append(rep.dense_run(r, len(runs)))
    sim_idx = list(range(len(similar)))
    pop_idx = list(range(len(similar), len(similar) + len(population)))
    tgt_idx = []
    for r in targets:
        tgt_idx.append(len(runs))
        runs.append(rep.dense_run(r, len(runs), keep_scores=True, qkv_steps=config.error_steps))
    dis_idx = [sim_idx[d] for d in dissimilar]
    log(f"dense runs: {len(runs)} at N={n_tok} in {time.time() - t_start:.1f}s")
    nb = runs[0]["mass"].shape[-1]
    S = config.sample_steps
    results = {"rows": [], "sections": {}}

    def bucket(step):
        return rep.bucket_of[step]

    # ---- recall per layer and output error, at every density ------------------------------
    grid = defaultdict(list)        # (kind, density) -> per-target dicts
    per_layer = defaultdict(list)   # (kind, density, layer) -> recalls
    split_rows = defaultdict(list)
    maps_by_density = {}
    for density in config.densities:
        maps = rep.source_maps(runs, tgt_idx, sim_idx, dis_idx, pop_idx, density, size)
        maps_by_density[density] = maps
        for ti, t in enumerate(tgt_idx):
            run = runs[t]
            for kind in KINDS:
                layer_recalls = []
                for layer in range(rep.L):
                    vals = []
                    for step in range(S):
                        mass = run["mass"][step, layer]
                        if kind == "online":
                            m = top_blocks(run["scores"][step][layer], density)
                        else:
                            m = maps[ti][kind][bucket(step), layer]
                        vals.append(recall_of(mass, m, n_tok, rep.bs))
                    layer_recalls.append(_mean(vals))
                    per_layer[(kind, density, layer)].append(layer_recalls[-1])
                grid[(kind, density)].append({"recall": _mean(layer_recalls)})
            # common vs request-specific split (bucket-mean mass of the target)
            for layer in range(rep.L):
                for b in range(len(config.step_buckets)):
                    split_rows[density].append(split_common_specific(
                        maps[ti]["oracle"][b, layer], maps[ti]["population"][b, layer],
                        run["bucket_mass"][b, layer], n_tok, rep.bs))
    log(f"recall done at {time.time() - t_start:.1f}s")

    # output error at the table density (and the neighbouring ones)
    err = defaultdict(list)
    err_densities = [d for d in config.densities if abs(d - config.table_density) < 1e-9] or [config.densities[0]]
    for density in err_densities:
        maps = maps_by_density[density]
        for ti, t in enumerate(tgt_idx):
            for (step, layer), (q, k, v, heads) in runs[t]["qkv"].items():
                for kind in KINDS:
                    if kind == "online":
                        m = top_blocks(block_scores(q, k, heads, rep.bs)[0], density)
                    else:
                        m = maps[ti][kind][bucket(step), layer]
                    e = sparse_output_error(q.float(), k.float(), v.float(), m[None], heads, rep.bs).overall
                    err[(kind, density)].append(e)
                    err[(kind, density, layer)].append(e)
    log(f"output error done at {time.time() - t_start:.1f}s")

    # ---- sparse sampling: PSNR / SSIM vs dense, same noise ------------------------------------
    def map_fn(kind, ti, density, select=None):
        maps = maps_by_density.get(density)
        if kind == "online":
            def fn(step, layer, q, k, heads, e):
                scores = block_scores(q, k, heads, rep.bs)[0]
                return select(scores) if select else top_blocks(scores, density)
            return fn
        if kind == "all_blocks":
            return lambda step, layer, q, k, heads, e: torch.ones(rep.H, nb, nb, dtype=torch.bool, device=q.device)
        if select is not None:
            source = {"oracle": tgt_idx[ti], "reused_similar": sim_idx[ti], "reused_dissimilar": dis_idx[ti]}[kind]
            chosen = select(runs[source]["bucket_mass"])
            return lambda step, layer, q, k, heads, e: chosen[bucket(step), layer]
        table = maps[ti][kind]
        return lambda step, layer, q, k, heads, e: table[bucket(step), layer]

    def target_quality(cache, kind, ti, density):
        """(PSNR, SSIM) of one target with one mask source (main-grid warm-up), sampled if not yet."""
        key = (kind, density, ti)
        if key not in cache:
            if density not in maps_by_density:
                maps_by_density[density] = rep.source_maps(runs, tgt_idx, sim_idx, dis_idx, pop_idx, density, size)
            finals = rep.sparse_run(runs[tgt_idx[ti]], [map_fn(kind, ti, density)], [config.warmup_dense_steps])
            cache[key] = compare(ti, finals, [kind])[kind]
        return cache[key]

    def compare(ti, finals, labels):
        ref = runs[tgt_idx[ti]]["final"].float()
        out = {}
        for e, label in enumerate(labels):
            x = finals[e:e + 1].float()
            out[label] = (float(psnr(ref, x)[0]), float(ssim(ref, x)[0]))
        return out

    k_s = min(config.sample_targets or len(tgt_idx), len(tgt_idx))
    sampled = spread_picks(len(tgt_idx), k_s)  # targets that get sampling runs (PSNR / SSIM)
    quality = defaultdict(list)
    per_target_quality = {}  # (kind, density, ti) -> (psnr, ssim), main-grid warm-up
    floor = []
    sample_densities = [d for d in config.densities
                        if not config.sample_densities or any(abs(d - x) < 1e-9 for x in config.sample_densities)]
    for density in sample_densities:
        if rep.time_left() < 25:
            rep.skipped.append(f"sparse sampling at density {density} and above (time)")
            break
        for ti in sampled:
            kinds = list(KINDS) + (["all_blocks"] if density == sample_densities[0] and ti == sampled[0] else [])
            fns = [map_fn(k, ti, density) for k in kinds]
            finals = rep.sparse_run(runs[tgt_idx[ti]], fns, [config.warmup_dense_steps] * len(fns))
            res = compare(ti, finals, kinds)
            for kind in KINDS:
                quality[(kind, density)].append(res[kind])
                per_target_quality[(kind, density, ti)] = res[kind]
            if "all_blocks" in res:
                floor.append(res["all_blocks"])
    log(f"sparse sampling done at {time.time() - t_start:.1f}s")

    # rows of the main grid
    for density in config.densities:
        oracle_recall = _mean([g["recall"] for g in grid[("oracle", density)]])
        oracle_psnr = _mean([q[0] for q in quality.get(("oracle", density), [])])
        for kind in KINDS:
            rec = _mean([g["recall"] for g in grid[(kind, density)]])
            qs = quality.get((kind, density), [])
            p = _mean([q[0] for q in qs])
            row = {"section": "grid", "mask_kind": kind, "density": density, "recall": rec,
                   "recall_vs_oracle": rec / oracle_recall if rec is not None and oracle_recall else None,
                   "psnr_db": p, "ssim": _mean([q[1] for q in qs]),
                   "psnr_vs_oracle_db": (p - oracle_psnr) if p is not None and oracle_psnr is not None else None,
                   "output_error": _mean(err.get((kind, density), [])) if (kind, density) in err else None,
                   "shape": shape, "N": n_tok, "batch": 1, "targets": len(tgt_idx), "sampled_targets": len(sampled),
                   "warmup_dense_steps": config.warmup_dense_steps, "steps": S}
            results["rows"].append(row)
    for (kind, density, layer), vals in sorted(per_layer.items(), key=lambda kv: (kv[0][1], KINDS.index(kv[0][0]), kv[0][2])):
        if abs(density - config.table_density) > 1e-9:
            continue
        oracle = _mean(per_layer[("oracle", density, layer)])
        rec = _mean(vals)
        results["rows"].append({"section": "per_layer", "mask_kind": kind, "density": density, "layer": layer,
                                "recall": rec, "recall_vs_oracle": rec / oracle if oracle else None,
                                "output_error": _mean(err.get((kind, density, layer), [])) if (kind, density, layer) in err else None,
                                "shape": shape, "N": n_tok})
    for density, rows in split_rows.items():
        row = {k: _mean([r[k] for r in rows]) for k in rows[0]}
        row["request_specific_recall_gain"] = row["recall_oracle"] - row["recall_common_part"]
        row["oracle_gain_over_prior"] = row["recall_oracle"] - row["recall_prior"]
        results["rows"].append({"section": "split", "mask_kind": "oracle", "density": density, "shape": shape,
                                "N": n_tok, **row})
    if floor:
        results["rows"].append({"section": "numerical_floor", "mask_kind": "all_blocks", "density": 1.0,
                                "psnr_db": _mean([f[0] for f in floor]), "ssim": _mean([f[1] for f in floor]),
                                "shape": shape, "N": n_tok,
                                "note": "every block kept, block-sparse kernel vs dense SDPA: the numerical floor"})

    # ---- dense warm-up sweep ---------------------------------------------------------------------
    td = config.table_density
    if td in maps_by_density and rep.time_left() > 20:
        wrows = defaultdict(list)
        for ti in sampled:
            kinds = ["oracle", "reused_similar", "online"]
            fns, warm, labels = [], [], []
            for w in config.warmup_sweep:
                for kind in kinds:
                    fns.append(map_fn(kind, ti, td))
                    warm.append(w)
                    labels.append((kind, w))
            finals = rep.sparse_run(runs[tgt_idx[ti]], fns, warm)
            res = compare(ti, finals, labels)
            for label, v in res.items():
                wrows[label].append(v)
        for (kind, w), vals in sorted(wrows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            results["rows"].append({"section": "warmup", "mask_kind": kind, "density": td, "warmup_dense_steps": w,
                                    "psnr_db": _mean([v[0] for v in vals]), "ssim": _mean([v[1] for v in vals]),
                                    "shape": shape, "N": n_tok, "steps": S})
    else:
        rep.skipped.append("dense warm-up sweep (time)")
    log(f"warm-up sweep done at {time.time() - t_start:.1f}s")

    # ---- dense-layers sweep (reused_similar, main-grid warm-up) ------------------------------------
    if config.dense_layers_sweep and rep.time_left() > 20:
        results["rows"].extend(dense_layers_rows(rep, [(runs[tgt_idx[ti]], runs[sim_idx[ti]]) for ti in sampled]))
    elif config.dense_layers_sweep:
        rep.skipped.append("dense-layers sweep (time)")
    log(f"dense-layers sweep done at {time.time() - t_start:.1f}s")

    # ---- top-p sweep (no density bounds) --------------------------------------------------------
    if config.top_p_sweep and rep.time_left() > 20:
        prow = defaultdict(list)
        for ti in sampled:
            fns, labels = [], []
            for top_p in config.top_p_sweep:
                sel = lambda mass, p=top_p: select_blocks(mass, top_p=p)  # noqa: E731
                for kind in ("oracle", "reused_similar", "online"):
                    fns.append(map_fn(kind, ti, None, select=sel))
                    labels.append((kind, top_p))
            finals = rep.sparse_run(runs[tgt_idx[ti]], fns, [config.warmup_dense_steps] * len(fns))
            res = compare(ti, finals, labels)
            run = runs[tgt_idx[ti]]
            for (kind, top_p), v in res.items():
                dens, recs = [], []
                for step in range(S):
                    for layer in range(rep.L):
                        if kind == "online":
                            m = select_blocks(run["scores"][step][layer], top_p=top_p)
                        else:
                            src = {"oracle": tgt_idx[ti], "reused_similar": sim_idx[ti]}[kind]
                            m = select_blocks(runs[src]["bucket_mass"][bucket(step), layer], top_p=top_p)
                        dens.append(float(m.float().mean()))
                        recs.append(recall_of(run["mass"][step, layer], m, n_tok, rep.bs))
                prow[(kind, top_p)].append((v[0], v[1], _mean(dens), _mean(recs), min(dens), max(dens)))
        for (kind, top_p), vals in sorted(prow.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            results["rows"].append({"section": "top_p", "mask_kind": kind, "top_p": top_p,
                                    "density": _mean([v[2] for v in vals]), "recall": _mean([v[3] for v in vals]),
                                    "psnr_db": _mean([v[0] for v in vals]), "ssim": _mean([v[1] for v in vals]),
                                    "density_min_layer_step": min(v[4] for v in vals),
                                    "density_max_layer_step": max(v[5] for v in vals),
                                    "shape": shape, "N": n_tok})
    else:
        rep.skipped.append("top-p sweep (time)")
    log(f"top-p sweep done at {time.time() - t_start:.1f}s")

    # ---- signature threshold sweep --------------------------------------------------------------
    try:
        if td not in maps_by_density or rep.time_left() < 15:
            raise TimeoutError("time")
        sig_mod = load_signature_module()

        def signature(request):
            t = generate_request(request)
            return sig_mod.build_signature(clip_vision=t.clip_vision[None], text=t.text[None], start_latent=t.first_frame)

        bank_idx = sim_idx + pop_idx  # entries recorded from earlier requests
        bank_sigs = [signature(runs[i]["request"]) for i in bank_idx]
        matches = []
        for ti, t in enumerate(tgt_idx):
            sig = signature(runs[t]["request"])
            sims = [sig.similarity(b)[0] for b in bank_sigs]
            best = max(range(len(sims)), key=lambda j: sims[j])
            entry = bank_idx[best]
            # The grid's PSNR at td may be missing (sparse sampling skipped for time, or td not in
            # sample_densities): indexing the grid's per-target lists then raised IndexError.
            if ti not in sampled:  # hit / family statistics only
                p_miss = p_hit = None
            elif entry == sim_idx[ti]:
                p_miss = target_quality(per_target_quality, "online", ti, td)[0]
                p_hit = target_quality(per_target_quality, "reused_similar", ti, td)[0]
            else:
                p_miss = target_quality(per_target_quality, "online", ti, td)[0]
                table = top_blocks(runs[entry]["bucket_mass"], td)
                fn = lambda step, layer, q, k, heads, e, table=table: table[bucket(step), layer]  # noqa: E731
                finals = rep.sparse_run(runs[t], [fn], [config.warmup_dense_steps])
                p_hit = compare(ti, finals, ["m"])["m"][0]
            same_family = (runs[entry]["request"].template == runs[t]["request"].template
                           and runs[entry]["request"].layout == runs[t]["request"].layout)
            sims_sorted = sorted(sims, reverse=True)
            matches.append({"similarity": sims[best], "second": sims_sorted[1] if len(sims) > 1 else None,
                            "psnr_hit": p_hit, "psnr_miss": p_miss, "same_family": same_family,
                            "similar_source_similarity": sims[bank_idx.index(sim_idx[ti])],
                            "best_other_family_similarity": max(
                                (s for j, s in enumerate(sims)
                                 if not (runs[bank_idx[j]]["request"].template == runs[t]["request"].template
                                         and runs[bank_idx[j]]["request"].layout == runs[t]["request"].layout)),
                                default=None)})
        for threshold in config.thresholds:
            hits = [m for m in matches if m["similarity"] >= threshold]
            results["rows"].append({
                "section": "threshold", "threshold": threshold, "density": td, "hit_rate": len(hits) / len(matches),
                "hit_same_family_share": (sum(m["same_family"] for m in hits) / len(hits)) if hits else None,
                "psnr_db": _mean([m["psnr_hit"] if m["similarity"] >= threshold else m["psnr_miss"] for m in matches]),
                "psnr_hits_db": _mean([m["psnr_hit"] for m in hits]), "mask_kind": "bank_top1_else_online",
                "shape": shape, "N": n_tok})
        results["sections"]["matches"] = matches
    except Exception as exc:  # noqa: BLE001
        rep.skipped.append(f"threshold sweep ({type(exc).__name__}: {exc})")
    log(f"threshold sweep done at {time.time() - t_start:.1f}s")

    # ---- step-bucket study -------------------------------------------------------------------------
    if config.bucket_study_targets > 0:
        try:
            results["rows"].extend(bucket_study(rep, runs, tgt_idx, sim_idx, sparse_run=rep.sparse_run,
                                                compare=compare))
        except Exception as exc:  # noqa: BLE001
            rep.skipped.append(f"step-bucket study ({type(exc).__name__}: {exc})")
        log(f"step-bucket study done at {time.time() - t_start:.1f}s")

    # ---- recall vs density at each sequence length ------------------------------------------------
    for lsize in config.length_sizes:
        lsize = tuple(lsize)
        if rep.time_left() < 8:
            rep.skipped.append(f"length {size_name(lsize)} (time)")
            continue
        results["rows"].extend(length_rows(rep, lsize))
    log(f"lengths done at {time.time() - t_start:.1f}s")
    results["skipped"] = rep.skipped
    results["report_seconds"] = round(time.time() - t_start, 1)
    return results


def spread_picks(n: int, k: int) -> list:
    """``k`` indices of ``range(n)`` spread evenly (first and last included)."""
    return sorted({round(i * (n - 1) / max(1, k - 1)) for i in range(k)}) if k > 1 else [0]


def load_default_bucket_edges() -> tuple:
    """``chorus_core.bank.records.DEFAULT_BUCKET_EDGES`` without the bank's optional imports."""
    try:
        from chorus_core.bank.records import DEFAULT_BUCKET_EDGES  # noqa: PLC0415

        return tuple(DEFAULT_BUCKET_EDGES)
    except Exception:  # noqa: BLE001
        import ast

        path = Path(__file__).resolve().parents[2] / "chorus_core" / "bank" / "records.py"
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "DEFAULT_BUCKET_EDGES":
                return tuple(ast.literal_eval(node.value))
        raise


def buckets_from_edges(steps: int, edges) -> list:
    """Step lists of buckets cut at ``round(edge * steps)`` (as ``bank.records.default_step_buckets``)."""
    cuts = sorted({min(steps, max(0, round(e * steps))) for e in edges})
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:]) if b > a]


def equal_buckets(steps: int, n: int) -> list:
    return buckets_from_edges(steps, [i / n for i in range(n + 1)])


def bucket_splits(steps: int, configured=None) -> dict:
    """The step splits the bucket study compares: name -> list of step lists."""
    splits = {"1 bucket": equal_buckets(steps, 1), "2 equal": equal_buckets(steps, 2),
              "3 default (25/35/40 %)": buckets_from_edges(steps, load_default_bucket_edges()),
              "3 equal": equal_buckets(steps, 3), "4 equal": equal_buckets(steps, 4),
              f"per step ({steps})": equal_buckets(steps, steps)}
    if configured:
        configured = [list(b) for b in configured]
        if all(configured != v for v in splits.values()):
            splits["testbed config"] = configured
    return splits


def cross_step_recall(target_mass: torch.Tensor, source_mass: torch.Tensor, density: float, seq_len: int,
                      block_size: int) -> torch.Tensor:
    """``R[i, j]``: recall at step j of the target of the top-``density`` mask of the source's step i,
    mean over layers. Masses ``[S, L, H, nb, nb]``."""
    S, L = target_mass.shape[:2]
    masks = top_blocks(source_mass, density)  # [S, L, H, nb, nb]
    out = torch.zeros(S, S)
    for i in range(S):
        for j in range(S):
            out[i, j] = _mean([recall_of(target_mass[j, layer], masks[i, layer], seq_len, block_size)
                               for layer in range(L)])
    return out


def split_recall(target_mass: torch.Tensor, source_mass: torch.Tensor, buckets: list, density: float, seq_len: int,
                 block_size: int, from_step: int = 0) -> float:
    """Mean recall (steps >= ``from_step``, layers) of per-bucket masks from the bucket-mean source mass."""
    L = target_mass.shape[1]
    vals = []
    for steps in buckets:
        m = top_blocks(source_mass[steps].mean(0), density)  # [L, H, nb, nb]
        for j in steps:
            if j >= from_step:
                vals.extend(recall_of(target_mass[j, layer], m[layer], seq_len, block_size) for layer in range(L))
    return _mean(vals)


def bucket_study(rep: Report, runs: list, tgt_idx: list, sim_idx: list, sparse_run=None, compare=None) -> list:
    """Rows of the step-bucket study: cross-step recall matrices and bucket splits by recall (and PSNR)."""
    config = rep.config
    S = config.sample_steps
    density = config.bucket_study_density or config.table_density
    k = min(config.bucket_study_targets, len(tgt_idx))
    picks = spread_picks(len(tgt_idx), k)
    req = runs[tgt_idx[0]]["request"]
    size = (req.frames, req.height, req.width)
    n_tok, shape = tokens_of(size), size_name(size)
    rows = []
    # cross-step matrices (oracle: the target's own step i; reused: the similar source's step i)
    for kind in ("oracle", "reused_similar"):
        mats = []
        for ti in picks:
            t_mass = runs[tgt_idx[ti]]["mass"]
            s_mass = t_mass if kind == "oracle" else runs[sim_idx[ti]]["mass"]
            mats.append(cross_step_recall(t_mass, s_mass, density, n_tok, rep.bs))
        mat = torch.stack(mats).mean(0)
        rows.append({"section": "cross_step", "mask_kind": kind, "density": density, "shape": shape, "N": n_tok,
                     "targets": len(picks), "steps": S, "matrix": [[round(float(x), 4) for x in r] for r in mat]})
    # splits
    splits = bucket_splits(S, config.step_buckets)
    warm = config.warmup_dense_steps
    psnrs = defaultdict(list)
    if config.bucket_study_psnr and sparse_run is not None:
        names = list(splits)
        for ti in picks:
            fns = []
            for name in names:
                s_mass = runs[sim_idx[ti]]["mass"]
                step_map = {}
                for steps in splits[name]:
                    m = top_blocks(s_mass[steps].mean(0), density)
                    for j in steps:
                        step_map[j] = m
                fns.append(lambda step, layer, q, kk, heads, e, step_map=step_map: step_map[step][layer])
            finals = sparse_run(runs[tgt_idx[ti]], fns, [warm] * len(fns))
            res = compare(ti, finals, names)
            for name in names:
                psnrs[name].append(res[name])
    for name, buckets in splits.items():
        row = {"section": "step_buckets", "split": name, "buckets": buckets, "n_buckets": len(buckets),
               "density": density, "shape": shape, "N": n_tok, "targets": len(picks), "steps": S,
               "warmup_dense_steps": warm}
        for kind in ("oracle", "reused_similar"):
            for label, start in (("", 0), ("_after_warmup", warm)):
                row[f"recall_{kind}{label}"] = _mean([
                    split_recall(runs[tgt_idx[ti]]["mass"],
                                 runs[tgt_idx[ti]]["mass"] if kind == "oracle" else runs[sim_idx[ti]]["mass"],
                                 buckets, density, n_tok, rep.bs, start) for ti in picks])
        row["recall"] = row["recall_reused_similar_after_warmup"]
        row["mask_kind"] = "reused_similar"
        if psnrs.get(name):
            row["psnr_db"] = _mean([v[0] for v in psnrs[name]])
            row["ssim"] = _mean([v[1] for v in psnrs[name]])
        rows.append(row)
    return rows


def resolve_layers(layers, num_layers: int) -> tuple:
    """Layer indices (negative = from the end) -> sorted distinct indices in ``range(num_layers)``."""
    return tuple(sorted({int(l) % num_layers for l in layers}))


def dense_share(num_steps: int, num_layers: int, warmup: int, dense_layers, sparse_density: float) -> dict:
    """Share of attention that stays dense: of the (step, layer) calls, and of the attention cost
    (kept blocks over all blocks, the sparse calls counting their mean map density)."""
    calls = num_steps * num_layers
    dense_calls = min(warmup, num_steps) * num_layers + max(0, num_steps - warmup) * len(dense_layers)
    share = dense_calls / calls
    return {"dense_call_share": share, "attention_cost_share": share + (1 - share) * sparse_density}


def dense_layers_rows(rep: Report, pairs: list, density: Optional[float] = None, warmup: Optional[int] = None,
                      sweep=None) -> list:
    """Dense-layers sweep: per (target run, similar-source run) pair one batched sampling run with the
    source's reused masks (top ``density`` of its bucket-mean block mass) after ``warmup`` dense steps,
    one element per layer set of ``sweep`` (those layers dense at every step); PSNR/SSIM of the final
    latents vs the target's dense run (same noise). Rows: one per layer set, mean over pairs."""
    config = rep.config
    density = density or config.dense_layers_density or config.table_density
    warmup = config.warmup_dense_steps if warmup is None else warmup
    sets = [resolve_layers(s, rep.L) for s in (config.dense_layers_sweep if sweep is None else sweep)]
    sets = list(dict.fromkeys(sets))
    S = config.sample_steps
    req = pairs[0][0]["request"]
    size = (req.frames, req.height, req.width)
    n_tok, shape = tokens_of(size), size_name(size)
    vals = defaultdict(list)
    for target, source in pairs:
        table = top_blocks(source["bucket_mass"], density)  # [Bk, L, H, nb, nb]
        full = torch.ones_like(table[0, 0])
        fns = [lambda step, layer, q, k, heads, e, d=d, full=full, table=table:
               (full if layer in d else table[rep.bucket_of[step], layer]) for d in sets]
        finals = rep.sparse_run(target, fns, [warmup] * len(fns))
        ref = target["final"].float()
        for e, d in enumerate(sets):
            x = finals[e:e + 1].float()
            kept = _mean([float(table[rep.bucket_of[step], layer].float().mean())
                          for step in range(warmup, S) for layer in range(rep.L) if layer not in d])
            vals[d].append((float(psnr(ref, x)[0]), float(ssim(ref, x)[0]), kept))
    rows = []
    for d in sets:
        v = vals[d]
        kept = _mean([x[2] for x in v])
        rows.append({"section": "dense_layers", "mask_kind": "reused_similar", "density": density,
                     "dense_layers": list(d), "warmup_dense_steps": warmup,
                     "psnr_db": _mean([x[0] for x in v]), "ssim": _mean([x[1] for x in v]),
                     "psnr_db_per_target": [round(x[0], 3) for x in v],
                     **dense_share(S, rep.L, warmup, d, kept if kept is not None else 0.0),
                     "shape": shape, "N": n_tok, "targets": len(pairs), "steps": S, "num_layers": rep.L})
    return rows


def dense_layers_sweep(model, config: TestbedConfig, device: str, log=print, dense_attention: str = "comfyui") -> dict:
    """The dense-layers sweep on its own: dense runs of the sampled targets and their similar sources
    (the same requests and noise as ``run_report``), then ``dense_layers_rows``."""
    rep = Report(model, config, device, log)
    if dense_attention != "comfyui":
        rep.dense_override = SDPAAttention()
    size = tuple(config.long_size)
    t_start = time.time()
    targets, similar, _, population = eval_requests(config, size)
    k_s = min(config.sample_targets or len(targets), len(targets))
    pairs = []
    for ti in spread_picks(len(targets), k_s):
        source = rep.dense_run(similar[ti], ti)  # run_report's indices: similar, population, targets
        target = rep.dense_run(targets[ti], len(similar) + len(population) + ti)
        pairs.append((target, source))
        log(f"dense runs of target {ti} done at {time.time() - t_start:.1f}s")
    rows = dense_layers_rows(rep, pairs)
    log(f"dense-layers sweep done at {time.time() - t_start:.1f}s")
    return {"rows": rows, "report_seconds": round(time.time() - t_start, 1)}


def length_rows(rep: Report, size) -> list:
    """Recall vs density from single forwards at noised ground truth (sigmas), several kinds."""
    config = rep.config
    targets, similar, dissimilar, _ = eval_requests(config, size)
    k = min(config.length_targets, len(targets))
    picks = [round(i * (len(targets) - 1) / max(1, k - 1)) for i in range(k)] if k > 1 else [0]
    n_tok = tokens_of(size)
    static = static_window_scores(size, rep.bs, rep.H).to(rep.device)

    def forward_mass(request, index, with_scores=False):
        batch = make_batch([request]).to(rep.device)
        g = torch.Generator().manual_seed(config.seed_report * 77 + index)
        noise = torch.randn(batch.x0.shape, generator=g).to(rep.device)
        masses, scores = [], []
        for sigma in config.length_sigmas:
            rec = Recorder(1, rep.L, rep.bs, with_scores)
            hook = rep.hook()
            hook.observe = rec
            x_t = (1 - sigma) * batch.x0 + sigma * noise
            with torch.no_grad(), torch.autocast(rep.device if rep.device != "cpu" else "cpu", dtype=torch.bfloat16,
                                                 enabled=rep.autocast):
                predict_velocity(rep.model, x_t, torch.full((1,), sigma, device=rep.device), batch, hook.options())
            masses.append(rec.stacked_mass()[0])
            if with_scores:
                scores.append(torch.stack(rec.scores[0]))
        return torch.stack(masses), (torch.stack(scores) if with_scores else None)  # [Sg, L, H, nb, nb]

    acc = defaultdict(list)
    for i in picks:
        t_mass, t_scores = forward_mass(targets[i], i, True)
        s_mass, _ = forward_mass(similar[i], 100 + i)
        d_req = similar[dissimilar[i]]
        d_mass, _ = forward_mass(d_req, 200 + i)
        for density in config.densities:
            for kind, source in (("oracle", t_mass), ("reused_similar", s_mass), ("reused_dissimilar", d_mass),
                                 ("online", t_scores), ("static", None)):
                vals = []
                for g in range(t_mass.shape[0]):
                    for layer in range(rep.L):
                        m = top_blocks(static if source is None else source[g, layer], density)
                        vals.append(recall_of(t_mass[g, layer], m, n_tok, rep.bs))
                acc[(kind, density)].append(_mean(vals))
    rows = []
    for density in config.densities:
        oracle = _mean(acc[("oracle", density)])
        for kind in ("oracle", "reused_similar", "reused_dissimilar", "online", "static"):
            rec = _mean(acc[(kind, density)])
            rows.append({"section": "length", "mask_kind": kind, "density": density, "recall": rec,
                         "recall_vs_oracle": rec / oracle if oracle else None, "shape": size_name(size), "N": n_tok,
                         "targets": len(picks), "sigmas": list(config.length_sigmas)})
    return rows


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def summarize(results: dict, config: TestbedConfig) -> dict:
    rows = results["rows"]
    grid = [r for r in rows if r["section"] == "grid"]
    td = config.table_density
    at = {r["mask_kind"]: r for r in grid if abs(r["density"] - td) < 1e-9}
    summary = {"table_density": td, "density_for_30db": {}, "targets": {}}
    for kind in KINDS:
        summary["density_for_30db"][kind] = first_density_reaching([r for r in grid if r["mask_kind"] == kind],
                                                                   "psnr_db", 30.0)
    sim, orc = at.get("reused_similar"), at.get("oracle")
    if sim and orc:
        others = [at[k] for k in ("reused_dissimilar", "online", "static") if k in at]
        summary["targets"] = {
            "similar_recall_vs_oracle_ge_0.95": (sim["recall_vs_oracle"] or 0) >= 0.95,
            "similar_recall_vs_oracle": sim["recall_vs_oracle"],
            "similar_within_1db_of_oracle": (sim["psnr_vs_oracle_db"] is not None and sim["psnr_vs_oracle_db"] >= -1.0),
            "similar_psnr_minus_oracle_db": sim["psnr_vs_oracle_db"],
            "similar_ahead_of_dissimilar_online_static_recall": all(
                (sim["recall"] or 0) > (o["recall"] or 0) for o in others),
            "similar_ahead_of_dissimilar_online_static_psnr": all(
                (sim["psnr_db"] or -1e9) > (o["psnr_db"] or -1e9) for o in others),
        }
        # the same targets at every density
        per_density = []
        for density in config.densities:
            d_at = {r["mask_kind"]: r for r in grid if abs(r["density"] - density) < 1e-9}
            s, o = d_at.get("reused_similar"), d_at.get("oracle")
            if s and o and s["psnr_db"] is not None:
                per_density.append({"density": density, "recall_vs_oracle": s["recall_vs_oracle"],
                                    "psnr_minus_oracle_db": s["psnr_vs_oracle_db"]})
        summary["similar_vs_oracle_by_density"] = per_density
    # defaults from evidence
    warm = [r for r in rows if r["section"] == "warmup" and r["mask_kind"] == "reused_similar"]
    if warm:
        best = max(r["psnr_db"] for r in warm)
        # fewest warm-up steps within 0.5 dB of the best
        summary["suggested_warmup_dense_steps"] = min(r["warmup_dense_steps"] for r in warm if r["psnr_db"] >= best - 0.5)
    tp = [r for r in rows if r["section"] == "top_p" and r["mask_kind"] == "reused_similar"]
    if tp:
        ok = [r for r in tp if r["psnr_db"] is not None and r["psnr_db"] >= 30.0]
        pick = min(ok, key=lambda r: r["density"]) if ok else max(tp, key=lambda r: r["psnr_db"] or -1e9)
        summary["suggested_top_p"] = pick["top_p"]
        summary["suggested_top_p_density"] = pick["density"]
    d30 = summary["density_for_30db"].get("reused_similar")
    summary["suggested_density_bounds"] = {"min_density": d30, "max_density": 0.5} if d30 else None
    br = [r for r in rows if r["section"] == "step_buckets" and not r["split"].startswith("per step")
          and r.get("recall_reused_similar_after_warmup") is not None]
    if br:
        tol = 0.005
        best = max(r["recall_reused_similar_after_warmup"] for r in br)
        ok = [r for r in br if r["recall_reused_similar_after_warmup"] >= best - tol]
        pick = min(ok, key=lambda r: (r["n_buckets"], -r["recall_reused_similar_after_warmup"]))
        summary["suggested_step_buckets"] = {"split": pick["split"], "buckets": pick["buckets"],
                                             "tolerance_recall": tol}
    th = [r for r in rows if r["section"] == "threshold"]
    matches = results["sections"].get("matches") or []
    if th and matches:
        fam = [m["similar_source_similarity"] for m in matches]
        other = [m["best_other_family_similarity"] for m in matches if m["best_other_family_similarity"] is not None]
        summary["signature_similarity"] = {"same_family_min": min(fam), "same_family_mean": _mean(fam),
                                           "other_family_max": max(other) if other else None}
        # highest threshold that still hits every same-family pair but no other family
        # The top-1 entry is usually the target's own family, so "hits all own family" holds at every
        # threshold; the threshold matters when the family is absent from the bank: it must lie above
        # the best other-family similarity and at or below the lowest same-family one.
        top = max(other) if other else -1.0
        clean = [r["threshold"] for r in th if r["threshold"] > top and r["threshold"] <= min(fam)
                 and (r["hit_same_family_share"] or 0) >= 1.0]
        summary["suggested_threshold"] = (min(clean) if clean else None)
        summary["threshold_separating_range"] = [top, min(fam)]
    return summary


def write_plots(results: dict, config: TestbedConfig, out: Path, name: str = "quality_plots.png") -> list:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return []
    rows = results["rows"]
    colours = {"oracle": "k", "reused_similar": "tab:green", "reused_dissimilar": "tab:red", "online": "tab:blue",
               "population": "tab:purple", "static": "tab:orange"}
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    grid = [r for r in rows if r["section"] == "grid"]
    for kind in KINDS:
        rs = sorted((r for r in grid if r["mask_kind"] == kind), key=lambda r: r["density"])
        axes[0, 0].plot([r["density"] for r in rs], [r["recall"] for r in rs], "o-", color=colours[kind], label=kind)
        rp = [r for r in rs if r["psnr_db"] is not None]
        axes[0, 1].plot([r["density"] for r in rp], [r["psnr_db"] for r in rp], "o-", color=colours[kind], label=kind)
    n = grid[0]["N"] if grid else 0
    axes[0, 0].set(title=f"attention recall vs density (N={n}, sampled runs)", xlabel="density", ylabel="recall")
    axes[0, 1].axhline(30, color="grey", ls=":")
    axes[0, 1].set(title=f"final-latent PSNR vs dense (N={n})", xlabel="density", ylabel="PSNR dB")
    axes[0, 0].legend(fontsize=8)
    axes[0, 1].legend(fontsize=8)
    # lengths
    lens = [r for r in rows if r["section"] == "length"]
    styles = ["-", "--", ":", "-."]
    for li, shape in enumerate(sorted({r["shape"] for r in lens}, key=lambda s: next(r["N"] for r in lens if r["shape"] == s))):
        for kind in ("oracle", "reused_similar", "online", "static"):
            rs = sorted((r for r in lens if r["shape"] == shape and r["mask_kind"] == kind), key=lambda r: r["density"])
            axes[0, 2].plot([r["density"] for r in rs], [r["recall"] for r in rs], styles[li % 4], color=colours[kind],
                            label=f"{kind} {shape}")
    axes[0, 2].set(title="recall vs density at each length (noised targets)", xlabel="density", ylabel="recall")
    axes[0, 2].legend(fontsize=6, ncol=2)
    # per layer
    pl = [r for r in rows if r["section"] == "per_layer"]
    width = 0.13
    for i, kind in enumerate(KINDS):
        rs = sorted((r for r in pl if r["mask_kind"] == kind), key=lambda r: r["layer"])
        axes[1, 0].bar([r["layer"] + (i - 2.5) * width for r in rs], [r["recall"] for r in rs], width,
                       color=colours[kind], label=kind)
    axes[1, 0].set(title=f"recall per layer at density {config.table_density}", xlabel="layer", ylabel="recall")
    axes[1, 0].set_ylim(0, 1)
    # warm-up and top-p
    warm = [r for r in rows if r["section"] == "warmup"]
    for kind in ("oracle", "reused_similar", "online"):
        rs = sorted((r for r in warm if r["mask_kind"] == kind), key=lambda r: r["warmup_dense_steps"])
        axes[1, 1].plot([r["warmup_dense_steps"] for r in rs], [r["psnr_db"] for r in rs], "o-", color=colours[kind],
                        label=f"warm-up: {kind}")
    tp = [r for r in rows if r["section"] == "top_p"]
    ax2 = axes[1, 1]
    axes[1, 1].set(title=f"PSNR vs dense warm-up steps (density {config.table_density})", xlabel="dense steps first",
                   ylabel="PSNR dB")
    axes[1, 1].legend(fontsize=8)
    for kind in ("oracle", "reused_similar", "online"):
        rs = sorted((r for r in tp if r["mask_kind"] == kind), key=lambda r: r["top_p"])
        axes[1, 2].plot([r["density"] for r in rs], [r["psnr_db"] for r in rs], "s--", color=colours[kind],
                        label=f"top-p {kind}")
        for r in rs:
            axes[1, 2].annotate(f"{r['top_p']}", (r["density"], r["psnr_db"]), fontsize=6)
    th = [r for r in rows if r["section"] == "threshold"]
    if th:
        ax3 = axes[1, 2].twiny()
        ax3.plot([r["threshold"] for r in th], [r["psnr_db"] for r in th], "^-", color="tab:gray", label="threshold")
        ax3.set_xlabel("signature threshold (grey triangles: mean PSNR, hit else online)")
    axes[1, 2].set(title="top-p selection: PSNR vs achieved density", xlabel="density", ylabel="PSNR dB")
    axes[1, 2].legend(fontsize=8)
    del ax2
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path.name]


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                import os

                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except Exception:  # noqa: BLE001
        pass
    return "cpu"


def sampler_text(config: TestbedConfig, device: str) -> str:
    return (f"Euler flow sampler, {config.sample_steps} steps, shift {config.sample_shift}, cfg 1, "
            + ("bf16 autocast" if device != "cpu" else "float32 on CPU (sparse calls: SDPA with the block map as a token mask)")
            + "; attention swapped by a direct optimized_attention_override")


def write_outputs(results: dict, config: TestbedConfig, out: Path, device: str, command: str, train_info=None,
                  suffix: str = "", doc_base=None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(results, config)
    machine = torch.cuda.get_device_name() if device != "cpu" else cpu_name()
    doc = {"benchmark": "testbed_quality", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine, "command": command, "git_commit": git_commit(), "summary": summary,
           "skipped": results.get("skipped", []), "report_seconds": results.get("report_seconds"),
           "model": {"dim": config.dim, "ffn_dim": config.ffn_dim, "num_layers": config.num_layers,
                     "heads": config.num_heads, "block_size": config.block_size},
           "sampler": sampler_text(config, device),
           "matches": results["sections"].get("matches"), "dense_attention": results.get("dense_attention", "comfyui"),
           "rows": results["rows"]}
    if train_info:
        doc["training"] = {k: train_info[k] for k in ("steps", "train_seconds", "machine", "training_attention")
                           if k in train_info}
        log = train_info.get("log") or []
        longs = [h["loss"] for h in log if h["size"] == "long"]
        if longs:
            doc["training"]["final_long_loss_mean_of_10"] = sum(longs[-10:]) / len(longs[-10:])
            doc["training"]["first_long_loss"] = longs[0]
    if doc_base:  # re-rendering: keep when / where / how the numbers were measured
        doc.update({k: doc_base[k] for k in ("date", "command", "git_commit", "training") if k in doc_base})
        if doc_base.get("machine") not in (None, "cpu"):
            doc["machine"] = doc_base["machine"]
    doc["config"] = json.loads(config.to_json())
    (out / f"testbed_quality{suffix}.json").write_text(json.dumps(doc, indent=1, default=float))
    plots = write_plots(results, config, out, f"quality_plots{suffix}.png")
    md = markdown(doc, config, plots)
    (out / f"testbed_quality{suffix}.md").write_text(md)
    (out / f"REPORT{suffix.upper()}.md").write_text(md)
    return doc


def append_section(results: dict, section: str, config: TestbedConfig, out: Path, device: str, command: str,
                   suffix: str = "") -> dict:
    """Put one sweep's rows (run on its own) into OUT/testbed_quality{suffix}.json in place of that
    section's rows, record when / how under ``runs_on_their_own``, re-render the .md."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"testbed_quality{suffix}.json"
    when = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    machine = torch.cuda.get_device_name() if device != "cpu" else cpu_name()
    if path.exists():
        doc = json.loads(path.read_text())
    else:
        doc = {"benchmark": "testbed_quality", "date": when, "machine": machine, "command": command,
               "git_commit": git_commit(), "summary": {}, "rows": [],
               "sampler": sampler_text(config, device), "config": json.loads(config.to_json())}
    doc["rows"] = [r for r in doc["rows"] if r.get("section") != section] + results["rows"]
    doc.setdefault("runs_on_their_own", {})[section] = {
        "date": when, "machine": machine, "command": command, "git_commit": git_commit(),
        "seconds": results.get("report_seconds"), "config": json.loads(config.to_json())}
    path.write_text(json.dumps(doc, indent=1, default=float))
    base = config_from_dict(doc["config"]) if doc.get("config") else config
    (out / f"testbed_quality{suffix}.md").write_text(markdown(doc, base, []))
    return doc


def dense_layers_table(rows: list) -> str:
    return md_table(rows, [("dense layers", lambda r: "{" + ", ".join(map(str, r["dense_layers"])) + "}"
                            if r["dense_layers"] else "none"),
                           ("dense share of attention calls", "dense_call_share"),
                           ("attention cost vs dense", "attention_cost_share"),
                           ("PSNR dB", "psnr_db"), ("SSIM", "ssim")])


def markdown(doc: dict, config: TestbedConfig, plots: list) -> str:
    rows = doc["rows"]
    s = doc["summary"]
    lines = ["# Chorus testbed: mask quality on a trained Wan2.1-I2V-architecture model\n",
             f"Generated by `{doc['command']}` on {doc['machine']} ({doc['date']}, commit {doc['git_commit'][:10]}).\n",
             f"Model: ComfyUI `WanModel` (I2V), dim {config.dim}, {config.num_layers} layers, {config.num_heads} heads x {config.head_dim}, "
             f"ffn {config.ffn_dim}."]
    if "training" in doc:
        t = doc["training"]
        lines.append(f" Trained {t.get('steps')} steps in {t.get('train_seconds')} s "
                     f"(long-size loss {_fmt(t.get('first_long_loss'))} -> {_fmt(t.get('final_long_loss_mean_of_10'))}).")
    lines.append(f"\n{doc['sampler']}. Block size {config.block_size}; step buckets {list(map(list, config.step_buckets))}; "
                 f"main grid with {config.warmup_dense_steps} dense warm-up step(s). Densities are matched: every source "
                 "keeps the same number of key blocks in every query-block row (diagonal forced). Targets are held-out "
                 f"subjects of templates {list(config.eval_templates) or 'all'} x layouts "
                 f"{list(config.eval_layouts)}; similar = same template + layout, other subject; dissimilar = other template "
                 f"and layout; population prior from layouts {list(config.population_layouts)} x those templates.\n")
    for p in plots:
        lines.append(f"![quality plots]({p})\n")
    if s.get("targets"):
        tg = s["targets"]
        lines.append("## Targets\n")
        lines.append(f"At density {s['table_density']} (N={next((r['N'] for r in rows if r['section'] == 'grid'), '?')}):\n")
        lines.append(f"- reused_similar keeps {_fmt(tg['similar_recall_vs_oracle'])} of the oracle's recall "
                     f"(target >= 0.95: {'met' if tg['similar_recall_vs_oracle_ge_0.95'] else 'NOT met'})")
        lines.append(f"- reused_similar PSNR minus oracle PSNR: {_fmt(tg['similar_psnr_minus_oracle_db'], 2)} dB "
                     f"(target within 1 dB: {'met' if tg['similar_within_1db_of_oracle'] else 'NOT met'})")
        lines.append(f"- ahead of dissimilar reuse, online and static in recall: "
                     f"{'yes' if tg['similar_ahead_of_dissimilar_online_static_recall'] else 'NO'}; in PSNR: "
                     f"{'yes' if tg['similar_ahead_of_dissimilar_online_static_psnr'] else 'NO'}")
        lines.append("- density at which each source first reaches 30 dB (of the densities tried): " + ", ".join(
            f"{k} {_fmt(v, 2) if v is not None else 'never'}" for k, v in s["density_for_30db"].items()))
        if s.get("similar_vs_oracle_by_density"):
            lines.append("\nreused_similar vs oracle at every density:\n")
            lines.append(md_table(s["similar_vs_oracle_by_density"], [("density", "density"),
                                                                      ("recall vs oracle", "recall_vs_oracle"),
                                                                      ("PSNR - oracle (dB)", "psnr_minus_oracle_db")]))
    lines.append("\n## Defaults the numbers support\n")
    lines.append(f"- dense warm-up steps: {s.get('suggested_warmup_dense_steps', '–')} (fewest within 0.5 dB of the best, "
                 f"reused_similar, density {config.table_density}, {config.sample_steps} steps)")
    lines.append(f"- top-p: {s.get('suggested_top_p', '–')} (mean density {_fmt(s.get('suggested_top_p_density'))}; "
                 "lowest-density top-p whose reused_similar PSNR reaches 30 dB)")
    lines.append(f"- density bounds: {s.get('suggested_density_bounds')}")
    lines.append(f"- signature threshold: {s.get('suggested_threshold', '–')} (lowest tried above the best other-family "
                 f"similarity and at most the lowest same-family one); similarities {s.get('signature_similarity')}")
    cols = [("kind", "mask_kind"), ("density", "density"), ("recall", "recall"), ("recall/oracle", "recall_vs_oracle"),
            ("out. err", "output_error"), ("PSNR dB", "psnr_db"), ("PSNR-oracle", "psnr_vs_oracle_db"), ("SSIM", "ssim")]
    lines.append("\n## Main grid (mean over targets)\n")
    lines.append(md_table([r for r in rows if r["section"] == "grid"], cols))
    floor = [r for r in rows if r["section"] == "numerical_floor"]
    if floor:
        lines.append(f"\nNumerical floor (every block kept through the block-sparse kernel vs dense SDPA): "
                     f"PSNR {_fmt(floor[0]['psnr_db'], 2)} dB, SSIM {_fmt(floor[0]['ssim'], 4)}.\n")
    lines.append(f"\n## Per layer at density {config.table_density}\n")
    lines.append(md_table([r for r in rows if r["section"] == "per_layer"],
                          [("kind", "mask_kind"), ("layer", "layer"), ("recall", "recall"),
                           ("recall/oracle", "recall_vs_oracle"), ("output error", "output_error")]))
    lines.append("\n## Common (population prior) vs request-specific part of the oracle mask\n")
    lines.append(md_table([r for r in rows if r["section"] == "split"],
                          [("density", "density"), ("share of oracle blocks in prior", "common_share"),
                           ("recall oracle", "recall_oracle"), ("recall of common part", "recall_common_part"),
                           ("recall added by request-specific part", "request_specific_recall_gain"),
                           ("recall prior alone", "recall_prior"), ("oracle - prior", "oracle_gain_over_prior")]))
    lines.append("\n## Recall vs density at each sequence length\n")
    lines.append("Single forwards on noised targets at sigmas " + str(list(config.length_sigmas)) + "; masks of the source "
                 "requests at the same sigma.\n")
    lines.append(md_table([r for r in rows if r["section"] == "length"],
                          [("shape", "shape"), ("N", "N"), ("kind", "mask_kind"), ("density", "density"),
                           ("recall", "recall"), ("recall/oracle", "recall_vs_oracle")]))
    lines.append("\n## Dense warm-up sweep\n")
    lines.append(md_table([r for r in rows if r["section"] == "warmup"],
                          [("kind", "mask_kind"), ("dense steps", "warmup_dense_steps"), ("density", "density"),
                           ("PSNR dB", "psnr_db"), ("SSIM", "ssim")]))
    dl_rows = [r for r in rows if r["section"] == "dense_layers"]
    if dl_rows:
        lines.append(f"\n## Dense-layers sweep (reused_similar, density {dl_rows[0]['density']}, "
                     f"{dl_rows[0]['warmup_dense_steps']} dense warm-up step(s), {dl_rows[0]['targets']} targets)\n")
        lines.append(dense_layers_table(dl_rows))
        own = (doc.get("runs_on_their_own") or {}).get("dense_layers")
        if own:
            lines.append(f"\nRun on its own: `{own['command']}` on {own['machine']} ({own['date']}, "
                         f"commit {own['git_commit'][:10]}, {own['seconds']} s).\n")
    lines.append("\n## Top-p sweep (no density bounds)\n")
    lines.append(md_table([r for r in rows if r["section"] == "top_p"],
                          [("kind", "mask_kind"), ("top-p", "top_p"), ("mean density", "density"),
                           ("min", "density_min_layer_step"), ("max", "density_max_layer_step"), ("recall", "recall"),
                           ("PSNR dB", "psnr_db"), ("SSIM", "ssim")]))
    lines.append("\n## Signature threshold sweep (bank = similar sources + population requests; "
                 "hit: top-1 entry's masks, miss: online, density " + str(config.table_density) + ")\n")
    lines.append(md_table([r for r in rows if r["section"] == "threshold"],
                          [("threshold", "threshold"), ("hit rate", "hit_rate"),
                           ("hits from own family", "hit_same_family_share"), ("PSNR dB (all)", "psnr_db"),
                           ("PSNR dB (hits)", "psnr_hits_db")]))
    bucket_rows = [r for r in rows if r["section"] == "step_buckets"]
    if bucket_rows:
        d = bucket_rows[0]["density"]
        lines.append(f"\n## Step buckets (density {d}, {bucket_rows[0]['targets']} targets, "
                     f"{bucket_rows[0]['warmup_dense_steps']} dense warm-up step(s))\n")
        lines.append("Each bucket's mask = top blocks of the bucket-mean block mass (of the target itself: oracle; of "
                     "the similar request: reused), applied at every step of the bucket. Recall: mean over steps "
                     "(all, or after the dense warm-up), layers and targets. PSNR/SSIM: a sampling run per split with "
                     "the reused_similar masks.\n")
        lines.append(md_table(bucket_rows, [
            ("split", "split"), ("buckets", lambda r: " ".join(f"{b[0]}-{b[-1]}" for b in r["buckets"])),
            ("recall oracle", "recall_oracle"), ("oracle after warm-up", "recall_oracle_after_warmup"),
            ("recall reused", "recall_reused_similar"), ("reused after warm-up", "recall_reused_similar_after_warmup"),
            ("PSNR dB (reused)", "psnr_db"), ("SSIM", "ssim")]))
        if s.get("suggested_step_buckets"):
            sb = s["suggested_step_buckets"]
            lines.append(f"\nFewest buckets within {sb['tolerance_recall']} recall (reused, after warm-up) of the best "
                         f"split other than per-step: **{sb['split']}** {sb['buckets']}.\n")
    for r in (r for r in rows if r["section"] == "cross_step"):
        n = len(r["matrix"])
        lines.append(f"\n### Cross-step recall, {r['mask_kind']} (row: step whose mask, column: step it is applied at; "
                     f"density {r['density']}, mean over {r['targets']} targets and layers)\n")
        mrows = [dict({"i": i}, **{f"s{j}": r["matrix"][i][j] for j in range(n)}) for i in range(n)]
        lines.append(md_table(mrows, [("mask of step", "i")] + [(str(j), f"s{j}") for j in range(n)]))
    if doc.get("skipped"):
        lines.append("\nSkipped: " + "; ".join(doc["skipped"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="full", choices=("full", "smoke", "cpu2k"))
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--train-info", type=Path, help="train_config.json to quote in the report")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--suffix", default="", help="output names: testbed_quality{suffix}.json, REPORT{SUFFIX}.md")
    parser.add_argument("--rerender", type=Path, help="rewrite the outputs from this testbed_quality JSON (no runs)")
    parser.add_argument("--only", choices=("dense_layers",),
                        help="run only this sweep; its rows replace the same section's rows of "
                             "OUT/testbed_quality{suffix}.json (created if missing), whose .md is re-rendered")
    args = parser.parse_args(argv)
    if args.rerender:
        base = json.loads(args.rerender.read_text())
        config = make_config(args.preset, args.set)
        results = {"rows": base["rows"], "sections": {"matches": base.get("matches")}, "skipped": base.get("skipped", []),
                   "report_seconds": base.get("report_seconds"), "dense_attention": base.get("dense_attention")}
        doc = write_outputs(results, config, args.out, args.device, base["command"], None, args.suffix, base)
        print(json.dumps(doc["summary"], indent=1, default=str))
        return 0
    from chorus_core.comfy.comfyui_locator import prepare_in_process

    prepare_in_process(cpu=args.device == "cpu")
    from .train import load_checkpoint

    config = make_config(args.preset, args.set)
    model = load_checkpoint(args.checkpoint, config, args.device)
    train_info = json.loads(args.train_info.read_text()) if args.train_info and args.train_info.exists() else None
    cos = ((train_info or {}).get("training_attention") or {}).get("cosines", {}).get("comfyui_default_bf16", 1.0)
    dense_attention = "comfyui" if cos >= 0.9 else "sdpa_flash_efficient"
    print(f"dense attention in the report: {dense_attention} (ComfyUI default gradient cosine {cos})")
    if args.only:
        command = "python -m tests.testbed.report " + " ".join(argv or sys.argv[1:])
        results = dense_layers_sweep(model, config, args.device, dense_attention=dense_attention)
        results["rows"] = [dict(r, dense_attention=dense_attention) for r in results["rows"]]
        append_section(results, "dense_layers", config, args.out, args.device, command, args.suffix)
        print(dense_layers_table(results["rows"]))
        return 0
    results = run_report(model, config, args.device, dense_attention=dense_attention)
    results["dense_attention"] = dense_attention
    doc = write_outputs(results, config, args.out, args.device,
                        "python -m tests.testbed.report " + " ".join(argv or sys.argv[1:]), train_info, args.suffix)
    print(json.dumps(doc["summary"], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
