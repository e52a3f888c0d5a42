"""A hit's prefetch never holds a generation: every wait on its worker is bounded by its progress."""

import contextlib
import threading

import pytest

from chorus_core.reuse import entry_prefetch
from chorus_core.reuse.entry_prefetch import EntryPrefetch


def test_a_load_that_makes_no_progress_fails_the_wait_within_the_bound(monkeypatch):
    monkeypatch.setattr(entry_prefetch, "STALL_S", 0.5)
    release = threading.Event()

    @contextlib.contextmanager
    def never_answers():  # a bank server that accepted the query and went silent
        release.wait(30)
        raise RuntimeError("the server came back")
        yield  # noqa: unreachable

    prefetch = EntryPrefetch(never_answers)
    try:
        with pytest.raises(TimeoutError, match="made no progress for 0.5 s"):
            prefetch.entry()
        with pytest.raises(TimeoutError):
            prefetch.layer_mask(0, 0, (16, 16), 128, "cpu")
    finally:
        release.set()
        prefetch.join(5)
