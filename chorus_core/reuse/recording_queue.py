"""A recording miss's masks on their way to the bank: spooled durably first, then queued.

The report may say ``recording: queued`` only once the recording is on disk (the bank's spool,
fsynced): whatever then stops the process, the entry reaches the bank, now or when the bank
is next opened. Where the spool cannot be written (a full or read-only disk), the entry is
written here and now, and the report says ``recorded``.
"""

from __future__ import annotations

import functools
import logging

from . import bank_writer
from ..bank import BankError, compat_key
from ..bank import spool

log = logging.getLogger("chorus")


def hand_over(bank, recording: spool.Recording, after=None) -> tuple[str | None, str | None]:
    """Spool ``recording`` for ``bank`` and queue its write; ``(recording state, warning)``.

    :param after: follow-up once the entry is in (the population prior's refresh)
    :return: state ``"queued"`` (spooled, written in the background), ``"recorded"`` (already in
        the bank) or None (not recorded; the warning says why)
    """
    try:
        path = spool.write_spool(spool.spool_folder(bank), recording)
    except BankError as exc:
        return _write_now(bank, recording, exc)
    pending = bank_writer.PendingWrite(
        bank_root=bank.label, entry_id=recording.entry_id,
        compat=compat_key(recording.fingerprint, recording.layout), signature=recording.signature,
        write=functools.partial(_commit, bank, path, recording), after=after, spool_path=path,
        retry=functools.partial(_replay, bank, path))
    if bank_writer.default_writer().submit(pending):
        return "queued", None
    return "queued", ("the bank writer is still busy with earlier recordings: this one stays spooled and "
                      "is written when the bank is next opened (a ComfyUI start, the Mask Bank Loader, "
                      "`python -m chorus_core.bank verify`)")


def _commit(bank, path, recording: spool.Recording) -> None:
    # Its own connection: SQLite connections are not shared between threads mid-transaction.
    with bank.reopen() as writer_bank:
        try:
            spool.commit(writer_bank, path, recording)
        except spool.RecordingRefused as exc:  # the same write would fail again: no back-off, no retry
            raise bank_writer.GiveUp(exc.reason) from exc


def _replay(bank, path) -> None:
    """A failed write tried again from its spool file (what a later start would do)."""
    with bank.reopen() as writer_bank:
        outcome, name = spool.replay_file(writer_bank, path, wait=60.0)
    if outcome == "quarantined":
        raise bank_writer.GiveUp("its spool file was damaged or the bank refused it; it was quarantined")
    if outcome == "dropped":
        raise bank_writer.GiveUp(spool.MODEL_GONE)
    if outcome == "left":
        why = name.partition(" (")[2].rstrip(")") or "another process holds its spool file"
        raise BankError(why)


def _write_now(bank, recording: spool.Recording, spool_error: BankError) -> tuple[str | None, str | None]:
    log.warning("Chorus: %s; writing the entry before the run reports", spool_error)
    try:
        with bank.reopen() as writer_bank:
            recording.add_to(writer_bank)
    except BankError as exc:
        return None, f"masks not recorded: {exc}"
    return "recorded", f"masks written to the bank at once (not spooled: {spool_error})"
