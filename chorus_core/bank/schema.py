"""Database schema of the mask bank, its version (``PRAGMA user_version``) and migrations.

A fresh bank is created at version 1 and migrated forward, so every migration runs on
every new bank and stays tested. Everything here is plain SQL on a ``sqlite3`` connection,
run inside the store's own ``BEGIN IMMEDIATE`` transaction: no statement commits on its own
(sqlite-utils' table helpers do, which broke that transaction on sqlite-utils 3.36-3.39).
"""

from __future__ import annotations

import secrets

SCHEMA_VERSION = 2
TABLES = {1: {"entries"}, 2: {"entries", "meta"}}  # tables each version must have

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


MIGRATIONS = {2: _migrate_1_to_2}  # target version -> step from the version before


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
