"""One bank object per bank and thread, one signature index per bank for the process: what it keeps
in memory lives, once; an ended thread's object is closed."""

import gc
import shutil
import threading
import time
import weakref

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


def in_thread(work):
    """``work()``'s result, computed on a thread that has ended when this returns."""
    out = []
    worker = threading.Thread(target=lambda: out.append(work()))
    worker.start()
    worker.join()
    return out[0]


def test_each_thread_has_its_own_object(tmp_path):
    bank = shared_bank(tmp_path / "bank")
    other = threading.Event()
    seen = []

    def worker_body():
        seen.append(shared_bank(tmp_path / "bank"))
        other.wait(10)  # alive while the main thread looks: an ended thread's object is closed

    worker = threading.Thread(target=worker_body)
    worker.start()
    while not seen:
        worker.join(0.01)
    assert seen[0] is not bank and seen[0].stats()["entries"] == 0
    other.set()
    worker.join()


def test_threads_matching_one_bank_share_one_index(location):
    bank = shared_bank(location)
    entry = add_toy(bank, seed=1)
    assert bank.match(toy_signature(1), FP, LAYOUT, threshold=0.9).entry_id == entry

    def match_in_worker():
        mine = shared_bank(location)
        return mine, mine.signature_index, mine.match(toy_signature(1), FP, LAYOUT, threshold=0.9).entry_id

    theirs, index, found = in_thread(match_in_worker)
    assert theirs is not bank  # its own object and connection...
    assert index is bank.signature_index  # ...and the process's one index
    assert found == entry


def test_a_removal_seen_by_one_threads_refresh_is_seen_by_the_others(location):
    bank = shared_bank(location)
    first, second = add_toy(bank, seed=1), add_toy(bank, seed=2)
    assert bank.match(toy_signature(1), FP, LAYOUT, threshold=0.9).entry_id == first
    go, matched, results = threading.Event(), threading.Event(), []

    def worker_body():  # a thread that stays alive, matching when told
        mine = shared_bank(location)
        results.append(mine.match(toy_signature(1), FP, LAYOUT, threshold=0.9).entry_id)
        matched.set()
        go.wait(10)
        results.append(mine.match(toy_signature(1), FP, LAYOUT, threshold=0.9).entry_id)

    worker = threading.Thread(target=worker_body)
    worker.start()
    assert matched.wait(10) and results == [first]
    with open_bank(location) as other_process:
        other_process.delete([first])
    assert bank.match(toy_signature(1), FP, LAYOUT).entry_id == second  # this thread's refresh drops it
    go.set()
    worker.join()
    assert results[1] == second  # the worker's match no longer finds it either


def test_an_ended_threads_bank_is_closed_and_its_index_let_go(tmp_path):
    def open_in_worker():
        mine = shared_bank(tmp_path / "bank")
        mine.match(toy_signature(1), FP, LAYOUT)
        return weakref.ref(mine), weakref.ref(mine.signature_index)

    bank_ref, index_ref = in_thread(open_in_worker)
    shared_bank(tmp_path / "other")  # any later call closes what ended threads left
    gc.collect()
    assert bank_ref() is None and index_ref() is None  # closed, dropped: nothing held it since


def test_an_ended_threads_folder_connection_is_closed(tmp_path):
    held = in_thread(lambda: shared_bank(tmp_path / "bank"))
    shared_bank(tmp_path / "other")
    with pytest.raises(BankError, match="closed database"):
        held.stats()


def test_an_ended_threads_postgres_connection_is_closed(pg, tmp_path):  # noqa: F811
    url = pg.url(pg.fresh_schema())
    shared_bank(url)
    sessions = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'chorus-mask-bank'"
    before = int(pg.sql(sessions))
    in_thread(lambda: shared_bank(url).stats())
    assert int(pg.sql(sessions)) == before + 1
    shared_bank(tmp_path / "other")
    deadline = time.monotonic() + 10  # the server's backend ends a moment after the client closes
    while int(pg.sql(sessions)) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert int(pg.sql(sessions)) == before


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


def test_threads_match_while_the_shared_index_takes_in_writes(tmp_path):
    """Matches (readers) and refreshes (one writer at a time) of the one index interleave: no
    thread fails, and each ends seeing every entry."""
    location = tmp_path / "bank"
    shared_bank(location)
    errors, found, stop = [], [], threading.Event()

    def matcher():
        try:
            mine = shared_bank(location)
            while not stop.is_set():
                mine.match(toy_signature(0), FP, LAYOUT)
            found.append(mine.match(toy_signature(11), FP, LAYOUT, threshold=0.9).entry_id)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    workers = [threading.Thread(target=matcher) for _ in range(4)]
    for worker in workers:
        worker.start()
    with open_bank(location) as writer:
        last = [add_toy(writer, seed=i) for i in range(12)][-1]
    stop.set()
    for worker in workers:
        worker.join()
    assert errors == [] and found == [last] * 4
