"""A real headless Chromium against ComfyUI's real frontend, in the versions people run.

Three configurations: frontend 1.27.10 (what ComfyUI 0.3.64 pins), and the current 1.58.1
(served with ``--front-end-root``) with its default LiteGraph canvas and with its Vue node
renderer ("Nodes 2.0"). In each, the Chorus nodes are in the node library, every example
workflow loads with no node drawn larger than the file says, and a miss then a hit queued
from the page show the per-layer view with the numbers the server reported. Screenshots of
the view are saved under tests/artifacts/.
"""

import decimal
import json
import math
import shutil
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from example_workflows_tool import WORKFLOWS, api_to_ui
from test_official_templates import chorus_patch_of, runnable_wan22_template, template_server  # noqa: F401 (fixture)
from workflows import TINY_MODEL_NAME, chorus_i2v_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.browser]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
APP = "(window.app ?? window.comfyAPI?.app?.app)"
NEW_FRONTEND = "1.58.1"
# `make setup` installs it there (pip install --target), next to the venv's own 1.27.10.
NEW_FRONTEND_ROOT = Path(sys.prefix) / f"frontend-{NEW_FRONTEND}" / "comfyui_frontend_package" / "static"
CONFIGS = [("1.27.10", "canvas"), (NEW_FRONTEND, "canvas"), (NEW_FRONTEND, "vue")]
SAMPLER = "3"
SCRIPT_TIMEOUT_S, LOAD_TIMEOUT_S = 240, 90
# Which of the page's requests are still open, for the account of a load that hangs.
TRACK_PENDING_REQUESTS = """
window.chorusTestPending = new Set();
const chorusTestFetch = window.fetch;
window.fetch = function (input, init) {
    const label = (init?.method ?? 'GET') + ' ' + (input?.url ?? String(input));
    window.chorusTestPending.add(label);
    return chorusTestFetch.apply(this, arguments).finally(() => window.chorusTestPending.delete(label));
};
"""
# Node ids are numbers in 1.27.10 and may be strings in 1.58.1 (whose graphs can also hold subgraphs).
SAMPLER_NODE = f"({APP}.graph.getNodeById({SAMPLER}) ?? {APP}.graph.getNodeById('{SAMPLER}'))"


@pytest.fixture(scope="module")
def servers(comfy_server, tmp_path_factory):
    """One ComfyUI per frontend version; the pinned one is the shared session server."""
    started = {"1.27.10": comfy_server}
    yield lambda version: started.get(version) or started.setdefault(
        version, _start_new_frontend_server(comfy_server, tmp_path_factory))
    for version, server in started.items():
        if server is not comfy_server:
            server.stop()
            (Path(REPO_ROOT) / "tests" / "artifacts").mkdir(parents=True, exist_ok=True)
            (Path(REPO_ROOT) / "tests" / "artifacts" / f"comfyui_server_{version}.log").write_text(server.log_text())


def _start_new_frontend_server(comfy_server, tmp_path_factory):
    from chorus_core.comfy.comfyui_process import ComfyServer, prepare_base_directory

    if not (NEW_FRONTEND_ROOT / "index.html").is_file():
        pytest.fail(f"frontend {NEW_FRONTEND} is not installed at {NEW_FRONTEND_ROOT}: run `make setup`")
    base = prepare_base_directory(tmp_path_factory.mktemp(f"comfy_base_{NEW_FRONTEND}"))
    model = Path("models") / "diffusion_models" / TINY_MODEL_NAME
    shutil.copyfile(comfy_server.base_dir / model, base / model)
    return ComfyServer(base, comfyui=comfy_server.comfyui,
                       extra_args=("--front-end-root", str(NEW_FRONTEND_ROOT))).start()


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"{c[0]}-{c[1]}")
def page(request, servers):
    """A browser on the frontend and renderer of this configuration."""
    version, renderer = request.param
    server = servers(version)
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail("Debian's chromium and chromium-driver are needed: `make browser` installs them "
                    "(apt-get install chromium chromium-driver)")
    # Settings live on the server: no first-run template browser over the canvas, and the renderer.
    _set_setting(server, "Comfy.TutorialCompleted", True)
    _set_setting(server, "Comfy.VueNodes.Enabled", renderer == "vue")
    driver = _chromium()
    try:
        driver.get(server.url + "/")
        _wait_for(driver, f"return !!{APP}?.graph && !!window.chorusReuseReports && "
                          "!!window.LiteGraph?.registered_node_types?.KSampler", 120)
        served_version = driver.execute_script("return window.__COMFYUI_FRONTEND_VERSION__")
        assert served_version == version
        if renderer == "vue":
            _wait_for(driver, f"return {APP}.extensionManager.setting.get('Comfy.VueNodes.Enabled') === true", 30)
        yield driver, server, version, renderer
    finally:
        driver.quit()


def _chromium():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1600,1300"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(SCRIPT_TIMEOUT_S)
    # Selenium's own HTTP timeout (120 s) is shorter than a script's: a slow script would fail as an
    # opaque urllib3 ReadTimeoutError, and every later command would queue behind it.
    driver.command_executor.client_config.timeout = SCRIPT_TIMEOUT_S + 60
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": TRACK_PENDING_REQUESTS})
    return driver


def _set_setting(server, key, value):
    request = urllib.request.Request(f"{server.url}/settings/{key}", data=json.dumps(value).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


def _wait_for(driver, script, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if driver.execute_script(script):
            return
        time.sleep(0.5)
    logs = driver.get_log("browser") if hasattr(driver, "get_log") else []
    raise TimeoutError(f"timed out waiting for: {script}\nbrowser log: {logs[-20:]}")


def _load(driver, workflow):
    """The node types of the loaded graph. A load that hangs is retried once on a fresh page, with a
    warning that says what the page was waiting for; a second hang fails with the same account."""
    loaded = _load_once(driver, workflow)
    assert "error" not in loaded, f"the frontend refused the workflow: {loaded['error']}"
    if "hung" not in loaded:
        return loaded["types"]
    warnings.warn(f"loading a workflow hung; retrying on a reloaded page: {loaded}")
    driver.refresh()
    _wait_for(driver, f"return !!{APP}?.graph && !!window.chorusReuseReports", 120)
    loaded = _load_once(driver, workflow)
    assert "hung" not in loaded, f"loading the workflow hung twice: {loaded}"
    return loaded["types"]


def _load_once(driver, workflow):
    return driver.execute_async_script(f"""
        const done = arguments[arguments.length - 1];
        const types = () => {APP}.graph._nodes.map(n => n.type);
        const timer = setTimeout(() => done({{hung: {LOAD_TIMEOUT_S}, types: types(),
                                               pending: [...(window.chorusTestPending ?? [])]}}),
                                 {LOAD_TIMEOUT_S * 1000});
        {APP}.loadGraphData(arguments[0]).then(() => {{ clearTimeout(timer); done({{types: types()}}); }},
                                               (error) => {{ clearTimeout(timer); done({{types: [], error: String(error)}}); }});
    """, workflow)


def test_chorus_nodes_are_in_the_node_library(page):
    driver, server, _, _ = page
    registered = driver.execute_script(
        "return Object.keys(LiteGraph.registered_node_types).filter(t => t.startsWith('Chorus')).sort()")
    served = sorted(name for name in server.get_json("/object_info") if name.startswith("Chorus"))
    assert registered == served
    assert {"ChorusMaskBankLoader", "ChorusSimilarityMatch", "ChorusSparseWanSampler"} <= set(registered)


@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_example_workflow_loads_and_every_node_fits_its_rectangle(page, name):
    """The files' sizes are the frontend's own: no widget spills out of a node onto another."""
    driver, _, _, renderer = page
    workflow = json.loads((REPO_ROOT / "example_workflows" / f"{name}.json").read_text())
    assert sorted(_load(driver, workflow)) == sorted(node["type"] for node in workflow["nodes"])
    if renderer == "vue":
        return  # Vue nodes size themselves from their DOM; the canvas renderers measure below
    needed = driver.execute_script(f"return {APP}.graph._nodes.map(n => [Number(n.id), n.computeSize()])")
    stored = {node["id"]: node["size"] for node in workflow["nodes"]}
    too_small = {node_id: (size, stored[node_id]) for node_id, size in needed
                 if size[0] > stored[node_id][0] + 0.5 or size[1] > stored[node_id][1] + 0.5}
    assert too_small == {}


def test_a_miss_then_a_hit_show_the_per_layer_view_with_the_server_numbers(page, artifacts_dir):
    driver, server, version, renderer = page
    bank = f"browser_{version.replace('.', '_')}_{renderer}"
    workflow = api_to_ui(chorus_i2v_prompt(bank=bank, prefix=bank), server.get_json("/object_info"))
    _load(driver, workflow)

    miss = _queue_and_wait(driver, server)
    assert miss["mode"] == "miss" and miss["mask_source"] == "online prediction" and miss["recorded_entry_id"]
    view = _shown_view(driver)
    assert view["kind"] == "online" and view["badge"] == "MISS · online"
    assert view["entry"] == "bank: no entries yet to match"
    _assert_layers_and_density(view, miss)

    hit = _queue_and_wait(driver, server)
    assert hit["mode"] == "hit" and hit["entry_id"] == miss["recorded_entry_id"]
    view = _shown_view(driver)
    assert view["kind"] == "hit" and view["badge"] == "HIT"
    assert view["entry"] == f"entry {hit['entry_id'][:12]}… · similarity {hit['similarity']:.3f}"
    _assert_layers_and_density(view, hit)
    on_node = driver.execute_script(f"return {SAMPLER_NODE}.chorusReport")
    assert on_node["layers"] == hit["layers"]
    _assert_each_bar_answers_the_pointer_with_its_tooltip(driver, hit)
    _screenshot_view(driver, artifacts_dir / f"browser_reuse_view_{version}_{renderer}.png")


def _queue_and_wait(driver, server):
    before = set(server.get_json("/history"))
    driver.execute_script(f"window.chorusReuseReports.delete('{SAMPLER}'); {APP}.queuePrompt(0, 1)")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        for prompt_id, record in server.get_json("/history").items():
            if prompt_id not in before and record.get("status", {}).get("completed"):
                report = record["outputs"][SAMPLER]["chorus_report"][0]
                _wait_for(driver, f"const r = window.chorusReuseReports.get('{SAMPLER}'); "
                                  "return !!r && r.step === r.steps && r.mask_source !== undefined", 30)
                return report
            if prompt_id not in before and record.get("status", {}).get("status_str") == "error":
                raise AssertionError(f"the page's prompt failed: {record['status']}")
        time.sleep(0.5)
    raise TimeoutError("the page's prompt did not finish")


def _shown_view(driver):
    """What the sampler's view shows, read from its DOM."""
    return driver.execute_script(f"""
        const view = {SAMPLER_NODE}.chorusView;
        const text = (sel) => view.querySelector(sel).textContent;
        return {{kind: view.dataset.kind, badge: text('.chorus-badge'), entry: text('.chorus-entry'),
                 step: text('.chorus-step'), density: text('.chorus-density'), saved: text('.chorus-saved'),
                 bars: [...view.querySelectorAll('.chorus-bar')].map(b => [b.dataset.layer, b.style.height]),
                 labels: [...view.querySelectorAll('.chorus-label')].map(l => l.textContent),
                 connected: view.isConnected, shown: view.getBoundingClientRect().height > 0}};
    """)


def _percent(value):
    return math.floor(value * 100 + 0.5)


def _fixed2(value):
    """``value.toFixed(2)`` as the browser writes it: the float's exact value, ties away from zero
    (Python's format rounds an exact tie such as 0.125 to even: 0.12, where the view shows 0.13)."""
    return str(decimal.Decimal(value).quantize(decimal.Decimal("0.01"), rounding=decimal.ROUND_HALF_UP))


def _assert_layers_and_density(view, report):
    assert view["connected"] and view["shown"], "the view is not in the page"
    layers = report["layers"]
    kept = [row["density"] if row["sparse_share"] > 0 and row["density"] is not None else 1.0 for row in layers]
    assert view["bars"] == [[f"L{row['layer']}", f"{max(2, _percent(k))}%"] for row, k in zip(layers, kept)]
    assert view["labels"] == [f"L{row['layer']}" for row in layers]  # the tiny model's 2 layers: all labelled
    assert view["step"] == f"step {report['steps']}/{report['steps']}"
    density = sum(kept) / len(kept)
    sparse = [row["density"] for row in layers if row["sparse_share"] > 0 and row["density"] is not None]
    max_density = 0.6  # chorus_i2v_prompt's; the tiny model keeps it on every layer: capped
    capped = bool(sparse) and max(sparse) - min(sparse) < 0.005 and min(sparse) > max_density - 0.1
    cap = ", capped by max_density" if capped else ""
    assert view["density"] == f"kept density {_percent(density)}% (warm-up excluded){cap}"
    timings = report["timings"]  # the run's own step times: its sparse steps against its dense warm-up
    if "dense_step_s" not in timings:  # a hit sparse from step 0: timed against the recording miss's dense step
        assert report["mode"] == "hit" and report["dense_steps"] == {}
        dense, which = timings["earlier_dense_step_s"], "an earlier run's dense step"
    else:
        dense, which = timings["dense_step_s"], "dense step"
    change = 1 - timings["sparse_step_s"] / dense
    verdict = f"{_percent(change)}% faster" if change >= 0 else f"{_percent(-change)}% slower"
    assert view["saved"] == f"sparse step {_fixed2(timings['sparse_step_s'])} s vs {which} {_fixed2(dense)} s: {verdict}"


def _assert_each_bar_answers_the_pointer_with_its_tooltip(driver, report):
    """What is under the pointer at each bar's centre is that bar, so its title shows on hover."""
    driver.execute_script(f"""
        const canvas = {APP}.canvas, node = {SAMPLER_NODE};
        canvas.ds.scale = 1.0;
        canvas.ds.offset = [200 - node.pos[0], 200 - node.pos[1]];
        {APP}.graph.setDirtyCanvas(true, true);
    """)
    time.sleep(1.5)
    under = driver.execute_script(f"""
        return [...{SAMPLER_NODE}.chorusView.querySelectorAll('.chorus-bar')].map(bar => {{
            const r = bar.getBoundingClientRect();
            const hit = document.elementFromPoint((r.left + r.right) / 2, r.bottom - 1);
            return [bar.dataset.layer, hit === bar, bar.title];
        }});
    """)
    assert [(layer, hit) for layer, hit, _ in under] == [(f"L{row['layer']}", True) for row in report["layers"]]
    assert all(title.startswith(f"layer {row['layer']}: ") for (_, _, title), row in zip(under, report["layers"]))


def _screenshot_view(driver, path):
    """The sampler node around its view, cropped from a full-window screenshot."""
    from PIL import Image

    driver.execute_script(f"""
        const canvas = {APP}.canvas, node = {SAMPLER_NODE};
        canvas.ds.scale = 1.0;
        canvas.ds.offset = [200 - node.pos[0], 700 - node.pos[1] - node.size[1]];
        {APP}.graph.setDirtyCanvas(true, true);
    """)
    time.sleep(1.5)
    full = path.with_suffix(".full.png")
    driver.save_screenshot(str(full))
    box = driver.execute_script(f"""
        const r = {SAMPLER_NODE}.chorusView.getBoundingClientRect();
        return [r.left, r.top, r.right, r.bottom, window.devicePixelRatio];
    """)
    left, top, right, bottom, ratio = box
    with Image.open(full) as image:
        crop = image.crop(tuple(round(v * ratio) for v in (left - 24, top - 240, right + 24, bottom + 16)))
        crop.save(path, optimize=True)
    full.unlink()


def test_the_view_is_as_tall_as_it_asks_and_block_size_offers_only_allowed_sizes(page):
    """The Vue renderer squashed the view to a strip; block_size offered sizes validation refuses."""
    driver, server, _, _ = page
    _load(driver, api_to_ui(chorus_i2v_prompt(bank="browser_layout", prefix="browser_layout"),
                            server.get_json("/object_info")))
    _wait_for(driver, f"return !!{SAMPLER_NODE}.chorusView?.isConnected", 30)
    time.sleep(1.0)  # one frame of the renderer's layout
    shown = driver.execute_script(f"""
        const view = {SAMPLER_NODE}.chorusView;
        const chain = [];
        for (let el = view; el && chain.length < 6; el = el.parentElement)
          chain.push([el.className.slice(0, 60), el.offsetHeight, getComputedStyle(el).display,
                      getComputedStyle(el).flexShrink]);
        const match = {APP}.graph.getNodeById(6) ?? {APP}.graph.getNodeById('6');
        const widget = match.widgets.find(w => w.name === 'block_size');
        // offsetHeight: the layout's height, before the canvas zoom scales what is drawn
        return {{height: view.offsetHeight, chain,
                 options: widget.options.values, type: widget.type}};
    """)
    assert abs(shown["height"] - 132) <= 1, shown["chain"]
    assert (shown["type"], shown["options"]) == ("combo", [16, 32, 64, 128, 256])


@pytest.mark.parametrize("change, node, inputs", [
    ({"5.new_bank_name": "a/b"}, "5", ["new_bank_name"]),
    ({"3.min_density": 0.7, "3.max_density": 0.6}, "3", ["min_density"]),
], ids=["bank-name", "density-order"])
def test_the_page_lists_a_chorus_validation_problem_once(page, change, node, inputs):
    """ComfyUI lists it under every input the rule reads; the page the user reads shows it once."""
    driver, _, _, _ = page
    prompt = chorus_i2v_prompt(bank="browser_errors", prefix="browser_errors")
    for key, value in change.items():
        node_id, name = key.split(".")
        prompt[node_id]["inputs"][name] = value
    errors = driver.execute_async_script("""
        const done = arguments[arguments.length - 1];
        const api = window.comfyAPI.api.api;
        api.queuePrompt(0, {output: arguments[0], workflow: {}})
            .then((answer) => done({answered: answer?.node_errors ?? null}))
            .catch((error) => done(error?.response?.node_errors ?? {thrown: String(error)}));
    """, prompt)
    assert list(errors) == [node], errors
    assert [e["extra_info"]["input_name"] for e in errors[node]["errors"]] == inputs


def test_the_official_wan22_template_shows_both_experts_runs(template_server, artifacts_dir):
    """ComfyUI's Wan 2.2 14B I2V template with Chorus on each expert (tiny fp8_scaled stand-ins), queued
    from the page twice: each expert's Chorus Sparse Attention node shows its own miss, then its own hit."""
    _set_setting(template_server, "Comfy.TutorialCompleted", True)
    prompt = runnable_wan22_template(template="pan", subject=7, layout=2, seed=9, bank="browser_official")
    experts = {expert: chorus_patch_of(prompt, expert) for expert in ("high", "low")}
    driver = _chromium()
    try:
        driver.get(template_server.url + "/")
        _wait_for(driver, f"return !!{APP}?.graph && !!window.chorusReuseReports && "
                          "!!window.LiteGraph?.registered_node_types?.KSampler", 120)
        _load(driver, api_to_ui(prompt, template_server.get_json("/object_info")))
        misses = _queue_and_wait_for(driver, template_server, list(experts.values()))
        hits = _queue_and_wait_for(driver, template_server, list(experts.values()))
        for expert, node in experts.items():
            miss, hit = misses[node], hits[node]
            assert miss["mode"] == "miss" and hit["mode"] == "hit" and hit["entry_id"] == miss["recorded_entry_id"]
            view = _shown_view_of(driver, node)
            assert (view["kind"], view["badge"]) == ("hit", "HIT"), expert
            assert view["entry"] == f"entry {hit['entry_id'][:12]}… · similarity {hit['similarity']:.3f}"
        assert misses[experts["high"]]["recorded_entry_id"] != misses[experts["low"]]["recorded_entry_id"]
        driver.save_screenshot(str(artifacts_dir / "browser_official_wan22_template.png"))
    finally:
        driver.quit()


def _queue_and_wait_for(driver, server, nodes):
    """Queue the page's graph; each listed Chorus node's report once the page has shown its last step."""
    before = set(server.get_json("/history"))
    driver.execute_script("arguments[0].forEach(n => window.chorusReuseReports.delete(n)); "
                          f"{APP}.queuePrompt(0, 1)", nodes)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        for prompt_id, record in server.get_json("/history").items():
            if prompt_id not in before and record.get("status", {}).get("completed"):
                for node in nodes:
                    _wait_for(driver, f"const r = window.chorusReuseReports.get('{node}'); "
                                      "return !!r && r.step === r.steps && r.mask_source !== undefined", 30)
                return {node: driver.execute_script(f"return window.chorusReuseReports.get('{node}')")
                        for node in nodes}
            if prompt_id not in before and record.get("status", {}).get("status_str") == "error":
                raise AssertionError(f"the page's prompt failed: {record['status']}")
        time.sleep(0.5)
    raise TimeoutError("the page's prompt did not finish")


def _shown_view_of(driver, node):
    return driver.execute_script(f"""
        const view = ({APP}.graph.getNodeById({node}) ?? {APP}.graph.getNodeById('{node}')).chorusView;
        const text = (sel) => view.querySelector(sel).textContent;
        return {{kind: view.dataset.kind, badge: text('.chorus-badge'), entry: text('.chorus-entry')}};
    """)
