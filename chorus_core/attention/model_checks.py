"""Which models Chorus makes sparse, and which other attention patches it refuses to stack on.

Wan 2.1 I2V and T2V only: other Wan-shaped variants load as the same classes but would file
their masks with, and match them against, plain I2V entries; core's Model Sparse Attention on
the same model would make the same calls sparse with other masks.
"""

from __future__ import annotations

from typing import Optional

from .run_keys import ON_PREPARE_STATE, OVERRIDE_KEY

SUPPORTED = "Wan 2.1 image-to-video and text-to-video (comfy.model_base.WAN21 running a WanModel)"

# Diffusion-model classes of the pinned ComfyUI that look like Wan but are not supported.
_KNOWN_VARIANTS = {
    "VaceWanModel": "Wan 2.1 VACE",
    "CameraWanModel": "Wan camera control",
    "WanModel_S2V": "Wan 2.2 S2V (speech to video)",
    "HumoWanModel": "HuMo",
    "AnimateWanModel": "Wan 2.2 Animate",
}


# --------------------------------------------------------------------------------------------
# Which models
# --------------------------------------------------------------------------------------------


class UnsupportedModelError(ValueError):
    """The model is not one Chorus can make sparse; the message names it and what is supported."""


class CompetingAttentionError(ValueError):
    """Another sparse-attention method patches the same model; two would silently stack."""


CORE_SPARSE_NODE = "Model Sparse Attention (BlockSparseAttention)"
CORE_SPARSE_CALLBACK_KEY = "block_sparse_attention"  # its ON_PREPARE_STATE callback reinstalls it every step
ATTENTION_BACKEND_NODE = "Model Attention Backend (ModelAttentionBackend)"


def is_core_sparse_override(function) -> bool:
    """Core's Model Sparse Attention override (comfy_extras/nodes_sparse_attention.py, newer ComfyUI;
    from cf3103c5 it is marked with its patch, ``_block_sparse_attention_patch``)."""
    return (getattr(function, "__module__", "") or "").endswith("nodes_sparse_attention") or \
        getattr(function, "__qualname__", "") == "make_attention_override.<locals>.override" or \
        getattr(function, "_block_sparse_attention_patch", None) is not None


def is_attention_backend_override(function) -> bool:
    """The override ModelPatcher.set_model_optimized_attention installs (Model Attention Backend)."""
    return getattr(function, "__qualname__", "") == \
        "ModelPatcher.set_model_optimized_attention.<locals>.optimized_attention_override"


def check_no_competing_sparse_attention(model_patcher, transformer_options: dict) -> None:
    """Refuse a model that core's Model Sparse Attention also patches, whichever was applied first.

    Core's node reinstalls its override on top of any other at every step and makes sparse
    whatever it accepts; Chorus would then run sparse only what core declines: two methods
    stacked, neither measured. One of the two has to go.
    """
    callbacks = (getattr(model_patcher, "callbacks", None) or {}).get(ON_PREPARE_STATE, {})
    override = transformer_options.get(OVERRIDE_KEY)
    found = CORE_SPARSE_CALLBACK_KEY in callbacks
    while override is not None and not found:
        found = is_core_sparse_override(override)
        override = getattr(override, "chorus_previous", getattr(override, "_block_sparse_attention_previous", None))
    if found:
        raise CompetingAttentionError(
            f"Chorus sparse attention and core's {CORE_SPARSE_NODE} node patch the same model: both would make "
            "self-attention sparse, each with its own masks. Remove one of the two nodes from the MODEL path "
            "(a Model Attention Backend node is fine: Chorus runs its dense calls through it)."
        )


def check_supported_model(model_patcher) -> None:
    """Raise UnsupportedModelError unless the patcher holds a Wan 2.1 I2V/T2V model."""
    import comfy.ldm.wan.model
    import comfy.model_base

    model = getattr(model_patcher, "model", None)
    diffusion_model = getattr(model, "diffusion_model", None)
    if type(model) is comfy.model_base.WAN21 and type(diffusion_model) is comfy.ldm.wan.model.WanModel:
        variant = _wan21_variant(model, diffusion_model)
        if variant is None:
            return
        raise UnsupportedModelError(
            f"Chorus sparse attention does not support {variant}: {_describe_model(model, diffusion_model)}. "
            f"Supported: {SUPPORTED}. Its masks would be filed with, and matched against, plain I2V entries. "
            "Leave Chorus out of this workflow."
        )
    raise UnsupportedModelError(
        f"Chorus sparse attention does not support this model: {_describe_model(model, diffusion_model)}. "
        f"Supported: {SUPPORTED}. Load a Wan 2.1 I2V or T2V checkpoint, or leave Chorus out of this workflow."
    )


def _wan21_variant(model, diffusion_model) -> Optional[str]:
    """A Wan 2.1 variant that loads as a plain WAN21/WanModel but is not I2V or T2V, or None.

    FunControl (``WAN21_FunControl2V``) has 48 input channels; FLF2V (first-last-frame) has the
    CLIP position embedding ``img_emb.emb_pos`` for its two images.
    """
    config = type(getattr(model, "model_config", None)).__name__
    in_dim = getattr(diffusion_model, "in_dim", None)
    if config == "WAN21_FunControl2V" or in_dim == 48:
        return "Wan 2.1 Fun Control (WAN21_FunControl2V, 48 input channels)"
    if getattr(getattr(diffusion_model, "img_emb", None), "emb_pos", None) is not None:
        return "Wan 2.1 FLF2V (first-last-frame to video)"
    return None


def _describe_model(model, diffusion_model) -> str:
    config = getattr(model, "model_config", None)
    names = f"{type(model).__name__} / {type(diffusion_model).__name__}"
    if config is not None:
        names += f" (config {type(config).__name__})"
    variant = _KNOWN_VARIANTS.get(type(diffusion_model).__name__)
    if variant is None and type(model).__name__ == "WAN22":
        variant = "Wan 2.2 TI2V 5B"
    return f"{variant}, {names}" if variant else names
