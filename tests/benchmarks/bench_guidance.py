"""Guidance enhancement on the testbed: does it recover condition adherence lost to mask reuse?

    .venv/bin/python tests/benchmarks/bench_guidance.py [--model PATH] [--steps 10] [--cfgs 5,1]

CPU is enough (latent 5x16x16 = 320 tokens). For each target request (templates x layouts,
held-out subjects 100+) a *similar* request (same template and layout, subject 200+) is run
dense once with a ``MaskRecorder`` (3 step buckets, block 32, top-p 0.9, density <= 0.3);
the target is then sampled through ComfyUI's own ``comfy.sample.sample`` (euler, simple):

- ``dense``: the unpatched model;
- ``hit``: ``install_sparse_attention`` with the similar request's masks
  (``StaticBlockMapProvider`` behind ``DenseWarmupProvider``, 1 dense step), what a bank hit serves;

each without guidance and with every (method, strength[, window]) of the sweep (default window
[0.1, 1.0): the steps after the dense warm-up). Measures per run: PSNR / SSIM of the final latent
vs the dense run without guidance (same seed), first-frame error (relative RMS of the generated
first latent frame vs the conditioning frame), ``adherence`` (template following: correlation of
the generated motion, frame t minus frame 0, with the template video's) and ``content_corr``
(correlation of frames 1..T-1 with the request's rendered video). Time: the
hook's own work per step (timed alone at the run's shapes) as a share of a dense step.

Writes ``guidance_testbed.json`` and ``.md`` into ``--out`` (default tests/benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

TESTBED = REPO_ROOT / "tests" / "testbed" / "chorus_testbed_wan21_i2v.safetensors"
BLOCK = 32


def log(msg: str) -> None:
    print(f"[bench_guidance] {msg}", flush=True)


def setup_comfy():
    from chorus_core.comfy.comfyui_locator import locate_comfyui, prepare_in_process

    prepare_in_process(locate_comfyui(allow_clone=False), cpu=True)
    import comfy.model_management  # noqa: F401


def load_model(path: str | None):
    import comfy.sd

    if path is None and TESTBED.exists():
        path = str(TESTBED)
    if path is None:
        from chorus_core.testbed.tiny_wan import save_tiny_wan_i2v

        path = str(save_tiny_wan_i2v(Path(tempfile.mkdtemp()) / "chorus_tiny_wan21_i2v.safetensors"))
        name = "random tiny Wan2.1-I2V (chorus_core.testbed.tiny_wan, untrained: NOT the trained testbed)"
    else:
        name = f"trained testbed {Path(path).name}"
    return comfy.sd.load_diffusion_model(path), name, path


def sample(patcher, request, seed, steps, cfg):
    import comfy.sample

    from chorus_core.testbed.workload import generate_request, i2v_conditioning

    tensors = generate_request(request)
    positive, negative, latent = i2v_conditioning(tensors)
    noise = comfy.sample.prepare_noise(latent["samples"], seed)
    out = comfy.sample.sample(patcher, noise, steps, cfg, "euler", "simple", positive, negative,
                              latent["samples"], seed=seed, disable_pbar=True)
    return out, tensors


def record_masks(patcher, request, seed, steps, cfg, max_density):
    """Dense run of the similar request with a recorder: bool [S, L, H, nq, nk] and bucket starts."""
    from chorus_core.bank.records import default_step_buckets
    from chorus_core.attention.mask_provider import DenseProvider
    from chorus_core.attention.masks import MaskRecorder
    from chorus_core.attention.mask_sources import RecordingProvider
    from chorus_core.attention.sparse_patch import install_sparse_attention

    buckets = default_step_buckets(steps)
    recorder = MaskRecorder(num_layers=len(patcher.model.diffusion_model.blocks),
                            step_buckets=[list(range(a, b)) for a, b in buckets], block_size=BLOCK,
                            top_p=0.9, min_density=0.0, max_density=max_density)
    provider = RecordingProvider(DenseProvider((BLOCK, BLOCK)), recorder)
    sample(install_sparse_attention(patcher, provider), request, seed, steps, cfg)
    recorded = recorder.finish()
    return recorded.block_maps, [a for a, _ in buckets], float(recorded.density.mean()) \
        if torch.is_tensor(recorded.density) else float(recorded.density)


def hit_model(patcher, maps, starts):
    from chorus_core.attention.mask_provider import DenseWarmupProvider, StaticBlockMapProvider
    from chorus_core.attention.sparse_patch import install_sparse_attention

    per_bucket = [{layer: maps[s, layer][None] for layer in range(maps.shape[1])} for s in range(maps.shape[0])]
    provider = DenseWarmupProvider(StaticBlockMapProvider(per_bucket, (BLOCK, BLOCK), starts), warmup_steps=1)
    return install_sparse_attention(patcher, provider)


def measures(out, dense_ref, tensors):
    from chorus_core.guidance.guidance import content_adherence, first_frame_error, template_adherence
    from chorus_core.quality import psnr, ssim

    same = torch.equal(out, dense_ref)
    return {"psnr_db": None if same else float(psnr(dense_ref, out)[0]), "ssim": float(ssim(dense_ref, out)[0]),
            "first_frame_err": float(first_frame_error(out, tensors.first_frame)[0]),
            "adherence": float(template_adherence(out, tensors.video)[0]),
            "content_corr": float(content_adherence(out, tensors.video)[0])}


def hook_cost_ms(patcher, request, cfg, method, reps=50):
    """Time of the hook's own work in one step at this run's shapes (CPU, median of reps)."""
    from chorus_core.guidance.guidance import boosted_cfg, scale_cross_attention

    batch = 2 if cfg != 1 else 1
    t, h, w = request.frames, request.height, request.width
    if method == "cfg_boost":
        x = [torch.randn(1, 16, t, h, w) for _ in range(3)]

        def work():
            boosted_cfg(x[0], x[1], x[2], cfg, 0.5)
    else:
        dm = patcher.model.diffusion_model
        n = t * (h // 2) * (w // 2)
        y = torch.randn(batch, n, dm.dim)
        calls = 2 * len(dm.blocks)  # image + text cross-attention per block

        def work():
            for _ in range(calls):
                scale_cross_attention(y, 0.5)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores visible, torch {torch.__version__} CPU"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="UNETLoader-loadable Wan2.1-I2V file (default: the testbed)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cfgs", default="5,1")
    parser.add_argument("--templates", default="pan,zoom,orbit,bounce")
    parser.add_argument("--layouts", default="0,1")
    parser.add_argument("--sweep", default="cfg_boost:0.25,cfg_boost:0.5,cfg_boost:1.0,"
                                           "cross_attention:0.1,cross_attention:0.25,cross_attention:0.5")
    parser.add_argument("--window", default="0.1,1.0")
    parser.add_argument("--max-density", type=float, default=0.3)
    parser.add_argument("--seeds", type=int, default=1, help="seeds per target request")
    parser.add_argument("--note", default="", help="a conclusion paragraph for the report")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 keeps a shared CPU usable)")
    parser.add_argument("--out", default=str(REPO_ROOT / "tests" / "benchmarks" / "results"))
    parser.add_argument("--name", default="guidance_testbed")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    setup_comfy()
    from chorus_core.guidance.guidance import GuidanceSettings, install_guidance
    from chorus_core.testbed.workload import I2VRequest

    patcher, model_name, model_path = load_model(args.model)
    log(f"model: {model_name}")
    start, end = (float(x) for x in args.window.split(","))
    sweep = []  # "method:strength" or "method:strength:start-end"
    for item in args.sweep.split(","):
        method, strength, *window = item.split(":")
        lo, hi = (float(x) for x in window[0].split("-")) if window else (start, end)
        sweep.append((method, float(strength), lo, hi))
    cfgs = [float(c) for c in args.cfgs.split(",")]
    targets = [(tpl, int(lay), seed) for tpl in args.templates.split(",") for lay in args.layouts.split(",")
               for seed in range(args.seeds)]
    started = time.time()
    per_request, step_ms = [], {}
    for cfg in cfgs:
        for k, (template, layout, seed_index) in enumerate(targets):
            # held-out subjects; shape id = subject % 4, and 3 (a thin cross) can vanish in small sprites
            target = I2VRequest(template, 100 + 4 * k + k % 3, layout)
            similar = I2VRequest(template, 200 + 4 * k + (k + 1) % 3, layout)
            seed = 10 + 100 * seed_index + k
            maps, starts, density = record_masks(patcher, similar, seed, args.steps, cfg, args.max_density)
            bases = {"dense": patcher, "hit": hit_model(patcher, maps, starts)}
            t0 = time.perf_counter()
            dense_ref, tensors = sample(patcher, target, seed, args.steps, cfg)
            step_ms.setdefault(cfg, []).append((time.perf_counter() - t0) * 1e3 / args.steps)
            configs = [("none", 0.0, start, end)] + [c for c in sweep if cfg != 1 or c[0] != "cfg_boost"]
            for mode, base in bases.items():
                for method, strength, lo, hi in configs:
                    model = base if method == "none" else install_guidance(
                        base, GuidanceSettings(method, strength, lo, hi))
                    out = dense_ref if (mode, method) == ("dense", "none") else sample(model, target, seed, args.steps, cfg)[0]
                    row = {"cfg": cfg, "template": template, "layout": layout, "subject": target.subject, "seed": seed,
                           "mode": mode, "guidance": method != "none", "method": method, "strength": strength,
                           "window": [lo, hi], "density": round(density, 4) if mode == "hit" else 1.0,
                           **measures(out, dense_ref, tensors)}
                    per_request.append(row)
            log(f"cfg {cfg} {template}/{layout} seed {seed}: done ({time.time() - started:.0f}s)")

    rows = []
    for cfg in cfgs:
        dense_step = mean(step_ms[cfg])
        keys = sorted({(r["mode"], r["method"], r["strength"], tuple(r["window"])) for r in per_request if r["cfg"] == cfg},
                      key=lambda x: (x[0] != "dense", x[1] != "none", x[1], x[3], x[2]))
        for mode, method, strength, window in keys:
            group = [r for r in per_request
                     if (r["cfg"], r["mode"], r["method"], r["strength"], tuple(r["window"])) == (cfg, mode, method, strength, window)]
            hook_ms = 0.0 if method == "none" else hook_cost_ms(patcher, I2VRequest(), cfg, method)
            rows.append({
                "shape": "testbed-320", "N": 320, "batch": 2 if cfg != 1 else 1, "cfg": cfg, "mode": mode,
                "guidance": method != "none", "method": method, "strength": strength,
                "window": list(window) if method != "none" else None,
                "density": round(mean([r["density"] for r in group]), 4),
                "psnr_db": mean([r["psnr_db"] for r in group]), "ssim": mean([r["ssim"] for r in group]),
                "adherence": mean([r["adherence"] for r in group]),
                "first_frame_err": mean([r["first_frame_err"] for r in group]),
                "content_corr": mean([r["content_corr"] for r in group]),
                "requests": len(group), "step_ms": round(dense_step, 2), "hook_ms_per_step": round(hook_ms, 4),
                "overhead_share": round(hook_ms / dense_step, 5),
            })
        reference = {(r["mode"], r["method"]): r for r in rows if r["cfg"] == cfg and r["method"] == "none"}
        dense, hit = reference.get(("dense", "none")), reference.get(("hit", "none"))
        for r in rows:
            if r["cfg"] == cfg and r["mode"] == "hit" and r["guidance"] and dense and hit:
                for key, sign in (("adherence", 1), ("first_frame_err", -1), ("content_corr", 1)):
                    gap = sign * (dense[key] - hit[key])  # what reuse lost (> 0)
                    r[f"{key}_gap_recovered"] = round(sign * (r[key] - hit[key]) / gap, 3) if gap > 1e-9 else None
    command = "python tests/benchmarks/bench_guidance.py " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = {"benchmark": "bench_guidance", "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": machine(), "command": command.strip(), "git_commit": git_commit(), "model": model_name,
           "model_file": os.path.relpath(model_path, REPO_ROOT) if model_path.startswith(str(REPO_ROOT)) else Path(model_path).name,
           "settings": {"steps": args.steps, "sampler": "euler", "scheduler": "simple", "block_size": BLOCK,
                        "top_p": 0.9, "max_density": args.max_density, "dense_warmup_steps": 1,
                        "targets": sorted({f"{t}/layout{l}" for t, l, _ in targets}), "seeds": args.seeds, "window": [start, end]},
           "seconds": round(time.time() - started, 1), "note": args.note, "rows": rows, "per_request": per_request}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"{args.name}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


def _fmt(v, digits=3):
    if v is None:
        return "inf" if digits == 2 else "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _recovered(r) -> str:
    if "adherence_gap_recovered" not in r:
        return ""
    keys = ("adherence_gap_recovered", "first_frame_err_gap_recovered", "content_corr_gap_recovered")
    return " / ".join("-" if r.get(k) is None else f"{r[k]:.2f}" for k in keys)


def markdown(doc: dict) -> str:
    lines = [f"# Guidance enhancement on the testbed ({doc['date']})", "",
             f"- machine: {doc['machine']}", f"- command: `{doc['command']}`", f"- git commit: {doc['git_commit']}",
             f"- model: {doc['model']} (`{doc['model_file']}`)",
             f"- settings: {json.dumps(doc['settings'])}", "",
             *([doc["note"], ""] if doc.get("note") else []),
             "psnr_db / ssim: final latent vs the dense run without guidance (same seed; inf = identical). "
             "adherence (template following): correlation of the generated motion (frame t minus frame 0, "
             "t >= 1) with the template video's motion (higher = better; 0 = no relation). "
             "first_frame_err: relative RMS of the first latent frame vs the condition (lower = better). "
             "content_corr: correlation of frames 1..T-1 with the request's rendered video (higher = better). "
             "overhead_share: the hook's own work per step / a dense step. recovered: share of the dense-vs-hit gap "
             "(adherence, first-frame error, content_corr) that guidance closes on the hit (1 = all of it; negative = wider).", "",
             "| cfg | mode | guidance | strength | window | density | psnr_db | ssim | adherence | first_frame_err | content_corr | recovered (adh / ff / content) | overhead_share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        window = "-" if not r["window"] else f"{r['window'][0]:g}-{r['window'][1]:g}"
        lines.append(f"| {r['cfg']:g} | {r['mode']} | {r['method']} | {r['strength']:g} | {window} | {r['density']:.3f} | "
                     f"{_fmt(r['psnr_db'], 2)} | {_fmt(r['ssim'])} | {_fmt(r['adherence'])} | "
                     f"{_fmt(r['first_frame_err'])} | {_fmt(r['content_corr'])} | {_recovered(r)} | {r['overhead_share']:.5f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
