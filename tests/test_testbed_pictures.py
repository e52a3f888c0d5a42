"""The quality section's pictures (issue 23, item 4): frames and error maps per mask source."""

import json

import numpy as np
import pytest
import torch

from tests.testbed.pictures import ROWS, draw_pictures, frame_indices, heat


def test_frame_picks_and_the_error_colour_scale():
    assert frame_indices(16, 4) == [0, 5, 10, 15]
    assert frame_indices(3, 8) == [0, 1, 2]
    assert frame_indices(1, 4) == [0]
    colours = heat(np.array([[0.0, 0.5, 1.0, 7.0]]), top=1.0)[0]
    assert colours.tolist() == [[0, 0, 0], [255, 0, 0], [255, 255, 0], [255, 255, 0]]  # clipped at the top


def test_pictures_show_each_source_s_distance_from_the_dense_run(tmp_path):
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(1, 16, 6, 8, 12, generator=generator)
    finals = {("dense", "dense", "req", 0): dense}
    for i, (_, section, kind) in enumerate(ROWS[1:]):  # the hit closest, static farthest
        finals[(section, kind, "req", 0)] = dense + 0.05 * (i + 1) * torch.randn(dense.shape, generator=generator)
    doc = draw_pictures(finals, "req", 0, 4, tmp_path)
    scores = [doc["psnr_db"][label] for label, _, _ in ROWS[1:]]
    assert scores == sorted(scores, reverse=True) and doc["frames"] == [0, 2, 3, 5]
    frames, errors = Image.open(tmp_path / "frames.png"), Image.open(tmp_path / "errors.png")
    cell_h = round(128 * 8 / 12)
    assert frames.size == (90 + 4 * 132, 24 + 5 * (cell_h + 4)) and errors.size == (90 + 4 * 132, 24 + 4 * (cell_h + 4))
    pixels = np.asarray(errors.convert("RGB")).astype(float)
    row_brightness = [pixels[24 + r * (cell_h + 4): 24 + r * (cell_h + 4) + cell_h, 90:].mean() for r in range(4)]
    assert row_brightness == sorted(row_brightness)  # larger errors draw brighter


@pytest.mark.comfy
def test_the_pictures_command_runs_the_product_path_on_the_tiny_model(comfy_runtime, tmp_path):
    from tests.testbed.pictures import main

    assert main(["--tiny", "--out", str(tmp_path), "--frames", "2"]) == 0
    doc = json.loads((tmp_path / "pictures.json").read_text())
    assert doc["command"] == f"python -m tests.testbed.pictures --tiny --out {tmp_path} --frames 2"
    assert doc["git_commit"] and doc["date"] and doc["machine"]
    assert set(doc["psnr_db"]) == {"hit", "online", "prior", "static"}
    assert all(np.isfinite(v) and v > 10 for v in doc["psnr_db"].values())
    assert (tmp_path / "frames.png").stat().st_size > 0 and (tmp_path / "errors.png").stat().st_size > 0


@pytest.mark.comfy
def test_the_product_path_refuses_a_preset_that_describes_another_model(comfy_runtime, tmp_path):
    """It counts layers and heads from the preset: the 4-layer cpu2k preset on a 6-layer checkpoint
    would have measured some layers and not others."""
    from dataclasses import replace

    from tests.testbed.product_path import ProductPath, tiny_setup

    patcher, config = tiny_setup(tmp_path)
    ProductPath(patcher, config, tmp_path)  # its own preset: accepted
    with pytest.raises(ValueError, match=r"describes 3 layers x 1 heads, the checkpoint has 2 x 1: pass the preset"):
        ProductPath(patcher, replace(config, num_layers=3), tmp_path)


@pytest.mark.comfy
def test_the_product_path_samples_at_the_configs_cfg(comfy_runtime, tmp_path):
    """sample_cfg reaches ComfyUI's sampler (cond and uncond in one batch above 1), and the oracle's
    block mass pools the batch as the shipped recorder does."""
    from dataclasses import replace

    from tests.testbed.product_path import ProductPath, tiny_setup
    from tests.testbed.report import eval_requests
    from chorus_core.testbed.workload import generate_request, i2v_conditioning

    patcher, config = tiny_setup(tmp_path, ["sample_cfg=5"])
    assert config.sample_cfg == 5.0
    targets, _, _, _ = eval_requests(config, config.long_size)
    conds = i2v_conditioning(generate_request(targets[0]))
    final5, mass5 = ProductPath(patcher, config, tmp_path).dense(conds, 0)
    final1, mass1 = ProductPath(patcher, replace(config, sample_cfg=1.0), tmp_path).dense(conds, 0)
    assert (final5 - final1).abs().max() > 1e-3  # the negative prompt now counts
    assert mass5.shape == mass1.shape  # one mass per (step, layer), whatever the batch
    rows = mass5.sum(-1)  # each query block's mass over the key blocks sums to 1
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-3)
