"""The population prior as a bank artefact: built once per set of members, read like an entry.

A prior-mode miss used to decode up to 8 entries per (step bucket, layer) during sampling. Here
the prior of one compatibility key is built once from the most recently used compatible entries
(its members), encoded with the entry codec and kept in ``<bank>/priors/`` under a name derived
from the members' ids and blob hashes: a write that leaves them as they were (an entry of another
model, a hit that only reorders them) keeps the prior, while a new, merged, pruned or quarantined
member makes the next prior a new file (the one it replaces is removed). It used to be keyed by
the bank's whole content, so on a shared bank every worker rebuilt it (8 blob loads) after nearly
every write anywhere in the bank. A bank without a folder (PostgreSQL) or a read-only one keeps its
priors in this process's memory instead, the most recent ``MEMORY_PRIORS`` of them.

A received bank folder is untrusted: ``priors/`` may be a symbolic link to the user's models.
Every file operation here goes through a descriptor of ``priors/`` opened without following
links, and only names of the prior-key pattern are read, replaced or removed; a ``priors/`` that
is a link (or not a folder) is never used: its priors stay in memory, with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import stat
import threading
import uuid
import warnings
from dataclasses import replace

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from ..bank import EntryMasks, LatentLayout, Schedule, compat_key, encode_masks
from ..bank import validation
from .population_prior import population_prior

PRIOR_ENTRIES = 8  # most recently used compatible entries that form the prior
CANDIDATES_PER_MEMBER = 4  # compatible entries looked at per member, to find 8 of one bucket split
PRIORS_DIR = "priors"
PRIOR_NAME = re.compile(r"[0-9a-f]{16}-[0-9a-f]{24}\.safetensors")  # f"{prior_key(...)}.safetensors"
# getattr: Windows lacks these flags, and a missing one must not stop the pack from importing (the
# prior folder then fails to open and the priors stay in memory, as for a linked folder).
_NO_FOLLOW_DIR = os.O_RDONLY | sum(getattr(os, flag, 0) for flag in ("O_DIRECTORY", "O_NOFOLLOW", "O_CLOEXEC"))
_memory: dict[str, EntryMasks] = {}  # banks without a usable priors/ folder: key -> prior, newest content only
_lock = threading.Lock()


MEMORY_PRIORS = 32  # priors kept in memory per process (banks without a usable priors/ folder)


def prior_members(bank, fingerprint, layout: LatentLayout) -> list[str]:
    """The entries the prior is built from: the most recently used compatible ones whose step
    buckets split the schedule alike (row reads, no blob)."""
    candidates = bank.compatible_entries(fingerprint, layout, limit=PRIOR_ENTRIES * CANDIDATES_PER_MEMBER)
    return same_buckets(bank, candidates)[:PRIOR_ENTRIES]


def prior_key(bank, fingerprint, layout: LatentLayout, min_density: float, max_density: float,
              members: list[str] | None = None) -> str:
    """``<members>-<prior>``: the members (ids and blob hashes, in no order: a hit that reorders
    them changes nothing), then model, layout and density clamp (hex, filename-safe)."""
    members = prior_members(bank, fingerprint, layout) if members is None else members
    held = sorted(f"{entry_id}:{bank.show(entry_id)['blob_sha256']}" for entry_id in members)
    text = json.dumps([compat_key(fingerprint, layout), round(min_density, 6), round(max_density, 6), PRIOR_ENTRIES])
    return f"{_digest(held, 16)}-{_digest(text, 24)}"


def _digest(value, length: int) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:length]


def load_prior(bank, fingerprint, layout, min_density: float, max_density: float):
    """The stored prior of the current members, building it when missing; None when no entry is compatible.

    A bank without a folder (PostgreSQL) or a read-only one keeps its priors in this process's memory.
    """
    members = prior_members(bank, fingerprint, layout)
    if not members:
        return None
    key = prior_key(bank, fingerprint, layout, min_density, max_density, members)
    with _lock:
        cached = _memory.get(key)
    if cached is not None:
        return cached
    folder = None if bank.read_only or bank.root is None else _open_priors_folder(bank.root)
    try:
        return _load_or_build(bank, key, folder, fingerprint, layout, min_density, max_density, members)
    finally:
        if folder is not None:
            os.close(folder)


def _load_or_build(bank, key, folder, fingerprint, layout, min_density, max_density, members):
    """The prior from ``folder`` (a descriptor of priors/), else built and stored there (or in memory)."""
    name = f"{key}.safetensors"
    if folder is not None:
        limit = validation.max_blob_bytes((validation.MAX_BUCKETS, fingerprint.layers, fingerprint.heads,
                                           *layout.blocks))
        with contextlib.suppress(Exception):  # missing, damaged or unfit: a prior is only a cache, build it again
            return _read(folder, name, key, limit, fingerprint, layout)
    built = build_prior(bank, fingerprint, layout, min_density, max_density, members)
    if built is None:
        return None
    prior = _entry(key, *built)
    if folder is None:
        with _lock:  # the newest priors only (dicts keep insertion order): memory stays bounded
            _memory.pop(key, None)
            _memory[key] = prior
            for old in list(_memory)[:-MEMORY_PRIORS]:
                del _memory[old]
    else:
        _write(folder, name, *built)
    return prior


def _open_priors_folder(root) -> int | None:
    """A descriptor of ``<root>/priors`` (made when missing), never through a symbolic link;
    None (priors then stay in memory) when it is a link or not a folder, or cannot be made."""
    path = os.path.join(root, PRIORS_DIR)
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the folder the user chose
    except OSError as exc:
        return _memory_only(f"the bank folder cannot be opened ({exc.strerror or exc})")
    try:
        with contextlib.suppress(FileExistsError):  # an existing link is not followed by mkdir
            os.mkdir(PRIORS_DIR, 0o755, dir_fd=root_fd)
        return os.open(PRIORS_DIR, _NO_FOLLOW_DIR, dir_fd=root_fd)
    except OSError as exc:  # a link (O_NOFOLLOW), a file (O_DIRECTORY), or no permission
        if os.path.islink(path):
            return _memory_only(f"{path} is a symbolic link (to {os.readlink(path)[:200]!r})")
        what = "not a folder" if exc.errno == errno.ENOTDIR else f"unusable ({exc.strerror or exc})"
        return _memory_only(f"{path} is {what}")
    finally:
        os.close(root_fd)


def _memory_only(problem: str) -> None:
    warnings.warn(f"Chorus mask bank: {problem}. Chorus never reads, writes or deletes through a link "
                  "or outside the bank folder, so this bank's population priors stay in memory and nothing "
                  "there was touched. Replace it with a real folder (or remove it) to store priors again.",
                  stacklevel=4)
    return None


def build_prior(bank, fingerprint, layout, min_density, max_density, members=None):
    """Per (bucket, layer), the blocks most often kept by the members, at their mean density.

    :param members: the entries to build from (:func:`prior_members` when None)
    :return: (tensors, metadata) in the entry codec, or None when no entry is compatible
    """
    ids = prior_members(bank, fingerprint, layout) if members is None else members
    entries = [bank.load_masks(entry_id, record_hit=False) for entry_id in ids]
    if not entries:
        return None
    buckets, layers = len(entries[0].step_buckets), entries[0].shape[1]
    maps = np.zeros((buckets, *entries[0].shape[1:]), dtype=bool)
    for bucket in range(buckets):
        for layer in range(layers):
            members = [e.block_map(bucket, layer) for e in entries]  # one noise level: same bucket split
            density = sum(m.float().mean().item() for m in members) / len(members)
            density = min(max(density, min_density), max_density)
            maps[bucket, layer] = population_prior(members, density).numpy()
    tensors, meta = encode_masks(maps)
    # Members may come from runs of other step counts: the prior is addressed by step, not sigma.
    schedule = replace(entries[0].schedule, sigmas=None)
    meta.update(prior_of=json.dumps([e.entry_id for e in entries]), schedule=json.dumps(schedule.to_dict()),
                layout=json.dumps(entries[0].layout.to_dict()))
    return tensors, meta


SPLIT_TOLERANCE = 0.15  # the default 25 / 35 / 40 % split starts its last bucket at 50 % of 4 steps, 62.5 % of 8


def bucket_split(schedule: Schedule) -> tuple:
    """Where a schedule's step buckets start, as shares of its steps."""
    return tuple(start / schedule.steps for start, _ in schedule.step_buckets)


def same_split(a: tuple, b: tuple) -> bool:
    """Whether two bucket splits cover about the same noise levels, bucket by bucket."""
    return len(a) == len(b) and all(abs(x - y) <= SPLIT_TOLERANCE for x, y in zip(a, b))


def same_buckets(bank, ids: list[str]) -> list[str]:
    """The ids (most recently used first) whose step buckets split their schedule as the first's
    does: each bucket of the prior mixes one noise level only (row reads, no blob)."""
    splits = {}
    for entry_id in ids:
        with contextlib.suppress(Exception):  # an unreadable row: left out (a hit on it quarantines it)
            splits[entry_id] = bucket_split(bank.entry_schedule(entry_id))
    kept = [i for i in ids if i in splits]
    return [i for i in kept if same_split(splits[i], splits[kept[0]])] if kept else []


def _write(folder: int, name: str, tensors: dict, meta: dict) -> None:
    """Store a prior under ``name`` in ``folder`` (readers see all of it or none), then remove
    the priors it replaces (same model, layout and clamp, other members); only prior-named
    regular files are ever removed."""
    data = st_save(tensors, metadata={"chorus": json.dumps(meta, sort_keys=True)})
    tmp = f".tmp-{uuid.uuid4().hex}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)  # replaces a link itself, never its target
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise
    same_prior = name.split("-", 1)[1]
    for old in os.listdir(folder):  # this prior's older versions only
        if PRIOR_NAME.fullmatch(old) and old != name and old.endswith(f"-{same_prior}"):
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(old, dir_fd=folder).st_mode):
                    os.unlink(old, dir_fd=folder)


def _read(folder: int, name: str, key: str, limit: int, fingerprint, layout: LatentLayout) -> EntryMasks:
    """The prior ``name`` of ``folder``: a regular file (never a link) of at most ``limit`` bytes,
    held against this model and layout as an entry is (a received bank's ``priors/`` is untrusted:
    a prior with more key blocks than the sequence has would reach the kernel, which has no bounds
    checks). :raises ValueError: why the file cannot serve (the caller builds the prior again)"""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            raise ValueError(f"prior {name} is not a regular file of at most {limit} bytes")
        data = fh.read(limit + 1)
    header = validation.read_header(data)
    meta = validation.load_json((header.get("__metadata__") or {}).get("chorus"), "prior metadata")
    prior = _entry(key, {}, meta)
    if prior.layout != layout:
        raise ValueError(f"prior {name} was made for another layout")
    shape = (len(prior.step_buckets), fingerprint.layers, fingerprint.heads, *layout.blocks)
    validation.check_shape_bounds(shape)
    checked = validation.check_header(header, shape)
    validation.check_part_sizes(header, shape, checked)
    return _entry(key, st_load(data), {**meta, **checked})


def _entry(key: str, tensors: dict, meta: dict) -> EntryMasks:
    schedule = Schedule(**json.loads(meta["schedule"]))
    layout = json.loads(meta["layout"])
    layout = LatentLayout(grid=tuple(layout["grid"]), token_order=layout["token_order"],
                          block_size=tuple(layout["block_size"]))
    return EntryMasks(f"prior-{key[:12]}", schedule, layout, tensors, meta)
