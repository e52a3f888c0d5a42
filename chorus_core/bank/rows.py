"""Index rows of the mask bank: how an entry is written down, whichever backend stores it.

The folder bank (SQLite), the PostgreSQL bank and the export/import code all build, select
and decode the same columns (schema.py), so the row helpers live here, below all of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time

from . import validation
from .encoding import CODEC
from .fingerprint import ModelFingerprint
from .records import LatentLayout, Schedule
from .signature import COMPONENTS, Signature, unit_component

# The columns a listing shows: everything but the signature vectors (which are large).
SUMMARY_COLUMNS = (
    "id, created, last_hit, hits, status, status_reason, tags, density, recall, "
    "steps, sampler, scheduler, shift, step_buckets, sigmas, grid_t, grid_h, grid_w, "
    "token_order, block_q, block_k, fingerprint, compat, codec, blob_name, blob_bytes, "
    "blob_sha256")
# The same from a bank read (read-only) at a schema version before the sigmas column.
SUMMARY_COLUMNS_NO_SIGMAS = SUMMARY_COLUMNS.replace(" sigmas,", " NULL AS sigmas,")


def summary_columns(has_sigmas: bool) -> str:
    """The listing's columns for a bank whose entries table has (or lacks) ``sigmas``."""
    return SUMMARY_COLUMNS if has_sigmas else SUMMARY_COLUMNS_NO_SIGMAS


def compat_key(fingerprint: ModelFingerprint, layout: LatentLayout) -> str:
    """What two entries must share to be interchangeable: model, grid, token order, blocks."""
    text = json.dumps([fingerprint.key(), layout.to_dict()], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def signature_columns(signature: Signature) -> dict:
    """``sig_<component>`` values of a row: unit float32 bytes, or None where absent.

    :raises ValueError: a component that cannot be made a unit vector of length DIM
    """
    return {f"sig_{c}": (unit_component(c, signature.components[c]).tobytes()
                         if c in signature.components else None) for c in COMPONENTS}


def schedule_columns(schedule: Schedule) -> dict:
    """The schedule's columns of a row (sigmas as a JSON list, or None when unknown)."""
    return {"steps": schedule.steps, "sampler": schedule.sampler,
            "scheduler": schedule.scheduler, "shift": schedule.shift,
            "step_buckets": json.dumps(schedule.step_buckets),
            "sigmas": None if schedule.sigmas is None else json.dumps(list(schedule.sigmas))}


def build_row(entry_id: str, fingerprint: ModelFingerprint, layout: LatentLayout,
              schedule: Schedule, signature: Signature, density, recall, tags,
              name: str, size: int, sha: str) -> dict:
    """A new entry's row (no hits yet, status ok), ready for insertion."""
    now = time.time()
    sigs = signature_columns(signature)
    return {
        "id": entry_id, "created": now, "last_hit": None, "hits": 0,
        "compat": compat_key(fingerprint, layout), "fingerprint": fingerprint.key(),
        "grid_t": layout.grid[0], "grid_h": layout.grid[1], "grid_w": layout.grid[2],
        "token_order": layout.token_order,
        "block_q": layout.block_size[0], "block_k": layout.block_size[1],
        **schedule_columns(schedule),
        "density": float(density), "recall": None if recall is None else float(recall),
        "tags": json.dumps(sorted(set(tags))), "status": "ok", "status_reason": None,
        "codec": CODEC, "blob_name": name, "blob_bytes": size, "blob_sha256": sha, **sigs,
    }


def decode_row(row: dict) -> dict:
    """A row as callers see it: the JSON columns (tags, step buckets, sigmas, fingerprint)
    parsed; ``sigmas`` is None for entries recorded before sigmas were stored."""
    row = dict(row)
    row.setdefault("sigmas", None)  # a bank read at a schema version before the column
    for key in ("tags", "step_buckets", "sigmas", "fingerprint"):
        if isinstance(row.get(key), str):
            with contextlib.suppress(ValueError):  # a damaged row still lists
                row[key] = validation.load_json(row[key], key)
    return row


def entry_label(row: dict) -> str:
    """An entry's id when it is a valid one, else its row number (never a hostile string)."""
    return row.get("id") if validation.is_entry_id(row.get("id")) else f"(row {row['rowid']})"


def blob_metadata(meta: dict) -> dict:
    """One JSON value: safetensors writes several metadata keys in random order, which would
    break content addressing (equal masks must give equal bytes)."""
    return {"chorus": json.dumps(meta, sort_keys=True)}
