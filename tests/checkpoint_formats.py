"""Tiny Wan checkpoints and LoRAs written in the formats users download (no ComfyUI needed).

* :func:`fp8_scaled_state`: Comfy-Org's ``*_fp8_scaled.safetensors`` layout (what the official Wan 2.2
  14B I2V template loads): every linear weight of the blocks stored as ``float8_e4m3fn`` with its own
  float32 ``<layer>.scale_weight``, and an empty ``scaled_fp8`` marker tensor; everything else as is.
* :func:`lightx2v_lora_state`: the key layout of the LightX2V step-distillation LoRAs: per linear layer
  ``lora_down.weight``, ``lora_up.weight`` and ``diff_b`` (a bias delta), ``diff`` for norm weights and
  ``diff_m`` for the modulation table (which ComfyUI does not load, as with the real files).
* :func:`wan22_i2v_state`: a Wan 2.2 14B I2V-shaped model (``in_dim`` 36, no CLIP-image projector).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
_BLOCK_LINEAR = re.compile(r"^blocks\.\d+\.(self_attn|cross_attn)\.(q|k|v|o|k_img|v_img)$|^blocks\.\d+\.ffn\.(0|2)$")
_BLOCK_NORM = re.compile(r"^blocks\.\d+\.(norm3|(self_attn|cross_attn)\.norm_(q|k|k_img))$")


def block_linear_layers(state: dict) -> list[str]:
    """The linear layers of the transformer blocks (``blocks.0.self_attn.q``, ...), in name order."""
    return sorted(k[:-len(".weight")] for k in state if k.endswith(".weight") and _BLOCK_LINEAR.match(k[:-7]))


def fp8_scaled_state(state: dict) -> dict:
    """``state`` as an fp8_scaled checkpoint: per-layer scale = amax / 448, weight = w / scale in e4m3."""
    out = dict(state)
    for layer in block_linear_layers(state):
        weight = state[f"{layer}.weight"].float()
        scale = (weight.abs().amax() / FP8_MAX).clamp(min=1e-12)
        out[f"{layer}.weight"] = (weight / scale).to(torch.float8_e4m3fn)
        out[f"{layer}.scale_weight"] = scale.reshape(())
    out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


def lightx2v_lora_state(state: dict, seed: int, rank: int = 4, scale: float = 0.05) -> dict:
    """A LoRA over every block linear layer, in LightX2V's key layout, for the model ``state``."""
    generator = torch.Generator().manual_seed(seed)

    def noise(*shape):
        return scale * torch.randn(*shape, generator=generator)

    lora = {}
    for layer in block_linear_layers(state):
        out_dim, in_dim = state[f"{layer}.weight"].shape
        lora[f"diffusion_model.{layer}.lora_up.weight"] = noise(out_dim, rank)
        lora[f"diffusion_model.{layer}.lora_down.weight"] = noise(rank, in_dim)
        lora[f"diffusion_model.{layer}.alpha"] = torch.tensor(float(rank))
        lora[f"diffusion_model.{layer}.diff_b"] = noise(out_dim)
    for key in state:
        if key.endswith(".weight") and _BLOCK_NORM.match(key[:-7]):
            lora[f"diffusion_model.{key[:-7]}.diff"] = noise(*state[key].shape)
        if re.fullmatch(r"blocks\.\d+\.modulation", key):
            lora[f"diffusion_model.{key[:-len('.modulation')]}.diff_m"] = noise(*state[key].shape)
    return lora


def wan22_i2v_state(state: dict) -> dict:
    """A Wan 2.1 I2V state dict made Wan 2.2 I2V-shaped: the CLIP-image projector and ``k_img``/``v_img`` go."""
    return {k: v for k, v in state.items()
            if not k.startswith("img_emb.") and not re.search(r"\.(k_img|v_img|norm_k_img)\.", k)}


def write_wan22_template_files(models_dir, models: dict, loras: dict, seeds: dict) -> None:
    """Tiny stand-ins for the official Wan 2.2 14B I2V template's files: per expert an fp8_scaled Wan 2.2
    I2V-shaped model in ``diffusion_models`` and a LightX2V-layout LoRA in ``loras``, under the template's
    own file names. Needs ComfyUI importable (the model is ComfyUI's own WanModel)."""
    from safetensors.torch import save_file

    from chorus_core.testbed.tiny_wan import TinyWanConfig, build_tiny_wan_i2v

    for folder in ("diffusion_models", "loras"):
        (Path(models_dir) / folder).mkdir(parents=True, exist_ok=True)
    for expert, seed in seeds.items():
        model = build_tiny_wan_i2v(TinyWanConfig(seed=seed))
        state = wan22_i2v_state({k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()})
        save_file(fp8_scaled_state(state), str(Path(models_dir) / "diffusion_models" / models[expert]))
        save_file(lightx2v_lora_state(state, seed=seed + 100), str(Path(models_dir) / "loras" / loras[expert]))
