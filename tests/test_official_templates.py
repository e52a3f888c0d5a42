"""ComfyUI's official Wan templates with Chorus in them, run by a real server on tiny stand-in models.

The Wan 2.2 14B I2V template's sampling half runs as users run it: two fp8_scaled experts (tiny, Wan 2.2
I2V-shaped, in Comfy-Org's fp8_scaled layout) under the template's file names, a LoRA in LightX2V's key
layout on each, ModelSamplingSD3 shift 5, two KSamplerAdvanced at 4 steps and cfg 1 (steps 0-2 on the
high-noise expert, 2-4 on the low-noise one), Chorus on each expert. Only what needs real weights
(text encoder, VAE, the start image) is replaced by the testbed request, whose outputs take the place of
WanImageToVideo's. Runs on each pinned ComfyUI release (``make test`` runs it on both).
"""

import subprocess
import time
import sys

import pytest

from conftest import REPO_ROOT, serve
from example_workflows_tool import (WAN22_EXPERT_NODES, WAN22_LORAS, WAN22_MODELS, wan21_i2v_template_chorus,
                                    wan22_i2v_14b_template_chorus)

pytestmark = pytest.mark.e2e
EXPERT_SEEDS = {"high": 11, "low": 12}
REPLACED_BY_THE_TESTBED_REQUEST = ("84", "90", "97", "93", "89")  # text encoder, VAE, image, prompts
DECODE_AND_SAVE = ("87", "94", "108")


def chorus_patch_of(prompt: dict, expert: str) -> str:
    """The Chorus Sparse Attention node in front of ``expert``'s KSamplerAdvanced."""
    return prompt[WAN22_EXPERT_NODES[expert][3]]["inputs"]["model"][0]


def runnable_wan22_template(template="pan", subject=0, layout=0, seed=42, bank="official_wan22") -> dict:
    """The Chorus template with its encoders replaced by the testbed request and its decode by SaveLatent."""
    prompt = wan22_i2v_14b_template_chorus()
    for node in REPLACED_BY_THE_TESTBED_REQUEST + DECODE_AND_SAVE:
        del prompt[node]
    prompt["98"] = {"class_type": "ChorusTestbedRequest", "inputs": {  # outputs 0-2 as WanImageToVideo's
        "template": template, "subject": subject, "layout": layout, "latent_frames": 5, "latent_height": 16,
        "latent_width": 16}}
    prompt["87"] = {"class_type": "SaveLatent", "inputs": {"samples": ["85", 0], "filename_prefix": "official_wan22"}}
    prompt["200"]["inputs"]["new_bank_name"] = bank
    for node in prompt.values():
        if node["class_type"] == "ChorusSimilarityMatch":
            node["inputs"]["block_size"] = 32  # the tiny latent has 320 tokens
        if node["class_type"] == "KSamplerAdvanced":
            node["inputs"]["noise_seed"] = seed
    return prompt


@pytest.fixture(scope="module")
def template_server(tmp_path_factory, comfyui_path):
    """A ComfyUI server whose models folder holds tiny stand-ins under the template's own file names."""
    from chorus_core.comfy.comfyui_process import ComfyServer, prepare_base_directory

    base = prepare_base_directory(tmp_path_factory.mktemp("official_templates"))
    code = ("import sys; from chorus_core.comfy.comfyui_locator import prepare_in_process; "
            f"prepare_in_process({str(comfyui_path)!r}); sys.path.insert(0, 'tests'); "
            "from checkpoint_formats import write_wan22_template_files; "
            f"write_wan22_template_files({str(base / 'models')!r}, {WAN22_MODELS!r}, {WAN22_LORAS!r}, {EXPERT_SEEDS!r})")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)
    yield from serve(ComfyServer(base, comfyui=comfyui_path), "official_templates_server.log")


def run(server, prompt) -> dict:
    """Queue ``prompt``; each Chorus node's report by node id."""
    events = []
    record = server.run_prompt(prompt, timeout=300, on_event=events.append)
    assert record["status"]["status_str"] == "success", record["status"]
    return {e["data"]["node"]: e["data"]["chorus_report"] for e in events if e.get("type") == "chorus.report"}


@pytest.fixture(scope="module")
def three_requests(template_server):
    """A request, a similar one (another subject) and a different one (other template and layout), in order."""
    return [run(template_server, runnable_wan22_template(**kwargs)) for kwargs in (
        dict(template="pan", subject=0, layout=0, seed=1), dict(template="pan", subject=1, layout=0, seed=2),
        dict(template="orbit", subject=3, layout=5, seed=3))]


def test_each_expert_misses_and_records_then_a_similar_request_hits_its_own_entry(three_requests):
    first, similar, _ = three_requests
    prompt = runnable_wan22_template()
    recorded = {}
    for expert in ("high", "low"):
        node = chorus_patch_of(prompt, expert)
        assert (first[node]["mode"], first[node]["recording"], first[node]["warnings"]) == ("miss", "queued", [])
        assert (similar[node]["mode"], similar[node]["warnings"]) == ("hit", [])
        assert similar[node]["entry_id"] == first[node]["recorded_entry_id"]
        recorded[expert] = first[node]["recorded_entry_id"]
        assert first[node]["steps"] == similar[node]["steps"] == 2  # each expert samples its half of 4 steps
    assert recorded["high"] != recorded["low"]  # one entry per expert: the models differ


def test_a_different_request_hits_neither_expert(three_requests):
    _, _, different = three_requests
    prompt = runnable_wan22_template()
    for expert in ("high", "low"):
        report = different[chorus_patch_of(prompt, expert)]
        assert report["mode"] == "miss" and report["entry_id"] is None


def test_the_bank_holds_one_entry_per_expert_and_kind_of_request(template_server, three_requests):
    """Two misses on each expert recorded; the similar request's hits added nothing."""
    deadline = time.monotonic() + 60
    while (entries := template_server.get_json("/chorus/api/banks/official_wan22/stats")["entries"]) < 4:
        assert time.monotonic() < deadline, f"the bank holds {entries} entries, not 4"
        time.sleep(0.2)
    time.sleep(1.0)
    assert template_server.get_json("/chorus/api/banks/official_wan22/stats")["entries"] == 4


def test_the_wan21_template_graph_is_valid_on_the_server(template_server):
    """Every node and input of the Wan 2.1 template with Chorus exists on this server, links typed right."""
    info = template_server.get_json("/object_info")
    for prompt in (wan21_i2v_template_chorus(), wan22_i2v_14b_template_chorus()):
        for node_id, node in prompt.items():
            spec = info[node["class_type"]]["input"]
            known = {**spec.get("required", {}), **spec.get("optional", {})}
            assert set(node["inputs"]) <= set(known), (node_id, set(node["inputs"]) - set(known))
            for name, value in node["inputs"].items():
                if isinstance(value, list):
                    origin = prompt[value[0]]
                    kind = info[origin["class_type"]]["output"][value[1]]
                    assert kind == known[name][0], (node_id, name, kind, known[name][0])
