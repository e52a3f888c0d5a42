"""The product path measured on the testbed: a recorded miss, then a similar request as a bank hit.

    python -m tests.testbed.product_path --checkpoint FILE --out DIR [--preset sharp16k]
        [--targets 8] [--seeds 3] [--threshold 0.9]
    python -m tests.testbed.product_path --tiny --out DIR     # CPU, random tiny model, ~10 s
    python -m tests.testbed.product_path --merge DIR_SEED0 DIR_SEED1 ... --out DIR

Every run goes through ComfyUI's sampler (``comfy.sample.sample``, euler / simple, cfg ``sample_cfg``:
1 by default, as step-distilled models run; ``--set sample_cfg=5 --set sample_steps=40`` for the base model) on a
ModelPatcher of the checkpoint, with Chorus's sparse-attention patch. Per held-out target and
seed, in a fresh SQLite bank:

- the similar request (same template and layout, another subject) and a dissimilar one (another
  template and layout) run as recording misses through ``ReuseRun`` (shipped top-p and clamps,
  the shipped recorder), written by the bank writer;
- the target is matched against the bank and runs as a hit through ``ReuseRun``
  (``reused_similar_product``): the masks a user gets;
- comparison sources at **matched density** (in every sparse step, layer, head and query-block
  row the same number of kept blocks as the hit's mask): ``reused_similar`` (the similar request's
  own dense mass, mean over the hit's step bucket: what the served entry should equal, so the gap
  to ``reused_similar_product`` is what recording, bank and serving cost), ``oracle`` (the
  target's own exact block mass, likewise), ``reused_dissimilar`` (the dissimilar request's dense
  mass), ``online`` (pooled q/k block scores of the call, as shipped; at natural density also
  ``online_no_warmup``, the same with no dense step), ``population_prior``
  (keep frequency over the masks recorded from requests of other layouts, a bank of their own),
  ``population_prior_dense`` (keep frequency over the recorder's rule applied to the same
  requests' dense runs), ``static`` (local 3D windows);
- every source at its own **natural density** (what the defaults give): the hit, ``oracle``
  and ``reused_similar`` (top-p on exact mass), ``reused_dissimilar_product`` (the recorded entry), ``online`` and
  ``population_prior`` as shipped (``OnlinePredictionProvider`` / ``ReuseRun`` in prior mode);
  static windows have no natural density in the pack, so they appear at matched density only;
- with ``--core-sparse``, core ComfyUI's Model Sparse Attention (comfy-kitchen's Sol-Attn, a
  source that looks at q and k; ``core_sparse.py``): ``core_sparse_defaults`` at its natural
  density (the node's defaults: tau 1.3, dense before 20 % of the schedule, min_tokens 12,288) and
  ``core_sparse_matched`` (sparse from the first step, tau chosen per step and layer so that its
  routed share equals the hit's density there). ``--core-only`` runs the hit, the dense reference
  and these two only (no mass, recall or other sources: a CPU-sized run); with it, ``--hit-pooled-tail``
  adds the hit's own maps with one pooled term per dropped block (``pooled_tail.py``, an experiment).

Quality: final latents vs the dense run with the same seed as relative RMS error, and PSNR /
SSIM of the frames decoded to RGB with ComfyUI's Wan 2.1 latent-to-RGB preview factors in the
previews' fixed 0-1 range. Recall: share of the target's exact attention mass (its dense run,
same seed) that each run's masks keep, over sparse steps and layers. Means with 95 % confidence
intervals over requests x seeds. Plus the ``sharpness`` row: oracle mass at density 0.15 of the
targets' dense runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from chorus_core.attention.mask_provider import MaskSource, ObservedMasks

from chorus_core._siblings import import_sibling
from chorus_core.attention.masks import forced_blocks, keep_top_counts, select_blocks
from chorus_core.attention.online_predictor import block_scores
from chorus_core.reuse.population_prior import keep_frequency
from chorus_core.quality import mass_recall, psnr, ssim
from chorus_core.testbed.workload import generate_request, i2v_conditioning
from .config import TestbedConfig, config_from_dict, make_config, tokens_of, with_overrides
from .comparisons import family_rows, held_out_templates, mean_ci, paired_differences, verdict
from .composition import COMPOSED_KINDS, composition_rows
from .core_sparse import core_sparse_rows
from .pooled_tail import parse_forms, pooled_tail_rows
from .models import check_model_matches, process_in
from .report import eval_requests, md_table, spread_picks, static_window_scores
from .run_record import run_record
from .sharpness import SHARPNESS_DENSITY, request_name, summarize_mass

# comfy/latent_formats.py (ComfyUI 0.3.64) Wan21.latent_rgb_factors / latent_rgb_factors_bias: the
# live-preview decoder. Previews decode the sampler's model-space latent and map -1..1 to 0..1.
WAN21_LATENT_RGB_FACTORS = torch.tensor([
    [-0.1299, -0.1692, 0.2932], [0.0671, 0.0406, 0.0442], [0.3568, 0.2548, 0.1747], [0.0372, 0.2344, 0.1420],
    [0.0313, 0.0189, -0.0328], [0.0296, -0.0956, -0.0665], [-0.3477, -0.4059, -0.2925], [0.0166, 0.1902, 0.1975],
    [-0.0412, 0.0267, -0.1364], [-0.1293, 0.0740, 0.1636], [0.0680, 0.3019, 0.1128], [0.0032, 0.0581, 0.0639],
    [-0.1251, 0.0927, 0.1699], [0.0060, -0.0633, 0.0005], [0.3477, 0.2275, 0.2950], [0.1984, 0.0913, 0.1861]])
WAN21_LATENT_RGB_BIAS = torch.tensor([-0.1835, -0.0868, -0.3360])

MATCHED_KINDS = ("reused_similar_product", "reused_similar", "oracle", "reused_dissimilar", "online",
                 "population_prior", "population_prior_dense", "static", "core_sparse_matched",
                 "reused_similar_pooled_tail", "reused_similar_pooled_tail_rows", "reused_similar_replayed")
NATURAL_KINDS = ("reused_similar_product", "reused_similar", "oracle", "reused_dissimilar_product", "online",
                 "online_no_warmup", "population_prior", "core_sparse_defaults")
METRICS = ("density", "recall", "recall_vs_oracle", "rel_rms", "psnr_db", "ssim")
RECORD_THRESHOLD = 1.0  # recording runs must miss: only an identical request reaches similarity 1
MERGED_SUFFIX = " (runs); merged here"


# --------------------------------------------------------------------------------------------
# Quality of final latents
# --------------------------------------------------------------------------------------------


def latents_to_rgb(latents: torch.Tensor) -> torch.Tensor:
    """Sampler output ``[B, 16, T, H, W]`` -> preview RGB ``[B, 3, T, H, W]`` in 0..1 (ComfyUI's Latent2RGB)."""
    x = process_in(latents.float())  # previews see the model-space latent
    rgb = torch.einsum("bcthw,cr->brthw", x, WAN21_LATENT_RGB_FACTORS.to(x)) + WAN21_LATENT_RGB_BIAS.to(x).view(1, 3, 1, 1, 1)
    return ((rgb + 1.0) / 2.0).clamp(0, 1)


def final_quality(dense: torch.Tensor, test: torch.Tensor) -> dict:
    """rel_rms of the latents; PSNR / SSIM of the RGB previews in the fixed 0..1 range."""
    a, b = dense.double(), test.double()
    rel = float((a - b).norm() / a.norm().clamp(min=1e-12))
    ra, rb = latents_to_rgb(dense), latents_to_rgb(test)
    return {"rel_rms": rel, "psnr_db": float(psnr(ra, rb, data_range=1.0)[0]), "ssim": float(ssim(ra, rb, data_range=1.0)[0])}


# --------------------------------------------------------------------------------------------
# Mask sources (chorus_core.attention.mask_provider's kinds; maps are kept for the recall measure)
# --------------------------------------------------------------------------------------------


class MassObserver(ObservedMasks):
    """Dense attention everywhere; records each call's exact block mass ``[H, nb, nb]`` per (step, layer)."""

    def __init__(self, block_size: int):
        self.block_size = (block_size, block_size)
        self.sums, self.counts = {}, {}

    def step_bucket(self, step: int) -> int:
        return step

    def observe(self, layer, step, cond_or_uncond, q, k, heads, skip_reshape) -> None:
        bm = import_sibling("kernels.block_mass")
        # Averaged over the batch and over calls: above cfg 1, ComfyUI runs cond and uncond in one
        # batch or, when memory is short, in two calls; the shipped recorder pools them the same way.
        mass = bm.block_mass(q, k, None if skip_reshape else heads, self.block_size[0]).float().cpu()
        key = (step, layer)
        self.sums[key] = self.sums.get(key, 0) + mass.sum(0)
        self.counts[key] = self.counts.get(key, 0) + mass.shape[0]

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device):
        return None

    def stacked(self, steps: int, layers: int) -> torch.Tensor:
        return torch.stack([torch.stack([self.sums[(s, l)] / self.counts[(s, l)] for l in range(layers)])
                            for s in range(steps)])


class CountMatchedProvider(MaskSource):
    """Per (step, layer): the ``counts`` highest-scoring blocks of each row (diagonal forced).

    :param counts_of: ``(step, layer) -> long [H, nq]`` (the hit's kept blocks per row)
    :param scores_of: ``(step, layer) -> [H, nq, nk]``, or None for online scores from the call's q, k
    """

    def __init__(self, block_size: int, counts_of, scores_of=None):
        self.block_size = (block_size, block_size)
        self.counts_of, self.scores_of = counts_of, scores_of
        self._online, self.maps = {}, {}

    def step_bucket(self, step: int) -> int:
        return step

    def observes(self, step: int) -> bool:
        return self.scores_of is None  # online scores come from the call's q and k

    def observe(self, layer, step, cond_or_uncond, q, k, heads, skip_reshape) -> None:
        if self.scores_of is None:
            self._online[layer] = block_scores(q, k, None if skip_reshape else heads, self.block_size[0]).mean(0).float()

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device):
        scores = self._online.pop(layer) if self.scores_of is None else self.scores_of(step, layer)
        scores = scores.to(device)
        nq, nk = scores.shape[-2:]
        chosen = keep_top_counts(scores, self.counts_of(step, layer).to(device), forced_blocks(nq, nk, True, None, device))
        self.maps[(step, layer)] = chosen.cpu()
        return chosen[None]


class CapturingProvider(MaskSource):
    """Wraps a provider and keeps the maps it serves (online prediction as shipped)."""

    def __init__(self, inner):
        self.inner, self.block_size, self.maps = inner, inner.block_size, {}

    def step_bucket(self, step: int):
        return self.inner.step_bucket(step)

    def observes(self, step: int) -> bool:
        return self.inner.observes(step)

    def observe(self, layer, step, cond_or_uncond, q, k, heads, skip_reshape) -> None:
        self.inner.observe(layer, step, cond_or_uncond, q, k, heads, skip_reshape)

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device):
        out = self.inner.block_map(layer, step, cond_or_uncond, num_heads, seq_len, device)
        if out is not None:
            self.maps[(step, layer)] = out[0].bool().cpu()
        return out


# --------------------------------------------------------------------------------------------
# One harness: model patcher, runs, rows
# --------------------------------------------------------------------------------------------


class ProductPath:
    def __init__(self, patcher, config: TestbedConfig, workdir: Path, threshold: float = 0.9, log=print,
                 options=None):
        self.patcher, self.config, self.workdir, self.threshold, self.log = patcher, config, Path(workdir), threshold, log
        # the shipped defaults (top-p, density clamps, warm-up, miss mode) unless a run varies one,
        # but every step sparse: the sources compared with the hit run the same steps sparse, as every
        # committed table was measured (--set dense_last_steps=1 for the shipped hit's dense last step)
        self.options = options or testbed_options()
        check_model_matches(patcher, config)
        self.bs, self.steps, self.L = config.block_size, config.sample_steps, config.num_layers
        # Every source compared with the hit runs the hit's dense steps (none by default: a hit is
        # sparse from step 0); an online miss at natural density keeps the miss's warm-up.
        self.warmup = self.options.hit_warmup_steps

    # --- runs ------------------------------------------------------------------------------
    def sample(self, patched, conds, seed: int) -> torch.Tensor:
        import comfy.sample

        positive, negative, latent = conds
        noise = comfy.sample.prepare_noise(latent["samples"], seed)
        return comfy.sample.sample(patched, noise, self.steps, self.config.sample_cfg, "euler", "simple", positive, negative,
                                   latent["samples"], seed=seed, disable_pbar=True).float().cpu()

    def with_provider(self, provider, conds, seed: int, warmup: int | None = None) -> torch.Tensor:
        from chorus_core.attention.mask_provider import DenseWarmupProvider
        from chorus_core.attention.sparse_patch import install_sparse_attention

        warmup = self.warmup if warmup is None else warmup
        wrapped = provider if isinstance(provider, MassObserver) else DenseWarmupProvider(provider, warmup)
        return self.sample(install_sparse_attention(self.patcher, wrapped), conds, seed)

    def dense(self, conds, seed: int):
        observer = MassObserver(self.bs)
        final = self.with_provider(observer, conds, seed)
        return final, observer.stacked(self.steps, self.L)  # [S, L, H, nb, nb]

    def match(self, bank, conds, threshold: float):
        from chorus_core.bank.signature import resolve_weights
        from chorus_core.reuse.reuse_match import build_match_request, match_request

        positive, _, latent = conds
        req = build_match_request(self.patcher, positive[0][1]["clip_vision_output"], positive, latent, None,
                                  threshold, resolve_weights(None), self.bs)
        return match_request(bank, req)

    def reuse_run(self, match, conds, seed: int, options=None):
        from chorus_core.reuse.reuse_run import ReusePatch

        patch = ReusePatch(self.patcher, match, options or self.options, block_size=self.bs, scheduler="simple")
        final = self.sample(patch.install(), conds, seed)
        return final, patch.last_report

    def record(self, bank, conds, seed: int) -> str:
        """A recording miss (online prediction as shipped); waits for the bank writer."""
        from chorus_core.reuse import bank_writer

        _, report = self.reuse_run(self.match(bank, conds, RECORD_THRESHOLD), conds, seed)
        if report.mode != "miss" or report.recording != "queued":
            raise RuntimeError(f"a recording run did not record: mode {report.mode}, recording {report.recording}, "
                               f"warnings {report.warnings}")
        if not bank_writer.flush_all(timeout=300):
            raise RuntimeError("the bank writer did not finish the recorded entry within 300 s")
        return report.recorded_entry_id

    # --- masks of entries ------------------------------------------------------------------
    def entry_maps(self, entry) -> dict:
        """(step, layer) -> bool [H, nq, nk] of an entry (a hit's, a prior's), over the sparse steps."""
        from chorus_core.reuse.entry_source import scaled_bucket_starts

        starts = scaled_bucket_starts(entry.schedule, self.steps)
        per_bucket = [[entry.block_map(b, l).bool() for l in range(self.L)] for b in range(len(starts))]
        return {(s, l): per_bucket[_bucket(starts, s)][l] for s in range(self.warmup, self.steps) for l in range(self.L)}

    def static_provider(self, maps: dict):
        """Serve fixed (step, layer) maps (an entry at natural density; a top-p oracle)."""
        return CountMatchedProvider(self.bs, lambda s, l: maps[(s, l)].sum(-1), lambda s, l: maps[(s, l)].float())

    # --- measures --------------------------------------------------------------------------
    def recall(self, mass: torch.Tensor, maps: dict, seq_len: int) -> float:
        values = [float(mass_recall(mass[s, l], maps[(s, l)].to(mass.device), seq_len, self.bs).mean()) for (s, l) in maps]
        return sum(values) / len(values)


def _bucket(starts, step: int) -> int:
    return max(i for i, s in enumerate(starts) if s <= step)


def bucket_mean_mass(mass: torch.Tensor, maps_steps: dict, steps_of_bucket) -> dict:
    return {k: mass[list(steps_of_bucket(k[0]))].mean(0)[k[1]] for k in maps_steps}


def dense_prior_scores(dense_masses: list, maps_steps: dict, steps_of_bucket, options) -> dict:
    """Keep frequency over masks made by the recorder's rule (top-p over each bucket's mean mass)
    from the population's dense runs: the prior that recorded entries should reproduce."""
    per_request = [bucket_mean_mass(m, maps_steps, steps_of_bucket) for m in dense_masses]
    return {k: keep_frequency(torch.stack([select_blocks(scores[k], options.top_p, options.min_density,
                                                         options.max_density) for scores in per_request]))
            for k in maps_steps}


# --------------------------------------------------------------------------------------------
# The measurement
# --------------------------------------------------------------------------------------------


def run_product_path(patcher, config: TestbedConfig, workdir: Path, targets: int, seeds: int, threshold: float = 0.9,
                     log=print, seed_start: int = 0, on_progress=None, options=None, finals=None,
                     compose: bool = False, picks: slice = slice(None), core_sparse: bool = False,
                     core_only: bool = False, core_min_tokens: int = 12288, core_kernel: bool = False,
                     hit_pooled_tail: tuple = (), hit_only: bool = False) -> dict:
    """Rows of every source at matched and natural density, for ``targets`` held-out requests x ``seeds``.

    ``on_progress(results_so_far)`` after every target: the CLI writes its outputs then, so a run
    stopped by a time limit keeps the targets it finished. ``compose``: also the rows of
    ``composition`` (Guidance Enhance and core's EasyCache on the hit). ``finals``: a dict that receives every
    run's final latents under ``(section, kind, request, seed)``, the dense run's as ``("dense", "dense", ...)``.
    ``picks``: which of the ``targets`` spread-out requests this run samples (a slice of them), so
    that long runs can be split by target over several processes and merged with ``--merge``.
    ``core_sparse``: also core's Model Sparse Attention (``core_sparse.py``); ``core_only``: the hit
    and core's rows only, against a plain dense run (no mass, recall or other sources), and with
    ``hit_only`` the hit's alone;
    ``core_min_tokens``: its node's min_tokens (12,288; the tiny model's few hundred tokens need 0);
    ``core_kernel``: core's rows computed by comfy-kitchen's CUDA kernel, not the float32 reproduction;
    ``hit_pooled_tail``: with ``core_only``, also the hit's maps with a pooled tail per form (``pooled_tail.py``).
    """
    from chorus_core.bank import MaskBank
    from chorus_core.reuse.prior_store import load_prior
    from chorus_core.attention.mask_sources import OnlinePredictionProvider

    pp = ProductPath(patcher, config, workdir, threshold, log, options)
    size = config.long_size
    seq_len = tokens_of(size)
    tgts, similar, dissimilar_of, population = eval_requests(config, size)
    chosen = spread_picks(len(tgts), min(targets, len(tgts)))[picks]
    o = pp.options
    static_scores = static_window_scores(size, pp.bs, config.num_heads)
    rows, sharp_masses, notes = [], [], []
    started = time.time()
    # the population: requests of other layouts, recorded once into a bank of their own (the prior's source)
    pop_bank = MaskBank.open(pp.workdir / "population")
    pop_dense = []  # the same requests' dense block mass: the prior the recorded entries should match
    for p in population if not core_only else ():
        pp.record(pop_bank, i2v_conditioning(generate_request(p)), 0)
        pop_dense.append(pp.dense(i2v_conditioning(generate_request(p)), 0)[1])
    for seed in range(seed_start, seed_start + seeds):
        for ti in chosen:
            target, sim, dis = tgts[ti], similar[ti], similar[dissimilar_of[ti]]
            conds = i2v_conditioning(generate_request(target))
            bank = MaskBank.open(pp.workdir / f"bank-t{ti}-seed{seed}")
            sim_id = pp.record(bank, i2v_conditioning(generate_request(sim)), seed)
            dis_id = pp.record(bank, i2v_conditioning(generate_request(dis)), seed)
            if core_only:
                dense_final, mass = pp.sample(pp.patcher, conds, seed), None
            else:
                dense_final, mass = pp.dense(conds, seed)
                _, dis_mass = pp.dense(i2v_conditioning(generate_request(dis)), seed)
                _, sim_mass = pp.dense(i2v_conditioning(generate_request(sim)), seed)
                sharp_masses.append(mass)

            hit = pp.match(bank, conds, threshold)
            hit_final, report = pp.reuse_run(hit, conds, seed)
            if report.mode != "hit":
                notes.append(f"{request_name(target)} seed {seed}: no hit (similarity {hit.result.similarity:.3f} "
                             f"< threshold {threshold}); skipped")
                log(notes[-1])
                continue
            notes += [f"{request_name(target)} seed {seed} hit: {w}" for w in report.warnings]
            hit_entry = bank.load_masks(report.entry_id, record_hit=False)
            hit_maps = pp.entry_maps(hit_entry)
            starts = _starts(hit_entry, pp)
            bucket_steps = lambda s: range(starts[_bucket(starts, s)], _next_start(starts, s, pp.steps))  # noqa: E731
            counts_of = lambda s, l: hit_maps[(s, l)].sum(-1)  # noqa: E731
            base = {"N": seq_len, "seed": seed, "request": request_name(target),
                    "hit_entry_is_similar": report.entry_id == sim_id, "similarity": round(hit.result.similarity, 4)}

            if finals is not None:
                finals[("dense", "dense", base["request"], seed)] = dense_final

            def row(section, kind, final, maps, oracle_recall=None, **extra):
                """``extra``: more keys; ``block_size`` (other than the run's) leaves recall out."""
                if finals is not None:
                    finals[(section, kind, base["request"], seed)] = final
                own_blocks = extra.get("block_size", pp.bs) == pp.bs
                recall = pp.recall(mass, maps, seq_len) if mass is not None and own_blocks else None
                density = sum(float(m.float().mean()) for m in maps.values()) / len(maps)
                r = {"section": section, "mask_kind": kind, **base, "density": density, "recall": recall,
                     "recall_vs_oracle": recall / oracle_recall if recall is not None and oracle_recall else None,
                     **final_quality(dense_final, final), **extra}
                rows.append(r)
                return r

            if core_only:
                for section in ("matched", "natural"):
                    row(section, "reused_similar_product", hit_final, hit_maps)
                pooled_tail_rows(pp, conds, seed, hit_maps, row, hit_pooled_tail)
                if not hit_only:
                    core_sparse_rows(pp, conds, seed, hit_maps, row, core_min_tokens, core_kernel)
                bank.close()
                log(f"{request_name(target)} seed {seed}: hit and core's sparse attention, {time.time() - started:.0f}s")
                if on_progress is not None:
                    on_progress(_results(rows, sharp_masses, notes, started, o, threshold, seq_len, pp.bs))
                continue
            # matched density: every source keeps the hit's blocks-per-row
            oracle_scores = bucket_mean_mass(mass, hit_maps, bucket_steps)
            dis_scores = bucket_mean_mass(dis_mass, hit_maps, bucket_steps)
            sim_scores = bucket_mean_mass(sim_mass, hit_maps, bucket_steps)
            pop_entries = [pop_bank.load_masks(e, record_hit=False)
                           for e in pop_bank.compatible_entries(hit.request.fingerprint, hit.request.layout, limit=64)]
            pop_maps = [pp.entry_maps(e) for e in pop_entries]
            pop_freq = {k: keep_frequency(torch.stack([m[k] for m in pop_maps])) for k in hit_maps}
            pop_dense_freq = dense_prior_scores(pop_dense, hit_maps, bucket_steps, o)
            sources = {"reused_similar": lambda s, l: sim_scores[(s, l)],
                       "oracle": lambda s, l: oracle_scores[(s, l)], "reused_dissimilar": lambda s, l: dis_scores[(s, l)],
                       "online": None, "population_prior": lambda s, l: pop_freq[(s, l)],
                       "population_prior_dense": lambda s, l: pop_dense_freq[(s, l)],
                       "static": lambda s, l: static_scores}
            matched = {}
            for kind, scores_of in sources.items():
                provider = CountMatchedProvider(pp.bs, counts_of, scores_of)
                matched[kind] = (pp.with_provider(provider, conds, seed), provider.maps)
            oracle_recall = pp.recall(mass, matched["oracle"][1], seq_len)
            row("matched", "reused_similar_product", hit_final, hit_maps, oracle_recall)
            for kind in sources:
                row("matched", kind, *matched[kind], oracle_recall)

            # natural density: what each source gives with the shipped defaults
            row("natural", "reused_similar_product", hit_final, hit_maps, oracle_recall)
            top_p_oracle = {k: select_blocks(v, o.top_p, o.min_density, o.max_density) for k, v in oracle_scores.items()}
            row("natural", "oracle", pp.with_provider(pp.static_provider(top_p_oracle), conds, seed), top_p_oracle,
                oracle_recall)
            top_p_similar = {k: select_blocks(v, o.top_p, o.min_density, o.max_density) for k, v in sim_scores.items()}
            row("natural", "reused_similar", pp.with_provider(pp.static_provider(top_p_similar), conds, seed),
                top_p_similar, oracle_recall)
            dis_maps = pp.entry_maps(bank.load_masks(dis_id, record_hit=False))
            row("natural", "reused_dissimilar_product", pp.with_provider(pp.static_provider(dis_maps), conds, seed),
                dis_maps, oracle_recall)
            online = CapturingProvider(OnlinePredictionProvider(pp.bs, o.top_p, o.min_density, o.max_density))
            row("natural", "online", pp.with_provider(online, conds, seed, o.dense_warmup_steps), online.maps,
                oracle_recall)
            # sparse from the first step like a hit: what a few-step run could gain online, and at what cost
            eager = CapturingProvider(OnlinePredictionProvider(pp.bs, o.top_p, o.min_density, o.max_density))
            row("natural", "online_no_warmup", pp.with_provider(eager, conds, seed, 0), eager.maps, oracle_recall)
            prior_match = pp.match(pop_bank, conds, RECORD_THRESHOLD)
            prior_final, prior_report = pp.reuse_run(prior_match, conds, seed,
                                                     replace(o, miss_mode="prior", record_on_miss=False))
            prior_entry = load_prior(pop_bank, hit.request.fingerprint, hit.request.layout, o.min_density, o.max_density)
            if not prior_report.mask_source.startswith("population prior"):
                raise RuntimeError(f"the prior-mode run used {prior_report.mask_source!r}, not the population prior")
            row("natural", "population_prior", prior_final, pp.entry_maps(prior_entry), oracle_recall)
            if core_sparse:
                core_sparse_rows(pp, conds, seed, hit_maps, row, core_min_tokens, core_kernel)
            if compose:
                rows.extend({**base, **r} for r in composition_rows(pp, hit, conds, seed, dense_final, final_quality))
            bank.close()
            log(f"{request_name(target)} seed {seed}: hit {report.entry_id} (similar: {report.entry_id == sim_id}), "
                f"{time.time() - started:.0f}s")
            if on_progress is not None:
                on_progress(_results(rows, sharp_masses, notes, started, o, threshold, seq_len, pp.bs))
    pop_bank.close()
    return _results(rows, sharp_masses, notes, started, o, threshold, seq_len, pp.bs)


def _results(rows, sharp_masses, notes, started, options, threshold, seq_len, block_size) -> dict:
    sharp = None
    if sharp_masses:
        sharp = summarize_mass(torch.cat(sharp_masses), SHARPNESS_DENSITY, seq_len, block_size)
        sharp["runs"] = len(sharp_masses)
    return {"rows": list(rows), "sharpness": sharp, "notes": list(notes), "seconds": time.time() - started,
            "options": asdict(options), "threshold": threshold, "N": seq_len}


def merge_results(docs: list) -> dict:
    """Several runs' ``product_path.json`` (e.g. one per seed, each under 9 minutes) as one result;
    sharpness is the run-weighted mean (each run's mean is over its dense target runs)."""
    sharp = [d["sharpness"] for d in docs if d.get("sharpness")]
    runs = sum(s["runs"] for s in sharp)
    merged_sharp = None
    if sharp:
        merged_sharp = {"density": sharp[0]["density"], "runs": runs,
                        "mean": sum(s["mean"] * s["runs"] for s in sharp) / runs,
                        "per_layer": [round(sum(s["per_layer"][i] * s["runs"] for s in sharp) / runs, 4)
                                      for i in range(len(sharp[0]["per_layer"]))]}
    if len({d["N"] for d in docs}) != 1 or len({d["threshold"] for d in docs}) != 1:
        raise SystemExit("--merge: the runs differ in N or threshold; merge only runs of one configuration")
    for field in ("config", "options"):
        if len({json.dumps(d.get(field), sort_keys=True) for d in docs}) != 1:
            raise SystemExit(f"--merge: the runs differ in their {field} (preset, --set, steps, cfg or --option); "
                             "merge only runs of one configuration")
    return {"rows": [r for d in docs for r in d["rows"]], "sharpness": merged_sharp,
            "notes": [n for d in docs for n in d["notes"]], "seconds": sum(d["seconds"] for d in docs),
            "options": docs[0]["options"], "threshold": docs[0]["threshold"], "N": docs[0]["N"]}


def _starts(entry, pp) -> list:
    from chorus_core.reuse.entry_source import scaled_bucket_starts

    return scaled_bucket_starts(entry.schedule, pp.steps)


def _next_start(starts, step: int, steps: int) -> int:
    later = [s for s in starts if s > step]
    return later[0] if later else steps


# --------------------------------------------------------------------------------------------
# Summary and outputs
# --------------------------------------------------------------------------------------------


def summarize(results: dict) -> list:
    """Mean and 95 % CI per (section, mask_kind) over requests x seeds."""
    out = []
    for section, kinds in (("matched", MATCHED_KINDS), ("natural", NATURAL_KINDS), ("composed", COMPOSED_KINDS)):
        for kind in kinds:
            group = [r for r in results["rows"] if r["section"] == section and r["mask_kind"] == kind]
            if not group:
                continue
            entry = {"section": section, "mask_kind": kind, "N": results["N"], "n": len(group)}
            if section == "composed":
                entry["against"] = group[0]["against"]
            for metric in METRICS + (("steps_skipped",) if section == "composed" else ()):
                m, ci = mean_ci([r[metric] for r in group])
                entry[metric], entry[f"{metric}_ci95"] = m, ci
            out.append(entry)
    if results["sharpness"] is not None:
        s = results["sharpness"]
        out.append({"section": "sharpness", "mask_kind": "sharpness", "N": results["N"],
                    "density": SHARPNESS_DENSITY, "oracle_mass_at_0.15": s["mean"], "per_layer": s["per_layer"]})
    return out


def _cell(entry, metric, digits):
    v, ci = entry.get(metric), entry.get(f"{metric}_ci95")
    if v is None:
        return "-"
    return f"{v:.{digits}f} ± {ci:.{digits}f}" if ci else f"{v:.{digits}f}"


def _sampling(doc: dict) -> str:
    config = doc.get("config", {})
    return f"{config.get('sample_steps', '?')} euler steps, cfg {config.get('sample_cfg', 1.0)}"


def markdown(doc: dict) -> str:
    lines = [f"# Product path on the testbed ({doc['N']:,} tokens)", "", f"Command: `{doc['command']}`", "",
             f"Machine {doc.get('machine', '?')}, {doc.get('date', '?')}, commit {doc.get('git_commit', '?')}.", "",
             f"{doc['targets']} targets x {doc['seeds']} seeds; {_sampling(doc)}; sampler options {doc['options']}; "
             f"match threshold {doc['threshold']}. Mean ± 95 % CI over requests x seeds.", ""]
    sharp = next((e for e in doc["summary"] if e["mask_kind"] == "sharpness"), None)
    if sharp:
        lines += [f"Sharpness: the oracle mask at density 0.15 keeps **{sharp['oracle_mass_at_0.15']:.3f}** of the "
                  f"attention mass (per layer {sharp['per_layer']}).", ""]
    for section, title in (("matched", "Matched density (the hit's blocks per row)"), ("natural", "Natural density"),
                           ("composed", "Composed: Guidance Enhance and core's EasyCache, each against its control")):
        entries = [e for e in doc["summary"] if e["section"] == section]
        if not entries:
            continue
        metrics = METRICS + (("steps_skipped",) if section == "composed" else ())
        first = [("mask_kind", "mask_kind")] + ([("against", "against")] if section == "composed" else [])
        table = [{"mask_kind": e["mask_kind"], "against": e.get("against"),
                  **{m: _cell(e, m, 2 if m == "psnr_db" else 3) for m in metrics}, "n": e["n"]} for e in entries]
        lines += [f"## {title}", "", md_table(table, first + [(m, m) for m in metrics] + [("n", "n")]), ""]
    lines += paired_markdown(doc) + family_markdown(doc)
    if doc["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in doc["notes"]] + [""]
    return "\n".join(lines)


def paired_markdown(doc: dict) -> list:
    entries = paired_differences(doc.get("rows", []))
    if not entries:
        return []
    table = [{**e, "psnr": _cell(e, "psnr_db", 2), "rms": _cell(e, "rel_rms", 3), "verdict": verdict(e)} for e in entries]
    columns = [("section", "section"), ("A", "a"), ("B", "b"), ("PSNR A - B (dB)", "psnr"),
               ("rel_rms A - B", "rms"), ("PSNR interval excludes 0", "verdict"), ("pairs", "n"),
               ("requests", "requests")]
    return ["## Paired differences (same request and seed)", "",
            "Each source ran on the same (request, seed) pairs. A - B per pair, averaged over each request's seeds, "
            "then mean and 95 % t interval over requests: sources whose unpaired intervals above overlap can still "
            "differ. Each row is its own 95 % statement; of many rows, one in twenty can be chance.", "",
            md_table(table, columns), ""]


def family_markdown(doc: dict) -> list:
    held_out = held_out_templates(doc.get("rows", []), doc.get("config", {}).get("train_templates", ()))
    if not held_out:
        return []
    table = [{"mask_kind": e["mask_kind"], "trained": _cell(e, "trained_psnr_db", 2),
              "trained_runs": f"{e['trained_n']} / {e['trained_requests']}",
              "held": _cell(e, "held_out_psnr_db", 2), "held_runs": f"{e['held_out_n']} / {e['held_out_requests']}"}
             for e in family_rows(doc["rows"], "matched", MATCHED_KINDS, held_out)]
    families = ", ".join(held_out)
    columns = [("mask_kind", "mask_kind"), ("PSNR, trained families (dB)", "trained"), ("runs / requests", "trained_runs"),
               (f"PSNR, held-out {families} (dB)", "held"), (f"runs / requests, {families}", "held_runs")]
    return [f"## Workload families the checkpoint was not trained on (matched density): {families}", "",
            "Mean ± 95 % t interval over requests x seeds.", "", md_table(table, columns), ""]


def write_outputs(results: dict, out: Path, command: str, targets: int, seeds: int, config: TestbedConfig,
                  machine: str | None = None) -> dict:
    """product_path.json and .md in ``out``; ``machine`` defaults to this one (a merge names the runs')."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {**run_record(command, torch.cuda.is_available(), machine), "N": results["N"], "targets": targets, "seeds": seeds, "threshold": results["threshold"],
           "options": results["options"], "seconds": round(results["seconds"], 1), "notes": results["notes"],
           "summary": summarize(results), "rows": results["rows"], "sharpness": results["sharpness"],
           "config": asdict(config)}
    (out / "product_path.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "product_path.md").write_text(markdown(doc))
    return doc


def tiny_setup(workdir: Path, overrides: list | None = None):
    """A random-weight tiny_sharp model (``NAME=VALUE`` overrides applied) saved as a diffusion-model
    file and loaded as UNETLoader does."""
    import comfy.sd

    from .models import build_model
    from .train import save_checkpoint

    config = make_config("tiny_sharp", overrides)
    torch.manual_seed(0)
    path = save_checkpoint(build_model(config), Path(workdir) / "tiny_sharp.safetensors", config, dtype=torch.float32)
    return comfy.sd.load_diffusion_model(str(path)), config


def add_model_arguments(parser, tiny_help: str = "a random tiny model on the CPU") -> None:
    """The testbed harnesses' model arguments: --checkpoint, --preset, --set and --tiny (see load_model)."""
    parser.add_argument("--checkpoint", type=Path, help="the trained testbed checkpoint (not with --tiny)")
    parser.add_argument("--preset", default="sharp16k")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--tiny", action="store_true", help=tiny_help)


def load_model(args, workdir: Path):
    """(patcher, config) for add_model_arguments' arguments: ComfyUI prepared in this process, then
    --tiny's random model, or --checkpoint loaded as UNETLoader does under --preset and --set."""
    if not args.tiny and args.checkpoint is None:
        raise SystemExit("pass --checkpoint FILE (the trained testbed), or --tiny for the CPU smoke run")
    from chorus_core.comfy.comfyui_locator import prepare_in_process

    prepare_in_process(cpu=args.tiny or not torch.cuda.is_available())
    if args.tiny:
        return tiny_setup(workdir, args.set)
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(args.checkpoint)), make_config(args.preset, args.set)


def testbed_options():
    """The shipped ReuseOptions with every step sparse (``dense_last_steps`` 0; the default is 1)."""
    from chorus_core.reuse.reuse_run import ReuseOptions

    return ReuseOptions(dense_last_steps=0)


def reuse_options(items: list[str]):
    """The testbed's ReuseOptions with ``NAME=VALUE`` items replaced."""
    return with_overrides(testbed_options(), items, "sampler option")


def pick_slice(text: str) -> slice:
    """``--picks START:STOP`` (either side may be empty) as a slice of the spread-out targets."""
    start, sep, stop = text.partition(":")
    try:
        if not sep:
            raise ValueError(text)
        return slice(int(start) if start else None, int(stop) if stop else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--picks wants START:STOP such as 0:4 or 4:, not {text!r}") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    add_model_arguments(parser, "a random tiny model on the CPU, 2 targets x 2 seeds")
    parser.add_argument("--targets", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="vary one of the sampler's ReuseOptions from the testbed's (the shipped ones with "
                             "every step sparse; e.g. dense_last_steps=1)")
    parser.add_argument("--seed-start", type=int, default=0, help="first seed (split seeds over several runs)")
    parser.add_argument("--picks", type=pick_slice, default=slice(None), metavar="START:STOP",
                        help="only these of the --targets spread-out requests (split targets over several runs)")
    parser.add_argument("--compose", action="store_true",
                        help="also Guidance Enhance and core's EasyCache on each hit, against their controls")
    parser.add_argument("--core-sparse", action="store_true",
                        help="also core ComfyUI's Model Sparse Attention (Sol-Attn) at its defaults and at the hit's density")
    parser.add_argument("--core-only", action="store_true",
                        help="only the hit and core's Model Sparse Attention against dense (a CPU-sized run)")
    parser.add_argument("--hit-only", action="store_true",
                        help="only the hit against dense (--core-only without core's rows): a CPU-sized run for "
                             "comparing two --option settings of the hit with tests.testbed.option_pairs")
    parser.add_argument("--core-kernel", action="store_true",
                        help="core's rows on comfy-kitchen's CUDA sol_attn (a GPU with it), not the float32 reproduction")
    parser.add_argument("--hit-pooled-tail", type=parse_forms, nargs="?", const=("centroid",), default=(),
                        metavar="FORMS", help="with --core-only: also the hit's masks with one pooled term per dropped "
                        "block (centroid, rows or none; comma-separated; centroid when bare)")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="DIR",
                        help="combine the product_path.json of these earlier runs into --out (no sampling)")
    args = parser.parse_args(argv)
    command = "python -m tests.testbed.product_path " + " ".join(argv or sys.argv[1:])
    if args.merge:
        docs = [json.loads((d / "product_path.json").read_text()) for d in args.merge]
        seeds = len({r["seed"] for d in docs for r in d["rows"]})
        targets = len({r["request"] for d in docs for r in d["rows"]})
        machines = " + ".join(sorted({d.get("machine", "?").removesuffix(MERGED_SUFFIX) for d in docs}))
        write_outputs(merge_results(docs), args.out, command, targets, seeds, config_from_dict(docs[0]["config"]),
                      machine=machines + MERGED_SUFFIX)
        print(f"merged {len(docs)} runs -> {args.out / 'product_path.md'}")
        return 0
    with tempfile.TemporaryDirectory(prefix="chorus-product-path-") as tmp:
        patcher, config = load_model(args, Path(tmp))
        targets, seeds = (2, 2) if args.tiny else (args.targets, args.seeds)
        sampled = len(range(targets)[args.picks])  # what this run's header counts: its share of the targets
        progress = lambda partial: write_outputs(partial, args.out, command, sampled, seeds, config)  # noqa: E731
        results = run_product_path(patcher, config, Path(tmp), targets, seeds, args.threshold,
                                   seed_start=args.seed_start, on_progress=progress,
                                   options=reuse_options(args.option), compose=args.compose, picks=args.picks,
                                   core_sparse=args.core_sparse or args.core_only,
                                   core_only=args.core_only or args.hit_only, hit_only=args.hit_only,
                                   core_min_tokens=0 if args.tiny else 12288, core_kernel=args.core_kernel,
                                   hit_pooled_tail=args.hit_pooled_tail)
    doc = write_outputs(results, args.out, command, sampled, seeds, config)
    print(f"{len(doc['rows'])} rows in {doc['seconds']:.0f}s -> {args.out / 'product_path.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
