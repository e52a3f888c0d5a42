"""The recording spool around ComfyUI's life: replay at start, drain on SIGTERM and SIGINT.

At start every bank with spooled recordings (folder banks in the registered ``chorus_banks``
folders, and named PostgreSQL banks, whose spools are local, in
``models/chorus_banks/.postgres-spool/``) is replayed on a background thread, so ComfyUI
answers at once. SIGTERM (``docker stop``, ``systemctl stop``, Kubernetes) and SIGINT (Ctrl-C)
give the queued writes up to ``CHORUS_DRAIN_SECONDS`` (5 s by default; well inside Docker's
10 s grace period), log what was written and what stays spooled, then go on as the handler
that was there before would (ComfyUI's own, or the default: the process ends).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger("chorus")
_replayed: set[str] = set()
_replay_lock = threading.Lock()


def on_start(bank_roots: list[str], postgres_banks: dict[str, str]) -> None:
    """Point PostgreSQL spools at the first bank folder, hook the signals, replay in the background."""
    from ..chorus_core.bank import spool

    if bank_roots:
        spool.set_local_spool_root(os.path.join(bank_roots[0], spool.POSTGRES_SPOOL_FOLDER))
    install_signal_drain()
    locations = [os.path.join(root, name) for root in bank_roots if os.path.isdir(root)
                 for name in sorted(os.listdir(root))]
    locations += list(postgres_banks.values())
    threading.Thread(target=replay_banks, args=(locations,), name="chorus-spool-replay", daemon=True).start()


def replay_banks(locations: list[str]) -> None:
    """Replay the spool of each bank location that has one (banks without are never opened)."""
    for location in locations:
        replay_once(location)


def replay_once(location: str) -> None:
    """Replay ``location``'s spool the first time this process asks (the start, then the Loader)."""
    from ..chorus_core.bank import BankError, open_bank, spool
    from ..chorus_core.bank.bank_url import redact

    with _replay_lock:
        if location in _replayed or not _has_spooled(location):
            return
        _replayed.add(location)
    try:
        with open_bank(location, create=False) as bank:
            outcome = spool.replay_spool(bank)
    except BankError as exc:  # a server that is down: the Loader tries again when it opens the bank
        with _replay_lock:
            _replayed.discard(location)
        log.warning("Chorus: the spooled recordings of bank %s were not replayed (%s); they stay spooled "
                    "and are replayed when the bank is next opened", redact(location), exc)
        return
    log_replay(redact(location), outcome)


def replay_in_background(location: str) -> None:
    """:func:`replay_once` off the caller's thread (the Loader must not wait for a replay)."""
    threading.Thread(target=replay_once, args=(location,), name="chorus-spool-replay", daemon=True).start()


def _has_spooled(location: str) -> bool:
    from ..chorus_core.bank import spool
    from ..chorus_core.bank.bank_url import is_bank_url, redact

    if is_bank_url(location):  # its spool is local: no connection is made for an empty one
        return bool(spool.pending_files(spool.spool_folder_at(None, redact(location))))
    return os.path.isfile(os.path.join(location, "bank.sqlite")) and \
        bool(spool.pending_files(spool.spool_folder_at(location, location)))


def log_replay(label: str, outcome: dict) -> None:
    """One line per bank whose spool held something: which entries went in, and which did not."""
    parts = [f"{len(ids)} {kind} ({', '.join(ids)})" for kind, ids in outcome.items() if ids]
    if parts:
        log.warning("Chorus: replayed the recording spool of bank %s: %s", label, "; ".join(parts))


def install_signal_drain() -> None:
    """Drain the bank writer on SIGTERM and SIGINT, then hand over to the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers (ComfyUI loads the pack there)
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)
        if getattr(previous, "chorus_drain", False) or previous == signal.SIG_IGN:
            continue  # installed already, or ComfyUI was started to ignore it: it goes on ignoring it
        handler = _drain_then(previous)
        signal.signal(signum, handler)


def _drain_then(previous):
    def handler(signum, frame):
        from ..chorus_core.reuse.bank_writer import drain_before_exit

        drain_before_exit(signal.Signals(signum).name)
        if callable(previous):
            previous(signum, frame)
        else:  # the default: end as the signal would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    handler.chorus_drain = True
    return handler
