"""A spooled write that fails is tried again with back-off and shown meanwhile, never just logged."""

import time

import pytest

from chorus_core.bank import BankError, MaskBank, spool
from chorus_core.reuse import bank_writer, recording_queue
from test_bank_spool import recording


@pytest.fixture()
def bank(tmp_path, monkeypatch):
    monkeypatch.setattr(bank_writer, "RETRY_DELAYS_S", (0.3, 0.3))
    with MaskBank.open(tmp_path / "bank") as opened:
        yield opened


def failing_add(monkeypatch, failures: int):
    """``Recording.add_to`` fails its first ``failures`` calls (a lock held by an import, a full disk)."""
    real, calls = spool.Recording.add_to, []

    def add_to(self, bank):
        calls.append(self.entry_id)
        if len(calls) <= failures:
            raise BankError("database is locked")
        return real(self, bank)

    monkeypatch.setattr(spool.Recording, "add_to", add_to)
    return calls


def wait_done(entry_id, timeout=30.0):
    item = bank_writer.default_writer().outcome(entry_id)
    assert item is not None and item.done.wait(timeout)
    return item


def test_a_failed_write_is_tried_again_from_its_spool_file_and_shown_as_retrying(bank, monkeypatch):
    calls = failing_add(monkeypatch, failures=1)
    rec = recording()

    assert recording_queue.hand_over(bank, rec) == ("queued", None)
    deadline = time.monotonic() + 10
    while not calls:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    shown = bank_writer.recordings(bank.label)

    assert wait_done(rec.entry_id).error is None
    assert shown and shown[0]["entry_id"] == rec.entry_id and shown[0]["state"] in ("queued", "retrying")
    assert [r["id"] for r in bank.entries()] == [rec.entry_id] and calls == [rec.entry_id] * 2
    assert spool.spooled_count(bank) == 0
    assert bank_writer.recordings(bank.label) == []  # written: nothing left to show


def test_a_write_that_keeps_failing_stays_spooled_is_shown_failed_and_goes_in_at_the_next_open(bank, monkeypatch):
    failing_add(monkeypatch, failures=100)
    rec = recording(seed=2)

    recording_queue.hand_over(bank, rec)
    item = wait_done(rec.entry_id)

    assert item.attempts == 3 and "database is locked" in item.error  # the first try and two retries
    assert [(r["entry_id"], r["state"], r["attempts"]) for r in bank_writer.recordings(bank.label)] == [
        (rec.entry_id, "failed", 3)]
    assert spool.spooled_count(bank) == 1 and bank.stats()["entries"] == 0
    monkeypatch.undo()
    assert spool.replay_spool(bank)["added"] == [rec.entry_id]
