"""Where a bank hit loses quality: one request recorded, then served to itself, stage by stage.

    python -m tests.testbed.hit_stages --checkpoint FILE --out DIR [--preset sharp16k] [--set NAME=VALUE]
    python -m tests.testbed.hit_stages --tiny --out DIR        # CPU, random tiny model

For one request and seed (issue [hit-quality]):

(a) the recording run as shipped (an online-prediction miss recording its masks), with the exact
    block mass of every call of that run kept beside it; the documented rule (top-p with the
    density clamps, over the mean mass of each bucket's recorded steps) applied to that mass,
    against what the recorder selected, bit for bit;
(b) the recorder's selection against the entry decoded from the bank (codec and bank round trip);
(c) the entry served to the same request as a hit (the product path), and the same masks
    through a plain static provider: outputs against each other and against the dense run;
(d) masks from the same request's dense run, at the entry's density: the rule over the recorded
    steps only, and over every step of the bucket. The gap between (c) and (d) is what the
    recording costs.

Writes ``hit_stages.json`` / ``.md`` (one row per stage: bits differing, density, recall, PSNR).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from chorus_core.attention.mask_provider import MaskSource, bucket_index
from chorus_core.attention.masks import select_blocks
from chorus_core.testbed.workload import generate_request, i2v_conditioning
from .config import tokens_of
from .product_path import (RECORD_THRESHOLD, CountMatchedProvider, MassObserver, ProductPath, add_model_arguments,
                           final_quality, load_model)
from .report import eval_requests
from .sharpness import request_name


class TeeObserver(MaskSource):
    """Wraps a provider; also keeps the exact block mass of every call (the run's own attention)."""

    def __init__(self, inner, block_size: int):
        self.inner, self.block_size = inner, inner.block_size
        self.mass_observer = MassObserver(block_size)

    def step_bucket(self, step):
        return self.inner.step_bucket(step)

    def observes(self, step) -> bool:
        return True

    def observe(self, layer, step, cond_or_uncond, q, k, heads, skip_reshape) -> None:
        self.mass_observer.observe(layer, step, cond_or_uncond, q, k, heads, skip_reshape)
        self.inner.observe(layer, step, cond_or_uncond, q, k, heads, skip_reshape)

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device):
        return self.inner.block_map(layer, step, cond_or_uncond, num_heads, seq_len, device)

    def prepared_mask(self, layer, step, cond_or_uncond, num_heads, seq_len, batch, device):
        return self.inner.prepared_mask(layer, step, cond_or_uncond, num_heads, seq_len, batch, device)


PLANS = {  # recording variants compared (the first is what ships)
    "shipped": {},
    "first_and_middle_steps": {"steps_per_bucket": 2},
    "every_step_stride16": {"query_stride": 16},
    "every_step_exact": {"query_stride": 1},
}


def recording_run(pp: ProductPath, bank, conds, seed: int, plan):
    """A recording miss as shipped, with the exact mass of its own calls; returns (entry id, mass
    [S, L, H, nb, nb], the recorder's selection bool [B, L, H, nq, nk], the recorded steps per bucket)."""
    from chorus_core.reuse import bank_writer
    from chorus_core.attention.mask_sources import recorded_steps
    from chorus_core.reuse.reuse_run import ReusePatch

    tee, selection = {}, {}

    class TeePatch(ReusePatch):
        """The shipped patch, with the run's q/k mass teed off and the recorder's selection kept."""

        def begin_run(self, sampling, step_callbacks, dense_attention):
            run = super().begin_run(sampling, step_callbacks, dense_attention)
            tee["provider"] = run.provider = TeeObserver(run.provider, pp.bs)
            return run

        def end_run(self, succeeded):
            recorder = self.current.recording.recorder if succeeded else None
            if recorder is not None:
                original_finish = recorder.finish

                def keep_selection():
                    recorded = original_finish()
                    selection["maps"] = recorded.block_maps
                    return recorded

                recorder.finish = keep_selection
            super().end_run(succeeded)

    patch = TeePatch(pp.patcher, pp.match(bank, conds, RECORD_THRESHOLD), pp.options, block_size=pp.bs,
                     scheduler="simple", recording_plan=plan)
    pp.sample(patch.install(), conds, seed)
    run, report = patch.last_run, patch.last_report
    if report.recording != "queued":
        raise RuntimeError(f"the recording run did not record: {report.recording}, {report.warnings}")
    if not bank_writer.flush_all(timeout=300):
        raise RuntimeError("the bank writer did not finish within 300 s")
    mass = tee["provider"].mass_observer.stacked(pp.steps, pp.L)
    return report.recorded_entry_id, mass, selection["maps"], recorded_steps(run.schedule.step_buckets,
                                                                               plan.steps_per_bucket)


def rule_maps(mass: torch.Tensor, steps_per_bucket, options) -> torch.Tensor:
    """The documented rule: top-p (with clamps) over each bucket's mean mass -> bool [B, L, H, nq, nk].

    The mean is summed step by step in float32 and then divided, as the recorder sums on a CPU, so
    on a CPU the two agree bit for bit (a mean in another order can flip a block at the top-p edge).
    """
    out = []
    for steps in steps_per_bucket:
        total = mass[steps[0]].clone()
        for step in steps[1:]:
            total += mass[step]
        out.append(select_blocks(total / len(steps), options.top_p, options.min_density, options.max_density))
    return torch.stack(out)


def differing(a: torch.Tensor, b: torch.Tensor) -> dict:
    diff = a.bool() ^ b.bool()
    per_bucket_layer = diff.flatten(2).sum(-1)
    return {"bits_differing": int(diff.sum()), "bits": diff.numel(),
            "per_bucket_layer": per_bucket_layer.tolist()}


def as_step_maps(pp: ProductPath, entry_like: torch.Tensor, starts) -> dict:
    """bool [B, L, H, nq, nk] per bucket -> the harness's (step, layer) maps over the sparse steps."""
    return {(s, l): entry_like[bucket_index(starts, s), l] for s in range(pp.warmup, pp.steps) for l in range(pp.L)}


def decoded_entry(pp: ProductPath, bank, entry_id: str):
    """The entry as the bank gives it back: (bool [B, L, H, nq, nk], its schedule)."""
    entry = bank.load_masks(entry_id, record_hit=False)
    maps = torch.stack([torch.stack([entry.block_map(b, l).bool() for l in range(pp.L)])
                        for b in range(len(entry.step_buckets))])
    return maps, entry.schedule


def run_stages(patcher, config, workdir: Path, seed: int = 0, request_index: int = 0, plans=None, log=print) -> dict:
    from chorus_core.bank import MaskBank
    from chorus_core.attention.mask_sources import RecordingPlan
    from chorus_core.reuse.entry_source import scaled_bucket_starts

    plans = PLANS if plans is None else plans
    pp = ProductPath(patcher, config, workdir)
    size = config.long_size
    seq_len = tokens_of(size)
    _, similar, _, _ = eval_requests(config, size)
    request = similar[request_index]
    conds = i2v_conditioning(generate_request(request))
    dense_final, dense_mass = pp.dense(conds, seed)
    o = pp.options
    rows = []
    shipped = None
    for name, fields in plans.items():
        bank = MaskBank.open(Path(workdir) / f"bank-{name}")
        entry_id, rec_mass, recorder_maps, steps_per_bucket = recording_run(pp, bank, conds, seed,
                                                                            RecordingPlan(**fields))
        decoded, schedule = decoded_entry(pp, bank, entry_id)
        hit_final, report = pp.reuse_run(pp.match(bank, conds, pp.threshold), conds, seed)
        bank.close()
        if report.mode != "hit":
            raise RuntimeError(f"the request did not hit its own entry: {report.mode}, {report.warnings}")
        if shipped is None:
            shipped = (entry_id, rec_mass, recorder_maps, steps_per_bucket, decoded, schedule, hit_final)
        else:
            starts = scaled_bucket_starts(schedule, pp.steps)
            r = {"stage": f"c_hit_recorded_{name}", "N": seq_len, "seed": seed, "request": request_name(request),
                 "density": float(decoded.float().mean()),
                 "recall": pp.recall(dense_mass, as_step_maps(pp, decoded, starts), seq_len),
                 "recorded_steps": [list(x) for x in steps_per_bucket], **final_quality(dense_final, hit_final)}
            rows.append(r)
            log(f"{r['stage']}: psnr {r['psnr_db']:.2f}, density {r['density']:.4f}")
    entry_id, rec_mass, recorder_maps, steps_per_bucket, decoded, schedule, hit_final = shipped
    starts = scaled_bucket_starts(schedule, pp.steps)
    bucket_ranges = [range(a, b) for a, b in schedule.step_buckets]

    def row(stage, maps_by_bucket, final=None, against=None):
        step_maps = as_step_maps(pp, maps_by_bucket, starts)
        r = {"stage": stage, "N": seq_len, "seed": seed, "request": request_name(request),
             "density": float(maps_by_bucket.float().mean()), "recall": pp.recall(dense_mass, step_maps, seq_len)}
        if against is not None:
            r.update(differing(maps_by_bucket, against))
        if final is not None:
            r.update(final_quality(dense_final, final))
        rows.append(r)
        log(f"{stage}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                     for k, v in r.items() if k not in ("per_bucket_layer", "request")))
        return r

    rule_rec = rule_maps(rec_mass, steps_per_bucket, o)
    row("a_rule_on_recording_run_mass", rule_rec, against=recorder_maps)
    row("b_decoded_entry_vs_recorder", decoded, against=recorder_maps)
    row("c_hit_product_path", decoded, hit_final)
    static_maps = as_step_maps(pp, decoded, starts)
    static = pp.with_provider(pp.static_provider(static_maps), conds, seed)
    row("c_static_provider_same_masks", decoded, static)
    rows[-1]["max_abs_vs_hit"] = float((static - hit_final).abs().max())
    rule_dense_rec = rule_maps(dense_mass, steps_per_bucket, o)
    row("d_rule_dense_mass_recorded_steps", rule_dense_rec,
        pp.with_provider(pp.static_provider(as_step_maps(pp, rule_dense_rec, starts)), conds, seed), decoded)
    rule_dense_all = rule_maps(dense_mass, [list(r) for r in bucket_ranges], o)
    row("d_rule_dense_mass_all_bucket_steps", rule_dense_all,
        pp.with_provider(pp.static_provider(as_step_maps(pp, rule_dense_all, starts)), conds, seed), decoded)
    counts = {(s, l): decoded[bucket_index(starts, s), l].sum(-1)
              for s in range(pp.warmup, pp.steps) for l in range(pp.L)}
    scores = {k: dense_mass[list(bucket_ranges[bucket_index(starts, k[0])])].mean(0)[k[1]] for k in counts}
    matched = CountMatchedProvider(pp.bs, lambda s, l: counts[(s, l)], lambda s, l: scores[(s, l)])
    final = pp.with_provider(matched, conds, seed)
    maps = torch.stack([torch.stack([matched.maps[(starts[b] if starts[b] >= pp.warmup else pp.warmup, l)]
                                     for l in range(pp.L)]) for b in range(len(starts))])
    row("d_count_matched_dense_mass", maps, final, decoded)
    rows.sort(key=lambda r: r["stage"])
    return {"rows": rows, "entry_id": entry_id, "steps_per_bucket": [list(s) for s in steps_per_bucket],
            "bucket_ranges": [[r.start, r.stop] for r in bucket_ranges], "N": seq_len,
            "options": {"top_p": o.top_p, "min_density": o.min_density, "max_density": o.max_density}}


def markdown(doc: dict) -> str:
    cols = ("stage", "request", "density", "recall", "bits_differing", "rel_rms", "psnr_db", "max_abs_vs_hit")
    lines = [f"# A recorded request served to itself, stage by stage ({doc['N']:,} tokens)", "",
             f"Command: `{doc['command']}`", "", f"recorded steps per bucket {doc['steps_per_bucket']}, "
             f"bucket ranges {doc['bucket_ranges']}, options {doc['options']}", "",
             "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in doc["rows"]:
        cells = [f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    add_model_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", default="0", help="indices into the report's similar requests, e.g. 0,3")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="chorus-hit-stages-") as tmp:
        patcher, config = load_model(args, Path(tmp))
        docs = [run_stages(patcher, config, Path(tmp) / f"r{i}", args.seed, int(i)) for i in args.requests.split(",")]
    doc = {**docs[0], "rows": [r for d in docs for r in d["rows"]], "entry_id": [d["entry_id"] for d in docs]}
    doc["command"] = "python -m tests.testbed.hit_stages " + " ".join(argv or sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hit_stages.json").write_text(json.dumps(doc, indent=1))
    (args.out / "hit_stages.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
