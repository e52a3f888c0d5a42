"""FP8 attention's error by half of its scheme (tests.testbed.fp8_ablation): per call, each arm's
error against float32 over the same blocks."""

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
