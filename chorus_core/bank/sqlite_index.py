"""The folder bank's SQLite index file: opening it safely, and its errors in plain words.

A bank folder may come from someone else: a bank whose index files, ``blobs/`` or
``quarantine/`` are symbolic links is refused at open, before SQLite or anything else opens a
file through them (SQLite would write through a link at -wal or -journal). Connections run in
autocommit mode with a busy timeout; the backend opens its own ``BEGIN IMMEDIATE``
transactions, so several processes can share a bank.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
import uuid
from pathlib import Path

from . import schema
from .blob_files import file_kind
from .errors import BankError, BankReadOnly

DB_NAME = "bank.sqlite"
# What the folder bank opens in a bank folder: SQLite's files and the folders of blobs.
# priors/ is prior_store.py's: it never follows a link there either, and keeps the priors in
# memory instead, so a bad priors/ fails no generation.
INDEX_FILES = (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm", f"{DB_NAME}-journal")
BANK_FOLDERS = ("blobs", "quarantine")
BUSY_TIMEOUT_S = 60.0


class Database:
    """The few calls other modules make on ``bank.db`` (``query``, ``execute``, ``conn``),
    over the store's own connection; no statement here commits by itself."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def execute(self, sql: str, params=()):
        return self.conn.execute(sql, params)

    def query(self, sql: str, params=()):
        cursor = self.conn.execute(sql, params)
        keys = [d[0] for d in cursor.description]
        return (dict(zip(keys, row)) for row in cursor)

    def table_names(self) -> list[str]:
        return sorted(schema.table_names(self.conn))

    def __getitem__(self, table: str):
        import sqlite_utils  # only for callers that want sqlite-utils' table helpers

        return sqlite_utils.Database(self.conn)[table]

    def close(self) -> None:
        self.conn.close()


def insert_row(conn: sqlite3.Connection, row: dict) -> None:
    """INSERT one entry row (column names are Chorus's own, quoted all the same)."""
    cols = ", ".join(f"[{c}]" for c in row)
    conn.execute(f"INSERT INTO entries ({cols}) VALUES ({', '.join('?' * len(row))})",
                 list(row.values()))


# ---- opening ------------------------------------------------------------------------------
def folder_writable(root: Path) -> bool:
    """False on a read-only mount or folder (``access`` reports EROFS even to root)."""
    return os.access(root, os.W_OK)


def refuse_links(root: Path) -> None:
    """Refuse a bank whose own files or folders are links (or folders that are files): a
    received bank's ``blobs`` linked to ``../../checkpoints`` must not reach the models."""
    for name in INDEX_FILES + BANK_FOLDERS:
        path = root / name
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            raise BankError(f"Cannot read {path} ({exc.strerror}); check its permissions.") from exc
        if stat.S_ISLNK(mode):
            what = f"a symbolic link (to {os.readlink(path)[:200]!r})"
        elif name in BANK_FOLDERS and not stat.S_ISDIR(mode):
            what = f"a {file_kind(mode)}, not a folder"
        else:
            continue
        raise BankError(
            f"{path} is {what}. Chorus never follows a link in a bank folder, so that nothing "
            "outside the bank is read, written or deleted; nothing was opened or changed. "
            "Replace it with a real folder or file holding its content (or remove it), then "
            "open the bank again.")


def check_db_file(db_path: Path) -> bool:
    """Whether the index file exists; refuses one that is not a regular file."""
    try:
        info = os.stat(db_path)
    except (FileNotFoundError, NotADirectoryError):  # the folder is made (or refused) later
        return False
    except OSError as exc:
        raise BankError(f"Cannot read {db_path} ({exc.strerror}); check its permissions.") from exc
    if not stat.S_ISREG(info.st_mode):
        raise BankError(f"{db_path} is a {file_kind(info.st_mode)}, not a database file; "
                        "move it away, or restore bank.sqlite from a backup.")
    return True


def read_only_uri(root: Path, db_path: Path) -> str:
    """``mode=ro``; also ``immutable=1`` when nothing can change the file: no WAL or
    shared-memory file exists and the folder is not writable (a read-only mount), where
    SQLite could not create the ``-shm`` file a WAL database otherwise needs."""
    uri = db_path.resolve().as_uri() + "?mode=ro"
    live = any(os.path.lexists(f"{db_path}{s}") for s in ("-wal", "-shm"))
    if not live and not folder_writable(root):
        uri += "&immutable=1"
    return uri


def make_dirs(root: Path) -> None:
    """Create the bank's folders and prove the folder writable before SQLite touches it."""
    try:
        for sub in BANK_FOLDERS:
            (root / sub).mkdir(parents=True, exist_ok=True)
        probe = root / f".write-probe-{uuid.uuid4().hex}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        probe.unlink()
    except OSError as exc:
        raise BankReadOnly(
            f"Cannot write the mask bank folder {root} ({exc.strerror or exc}). Choose a "
            "writable folder, or open it with read_only=True to match against it only."
        ) from exc


def connect(target: str, root: Path, uri: bool = False) -> sqlite3.Connection:
    """An autocommit connection with the bank's busy timeout (shared by threads: the bank
    serialises its own use of it)."""
    try:
        conn = sqlite3.connect(target, timeout=BUSY_TIMEOUT_S, uri=uri,
                               isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        return conn
    except sqlite3.Error as exc:
        raise BankError(f"Cannot open the mask bank database in {root} ({exc}). "
                        "Check the path and its permissions.") from exc


def check_known(root: Path, found: int, tables: set, fresh_ok: bool = False) -> None:
    """Refuse a database that is not a Chorus bank, or one from a newer Chorus."""
    if found == 0 and not tables and fresh_ok:
        return
    if found > schema.SCHEMA_VERSION:
        raise BankError(
            f"The bank at {root} has schema version {found}, newer than this "
            f"Chorus ({schema.SCHEMA_VERSION}); upgrade Chorus to use it.")
    missing = schema.TABLES.get(found, {"entries"}) - set(tables)
    if found == 0 or missing:
        what = (f"holds other tables ({', '.join(sorted(tables))[:200]})" if found == 0
                else f"lacks the {', '.join(sorted(missing))} table(s)")
        raise BankError(
            f"{root / DB_NAME} is not a Chorus bank: it {what}. Nothing was changed. "
            "Point Chorus at a bank folder (or an empty one to create a bank); if this "
            "folder held a bank, restore bank.sqlite from a backup.")


# ---- errors -------------------------------------------------------------------------------
def database_error(root: Path, exc: sqlite3.Error) -> BankError:
    """A sqlite3 error as a BankError that says what happened and what to do."""
    text = str(exc)
    if "full" in text:
        return BankError(f"The disk holding the mask bank {root} is full ({text}); nothing was "
                         "stored. Free some space, or prune the bank (`python -m chorus_core.bank "
                         f"prune {root} --max-bytes 20G`), and retry.")
    if "locked" in text or "busy" in text:
        return BankError(f"The mask bank {root} stayed locked by another process for more than "
                         f"{BUSY_TIMEOUT_S:.0f} s ({text}); retry when that process has finished.")
    if "readonly" in text or "read-only" in text:
        return BankReadOnly(f"Cannot write the bank at {root} ({text}); check that the folder "
                            "and bank.sqlite are writable, or open with read_only=True.")
    return BankError(f"The mask bank index {root / DB_NAME} is damaged or is not a Chorus bank "
                     f"({text}); nothing was changed. Restore bank.sqlite from a backup, or move "
                     "the folder away and start a new bank.")


def os_error(root: Path, exc: OSError, what: str) -> BankError:
    """An OS error while trying to ``what`` as a BankError (disk full, read-only, other)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return BankError(f"The disk holding the mask bank {root} is full ({exc.strerror}) while "
                         f"trying to {what}; nothing was stored. Free some space, or prune the "
                         "bank, and retry.")
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return BankReadOnly(f"Cannot {what} in the mask bank {root} ({exc.strerror}); make the "
                            "folder writable, or open the bank with read_only=True.")
    return BankError(f"Cannot {what} in the mask bank {root} ({exc.strerror or exc}); check the "
                     "folder, its permissions and free space, then retry.")
