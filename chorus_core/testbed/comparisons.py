"""The product path's comparisons between mask sources, with intervals that can separate them.

Every source runs on the same (request, seed) pairs, so the question "is the hit worse than the
oracle?" is best answered by the mean of the per-pair differences and its 95 % interval: the
requests' own spread (some targets are simply harder) cancels, and two sources whose unpaired
intervals overlap can still differ beyond doubt. Issue 23's targets are read from these:

- ``paired_differences``: for each pair (A, B) of one section, mean and 95 % interval of A - B
  in PSNR (dB) and relative RMS error, over the pairs both were run on;
- ``family_rows``: every source's PSNR on the workload families the checkpoint was trained on
  and, apart, on those it never saw (the held-out family that chose nothing).
"""

from __future__ import annotations

import math

# (A, B): the hit against what it should equal and what it should beat; the oracle against what it must beat
PAIRS = {
    "matched": (("reused_similar_product", "oracle"), ("reused_similar_product", "reused_similar"),
                ("reused_similar_product", "online"), ("reused_similar_product", "population_prior"),
                ("reused_similar_product", "reused_dissimilar"), ("reused_similar_product", "static"),
                ("oracle", "reused_dissimilar"),
                ("oracle", "static")),
    "natural": (("reused_similar_product", "oracle"), ("reused_similar_product", "online"),
                ("reused_similar_product", "online_no_warmup"), ("reused_similar_product", "population_prior"),
                ("reused_similar_product", "reused_dissimilar_product")),
}
DIFF_METRICS = ("psnr_db", "rel_rms")


def mean_ci(values: list) -> tuple:
    """Mean and 95 % half-width (normal approximation; 0 for one value) of the finite values."""
    v = [x for x in values if x is not None and math.isfinite(x)]
    if not v:
        return None, None
    m = sum(v) / len(v)
    if len(v) < 2:
        return m, 0.0
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))
    return m, 1.96 * sd / math.sqrt(len(v))


def _by_pair(rows: list, section: str, kind: str) -> dict:
    return {(r["request"], r["seed"]): r for r in rows if r["section"] == section and r["mask_kind"] == kind}


def paired_differences(rows: list) -> list:
    """One entry per (section, A, B) of ``PAIRS`` that both sources have rows for."""
    out = []
    for section, pairs in PAIRS.items():
        for a, b in pairs:
            rows_a, rows_b = _by_pair(rows, section, a), _by_pair(rows, section, b)
            common = sorted(set(rows_a) & set(rows_b))
            if not common:
                continue
            entry = {"section": section, "a": a, "b": b, "n": len(common)}
            for metric in DIFF_METRICS:
                diffs = [rows_a[k][metric] - rows_b[k][metric] for k in common
                         if rows_a[k].get(metric) is not None and rows_b[k].get(metric) is not None]
                entry[metric], entry[f"{metric}_ci95"] = mean_ci(diffs)
            out.append(entry)
    return out


def verdict(entry: dict) -> str:
    """'A ahead', 'B ahead' (in PSNR, beyond the 95 % interval) or 'not separated'."""
    m, ci = entry.get("psnr_db"), entry.get("psnr_db_ci95")
    if m is None:
        return "-"
    if m - ci > 0:
        return f"{entry['a']} ahead"
    if m + ci < 0:
        return f"{entry['b']} ahead"
    return "not separated"


def template_of(request_name: str) -> str:
    """The workload family of a product-path request name ('bounce/s106/l0/detailed' -> 'bounce')."""
    return request_name.split("/", 1)[0]


def held_out_templates(rows: list, train_templates) -> list:
    """Families the rows cover that the checkpoint was not trained on."""
    return sorted({template_of(r["request"]) for r in rows} - set(train_templates))


def family_rows(rows: list, section: str, kinds, held_out: list) -> list:
    """Per source: PSNR mean ± 95 % interval on the trained families and on the held-out ones."""
    out = []
    for kind in kinds:
        group = [r for r in rows if r["section"] == section and r["mask_kind"] == kind]
        if not group:
            continue
        entry = {"mask_kind": kind}
        for label, members in (("trained", [r for r in group if template_of(r["request"]) not in held_out]),
                               ("held_out", [r for r in group if template_of(r["request"]) in held_out])):
            m, ci = mean_ci([r["psnr_db"] for r in members])
            entry[f"{label}_psnr_db"], entry[f"{label}_psnr_db_ci95"], entry[f"{label}_n"] = m, ci, len(members)
        out.append(entry)
    return out
