"""One bank object per bank for the process: what it keeps in memory (its signature index) lives."""

import shutil
import threading

import pytest
from bank_fixtures import FP, LAYOUT, add_toy, toy_signature
from bank_pg_cluster import DATABASE, location, pg  # noqa: F401  (fixtures)

from chorus_core.bank import BankError, open_bank
from chorus_core.bank.open_banks import forget_shared_banks, shared_bank


@pytest.fixture(autouse=True)
def no_shared_banks_left():
    yield
    forget_shared_banks()


def test_one_object_per_bank_that_sees_every_later_write(location):
    bank = shared_bank(location)
    first = add_toy(bank, seed=1)
    assert bank.match(toy_signature(1), FP, LAYOUT, threshold=0.9).entry_id == first
    with open_bank(location) as other_process:  # a write on another connection
        second = add_toy(other_process, seed=2)
    assert shared_bank(location) is bank
    assert bank.match(toy_signature(2), FP, LAYOUT, threshold=0.9).entry_id == second
    assert shared_bank(location, read_only=True) is not bank  # the mode is part of what is shared


def test_each_thread_has_its_own_object(tmp_path):
    bank = shared_bank(tmp_path / "bank")
    seen = []
    worker = threading.Thread(target=lambda: seen.append(shared_bank(tmp_path / "bank")))
    worker.start()
    worker.join()
    assert seen[0] is not bank and seen[0].stats()["entries"] == 0


def test_a_replaced_folder_bank_gets_a_new_object_and_the_old_one_is_closed(tmp_path):
    bank = shared_bank(tmp_path / "bank")
    add_toy(bank, seed=1)
    shutil.rmtree(tmp_path / "bank")
    fresh = shared_bank(tmp_path / "bank")
    assert fresh is not bank and fresh.stats()["entries"] == 0
    with pytest.raises(BankError, match="closed database"):
        bank.stats()  # closed: nothing keeps a deleted bank's file open


def test_a_postgres_bank_made_again_under_its_url_gets_a_new_object(pg):  # noqa: F811
    schema = pg.fresh_schema()
    url = pg.url(schema)
    bank = shared_bank(url)
    add_toy(bank, seed=1)
    pg.sql(f'DROP SCHEMA "{schema}" CASCADE', database=DATABASE)
    fresh = shared_bank(url)
    assert fresh is not bank and fresh.stats()["entries"] == 0
