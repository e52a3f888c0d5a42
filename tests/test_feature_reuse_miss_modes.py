"""Feature Reuse with every mask source of a real ReuseRun (hit, online, recording, prior) and
its fallbacks, on the tiny Wan2.1-I2V model, in process on the CPU, over a real bank.

Counts come from spies on the kernel's ``block_sparse_attention`` and on the attention
function ComfyUI would run (an override installed before Feature Reuse): every reduced
self-attention is either one sparse kernel call over the reduced tokens or one dense call with
no mask. The dense fallback's exactness is checked against a softmax with the ``log(cell
size)`` bias written out here, with the cell sizes counted from the region map by hand.

Schedule of every generation here: 6 euler steps, 2 layers (both reduced), cond and uncond in
one batch (one self-attention per layer and step), dense warm-up step 0. Feature Reuse runs
steps 3, 4, 5 reduced (start_percent 0.5). The recorder records steps 0, 2 and 4 (the first
and middle step of the buckets (0, 2), (2, 4), (4, 6)), so a recording miss runs step 4 at full
resolution and reduces steps 3 and 5 only.
"""

import logging
import math

import pytest
import torch

from chorus_core.reuse import bank_writer
from chorus_core.guidance.feature_regions import cell_grid
from chorus_core.guidance.feature_reuse import FeatureReuseSettings, install_feature_reuse
from chorus_core.attention.mask_provider import KnownMasks
from chorus_core.guidance.token_layout import TokenLayout

pytestmark = pytest.mark.comfy

GRID = (5, 8, 8)
SEQ_LEN = 320
HEADS = 2
BLOCK = 32
STEPS = 6
CELL = (1, 2, 2)
SETTINGS = FeatureReuseSettings(layers=(0, 1), start_percent=0.5, rim=0)
REDUCED_STEPS = (3, 4, 5)


def region_map():
    """Every other cell column of every frame pooled: 5 x 4 x 2 = 40 cells of 4 tokens."""
    picked = torch.zeros(cell_grid(GRID, CELL), dtype=torch.bool)
    picked[:, :, ::2] = True
    return picked


N_REDUCED = SEQ_LEN - 40 * 3  # 200: 40 cells of 4 tokens each become one token
assert TokenLayout(region_map(), GRID, CELL).n_reduced == N_REDUCED


# --------------------------------------------------------------------------------------------
# Spies
# --------------------------------------------------------------------------------------------


class KernelSpy:
    """Wraps kernels.block_sparse.block_sparse_attention: the (sequence length, mask shape) of
    each call; ``fail_on`` (a sequence length) makes calls of that length raise as a failing
    Triton launch would."""

    def __init__(self, monkeypatch, fail_on=None):
        import kernels.block_sparse as block_sparse

        self.calls, self.masks, self.fail_on = [], [], fail_on
        real = block_sparse.block_sparse_attention

        def spy(q, k, v, mask, heads, skip_reshape=False, skip_output_reshape=False, **kwargs):
            n = q.shape[2] if skip_reshape else q.shape[1]
            self.calls.append((n, mask.n_q_blocks, mask.n_k_blocks))
            self.masks.append(mask)
            if n == self.fail_on:
                raise RuntimeError("triton launch failed (test)")
            return real(q, k, v, mask, heads, skip_reshape, skip_output_reshape, **kwargs)

        monkeypatch.setattr(block_sparse, "block_sparse_attention", spy)

    def count(self, seq_len):
        return sum(1 for n, *_ in self.calls if n == seq_len)


def with_attention_spy(patcher):
    """A clone whose attention goes through a spy first (Feature Reuse chains to it): records
    the (query length, key length, mask) of every self-attention-shaped call ComfyUI runs."""
    seen = []

    def spy(func, *args, **kwargs):
        q, k = args[0], args[1]
        if q.shape[1] in (SEQ_LEN, N_REDUCED) and k.shape[1] in (SEQ_LEN, N_REDUCED):  # not cross-attention
            seen.append((q.shape[1], k.shape[1], kwargs.get("mask")))
        return func(*args, **kwargs)

    clone = patcher.clone()
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = spy
    return clone, seen


# --------------------------------------------------------------------------------------------
# A real ReuseRun over a real bank
# --------------------------------------------------------------------------------------------


def request():
    from chorus_core.testbed.workload import I2VRequest, generate_request, i2v_conditioning

    return i2v_conditioning(generate_request(I2VRequest()))


def match_for(model, bank, threshold):
    from chorus_core.reuse.reuse_match import build_match_request, match_request

    positive, _, latent = request()
    clip = positive[0][1]["clip_vision_output"]
    req = build_match_request(model, clip, positive, latent, None, threshold,
                              {"clip": 0.5, "text": 0.3, "layout": 0.2}, BLOCK)
    return match_request(bank, req)


def generate(model, match, miss_mode="online", record_on_miss=True, on_prepared=None):
    """One ReuseRun generation as the sampler node runs it; returns (latent, run, report, patched
    model): the run holds the patched model weakly, so the caller keeps it.

    ``on_prepared(provider)`` sees the run's mask source as the run begins."""
    import comfy.sample

    from chorus_core.reuse.reuse_run import ReuseOptions, ReusePatch

    # every reduced step sparse after the warm-up (dense_last_steps 0): what these tests count
    options = ReuseOptions(miss_mode=miss_mode, record_on_miss=record_on_miss, min_density=0.2, max_density=0.6,
                           dense_last_steps=0)
    class WatchedPatch(ReusePatch):
        def begin_run(self, sampling, step_callbacks, dense_attention):
            run = super().begin_run(sampling, step_callbacks, dense_attention)
            if on_prepared is not None:
                on_prepared(run.provider)
            return run

    patch = WatchedPatch(model, match, options, block_size=BLOCK, scheduler="simple")
    patched = patch.install()
    positive, negative, latent = request()
    noise = comfy.sample.prepare_noise(latent["samples"], 0)
    out = comfy.sample.sample(patched, noise, STEPS, 5.0, "euler", "simple", positive, negative,
                              latent["samples"], seed=0, disable_pbar=True)
    return out, patch.last_run, patch.last_report, patched


def feature_reuse(patcher):
    return install_feature_reuse(patcher, region_map(), GRID, SETTINGS)


def fr_stats(patched):
    from chorus_core.guidance.feature_reuse import get_feature_reuse_state

    return get_feature_reuse_state(patched).stats


def mask_source(provider):
    while getattr(provider, "inner", None) is not None:
        provider = provider.inner
    return provider


@pytest.fixture()
def bank(tmp_path):
    from chorus_core.bank import MaskBank

    with MaskBank.open(tmp_path / "bank") as opened:
        yield opened


@pytest.fixture()
def recorded(tiny_wan_patcher, bank):
    """A recording miss through Feature Reuse: the entry it wrote, its run and its report."""
    model = feature_reuse(tiny_wan_patcher)
    shown = []

    def watch_recorder(provider):
        recorder = get_recorder(provider)
        real = recorder.record

        def record(layer, step, q, k, heads=None):
            shown.append((step, q.shape[1]))
            return real(layer, step, q, k, heads)

        recorder.record = record

    out, run, report, patched = generate(model, match_for(model, bank, 0.9), on_prepared=watch_recorder)
    assert bank_writer.flush_all(timeout=60)  # the entry is written in the background
    return dict(out=out, run=run, report=report, shown=shown, model=model, patched=patched)


def get_recorder(provider):
    return provider.recorder


# --------------------------------------------------------------------------------------------
# Each mask source runs the reduced steps sparse
# --------------------------------------------------------------------------------------------


def test_online_miss_predicts_on_the_reduced_tokens_and_runs_them_sparse(tiny_wan_patcher, monkeypatch):
    kernel = KernelSpy(monkeypatch)
    observed, predicted = [], []

    def watch_predictor(provider):
        source = mask_source(provider)
        real_observe, real_block_map = source.observe, source.block_map

        def observe(layer, step, cond_or_uncond, q, k, heads, skip_reshape):
            observed.append(("observe", step, q.shape[1]))
            return real_observe(layer, step, cond_or_uncond, q, k, heads, skip_reshape)

        def block_map(layer, step, cond_or_uncond, num_heads, seq_len, device):
            answer = real_block_map(layer, step, cond_or_uncond, num_heads, seq_len, device)
            observed.append(("block_map", step, answer.shape[-1]))
            predicted.append(answer)
            return answer

        source.observe, source.block_map = observe, block_map

    model, attention = with_attention_spy(tiny_wan_patcher)
    out, run, report, patched = generate(feature_reuse(model), None, on_prepared=watch_predictor)
    stats = fr_stats(patched)
    assert report.mode == "miss" and report.mask_source == "online prediction" and run.recording is None
    assert (stats.reduced_calls, stats.sparse_reduced_calls, stats.warnings) == (6, 6, [])
    # the predictor saw each reduced call's q and k (N' = 200 tokens) and answered over its 7 blocks
    nbr = math.ceil(N_REDUCED / BLOCK)
    reduced = [(kind, step, n) for kind, step, n in observed if step in REDUCED_STEPS]
    assert reduced == [item for step in REDUCED_STEPS for _ in range(2)
                       for item in (("observe", step, N_REDUCED), ("block_map", step, nbr))]
    assert kernel.count(N_REDUCED) == 6 and {c for c in kernel.calls if c[0] == N_REDUCED} == {(N_REDUCED, nbr, nbr)}
    # ... and the kernel ran exactly those predictions, not a mapped version of them
    from kernels.block_sparse import mask_to_block_map

    ran = [mask_to_block_map(m) for m in kernel.masks if m.seq_len == N_REDUCED]
    assert all(torch.equal(r, p.expand_as(r)) for r, p in zip(ran, predicted[-6:], strict=True))
    assert kernel.count(SEQ_LEN) == 4  # steps 1 and 2 at full resolution; step 0 is the dense warm-up
    # nothing of the reduced steps reached ComfyUI's attention function
    assert [n for n, _, _ in attention if n == N_REDUCED] == []
    layers = patched.get_attachment("chorus").stats.layers
    assert [(layers[i].sparse_calls, layers[i].dense_calls) for i in (0, 1)] == [(5, 1), (5, 1)]
    assert torch.isfinite(out).all()


def test_a_recording_miss_records_every_step_at_full_resolution(recorded, bank):
    """A bucket's mask averages every one of its steps (masks from some steps only cost up to
    11 dB on the testbed), so a recording miss reduces none of its steps."""
    run, report = recorded["run"], recorded["report"]
    stats = fr_stats(recorded["patched"])
    assert report.mode == "miss" and report.recorded_entry_id and report.warnings == []
    assert (stats.reduced_calls, stats.full_calls, stats.sparse_reduced_calls) == (0, 12, 0)
    assert {step for step, _ in recorded["shown"]} == set(range(6))
    assert {n for _, n in recorded["shown"]} == {SEQ_LEN}
    assert run.recording.recorder.seq_len == SEQ_LEN
    entry = bank.load_masks(report.recorded_entry_id)
    assert entry.shape == (3, 2, HEADS, SEQ_LEN // BLOCK, SEQ_LEN // BLOCK)
    assert all(tuple(entry.block_map(b, layer).shape) == (HEADS, 10, 10) for b in range(3) for layer in range(2))


def test_a_hit_from_the_recorded_entry_runs_every_reduced_step_sparse(tiny_wan_patcher, recorded, bank,
                                                                      monkeypatch):
    kernel = KernelSpy(monkeypatch)
    spied, attention = with_attention_spy(tiny_wan_patcher)
    model = feature_reuse(spied)
    out, run, report, patched = generate(model, match_for(model, bank, 0.9))
    stats = fr_stats(patched)
    assert report.mode == "hit" and report.entry_id == recorded["report"].recorded_entry_id
    assert (stats.reduced_calls, stats.sparse_reduced_calls, stats.warnings) == (6, 6, [])
    nbr = math.ceil(N_REDUCED / BLOCK)
    assert kernel.count(N_REDUCED) == 6 and {c for c in kernel.calls if c[0] == N_REDUCED} == {(N_REDUCED, nbr, nbr)}
    assert [n for n, _, _ in attention if n == N_REDUCED] == []
    assert torch.isfinite(out).all()


def test_prior_miss_runs_every_reduced_step_sparse(recorded, bank, monkeypatch):
    kernel = KernelSpy(monkeypatch)
    model = recorded["model"]
    out, run, report, patched = generate(model, match_for(model, bank, 1.5), miss_mode="prior", record_on_miss=False)
    stats = fr_stats(patched)
    assert report.mode == "miss" and report.mask_source == "population prior of 1 entries"
    assert (stats.reduced_calls, stats.sparse_reduced_calls, stats.warnings) == (6, 6, [])
    assert kernel.count(N_REDUCED) == 6
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------------------------
# The dense fallback: the size bias, exactly, with no float mask
# --------------------------------------------------------------------------------------------


def biased_attention(q, k, v, sizes):
    """softmax(q.k / sqrt(D) + log(size of the key's cell)) v, written out; [B, H, N', D]."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + sizes.log()
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("skip_reshape", [False, True])
def test_repeated_keys_equal_the_size_biased_attention(skip_reshape):
    layout = TokenLayout(region_map(), GRID, CELL)
    # tokens behind each reduced token, counted from the region map by hand: a reduced token
    # that starts a pooled cell (even cell column) stands for 4 tokens
    t, h, w = GRID
    sizes = []
    for frame in range(t):
        for row in range(h):
            for col in range(w):
                cell_col_even = (col // 2) % 2 == 0
                if not cell_col_even:
                    sizes.append(1)
                elif row % 2 == 0 and col % 2 == 0:
                    sizes.append(4)
    sizes = torch.tensor(sizes, dtype=torch.float64)
    assert len(sizes) == N_REDUCED
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, HEADS, N_REDUCED, 16, generator=g, dtype=torch.float64) for _ in range(3))
    expected = biased_attention(q, k, v, sizes)
    if skip_reshape:
        k_full, v_full = layout.expand_keys(k, True), layout.expand_keys(v, True)
        got = torch.nn.functional.scaled_dot_product_attention(q, k_full, v_full)
    else:
        flat = lambda x: x.transpose(1, 2).reshape(2, -1, HEADS * 16)  # noqa: E731
        k_full, v_full = layout.expand_keys(flat(k)), layout.expand_keys(flat(v))
        bhnd = lambda x: x.view(2, -1, HEADS, 16).transpose(1, 2)  # noqa: E731
        got = torch.nn.functional.scaled_dot_product_attention(q, bhnd(k_full), bhnd(v_full))
    assert k_full.shape[2 if skip_reshape else 1] == SEQ_LEN
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sparse", ["none", "dense provider"])
def test_dense_reduced_calls_pass_no_mask(tiny_wan_patcher, sparse):
    from i2v_inputs import sample_request

    from chorus_core.attention.mask_provider import DenseProvider
    from chorus_core.attention.sparse_patch import install_sparse_attention

    model, attention = with_attention_spy(tiny_wan_patcher)
    patched = feature_reuse(model)
    if sparse == "dense provider":
        patched = install_sparse_attention(patched, DenseProvider((BLOCK, BLOCK)))
    sample_request(patched, seed=0, steps=STEPS)
    reduced = [(n, kv, mask) for n, kv, mask in attention if n == N_REDUCED]
    # one per reduced layer and step: N' queries against the N repeated keys, and no mask
    assert reduced == [(N_REDUCED, SEQ_LEN, None)] * 6
    assert fr_stats(patched).sparse_reduced_calls == 0


def test_a_run_whose_sparse_calls_are_all_reduced_names_the_kernel_backend(tiny_wan_patcher):
    from i2v_inputs import sample_request

    from chorus_core.guidance.feature_reuse import FeatureReuseSettings, install_feature_reuse
    from chorus_core.attention.mask_provider import DenseWarmupProvider, StaticBlockMapProvider
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    everywhere = FeatureReuseSettings(layers=(0, 1), start_percent=0.0, rim=0)
    maps = {layer: torch.ones(1, HEADS, SEQ_LEN // BLOCK, SEQ_LEN // BLOCK, dtype=torch.bool) for layer in (0, 1)}
    provider = DenseWarmupProvider(StaticBlockMapProvider.for_all_steps(maps, (BLOCK, BLOCK)), 1)
    patched = install_sparse_attention(install_feature_reuse(tiny_wan_patcher, region_map(), GRID, everywhere),
                                       provider)
    sample_request(patched, seed=0, steps=STEPS)
    stats = fr_stats(patched)
    assert (stats.full_calls, stats.sparse_reduced_calls) == (0, 2 * (STEPS - 1))
    assert get_run_stats(patched).backend == "reference (CPU tensors: the pure-torch reference)"


# --------------------------------------------------------------------------------------------
# Failures on the sparse reduced path cost speed, never the generation
# --------------------------------------------------------------------------------------------


class FailingAt(KnownMasks):
    """A hit-like provider whose maps are fine until ``step``, then ``kind`` goes wrong."""

    def __init__(self, kind, step):
        self.kind, self.step, self.block_size = kind, step, (BLOCK, BLOCK)

    def step_bucket(self, step):
        return step

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device):
        nb = math.ceil(seq_len / BLOCK)
        if step >= self.step and self.kind == "raises":
            raise RuntimeError("mask source broke (test)")
        if step >= self.step and self.kind == "empty rows":
            return torch.zeros(1, num_heads, nb, nb, dtype=torch.bool)
        if step >= self.step and self.kind == "wrong shape":
            return torch.ones(1, num_heads, nb + 1, nb + 1, dtype=torch.bool)
        return torch.ones(1, num_heads, nb, nb, dtype=torch.bool)


FAILURES = {
    "raises": "RuntimeError: mask source broke (test)",
    "empty rows": "ValueError: block-sparse mask has 14 query block(s) with no live key block, first at batch 0, "
                  "head 0, query block 0: every query block needs at least one live key block (keep the diagonal "
                  "block, or fall back to dense attention)",
    "wrong shape": "ValueError: FailingAt returned a block map of shape (1, 2, 11, 11) for layer 0; this call "
                   "needs [*, 2, 10, 10] over the 320 full-resolution tokens or [*, 2, 7, 7] over the 200 reduced ones",
    "kernel": "RuntimeError: triton launch failed (test)",
}
PLAN_FAILURES = {
    "raises": "RuntimeError: mask source broke (test)",
    "wrong shape": "ValueError: block_map must be [B, H, 10, 10] for seq_len=320, blocks 32x32; got (1, 2, 11, 11)",
}


@pytest.mark.parametrize("kind", list(FAILURES))
def test_a_failure_on_the_reduced_path_makes_the_rest_dense_with_one_warning(tiny_wan_patcher, monkeypatch,
                                                                            caplog, kind):
    from i2v_inputs import sample_request

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    KernelSpy(monkeypatch, fail_on=N_REDUCED if kind == "kernel" else None)
    model, attention = with_attention_spy(tiny_wan_patcher)
    provider = FailingAt("raises" if kind == "kernel" else kind, step=4 if kind != "kernel" else 99)
    patched = install_sparse_attention(feature_reuse(model), provider)
    with caplog.at_level(logging.WARNING):
        out = sample_request(patched, seed=0, steps=STEPS)
    assert torch.isfinite(out).all()
    stats = fr_stats(patched)
    step = 3 if kind == "kernel" else 4  # the kernel fails on the first reduced call; the maps at step 4
    if kind in PLAN_FAILURES:  # a hit-like source: its full-size masks are planned before the model call,
        # so the sparse patch meets the failure first and the reduced calls follow it into dense
        assert stats.warnings == []
        assert get_run_stats(patched).warnings == [f"masks unavailable at step 4 ({PLAN_FAILURES[kind]}); the rest "
                                                   "of this run is dense"]
    else:
        assert stats.warnings == [f"sparse attention failed on a reduced call at layer 0, step {step} "
                                  f"({FAILURES[kind]}); the rest of this run's reduced calls are dense"]
        assert [r.getMessage() for r in caplog.records if "feature reuse" in r.getMessage()] == \
            [f"Chorus feature reuse: {stats.warnings[0]}"]
    sparse_before = 0 if kind == "kernel" else 2  # step 3's two reduced calls ran sparse
    assert (stats.reduced_calls, stats.sparse_reduced_calls) == (6, sparse_before)
    # the rest ran dense, size-biased through repeated keys, with no mask
    assert [(n, kv, m) for n, kv, m in attention if n == N_REDUCED] == [(N_REDUCED, SEQ_LEN, None)] * (6 - sparse_before)
    layers = get_run_stats(patched).layers
    assert [(layers[i].sparse_calls, layers[i].dense_calls) for i in (0, 1)] == \
        [(3 + sparse_before // 2, 3 - sparse_before // 2)] * 2
