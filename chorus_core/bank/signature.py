"""Request signatures built from what a ComfyUI I2V graph already has.

Components (each a float32 unit vector of fixed length ``DIM``):

* ``clip``: CLIP-vision output. Penultimate hidden states ``[1, 257, 1280]`` are pooled to
  the class token and the mean of the patch tokens; ``image_embeds`` ``[1, 1024]`` are taken
  as is. Each kind has its own projection, so the two kinds never look alike.
* ``text``: positive text conditioning ``[1, L, 4096]``, mean over non-padding tokens.
* ``layout``: the start frame's latent ``[16, T, H, W]``: the first latent frame pooled to an
  8 x 8 map per channel minus that channel's mean, so *where* the subject is matters.

Raw vectors are reduced to ``DIM`` with fixed seeded Gaussian projections (Johnson-Lindenstrauss:
cosines are kept to about +-0.06 for DIM = 256), then normalised.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

DIM = 256
COMPONENTS = ("clip", "text", "layout")
DEFAULT_WEIGHTS = {"clip": 0.5, "text": 0.3, "layout": 0.2}
LAYOUT_GRID = 8


@dataclass
class Signature:
    """A request signature: unit float32 vectors per component (missing ones are absent).

    :param components: name -> float32 vector of length ``DIM``
    """

    components: dict[str, np.ndarray] = field(default_factory=dict)

    def vector(self, name: str) -> np.ndarray:
        """The component's vector, or zeros when it is absent."""
        vec = self.components.get(name)
        return np.zeros(DIM, np.float32) if vec is None else vec

    def similarity(self, other: "Signature", weights=None) -> tuple[float, dict[str, float]]:
        """Weighted cosine similarity over this signature's components, and per component;
        each cosine is taken between unit vectors, so the result lies in [-1, 1]."""
        weights = resolve_weights(weights)
        per = {c: cosine(self.components[c], other.vector(c)) for c in self.components}
        total = sum(weights[c] for c in per) or 1.0
        return sum(weights[c] * s for c, s in per.items()) / total, per


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine of two vectors (0 when either is zero or not finite), within [-1, 1]."""
    a, b = _unit(np.asarray(a, np.float32)), _unit(np.asarray(b, np.float32))
    return 0.0 if a is None or b is None else float(np.clip(a @ b, -1.0, 1.0))


def unit_component(name: str, vec) -> np.ndarray:
    """A component as stored: ``vec`` scaled to unit length, as float32 of length ``DIM``.

    Matching scores dot products, so a longer vector would score beyond the metric's [-1, 1]
    and take every match; it is normalised here, and what cannot be normalised is refused.

    :raises ValueError: wrong length, NaN or infinite values, or a zero vector
    """
    vec = np.asarray(vec, np.float32)
    if vec.shape != (DIM,):
        raise ValueError(f"signature component {name} must be {DIM} float32 values, got shape "
                         f"{vec.shape}")
    if not np.isfinite(vec).all():
        raise ValueError(f"signature component {name} holds NaN or infinite values")
    unit = _unit(vec)
    if unit is None:
        raise ValueError(f"signature component {name} is a zero vector (or too large to scale)")
    return unit


def resolve_weights(weights=None) -> dict[str, float]:
    """Default weights updated with ``weights`` (unknown names and negative or non-finite
    weights are an error: a negative weight would let similarity leave [-1, 1])."""
    out = dict(DEFAULT_WEIGHTS)
    for name, value in (weights or {}).items():
        if name not in out:
            raise ValueError(f"Unknown signature component {name!r}; use one of {COMPONENTS}.")
        value = float(value)
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"The weight of {name} must be a finite number >= 0, got {value}; "
                             "use e.g. 0.5 (0 ignores the component).")
        out[name] = value
    return out


@lru_cache(maxsize=16)
def _projection(kind: str, raw_dim: int) -> np.ndarray:
    seed = zlib.crc32(f"chorus-signature:{kind}:{raw_dim}".encode())
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((raw_dim, DIM)) / np.sqrt(DIM)).astype(np.float32)


def _unit(vec: np.ndarray) -> np.ndarray | None:
    norm = float(np.linalg.norm(vec))
    return None if norm < 1e-12 or not np.isfinite(norm) else (vec / norm).astype(np.float32)


def _project(kind: str, vec: np.ndarray) -> np.ndarray | None:
    vec = _unit(np.asarray(vec, np.float32).ravel())
    return None if vec is None else _unit(vec @ _projection(kind, vec.size))


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def clip_vector(clip_vision) -> np.ndarray | None:
    """CLIP-vision output (object with ``penultimate_hidden_states``/``image_embeds`` or a tensor)."""
    hidden = getattr(clip_vision, "penultimate_hidden_states", None)
    if hidden is None and not hasattr(clip_vision, "shape"):
        hidden = getattr(clip_vision, "image_embeds", None)
    x = _to_numpy(clip_vision if hidden is None else hidden)
    if x.ndim == 3:  # [B, tokens, width]: class token + mean of patch tokens
        x = np.concatenate([x[0, 0], x[0, 1:].mean(axis=0)])
        return _project("clip-hidden", x)
    return _project("clip-embeds", x.reshape(-1))


def text_vector(text) -> np.ndarray | None:
    """Text conditioning ``[1, L, D]`` (or ComfyUI's ``[[tensor, dict]]``)."""
    if isinstance(text, (list, tuple)):
        text = text[0][0]
    x = _to_numpy(text)
    x = x.reshape(-1, x.shape[-1])
    rows = x[np.abs(x).sum(axis=1) > 0]  # padding rows are exact zeros
    return _project("text", rows.mean(axis=0)) if len(rows) else None


def layout_vector(start_latent) -> np.ndarray | None:
    """Start-frame latent ``[16, T, H, W]`` or ``[1, 16, T, H, W]`` -> centred 8x8 map per channel."""
    x = _to_numpy(start_latent)
    if x.ndim == 5:
        x = x[0]
    if x.ndim != 4:
        raise ValueError(f"start_latent must be [C, T, H, W] or [1, C, T, H, W], got {x.shape}.")
    frame = x[:, 0]
    c, h, w = frame.shape
    ys = np.linspace(0, h, LAYOUT_GRID + 1).astype(int)
    xs = np.linspace(0, w, LAYOUT_GRID + 1).astype(int)
    pooled = np.stack([[frame[:, ys[i]:max(ys[i + 1], ys[i] + 1), xs[j]:max(xs[j + 1], xs[j] + 1)]
                        .mean(axis=(1, 2)) for j in range(LAYOUT_GRID)]
                       for i in range(LAYOUT_GRID)], axis=-1)  # [8, C, 8]
    pooled = pooled.transpose(1, 0, 2)  # [C, 8, 8]
    pooled -= pooled.mean(axis=(1, 2), keepdims=True)
    # Where the content is, not what colour it has: the channel norm of each cell's deviation
    # from the frame mean. Two subjects at one spot then share a layout, as their masks do.
    energy = np.sqrt((pooled**2).sum(axis=0))  # [8, 8]
    return _project("layout", energy - energy.mean())


def build_signature(clip_vision=None, text=None, start_latent=None) -> Signature:
    """Build a request signature from the parts of an I2V request that are present.

    :param clip_vision: CLIP-vision output: penultimate hidden states ``[1, 257, 1280]``,
        ``image_embeds`` ``[1, 1024]``, or an object carrying either
    :param text: positive text conditioning ``[1, L, 4096]``
    :param start_latent: start-frame latent ``[16, T, H, W]`` or ``[1, 16, T, H, W]``
    :raises ValueError: when no component is given
    """
    parts = {"clip": clip_vector(clip_vision) if clip_vision is not None else None,
             "text": text_vector(text) if text is not None else None,
             "layout": layout_vector(start_latent) if start_latent is not None else None}
    comps = {k: v for k, v in parts.items() if v is not None}
    if not comps:
        raise ValueError("A signature needs at least one of clip_vision, text or start_latent "
                         "(non-zero); pass the CLIP-vision output of the start image.")
    return Signature(comps)
