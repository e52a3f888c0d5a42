"""Staged dense generations for ``bench_few_step``: a dense run longer than one device call
(720p, 40 steps, cfg 5: about 800 s against a 600 s call) is timed as the stages of a
KSamplerAdvanced split, one device call each, and the stages are joined at merge.

The second stage starts from the first stage's output latent with no new noise, as
KSamplerAdvanced's ``add_noise: disable`` does; the first returns with its leftover noise. Each
stage is a whole sampling call of the 40-block model (its own model load, its own first step),
so the joined time is what a user who splits the run would wait, a little over an unsplit run.
The latent passes between stages as files (``--stage-latent``), so the stages may run on
different machines of one kind, in different sessions.
"""

from __future__ import annotations

import re
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


# The device returns files of up to 16 MiB and a 720p latent is about 19 MB (float32), so a stage's
# latent is kept in parts under that: written to the call's $OUT, it comes back and can be carried
# to a later session's machine, so the stages of one run need not share a machine.
PART_BYTES = 15 * 2**20


def staged_sampling(stage: tuple[int, int], steps: int, latent_dir: Path, label: str, latent, noise):
    """(latent, noise, comfy.sample.sample keyword arguments) for one stage of ``label``'s run."""
    import torch

    start, end = stage
    kwargs = dict(start_step=start, last_step=end, force_full_denoise=end == steps, disable_noise=start > 0)
    if start == 0:
        return latent, noise, kwargs
    carried = load_stage_latent(latent_dir, label, steps, start)
    if carried.shape != latent.shape:
        raise RuntimeError(f"the latent {label}'s stage 0:{start} left is {list(carried.shape)}, this run's is "
                           f"{list(latent.shape)} (another --shape): run --stage 0:{start} at this shape")
    return carried, torch.zeros_like(carried), kwargs


def keep_stage_output(stage: tuple[int, int], steps: int, latent_dir: Path, label: str, out,
                      part_bytes: int = PART_BYTES) -> None:
    """The latent the next stage of ``label`` starts from (nothing after the last stage), in parts of
    at most ``part_bytes``, each naming the run and the step it ends at."""
    from safetensors.torch import save_file

    if stage[1] >= steps:
        return
    stem = stage_stem(label, steps, stage[1])
    latent_dir.mkdir(parents=True, exist_ok=True)
    for old in latent_dir.glob(f"{stem}_part*"):
        old.unlink()  # a shorter re-run must not leave a longer run's tail behind
    flat = out.detach().cpu().contiguous().reshape(-1)
    chunks = flat.split(max(1, part_bytes // flat.element_size()))
    shape = ",".join(str(n) for n in out.shape)
    for i, chunk in enumerate(chunks):
        meta = dict(label=label, steps=str(steps), end=str(stage[1]), part=str(i), parts=str(len(chunks)), shape=shape)
        # clone: safetensors refuses tensors that share storage, as the split's views do
        save_file({"latent": chunk.clone()}, str(latent_dir / f"{stem}_part{i}.safetensors"), metadata=meta)


def load_stage_latent(latent_dir: Path, label: str, steps: int, start: int):
    """The latent an earlier stage of ``label``'s ``steps``-step run left at step ``start``, from
    its parts; refused, with what to do, when a part is missing or belongs to another run."""
    import torch
    from safetensors import safe_open

    stem = stage_stem(label, steps, start)
    numbered = (re.fullmatch(rf"{re.escape(stem)}_part(\d+)\.safetensors", p.name) for p in latent_dir.glob("*"))
    paths = [latent_dir / m.group(0) for m in sorted(filter(None, numbered), key=lambda m: int(m.group(1)))]
    if not paths:
        raise RuntimeError(f"{latent_dir}/{stem}_part*.safetensors is missing: run --stage 0:{start} of {label} "
                           "first with the same --stage-latent folder (on this machine, or carry that folder here)")
    chunks = []
    for i, path in enumerate(paths):
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("parts") != str(len(paths)):
                raise RuntimeError(f"{stem}: {len(paths)} parts are here, {path.name} says {meta.get('parts')}: "
                                   f"carry every part of the folder, or run --stage 0:{start} again")
            want = dict(label=label, steps=str(steps), end=str(start), part=str(i))
            if any(meta.get(k) != v for k, v in want.items()):
                raise RuntimeError(f"{path}: its metadata {meta} is not part {i} of {len(paths)} of {label}'s "
                                   f"{steps}-step run at step {start}: run --stage 0:{start} again")
            chunks.append(f.get_tensor("latent"))
    shape = [int(n) for n in meta["shape"].split(",")]  # checked against the parts' values below
    flat = torch.cat(chunks)
    if flat.numel() != torch.Size(shape).numel():
        raise RuntimeError(f"{stem}: its parts hold {flat.numel()} values, not {shape}: run --stage 0:{start} again")
    return flat.reshape(shape)


def steps_run(stage: tuple[int, int] | None, steps: int) -> int:
    """How many steps a sampling call runs: the stage's, or the whole schedule's."""
    return steps if stage is None else stage[1] - stage[0]


def check_stage_latents(latent_dir: Path, labels: list[str], steps: int, start: int) -> None:
    """Refuse a later stage whose starting latent is missing or wrong before anything is built: on
    the device the model build, the compile and the warm-up come first and take minutes of a call."""
    for label in labels:
        try:
            load_stage_latent(latent_dir, label, steps, start)
        except RuntimeError as exc:
            raise SystemExit(f"this stage starts at step {start}: {exc}") from None


def stage_stem(label: str, steps: int, end: int) -> str:
    """A file name the device returns (letters, digits, '_' and '.' only)."""
    return f"{label}_steps{steps}_at{end}"


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


def first_of_each_stage(parts: list[dict]) -> tuple[list[dict], list[dict]]:
    """The first measurement of each stage, and those that timed a stage again (a merge keeps
    them as repeats, as it keeps a whole run timed twice: the first file wins)."""
    seen, firsts, again = set(), [], []
    for m in parts:
        (again if tuple(m["stage"]) in seen else firsts).append(m)
        seen.add(tuple(m["stage"]))
    return firsts, again


def timed_floor_s(parts: list[dict]) -> float:
    """The least time a run still in stages can take: the largest sum of timed stages that share
    no step (two stages that overlap would count their shared steps twice)."""
    best = {0: 0.0}  # a stage's end -> the largest sum of stages that end by it
    for m in sorted(parts, key=lambda m: m["stage"][1]):
        start, end = m["stage"]
        before = max(v for e, v in best.items() if e <= start)
        best[end] = max(max(best.values()), before + m["generation_s"])
    return round(max(best.values()), 3)
