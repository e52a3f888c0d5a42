"""The README's main command (``make demo``): Chorus in a headless ComfyUI, end to end.

Starts ComfyUI (``--cpu``) with the pack and the built-in testbed Wan2.1-I2V model (trained,
tests/testbed/) in a
scratch base directory, then drives it through the HTTP API: a first request (a miss that
records masks into a fresh bank), a similar one (a hit that reuses them) and a dissimilar
one (a miss). Prints what the pack reported for each. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]

from chorus_core.comfy.comfyui_locator import ComfyUINotFound, locate_comfyui  # noqa: E402
from chorus_core.comfy.comfyui_process import ComfyServer, prepare_base_directory  # noqa: E402
from workflows import TESTBED_MODEL_NAME, chorus_i2v_prompt  # noqa: E402

REQUESTS = [
    ("first request (pan, subject 0, layout 0)", dict(template="pan", subject=0, layout=0, seed=1),
     "The bank is empty, so this is a miss: masks are predicted online from pooled q/k at every step, and\n"
     "   the run's own masks are recorded into the bank afterwards. Its time includes starting the model\n"
     "   (loading the checkpoint, first-call set-up), which the later requests do not pay again."),
    ("similar request (pan, subject 1, layout 0)", dict(template="pan", subject=1, layout=0, seed=2),
     "Same effect template and layout, another subject: similar enough to the first request's entry, so\n"
     "   this is a hit: it runs with that entry's recorded masks and predicts nothing."),
    ("dissimilar request (orbit, subject 3, layout 5)", dict(template="orbit", subject=3, layout=5, seed=3),
     "Another template and layout: below the similarity threshold of every entry, so a dissimilar miss:\n"
     "   online prediction again, and its masks become a second entry."),
]


def install_testbed_model(models_dir: Path) -> None:
    """The embedded default: the trained testbed checkpoint (tests/testbed/, 16 MB, no download)."""
    target = models_dir / "diffusion_models" / TESTBED_MODEL_NAME
    shutil.copyfile(REPO_ROOT / "tests" / "testbed" / TESTBED_MODEL_NAME, target)


def kept_density(report: dict) -> float | None:
    """Share of key blocks kept on the sparse steps (dense warm-up excluded; dense layers count as 1)."""
    layers = report.get("layers", [])
    kept = [row["density"] if row["sparse_share"] > 0 and row["density"] is not None else 1.0 for row in layers]
    return sum(kept) / len(kept) if kept and any(row["sparse_share"] > 0 for row in layers) else None


def density_line(report: dict) -> str:
    """The sparse steps' kept share, and the whole run's (the log's "density": dense calls count as 1)."""
    kept = kept_density(report)
    if kept is None:
        return "kept density: - (every attention call ran dense)"
    line = f"kept density: {kept:.0%} of key blocks on the sparse steps (about {1 - kept:.0%} skipped)"
    whole = report.get("density")
    if whole is None:
        return line
    return line + (f"; {whole:.0%} over the whole run, dense steps counted as 100% "
                   f"(the log's density {whole:.2f})")


def timing_line(timings: dict) -> str:
    """Sampling time, and a dense and a sparse step where the run had them, in seconds."""
    parts = [f"{label} {timings[key]:.2f}s" for key, label in (("dense_step_s", "dense step"),
                                                              ("sparse_step_s", "sparse step"))
             if timings.get(key) is not None]
    return f"sampling took {timings.get('sampling_s', 0):.2f}s" + (f" ({', '.join(parts)})" if parts else "")


def match_line(report: dict) -> str:
    if report["mode"] == "hit":
        return (f"HIT: entry {report['entry_id']} matched with similarity {report['similarity']:.3f} "
                "(weighted cosine of image, text and layout signatures)")
    if not report.get("components"):  # no compatible entry was compared
        return "MISS: the bank has no entries yet for this model and latent size, so there was nothing to match"
    return (f"MISS: the most similar entry scored {report['similarity']:.3f}, below the threshold, "
            "so no entry was reused")


def print_report(title: str, explanation: str, record: dict, seconds: float, first: bool) -> None:
    status = record.get("status", {}).get("status_str")
    print(f"\n== {title}: {status} in {seconds:.1f}s{' (includes loading the model)' if first else ''}")
    print(f"   {explanation}")
    for node_output in record.get("outputs", {}).values():
        for report in node_output.get("chorus_report", []):
            print(f"   {match_line(report)}")
            print(f"   mask source: {report.get('mask_source') or '-'} (where this run's sparse masks came from)")
            print(f"   {density_line(report)}")
            layers = " ".join(f"L{l['layer']}:{l['sparse_share']:.0%}" for l in report["layers"])
            print(f"   share of each layer's attention calls that ran sparse: {layers}")
            print(f"   {timing_line(report.get('timings', {}))}")
            if report.get("recorded_entry_id"):
                print(f"   recorded new bank entry {report['recorded_entry_id']}: a later similar request can hit it")
            for eviction in report.get("evictions", []):
                print(f"   {eviction['line']}")
            for warning in report.get("warnings", []):
                print(f"   warning: {warning}")


def recorded_ids(record: dict) -> list[str]:
    """The entry ids a prompt's reports say were recorded (queued or already in the bank)."""
    return [report["recorded_entry_id"] for node_output in record.get("outputs", {}).values()
            for report in node_output.get("chorus_report", []) if report.get("recorded_entry_id")]


def bank_entry_count(bank: Path) -> int:
    """Entries in the bank as the stopped server left it (read-only: nothing is replayed here)."""
    from chorus_core.bank import MaskBank

    with MaskBank.open(bank, read_only=True) as opened:
        return opened.stats()["entries"]


def run_requests(base: Path, comfyui: Path) -> list[str]:
    """Start the server, run the three requests, stop it (SIGTERM); the ids the reports recorded."""
    recorded = []
    with ComfyServer(base, comfyui=comfyui) as server:
        print(f"server on {server.url} (log: {server.log_path})")
        for index, (title, request, explanation) in enumerate(REQUESTS):
            started = time.monotonic()
            record = server.run_prompt(chorus_i2v_prompt(bank="demo_bank", model=TESTBED_MODEL_NAME, steps=8, **request),
                                       timeout=600)
            print_report(title, explanation, record, time.monotonic() - started, first=index == 0)
            if record.get("status", {}).get("status_str") != "success":
                print(server.log_tail(), file=sys.stderr)
                raise SystemExit(1)
            recorded += recorded_ids(record)
    return recorded


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
    recorded = run_requests(base, comfyui)
    bank = base / "models" / "chorus_banks" / "demo_bank"
    count = bank_entry_count(bank)
    print(f"\nThe server has stopped; the bank holds {count} entries, and the reports recorded {len(recorded)}.")
    print(f"The scratch folder stays for you to look at: bank {bank}, server log {base / 'comfyui.log'}")
    print(f"Inspect the bank: {sys.executable} -m chorus_core.bank stats {bank}")
    if count != len(recorded):
        print(f"error: the reports recorded {len(recorded)} entries but the bank holds {count}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
