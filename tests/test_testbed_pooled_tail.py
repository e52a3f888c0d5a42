"""The hit's masks with Sol-Attn's pooled tail (tests.testbed.pooled_tail, an experiment): exact
where nothing is dropped, nearer dense than dropping where blocks are, and a product-path row."""

import math

import pytest
import torch

from tests.testbed.pooled_tail import FORMS, parse_forms, pooled_tail_attention


def _qkv(tokens: int, heads: int = 2, dim: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, heads, tokens, dim) for _ in range(3))
    # keys in runs of 16 alike: blocks with a mean worth pooling, as a trained model's are
    k = k + 0.8 * torch.randn(1, 1, tokens // 16 + 1, dim).repeat_interleave(16, 2)[:, :, :tokens]
    return q, k, v


def _random_mask(heads: int, n: int, density: float, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(heads, n, n, generator=g) < density) | torch.eye(n, dtype=torch.bool)  # diagonal, as a hit's


def _rms(x, ref) -> float:
    return float((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


@pytest.mark.parametrize("tokens", [1024, 1000])  # whole blocks, and a short last block
@pytest.mark.parametrize("form", FORMS)
def test_with_every_block_kept_it_is_dense_attention(tokens, form):
    q, k, v = _qkv(tokens)
    kept = torch.ones(2, math.ceil(tokens / 128), math.ceil(tokens / 128), dtype=torch.bool)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(pooled_tail_attention(q, k, v, kept, 128, form), dense, atol=1e-5, rtol=0)


def test_with_no_block_dropped_there_is_no_pooled_term():
    q, k, v = _qkv(1000)
    kept = torch.ones(2, 8, 8, dtype=torch.bool)
    plain = pooled_tail_attention(q, k, v, kept, 128, "none")
    for form in ("centroid", "rows"):  # bit for bit: the softmax had no extra column
        assert torch.equal(pooled_tail_attention(q, k, v, kept, 128, form), plain)


@pytest.mark.parametrize("density", [0.15, 0.3, 0.6])
def test_the_tail_brings_a_sparse_mask_nearer_dense_than_dropping(density):
    q, k, v = _qkv(2048)
    kept = _random_mask(2, 16, density)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    dropped = _rms(pooled_tail_attention(q, k, v, kept, 128, "none"), dense)
    centroid = _rms(pooled_tail_attention(q, k, v, kept, 128, "centroid"), dense)
    rows = _rms(pooled_tail_attention(q, k, v, kept, 128, "rows"), dense)
    assert centroid < 0.8 * dropped and rows < 0.8 * dropped
    assert rows <= centroid * 1.05  # each row's own logit is at least as good as its block's centroid


def test_dropping_is_block_sparse_attention_as_the_hit_computes_it():
    from kernels.block_sparse import block_map_to_mask, block_sparse_attention_reference

    q, k, v = _qkv(1000)
    kept = _random_mask(2, 8, 0.3)
    ref = block_sparse_attention_reference(q, k, v, block_map_to_mask(kept[None], 128, 128, 1000), 2, skip_reshape=True,
                                           skip_output_reshape=True)
    torch.testing.assert_close(pooled_tail_attention(q, k, v, kept, 128, "none"), ref, atol=1e-5, rtol=0)


def test_forms_are_parsed_or_refused():
    assert parse_forms("centroid, rows") == ("centroid", "rows")
    with pytest.raises(ValueError, match="--hit-pooled-tail"):
        parse_forms("mean")


@pytest.mark.comfy
def test_the_product_path_adds_the_hit_with_its_tail_next_to_the_hit(comfy_runtime, tmp_path):
    from tests.testbed.product_path import run_product_path, tiny_setup

    patcher, config = tiny_setup(tmp_path)
    finals = {}
    results = run_product_path(patcher, config, tmp_path, 1, 1, log=lambda *_: None, core_only=True, core_min_tokens=0,
                               hit_pooled_tail=("centroid", "none"), finals=finals)
    rows = {r["mask_kind"]: r for r in results["rows"] if r["section"] == "matched"}
    hit, tail = rows["reused_similar_product"], rows["reused_similar_pooled_tail"]
    assert tail["density"] == hit["density"] and tail["pooled_form"] == "centroid"
    # no tail: the hit's own run again, so the tail row's difference from the hit is the tail alone
    (replayed,) = [f for key, f in finals.items() if key[1] == "reused_similar_replayed"]
    (served,) = [f for key, f in finals.items() if key[:2] == ("matched", "reused_similar_product")]
    assert _rms(replayed, served) < 1e-5
    assert tail["rel_rms"] < hit["rel_rms"]  # the tail moved the run towards dense
