"""One generation with mask reuse: match, choose a mask source, sample patched, record on a miss.

This is the library side of the Similarity Match and Sparse Wan Sampler nodes. It knows
ComfyUI's data (a ModelPatcher, CONDITIONING lists, LATENT dicts) but none of its nodes.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field

import torch

from .bank import (BankEntryCorrupt, BankError, LatentLayout, MaskBank, MatchResult, Schedule,
                   Signature, build_signature, fingerprint_model)
from .bank.signature import resolve_weights
from .mask_provider import DenseProvider, DenseWarmupProvider, StaticBlockMapProvider

log = logging.getLogger("chorus")
MISS_MODES = ("online", "prior", "dense")
PATCH_SIZE = (1, 2, 2)  # Wan 2.1 patchify: latent (T, H, W) -> tokens (T, H/2, W/2)


@dataclass(frozen=True)
class ReuseOptions:
    """What the sampler does with a match. Defaults: see the README's "Defaults" section."""

    dense_warmup_steps: int = 1
    dense_layers: tuple[int, ...] = ()
    miss_mode: str = "online"
    top_p: float = 0.9
    min_density: float = 0.05
    max_density: float = 0.5
    record_on_miss: bool = True
    tags: tuple[str, ...] = ()

    def __post_init__(self):
        if self.miss_mode not in MISS_MODES:
            raise ValueError(f"miss_mode {self.miss_mode!r} is not one of {', '.join(MISS_MODES)}")
        if not 0.0 < self.min_density <= self.max_density <= 1.0:
            raise ValueError(f"need 0 < min_density <= max_density <= 1, got {self.min_density} and {self.max_density}")


@dataclass
class MatchRequest:
    """Everything a bank lookup needs, taken from what an I2V graph already has."""

    signature: Signature
    fingerprint: object
    layout: LatentLayout
    threshold: float
    weights: dict


@dataclass
class ReuseMatch:
    """The Similarity Match node's output: the bank, the request and the lookup's result."""

    bank: MaskBank
    request: MatchRequest
    result: MatchResult
    match_ms: float

    def summary(self) -> str:
        r = self.result
        parts = " ".join(f"{k}={v:.3f}" for k, v in sorted(r.components.items()))
        verdict = f"HIT {r.entry_id}" if r.hit else "MISS"
        return (f"Chorus: {verdict} similarity={r.similarity:.3f} (threshold {self.request.threshold:.3f}; {parts}) "
                f"among {r.candidates} compatible entries in {self.match_ms:.1f} ms")


def layout_from_latent(samples: torch.Tensor, block_size: int) -> LatentLayout:
    """Token grid of a Wan latent ``[B, 16, T, H, W]`` after patchify, cut into square blocks."""
    if samples.ndim != 5:
        raise ValueError(f"Chorus needs a video latent [B, 16, T, H, W]; got shape {tuple(samples.shape)}. "
                         "Use the latent from WanImageToVideo.")
    t, h, w = samples.shape[2:]
    grid = (math.ceil(t / PATCH_SIZE[0]), math.ceil(h / PATCH_SIZE[1]), math.ceil(w / PATCH_SIZE[2]))
    return LatentLayout(grid=grid, token_order="thw", block_size=(block_size, block_size))


def start_latent_from(positive, start_latent: dict | None) -> torch.Tensor | None:
    """The start frame's latent: given directly, or WanImageToVideo's ``concat_latent_image``."""
    if start_latent is not None:
        return start_latent["samples"][:, :, :1]
    concat = positive[0][1].get("concat_latent_image") if positive else None
    return None if concat is None else concat[:, :, :1]


def fingerprint_patcher(model_patcher):
    """Fingerprint of the diffusion model inside a ComfyUI ModelPatcher."""
    return fingerprint_model(model_patcher.model.diffusion_model.state_dict(), architecture="wan2.1")


def build_match_request(model_patcher, clip_vision_output, positive, latent: dict, start_latent: dict | None,
                        threshold: float, weights: dict, block_size: int) -> MatchRequest:
    """Signature, fingerprint and layout of one request, from ComfyUI's objects."""
    signature = build_signature(clip_vision=clip_vision_output, text=positive[0][0] if positive else None,
                                start_latent=start_latent_from(positive, start_latent))
    return MatchRequest(signature=signature, fingerprint=fingerprint_patcher(model_patcher),
                        layout=layout_from_latent(latent["samples"], block_size), threshold=threshold,
                        weights=resolve_weights(weights))


def match_request(bank: MaskBank, request: MatchRequest) -> ReuseMatch:
    started = time.perf_counter()
    result = bank.match(request.signature, request.fingerprint, request.layout, threshold=request.threshold,
                        top_k=1, weights=request.weights)
    return ReuseMatch(bank=bank, request=request, result=result, match_ms=(time.perf_counter() - started) * 1e3)


@dataclass
class RunReport:
    """What one generation did; the sampler's UI output and ``/history`` carry it as JSON."""

    mode: str
    steps: int
    entry_id: str | None = None
    similarity: float | None = None
    components: dict = field(default_factory=dict)
    density: float | None = None
    layers: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    recorded_entry_id: str | None = None
    warnings: list = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def scaled_bucket_starts(schedule: Schedule, steps: int) -> list[int]:
    """Bucket starts of a recorded schedule, rescaled to this run's step count."""
    starts = [round(a * steps / schedule.steps) for a, _ in schedule.step_buckets]
    unique = []
    for s in starts:
        unique.append(max(s, unique[-1] + 1) if unique else 0)
    return unique


def provider_from_entry(entry_masks, steps: int) -> StaticBlockMapProvider:
    """A provider that serves a bank entry's masks, one set per step bucket."""
    schedule = entry_masks.schedule
    layers = entry_masks.layers if hasattr(entry_masks, "layers") else entry_masks.num_layers
    buckets = [{layer: entry_masks.block_map(b, layer)[None] for layer in range(layers)}
               for b in range(len(schedule.step_buckets))]
    return StaticBlockMapProvider(buckets, tuple(entry_masks.layout.block_size), scaled_bucket_starts(schedule, steps))
