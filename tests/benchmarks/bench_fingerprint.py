"""Model fingerprint cost at the Wan 2.1 14B tensor count, with and without a LoRA.

    python tests/benchmarks/bench_fingerprint.py [--repeats 20] [--out DIR]

Wan 2.1 14B has 40 blocks: 1,303 diffusion-model tensors, as many as the 40-block tiny
Wan2.1-I2V model built here (dim 128) in ComfyUI's own loader. The digest reads a fixed
sample of each tensor (``SAMPLES_PER_TENSOR``), so its cost follows the tensor count, not the
tensors' size (``tests/test_fingerprint.py`` pins what is read). Every Similarity Match and
sampler run fingerprints its model once, so it should stay well under 100 ms. A LoRA on all
488 linear layers (as LoraLoaderModelOnly applies one) adds its patch list's digest.

Wall time and this process's CPU time per fingerprint (min and median of ``--repeats``); on a
loaded machine the wall time is the one that grows. Writes ``fingerprint_cpu.json`` / ``.md``.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor() or platform.machine())
    return f"{model}, {os.cpu_count()} cores (CPU only)"


def git_commit() -> str | None:
    result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip() or None


def models(folder: Path):
    """The 40-block tiny model as UNETLoader loads it, and a clone with a LoRA on its 488 linear layers."""
    from chorus_core.comfy.comfyui_locator import locate_comfyui, prepare_in_process

    prepare_in_process(locate_comfyui(allow_clone=False), cpu=True)
    import comfy.sd

    from chorus_core.testbed.tiny_wan import TinyWanConfig, save_tiny_wan_i2v
    from test_fingerprint import with_lora

    path = save_tiny_wan_i2v(folder / "deep.safetensors", TinyWanConfig(dim=128, ffn_dim=256, num_layers=40))
    patcher = comfy.sd.load_diffusion_model(str(path))
    state = patcher.model.diffusion_model.state_dict()
    linear = [k[:-len(".weight")] for k, v in state.items() if k.endswith(".weight") and v.ndim == 2]
    return len(state), {"bare": patcher, f"LoRA on {len(linear)} keys": with_lora(patcher, seed=3, strength=1.0,
                                                                                 keys=linear)}


def measure(patcher, repeats: int) -> dict:
    from chorus_core.reuse.model_identity import fingerprint_patcher

    fingerprint_patcher(patcher)  # first call: imports and torch's lazy set-up, not counted
    wall, cpu = [], []
    for _ in range(repeats):
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        fingerprint_patcher(patcher)
        wall.append((time.perf_counter() - wall_start) * 1e3)
        cpu.append((time.process_time() - cpu_start) * 1e3)
    return {"wall_ms_min": round(min(wall), 1), "wall_ms_median": round(statistics.median(wall), 1),
            "cpu_ms_min": round(min(cpu), 1), "cpu_ms_median": round(statistics.median(cpu), 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "tests" / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    from chorus_core.bank.fingerprint import SAMPLES_PER_TENSOR

    with tempfile.TemporaryDirectory() as folder:
        tensors, patchers = models(Path(folder))
        rows = [{"model": name, "tensors": tensors, **measure(p, args.repeats)} for name, p in patchers.items()]
    doc = {"benchmark": "bench_fingerprint", "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": machine(), "command": " ".join(["python", "tests/benchmarks/bench_fingerprint.py", *sys.argv[1:]]),
           "git_commit": git_commit(), "samples_per_tensor": SAMPLES_PER_TENSOR, "repeats": args.repeats,
           "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fingerprint_cpu.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = ["# Model fingerprint at the Wan 2.1 14B tensor count", "",
             f"{doc['machine']}; `{doc['command']}`; {doc['date']}; commit {doc['git_commit']}", "",
             f"{SAMPLES_PER_TENSOR} samples per tensor, {args.repeats} repeats after one untimed call.", "",
             "| model | tensors | wall ms (min) | wall ms (median) | CPU ms (min) | CPU ms (median) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tensors']:,} | {r['wall_ms_min']} | {r['wall_ms_median']} | "
                     f"{r['cpu_ms_min']} | {r['cpu_ms_median']} |")
    (out / "fingerprint_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
