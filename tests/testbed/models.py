"""The testbed model and its inputs: ComfyUI's own ``WanModel`` (I2V) fed as ComfyUI feeds it.

``model_inputs`` builds the 36 input channels exactly as ComfyUI's ``WAN21.concat_cond`` and
``BaseModel._apply_model`` do: ``[noisy latent (16), mask (4), condition latent (16)]``, where
the mask is ``1 - concat_mask`` (1 on the first latent frame, 0 elsewhere) and the condition is
``Wan21.process_in`` of the concat latent (the first frame, zeros elsewhere, then normalised,
so the zero frames become ``-mean / std``). Latents in model space are ``process_in`` of the
workload's latents, as ComfyUI's sampler sees them.

``AttentionHook`` is a direct ``optimized_attention_override`` (no ModelPatcher): it counts the
self-attention calls of one forward to know the layer, and per call can record block mass,
online block scores and q/k/v, or run block-sparse attention with a given block map.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from chorus_core._siblings import import_sibling
from chorus_core.testbed.tiny_wan import TinyWanConfig, build_tiny_wan_i2v
from chorus_core.testbed.workload import I2VRequest, generate_request

# comfy.latent_formats.Wan21 (kept here so data preparation needs no ComfyUI import)
WAN21_MEAN = torch.tensor([-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                           0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921])
WAN21_STD = torch.tensor([2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                          3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160])


def process_in(latent: torch.Tensor) -> torch.Tensor:
    """Wan21 latent format ``process_in`` on ``[..., 16, T, H, W]`` (channel dim = -4)."""
    shape = (16, 1, 1, 1)
    return (latent - WAN21_MEAN.view(shape).to(latent)) / WAN21_STD.view(shape).to(latent)


def is_qk_gain(name: str) -> bool:
    """The self-attention q/k RMSNorm gains: together they set the attention temperature."""
    return ".self_attn.norm_q." in name or ".self_attn.norm_k." in name


def build_model(config) -> torch.nn.Module:
    model = build_tiny_wan_i2v(TinyWanConfig(dim=config.dim, ffn_dim=config.ffn_dim,
                                             num_layers=config.num_layers, seed=config.model_seed,
                                             head_dim=config.head_dim))
    if config.qk_gain_init != 1.0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if is_qk_gain(name):
                    param.fill_(config.qk_gain_init)
    return model


@dataclass
class Batch:
    x0: torch.Tensor      # [B, 16, T, H, W] target latent in model space
    cond: torch.Tensor    # [B, 20, T, H, W] mask (4) + condition latent (16), as concat_cond makes it
    clip: torch.Tensor    # [B, 257, 1280]
    text: torch.Tensor    # [B, L, 4096]

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device, non_blocking=True) for t in (self.x0, self.cond, self.clip, self.text)))

    def __len__(self):
        return self.x0.shape[0]

    def select(self, idx) -> "Batch":
        return Batch(self.x0[idx], self.cond[idx], self.clip[idx], self.text[idx])


def request_example(request: I2VRequest) -> tuple:
    """One request -> (x0, cond, clip, text) tensors in model space (no batch dim)."""
    t = generate_request(request)
    x0 = process_in(t.video)
    concat = torch.zeros_like(t.video)
    concat[:, :1] = t.first_frame
    concat = process_in(concat)
    mask = torch.zeros(4, *t.video.shape[1:])
    mask[:, :1] = 1.0  # 1 - concat_mask: the given first frame
    return x0, torch.cat([mask, concat]), t.clip_vision, t.text


def _example_worker(request):
    torch.set_num_threads(1)
    return request_example(request)


def make_batch(requests: Sequence[I2VRequest], workers: int = 1) -> Batch:
    if workers > 1 and len(requests) > 4:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(workers) as pool:
            parts = pool.map(_example_worker, list(requests), chunksize=max(1, len(requests) // (4 * workers)))
    else:
        parts = [request_example(r) for r in requests]
    return Batch(*(torch.stack([p[i] for p in parts]) for i in range(4)))


def shifted(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Flow-matching time shift (as ComfyUI's ModelSamplingDiscreteFlow): t' = s t / (1 + (s - 1) t)."""
    return shift * u / (1 + (shift - 1) * u)


def predict_velocity(model, x_t: torch.Tensor, sigma: torch.Tensor, batch: Batch,
                     transformer_options: Optional[dict] = None) -> torch.Tensor:
    """The model's output (velocity noise - x0) for x_t at sigma ``[B]``; timestep = 1000 sigma."""
    x_in = torch.cat([x_t, batch.cond.to(x_t.dtype)], dim=1)
    with comfy_training(torch.is_grad_enabled()):
        return model(x_in, sigma * 1000.0, batch.text, clip_fea=batch.clip,
                     transformer_options=transformer_options if transformer_options is not None else {})


@contextlib.contextmanager
def comfy_training(enabled: bool):
    """ComfyUI's training flag while a forward that will be differentiated runs.

    ComfyUI 0.19 applies rope through comfy-kitchen kernels that have no backward; it takes its
    pure-torch path when ``comfy.model_management.in_training`` is set, as its own training nodes do.
    Older ComfyUI has no such flag and needs none.
    """
    management = sys.modules.get("comfy.model_management")
    if not enabled or not hasattr(management, "in_training"):
        yield
        return
    before, management.in_training = management.in_training, True
    try:
        yield
    finally:
        management.in_training = before


def flow_loss(model, batch: Batch, shift: float, generator=None, transformer_options=None) -> torch.Tensor:
    """Wan's flow-matching loss: x_t = (1 - t) x0 + t noise, target noise - x0."""
    b = len(batch)
    u = torch.rand(b, generator=generator, device="cpu").to(batch.x0.device)
    noise = torch.randn(batch.x0.shape, generator=generator, device="cpu").to(batch.x0.device)
    return flow_loss_at(model, batch, shifted(u, shift), noise, transformer_options)


def flow_loss_at(model, batch: Batch, t: torch.Tensor, noise: torch.Tensor, transformer_options=None) -> torch.Tensor:
    """The flow-matching loss at given noise levels ``t [B]`` and noise (``flow_loss`` draws both)."""
    x_t = (1 - t.view(-1, 1, 1, 1, 1)) * batch.x0 + t.view(-1, 1, 1, 1, 1) * noise
    pred = predict_velocity(model, x_t, t, batch, transformer_options)
    return torch.nn.functional.mse_loss(pred.float(), (noise - batch.x0).float())


def sigma_schedule(steps: int, shift: float) -> torch.Tensor:
    """Sigmas of a simple schedule as ComfyUI's 'simple' scheduler gives for flow models: shifted linear."""
    return torch.cat([shifted(torch.linspace(1, 0, steps + 1)[:-1], shift), torch.zeros(1)])


class SDPAAttention:
    """An ``optimized_attention_override`` for training: plain SDPA on contiguous ``[B, H, N, D]``
    tensors, restricted to the given backends (names of ``torch.nn.attention.SDPBackend``).

    On CUDA ComfyUI puts cuDNN attention first in SDPA's priority list; in the first testbed
    run on an H200 (torch 2.11) training through it did not learn at all (loss flat for 1,900
    steps) while the same code learned on the CPU, so training picks its attention backend by a
    gradient check (``train.gradient_check``).
    """

    def __init__(self, backends=("FLASH_ATTENTION", "EFFICIENT_ATTENTION")):
        self.backends = tuple(backends)

    def __call__(self, func, *args, **kwargs):
        q, k, v = args[:3]
        heads = kwargs.get("heads", args[3] if len(args) > 3 else None)
        if (kwargs.get("mask") is not None or kwargs.get("skip_reshape") or kwargs.get("skip_output_reshape")
                or q.dim() != 3 or heads is None):
            return func(*args, **kwargs)
        b, _, hd = q.shape
        d = hd // heads
        dt = v.dtype if q.is_cuda else q.dtype
        qh, kh, vh = (x.to(dt).reshape(b, -1, heads, d).transpose(1, 2).contiguous() for x in (q, k, v))
        if q.is_cuda and self.backends:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([getattr(SDPBackend, name) for name in self.backends]):
                o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh)
        return o.transpose(1, 2).reshape(b, -1, heads * d)


# --------------------------------------------------------------------------------------------
# Attention hook
# --------------------------------------------------------------------------------------------


class AttentionHook:
    """A direct ``optimized_attention_override``: per self-attention call, observe and/or go sparse.

    :param num_layers: self-attention calls per forward (the layer is the call index).
    :param observe: ``observe(layer, q, k, v, heads)`` for every self-attention call.
    :param block_map_for: ``block_map_for(layer, q, k, heads) -> bool [1|B, H, nb, nb] or None``
        (None = dense).
    """

    def __init__(self, num_layers: int, block_size: int = 128):
        self.num_layers, self.block_size = num_layers, block_size
        self.observe: Optional[Callable] = None
        self.block_map_for: Optional[Callable] = None
        self.calls = 0
        self.dense_override: Optional[Callable] = None  # an override for the dense calls (None: ComfyUI's)

    def options(self) -> dict:
        self.calls = 0
        return {"optimized_attention_override": self}

    def __call__(self, func, *args, **kwargs):
        q, k, v = args[:3]
        heads = kwargs.get("heads", args[3] if len(args) > 3 else None)
        dense = (lambda: self.dense_override(func, *args, **kwargs)) if self.dense_override else (lambda: func(*args, **kwargs))
        if kwargs.get("skip_reshape") or q.dim() != 3 or q.shape[1] != k.shape[1]:
            return dense()  # cross-attention (or a layout we do not handle): dense
        layer = self.calls % self.num_layers
        self.calls += 1
        if self.observe is not None:
            self.observe(layer, q, k, v, heads)
        block_map = self.block_map_for(layer, q, k, heads) if self.block_map_for is not None else None
        if block_map is None:
            return dense()
        bs = import_sibling("kernels.block_sparse")
        n = q.shape[1]
        if q.is_cuda:  # under autocast q, k (after RoPE) can be fp32 while v is bf16: one dtype for the kernel
            q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
        mask = bs.block_map_to_mask(block_map, self.block_size, self.block_size, n)
        return bs.block_sparse_attention(q, k, v, mask, heads)


def sample(model, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor, hook: Optional[AttentionHook] = None,
           on_step: Optional[Callable[[int], None]] = None, autocast: bool = False) -> torch.Tensor:
    """Euler sampler of the flow ODE (denoised = x - sigma v), as ComfyUI's 'euler' does; cfg 1."""
    x = noise * sigmas[0]  # flow: noise_scaling gives sigma * noise + (1 - sigma) * 0
    device = batch.x0.device
    for i in range(len(sigmas) - 1):
        if on_step is not None:
            on_step(i)
        s = sigmas[i].to(device).expand(x.shape[0])
        options = hook.options() if hook is not None else {}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            v = predict_velocity(model, x, s, batch, options).float()
        denoised = x - sigmas[i] * v
        x = denoised + (x - denoised) * (sigmas[i + 1] / sigmas[i]) if sigmas[i + 1] > 0 else denoised
    return x


def block_grid_coords(size, block_size: int) -> torch.Tensor:
    """Centre (t, h, w) of each token block in Wan's (t, h, w) raster order -> float ``[nb, 3]``."""
    t, h, w = size[0], (size[1] + 1) // 2, (size[2] + 1) // 2
    grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    coords = grid.reshape(-1, 3).float()
    n = coords.shape[0]
    nb = math.ceil(n / block_size)
    pad = nb * block_size - n
    counts = torch.full((nb,), float(block_size))
    counts[-1] = block_size - pad
    summed = torch.nn.functional.pad(coords, (0, 0, 0, pad)).view(nb, block_size, 3).sum(1)
    return summed / counts[:, None]


def check_model_matches(patcher, config) -> None:
    """Refuse a preset that describes another model than the loaded checkpoint: the harnesses count
    layers and heads from the preset, so a mismatch would measure some layers and not others.

    :raises ValueError: saying both shapes and what to pass instead.
    """
    blocks = patcher.model.diffusion_model.blocks
    layers, heads = len(blocks), blocks[0].self_attn.num_heads
    if (layers, heads) != (config.num_layers, config.num_heads):
        raise ValueError(f"the preset describes {config.num_layers} layers x {config.num_heads} heads, the checkpoint "
                         f"has {layers} x {heads}: pass the preset it was trained with (e.g. --preset sharp16k) and "
                         "change sizes with --set (e.g. --set long_size=[8,32,32] --set block_size=64)")
