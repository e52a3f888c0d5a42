"""Which model a ComfyUI ModelPatcher runs: its checkpoint's weights plus its patch list.

ComfyUI applies a LoRA by adding it to ``ModelPatcher.patches``; ``patch_model`` later writes
the merged weights into the shared module in place and keeps the originals in
``ModelPatcher.backup`` (shared between clones), while a low-VRAM load leaves the weights
un-patched and merges them on the fly through ``weight_function``. Digesting the live
weights would therefore change with how the model happens to be loaded. This module digests
the weights as loaded from the checkpoint (the backup where a key is backed up) and,
separately, the patch list by content (strengths and tensor samples, never object ids), so
the fingerprint is the same before, during and after ``patch_model`` and in low-VRAM mode.

ComfyUI 0.3.64 keeps no hash or file path of the checkpoint on the ModelPatcher, so the
weights themselves are the identity. Only duck-typed attributes are read; ComfyUI is not
imported.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from ..bank.fingerprint import ARCHITECTURE, ModelFingerprint, TensorDigest, wan_shapes, weights_digest
from ..names import callable_name, type_name

DIFFUSION_PREFIX = "diffusion_model."  # ModelPatcher keys are relative to the BaseModel
_MAX_DEPTH = 8  # patch data nests tuples a few levels deep; never follow a cycle


def fingerprint_patcher(model_patcher, architecture: str = ARCHITECTURE) -> ModelFingerprint:
    """Fingerprint of the diffusion model inside a ComfyUI ModelPatcher, patches included.

    Equal to ``fingerprint_model`` of the checkpoint's state dict when nothing is patched.

    :raises BankError: when the model is not Wan-shaped or none of its weights can be read
    """
    weights = base_weights(model_patcher)
    shapes = wan_shapes(weights)
    digest = weights_digest(weights, computed_dtypes(model_patcher.model.diffusion_model, weights)).hexdigest()
    patches = patches_digest(model_patcher)
    if patches is not None:
        digest = hashlib.sha256(f"weights {digest} patches {patches}".encode()).hexdigest()
    return ModelFingerprint(architecture, digest=digest, **shapes)


def base_weights(model_patcher) -> dict:
    """The diffusion model's tensors without any patch ComfyUI wrote into them in place.

    A key in ``backup`` (regular patches) or ``hook_backup`` (hook patches) holds the weight as
    it was before patching; ``backup`` wins, as ``hook_backup`` may hold an already patched one.
    """
    backup = getattr(model_patcher, "backup", None) or {}
    hook_backup = getattr(model_patcher, "hook_backup", None) or {}
    weights, originals = {}, {}
    for name, tensor in model_patcher.model.diffusion_model.state_dict().items():
        key = DIFFUSION_PREFIX + name
        if key in backup:
            originals.update(as_stored(name, backup[key].weight))
        elif key in hook_backup:
            originals.update(as_stored(name, hook_backup[key][0]))
        weights[name] = tensor
    weights.update(originals)  # after the loop: a patched layer's own scale may come later in its state_dict
    return weights


def computed_dtypes(diffusion_model, weights: dict) -> dict:
    """name -> the dtype ComfyUI computes a plain tensor of ``weights`` in, where that differs from
    the dtype it holds now.

    ComfyUI 0.19+ archives each parameter's dtype when it builds the model
    (``<name>_comfy_model_dtype`` on its module); under DynamicVRAM the weights stay as the file
    holds them (memory-mapped) until the model loads, when the loader casts some of them in place
    (a block's ``modulation``: bf16 from the file, fp8 under ``fp8_e4m3fn_fast``; 2026-12-07, H100).
    Read in the archived dtype, they digest the same before and after the load, and as the legacy
    loader, which casts everything when it builds the model, holds them.
    """
    dtypes = {}
    for module_name, module in diffusion_model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            archived = getattr(module, f"{name}_comfy_model_dtype", None)
            tensor = weights.get(prefix + name)
            if isinstance(archived, torch.dtype) and type(tensor) in (torch.Tensor, torch.nn.Parameter) \
                    and tensor.dtype != archived:
                dtypes[prefix + name] = archived
    return dtypes


def as_stored(name: str, tensor) -> dict:
    """``{name: tensor}``, or for a quantized weight the tensors its layer's ``state_dict`` writes.

    Newer ComfyUI keeps an fp8_scaled layer's weight as a comfy-kitchen ``QuantizedTensor``: the
    layer's ``state_dict`` gives its raw data and scale (``weight``, ``weight_scale``), while a
    backed-up weight is the tensor object itself. Expanding it the same way keeps one fingerprint
    before and after a LoRA is patched in (the patch re-quantizes the weight with a new scale).
    """
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and callable(getattr(tensor, "state_dict", None)):
        return dict(tensor.state_dict(name))
    return {name: tensor}


def patches_digest(model_patcher) -> str | None:
    """sha256 over what the patcher changes in the weights; None when it changes nothing.

    Covers ``patches`` (LoRAs, model merges: per key, each patch's strengths, offset,
    function and data), ``hook_patches``, ``weight_wrapper_patches`` and object patches that
    replace part of the diffusion model.
    """
    digest = TensorDigest()
    _describe_patch_map(digest, "patch", getattr(model_patcher, "patches", None) or {})
    hooks = getattr(model_patcher, "hook_patches", None) or {}
    for hook_digest in sorted(_patch_map_digest(patch_map) for patch_map in hooks.values()):
        digest.add_text(f"hook {hook_digest}")
    wrappers = getattr(model_patcher, "weight_wrapper_patches", None) or {}
    for key in sorted(wrappers):
        digest.add_text(f"wrapper {key}: " + ", ".join(callable_name(f) for f in wrappers[key]))
    objects = getattr(model_patcher, "object_patches", None) or {}
    for name in sorted(n for n in objects if n.startswith(DIFFUSION_PREFIX)):
        digest.add_text(f"object {name}: {type_name(objects[name])}")
    return digest.hexdigest() if digest.has_content() else None


def _patch_map_digest(patch_map: dict) -> str:
    digest = TensorDigest()
    _describe_patch_map(digest, "hook", patch_map)
    return digest.hexdigest()


def _describe_patch_map(digest: TensorDigest, label: str, patch_map: dict) -> None:
    """Each entry is ComfyUI's ``(strength_patch, patch_data, strength_model, offset, function)``."""
    for key in sorted(patch_map):
        for index, patch in enumerate(patch_map[key]):
            _describe(digest, f"{label} {key}[{index}]", patch, 0)


def _describe(digest: TensorDigest, path: str, value, depth: int) -> None:
    """Add ``value``'s content: numbers exactly, tensors sampled, code by name, never ids."""
    if depth > _MAX_DEPTH:
        digest.add_text(f"{path}: nested too deep")
    elif isinstance(value, torch.Tensor):
        digest.add_tensor(path, value)
    elif _is_scalar(value):
        digest.add_text(f"{path}={value!r}")
    elif isinstance(value, (tuple, list)):  # scalars inline, one line per sequence: LoRAs have many
        digest.add_text(f"{path}: {type(value).__name__} " + ", ".join(
            repr(item) if _is_scalar(item) else "*" for item in value))
        for index, item in enumerate(value):
            if not _is_scalar(item):
                _describe(digest, f"{path}.{index}", item, depth + 1)
    elif isinstance(value, dict):
        digest.add_text(f"{path}: dict[{len(value)}]")
        for key in sorted(value, key=str):
            _describe(digest, f"{path}.{key}", value[key], depth + 1)
    elif isinstance(value, functools.partial):
        _describe(digest, path, (value.func, value.args, value.keywords), depth + 1)
    elif hasattr(value, "weights") and not callable(value):  # a comfy.weight_adapter (LoRA, LoHa, ...)
        digest.add_text(f"{path}: {type_name(value)} {getattr(value, 'name', '')!r}")
        _describe(digest, f"{path}.weights", value.weights, depth + 1)
    elif callable(value):
        digest.add_text(f"{path}: {callable_name(value)}")
    else:
        digest.add_text(f"{path}: {type_name(value)}")


def _is_scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, bytes))
