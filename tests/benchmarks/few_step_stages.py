"""Staged dense generations for ``bench_few_step``: a dense run longer than one device call
(720p, 40 steps, cfg 5: about 800 s against a 600 s call) is timed as the two stages of a
KSamplerAdvanced split, one call each on one machine, and the stages are joined at merge.

The second stage starts from the first stage's output latent with no new noise, as
KSamplerAdvanced's ``add_noise: disable`` does; the first returns with its leftover noise. Each
stage is a whole sampling call of the 40-block model (its own model load, its own first step),
so the joined time is what a user who splits the run would wait, a little over an unsplit run.
"""

from __future__ import annotations

from pathlib import Path


def parse_stage(text: str, steps: list[int]) -> tuple[int, int] | None:
    """``A:B`` -> (A, B): steps A..B-1 of the schedule, or None when that is the whole schedule (a
    whole run, so every stage kept is a part); refused with what to do when it cannot run."""
    if len(steps) != 1:
        raise SystemExit("--stage needs exactly one --steps value (the schedule it is a stage of)")
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise SystemExit(f"--stage {text!r}: write it as START:END, e.g. 0:20 then 20:40") from None
    if not 0 <= start < end <= steps[0]:
        raise SystemExit(f"--stage {text}: needs 0 <= START < END <= {steps[0]} (the --steps value)")
    return None if (start, end) == (0, steps[0]) else (start, end)


def staged_sampling(stage: tuple[int, int], steps: int, latent_dir: Path, label: str, latent, noise):
    """(latent, noise, comfy.sample.sample keyword arguments) for one stage of ``label``'s run."""
    import torch

    start, end = stage
    kwargs = dict(start_step=start, last_step=end, force_full_denoise=end == steps, disable_noise=start > 0)
    if start == 0:
        return latent, noise, kwargs
    path = latent_dir / f"{label}.pt"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: run --stage 0:{start} of {label} first on this machine, "
                           "with the same --stage-latent folder")
    carried = torch.load(path, map_location="cpu", weights_only=True)
    return carried, torch.zeros_like(carried), kwargs


def keep_stage_output(stage: tuple[int, int], steps: int, latent_dir: Path, label: str, out) -> None:
    """The latent the next stage of ``label`` starts from (nothing after the last stage)."""
    import torch

    if stage[1] < steps:
        latent_dir.mkdir(parents=True, exist_ok=True)
        torch.save(out.detach().cpu(), latent_dir / f"{label}.pt")


def is_partial(m: dict) -> bool:
    """One stage of a split run (``parse_stage`` keeps no stage for a whole one)."""
    return m.get("stage") is not None


def join_stages(parts: list[dict], steps: int):
    """One measurement from stage measurements that cover steps 0..steps-1 in order, or a string
    that says what is missing. Times add up; each stage's first step keeps its own model load."""
    parts = sorted(parts, key=lambda m: m["stage"][0])
    edge = 0
    for m in parts:
        if m["stage"][0] != edge:
            return f"stages {[tuple(p['stage']) for p in parts]} leave steps {edge}..{m['stage'][0] - 1} untimed"
        edge = m["stage"][1]
    if edge != steps:
        return f"stages {[tuple(p['stage']) for p in parts]} stop at step {edge} of {steps}"
    joined = dict(parts[0])
    joined.update(generation_s=round(sum(m["generation_s"] for m in parts), 3),
                  step_ms=[s for m in parts for s in m["step_ms"]],
                  model_load_s=round(sum(m.get("model_load_s") or 0.0 for m in parts), 3),
                  graphs=sum(m.get("graphs") or 0 for m in parts), finite=all(m.get("finite", True) for m in parts),
                  stage=None, stages=[dict(stage=m["stage"], run=m.get("run"), generation_s=m["generation_s"],
                                           compile_s=m.get("compile_s")) for m in parts])
    return joined
