"""Paired comparison of two product-path runs that differ in one sampler option.

    python -m tests.testbed.option_pairs --a DIR [DIR ...] --b DIR [DIR ...] --label-a bf16 --label-b fp8 \
        [--kind reused_similar_product] [--section matched] [--limit-db 0.3] --out DIR

Each DIR holds a ``product_path.json`` (one run, or one seed of a run split with ``--seed-start``).
Runs of ``--option attention_precision=fp8`` against the testbed's bf16, say, see the same requests
and seeds, so their rows pair by (request, seed): B - A in PSNR per pair, averaged over each
request's seeds, then a mean and t interval over requests (``comparisons.paired_difference``). With
``--limit-db L`` the verdict says whether B is at most L dB under A: the interval's lower end
at or above -L. Writes option_pairs.json and .md into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .comparisons import paired_difference, plus_minus, rows_by_pair


def load_rows(dirs: list[Path]) -> tuple[list, list]:
    """Every row of the runs in ``dirs`` and each run's options (to say which option differs)."""
    rows, options = [], []
    for d in dirs:
        doc = json.loads((Path(d) / "product_path.json").read_text())
        rows += doc["rows"]
        options.append(doc.get("options", {}))
    return rows, options


def differing_options(options_a: list, options_b: list) -> dict:
    """Option -> (A's values, B's values) for the options the two groups do not share."""
    keys = {k for o in options_a + options_b for k in o}
    out = {}
    for k in sorted(keys):
        a, b = sorted({json.dumps(o.get(k)) for o in options_a}), sorted({json.dumps(o.get(k)) for o in options_b})
        if a != b:
            out[k] = (a, b)
    return out


def compare(args) -> dict:
    rows_a, options_a = load_rows(args.a)
    rows_b, options_b = load_rows(args.b)
    a = rows_by_pair(rows_a, args.section, args.kind)
    b = rows_by_pair(rows_b, args.section, args.kind)
    diff = paired_difference(b, a, "psnr_db")
    pairs = [dict(request=r, seed=s, psnr_a=a[(r, s)]["psnr_db"], psnr_b=b[(r, s)]["psnr_db"],
                  density_a=a[(r, s)]["density"], density_b=b[(r, s)]["density"]) for r, s in diff["keys"]]
    if diff["requests"] < 2:  # one request's seeds give a spread, not an interval over requests
        diff["ci95"] = None
    doc = dict(kind=args.kind, section=args.section, label_a=args.label_a, label_b=args.label_b,
               runs_a=[str(d) for d in args.a], runs_b=[str(d) for d in args.b],
               differing_options=differing_options(options_a, options_b),
               b_minus_a_db=diff["mean"], ci95_db=diff["ci95"], pairs=diff["pairs"], requests=diff["requests"],
               per_pair=pairs, limit_db=args.limit_db)
    doc["verdict"] = verdict(doc)
    return doc


def verdict(doc: dict) -> str:
    if doc["b_minus_a_db"] is None:
        return "no pairs"
    if doc["limit_db"] is None:
        return "measured"
    if doc["ci95_db"] is None:
        return f"not judged: {doc['requests']} request(s), an interval needs two or more"
    within = doc["b_minus_a_db"] - doc["ci95_db"] >= -doc["limit_db"]
    return f"{doc['label_b']} is at most {doc['limit_db']} dB under {doc['label_a']}" if within else \
        f"not shown to be within {doc['limit_db']} dB"


def markdown(doc: dict) -> str:
    lines = [f"# {doc['label_b']} against {doc['label_a']}: {doc['kind']}, {doc['section']} section", "",
             f"Options that differ: `{json.dumps(doc['differing_options'])}`", "",
             f"**{doc['label_b']} - {doc['label_a']}: {plus_minus(doc['b_minus_a_db'], doc['ci95_db'])} dB** "
             f"over {doc['pairs']} pairs, {doc['requests']} requests (mean over each request's seeds, 95 % t "
             f"interval over requests). Verdict: {doc['verdict']}.", "",
             f"| request | seed | density {doc['label_a']} | density {doc['label_b']} | PSNR {doc['label_a']} | "
             f"PSNR {doc['label_b']} | {doc['label_b']} - {doc['label_a']} |", "|---|---|---|---|---|---|---|"]
    for p in doc["per_pair"]:
        lines.append(f"| {p['request']} | {p['seed']} | {p['density_a']:.4f} | {p['density_b']:.4f} | "
                     f"{p['psnr_a']:.3f} | {p['psnr_b']:.3f} | {p['psnr_b'] - p['psnr_a']:+.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, nargs="+", required=True)
    parser.add_argument("--b", type=Path, nargs="+", required=True)
    parser.add_argument("--label-a", default="A")
    parser.add_argument("--label-b", default="B")
    parser.add_argument("--kind", default="reused_similar_product")
    parser.add_argument("--section", default="matched")
    parser.add_argument("--limit-db", type=float, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    doc = compare(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "option_pairs.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "option_pairs.md").write_text(markdown(doc))
    sys.stdout.write(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
