"""The Chorus template workflows are ComfyUI's official ones node for node, with Chorus inserted and nothing else changed.

Compared with the official UI files of the ``comfyui-workflow-templates`` package that ComfyUI 0.3.64 pins
(0.1.95, flat graphs; the package of 0.19.3 wraps the same graphs in subgraphs): every live node of the
official file is in the API twin under its own id, with its widget values (the seed aside) and its links,
except the sampler's model input, which goes through Chorus Sparse Attention to the official model.
"""

import importlib.util
import json
from pathlib import Path

import pytest

from example_workflows_tool import wan21_i2v_template_chorus, wan22_i2v_14b_template_chorus

CHORUS_TYPES = {"ChorusMaskBankLoader", "ChorusSimilarityMatch", "ChorusSparseAttention"}
NOTES = {"Note", "MarkdownNote"}
LIVE = 0  # LiteGraph's mode for a node that runs (4 is bypassed, 2 muted)
SEED_INPUTS = {"seed", "noise_seed"}  # "randomize" in the templates: each user's differs
OURS_ONLY = {"image"}  # LoadImage: the template ships its own example picture


def official_template(name: str) -> dict:
    spec = importlib.util.find_spec("comfyui_workflow_templates")
    path = Path(spec.submodule_search_locations[0]) / "templates" / name
    if not path.exists():
        pytest.fail(f"{path} is missing: this test reads the flat templates of comfyui-workflow-templates 0.1.95 "
                    "(the version ComfyUI 0.3.64 pins); run it in the suite's first venv")
    return json.loads(path.read_text())


def live_nodes(ui: dict) -> dict:
    return {str(n["id"]): n for n in ui["nodes"] if n.get("mode", LIVE) == LIVE and n["type"] not in NOTES}


def official_links(ui: dict, node: dict) -> dict:
    """input name -> [origin id, origin slot] for each linked input of a UI node."""
    by_id = {link[0]: link for link in ui["links"]}
    return {i["name"]: [str(by_id[i["link"]][1]), by_id[i["link"]][2]] for i in node["inputs"] if i.get("link")}


def through_chorus(prompt: dict, origin: list) -> list:
    """Follow a model link back through Chorus Sparse Attention to the model it patches."""
    while prompt[origin[0]]["class_type"] in CHORUS_TYPES:
        origin = prompt[origin[0]]["inputs"]["model"]
    return origin


@pytest.mark.parametrize("file, build", [("video_wan2_2_14B_i2v.json", wan22_i2v_14b_template_chorus),
                                         ("image_to_video_wan.json", wan21_i2v_template_chorus)],
                         ids=["wan22_i2v_14b", "wan21_i2v"])
def test_the_chorus_template_is_the_official_one_with_chorus_inserted(file, build):
    official, prompt = official_template(file), build()
    nodes = live_nodes(official)
    assert set(nodes) == {i for i, n in prompt.items() if n["class_type"] not in CHORUS_TYPES}
    for node_id, node in nodes.items():
        ours = prompt[node_id]
        assert ours["class_type"] == node["type"]
        links = {name: through_chorus(prompt, value) for name, value in ours["inputs"].items()
                 if isinstance(value, list)}
        assert links == official_links(official, node), node_id
        widgets = [v for name, v in ours["inputs"].items()
                   if not isinstance(v, list) and name not in SEED_INPUTS | OURS_ONLY]
        official_widgets = [v for v in node["widgets_values"] if v not in ("randomize", "fixed")]
        for value in widgets:
            assert any(value == w or (isinstance(w, float) and abs(value - w) < 1e-9) for w in official_widgets), \
                (node_id, node["type"], value, node["widgets_values"])
    samplers = [n for n in prompt.values() if n["class_type"] in ("KSampler", "KSamplerAdvanced")]
    assert samplers and all(prompt[s["inputs"]["model"][0]]["class_type"] == "ChorusSparseAttention" for s in samplers)
