"""Several processes on one bank: concurrent writers, and writers killed mid-write."""

import random
import signal
import subprocess
import time

from bank_fixtures import FP, LAYOUT, toy_signature, writer_command

from chorus_core.bank import MaskBank


def test_two_processes_write_50_entries_each(tmp_path):
    path = tmp_path / "bank"
    MaskBank.open(path).close()
    procs = [subprocess.Popen(writer_command(path, 50, seed), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, cwd=".") for seed in (1, 2)]
    for p in procs:
        assert p.wait(timeout=90) == 0, p.stderr.read().decode()
    bank = MaskBank.open(path)
    assert bank.stats()["entries"] == 100
    assert [len(bank.entries(tag=f"writer{s}", limit=1000)) for s in (1, 2)] == [50, 50]
    report = bank.verify()
    assert (report["checked"], report["ok"], report["quarantined"]) == (100, 100, [])
    assert bank.match(toy_signature(1 * 100_000 + 7), FP, LAYOUT).hit


def test_writer_killed_mid_write_leaves_no_partial_entry(tmp_path):
    path = tmp_path / "bank"
    MaskBank.open(path).close()
    rng = random.Random(7)
    for _ in range(4):
        proc = subprocess.Popen(writer_command(path, -1, rng.randrange(1000)),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        proc.stdout.readline()  # it has started writing
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        bank = MaskBank.open(path)
        report = bank.verify()
        assert report["quarantined"] == [] and report["ok"] == report["checked"] > 0
        for row in bank.entries(limit=5):
            bank.load_masks(row["id"]).block_map(2, 1)
        bank.close()
