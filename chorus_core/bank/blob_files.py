"""The folder bank's blob files: ``blobs/ab/<sha256>.safetensors`` and ``quarantine/``.

Only files inside these two folders are ever written, moved or deleted, and only under names
Chorus derives itself (the sha256 of the content, an entry id of 32 hex digits); every path
is resolved and checked to lie inside its folder first, and a shard folder that is a link is
never written, read or emptied. A blob is written to a temporary file, fsynced and renamed, so
a reader never sees a partial blob; it is stat-ed before it is opened, only regular files are
opened (non-blocking, no symlinks), and no more bytes than its row declares are read.

Nothing here knows about the index: the SQLite backend decides *when* a blob may go (after
the transaction that stops referencing it has committed, under the write lock).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
import warnings
from pathlib import Path

from . import validation
from .errors import BankError


def file_kind(mode: int) -> str:
    """What a non-regular file is, for messages ("a FIFO, not a regular file")."""
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISLNK, "symlink"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (where the filesystem allows it)."""
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_regular_file(path, size: int) -> tuple[bytes | None, str | None]:
    """Exactly ``size`` bytes of the regular file ``path``, or ``(None, reason)``.

    Bounded work whatever sits at ``path``: it is lstat-ed first (a directory, FIFO, device
    or symlink is refused unopened, a file of another size unread), opened non-blocking
    without following symlinks, and at most ``size + 1`` bytes are read.
    """
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        return None, "blob missing"
    except OSError as exc:
        return None, f"blob unreadable ({exc.strerror or exc})"
    if not stat.S_ISREG(before.st_mode):
        return None, f"blob is a {file_kind(before.st_mode)}, not a regular file"
    if before.st_size != size:
        return None, f"blob truncated or resized ({before.st_size} of {size} bytes)"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return None, f"blob unreadable ({exc.strerror or exc})"
    try:
        now = os.fstat(fd)
        if (now.st_ino, now.st_dev) != (before.st_ino, before.st_dev) or not stat.S_ISREG(now.st_mode):
            return None, "blob replaced while being read"
        data = _read_at_most(fd, size + 1)
    except OSError as exc:
        return None, f"blob unreadable ({exc.strerror or exc})"
    finally:
        os.close(fd)
    if len(data) != size:
        return None, f"blob truncated or resized ({len(data)} of {size} bytes)"
    return data, None


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, left = [], limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class BlobFolder:
    """``blobs/`` and ``quarantine/`` of one bank folder.

    :param root: the bank folder (already checked: its ``blobs`` and ``quarantine`` are no links)
    """

    def __init__(self, root: Path):
        self.blobs = root / "blobs"
        self.quarantine_dir = root / "quarantine"
        self._real_blobs = os.path.realpath(self.blobs)
        self._real_quarantine = os.path.realpath(self.quarantine_dir)

    # ---- paths ---------------------------------------------------------------------------
    def path(self, sha) -> Path | None:
        """Where the blob of digest ``sha`` lives, or None when ``sha`` is not a digest, its
        shard folder is a symlink, or the path would leave ``blobs/``."""
        if not validation.is_sha256(sha):
            return None
        path = self.blobs / sha[:2] / validation.blob_name(sha)
        if os.path.islink(path.parent):  # even a link to another shard: never followed
            return None
        return path if validation.inside(self._real_blobs, path) else None

    def _quarantine_target(self, row: dict) -> Path | None:
        label = row["id"] if validation.is_entry_id(row.get("id")) else f"row{int(row['rowid'])}"
        sha = row["blob_sha256"] if validation.is_sha256(row.get("blob_sha256")) else "no-sha"
        path = self.quarantine_dir / f"{label}-{uuid.uuid4().hex[:8]}-{sha}{validation.BLOB_SUFFIX}"
        return path if validation.inside(self._real_quarantine, path) else None

    # ---- reading and writing -------------------------------------------------------------
    def read(self, sha: str, size: int) -> tuple[bytes | None, str | None]:
        """The blob's ``size`` bytes, or ``(None, reason)`` (see :func:`read_regular_file`)."""
        path = self.path(sha)
        if path is None:
            return None, "blob path leaves the bank folder"
        return read_regular_file(path, size)

    def holds(self, data: bytes, sha: str) -> bool:
        """Whether the blob of ``sha`` exists and holds exactly ``data``."""
        path = self.path(sha)
        current, _ = read_regular_file(path, len(data)) if path else (None, None)
        return current == data

    def write(self, data: bytes, sha: str) -> str:
        """Write ``data`` to its content address via temp file + fsync + rename."""
        final = self.path(sha)
        if final is None:
            raise BankError(f"Refusing to write blob {sha[:80]!r}: its path would leave "
                            f"{self.blobs}. Replace the symlinked shard folder with a real one.")
        final.parent.mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(os.lstat(final).st_mode):  # something squats the name
                self.move_aside(final, {"id": None, "rowid": 0, "blob_sha256": sha})
        tmp = self.blobs / f".tmp-{uuid.uuid4().hex}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fsync_dir(final.parent)
        return validation.blob_name(sha)

    # ---- moving and removing -------------------------------------------------------------
    def move_aside(self, path: Path, row: dict) -> bool:
        """Rename whatever is at ``path`` (file, directory, FIFO, symlink) into quarantine/
        without opening it; False when it cannot be moved (it is then left in place)."""
        target = self._quarantine_target(row)
        if target is None:
            return False
        try:
            self.quarantine_dir.mkdir(exist_ok=True)
            if not stat.S_ISDIR(os.lstat(self.quarantine_dir).st_mode):  # replaced by a link since open
                raise OSError(errno.ELOOP, "quarantine/ is no longer a real folder")
            os.replace(path, target)
            return True
        except OSError as exc:
            warnings.warn(f"Chorus mask bank: could not move {path} to quarantine "
                          f"({exc.strerror or exc}); it stays where it is.", stacklevel=4)
            return False

    def remove(self, sha: str) -> None:
        """Unlink the blob of ``sha`` if it is a regular file (the caller holds the write
        lock and has checked that no row uses it)."""
        path = self.path(sha)
        with contextlib.suppress(FileNotFoundError):
            if path is not None and stat.S_ISREG(os.lstat(path).st_mode):
                os.unlink(path)

    @staticmethod
    def remove_old(paths, cutoff: float) -> int:
        """Unlink those of ``paths`` that are still regular files older than ``cutoff``."""
        removed = 0
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode) and info.st_mtime < cutoff:
                    os.unlink(path)
                    removed += 1
        return removed

    def quarantined(self) -> list[dict]:
        """The regular files kept in ``quarantine/``: ``{"key": name, "bytes", "moved"}``; ``moved`` is
        the time of the rename that put it there (a rename sets the file's ctime, not its mtime)."""
        found = []
        for entry in _scandir(self.quarantine_dir):
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed by another writer since the scan
                continue
            if stat.S_ISREG(info.st_mode):
                found.append({"key": entry.name, "bytes": info.st_size, "moved": info.st_ctime})
        return found

    def remove_quarantined(self, names) -> None:
        """Unlink those of ``names`` that are regular files directly inside ``quarantine/``."""
        for name in names:
            path = self.quarantine_dir / name
            if name != os.path.basename(name) or not validation.inside(self._real_quarantine, path):
                continue
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG(os.lstat(path).st_mode):
                    os.unlink(path)

    # ---- scanning (never follows a link) -------------------------------------------------
    def count(self, limit: int | None = None) -> int:
        """How many content-addressed blob files ``blobs/`` holds (stops at ``limit``)."""
        count = 0
        for shard in _scandir(self.blobs):
            if _is_shard(shard):
                for entry in _scandir(shard.path):
                    count += _is_blob_file(shard.name, entry)
                    if limit is not None and count >= limit:
                        return count
        return count

    def old_files(self, cutoff: float) -> tuple[int, list]:
        """(how many blob files are older than ``cutoff``, [(path, sha or None)] of those and of
        old temp files), from a scan that follows no link."""
        blobs, found = 0, []
        for shard in _scandir(self.blobs):
            if shard.name.startswith(".tmp-") and shard.is_file(follow_symlinks=False):
                if _mtime(shard) < cutoff:
                    found.append((Path(shard.path), None))
            elif _is_shard(shard):
                for entry in _scandir(shard.path):
                    if _is_blob_file(shard.name, entry) and _mtime(entry) < cutoff:
                        blobs += 1
                        found.append((Path(entry.path), entry.name[:64]))
        return blobs, found


def _scandir(path):
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _mtime(entry) -> float:
    """Modification time of a scanned entry; +inf (never stale) when a concurrent prune or
    writer removed or renamed it since the scan."""
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return float("inf")


def _is_shard(entry) -> bool:
    return (len(entry.name) == 2 and all(c in "0123456789abcdef" for c in entry.name)
            and entry.is_dir(follow_symlinks=False))


def _is_blob_file(shard: str, entry) -> bool:
    name = entry.name
    return (name.endswith(validation.BLOB_SUFFIX) and name[:2] == shard
            and validation.is_sha256(name[:-len(validation.BLOB_SUFFIX)])
            and entry.is_file(follow_symlinks=False))
