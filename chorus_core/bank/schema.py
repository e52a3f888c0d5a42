"""Database schema of the mask bank, its version (``PRAGMA user_version``) and migrations.

A fresh bank is created at version 1 and migrated forward, so every migration runs on
every new bank and stays tested. Everything here is plain SQL on a ``sqlite3`` connection,
run inside the store's own ``BEGIN IMMEDIATE`` transaction: no statement commits on its own
(sqlite-utils' table helpers do, which broke that transaction on sqlite-utils 3.36-3.39).
"""

from __future__ import annotations

import secrets

SCHEMA_VERSION = 3
# The oldest version a read-only bank is read at: v3 only added the nullable ``sigmas``
# column, which a reader of a v2 bank takes as NULL (it cannot migrate without writing).
READ_ONLY_OLDEST = 2
SIGMAS_SINCE = 3  # the first version whose entries table has the sigmas column
TABLES = {1: {"entries"}, 2: {"entries", "meta"}, 3: {"entries", "meta"}}  # tables each version must have

_V1_ENTRIES = """CREATE TABLE [entries] (
   [id] TEXT PRIMARY KEY NOT NULL, [created] FLOAT NOT NULL, [last_hit] FLOAT, [hits] INTEGER,
   [compat] TEXT NOT NULL, [fingerprint] TEXT,
   [grid_t] INTEGER, [grid_h] INTEGER, [grid_w] INTEGER, [token_order] TEXT,
   [block_q] INTEGER, [block_k] INTEGER,
   [steps] INTEGER, [sampler] TEXT, [scheduler] TEXT, [shift] FLOAT, [step_buckets] TEXT,
   [density] FLOAT, [sig_clip] BLOB, [sig_text] BLOB, [sig_layout] BLOB,
   [blob_name] TEXT, [blob_bytes] INTEGER, [blob_sha256] TEXT)"""

_V2_STEPS = (
    "ALTER TABLE [entries] ADD COLUMN [recall] FLOAT",
    "ALTER TABLE [entries] ADD COLUMN [tags] TEXT NOT NULL DEFAULT '[]'",
    "ALTER TABLE [entries] ADD COLUMN [status] TEXT NOT NULL DEFAULT 'ok'",
    "ALTER TABLE [entries] ADD COLUMN [status_reason] TEXT",
    "ALTER TABLE [entries] ADD COLUMN [codec] TEXT",
    "CREATE TABLE [meta] ([key] TEXT PRIMARY KEY, [value] TEXT)",
    "CREATE INDEX [idx_entries_compat] ON [entries] ([compat], [status])",
    "CREATE INDEX [idx_entries_last_hit] ON [entries] ([last_hit])",
)


def _conn(db):
    return getattr(db, "conn", db)  # a sqlite3 connection or a sqlite_utils.Database


def _create_v1(conn) -> None:
    conn.execute(_V1_ENTRIES)


def _migrate_1_to_2(conn) -> None:
    """v2: measured recall, user tags, quarantine status, codec; meta counters; indexes."""
    for statement in _V2_STEPS:
        conn.execute(statement)
    conn.executemany("INSERT INTO [meta] ([key], [value]) VALUES (?, ?)",
                     [("bank_id", secrets.token_hex(8)), ("generation", "0"), ("removals", "0")])


def _migrate_2_to_3(conn) -> None:
    """v3: the recording run's sigma schedule (JSON list; NULL for entries recorded before)."""
    conn.execute("ALTER TABLE [entries] ADD COLUMN [sigmas] TEXT")


MIGRATIONS = {2: _migrate_1_to_2, 3: _migrate_2_to_3}  # target version -> step from the version before


def schema_version(db) -> int:
    return _conn(db).execute("PRAGMA user_version").fetchone()[0]


def table_names(db) -> set[str]:
    rows = _conn(db).execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return {r[0] for r in rows}


def missing_tables(db, version: int) -> set[str]:
    """Tables a bank of ``version`` must have but ``db`` lacks."""
    return TABLES.get(version, TABLES[SCHEMA_VERSION]) - table_names(db)


def migrate(db) -> int:
    """Bring ``db`` to :data:`SCHEMA_VERSION`; call inside a write transaction.

    :return: the version found before migrating (0 for an empty database)
    """
    conn = _conn(db)
    found = schema_version(conn)
    if found == 0 and "entries" not in table_names(conn):
        _create_v1(conn)
        conn.execute("PRAGMA user_version = 1")
    for target in range(max(found, 1) + 1, SCHEMA_VERSION + 1):
        MIGRATIONS[target](conn)
        conn.execute(f"PRAGMA user_version = {target}")
    return found


# ---- PostgreSQL ---------------------------------------------------------------------------
# One bank per PostgreSQL schema; the version lives in its meta table (key "schema_version").
# Statements use "{s}" for the schema name (checked as a plain identifier by bank_url.parse).
# ``rowid`` is a sequence assigned under the bank's write lock (an advisory lock), so rows
# become visible in rowid order: a reader that appends "rowid > last seen" misses none.
PG_SCHEMA_VERSION = 2
PG_READ_ONLY_OLDEST = 1  # as READ_ONLY_OLDEST: v2 only added the nullable sigmas column
PG_SIGMAS_SINCE = 2
PG_TABLES = {"entries", "blobs", "meta"}

_PG_V1 = (
    """CREATE TABLE {s}.entries (
       rowid BIGSERIAL UNIQUE, id TEXT PRIMARY KEY, created DOUBLE PRECISION NOT NULL,
       last_hit DOUBLE PRECISION, hits INTEGER NOT NULL DEFAULT 0, compat TEXT NOT NULL,
       fingerprint TEXT, grid_t INTEGER, grid_h INTEGER, grid_w INTEGER, token_order TEXT,
       block_q INTEGER, block_k INTEGER, steps INTEGER, sampler TEXT, scheduler TEXT,
       shift DOUBLE PRECISION, step_buckets TEXT, density DOUBLE PRECISION,
       recall DOUBLE PRECISION, tags TEXT NOT NULL DEFAULT '[]',
       status TEXT NOT NULL DEFAULT 'ok', status_reason TEXT, codec TEXT,
       sig_clip BYTEA, sig_text BYTEA, sig_layout BYTEA,
       blob_name TEXT, blob_bytes BIGINT, blob_sha256 TEXT)""",
    # Content-addressed blobs: one row per sha256, shared by every entry with equal masks.
    "CREATE TABLE {s}.blobs (sha256 TEXT PRIMARY KEY, size BIGINT NOT NULL, data BYTEA NOT NULL)",
    # Blobs that failed verification, kept for inspection (the entries point at them no more).
    """CREATE TABLE {s}.quarantine (id BIGSERIAL PRIMARY KEY, entry_id TEXT, sha256 TEXT,
       reason TEXT, moved DOUBLE PRECISION NOT NULL, data BYTEA)""",
    "CREATE TABLE {s}.meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE INDEX ON {s}.entries (compat, status, rowid)",
    "CREATE INDEX ON {s}.entries (blob_sha256)",
    "CREATE INDEX ON {s}.entries (last_hit)",
)

_PG_V2 = ("ALTER TABLE {s}.entries ADD COLUMN sigmas TEXT",)  # the recording's sigmas (JSON)

PG_MIGRATIONS = {1: _PG_V1, 2: _PG_V2}  # target version -> statements from the version before


def pg_migrate(conn, schema: str, found: int) -> None:
    """Bring a bank schema from version ``found`` (0: empty) to :data:`PG_SCHEMA_VERSION`;
    call inside the bank's write transaction (psycopg connection, schema name checked)."""
    for target in range(found + 1, PG_SCHEMA_VERSION + 1):
        for statement in PG_MIGRATIONS[target]:
            conn.execute(statement.format(s=schema))
        if target == 1:
            conn.execute(f"INSERT INTO {schema}.meta (key, value) VALUES ('bank_id', %s), "
                         "('generation', '0'), ('removals', '0'), ('schema_version', '1')",
                         [secrets.token_hex(8)])
        else:
            conn.execute(f"UPDATE {schema}.meta SET value = %s WHERE key = 'schema_version'",
                         [str(target)])
