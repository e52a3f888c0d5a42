"""Train the testbed model: ComfyUI's WanModel (I2V) with Wan's flow-matching objective.

    python -m tests.testbed.train --out DIR [--preset full|smoke|sharp16k|...] [--set name=value ...]
    python -m tests.testbed.train --resume DIR/train_state.pt --time-budget-s 480 --out DIR

Each run is one chunk: at its end it writes the resumable state ``DIR/train_state.pt`` (model,
optimizer, step, RNGs, loss log) and a resumed chunk continues exactly (same batches, noise and
schedule as one longer run).

Writes ``DIR/chorus_testbed_wan21_i2v.safetensors`` (fp16, unprefixed keys: UNETLoader loads
it and ComfyUI detects WAN21_I2V), ``DIR/train_config.json`` (config, loss log, timing) and
``DIR/loss_curve.png`` (when matplotlib is there).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from chorus_core.testbed.workload import I2VRequest
from .config import PRESETS, TestbedConfig, config_from_dict, config_with_overrides, make_config, size_name, tokens_of
from .attention_entropy import with_entropy_penalty
from .models import SDPAAttention, build_model, flow_loss, is_qk_gain, make_batch
from .validation import ValidationSet

CHECKPOINT_NAME = "chorus_testbed_wan21_i2v.safetensors"


def training_requests(config: TestbedConfig, size) -> list[I2VRequest]:
    frames, height, width = size
    return [I2VRequest(template, subject, layout, frames, height, width, texture=config.texture)
            for template in config.train_templates
            for layout in range(config.train_layouts)
            for subject in range(config.train_subjects)]


def lr_at(config: TestbedConfig, step: int) -> float:
    total = max(1, min(config.expected_steps, config.max_steps))
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, total - config.warmup_steps))
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


def long_share_at(config: TestbedConfig, step: int) -> float:
    """Share of long batches at ``step``: ``long_share``, or a linear ramp up to it (curriculum)."""
    if config.curriculum_steps <= 0:
        return config.long_share
    return config.long_share * min(1.0, step / config.curriculum_steps)


# The fp32 math-attention reference of the gradient check keeps every attention matrix for the
# backward pass; this many scores (sharp16k's: batch 2 x 3 heads x 6 layers at 16,384 tokens)
# fitted the H200. Larger designs are checked on the short pool (same attention path and head width).
GRADIENT_CHECK_MAX_SCORES = 2 * 3 * 6 * 16384**2


def _gradient_check_pool(pools: dict, config: TestbedConfig):
    scores = 2 * config.num_heads * config.num_layers * tokens_of(config.long_size) ** 2
    return pools["long"] if "long" in pools and scores <= GRADIENT_CHECK_MAX_SCORES else pools["short"]


def _grads(model, batch, config, options, autocast, device):
    model.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(config.seed + 99)
    with torch.autocast(device_type="cuda" if device != "cpu" else "cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = flow_loss(model, batch, config.shift, gen, options)
    loss.backward()
    grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def gradient_check(model, batch, config, device, log=print) -> dict:
    """Cosine of each candidate attention path's gradient with an fp32 math-attention reference.

    Returns ``{"choice": name, "options": transformer_options, "cosines": {...}}``; the first
    candidate (in preference order) with cosine >= 0.9 is chosen, else the reference path.
    """
    autocast = config.autocast_bf16 and device != "cpu"
    reference = {"optimized_attention_override": SDPAAttention(("MATH",))}
    _, ref = _grads(model, batch, config, reference, False, device)
    candidates = {"sdpa_flash_efficient_bf16": {"optimized_attention_override": SDPAAttention()},
                  "comfyui_default_bf16": {}}
    cosines, choice = {}, None
    for name, options in candidates.items():
        loss, g = _grads(model, batch, config, options, autocast, device)
        cosines[name] = float(torch.nn.functional.cosine_similarity(g, ref, dim=0))
        log(f"gradient check: {name} cosine {cosines[name]:.4f} (loss {loss:.4f})")
        if choice is None and cosines[name] >= 0.9:
            choice = name
    if choice is None:
        log("gradient check: no fast path agrees with the reference; training in fp32 math attention")
        return {"choice": "math_fp32", "options": reference, "autocast": False, "cosines": cosines}
    return {"choice": choice, "options": candidates[choice], "autocast": autocast, "cosines": cosines}


STATE_NAME = "train_state.pt"


def _optimizer(model, config: TestbedConfig):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 and not (config.qk_gain_lr_mult != 1.0 and is_qk_gain(n))]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if config.qk_gain_lr_mult != 1.0:  # a third group only then, so older optimizer states still load
        gains = [p for n, p in model.named_parameters() if is_qk_gain(n)]
        groups.append({"params": gains, "weight_decay": 0.0, "lr_mult": config.qk_gain_lr_mult})
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.99))


def train(config: TestbedConfig, device: str = "cpu", log=print, model=None, resume: dict = None,
          stop_after_steps: int = None, on_checkpoint=None, checkpoint_every: int = 0) -> dict:
    """Train in place; returns ``{"model", "log": [...], "steps", "seconds", "state", ...}``.

    ``resume``: a state from ``load_state`` (model, optimizer, step, RNGs, log): training goes on
    exactly where that chunk stopped. ``stop_after_steps``: end this chunk after that many steps
    (the schedule still runs to ``config.max_steps``). ``result["state"]`` is what the next chunk resumes.
    ``on_checkpoint(step, model)``: called (model in eval mode) every ``checkpoint_every`` steps; its
    time counts neither against ``config.time_budget_s`` nor in ``result["seconds"]``.
    """
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    t0 = time.time()
    pools = {}
    for name, size in (("short", config.short_size), ("long", config.long_size)):
        if name == "long" and config.long_share <= 0:
            continue
        pools[name] = make_batch(training_requests(config, size), workers=config.data_workers).to(device)
    validation = ValidationSet(config, device, config.data_workers) if config.val_every > 0 else None
    data_s = time.time() - t0
    log(f"data: {', '.join(f'{k} {len(v)} x {tuple(v.x0.shape[1:])}' for k, v in pools.items())} in {data_s:.1f}s")

    model = model if model is not None else build_model(config)
    model.to(device).train()
    opt = _optimizer(model, config)
    history, step, trained_s, chunks, val_log = [], 0, 0.0, [], []
    if resume is not None:
        chunks, val_log = list(resume.get("chunks", [])), list(resume.get("val_log", []))
        model.load_state_dict(resume["model"])
        step, history, trained_s = resume["step"], list(resume["log"]), resume.get("train_seconds", 0.0)
        if resume.get("optimizer") is not None:  # an exact resume
            opt.load_state_dict(resume["optimizer"])
            rng.setstate(resume["rng"]["python"])
            gen.set_state(resume["rng"]["generator"])
            torch.set_rng_state(resume["rng"]["torch"])
        else:  # weights only (init_state_from_weights): fresh moments, new batches from a step-dependent seed
            rng.seed(config.seed + step)
            gen.manual_seed(config.seed + step)
        check = resume["attention"]
        check["options"] = _attention_options(check["choice"])
        log(f"resumed at step {step} ({check['choice']} attention)")
    else:
        check_pool = _gradient_check_pool(pools, config)
        check = gradient_check(model, check_pool.select(torch.arange(min(2, len(check_pool)), device=check_pool.x0.device)),
                               config, device, log)
    options, autocast = check["options"], check["autocast"]
    validate = _validate(validation, val_log, options, autocast, log) if validation is not None else None
    penalty = None
    if config.attn_entropy_weight > 0:
        options, penalty = with_entropy_penalty(options, config.attn_entropy_queries, gen)
    start, first_step, paused = time.time(), step, 0.0
    chunk_end = config.max_steps if stop_after_steps is None else min(config.max_steps, step + stop_after_steps)
    while step < chunk_end and time.time() - start - paused < config.time_budget_s:
        which = "long" if ("long" in pools and rng.random() < long_share_at(config, step)) else "short"
        pool = pools[which]
        bsz = config.batch_long if which == "long" else config.batch_short
        idx = torch.randint(len(pool), (bsz,), generator=gen)
        batch = pool.select(idx.to(pool.x0.device))
        for group in opt.param_groups:
            group["lr"] = lr_at(config, step) * group.get("lr_mult", 1.0)
        with torch.autocast(device_type="cuda" if device != "cpu" else "cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = flow_loss(model, batch, config.shift, gen, options)
            entropy = penalty.take() if penalty is not None else None
        opt.zero_grad(set_to_none=True)
        (loss if entropy is None else loss + config.attn_entropy_weight * entropy).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        opt.step()
        step += 1
        if step % config.log_every == 0 or step == 1:
            value = float(loss.detach())
            if not math.isfinite(value):
                raise FloatingPointError(f"loss became {value} at step {step}")
            history.append({"step": step, "size": which, "loss": value, "grad_norm": float(grad_norm),
                            "lr": lr_at(config, step - 1), "seconds": round(trained_s + time.time() - start - paused, 2)})
            if entropy is not None:  # the logged loss stays the flow loss alone, comparable across designs
                history[-1]["attn_entropy"] = round(float(entropy.detach()), 4)
            log(f"step {step:5d} {which:5s} loss {value:.4f} grad {float(grad_norm):.3f} t {time.time() - start - paused:.0f}s")
        if on_checkpoint is not None and checkpoint_every > 0 and step % checkpoint_every == 0:
            paused += _paused_call(on_checkpoint, step, model, device)
        if validate is not None and step % config.val_every == 0:
            paused += _paused_call(validate, step, model, device)
    if validate is not None and (not val_log or val_log[-1]["step"] != step):
        paused += _paused_call(validate, step, model, device)
    if device != "cpu":
        torch.cuda.synchronize()
    model.eval()
    seconds = time.time() - start - paused
    attention = {"choice": check["choice"], "cosines": check["cosines"], "autocast": autocast}
    state = {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
             "optimizer": opt.state_dict(), "step": step, "log": history, "train_seconds": trained_s + seconds,
             "rng": {"python": rng.getstate(), "generator": gen.get_state(), "torch": torch.get_rng_state()},
             "attention": attention, "config": asdict(config), "val_log": val_log,
             "chunks": chunks + [{"start_step": first_step, "end_step": step, "seconds": round(seconds, 1),
                                  "data_seconds": round(data_s, 1)}]}
    return {"model": model, "log": history, "steps": step, "seconds": seconds, "data_seconds": data_s,
            "attention": {"choice": check["choice"], "cosines": check["cosines"], "autocast_bf16": autocast},
            "state": state, "total_train_seconds": trained_s + seconds, "val_log": val_log}


def _validate(validation: ValidationSet, val_log: list, options: dict, autocast: bool, log):
    """An on_checkpoint callback: the held-out loss at this step, appended to ``val_log``."""
    def measure(step: int, model) -> None:
        value = validation.loss(model, options, autocast)
        val_log.append({"step": step, "val_loss": round(value, 6)})
        log(f"step {step:5d} held-out loss {value:.4f} ({len(validation)} clips of unseen subjects)")
    return measure


def _paused_call(on_checkpoint, step: int, model, device: str) -> float:
    """Run ``on_checkpoint(step, model)`` with the model in eval mode; the seconds it took (queued
    training work is finished first, so it is not counted as the checkpoint's)."""
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.time()
    model.eval()
    on_checkpoint(step, model)
    model.train()
    return time.time() - t0


def _attention_options(choice: str) -> dict:
    """The transformer_options of a gradient-check choice (a resumed chunk reuses the first chunk's)."""
    if choice == "math_fp32":
        return {"optimized_attention_override": SDPAAttention(("MATH",))}
    if choice == "sdpa_flash_efficient_bf16":
        return {"optimized_attention_override": SDPAAttention()}
    return {}


def save_state(state: dict, path: Path) -> Path:
    """Write a resumable training state (model, optimizer, step, RNGs, loss log, config); atomic."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    return path


def init_state_from_weights(folder: Path) -> dict:
    """A weights-only resume state from what came back from the device (``--parts-out``: checkpoint
    parts or the joined file, and train_config.json), for when the machine holding ``train_state.pt``
    is gone: the fp16 weights, the step, the loss log and the config; fresh AdamW moments and
    fresh batch order, so it is not the exact continuation an ``--resume`` is."""
    from safetensors.torch import load_file

    folder = Path(folder)
    info_path = folder / "train_config.json"
    if not info_path.is_file():
        raise SystemExit(f"--init-from {folder}: no train_config.json there (pass the folder --parts-out wrote)")
    info = json.loads(info_path.read_text())
    single = folder / CHECKPOINT_NAME
    if not single.is_file():
        single = join_checkpoint_parts(folder, folder / CHECKPOINT_NAME)
    attention = info.get("training_attention") or {}
    return {"model": {k: v.float() for k, v in load_file(str(single)).items()}, "optimizer": None,
            "step": info["steps"], "log": info["log"], "train_seconds": info.get("total_train_seconds", 0.0),
            "val_log": info.get("val_log", []),
            "chunks": info.get("chunks", []), "config": info["config"],
            "attention": {"choice": attention.get("choice", "sdpa_flash_efficient_bf16"),
                          "cosines": attention.get("cosines", {}), "autocast": attention.get("autocast_bf16", True)}}


def load_state(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"--resume {path}: no such training state; pass the {STATE_NAME} a previous chunk wrote")
    return torch.load(path, map_location="cpu", weights_only=False)


def save_checkpoint(model, path: Path, config: TestbedConfig, dtype=torch.float16) -> Path:
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"architecture": "wan2.1-i2v-chorus-testbed", "dim": str(config.dim),
                "ffn_dim": str(config.ffn_dim), "num_layers": str(config.num_layers)}
    save_file(state, str(path), metadata=metadata)
    return path


PART_BYTES = 15 * 2**20  # the device returns files of at most 16 MiB: the fp16 checkpoint comes back in parts


def save_checkpoint_parts(model, out: Path, config: TestbedConfig, max_bytes: int = PART_BYTES) -> list:
    """The fp16 checkpoint as ``NAME.partK-of-N.safetensors`` files of at most ``max_bytes`` of tensors each
    (keys in state-dict order); ``join_checkpoint_parts`` rebuilds the single file UNETLoader loads."""
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in model.state_dict().items()}
    groups, current, size = [], {}, 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_bytes:
            groups.append(current)
            current, size = {}, 0
        current[key] = tensor
        size += nbytes
    groups.append(current)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = CHECKPOINT_NAME.removesuffix(".safetensors")
    paths = []
    for i, group in enumerate(groups):
        path = out / f"{stem}.part{i + 1}-of-{len(groups)}.safetensors"
        save_file(group, str(path), metadata={"architecture": "wan2.1-i2v-chorus-testbed", "dim": str(config.dim),
                                              "ffn_dim": str(config.ffn_dim), "num_layers": str(config.num_layers)})
        paths.append(path)
    return paths


def join_checkpoint_parts(folder: Path, out_path: Path) -> Path:
    """Join ``save_checkpoint_parts``' files in ``folder`` into one safetensors file (all parts must be there)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    stem = CHECKPOINT_NAME.removesuffix(".safetensors")
    parts = sorted(Path(folder).glob(f"{stem}.part*-of-*.safetensors"), key=lambda p: int(p.name.split(".part")[1].split("-")[0]))
    if not parts:
        raise SystemExit(f"no {stem}.partK-of-N.safetensors files in {folder}")
    expected = int(parts[0].name.split("-of-")[1].split(".")[0])
    if len(parts) != expected:
        raise SystemExit(f"{folder} holds {len(parts)} of the {expected} checkpoint parts; fetch them all")
    state, metadata = {}, None
    for part in parts:
        with safe_open(str(part), framework="pt") as f:
            metadata = metadata or f.metadata()
            state.update({k: f.get_tensor(k) for k in f.keys()})
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_path), metadata=metadata)
    return Path(out_path)


def load_checkpoint(path: Path, config: TestbedConfig, device="cpu") -> torch.nn.Module:
    from safetensors.torch import load_file

    model = build_model(config)
    model.load_state_dict({k: v.float() for k, v in load_file(str(path)).items()})
    return model.to(device).eval()


def smoothed(values, window=10):
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot_loss(history: list, path: Path, val_log: list = ()) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for size in ("short", "long"):
        rows = [h for h in history if h["size"] == size]
        if rows:
            ax.plot([h["step"] for h in rows], [h["loss"] for h in rows], ".", alpha=0.3, label=f"{size} (raw)")
            ax.plot([h["step"] for h in rows], smoothed([h["loss"] for h in rows]), "-", label=f"{size} (mean of 10)")
    if val_log:
        ax.plot([v["step"] for v in val_log], [v["val_loss"] for v in val_log], "o-", color="black",
                label="held-out subjects (long)")
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching loss (velocity MSE)")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(result: dict, config: TestbedConfig, out: Path, device: str, command: str, parts_out: Path = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(result["model"], out / CHECKPOINT_NAME, config)
    if result.get("state") is not None:
        save_state(result["state"], out / STATE_NAME)
    machine = torch.cuda.get_device_name() if device != "cpu" else "cpu"
    info = {"config": asdict(config), "steps": result["steps"], "train_seconds": round(result["seconds"], 1),
            "total_train_seconds": round(result.get("total_train_seconds", result["seconds"]), 1),
            "data_seconds": round(result["data_seconds"], 1), "training_attention": result.get("attention"), "machine": machine, "command": command,
            "sizes": {"short": {"latent": list(config.short_size), "tokens": tokens_of(config.short_size),
                                "name": size_name(config.short_size)},
                      "long": {"latent": list(config.long_size), "tokens": tokens_of(config.long_size),
                               "name": size_name(config.long_size)}},
            "objective": "flow matching: x_t = (1-t) x0 + t noise, t = shift*u/(1+(shift-1)*u), u~U(0,1); "
                         "target noise - x0; timestep 1000 t; inputs [x_t, 1-concat_mask (4), process_in(concat latent) (16)]",
            "chunks": (result.get("state") or {}).get("chunks", []), "log": result["log"],
            "val_log": result.get("val_log", [])}
    (out / "train_config.json").write_text(json.dumps(info, indent=1))
    plot_loss(result["log"], out / "loss_curve.png", info["val_log"])
    if parts_out is not None:  # what comes back from the device: parts, config, curve (the state stays there)
        save_checkpoint_parts(result["model"], parts_out, config)
        for name in ("train_config.json", "loss_curve.png"):
            if (out / name).exists() and Path(parts_out).resolve() != out.resolve():
                (Path(parts_out) / name).write_bytes((out / name).read_bytes())
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="full", choices=sorted(PRESETS))
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--resume", type=Path, help=f"a {STATE_NAME} from an earlier chunk: go on from there "
                        "(its config is used; --preset is ignored, --set still applies)")
    parser.add_argument("--init-from", type=Path, metavar="DIR", help="weights-only resume from a --parts-out folder "
                        "(when train_state.pt is lost with its machine): fresh optimizer moments, not exact")
    parser.add_argument("--time-budget-s", type=float, help="wall-clock seconds of training in this chunk")
    parser.add_argument("--chunk-steps", type=int, help="end this chunk after this many steps")
    parser.add_argument("--parts-out", type=Path, help="also write the fp16 checkpoint in parts of at most 15 MiB, "
                        "with train_config.json and loss_curve.png, here (the device's $OUT)")
    parser.add_argument("--join-parts", type=Path, metavar="DIR", help="only join the checkpoint parts in DIR into "
                        f"--out/{CHECKPOINT_NAME} (no training)")
    args = parser.parse_args(argv)
    if args.join_parts:
        path = join_checkpoint_parts(args.join_parts, args.out / CHECKPOINT_NAME)
        print(f"joined -> {path}")
        return 0
    from chorus_core.comfy.comfyui_locator import prepare_in_process

    prepare_in_process(cpu=args.device == "cpu")
    resume = load_state(args.resume) if args.resume else init_state_from_weights(args.init_from) if args.init_from else None
    config = config_with_overrides(config_from_dict(resume["config"]), args.set) if resume else make_config(args.preset, args.set)
    if args.time_budget_s is not None:
        config = replace(config, time_budget_s=args.time_budget_s)
    result = train(config, args.device, resume=resume, stop_after_steps=args.chunk_steps)
    write_outputs(result, config, args.out, args.device, "python -m tests.testbed.train " + " ".join(argv or sys.argv[1:]),
                  args.parts_out)
    print(f"trained to step {result['steps']} ({result['seconds']:.0f}s this chunk) -> {args.out / CHECKPOINT_NAME}, "
          f"{args.out / STATE_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
