"""The quality table (issue 23, items 3 and 5): every product-path run of one checkpoint in one
table, and the comparisons between runs that choose the sampler's defaults.

    python -m tests.testbed.quality_table --results DIR [--compare A:B ...] [--out DIR]

``DIR`` holds one folder per run (``product_path.json`` from ``product_path`` or ``--merge``);
folders named in ``--skip`` (default ``parts``: the pieces a merged run was made of) are left out.
Writes ``quality_table.md`` and ``quality_table.json`` into ``--out`` (default ``DIR``):

- per run, its sampling (steps, cfg), the setting that differs from the shipped defaults, how many
  (request, seed) pairs it has, the hit's density and PSNR, and the paired differences that issue
  23's targets read (hit minus oracle, online, population prior; oracle minus static and the
  dissimilar request), every source at the hit's kept blocks per row, each a 95 % t interval over
  requests (``comparisons.paired_differences``);
- per run, the same sources' PSNR on the workload families the checkpoint never trained on;
- per ``--compare A:B`` (two run folders), the hit's PSNR in run A minus run B on the (request,
  seed) pairs both have, the same interval, and the settings that differ: a default is chosen by
  such a row (the README's Defaults table cites them).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from .comparisons import (family_rows, held_out_templates, mean_ci, paired_difference, paired_differences,
                          plus_minus, rows_by_pair, verdict)
from .run_record import run_record

HIT = "reused_similar_product"
# (column, section, A, B): the paired differences each run's row shows, every source with the hit's
# kept blocks per row ("matched"), so that a source is not ahead only by keeping more blocks
RUN_COLUMNS = (("hit - oracle", "matched", HIT, "oracle"), ("hit - online", "matched", HIT, "online"),
               ("hit - prior", "matched", HIT, "population_prior"),
               ("oracle - dissimilar", "matched", "oracle", "reused_dissimilar"),
               ("oracle - static", "matched", "oracle", "static"))
HELD_OUT_KINDS = (HIT, "oracle", "population_prior", "online")  # the held-out family's line, in this order


def load_runs(results: Path, skip=("parts",)) -> dict:
    """Run folder name -> its product_path.json, for every folder of ``results`` that has one."""
    runs = {}
    for folder in sorted(p for p in results.iterdir() if p.is_dir() and p.name not in skip):
        doc_path = folder / "product_path.json"
        if doc_path.is_file():
            runs[folder.name] = json.loads(doc_path.read_text())
    if not runs:
        raise SystemExit(f"no product_path.json under {results}: pass the folder that holds the runs' folders")
    return runs


def sampling(doc: dict) -> str:
    config = doc.get("config", {})
    # runs made before the harness had a cfg setting sampled at cfg 1
    return f"{config.get('sample_steps', '?')} steps, cfg {float(config.get('sample_cfg', 1.0)):g}"


def _normal(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def shipped_options() -> dict:
    """The sampler's options as it ships them (``ReuseOptions``' defaults)."""
    from chorus_core.reuse.reuse_run import ReuseOptions  # the sampler's own defaults, so this table cannot drift from them

    return asdict(ReuseOptions())


def setting(doc: dict, against: dict | None = None) -> str:
    """The sampler options of ``doc`` that differ from ``against`` (default: as shipped; 'shipped'
    when none does)."""
    options, against = doc.get("options", {}), against if against is not None else shipped_options()
    changed = [f"{name}={_normal(options[name])}" for name in sorted(against)
               if name in options and _normal(options[name]) != _normal(against[name])]
    return ", ".join(changed) or "shipped"


def run_row(name: str, doc: dict) -> dict:
    """One run's line: its sampling and setting, the hit's density and PSNR, ``RUN_COLUMNS``."""
    hits = rows_by_pair(doc["rows"], "natural", HIT)
    density, _ = mean_ci([r["density"] for r in hits.values()])
    psnr, psnr_ci = mean_ci([r["psnr_db"] for r in hits.values()])
    diffs = {(e["section"], e["a"], e["b"]): e for e in paired_differences(doc["rows"])}
    row = {"run": name, "sampling": sampling(doc), "setting": setting(doc), "pairs": len(hits),
           "requests": len({q for q, _ in hits}), "hit_density": density, "hit_psnr_db": psnr,
           "hit_psnr_db_ci95": psnr_ci}
    for column, section, a, b in RUN_COLUMNS:
        entry = diffs.get((section, a, b), {})
        row[column] = {"psnr_db": entry.get("psnr_db"), "ci95": entry.get("psnr_db_ci95"),
                       "verdict": verdict(entry) if entry else "-"}
    row["held_out"] = held_out_row(doc)
    return row


def held_out_row(doc: dict) -> dict:
    """PSNR of ``HELD_OUT_KINDS`` (matched density) on the families the checkpoint never trained on,
    with how many (request, seed) runs that is; empty when the run names no trained families."""
    held_out = held_out_templates(doc["rows"], doc.get("config", {}).get("train_templates", ()))
    if not held_out:
        return {}
    by_kind = {e["mask_kind"]: e for e in family_rows(doc["rows"], "matched", HELD_OUT_KINDS, held_out)}
    return {"families": held_out, "runs": by_kind.get(HIT, {}).get("held_out_n", 0),
            **{kind: by_kind[kind]["held_out_psnr_db"] for kind in HELD_OUT_KINDS if kind in by_kind}}


def compare_runs(name_a: str, doc_a: dict, name_b: str, doc_b: dict) -> dict:
    """The hit's PSNR in run A minus run B, paired on their common (request, seed), as one mean per
    request over its seeds with a 95 % t interval over requests."""
    hits_a, hits_b = rows_by_pair(doc_a["rows"], "natural", HIT), rows_by_pair(doc_b["rows"], "natural", HIT)
    diff = paired_difference(hits_a, hits_b, "psnr_db")
    common = diff["keys"]
    if not common:
        raise SystemExit(f"--compare {name_a}:{name_b}: the two runs share no (request, seed) pair with finite PSNR")
    entry = {"a": name_a, "b": name_b, "a_setting": setting(doc_a, doc_b.get("options", {})),
             "b_setting": setting(doc_b, doc_a.get("options", {})), "psnr_db": diff["mean"],
             "psnr_db_ci95": diff["ci95"], "pairs": diff["pairs"], "requests": diff["requests"],
             "a_density": sum(hits_a[k]["density"] for k in common) / len(common),
             "b_density": sum(hits_b[k]["density"] for k in common) / len(common)}
    if sampling(doc_a) != sampling(doc_b):
        entry["a_setting"] += f" ({sampling(doc_a)})"
        entry["b_setting"] += f" ({sampling(doc_b)})"
    return entry


def markdown(doc: dict) -> str:
    head = ["run", "sampling", "setting", "pairs", "hit density", "hit PSNR dB"] + [c for c, *_ in RUN_COLUMNS]
    lines = ["# Quality table", "", f"Runs on {doc['machine']}; table built {doc['date']}, commit {doc['git_commit']}.", "",
             f"Command: `{doc['command']}`", "",
             "Hit = `reused_similar_product` (a similar request's recorded entry served through the bank), "
             "at the density its setting selects; every other source in a run's row keeps the hit's blocks "
             "per row. The hit's PSNR is a mean ± 95 % interval over requests x seeds, as product_path's own "
             "tables give it (seeds of one request are not independent: read it as a spread, not a test). "
             "Differences are paired on (request, seed), averaged over each request's seeds, mean ± 95 % t "
             "interval over requests; a verdict names the side the interval favours.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in doc["runs"]:
        if r["hit_density"] is None:  # no hit in this run (every target missed): nothing to compare
            lines.append(f"| {r['run']} | {r['sampling']} | {r['setting']} | 0 | - | - |" + " - |" * len(RUN_COLUMNS))
            continue
        cells = [r["run"], r["sampling"], r["setting"], f"{r['pairs']} ({r['requests']} requests)",
                 f"{r['hit_density']:.3f}", f"{r['hit_psnr_db']:.2f} ± {r['hit_psnr_db_ci95']:.2f}"]
        cells += [f"{plus_minus(r[c]['psnr_db'], r[c]['ci95'])} ({r[c]['verdict']})" for c, *_ in RUN_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    held = [r for r in doc["runs"] if r.get("held_out")]
    if held:
        lines += ["", "## The held-out families (never trained on; matched density, PSNR dB)", "",
                  "| run | families | runs | " + " | ".join(HELD_OUT_KINDS) + " |", "|" + "---|" * (3 + len(HELD_OUT_KINDS))]
        for r in held:
            h = r["held_out"]
            values = [f"{h[k]:.2f}" if h.get(k) is not None else "-" for k in HELD_OUT_KINDS]
            lines.append(f"| {r['run']} | {', '.join(h['families'])} | {h['runs']} | " + " | ".join(values) + " |")
    if doc["comparisons"]:
        lines += ["", "## Settings compared (the hit's PSNR, run A minus run B, same pairs)", "",
                  "| A | B | A's setting | B's setting | density A / B | hit PSNR A - B (dB) | pairs |",
                  "|---|---|---|---|---|---|---|"]
        for c in doc["comparisons"]:
            lines.append(f"| {c['a']} | {c['b']} | {c['a_setting']} | {c['b_setting']} | "
                         f"{c['a_density']:.3f} / {c['b_density']:.3f} | {plus_minus(c['psnr_db'], c['psnr_db_ci95'])} | "
                         f"{c['pairs']} ({c['requests']} requests) |")
    return "\n".join(lines) + "\n"


def build(results: Path, compare: list, command: str, skip=("parts",)) -> dict:
    runs = load_runs(results, skip)
    for a, b in compare:
        for name in (a, b):
            if name not in runs:
                raise SystemExit(f"--compare names {name!r}, which is not a run under {results}: {sorted(runs)}")
    machines = sorted({d.get("machine", "?").split(" (")[0] for d in runs.values()})
    return {**run_record(command, False, machine=" + ".join(machines)),
            "runs": [run_row(name, doc) for name, doc in runs.items()],
            "comparisons": [compare_runs(a, runs[a], b, runs[b]) for a, b in compare]}


def compare_pair(text: str) -> tuple:
    a, sep, b = text.partition(":")
    if not (sep and a and b):
        raise argparse.ArgumentTypeError(f"--compare wants RUN_A:RUN_B (two run folders), not {text!r}")
    return a, b


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, required=True, help="the folder holding one folder per run")
    parser.add_argument("--compare", type=compare_pair, action="append", default=[], metavar="A:B")
    parser.add_argument("--skip", nargs="*", default=["parts"], help="folders that are not runs")
    parser.add_argument("--out", type=Path, help="where quality_table.md/json go (default: --results)")
    args = parser.parse_args(argv)
    command = "python -m tests.testbed.quality_table " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = build(args.results, args.compare, command, tuple(args.skip))
    out = args.out or args.results
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality_table.json").write_text(json.dumps(doc, indent=1))
    (out / "quality_table.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
