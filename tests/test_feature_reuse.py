"""Feature reuse: token bookkeeping, RoPE of pooled tokens, masks on the reduced layout, the
block patch on the tiny Wan2.1-I2V model (alone and chained with the sparse patch in both
orders) and the node, in process on the CPU.

Expected values never come from the code under test: pooling is checked against explicit
loops over cells, RoPE against ComfyUI's own embedder at fractional positions, reduced block
maps against a brute-force element-level expansion.
"""

import importlib.util
import math
import sys

import pytest
import torch

from chorus_core.guidance.feature_regions import (cell_grid, erode_regions, flops_estimate, region_map_image, seam_measure,
                                         select_regions, token_grid)
from chorus_core.guidance.feature_reuse import (FeatureReuseSettings, apply_feature_reuse, get_feature_reuse_state,
                                       install_feature_reuse)
from chorus_core.guidance.token_layout import TokenLayout
from conftest import REPO_ROOT

GRID = (5, 8, 8)  # tokens of the default 5 x 16 x 16 latent request
SEQ_LEN = 320
BLOCK = 32
STEPS = 3
ALL_LAYERS = FeatureReuseSettings(layers=(0, 1), start_percent=0.0, rim=0)


def random_map(grid, cell, share, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(cell_grid(grid, cell), generator=g) < share


def reference_pool(x, grid, cell, region_map):
    """Explicit loops: the reduced sequence, in raster order of each new token's first token."""
    t, h, w = grid
    ct, ch, cw = cell
    index = torch.arange(t * h * w).view(t, h, w)
    items = []  # (first token, value)
    pooled = set()
    for a, b, c in region_map.nonzero().tolist():
        ids = index[a * ct:(a + 1) * ct, b * ch:(b + 1) * ch, c * cw:(c + 1) * cw].flatten().tolist()
        pooled.update(ids)
        items.append((min(ids), x[:, ids].mean(1)))
    items += [(i, x[:, i]) for i in range(t * h * w) if i not in pooled]
    items.sort(key=lambda item: item[0])
    return torch.stack([v for _, v in items], 1)


# --------------------------------------------------------------------------------------------
# Bookkeeping (no ComfyUI)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cell", [(1, 2, 2), (2, 2, 2), (1, 4, 4)], ids=lambda c: "x".join(map(str, c)))
def test_pool_matches_explicit_cells(cell):
    region_map = random_map(GRID, cell, 0.5)
    layout = TokenLayout(region_map, GRID, cell)
    x = torch.randn(2, SEQ_LEN, 6, dtype=torch.float64)
    expected = reference_pool(x, GRID, cell, region_map)
    assert layout.n_reduced == expected.shape[1] == SEQ_LEN - int(region_map.sum()) * (math.prod(cell) - 1)
    torch.testing.assert_close(layout.pool(x), expected)


def test_nothing_selected_is_the_identity():
    layout = TokenLayout(torch.zeros(cell_grid(GRID, (1, 2, 2)), dtype=torch.bool), GRID, (1, 2, 2))
    x, y = torch.randn(2, 1, SEQ_LEN, 4).unbind(0)
    assert torch.equal(layout.pool(x), x)
    assert torch.equal(layout.restore(x, layout.pool(x), y), x + (y - x))


@pytest.mark.parametrize("blend", [False, True])
def test_restore_keeps_full_resolution_tokens_exact_and_respects_the_map(blend):
    cell = (1, 2, 2)
    region_map = random_map(GRID, cell, 0.4, seed=3)
    layout = TokenLayout(region_map, GRID, cell)
    x = torch.randn(1, SEQ_LEN, 5, dtype=torch.float64)
    x_red = layout.pool(x)
    update = torch.randn_like(x_red)
    y = layout.restore(x, x_red, x_red + update, blend=blend)
    kept = ~layout.pooled
    # tokens outside the map: exactly their own update
    torch.testing.assert_close((y - x)[:, kept], update[:, layout._on("cpu")["inverse"][:kept.sum()]])
    if not blend:  # each pooled token gets its cell's update
        for row, members in enumerate(layout.members):
            position = int((layout.order == kept.sum() + row).nonzero())
            torch.testing.assert_close((y - x)[0, members], update[0, position].expand(len(members), -1))


def test_a_cell_constant_update_survives_blending():
    cell = (1, 2, 2)
    region_map = torch.ones(cell_grid(GRID, cell), dtype=torch.bool)
    layout = TokenLayout(region_map, GRID, cell)
    x = torch.randn(1, SEQ_LEN, 3, dtype=torch.float64)
    constant = torch.full((1, layout.n_reduced, 3), 0.5, dtype=torch.float64)
    y = layout.restore(x, layout.pool(x), layout.pool(x) + constant, blend=True)
    torch.testing.assert_close(y - x, torch.full_like(x, 0.5))


def test_rim_erosion_and_region_selection():
    region_map = torch.zeros(2, 6, 6, dtype=torch.bool)
    region_map[:, 1:5, 1:5] = True
    assert erode_regions(region_map, 1).sum() == 2 * 4  # the 4 x 4 square keeps its 2 x 2 core
    full = torch.ones(1, 4, 4, dtype=torch.bool)
    assert erode_regions(full, 1).all()  # frame edges do not erode
    # a flat start frame with one detailed corner: the detail and its margin are never picked
    start = torch.zeros(1, 16, 1, 16, 16)
    start[..., :4, :4] = torch.randn(16, 1, 4, 4)
    picked = select_regions(start, GRID, 0.5, (1, 2, 2), margin=1, rim=0)
    assert picked.shape == (5, 4, 4) and picked.sum() == 5 * 8
    assert not picked[:, :2, :2].any()
    image = region_map_image(picked, GRID, (1, 2, 2), start)
    assert image.shape == (5, 64, 64, 3) and 0 <= image.min() and image.max() <= 1


def test_reduced_block_map_is_the_least_block_superset():
    cell = (1, 2, 2)
    region_map = random_map(GRID, cell, 0.5, seed=1)
    layout = TokenLayout(region_map, GRID, cell)
    nb = math.ceil(SEQ_LEN / BLOCK)
    block_map = torch.rand(1, 2, nb, nb, generator=torch.Generator().manual_seed(2)) < 0.3
    reduced = layout.map_block_map(block_map, BLOCK, BLOCK)
    nbr = math.ceil(layout.n_reduced / BLOCK)
    assert reduced.shape == (1, 2, nbr, nbr)
    # brute force: full-resolution tokens behind each reduced token, element-level map
    behind = [[i] for i in layout.kept.tolist()] + layout.members.tolist()
    behind = [behind[int(r)] for r in layout.order]
    expected = torch.zeros(1, 2, nbr, nbr, dtype=torch.bool)
    for i, qs in enumerate(behind):
        for j, ks in enumerate(behind):
            live = block_map[:, :, [q // BLOCK for q in qs]][:, :, :, [k // BLOCK for k in ks]].flatten(2).any(-1)
            expected[:, :, i // BLOCK, j // BLOCK] |= live
    assert torch.equal(reduced, expected)


def test_flops_estimate_at_480p():
    est = flops_estimate((21, 30, 52), pooled_token_share=0.5, cell_size=4)
    assert est["N"] == 32760 and est["N_reduced"] == round(32760 * (1 - 0.5 * 0.75))
    assert 0 < est["generation_flops_saved"] < est["attention_share_saved_per_block"] < 1


def test_seam_measure_is_one_for_identical_latents_and_sees_added_edges():
    cell = (1, 2, 2)
    region_map = torch.zeros(cell_grid(GRID, cell), dtype=torch.bool)
    region_map[:, 1:3, 1:3] = True
    dense = torch.randn(1, 16, 5, 16, 16, generator=torch.Generator().manual_seed(0)).cumsum(-1).cumsum(-2)
    assert seam_measure(dense, dense, region_map, cell)["seam_ratio"] == pytest.approx(1.0)
    stepped = dense.clone()
    stepped[..., 4:12, 4:12] += 3.0  # a jump exactly at the region's border
    stepped += 0.01 * torch.randn(stepped.shape, generator=torch.Generator().manual_seed(1))
    measure = seam_measure(dense, stepped, region_map, cell)
    assert measure["seam_ratio"] > 1.5 and measure["seam_excess"] > 10


# --------------------------------------------------------------------------------------------
# RoPE of pooled tokens (ComfyUI's own embedder as the reference)
# --------------------------------------------------------------------------------------------


@pytest.mark.comfy
@pytest.mark.parametrize("cell", [(1, 2, 2), (2, 2, 2), (1, 4, 4)], ids=lambda c: "x".join(map(str, c)))
def test_pooled_tokens_get_rope_of_their_cell_centre(tiny_wan_patcher, cell):
    model = tiny_wan_patcher.model.diffusion_model
    freqs = model.rope_encode(5, 16, 16, dtype=torch.float64)  # [1, N, 1, D/2, 2, 2]
    region_map = random_map(GRID, cell, 0.5, seed=4)
    layout = TokenLayout(region_map, GRID, cell)
    t, h, w = GRID
    positions = torch.stack(torch.meshgrid(*(torch.arange(n, dtype=torch.float64) for n in GRID), indexing="ij"), -1)
    positions = positions.view(-1, 3)
    centre = torch.cat([positions[layout.kept], positions[layout.members].mean(1)])[layout.order]
    expected = model.rope_embedder(centre[None]).movedim(1, 2)
    torch.testing.assert_close(layout.pool_freqs(freqs), expected.to(freqs.dtype), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# The block patch on the tiny model
# --------------------------------------------------------------------------------------------


def request_inputs():
    from chorus_core.testbed.workload import I2VRequest, generate_request

    return I2VRequest(), generate_request(I2VRequest()).first_frame[None]


@pytest.mark.comfy
def test_empty_region_map_gives_the_dense_result(tiny_wan_patcher):
    from i2v_inputs import sample_request

    dense = sample_request(tiny_wan_patcher, seed=1, steps=STEPS)
    empty = torch.zeros(cell_grid(GRID, (1, 2, 2)), dtype=torch.bool)
    patched = install_feature_reuse(tiny_wan_patcher, empty, GRID, ALL_LAYERS)
    assert torch.equal(sample_request(patched, seed=1, steps=STEPS), dense)
    assert get_feature_reuse_state(patched).stats.reduced_calls == 0


@pytest.mark.comfy
def test_selected_regions_run_reduced_and_stay_close(tiny_wan_patcher):
    from i2v_inputs import sample_request

    from chorus_core.quality import psnr

    dense = sample_request(tiny_wan_patcher, seed=1, steps=STEPS)
    region_map = random_map(GRID, (1, 2, 2), 0.5)
    patched = install_feature_reuse(tiny_wan_patcher, region_map, GRID, ALL_LAYERS)
    out = sample_request(patched, seed=1, steps=STEPS)
    stats = get_feature_reuse_state(patched).stats
    assert stats.reduced_calls == STEPS * 2 * 1  # every step and layer; cond+uncond in one batch
    assert stats.tokens_reduced == SEQ_LEN - 3 * int(region_map.sum())
    assert torch.isfinite(out).all() and not torch.equal(out, dense)
    assert psnr(dense, out).item() > 20
    assert tiny_wan_patcher.model_options.get("transformer_options", {}).get("patches_replace") is None


def _sparse(patcher, maps):
    from chorus_core.attention.mask_provider import StaticBlockMapProvider
    from chorus_core.attention.sparse_patch import install_sparse_attention

    return install_sparse_attention(patcher, StaticBlockMapProvider.for_all_steps(maps, (BLOCK, BLOCK)))


@pytest.mark.comfy
def test_chains_with_the_sparse_patch_in_both_orders(tiny_wan_patcher):
    from i2v_inputs import sample_request

    from chorus_core.attention.sparse_patch import get_run_stats

    nb = math.ceil(SEQ_LEN / BLOCK)
    g = torch.Generator().manual_seed(5)
    maps = {layer: (torch.rand(1, 2, nb, nb, generator=g) < 0.3) | torch.eye(nb, dtype=torch.bool) for layer in (0, 1)}
    region_map = random_map(GRID, (1, 2, 2), 0.5)
    settings = FeatureReuseSettings(layers=(1,), start_percent=0.0, rim=0)
    fr_then_sparse = _sparse(install_feature_reuse(tiny_wan_patcher, region_map, GRID, settings), maps)
    sparse_then_fr = install_feature_reuse(_sparse(tiny_wan_patcher, maps), region_map, GRID, settings)
    a = sample_request(fr_then_sparse, seed=2, steps=STEPS)
    b = sample_request(sparse_then_fr, seed=2, steps=STEPS)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for patched in (fr_then_sparse, sparse_then_fr):
        fr, sparse = get_feature_reuse_state(patched).stats, get_run_stats(patched)
        assert fr.reduced_calls == STEPS and fr.sparse_reduced_calls == STEPS
        assert sparse.layers[1].sparse_calls == STEPS and sparse.layers[0].sparse_calls == STEPS  # all counted
    # the reduced layer really ran sparse: all-live maps equal feature reuse alone (no size bias then)
    no_bias = FeatureReuseSettings(layers=(1,), start_percent=0.0, rim=0, size_bias=False)
    alone = sample_request(install_feature_reuse(tiny_wan_patcher, region_map, GRID, no_bias), seed=2, steps=STEPS)
    full_maps = {1: torch.ones(1, 2, nb, nb, dtype=torch.bool)}
    with_all_live = sample_request(_sparse(install_feature_reuse(tiny_wan_patcher, region_map, GRID, no_bias),
                                           full_maps), seed=2, steps=STEPS)
    torch.testing.assert_close(with_all_live, alone, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(a, alone, rtol=1e-4, atol=1e-4)


@pytest.mark.comfy
def test_installing_twice_replaces_and_other_resolutions_pass_through(tiny_wan_patcher):
    from i2v_inputs import sample_request

    from chorus_core.testbed.workload import I2VRequest

    region_map = random_map(GRID, (1, 2, 2), 0.5)
    once = install_feature_reuse(tiny_wan_patcher, region_map, GRID, ALL_LAYERS)
    twice = install_feature_reuse(once, region_map, GRID, ALL_LAYERS)
    patch = twice.model_options["transformer_options"]["patches_replace"]["dit"][("double_block", 0)]
    assert patch.chorus_previous is None
    # a latent of another size: the map does not fit, the run stays at full resolution and says why
    other = I2VRequest(height=8, width=8)
    out = sample_request(twice, seed=0, steps=2, request=other)
    assert torch.equal(out, sample_request(tiny_wan_patcher, seed=0, steps=2, request=other))
    assert "region map was made for 320" in get_feature_reuse_state(twice).stats.skipped_reason


# --------------------------------------------------------------------------------------------
# The node
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node_module(comfy_runtime):
    name = str(REPO_ROOT).replace(".", "_x_") + "_feature_reuse"
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    from importlib import import_module

    return import_module(f"{name}.nodes.feature_reuse_nodes")


@pytest.mark.comfy
def test_node_patches_the_model_and_shows_the_region_map(node_module, tiny_wan_patcher):
    from i2v_inputs import sample_request

    from chorus_core.testbed.workload import generate_request, i2v_conditioning

    node = node_module.ChorusFeatureReuse
    assert node_module.NODES == [node]
    schema = node.define_schema()
    assert schema.node_id == "ChorusFeatureReuse"
    positive, _, latent = i2v_conditioning(generate_request(request_inputs()[0]))
    off_model, off_image = node.execute(tiny_wan_patcher, positive, latent, 0.0, "1x2x2", 0.3, 1.0, 1, True).args
    assert off_model is tiny_wan_patcher and off_image.shape == (5, 64, 64, 3)
    model, image = node.execute(tiny_wan_patcher, positive, latent, 0.8, "1x2x2", 0.0, 1.0, 0, True).args
    assert image.shape == (5, 64, 64, 3) and image.dtype == torch.float32
    state = model.get_attachment("chorus_fr")  # the pack's own copy of chorus_core made it
    assert state.region_map.any() and state.settings.start_percent == 0.0
    sample_request(model, seed=0, steps=2)
    assert state.stats.reduced_calls == 0  # 2-layer model: the default skips the first and last block
    assert node.validate_inputs(start_percent=0.5, end_percent=0.2) is not True
    with pytest.raises(ValueError, match="start frame"):
        node.execute(tiny_wan_patcher, [[torch.zeros(1, 4, 8), {}]], latent, 0.5, "1x2x2", 0.3, 1.0, 1, True)


@pytest.mark.comfy
def test_apply_feature_reuse_refuses_a_non_video_latent(tiny_wan_patcher):
    with pytest.raises(ValueError, match="video latent"):
        apply_feature_reuse(tiny_wan_patcher, torch.zeros(1, 4, 8, 8), None, 0.5)
    assert token_grid((1, 16, 5, 16, 16)) == GRID


@pytest.mark.comfy
def test_reduced_calls_follow_the_runs_attention_precision(tiny_wan_patcher, monkeypatch):
    """With attention_precision "fp8" the reduced layer's block-sparse calls go to the FP8 dispatch
    too (on these CPU tensors, the scheme's reference), not to the 16-bit one."""
    from i2v_inputs import sample_request

    import kernels.fp8_block_sparse as fp8
    from chorus_core.attention.mask_provider import StaticBlockMapProvider
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    nb = math.ceil(SEQ_LEN / BLOCK)
    g = torch.Generator().manual_seed(5)
    maps = {layer: (torch.rand(1, 2, nb, nb, generator=g) < 0.3) | torch.eye(nb, dtype=torch.bool) for layer in (0, 1)}
    seen = []
    real = fp8.fp8_block_sparse_attention

    def counted(q, *args, **kwargs):
        seen.append(q.shape[-2] if q.dim() == 4 else q.shape[1])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(fp8, "fp8_block_sparse_attention", counted)
    settings = FeatureReuseSettings(layers=(1,), start_percent=0.0, rim=0)
    region_map = random_map(GRID, (1, 2, 2), 0.5)
    sparse = install_sparse_attention(tiny_wan_patcher, StaticBlockMapProvider.for_all_steps(maps, (BLOCK, BLOCK)),
                                      attention_precision="fp8")
    patched = install_feature_reuse(sparse, region_map, GRID, settings)
    sample_request(patched, seed=2, steps=STEPS)
    reduced = SEQ_LEN - 3 * int(region_map.sum())
    assert get_feature_reuse_state(patched).stats.sparse_reduced_calls == STEPS
    assert seen.count(reduced) == STEPS and seen.count(SEQ_LEN) == STEPS  # layer 1 reduced, layer 0 whole
    assert get_run_stats(patched).backend.startswith("reference_fp8")
