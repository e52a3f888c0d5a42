"""The population prior as a bank artefact: built once per bank content, read like an entry.

A prior-mode miss used to decode up to 8 entries per (step bucket, layer) during sampling. Here
the prior of one compatibility key is built once from the most recently used compatible entries,
encoded with the entry codec and kept in ``<bank>/priors/`` under a name derived from the bank's
content token, so adding, pruning or quarantining entries makes the next prior a new file (old
ones are removed). A read-only bank keeps its priors in this process's memory instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from pathlib import Path

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from .bank import EntryMasks, LatentLayout, Schedule, compat_key, encode_masks
from .population_prior import population_prior

PRIOR_ENTRIES = 8  # most recently used compatible entries that form the prior
PRIORS_DIR = "priors"
_memory: dict[str, EntryMasks] = {}  # read-only banks: key -> prior, newest content only
_lock = threading.Lock()


def prior_key(bank, fingerprint, layout: LatentLayout, min_density: float, max_density: float) -> str:
    """Names the prior of this bank content, model, layout and density clamp (hex, filename-safe)."""
    text = json.dumps([bank.content_token(), compat_key(fingerprint, layout), round(min_density, 6),
                       round(max_density, 6), PRIOR_ENTRIES])
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def load_prior(bank, fingerprint, layout, min_density: float, max_density: float):
    """The stored prior for this content, building it when missing; None when no entry is compatible."""
    key = prior_key(bank, fingerprint, layout, min_density, max_density)
    path = Path(bank.root) / PRIORS_DIR / f"{key}.safetensors"
    if key in _memory:
        return _memory[key]
    if path.is_file() and not path.is_symlink():
        try:
            return _read(path, key)
        except Exception:  # a damaged prior is only a cache: build it again
            pass
    built = build_prior(bank, fingerprint, layout, min_density, max_density)
    if built is None:
        return None
    tensors, meta = built
    if bank.read_only:
        with _lock:
            _memory.clear()  # one bank content at a time: memory stays bounded
            _memory[key] = _entry(key, tensors, meta)
        return _memory[key]
    _write(path, tensors, meta)
    return _entry(key, tensors, meta)


def build_prior(bank, fingerprint, layout, min_density, max_density):
    """Per (bucket, layer), the blocks most often kept by the compatible entries, at their mean density.

    :return: (tensors, metadata) in the entry codec, or None when no entry is compatible
    """
    ids = bank.compatible_entries(fingerprint, layout, limit=PRIOR_ENTRIES)
    entries = [bank.load_masks(entry_id, record_hit=False) for entry_id in ids]
    if not entries:
        return None
    buckets, layers = len(entries[0].step_buckets), entries[0].shape[1]
    maps = np.zeros((buckets, *entries[0].shape[1:]), dtype=bool)
    for bucket in range(buckets):
        for layer in range(layers):
            members = [e.block_map(min(bucket, len(e.step_buckets) - 1), layer) for e in entries]
            density = sum(m.float().mean().item() for m in members) / len(members)
            density = min(max(density, min_density), max_density)
            maps[bucket, layer] = population_prior(members, density).numpy()
    tensors, meta = encode_masks(maps)
    meta.update(prior_of=json.dumps(ids), schedule=json.dumps(entries[0].schedule.to_dict()),
                layout=json.dumps(entries[0].layout.to_dict()))
    return tensors, meta


def _write(path: Path, tensors: dict, meta: dict) -> None:
    path.parent.mkdir(exist_ok=True)
    data = st_save(tensors, metadata={"chorus": json.dumps(meta, sort_keys=True)})
    tmp = path.parent / f".tmp-{uuid.uuid4().hex}"
    tmp.write_bytes(data)
    os.replace(tmp, path)  # readers see the whole prior or none
    for old in path.parent.glob("*.safetensors"):
        if old.name != path.name and old.is_file() and not old.is_symlink():
            old.unlink(missing_ok=True)  # priors of older bank content


def _read(path: Path, key: str) -> EntryMasks:
    data = path.read_bytes()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    return _entry(key, st_load(data), json.loads(header["__metadata__"]["chorus"]))


def _entry(key: str, tensors: dict, meta: dict) -> EntryMasks:
    schedule = Schedule(**json.loads(meta["schedule"]))
    layout = json.loads(meta["layout"])
    layout = LatentLayout(grid=tuple(layout["grid"]), token_order=layout["token_order"],
                          block_size=tuple(layout["block_size"]))
    return EntryMasks(f"prior-{key[:12]}", schedule, layout, tensors, meta)
