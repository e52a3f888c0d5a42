"""What every testbed result file names about its run (../shared/RESULTS.md): machine, date,
commit and command."""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

import torch

from .report import cpu_name


def git_commit() -> str:
    """The checkout's commit (``CHORUS_GIT_COMMIT`` where the copy has no .git), with ``+dirty`` for local changes."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("CHORUS_GIT_COMMIT", "unknown")


def run_record(command: str, on_gpu: bool, machine: str | None = None) -> dict:
    """``{"machine", "date", "git_commit", "command"}`` of a run made now (``machine`` to name another)."""
    return {"machine": machine or (torch.cuda.get_device_name() if on_gpu else cpu_name()),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "command": command}
