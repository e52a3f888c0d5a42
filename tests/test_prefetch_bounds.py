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


def test_a_cancelled_run_stops_its_prefetch_at_once_and_nothing_refills_what_it_freed():
    """Before: a failed or cancelled hit joined the worker for up to 60 s while it decoded the rest
    of the entry, refilling the pinned buffers just cleared."""
    import time
    from contextlib import nullcontext

    decoded = []

    class SlowEntry:  # 2 buckets x 20 layers, 0.2 s each: 8 s to decode whole
        shape, step_buckets = (2, 20, 1, 4, 4), [(0, 1), (1, 2)]

        def packed_block_map_or_reason(self, bucket, layer):
            time.sleep(0.2)
            decoded.append((bucket, layer))
            import numpy as np
            return np.packbits(np.eye(4, dtype=bool)[None], axis=-1), None

    prefetch = EntryPrefetch(lambda: nullcontext(SlowEntry()), decode_threads=1)
    prefetch.layer_mask(0, 0, (16, 16), 64, "cpu")
    started = time.monotonic()
    prefetch.cancel()
    took = time.monotonic() - started

    assert took < entry_prefetch.CANCEL_JOIN_S and not prefetch._thread.is_alive()
    assert prefetch._host == {} and prefetch._entry is None and len(decoded) < 10
