"""Every example workflow checks against a real server's /object_info; the API script runs."""

import json
import subprocess
import sys
import urllib.request

import pytest

from conftest import REPO_ROOT
from example_workflows_tool import (NOTE_TYPE, SAMPLER_TYPES, TEMPLATES, TESTBED_MODEL, TITLE_HEIGHT, WORKFLOWS,
                                    api_to_ui, sizes_of)
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
        assert node["type"] in object_info or node["type"] == NOTE_TYPE, f"{name}: unknown node type {node['type']}"
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
    ui = json.loads((EXAMPLES / f"{name}.json").read_text())
    assert ui == without_outputs_added_since(api_to_ui(api, object_info, sizes_of(ui), TEMPLATES[name]), ui)


def without_outputs_added_since(derived: dict, committed: dict) -> dict:
    """``derived`` less the unlinked outputs a newer ComfyUI appended to a node (0.19.3's PreviewAny has a
    STRING output that 0.3.64's, which the files are derived with, lacks); the frontend adds those itself
    when it loads the file, and every widget and link stays where it was."""
    kept = {node["id"]: len(node["outputs"]) for node in committed["nodes"]}
    nodes = []
    for node in derived["nodes"]:
        extra = node["outputs"][kept.get(node["id"], len(node["outputs"])):]
        assert all(not output["links"] for output in extra), (node["type"], extra)
        nodes.append({**node, "outputs": node["outputs"][:len(node["outputs"]) - len(extra)]})
    return {**derived, "nodes": nodes}


def _rectangles(ui):
    """Each node's rectangle on the canvas, title bar included (LiteGraph draws it above pos)."""
    return {node["id"]: (node["pos"][0], node["pos"][1] - TITLE_HEIGHT,
                         node["pos"][0] + node["size"][0], node["pos"][1] + node["size"][1]) for node in ui["nodes"]}


@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_no_two_nodes_overlap_and_outputs_sit_beside_the_sampler(name, object_info):
    ui = json.loads((EXAMPLES / f"{name}.json").read_text())
    boxes = _rectangles(ui)
    overlapping = [(a, b) for a in boxes for b in boxes if a < b and boxes[a][0] < boxes[b][2] and boxes[b][0] < boxes[a][2]
                   and boxes[a][1] < boxes[b][3] and boxes[b][1] < boxes[a][3]]
    assert overlapping == []
    sampler = next(node["id"] for node in ui["nodes"] if node["type"] in SAMPLER_TYPES)
    outputs = [node["id"] for node in ui["nodes"] if object_info.get(node["type"], {}).get("output_node")]
    assert outputs  # the official templates have SaveVideo alone; the others a summary preview too
    assert [n for n in outputs if boxes[n][0] < boxes[sampler][2]] == []  # right of the sampler, not on it


@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_every_template_has_a_thumbnail_the_server_serves(name, comfy_server):
    """ComfyUI's template browser asks for <name>.jpg next to <name>.json."""
    from PIL import Image

    thumbnail = EXAMPLES / f"{name}.jpg"
    with Image.open(thumbnail) as image:
        assert image.format == "JPEG" and image.width == 512 and 150 <= image.height <= 512
    with urllib.request.urlopen(f"{comfy_server.url}/api/workflow_templates/chorus/{name}.jpg", timeout=30) as response:
        assert response.headers["Content-Type"] == "image/jpeg"
        assert response.read() == thumbnail.read_bytes()


@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_every_template_carries_its_title_and_description_in_a_note(name):
    """The template browser shows only the file name: the graph says what it is and what it needs."""
    ui = json.loads((EXAMPLES / f"{name}.json").read_text())
    notes = [node for node in ui["nodes"] if node["type"] == NOTE_TYPE]
    title, description = TEMPLATES[name]
    assert [(note["title"], note["widgets_values"]) for note in notes] == [(title, [f"## {title}\n\n{description}"])]
    assert len(set(title for title, _ in TEMPLATES.values())) == len(TEMPLATES)


def test_the_guidance_example_leaves_feature_reuse_off():
    """The README: Feature Reuse costs quality and is off by default; the example must not turn it on."""
    api = json.loads((EXAMPLES / "api" / "chorus_wan21_i2v_480p_guidance_feature_reuse_api.json").read_text())
    reuse = [node for node in api.values() if node["class_type"] == "ChorusFeatureReuse"]
    assert [node["inputs"]["strength"] for node in reuse] == [0.0]


def test_the_testbed_template_runs_on_the_built_in_model_a_miss_then_a_hit(comfy_server):
    import shutil

    shutil.copyfile(REPO_ROOT / "tests" / "testbed" / TESTBED_MODEL,
                    comfy_server.base_dir / "models" / "diffusion_models" / TESTBED_MODEL)
    api = json.loads((EXAMPLES / "api" / "chorus_testbed_check_install_api.json").read_text())
    api["5"]["inputs"]["new_bank_name"] = "example_testbed_check"  # a bank of this test only
    reports = []
    for _ in range(2):
        record = comfy_server.run_prompt(api, timeout=300)
        assert record["status"]["status_str"] == "success", record["status"]
        reports.append(record["outputs"]["3"]["chorus_report"][0])
    assert reports[0]["mode"] == "miss" and reports[0]["recorded_entry_id"]
    assert reports[1]["mode"] == "hit" and reports[1]["entry_id"] == reports[0]["recorded_entry_id"]


def test_the_template_browser_lists_exactly_the_ui_workflows(comfy_server):
    assert sorted(comfy_server.get_json("/workflow_templates")["chorus"]) == sorted(WORKFLOWS)


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


@pytest.mark.parametrize("change, header, message", [
    ({"min_density": 0.7, "max_density": 0.6}, "error: the server refused the workflow:",
     "node 3 (ChorusSparseWanSampler): Custom validation failed for node: min_density - min_density (0.7) must not "
     "exceed max_density (0.6)."),
    ({"dense_layers": "0, x"}, "error: the workflow failed on the server: ",
     "node 3 (ChorusSparseWanSampler) failed: dense_layers must be comma-separated block indices such as '0, 39', "
     "got '0, x'"),
], ids=["refused", "failed"])
def test_api_mode_example_script_prints_the_server_errors_and_exits_non_zero(comfy_server, tmp_path, change, header,
                                                                           message):
    workflow = chorus_i2v_prompt(bank="api_example_errors", prefix="api_example_errors")
    workflow["3"]["inputs"].update(change)
    path = tmp_path / "bad_api.json"
    path.write_text(json.dumps(workflow))
    result = subprocess.run([sys.executable, str(EXAMPLES / "api" / "chorus_api_example.py"), "--server",
                             comfy_server.url, "--workflow", str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(header)
    assert message in [line.strip() for line in result.stderr.replace(header, "").splitlines()]
    assert "Traceback" not in result.stderr and "HTTP Error 400" not in result.stderr
