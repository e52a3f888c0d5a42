"""A received bank's ``priors/`` is untrusted: a prior is held against the model and layout as an
entry is, and nothing reaches the kernel's unchecked path (``assume_valid``) with block ids beyond
the run's sequence, whatever its source.

Hostile priors: more key blocks than the sequence has, another head count, another layout, a
header that lies. On the CPU the kernel runs in Triton's interpreter (conftest sets
TRITON_INTERPRET) and the reference; the generation test below runs whichever the CPU path picks.
"""

import json

import numpy as np
import pytest
from safetensors.numpy import save as st_save

from bank_fixtures import FP, LAYOUT
from chorus_core.bank import LatentLayout, encode_masks
from chorus_core.reuse.prior_store import PRIORS_DIR, load_prior, prior_key
from test_bank_hostile import new_bank

HOSTILE = {
    "too_many_key_blocks": dict(shape=(3, 2, 2, 8, 16)),
    "too_many_heads": dict(shape=(3, 2, 3, 8, 8)),
    "too_few_layers": dict(shape=(3, 1, 2, 8, 8)),
    "another_layout": dict(shape=(3, 2, 2, 8, 8), layout=LatentLayout(grid=(2, 8, 16), block_size=(16, 64))),
    "shape_that_lies": dict(shape=(3, 2, 2, 8, 16), claim="3,2,2,8,8"),
}


def plant_prior(bank, fingerprint, layout, shape, claim=None, stated_layout=None, min_d=0.05, max_d=0.5):
    """A prior file under the name load_prior reads, with masks of ``shape`` (diagonal kept)."""
    maps = np.random.default_rng(0).random(shape) < 0.3
    for index in np.ndindex(*shape[:3]):
        np.fill_diagonal(maps[index], True)
    tensors, meta = encode_masks(maps)
    schedule = {"steps": 8, "sampler": "uni_pc", "scheduler": "simple", "shift": 5.0,
                "step_buckets": [[0, 2], [2, 5], [5, 8]][:shape[0]], "sigmas": None}
    meta.update(prior_of="[]", schedule=json.dumps(schedule),
                layout=json.dumps((stated_layout or layout).to_dict()), **({"shape": claim} if claim else {}))
    folder = bank.root / PRIORS_DIR
    folder.mkdir(exist_ok=True)
    path = folder / f"{prior_key(bank, fingerprint, layout, min_d, max_d)}.safetensors"
    path.write_bytes(st_save(tensors, metadata={"chorus": json.dumps(meta, sort_keys=True)}))
    return path


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_prior_file_is_never_served_and_the_prior_is_built_again(tmp_path, case):
    bank, _ = new_bank(tmp_path, n=2)
    spec = HOSTILE[case]
    path = plant_prior(bank, FP, LAYOUT, spec["shape"], spec.get("claim"), spec.get("layout"))

    prior = load_prior(bank, FP, LAYOUT, 0.05, 0.5)

    assert prior.shape == (3, 2, 2, 8, 8) and prior.layout == LAYOUT  # FP's layers and heads, LAYOUT's blocks
    assert prior.block_map_numpy(2, 1).shape == (2, 8, 8)
    header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    assert json.loads(header["__metadata__"]["chorus"])["shape"] == "3,2,2,8,8"  # replaced by the rebuilt one


def test_masks_with_more_key_blocks_than_the_sequence_never_reach_assume_valid():
    """Whatever the source (entry, prior, a bug): the upload checks blocks against the run's sequence."""
    from chorus_core.reuse.entry_prefetch import HostLayer

    maps = np.zeros((2, 8, 16), dtype=bool)
    maps[..., 15] = True  # key block 15: the run's 128 tokens in blocks of 16 have 8
    host = HostLayer.from_packed(np.packbits(maps, axis=-1), 16, pin=False)
    with pytest.raises(ValueError, match="16 key blocks; this run's 128 tokens make 8 and 8"):
        host.to_device(16, (16, 16), 128, "cpu")
    fewer = HostLayer.from_packed(np.packbits(maps[:, :4], axis=-1), 16, pin=False)
    with pytest.raises(ValueError, match="4 query and 16 key blocks"):
        fewer.to_device(16, (16, 16), 128, "cpu")


@pytest.mark.comfy
@pytest.mark.parametrize("case", ["too_many_key_blocks", "shape_that_lies"])
def test_a_prior_mode_miss_with_a_hostile_prior_in_a_received_bank_runs_on_the_rebuilt_prior(
        bank_with_entry, tiny_wan_patcher, case):
    from chorus_core.reuse.reuse_run import ReuseOptions
    from test_reuse_loop import match_for, request, run_generation

    bank, _ = bank_with_entry
    positive, _, latent = request(subject=3, template="orbit")
    match = match_for(bank, tiny_wan_patcher, positive, latent, threshold=0.9999)
    req = match.request
    nq, nk = req.layout.blocks
    layers, heads = req.fingerprint.layers, req.fingerprint.heads
    shape = (3, layers, heads, nq, 2 * nk)
    claim = ",".join(map(str, (3, layers, heads, nq, nk))) if case == "shape_that_lies" else None
    plant_prior(bank, req.fingerprint, req.layout, shape, claim, min_d=0.1, max_d=0.6)

    _, report, _ = run_generation(tiny_wan_patcher, match, ReuseOptions(dense_warmup_steps=1, miss_mode="prior",
                                                                        record_on_miss=False, min_density=0.1,
                                                                        max_density=0.6))

    assert report.mode == "miss" and report.mask_source == "population prior of 1 entries"
    assert report.warnings == [] and all(row["sparse_share"] > 0 for row in report.layers)


from test_reuse_loop import bank_with_entry  # noqa: E402,F401  (the fixture)
