"""Recordings on their way into a bank, kept on disk until they are in: a write-ahead spool.

A recording miss writes its packed masks and everything its entry needs to one file
(``<entry id>.spool``: a safetensors file, never pickle) in the bank's spool folder, fsyncs
the file and the folder, and only then reports ``recording: queued``. The background writer
adds the entry and removes the file; a process that stops first (SIGTERM past the drain bound,
SIGKILL, a crash, a power cut) leaves the file, and the next process that opens the bank
replays it (:func:`replay_spool`). Whoever adds an entry holds an exclusive ``flock`` on its
spool file, and the bank refuses a second row of one id, so two processes replaying one spool
add each entry once.

Where: ``<bank folder>/spool/``; a PostgreSQL bank has no folder, so its spool is local to
the machine, under :func:`local_spool_root` (ComfyUI: beside the folder banks, in
``models/chorus_banks/.postgres-spool/``, where the CLI looks too: :func:`comfyui_spool_root`),
one folder per bank.

A spool file is untrusted when replayed (it may come with a received bank folder): it must be
a regular file, no link; its header is read first and bounded; its record is checked like an
imported row; it is read up to the size its header declares and that size must be the
file's. A file that fails, or whose recording the bank refuses (:func:`refused`: its masks or
values, never a busy, absent or full bank), is moved to ``spool/quarantine/`` with a warning,
never fatal. A recording whose model files (where the recorder knew them) are all gone is
dropped with a log line: no request can ever hit it.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save as st_save

from . import validation
from .blob_files import file_kind, fsync_dir
from .encoding import PackedBlockMaps
from .errors import BankError, BankIncompatible
from .fingerprint import ModelFingerprint
from .records import LatentLayout, Schedule
from .rows import schedule_columns, signature_columns
from .signature import Signature

log = logging.getLogger("chorus")

FORMAT = "chorus-spool-v1"
SUFFIX = ".spool"
FOLDER = "spool"  # inside a bank folder
QUARANTINE = "quarantine"  # inside the spool folder
SPOOL_ROOT_ENV = "CHORUS_SPOOL_ROOT"  # where PostgreSQL banks spool on this machine
# A ComfyUI spools its PostgreSQL banks here, inside its first chorus_banks folder (hidden: never
# offered as a bank name); the CLI looks in the same place (comfyui_spool_root).
POSTGRES_SPOOL_FOLDER = ".postgres-spool"
MAX_META_BYTES = 1 << 20  # a record is a few kB (signatures, sigmas); more is hostile
MAX_MODEL_FILES = 16
STALE_TEMP_S = 3600.0  # a temp file this old belongs to a process that died while spooling
CLAIM_POLL_S = 0.05

_local_root: Path | None = None


@dataclass
class Recording:
    """One recorded entry, as the spool keeps it: what :meth:`BankStorage.add_entry` takes.

    :param model_files: files the model was loaded from, where the recorder knew them; when
        every one is gone the recording is dropped at replay (nothing could hit it)
    """

    entry_id: str
    fingerprint: ModelFingerprint
    layout: LatentLayout
    schedule: Schedule
    signature: Signature
    masks: PackedBlockMaps
    density: float
    recall: float | None = None
    tags: tuple = ()
    model_files: tuple = ()

    def add_to(self, bank) -> bool:
        """Add the entry unless the bank has it already; True when this call added it."""
        if bank.has_entry(self.entry_id):
            return False
        try:
            bank.add_entry(fingerprint=self.fingerprint, layout=self.layout, schedule=self.schedule,
                           masks=self.masks, signature=self.signature, density=self.density,
                           recall=self.recall, tags=list(self.tags), entry_id=self.entry_id)
        except BankIncompatible:
            raise
        except BankError:
            if bank.has_entry(self.entry_id):  # another process added it between the check and ours
                return False
            raise
        return True

    def models_gone(self) -> bool:
        """Whether the recorder named its model's files and none of them exists any more."""
        return bool(self.model_files) and not any(os.path.isfile(p) for p in self.model_files)


class SpoolDamaged(ValueError):
    """A spool file that cannot be a recording Chorus wrote (cut short, altered, hostile)."""


class RecordingRefused(BankError):
    """A recording that can never go in (the bank refused what it holds, or its model is gone);
    its spool file has been quarantined or removed.

    :param reason: a short text naming no path, for the web view and the routes
    """

    def __init__(self, entry_id: str, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"Recording {entry_id}: {reason}" + (f" ({detail})" if detail else ""))


MODEL_GONE = "its model's files were deleted, so no request could use it; dropped"


def refused(exc: BaseException) -> bool:
    """Whether adding a recording failed for the recording's own content (masks that do not fit
    their layout, a value the bank rejects): the same file fails the same way on every try.
    Anything else (a lock held by an import, a server away, a full or read-only disk) can pass,
    so that write is tried again."""
    return isinstance(exc, (BankIncompatible, ValueError, TypeError))  # BankInvalidArgument is a ValueError


# ---- where ------------------------------------------------------------------------------
def set_local_spool_root(path) -> None:
    """Where this process spools for banks without a folder (ComfyUI: beside its folder banks)."""
    global _local_root
    _local_root = Path(path)


def local_spool_root() -> Path:
    """``CHORUS_SPOOL_ROOT``, else what :func:`set_local_spool_root` set, else ``~/.cache/chorus/spool``."""
    env = os.environ.get(SPOOL_ROOT_ENV)
    if env:
        return Path(env).expanduser()
    return _local_root or Path.home() / ".cache" / "chorus" / "spool"


def comfyui_spool_root(comfyui) -> Path:
    """Where the ComfyUI in folder ``comfyui`` (or started with ``--base-directory comfyui``)
    spools its PostgreSQL banks: ``models/chorus_banks/.postgres-spool``."""
    return Path(comfyui) / "models" / "chorus_banks" / POSTGRES_SPOOL_FOLDER


def installed_comfyui() -> Path | None:
    """The ComfyUI folder this pack is installed in (``<ComfyUI>/custom_nodes/<pack>``), or None."""
    pack = Path(__file__).absolute().parents[2]
    comfyui = pack.parent.parent
    if pack.parent.name == "custom_nodes" and (comfyui / "main.py").is_file():
        return comfyui
    return None


def spool_folder(bank) -> Path:
    """The spool folder of ``bank``: inside its folder, or local to this machine for a server bank."""
    return spool_folder_at(bank.root, bank.label)


def spool_folder_at(root, label: str) -> Path:
    """The spool folder of the bank in folder ``root``, or (``root`` None) of the server bank
    whose shown location is ``label`` (:func:`~chorus_core.bank.bank_url.redact`: no password)."""
    if root is not None:
        return Path(root) / FOLDER
    return local_spool_root() / hashlib.sha256(label.encode()).hexdigest()[:24]


def pending_files(folder: Path) -> list[Path]:
    """The spooled recordings in ``folder``, oldest first (none when it is missing or a link)."""
    if not _usable_folder(folder):
        return []
    found = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.endswith(SUFFIX) and validation.is_entry_id(entry.name[:-len(SUFFIX)]):
                found.append((_mtime(entry), Path(entry.path)))
    return [path for _, path in sorted(found)]


def _usable_folder(folder: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(folder).st_mode)  # a link is never followed
    except OSError:
        return False


def _mtime(entry) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


# ---- writing ----------------------------------------------------------------------------
def write_spool(folder: Path, recording: Recording) -> Path:
    """Write ``recording`` durably (file and folder fsynced) and return its path.

    :raises BankError: the folder cannot be made or written (full disk, permissions, a link)
    """
    try:
        _make_folder(folder)
        data = st_save({"packed": np.ascontiguousarray(recording.masks.packed)},
                       metadata={"chorus_spool": json.dumps(_record(recording), sort_keys=True)})
        target = folder / f"{recording.entry_id}{SUFFIX}"
        tmp = folder / f".{recording.entry_id}.tmp-{uuid.uuid4().hex[:8]}"
        _write_new_file(tmp, data)
        os.replace(tmp, target)
        fsync_dir(folder)
    except OSError as exc:
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp)
        raise BankError(f"Cannot spool the recording to {folder} ({exc.strerror or exc}); check "
                        "free space and permissions there.") from exc
    return target


def _make_folder(folder: Path) -> None:
    if os.path.islink(folder):
        raise OSError(f"{folder} is a symbolic link; Chorus never spools through a link")
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        fsync_dir(folder.parent)


def _write_new_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _record(recording: Recording) -> dict:
    """The recording's record, in the columns an index row and an export use."""
    layout, sigs = recording.layout, signature_columns(recording.signature)
    return {
        "format": FORMAT, "id": recording.entry_id, "created": time.time(),
        "fingerprint": recording.fingerprint.key(),
        "grid_t": layout.grid[0], "grid_h": layout.grid[1], "grid_w": layout.grid[2],
        "token_order": layout.token_order, "block_q": layout.block_size[0], "block_k": layout.block_size[1],
        **schedule_columns(recording.schedule),
        "density": float(recording.density),
        "recall": None if recording.recall is None else float(recording.recall),
        "tags": json.dumps(sorted(set(recording.tags))), "nk": recording.masks.nk,
        "model_files": [str(p) for p in recording.model_files][:MAX_MODEL_FILES],
        **{k: None if v is None else base64.b64encode(v).decode() for k, v in sigs.items()},
    }


# ---- claiming ---------------------------------------------------------------------------
@contextlib.contextmanager
def claimed(path: Path, wait: float = 0.0):
    """An exclusive claim on the spool file ``path``: yields its descriptor, or None when it
    is gone (another process added it) or, after ``wait`` seconds, still held by another."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # gone, or replaced by a link since it was listed
        yield None
        return
    try:
        yield fd if _lock(fd, wait) and _still_linked(path, fd) else None
    finally:
        os.close(fd)  # releases the flock


def _lock(fd: int, wait: float) -> bool:
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(CLAIM_POLL_S)


def _still_linked(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file we locked (its holder unlinks it when done)."""
    try:
        now, held = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (now.st_ino, now.st_dev) == (held.st_ino, held.st_dev)


def finish(path: Path) -> None:
    """Remove a spool file whose entry is in the bank (call while holding its claim)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fsync_dir(path.parent)


# ---- reading ----------------------------------------------------------------------------
def read_spool(fd: int) -> Recording:
    """The recording in the claimed spool file ``fd``; reads no byte past its declared size.

    :raises SpoolDamaged: anything that is not a spool file Chorus wrote, and why
    """
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise SpoolDamaged("not a regular file")
    head = _read_exactly(fd, 0, 8)
    size = int.from_bytes(head, "little")
    if size > min(MAX_META_BYTES, info.st_size - 8):
        raise SpoolDamaged(f"header declares {size} bytes; the file has {info.st_size}")
    try:
        header = validation.load_json(_read_exactly(fd, 8, size), "spool header")
        meta, spec, shape = _parse_header(header)
        data_bytes = int(np.prod(shape))
        if info.st_size != 8 + size + data_bytes:
            raise ValueError(f"file is {info.st_size} bytes; its header declares {8 + size + data_bytes}")
        packed = np.frombuffer(_read_exactly(fd, 8 + size, data_bytes), np.uint8).reshape(shape)
        return _parse_record(meta, spec, PackedBlockMaps(packed, spec.shape[-1]))
    except (ValueError, TypeError, KeyError) as exc:
        raise SpoolDamaged(str(exc)) from None


def _read_exactly(fd: int, offset: int, count: int) -> bytes:
    chunks, left = [], count
    while left > 0:
        chunk = os.pread(fd, min(left, 1 << 24), offset + count - left)
        if not chunk:
            raise SpoolDamaged(f"file is cut short ({count - left} of {count} bytes at {offset})")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _parse_header(header) -> tuple[dict, validation.EntrySpec, tuple]:
    """(record, its entry's spec, packed shape) from a safetensors header holding one uint8 tensor ``packed``."""
    if not isinstance(header, dict) or set(header) != {"__metadata__", "packed"}:
        raise ValueError("header is not one tensor 'packed' with metadata")
    text = header["__metadata__"].get("chorus_spool") if isinstance(header["__metadata__"], dict) else None
    meta = validation.load_json(text, "spool record")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"record format is not {FORMAT}")
    spec = validation.entry_spec(meta)
    nk = meta.get("nk")
    if nk != spec.shape[-1]:
        raise ValueError(f"nk {str(nk)[:20]} does not match its layout's {spec.shape[-1]} key blocks")
    shape = (*spec.shape[:-1], -(-nk // 8))
    tensor = header["packed"]
    if not isinstance(tensor, dict) or tensor.get("dtype") != "U8" or tensor.get("shape") != list(shape) \
            or tensor.get("data_offsets") != [0, int(np.prod(shape))]:
        raise ValueError(f"tensor 'packed' is not uint8 {list(shape)} at offset 0")
    return meta, spec, shape


def _parse_record(meta: dict, spec: validation.EntrySpec, masks: PackedBlockMaps) -> Recording:
    """A Recording from a record whose records ``spec`` holds, checked value by value."""
    if not validation.is_entry_id(meta.get("id")):
        raise ValueError("id is not 32 lowercase hex digits")
    components = {}
    for column in validation.SIGNATURE_COLUMNS:
        raw = _signature(meta.get(column), column)
        if raw is not None:
            components[column[len("sig_"):]] = np.frombuffer(raw, np.float32).copy()
    if not components:
        raise ValueError("the record has no signature")
    files = meta.get("model_files", [])
    if not (isinstance(files, list) and len(files) <= MAX_MODEL_FILES
            and all(isinstance(p, str) and 0 < len(p) <= 4096 for p in files)):
        raise ValueError("model_files is not a short list of paths")
    return Recording(entry_id=meta["id"], fingerprint=spec.fingerprint, layout=spec.layout,
                     schedule=spec.schedule, signature=Signature(components), masks=masks,
                     density=validation.finite(meta.get("density"), "density", 0.0, 1.0),
                     recall=validation.finite(meta.get("recall"), "recall", 0.0, 1.0, optional=True),
                     tags=tuple(json.loads(validation.tags_json(meta.get("tags")))),
                     model_files=tuple(files))


def _signature(value, key) -> bytes | None:
    if value is None:
        return None
    try:
        raw = base64.b64decode(value, validate=True) if isinstance(value, str) else None
    except ValueError:
        raw = None
    if raw is None:
        raise ValueError(f"{key} is not base64 text")
    return validation.signature_bytes(raw, key)


def commit(bank, path: Path, recording: Recording, wait: float = 60.0) -> bool:
    """The writer's add of a recording it spooled itself: claim the file, add the entry, remove
    the file. True when this call added it; False when another process replayed it first.

    :raises RecordingRefused: the bank refused the recording itself (:func:`refused`; the file
        was quarantined), or its model's files are gone (the file was removed)
    :raises BankError: the write failed otherwise (the file stays spooled), or another process
        held the file for ``wait`` seconds
    """
    with claimed(path, wait) as fd:
        if fd is None:
            if os.path.lexists(path):
                raise BankError(f"another process has held the spool file {path.name} for {wait:.0f} s")
            return False
        if recording.models_gone():
            drop_file(path, recording)
            raise RecordingRefused(recording.entry_id, MODEL_GONE)
        try:
            added = recording.add_to(bank)
        except Exception as exc:
            if not refused(exc):
                raise
            quarantine_file(path, f"the bank refused it: {exc}")
            reason = f"the bank refused it ({type(exc).__name__}); its spool file was quarantined"
            raise RecordingRefused(recording.entry_id, reason, str(exc)) from exc
        finish(path)
        return added


# ---- replaying --------------------------------------------------------------------------
def replay_spool(bank, folder: Path | None = None) -> dict:
    """Add every recording spooled for ``bank`` that is not in it yet; returns what happened.

    Safe to run in several processes at once: each file is claimed (``flock``) before it is
    read, and a file another process holds is left to it. A bank or disk error leaves the
    file for the next try; a damaged file is quarantined; a recording whose model files are
    gone is dropped.

    :return: ``{"added": [ids], "present": [ids], "quarantined": [names], "dropped": [ids],
        "left": [ids]}`` (left: held by another process, or "id (why)" when the bank refused the write)
    """
    folder = spool_folder(bank) if folder is None else Path(folder)
    outcome = {"added": [], "present": [], "quarantined": [], "dropped": [], "left": []}
    if bank.read_only:
        return outcome
    remove_stale_temp_files(folder)
    for path in pending_files(folder):
        kind, name = replay_file(bank, path)
        outcome[kind].append(name)
    return outcome


def replay_file(bank, path: Path, wait: float = 0.0) -> tuple[str, str]:
    """Replay one spool file: ``(what happened, entry id or file name)`` (see :func:`replay_spool`)."""
    entry_id = path.name[:-len(SUFFIX)]
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "present", entry_id  # another process added it and removed the file
    if not stat.S_ISREG(mode):  # a link, FIFO or device: never opened (moving a link moves only the link)
        quarantine_file(path, f"it is a {file_kind(mode)}, not a regular file")
        return "quarantined", path.name
    with claimed(path, wait) as fd:
        if fd is None:
            return ("present" if not os.path.lexists(path) else "left"), entry_id
        try:
            recording = read_spool(fd)
            if recording.entry_id != entry_id:
                raise SpoolDamaged(f"it holds entry {recording.entry_id}, not the one its name says")
        except SpoolDamaged as exc:
            quarantine_file(path, str(exc))
            return "quarantined", path.name
        return _replay_recording(bank, path, recording)


def _replay_recording(bank, path: Path, recording: Recording) -> tuple[str, str]:
    entry_id = recording.entry_id
    if recording.models_gone():
        drop_file(path, recording)
        return "dropped", entry_id
    try:
        added = recording.add_to(bank)
    except Exception as exc:
        if refused(exc):  # fails the same way at every start: never left spooled for ever
            quarantine_file(path, f"the bank refused it: {exc}")
            return "quarantined", path.name
        if not isinstance(exc, BankError):
            raise
        log.warning("Chorus: the spooled recording %s stays spooled for the next try: %s", entry_id, exc)
        return "left", f"{entry_id} ({exc})"
    finish(path)
    return ("added" if added else "present"), entry_id


def drop_file(path: Path, recording: Recording) -> None:
    """Remove the spool file of a recording whose model is gone (call while holding its claim), and say so."""
    log.warning("Chorus: dropped the spooled recording %s: its model (%s) no longer exists, so no request "
                "could use it", recording.entry_id, ", ".join(os.path.basename(p) for p in recording.model_files))
    finish(path)


def quarantine_file(path: Path, reason: str) -> None:
    """Move a damaged spool file to ``quarantine/`` beside it (deleted if that fails), and warn."""
    target_dir = path.parent / QUARANTINE
    target = target_dir / f"{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        if os.path.islink(target_dir):
            raise OSError("the quarantine folder is a link")
        target_dir.mkdir(exist_ok=True)
        os.rename(path, target)
        where = f"moved to {target}"
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        where = "deleted (it could not be moved to quarantine)"
    fsync_dir(path.parent)
    log.warning("Chorus: quarantined the spool file %s: %s; %s. No entry was added from it.",
                path.name, reason[:300], where)


def remove_stale_temp_files(folder: Path, older_than: float = STALE_TEMP_S) -> int:
    """Remove half-written spool files of processes that died while spooling (never reported)."""
    if not _usable_folder(folder):
        return 0
    cutoff, removed = time.time() - older_than, 0
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.startswith(".") and ".tmp-" in entry.name and entry.is_file(follow_symlinks=False) \
                    and _mtime(entry) < cutoff:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed += 1
    return removed


def spooled_count(bank) -> int:
    """How many recordings wait in ``bank``'s spool."""
    return len(pending_files(spool_folder(bank)))
