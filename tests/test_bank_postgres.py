"""The mask bank on PostgreSQL: the backend-neutral store tests over both backends, and the
fleet promises (several writer processes, a writer killed in its transaction, a server
restart, a server down at start, another worker's entry seen at once, no password shown).

A throwaway cluster (tests/bank_pg_cluster.py) is started once for this module from Debian's
PostgreSQL packages; each test gets a fresh schema (one bank per schema). Without the server
binaries these tests skip, unless CHORUS_REQUIRE_POSTGRES=1 (``make test`` sets it).
"""

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import test_bank_store as store_tests
from bank_fixtures import (FP, LAYOUT, add_toy, corrupt, prune_least_recently_used, python_command,
                           toy_masks, toy_signature, writer_command)
from bank_pg_cluster import PASSWORD, bank, location, pg  # noqa: F401  (fixtures)

from chorus_core.bank import BankEntryCorrupt, BankError, BankReadOnly, BankUnavailable, MaskBank
from chorus_core.bank import bank_url, pg_store
from chorus_core.bank.__main__ import main


@pytest.fixture
def pg_url(pg):
    url = pg.url(pg.fresh_schema())
    MaskBank.open(url).close()
    return url


# ---- the store suite, on both backends --------------------------------------------------
test_round_trip = store_tests.test_round_trip
test_add_checks_mask_shape = store_tests.test_add_checks_mask_shape
test_match_only_compatible_entries = store_tests.test_match_only_compatible_entries
test_match_picks_nearest_and_reports_components = store_tests.test_match_picks_nearest_and_reports_components
test_threshold_edges = store_tests.test_threshold_edges
test_weights_change_similarity = store_tests.test_weights_change_similarity
test_hits_do_not_change_content_token = store_tests.test_hits_do_not_change_content_token
test_identical_masks_share_one_blob = store_tests.test_identical_masks_share_one_blob


def test_index_refreshes_when_another_connection_writes(location):
    first, second = MaskBank.open(location), MaskBank.open(location)
    sig = toy_signature(4)
    token = first.content_token()
    assert first.match(sig, FP, LAYOUT).candidates == 0
    entry = add_toy(second, seed=4)
    assert first.content_token() != token
    assert first.match(sig, FP, LAYOUT).entry_id == entry
    second.delete([entry])
    assert first.match(sig, FP, LAYOUT).candidates == 0
    first.close()
    second.close()


def test_reopen_gives_the_same_bank_on_its_own_connection(bank):
    entry = add_toy(bank, seed=1)
    with bank.reopen() as other:
        assert (type(other), other.label, other.read_only) == (type(bank), bank.label, False)
        assert other.match(toy_signature(1), FP, LAYOUT).entry_id == entry
        add_toy(other, seed=2)
    assert bank.stats()["entries"] == 2


def test_verify_quarantines_truncated_and_wrong_digest(bank):
    good, short, flipped = (add_toy(bank, seed=s) for s in range(3))
    corrupt(bank, short, "truncate")
    corrupt(bank, flipped, "flip")
    report = bank.verify()
    assert {k: report[k] for k in ("checked", "ok", "orphans_removed")} == {
        "checked": 3, "ok": 1, "orphans_removed": 0}
    assert {q["id"]: q["reason"].split(" (")[0] for q in report["quarantined"]} == {
        short: "blob truncated or resized", flipped: "blob sha256 mismatch"}
    assert bank.stats()["entries"] == 1 and bank.stats()["quarantined"] == 2
    assert bank.match(toy_signature(1), FP, LAYOUT).entry_id == good
    assert bank.verify()["quarantined"] == []


@pytest.mark.parametrize("how", ["truncate", "flip", "missing"])
def test_load_of_corrupt_blob_raises_after_quarantine(bank, how):
    entry = add_toy(bank, seed=1)
    corrupt(bank, entry, how)
    with pytest.warns(UserWarning, match="quarantining entry"):
        with pytest.raises(BankEntryCorrupt, match="dense") as info:
            bank.load_masks(entry)
    assert info.value.entry_id == entry
    assert bank.show(entry)["status"] == "quarantined"
    assert bank.match(toy_signature(1), FP, LAYOUT).candidates == 0
    again = add_toy(bank, seed=1)  # the same masks again: a fresh, healthy blob
    assert (bank.load_masks(again).block_map_numpy(2, 1) == toy_masks(1)[2, 1]).all()


def test_prune_evicts_least_recently_used_and_their_blobs(bank):
    ids = prune_least_recently_used(bank)
    assert bank.verify()["orphans_removed"] == 0  # the pruned blobs went with their rows
    assert bank.delete([ids[0], "f" * 32]) == 1 and bank.stats()["entries"] == 0


def test_read_only_reads_and_refuses_writes(location):
    with pytest.raises(BankError, match="Create one with"):
        MaskBank.open(location, read_only=True)
    with MaskBank.open(location) as writer:
        entry = add_toy(writer, seed=1)
    with MaskBank.open(location, read_only=True) as reader:
        assert reader.match(toy_signature(1), FP, LAYOUT).entry_id == entry
        assert reader.load_masks(entry).block_map(0, 0).shape == (2, 8, 8)
        assert reader.stats()["hits"] == 0
        with pytest.raises(BankReadOnly, match="open it with read_only=False"):
            add_toy(reader, seed=2)


def test_entries_by_tag_and_order(bank):
    a = add_toy(bank, seed=1, tags=["pan"])
    b = add_toy(bank, seed=2, tags=["pan", "zoom"])
    add_toy(bank, seed=3, tags=["zoom"])
    assert sorted(r["id"] for r in bank.entries(tag="pan")) == sorted([a, b])
    bank.load_masks(a)
    assert [r["id"] for r in bank.entries(order="last_hit DESC", limit=1)] == [a]
    assert len(bank.entries(order="hits ASC")) == 3
    with pytest.raises(BankError, match="must be one of"):
        bank.entries(order="id; DROP TABLE entries")


@pytest.mark.parametrize("direction", ["folder_to_pg", "pg_to_folder"])
def test_export_import_between_backends(pg, tmp_path, direction):
    folder, url = str(tmp_path / "folder"), pg.url(pg.fresh_schema())
    src, dst = (folder, url) if direction == "folder_to_pg" else (url, folder)
    with MaskBank.open(src) as bank:
        pan = [add_toy(bank, seed=s, tags=["pan"]) for s in range(3)]
        add_toy(bank, seed=1, tags=["zoom"])  # shares a blob with pan[1]
        assert bank.export(tmp_path / "pan.tar", tag="pan") == 3
    with MaskBank.open(dst) as bank:
        assert bank.import_file(tmp_path / "pan.tar") == {"added": 3, "skipped": 0}
        assert bank.import_file(tmp_path / "pan.tar") == {"added": 0, "skipped": 3}
        assert sorted(r["id"] for r in bank.entries()) == sorted(pan)
        assert bank.verify()["ok"] == 3
        assert (bank.load_masks(pan[2]).block_map_numpy(1, 0) == toy_masks(2)[1, 0]).all()
        assert bank.match(toy_signature(2), FP, LAYOUT).entry_id == pan[2]


def test_schema_versions_are_checked(pg, pg_url):
    with MaskBank.open(pg_url) as bank:
        assert bank.stats()["schema_version"] == 2
        bank.db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(BankError, match="newer than this Chorus"):
        MaskBank.open(pg_url)
    foreign = pg.fresh_schema()
    pg.sql(f"CREATE SCHEMA {foreign} AUTHORIZATION chorus; "
           f"CREATE TABLE {foreign}.entries (x int); ALTER TABLE {foreign}.entries OWNER TO chorus",
           database="chorus_test")
    with pytest.raises(BankError, match="is not a Chorus bank: it lacks the blobs, meta"):
        MaskBank.open(pg.url(foreign))


# ---- several processes ------------------------------------------------------------------
def test_four_processes_write_50_entries_each(pg_url):
    reader = MaskBank.open(pg_url)  # matches all along: its matrix only appends new rows
    procs = [subprocess.Popen(writer_command(pg_url, 50, seed), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE) for seed in range(1, 5)]
    while any(p.poll() is None for p in procs):
        reader.match(toy_signature(0), FP, LAYOUT)
        time.sleep(0.01)
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read().decode()
    assert reader.match(toy_signature(0), FP, LAYOUT).candidates == 200  # no row skipped
    reader.close()
    with MaskBank.open(pg_url) as bank:
        assert bank.stats()["entries"] == 200
        assert [len(bank.entries(tag=f"writer{s}")) for s in range(1, 5)] == [50] * 4
        report = bank.verify()
        assert (report["checked"], report["ok"], report["quarantined"]) == (200, 200, [])
        assert bank.match(toy_signature(3 * 100_000 + 7), FP, LAYOUT).hit


@pytest.mark.parametrize("point", ["add-blob-written", "add-before-commit"])
def test_writer_killed_inside_its_transaction_leaves_nothing(pg_url, point):
    with MaskBank.open(pg_url) as bank:
        add_toy(bank, seed=1)
    env = {**os.environ, "CHORUS_BANK_FAULT": point}
    done = subprocess.run(python_command(f"from bank_fixtures import victim_main; "
                                         f"victim_main('add', {pg_url!r}, '9')"),
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL and "survived" not in done.stdout
    with MaskBank.open(pg_url) as bank:
        assert bank.stats()["entries"] == 1
        assert bank.db.query("SELECT COUNT(*) AS n FROM blobs")[0]["n"] == 1
        assert bank.verify()["orphans_removed"] == 0
        add_toy(bank, seed=9)  # the lock died with the writer: the next writer goes on
        assert bank.stats()["entries"] == 2


def test_writers_killed_at_random_leave_only_whole_entries(pg_url):
    for seed in (11, 12, 13):
        proc = subprocess.Popen(writer_command(pg_url, -1, seed), stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        proc.stdout.readline()
        time.sleep(0.05 * (seed - 10))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with MaskBank.open(pg_url) as bank:
        report = bank.verify()
        assert report["quarantined"] == [] and report["ok"] == report["checked"] >= 3
        assert bank.db.query("SELECT COUNT(*) AS n FROM blobs b WHERE NOT EXISTS (SELECT 1 "
                             "FROM entries e WHERE e.blob_sha256 = b.sha256)")[0]["n"] == 0


def match_until(bank, sig, done, seconds):
    """Match until ``done(result)`` or ``seconds`` pass: (result, seconds it took)."""
    start = time.monotonic()
    while True:
        result = bank.match(sig, FP, LAYOUT)
        if done(result) or time.monotonic() - start > seconds:
            return result, time.monotonic() - start
        time.sleep(0.005)


def test_second_worker_sees_a_new_entry_within_a_second(pg_url):
    sig = toy_signature(500_000)
    with MaskBank.open(pg_url) as reader:
        add_toy(reader, seed=1)
        assert not reader.match(sig, FP, LAYOUT).hit  # its matrix is loaded now
        with subprocess.Popen(writer_command(pg_url, 1, 5), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL) as proc:
            proc.stdout.readline()  # the other worker committed its entry
            result, seen_after = match_until(reader, sig, lambda r: r.hit, 2.0)
            assert proc.wait(timeout=60) == 0
        assert result.hit and seen_after < 1.0  # the bound docs/mask-bank.md states
        assert (reader.load_masks(result.entry_id).block_map_numpy(0, 1)
                == toy_masks(500_000)[0, 1]).all()


def counting_meta_reads(bank):
    """A list that grows by one for each query of the bank's ``meta`` table (its change counters)."""
    reads, real = [], bank.db.query

    def query(sql, params=()):
        if "FROM meta" in sql:
            reads.append(sql)
        return real(sql, params)

    bank.db.query = query
    return reads


@pytest.mark.parametrize("read_only", [False, True])
def test_matches_read_no_counters_until_a_write_is_announced(pg_url, monkeypatch, read_only):
    """The round trip a match spent on the counters is gone while nothing changes; another
    process's new and removed entries are still seen, told by the server's notification (the
    safety net of COUNTERS_MAX_AGE_S is pushed out of the way here)."""
    monkeypatch.setattr(pg_store, "COUNTERS_MAX_AGE_S", 3600.0)
    with MaskBank.open(pg_url) as setup:
        add_toy(setup, seed=1)
    sig = toy_signature(500_000)
    with MaskBank.open(pg_url, read_only=read_only) as reader:
        assert not reader.match(sig, FP, LAYOUT).hit
        reads = counting_meta_reads(reader)
        for _ in range(20):
            reader.match(sig, FP, LAYOUT)
        assert reads == []  # twenty matches, no counters read
        proc = subprocess.run(writer_command(pg_url, 1, 5), capture_output=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        result, seconds = match_until(reader, sig, lambda r: r.hit, 5.0)
        assert result.hit and seconds < 1.0 and len(reads) == 1
        deleting = python_command(f"from chorus_core.bank import MaskBank; "
                                  f"MaskBank.open({pg_url!r}).delete([{result.entry_id!r}])")
        subprocess.run(deleting, check=True, capture_output=True, timeout=120)
        gone, seconds = match_until(reader, sig, lambda r: r.entry_id != result.entry_id, 5.0)
        assert gone.entry_id != result.entry_id and seconds < 1.0 and len(reads) == 2


def test_a_writer_that_does_not_notify_is_seen_within_the_counters_age(pg_url, monkeypatch):
    """A writer that sends no notification (an older Chorus) is seen when the counters are read
    again, COUNTERS_MAX_AGE_S after the last read: not before, and not much later."""
    max_age = 4.0
    monkeypatch.setattr(pg_store, "COUNTERS_MAX_AGE_S", max_age)
    sig = toy_signature(500_000)
    with MaskBank.open(pg_url) as reader:
        add_toy(reader, seed=1)
        assert not reader.match(sig, FP, LAYOUT).hit  # counters read now
        last_read = time.monotonic()
        silent = ("import sys; sys.path.insert(0, 'tests'); import chorus_core.bank.pg_store as s; "
                  "s.NOTIFY_CHANNEL = 'chorus_nobody_listens'; from bank_fixtures import writer_main; "
                  f"writer_main({pg_url!r}, 1, 5)")
        with subprocess.Popen([sys.executable, "-c", silent], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL) as proc:
            proc.stdout.readline()  # committed
            if time.monotonic() - last_read < max_age - 0.5:  # a slow start leaves no time to look
                assert not reader.match(sig, FP, LAYOUT).hit  # stale, as stated: no notification came
            result, _ = match_until(reader, sig, lambda r: r.hit, 2 * max_age)
            assert proc.wait(timeout=60) == 0
        assert result.hit and time.monotonic() - last_read < max_age + 1.0


# ---- the server going away --------------------------------------------------------------
def test_server_restart_mid_run_is_one_miss_then_reconnects(pg, pg_url):
    bank = MaskBank.open(pg_url)
    entry = add_toy(bank, seed=1)
    assert bank.match(toy_signature(1), FP, LAYOUT).hit
    pg.restart()
    with pytest.raises(BankUnavailable, match="Lost the connection to the PostgreSQL mask bank at "
                                        r"127\.0\.0\.1:\d+ .*runs as a miss") as info:
        # the generation's calls: its match may be served from memory (no change was announced),
        # its masks need the server
        bank.load_masks(bank.match(toy_signature(1), FP, LAYOUT).entry_id)
    assert PASSWORD not in str(info.value)
    assert bank.match(toy_signature(1), FP, LAYOUT).entry_id == entry  # reconnected
    assert add_toy(bank, seed=2) and bank.stats()["entries"] == 2
    bank.close()


def test_server_down_at_start_names_the_host_not_the_password(pg):
    url = pg.url(pg.fresh_schema()).replace(f":{pg.port}/", ":1/")
    with pytest.raises(BankUnavailable, match=r"Cannot reach the PostgreSQL mask bank at "
                                        r"127\.0\.0\.1:1 \(database chorus_test") as info:
        MaskBank.open(url)
    assert PASSWORD not in str(info.value) and "each generation runs as a miss" in str(info.value)


def test_wrong_password_is_not_echoed(pg):
    url = pg.url(pg.fresh_schema()).replace(PASSWORD, "Wr0ng-pw-xyz")
    with pytest.raises(BankError, match="password authentication failed") as info:
        MaskBank.open(url)
    assert "Wr0ng-pw-xyz" not in str(info.value)


# ---- credentials ------------------------------------------------------------------------
def test_credentials_absent_from_every_output(pg, pg_url, tmp_path, capsys):
    with MaskBank.open(pg_url) as bank:
        entry = add_toy(bank, seed=1, tags=["pan"])
        corrupt(bank, add_toy(bank, seed=2), "flip")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            texts = [json.dumps(bank.stats()), json.dumps(bank.entries(), default=str),
                     json.dumps(bank.show(entry), default=str), json.dumps(bank.verify()),
                     bank.label, repr(bank.match(toy_signature(1), FP, LAYOUT))]
        texts += [str(w.message) for w in caught]
    for argv in (["stats", pg_url], ["list", pg_url], ["show", pg_url, entry],
                 ["verify", pg_url, "--json"], ["show", pg_url, "0" * 32],
                 ["export", pg_url, str(tmp_path / "x.tar")]):
        main(argv)
        out = capsys.readouterr()
        texts += [out.out, out.err]
    assert bank_url.redact(pg_url) == pg_url.replace(f":{PASSWORD}", "")
    assert all(PASSWORD not in t for t in texts)
    assert any("127.0.0.1" in t for t in texts)


def test_cli_on_a_postgres_url(pg, capsys):
    url = pg.url(pg.fresh_schema())
    assert main(["stats", url]) == 2 and "Create one with" in capsys.readouterr().err
    assert main(["init", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "postgresql"
    with MaskBank.open(url) as bank:
        ids = [add_toy(bank, seed=s) for s in range(3)]
    assert main(["prune", url, "--max-entries", "1", "--json"]) == 0
    pruned = json.loads(capsys.readouterr().out)
    assert (len(pruned["removed"]), pruned["entries"]) == (2, 1)
    assert main(["verify", url]) == 0 and ids[2] in main_list(url, capsys)


def main_list(url, capsys) -> str:
    capsys.readouterr()
    main(["list", url])
    return capsys.readouterr().out


def test_named_banks_from_env_and_yaml(tmp_path):
    yaml_file = tmp_path / "extra_model_paths.yaml"
    yaml_file.write_text("comfyui:\n  chorus_banks: |\n    /srv/banks\n"
                         "    fleet=postgresql://u:pw@db1/chorus\n"
                         "    archive=postgresql://u@db2/chorus?schema=old\n"
                         "  checkpoints: models/checkpoints\n")
    env = {bank_url.URLS_ENV: "fleet=postgresql://w@db3/c; bad name=postgresql://x@y/z;"
                              "local=/not/a/url"}
    assert bank_url.named_urls(env, [yaml_file]) == {
        "fleet": "postgresql://w@db3/c", "archive": "postgresql://u@db2/chorus?schema=old"}
    assert bank_url.named_urls({}, [yaml_file])["fleet"] == "postgresql://u:pw@db1/chorus"
    assert bank_url.named_urls({}, [tmp_path / "absent.yaml"]) == {}
    assert bank_url.redact("postgresql://u:pw@db1:6432/chorus") == \
        "postgresql://u@db1:6432/chorus?schema=chorus_bank"
    with pytest.raises(BankError, match="lowercase identifier"):
        bank_url.parse("postgresql://u@db/c?schema=x;drop")


def test_bank_rows_match_between_backends(pg, tmp_path):
    """The same masks give the same blob bytes and digest on both backends."""
    folder, url = MaskBank.open(tmp_path / "f"), MaskBank.open(pg.url(pg.fresh_schema()))
    a, b = add_toy(folder, seed=3), add_toy(url, seed=3)
    fa, fb = folder.show(a), url.show(b)
    assert (fa["blob_sha256"], fa["blob_bytes"]) == (fb["blob_sha256"], fb["blob_bytes"])
    sims = [x.match(toy_signature(3, noise=0.4), FP, LAYOUT).similarity for x in (folder, url)]
    assert np.isclose(sims[0], sims[1], atol=1e-6)
    folder.close()
    url.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_the_cli_replays_a_postgres_banks_spool_where_comfyui_keeps_it(pg, tmp_path):
    """With no CHORUS_SPOOL_ROOT, the CLI finds a PostgreSQL bank's local spool where a ComfyUI start
    does (models/chorus_banks/.postgres-spool): in the ComfyUI the pack is installed in, or in
    the one --comfyui names."""
    import shutil

    from conftest import REPO_ROOT
    from test_bank_spool import recording

    from chorus_core.bank import spool

    url = pg.url(pg.fresh_schema())
    with MaskBank.open(url) as bank:
        spool_name = spool.spool_folder_at(None, bank.label).name  # one folder per bank
    comfyui, other_base = tmp_path / "ComfyUI", tmp_path / "base"
    pack = comfyui / "custom_nodes" / "chorus"  # installed as the README says: a clone in custom_nodes
    shutil.copytree(REPO_ROOT / "chorus_core", pack / "chorus_core", ignore=shutil.ignore_patterns("__pycache__"))
    (comfyui / "main.py").write_text("")
    other_base.mkdir()
    installed, named = recording(seed=1), recording(seed=2)
    spool.write_spool(spool.comfyui_spool_root(comfyui) / spool_name, installed)
    spool.write_spool(spool.comfyui_spool_root(other_base) / spool_name, named)
    env = {k: v for k, v in os.environ.items() if k != spool.SPOOL_ROOT_ENV}

    def cli(*argv, cwd):
        done = subprocess.run([sys.executable, "-m", "chorus_core.bank", *argv, url, "--json"], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    assert cli("stats", cwd=pack)["spooled"] == 1
    assert cli("verify", cwd=pack)["spool"]["added"] == [installed.entry_id]
    assert cli("verify", "--comfyui", str(other_base), cwd=REPO_ROOT)["spool"]["added"] == [named.entry_id]
    with MaskBank.open(url, read_only=True) as bank:
        assert sorted(r["id"] for r in bank.entries()) == sorted([installed.entry_id, named.entry_id])
    assert not spool.pending_files(spool.comfyui_spool_root(comfyui) / spool_name)
