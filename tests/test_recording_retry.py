"""A spooled write that fails is tried again with back-off and shown meanwhile, never just logged."""

import time

import pytest

from chorus_core.bank import BankError, MaskBank, spool
from chorus_core.bank.errors import BankIncompatible, BankInvalidArgument
from chorus_core.reuse import bank_writer, recording_queue
from test_bank_spool import recording


@pytest.fixture()
def bank(tmp_path, monkeypatch):
    monkeypatch.setattr(bank_writer, "RETRY_DELAYS_S", (0.3, 0.3))
    with MaskBank.open(tmp_path / "bank") as opened:
        yield opened


def failing_add(monkeypatch, failures: int, error: Exception = None):
    """``Recording.add_to`` fails its first ``failures`` calls with ``error``, by default as when a
    lock is held by an import."""
    real, calls = spool.Recording.add_to, []

    def add_to(self, bank):
        calls.append(self.entry_id)
        if len(calls) <= failures:
            raise error or BankError("database is locked")
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
    assert [(r["entry_id"], r["state"], r["attempts"], r["reason"]) for r in bank_writer.recordings(bank.label)] == [
        (rec.entry_id, "failed", 3, "BankError after 3 tries; stays spooled for the next start")]
    assert spool.spooled_count(bank) == 1 and bank.stats()["entries"] == 0
    monkeypatch.undo()
    assert spool.replay_spool(bank)["added"] == [rec.entry_id]


REFUSALS = [BankIncompatible("masks not stored: 9 key blocks, the layout has 8"),
            BankInvalidArgument("signature not stored: a NaN component"), ValueError("sigma is NaN")]


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda e: type(e).__name__)
def test_a_recording_the_bank_refuses_is_quarantined_at_once_and_shown_failed(bank, monkeypatch, caplog, refusal):
    """Trying again cannot help a recording the bank refuses for its content: one try, no back-off,
    its spool file quarantined (not replayed at every start), failed with a short reason."""
    calls = failing_add(monkeypatch, failures=100, error=refusal)
    rec = recording(seed=3)

    recording_queue.hand_over(bank, rec)
    item = wait_done(rec.entry_id)

    reason = f"the bank refused it ({type(refusal).__name__}); its spool file was quarantined"
    assert calls == [rec.entry_id] and item.reason == reason
    assert bank_writer.recording_state(rec.entry_id) == {
        "entry_id": rec.entry_id, "state": "failed", "attempts": 1, "error": item.error, "reason": reason,
        "retry_in_s": None, "merged_into": None}
    assert [r["state"] for r in bank_writer.recordings(bank.label)] == ["failed"]
    assert spool.spooled_count(bank) == 0 and len(list((spool.spool_folder(bank) / "quarantine").iterdir())) == 1
    assert f"recorded masks {rec.entry_id} will not be written (not retried" in caplog.text
    assert not any(spool.replay_spool(bank).values())  # nothing left for the next start


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda e: type(e).__name__)
def test_a_spooled_recording_the_bank_refuses_at_replay_is_quarantined_not_left(bank, monkeypatch, refusal):
    """A start that replays a recording the bank refuses quarantines it: left spooled, every later
    start would try it again, for ever."""
    rec = recording(seed=4)
    spool.write_spool(spool.spool_folder(bank), rec)
    failing_add(monkeypatch, failures=100, error=refusal)

    assert spool.replay_spool(bank)["quarantined"] == [f"{rec.entry_id}.spool"]
    assert spool.spooled_count(bank) == 0 and not any(spool.replay_spool(bank).values())


def test_a_transient_failure_is_retried_and_the_state_says_recorded_once_in(bank, monkeypatch):
    """A server that is away for a moment is waited out; the web view's poll then reads recorded."""
    from chorus_core.bank.errors import BankUnavailable

    calls = failing_add(monkeypatch, failures=1, error=BankUnavailable("connection lost"))
    rec = recording(seed=5)

    recording_queue.hand_over(bank, rec)
    item = wait_done(rec.entry_id)

    assert item.error is None and len(calls) == 2
    assert bank_writer.recording_state(rec.entry_id)["state"] == "recorded"
    assert bank_writer.recording_state("0" * 32) == {"entry_id": "0" * 32, "state": "unknown"}


def test_a_recording_whose_model_was_deleted_before_its_write_is_dropped_not_written(bank, tmp_path, caplog):
    """Its model is gone (deleted between the generation and the write): no request could ever
    hit the entry, so it is dropped at its first try, as a replay drops it, and shown failed."""
    model = tmp_path / "wan.safetensors"
    model.write_bytes(b"weights")
    rec = recording(seed=6, model_files=(str(model),))
    model.unlink()

    recording_queue.hand_over(bank, rec)
    item = wait_done(rec.entry_id)

    assert item.reason == "its model's files were deleted, so no request could use it; dropped"
    assert item.attempts == 1
    assert bank.stats()["entries"] == 0 and spool.spooled_count(bank) == 0
    assert f"dropped the spooled recording {rec.entry_id}" in caplog.text
