"""One open bank object per bank and thread, one signature index per bank for the process.

A bank object keeps its signature index (:mod:`.matching`) and refreshes it incrementally by the
bank's generation counter: a new entry appends its vector, it does not reload the others. A caller
that opened a new object whenever the bank changed (ComfyUI's cache key of the Mask Bank Loader
changes with every write) threw that index away and read every signature of the key again on its
next match: about 300 MB at 100,000 entries. :func:`shared_bank` hands out the same object while
it is still the same bank: a folder bank whose ``bank.sqlite`` was deleted or replaced (another
file at the path), or a PostgreSQL bank made again under its URL (another bank id), gets a new
object. SQLite connections must not be shared by threads (one thread's transaction would take in
another's statements), so each thread has its own object and connection; but the objects of one
bank share one signature index (about 3 GB at 1,000,000 entries: ComfyUI's prompt thread and its
route threads hold it once). An object whose thread has ended is closed on the next call here.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from . import BankError, open_bank
from .bank_url import is_bank_url
from .matching import SignatureIndex
from .storage import BankStorage

_lock = threading.Lock()
# (location, read_only, thread) -> (bank, identity): the Thread object, not its ident, which a
# new thread may be given again once the old one has ended
_open: dict[tuple, tuple[BankStorage, object]] = {}
_indexes: dict[tuple, tuple[object, SignatureIndex]] = {}  # (location, read_only) -> (identity, index)
UNKNOWN = ("missing", "unreadable")  # identities that name no bank (see _identity)


def shared_bank(location, read_only: bool = False, create: bool = True) -> BankStorage:
    """This thread's open object for the bank at ``location`` (see :func:`open_bank` for the
    arguments and errors); opened on first use, and again when the bank's file was replaced.
    Objects of one bank in other threads share its signature index."""
    _close_ended_threads()
    key = (str(location), bool(read_only), threading.current_thread())
    with _lock:
        held = _open.get(key)
    if held is not None and held[1] == _identity(held[0], location):
        return held[0]
    bank = open_bank(location, read_only=read_only, create=create)
    identity = _identity(bank, location)
    with _lock:
        previous = _open.get(key)
        _open[key] = (bank, identity)
        bank.signature_index = _index_for(key[:2], identity)
    if previous is not None and previous[0] is not bank:
        _close_quietly(previous[0])
    return bank


def _index_for(bank_key: tuple, identity) -> SignatureIndex:
    """The process's index of the bank (under ``_lock``): a new one when the bank was replaced,
    whose entries the old index would still serve."""
    if identity in UNKNOWN:  # a passing failure must not throw away the shared index
        return SignatureIndex()
    held = _indexes.get(bank_key)
    if held is None or held[0] != identity:
        held = _indexes[bank_key] = (identity, SignatureIndex())
    return held[1]


def _close_ended_threads() -> None:
    """Close the objects of threads that have ended (nothing else would: their connections and,
    for the last of a bank, its index stayed in memory), and forget indexes no object uses."""
    with _lock:
        ended = [key for key in _open if not key[2].is_alive()]
        closing = [_open.pop(key)[0] for key in ended]
        used = {key[:2] for key in _open}
        for bank_key in [k for k in _indexes if k not in used]:
            del _indexes[bank_key]
    for bank in closing:
        _close_quietly(bank)


def forget_shared_banks() -> None:
    """Close and drop every shared object (tests; a process that moves its banks)."""
    with _lock:
        held = list(_open.values())
        _open.clear()
        _indexes.clear()
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
