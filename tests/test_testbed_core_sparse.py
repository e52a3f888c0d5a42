"""Core ComfyUI's Model Sparse Attention (Sol-Attn) as a product-path source (issue 50, item 3):
it runs through the harness on the tiny model, its matched arm keeps the hit's density, and our
reproduction computes what comfy-kitchen's eager reference computes."""

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.comfy


def test_core_sparse_rows_run_through_the_product_path_at_the_hit_s_density(comfy_runtime, tmp_path):
    from tests.testbed.product_path import run_product_path, tiny_setup

    patcher, config = tiny_setup(tmp_path)
    # the tiny model's 384 tokens are under the node's min_tokens (12,288): lowered, or core runs dense
    results = run_product_path(patcher, config, tmp_path, 1, 1, log=lambda *_: None, core_only=True,
                               core_min_tokens=0)
    rows = {(r["section"], r["mask_kind"]): r for r in results["rows"]}
    hit = rows[("matched", "reused_similar_product")]
    matched, defaults = rows[("matched", "core_sparse_matched")], rows[("natural", "core_sparse_defaults")]
    assert matched["density"] == pytest.approx(hit["density"], abs=0.02)
    assert matched["sparse_steps"] == config.sample_steps  # sparse from the first step, like the hit
    # at its defaults core runs dense before 20 % of the schedule: the first of 4 steps
    assert defaults["sparse_steps"] == config.sample_steps - 1
    assert defaults["density_whole_run"] > defaults["density"] and defaults["mean_tau"] == pytest.approx(1.3)
    for row in (matched, defaults):  # sparse attention changed the output, and not by much
        assert 0 < row["rel_rms"] < 0.2 and 20 < row["psnr_db"] < float("inf")


def _comfy_kitchen_eager():
    if importlib.util.find_spec("comfy_kitchen") is None:
        if os.environ.get("CHORUS_COMFYUI_VERSION", "0.3.64") != "0.3.64":
            pytest.fail("comfy_kitchen is missing from the newer ComfyUI's environment")
        pytest.skip("comfy_kitchen is installed with the newer ComfyUI only (CHORUS_COMFYUI_VERSION=0.19.3)")
    from comfy_kitchen.backends.eager.sol_attn import sol_attn

    return sol_attn


@pytest.mark.parametrize("tokens", [1024, 1000])  # whole blocks, and a short last block
def test_our_sol_attention_computes_what_comfy_kitchen_s_eager_reference_computes(tokens):
    from tests.testbed.core_sparse import (
        route_tau,
        routing_of,
        sol_attention,
        tau_for_density,
    )

    sol_attn = _comfy_kitchen_eager()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, tokens, 2, 128) for _ in range(3))
    k = k + 0.5 * torch.randn(1, tokens // 8 + 1, 1, 128).repeat_interleave(8, 1)[:, :tokens]  # some structure
    heads_first = [t.permute(0, 2, 1, 3) for t in (q, k, v)]
    routing = routing_of(*heads_first[:2])
    for tau in (1.3, 0.9):  # fixed values: a bisected tau sits on a block's edge, where rounding decides
        routed = route_tau(routing, tau)
        ours = sol_attention(*heads_first, routed, routing).permute(0, 2, 1, 3)
        assert 0.05 < float(routed.float().mean()) < 0.95  # sparse, not dense nor empty
        torch.testing.assert_close(ours, sol_attn(q, k, v, tau=tau), atol=2e-5, rtol=1e-4)
    for density in (0.2, 0.3, 0.5):  # what the matched arm asks of each call
        assert float(route_tau(routing, tau_for_density(routing, density)).float().mean()) == pytest.approx(density, abs=0.01)


def test_core_rows_on_the_kernel_say_plainly_that_they_need_cuda():
    pytest.importorskip("comfy_kitchen")
    from tests.testbed.core_sparse import kernel_attention

    q = torch.zeros(1, 1, 128, 128)
    with pytest.raises(RuntimeError, match="CUDA sol_attn"):
        kernel_attention(q, q, q, 1.3, 256)


def test_hit_only_runs_the_hit_against_dense_with_the_option_it_is_given(comfy_runtime, tmp_path):
    """``--hit-only`` (a CPU-sized run for tests.testbed.option_pairs): the hit's rows and no core
    rows; ``--option attention_precision=int8`` reaches the hit (its output moves off the bf16 hit's)."""
    import json

    from tests.testbed.product_path import main

    def hit_rows(*option) -> list:
        out = tmp_path / (option[-1] if option else "bf16")
        assert main(["--tiny", "--hit-only", *option, "--out", str(out)]) == 0
        return json.loads((out / "product_path.json").read_text())["rows"]

    int8, bf16 = hit_rows("--option", "attention_precision=int8"), hit_rows()
    assert {(r["section"], r["mask_kind"]) for r in int8} == {("matched", "reused_similar_product"),
                                                              ("natural", "reused_similar_product")}
    assert all(20 < r["psnr_db"] < float("inf") for r in int8 + bf16)
    assert [r["psnr_db"] for r in int8] != [r["psnr_db"] for r in bf16]
