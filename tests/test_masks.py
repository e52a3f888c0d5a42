"""Block selection, online prediction, recording and the population prior, on CPU-sized problems."""

import math

import pytest
import torch

from chorus_core.attention.masks import MaskRecorder, check_block_map, first_frame_blocks, select_blocks
from chorus_core.attention.online_predictor import block_scores, pool_blocks, predict_block_map
from chorus_core.reuse.population_prior import keep_frequency, population_prior
from chorus_core.quality import mass_recall
from kernels.block_mass import block_mass_reference


def random_mass(*shape, sharpness=3.0, seed=0):
    """Rows that sum to 1 with a few heavy blocks, like trained attention."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * sharpness).softmax(-1)


def kept_mass(mass, block_map):
    return (mass * block_map).sum(-1)


def assert_valid_map(block_map, shape):
    assert block_map.dtype == torch.bool and tuple(block_map.shape) == tuple(shape)
    assert block_map.any(-1).all(), "a query block with no key block"
    check_block_map(block_map, shape[-2], shape[-1])


# ---------------------------------------------------------------- select_blocks


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_selection_reaches_top_p_with_the_fewest_blocks(top_p):
    mass = random_mass(2, 3, 20, 20)
    block_map = select_blocks(mass, top_p=top_p, keep_diagonal=False)
    assert_valid_map(block_map, mass.shape)
    assert (kept_mass(mass, block_map) >= top_p - 1e-6).all()
    # Dropping the lightest kept block of any row would fall below top_p (greedy is minimal).
    lightest = mass.masked_fill(~block_map, torch.inf).amin(-1)
    assert (kept_mass(mass, block_map) - lightest < top_p).all()


def test_selection_by_hand():
    mass = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.0, 1.0]])
    got = select_blocks(mass, top_p=0.8, keep_diagonal=False)
    want = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(got, want)
    # A forced diagonal block goes first and its mass counts towards top_p; ties go to the lower id.
    got = select_blocks(mass, top_p=0.5, keep_diagonal=True)
    want = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 1], [1, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(got, want)


def test_min_and_max_density_clamp_counts():
    mass = random_mass(2, 2, 30, 30, sharpness=6.0)
    loose = select_blocks(mass, top_p=0.5, keep_diagonal=False)
    dense = select_blocks(mass, top_p=0.5, min_density=0.4, keep_diagonal=False)  # >= 12 blocks
    sparse = select_blocks(mass, top_p=0.999, max_density=0.1, keep_diagonal=False)  # <= 3 blocks
    assert loose.sum(-1).min() < 12 and dense.sum(-1).min() >= 12
    assert (sparse.sum(-1) <= 3).all() and (sparse.sum(-1) == 3).any()
    assert (dense & loose).eq(loose).all(), "min_density only adds blocks"


def test_diagonal_and_sinks_always_kept_even_past_max_density():
    mass = torch.zeros(1, 2, 12, 12)
    mass[..., 5] = 1.0  # all mass on one column: top-p alone would keep only it
    block_map = select_blocks(mass, top_p=0.9, max_density=1 / 12, keep_diagonal=True, sink_blocks=[0, 1])
    assert_valid_map(block_map, mass.shape)
    assert block_map[..., torch.arange(12), torch.arange(12)].all()
    assert block_map[..., [0, 1]].all()
    assert int(block_map.sum(-1).max()) == 3, "forced blocks win over max_density, nothing else is added"


def test_every_row_non_empty_at_top_p_zero():
    block_map = select_blocks(random_mass(1, 1, 9, 9), top_p=0.0, keep_diagonal=False)
    assert (block_map.sum(-1) == 1).all()


def test_selection_arguments_are_checked():
    with pytest.raises(ValueError, match="top_p"):
        select_blocks(random_mass(4, 4), top_p=1.5)
    with pytest.raises(ValueError, match="min_density"):
        select_blocks(random_mass(4, 4), min_density=0.6, max_density=0.5)
    with pytest.raises(ValueError, match="sink_blocks"):
        select_blocks(random_mass(4, 4), sink_blocks=[4])


def test_first_frame_blocks():
    assert first_frame_blocks(1560, 128) == list(range(13))  # 480p: 30 x 52 tokens per latent frame


# ---------------------------------------------------------------- online prediction


def test_pool_blocks_ragged_and_strided():
    x = torch.randn(2, 10, 3 * 8).view(2, 10, 3, 8).transpose(1, 2)  # [B, H, N, D] view of [B, N, H*D]
    pooled = pool_blocks(x, 4)
    assert pooled.shape == (2, 3, 3, 8)
    torch.testing.assert_close(pooled[:, :, 1], x[:, :, 4:8].mean(2))
    torch.testing.assert_close(pooled[:, :, 2], x[:, :, 8:].mean(2))


def test_block_scores_exact_for_blockwise_constant_inputs():
    # Q and K constant within each block: pooled scores with the log-count term are the true mass.
    n, bs, d = 44, 16, 8  # last block has 12 tokens
    nb = math.ceil(n / bs)
    qb, kb = torch.randn(1, 2, nb, d) * 2, torch.randn(1, 2, nb, d) * 2
    q, k = qb.repeat_interleave(bs, 2)[:, :, :n], kb.repeat_interleave(bs, 2)[:, :, :n]
    torch.testing.assert_close(block_scores(q, k, block_size=bs), block_mass_reference(q, k, block_size=bs))


def test_predicted_masks_are_valid_kernel_input():
    from kernels.block_sparse import block_map_to_mask

    b, h, n, d, bs = 2, 3, 70, 16, 16
    q = torch.randn(b, n, h * d, dtype=torch.bfloat16)
    k = torch.randn(b, n, h * d, dtype=torch.bfloat16)
    block_map = predict_block_map(q, k, heads=h, block_size=bs, top_p=0.9, max_density=0.4, sink_blocks=[0])
    assert_valid_map(block_map, (b, h, 5, 5))
    assert block_map[..., 0].all() and (block_map.sum(-1) <= 2).all()
    block_map_to_mask(block_map, bs, bs, n).validate()


def test_prediction_reaches_its_own_top_p():
    q, k = torch.randn(1, 2, 96, 16) * 2, torch.randn(1, 2, 96, 16) * 2
    scores = block_scores(q, k, block_size=16)
    block_map = predict_block_map(q, k, block_size=16, top_p=0.8)
    assert (kept_mass(scores, block_map) >= 0.8 - 1e-6).all()


# ---------------------------------------------------------------- recording


def attention_inputs(layer, step, b=2, h=2, n=50, d=16):
    g = torch.Generator().manual_seed(100 * layer + step)
    return (torch.randn(b, h, n, d, generator=g) * 2, torch.randn(b, h, n, d, generator=g) * 2)


def test_recorder_averages_buckets_and_reaches_top_p():
    buckets = [[0, 1], [3]]
    rec = MaskRecorder(num_layers=2, step_buckets=buckets, block_size=16, top_p=0.85, sink_blocks=[0])
    for step in range(5):  # steps 2 and 4 are in no bucket
        for layer in range(2):
            rec.record(layer, step, *attention_inputs(layer, step))
    out = rec.finish()
    assert out.block_maps.shape == (2, 2, 2, 4, 4) and out.recall.shape == (2, 2, 2)
    assert_valid_map(out.block_maps, (2, 2, 2, 4, 4))
    assert out.block_maps[..., 0].all()
    for s, steps in enumerate(buckets):
        for layer in range(2):
            mean = torch.stack([block_mass_reference(*attention_inputs(layer, t), block_size=16).mean(0) for t in steps]).mean(0)
            torch.testing.assert_close(out.block_maps[s, layer], select_blocks(mean, 0.85, sink_blocks=[0]))
            # Selected from that mean: every query block keeps >= top_p of it, so recall does too.
            assert (kept_mass(mean, out.block_maps[s, layer]) >= 0.85 - 1e-6).all()
            torch.testing.assert_close(out.recall[s, layer], mass_recall(mean, out.block_maps[s, layer], 50, 16))
    assert out.mean_recall >= 0.85 - 1e-6


def test_recorder_query_stride_estimates_the_mass():
    rec = MaskRecorder(num_layers=1, step_buckets=[[0]], block_size=16, top_p=0.9, query_stride=4)
    rec.record(0, 0, *attention_inputs(0, 0))
    out = rec.finish()
    sampled = block_mass_reference(*attention_inputs(0, 0), block_size=16, query_stride=4).mean(0)
    assert torch.equal(out.block_maps[0, 0], select_blocks(sampled, 0.9))
    assert_valid_map(out.block_maps, (1, 1, 2, 4, 4))


def test_recorder_comfy_layout_and_missing_layers():
    rec = MaskRecorder(num_layers=2, step_buckets=[[0]], block_size=16)
    q, k = attention_inputs(0, 0)
    comfy = lambda x: x.transpose(1, 2).reshape(2, 50, 32)  # noqa: E731
    rec.record(0, 0, comfy(q), comfy(k), heads=2)
    assert rec.bucket(0) == 0 and rec.bucket(7) is None
    with pytest.raises(ValueError, match="bucket, layer"):
        rec.finish()
    with pytest.raises(ValueError, match="N=50"):
        rec.record(1, 0, *attention_inputs(1, 0, n=40))


# ---------------------------------------------------------------- population prior


def test_population_prior_keeps_the_most_frequent_blocks():
    maps = torch.zeros(3, 1, 4, 6, dtype=torch.bool)
    maps[:, :, :, 5] = True  # kept by all three
    maps[:2, :, :, 4] = True  # by two
    maps[0, :, :, 3] = True  # by one
    torch.testing.assert_close(keep_frequency(list(maps))[0, 0], torch.tensor([0, 0, 0, 1 / 3, 2 / 3, 1.0]))
    prior = population_prior(maps, density=2 / 6, keep_diagonal=False)
    assert prior.shape == (1, 4, 6) and (prior.sum(-1) == 2).all() and prior[..., 4:].all()
    with_diag = population_prior(maps, density=2 / 6)  # the diagonal takes one of the two places
    assert with_diag[0, 0].tolist() == [True, False, False, False, False, True]


def test_population_prior_density_on_random_maps():
    maps = [select_blocks(random_mass(2, 16, 16, seed=s), 0.7) for s in range(5)]
    prior = population_prior(maps, density=0.25, sink_blocks=[0])
    assert_valid_map(prior, (2, 16, 16))
    assert (prior.sum(-1) == 4).all() and prior[..., 0].all()
    assert prior[..., torch.arange(16), torch.arange(16)].all()
