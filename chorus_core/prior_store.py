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
    """``<content>-<prior>``: the bank content, then model, layout and density clamp (hex, filename-safe)."""
    content = hashlib.sha256(bank.content_token().encode()).hexdigest()[:16]
    text = json.dumps([compat_key(fingerprint, layout), round(min_density, 6), round(max_density, 6), PRIOR_ENTRIES])
    return f"{content}-{hashlib.sha256(text.encode()).hexdigest()[:24]}"


def load_prior(bank, fingerprint, layout, min_density: float, max_density: float):
    """The stored prior for this content, building it when missing; None when no entry is compatible.

    A bank without a folder (PostgreSQL) or a read-only one keeps its priors in this process's memory.
    """
    key = prior_key(bank, fingerprint, layout, min_density, max_density)
    with _lock:
        cached = _memory.get(key)
    if cached is not None:
        return cached
    in_memory = bank.read_only or bank.root is None
    path = None if in_memory else Path(bank.root) / PRIORS_DIR / f"{key}.safetensors"
    if path is not None and path.is_file() and not path.is_symlink():
        try:
            return _read(path, key)
        except Exception:  # a damaged prior is only a cache: build it again
            pass
    built = build_prior(bank, fingerprint, layout, min_density, max_density)
    if built is None:
        return None
    prior = _entry(key, *built)
    if in_memory:
        with _lock:  # only the newest bank content: memory stays bounded
            content = key.split("-")[0]
            for old in [k for k in _memory if not k.startswith(content)]:
                del _memory[old]
            _memory[key] = prior
    else:
        _write(path, *built)
    return prior


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
    content = path.name.split("-")[0]
    for old in path.parent.glob("*.safetensors"):  # priors of older bank content only
        if not old.name.startswith(content) and old.is_file() and not old.is_symlink():
            old.unlink(missing_ok=True)


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
