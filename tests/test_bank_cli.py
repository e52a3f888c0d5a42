"""Command line: init, stats, list, show, verify, prune, export and import by tag."""

import json
import subprocess
import sys

from bank_fixtures import add_toy

from chorus_core.bank import MaskBank
from chorus_core.bank.__main__ import main


def run_json(capsys, *argv):
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_init_and_stats_json_in_a_subprocess(tmp_path):
    path = str(tmp_path / "bank")
    for command in ("init", "stats"):
        out = subprocess.run([sys.executable, "-m", "chorus_core.bank", command, path, "--json"],
                             capture_output=True, text=True, check=True).stdout
    stats = json.loads(out)
    assert {k: stats[k] for k in ("entries", "bytes", "schema_version", "quarantined")} == {
        "entries": 0, "bytes": 0, "schema_version": 3, "quarantined": 0}


def test_stats_list_show_verify_prune(tmp_path, capsys):
    path = tmp_path / "bank"
    with MaskBank.open(path) as bank:
        ids = [add_toy(bank, seed=s, tags=["pan"] if s < 2 else ["zoom"]) for s in range(3)]
        size = sum(bank.show(i)["blob_bytes"] for i in ids)
    assert run_json(capsys, "stats", str(path))[1]["bytes"] == size
    code, rows = run_json(capsys, "list", str(path), "--tag", "pan")
    assert (code, sorted(r["id"] for r in rows)) == (0, sorted(ids[:2]))
    assert run_json(capsys, "show", str(path), ids[2])[1]["tags"] == ["zoom"]
    assert run_json(capsys, "verify", str(path))[1]["ok"] == 3
    code, pruned = run_json(capsys, "prune", str(path), "--max-entries", "1")
    assert (code, pruned["removed"], pruned["entries"]) == (0, ids[:2], 1)
    assert main(["list", str(path)]) == 0 and ids[2] in capsys.readouterr().out


def test_export_import_by_tag(tmp_path, capsys):
    src, dst, tar = tmp_path / "src", tmp_path / "dst", tmp_path / "pan.tar"
    with MaskBank.open(src) as bank:
        pan = [add_toy(bank, seed=s, tags=["pan"]) for s in range(2)]
        add_toy(bank, seed=5, tags=["zoom"])
    assert run_json(capsys, "export", str(src), str(tar), "--tag", "pan")[1]["exported"] == 2
    main(["init", str(dst)])
    capsys.readouterr()
    assert run_json(capsys, "import", str(dst), str(tar))[1] == {"added": 2, "skipped": 0}
    assert run_json(capsys, "import", str(dst), str(tar))[1] == {"added": 0, "skipped": 2}
    with MaskBank.open(dst) as bank:
        assert sorted(r["id"] for r in bank.entries()) == sorted(pan)
        assert bank.verify()["ok"] == 2
        assert bank.load_masks(pan[0]).block_map(0, 0).shape == (2, 8, 8)


def test_errors_say_what_to_do(tmp_path, capsys):
    assert main(["stats", str(tmp_path / "nothing")]) == 2
    assert "python -m chorus_core.bank init" in capsys.readouterr().err
    main(["init", str(tmp_path / "b")])
    capsys.readouterr()
    assert main(["prune", str(tmp_path / "b")]) == 2
    assert "--max-bytes" in capsys.readouterr().err
