"""What a dense step costs, remembered per process, so a run with no dense step of its own (a hit
sparse from its first step) can still be timed against one.

Keyed by the model's fingerprint, the latent grid and the model-call batch (cfg 1 runs half the
batch of cfg > 1): only a dense step of the same work is a fair comparison. Bounded: the most
recent keys only.
"""

from __future__ import annotations

from collections import OrderedDict
from threading import Lock
from typing import Optional

_MAX_KEYS = 64
_times: "OrderedDict[tuple, float]" = OrderedDict()
_lock = Lock()


def remember_dense_step(key: tuple, seconds: float) -> None:
    """Keep the mean dense step time of a run of ``key``."""
    with _lock:
        _times[key] = float(seconds)
        _times.move_to_end(key)
        while len(_times) > _MAX_KEYS:
            _times.popitem(last=False)


def earlier_dense_step(key: tuple) -> Optional[float]:
    """The last remembered dense step time of ``key`` in this process, or None."""
    with _lock:
        return _times.get(key)


def forget_dense_steps() -> None:
    """Forget every remembered dense step (a fresh process's state)."""
    with _lock:
        _times.clear()
