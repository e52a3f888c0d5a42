"""Database schema of the mask bank, its version (``PRAGMA user_version``) and migrations.

A fresh bank is created at version 1 and migrated forward, so every migration runs on
every new bank and stays tested.
"""

from __future__ import annotations

import secrets

import sqlite_utils

SCHEMA_VERSION = 2

_V1_COLUMNS = {
    "id": str, "created": float, "last_hit": float, "hits": int,
    "compat": str, "fingerprint": str,
    "grid_t": int, "grid_h": int, "grid_w": int, "token_order": str,
    "block_q": int, "block_k": int,
    "steps": int, "sampler": str, "scheduler": str, "shift": float, "step_buckets": str,
    "density": float, "sig_clip": bytes, "sig_text": bytes, "sig_layout": bytes,
    "blob_name": str, "blob_bytes": int, "blob_sha256": str,
}


def _create_v1(db: sqlite_utils.Database) -> None:
    db["entries"].create(_V1_COLUMNS, pk="id", not_null={"id", "created", "compat"})


def _migrate_1_to_2(db: sqlite_utils.Database) -> None:
    """v2: measured recall, user tags, quarantine status, codec; meta counters; indexes."""
    entries = db["entries"]
    entries.add_column("recall", float)
    entries.add_column("tags", str, not_null_default="[]")
    entries.add_column("status", str, not_null_default="ok")
    entries.add_column("status_reason", str)
    entries.add_column("codec", str)
    db["meta"].create({"key": str, "value": str}, pk="key")
    db["meta"].insert_all([{"key": "bank_id", "value": secrets.token_hex(8)},
                           {"key": "generation", "value": "0"},
                           {"key": "removals", "value": "0"}])
    entries.create_index(["compat", "status"], index_name="idx_entries_compat")
    entries.create_index(["last_hit"], index_name="idx_entries_last_hit")


MIGRATIONS = {2: _migrate_1_to_2}  # target version -> step from the version before


def schema_version(db: sqlite_utils.Database) -> int:
    return db.execute("PRAGMA user_version").fetchone()[0]


def migrate(db: sqlite_utils.Database) -> int:
    """Bring ``db`` to :data:`SCHEMA_VERSION`; call inside a write transaction.

    :return: the version found before migrating (0 for an empty database)
    """
    found = schema_version(db)
    if found == 0 and "entries" not in db.table_names():
        _create_v1(db)
        db.execute("PRAGMA user_version = 1")
    for target in range(max(found, 1) + 1, SCHEMA_VERSION + 1):
        MIGRATIONS[target](db)
        db.execute(f"PRAGMA user_version = {target}")
    return found
