"""A tiny Wan2.1-I2V-architecture checkpoint built from ComfyUI's own ``WanModel`` class.

ComfyUI detects it as ``WAN21_I2V`` (``in_dim`` 36, an ``img_emb`` projector), so it goes
through exactly the code paths a real Wan2.1-I2V-14B checkpoint does, at a size a CPU
runs in seconds. Head width defaults to 128 because ComfyUI's checkpoint detection derives
``num_heads = dim // 128``; a narrower ``head_dim`` builds a model in process (the testbed
probe's many-head candidates) that UNETLoader would load with the wrong head count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

WAN_HEAD_DIM = 128
WAN_TEXT_DIM = 4096  # UMT5-XXL width; fixed in ComfyUI's WanModel
WAN_CLIP_DIM = 1280  # clip_vision_h penultimate width
WAN_LATENT_CHANNELS = 16


@dataclass(frozen=True)
class TinyWanConfig:
    """Shape of the tiny model; ``heads = dim // head_dim`` (128: what ComfyUI's detection assumes)."""

    dim: int = 256
    ffn_dim: int = 512
    num_layers: int = 2
    seed: int = 0
    head_dim: int = WAN_HEAD_DIM

    @property
    def num_heads(self) -> int:
        return self.dim // self.head_dim


def build_tiny_wan_i2v(config: TinyWanConfig = TinyWanConfig()) -> torch.nn.Module:
    """Instantiate ComfyUI's ``WanModel`` (I2V) with seeded weights; ComfyUI must be importable."""
    from comfy.ldm.wan.model import WanModel

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(config.seed)
    try:
        # plain torch.nn as "operations": ComfyUI's own ops skip weight init on purpose.
        model = WanModel(model_type="i2v", in_dim=36, dim=config.dim, ffn_dim=config.ffn_dim,
                         num_heads=config.num_heads, num_layers=config.num_layers, out_dim=16,
                         operations=torch.nn)
        _init_modulations(model, config.dim)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval()


def _init_modulations(model: torch.nn.Module, dim: int) -> None:
    """ComfyUI allocates the adaLN modulation tables with ``torch.empty`` (they always come
    from a checkpoint); give them Wan's own initialisation, N(0, 1/dim)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("modulation"):
                param.normal_(0.0, dim**-0.5)


def save_tiny_wan_i2v(path: Path, config: TinyWanConfig = TinyWanConfig(), dtype=torch.float16) -> Path:
    """Write the tiny model as a diffusion-model safetensors file that UNETLoader loads."""
    from safetensors.torch import save_file

    model = build_tiny_wan_i2v(config)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {k: str(v) for k, v in asdict(config).items() if k != "head_dim" or v != WAN_HEAD_DIM}  # files as before
    metadata["architecture"] = "wan2.1-i2v-tiny"
    save_file(state, str(path), metadata=metadata)
    return path
