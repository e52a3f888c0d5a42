"""The crash-test seam of the bank: die at a named point, as a power cut or OOM kill would.

Tests set ``CHORUS_BANK_FAULT`` to a point name (``add-blob-written``, ``delete-before-commit``,
...) and check that the bank is consistent afterwards. It lives apart from the backends so
that each of them, and the export/import code, can mark its points without importing another.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "CHORUS_BANK_FAULT"


def fault(point: str) -> None:
    """Die here (SIGKILL, no cleanup) when ``CHORUS_BANK_FAULT`` names ``point``."""
    if os.environ.get(FAULT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)
