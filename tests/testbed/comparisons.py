"""The product path's comparisons between mask sources, with intervals that can separate them.

Every source runs on the same (request, seed) pairs, so the question "is the hit worse than the
oracle?" is best answered by the per-pair differences: the requests' own spread (some targets are
simply harder) cancels, and two sources whose unpaired intervals overlap can still differ. The
seeds of one request are not independent samples of the workload, so each request's differences
are averaged over its seeds first and the interval is a t interval over requests. Issue 23's
targets are read from these:

- ``paired_differences``: for each pair (A, B) of one section, mean and 95 % interval of A - B
  in PSNR (dB) and relative RMS error, over requests (each the mean over its seeds);
- ``family_rows``: every source's PSNR on the workload families the checkpoint was trained on
  and, apart, on those it never saw (a held-out family).

Many pairs are read at once, each at 95 %: one in twenty separations can be chance.
"""

from __future__ import annotations

import math

# (A, B): the hit against what it should equal and what it should beat; the oracle against what it must beat
PAIRS = {
    "matched": (("reused_similar_product", "oracle"), ("reused_similar_product", "reused_similar"),
                ("reused_similar_product", "online"), ("reused_similar_product", "population_prior"),
                ("reused_similar_product", "reused_dissimilar"), ("reused_similar_product", "static"),
                ("oracle", "reused_dissimilar"),
                ("oracle", "static"), ("reused_similar_product", "core_sparse_matched"),
                ("reused_similar_pooled_tail", "reused_similar_product"), ("reused_similar_pooled_tail", "core_sparse_matched"),
                ("reused_similar_pooled_tail_rows", "reused_similar_product"),
                ("reused_similar_pooled_tail_rows", "core_sparse_matched"),
                ("reused_similar_replayed", "reused_similar_product")),
    "natural": (("reused_similar_product", "oracle"), ("reused_similar_product", "online"),
                ("reused_similar_product", "online_no_warmup"), ("reused_similar_product", "population_prior"),
                ("reused_similar_product", "reused_dissimilar_product"),
                ("reused_similar_product", "core_sparse_defaults")),
}
DIFF_METRICS = ("psnr_db", "rel_rms")


# two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile_975(df: int) -> float:
    """Student's t 97.5 % quantile (beyond 30 degrees of freedom 1.96 + 2.5 / df, within 0.002)."""
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.5 / df


def mean_ci(values: list) -> tuple:
    """Mean and 95 % half-width (t interval; 0 for one value) of the finite values."""
    v = [x for x in values if is_finite(x)]
    if not v:
        return None, None
    m = sum(v) / len(v)
    if len(v) < 2:
        return m, 0.0
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))
    return m, t_quantile_975(len(v) - 1) * sd / math.sqrt(len(v))


def rows_by_pair(rows: list, section: str, kind: str) -> dict:
    """(request, seed) -> the row of ``kind`` in ``section``; ValueError on a pair seen twice."""
    out = {}
    for r in rows:
        if r["section"] == section and r["mask_kind"] == kind:
            key = (r["request"], r["seed"])
            if key in out:
                raise ValueError(f"two {section} {kind} rows for {key}: merge each run once")
            out[key] = r
    return out


def paired_difference(rows_a: dict, rows_b: dict, metric: str) -> dict:
    """A - B in ``metric`` over the (request, seed) pairs both have with finite values (identical
    latents give +inf): ``mean`` and ``ci95`` over requests, each the mean over its seeds, and how
    many ``pairs`` and ``requests`` that is."""
    diffs = {k: rows_a[k][metric] - rows_b[k][metric] for k in sorted(set(rows_a) & set(rows_b))
             if is_finite(rows_a[k].get(metric)) and is_finite(rows_b[k].get(metric))}
    by_request = {}
    for (request, _), d in diffs.items():
        by_request.setdefault(request, []).append(d)
    mean, ci = mean_ci([sum(v) / len(v) for v in by_request.values()])
    return {"mean": mean, "ci95": ci, "pairs": len(diffs), "requests": len(by_request), "keys": list(diffs)}


def paired_differences(rows: list) -> list:
    """One entry per (section, A, B) of ``PAIRS`` that both sources have rows for."""
    out = []
    for section, pairs in PAIRS.items():
        for a, b in pairs:
            rows_a, rows_b = rows_by_pair(rows, section, a), rows_by_pair(rows, section, b)
            if not set(rows_a) & set(rows_b):
                continue
            entry = {"section": section, "a": a, "b": b}
            for metric in DIFF_METRICS:
                diff = paired_difference(rows_a, rows_b, metric)
                entry[metric], entry[f"{metric}_ci95"] = diff["mean"], diff["ci95"]
                if metric == "psnr_db":
                    entry["n"], entry["requests"] = diff["pairs"], diff["requests"]
            out.append(entry)
    return out


def plus_minus(mean, ci, digits: int = 2) -> str:
    """A signed difference as a table cell: ``+m ± ci``, ``+m`` when there is no interval (``ci``
    None, e.g. one request), ``-`` when there is no value."""
    if mean is None:
        return "-"
    return f"{mean:+.{digits}f}" if ci is None else f"{mean:+.{digits}f} ± {ci:.{digits}f}"


def is_finite(x) -> bool:
    """A number that is not None, inf or NaN (identical latents give a PSNR of +inf)."""
    return x is not None and math.isfinite(x)


def verdict(entry: dict) -> str:
    """'A ahead' or 'B ahead' when the 95 % interval of A - B in PSNR excludes 0, else 'not separated'."""
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
    """Families the rows cover that the checkpoint was not trained on (none when that is not known)."""
    if not train_templates:
        return []
    return sorted({template_of(r["request"]) for r in rows} - set(train_templates))


def family_rows(rows: list, section: str, kinds, held_out: list) -> list:
    """Per source: PSNR mean ± 95 % interval (over requests x seeds) on the trained families and on
    the held-out ones, with how many requests each side has."""
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
            entry[f"{label}_requests"] = len({r["request"] for r in members})
        out.append(entry)
    return out
