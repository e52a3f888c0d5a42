"""How a mask bank grows under production-like traffic: a seeded request stream through the real bank code.

Run: .venv/bin/python tests/benchmarks/bench_bank_lifecycle.py [--requests 100000] [--kinds 300] [--seed 0]
     [--policies none,merge,prune_25,budget_10,budget_25,budget_50] [--url postgresql://...]
     [--merge-similarity 0.65 --merge-agreement 0.55]
Writes tests/benchmarks/results/bank_lifecycle.{json,md,png}.

The stream (mask level, no model): a *kind* of request is an effect template at a recurring layout;
kinds appear over the stream (a new one about every requests / (1.2 x kinds) requests) and are drawn
with Zipf popularity (exponent 1.1, the earliest kinds the most popular); every request is a new photo
(a new subject). Signatures: the text component is the template's, the layout component the layout's,
the CLIP component mostly the kind's with the photo's own part (two photos of one kind: cosine about
0.8, so their weighted similarity sits just over the default threshold 0.9, as in the testbed).
Attention: per kind a block-mass pattern per (layer, head, query block) and per photo a log-normal
perturbation of it; the oracle mask keeps each row's top blocks up to 90 % of its mass (top-p 0.9, as
the shipped recording). A miss records the request's oracle mask (add_entry); a hit loads the entry's
masks (load_masks, the real decode) and scores their recall: the share of the request's own attention
mass they keep, against the oracle mask's.

Policies: ``none`` (every miss adds an entry: today's behaviour), ``merge`` (the bank's merge policy at
``MERGE_THRESHOLDS``: a miss whose recording is close to an entry in signature and masks updates that entry,
chorus_core/bank/merge.py), ``prune_<P>`` (after each add,
``prune(max_bytes=P % of the final size of 'none')``: the people's tool, least recently used first, run
as a writer would) and ``budget_<P>`` (the bank's own budget, ``set_budget(max_bytes=P % of the final
size of 'none')`` once: every add evicts the entries worth least in its own transaction). After every
add the bank's budgeted bytes are read; a budget row's ``peak_bytes`` is the most seen, and
``within_budget`` says whether it never exceeded the budget.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from chorus_core.bank import LatentLayout, ModelFingerprint, Schedule, Signature, open_bank  # noqa: E402
from chorus_core.bank.signature import DIM  # noqa: E402

RESULTS = ROOT / "tests" / "benchmarks" / "results"
LAYERS, HEADS = 2, 2
LAYOUT = LatentLayout(grid=(4, 8, 8), block_size=(16, 16))  # 256 tokens, 16 x 16 blocks
SCHEDULE = Schedule(steps=4, sampler="euler", scheduler="simple", shift=5.0, step_buckets=[(0, 4)])
FINGERPRINT = ModelFingerprint("wan2.1", dim=HEADS * 128, layers=LAYERS, heads=HEADS, in_dim=36, digest="0" * 64)
TOP_P, ZIPF, WINDOW = 0.9, 1.1, 1000
# (signature similarity, mask agreement) for policy "merge": midway between the two kinds of pairs that
# threshold_study() measures (see its docstring and the JSON's "threshold_study").
MERGE_THRESHOLDS = (0.65, 0.55)


def unit(vec: np.ndarray) -> np.ndarray:
    return (vec / np.linalg.norm(vec)).astype(np.float32)


class Stream:
    """The seeded request stream: kinds appear over time, Zipf popularity, a new photo per request."""

    def __init__(self, requests: int, kinds: int, seed: int):
        self.rng = np.random.default_rng(seed)
        self.requests, self.kinds = requests, kinds
        templates = max(2, int(np.sqrt(kinds)))
        layouts = -(-kinds // templates)
        self.kind_of = [(k % templates, k // templates) for k in range(kinds)]
        self.text = [unit(self.rng.standard_normal(DIM)) for _ in range(templates)]
        self.layout = [unit(self.rng.standard_normal(DIM)) for _ in range(layouts)]
        self.kind_clip = [unit(self.rng.standard_normal(DIM)) for _ in range(kinds)]
        nq, nk = LAYOUT.blocks
        self.pattern = [self.rng.normal(0, 1.5, (LAYERS, HEADS, nq, nk)) for _ in range(kinds)]
        self.every = max(1, requests // int(1.2 * kinds))

    def draw(self, index: int) -> tuple[int, Signature, np.ndarray]:
        """The request at ``index``: its kind, signature and block attention ``[L, H, nq, nk]`` (rows sum to 1)."""
        available = min(self.kinds, 1 + index // self.every)
        weights = 1.0 / np.arange(1, available + 1) ** ZIPF
        kind = int(self.rng.choice(available, p=weights / weights.sum()))
        template, layout = self.kind_of[kind]
        clip = unit(0.9 * self.kind_clip[kind] + 0.44 * unit(self.rng.standard_normal(DIM)))
        signature = Signature({"clip": clip, "text": self.text[template], "layout": self.layout[layout]})
        logits = self.pattern[kind] + self.rng.normal(0, 0.5, self.pattern[kind].shape)
        mass = np.exp(logits)
        return kind, signature, mass / mass.sum(-1, keepdims=True)


def oracle_mask(attention: np.ndarray, top_p: float = TOP_P) -> np.ndarray:
    """Each row's fewest blocks holding ``top_p`` of its mass, and the diagonal."""
    order = np.argsort(-attention, axis=-1)
    sorted_mass = np.take_along_axis(attention, order, -1)
    keep_sorted = np.cumsum(sorted_mass, -1) - sorted_mass < top_p
    mask = np.zeros_like(attention, dtype=bool)
    np.put_along_axis(mask, order, keep_sorted, -1)
    eye = np.eye(attention.shape[-1], dtype=bool)
    return mask | eye


def recall(mask: np.ndarray, attention: np.ndarray) -> float:
    return float((attention * mask).sum(-1).mean())


def run_policy(policy: str, stream_args: tuple, bank_location: str, budget_bytes: int | None, log,
               merge_thresholds: tuple = MERGE_THRESHOLDS) -> dict:
    stream = Stream(*stream_args)
    bank = open_bank(bank_location)
    if policy.startswith("budget_"):
        bank.set_budget(max_bytes=budget_bytes)
    if policy == "merge":
        bank.set_merge_policy(*merge_thresholds)
    served, oracle, latencies, hits, windows, kinds_seen, peak = [], [], [], 0, [], set(), 0
    masks_of: dict[str, np.ndarray] = {}
    started = time.perf_counter()
    for index in range(stream.requests):
        kind, signature, attention = stream.draw(index)
        kinds_seen.add(kind)
        t0 = time.perf_counter()
        result = bank.match(signature, FINGERPRINT, LAYOUT, threshold=0.9)
        latencies.append((time.perf_counter() - t0) * 1e3)
        if result.hit:
            hits += 1
            if result.entry_id not in masks_of:
                entry = bank.load_masks(result.entry_id)
                masks_of[result.entry_id] = np.stack([entry.block_map_numpy(0, layer) for layer in range(LAYERS)])
            served.append(recall(masks_of[result.entry_id], attention))
            oracle.append(recall(oracle_mask(attention), attention))
        else:
            mask = oracle_mask(attention)
            written = bank.add_entry(FINGERPRINT, LAYOUT, SCHEDULE, mask[None], signature,
                                     density=float(mask.mean()), tags=[f"kind{kind}"])
            masks_of.pop(written, None)  # merged into: its masks changed
            if policy.startswith("prune_"):
                bank.prune(max_bytes=budget_bytes)
            peak = max(peak, bank.budget_status()["bytes"])
        if (index + 1) % WINDOW == 0:
            windows.append(window_row(policy, index + 1, bank.stats(), hits, served, oracle, latencies,
                                      len(kinds_seen)))
            hits, served, oracle, latencies = 0, [], [], []
            log(f"{policy}: {index + 1} requests, {windows[-1]['entries']} entries, hit rate "
                f"{windows[-1]['hit_rate']:.3f}, {time.perf_counter() - started:.0f} s")
    stats = bank.stats()
    merge_status = bank.merge_status()
    bank.close()
    final = final_row(policy, windows, stats, len(kinds_seen))
    if policy == "merge":
        final.update(merge_similarity=merge_status["similarity"], merge_agreement=merge_status["agreement"],
                     votes_bytes=merge_status["votes_bytes"])
    if budget_bytes is not None:
        final.update(budget_bytes=budget_bytes, peak_bytes=peak, within_budget=peak <= budget_bytes)
    return {"windows": windows, "final": final}


def threshold_study(stream_args: tuple, pairs: int = 2000) -> dict:
    """What the merge thresholds are chosen from: for requests of one kind (two photos) and for a request
    and its most similar request of another kind, the signature similarity and the mask agreement
    (Jaccard of their oracle masks). Drawn from the last half of the stream, when every kind exists.
    A threshold is put midway between the other kinds' maximum and the same kind's 1st percentile."""
    from chorus_core.bank.merge import agreement

    stream = Stream(*stream_args)
    by_kind: dict[int, list] = {}
    for index in range(stream.requests // 2, stream.requests // 2 + pairs):
        kind, signature, attention = stream.draw(index)
        by_kind.setdefault(kind, []).append((signature, oracle_mask(attention)))
    firsts = {k: v[0] for k, v in by_kind.items()}
    same_sim, same_agree, other_sim, other_agree = [], [], [], []
    for kind, seen in by_kind.items():
        for (sig_a, mask_a), (sig_b, mask_b) in zip(seen, seen[1:]):
            same_sim.append(sig_a.similarity(sig_b)[0])
            same_agree.append(agreement(mask_a, mask_b))
        sim, other = max((seen[0][0].similarity(firsts[o][0])[0], o) for o in firsts if o != kind)
        other_sim.append(sim)
        other_agree.append(agreement(seen[0][1], firsts[other][1]))

    def spread(values):
        return {q: round(float(np.percentile(values, p)), 4) for q, p in (("min", 0), ("p1", 1), ("p50", 50),
                                                                         ("p99", 99), ("max", 100))}

    result = {"same_kind_pairs": len(same_sim), "other_kind_pairs": len(other_sim),
              "similarity": {"same_kind": spread(same_sim), "nearest_other_kind": spread(other_sim)},
              "agreement": {"same_kind": spread(same_agree), "nearest_other_kind": spread(other_agree)}}
    for key in ("similarity", "agreement"):
        result[key]["midway"] = round((result[key]["same_kind"]["p1"] + result[key]["nearest_other_kind"]["max"]) / 2, 4)
    return result


def window_row(policy, requests, stats, hits, served, oracle, latencies, kinds_seen) -> dict:
    return {"policy": policy, "requests": requests, "entries": stats["entries"], "bytes": stats["bytes"],
            "kinds_seen": kinds_seen, "hit_rate": hits / WINDOW,
            "served_recall": float(np.mean(served)) if served else None,
            "oracle_recall": float(np.mean(oracle)) if oracle else None,
            "match_p50_ms": float(np.percentile(latencies, 50)), "match_p99_ms": float(np.percentile(latencies, 99))}


def final_row(policy, windows, stats, kinds_seen) -> dict:
    served = [w["served_recall"] for w in windows if w["served_recall"] is not None]
    return {"final": True, "policy": policy, "entries": stats["entries"], "kinds_seen": kinds_seen,
            "hit_rate": float(np.mean([w["hit_rate"] for w in windows])), "bytes": stats["bytes"],
            "served_recall": float(np.mean(served)) if served else None,
            "last_window_hit_rate": windows[-1]["hit_rate"],
            "last_window_match_p99_ms": windows[-1]["match_p99_ms"]}


def machine() -> str:
    import os

    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor())
    return f"{model}, {os.cpu_count()} cores (CPU only)"


def write_results(doc: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bank_lifecycle.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [f"# Bank lifecycle ({doc['date']}, {doc['machine']})", "", f"`{doc['command']}` at {doc['git_commit'][:10]}",
             "", "| policy | entries | kinds seen | hit rate | last 1,000 hit rate | bytes | budget | peak bytes "
             "| served recall |", "|---|---|---|---|---|---|---|---|---|"]
    for row in doc["rows"]:
        if row.get("final"):
            recall_text = "n/a" if row["served_recall"] is None else f"{row['served_recall']:.4f}"
            lines.append(f"| {row['policy']} | {row['entries']} | {row['kinds_seen']} | {row['hit_rate']:.3f} | "
                         f"{row['last_window_hit_rate']:.3f} | {row['bytes']} | {row.get('budget_bytes', '-')} | "
                         f"{row.get('peak_bytes', '-')} | {recall_text} |")
    study = doc.get("threshold_study")
    if study:
        lines += ["", f"Merge thresholds measured on {study['same_kind_pairs']} same-kind pairs and "
                  f"{study['other_kind_pairs']} nearest-other-kind pairs (min / p1 / p50 / p99 / max):", ""]
        for key in ("similarity", "agreement"):
            same, other = study[key]["same_kind"], study[key]["nearest_other_kind"]
            lines.append(f"- {key}: same kind {' / '.join(str(v) for v in same.values())}; nearest other kind "
                         f"{' / '.join(str(v) for v in other.values())}; midway {study[key]['midway']}")
        merged = [r for r in doc["rows"] if r.get("final") and r["policy"] == "merge"]
        if merged:
            lines.append(f"- policy merge ran at similarity {merged[0]['merge_similarity']}, agreement "
                         f"{merged[0]['merge_agreement']}; its kept votes: {merged[0]['votes_bytes']} bytes "
                         "(meta rows, not in the budget's bytes)")
    (out / "bank_lifecycle.md").write_text("\n".join(lines) + "\n")
    plot(doc, out / "bank_lifecycle.png")


def plot(doc: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (entries_ax, hits_ax) = plt.subplots(1, 2, figsize=(10, 3.5))
    for policy in dict.fromkeys(r["policy"] for r in doc["rows"] if not r.get("final")):
        rows = [r for r in doc["rows"] if r["policy"] == policy and not r.get("final")]
        x = [r["requests"] for r in rows]
        entries_ax.plot(x, [r["entries"] for r in rows], label=policy)
        hits_ax.plot(x, [r["hit_rate"] for r in rows], label=policy)
    kinds = [r for r in doc["rows"] if not r.get("final") and r["policy"] == doc["rows"][0]["policy"]]
    entries_ax.plot([r["requests"] for r in kinds], [r["kinds_seen"] for r in kinds], "k:", label="kinds seen")
    entries_ax.set(xlabel="requests", ylabel="entries"), hits_ax.set(xlabel="requests", ylabel="hit rate (per 1,000)")
    entries_ax.legend(), hits_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--kinds", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default="none,prune_25,budget_10,budget_25,budget_50")
    parser.add_argument("--url", default=None, help="a PostgreSQL bank URL instead of a temporary folder bank")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--merge-similarity", type=float, default=MERGE_THRESHOLDS[0])
    parser.add_argument("--merge-agreement", type=float, default=MERGE_THRESHOLDS[1])
    args = parser.parse_args(argv)
    command = "python tests/benchmarks/bench_bank_lifecycle.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows, unbounded = [], None
    for policy in args.policies.split(","):
        budget = None
        if policy.startswith(("prune_", "budget_")):
            if unbounded is None:
                raise SystemExit(f"{policy} needs 'none' run before it (its budget is a share of that size)")
            budget = max(1, int(unbounded * int(policy.split("_")[1]) / 100))
        with tempfile.TemporaryDirectory() as tmp:
            result = run_policy(policy, (args.requests, args.kinds, args.seed), args.url or str(Path(tmp) / policy),
                                budget, print, (args.merge_similarity, args.merge_agreement))
        rows += result["windows"] + [result["final"]]
        if policy == "none":
            unbounded = result["final"]["bytes"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    doc = {"benchmark": "bench_bank_lifecycle", "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": machine(), "command": command, "git_commit": commit,
           "backend": "postgresql" if args.url else "folder", "rows": rows}
    if "merge" in args.policies.split(","):
        doc["threshold_study"] = threshold_study((args.requests, args.kinds, args.seed))
    write_results(doc, Path(args.out))
    for row in rows:
        if row.get("final"):
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
