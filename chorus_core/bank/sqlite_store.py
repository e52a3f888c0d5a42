"""The folder bank: one SQLite index (WAL) plus content-addressed safetensors blobs.

Layout of a bank folder::

    <bank>/bank.sqlite          index rows (schema in schema.py; opened by sqlite_index.py)
    <bank>/blobs/ab/abcd....safetensors   encoded masks, named by their sha256 (blob_files.py)
    <bank>/quarantine/          blobs that failed verification
    <bank>/priors/              cached population priors (not touched by this module)

Safety rules (the file-level ones are in blob_files.py and sqlite_index.py):

* A blob is written (temp file, fsync, rename) before its row is committed, so a row never
  points at a partial blob. Writes are ``BEGIN IMMEDIATE`` transactions of plain ``sqlite3``
  statements with a busy timeout, so several processes can share a bank.
* Nothing is unlinked before the transaction that stops referencing it has committed; the
  unlink then happens under the write lock after re-checking that no row (for example one a
  concurrent writer just added with the same masks) references the blob.
* A blob's size, digest and safetensors header are checked against the row's model, layout
  and schedule before any tensor is loaded (storage.py's ``_problem``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sqlite3
import threading
import time
import warnings
from pathlib import Path

from . import schema, validation
from .blob_files import BlobFolder
from .errors import BankError, BankInvalidArgument
from .faults import fault
from .matching import SignatureIndex
from .rows import decode_row, entry_label, summary_columns
from .sqlite_index import (BUSY_TIMEOUT_S, DB_NAME, Database, check_db_file, check_known, connect,
                           database_error, insert_row, make_dirs, os_error, read_only_uri, refuse_links)
from .storage import BankStorage, guarded, warn_quarantined

STALE_TEMP_S = 3600.0  # temp/orphan blobs younger than this may belong to a live writer
_ORDER = re.compile(r"(created|last_hit|hits|density|recall|blob_bytes)( (ASC|DESC))?", re.I)


_pending_hits: dict[str, dict[str, list]] = {}  # bank folder -> entry id -> [hits, last hit time]
_hits_lock = threading.Lock()


def take_pending_hits(bank_key: str, entry_id: str) -> dict[str, list]:
    """This hit and every hit of the bank not yet counted, taken out to be written."""
    with _hits_lock:
        pending = _pending_hits.pop(bank_key, {})
        count = pending.setdefault(entry_id, [0, 0.0])
        count[0], count[1] = count[0] + 1, time.time()
        return pending


def keep_pending_hits(bank_key: str, batch: dict[str, list]) -> None:
    """Hits that could not be written now: counted with the next one that gets the lock."""
    with _hits_lock:
        pending = _pending_hits.setdefault(bank_key, {})
        for entry_id, (n, last) in batch.items():
            count = pending.setdefault(entry_id, [0, 0.0])
            count[0], count[1] = count[0] + n, max(count[1], last)


class SQLiteBank(BankStorage):
    """A folder of recorded block-sparse attention masks, indexed by request signature: a
    SQLite index plus blob files (the embedded default backend). Use
    :func:`chorus_core.bank.open_bank` (or ``MaskBank.open``) to open any location; this
    class opens folders only."""

    def __init__(self, root: Path, conn: sqlite3.Connection, read_only: bool):
        self.root, self.conn, self.read_only = root, conn, read_only
        self.db = Database(conn)
        self._files = BlobFolder(root)
        self._real_root = os.path.realpath(root)
        self.signature_index = SignatureIndex()
        self._summary = summary_columns(True)  # a read-only bank at schema v2: without sigmas

    # ---- opening -------------------------------------------------------------------------
    @classmethod
    def open_folder(cls, path, read_only: bool = False, create: bool = True) -> "SQLiteBank":
        """Open (and by default create) the bank in folder ``path``.

        :param path: folder holding ``bank.sqlite`` and ``blobs/``
        :param read_only: open without ever writing (no hit counts either); a bank on a
            read-only folder or mount opens this way
        :param create: create the folder and database when missing
        :raises BankError: when the bank is missing, damaged, not a Chorus bank, or newer
        :raises BankReadOnly: when a writable bank was asked for on a read-only location
        """
        root = Path(path).expanduser()
        db_path = root / DB_NAME
        refuse_links(root)
        exists = check_db_file(db_path)
        if not exists and (read_only or not create):
            raise BankError(f"No mask bank at {root}. Create one with "
                            f"`python -m chorus_core.bank init {root}` or open with create=True.")
        if read_only:
            conn = connect(cls._read_only_uri(root, db_path), root, uri=True)
        else:
            make_dirs(root)
            conn = connect(str(db_path), root)
        bank = cls(root, conn, read_only)
        try:
            refuse_links(root)  # again: make_dirs and SQLite made files since the first look
            bank._prepare()
        except BaseException:
            conn.close()
            raise
        return bank

    open = open_folder  # the backend's own opener, as PostgresBank.open is PostgreSQL's
    # a method still, so that tests can ask which URI a read-only open would use
    _read_only_uri = staticmethod(read_only_uri)

    def _index_lost(self, detail: str) -> BankError:
        count = self._files.count()
        return BankError(
            f"The index {self.root / DB_NAME} {detail}, but blobs/ holds {count} recorded "
            "mask file(s); Chorus will not create a new index over them. Restore bank.sqlite "
            "from a backup, or move the whole folder away and create a new bank (the blobs alone "
            "cannot rebuild the index: they hold masks, not the signatures that find them).")

    def _prepare(self) -> None:
        try:
            found = schema.schema_version(self.conn)
            tables = schema.table_names(self.conn)
        except sqlite3.DatabaseError as exc:
            raise self._damaged(exc) from exc
        if found == 0 and not tables:
            if self.read_only or self._files.count(limit=1):
                raise self._index_lost("is empty") if self._files.count(limit=1) else BankError(
                    f"{self.root / DB_NAME} is empty: not a Chorus bank yet. Create it with "
                    f"`python -m chorus_core.bank init {self.root}`.")
        else:
            check_known(self.root, found, tables)
        if self.read_only:
            if found < schema.READ_ONLY_OLDEST:
                raise BankError(
                    f"The bank at {self.root} has schema version {found}, this Chorus reads "
                    f"{schema.READ_ONLY_OLDEST} to {schema.SCHEMA_VERSION}; open it once "
                    "without read_only to migrate it.")
            self._summary = summary_columns(found >= schema.SIGMAS_SINCE)
            return
        try:
            self.conn.execute("PRAGMA journal_mode = WAL")
            self.conn.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL is durable at commit
            if found == schema.SCHEMA_VERSION:
                return  # nothing to migrate: no write lock (a hit's reopen never waits for an import)
            with self._write(bump=False):
                found = schema.schema_version(self.conn)  # another process may have migrated
                check_known(self.root, found, schema.table_names(self.conn), fresh_ok=True)
                schema.migrate(self.conn)
        except sqlite3.DatabaseError as exc:
            raise self._damaged(exc) from exc

    def _damaged(self, exc: sqlite3.Error) -> BankError:
        if self._files.count(limit=1):
            return self._index_lost(f"cannot be read ({exc})")
        return BankError(f"The mask bank database {self.root / DB_NAME} cannot be used ({exc}); "
                         "nothing was changed. Restore it from a backup, or move the folder "
                         "away and create a new bank.")

    def close(self) -> None:
        """Close the database connection."""
        self.conn.close()

    # ---- backend hooks (see BankStorage) -------------------------------------------------
    @property
    def label(self) -> str:
        return str(self.root)

    def reopen(self) -> "SQLiteBank":
        return type(self).open_folder(self.root, read_only=self.read_only, create=False)

    @property
    def _skip_key(self) -> str:
        return self._real_root

    @contextlib.contextmanager
    def _guard(self, what: str):
        try:
            yield
        except sqlite3.Error as exc:
            raise database_error(self.root, exc) from exc
        except OSError as exc:
            raise os_error(self.root, exc, what) from exc

    def _read_blob(self, sha: str, size: int) -> tuple[bytes | None, str | None]:
        return self._files.read(sha, size)

    def _store_entry(self, row: dict, data: bytes):
        """Blob file first (temp + fsync + rename), then the row and the budget's evictions in one
        transaction, then the evicted blobs (unlinked after the commit: see :meth:`delete`)."""
        self._write_blob(data, row["blob_sha256"])
        fault("add-blob-written")
        with self._write():
            self._ensure_blob(data, row["blob_sha256"])
            insert_row(self.conn, row)
            eviction, released = self._keep_budget(protect=[row["id"]], written=row["id"])
            fault("add-before-commit")
        fault("evict-after-commit")
        self._release_blobs(released)
        if eviction:
            self._sweep_orphans_when_due()
        return eviction

    def _put_merged_blob(self, data: bytes, sha: str) -> None:
        """Temp file, fsync, rename: on disk before the row names it (a crash leaves an orphan)."""
        self._write_blob(data, sha)

    def _renumber(self, entry_id: str) -> None:
        self.conn.execute("UPDATE entries SET rowid = (SELECT MAX(rowid) FROM entries) + 1 WHERE id = ?",
                          [entry_id])

    def _quarantined_blobs(self) -> list[dict]:
        return self._files.quarantined()

    def _remove_quarantined(self, keys: list) -> None:
        self._files.remove_quarantined(keys)

    def _sweep_orphans_when_due(self) -> None:
        """At most once per ``STALE_TEMP_S`` per bank, a writer that evicted removes old orphan
        blobs (a writer killed between an eviction's commit and its unlinks leaves some), so a
        budgeted bank needs nobody to run ``verify`` for its disk to match its budget."""
        with self._write(bump=False):
            last = self.conn.execute("SELECT value FROM meta WHERE key = 'orphan_sweep'").fetchone()
            if last is not None and time.time() - float(last[0] or 0) < STALE_TEMP_S:
                return
            self.conn.execute("DELETE FROM meta WHERE key = 'orphan_sweep'")
            self.conn.execute("INSERT INTO meta (key, value) VALUES ('orphan_sweep', ?)", [str(time.time())])
        problems = []
        self._remove_orphans(problems)
        for problem in problems:
            warnings.warn(f"Chorus mask bank: {problem}", stacklevel=4)

    def _has_entry(self, entry_id: str) -> bool:
        return self.conn.execute("SELECT 1 FROM entries WHERE id = ?", [entry_id]).fetchone() is not None

    @guarded
    def stage_blob(self, data: bytes, sha: str) -> None:
        """Before an import's transaction: write the blob now (content-addressed, so harmless
        if the import fails; ``verify`` removes it once old if no row ever names it)."""
        self._write_blob(data, sha)

    def _import_row(self, row: dict, read_data) -> None:
        """Inside an import's transaction: the row, its blob re-written from ``read_data()``
        when it was removed or damaged since :meth:`stage_blob`."""
        data, _ = self._files.read(row["blob_sha256"], row["blob_bytes"])
        if data is None or hashlib.sha256(data).hexdigest() != row["blob_sha256"]:
            self._write_blob(read_data(), row["blob_sha256"])
        insert_row(self.conn, row)

    # ---- transactions and counters -------------------------------------------------------

    @contextlib.contextmanager
    def _write(self, bump: bool = True, removal: bool = False):
        """One ``BEGIN IMMEDIATE`` transaction; bumps the generation counter when asked.

        A failed statement or commit is re-raised as itself (the caller's guard turns it into
        a BankError with SQLite's message, e.g. "database or disk is full"); the rollback is
        only attempted while a transaction is still open, because SQLite ends it by itself
        on some errors and a second error would hide the real one.
        """
        self.check_writable()
        conn = self.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise database_error(self.root, exc) from exc
        try:
            yield
            if bump:
                self._bump("generation")
            if removal:
                self._bump("removals")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise

    def _bump(self, key: str) -> None:
        self.conn.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = ?", [key])

    def _meta(self, key: str) -> str:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", [key]).fetchone()
        if row is None:
            raise BankError(f"The index {self.root / DB_NAME} lacks its {key!r} record: it is "
                            "damaged. Restore bank.sqlite from a backup.")
        return row[0]

    @guarded
    def content_token(self) -> str:
        """A string that changes whenever entries are added, removed or quarantined."""
        return f"{self._meta('bank_id')}:{self._meta('generation')}"

    # ---- blob files (blob_files.py; these stay methods for tests that stall a write) ----
    def blob_path(self, name: str) -> Path:
        """Path of blob ``<sha256>.safetensors`` (names are never taken as paths)."""
        sha = name[:-len(validation.BLOB_SUFFIX)] if isinstance(name, str) \
            and name.endswith(validation.BLOB_SUFFIX) else None
        path = self._files.path(sha)
        if path is None:
            raise BankInvalidArgument(f"{str(name)[:100]!r} is not a blob name of this bank "
                                      "(blobs are named <sha256>.safetensors).")
        return path

    def _write_blob(self, data: bytes, sha: str) -> str:
        """Write ``data`` to its content address via temp file + fsync + rename."""
        return self._files.write(data, sha)

    def _ensure_blob(self, data: bytes, sha: str) -> None:
        """Under the write lock: the blob holds ``data``, or is written again (a concurrent
        prune may have removed it between our write and our lock)."""
        if not self._files.holds(data, sha):
            self._write_blob(data, sha)

    # ---- matching and loading ------------------------------------------------------------
    def _get_row(self, entry_id: str) -> dict:
        if not validation.is_entry_id(entry_id):
            raise BankInvalidArgument(
                f"{str(entry_id)[:80]!r} is not an entry id (32 lowercase hex digits); list "
                f"entries with `python -m chorus_core.bank list {self.root}`.")
        rows = list(self.db.query("SELECT rowid, * FROM entries WHERE id = ?", [entry_id]))
        if not rows:
            raise BankError(f"No entry {entry_id} in the bank at {self.root}; "
                            "list entries with `python -m chorus_core.bank list PATH`.")
        return rows[0]

    def _record_hit(self, entry_id: str) -> None:
        """Hit counters are statistics: a hit never waits for the write lock (an import or another
        writer may hold it for long). When the lock is taken the hit is kept in this process and
        counted with the next hit that finds the lock free."""
        batch = take_pending_hits(self._real_root, entry_id)
        try:
            with self._write_without_waiting():  # hits do not change content: no new cache key
                self.conn.executemany("UPDATE entries SET hits = hits + ?, last_hit = MAX(COALESCE(last_hit, 0), ?) "
                                      "WHERE id = ?", [(n, last, i) for i, (n, last) in batch.items()])
        except (sqlite3.Error, BankError):
            keep_pending_hits(self._real_root, batch)

    @contextlib.contextmanager
    def _write_without_waiting(self):
        """A write transaction only if the lock is free now (raises BankError "locked" otherwise)."""
        self.conn.execute("PRAGMA busy_timeout = 0")
        try:
            with self._write(bump=False):
                yield
        finally:
            self.conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")

    # ---- maintenance ---------------------------------------------------------------------
    @guarded
    def quarantine(self, entry_id: str, reason: str) -> None:
        """Move an entry's blob to ``quarantine/`` and mark every row that uses it.

        In a read-only bank nothing moves: a warning says it would be quarantined and this
        process skips the entry from now on.
        """
        self._quarantine_row(self._get_row(entry_id), reason, recheck=False)

    def _quarantine_row(self, row: dict, reason: str, recheck: bool, warn: bool = True):
        """True: quarantined; None: read-only, skipped in this process; False: ``recheck``
        found the blob healthy under the lock (a writer re-added the same masks meanwhile);
        "gone": the row was deleted or quarantined meanwhile (e.g. by a concurrent prune)."""
        label = entry_label(row)
        if self.read_only:
            return self._skip_for_this_process(row, reason, warn)
        with self._write(bump=False):
            # rowid and id: a deleted row's rowid can be reused by a newer entry
            current = next(self.db.query(f"SELECT rowid, {self._summary} FROM entries WHERE rowid = ? "
                                         "AND id IS ?", [row["rowid"], row.get("id")]), None)
            if current is None or current["status"] != "ok":
                return "gone"
            if recheck and self._problem(current)[0] is None:
                return False
            sha = current["blob_sha256"]
            if validation.is_sha256(sha):  # every row sharing the blob shares its damage
                self.conn.execute("UPDATE entries SET status = 'quarantined', status_reason = ? "
                                  "WHERE blob_sha256 = ? AND status = 'ok'", [reason, sha])
            else:
                self.conn.execute("UPDATE entries SET status = 'quarantined', status_reason = ? "
                                  "WHERE rowid = ?", [reason, row["rowid"]])
            self._bump("generation")
            self._bump("removals")
            src = self._files.path(sha)
            if src is not None and os.path.lexists(src):
                self._files.move_aside(src, current)
            fault("quarantine-moved")
        if warn:
            warn_quarantined(label, reason)
        return True

    @guarded
    def verify(self) -> dict:
        """Recompute every blob digest and check every header; quarantine failures; drop
        stale temp and orphan blobs when the index can be trusted.

        :return: ``{"checked", "ok", "quarantined": [{"id", "reason"}], "orphans_removed",
            "problems": [text], "read_only"}``; ``problems`` lists what could not be done
            (then nothing was removed)
        """
        report = {"checked": 0, "ok": 0, "quarantined": [], "orphans_removed": 0,
                  "problems": [], "read_only": self.read_only}
        check = [r[0] for r in self.conn.execute("PRAGMA quick_check").fetchall()]
        if check != ["ok"]:
            report["problems"].append(
                f"the index fails SQLite's quick_check ({'; '.join(check)[:300]}); orphan blobs "
                "were not removed. Restore bank.sqlite from a backup.")
        rows = list(self.db.query(f"SELECT rowid, {self._summary} FROM entries WHERE status = 'ok'"))
        self._verify_entries(rows, report)
        if not self.read_only and not report["problems"]:
            report["orphans_removed"] = self._remove_orphans(report["problems"])
        return report

    def _remove_orphans(self, problems: list) -> int:
        """Blobs no row names, left by writers killed before their commit (if old enough).

        Refused when the index looks wrong (no rows but blobs present, or most blobs unknown):
        removing "orphans" of a lost or foreign index would delete the user's masks. Only blobs
        older than ``STALE_TEMP_S`` count: a live writer or importer writes its blobs before its
        rows commit, and those are neither orphans nor a sign of a lost index.
        """
        cutoff = time.time() - STALE_TEMP_S
        old_blobs, candidates = self._files.old_files(cutoff)  # old files stay old: scanned unlocked
        with self._write(bump=False):  # the rows as committed now; a writer re-checks under it too
            known = {r[0] for r in self.conn.execute("SELECT DISTINCT blob_sha256 FROM entries")}
            rows = self.conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
            orphans = [(path, sha) for path, sha in candidates if sha is None or sha not in known]
            unknown = sum(1 for _, sha in orphans if sha)
            if old_blobs and rows == 0:
                problems.append(f"the index has no entries but blobs/ holds {old_blobs} blob(s): the "
                                "index looks lost, so no orphan was removed. Restore bank.sqlite from "
                                "a backup.")
                return 0
            if unknown > 16 and unknown * 2 > old_blobs:
                problems.append(f"{unknown} of {old_blobs} blobs are not in the index: it looks like an "
                                "old or another bank's bank.sqlite, so no orphan was removed. Restore "
                                "the right index from a backup.")
                return 0
            return self._files.remove_old([path for path, _ in orphans], cutoff)

    def _delete_rows(self, ids: list[str]) -> tuple[int, list[str]]:
        shas, count = set(), 0
        for start in range(0, len(ids), 500):  # stay under SQLite's variable limit
            chunk = ids[start:start + 500]
            marks = ",".join("?" * len(chunk))
            shas.update(r[0] for r in self.conn.execute(
                f"SELECT DISTINCT blob_sha256 FROM entries WHERE id IN ({marks})", chunk))
            count += self.conn.execute(f"DELETE FROM entries WHERE id IN ({marks})", chunk).rowcount
        return count, sorted(s for s in shas if validation.is_sha256(s))

    def _release_blobs(self, shas: list[str]) -> None:
        """After the commit: unlink the blobs no row uses any more (under the write lock)."""
        try:
            with self._write(bump=False):
                for sha in shas:
                    if self.conn.execute("SELECT 1 FROM entries WHERE blob_sha256 = ?",
                                         [sha]).fetchone():
                        continue  # shared, or re-added by a concurrent writer
                    self._files.remove(sha)
                    fault("delete-mid-unlink")
        except (sqlite3.Error, OSError, BankError) as exc:  # rows are gone already: say so
            warnings.warn(f"Chorus mask bank: entries deleted, but their blobs were not removed "
                          f"({exc}); `python -m chorus_core.bank verify {self.root}` removes "
                          "them later.", stacklevel=4)

    # ---- reading -------------------------------------------------------------------------
    @guarded
    def stats(self) -> dict:
        """Counts and sizes: ``entries``, ``quarantined``, ``bytes``, ``hits``, ``schema_version``."""
        ok = self.conn.execute("SELECT COUNT(*), COALESCE(SUM(blob_bytes), 0), "
                               "COALESCE(SUM(hits), 0) FROM entries WHERE status = 'ok'").fetchone()
        bad = self.conn.execute("SELECT COUNT(*) FROM entries WHERE status != 'ok'").fetchone()[0]
        return {"path": str(self.root), "backend": "folder", "entries": ok[0], "bytes": ok[1], "hits": ok[2],
                "quarantined": bad, "schema_version": schema.schema_version(self.conn),
                "content_token": self.content_token()}

    @guarded
    def entries(self, tag: str | None = None, limit: int | None = None,
                order: str = "created DESC") -> list[dict]:
        """Entry rows (without signature vectors), optionally only those carrying ``tag``.

        :param order: ``<column> [ASC|DESC]`` over created, last_hit, hits, density, recall,
            blob_bytes
        """
        if not _ORDER.fullmatch(order):
            raise BankInvalidArgument(f"order {order[:60]!r} must be one of created, last_hit, "
                                      "hits, density, recall, blob_bytes, optionally ASC/DESC.")
        sql = f"SELECT {self._summary} FROM entries"
        params = []
        if tag is not None:
            sql += " WHERE EXISTS (SELECT 1 FROM json_each(entries.tags) WHERE value = ?)"
            params.append(tag)
        sql += f" ORDER BY {order}" + (f" LIMIT {int(limit)}" if limit else "")
        return [decode_row(r) for r in self.db.query(sql, params)]
