"""The fast path, end to end: FA4 sparse and dense, Triton, eager and ``torch.compile``, Wan2.1-14B shapes.

Run on a CUDA machine from the repo root (ComfyUI importable, e.g. ``COMFYUI_PATH`` set, and
``flash-attn-4`` importable for the FA4 rows):

    python tests/benchmarks/bench_fast_path.py --out DIR [--shapes 720p] [--blocks 2] [--budget-s 540]

or on the CPU at a tiny size to debug the script: ``--tiny``.

What runs: the model, request and synthetic structured hit masks of ``bench_end_to_end.py``
(ComfyUI's ``WAN21_I2V`` ``WanModel`` at Wan2.1-I2V-14B width, bf16, random weights, with
``--blocks`` of its 40 blocks; ``comfy.sample.sample``, euler, cfg 5, cond + uncond as one
batch of 2). Each mode is one sampling run; its step time is the median of the steady steps
(after the first two: model load, dense warm-up, kernel JIT and, compiled, the compiles).

Modes, each eager and compiled (``compiled``: ComfyUI's own TorchCompileModel path,
``set_torch_compile_wrapper(backend="inductor")`` on the patched model, so the diffusion model
is compiled and Chorus's APPLY_MODEL wrapper stays outside it):
- ``dense_comfyui``: no Chorus, ComfyUI as shipped (its SDPA priority list: cuDNN first). The
  eager row is ``vs_comfyui_default``'s baseline;
- ``dense_fa4``: Chorus installed with every call dense (``DenseProvider``), so every
  self-attention runs FlashAttention-4's dense forward (``dense_attention="auto"``);
- ``hit_fa4_<d>``: a bank hit as served (static per-layer masks behind one dense warm-up
  step), FA4 block-sparse, warm-up step on FA4 dense;
- ``hit_triton_<d>``: the same on the Triton kernel with ComfyUI's dense attention (what a
  GPU without FA4 runs);
- ``miss_online``: online prediction (pooled q/k, top-p 0.9 clamped to density 0.15), FA4;
- ``hit_fr_<d>``: the FA4 hit plus Feature Reuse at strength 0.5 (half the start frame's cells
  pooled) with its shipped settings otherwise, except that every measured block and step is
  reduced (scaled to its default window below).

Whole generation: 40 euler steps at 40 blocks, each step ``a + 40 x per-block time`` with
``a`` the same run mode's step with no blocks (``nonblock``; compiled, the smaller of the compiled
and the eager one: ``outside_blocks_ms`` says why). Dense rows: 40 dense steps. Hit and
miss rows: 1 dense warm-up step (the ``dense_fa4`` step of the same compile mode, or
``dense_comfyui`` for the Triton rows) + 39 steps of the mode. Feature Reuse: its default window
(the steps with sigma below ``percent_to_sigma(0.3)`` of ComfyUI's simple schedule at shift 5,
counted here) reduced on 38 of 40 blocks (``skip_first = skip_last = 1``), the other steps as
the hit. ``vs_comfyui_default`` = dense_comfyui eager generation / this row's;
``vs_best_dense`` = the fastest dense generation of this run (eager or compiled) / this row's.
Per-request host overhead (match, fingerprint, the entry's decode on the prefetch worker) is
not in these rows: ``reuse_loop_h200.md`` measures it on the product path.

Writes ``fast_path_h200.json`` and ``.md`` (``fast_path_tiny`` with ``--tiny``) into ``--out``
after every measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_end_to_end as e2e  # noqa: E402  (model, request, masks, timing: shared with the older benchmark)

import torch  # noqa: E402

REPO_ROOT = e2e.REPO_ROOT
GEN_STEPS, WARMUP_STEPS, FULL_LAYERS = 40, 1, 40
FR_SKIPPED_BLOCKS = 2  # Feature Reuse's default skip_first + skip_last
BACKEND_ENV = "CHORUS_BLOCK_SPARSE_BACKEND"
METHOD = __doc__[__doc__.index("What runs:"):__doc__.index("Writes ``fast")].strip()  # the results files quote it
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------


def mode_table(densities) -> list[tuple[str, dict]]:
    """(key, spec) in the order they run: baselines first, then the rows the targets name."""
    modes = [("nonblock", dict(kind="dense_comfyui", layers=0)),
             ("dense_comfyui", dict(kind="dense_comfyui")),
             ("dense_fa4", dict(kind="dense_fa4"))]
    modes += [(f"hit_fa4_{d}", dict(kind="hit", backend="fa4", density=d)) for d in densities]
    modes += [("miss_online", dict(kind="online", backend="fa4", density=0.15)),
              ("hit_triton_0.15", dict(kind="hit", backend="triton", density=0.15, dense_attention="comfyui")),
              ("hit_fr_0.15", dict(kind="hit_fr", backend="fa4", density=0.15))]
    return modes


def provider_for(spec, ctx, layers):
    from chorus_core.attention.mask_provider import DenseProvider, DenseWarmupProvider, StaticBlockMapProvider
    from chorus_core.attention.mask_sources import OnlinePredictionProvider

    if spec["kind"] == "dense_fa4":
        return DenseProvider(block_size=(e2e.BLOCK, e2e.BLOCK))
    if spec["kind"] == "online":
        d = spec["density"]
        return DenseWarmupProvider(OnlinePredictionProvider(e2e.BLOCK, top_p=0.9, min_density=d, max_density=d),
                                   WARMUP_STEPS)
    maps = {layer: ctx["hit_maps"][spec["density"]][layer] for layer in range(layers)}
    return DenseWarmupProvider(StaticBlockMapProvider.for_all_steps(maps, (e2e.BLOCK, e2e.BLOCK)), WARMUP_STEPS)


def patched_model(ctx, spec, layers, compiled: bool):
    """The ModelPatcher a user's graph would hand the sampler for this mode."""
    from chorus_core.attention.sparse_patch import install_sparse_attention

    patcher = ctx["patcher"]
    if spec["kind"] != "dense_comfyui":
        patcher = install_sparse_attention(patcher, provider_for(spec, ctx, layers),
                                           dense_attention=spec.get("dense_attention", "auto"))
    if spec["kind"] == "hit_fr":
        patcher = with_feature_reuse(patcher, ctx, layers)
    if compiled:
        from comfy_api.torch_helpers import set_torch_compile_wrapper

        patcher = patcher.clone()
        set_torch_compile_wrapper(model=patcher, backend="inductor")
    return patcher


def with_feature_reuse(patcher, ctx, layers):
    from chorus_core.guidance.feature_regions import select_regions, token_grid
    from chorus_core.guidance.feature_reuse import FeatureReuseSettings, install_feature_reuse

    latent = ctx["req"][2]
    grid = token_grid(latent.shape[2:])
    start = ctx["req"][0][0][1]["concat_latent_image"][:, :, :1]
    settings = FeatureReuseSettings(start_percent=0.0, layers=tuple(range(layers)))
    region_map = select_regions(start, grid, 0.5, settings.cell)
    return install_feature_reuse(patcher, region_map, grid, settings)


@contextlib.contextmanager
def forced_backend(name):
    previous = os.environ.get(BACKEND_ENV)
    if name:
        os.environ[BACKEND_ENV] = name
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = previous


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": counters["stats"].get("unique_graphs", 0)}


def run_mode(ctx, key, spec, compiled: bool) -> dict:
    from chorus_core.attention.sparse_patch import get_run_stats

    layers = spec.get("layers", ctx["blocks"])
    e2e.set_blocks(ctx["model"], ctx["all_blocks"], layers)
    before = dynamo_counts()
    torch._dynamo.reset()  # each mode compiles from scratch, as a fresh ComfyUI process would
    with forced_backend(spec.get("backend") if ctx["cuda"] else None):  # CPU: the reference, whatever the row
        patcher = patched_model(ctx, spec, layers, compiled)
        m = e2e.timed_sample(patcher, ctx["req"], ctx["steps"], ctx["cuda"], "comfyui")
    after = dynamo_counts()
    steady = m["step_ms_all"][2:]
    m.update(layers=layers, step_ms=statistics.median(steady), step_ms_steady=steady, compiled=compiled,
             first_two_steps_ms=m["step_ms_all"][:2])
    if compiled:
        m["graph_breaks"] = after["graph_breaks"] - before["graph_breaks"]
        m["graphs"] = after["unique_graphs"] - before["unique_graphs"]
    stats = get_run_stats(patcher) if spec["kind"] != "dense_comfyui" else None
    if stats is not None:
        m.update(sparse_calls=stats.sparse_calls, dense_calls=stats.dense_calls, backend=stats.backend,
                 dense_backend=stats.dense_backend, warnings=list(stats.warnings))
        dens = [s.mean_density for s in stats.layers.values() if s.mean_density is not None]
        m["measured_density"] = round(sum(dens) / len(dens), 4) if dens else None
    del patcher
    gc.collect()
    return m


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


def reduced_step_count(shift: float = 5.0, start_percent: float = 0.3) -> int:
    """Steps of a 40-step simple schedule inside Feature Reuse's default window (sigma below
    ``percent_to_sigma(start_percent)``), with ComfyUI's own model sampling at Wan's shift."""
    import comfy.model_sampling
    import comfy.samplers

    class Sampling(comfy.model_sampling.ModelSamplingDiscreteFlow, comfy.model_sampling.CONST):
        pass

    sampling = Sampling(type("Config", (), {"sampling_settings": {"shift": shift, "multiplier": 1000}})())
    sigmas = comfy.samplers.calculate_sigmas(sampling, "simple", GEN_STEPS)
    bound = sampling.percent_to_sigma(start_percent)
    return sum(1 for s in sigmas[:-1].tolist() if s <= bound)


def derive_rows(shape, res, n_tokens):
    rows = []
    step40, gens = {}, {}
    for compiled in (False, True):
        tag = "compiled" if compiled else "eager"
        a = outside_blocks_ms(res, tag)
        if a is None:
            continue
        for key, m in res.items():
            if key.endswith(f"_{tag}") and not key.startswith("nonblock") and m.get("layers"):
                per_block = (m["step_ms"] - a) / m["layers"]
                step40[key] = (a, per_block)

    def s40(key, reduced_blocks=0, full_key=None):
        a, pb = step40[key]
        if not reduced_blocks:
            return a + FULL_LAYERS * pb
        return a + reduced_blocks * pb + (FULL_LAYERS - reduced_blocks) * step40[full_key][1]

    reduced_steps = res.get("fr_reduced_steps", 0)
    for compiled in (False, True):
        tag = "compiled" if compiled else "eager"
        for key in [k for k in res if k.endswith(f"_{tag}") and k in step40]:
            mode = key[: -len(tag) - 1]
            warm_key = f"dense_comfyui_{tag}" if mode.startswith("hit_triton") else f"dense_fa4_{tag}"
            if mode.startswith("dense"):
                gen = GEN_STEPS * s40(key)
            elif warm_key not in step40:
                continue
            elif mode.startswith("hit_fr"):
                hit_key = key.replace("hit_fr", "hit_fa4")
                if hit_key not in step40:
                    continue
                fr_step = s40(key, FULL_LAYERS - FR_SKIPPED_BLOCKS, hit_key)
                gen = (WARMUP_STEPS * s40(warm_key) + reduced_steps * fr_step
                       + (GEN_STEPS - WARMUP_STEPS - reduced_steps) * s40(hit_key))
            else:
                gen = WARMUP_STEPS * s40(warm_key) + (GEN_STEPS - WARMUP_STEPS) * s40(key)
            gens[key] = gen / 1e3
    base = gens.get("dense_comfyui_eager")
    best_dense = min((g for k, g in gens.items() if k.startswith("dense")), default=None)
    for key, gen in gens.items():
        m = res[key]
        tag = "compiled" if m["compiled"] else "eager"
        mode = key[: -len(tag) - 1]
        row = dict(shape=shape, N=n_tokens, batch=2, case=mode, mode=_results_mode(mode),
                   kind="online_prediction" if mode == "miss_online" else None, compiled=m["compiled"],
                   density=_density_of(mode), measured_density=m.get("measured_density"),
                   backend=(m.get("backend") or "").split(" ")[0] or None,
                   dense_backend=(m.get("dense_backend") or "").split(" ")[0] or None,
                   step_ms=round(s40(key), 1), step_ms_measured=round(m["step_ms"], 1),
                   outside_blocks_ms=round(step40[key][0], 1),
                   blocks_measured=m["layers"], block_ms=round(step40[key][1], 2),
                   generation_s=round(gen, 1),
                   vs_comfyui_default=round(base / gen, 3) if base else None,
                   vs_best_dense=round(best_dense / gen, 3) if best_dense else None,
                   speedup_whole_generation=round(best_dense / gen, 3) if best_dense else None)
        if m["compiled"]:
            row.update(graph_breaks=m.get("graph_breaks"), graphs=m.get("graphs"))
        rows.append(row)
    return rows


def outside_blocks_ms(res: dict, tag: str):
    """The step time outside the blocks, which the projection keeps once and does not scale.

    Compiled, it is the smaller of the compiled and the eager no-block step. A compiled model
    with no blocks has almost no GPU work, so its step is the host's launch and guard time
    (480p: 39.8 ms against 14.4 ms eager), which a model with blocks hides behind the GPU's work;
    subtracted from the 2-block step and scaled, that over-stated time made the 480p projection
    10 % (dense) to 23 % (hit) faster than the whole 40-block generation
    (``few_step_h200_480p_cfg5.md``). The work outside the blocks is the same in both modes."""
    own = res.get(f"nonblock_{tag}")
    if own is None:
        return None
    eager = res.get("nonblock_eager")
    return min(own["step_ms"], eager["step_ms"]) if tag == "compiled" and eager else own["step_ms"]


def _results_mode(case: str) -> str:
    """RESULTS.md's ``mode`` for a case: dense, hit, miss or hit+feature_reuse."""
    if case.startswith("hit_fr"):
        return "hit+feature_reuse"
    return case.split("_", 1)[0]


def _density_of(mode: str):
    tail = mode.rsplit("_", 1)[-1]
    try:
        return float(tail)
    except ValueError:
        return 0.15 if mode == "miss_online" else 1.0


def targets(rows) -> list[str]:
    out = []
    for r in rows:
        if r["shape"] != "720p" or not r["case"].startswith("hit_fa4"):
            continue
        goal_best = 2.5 if r["density"] >= 0.15 else 2.8
        parts = [f"720p {r['case']} {'compiled' if r['compiled'] else 'eager'}: {r['vs_best_dense']}x vs best "
                 f"dense (target >= {goal_best}x: {'MET' if r['vs_best_dense'] >= goal_best else 'NOT MET'})"]
        if r["density"] == 0.15:
            ok = r["vs_comfyui_default"] >= 3.0
            parts.append(f"{r['vs_comfyui_default']}x vs ComfyUI default (target >= 3.0x: {'MET' if ok else 'NOT MET'})")
        out.append(", ".join(parts))
    for compiled in (False, True):
        by_mode = {r["case"]: r for r in rows if r["compiled"] == compiled and r["shape"] == "720p"}
        hit, online = by_mode.get("hit_fa4_0.15"), by_mode.get("miss_online")
        if hit and online:
            ok = hit["generation_s"] < online["generation_s"]
            out.append(f"720p {'compiled' if compiled else 'eager'}: hit {hit['generation_s']} s vs online miss "
                       f"{online['generation_s']} s (hit faster: {'MET' if ok else 'NOT MET'})")
    return out


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

COLUMNS = ["shape", "case", "mode", "compiled", "density", "backend", "dense_backend", "step_ms", "step_ms_measured",
           "generation_s", "vs_comfyui_default", "vs_best_dense", "graph_breaks", "graphs"]


def write_results(out_dir: Path, name: str, doc: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [f"# Fast path end to end ({doc['machine']})", "",
             f"- date: {doc['date']}", f"- machine: {doc['machine']}", f"- command: `{doc['command']}`",
             f"- git commit: {doc['git_commit']}",
             *[f"- rows re-derived from the measurements: {r['date']}, `{r['command']}`"
               for r in [doc["details"].get("rederived")] if r],
             f"- torch {doc['details']['torch']}, ComfyUI {doc['details']['comfyui']}, flash-attn-4 "
             f"{doc['details']['flash_attn']}", "", doc["method"], "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in doc["rows"]:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in COLUMNS) + " |")
    lines += ["", "Targets:", ""] + [f"- {t}" for t in doc["targets"]]
    lines += ["", "Not measured / caveats:", ""] + [f"- {t}" for t in doc["not_measured"]]
    lines += ["", "Measurements:", "", "```", json.dumps(doc["details"]["measurements"], indent=1)[:30000], "```"]
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")


def caveats(doc) -> list[str]:
    d = doc["details"]
    return ["speed only: random weights; the hit masks are synthetic (local 3D windows + global key columns per "
            "head, bench_end_to_end.py) and the same at every step",
            f"{d['blocks']} of 40 blocks timed and scaled (a + 40 x per-block time, per compile mode)",
            "each mode is one sampling run; step_ms is the median of its steady steps (after the first two)",
            "compile time is not in the generation times: first_two_steps_ms in the measurements holds it "
            "(ComfyUI compiles again for a new resolution)",
            "per-request host overhead is not in these rows (reuse_loop_h200.md: 0.40 % of a 720p hit generation, "
            "0.82 % at 480p)",
            "VAE, text and CLIP-vision encoders: outside the sampler, equal in every mode"] + doc["skipped"] + \
        [f"error: {e}" for e in d["errors"]]


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def rederive(path: Path, out_dir: Path, command: str) -> None:
    """Rows, targets and markdown again from a results file's measurements (no timing)."""
    doc = json.loads(path.read_text())
    doc["rows"] = []
    for shape, res in doc["details"]["measurements"].items():
        grid = (e2e.SHAPES | e2e.TINY_SHAPES)[shape]
        doc["rows"] += derive_rows(shape, res, math.prod(e2e.token_grid(grid)))
    doc["targets"] = targets(doc["rows"])
    doc["method"] = METHOD  # the rule now applied
    doc["details"]["rederived"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                   "command": command}
    write_results(out_dir, path.stem, doc)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO_ROOT / "tests" / "benchmarks" / "results"))
    p.add_argument("--tiny", action="store_true", help="dim 256, 2 blocks, a tiny latent, on the CPU")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--shapes", default="720p")
    p.add_argument("--densities", default="0.1,0.15")
    p.add_argument("--steps", type=int, default=5, help="sampling steps per timed run")
    p.add_argument("--compiled", default="eager,compiled", help="which of eager,compiled to run")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting new runs after this many seconds")
    p.add_argument("--extra-site", default=None)
    p.add_argument("--git-commit", default=None)
    p.add_argument("--command", default=None)
    p.add_argument("--name", default=None, help="results file name (default fast_path_h200 / fast_path_tiny)")
    p.add_argument("--rederive", default=None, metavar="JSON",
                   help="recompute rows and targets from a results file's measurements; write to --out")
    args = p.parse_args(argv)
    if args.rederive:
        return rederive(Path(args.rederive), Path(args.out), " ".join(["python"] + sys.argv))

    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    e2e.setup_comfy(cuda, args.extra_site)
    if not cuda:  # ComfyUI's CPU attention (sub-quadratic, psutil) breaks graphs; on a GPU it is SDPA
        import comfy.ldm.modules.attention as attention
        import comfy.ldm.wan.model as wan

        wan.optimized_attention = attention.attention_pytorch
    if args.tiny:
        dim, ffn, dtype, shapes, shape_table = 256, 512, torch.float32, ["tiny"], e2e.TINY_SHAPES
    else:
        dim, ffn, dtype, shapes, shape_table = 5120, 13824, torch.bfloat16, args.shapes.split(","), e2e.SHAPES
    densities = [float(d) for d in args.densities.split(",")]
    name = args.name or ("fast_path_tiny" if args.tiny else "fast_path_h200")
    fa_version = e2e.flash_attn_version()
    import comfyui_version

    doc = {"benchmark": "bench_fast_path",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": e2e.machine_name(cuda), "command": args.command or " ".join(["python"] + sys.argv),
           "git_commit": args.git_commit or "unknown", "rows": [], "targets": [], "skipped": [],
           "method": METHOD,
           "details": {"torch": torch.__version__, "comfyui": getattr(comfyui_version, "__version__", None),
                       "flash_attn": fa_version, "blocks": args.blocks, "dim": dim, "steps": args.steps,
                       "measurements": {}, "errors": []}}
    model, patcher = e2e.build_model(dim, ffn, args.blocks, device, dtype)
    all_blocks = list(model.diffusion_model.blocks)
    out_dir = Path(args.out)

    def save():
        doc["rows"] = []
        for shape in shapes:
            res = doc["details"]["measurements"].get(shape, {})
            n = math.prod(e2e.token_grid(shape_table[shape]))
            doc["rows"] += derive_rows(shape, res, n)
        doc["targets"] = targets(doc["rows"])
        doc["not_measured"] = caveats(doc)
        write_results(out_dir, name, doc)

    for shape in shapes:
        latent_thw = shape_table[shape]
        grid = e2e.token_grid(latent_thw)
        heads = dim // e2e.HEAD_DIM
        ctx = dict(cuda=cuda, model=model, patcher=patcher, all_blocks=all_blocks, blocks=args.blocks,
                   req=e2e.make_request(latent_thw), steps=args.steps)
        ctx["hit_maps"] = {d: [e2e.structured_block_map(grid, heads, d, 100 * layer + int(d * 100), device).cpu()
                               for layer in range(args.blocks)] for d in densities + [0.15]}
        res = doc["details"]["measurements"].setdefault(shape, {})
        res["fr_reduced_steps"] = reduced_step_count()
        for compiled in [c == "compiled" for c in args.compiled.split(",")]:
            tag = "compiled" if compiled else "eager"
            for key, spec in mode_table(densities):
                if time.perf_counter() - T0 > args.budget_s:
                    doc["skipped"].append(f"{shape} {key} {tag}: skipped, time budget")
                    continue
                try:
                    m = run_mode(ctx, key, spec, compiled)
                    res[f"{key}_{tag}"] = m
                    log(f"{shape} {key:16s} {tag:8s}: step {m['step_ms']:.1f} ms, steps {m['step_ms_all']}, "
                        f"breaks {m.get('graph_breaks')}, graphs {m.get('graphs')}, backend {m.get('backend')}, "
                        f"dense {m.get('dense_backend')}, density {m.get('measured_density')}")
                except Exception as exc:  # noqa: BLE001
                    doc["details"]["errors"].append(f"{shape} {key} {tag}: {type(exc).__name__}: {exc}")
                    log(f"FAILED {shape} {key} {tag}: {traceback.format_exc()}")
                if cuda:
                    torch.cuda.empty_cache()
                save()
    save()
    for r in doc["rows"]:
        log(" ".join(f"{c}={r.get(c)}" for c in COLUMNS))
    for t in doc["targets"]:
        log(t)


if __name__ == "__main__":
    main()
