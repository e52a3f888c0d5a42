"""The reuse loop on a PostgreSQL bank (a fleet's shared bank), in process on the CPU.

A recording miss is written by the background writer on a connection of its own, a similar
request then hits it, and prior mode serves the population prior from memory (a PostgreSQL
bank has no folder for it).
"""


import pytest
from bank_pg_cluster import PASSWORD, running_cluster
from test_reuse_loop import match_for, request, run_generation

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def pg():
    yield from running_cluster()


def test_a_miss_recorded_into_postgres_is_hit_next_and_serves_the_prior(pg, tiny_wan_patcher):
    from chorus_core.reuse import bank_writer
    from chorus_core.bank import MaskBank
    from chorus_core.reuse.reuse_run import ReuseOptions

    bank = MaskBank.open(pg.url("reuse_loop"))
    try:
        positive, _, latent = request()
        _, first, _ = run_generation(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent))
        assert first.mode == "miss" and first.recording == "queued"
        assert bank_writer.flush_all(timeout=60)
        assert bank_writer.default_writer().outcome(first.recorded_entry_id).error is None
        assert [e["id"] for e in bank.entries()] == [first.recorded_entry_id]

        _, second, _ = run_generation(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent))
        assert second.mode == "hit" and second.entry_id == first.recorded_entry_id and second.warnings == []

        other_positive, _, other_latent = request(subject=3, template="orbit")
        miss = match_for(bank, tiny_wan_patcher, other_positive, other_latent, threshold=0.9999)
        _, prior, run = run_generation(tiny_wan_patcher, miss,
                                       ReuseOptions(dense_warmup_steps=1, miss_mode="prior", record_on_miss=False))
        assert prior.mask_source == "population prior of 1 entries" and prior.warnings == []
        assert all(row["sparse_share"] > 0 for row in prior.layers)
        assert PASSWORD not in str(first.to_json()) + str(second.to_json()) + str(prior.to_json())
    finally:
        bank.close()


def test_a_postgres_recording_spools_on_this_machine_and_a_leftover_replays_once(pg, tiny_wan_patcher, tmp_path,
                                                                                monkeypatch):
    """A server bank has no folder: its spool is local (CHORUS_SPOOL_ROOT; ComfyUI: beside its folder
    banks), one folder per bank; what a stopped worker left there goes in once, whoever replays it."""
    from chorus_core.bank import MaskBank, spool
    from chorus_core.reuse import bank_writer
    from test_bank_spool import recording

    monkeypatch.setenv(spool.SPOOL_ROOT_ENV, str(tmp_path))
    bank = MaskBank.open(pg.url("spool_pg"))
    try:
        positive, _, latent = request()
        _, first, _ = run_generation(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent))
        assert first.recording == "queued" and bank_writer.flush_all(timeout=60)
        folder = spool.spool_folder(bank)
        assert folder.parent == tmp_path and folder.is_dir() and spool.pending_files(folder) == []

        left = recording(seed=4)
        spool.write_spool(folder, left)  # as a worker stopped by SIGKILL leaves it
        with MaskBank.open(pg.url("spool_pg")) as other_worker:
            assert spool.replay_spool(other_worker)["added"] == [left.entry_id]
        assert spool.replay_spool(bank)["added"] == []
        assert sorted(e["id"] for e in bank.entries()) == sorted([first.recorded_entry_id, left.entry_id])
    finally:
        bank.close()


def test_a_server_that_stops_answering_makes_the_match_a_miss_within_the_bound(pg, tiny_wan_patcher, monkeypatch):
    """The bank connection's server process is stopped (SIGSTOP: its kernel still acknowledges, so
    neither TCP keepalives nor the server's statement_timeout can help): the lookup gives up. The
    counters are made stale, so the match must ask the server (a match within a second of the last
    read, with no notification since, is answered from memory and never reaches it)."""
    import os
    import signal
    import time

    from chorus_core.bank import MaskBank, pg_store
    from chorus_core.reuse import reuse_match

    monkeypatch.setattr(reuse_match, "SERVER_ANSWER_S", 2.0)
    monkeypatch.setattr(pg_store, "COUNTERS_MAX_AGE_S", 0.0)
    bank = MaskBank.open(pg.url("stalled"))
    positive, _, latent = request()
    request_only = match_for(bank, tiny_wan_patcher, positive, latent).request  # fingerprinting is not timed
    backend = bank.db.query("SELECT pg_backend_pid() AS pid")[0]["pid"]
    os.kill(backend, signal.SIGSTOP)
    try:
        started = time.monotonic()
        match = reuse_match.match_request(bank, request_only)
        took = time.monotonic() - started
    finally:
        os.kill(backend, signal.SIGCONT)
    assert not match.result.hit and took < 6
    assert "runs as a miss" in match.warning and "did not answer within 2 s" in match.warning
    bank.close()


def test_a_prior_miss_whose_server_stops_answering_predicts_online_within_the_bound(pg, tiny_wan_patcher, monkeypatch):
    """The sampling thread's own bank reads (the prior's compatible entries) are bounded too."""
    import os
    import signal

    from chorus_core.bank import MaskBank
    from chorus_core.reuse import reuse_match
    from chorus_core.reuse.reuse_run import ReuseOptions

    monkeypatch.setattr(reuse_match, "SERVER_ANSWER_S", 2.0)
    bank = MaskBank.open(pg.url("stalled_prior"))
    positive, _, latent = request()
    match = match_for(bank, tiny_wan_patcher, positive, latent, threshold=0.9999)
    backend = bank.db.query("SELECT pg_backend_pid() AS pid")[0]["pid"]
    os.kill(backend, signal.SIGSTOP)
    try:
        _, report, _ = run_generation(tiny_wan_patcher, match,
                                      ReuseOptions(dense_warmup_steps=1, miss_mode="prior", record_on_miss=False))
    finally:
        os.kill(backend, signal.SIGCONT)
    assert report.mode == "miss" and report.mask_source.startswith("online")
    assert any("did not answer within 2 s" in w for w in report.warnings), report.warnings
    bank.close()
