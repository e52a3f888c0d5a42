"""The reuse loop on the product path: record on a miss, hit on the entry just written, prior mode.

Run on a CUDA machine from the repo root (ComfyUI importable, e.g. ``COMFYUI_PATH`` set):

    python tests/benchmarks/bench_reuse_loop.py --out DIR [--blocks 8] [--steps 10] [--budget-s 540]

or on the CPU at a tiny width and grid, to test the script end to end: ``--tiny``.

What runs: the model of ``bench_end_to_end.py`` (ComfyUI's ``WanModel`` built through
``comfy.supported_models.WAN21_I2V`` at Wan2.1-I2V-14B width: dim 5120, 40 heads x 128, ffn
13824, bf16, random weights; ``--blocks`` of its 40 blocks) in a ComfyUI ``ModelPatcher``, and
its I2V conditioning (512 text tokens, 257 CLIP-vision tokens, concat latent image and mask).
Every Chorus request goes the way the nodes take it: ``build_match_request`` + ``match_request``
(the Similarity Match node) against a real ``MaskBank`` in a temporary folder, then
``ReusePatch.install()`` -> ``comfy.sample.sample`` with the patched clone (euler, simple, cfg 5,
cond + uncond as one batch of 2), whose run ends with ``ReuseRun.finish()`` (the Sparse Wan Sampler node).
A sampler callback (after a CUDA sync) stamps every step.

Modes, per shape, in this order (density 0.15, 1 dense warm-up step):
- ``dense``: ComfyUI as shipped (its SDPA backend list) and torch SDPA forced to cuDNN
  (``bench_end_to_end.dense_attention``); the faster is the speedup denominator;
- ``miss_recording``: empty bank, so a miss; online prediction with
  ``min_density = max_density = 0.15`` and ``record_on_miss``: the real recorder and bank writer;
- ``hit``: the same request again (threshold 0.9): served from the entry just recorded;
- ``miss_online``: threshold 1.01 (no similarity reaches it), ``record_on_miss`` off;
- ``miss_prior``: threshold 1.01, ``miss_mode="prior"``: the population prior of the bank's
  compatible entries (here the one recorded entry).
Before the timed modes, each shape runs 2 steps at 1 block (dense cuDNN, a recording miss and a
hit in a throwaway bank), so kernel compilation and first-use imports, paid once per process, are
not in any mode's numbers.

Measured per mode: ``generation_s`` = match + prepare + sampling + finish (dense: sampling);
``step_ms`` = median of the steady steps (dense: all but step 0; Chorus: all but the warm-up
and the first sparse step), with min and max; ``queue_block_s`` = last step callback to
``finish()`` returning (when ComfyUI could start the next prompt: the sampler's own tail, then
``finish()``); on a recording miss then
the wait for the background writer (``chorus_core.reuse.bank_writer``, if present) and the entry's
``blob_bytes``; ``overhead_s`` = per-request Chorus time on the prompt's thread not overlapped
with sampling = match + prepare + ``finish()`` + first-sparse-step stall (its excess over the steady
median) + warm-up-step stall (its excess over the dense ComfyUI run's step 0), and
``overhead_share`` = overhead_s / generation_s; ``extra_vram_gb`` = peak
``torch.cuda.max_memory_allocated`` over the start of the request minus the same for dense
ComfyUI; ``host_ram_gb`` = peak resident memory of the process (sampled every 10 ms from
/proc/self/statm) over its value at the start of the request; ``decode_ms`` from the run
report's timings when it has them.

Projection to 40 blocks (labelled ``*_40``; the measured L-block numbers are primary): as in
``bench_end_to_end``, a run with no blocks gives the non-block step time ``a``; each step t
becomes ``t + (40 - L) (t - a) / L``; per-request time outside the steps (match, prepare,
finish, sampler tail) is scaled by 40 / L (an upper bound: entry decode, recorder finish and
entry size grow with the layer count, match does not). ``*_40x40``: also 40 steps
(1 warm-up, the rest at the steady median; a recording run's recorded and other steps
counted apart, with the recorded steps of a 40-step schedule).

Writes ``reuse_loop_h200.json`` and ``.md`` into ``--out`` (``reuse_loop_tiny`` with ``--tiny``;
keys: ../shared/RESULTS.md), after every mode.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import importlib.util
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bench_end_to_end as e2e  # noqa: E402  (also puts the repo root on sys.path)
from bench_end_to_end import (BLOCK, CFG, FULL_LAYERS, GEN_STEPS, build_model, dense_attention, elapsed,  # noqa: E402
                              log, machine_name, make_request, set_blocks, setup_comfy, sync, token_grid)

import torch  # noqa: E402

DENSITY = 0.15
HIT_THRESHOLD, NO_MATCH_THRESHOLD = 0.9, 1.01  # cosine similarity never exceeds 1
WARMUP_STEPS = 1
SAMPLER, SCHEDULER = "euler", "simple"
WARMUP_RUN_STEPS = 2  # a dense step and a sparse one: every kernel of every mode runs once
FLUSH_TIMEOUT_S = 300.0  # longest wait for the background writer after a recording miss
MODES = ("dense", "miss_recording", "hit", "miss_online", "miss_prior")
# H200 eager, 14B width, batch 2, ms per block per step (tests/benchmarks/results/end_to_end_h200.md),
# and host-side recording costs per (bucket, layer) in s (issue 14): only for the budget guard.
COSTS = {"480p": dict(a=16, dense=165, sparse=103, record=33, finish=0.45, write=0.35),
         "720p": dict(a=26, dense=620, sparse=277, record=141, finish=2.4, write=2.3)}


# --------------------------------------------------------------------------------------------
# Host memory
# --------------------------------------------------------------------------------------------


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: only ru_maxrss (a process-lifetime peak) is there
        return 0


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class RssPeak:
    """Peak resident memory while the block runs, sampled by a thread every ``period`` s."""

    def __init__(self, period: float = 0.01):
        self.period, self.start, self.peak = period, 0, 0
        self._stop = threading.Event()

    def __enter__(self):
        self.start = self.peak = rss_bytes()
        self.maxrss_start = maxrss_bytes()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.maxrss_delta = maxrss_bytes() - self.maxrss_start


# --------------------------------------------------------------------------------------------
# One request
# --------------------------------------------------------------------------------------------


def bank_writer_flush():
    """The background writer's flush, if ``chorus_core.reuse.bank_writer`` exists (else None)."""
    if importlib.util.find_spec("chorus_core.reuse.bank_writer") is None:
        return None
    module = importlib.import_module("chorus_core.reuse.bank_writer")
    return getattr(module, "flush_all", None) or getattr(module, "flush", None)


def recorded_step_set(steps: int) -> set[int]:
    """Steps a recording run of ``steps`` records (the ReuseRun default schedule's picks)."""
    from chorus_core.bank import default_step_buckets
    from chorus_core.reuse import reuse_run

    picks = getattr(reuse_run, "recorded_steps", None)
    if picks is None:
        return set()
    return {s for bucket in picks(default_step_buckets(steps)) for s in bucket}


def chorus_options(mode: str):
    from chorus_core.reuse.reuse_run import ReuseOptions

    # every step after the warm-up sparse, as the committed tables were measured (dense_last_steps
    # became 1 on 2026-12-06; bench_user_stack.py's hit_last1 rows measure it)
    common = dict(dense_warmup_steps=WARMUP_STEPS, min_density=DENSITY, max_density=DENSITY, dense_last_steps=0)
    if mode == "miss_prior":
        return ReuseOptions(miss_mode="prior", record_on_miss=False, **common)
    return ReuseOptions(miss_mode="online", record_on_miss=mode == "miss_recording", **common)


def generate(ctx, mode: str, bank=None, attention: str = "comfyui") -> dict:
    """One request of ``mode`` (``dense`` or a Chorus mode) with the model's current blocks."""
    import comfy.sample

    from chorus_core.reuse.reuse_run import ReusePatch
    from chorus_core.reuse.reuse_match import build_match_request, match_request
    from chorus_core.attention.sparse_patch import get_run_stats

    cuda, steps, patcher = ctx["cuda"], ctx["steps"], ctx["patcher"]
    positive, negative, latent, clip = ctx["req"]
    noise = comfy.sample.prepare_noise(latent, 0)
    stamps, m, patch = [], {}, None

    def callback(step, x0, x, total):
        sync(cuda)
        stamps.append(time.perf_counter())

    gc.collect()
    sync(cuda)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with RssPeak() as rss:
        t_start = time.perf_counter()
        sampled = patcher
        if mode != "dense":
            threshold = HIT_THRESHOLD if mode in ("miss_recording", "hit") else NO_MATCH_THRESHOLD
            request = build_match_request(patcher, clip, positive, {"samples": latent}, None, threshold, {}, BLOCK)
            match = match_request(bank, request)
            t_matched = time.perf_counter()
            patch = ReusePatch(patcher, match, chorus_options(mode), scheduler=SCHEDULER)
            sampled = patch.install()
            t_prepared = time.perf_counter()
        t_sample = time.perf_counter()
        with dense_attention(attention, cuda):
            out = comfy.sample.sample(sampled, noise, steps, CFG, SAMPLER, SCHEDULER, positive, negative, latent,
                                      callback=callback, disable_pbar=True, seed=0)
        sync(cuda)
        t_sampled = time.perf_counter()
        report = patch.last_report if patch is not None else None
        t_end = time.perf_counter()
        flush = bank_writer_flush() if mode == "miss_recording" else None
        wait = min(FLUSH_TIMEOUT_S, max(5.0, ctx["budget_s"] - elapsed()))  # never past the budget
        if flush is not None and flush(wait) is False:
            raise RuntimeError(f"the bank writer had not finished after {wait:.0f} s")
        t_flushed = time.perf_counter()
        sync(cuda)
    if len(stamps) != steps:
        raise RuntimeError(f"{mode}: the sampler called back {len(stamps)} times for {steps} steps")
    times = [(b - a) * 1e3 for a, b in zip([t_sample] + stamps[:-1], stamps)]
    m.update(step_ms_all=[round(t, 2) for t in times], generation_s=t_end - t_start,
             queue_block_s=t_end - stamps[-1], sampler_tail_s=t_sampled - stamps[-1],
             finite=bool(torch.isfinite(out).all()), host_ram_bytes=rss.peak - rss.start,
             host_rss_start_bytes=rss.start, ru_maxrss_delta_bytes=rss.maxrss_delta,
             peak_bytes=(torch.cuda.max_memory_allocated() - base) if cuda else None)
    if patch is not None:
        stats = get_run_stats(sampled)
        # The run's own prepare (choosing the source) and finish (report, recording) happen inside
        # the sampling call now (the patch's OUTER_SAMPLE wrapper): the report times them.
        prepare_s = (t_prepared - t_matched) + report.timings.get("prepare_ms", 0.0) / 1e3
        m.update(match_s=t_matched - t_start, prepare_s=prepare_s, finish_s=report.timings.get("finish_ms", 0.0) / 1e3,
                 flush_s=(t_flushed - t_end) if flush is not None else None, report=report.to_json(),
                 sparse_calls=stats.sparse_calls if stats else 0, dense_calls=stats.dense_calls if stats else 0,
                 layers=len(ctx["model"].diffusion_model.blocks))
    del sampled, out
    return m


def check_mode(mode: str, m: dict, bank, recorded_id: str | None) -> str | None:
    """The entry a recording wrote; raises when a mode did not take the path it is named for."""
    if mode == "dense":
        return None
    rep = m["report"]
    if m["sparse_calls"] == 0:
        raise RuntimeError(f"{mode}: no sparse attention call ran (warnings: {rep['warnings']})")
    layers, steps = m["layers"], len(m["step_ms_all"])
    expected = (layers * (steps - WARMUP_STEPS), layers * WARMUP_STEPS)  # one self-attention call per block and step
    m["all_sparse_after_warmup"] = (m["sparse_calls"], m["dense_calls"]) == expected
    if not m["all_sparse_after_warmup"]:
        m["path_warning"] = (f"{mode}: {m['sparse_calls']} sparse and {m['dense_calls']} dense self-attention calls, "
                             f"expected {expected[0]} and {expected[1]} (warnings: {rep['warnings']})")
    expect = {"hit": "hit"}.get(mode, "miss")
    if rep["mode"] != expect:
        raise RuntimeError(f"{mode}: the run was a {rep['mode']} ({rep['mask_source']}; warnings {rep['warnings']})")
    if mode == "hit" and rep["entry_id"] != recorded_id:
        raise RuntimeError(f"hit served entry {rep['entry_id']}, not the recorded {recorded_id}")
    if mode == "miss_prior" and not rep["mask_source"].startswith("population prior"):
        raise RuntimeError(f"miss_prior ran with {rep['mask_source']!r} (warnings {rep['warnings']})")
    if mode == "miss_online" and rep["mask_source"] != "online prediction":
        raise RuntimeError(f"miss_online ran with {rep['mask_source']!r}")
    if mode != "miss_recording":
        return None
    entries = bank.entries()
    entry_id = rep.get("recorded_entry_id") or (entries[0]["id"] if entries else None)
    if len(entries) != 1 or entry_id is None:
        raise RuntimeError(f"recording left {len(entries)} entries in the bank (warnings {rep['warnings']})")
    m["entry_bytes"] = int(bank.show(entry_id)["blob_bytes"])
    m["entry_id"] = entry_id
    return entry_id


# --------------------------------------------------------------------------------------------
# Derived rows
# --------------------------------------------------------------------------------------------


def timing(report: dict, name: str):
    """A run report timing: the run's own, else the entry prefetch's (``prefetch_<name>``)."""
    t = report["timings"]
    return t.get(name, t.get(f"prefetch_{name}"))


def sparse_density(report: dict):
    """Mean share of key blocks kept by the sparse calls (the report's ``density`` counts dense calls as 1)."""
    kept = [layer["density"] for layer in report["layers"] if layer.get("density") is not None]
    return round(sum(kept) / len(kept), 4) if kept else None


def steady(m: dict, mode: str) -> list[float]:
    skip = 1 if mode == "dense" else WARMUP_STEPS + 1
    return m["step_ms_all"][skip:]


def to40(t: float, a: float, blocks: int) -> float:
    """One step time scaled from ``blocks`` to 40 blocks around the non-block time ``a``."""
    return t + (FULL_LAYERS - blocks) * (t - a) / blocks if blocks else t


def derive_row(shape: str, key: str, m: dict, res: dict, blocks: int, steps: int) -> dict:
    mode = "dense" if key.startswith("dense") else key
    a = res["nonblock"]["step_ms"] if "nonblock" in res else None
    st = steady(m, mode)
    dense_ref = res.get("dense_comfyui")
    row = dict(shape=shape, N=res["N"], batch=2, density=1.0 if mode == "dense" else DENSITY, mode=mode,
               attention=key.split("_", 1)[1] if mode == "dense" else "block_sparse", blocks=blocks, steps=steps,
               generation_s=round(m["generation_s"], 3), step_ms=round(statistics.median(st), 1),
               step_ms_min=round(min(st), 1), step_ms_max=round(max(st), 1), steady_steps=len(st),
               queue_block_s=round(m["queue_block_s"], 3), sampler_tail_ms=round(m["sampler_tail_s"] * 1e3, 1),
               host_ram_gb=round(m["host_ram_bytes"] / 2**30, 3),
               entry_bytes=m.get("entry_bytes"), finite=m["finite"])
    if m.get("peak_bytes") is not None and dense_ref and dense_ref.get("peak_bytes") is not None:
        row["extra_vram_gb"] = round((m["peak_bytes"] - dense_ref["peak_bytes"]) / 2**30, 3)
    if mode == "dense":
        row.update(overhead_s=0.0, overhead_share=0.0)
    else:
        row.update(chorus_columns(m, row["step_ms"], dense_ref))
    if mode == "miss_recording":
        row.update(recording_columns(m, steps))
    if a is not None:
        row.update(project(row, m, mode, a, blocks, steps))
    row["step_ms_all"] = m["step_ms_all"]
    return row


def chorus_columns(m: dict, steady_ms: float, dense_ref: dict | None) -> dict:
    """Per-request time on the prompt's thread, and what the run report says, for a Chorus mode."""
    rep = m["report"]
    stall_first = max(0.0, m["step_ms_all"][WARMUP_STEPS] - steady_ms) / 1e3
    stall_warmup = max(0.0, m["step_ms_all"][0] - dense_ref["step_ms_all"][0]) / 1e3 if dense_ref else 0.0
    overhead = m["match_s"] + m["prepare_s"] + m["finish_s"] + stall_first + stall_warmup
    return dict(overhead_s=round(overhead, 4), overhead_share=round(overhead / m["generation_s"], 5),
                match_ms=round(m["match_s"] * 1e3, 2), prepare_ms=round(m["prepare_s"] * 1e3, 2),
                finish_ms=round(m["finish_s"] * 1e3, 2), first_sparse_stall_ms=round(stall_first * 1e3, 1),
                warmup_stall_ms=round(stall_warmup * 1e3, 1),
                writer_flush_s=None if m.get("flush_s") is None else round(m["flush_s"], 3),
                decode_ms=timing(rep, "decode_ms"), load_ms=timing(rep, "load_ms"),
                prefetch_wait_ms=timing(rep, "wait_ms"), report_timings=rep["timings"],
                mask_source=rep["mask_source"], report_mode=rep["mode"], entry_id=rep["entry_id"],
                kernel_backend=rep.get("backend"),
                similarity=None if rep["similarity"] is None else round(rep["similarity"], 4),
                measured_density=sparse_density(rep), report_density=rep["density"],
                sparse_calls=m["sparse_calls"], dense_calls=m["dense_calls"],
                all_sparse_after_warmup=m.get("all_sparse_after_warmup"), warnings=rep["warnings"])


def recording_columns(m: dict, steps: int) -> dict:
    """Median time of the steady steps that record and of those that do not."""
    rec = recorded_step_set(steps)
    idx = range(WARMUP_STEPS + 1, steps)
    rec_ms = [m["step_ms_all"][s] for s in idx if s in rec]
    other_ms = [m["step_ms_all"][s] for s in idx if s not in rec]
    return dict(recorded_step_ms=round(statistics.median(rec_ms), 1) if rec_ms else None,
                unrecorded_step_ms=round(statistics.median(other_ms), 1) if other_ms else None)


def project(row: dict, m: dict, mode: str, a: float, blocks: int, steps: int) -> dict:
    """The ``*_40`` (40 blocks) and ``*_40x40`` (40 blocks, 40 steps) projections of one row."""
    scale = FULL_LAYERS / blocks
    t40 = [to40(t, a, blocks) for t in m["step_ms_all"]]
    outside = m["generation_s"] - sum(m["step_ms_all"]) / 1e3  # match, prepare, finish, sampler tail
    gen40 = sum(t40) / 1e3 + outside * scale
    out = dict(step_ms_40=round(to40(row["step_ms"], a, blocks), 1), generation_s_40=round(gen40, 2),
               queue_block_s_40=round(row["queue_block_s"] * scale, 3),
               overhead_share_40=round(row["overhead_s"] * scale / gen40, 5))
    if row.get("entry_bytes"):
        out["entry_bytes_40"] = int(row["entry_bytes"] * scale)
    first_steady = 1 if mode == "dense" else WARMUP_STEPS + 1
    head = t40[:first_steady]  # dense: step 0; Chorus: warm-up + first sparse step, as measured
    later = range(first_steady, GEN_STEPS)
    if mode == "miss_recording" and row.get("recorded_step_ms") and row.get("unrecorded_step_ms"):
        rec40 = recorded_step_set(GEN_STEPS)
        per = {True: to40(row["recorded_step_ms"], a, blocks), False: to40(row["unrecorded_step_ms"], a, blocks)}
        rest = sum(per[s in rec40] for s in later)
    else:
        rest = len(later) * to40(row["step_ms"], a, blocks)
    out["generation_s_40x40"] = round((sum(head) + rest) / 1e3 + outside * scale, 1)
    return out


def add_speedups(rows: list[dict]) -> None:
    for shape in {r["shape"] for r in rows}:
        mine = [r for r in rows if r["shape"] == shape]
        dense = [r for r in mine if r["mode"] == "dense"]
        for col in ("generation_s", "generation_s_40", "generation_s_40x40"):
            ref = min((r[col] for r in dense if r.get(col)), default=None)
            suffix = col[len("generation_s"):]
            for r in mine:
                if ref and r.get(col):
                    r["speedup_whole_generation" + suffix] = round(ref / r[col], 3)


def targets(rows: list[dict]) -> list[str]:
    """Issue 14's targets, checked on the measured rows and on the 40-block projections."""
    out = []

    def get(shape, mode):
        return next((r for r in rows if r["shape"] == shape and r["mode"] == mode), None)

    for shape in sorted({r["shape"] for r in rows}):
        hit, online, rec = get(shape, "hit"), get(shape, "miss_online"), get(shape, "miss_recording")
        if hit and online:
            for col in ("generation_s", "generation_s_40x40"):
                if hit.get(col) and online.get(col):
                    diff = online[col] - hit[col]
                    out.append(f"{shape} hit faster than online miss ({col}): {hit[col]} s vs {online[col]} s, "
                               f"{'MET' if diff > 0 else 'NOT MET'} by {abs(diff):.2f} s "
                               f"({100 * diff / online[col]:+.1f} %)")
        if hit:
            for col in ("overhead_share", "overhead_share_40"):
                if hit.get(col) is not None:
                    out.append(f"{shape} hit {col} {hit[col]} vs <= 0.005: {'MET' if hit[col] <= 0.005 else 'NOT MET'}")
        if rec:
            for col in ("queue_block_s", "queue_block_s_40"):
                if rec.get(col) is not None:
                    verdict = "MET" if rec[col] <= 2 else "NOT MET"
                    out.append(f"{shape} recording {col} {rec[col]} s vs <= 2 s: {verdict}")
            if rec.get("entry_bytes_40"):
                mb = rec["entry_bytes_40"] / 1e6
                out.append(f"{shape} entry {rec['entry_bytes'] / 1e6:.2f} MB at {rec['blocks']} layers, {mb:.2f} MB "
                           f"projected to 40 vs <= 10 MB: {'MET' if mb <= 10 else 'NOT MET'}")
            if rec.get("extra_vram_gb") is not None:
                measured, bound = rec["extra_vram_gb"], rec["extra_vram_gb"] * FULL_LAYERS / rec["blocks"]
                verdict = "MET" if bound <= 1.5 else (f"MET at {rec['blocks']} layers, open at 40" if measured <= 1.5
                                                      else "NOT MET")
                out.append(f"{shape} recording extra VRAM {measured} GB at {rec['blocks']} layers "
                           f"(<= {bound:.2f} GB at 40 if all of it grows with layers) vs <= 1.5 GB: {verdict}")
            out.append(f"{shape} recording host RAM {rec['host_ram_gb']} GB at {rec['blocks']} layers vs <= 4 GB: "
                       f"{'MET' if rec['host_ram_gb'] <= 4 else 'NOT MET'}")
            if online:
                for col in ("generation_s", "generation_s_40x40"):
                    if rec.get(col) and online.get(col):
                        ratio = rec[col] / online[col]
                        out.append(f"{shape} recording / online ({col}) {ratio:.3f} vs <= 1.05: "
                                   f"{'MET' if ratio <= 1.05 else 'NOT MET'}")
    return out


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

COLUMNS = ["shape", "N", "blocks", "steps", "mode", "attention", "density", "generation_s", "step_ms", "step_ms_min",
           "step_ms_max", "speedup_whole_generation", "overhead_share", "queue_block_s", "extra_vram_gb",
           "host_ram_gb", "entry_bytes", "decode_ms"]
DETAIL_COLUMNS = ["shape", "mode", "attention", "match_ms", "prepare_ms", "sampler_tail_ms", "finish_ms",
                  "first_sparse_stall_ms", "warmup_stall_ms", "load_ms", "prefetch_wait_ms", "writer_flush_s",
                  "recorded_step_ms", "unrecorded_step_ms", "measured_density", "mask_source", "kernel_backend"]
PROJECTION_COLUMNS = ["shape", "mode", "attention", "step_ms_40", "generation_s_40", "speedup_whole_generation_40",
                      "overhead_share_40", "queue_block_s_40", "entry_bytes_40", "generation_s_40x40",
                      "speedup_whole_generation_40x40"]


def table(rows, cols) -> list[str]:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |" for r in rows]
    return lines


def markdown(doc: dict) -> str:
    d, rows = doc["details"], doc["rows"]
    lines = [f"# The reuse loop on the product path ({doc['machine']})", "",
             f"- date: {doc['date']}", f"- machine: {doc['machine']}", f"- command: `{doc['command']}`",
             f"- git commit: {doc['git_commit']}",
             f"- torch {d.get('torch')}, triton {d.get('triton')}, ComfyUI {d.get('comfyui')}; model dim {d['dim']}, "
             f"{d['blocks']} of 40 blocks, {d['steps']} steps, {d['dtype']}", "",
             doc["method"], "",
             f"Measured ({d['blocks']} blocks, {d['steps']} steps; speedup over the faster dense row of the "
             "shape):", ""]
    lines += table(rows, COLUMNS)
    lines += ["", "Where the per-request time goes (measured):", ""] + table([r for r in rows if r["mode"] != "dense"],
                                                                           DETAIL_COLUMNS)
    lines += ["", f"Projection (not measured): 40 blocks at {d['steps']} steps (`*_40`), and 40 blocks at 40 steps "
              "(`*_40x40`), from the non-block step time of a 0-block run "
              f"({ {s: r.get('nonblock', {}).get('step_ms') for s, r in d['measurements'].items()} } ms):", ""]
    lines += table(rows, PROJECTION_COLUMNS)
    if doc.get("targets"):
        lines += ["", "Targets (issue 14):", ""] + [f"- {t}" for t in doc["targets"]]
    lines += ["", "Caveats:", ""] + [f"- {c}" for c in doc["caveats"]]
    if d.get("errors"):
        lines += ["", "Errors:", ""] + [f"- {e}" for e in d["errors"]]
    return "\n".join(lines) + "\n"


def caveats(doc: dict) -> list[str]:
    d = doc["details"]
    out = ["random weights give flat attention, so top-p would keep most blocks: every Chorus mode holds the density "
           f"at {DENSITY} (min_density = max_density = {DENSITY}); speed only, no quality or recall",
           f"{d['blocks']} of 40 blocks were run; the *_40 and *_40x40 columns are projections "
           "(a + 40 x per-block time; time outside the steps scaled by 40 / L, an upper bound for match and the "
           "sampler tail)",
           "one sampling run per mode; spread = min/max of its steady steps",
           "the hit is served from the entry the recording miss just wrote; the prior is made from that one entry "
           "(the bank holds nothing else); with up to 8 compatible entries, making it reads more of them",
           "match_ms is build_match_request (signature, model fingerprint, layout) + match_request, as the Similarity "
           "Match node runs them; prepare_ms and finish_ms are the run report's (ReusePatch.begin_run choosing the source, "
           "ReuseRun.finish() alone, both inside the sampling call), plus the patch's install; queue_block_s adds the sampler's own tail "
           "after its last step (sampler_tail_ms, inside which Chorus' OUTER_SAMPLE wrapper closes the run)",
           "extra_vram_gb is measured at the blocks run; the part that grows with layers (masks, accumulators) "
           "would be larger at 40",
           "host_ram_gb: resident memory of this process only (a writer in another process is not counted)",
           "VAE, text and CLIP-vision encoders are outside the sampler and the same in every mode"]
    if not d.get("bank_writer"):
        out.append("no chorus_core.reuse.bank_writer at this commit: finish() writes the entry itself, so the write is in "
                   "queue_block_s")
    if d.get("carried_packages"):
        out.append(d["carried_packages"])
    return out + doc["skipped"]


# --------------------------------------------------------------------------------------------
# Budget
# --------------------------------------------------------------------------------------------


def estimate_s(shape: str, mode: str, blocks: int, steps: int, calib: dict) -> float:
    """Seconds a mode should take (for --budget-s); from COSTS, scaled by what was measured."""
    c = COSTS.get(shape)
    if c is None:  # a shape with no table (tiny): the dense run of the shape, when there is one
        return calib.get(shape, {}).get("dense_s", 0.0) * (2.0 if mode == "miss_recording" else 1.0)
    dense_step = (c["a"] + blocks * c["dense"]) / 1e3
    sparse_step = (c["a"] + blocks * c["sparse"]) / 1e3
    ratio = calib.get(shape, {}).get("ratio", 1.0)
    if mode in ("dense", "dense_comfyui", "dense_cudnn"):
        return ratio * steps * dense_step
    if mode == "nonblock":
        return 2 + steps * c["a"] / 1e3
    if mode == "warmup":  # 1 block: dense cuDNN, a recording miss, a hit; plus kernel compilation
        one_dense, one_sparse = (c["a"] + c["dense"]) / 1e3, (c["a"] + c["sparse"]) / 1e3
        return 20 + ratio * WARMUP_RUN_STEPS * (one_dense + 2 * one_sparse) + 2 * c["finish"] + c["write"]
    gen = ratio * (WARMUP_STEPS * dense_step + (steps - WARMUP_STEPS) * sparse_step) + 2
    if mode == "miss_recording":
        host = calib.get("record_host_s_per_layer_nb2")
        nb2 = math.ceil(math.prod(token_grid(e2e.SHAPES[shape])) / BLOCK) ** 2
        host = host * nb2 * blocks if host else blocks * (3 * c["finish"] + c["write"])
        gen += ratio * 6 * blocks * c["record"] / 1e3 + host
    return gen


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def warm_up(ctx) -> None:
    """2 steps at 1 block: dense cuDNN, a recording miss and a hit in a throwaway bank (compiles kernels)."""
    from chorus_core.bank import MaskBank

    blocks_all, full = ctx["all_blocks"], ctx
    ctx = dict(ctx, steps=WARMUP_RUN_STEPS)
    set_blocks(ctx["model"], blocks_all, 1)
    try:
        generate(ctx, "dense", attention="cudnn")
        with tempfile.TemporaryDirectory(prefix="chorus-warmup-") as tmp:
            bank = MaskBank.open(tmp)
            try:
                m = generate(ctx, "miss_recording", bank)
                recorded = check_mode("miss_recording", m, bank, None)
                check_mode("hit", generate(ctx, "hit", bank), bank, recorded)
            finally:
                bank.close()
    finally:
        set_blocks(ctx["model"], blocks_all, full["blocks"])


def git_commit(given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=e2e.REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(BENCH_DIR / "results"))
    p.add_argument("--tiny", action="store_true", help="dim 256, 2 blocks, a tiny latent, on the CPU")
    p.add_argument("--blocks", type=int, default=8, help="blocks built and run (of 40; projected to 40)")
    p.add_argument("--steps", type=int, default=None,
                   help="sampling steps per request, >= 6 for 4 steady steps (default 10; 6 with --tiny)")
    p.add_argument("--shapes", default="480p,720p")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="skip a mode (cleanly, noted in the results) when it would end past this many seconds")
    p.add_argument("--extra-site", default=None, help="folder of carried pure-Python packages (appended to sys.path)")
    p.add_argument("--git-commit", default=None)
    p.add_argument("--keep-banks", default=None, help="keep each shape's bank in DIR/<shape> (for bench_codec.py)")
    p.add_argument("--command", default=None, help="the command line to record (default: argv)")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 6 if args.tiny else 10
    if args.steps < WARMUP_STEPS + 5:
        p.error(f"--steps must be at least {WARMUP_STEPS + 5} (warm-up, first sparse step, 4 steady steps)")
    return args


def main(argv=None):
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    comfy_path = setup_comfy(cuda, args.extra_site)
    log(f"ComfyUI at {comfy_path}; device {device}")
    if args.tiny:
        dim, ffn, blocks, shapes, dtype = 256, 512, 2, ["tiny"], torch.float32
        shape_thw = dict(e2e.TINY_SHAPES)
    else:
        dim, ffn, blocks, shapes, dtype = 5120, 13824, args.blocks, args.shapes.split(","), torch.bfloat16
        shape_thw = dict(e2e.SHAPES)
    unknown = [s for s in shapes if s not in shape_thw]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}; use {', '.join(shape_thw)}")
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    import comfyui_version  # noqa: F401  (ComfyUI's own version module)

    name = "reuse_loop_tiny" if args.tiny else "reuse_loop_" + ("h200" if "H200" in machine_name(cuda) else "gpu")
    out_dir = Path(args.out)
    doc = {"benchmark": "bench_reuse_loop",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_name(cuda), "command": args.command or " ".join([Path(sys.executable).name] + sys.argv),
           "git_commit": git_commit(args.git_commit), "rows": [], "caveats": [], "targets": [],
           "method": __doc__[__doc__.index("What runs:"):__doc__.index("Writes ``reuse")].strip(),
           "details": {"torch": torch.__version__, "triton": triton_version,
                       "comfyui": getattr(sys.modules.get("comfyui_version"), "__version__", None),
                       "blocks": blocks, "steps": args.steps, "dim": dim, "ffn_dim": ffn, "heads": dim // 128,
                       "dtype": str(dtype), "budget_s": args.budget_s,
                       "bank_writer": importlib.util.find_spec("chorus_core.reuse.bank_writer") is not None,
                       "carried_packages": (f"pure-Python packages the machine may lack came unpacked in "
                                            f"{e2e.CARRIED[0]}, after its own on sys.path") if e2e.CARRIED else None,
                       "measurements": {}, "estimates_s": {}, "errors": []},
           "skipped": []}

    def save():
        rows = []
        for shape in shapes:
            res = doc["details"]["measurements"].get(shape, {})
            for key in ("dense_comfyui", "dense_cudnn") + MODES[1:]:
                if key in res:
                    try:
                        rows.append(derive_row(shape, key, res[key], res, blocks, args.steps))
                    except Exception as e:  # noqa: BLE001
                        doc["details"]["errors"].append(f"derive {shape} {key}: {type(e).__name__}: {e}")
        add_speedups(rows)
        doc["details"]["cudnn_fallbacks"] = e2e.FALLBACKS["cudnn"]  # forced-cuDNN calls cuDNN refused
        doc["rows"], doc["targets"], doc["caveats"] = rows, targets(rows), caveats(doc)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out_dir / f"{name}.md").write_text(markdown(doc))

    t0 = time.perf_counter()
    model, patcher = build_model(dim, ffn, blocks, device, dtype)
    all_blocks = list(model.diffusion_model.blocks)
    log(f"model built: dim {dim}, {blocks} blocks in {time.perf_counter() - t0:.1f} s")
    calib: dict = {}
    for shape in shapes:
        ctx = dict(cuda=cuda, model=model, patcher=patcher, all_blocks=all_blocks, blocks=blocks, steps=args.steps,
                   budget_s=args.budget_s, req=make_request(shape_thw[shape]), keep_banks=args.keep_banks)
        ShapeRun(doc, shape, math.prod(token_grid(shape_thw[shape])), ctx, calib, save).run()
        del ctx
        if cuda:
            torch.cuda.empty_cache()
    save()
    print("\n".join(table(doc["rows"], COLUMNS)))
    print()
    print("\n".join(table(doc["rows"], PROJECTION_COLUMNS)))
    for t in doc["targets"]:
        print(t)
    log(f"errors: {doc['details']['errors']}")
    log(f"skipped: {doc['skipped']}")
    log(f"wrote {out_dir / name}.json and .md")
    return doc


class ShapeRun:
    """The modes of one shape, in order, each skipped when the budget would run out."""

    def __init__(self, doc: dict, shape: str, n: int, ctx: dict, calib: dict, save):
        self.doc, self.shape, self.n, self.ctx, self.calib, self.save = doc, shape, n, ctx, calib, save
        self.res = doc["details"]["measurements"].setdefault(shape, {"N": n})
        self.recorded: str | None = None  # the entry miss_recording wrote

    def run(self) -> None:
        from chorus_core.bank import MaskBank

        log(f"== {self.shape}: {self.n} tokens, {self.ctx['blocks']} blocks, {self.ctx['steps']} steps")
        if self.fits("warmup"):
            t1 = time.perf_counter()
            self.attempt("warmup", lambda: warm_up(self.ctx))
            self.res["warmup_s"] = round(time.perf_counter() - t1, 1)
            log(f"{self.shape} warm-up (1 block) in {self.res['warmup_s']} s")
        if self.fits("nonblock"):
            self.attempt("nonblock", self.nonblock)
        with tempfile.TemporaryDirectory(prefix="chorus-bank-") as tmp:
            if self.ctx.get("keep_banks"):  # kept for bench_codec.py: the masks this run recorded
                tmp = str(Path(self.ctx.get("keep_banks")) / self.shape)
            bank = MaskBank.open(tmp)
            try:
                for key in ("dense_comfyui", "dense_cudnn") + MODES[1:]:
                    if key in ("hit", "miss_prior") and self.recorded is None:
                        self.skip(f"{self.shape} {key}: skipped, needs the entry miss_recording writes")
                    elif self.fits(key):
                        self.attempt(key, lambda key=key: self.mode(key, bank))
            finally:
                bank.close()

    def skip(self, why: str) -> None:
        self.doc["skipped"].append(why)
        log(why)

    def fits(self, key: str) -> bool:
        est = estimate_s(self.shape, key, self.ctx["blocks"], self.ctx["steps"], self.calib)
        self.doc["details"]["estimates_s"][f"{self.shape} {key}"] = round(est, 1)
        if elapsed() + est <= self.ctx["budget_s"]:
            return True
        self.skip(f"{self.shape} {key}: skipped, would end past the time budget "
                  f"({elapsed():.0f} s + about {est:.0f} s > {self.ctx['budget_s']:.0f} s)")
        return False

    def attempt(self, key: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001  (one failed mode must not cost the others)
            self.doc["details"]["errors"].append(f"{self.shape} {key}: {type(e).__name__}: {e}")
            log(f"FAILED {self.shape} {key}: {traceback.format_exc()}")
        finally:
            self.save()

    def nonblock(self) -> None:
        model, blocks = self.ctx["model"], self.ctx["blocks"]
        set_blocks(model, self.ctx["all_blocks"], 0)
        try:
            m = generate(self.ctx, "dense")
        finally:
            set_blocks(model, self.ctx["all_blocks"], blocks)
        m["step_ms"] = statistics.median(m["step_ms_all"][1:])
        self.res["nonblock"] = m
        log(f"{self.shape} nonblock (0 blocks): step {m['step_ms']:.1f} ms")

    def mode(self, key: str, bank) -> None:
        mode = "dense" if key.startswith("dense") else key
        m = generate(self.ctx, mode, bank, attention=key[len("dense_"):] if mode == "dense" else "comfyui")
        entry = check_mode(mode, m, bank, self.recorded)
        self.res[key] = m
        if m.get("path_warning"):
            self.doc["details"]["errors"].append(f"{self.shape} {m['path_warning']}")
        if entry is not None:
            self.recorded = entry
        log(f"{self.shape} {key:15s} gen {m['generation_s']:.2f} s, steps {m['step_ms_all']}, "
            f"queue block {m['queue_block_s']:.3f} s"
            + (f", {m['report']['mask_source']}, timings {m['report']['timings']}" if "report" in m else ""))
        calibrate(self.calib, self.shape, key, m, self.ctx["blocks"], self.ctx["steps"], self.n)


def calibrate(calib: dict, shape: str, key: str, m: dict, blocks: int, steps: int, n: int) -> None:
    """Keep what the budget estimates of later modes learn from a measured one."""
    c = calib.setdefault(shape, {})
    if key == "dense_comfyui":
        c["dense_s"] = m["generation_s"]
        if shape in COSTS:
            c["ratio"] = min(3.0, max(0.5, m["generation_s"] / estimate_s(shape, "dense", blocks, steps, {})))
    if key == "miss_recording":  # host-side recording time per layer and per block pair, for the next shape
        host = m["queue_block_s"] + (m.get("flush_s") or 0.0)
        calib["record_host_s_per_layer_nb2"] = host / blocks / math.ceil(n / BLOCK) ** 2


if __name__ == "__main__":
    main()
