"""The population prior takes each step bucket from entries whose buckets cover the same noise
levels: before, it took the newest entry's bucket count and indexed every other entry with
``min(bucket, len - 1)``, mixing an early bucket of one entry with a late one of another."""

import json

import numpy as np
import torch

from bank_fixtures import FP, LAYOUT, SCHEDULE, toy_masks, toy_signature
from chorus_core.bank import MaskBank, Schedule
from chorus_core.reuse.population_prior import population_prior
from chorus_core.reuse.prior_store import load_prior


def add(bank, schedule, masks, seed):
    return bank.add_entry(fingerprint=FP, layout=LAYOUT, schedule=schedule, masks=masks,
                          signature=toy_signature(seed), density=0.3)


def test_a_prior_mixes_only_entries_whose_buckets_cover_the_same_noise_levels(tmp_path):
    bank = MaskBank.open(tmp_path / "bank")
    three = add(bank, SCHEDULE, toy_masks(0), 0)  # 3 buckets of 8 steps
    three_at_4_steps = add(bank, Schedule(steps=4, sampler="uni_pc", scheduler="simple", shift=5.0),
                           toy_masks(1), 1)  # the default split at 4 steps: the same noise levels
    two_masks = toy_masks(2)[:2]
    two = add(bank, Schedule(steps=8, sampler="uni_pc", scheduler="simple", shift=5.0,
                             step_buckets=[(0, 4), (4, 8)]), two_masks, 2)  # the newest: 2 buckets

    prior = load_prior(bank, FP, LAYOUT, 0.05, 0.9)

    assert json.loads(prior._meta["prior_of"]) == [two] and len(prior.step_buckets) == 2
    only = [torch.from_numpy(two_masks[1, 0])]
    assert torch.equal(prior.block_map(1, 0), population_prior(only, only[0].float().mean().item()))

    bank.delete([two])
    prior = load_prior(bank, FP, LAYOUT, 0.05, 0.9)
    assert sorted(json.loads(prior._meta["prior_of"])) == sorted([three, three_at_4_steps])
    assert len(prior.step_buckets) == 3 and np.asarray(prior.block_map_numpy(2, 1)).shape == (2, 8, 8)
