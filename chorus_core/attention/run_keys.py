"""The names Chorus's hooks share through ComfyUI: wrapper and callback types, the attention
override slot, and the per-run ``transformer_options`` entries (one place, so the sparse patch
and Feature Reuse never re-type each other's strings)."""

from __future__ import annotations

OUTER_SAMPLE = "outer_sample"  # comfy.patcher_extension.WrappersMP.OUTER_SAMPLE (checked in tests)
DIFFUSION_MODEL = "diffusion_model"  # comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL (checked in tests)
APPLY_MODEL = "apply_model"  # comfy.patcher_extension.WrappersMP.APPLY_MODEL (checked in tests)
ON_PREPARE_STATE = "on_prepare_state"  # comfy.patcher_extension.CallbacksMP.ON_PREPARE_STATE
OVERRIDE_KEY = "optimized_attention_override"


def sparse_run_key(key: str) -> str:
    return f"{key}_sparse_run"


def sparse_block_key(key: str) -> str:
    return f"{key}_sparse_block"


def sparse_video_key(key: str) -> str:
    return f"{key}_sparse_video_tokens"


def sparse_plan_key(key: str) -> str:
    return f"{key}_sparse_plan"


def sparse_declared_key(key: str) -> str:
    return f"{key}_sparse_declared_attention"


def feature_reuse_run_key(key: str) -> str:
    return f"{key}_feature_reuse_run"


def feature_reuse_call_key(key: str) -> str:
    return f"{key}_feature_reuse_call"
