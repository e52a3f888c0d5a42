"""Recorded masks go into the bank on a background thread, so a miss never holds the queue.

After a recording miss the prompt's thread writes the recording to the bank's spool
(:mod:`chorus_core.bank.spool`: fsynced before the report says ``queued``) and hands it to
:func:`submit`; one writer thread per process adds the entry and removes the spool file, then
(``after``) refreshes that key's population prior; a request waiting for the entry is released
when the entry is in, not after the refresh. The queue is bounded: when it is full the new
recording is dropped with a warning rather than delaying the next prompt. Nothing reported
``queued`` is lost when the process stops: :func:`drain` (run by the pack's SIGTERM and SIGINT
handlers and at exit) waits up to :data:`DRAIN_S` for the queue, and what is left stays spooled
for the next process that opens the bank to replay.

A request that arrives while a similar entry is still being written waits for that write
(:func:`wait_for_similar`) and then hits it, instead of missing and recording the same masks again.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

log = logging.getLogger("chorus")
QUEUE_SIZE = 4  # recordings waiting to be written; more are dropped (each holds its masks in RAM)
HISTORY = 64  # finished writes remembered for outcome()
# When the process is told to stop (SIGTERM, SIGINT, exit), how long queued writes may go on:
# well under Docker's 10 s and Kubernetes' 30 s grace periods; what is left stays spooled.
DRAIN_S = float(os.environ.get("CHORUS_DRAIN_SECONDS", "5"))
# Tests only: seconds the writer sleeps before each write, so a test can stop a server while a
# recording is certainly still queued. Never set it in production.
TEST_ONLY_DELAY_ENV = "CHORUS_TEST_ONLY_WRITER_DELAY_S"
# A spooled write that fails (the bank's lock held by a long import, a database restarting, a
# full disk) is tried again after each of these; after the last it stays spooled for the next start.
RETRY_DELAYS_S = (1.0, 2.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0)
FLUSH_POLL_S = 0.05  # how often flush() looks whether a write now waits out a back-off


class GiveUp(Exception):
    """A write that trying again cannot help (the bank refused the recording, its spool file was
    damaged, or its model is gone). Its message is shown by the routes and the web view: a
    short reason that names no path."""
SIMILAR_WAIT_S = 60.0  # longest a request waits for a similar pending entry before it misses


@dataclass
class PendingWrite:
    """One recording on its way into a bank."""

    bank_root: str  # the bank's identity: its folder, or a key naming a server bank
    entry_id: str
    compat: str
    signature: object  # chorus_core.bank.Signature
    write: Optional[Callable[[], None]]  # does the work, raises on failure; dropped when done (it holds the masks)
    after: Optional[Callable[[], None]] = None  # follow-up work no request waits for (the prior's refresh)
    done: threading.Event = field(default_factory=threading.Event)  # the entry is in the bank (or failed)
    settled: threading.Event = field(default_factory=threading.Event)  # ``after`` has run too
    error: Optional[str] = None  # the whole text, for the log (it may name server paths)
    reason: Optional[str] = None  # why it failed for good, short and without paths (routes, web view)
    spool_path: Optional[object] = None  # the recording's spool file (a Path) until the entry is in
    retry: Optional[Callable[[], None]] = None  # writes it again from its spool file (holds no masks)
    attempts: int = 0  # failed tries so far
    next_try: Optional[float] = None  # monotonic time of the next try while a failed write waits
    submitted: float = field(default_factory=time.perf_counter)
    seconds: Optional[float] = None


class BankWriter:
    """A single writer thread with a bounded queue (one per process: :func:`default_writer`)."""

    def __init__(self, size: int = QUEUE_SIZE):
        self._queue: "queue.Queue[PendingWrite]" = queue.Queue(maxsize=size)
        self._pending: dict[str, PendingWrite] = {}
        self._unsettled: dict[str, PendingWrite] = {}  # submitted, ``after`` not yet run
        self._finished: "collections.OrderedDict[str, PendingWrite]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self._serial = 0  # bumps at every submit and completion: part of the bank loader's cache key
        self._thread = threading.Thread(target=self._run, name="chorus-bank-writer", daemon=True)
        self._thread.start()

    def submit(self, item: PendingWrite) -> bool:
        """Queue ``item``; False (and nothing queued) when the queue is full."""
        with self._lock:
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                return False
            self._pending[item.entry_id] = item
            self._unsettled[item.entry_id] = item
            self._serial += 1
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if self._attempt(item):
                self._follow_up(item)
            self._queue.task_done()

    def _attempt(self, item: PendingWrite) -> bool:
        """One try at ``item``'s write; True when it is over (written, or failed for good)."""
        try:
            _test_only_delay()
            item.write()
            item.error = None
        except Exception as exc:  # the generation succeeded long ago: log, never raise
            item.error = f"{type(exc).__name__}: {exc}"
            item.attempts += 1
            if self._retry_later(item, exc):
                return False
            item.after = None  # nothing to refresh for an entry that is not there
            _give_up(item, exc)
        self._finish(item)
        return True

    def _retry_later(self, item: PendingWrite, exc: Exception) -> bool:
        """Schedule another try of a spooled write after its back-off; False when none is left."""
        if item.retry is None or isinstance(exc, GiveUp) or item.attempts > len(RETRY_DELAYS_S):
            return False
        delay = RETRY_DELAYS_S[item.attempts - 1]
        item.write = item.retry  # reads the spool file again: the recorded masks are freed meanwhile
        item.next_try = time.monotonic() + delay
        log.warning("Chorus: recorded masks %s were not written (%s); trying again in %.0f s (try %d of %d)",
                    item.entry_id, item.error, delay, item.attempts + 1, len(RETRY_DELAYS_S) + 1)
        with self._lock:
            self._serial += 1
        timer = threading.Timer(delay, self._requeue, [item])
        timer.daemon = True
        timer.start()
        return True

    def _requeue(self, item: PendingWrite) -> None:
        item.next_try = None
        try:
            self._queue.put_nowait(item)
        except queue.Full:  # new recordings fill the queue: look again in a second
            item.next_try = time.monotonic() + 1.0
            timer = threading.Timer(1.0, self._requeue, [item])
            timer.daemon = True
            timer.start()

    def _finish(self, item: PendingWrite) -> None:
        item.write = item.retry = None  # the closure holds the recorded masks (210 MB at 720p-14B): free them
        item.seconds = time.perf_counter() - item.submitted
        with self._lock:
            self._pending.pop(item.entry_id, None)
            self._finished[item.entry_id] = item
            while len(self._finished) > HISTORY:
                self._finished.popitem(last=False)
            self._serial += 1
        item.done.set()

    def _follow_up(self, item: PendingWrite) -> None:
        try:
            if item.after is not None:
                item.after()
        except Exception as exc:  # the entry is in; a stale prior is rebuilt by the next prior-mode miss
            log.warning("Chorus: the population prior was not refreshed after %s: %s", item.entry_id, exc)
        finally:
            item.after = None
            with self._lock:
                self._unsettled.pop(item.entry_id, None)
            item.settled.set()

    def pending(self, bank_key=None) -> list[PendingWrite]:
        """Writes not finished yet (for one bank, or all)."""
        key = None if bank_key is None else str(bank_key)
        with self._lock:
            return [p for p in self._pending.values() if key is None or p.bank_root == key]

    def outcome(self, entry_id: str) -> Optional[PendingWrite]:
        """A queued or recently finished write (``.done``, ``.error``, ``.seconds``), or None."""
        with self._lock:
            return self._pending.get(entry_id) or self._finished.get(entry_id)

    def recordings(self, bank_key=None) -> list[dict]:
        """What the web view and routes show: each pending write and each recent failed one, as
        ``{"entry_id", "state": "queued"|"retrying"|"failed", "attempts", "error", "reason", "retry_in_s",
        "merged_into"}`` (``merged_into``: the entry a written recording merged into, else None)
        (``error`` is the whole text, ``reason`` a short one without paths, once failed)."""
        key = None if bank_key is None else str(bank_key)
        with self._lock:
            items = list(self._pending.values()) + [i for i in self._finished.values() if i.error is not None]
        return [_shown(i) for i in items if key is None or i.bank_root == key]

    def recording_state(self, entry_id: str) -> dict:
        """One recording as :meth:`recordings` shows it, or state ``recorded`` once it is in the bank,
        ``unknown`` when this process never had it or has forgotten it (:data:`HISTORY`)."""
        item = self.outcome(entry_id)
        if item is None:
            return {"entry_id": entry_id, "state": "unknown"}
        return _shown(item)

    def state_token(self) -> int:
        """Changes whenever a write is queued or finishes."""
        with self._lock:
            return self._serial

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued write and its follow-up has finished, or failed and waits out its
        back-off (it stays spooled: see :meth:`recordings`); False when ``timeout`` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            items = list(self._unsettled.values())
        for item in items:
            while not (item.settled.is_set() or item.next_try is not None):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                item.settled.wait(FLUSH_POLL_S if left is None else min(FLUSH_POLL_S, left))
        return True

    def drain(self, timeout: float) -> tuple[list[str], list[str]]:
        """Wait up to ``timeout`` s until every queued entry is in its bank (prior refreshes are
        not waited for); returns (ids written meanwhile, ids still pending)."""
        deadline = time.monotonic() + timeout
        items = self.pending()
        for item in items:
            if item.next_try is not None and item.next_try > deadline:
                continue  # failed, and its next try comes after the bound: it stays spooled
            item.done.wait(max(0.0, deadline - time.monotonic()))
        written = [i.entry_id for i in items if i.done.is_set() and i.error is None]
        return written, [i.entry_id for i in items if not i.done.is_set() or i.error is not None]


def _give_up(item: PendingWrite, exc: Exception) -> None:
    """Say in the log, and in ``item.reason`` for the routes, why the write stops being tried."""
    if isinstance(exc, GiveUp):  # trying again cannot help: not retried, nor left for the next start
        item.reason = str(exc)
        log.warning("Chorus: recorded masks %s will not be written (not retried: the same write would "
                    "fail again): %s", item.entry_id, item.error)
        return
    kept = item.spool_path is not None
    item.reason = f"{type(exc).__name__} after {item.attempts} tries" + ("; stays spooled for the next start"
                                                                         if kept else "")
    log.warning("Chorus: recorded masks %s were not written: %s%s", item.entry_id, item.error,
                "; it stays spooled and is replayed when the bank is next opened" if kept else "")


def _state(item: PendingWrite) -> str:
    if item.done.is_set():
        return "failed" if item.error is not None else "recorded"
    return "retrying" if item.attempts else "queued"


def _shown(item: PendingWrite) -> dict:
    from ..bank.merge import merged_into  # here: this module imports nothing of the bank at load

    retry_in = None if item.next_try is None else round(max(0.0, item.next_try - time.monotonic()), 1)
    return {"entry_id": item.entry_id, "state": _state(item), "attempts": item.attempts, "error": item.error,
            "reason": item.reason, "retry_in_s": retry_in, "merged_into": merged_into(item.entry_id)}


def _test_only_delay() -> None:
    delay = os.environ.get(TEST_ONLY_DELAY_ENV)
    if delay:
        time.sleep(float(delay))


_default: Optional[BankWriter] = None
_default_lock = threading.Lock()


def default_writer() -> BankWriter:
    """This process's writer, started on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = BankWriter()
            atexit.register(drain_before_exit, "exit")
        return _default


def new_entry_id() -> str:
    """The id a queued recording will have in the bank (known before it is written)."""
    return uuid.uuid4().hex


def drain_before_exit(reason: str, timeout: Optional[float] = None) -> None:
    """Give queued writes up to ``timeout`` (default :data:`DRAIN_S`) s, then log what was
    written and what stays spooled. Runs once per process (a signal handler, then atexit)."""
    global _drained
    with _default_lock:
        if _drained or _default is None:
            return
        _drained = True
    started = time.monotonic()
    written, left = _default.drain(DRAIN_S if timeout is None else timeout)
    if written or left:
        log.warning("Chorus: stopping (%s): %d recording(s) written to the bank in %.2f s%s%s", reason,
                    len(written), time.monotonic() - started, f" ({', '.join(written)})" if written else "",
                    f"; {len(left)} left spooled ({', '.join(left)}), replayed when the bank is next opened"
                    if left else "")


_drained = False


def recordings(bank_key) -> list[dict]:
    """This process's pending and recently failed writes to one bank (:meth:`BankWriter.recordings`)."""
    return [] if _default is None else _default.recordings(bank_key)


def recording_state(entry_id: str) -> dict:
    """Where one recording of this process is (:meth:`BankWriter.recording_state`); polled by the web view."""
    return {"entry_id": entry_id, "state": "unknown"} if _default is None else _default.recording_state(entry_id)


def flush_all(timeout: Optional[float] = None) -> bool:
    """Wait for every pending write of this process (benchmarks, tests, shutdown)."""
    return _default is None or _default.flush(timeout)


def wait_for_similar(bank_key, compat: str, signature, threshold: float, weights=None,
                     timeout: float = SIMILAR_WAIT_S) -> Optional[str]:
    """Wait for a pending write to this bank that this request would hit; its entry id, or None.

    :param bank_key: the bank's identity as given to :class:`PendingWrite` (its folder or URL key)
    :param threshold: the request's hit threshold (weighted cosine similarity)
    :param timeout: longest wait in all; after it the request goes on as a miss
    """
    if _default is None or bank_key is None:
        return None
    deadline = time.monotonic() + timeout
    for item in _default.pending(bank_key):
        if item.compat != compat or item.signature is None:
            continue
        similarity, _ = signature.similarity(item.signature, weights)
        if similarity < threshold:
            continue
        if not item.done.wait(max(0.0, deadline - time.monotonic())):
            log.warning("Chorus: a similar entry is still being written after %.0f s; this request runs "
                        "as a miss", timeout)
            return None
        if item.error is None:
            return item.entry_id
    return None
