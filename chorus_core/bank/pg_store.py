"""The mask bank in PostgreSQL: one bank per schema, index rows and mask blobs in one engine.

Tables (schema.py, versioned in ``meta``): ``entries`` (the same columns as the folder bank's
index), ``blobs`` (content-addressed: ``sha256`` -> ``bytea``, shared by equal masks),
``quarantine`` (blobs that failed verification, kept for inspection) and ``meta`` (bank id,
schema version, generation and removal counters).

Safety rules, the folder bank's promises in one engine:

* Every write is one transaction that first takes the bank's advisory lock, so writers from
  any number of processes and machines are serialised, a row and its blob commit together,
  and a writer killed mid-transaction leaves nothing (the server rolls it back).
* A blob is size-checked before its bytes are fetched and digest-verified before use, exactly
  like a folder blob; a bad one is moved to ``quarantine`` and its entries marked.
* Signatures are matched in this process: the compatible rows are filtered in SQL and kept in
  the same in-memory matrix as the folder bank, refreshed when the change counters move. A match
  reads the counters (a round trip, which waits for the server's process to get a core) only when
  they may have moved: every counter bump sends a notification on ``chorus_bank`` with its
  commit, which each bank connection LISTENs for; a write by this process is seen at once; and
  the counters are read anyway when the last read is older than ``COUNTERS_MAX_AGE_S`` (writers
  that do not notify: an older Chorus, a pooler that drops notifications). So another worker's
  new or removed entry is seen as soon as its notification arrives, and within a second at most.
* A lost connection (server restart) fails the first call that needs the server with a
  BankError (the generation runs as a miss; a match served from memory needs none, its masks do)
  and the next call reconnects. No message ever shows the password.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
import time
import warnings
import weakref

import psycopg
from psycopg.rows import dict_row

from . import bank_url, schema, validation
from .errors import BankError, BankInvalidArgument, BankReadOnly, BankUnavailable
from .faults import fault
from .matching import SignatureIndex
from .rows import decode_row, entry_label, summary_columns
from .storage import BankStorage, guarded, warn_quarantined

CONNECT_TIMEOUT_S = 5
LOCK_TIMEOUT_S = 60
# A statement the server runs longer than this is cancelled by the server (a blob insert of an
# entry at 720p-14B, 123 MB, takes seconds); a lost peer is found by TCP: keepalive probes after
# 10 s idle (3 probes 5 s apart) and unacknowledged data after 30 s (tcp_user_timeout), instead of
# the kernel's default of minutes to hours.
STATEMENT_TIMEOUT_S = 120
TCP_SETTINGS = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
                "tcp_user_timeout": 30_000}
CLI = "python -m chorus_core.bank"
_ORDER_COLUMNS = ("created", "last_hit", "hits", "density", "recall", "blob_bytes")
NOTIFY_CHANNEL = "chorus_bank"  # one channel for every bank of a database; the payload names the schema
COUNTERS_MAX_AGE_S = 1.0  # the longest a match trusts notifications alone (see the module docstring)
_process_writes: dict[str, int] = {}  # bank label -> commits that moved its counters, by this process
_process_writes_lock = threading.Lock()


class _PgDatabase:
    """``query(sql, params)`` with ``?`` placeholders, as the shared code and the signature
    index call it on the folder bank; tables resolve through the bank's search_path."""

    def __init__(self, bank: "PostgresBank"):
        self._bank = bank

    def query(self, sql: str, params=()):
        with self._bank._connection().cursor(row_factory=dict_row) as cur:
            cur.execute(sql.replace("?", "%s"), list(params))
            return [{k: bytes(v) if isinstance(v, memoryview) else v for k, v in row.items()}
                    for row in cur.fetchall()]

    def execute(self, sql: str, params=()):
        return self._bank._connection().execute(sql.replace("?", "%s"), list(params))


class PostgresBank(BankStorage):
    """A mask bank in one schema of a PostgreSQL database (psycopg 3)."""

    root = None  # no folder: caches that need one (population priors) stay in memory

    def __init__(self, url: bank_url.BankURL, read_only: bool):
        self.url, self.read_only = url, read_only
        self.db = _PgDatabase(self)
        self._conn: psycopg.Connection | None = None
        self._lock = threading.RLock()  # one connection: one caller at a time
        self.signature_index = SignatureIndex()
        digest = hashlib.sha256(f"chorus-bank:{url.schema}".encode()).digest()
        self._lock_key = int.from_bytes(digest[:8], "big", signed=True)
        self._summary = summary_columns(True)  # a read-only bank at schema v1: without sigmas
        self._listening = False  # whether this connection gets the bank's change notifications
        self._notified = True  # a notification (or a reconnection) since the counters were last read
        self._checked = None  # (monotonic time, process writes) of the last counters read
        self._bumped = False  # whether the write under way moved the counters

    @property
    def label(self) -> str:
        return self.url.label

    @property
    def _skip_key(self) -> str:
        return self.url.label

    # ---- opening -------------------------------------------------------------------------
    @classmethod
    def open(cls, url: str, read_only: bool = False, create: bool = True) -> "PostgresBank":
        """Open (and by default create) the bank at ``url``.

        :raises BankError: the server cannot be reached (the message names its host, never
            the password), the schema is not a Chorus bank, or it is newer than this Chorus
        """
        bank = cls(bank_url.parse(url), read_only)
        try:
            with bank._guard("open the bank"):
                bank._prepare(create)
        except BaseException:
            bank.close()
            raise
        return bank

    def reopen(self) -> "PostgresBank":
        """The same bank on a new connection (e.g. for a writer thread)."""
        bank = PostgresBank(self.url, self.read_only)
        bank._summary = self._summary
        with bank._guard("open the bank"):
            bank._connection()
        return bank

    def _connect(self) -> psycopg.Connection:
        options = (f"-c search_path={self.url.schema} -c lock_timeout={LOCK_TIMEOUT_S * 1000} "
                   f"-c statement_timeout={STATEMENT_TIMEOUT_S * 1000}")
        if self.read_only:
            options += " -c default_transaction_read_only=on"
        try:
            return psycopg.connect(self.url.conninfo, autocommit=True, options=options,
                                   connect_timeout=CONNECT_TIMEOUT_S,
                                   application_name="chorus-mask-bank", **TCP_SETTINGS)
        except psycopg.Error as exc:
            raise BankUnavailable(
                f"Cannot reach the PostgreSQL mask bank at {self._where()} "
                f"({self._scrub(exc)}). Check that the server runs and accepts connections from "
                "this machine, and the user, password (PGPASSWORD or ~/.pgpass) and database; "
                "until then each generation runs as a miss (online masks, no entry reused).") from None

    def _connection(self) -> psycopg.Connection:
        """The open connection, reconnecting after a lost one (e.g. a server restart)."""
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            self._drop_connection()
            self._conn = conn = self._connect()
            self._listen(conn)
        return conn

    def _listen(self, conn: psycopg.Connection) -> None:
        """Ask for the bank's change notifications. Notifications sent while this object had no
        connection are lost: the next match reads the counters. A server that refuses LISTEN (a
        hot standby) leaves every match reading them."""
        self._notified, self._listening = True, False
        try:
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        except psycopg.Error:
            return
        # through a weak reference: a connection that held its bank would keep a dropped bank's
        # signature index (3 GB at 1,000,000 entries) until the garbage collector finds the cycle
        conn.add_notify_handler(functools.partial(PostgresBank._on_notify, weakref.ref(self)))
        self._listening = True

    @staticmethod
    def _on_notify(bank_ref, note) -> None:
        bank = bank_ref()
        if bank is not None and note.payload == bank.url.schema:
            bank._notified = True

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _where(self) -> str:
        port = f":{self.url.port}" if self.url.port else ""
        return f"{self.url.host}{port} (database {self.url.database}, schema {self.url.schema})"

    def _scrub(self, exc) -> str:
        return self.url.scrub(str(exc).strip().replace("\n", " "))

    def _tables(self) -> set[str]:
        rows = self.db.query("SELECT table_name FROM information_schema.tables "
                             "WHERE table_schema = ?", [self.url.schema])
        return {r["table_name"] for r in rows}

    def _found_version(self, tables: set) -> int:
        if not tables:
            return 0
        missing = schema.PG_TABLES - tables
        if missing:
            raise BankError(
                f"Schema {self.url.schema} at {self._where()} is not a Chorus bank: it lacks the "
                f"{', '.join(sorted(missing))} table(s). Nothing was changed. Use another "
                "?schema= in the URL, or restore the bank from a backup.")
        rows = self.db.query("SELECT value FROM meta WHERE key = 'schema_version'")
        if not rows or not str(rows[0]["value"]).isdigit():
            raise BankError(f"The bank at {self.label} has no schema version in its meta table: "
                            "it is damaged. Restore it from a backup.")
        return int(rows[0]["value"])

    def _prepare(self, create: bool) -> None:
        found = self._found_version(self._tables())
        if found == 0 and (self.read_only or not create):
            raise BankError(f"No mask bank at {self.label}. Create one with "
                            f"`{CLI} init '{self.label}'` or open with create=True.")
        if found > schema.PG_SCHEMA_VERSION:
            raise BankError(f"The bank at {self.label} has schema version {found}, newer than "
                            f"this Chorus ({schema.PG_SCHEMA_VERSION}); upgrade Chorus to use it.")
        if found == schema.PG_SCHEMA_VERSION:
            return
        if self.read_only:
            if found < schema.PG_READ_ONLY_OLDEST:
                raise BankError(f"The bank at {self.label} has schema version {found}, this "
                                f"Chorus reads {schema.PG_READ_ONLY_OLDEST} to "
                                f"{schema.PG_SCHEMA_VERSION}; open it once without read_only "
                                "to migrate it.")
            self._summary = summary_columns(found >= schema.PG_SIGMAS_SINCE)
            return
        conn = self._connection()
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", [self._lock_key])
            conn.execute(f"CREATE SCHEMA IF NOT EXISTS {self.url.schema}")
            found = self._found_version(self._tables())  # another worker may have migrated
            schema.pg_migrate(conn, self.url.schema, found)

    def close(self) -> None:
        """Close the connection (a later call would reconnect)."""
        with self._lock:
            self._drop_connection()

    # ---- errors, transactions and counters -----------------------------------------------
    @contextlib.contextmanager
    def _guard(self, what: str):
        with self._lock:
            try:
                yield
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                if isinstance(exc, psycopg.errors.DiskFull):
                    raise self._database_error(exc) from None
                self._drop_connection()  # the next call reconnects
                raise BankUnavailable(
                    f"Lost the connection to the PostgreSQL mask bank at {self._where()} while "
                    f"trying to {what} ({self._scrub(exc)}); nothing half-done was kept. This "
                    "request runs as a miss; the next one reconnects.") from None
            except psycopg.Error as exc:
                raise self._database_error(exc) from None

    def _database_error(self, exc: psycopg.Error) -> BankError:
        text = self._scrub(exc)
        if isinstance(exc, psycopg.errors.DiskFull):
            return BankError(f"The disk of the PostgreSQL server holding the mask bank "
                             f"{self.label} is full ({text}); nothing was stored. Free space on "
                             f"the server, or prune the bank (`{CLI} prune '{self.label}' "
                             "--max-bytes 20G`), and retry.")
        if isinstance(exc, (psycopg.errors.ReadOnlySqlTransaction,
                            psycopg.errors.InsufficientPrivilege)):
            return BankReadOnly(f"Cannot write the bank at {self.label} ({text}); grant the "
                                "user write access to its schema, or open with read_only=True.")
        if isinstance(exc, psycopg.errors.LockNotAvailable):
            return BankError(f"The mask bank {self.label} stayed locked by another worker for "
                             f"more than {LOCK_TIMEOUT_S} s ({text}); retry when it has finished.")
        return BankError(f"The mask bank {self.label} cannot be used ({text}); nothing was "
                         "changed. Check that its schema is a Chorus bank (restore it from a "
                         "backup if it was damaged).")

    @contextlib.contextmanager
    def _write(self, bump: bool = True, removal: bool = False):
        """One transaction holding the bank's advisory lock (writers are serialised, so rows
        appear in rowid order); bumps the counters when asked; rolled back on any error."""
        self.check_writable()
        conn = self._connection()
        with self._lock:
            self._bumped = False
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [self._lock_key])
                yield
                if bump:
                    self._bump("generation")
                if removal:
                    self._bump("removals")
            if self._bumped:  # committed: this process's other objects need no notification
                with _process_writes_lock:
                    _process_writes[self.url.label] = _process_writes.get(self.url.label, 0) + 1

    def _bump(self, key: str) -> None:
        """Move a counter, and tell the listeners at commit (the server sends one notification
        per transaction for equal ones, and none if it rolls back)."""
        self.db.execute("UPDATE meta SET value = (value::bigint + 1)::text WHERE key = ?", [key])
        self.db.execute("SELECT pg_notify(?, ?)", [NOTIFY_CHANNEL, self.url.schema])
        self._bumped = True

    def _meta(self, key: str) -> str:
        rows = self.db.query("SELECT value FROM meta WHERE key = ?", [key])
        if not rows:
            raise BankError(f"The bank at {self.label} lacks its {key!r} record: it is damaged. "
                            "Restore it from a backup.")
        return rows[0]["value"]

    def _counters_if_moved(self) -> tuple[int, int] | None:
        """The change counters, read from the server only when they may have moved since the
        last read (see the module docstring); None when they have not."""
        conn = self._connection()
        writes = _process_writes.get(self.url.label, 0)
        if self._unmoved(conn, writes):
            return None
        # cleared and timed before the read: a notification arriving during it is not lost
        self._notified, started = False, time.monotonic()
        counters = self._counters()
        self._checked = (started, writes)
        return counters

    def _unmoved(self, conn: psycopg.Connection, writes: int) -> bool:
        if not self._listening or self._checked is None:
            return False
        started, seen_writes = self._checked
        if writes != seen_writes or time.monotonic() - started > COUNTERS_MAX_AGE_S:
            return False
        pgconn = conn.pgconn
        pgconn.consume_input()  # what arrived while the connection was idle; does not block
        while (note := pgconn.notifies()) is not None:
            pgconn.notify_handler(note)  # psycopg's dispatch, as during its own queries
        return not self._notified

    def _counters(self) -> tuple[int, int]:
        rows = {r["key"]: r["value"] for r in self.db.query(
            "SELECT key, value FROM meta WHERE key IN ('generation', 'removals')")}
        if len(rows) != 2:
            raise BankError(f"The bank at {self.label} lacks its change counters: it is "
                            "damaged. Restore it from a backup.")
        return int(rows["generation"]), int(rows["removals"])

    @guarded
    def content_token(self) -> str:
        """A string that changes whenever entries are added, removed or quarantined."""
        rows = {r["key"]: r["value"] for r in self.db.query(
            "SELECT key, value FROM meta WHERE key IN ('bank_id', 'generation')")}
        if len(rows) != 2:
            raise BankError(f"The bank at {self.label} lacks its meta records: it is damaged.")
        return f"{rows['bank_id']}:{rows['generation']}"

    # ---- rows and blobs ------------------------------------------------------------------
    def _get_row(self, entry_id: str) -> dict:
        if not validation.is_entry_id(entry_id):
            raise BankInvalidArgument(
                f"{str(entry_id)[:80]!r} is not an entry id (32 lowercase hex digits); list "
                f"entries with `{CLI} list '{self.label}'`.")
        rows = self.db.query("SELECT * FROM entries WHERE id = ?", [entry_id])
        if not rows:
            raise BankError(f"No entry {entry_id} in the bank at {self.label}; "
                            f"list entries with `{CLI} list URL`.")
        return rows[0]

    def _has_entry(self, entry_id: str) -> bool:
        return bool(self.db.query("SELECT 1 FROM entries WHERE id = ?", [entry_id]))

    def _read_blob(self, sha: str, size: int) -> tuple[bytes | None, str | None]:
        """The blob's bytes, fetched only when its stored size is the row's."""
        rows = self.db.query("SELECT octet_length(data) AS n, CASE WHEN octet_length(data) = ? "
                             "THEN data END AS data FROM blobs WHERE sha256 = ?", [size, sha])
        if not rows:
            return None, "blob missing"
        if rows[0]["n"] != size:
            return None, f"blob truncated or resized ({rows[0]['n']} of {size} bytes)"
        return rows[0]["data"], None

    def _put_blob(self, data: bytes, sha: str) -> None:
        """Inside a write: the blob row holds ``data`` (an existing damaged copy is replaced)."""
        self.db.execute(
            "INSERT INTO blobs (sha256, size, data) VALUES (?, ?, ?) ON CONFLICT (sha256) DO "
            "UPDATE SET data = EXCLUDED.data, size = EXCLUDED.size WHERE blobs.size <> "
            "EXCLUDED.size OR encode(sha256(blobs.data), 'hex') <> blobs.sha256",
            [sha, len(data), data])

    def _insert(self, row: dict) -> None:
        cols = ", ".join(row)
        self.db.execute(f"INSERT INTO entries ({cols}) VALUES ({', '.join('?' * len(row))})",
                        list(row.values()))

    def _store_entry(self, row: dict, data: bytes):
        """The blob, the row and the budget's evictions commit together (or, killed, none of them)."""
        with self._write():
            self._put_blob(data, row["blob_sha256"])
            fault("add-blob-written")
            self._insert(row)
            eviction, _ = self._keep_budget(protect=[row["id"]], written=row["id"])
            fault("add-before-commit")
        return eviction

    def _put_merged_blob(self, data: bytes, sha: str) -> None:
        self._put_blob(data, sha)  # in the merge's transaction: it commits with the row or not at all

    def _renumber(self, entry_id: str) -> None:
        """The next value of the rowid sequence, taken under the bank's lock as an insert takes it."""
        self.db.execute("UPDATE entries SET rowid = nextval(pg_get_serial_sequence('entries', 'rowid')) "
                        "WHERE id = ?", [entry_id])

    def _unused_after_switch(self, sha: str) -> list:
        """The old blob goes in the merge's own transaction when no entry uses it any more."""
        self.db.execute("DELETE FROM blobs b WHERE sha256 = ? AND NOT EXISTS "
                        "(SELECT 1 FROM entries e WHERE e.blob_sha256 = b.sha256)", [sha])
        return []

    def _quarantined_blobs(self) -> list[dict]:
        return [{"key": r["id"], "bytes": int(r["bytes"] or 0), "moved": r["moved"]} for r in self.db.query(
            "SELECT id, COALESCE(octet_length(data), 0) AS bytes, moved FROM quarantine")]

    def _remove_quarantined(self, keys: list) -> None:
        if keys:
            self.db.execute("DELETE FROM quarantine WHERE id = ANY(?)", [list(keys)])

    def stage_blob(self, data: bytes, sha: str) -> None:
        """Nothing to do before an import's transaction: the blob goes in with its row."""

    _import_transaction_s, _import_pause_s = 0.0, 0.0  # waiters of an advisory lock are queued

    def _import_reader(self, row: dict, read_data):
        data = read_data()  # read and digest-checked before the advisory lock is taken
        return lambda: data

    def _import_row(self, row: dict, read_data) -> None:
        self._put_blob(read_data(), row["blob_sha256"])
        self._insert(row)

    def _record_hit(self, entry_id: str) -> None:
        """Hit counters are statistics: a failed update must not fail the load."""
        try:
            self.db.execute("UPDATE entries SET hits = hits + 1, last_hit = ? WHERE id = ?",
                            [time.time(), entry_id])
        except psycopg.Error as exc:
            if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
                self._drop_connection()
            warnings.warn(f"Chorus mask bank: hit of {entry_id} not counted "
                          f"({self._scrub(exc)}).", stacklevel=3)

    # ---- maintenance ---------------------------------------------------------------------
    @guarded
    def quarantine(self, entry_id: str, reason: str) -> None:
        """Mark an entry (and every entry sharing its blob) quarantined and move the blob to
        the quarantine table; read-only: warn and skip it in this process."""
        self._quarantine_row(self._get_row(entry_id), reason, recheck=False)

    def _quarantine_row(self, row: dict, reason: str, recheck: bool, warn: bool = True):
        """True: quarantined; None: read-only, skipped in this process; False: ``recheck``
        found the blob healthy under the lock; "gone": deleted or quarantined meanwhile."""
        label = entry_label(row)
        if self.read_only:
            return self._skip_for_this_process(row, reason, warn)
        with self._write(bump=False):
            current = self.db.query(f"SELECT rowid, {self._summary} FROM entries WHERE rowid = ? "
                                    "AND id IS NOT DISTINCT FROM ?", [row["rowid"], row.get("id")])
            if not current or current[0]["status"] != "ok":
                return "gone"
            if recheck and self._problem(current[0])[0] is None:
                return False
            self._mark_quarantined(current[0], reason)
            self._bump("generation")
            self._bump("removals")
            fault("quarantine-moved")
        if warn:
            warn_quarantined(label, reason)
        return True

    def _mark_quarantined(self, row: dict, reason: str) -> None:
        sha = row["blob_sha256"]
        if not validation.is_sha256(sha):
            self.db.execute("UPDATE entries SET status = 'quarantined', status_reason = ? "
                            "WHERE rowid = ?", [reason, row["rowid"]])
            return
        # every row sharing the blob shares its damage; a re-add writes a fresh blob
        self.db.execute("UPDATE entries SET status = 'quarantined', status_reason = ? "
                        "WHERE blob_sha256 = ? AND status = 'ok'", [reason, sha])
        self.db.execute("INSERT INTO quarantine (entry_id, sha256, reason, moved, data) "
                        "SELECT ?, sha256, ?, ?, data FROM blobs WHERE sha256 = ?",
                        [row["id"], reason, time.time(), sha])
        self.db.execute("DELETE FROM blobs WHERE sha256 = ?", [sha])

    @guarded
    def verify(self) -> dict:
        """Recompute every blob digest and check every header; quarantine failures; drop
        blobs no entry uses (when the index can be trusted).

        :return: ``{"checked", "ok", "quarantined": [{"id", "reason"}], "orphans_removed",
            "problems": [text], "read_only"}``
        """
        report = {"checked": 0, "ok": 0, "quarantined": [], "orphans_removed": 0,
                  "problems": [], "read_only": self.read_only}
        rows = self.db.query(f"SELECT rowid, {self._summary} FROM entries WHERE status = 'ok' "
                             "ORDER BY rowid")
        self._verify_entries(rows, report)
        if not self.read_only:
            report["orphans_removed"] = self._remove_orphans(report["problems"])
        return report

    def _remove_orphans(self, problems: list) -> int:
        """Blobs no row names (only a hand-edited index leaves them: writes are atomic).
        Refused when the index has no rows at all but blobs remain: it looks lost."""
        with self._write(bump=False):
            rows = self.db.query("SELECT (SELECT COUNT(*) FROM entries) AS rows, "
                                 "(SELECT COUNT(*) FROM blobs) AS blobs")[0]
            if rows["blobs"] and rows["rows"] == 0:
                problems.append(f"the index has no entries but the blobs table holds "
                                f"{rows['blobs']} blob(s): the index looks lost, so no orphan "
                                "was removed. Restore the bank from a backup.")
                return 0
            cur = self.db.execute("DELETE FROM blobs b WHERE NOT EXISTS (SELECT 1 FROM entries e "
                                  "WHERE e.blob_sha256 = b.sha256)")
            return cur.rowcount

    def _delete_rows(self, ids: list[str]) -> tuple[int, list]:
        """Inside a write: the rows, then every blob they used that no row uses any more (in the
        same transaction, so nothing is left for after the commit); returns (rows gone, [])."""
        gone = self.db.execute("DELETE FROM entries WHERE id = ANY(?) RETURNING blob_sha256",
                               [ids]).fetchall()
        shas = sorted({r[0] for r in gone if r[0]})
        if shas:
            self.db.execute("DELETE FROM blobs b WHERE sha256 = ANY(?) AND NOT EXISTS "
                            "(SELECT 1 FROM entries e WHERE e.blob_sha256 = b.sha256)", [shas])
        return len(gone), []

    # ---- reading -------------------------------------------------------------------------
    @guarded
    def stats(self) -> dict:
        """Counts and sizes: ``entries``, ``quarantined``, ``bytes``, ``hits``, ``schema_version``."""
        row = self.db.query(
            "SELECT COUNT(*) FILTER (WHERE status = 'ok') AS entries, "
            "COALESCE(SUM(blob_bytes) FILTER (WHERE status = 'ok'), 0) AS bytes, "
            "COALESCE(SUM(hits) FILTER (WHERE status = 'ok'), 0) AS hits, "
            "COUNT(*) FILTER (WHERE status <> 'ok') AS quarantined FROM entries")[0]
        return {"path": self.label, "backend": "postgresql", "entries": row["entries"],
                "bytes": int(row["bytes"]), "hits": int(row["hits"]),
                "quarantined": row["quarantined"],
                "schema_version": int(self._meta("schema_version")),
                "content_token": self.content_token()}

    @guarded
    def entries(self, tag: str | None = None, limit: int | None = None,
                order: str = "created DESC") -> list[dict]:
        """Entry rows (without signature vectors), optionally only those carrying ``tag``.

        :param order: ``<column> [ASC|DESC]`` over created, last_hit, hits, density, recall,
            blob_bytes (missing values sort first, as in the folder bank)
        """
        column, _, direction = order.strip().partition(" ")
        direction = direction.strip().upper() or "ASC"
        if column.lower() not in _ORDER_COLUMNS or direction not in ("ASC", "DESC"):
            raise BankInvalidArgument(f"order {order[:60]!r} must be one of created, last_hit, "
                                      "hits, density, recall, blob_bytes, optionally ASC/DESC.")
        nulls = "NULLS FIRST" if direction == "ASC" else "NULLS LAST"
        sql, params = f"SELECT {self._summary} FROM entries", []
        if tag is not None:
            sql += (" WHERE EXISTS (SELECT 1 FROM json_array_elements_text(entries.tags::json) "
                    "AS t(value) WHERE t.value = ?)")
            params.append(tag)
        sql += f" ORDER BY {column.lower()} {direction} {nulls}, rowid {direction}"
        sql += f" LIMIT {int(limit)}" if limit else ""
        return [decode_row(r) for r in self.db.query(sql, params)]
