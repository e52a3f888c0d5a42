"""A real headless Chromium against ComfyUI's real frontend, served by the test server.

The Chorus nodes are in the node library, the example workflow loads, and a run queued
from the page shows the per-layer view with the numbers the server reported. A screenshot
is saved under tests/artifacts/.
"""

import json
import shutil
import time

import pytest

from conftest import REPO_ROOT
from example_workflows_tool import api_to_ui
from workflows import chorus_i2v_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.browser]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
APP = "(window.app ?? window.comfyAPI?.app?.app)"


@pytest.fixture(scope="module")
def browser(comfy_server):
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail("Debian's chromium and chromium-driver are needed: `make setup` installs them "
                    "(apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1600,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(240)
    try:
        driver.get(comfy_server.url + "/")
        _wait_for(driver, f"return !!{APP}?.graph && !!window.chorusReuseReports && !!window.LiteGraph?.registered_node_types?.KSampler", 120)
        yield driver
    finally:
        driver.quit()


def _wait_for(driver, script, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if driver.execute_script(script):
            return
        time.sleep(0.5)
    logs = driver.get_log("browser") if hasattr(driver, "get_log") else []
    raise TimeoutError(f"timed out waiting for: {script}\nbrowser log: {logs[-20:]}")


def test_chorus_nodes_are_in_the_node_library(browser, comfy_server):
    registered = browser.execute_script(
        "return Object.keys(LiteGraph.registered_node_types).filter(t => t.startsWith('Chorus')).sort()")
    served = sorted(name for name in comfy_server.get_json("/object_info") if name.startswith("Chorus"))
    assert registered == served
    assert {"ChorusMaskBankLoader", "ChorusSimilarityMatch", "ChorusSparseWanSampler"} <= set(registered)


def test_example_workflow_loads(browser):
    workflow = json.loads((REPO_ROOT / "example_workflows" / "chorus_wan21_i2v_480p.json").read_text())
    types = browser.execute_async_script(f"""
        const done = arguments[arguments.length - 1];
        {APP}.loadGraphData(arguments[0]).then(() => done({APP}.graph._nodes.map(n => n.type)));
    """, workflow)
    assert sorted(types) == sorted(node["type"] for node in workflow["nodes"])


def test_a_run_shows_the_per_layer_view_with_the_server_numbers(browser, comfy_server, artifacts_dir):
    object_info = comfy_server.get_json("/object_info")
    workflow = api_to_ui(chorus_i2v_prompt(bank="browser_bank", prefix="browser"), object_info)
    browser.execute_async_script(f"""
        const done = arguments[arguments.length - 1];
        {APP}.loadGraphData(arguments[0]).then(() => {APP}.queuePrompt(0, 1)).then(() => done(true));
    """, workflow)
    _wait_for(browser, "const r = window.chorusReuseReports.get('3'); return r && r.step === r.steps", 240)
    shown = browser.execute_script("return window.chorusReuseReports.get('3')")
    history = _latest_history_report(comfy_server)
    assert shown["mode"] == history["mode"] == "miss"
    assert shown["layers"] == history["layers"]
    on_node = browser.execute_script(f"return {APP}.graph.getNodeById(3).chorusReport")
    assert on_node["layers"] == history["layers"]
    _close_dialogs(browser)
    browser.execute_script(f"""
        const canvas = {APP}.canvas, node = {APP}.graph.getNodeById(3);
        canvas.ds.scale = 1.2;
        canvas.centerOnNode?.(node);
        {APP}.graph.setDirtyCanvas(true, true);
    """)
    time.sleep(1)
    browser.save_screenshot(str(artifacts_dir / "browser_reuse_view.png"))


def _close_dialogs(browser):
    """The first-run template browser covers the canvas; close it for the screenshot."""
    from selenium.webdriver.common.keys import Keys

    browser.execute_script("document.querySelectorAll('.p-dialog-close-button').forEach(b => b.click())")
    browser.find_element("tag name", "body").send_keys(Keys.ESCAPE)
    time.sleep(0.5)


def _latest_history_report(server):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        history = server.get_json("/history?max_items=1")
        for record in history.values():
            if record.get("status", {}).get("completed"):
                return record["outputs"]["3"]["chorus_report"][0]
        time.sleep(0.5)
    raise TimeoutError("the browser's prompt did not finish")
