"""The budget seen from a generation (tiny Wan2.1-I2V model, in process, CPU): a write that evicts puts a
line in the report, and a hit whose entry is evicted while its worker reads it runs as a miss."""

import pytest
import torch
from test_reuse_loop import bank_with_entry, match_for, request, run_generation  # noqa: F401  (fixture)

pytestmark = pytest.mark.comfy


def test_a_write_that_evicts_puts_a_line_in_a_report(tmp_path, tiny_wan_patcher):
    from chorus_core.bank import MaskBank
    from chorus_core.reuse import bank_writer

    positive, _, latent = request()
    other_positive, _, other_latent = request(subject=3, template="orbit")
    with MaskBank.open(tmp_path / "bank") as bank:
        bank.set_budget(max_entries=1)
        _, first, _ = run_generation(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, other_positive, other_latent,
                                                                 threshold=0.999))
        assert first.mode == "miss" and bank_writer.flush_all(timeout=60)
        assert first.evictions == []  # its write found room
        _, second, _ = run_generation(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent,
                                                                  threshold=0.999))
        assert second.mode == "miss" and bank_writer.flush_all(timeout=60)
        _, third, _ = run_generation(tiny_wan_patcher, match_for(bank, tiny_wan_patcher, positive, latent))
        assert third.mode == "hit" and third.entry_id == second.recorded_entry_id
        assert [r["id"] for r in bank.entries()] == [second.recorded_entry_id]
    # the second run's write may finish before or after its own report: one of the two reports says it
    (eviction,) = second.evictions + third.evictions
    assert eviction["entry_ids"] == [first.recorded_entry_id] and eviction["written"] == second.recorded_entry_id
    assert eviction["line"].startswith(f"bank budget: writing entry {second.recorded_entry_id[:8]} evicted 1 entry (")
    assert eviction["line"].endswith("freed) to stay within 1 entries") and eviction["bytes_freed"] > 0


def test_a_hit_whose_entry_is_evicted_while_its_worker_reads_it_runs_as_a_miss(bank_with_entry, tiny_wan_patcher,
                                                                               monkeypatch):
    from bank_fixtures import add_toy

    from chorus_core.bank import sqlite_store
    from chorus_core.reuse import bank_writer

    bank, _ = bank_with_entry
    positive, _, latent = request()
    match = match_for(bank, tiny_wan_patcher, positive, latent)
    assert match.result.hit
    real_read_blob, evicted = sqlite_store.SQLiteBank._read_blob, []

    def evicted_before_the_blob_is_read(self, sha, size):  # the worker has the row, another writer evicts
        if not evicted:
            with self.reopen() as writer:
                writer.set_budget(max_entries=1)
                evicted.append(add_toy(writer, seed=5))
        return real_read_blob(self, sha, size)

    monkeypatch.setattr(sqlite_store.SQLiteBank, "_read_blob", evicted_before_the_blob_is_read)
    out, report, _ = run_generation(tiny_wan_patcher, match)
    monkeypatch.undo()
    assert evicted and not bank.has_entry(match.result.entry_id)
    assert report.mode == "miss" and report.mask_source.startswith("online prediction"), report.warnings
    assert any("removed or quarantined it while it was being read" in w for w in report.warnings)
    assert torch.isfinite(out).all()
    assert bank_writer.flush_all(timeout=60)
    bank.set_budget()  # the stored budget stays with this test's bank
