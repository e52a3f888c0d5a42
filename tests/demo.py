"""The README's main command (``make demo``): Chorus in a headless ComfyUI, end to end.

Starts ComfyUI (``--cpu``) with the pack and the built-in testbed Wan2.1-I2V model (trained,
tests/testbed/) in a
scratch base directory, then drives it through the HTTP API: a first request (a miss that
records masks into a fresh bank), a similar one (a hit that reuses them) and a dissimilar
one (a miss). Prints what the pack reported for each. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]

from chorus_core.comfyui_locator import ComfyUINotFound, locate_comfyui  # noqa: E402
from chorus_core.comfyui_process import ComfyServer, prepare_base_directory  # noqa: E402
from workflows import TESTBED_MODEL_NAME, chorus_i2v_prompt  # noqa: E402

REQUESTS = [
    ("first request (pan, subject 0, layout 0)", dict(template="pan", subject=0, layout=0, seed=1)),
    ("similar request (pan, subject 1, layout 0)", dict(template="pan", subject=1, layout=0, seed=2)),
    ("dissimilar request (orbit, subject 3, layout 5)", dict(template="orbit", subject=3, layout=5, seed=3)),
]


def install_testbed_model(models_dir: Path) -> None:
    """The embedded default: the trained testbed checkpoint (tests/testbed/, 16 MB, no download)."""
    target = models_dir / "diffusion_models" / TESTBED_MODEL_NAME
    shutil.copyfile(REPO_ROOT / "tests" / "testbed" / TESTBED_MODEL_NAME, target)


def print_report(title: str, record: dict, seconds: float) -> None:
    status = record.get("status", {}).get("status_str")
    print(f"\n== {title}: {status} in {seconds:.1f}s")
    for node_output in record.get("outputs", {}).values():
        for report in node_output.get("chorus_report", []):
            layers = " ".join(f"L{l['layer']}:{l['sparse_share']:.0%}" for l in report["layers"])
            similarity = report.get("similarity")
            similarity = "-" if similarity is None else f"{similarity:.3f}"
            print(f"   mode={report['mode']} entry={report.get('entry_id')} similarity={similarity}")
            print(f"   density={report.get('density')} per-layer sparse share: {layers}")
            print(f"   timings: {json.dumps(report.get('timings', {}))}")
            if report.get("recorded_entry_id"):
                print(f"   recorded new bank entry {report['recorded_entry_id']}")
            for warning in report.get("warnings", []):
                print(f"   warning: {warning}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    try:
        comfyui = locate_comfyui()
    except ComfyUINotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="chorus-demo-"))
    base = prepare_base_directory(scratch)
    install_testbed_model(base / "models")
    print(f"ComfyUI {comfyui}\nbase directory {base}")
    with ComfyServer(base, comfyui=comfyui) as server:
        print(f"server on {server.url} (log: {server.log_path})")
        for title, request in REQUESTS:
            started = time.monotonic()
            record = server.run_prompt(chorus_i2v_prompt(bank="demo_bank", model=TESTBED_MODEL_NAME, steps=8, **request),
                                       timeout=600)
            print_report(title, record, time.monotonic() - started)
            if record.get("status", {}).get("status_str") != "success":
                print(server.log_tail(), file=sys.stderr)
                return 1
    bank = base / "models" / "chorus_banks" / "demo_bank"
    print(f"\nThe scratch folder stays for you to look at: bank {bank}, server log {base / 'comfyui.log'}")
    print(f"Inspect the bank: {sys.executable} -m chorus_core.bank stats {bank}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
