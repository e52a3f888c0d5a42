"""Model fingerprint: shapes read from a Wan state dict plus a digest of every weight tensor.

Masks are only reused on the checkpoint they were recorded on, so the digest must tell apart
two checkpoints of the same shape even when a fine-tune changed a single late block. It
therefore covers every tensor (name, shape and a strided sample of its values), not a few
fixed ones; sampling a fixed number of elements per tensor keeps a 14B model (~1,100
tensors) in milliseconds. Values are rounded to bfloat16, so the same checkpoint loaded as
fp32, fp16 or bf16 gives the same digest (ComfyUI picks the load dtype per device).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import asdict, dataclass

from .errors import BankError

log = logging.getLogger("chorus")

HEAD_DIM = 128  # Wan 2.1 in ComfyUI: num_heads = dim // 128
ARCHITECTURE = "wan2.1"  # I2V and T2V alike (their shapes tell them apart); one default for every entry point
_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
_SHAPE_KEYS = ("patch_embedding.weight", "blocks.0.self_attn.q.weight")
SAMPLES_PER_TENSOR = 64  # evenly strided elements; a fine-tune changes nearly all of them


@dataclass(frozen=True)
class ModelFingerprint:
    """What a mask entry's model must match.

    :param architecture: e.g. ``"wan2.1"`` (:data:`ARCHITECTURE`)
    :param dim: hidden width
    :param layers: number of transformer blocks
    :param heads: attention heads per block
    :param in_dim: latent channels into the patch embedding (36 for Wan I2V)
    :param digest: sha256 over every tensor's name, shape and value sample (and, from
        :func:`chorus_core.reuse.model_identity.fingerprint_patcher`, the patch list)
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


class TensorDigest:
    """sha256 over many tensors' names, shapes and strided value samples.

    Samples are gathered per (device, dtype) and copied to the host once per group, so a
    model on a GPU costs one synchronisation, not one per tensor. The result does not
    depend on which device a tensor sits on (low-VRAM loading offloads some of them).
    Tensors on ``meta`` (no data) or that cannot be read count by name and shape only.
    """

    def __init__(self):
        self._lines: list[str] = []
        self._groups: dict[tuple, list] = {}
        self._group_sizes: dict[tuple, int] = {}
        self._parts: list[tuple[tuple, int, int]] = []  # (group, start, length) in add order
        self.sampled = 0
        self.unsampled = 0  # on 'meta' or unreadable
        self.unreadable: list[str] = []  # "name (why)" of each tensor that raised when read
        self.sampled_values = 0  # what the digest reads: at most SAMPLES_PER_TENSOR per tensor

    def add_text(self, text: str) -> None:
        self._lines.append(text)

    def has_content(self) -> bool:
        return bool(self._lines)

    def add_tensor(self, name: str, tensor, as_dtype=None) -> None:
        """``as_dtype``: read the samples cast to it (the dtype the model computes the tensor in)."""
        try:
            picked = _strided_sample(tensor)
            if as_dtype is not None and picked is not None and picked.dtype != as_dtype:
                picked = picked.to(as_dtype)
        except Exception as exc:  # an exotic tensor type: its name and shape still count
            picked, state = None, f"unreadable {type(exc).__name__}"
            self.unreadable.append(f"{name} ({type(exc).__name__}: {exc})")
        else:
            state = "meta" if picked is None else "sampled"
        self._lines.append(f"{name}|{tuple(getattr(tensor, 'shape', ()))}|{state}")
        if picked is None:
            self.unsampled += 1
            return
        group, count = (str(picked.device), picked.dtype), picked.numel()
        start = self._group_sizes.get(group, 0)
        self._groups.setdefault(group, []).append(picked)
        self._group_sizes[group] = start + count
        self._parts.append((group, start, count))
        self.sampled += 1
        self.sampled_values += count

    def hexdigest(self) -> str:
        import numpy as np

        digest = hashlib.sha256("\n".join(self._lines).encode())
        host = {group: _canonical_values(items) for group, items in self._groups.items()}
        if self._parts:
            values = np.concatenate([host[g][s:s + n] for g, s, n in self._parts])
            digest.update(values.tobytes())
        return digest.hexdigest()


def _strided_sample(tensor):
    """Up to SAMPLES_PER_TENSOR evenly spaced elements (a view where the tensor allows one, else a
    gather); None on 'meta'."""
    import torch

    tensor = tensor.detach()
    if type(tensor) is not torch.Tensor:  # e.g. a quantized-storage subclass: sample its raw data
        tensor = tensor.as_subclass(torch.Tensor)
    if tensor.is_meta:
        return None
    stride = max(1, tensor.numel() // SAMPLES_PER_TENSOR)
    try:
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
        return flat[::stride][:SAMPLES_PER_TENSOR]
    except RuntimeError:
        # A view needs the tensor's version counter, and some have none: under DynamicVRAM
        # (ComfyUI 0.19+) a tensor the loader moved back to the CPU after a run raised "Inference
        # tensors do not track version counter" (2026-12-07, H100). A gather reads the same elements
        # without a view (seen to work there). fp8 has no gather kernel: it is gathered from a float32
        # copy, which holds every fp8 value exactly, and cast back, so the digest is the view path's.
        count = min(SAMPLES_PER_TENSOR, -(-tensor.numel() // stride))  # what the view path takes
        index = torch.arange(0, count * stride, stride, device=tensor.device)
        if tensor.element_size() == 1 and tensor.is_floating_point():
            return torch.take(tensor.to(torch.float32), index).to(tensor.dtype)
        return torch.take(tensor, index)


def _canonical_values(samples):
    """One group's samples on the host as int64: bfloat16 bit patterns for floats, values otherwise.

    The float conversions run in numpy: torch's own, on tensors this small, spend most of
    their time waking its thread pool.
    """
    import numpy as np
    import torch

    joined = torch.cat(samples)
    if not joined.is_floating_point():
        return joined.to("cpu").numpy().astype(np.int64)
    if joined.dtype == torch.bfloat16:
        return joined.view(torch.int16).to("cpu").numpy().view(np.uint16).astype(np.int64)
    if joined.dtype not in (torch.float32, torch.float16):  # fp8, fp64: rare, small
        joined = joined.to(torch.float32)
    bits = joined.to("cpu").numpy().astype(np.float32).view(np.uint32).astype(np.int64)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 & 0xFFFF  # round to nearest even, as torch does


def strip_prefix(state: dict) -> dict:
    for prefix in _PREFIXES:
        if any(k.startswith(prefix) for k in state):
            return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    return state


def weights_digest(state: dict, as_dtypes: dict | None = None) -> TensorDigest:
    """A :class:`TensorDigest` over every tensor of ``state``, in name order (file and module agree);
    a tensor named in ``as_dtypes`` is read cast to that dtype."""
    digest = TensorDigest()
    as_dtypes = as_dtypes or {}
    for name in sorted(state):
        digest.add_tensor(name, state[name], as_dtypes.get(name))
    if digest.unreadable:  # counted by name and shape only: if they read later, the digest changes
        log.warning("Chorus: %d of the model's tensors could not be read for its fingerprint, first %s; "
                    "if they can be read later, that request will not find the entries recorded now",
                    len(digest.unreadable), digest.unreadable[0])
    if not digest.sampled:
        raise BankError(f"Cannot fingerprint this model: none of its {len(state)} weights can be read "
                        "(all on 'meta' or of an unreadable type). Fingerprint it after ComfyUI has "
                        "loaded its weights.")
    return digest


def wan_shapes(state: dict) -> dict:
    """dim, layers, heads and in_dim of a prefix-free Wan state dict."""
    missing = [k for k in _SHAPE_KEYS if k not in state]
    if missing:
        raise BankError(f"Cannot fingerprint this model: keys {missing} are missing. "
                        "Pass a Wan 2.1 diffusion model (or its state dict).")
    dim = int(state["blocks.0.self_attn.q.weight"].shape[0])
    layers = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"blocks\.(\d+)\.", k)))
    return {"dim": dim, "layers": layers, "heads": max(1, dim // HEAD_DIM),
            "in_dim": int(state["patch_embedding.weight"].shape[1])}


def fingerprint_model(module_or_state_dict, architecture: str = ARCHITECTURE) -> ModelFingerprint:
    """Fingerprint a Wan diffusion model from its module or state dict (weights as given).

    For a ComfyUI ModelPatcher use :func:`chorus_core.reuse.model_identity.fingerprint_patcher`,
    which reads the un-patched weights and adds the patch list.

    :param module_or_state_dict: a ``torch.nn.Module`` or a mapping of name -> tensor; keys may
        carry a ``diffusion_model.`` or ``model.diffusion_model.`` prefix
    :param architecture: architecture name stored with the fingerprint
    :raises BankError: when the Wan keys are missing or no weight can be read
    """
    state = module_or_state_dict
    if hasattr(state, "state_dict"):
        state = state.state_dict()
    state = strip_prefix(dict(state))
    shapes = wan_shapes(state)
    return ModelFingerprint(architecture, digest=weights_digest(state).hexdigest(), **shapes)
