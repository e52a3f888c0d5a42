"""End to end through a real ComfyUI server: KSampler runs a model patched by Chorus Sparse Attention."""

import pytest

from workflows import chorus_i2v_prompt

pytestmark = pytest.mark.e2e
STEPS = 4


def ksampler_through_the_patch(bank, subject, seed):
    """The tiny I2V graph with the MODEL patch in front of ComfyUI's own KSampler."""
    prompt = chorus_i2v_prompt(bank=bank, subject=subject, seed=seed, steps=STEPS)
    prompt["7"] = {"class_type": "ChorusSparseAttention", "inputs": {
        "model": ["1", 0], "match": ["6", 0], "dense_warmup_steps": 1, "dense_layers": "", "miss_mode": "online",
        "top_p": 0.9, "min_density": 0.1, "max_density": 0.6, "record_on_miss": True, "tag": "pan"}}
    prompt["3"] = {"class_type": "KSampler", "inputs": {
        "model": ["7", 0], "positive": ["2", 0], "negative": ["2", 1], "latent_image": ["2", 2], "seed": seed,
        "steps": STEPS, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}
    return prompt


def run(server, prompt):
    events = []
    record = server.run_prompt(prompt, timeout=300, on_event=events.append)
    assert record["status"]["status_str"] == "success", record["status"]
    reports = [e["data"]["chorus_report"] for e in events if e.get("type") == "chorus.report"]
    steps = [e["data"] for e in events if e.get("type") == "chorus.step"]
    return reports, steps


def test_a_ksampler_run_through_the_patch_records_then_hits(comfy_server):
    (first,), first_steps = run(comfy_server, ksampler_through_the_patch("e2e_patch", subject=0, seed=1))
    assert (first["mode"], first["steps"], first["recording"]) == ("miss", STEPS, "queued")
    assert [s["step"] for s in first_steps] == [1, 2, 3, 4] and {s["node"] for s in first_steps} == {"7"}

    (second,), _ = run(comfy_server, ksampler_through_the_patch("e2e_patch", subject=1, seed=2))
    assert (second["mode"], second["entry_id"]) == ("hit", first["recorded_entry_id"])
    # a hit is sparse from step 0; its last step is dense (dense_last_steps 1, the default)
    assert [layer["sparse_share"] for layer in second["layers"]] == [0.75, 0.75]
    assert second["dense_steps"] == {"3": "one of the last steps kept dense (dense_last_steps=1)"}
    assert second["warnings"] == []


def test_a_sampling_on_another_latent_grid_runs_without_the_match_and_says_why(comfy_server):
    """The patched model may reach a second sampler on another latent (an upscale pass): that run
    is a miss that records nothing, with a warning, instead of a recording that can never be stored."""
    prompt = ksampler_through_the_patch("e2e_patch_other_grid", subject=0, seed=1)
    prompt["8"] = {"class_type": "ChorusTestbedRequest", "inputs": {
        "template": "pan", "subject": 0, "layout": 0, "latent_frames": 9, "latent_height": 16, "latent_width": 16}}
    prompt["6"]["inputs"]["latent"] = ["8", 2]
    (report,), _ = run(comfy_server, prompt)
    assert (report["mode"], report["recording"], report["recorded_entry_id"]) == ("miss", None, None)
    assert report["warnings"] == [
        "ran without the match, as a miss that records nothing: the match was made for a latent of 9x8x8 tokens "
        "(frames x height x width), but the sampler got 5x8x8. Wire the same latent into Similarity Match's "
        "latent and the sampler's latent_image."]


def test_the_sampler_custom_advanced_example_graph_is_valid_on_the_server(comfy_server):
    """Every node and input of the example's API graph exists on the server, with the right link types."""
    from example_workflows_tool import wan21_i2v_chorus_model_patch

    info = comfy_server.get_json("/object_info")
    prompt = wan21_i2v_chorus_model_patch("480p")
    assert prompt["12"]["class_type"] == "SamplerCustomAdvanced" and prompt["20"]["inputs"]["model"] == ["1", 0]
    for node_id, node in prompt.items():
        spec = info[node["class_type"]]["input"]
        known = {**spec.get("required", {}), **spec.get("optional", {})}
        assert set(node["inputs"]) <= set(known), f"node {node_id}: unknown inputs"
        assert set(spec.get("required", {})) <= set(node["inputs"]), f"node {node_id}: missing inputs"
        for name, value in node["inputs"].items():
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                produced = info[prompt[value[0]]["class_type"]]["output"][value[1]]
                accepted = known[name][0].split(",")
                assert produced in accepted or "*" in accepted, f"node {node_id} input {name}: {produced} into {accepted}"
