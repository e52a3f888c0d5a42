"""The per-layer view follows a queued recording past its report: recorded, or failed and why.

A run's report is sent before its recording is written (the background writer), so what the
report says is "queued"; the view then polls ``/chorus/api/recordings/<id>`` until the write has
settled. A real server (its writer slowed by the test-only ``CHORUS_TEST_ONLY_WRITER_DELAY_S``,
so the page certainly sees "queued" first) and a real Chromium on the pinned frontend. The
failure is a real one: the recording's model file is deleted after the report, before the write.
"""

import shutil
import time

import pytest

from example_workflows_tool import api_to_ui
from test_browser_reuse_view import APP, CHROMEDRIVER, CHROMIUM, SAMPLER, SAMPLER_NODE, _chromium, _load, \
    _set_setting, _wait_for
from workflows import TINY_MODEL_NAME, chorus_i2v_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.browser]
WRITER_DELAY_S = 6  # the report is on the page well before the write; the view polls every 2 s
DOOMED_MODEL = "chorus_tiny_doomed.safetensors"  # deleted after its run's report


@pytest.fixture(scope="module")
def slow_writer_page(comfy_server, tmp_path_factory):
    from chorus_core.comfy.comfyui_process import ComfyServer, prepare_base_directory

    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail("Debian's chromium and chromium-driver are needed: `make browser` installs them")
    base = prepare_base_directory(tmp_path_factory.mktemp("recording_state_base"))
    for name in (TINY_MODEL_NAME, DOOMED_MODEL):
        shutil.copyfile(comfy_server.base_dir / "models" / "diffusion_models" / TINY_MODEL_NAME,
                        base / "models" / "diffusion_models" / name)
    server = ComfyServer(base, comfyui=comfy_server.comfyui,
                         env={"CHORUS_TEST_ONLY_WRITER_DELAY_S": str(WRITER_DELAY_S)}).start()
    driver = None
    try:
        _set_setting(server, "Comfy.TutorialCompleted", True)
        driver = _chromium()
        driver.get(server.url + "/")
        _wait_for(driver, f"return !!{APP}?.graph && !!window.chorusReuseReports && "
                          "!!window.LiteGraph?.registered_node_types?.KSampler", 120)
        yield driver, server
    finally:
        if driver is not None:
            driver.quit()
        server.stop()


def test_the_view_follows_a_queued_recording_to_recorded_and_to_failed(slow_writer_page):
    driver, server = slow_writer_page
    model_file = server.base_dir / "models" / "diffusion_models" / DOOMED_MODEL

    kept = _run_from_page(driver, server, chorus_i2v_prompt(bank="state_kept", steps=2))
    assert _recording_line(driver) == f"recording {kept[:12]}… queued: on disk, going into the bank"
    _wait_for_line(driver, f"recorded as entry {kept[:12]}…")

    doomed = _run_from_page(driver, server, chorus_i2v_prompt(bank="state_doomed", steps=2, model=DOOMED_MODEL),
                            after_report=model_file.unlink)
    assert _recording_line(driver) == f"recording {doomed[:12]}… queued: on disk, going into the bank"
    _wait_for_line(driver, f"recording {doomed[:12]}… failed: its model's files were deleted, so no request "
                           "could use it; dropped")
    assert server.get_json(f"/chorus/api/recordings/{doomed}")["state"] == "failed"
    assert server.get_json(f"/chorus/api/recordings/{kept}")["state"] == "recorded"


def _run_from_page(driver, server, prompt, after_report=None) -> str:
    """Queue ``prompt`` from the page; ``after_report`` runs as soon as the server has answered
    (before the slowed writer writes); the recorded entry id once the page shows the report."""
    _load(driver, api_to_ui(prompt, server.get_json("/object_info")))
    before = set(server.get_json("/history"))
    driver.execute_script(f"window.chorusReuseReports.delete('{SAMPLER}'); {APP}.queuePrompt(0, 1)")
    report = _report_when_done(server, before)
    if after_report is not None:
        after_report()
    _wait_for(driver, f"const r = window.chorusReuseReports.get('{SAMPLER}'); "
                      f"return !!r && r.recorded_entry_id === '{report['recorded_entry_id']}'", 30)
    assert report["recording"] == "queued", report
    return report["recorded_entry_id"]


def _report_when_done(server, before: set, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for prompt_id, record in server.get_json("/history").items():
            status = record.get("status", {})
            if prompt_id not in before and status.get("completed"):
                return record["outputs"][SAMPLER]["chorus_report"][0]
            if prompt_id not in before and status.get("status_str") == "error":
                raise AssertionError(f"the page's prompt failed: {status}")
        time.sleep(0.2)
    raise TimeoutError("the page's prompt did not finish")


def _recording_line(driver) -> str:
    return driver.execute_script(f"return {SAMPLER_NODE}.chorusView.querySelector('.chorus-recording').textContent")


def _wait_for_line(driver, expected: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (shown := _recording_line(driver)) != expected:
        assert time.monotonic() < deadline, f"the view still says {shown!r}, not {expected!r}"
        time.sleep(0.25)
