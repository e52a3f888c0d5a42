"""The recording spool (chorus_core.bank.spool): a recording on disk before it is reported, replayed once.

What a real server does when it is stopped with a recording queued is in
tests/test_e2e_recording_spool.py; here the library: round trip, replay once under concurrency,
hostile and damaged files quarantined, a recording whose model is gone dropped.
"""

import json
import logging
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from bank_fixtures import FP, LAYOUT, SCHEDULE, toy_masks, toy_signature
from chorus_core.bank import MaskBank
from chorus_core.bank import spool
from chorus_core.bank.encoding import PackedBlockMaps
from conftest import REPO_ROOT


def recording(seed=0, model_files=()):
    masks = toy_masks(seed)
    return spool.Recording(entry_id=uuid.uuid4().hex, fingerprint=FP, layout=LAYOUT, schedule=SCHEDULE,
                           signature=toy_signature(seed), masks=PackedBlockMaps(np.packbits(masks, axis=-1), 8),
                           density=0.3, recall=0.9, tags=("pan",), model_files=model_files)


@pytest.fixture()
def bank(tmp_path):
    with MaskBank.open(tmp_path / "bank") as opened:
        yield opened


def test_a_spooled_recording_replays_into_the_bank_with_its_masks_and_leaves_no_file(bank):
    rec = recording()
    path = spool.write_spool(spool.spool_folder(bank), rec)
    assert path == bank.root / "spool" / f"{rec.entry_id}.spool" and path.is_file()
    assert spool.spooled_count(bank) == 1

    outcome = spool.replay_spool(bank)

    assert outcome == {"added": [rec.entry_id], "present": [], "quarantined": [], "dropped": [], "left": []}
    assert [r["id"] for r in bank.entries()] == [rec.entry_id]
    assert bank.show(rec.entry_id)["tags"] == ["pan"]
    loaded = bank.load_masks(rec.entry_id, record_hit=False)
    assert (loaded.block_map_numpy(2, 1) == toy_masks(0)[2, 1]).all()
    assert spool.spooled_count(bank) == 0
    assert spool.replay_spool(bank)["added"] == []  # replaying again adds nothing


def test_a_recording_already_in_the_bank_is_not_added_twice(bank):
    rec = recording()
    path = spool.write_spool(spool.spool_folder(bank), rec)
    assert rec.add_to(bank) is True  # the writer got there, then the process died before unlinking
    assert spool.replay_spool(bank)["present"] == [rec.entry_id]
    assert bank.stats()["entries"] == 1 and not path.exists()


def test_two_processes_replaying_one_spool_add_each_entry_once(bank):
    ids = [spool.write_spool(spool.spool_folder(bank), recording(seed)).name[:32] for seed in range(6)]
    code = ("import sys, json; sys.path[:0] = ['tests', '.']; from chorus_core.bank import MaskBank, spool; "
            f"b = MaskBank.open({str(bank.root)!r}); print(json.dumps(spool.replay_spool(b)))")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outcomes = [json.loads(p.communicate(timeout=120)[0]) for p in procs]

    added = sorted(i for o in outcomes for i in o["added"])
    assert added == sorted(ids)
    assert sorted(r["id"] for r in bank.entries()) == sorted(ids)
    assert spool.spooled_count(bank) == 0


@pytest.mark.parametrize("damage", ["truncated", "header_lies_about_size", "wrong_id", "grown",
                                    "not_json", "empty_row", "huge_header", "symlink", "fifo"])
def test_a_damaged_or_hostile_spool_file_is_quarantined_and_never_fatal(bank, tmp_path, damage, caplog):
    rec = recording()
    path = spool.write_spool(spool.spool_folder(bank), rec)
    _damage(path, damage, tmp_path)
    healthy = recording(seed=1)
    spool.write_spool(spool.spool_folder(bank), healthy)

    with caplog.at_level(logging.WARNING, logger="chorus"):
        outcome = spool.replay_spool(bank)

    assert outcome["added"] == [healthy.entry_id]  # the next file still goes in
    assert [r["id"] for r in bank.entries()] == [healthy.entry_id]
    assert not os.path.lexists(path) and outcome["quarantined"] == [path.name]
    assert len(list((path.parent / "quarantine").iterdir())) == 1  # a link or FIFO is moved, never opened
    assert "quarantined the spool file" in caplog.text


def _damage(path, how, tmp_path):
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    if how == "truncated":
        path.write_bytes(data[:-5])
    elif how == "grown":  # more bytes than the header declares: never read
        path.write_bytes(data + b"\0" * 4096)
    elif how == "header_lies_about_size":
        path.write_bytes((2 ** 40).to_bytes(8, "little") + data[8:])
    elif how == "huge_header":
        path.write_bytes((2 ** 30).to_bytes(8, "little") + b"{" * 64)
    elif how == "wrong_id":  # a file named for one entry that holds another
        text = data[8:8 + size].decode().replace(path.name[:32], "f" * 32)
        path.write_bytes(len(text).to_bytes(8, "little") + text.encode() + data[8 + size:])
    elif how == "not_json":
        path.write_bytes(size.to_bytes(8, "little") + b"\xff" * size + data[8 + size:])
    elif how == "empty_row":  # a query block that keeps no key block: add_entry refuses it
        path.write_bytes(data[:8 + size] + b"\0" * (len(data) - 8 - size))
    elif how == "symlink":
        target = tmp_path / "decoy.spool"
        target.write_bytes(data)
        os.unlink(path)
        os.symlink(target, path)
    elif how == "fifo":
        os.unlink(path)
        os.mkfifo(path)


def test_a_recording_whose_model_files_are_gone_is_dropped_with_a_line(bank, tmp_path, caplog):
    model = tmp_path / "wan.safetensors"
    model.write_bytes(b"weights")
    kept = recording(seed=0, model_files=(str(model),))
    spool.write_spool(spool.spool_folder(bank), kept)
    spool.replay_spool(bank)
    gone = recording(seed=1, model_files=(str(model),))
    spool.write_spool(spool.spool_folder(bank), gone)
    model.unlink()

    with caplog.at_level(logging.WARNING, logger="chorus"):
        outcome = spool.replay_spool(bank)

    assert outcome["dropped"] == [gone.entry_id]
    assert [r["id"] for r in bank.entries()] == [kept.entry_id]
    assert spool.spooled_count(bank) == 0
    assert f"dropped the spooled recording {gone.entry_id}: its model (wan.safetensors) no longer exists" in caplog.text


def test_a_read_only_bank_replays_nothing_and_a_linked_spool_folder_is_never_read(bank, tmp_path):
    rec = recording()
    spool.write_spool(spool.spool_folder(bank), rec)
    with MaskBank.open(bank.root, read_only=True) as read_only:
        assert spool.replay_spool(read_only)["added"] == []
    elsewhere = tmp_path / "elsewhere"
    (bank.root / "spool").rename(elsewhere)
    os.symlink(elsewhere, bank.root / "spool")
    assert spool.replay_spool(bank)["added"] == [] and bank.stats()["entries"] == 0
    with pytest.raises(Exception, match="symbolic link"):
        spool.write_spool(spool.spool_folder(bank), recording(seed=2))


def test_a_server_bank_spools_on_this_machine_under_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(spool.SPOOL_ROOT_ENV, str(tmp_path / "spools"))

    class ServerBank:
        root, read_only = None, False
        label = "postgresql://chorus@db:5432/chorus?schema=fleet"

    folder = spool.spool_folder(ServerBank())
    assert folder.parent == tmp_path / "spools" and len(folder.name) == 24
    other = type("Other", (ServerBank,), {"label": ServerBank.label.replace("fleet", "archive")})
    assert spool.spool_folder(other()) != folder


def test_the_cli_replays_the_spool_before_verify_and_stats_counts_what_waits(bank, capsys):
    from chorus_core.bank.__main__ import main

    rec = recording()
    spool.write_spool(spool.spool_folder(bank), rec)
    assert main(["stats", str(bank.root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spooled"] == 1

    assert main(["verify", str(bank.root), "--json"]) == 0
    captured = capsys.readouterr()
    assert f"spool: 1 added: {rec.entry_id}" in captured.err
    assert json.loads(captured.out)["spool"]["added"] == [rec.entry_id]
    assert [r["id"] for r in bank.entries()] == [rec.entry_id]
