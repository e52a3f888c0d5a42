"""Whole generations in the step-distilled regime (4-8 steps, cfg 1), measured at all 40 blocks.

Run on a CUDA machine from the repo root (ComfyUI importable, e.g. ``COMFYUI_PATH`` set, and
``flash-attn-4`` importable for the FA4 rows):

    python tests/benchmarks/bench_few_step.py --out DIR --shape 720p --steps 4,8 [--cfg 1] [--budget-s 540]

or on the CPU at a tiny width and grid, to test the script end to end: ``--tiny``. ``--profile
hit_dense0_compiled`` adds one profiled generation of that case after its timed one (operator
tables beside the results, the GPU's busy share in the JSON): where a hit's time goes besides
attention and GEMMs. ``model_load_s`` is the time ComfyUI spent loading the model in a generation.
A table longer than one device call (480p, 40 steps, cfg 5) splits by ``--only`` over calls on
one machine with ``--bank /tmp/few-step-bank``: the first call records the entry there, later
calls serve their hits from it (the random weights are seeded, so every call builds the same
model) and merge with ``--merge``. A dense run longer than one call (720p, 40 steps, cfg 5: about
800 s) is timed as the stages of a KSamplerAdvanced split, ``--stage 0:20`` then ``--stage
20:40`` in two calls, and ``--merge`` joins them (``few_step_stages.py``); the latent between
them is kept in files under ``--stage-latent``, small enough for the device to return, so the
stages may run in different sessions (a compiled dense stage warms up on ``--warmup-steps 1``: a
dense mode needs no sparse step in its warm-up, and on the H200 a dense FA4 model compiled on a
1-step schedule compiled nothing more for 2 steps or a 16-step stage, ``few_step_h200_720p_cfg5_runs``;
an eager stage that does not start the run warms up on one step, so the joined row pays
FlashAttention-4's just-in-time compile once, as a whole run does).
Pass ``--call-limit-s`` a little under the device call's limit: a compiled mode's timed generation
that its warm-up says would be killed at that limit is not started, and the results say so. The
estimate needs step times without a compile in them, so with the flag a warm-up whose last
generation compiled a graph runs once more. Send
the output to a file under ``$OUT`` and read its tail afterwards (``> $OUT/log 2>&1``), not through
a pipe: a call killed at its limit returns what is in ``$OUT``, and a pipe's buffer is lost. An entry
recorded at cfg 1 (batch 1, a call's worth at 720p) serves a cfg 5 run's hits: it is the same
request, and an entry's masks serve cond and uncond alike.

What runs: ComfyUI's ``WAN21_I2V`` ``WanModel`` at Wan2.1-I2V-14B width (dim 5120, 40 heads x
128, ffn 13824), all 40 blocks, bf16, random weights (``bench_end_to_end.build_model``), and its
I2V conditioning; ``comfy.sample.sample`` with euler and the simple scheduler at ``--cfg``
(at cfg 1 ComfyUI runs the cond alone: batch 1, as step-distilled workflows do). Every Chorus
request goes the way the nodes take it: Similarity Match (``build_match_request`` +
``match_request`` against a real SQLite bank in a temporary folder), then ``ReusePatch.install()``
and the sampling call (the Sparse Wan Sampler). A generation is timed whole, from the match to
the sampler's return after a CUDA sync; nothing is projected or scaled.

Modes, in the order they run:
- ``dense_comfyui`` (eager): ComfyUI as shipped (its SDPA priority list), ``vs_comfyui_default``'s baseline;
- ``dense_fa4`` (eager, then compiled): Chorus with every call dense, so every self-attention runs
  FlashAttention-4's dense forward;
- ``miss_recording`` (eager): an empty bank, so a miss that records the entry the hits are served
  from (online prediction, density clamped to ``--density``; the entry is written in the background
  and waited for). Recorded once, at the largest ``--steps`` value: an entry serves runs sampled at
  most as finely as it was recorded (``entry_source.schedule_shortfall``), so the finest schedule
  serves every other step count by sigma;
- ``hit`` with ``dense_steps`` 0 (the default: a hit's entry holds every step's masks) and 1;
- ``online`` (a miss: threshold 1.01, nothing recorded) with ``dense_steps`` 1 (a miss's default
  warm-up) and 0, compiled and eager.
The Chorus modes run compiled (unless ``--no-compile``): ComfyUI's own TorchCompileModel path,
``set_torch_compile_wrapper(backend="inductor")`` on the patched model. The first generation of
each compiled mode is a warm-up of ``--warmup-steps`` steps (a dense step and a sparse one); its
time is reported as ``compile_s`` (it holds the compile and those steps). After it, every timed
Chorus generation makes a new match and a new install, as a new prompt does, so a recompile that a
new request causes is inside its ``generation_s`` (column ``graphs``: graphs compiled during it).

``vs_best_dense`` = the fastest dense generation of the same shape, steps and cfg / this row's;
``vs_online_miss`` = the fastest online miss with one dense step (eager or compiled) / this row's;
``vs_comfyui_default`` = ``dense_comfyui`` / this row's.

Writes ``few_step_<machine>_<shape>.json`` and ``.md`` into ``--out`` after every generation
(``few_step_tiny`` with ``--tiny``; keys: ../shared/RESULTS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bench_end_to_end as e2e  # noqa: E402  (model, request, machine name; puts the repo root on sys.path)
import bench_reuse_loop as loop  # noqa: E402  (the background writer's flush, the commit, the table)
import few_step_stages as stages  # noqa: E402  (a dense run longer than one call, timed in two stages)

import torch  # noqa: E402

SAMPLER, SCHEDULER = "euler", "simple"
HIT_THRESHOLD, NO_MATCH_THRESHOLD = 0.9, 1.01  # cosine similarity never exceeds 1
FLUSH_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Mode:
    key: str  # dense_comfyui, dense_fa4, miss_recording, hit, online
    compiled: bool
    dense_steps: int = 0

    @property
    def label(self) -> str:
        tag = "compiled" if self.compiled else "eager"
        dense = "" if self.key.startswith("dense") else f"_dense{self.dense_steps}"
        return f"{self.key}{dense}_{tag}"


def mode_plan(compiled: bool, eager_hit: bool) -> list[Mode]:
    """Baselines first, then the entry's recording, then the rows the targets name. Compiled, the
    online misses run eager too: the fastest online miss a user has is the ratio's denominator."""
    plan = [Mode("dense_comfyui", False), Mode("dense_fa4", False)]
    plan += [Mode("dense_fa4", True)] if compiled else []
    plan += [Mode("miss_recording", False, dense_steps=1)]
    plan += [Mode("hit", compiled, 0), Mode("hit", compiled, 1), Mode("online", compiled, 1),
             Mode("online", compiled, 0)]
    if compiled:
        plan += [Mode("online", False, 1), Mode("online", False, 0)] + ([Mode("hit", False, 0)] if eager_hit else [])
    return plan


# --------------------------------------------------------------------------------------------
# One generation
# --------------------------------------------------------------------------------------------


def chorus_options(mode: Mode, density: float):
    from chorus_core.reuse.reuse_run import ReuseOptions

    # a mode's dense steps are its warm-up only (hit_dense0: none at all), as the committed tables
    # were measured; dense_last_steps became 1 on 2026-12-06 (bench_user_stack.py's hit_last1 rows)
    return ReuseOptions(dense_warmup_steps=mode.dense_steps, hit_warmup_steps=mode.dense_steps,
                        min_density=density, max_density=density, miss_mode="online",
                        record_on_miss=mode.key == "miss_recording", dense_last_steps=0)


def compiled_clone(patcher):
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    patcher = patcher.clone()
    set_torch_compile_wrapper(model=patcher, backend="inductor")
    return patcher


def dense_model(ctx, mode: Mode):
    """The patched model of a dense mode, built once per mode (a user's graph keeps it cached)."""
    cached = ctx["dense_models"].get(mode.label)
    if cached is not None:
        return cached
    from chorus_core.attention.mask_provider import DenseProvider
    from chorus_core.attention.sparse_patch import install_sparse_attention

    patcher = ctx["patcher"]
    if mode.key == "dense_fa4":
        patcher = install_sparse_attention(patcher, DenseProvider(block_size=(e2e.BLOCK, e2e.BLOCK)))
    if mode.compiled:
        patcher = compiled_clone(patcher)
    ctx["dense_models"][mode.label] = patcher
    return patcher


def chorus_model(ctx, mode: Mode):
    """Similarity Match, then the Sparse Wan Sampler's install: what a new prompt runs."""
    from chorus_core.reuse.reuse_match import build_match_request, match_request
    from chorus_core.reuse.reuse_run import ReusePatch

    positive, _, latent, clip = ctx["req"]
    threshold = NO_MATCH_THRESHOLD if mode.key == "online" else HIT_THRESHOLD
    request = build_match_request(ctx["patcher"], clip, positive, {"samples": latent}, None, threshold, {}, e2e.BLOCK)
    patch = ReusePatch(ctx["patcher"], match_request(ctx["bank"], request), chorus_options(mode, ctx["density"]),
                       scheduler=SCHEDULER, sampler=SAMPLER)
    sampled = patch.install()
    return (compiled_clone(sampled) if mode.compiled else sampled), patch


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def generate(ctx, mode: Mode, steps: int, stage: tuple[int, int] | None = None) -> dict:
    """One timed sampling call: the whole schedule, or with ``stage`` (A, B) its steps A..B-1."""
    import comfy.sample

    cuda = ctx["cuda"]
    positive, negative, latent, _ = ctx["req"]
    noise, staged = comfy.sample.prepare_noise(latent, 0), {}
    if stage is not None:
        latent, noise, staged = stages.staged_sampling(stage, steps, ctx["stage_latent"], mode.label, latent, noise)
    stamps, patch = [], None

    def callback(step, x0, x, total):
        e2e.sync(cuda)
        stamps.append(time.perf_counter())

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    e2e.sync(cuda)
    graphs_before = graphs_compiled()
    start = time.perf_counter()
    with timed_model_loads(cuda) as loads:
        if mode.key.startswith("dense"):
            sampled = dense_model(ctx, mode)
        else:
            sampled, patch = chorus_model(ctx, mode)
        out = comfy.sample.sample(sampled, noise, steps, ctx["cfg"], SAMPLER, SCHEDULER, positive, negative, latent,
                                  callback=callback, disable_pbar=True, seed=0, **staged)
    e2e.sync(cuda)
    end = time.perf_counter()
    ran = stages.steps_run(stage, steps)
    if len(stamps) != ran:
        raise RuntimeError(f"{mode.label}: the sampler called back {len(stamps)} times for {ran} steps")
    if stage is not None:
        stages.keep_stage_output(stage, steps, ctx["stage_latent"], mode.label, out)
    step_ms = [round((b - a) * 1e3, 1) for a, b in zip([start] + stamps[:-1], stamps)]
    m = dict(generation_s=round(end - start, 3), step_ms=step_ms, graphs=graphs_compiled() - graphs_before,
             model_load_s=round(sum(loads), 3), finite=bool(torch.isfinite(out).all()))
    if patch is not None:
        m.update(report_fields(patch.last_report))
    return m


@contextlib.contextmanager
def timed_model_loads(cuda: bool):
    """Seconds spent in ComfyUI's ``load_models_gpu`` (moving weights to the GPU before the first
    step): part of a generation's first step, and not Chorus's work when the model was offloaded."""
    import comfy.model_management as mm

    seconds, load = [], mm.load_models_gpu

    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return load(*args, **kwargs)
        finally:
            e2e.sync(cuda)
            seconds.append(time.perf_counter() - began)

    mm.load_models_gpu = timed
    try:
        yield seconds
    finally:
        mm.load_models_gpu = load


def report_fields(report) -> dict:
    rep = report.to_json()
    kept = [layer["density"] for layer in rep["layers"] if layer.get("density") is not None]
    return dict(run_mode=rep["mode"], mask_source=rep["mask_source"], entry_id=rep["entry_id"],
                recorded_entry_id=rep["recorded_entry_id"], dense_step_reasons=rep["dense_steps"],
                measured_density=round(statistics.mean(kept), 4) if kept else None,
                backend=(rep["backend"] or "").split(" ")[0] or None,
                dense_backend=(rep["dense_backend"] or "").split(" ")[0] or None, warnings=rep["warnings"],
                timings=rep["timings"])


def check_path(mode: Mode, m: dict, steps: int) -> None:
    """Raise when a Chorus generation did not take the path its row is named for."""
    if mode.key.startswith("dense"):
        return
    expect = "hit" if mode.key == "hit" else "miss"
    if m["run_mode"] != expect:
        raise RuntimeError(f"{mode.label}: the run was a {m['run_mode']} ({m['mask_source']}; {m['warnings']})")
    dense = len(m["dense_step_reasons"])
    if dense != min(mode.dense_steps, steps):
        raise RuntimeError(f"{mode.label}: {dense} dense steps ({m['dense_step_reasons']}), "
                           f"expected {mode.dense_steps}")


def record_entry(ctx, steps: int) -> dict:
    """The miss that records the hits' entry; waits for the background writer."""
    mode = Mode("miss_recording", False, dense_steps=1)
    m = generate(ctx, mode, steps)
    flush = loop.bank_writer_flush()
    if flush is not None and flush(FLUSH_TIMEOUT_S) is False:
        raise RuntimeError(f"the bank writer had not finished after {FLUSH_TIMEOUT_S:.0f} s")
    entries = ctx["bank"].entries()
    if len(entries) != 1:
        raise RuntimeError(f"the recording left {len(entries)} entries in the bank ({m.get('warnings')})")
    return m


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


# a hit's prefetch timings (the run report's), kept in each row when the run had them
PREFETCH_TIMINGS = ("prefetch_wait_ms", "prefetch_first_bucket_ms", "prefetch_decode_threads")


def measurement_key(label: str, steps: int) -> str:
    """A measurement's key in ``details.measurements``: its mode's label and step count."""
    return f"{label}@{steps}"


def split_measurement_key(key: str) -> tuple[str, int]:
    label, steps = key.rsplit("@", 1)
    return label, int(steps)


def derive_rows(doc: dict) -> list[dict]:
    rows = []
    meas = doc["details"]["measurements"]
    for key, m in meas.items():
        label, steps = split_measurement_key(key)
        if stages.is_partial(m):
            continue  # one stage of a split run: a row once --merge has joined its stages
        rows.append(dict(shape=doc["details"]["shape"], steps=steps, cfg=doc["details"]["cfg"],
                         blocks=doc["details"]["blocks"], mode=m["mode"], case=label, compiled=m["compiled"],
                         density=1.0 if m["mode"] == "dense" else doc["details"]["density"],
                         measured_density=m.get("measured_density"), dense_steps=m["dense_steps"],
                         backend=m.get("backend"), dense_backend=m.get("dense_backend"),
                         generation_s=m["generation_s"], compile_s=m.get("compile_s"), graphs=m.get("graphs"),
                         step_ms_all=m["step_ms"], step_ms=round(statistics.median(m["step_ms"][1:] or m["step_ms"]), 1),
                         batch=1 if doc["details"]["cfg"] == 1.0 else 2,
                         kind="online_prediction" if label.startswith("online") else None,
                         run=m.get("run", 0), first_step_s=round(m["step_ms"][0] / 1e3, 2),
                         model_load_s=m.get("model_load_s"),
                         last_step_s=round(m["step_ms"][-1] / 1e3, 2),
                         **{k: (m.get("timings") or {}).get(k) for k in PREFETCH_TIMINGS}))
    floors = unfinished_dense_floor_s(doc["details"])
    for row in rows:
        same = [r for r in rows if r["steps"] == row["steps"]]
        joined = min((r["generation_s"] for r in same if r["mode"] == "dense"), default=None)
        best = fastest_dense_s_if_decided(joined, floors.get(row["steps"]))
        base = next((r["generation_s"] for r in same if r["case"] == "dense_comfyui_eager"), None)
        online = fastest_online_miss(same)
        row["vs_best_dense"] = row["speedup_whole_generation"] = round(best / row["generation_s"], 3) if best else None
        # the fastest dense run can only get faster once the one still in stages is joined
        row["vs_best_dense_at_most"] = round(joined / row["generation_s"], 3) if joined and not best else None
        row["vs_comfyui_default"] = round(base / row["generation_s"], 3) if base else None
        row["vs_online_miss"] = round(online / row["generation_s"], 3) if online else None
    return rows


def unfinished_dense_floor_s(details: dict) -> dict[int, float]:
    """Step counts with a dense mode timed in stages that do not yet cover its schedule, each with
    the least time such a mode can still take (its timed stages). Until it is known, a ratio
    against the dense rows that are in could compare a hit with a slower baseline than the one
    still running (720p, 40 steps, cfg 5: dense FA4 compiled, steps 0-27 of 40 timed, would have
    left dense ComfyUI as the "fastest" at 2.9x)."""
    floors = {key: m["generation_s"] for key, m in details["measurements"].items()
              if stages.is_partial(m) and m["mode"] == "dense"}
    floors.update(details.get("unjoined_floor_s", {}))
    out: dict[int, float] = {}
    for key, floor in floors.items():
        _, steps = split_measurement_key(key)
        out[steps] = min(floor, out.get(steps, floor))
    return out


def fastest_dense_s_if_decided(joined_best_s: float | None, unfinished_floor_s: float | None) -> float | None:
    """The fastest dense generation's seconds, or None while a dense mode still in stages could
    beat it: one whose timed stages alone already take as long cannot."""
    if unfinished_floor_s is None or (joined_best_s is not None and unfinished_floor_s >= joined_best_s):
        return joined_best_s
    return None


def fastest_online_miss(rows: list[dict]):
    """The fastest online miss with one dense step, eager or compiled: the baseline a user has."""
    return min((r["generation_s"] for r in rows if r["case"].startswith("online_dense1")), default=None)


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, each met or not, for every compiled hit with no dense step: 720p at 4
    steps (>= 2.4x the fastest dense run, >= 1.35x an online miss) and 40 steps at cfg 5 (>= 2.5x
    the fastest dense run, >= 3.0x ComfyUI's default); other rows are reported with no target."""
    out = []
    for r in rows:
        if r["case"] != "hit_dense0_compiled":
            continue
        head = f"{r['shape']} {r['steps']} steps cfg {r['cfg']}, hit with no dense step, compiled"
        if r["shape"] == "720p" and r["steps"] == 4:
            pairs = [("the fastest dense run", r["vs_best_dense"], 2.4, r.get("vs_best_dense_at_most")),
                     ("an online miss with one dense step", r["vs_online_miss"], 1.35, None)]
        elif r["steps"] == 40 and r["cfg"] == 5.0:
            pairs = [("the fastest dense run", r["vs_best_dense"], 2.5, r.get("vs_best_dense_at_most")),
                     ("ComfyUI's default", r["vs_comfyui_default"], 3.0, None)]
        else:
            out.append(f"{head}: {r['vs_best_dense']}x the fastest dense run, {r['vs_online_miss']}x an online "
                       "miss with one dense step (no target at this shape and step count)")
            continue
        out.append(f"{head}: " + ", ".join(target_status(*pair) for pair in pairs))
    return out


def target_status(what: str, ratio, goal: float, at_most=None) -> str:
    """One target's verdict; a run whose baseline is not in the table (a split table's call) says
    so rather than calling the target missed, unless the ratio is already bound to stay under it."""
    if ratio is None and at_most is not None and at_most < goal:
        return (f"at most {at_most}x {what}, as a dense run still in stages can only lower it "
                f"(target >= {goal}x: NOT MET)")
    if ratio is None:
        return f"{what} not in this run (target >= {goal}x: not yet measured)"
    return f"{ratio}x {what} (target >= {goal}x: {'MET' if ratio >= goal else 'NOT MET'})"


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

COLUMNS = ["run", "shape", "steps", "cfg", "blocks", "case", "mode", "compiled", "density", "measured_density",
           "dense_steps", "backend", "generation_s", "first_step_s", "last_step_s", "prefetch_wait_ms",
           "prefetch_first_bucket_ms", "prefetch_decode_threads", "model_load_s",
           "compile_s", "graphs", "vs_best_dense", "vs_best_dense_at_most", "vs_online_miss", "vs_comfyui_default"]


def write_results(out_dir: Path, name: str, doc: dict) -> None:
    doc["rows"] = derive_rows(doc)
    doc["targets"] = targets(doc["rows"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [f"# Few-step whole generations ({doc['machine']})", "",
             f"- date: {doc['date']}", f"- machine: {doc['machine']}", f"- command: `{doc['command']}`",
             f"- git commit: {doc['git_commit']}",
             *[f"- run {r['run']}: {r['date']}, `{r['command']}`, flash-attn-4 {r.get('flash_attn')}"
               for r in doc["details"].get("runs", [])],
             f"- torch {doc['details']['torch']}, ComfyUI {doc['details']['comfyui']}, flash-attn-4 "
             f"{doc['details']['flash_attn']}", "", doc["method"], ""] + loop.table(doc["rows"], COLUMNS)
    lines += ["", "Targets:", ""] + [f"- {t}" for t in doc["targets"] or ["(no compiled hit row)"]]
    lines += ["", "Caveats:", ""] + [f"- {c}" for c in caveats(doc)]
    lines += ["", "Per-step times (ms) of every generation are in the JSON (`rows[].step_ms_all`; `step_ms` is the "
              "median after the first step)."]
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")


def caveats(doc: dict) -> list[str]:
    d = doc["details"]
    return (["speed only: random weights, so the recorded masks carry no structure; their density is clamped to "
             f"{d['density']} (min_density = max_density)",
             *([f"the hits of every step count are served from one entry recorded at {d['recorded_steps']} steps "
                "(addressed by sigma)"] if d["recorded_steps"] else []),
             "compile_s is the warm-up generation of a compiled mode (compile + its steps), or the 1-step "
             "warm-up of an eager stage that does not start its run; not in generation_s",
             "dense ComfyUI compiled is not run: it was slower than dense FA4 compiled at 720p cfg 5 "
             "(fast_path_h200_720p.md: 22.6 s vs 20.4 s per 40-block step)",
             "VAE, text and CLIP-vision encoders: outside the sampler, equal in every mode"]
            + stage_notes(d["measurements"]) + d["skipped"] + [f"error: {e}" for e in d["errors"]])


def stage_notes(meas: dict) -> list[str]:
    """A line for each stage timed alone (no row until --merge joins it) and each joined run."""
    notes = []
    for key, m in meas.items():
        if stages.is_partial(m):
            notes.append(f"{key}: stage {m['stage'][0]}:{m['stage'][1]} only, {m['generation_s']} s (no row: "
                         "--merge joins it with its other stage)")
        elif m.get("stages"):
            notes.append(f"{key}: timed as {len(m['stages'])} stages of a KSamplerAdvanced split in separate calls "
                         f"(runs {[p['run'] for p in m['stages']]}), joined: "
                         + " + ".join(f"{p['generation_s']} s" for p in m["stages"]))
    return notes


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(BENCH_DIR / "results"))
    p.add_argument("--tiny", action="store_true", help="dim 256, 2 blocks, a tiny latent, on the CPU")
    p.add_argument("--shape", default="720p")
    p.add_argument("--steps", default="4,8", help="step counts, each a whole timed generation per mode")
    p.add_argument("--cfg", type=float, default=1.0)
    p.add_argument("--density", type=float, default=0.15)
    p.add_argument("--warmup-steps", default="2,3",
                   help="steps of the first compiled mode's warm-up generations (two step counts, so the compiled "
                        "model is already general over the schedule's length); later modes warm up on the first")
    p.add_argument("--eager-hit", action="store_true", help="also time the hit eager")
    p.add_argument("--only", default=None, help="comma-separated mode labels to run (e.g. online_dense1_eager)")
    p.add_argument("--no-compile", action="store_true", help="run every mode eager")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no generation after this many seconds")
    p.add_argument("--call-limit-s", type=float, default=None,
                   help="the device call's limit: a compiled mode's timed generation that its warm-up's step times "
                        "say would end past it is not started (killed, it would leave nothing), and the results "
                        "say so; a next call within ~30 s reuses the compile")
    p.add_argument("--extra-site", default=None, help="folder of carried pure-Python packages (appended to sys.path)")
    p.add_argument("--bank", default=None, metavar="DIR",
                   help="keep the bank in DIR (created if absent), not a temporary folder: a later call on "
                        "the same machine serves its hits from the entry recorded here, so a long table "
                        "(40 steps, cfg 5) splits over calls by --only")
    p.add_argument("--git-commit", default=None)
    p.add_argument("--command", default=None, help="the command line to record (default: argv)")
    p.add_argument("--profile", default=None, metavar="CASE,CASE",
                   help="after each named case's first timed generation, one more under torch.profiler: operator "
                        "tables to profile_<case>_<steps>.txt and the GPU's busy share to the results")
    p.add_argument("--note", action="append", default=[], help="a caveat to add to a merged document")
    p.add_argument("--stage", default=None, metavar="START:END",
                   help="time only steps START..END-1 of the --steps schedule, as one stage of a KSamplerAdvanced "
                        "split (dense modes only): a dense run longer than one device call is timed in two or more "
                        "calls, e.g. 0:N/2 then N/2:N, and --merge joins them")
    p.add_argument("--stage-latent", default=str(Path(tempfile.gettempdir()) / "chorus-few-step-stages"),
                   metavar="DIR", help="where a stage leaves the latent the next stage starts from, in parts "
                        "of at most 15 MiB: a folder under the device's $OUT comes back, and carried to a later "
                        "call (another session's machine) it starts the next stage there")
    p.add_argument("--merge", default=None, metavar="JSON,JSON,...",
                   help="combine results files of one shape (runs of this script in separate processes on one "
                        "machine, e.g. one device call each) into --out; the first file's measurement of a mode wins, "
                        "later ones are kept as repeats")
    return p.parse_args(argv)


def merge(paths: list[Path], out_dir: Path, command: str, notes: list[str]) -> None:
    """One results document from several runs; every measurement says which run it came from."""
    docs = [json.loads(p.read_text()) for p in paths]
    for path, d in zip(paths, docs):
        if "runs" in d["details"]:  # its skipped notes and bounds would carry over as this merge's
            raise SystemExit(f"{path} is a merged table: merge the run files its command names instead")
    merged = docs[0]
    merged["details"]["runs"] = [dict(run=i, date=d["date"], command=d["command"], git_commit=d["git_commit"],
                                      flash_attn=d["details"]["flash_attn"]) for i, d in enumerate(docs)]
    # a ComfyUI-only call need not install FA4: the header names the version the FA4 rows ran on
    merged["details"]["flash_attn"] = next((d["details"]["flash_attn"] for d in docs if d["details"]["flash_attn"]),
                                           None)
    merged["details"]["repeats"] = {}
    meas, parts = {}, {}
    merged["details"]["unjoined"], merged["details"]["unjoined_floor_s"] = [], {}
    for i, d in enumerate(docs):
        for what in ("shape", "cfg"):
            if d["details"][what] != merged["details"][what]:
                raise SystemExit(f"{paths[i]} has {what} {d['details'][what]}, not {merged['details'][what]}: "
                                 "merge runs of one shape and one cfg")
        for key, m in d["details"]["measurements"].items():
            m = dict(m, run=i)
            if stages.is_partial(m):
                parts.setdefault(key, []).append(m)
            elif key in meas:
                merged["details"]["repeats"].setdefault(key, []).append(m)
            else:
                meas[key] = m
        merged["details"]["errors"] += [e for e in d["details"]["errors"] if i]
    for key, staged in parts.items():
        join_staged(merged["details"], meas, key, staged)
    merged["details"]["measurements"] = meas
    merged["details"]["skipped"] += notes
    merged["command"] = command
    merged["date"] = max(d["date"] for d in docs)
    machine = "h200" if "H200" in merged["machine"] else "gpu"
    write_results(out_dir, results_name(machine, merged["details"]["shape"], merged["details"]["cfg"]), merged)


def join_staged(details: dict, meas: dict, key: str, staged: list[dict]) -> None:
    """One mode's stages joined into ``meas`` (a repeat if its whole run is in); stages that do not
    cover the schedule leave the mode unjoined, with the least time it can still take."""
    firsts, again = stages.first_of_each_stage(staged)
    if again:
        details["repeats"].setdefault(key, []).extend(again)
    joined = stages.join_stages(firsts, split_measurement_key(key)[1])
    if not isinstance(joined, str):
        if key in meas:
            details["repeats"].setdefault(key, []).append(joined)
        else:
            meas[key] = joined
    elif key in meas:  # its floor would undercut the whole run's own time
        details["skipped"].append(f"{key}: stages not joined, {joined}; its whole run is in")
    else:
        details["skipped"].append(f"{key}: not joined, {joined}")
        details["unjoined"].append(key)
        details["unjoined_floor_s"][key] = stages.timed_floor_s(firsts)


def results_name(machine: str, shape: str, cfg: float) -> str:
    """cfg 1 (the step-distilled regime) keeps the plain name; other cfg values get their own file, as
    a cfg 5 run's measurements would otherwise replace the cfg 1 ones of the same steps."""
    name = f"few_step_{machine}_{shape}"
    return name if cfg == 1.0 else f"{name}_cfg{cfg:g}"


def new_doc(args, cuda: bool, blocks: int, shape: str) -> dict:
    fa_version = e2e.flash_attn_version()
    import comfyui_version

    return {"benchmark": "bench_few_step",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": e2e.machine_name(cuda), "command": args.command or " ".join(["python"] + sys.argv),
            "git_commit": loop.git_commit(args.git_commit), "rows": [], "targets": [],
            "method": __doc__[__doc__.index("What runs:"):__doc__.index("Writes ``few")].strip(),
            "details": {"torch": torch.__version__, "comfyui": getattr(comfyui_version, "__version__", None),
                        "flash_attn": fa_version, "shape": shape, "blocks": blocks, "cfg": args.cfg,
                        "density": args.density, "recorded_steps": None, "measurements": {}, "skipped": [],
                        "errors": []}}


def results_mode(mode: Mode) -> str:
    """RESULTS.md's ``mode``: dense, hit or miss (an online run is a miss; ``case`` tells which)."""
    if mode.key.startswith("dense"):
        return "dense"
    return "hit" if mode.key == "hit" else "miss"


def warm_up(ctx, mode: Mode) -> float:
    """Warm-up generations of a compiled mode; seconds they took (compiles included).

    Compiling with one sigma schedule length and then sampling another recompiles (the schedule
    becomes a dynamic shape on its second length), so the first compiled mode warms up on two
    lengths and later modes, sharing its compiled code, on one."""
    lengths = ctx["warmup_steps"] if not ctx["warmed"] else ctx["warmup_steps"][:1]
    ctx["warmed"] = True
    warm_ups = [warm_up_generation(ctx, mode, steps) for steps in lengths]
    if ctx.get("call_limit_s") is not None and warm_ups[-1]["graphs"]:
        # a step that compiled took the compile's time, not a step's: the call-limit check on a
        # 1-step warm-up refused a 16-step dense FA4 stage at "2274 s" (run 6 of
        # few_step_h200_720p_cfg5_runs), so the last warm-up is repeated once to time the steps
        warm_ups.append(warm_up_generation(ctx, mode, lengths[-1]))
    ctx["warm_step_ms"] = compile_free_step_ms(warm_ups[-1])
    return round(sum(w["generation_s"] for w in warm_ups), 3)


def later_stage_warm_up(ctx, mode: Mode) -> float:
    """A 1-step generation before an eager stage that does not start the run; seconds it took.
    A whole run pays FlashAttention-4's just-in-time compile once, in its first step; a later
    stage, a new process, would pay it again in its own first step (run 10 of
    few_step_h200_720p_cfg5_runs: 28.4 s against 22.4 s), and the joined row would hold it twice."""
    return warm_up_generation(ctx, mode, 1)["generation_s"]


def warm_up_generation(ctx, mode: Mode, steps: int) -> dict:
    warm = generate(ctx, mode, steps)
    e2e.log(f"{mode.label}: warm-up of {steps} steps {warm['generation_s']:.1f} s, steps {warm['step_ms']}, "
            f"graphs {warm['graphs']}")
    return warm


def compile_free_step_ms(generation: dict) -> list[float] | None:
    """A generation's step times when none of its steps compiled a graph, else None: the
    call-limit check estimates a timed generation only from steps that show a step's time."""
    return None if generation["graphs"] else generation["step_ms"]


def profile_generation(ctx, mode: Mode, steps: int) -> dict:
    """One more generation of ``mode`` under torch.profiler, after its timed one (whose time it
    leaves alone): the operator tables go to ``profile_<case>_<steps>.txt`` beside the results,
    and the returned summary says how much of the generation the GPU was busy."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx["cuda"] else [])
    with profile(activities=activities) as prof:
        m = generate(ctx, mode, steps)
    table = prof.key_averages()
    sort = "self_cuda_time_total" if ctx["cuda"] else "self_cpu_time_total"
    path = ctx["out_dir"] / f"profile_{mode.label}_{steps}.txt"
    ctx["out_dir"].mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {mode.label}, {steps} steps, profiled generation {m['generation_s']} s, steps {m['step_ms']}\n\n"
                    f"## by {sort}\n\n{table.table(sort_by=sort, row_limit=40)}\n\n"
                    f"## by self_cpu_time_total\n\n{table.table(sort_by='self_cpu_time_total', row_limit=40)}\n")
    kernel_s = sum(getattr(e, "self_device_time_total", 0.0) for e in table
                   if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)) / 1e6
    summary = dict(file=path.name, generation_s=m["generation_s"], step_ms=m["step_ms"],
                   gpu_kernel_s=round(kernel_s, 3),
                   gpu_busy_share=round(kernel_s / m["generation_s"], 3) if ctx["cuda"] else None)
    e2e.log(f"{mode.label} profiled: {summary}")
    return summary


def run_mode(ctx, doc, mode: Mode, step_counts: list[int], save) -> None:
    meas = doc["details"]["measurements"]
    compile_s = None
    if mode.compiled:
        compile_s = warm_up(ctx, mode)
    elif ctx["stage"] and ctx["stage"][0] > 0:
        compile_s = later_stage_warm_up(ctx, mode)
    for steps in step_counts:
        if time.perf_counter() - e2e.T0 > ctx["budget_s"]:
            doc["details"]["skipped"].append(f"{mode.label} at {steps} steps: skipped, time budget")
            continue
        late = past_call_limit(ctx, mode, steps, compile_s)
        if late:
            doc["details"]["skipped"].append(late)
            e2e.log(late)
            save()
            continue
        m = generate(ctx, mode, steps, ctx["stage"])
        check_path(mode, m, steps)
        m.update(mode=results_mode(mode), compiled=mode.compiled,
                 dense_steps=steps if mode.key.startswith("dense") else mode.dense_steps, compile_s=compile_s,
                 stage=list(ctx["stage"]) if ctx["stage"] else None)
        meas[measurement_key(mode.label, steps)] = m
        e2e.log(f"{mode.label} @ {steps}: {m['generation_s']:.2f} s, steps {m['step_ms']}, graphs {m['graphs']}, "
                f"density {m.get('measured_density')}, backend {m.get('backend')}/{m.get('dense_backend')}, "
                f"timings {m.get('timings')}")
        save()
        if mode.label in ctx["profile"] and steps == step_counts[0]:
            m["profile"] = profile_generation(ctx, mode, steps)
            save()


def estimated_generation_s(warm_step_ms: list[float], steps: int) -> float:
    """A generation's time from its warm-up's steps: the first step (which holds a hit's mask wait
    or an online miss's dense step) once, then the median of the others for every further step."""
    rest = statistics.median(warm_step_ms[1:]) if len(warm_step_ms) > 1 else warm_step_ms[0]
    return (warm_step_ms[0] + rest * (steps - 1)) / 1e3


def past_call_limit(ctx, mode: Mode, steps: int, compile_s) -> str | None:
    """Why a timed generation is not started (it would be killed at the call's limit with nothing
    written), or None when it fits or nothing says otherwise (eager modes have no warm-up)."""
    limit, warm = ctx.get("call_limit_s"), ctx.get("warm_step_ms")
    if limit is None or not mode.compiled or not warm:
        return None
    timed = stages.steps_run(ctx["stage"], steps)
    now = time.perf_counter() - e2e.T0
    estimate = estimated_generation_s(warm, timed)
    if now + estimate <= limit:
        return None
    return (f"{mode.label} at {steps} steps: not started, its warm-up's steps say {estimate:.0f} s, which from "
            f"{now:.0f} s would end past --call-limit-s {limit:.0f} (compile_s {compile_s} ran; a next call "
            "within ~30 s reuses the compile)")


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        # quoted, so that the command a merged table records runs again as it stands (its notes have spaces)
        command = shlex.join(["python", sys.argv[0]] + (sys.argv[1:] if argv is None else list(argv)))
        return merge([Path(p) for p in args.merge.split(",")], Path(args.out), command, args.note)
    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    e2e.setup_comfy(cuda, args.extra_site)
    if args.tiny:
        dim, ffn, blocks, shape, latent_thw, dtype = 256, 512, 2, "tiny", e2e.TINY_SHAPES["tiny"], torch.float32
    else:
        dim, ffn, blocks, shape, dtype = 5120, 13824, e2e.FULL_LAYERS, args.shape, torch.bfloat16
        latent_thw = e2e.SHAPES[shape]
    step_counts = [int(s) for s in args.steps.split(",")]
    stage = stages.parse_stage(args.stage, step_counts) if args.stage else None
    if stage and (args.only is None or not all(label.startswith("dense") for label in args.only.split(","))):
        raise SystemExit("--stage times dense modes only (name them with --only): the hit, online and recording "
                         "rows of a long schedule fit one call")
    if stage and stage[0] > 0:
        stages.check_stage_latents(Path(args.stage_latent), args.only.split(","), step_counts[0], stage[0])
    machine = "tiny" if args.tiny else ("h200" if "H200" in e2e.machine_name(cuda) else "gpu")
    name = "few_step_tiny" if args.tiny else results_name(machine, shape, args.cfg)
    doc = new_doc(args, cuda, blocks, shape)
    out_dir = Path(args.out)
    model, patcher = e2e.build_model(dim, ffn, blocks, device, dtype)
    e2e.log(f"model built: {blocks} blocks, dim {dim}, on {device}")
    from chorus_core.bank import open_bank

    with tempfile.TemporaryDirectory(prefix="chorus-few-step-") as tmp:
        bank = open_bank(args.bank or tmp)
        ctx = dict(cuda=cuda, patcher=patcher, req=e2e.make_request(latent_thw), cfg=args.cfg, bank=bank,
                   density=args.density, warmed=False, stage=stage, stage_latent=Path(args.stage_latent),
                   warmup_steps=[int(s) for s in args.warmup_steps.split(",")], budget_s=args.budget_s, dense_models={},
                   call_limit_s=args.call_limit_s,
                   profile=set(args.profile.split(",")) if args.profile else set(), out_dir=out_dir)
        try:
            run_all(ctx, doc, args, step_counts, lambda: write_results(out_dir, name, doc))
        finally:
            bank.close()
    write_results(out_dir, name, doc)
    for r in doc["rows"]:
        e2e.log(" ".join(f"{c}={r.get(c)}" for c in COLUMNS))
    for t in doc["targets"]:
        e2e.log(t)


def run_all(ctx, doc, args, step_counts: list[int], save) -> None:
    plan = mode_plan(compiled=not args.no_compile, eager_hit=args.eager_hit)
    # the finest schedule: an entry recorded on fewer steps would not serve the others
    recorded_steps = max(step_counts)
    entry_kept = kept_entry(ctx["bank"], doc, recorded_steps)
    chosen = [m for m in plan if args.only is None or m.label in args.only.split(",")]
    if not entry_kept and any(m.key == "hit" for m in chosen) and not any(m.key == "miss_recording" for m in chosen):
        # before the hits' compile: a released device machine takes its /tmp bank with it
        raise SystemExit("the hits need the entry a recording miss puts in the bank, and this run neither records "
                         "one nor finds one in --bank: add miss_recording_dense1_eager to --only, or pass the "
                         "--bank folder a recording call filled on this machine")
    for mode in chosen:
        if time.perf_counter() - e2e.T0 > args.budget_s:
            doc["details"]["skipped"].append(f"{mode.label}: skipped, time budget")
            continue
        try:
            if mode.key == "miss_recording":
                if not entry_kept:
                    record_mode(ctx, doc, mode, recorded_steps, save)
            else:
                run_mode(ctx, doc, mode, step_counts, save)
        except Exception as exc:  # noqa: BLE001  (one mode's failure is a result; the others still run)
            doc["details"]["errors"].append(f"{mode.label}: {type(exc).__name__}: {exc}")
            e2e.log(f"FAILED {mode.label}: {traceback.format_exc()}")
        if ctx["cuda"]:
            torch.cuda.empty_cache()


def record_mode(ctx, doc, mode: Mode, steps: int, save) -> None:
    """The recording miss as a measured row, and the step count its entry serves from."""
    m = record_entry(ctx, steps)
    m.update(mode="miss", compiled=False, dense_steps=1, compile_s=None)
    doc["details"]["recorded_steps"] = steps
    doc["details"]["measurements"][measurement_key(mode.label, steps)] = m
    e2e.log(f"recorded: {m['generation_s']:.2f} s, steps {m['step_ms']}")
    save()


def kept_entry(bank, doc, needed_steps: int) -> bool:
    """Whether ``--bank`` already holds the hits' entry (an earlier call recorded it): then it is
    not recorded again, and the document says which entry its hits were served from."""
    entries = bank.entries()
    if not entries:
        return False
    if len(entries) != 1:
        raise RuntimeError(f"--bank holds {len(entries)} entries; the hits need exactly the one recorded for them")
    if entries[0]["steps"] < needed_steps:
        raise SystemExit(f"--bank holds an entry recorded at {entries[0]['steps']} steps; runs of "
                         f"{needed_steps} steps would not be served from it: use a new --bank folder")
    doc["details"]["recorded_steps"] = entries[0]["steps"]
    doc["details"]["skipped"].append(f"miss_recording: not run; the hits are served from entry {entries[0]['id']}, "
                                     f"recorded at {entries[0]['steps']} steps by an earlier call (--bank)")
    return True


if __name__ == "__main__":
    main()
