"""End to end: a real ComfyUI server loads the pack and runs a tiny Wan2.1 I2V sampling."""


import pytest

from workflows import tiny_i2v_prompt

pytestmark = pytest.mark.e2e


def test_startup_log_shows_the_pack_imported(comfy_server):
    log = comfy_server.log_text()
    import_lines = [line for line in log.splitlines() if "custom_nodes" in line and "chorus" in line]
    assert import_lines, f"pack not listed in the import times:\n{comfy_server.log_tail()}"
    assert not any("IMPORT FAILED" in line for line in import_lines), "\n".join(import_lines)
    # ComfyUI's own audio nodes may fail without torchaudio; no failure may involve the pack
    pack_failures = [line for line in log.splitlines()
                     if ("Cannot import" in line or 'File "' in line) and "custom_nodes/chorus" in line]
    assert not pack_failures, "\n".join(pack_failures)
    assert "is untested; Chorus was tested on ComfyUI" not in log  # both pinned releases are tested ones


def test_pack_nodes_are_listed_in_object_info(comfy_server):
    info = comfy_server.get_json("/object_info/ChorusTestbedRequest")["ChorusTestbedRequest"]
    assert info["category"] == "Chorus/testbed"
    assert info["output_name"] == ["positive", "negative", "latent", "clip_vision_output", "start_latent"]


def test_real_tiny_wan_i2v_sampling_through_prompt(comfy_server):
    record = comfy_server.run_prompt(tiny_i2v_prompt(prefix="foundation"), timeout=300)
    assert record["status"]["status_str"] == "success", record["status"]
    saved = record["outputs"]["4"]["latents"][0]
    path = comfy_server.base_dir / "output" / saved["subfolder"] / saved["filename"]
    assert path.exists() and path.stat().st_size > 16 * 5 * 16 * 16 * 2
    from safetensors.torch import load_file

    latent = load_file(str(path))["latent_tensor"]
    assert tuple(latent.shape) == (1, 16, 5, 16, 16)
    assert latent.isfinite().all() and latent.std() > 0
