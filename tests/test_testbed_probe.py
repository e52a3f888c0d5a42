"""The design probe of issue 23 at CPU size: two tiny candidates, a few steps each, through the CLI;
the records it writes, and that its sharpness numbers are the sharpness module's own."""

import json
import math
from dataclasses import replace

import pytest
import torch
from workload_sums import assert_renders

pytestmark = pytest.mark.comfy


def test_the_probe_trains_each_candidate_and_measures_it_with_the_sharpness_code(comfy_runtime, tmp_path):
    from tests.testbed.config import make_config
    from tests.testbed.models import build_model
    from tests.testbed.probe import candidate_config, main, probe_requests
    from tests.testbed.sharpness import measure_sharpness
    from tests.testbed.train import train

    out = tmp_path / "probe"
    assert main(["--candidates", "tiny_sharp,tiny_probe_heads", "--seconds-each", "200", "--every", "2",
                 "--requests", "1", "--set", "max_steps=4", "--set", "log_every=1", "--device", "cpu",
                 "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["probe.json", "probe.md"]
    doc = json.loads((out / "probe.json").read_text())
    assert doc["machine"] == "cpu" and doc["held_out"] == "bounce" and doc["density"] == 0.15
    assert doc["command"].startswith("python -m tests.testbed.probe --candidates tiny_sharp,tiny_probe_heads")
    assert doc["git_commit"] and doc["date"][:2] == "20"
    assert [c["name"] for c in doc["candidates"]] == ["tiny_sharp", "tiny_probe_heads"]
    plain, heads = doc["candidates"]
    assert (plain["heads"], heads["heads"]) == (1, 4) and heads["config"]["texture"] == "multi"
    for row in doc["candidates"]:
        assert row["steps"] == 4 and 0 < row["seconds"] <= row["budget_s"] <= 200 and row["steps_per_s"] > 0
        assert [c["step"] for c in row["checkpoints"]] == [0, 2, 4]
        assert [h["step"] for h in row["loss_curve"]] == [1, 2, 3, 4]
        assert "bounce" not in row["config"]["train_templates"] + row["config"]["eval_templates"]
        for c in row["checkpoints"]:
            assert 0 <= c["mean"] <= 1 and len(c["per_layer"]) == row["config"]["num_layers"]
            assert all(0 <= v <= 1 for v in c["per_layer"])
        assert row["final"] == row["checkpoints"][-1]["mean"] and math.isfinite(row["slope_per_1k"])

    # the numbers are sharpness.measure_sharpness on the same model: untrained (step 0) and after the
    # same 4 steps of an ordinary training run (measuring in between must not change the training)
    quiet = lambda *_: None  # noqa: E731
    config = candidate_config("tiny_probe_heads", "bounce", ["max_steps=4", "log_every=1"])
    requests = probe_requests(config, 1)
    assert heads["requests"] == [f"{r.template}/s{r.subject}/l{r.layout}/{r.texture}" for r in requests]
    untrained = measure_sharpness(build_model(config).eval(), config, "cpu", requests, log=quiet)
    assert heads["checkpoints"][0]["mean"] == round(untrained["mean"], 4)
    assert heads["checkpoints"][0]["per_layer"] == untrained["per_layer"]
    trained = train(replace(config, time_budget_s=600), "cpu", log=quiet)["model"]  # stops at max_steps
    direct = measure_sharpness(trained, config, "cpu", requests, log=quiet)
    assert heads["final"] == round(direct["mean"], 4) and heads["final_per_layer"] == direct["per_layer"]
    assert heads["final"] != heads["checkpoints"][0]["mean"]  # trained: the measure saw a different model

    table = (out / "probe.md").read_text()
    assert "Held-out workload family" in table and "`bounce`" in table
    assert "| candidate | tests | params (M) | N | heads x dim x layers | train s | steps/s | steps | @0 | @2 | @4 | final |" in table
    assert "| tiny_probe_heads |" in table and f"{heads['final']:.3f} (@4)" in table
    assert make_config("tiny_probe_heads").head_dim == 32

    with pytest.raises(SystemExit, match="unknown candidate 'nope'"):
        main(["--candidates", "nope", "--out", str(tmp_path / "x"), "--device", "cpu"])


def test_out_of_time_candidates_are_skipped_and_budgets_shrink_to_the_deadline():
    from tests.testbed.probe import budget_for, render_markdown, slope_per_1k

    assert budget_for(110, 540, 4, 20) == 110
    assert budget_for(110, 400, 4, 30) == pytest.approx(70)
    checkpoints = [{"step": 0, "mean": 0.9}, {"step": 200, "mean": 0.3}, {"step": 400, "mean": 0.35},
                   {"step": 600, "mean": 0.4}]
    assert slope_per_1k(checkpoints, 200) == pytest.approx(0.25)  # step 0 left out
    doc = {"density": 0.15, "command": "c", "machine": "m", "date": "d", "git_commit": "g", "held_out": "bounce",
           "seconds_each": 110, "requests": 2, "every": 200,
           "candidates": [{"name": "late", "skipped": "out of time: 3 s of training left"}]}
    assert "Skipped: late (out of time: 3 s of training left)" in render_markdown(doc)


def test_probe_candidates_are_the_designs_they_name(comfy_runtime):
    from tests.testbed.config import make_config, tokens_of
    from tests.testbed.models import build_model
    from tests.testbed.train import long_share_at

    base = make_config("sharp16k")
    shapes = {name: (c.num_heads, c.head_dim, c.num_layers, tokens_of(c.long_size), c.texture)
              for name in ("sharp16k", "probe_heads8x48", "probe_heads8x64", "probe_wide", "probe_multi",
                           "probe_frames32", "probe_curriculum", "probe_combo")
              for c in [make_config(name)]}
    assert shapes == {"sharp16k": (3, 128, 6, 16384, "detailed"), "probe_heads8x48": (8, 48, 6, 16384, "detailed"),
                      "probe_heads8x64": (8, 64, 4, 16384, "detailed"), "probe_wide": (3, 128, 6, 16384, "detailed"),
                      "probe_multi": (3, 128, 6, 16384, "multi"), "probe_frames32": (3, 128, 6, 32768, "detailed"),
                      "probe_curriculum": (3, 128, 6, 16384, "detailed"), "probe_combo": (8, 64, 4, 16384, "multi")}
    assert make_config("probe_wide").long_size == (16, 32, 128)  # rows of 64 tokens
    # ComfyUI's WanModel really gets the narrower heads (its RoPE splits head_dim over t, h, w)
    model = build_model(make_config("probe_heads8x48"))
    assert model.blocks[0].self_attn.num_heads == 8 and model.blocks[0].self_attn.head_dim == 48
    assert sum(p.numel() for p in model.parameters()) == 16_335_680  # sharp16k's size: only the split differs
    # curriculum: no long clips at first, then a linear ramp to sharp16k's share; the others never ramp
    curriculum = make_config("probe_curriculum")
    assert [long_share_at(curriculum, s) for s in (0, 300, 600, 5000)] == [0.0, 0.35, 0.7, 0.7]
    assert {long_share_at(base, s) for s in (0, 300, 5000)} == {0.7}


def test_the_shift05_follow_up_candidates_change_only_what_they_name():
    from dataclasses import asdict

    from tests.testbed.config import PROBE_CANDIDATES, make_config
    from tests.testbed.probe import WHAT_IT_TESTS

    def changed(name, against):
        a, b = asdict(make_config(name)), asdict(make_config(against))
        return {k: a[k] for k in a if a[k] != b[k]}

    assert changed("probe_shift05_entropy", "probe_shift05") == {"attn_entropy_weight": 0.02}
    assert changed("probe_shift05_entropy_strong", "probe_shift05") == {"attn_entropy_weight": 0.1}
    assert changed("probe_shift05_heads6x128", "probe_heads6x128") == {"shift": 0.5}
    assert make_config("sharp16k").attn_entropy_weight == 0.0  # no committed design trains with the penalty
    assert set(PROBE_CANDIDATES) <= set(WHAT_IT_TESTS)  # every candidate's table row says what it tests


# --------------------------------------------------------------------------------------------
# Workload options of the probe
# --------------------------------------------------------------------------------------------


def test_detailed_requests_are_unchanged_by_the_multi_family():
    """sharp16k's checkpoint was trained on the detailed family: it renders what it rendered at e36bdc7."""
    from chorus_core.testbed.workload import I2VRequest, generate_request

    t = generate_request(I2VRequest("zoom", 5, 1, frames=5, height=32, width=32, texture="detailed"))
    # request_sums from e36bdc7's code (see workload_sums for why not a checksum)
    assert_renders(t, [58694.505121182185, 68613.85013348755, 140185.96545619826, 10422.79644576734, 5914.144136468292,
                       84.83563568624896, 69.2343419846454, -378.1551804357706, -17.595345999060875])


def test_multi_objects_move_differently_and_hide_behind_the_bar():
    from chorus_core.testbed.workload import (MULTI_OBJECTS, I2VRequest, _detailed_background, _detailed_subject, _layout,
                                      _multi_motion, _multi_occluder, render_video)

    request = I2VRequest("pan", 3, 2, frames=16, height=64, width=64, texture="multi")
    video = render_video(request)
    background = _detailed_background(2, 64, 64)
    bar, left = _multi_occluder(2, 64, 64)
    assert 0 < left and left + bar.shape[-1] < 64
    for f in range(16):  # the bar is in front of everything, in every frame
        assert torch.equal(video[:, f, :, left:left + bar.shape[-1]], bar)
    # three objects, three different motions (object 0: twice the template's path)
    paths = [[_multi_motion("pan", 2, j, f / 15)[:2] for f in range(16)] for j in range(MULTI_OBJECTS)]
    steps = [(round(p[1][0] - p[0][0], 4), round(p[1][1] - p[0][1], 4)) for p in paths]
    assert len(set(steps)) == MULTI_OBJECTS and steps[0] == (round(2 * 0.5 / 15, 4), 0.0)
    # what covers the background in a later frame is the objects' texture, copied exactly (no blending)
    side = max(2, round(0.7 * _layout(2, 64, 64)[2] * 64))
    texels = torch.cat([_detailed_subject(3 * 3 + j, side).flatten(1) for j in range(MULTI_OBJECTS)], 1).T
    later = video[:, 9]
    covered = ((later - background).abs().sum(0) > 0).nonzero().tolist()
    covered = [(y, x) for y, x in covered if not left <= x < left + bar.shape[-1]]
    assert len(covered) > 20
    assert all((texels == later[:, y, x]).all(1).any() for y, x in covered[::7])
    moved = (video - background[:, None]).abs().sum(0) > 0  # [T, H, W]: objects or the bar
    moved[:, :, left:left + bar.shape[-1]] = False
    counts = moved.flatten(1).sum(1)
    assert (counts > 0).all() and len(set(counts.tolist())) > 1  # visible share changes: occlusion, wrap
    assert not torch.equal(video[:, 0], video[:, 8])
    # the family is keyed like the others: another subject changes the texture, not the motion
    other = render_video(I2VRequest("pan", 4, 2, frames=16, height=64, width=64, texture="multi"))
    assert not torch.equal(other[:, 0], video[:, 0])
    with pytest.raises(ValueError, match="unknown texture 'rough'; choose one of plain, detailed, multi"):
        I2VRequest(texture="rough")


def test_qk_gain_levers_start_and_train_the_self_attention_temperature_only(comfy_runtime):
    """qk_gain_init sets only the self-attention norm_q / norm_k gains; qk_gain_lr_mult gives them (and
    nothing else) a faster learning rate that the schedule keeps; at 1.0 the optimizer is as before."""
    from tests.testbed.config import make_config
    from tests.testbed.models import build_model, is_qk_gain
    from tests.testbed.train import train

    config = replace(make_config("tiny_sharp"), qk_gain_init=1.5, qk_gain_lr_mult=10.0, max_steps=2,
                     time_budget_s=600)
    model = build_model(config)
    gains = {n: p for n, p in model.named_parameters() if is_qk_gain(n)}
    assert len(gains) == 2 * config.num_layers
    assert all(torch.equal(p, torch.full_like(p, 1.5)) for p in gains.values())
    assert all(p.detach().mean().item() == 1.0 for n, p in model.named_parameters()
               if "norm" in n and not is_qk_gain(n) and n.endswith("weight") and p.dim() == 1)
    result = train(config, "cpu", log=lambda *_: None, model=model)
    groups = result["state"]["optimizer"]["param_groups"]
    assert len(groups) == 3 and groups[2]["lr_mult"] == 10.0
    assert groups[2]["lr"] == pytest.approx(10.0 * groups[0]["lr"]) and groups[0]["lr"] > 0
    assert len(groups[2]["params"]) == len(gains)
    plain = train(replace(config, qk_gain_lr_mult=1.0, qk_gain_init=1.0), "cpu", log=lambda *_: None)
    assert len(plain["state"]["optimizer"]["param_groups"]) == 2  # older train_state.pt files still resume
