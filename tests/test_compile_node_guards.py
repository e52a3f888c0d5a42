"""Chorus behind ComfyUI's own TorchCompileModel node, on the CPU (inductor).

Since ComfyUI 0.19 or earlier (not in 0.3.64) that node compiles with a guard filter that drops every guard whose source is
under ``transformer_options`` (``skip_torch_compile_dict``), where Chorus's override finds its
plan. Dynamo then could not tell a Chorus call from a plain one: on an H100 a model compiled and
run without Chorus first ran a later bank hit on its dense graph (a "hit" at the dense time,
no block-sparse call). Each planned call now passes a keyword that names its plan's structure
(``graph_keys``). Expected results come from eager runs; on 0.3.64 (no filter) these pass too.
"""

import pytest
import torch

from chorus_core.attention.mask_provider import DenseWarmupProvider, StaticBlockMapProvider
from test_compile_patch import BLOCK, CLOSE, LAYERS, STEPS, block_maps, hit_provider, layer_stats, sample
from test_compile_patch import dynamo, gpu_like_comfyui_attention  # noqa: F401 (fixtures, one autouse)

pytestmark = pytest.mark.comfy


def compiled_by_the_node(patcher):
    """What a workflow's TorchCompileModel node outputs (backend inductor, its own options)."""
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    output = TorchCompileModel.execute(patcher, "inductor")
    return (output.result if hasattr(output, "result") else output)[0]


def first_layer_only_hit():
    """A hit whose plan has another structure: layer 1 runs dense at every step."""
    maps = {0: block_maps(seed=5, density=0.4)[0]}
    return DenseWarmupProvider(StaticBlockMapProvider([maps], (BLOCK, BLOCK)), 1)


def test_a_hit_after_a_plain_run_of_the_compiled_model_runs_sparse(tiny_wan_patcher, dynamo):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    eager = install_sparse_attention(tiny_wan_patcher, hit_provider(buckets=3))
    expected = sample(eager)
    model = compiled_by_the_node(tiny_wan_patcher)
    sample(model)  # the plain model first: its graph must not serve the hit
    patched = install_sparse_attention(model, hit_provider(buckets=3))

    torch.testing.assert_close(sample(patched), expected, **CLOSE)
    assert get_run_stats(patched).sparse_calls == LAYERS * (STEPS - 1)
    assert layer_stats(patched) == layer_stats(eager)


def test_a_plain_run_after_a_hit_runs_dense(tiny_wan_patcher, dynamo):
    from chorus_core.attention.sparse_patch import install_sparse_attention

    expected = sample(tiny_wan_patcher)
    model = compiled_by_the_node(tiny_wan_patcher)
    sample(install_sparse_attention(model, hit_provider(buckets=1)))

    torch.testing.assert_close(sample(model), expected, **CLOSE)


def test_plans_of_another_structure_get_their_own_graph_and_equal_plans_share_one(tiny_wan_patcher, dynamo):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    expected = sample(install_sparse_attention(tiny_wan_patcher, first_layer_only_hit()))
    model = compiled_by_the_node(tiny_wan_patcher)
    sample(install_sparse_attention(model, hit_provider(buckets=1)))
    graphs_after_first_hit = dynamo["stats"]["unique_graphs"]
    patched = install_sparse_attention(model, first_layer_only_hit())

    torch.testing.assert_close(sample(patched), expected, **CLOSE)
    assert get_run_stats(patched).sparse_calls == STEPS - 1  # layer 0 only
    graphs = dynamo["stats"]["unique_graphs"]
    assert graphs > graphs_after_first_hit
    sample(install_sparse_attention(model, first_layer_only_hit()))  # a new install, as each prompt makes
    assert dynamo["stats"]["unique_graphs"] == graphs


def test_the_graph_keyword_names_the_structure_not_the_mask_values():
    from chorus_core.attention.graph_keys import GRAPH_KWARG_PREFIX, graph_kwarg
    from chorus_core.attention.sparse_run import CallPlan
    from kernels.block_sparse import BlockSparseMask

    def mask(width, fill):
        return BlockSparseMask(torch.full((1, 2, 3, width), fill, dtype=torch.int32),
                               torch.ones(1, 2, 3, dtype=torch.int32), 64, 64, 192)

    def plan(*masks, seq_len=192):
        return CallPlan(seq_len, masks, (None,) * len(masks), torch.sin, None)

    key = graph_kwarg(plan(mask(2, 0), None), {}, None)
    assert key.startswith(GRAPH_KWARG_PREFIX) and key.isidentifier()
    assert graph_kwarg(plan(mask(3, 1), None), {}, None) == key  # other values, other width: one graph
    assert graph_kwarg(plan(None, mask(2, 0)), {}, None) != key
    assert graph_kwarg(plan(mask(2, 0), None, seq_len=256), {}, None) != key
    assert graph_kwarg(plan(mask(2, 0), None), {"optimized_attention_override": torch.cos}, None) != key
