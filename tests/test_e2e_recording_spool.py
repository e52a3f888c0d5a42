"""A real ComfyUI server stopped while a recording is queued: nothing a report called queued is lost.

Each server runs with the writer slowed down (the test-only ``CHORUS_TEST_ONLY_WRITER_DELAY_S``),
so the recording is certainly still queued when the signal arrives. SIGTERM and SIGINT drain
for at most ``CHORUS_DRAIN_SECONDS`` (2 s here) and leave the rest spooled; SIGKILL leaves it
spooled; the next server to start replays every bank: each entry is in its bank exactly once. The same
restart drops a recording whose model file was deleted meanwhile and quarantines a damaged
spool file. A server whose writer is quick enough drains within the bound before it exits.
"""

import os
import shutil
import signal
import time
import uuid

import pytest

from chorus_core.bank import MaskBank
from chorus_core.comfy.comfyui_process import ComfyServer, prepare_base_directory
from workflows import TINY_MODEL_NAME, chorus_i2v_prompt

pytestmark = pytest.mark.e2e
DELAY_ENV = "CHORUS_TEST_ONLY_WRITER_DELAY_S"
DRAIN_S = 2.0
COPY_MODEL = "chorus_tiny_copy.safetensors"  # deleted before the restart


def bank_dir(base, name):
    return base / "models" / "chorus_banks" / name


def entry_ids(base, name) -> list[str]:
    if not (bank_dir(base, name) / "bank.sqlite").exists():
        return []
    with MaskBank.open(bank_dir(base, name), read_only=True) as bank:
        return [row["id"] for row in bank.entries()]


def record_one(server, bank, model=TINY_MODEL_NAME) -> str:
    """A recording miss; returns its entry id once the report says it is queued (spooled)."""
    record = server.run_prompt(chorus_i2v_prompt(bank=bank, steps=2, model=model), timeout=300)
    assert record["status"]["status_str"] == "success", record["status"]
    report = record["outputs"]["3"]["chorus_report"][0]
    assert report["recording"] == "queued", report
    entry = report["recorded_entry_id"]
    assert (bank_dir(server.base_dir, bank) / "spool" / f"{entry}.spool").is_file()  # on disk before the report
    return entry


def stop_with(server, signum) -> float:
    """Send ``signum`` to ComfyUI itself; the seconds until it exited."""
    started = time.monotonic()
    os.kill(server.process.pid, signum)
    server.process.wait(timeout=60)
    return time.monotonic() - started


def server_for(base, comfyui_path, delay: float) -> ComfyServer:
    return ComfyServer(base, comfyui=comfyui_path, env={DELAY_ENV: str(delay), "CHORUS_DRAIN_SECONDS": str(DRAIN_S)})


@pytest.fixture(scope="module")
def base(tmp_path_factory, comfy_server):
    """A base directory of its own (the tiny model copied from the shared server's)."""
    folder = prepare_base_directory(tmp_path_factory.mktemp("spool_base"))
    model = comfy_server.base_dir / "models" / "diffusion_models" / TINY_MODEL_NAME
    for name in (TINY_MODEL_NAME, COPY_MODEL):
        shutil.copyfile(model, folder / "models" / "diffusion_models" / name)
    return folder


@pytest.fixture(scope="module")
def stopped_then_restarted(base, comfyui_path):
    """Three servers stopped by SIGTERM, SIGINT and SIGKILL with recordings queued, then one restart."""
    found = {"entries": {}, "seconds": {}, "logs": {}, "after_stop": {}}
    for signum, banks in ((signal.SIGTERM, ["term"]), (signal.SIGINT, ["int"]), (signal.SIGKILL, ["kill", "gone"])):
        server = server_for(base, comfyui_path, delay=120).start()
        try:
            for bank in banks:
                found["entries"][bank] = record_one(server, bank, COPY_MODEL if bank == "gone" else TINY_MODEL_NAME)
            found["seconds"][signum.name] = stop_with(server, signum)
        finally:
            server.stop()
        found["logs"][signum.name] = server.log_text()
        # before the next server starts (which replays every bank's spool, these included)
        found["after_stop"].update({bank: (entry_ids(base, bank), sorted(
            p.name for p in (bank_dir(base, bank) / "spool").glob("*.spool"))) for bank in banks})
    os.unlink(base / "models" / "diffusion_models" / COPY_MODEL)
    hostile = bank_dir(base, "term") / "spool" / f"{uuid.uuid4().hex}.spool"
    hostile.write_bytes((2 ** 62).to_bytes(8, "little") + b"{}")
    found["hostile"] = hostile
    restarted = server_for(base, comfyui_path, delay=0).start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "dropped the spooled" not in restarted.log_text() \
                or any(not entry_ids(base, b) for b in ("term", "int", "kill")):
            assert time.monotonic() < deadline, restarted.log_tail()
            time.sleep(0.5)
        found["restart_log"] = restarted.log_text()
    finally:
        restarted.stop()
    return found


@pytest.mark.parametrize("bank,signame", [("term", "SIGTERM"), ("int", "SIGINT"), ("kill", "SIGKILL")])
def test_a_queued_recording_is_in_the_bank_exactly_once_after_a_stop_and_a_restart(
        base, stopped_then_restarted, bank, signame):
    found = stopped_then_restarted
    entry = found["entries"][bank]
    assert found["after_stop"][bank] == ([], [f"{entry}.spool"])  # the writer was still waiting: only spooled
    assert entry_ids(base, bank) == [entry]
    assert not list((bank_dir(base, bank) / "spool").glob("*.spool"))
    replayed = found["restart_log"] + "".join(found["logs"].values())  # the next server to start replays it
    assert f"1 added ({entry})" in replayed


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_drain_within_the_bound_and_log_what_stays_spooled(stopped_then_restarted, signame):
    found = stopped_then_restarted
    bank = {"SIGTERM": "term", "SIGINT": "int"}[signame]
    assert found["seconds"][signame] < DRAIN_S + 8  # the bound, plus ComfyUI's own exit
    assert f"Chorus: stopping ({signame}): 0 recording(s) written to the bank" in found["logs"][signame]
    assert f"1 left spooled ({found['entries'][bank]}), replayed when the bank is next opened" in found["logs"][signame]


def test_a_spooled_recording_whose_model_was_deleted_is_dropped_with_a_line(base, stopped_then_restarted):
    entry = stopped_then_restarted["entries"]["gone"]
    assert stopped_then_restarted["after_stop"]["gone"] == ([], [f"{entry}.spool"])
    assert entry_ids(base, "gone") == []
    assert (f"dropped the spooled recording {entry}: its model ({COPY_MODEL}) no longer exists"
            in stopped_then_restarted["restart_log"])
    assert not list((bank_dir(base, "gone") / "spool").glob("*.spool"))


def test_a_damaged_spool_file_is_quarantined_at_start_and_the_server_runs_on(base, stopped_then_restarted):
    hostile = stopped_then_restarted["hostile"]
    assert not hostile.exists()
    assert [p.name.split("-")[0] for p in (hostile.parent / "quarantine").iterdir()] == [hostile.name]
    assert f"quarantined the spool file {hostile.name}" in stopped_then_restarted["restart_log"]


def test_a_quick_writer_drains_before_sigterm_ends_the_server(base, comfyui_path):
    server = server_for(base, comfyui_path, delay=0.5).start()
    try:
        entry = record_one(server, "drained")
        seconds = stop_with(server, signal.SIGTERM)
    finally:
        server.stop()
    assert entry_ids(base, "drained") == [entry]  # written during the drain, before the process ended
    assert seconds < DRAIN_S + 8
    assert f"Chorus: stopping (SIGTERM): 1 recording(s) written to the bank" in server.log_text()
    assert not list((bank_dir(base, "drained") / "spool").glob("*.spool"))


def test_a_recording_waiting_for_another_process_write_lock_survives_sigterm(base, comfyui_path):
    """No test hook: another process (here this test) holds the folder bank's write lock, as a
    large import does, so the writer is stuck when SIGTERM comes; before the spool that entry was lost."""
    import sqlite3

    server = server_for(base, comfyui_path, delay=0).start()
    holder = []

    def hold_the_lock_once_sampling_starts(event):
        if event.get("type") == "chorus.run_start" and not holder:
            conn = sqlite3.connect(bank_dir(base, "locked") / "bank.sqlite", timeout=60, isolation_level=None)
            conn.execute("BEGIN IMMEDIATE")
            holder.append(conn)

    try:
        record = server.run_prompt(chorus_i2v_prompt(bank="locked", steps=2), timeout=300,
                                   on_event=hold_the_lock_once_sampling_starts)
        entry = record["outputs"]["3"]["chorus_report"][0]["recorded_entry_id"]
        shown = server.get_json("/chorus/api/banks/locked/stats")  # the web view's route: still pending
        seconds = stop_with(server, signal.SIGTERM)
    finally:
        server.stop()
        for conn in holder:
            conn.rollback()
            conn.close()
    stopped_log, before_restart = server.log_text(), entry_ids(base, "locked")
    restarted = server_for(base, comfyui_path, delay=0).start()
    try:
        deadline = time.monotonic() + 60
        while not entry_ids(base, "locked") and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        restarted.stop()
    assert entry_ids(base, "locked") == [entry], f"lost: {entry}"
    assert holder and before_restart == [] and seconds < DRAIN_S + 8
    assert shown["spooled"] == 1 and [(r["entry_id"], r["state"]) for r in shown["recordings"]] == [(entry, "queued")]
    assert f"1 left spooled ({entry})" in stopped_log
