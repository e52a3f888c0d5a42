"""A request's bank lookup: its signature, model identity and latent layout, and the match.

The library side of the Similarity Match node. It knows ComfyUI's data (a ModelPatcher,
CONDITIONING lists, LATENT dicts) but none of its nodes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

from . import bank_writer
from ..bank import (BankError, BankUnavailable, LatentLayout, MaskBank, MatchResult, Signature, build_signature,
                    compat_key)
from ..bank.signature import resolve_weights
from ..attention.model_checks import check_supported_model
from .model_identity import fingerprint_patcher

log = logging.getLogger("chorus")
PATCH_SIZE = (1, 2, 2)  # Wan 2.1 patchify: latent (T, H, W) -> tokens (T, H/2, W/2)


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
    warning: str | None = None  # why the lookup could not run (the request is then a miss)

    def summary(self) -> str:
        if self.warning:
            return f"Chorus: MISS ({self.warning})"
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


def match_grid_problem(match: "ReuseMatch | None", samples: torch.Tensor) -> Optional[str]:
    """Why ``match`` cannot serve a run on ``samples`` (a latent of another token grid), or None.

    Such a match's entries can never serve the run, and the masks it records could never be
    stored under it: every rerun would miss with nothing to say why, so callers refuse it (the
    Sparse Wan Sampler) or sample without it and warn (Chorus Sparse Attention).
    """
    if match is None:
        return None
    wanted = tuple(match.request.layout.grid)
    sampled = tuple(layout_from_latent(samples, match.request.layout.block_size[0]).grid)
    if sampled == wanted:
        return None
    shown = ["x".join(map(str, grid)) for grid in (wanted, sampled)]
    return (f"the match was made for a latent of {shown[0]} tokens (frames x height x width), but the sampler "
            f"got {shown[1]}. Wire the same latent into Similarity Match's latent and the sampler's latent_image.")


def start_latent_from(positive, start_latent: dict | None) -> torch.Tensor | None:
    """The start frame's latent: given directly, or WanImageToVideo's ``concat_latent_image``."""
    if start_latent is not None:
        return start_latent["samples"][:, :, :1]
    concat = positive[0][1].get("concat_latent_image") if positive else None
    return None if concat is None else concat[:, :, :1]


def build_match_request(model_patcher, clip_vision_output, positive, latent: dict, start_latent: dict | None,
                        threshold: float, weights: dict, block_size: int) -> MatchRequest:
    """Signature, fingerprint and layout of one request, from ComfyUI's objects."""
    check_supported_model(model_patcher)  # refuse other variants here too, never file masks under them
    signature = build_signature(clip_vision=clip_vision_output, text=positive[0][0] if positive else None,
                                start_latent=start_latent_from(positive, start_latent))
    return MatchRequest(signature=signature, fingerprint=fingerprint_patcher(model_patcher),
                        layout=layout_from_latent(latent["samples"], block_size), threshold=threshold,
                        weights=resolve_weights(weights))


# Entries a match keeps, best first: the sampler serves the most similar one above the threshold
# whose schedule fits its own (see ReuseRun.serving_candidate).
MATCH_CANDIDATES = 4


# Longest a lookup on a bank server may take on the prompt's thread; then the request is a miss.
SERVER_ANSWER_S = 20.0


def bounded(bank, call):
    """``call()``, given at most :data:`SERVER_ANSWER_S` when ``bank`` is a server bank (a
    PostgreSQL server behind a silent partition, or stopped, never answers: its socket read would
    wait as long as TCP keeps the connection). A folder bank is called as is: SQLite's busy
    timeout bounds it, and its connection must stay on this thread.

    :raises BankUnavailable: no answer in time (the call goes on in the background, and fails there)
    """
    if bank.root is not None:
        return call()
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed back to the caller below
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="chorus-bank-call", daemon=True)
    worker.start()
    worker.join(SERVER_ANSWER_S)
    if worker.is_alive():
        raise BankUnavailable(f"the bank server did not answer within {SERVER_ANSWER_S:.0f} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def match_request(bank: MaskBank, request: MatchRequest) -> ReuseMatch:
    """Look the request up; a similar entry still being written is waited for, then hit.

    A bank that cannot answer (a PostgreSQL server restarting, a damaged index) makes this
    request a miss with a warning, never a failed prompt.
    """
    started = time.perf_counter()
    try:
        bank_writer.wait_for_similar(bank.label, compat_key(request.fingerprint, request.layout),
                                     request.signature, request.threshold, request.weights)
        result = bounded(bank, lambda: bank.match(request.signature, request.fingerprint, request.layout,
                                                  threshold=request.threshold, top_k=MATCH_CANDIDATES,
                                                  weights=request.weights))
        warning = None
    except BankError as exc:
        result = MatchResult(hit=False, entry_id=None, similarity=0.0, components={}, candidates=0)
        warning = f"the bank could not be searched, so this request runs as a miss: {exc}"
        log.warning("Chorus: %s", warning)
    return ReuseMatch(bank=bank, request=request, result=result, match_ms=(time.perf_counter() - started) * 1e3,
                      warning=warning)
