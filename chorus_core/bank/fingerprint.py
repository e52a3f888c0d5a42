"""Model fingerprint: shapes read from a Wan state dict plus a digest of a few weight tensors.

Two checkpoints with the same shapes (e.g. I2V 480p vs 720p fine-tunes) have different
attention patterns, so the digest tells them apart; it samples a fixed set of elements
(not whole tensors) so fingerprinting a 14B model takes milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass

from .errors import BankError

HEAD_DIM = 128  # Wan 2.1 in ComfyUI: num_heads = dim // 128
_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
_DIGEST_KEYS = ("patch_embedding.weight", "blocks.0.self_attn.q.weight",
                "blocks.0.self_attn.k.weight", "head.modulation")
_SAMPLES = 4096  # elements taken from each digest tensor (first ones + an even stride)


@dataclass(frozen=True)
class ModelFingerprint:
    """What a mask entry's model must match.

    :param architecture: e.g. ``"wan2.1-i2v"``
    :param dim: hidden width
    :param layers: number of transformer blocks
    :param heads: attention heads per block
    :param in_dim: latent channels into the patch embedding (36 for Wan I2V)
    :param digest: sha256 over samples of a few fixed weight tensors
    """

    architecture: str
    dim: int
    layers: int
    heads: int
    in_dim: int
    digest: str

    def key(self) -> str:
        """Stable string that equal fingerprints share."""
        return json.dumps(asdict(self), sort_keys=True)

    def to_dict(self) -> dict:
        return asdict(self)


def _strip_prefix(state: dict) -> dict:
    for prefix in _PREFIXES:
        if any(k.startswith(prefix) for k in state):
            return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    return state


def _sample_bytes(tensor) -> bytes:
    """Fixed sample of a tensor's values, rounded to bfloat16 so fp32/bf16 copies agree."""
    import torch

    flat = tensor.detach().reshape(-1)
    stride = max(1, flat.numel() // _SAMPLES)
    picked = torch.cat([flat[:_SAMPLES], flat[::stride][:_SAMPLES]])
    picked = picked.to(device="cpu", dtype=torch.float32).to(torch.bfloat16)
    return picked.view(torch.int16).numpy().tobytes()


def fingerprint_model(module_or_state_dict, architecture: str = "wan2.1-i2v") -> ModelFingerprint:
    """Fingerprint a Wan diffusion model from its module or state dict.

    :param module_or_state_dict: a ``torch.nn.Module`` or a mapping of name -> tensor; keys may
        carry a ``diffusion_model.`` or ``model.diffusion_model.`` prefix
    :param architecture: architecture name stored with the fingerprint
    :raises BankError: when the Wan keys are missing
    """
    state = module_or_state_dict
    if hasattr(state, "state_dict"):
        state = state.state_dict()
    state = _strip_prefix(dict(state))
    missing = [k for k in _DIGEST_KEYS if k not in state]
    if missing:
        raise BankError(f"Cannot fingerprint this model: keys {missing} are missing. "
                        "Pass a Wan 2.1 diffusion model (or its state dict).")
    dim = int(state["blocks.0.self_attn.q.weight"].shape[0])
    layers = 1 + max(int(m.group(1)) for k in state
                     if (m := re.match(r"blocks\.(\d+)\.", k)))
    in_dim = int(state["patch_embedding.weight"].shape[1])
    digest = hashlib.sha256()
    for key in _DIGEST_KEYS:
        digest.update(key.encode() + str(tuple(state[key].shape)).encode())
        digest.update(_sample_bytes(state[key]))
    return ModelFingerprint(architecture, dim, layers, max(1, dim // HEAD_DIM), in_dim,
                            digest.hexdigest())
