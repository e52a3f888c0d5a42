"""FP8 attention's error by half of its scheme (tests.testbed.fp8_ablation): per call, each arm's
error against float32 over the same blocks."""

import pytest
import torch

from tests.testbed.fp8_ablation import ARMS, call_errors


def _call(tokens=1000, heads=2, dim=128, sharpness=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, tokens, heads * dim, generator=g) * sharpness
    k = torch.randn(1, tokens, heads * dim, generator=g) + 2.0 * torch.randn(1, 1, heads * dim, generator=g)
    v = torch.randn(1, tokens, heads * dim, generator=g)
    nb = -(-tokens // 128)
    block_map = (torch.rand(heads, nb, nb, generator=g) < 0.3) | torch.eye(nb, dtype=torch.bool)
    return q, k, v, heads, block_map


def test_every_arm_is_measured_and_float16_alone_is_far_smaller_than_fp8():
    errors = call_errors(*_call(), block_size=128)
    assert set(errors) == set(ARMS)
    assert errors["16-bit"] < 0.2 * min(errors["int8 QK only"], errors["e4m3 PV only"])
    assert errors["fp8"] >= 0.9 * max(errors["int8 QK only"], errors["e4m3 PV only"])


def test_sharper_attention_raises_the_int8_qk_halfs_error():
    """Scaling q scales the logits and their quantisation error with them, and the softmax passes
    a logit's error on as a relative error of its weight: QK^T's share grows as attention sharpens."""
    mild, sharp = (call_errors(*_call(sharpness=s), block_size=128) for s in (1.0, 4.0))
    assert sharp["int8 QK only"] > 1.5 * mild["int8 QK only"], (mild, sharp)


@pytest.mark.comfy
def test_a_dense_run_gives_every_step_and_layer_its_errors_at_any_step_count(comfy_runtime):
    """End to end on a random tiny testbed model: the dense run records every call's q, k and v
    (the 10-step presets' step buckets do not stop a 4-step run), and each call gets every arm."""
    from tests.testbed.config import make_config
    from tests.testbed.fp8_ablation import ablate
    from tests.testbed.models import build_model
    from tests.testbed.report import eval_requests

    config = make_config("tiny_sharp", ["sample_steps=3"])  # fewer steps than its buckets (up to 3) name
    torch.manual_seed(0)
    request = eval_requests(config, config.long_size)[0][0]
    result = ablate(build_model(config).eval(), config, request, "cpu", 0.3, log=lambda _: None)
    layers = {c["layer"] for c in result["calls"]}
    assert {(c["step"], c["layer"]) for c in result["calls"]} == {(s, l) for s in range(3) for l in layers}
    assert len(layers) > 1 and set(result["mean_rel_err"]) == set(ARMS)
    assert all(0 < c["16-bit"] < c["fp8"] for c in result["calls"])
