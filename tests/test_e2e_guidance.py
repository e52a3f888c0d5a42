"""End to end through a real ComfyUI server (API mode): Chorus Guidance Enhance before a sampler.

Needs "guidance_nodes" in nodes/setup.py FEATURE_MODULES (the node must be registered).
"""

import pytest
import torch

from workflows import chorus_i2v_prompt, tiny_i2v_prompt

pytestmark = pytest.mark.e2e
STEPS = 3


def with_guidance(prompt, method="cfg_boost", strength=0.5, start=0.0, end=1.0):
    """Insert UNETLoader -> ChorusGuidanceEnhance -> (every node that took the model)."""
    prompt = {k: {**v, "inputs": dict(v["inputs"])} for k, v in prompt.items()}
    prompt["10"] = {"class_type": "ChorusGuidanceEnhance", "inputs": {
        "model": ["1", 0], "method": method, "strength": strength, "start": start, "end": end}}
    for node_id, node in prompt.items():
        if node_id != "10" and node["inputs"].get("model") == ["1", 0] and node["class_type"] != "ChorusSimilarityMatch":
            node["inputs"]["model"] = ["10", 0]
    return prompt


def saved_latent(server, record, node="4"):
    from safetensors.torch import load_file

    saved = record["outputs"][node]["latents"][0]
    return load_file(str(server.base_dir / "output" / saved["subfolder"] / saved["filename"]))["latent_tensor"]


def run(server, prompt):
    record = server.run_prompt(prompt, timeout=300)
    assert record["status"]["status_str"] == "success", record["status"]
    return record


def test_node_is_listed_with_its_widgets(comfy_server):
    info = comfy_server.get_json("/object_info/ChorusGuidanceEnhance")["ChorusGuidanceEnhance"]
    assert info["category"] == "Chorus" and info["output"] == ["MODEL"]
    required = info["input"]["required"]
    assert list(required) == ["model", "method", "strength", "start", "end"]
    kind, spec = required["method"][0], required["method"][1]
    options = kind if isinstance(kind, list) else spec["options"]  # V1 list form, or "COMBO" + options
    assert options == ["cfg_boost", "cross_attention"]
    assert spec["default"] == "cross_attention"


def test_guidance_before_ksampler_in_api_mode(comfy_server):
    plain = saved_latent(comfy_server, run(comfy_server, tiny_i2v_prompt(seed=7, steps=STEPS, prefix="g_plain")))
    off = saved_latent(comfy_server, run(comfy_server, with_guidance(
        tiny_i2v_prompt(seed=7, steps=STEPS, prefix="g_off"), strength=0.0)))
    assert torch.equal(off, plain)
    # the CFG boost over the whole schedule is plain CFG at cfg 5 x 1.2 = 6
    boosted = saved_latent(comfy_server, run(comfy_server, with_guidance(
        tiny_i2v_prompt(seed=7, steps=STEPS, prefix="g_boost"), strength=0.2)))
    at_six = saved_latent(comfy_server, run(comfy_server, tiny_i2v_prompt(seed=7, steps=STEPS, cfg=6.0, prefix="g_six")))
    torch.testing.assert_close(boosted, at_six, rtol=1e-3, atol=1e-3)
    assert not torch.equal(boosted, plain)


def test_guidance_before_the_chorus_sparse_sampler(comfy_server):
    """Miss (records), then a similar request hits, with cross-attention enhancement in the window."""
    reports = []
    for subject, seed in ((0, 1), (1, 2)):
        prompt = with_guidance(chorus_i2v_prompt(bank="e2e_guidance", subject=subject, seed=seed, steps=STEPS,
                                                 prefix="g_sparse"), method="cross_attention", strength=0.3, start=0.3)
        record = run(comfy_server, prompt)
        reports.append(record["outputs"]["3"]["chorus_report"][0])
        latent = saved_latent(comfy_server, record)
        assert latent.isfinite().all() and latent.std() > 0
    assert [r["mode"] for r in reports] == ["miss", "hit"]
    assert reports[1]["entry_id"] == reports[0]["recorded_entry_id"]
