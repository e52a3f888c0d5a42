"""Pictures for the quality section (issue 23, item 4): one held-out target's frames as each mask
source leaves them, and where each one differs from the dense run.

    python -m tests.testbed.pictures --checkpoint FILE --out DIR [--preset sharp16k] [--set NAME=VALUE]
        [--option min_density=0.15 --option max_density=0.15] [--frames 4] [--seed 0]
    python -m tests.testbed.pictures --tiny --out DIR     # CPU, random tiny model

It runs the product path (``product_path.run_product_path``, its first held-out target, one seed) keeping every
run's final latents, and draws, in ComfyUI's Wan 2.1 latent-to-RGB preview:

- ``DIR/frames.png``: rows dense | hit | online | prior | static, columns evenly spaced frames;
- ``DIR/errors.png``: per frame, |source - dense| (mean over RGB) on one colour scale for every
  row (black 0, red, then yellow at the scale's top: the 99th percentile of all errors), with
  each row's PSNR against the dense frames;
- ``DIR/pictures.json``: machine, date, commit, command, the rows' PSNR and the scale.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from chorus_core.quality import psnr
from .product_path import add_model_arguments, latents_to_rgb, load_model, reuse_options, run_product_path
from .report import cpu_name, git_commit

# (label, section, kind) of product_path's rows: the hit and the shipped sources at their natural
# density, static windows at the hit's density (the pack has no natural density for them)
ROWS = [("dense", "dense", "dense"), ("hit", "natural", "reused_similar_product"), ("online", "natural", "online"),
        ("prior", "natural", "population_prior"), ("static", "matched", "static")]
CELL_PX = 128  # each frame drawn this wide (nearest upscaling of the latent-resolution preview)
LABEL_PX = 90


def frame_indices(frames: int, count: int) -> list[int]:
    """``count`` evenly spaced frame indices from the first to the last."""
    count = max(1, min(count, frames))
    return sorted({round(i * (frames - 1) / max(1, count - 1)) for i in range(count)})


def heat(error: np.ndarray, top: float) -> np.ndarray:
    """Error ``[H, W]`` -> RGB uint8: black at 0, red at half the scale, yellow at its top."""
    x = np.clip(error / max(top, 1e-12), 0.0, 1.0)
    rgb = np.stack([np.clip(2 * x, 0, 1), np.clip(2 * x - 1, 0, 1), np.zeros_like(x)], axis=-1)
    return (rgb * 255).astype(np.uint8)


def to_uint8(rgb: torch.Tensor) -> np.ndarray:
    """One preview frame ``[3, H, W]`` in 0..1 -> ``[H, W, 3]`` uint8."""
    return (rgb.permute(1, 2, 0).clamp(0, 1).numpy() * 255).round().astype(np.uint8)


def draw_grid(rows: list[tuple[str, list[np.ndarray]]], title: str):
    """A PIL image: labelled rows of equal-size RGB tiles, each upscaled to CELL_PX wide."""
    from PIL import Image, ImageDraw

    h, w = rows[0][1][0].shape[:2]
    cell_h = max(1, round(CELL_PX * h / w))
    cols = max(len(tiles) for _, tiles in rows)
    image = Image.new("RGB", (LABEL_PX + cols * (CELL_PX + 4), 24 + len(rows) * (cell_h + 4)), "white")
    draw = ImageDraw.Draw(image)
    draw.text((4, 4), title, fill="black")
    for r, (label, tiles) in enumerate(rows):
        y = 24 + r * (cell_h + 4)
        draw.text((4, y + cell_h // 2 - 12), label, fill="black")
        for c, tile in enumerate(tiles):
            image.paste(Image.fromarray(tile).resize((CELL_PX, cell_h), Image.NEAREST), (LABEL_PX + c * (CELL_PX + 4), y))
    return image


def draw_pictures(finals: dict, request: str, seed: int, frames: int, out: Path) -> dict:
    """frames.png and errors.png from product_path's final latents of one target and seed."""
    rgb = {label: latents_to_rgb(finals[(section, kind, request, seed)])[0] for label, section, kind in ROWS}
    dense = rgb["dense"]
    picks = frame_indices(dense.shape[1], frames)
    errors = {label: (x - dense).abs().mean(0).numpy() for label, x in rgb.items() if label != "dense"}
    top = float(np.percentile(np.concatenate([e.ravel() for e in errors.values()]), 99))
    scores = {label: round(float(psnr(dense[None], x[None], data_range=1.0)[0]), 2) for label, x in rgb.items()
              if label != "dense"}
    frame_rows = [(label if label == "dense" else f"{label}\n{scores[label]:.1f} dB", [to_uint8(x[:, t]) for t in picks])
                  for label, x in rgb.items()]
    error_rows = [(f"{label}\n{scores[label]:.1f} dB", [heat(e[t], top) for t in picks]) for label, e in errors.items()]
    where = f"{request}, seed {seed}, frames {', '.join(map(str, picks))}"
    draw_grid(frame_rows, f"frames: {where}").save(out / "frames.png")
    draw_grid(error_rows, f"|source - dense|, scale 0..{top:.3f} (black..yellow): {where}").save(out / "errors.png")
    return {"request": request, "seed": seed, "frames": picks, "psnr_db": scores, "error_scale_top": round(top, 5)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    add_model_arguments(parser)
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="a sampler ReuseOption (min_density=0.15 and max_density=0.15 draw density 0.15)")
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    finals: dict = {}
    with tempfile.TemporaryDirectory(prefix="chorus-pictures-") as tmp:
        patcher, config = load_model(args, Path(tmp))
        results = run_product_path(patcher, config, Path(tmp), 1, 1, seed_start=args.seed,
                                   options=reuse_options(args.option), finals=finals)
    if not results["rows"]:
        raise SystemExit(f"the target was not served as a hit, nothing to draw: {results['notes']}")
    request = results["rows"][0]["request"]
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"machine": torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "git_commit": git_commit(), "command": "python -m tests.testbed.pictures " + " ".join(argv or sys.argv[1:]),
           "options": args.option, **draw_pictures(finals, request, args.seed, args.frames, args.out)}
    (args.out / "pictures.json").write_text(json.dumps(doc, indent=1))
    print(f"{args.out / 'frames.png'}, {args.out / 'errors.png'}: PSNR {doc['psnr_db']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
