"""A large import never holds the bank's write lock for long: each entry goes in in a transaction
of its own, so a recording or a prune in another process waits at most one entry's time."""

import threading
import time

import pytest

from bank_fixtures import add_toy
from bank_pg_cluster import location, pg  # noqa: F401  (fixtures: a folder, or a PostgreSQL schema)
from chorus_core.bank import MaskBank

SLOW_ROW_S = 0.4  # each imported row's work under the lock, slowed down (a 720p blob re-read)


def test_a_recording_waits_one_entry_not_the_whole_import(tmp_path, location, monkeypatch):
    source = MaskBank.open(tmp_path / "source")
    ids = [add_toy(source, seed=s) for s in range(6)]
    source.export(tmp_path / "six.tar")
    importer, recorder = MaskBank.open(location), MaskBank.open(location)
    real = type(importer)._import_row

    def slow_import_row(self, row, read_data):
        time.sleep(SLOW_ROW_S)
        return real(self, row, read_data)

    monkeypatch.setattr(type(importer), "_import_row", slow_import_row)
    result = {}
    importing = threading.Thread(target=lambda: result.update(importer.import_file(tmp_path / "six.tar")))
    importing.start()
    time.sleep(SLOW_ROW_S / 2)  # the first row's transaction is open now
    started = time.monotonic()
    recorded = add_toy(recorder, seed=99)
    waited = time.monotonic() - started
    importing.join(60)

    assert result == {"added": 6, "skipped": 0}
    assert waited < 3 * SLOW_ROW_S  # the whole import holds the lock for 6 x 0.4 s
    assert sorted(r["id"] for r in recorder.entries()) == sorted(ids + [recorded])
    assert importer.import_file(tmp_path / "six.tar") == {"added": 0, "skipped": 6}
