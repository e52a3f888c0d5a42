"""Bad prompts posted to a real ComfyUI server: each problem is reported on the inputs its rule reads.

ComfyUI 0.3.64 shows a failed ``validate_inputs`` on every input the method takes, so each
node's method takes only the inputs of its rule: a one-input problem gives exactly one error on
that input, a two-input rule (min_density <= max_density, start <= end) one error on each of its
two inputs, the Mask Bank Loader's rule (which name, must it exist) one on each of its three,
and no other input of the node is marked. Rules that read inputs ComfyUI does not give to
validation (a linked value) are reported once when the node runs.
"""

import json
import urllib.error
import urllib.request

import pytest

from workflows import chorus_i2v_prompt

pytestmark = pytest.mark.e2e
LOADER, MATCH, SAMPLER = "5", "6", "3"


def _post(server, prompt):
    """POST /prompt; the parsed answer and the HTTP status."""
    request = urllib.request.Request(server.url + "/prompt", data=json.dumps({"prompt": prompt}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _errors(server, prompt):
    """{node id: [(input name, error type, details)]} from a refused prompt."""
    status, answer = _post(server, prompt)
    assert status == 400, f"the server accepted the prompt: {answer}"
    return {node_id: sorted((e["extra_info"].get("input_name"), e["type"], e["details"]) for e in entry["errors"])
            for node_id, entry in answer["node_errors"].items()}


def _prompt(bank="validation_bank"):
    return chorus_i2v_prompt(bank=bank)


def _with(changes: dict):
    """The test prompt with {"node.input": value} changes."""
    prompt = _prompt()
    for key, value in changes.items():
        node_id, name = key.split(".")
        prompt[node_id]["inputs"][name] = value
    return prompt


def test_min_density_above_max_density_is_reported_on_those_two_inputs_only(comfy_server):
    message = "min_density (0.7) must not exceed max_density (0.6)."
    assert _errors(comfy_server, _with({"3.min_density": 0.7, "3.max_density": 0.6})) == {SAMPLER: [
        ("max_density", "custom_validation_failed", f"max_density - {message}"),
        ("min_density", "custom_validation_failed", f"min_density - {message}"),
    ]}


def test_comfyui_still_range_checks_the_inputs_validate_inputs_does_not_take(comfy_server):
    # with **kwargs, ComfyUI skipped every min/max check of the node: top_p 3 went through
    assert _errors(comfy_server, _with({"3.top_p": 3.0, "6.threshold": 1.5})) == {
        SAMPLER: [("top_p", "value_bigger_than_max", "top_p")],
        MATCH: [("threshold", "value_bigger_than_max", "threshold")],
    }


def test_an_out_of_range_density_is_one_error_with_the_range(comfy_server):
    assert _errors(comfy_server, _with({"3.max_density": 1.5})) == {SAMPLER: [
        ("max_density", "custom_validation_failed",
         "max_density - max_density must be between 0.01 and 1 (a share of key blocks), got 1.5."),
        ("min_density", "custom_validation_failed",
         "min_density - max_density must be between 0.01 and 1 (a share of key blocks), got 1.5."),
    ]}


def test_block_size_is_one_error_on_block_size(comfy_server):
    message = ("block_size must be a power of two from 16 to 256 (16, 32, 64, 128, 256) for the GPU kernels; "
               "got 48.")
    assert _errors(comfy_server, _with({"6.block_size": 48})) == {MATCH: [
        ("block_size", "custom_validation_failed", f"block_size - {message}")]}


LOADER_INPUTS = ("bank", "new_bank_name", "read_only")  # the Loader's rule reads all three


def _loader_error(message):
    """A Loader problem as ComfyUI lists it: once under each input its rule reads (the web
    extension shows it once, see test_browser_reuse_view)."""
    return {LOADER: [(name, "custom_validation_failed", f"{name} - {message}") for name in LOADER_INPUTS]}


def test_block_size_offers_exactly_the_sizes_validation_accepts(comfy_server):
    spec = comfy_server.get_json("/object_info/ChorusSimilarityMatch")["ChorusSimilarityMatch"]
    kind, options = spec["input"]["required"]["block_size"]
    assert (kind, options["options"], options["default"]) == ("COMBO", [16, 32, 64, 128, 256], 128)
    for size in options["options"]:
        status, answer = _post(comfy_server, _with({"6.block_size": size, "3.max_density": 2.0}))
        assert set(answer["node_errors"]) == {SAMPLER}, size  # refused for max_density only


def test_a_block_size_sent_as_text_by_an_older_api_prompt_is_accepted(comfy_server):
    """block_size was an Int input: prompts written then may send "128"; ComfyUI converted it."""
    status, answer = _post(comfy_server, _with({"6.block_size": "32", "3.max_density": 2.0}))
    assert set(answer["node_errors"]) == {SAMPLER}  # refused for max_density only
    assert set(_errors(comfy_server, _with({"6.block_size": "48"}))) == {"6"}


def test_the_bank_combo_offers_only_names_the_loader_accepts(comfy_server):
    """A folder holding bank.sqlite under a name the Loader refuses is not offered."""
    root = comfy_server.base_dir / "models" / "chorus_banks"
    for name in (".hidden_bank", "offered_bank"):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "bank.sqlite").write_bytes(b"")
    spec = comfy_server.get_json("/object_info/ChorusMaskBankLoader")["ChorusMaskBankLoader"]
    offered = spec["input"]["required"]["bank"][1]["options"]
    assert "offered_bank" in offered and ".hidden_bank" not in offered


@pytest.mark.parametrize("name, message", [
    ("bad\x00name", "Chorus Mask Bank Loader: new_bank_name 'bad\\x00name' contains a NUL character, which no file "
                    "system allows in a folder name."),
    ("é" * 128, "Chorus Mask Bank Loader: new_bank_name is 256 bytes long; the file system allows at most 255. "
                "Use a shorter name."),
    ("../escape", "Chorus Mask Bank Loader: new_bank_name '../escape' must be a plain folder name (no path "
                  "separators, not starting with a dot); banks live in models/chorus_banks."),
    ("", "Chorus Mask Bank Loader: new_bank_name is empty. Enter the name of the bank to create (it is used when "
         "bank is '(create new bank)'), or pick an existing bank."),
], ids=["nul", "256-bytes", "path", "empty"])
def test_a_bad_new_bank_name_is_refused_with_the_loader_prefix(comfy_server, name, message):
    assert _errors(comfy_server, _with({"5.new_bank_name": name})) == _loader_error(message)


@pytest.mark.parametrize("bank", ["../etc", "/tmp/chorus_abs_bank", "not_a_bank_yet", ""])
def test_a_bank_combo_value_that_is_no_existing_bank_is_refused_and_nothing_is_created(comfy_server, bank):
    # ComfyUI 0.3.64 does not check a V3 combo's value: the Loader must.
    models = comfy_server.base_dir / "models"
    before = sorted(str(p.relative_to(models)) for p in models.rglob("*"))
    message = (f"Chorus Mask Bank Loader: bank {bank!r} is not an existing bank (a folder of models/chorus_banks "
               "holding bank.sqlite, or a named PostgreSQL bank). Pick one from the list, or '(create new bank)' "
               "and a new_bank_name.")
    assert _errors(comfy_server, _with({"5.bank": bank})) == _loader_error(message)
    assert sorted(str(p.relative_to(models)) for p in models.rglob("*")) == before
    assert not (models / "etc").exists() and not (comfy_server.base_dir / "etc").exists()


def test_a_linked_bank_name_is_checked_when_the_loader_runs_and_nothing_is_created(comfy_server):
    prompt = _prompt()
    prompt["20"] = {"class_type": "PrimitiveString", "inputs": {"value": "../linked_escape"}}
    prompt[LOADER]["inputs"]["new_bank_name"] = ["20", 0]
    errors = _execution_errors(comfy_server, prompt)
    assert [(e["node_id"], e["exception_message"].rstrip("\n")) for e in errors] == [
        (LOADER, "Chorus Mask Bank Loader: new_bank_name '../linked_escape' must be a plain folder name (no path "
                 "separators, not starting with a dot); banks live in models/chorus_banks.")]
    assert not (comfy_server.base_dir / "models" / "linked_escape").exists()


def test_a_255_byte_bank_name_passes_validation(comfy_server):
    prompt = _with({"5.new_bank_name": "é" * 127 + "a", "3.max_density": 2.0})
    assert set(_errors(comfy_server, prompt)) == {SAMPLER}  # refused for max_density only: the name is fine


def test_three_problems_in_three_nodes_give_exactly_their_errors(comfy_server):
    prompt = _with({"5.new_bank_name": "a/b", "6.block_size": 100, "3.min_density": 0.9})
    errors = _errors(comfy_server, prompt)
    assert {node_id: [e[0] for e in found] for node_id, found in errors.items()} == {
        LOADER: sorted(LOADER_INPUTS), MATCH: ["block_size"], SAMPLER: ["max_density", "min_density"]}


def test_guidance_and_feature_reuse_windows_are_reported_on_their_two_inputs(comfy_server):
    prompt = _prompt()
    prompt["17"] = {"class_type": "ChorusGuidanceEnhance", "inputs": {
        "model": ["1", 0], "method": "cross_attention", "strength": 0.1, "start": 0.8, "end": 0.2}}
    prompt["18"] = {"class_type": "ChorusFeatureReuse", "inputs": {
        "model": ["17", 0], "positive": ["2", 0], "latent": ["2", 2], "strength": 0.25, "cell": "1x2x2",
        "start_percent": 0.3, "end_percent": 1.5, "rim": 1, "blend": True}}
    prompt[SAMPLER]["inputs"]["model"] = ["18", 0]
    guidance = "start (0.8) must not be after end (0.2): both are fractions of the schedule, 0 to 1."
    reuse = "end_percent must be between 0 and 1 (a fraction of the sigma schedule), got 1.5."
    assert _errors(comfy_server, prompt) == {
        "17": [("end", "custom_validation_failed", f"end - {guidance}"),
               ("start", "custom_validation_failed", f"start - {guidance}")],
        "18": [("end_percent", "custom_validation_failed", f"end_percent - {reuse}"),
               ("start_percent", "custom_validation_failed", f"start_percent - {reuse}")],
    }


def _execution_errors(server, prompt):
    record = server.run_prompt(prompt, timeout=300)
    assert record["status"]["status_str"] == "error"
    return [data for kind, data in record["status"]["messages"] if kind == "execution_error"]


def test_malformed_dense_layers_fails_once_when_the_sampler_runs(comfy_server):
    errors = _execution_errors(comfy_server, _with({"3.dense_layers": "0, x"}))
    assert [(e["node_id"], e["exception_message"].rstrip("\n")) for e in errors] == [
        (SAMPLER, "dense_layers must be comma-separated block indices such as '0, 39', got '0, x'")]


def test_a_missing_read_only_bank_is_refused_at_validation(comfy_server):
    prompt = _with({"5.new_bank_name": "never_created_bank", "5.read_only": True})
    assert _errors(comfy_server, prompt) == _loader_error(
        "Chorus Mask Bank Loader: Bank 'never_created_bank' does not exist, so it cannot be opened read-only. "
        "Untick read_only to create it, or pick an existing bank.")
    assert not (comfy_server.base_dir / "models" / "chorus_banks" / "never_created_bank").exists()


def test_an_existing_bank_opens_read_only_by_its_combo_value_whatever_new_bank_name_says(comfy_server):
    comfy_server.run_prompt(_prompt(bank="validation_existing"), timeout=300)  # creates it
    prompt = _with({"5.bank": "validation_existing", "5.new_bank_name": "", "5.read_only": True})
    record = comfy_server.run_prompt(prompt, timeout=300)
    assert record["status"]["status_str"] == "success", record["status"]


def test_a_refused_prompt_reads_each_problem_once_in_the_clients_error(comfy_server):
    """Tried as a new user: ComfyUI's raw answer showed a two-input rule's message three times."""
    message = "max_density must be between 0.01 and 1 (a share of key blocks), got 1.5."
    with pytest.raises(RuntimeError) as refused:
        comfy_server.queue_prompt(_with({"3.max_density": 1.5}))
    text = str(refused.value)
    assert text.count(message) == 1, text
    assert f"node {SAMPLER} ChorusSparseWanSampler (input min_density, max_density): {message}" in text
    assert text.splitlines()[0] == "POST /prompt failed (400): Prompt outputs failed validation"


@pytest.mark.parametrize("body, shown", [("<html>502</html>", "<html>502</html>"), ("[1]", "[1]"),
                                         ('{"error": "no prompt"}', "no prompt")])
def test_an_answer_of_another_shape_is_shown_as_it_came(body, shown):
    from chorus_core.comfy.comfyui_process import describe_refusal

    assert describe_refusal(body) == shown
