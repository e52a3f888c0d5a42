"""Quality measures against float64 computations written out here, independently of the library."""

import math

import numpy as np
import pytest
import torch

from chorus_core.attention.masks import select_blocks
from chorus_core.quality import attention_recall, psnr, sparse_output_error, ssim


def element_mask(block_map, bs, n):
    """bool [B, H, nq, nk] -> [B, H, N, N], by explicit loops over block pairs."""
    b, h, nq, nk = block_map.shape
    m = torch.zeros(b, h, n, n, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            m[:, :, i * bs : (i + 1) * bs, j * bs : (j + 1) * bs] = block_map[:, :, i, j, None, None]
    return m


def float64_attention(q, k, v, mask=None):
    """Probabilities [B, H, N, N] and outputs [B, H, N, D] in float64."""
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    p = s.softmax(-1)
    return p, p @ v.double()


def random_problem(b=2, h=3, n=53, d=16, bs=16, density=0.4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) * 1.5 for _ in range(3))
    nb = math.ceil(n / bs)
    block_map = torch.rand(b, h, nb, nb, generator=g) < density
    block_map |= torch.eye(nb, dtype=torch.bool)  # no empty rows
    return q, k, v, block_map


def test_recall_matches_float64():
    q, k, v, block_map = random_problem()
    p, _ = float64_attention(q, k, v)
    want = (p * element_mask(block_map, 16, 53)).sum(-1).mean(-1)  # [B, H]
    got = attention_recall(q, k, block_map, block_size=16)
    torch.testing.assert_close(got.per_head.double(), want, rtol=0, atol=1e-6)
    assert got.overall == pytest.approx(float(want.mean()), abs=1e-6)


def test_recall_comfy_layout_and_broadcast_batch():
    q, k, v, block_map = random_problem(b=2)
    one = block_map[:1]
    comfy = lambda x: x.transpose(1, 2).reshape(2, 53, 48)  # noqa: E731
    p, _ = float64_attention(q, k, v)
    want = (p * element_mask(one.expand(2, -1, -1, -1), 16, 53)).sum(-1).mean(-1)
    got = attention_recall(comfy(q), comfy(k), one, heads=3, block_size=16)
    torch.testing.assert_close(got.per_head.double(), want, rtol=0, atol=1e-6)


def test_recall_of_top_p_selection_reaches_top_p():
    q, k, v, _ = random_problem(b=1, n=96, seed=3)
    p, _ = float64_attention(q, k, v)
    mass = torch.stack([p[..., j * 16 : (j + 1) * 16].sum(-1) for j in range(6)], -1)  # [B, H, N, nk]
    mass = mass.unflatten(2, (6, 16)).mean(3)  # [B, H, nq, nk]
    block_map = select_blocks(mass, top_p=0.9)
    assert attention_recall(q, k, block_map, block_size=16).per_head.min() >= 0.9 - 1e-5


def test_output_error_matches_float64():
    q, k, v, block_map = random_problem(seed=1)
    _, dense = float64_attention(q, k, v)
    _, sparse = float64_attention(q, k, v, element_mask(block_map, 16, 53))
    want = ((sparse - dense).square().sum((-1, -2)) / dense.square().sum((-1, -2))).sqrt()
    got = sparse_output_error(q, k, v, block_map, block_size=16)
    torch.testing.assert_close(got.per_head.double(), want, rtol=1e-5, atol=1e-7)
    overall = math.sqrt(float((sparse - dense).square().sum() / dense.square().sum()))
    assert got.overall == pytest.approx(overall, rel=1e-5)


def test_output_error_float64_inputs_is_float64_exact():
    q, k, v, block_map = (x.double() if x.is_floating_point() else x for x in random_problem(b=1, seed=2))
    _, dense = float64_attention(q, k, v)
    _, sparse = float64_attention(q, k, v, element_mask(block_map, 16, 53))
    want = ((sparse - dense).square().sum((-1, -2)) / dense.square().sum((-1, -2))).sqrt()
    torch.testing.assert_close(sparse_output_error(q, k, v, block_map, block_size=16).per_head, want, rtol=1e-10, atol=1e-12)


def test_dense_mask_is_perfect():
    q, k, v, block_map = random_problem(b=1)
    full = torch.ones_like(block_map)
    assert attention_recall(q, k, full, block_size=16).per_head.sub(1).abs().max() < 1e-5
    assert sparse_output_error(q, k, v, full, block_size=16).overall == 0.0


def test_bad_block_map_shape_raises():
    q, k, v, block_map = random_problem(b=1)
    with pytest.raises(ValueError, match="block_map"):
        attention_recall(q, k, block_map[..., :-1], block_size=16)


# ---------------------------------------------------------------- PSNR / SSIM


def latents(seed=0, shape=(2, 4, 3, 9, 10)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def naive_ssim(a, b, window=7, sigma=1.5):
    """Per-sample SSIM by explicit loops over planes and window positions (numpy, float64)."""
    a, b = a.double().numpy(), b.double().numpy()
    x = np.arange(window) - (window - 1) / 2
    g = np.exp(-(x**2) / (2 * sigma**2))
    w = np.outer(g, g) / np.outer(g, g).sum()
    out = []
    for s in range(a.shape[0]):
        r = a[s].max() - a[s].min()
        c1, c2 = (0.01 * r) ** 2, (0.03 * r) ** 2
        vals = []
        for c in range(a.shape[1]):
            for t in range(a.shape[2]):
                for i in range(a.shape[3] - window + 1):
                    for j in range(a.shape[4] - window + 1):
                        pa, pb = a[s, c, t, i : i + window, j : j + window], b[s, c, t, i : i + window, j : j + window]
                        ma, mb = (w * pa).sum(), (w * pb).sum()
                        va, vb = (w * (pa - ma) ** 2).sum(), (w * (pb - mb) ** 2).sum()
                        cov = (w * (pa - ma) * (pb - mb)).sum()
                        vals.append((2 * ma * mb + c1) * (2 * cov + c2) / ((ma**2 + mb**2 + c1) * (va + vb + c2)))
        out.append(np.mean(vals))
    return torch.tensor(out)


def test_identical_latents():
    a = latents()
    assert torch.isinf(psnr(a, a.clone())).all()
    torch.testing.assert_close(ssim(a, a.clone()), torch.ones(2, dtype=torch.float64))


def test_psnr_of_a_constant_offset():
    a = latents()
    r = (a.flatten(1).amax(1) - a.flatten(1).amin(1)).double()
    torch.testing.assert_close(psnr(a, a + 0.1), 20 * torch.log10(r / 0.1))
    torch.testing.assert_close(psnr(a, a + 0.1, data_range=2.0), torch.full((2,), 20 * math.log10(2 / 0.1), dtype=torch.float64))


@pytest.mark.parametrize("kind", ["noise", "offset", "scale"])
def test_ssim_matches_naive_loops(kind):
    a = latents(1)
    b = {"noise": a + 0.3 * latents(2), "offset": a + 0.5, "scale": 0.7 * a}[kind]
    torch.testing.assert_close(ssim(a, b), naive_ssim(a, b), rtol=1e-10, atol=1e-12)


def test_ssim_falls_with_noise():
    a = latents(3)
    values = [float(ssim(a, a + s * latents(4)).mean()) for s in (0.01, 0.1, 1.0)]
    assert 1.0 > values[0] > values[1] > values[2]


def test_latent_shapes_checked():
    with pytest.raises(ValueError, match="B, C, T, H, W"):
        psnr(torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4, 5))
