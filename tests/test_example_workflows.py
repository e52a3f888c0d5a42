"""Every example workflow checks against a real server's /object_info; the API script runs."""

import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from example_workflows_tool import WORKFLOWS, api_to_ui
from workflows import chorus_i2v_prompt

pytestmark = pytest.mark.e2e
EXAMPLES = REPO_ROOT / "example_workflows"


@pytest.fixture(scope="module")
def object_info(comfy_server):
    return comfy_server.get_json("/object_info")


@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_ui_workflow_types_and_links_match_object_info(name, object_info):
    ui = json.loads((EXAMPLES / f"{name}.json").read_text())
    nodes = {node["id"]: node for node in ui["nodes"]}
    for node in ui["nodes"]:
        assert node["type"] in object_info, f"{name}: unknown node type {node['type']}"
    for link_id, origin, origin_slot, target, target_slot, kind in ui["links"]:
        origin_spec = object_info[nodes[origin]["type"]]
        assert origin_spec["output"][origin_slot] == kind, f"{name}: link {link_id} output type"
        target_input = nodes[target]["inputs"][target_slot]
        assert target_input["link"] == link_id
        accepted = target_input["type"].split(",")
        assert kind in accepted or "*" in accepted, f"{name}: link {link_id} {kind} into {target_input}"


@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_ui_file_is_derived_from_its_api_twin(name, object_info):
    api = json.loads((EXAMPLES / "api" / f"{name}_api.json").read_text())
    assert api == WORKFLOWS[name]()
    assert json.loads((EXAMPLES / f"{name}.json").read_text()) == api_to_ui(api, object_info)


@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_api_workflow_inputs_are_known_to_the_server(name, object_info):
    api = json.loads((EXAMPLES / "api" / f"{name}_api.json").read_text())
    for node_id, node in api.items():
        spec = object_info[node["class_type"]]["input"]
        known = {**spec.get("required", {}), **spec.get("optional", {})}
        assert set(node["inputs"]) <= set(known), f"{name} node {node_id}: {set(node['inputs']) - set(known)}"
        assert set(spec.get("required", {})) <= set(node["inputs"]), f"{name} node {node_id} misses required inputs"


def test_api_mode_example_script_uploads_submits_follows_and_reports(comfy_server, tmp_path):
    from PIL import Image

    image = tmp_path / "start.png"
    Image.new("RGB", (32, 32), (200, 40, 40)).save(image)
    workflow = chorus_i2v_prompt(bank="api_example_bank", prefix="api_example")
    workflow["9"] = {"class_type": "LoadImage", "inputs": {"image": "placeholder.png"}}
    workflow["10"] = {"class_type": "PreviewImage", "inputs": {"images": ["9", 0]}}
    path = tmp_path / "workflow_api.json"
    path.write_text(json.dumps(workflow))
    result = subprocess.run([sys.executable, str(EXAMPLES / "api" / "chorus_api_example.py"), "--server",
                             comfy_server.url, "--workflow", str(path), "--image", str(image)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"status": "success"' in result.stdout
    assert "step 4/4 miss sparse share per layer" in result.stdout
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["chorus"][0]["mode"] == "miss" and report["chorus"][0]["recorded_entry_id"]
