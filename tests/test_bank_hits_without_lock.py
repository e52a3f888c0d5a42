"""A hit on a folder bank never waits for the write lock: another process (an import, a writer)
may hold it for minutes. Reopening a current bank takes no lock, and a hit that finds the lock
taken is counted later, with the next hit that finds it free."""

import sqlite3
import time

from bank_fixtures import add_toy
from chorus_core.bank import MaskBank


def test_a_hit_is_served_at_once_while_another_process_holds_the_write_lock_and_counted_later(tmp_path):
    bank = MaskBank.open(tmp_path / "bank")
    entry = add_toy(bank)
    holder = sqlite3.connect(tmp_path / "bank" / "bank.sqlite", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # as an import holds it while it adds its rows
    try:
        started = time.monotonic()
        with bank.reopen() as reopened:  # what a hit's prefetch does first
            masks = reopened.load_masks(entry)
        took = time.monotonic() - started
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert took < 2 and masks.block_map_numpy(0, 0).shape == (2, 8, 8)
    assert bank.show(entry)["hits"] == 0  # not counted yet: the lock was taken

    bank.load_masks(entry)
    row = bank.show(entry)
    assert row["hits"] == 2 and row["last_hit"] is not None  # the held-back hit went in with this one
