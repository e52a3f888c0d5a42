"""One open bank object per bank for the process (per thread), so what it keeps in memory lives.

A bank object keeps its signature index (:mod:`.matching`) and refreshes it incrementally by the
bank's generation counter: a new entry appends its vector, it does not reload the others. A caller
that opened a new object whenever the bank changed (ComfyUI's cache key of the Mask Bank Loader
changes with every write) threw that index away and read every signature of the key again on its
next match: about 300 MB at 100,000 entries. :func:`shared_bank` hands out the same object while
it is still the same bank: a folder bank whose ``bank.sqlite`` was deleted or replaced (another
file at the path), or a PostgreSQL bank made again under its URL (another bank id), gets a new
object. SQLite connections belong to the thread that opened them, so
the objects are kept per thread; ComfyUI runs prompts on one thread.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from . import BankError, open_bank
from .bank_url import is_bank_url
from .storage import BankStorage

_lock = threading.Lock()
_open: dict[tuple, tuple[BankStorage, object]] = {}  # (location, read_only, thread) -> (bank, file identity)


def shared_bank(location, read_only: bool = False, create: bool = True) -> BankStorage:
    """The process's open object for the bank at ``location`` (see :func:`open_bank` for the
    arguments and errors); opened on first use, and again when the bank's file was replaced."""
    key = (str(location), bool(read_only), threading.get_ident())
    with _lock:
        held = _open.get(key)
    if held is not None and held[1] == _identity(held[0], location):
        return held[0]
    bank = open_bank(location, read_only=read_only, create=create)
    with _lock:
        previous = _open.get(key)
        _open[key] = (bank, _identity(bank, location))
    if previous is not None and previous[0] is not bank:
        _close_quietly(previous[0])
    return bank


def forget_shared_banks() -> None:
    """Close and drop every shared object (tests; a process that moves its banks)."""
    with _lock:
        held = list(_open.values())
        _open.clear()
    for bank, _ in held:
        _close_quietly(bank)


def _identity(bank: BankStorage, location):
    """What says a bank is still the one an object was opened on: a folder bank's database file
    (device and inode); a PostgreSQL bank's id (a schema dropped and made again under the same
    URL is another bank, whose counters start again: an index kept from the old one would serve
    entries it does not hold)."""
    if not is_bank_url(location):
        return _file_identity(location)
    try:
        return bank.content_token().partition(":")[0]
    except BankError:
        return "unreadable"


def _file_identity(location):
    try:
        info = os.stat(Path(location) / "bank.sqlite")
    except OSError:
        return "missing"
    return info.st_dev, info.st_ino


def _close_quietly(bank: BankStorage) -> None:
    try:
        bank.close()
    except Exception:  # noqa: BLE001 - a replaced bank's old connection: nothing to save
        pass
