"""Procedural I2V requests in Wan's 16-channel latent space, in families of known similarity.

A request = effect template (a motion program with its own text embedding) x subject
(sprite shape, texture, colour) x layout (position, size, background). Requests that share
template and layout differ only in the subject's look; a different template moves the
subject differently, so where attention must look differs too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TEMPLATES = ("pan", "zoom", "orbit", "bounce", "fade")
# "plain": the original smooth sprites; "detailed": see render_detailed_video; "multi": render_multi_video
TEXTURES = ("plain", "detailed", "multi")
CLIP_TOKENS, CLIP_DIM = 257, 1280
TEXT_DIM = 4096
LATENT_CHANNELS = 16


@dataclass(frozen=True)
class I2VRequest:
    """Identity of one procedural request; equal fields give identical tensors."""

    template: str = "pan"
    subject: int = 0
    layout: int = 0
    frames: int = 5   # latent frames (video frames = 4 * (frames - 1) + 1)
    height: int = 16  # latent height (pixels / 8)
    width: int = 16
    text_tokens: int = 16
    texture: str = "plain"  # "detailed" / "multi": later frames copy high-frequency texture from the first

    def __post_init__(self):
        if self.template not in TEMPLATES:
            raise ValueError(f"unknown template {self.template!r}; choose one of {', '.join(TEMPLATES)}")
        if self.texture not in TEXTURES:
            raise ValueError(f"unknown texture {self.texture!r}; choose one of {', '.join(TEXTURES)}")


@dataclass
class RequestTensors:
    video: torch.Tensor        # [16, T, H, W] target latent video
    first_frame: torch.Tensor  # [16, 1, H, W] the I2V condition
    clip_vision: torch.Tensor  # [257, 1280] CLIP-vision stand-in derived from the first frame
    text: torch.Tensor         # [L, 4096] template text embedding


def _stable_seed(*parts) -> int:
    """A seed that is stable across processes (``hash`` of str is salted per process)."""
    text = "|".join(str(p) for p in parts)
    return sum((i + 1) * ord(c) * 7919 for i, c in enumerate(text)) % (2**31)


def _generator(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(_stable_seed(*parts))


def _subject_look(subject: int, size: int):
    """Shape mask on a [size, size] grid and a 16-channel colour for a subject id."""
    g = _generator("subject", subject)
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
    radius = (xx**2 + yy**2).sqrt()
    shapes = [radius < 0.9, (xx.abs() < 0.8) & (yy.abs() < 0.8), (radius < 0.9) & (radius > 0.45),
              (xx.abs() < 0.3) | (yy.abs() < 0.3)]
    shape = shapes[subject % len(shapes)].float()
    frequency = 1 + subject % 3
    texture = 0.75 + 0.25 * torch.sin(frequency * math.pi * (xx + yy))
    colour = torch.randn(LATENT_CHANNELS, generator=g)
    return shape * texture, colour


def _trajectory(template: str, t: float, x0: float, y0: float):
    """Position offset, scale and amplitude of the subject at time t in [0, 1]."""
    if template == "pan":
        return x0 + 0.5 * t, y0, 1.0, 1.0
    if template == "zoom":
        return x0, y0, 1.0 + 1.2 * t, 1.0
    if template == "orbit":
        return x0 + 0.3 * math.cos(2 * math.pi * t), y0 + 0.3 * math.sin(2 * math.pi * t), 1.0, 1.0
    if template == "bounce":
        return x0, y0 - 0.5 * abs(math.sin(2 * math.pi * t)), 1.0, 1.0
    return x0, y0, 1.0, 1.0 - 0.9 * t  # fade


def _layout(layout: int, height: int, width: int):
    g = _generator("layout", layout)
    x0, y0 = (0.2 + 0.4 * torch.rand(2, generator=g)).tolist()
    size = 0.25 + 0.15 * float(torch.rand(1, generator=g))
    background = 0.5 * torch.randn(LATENT_CHANNELS, generator=g)
    gradient = torch.linspace(-0.5, 0.5, width).expand(height, width)
    return x0, y0, size, background[:, None, None] * (1 + gradient)


def render_video(request: I2VRequest) -> torch.Tensor:
    """The request's latent video [16, T, H, W]: a textured sprite moving over a background."""
    if request.texture == "detailed":
        return render_detailed_video(request)
    if request.texture == "multi":
        return render_multi_video(request)
    T, H, W = request.frames, request.height, request.width
    x0, y0, size, background = _layout(request.layout, H, W)
    video = background[:, None].repeat(1, T, 1, 1).clone()
    for f in range(T):
        t = f / max(T - 1, 1)
        x, y, scale, amplitude = _trajectory(request.template, t, x0, y0)
        side = max(2, int(round(size * scale * min(H, W))))
        look, colour = _subject_look(request.subject, side)
        top, left = int(round(y * H - side / 2)), int(round(x * W - side / 2))
        _paste(video[:, f], look[None] * colour[:, None, None] * amplitude, top, left)
    return video


def _detailed_subject(subject: int, side: int) -> torch.Tensor:
    """A subject [16, side, side] with per-pixel random texture (zero outside its shape).

    The texture is white noise per latent pixel and channel, so a later frame can only reproduce
    it by looking it up in the first frame: no smooth pattern a model could extrapolate locally.
    """
    g = _generator("detailed-subject", subject)
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, side), torch.linspace(-1, 1, side), indexing="ij")
    radius = (xx**2 + yy**2).sqrt()
    shapes = [radius < 0.95, (xx.abs() < 0.85) & (yy.abs() < 0.85), (radius < 0.95) & (radius > 0.35),
              (xx.abs() < 0.4) | (yy.abs() < 0.4)]
    colour = torch.randn(LATENT_CHANNELS, generator=g)
    texture = 1.2 * torch.randn(LATENT_CHANNELS, side, side, generator=g)
    return shapes[subject % len(shapes)].float()[None] * (colour[:, None, None] + texture)


def _detailed_background(layout: int, height: int, width: int) -> torch.Tensor:
    """A static background [16, H, W]: a layout colour plus per-pixel texture (copied, never moved)."""
    g = _generator("detailed-background", layout)
    colour = 0.5 * torch.randn(LATENT_CHANNELS, generator=g)
    return colour[:, None, None] + 0.6 * torch.randn(LATENT_CHANNELS, height, width, generator=g)


def render_detailed_video(request: I2VRequest) -> torch.Tensor:
    """The "detailed" family: a white-noise-textured subject over a white-noise-textured background.

    Every later frame is the first frame's background with the first frame's subject texture
    pasted (resampled for zoom, dimmed for fade) where the template moves it. Predicting a later
    frame means copying exact detail from the start frame at a place that depends on the
    template (motion) and the layout (start position, size): attention has to find the subject.
    """
    T, H, W = request.frames, request.height, request.width
    x0, y0, size, _ = _layout(request.layout, H, W)
    background = _detailed_background(request.layout, H, W)
    base_side = max(2, int(round(size * min(H, W))))
    sprite = _detailed_subject(request.subject, base_side)
    video = background[:, None].repeat(1, T, 1, 1).clone()
    for f in range(T):
        t = f / max(T - 1, 1)
        x, y, scale, amplitude = _trajectory(request.template, t, x0, y0)
        side = max(2, int(round(size * scale * min(H, W))))
        # nearest-neighbour resampling keeps the texture's values (a zoom repeats pixels, never blurs)
        look = sprite if side == base_side else torch.nn.functional.interpolate(sprite[None], size=(side, side),
                                                                                mode="nearest")[0]
        top, left = int(round(y * H - side / 2)), int(round(x * W - side / 2))
        _replace(video[:, f], look, amplitude, top, left)
    return video


MULTI_OBJECTS = 3


def _multi_start(layout: int, index: int):
    """Start centre (x, y) of object ``index`` of a layout, in [0.15, 0.85]."""
    return (0.15 + 0.7 * torch.rand(2, generator=_generator("multi-start", layout, index))).tolist()


def _multi_motion(template: str, layout: int, index: int, t: float):
    """Centre (x, y), scale and amplitude of object ``index`` at time t in [0, 1].

    Object 0 follows the template over twice its usual path; the others move in straight lines at
    velocities seeded by (template, layout, object), so every object moves differently. Centres wrap
    round the frame: an object leaving one side comes back in on the other.
    """
    x0, y0 = _multi_start(layout, index)
    if index == 0:
        x, y, scale, amplitude = _trajectory(template, t, x0, y0)
        x, y = x0 + 2 * (x - x0), y0 + 2 * (y - y0)
    else:
        vx, vy = (1.2 * torch.rand(2, generator=_generator("multi-velocity", template, layout, index)) - 0.6).tolist()
        x, y, scale, amplitude = x0 + vx * t, y0 + vy * t, 1.0, 1.0
    return x % 1.0, y % 1.0, scale, amplitude


def _multi_occluder(layout: int, height: int, width: int):
    """A static textured vertical bar [16, H, w] in front of every object, and its left column."""
    g = _generator("multi-occluder", layout)
    bar_width = max(1, round(0.1 * width))
    left = int(round((0.3 + 0.4 * float(torch.rand(1, generator=g))) * width - bar_width / 2))
    colour = torch.randn(LATENT_CHANNELS, generator=g)
    return colour[:, None, None] + 0.8 * torch.randn(LATENT_CHANNELS, height, bar_width, generator=g), left


def render_multi_video(request: I2VRequest) -> torch.Tensor:
    """The "multi" family: the detailed family's look-ups made harder.

    Three white-noise-textured objects over a white-noise background, each moving differently
    (``_multi_motion``) over large distances, drawn in a fixed depth order (later objects cover
    earlier ones), and a static textured bar in front of them all: an object passing behind it or
    another object disappears and reappears, so its detail must come from the first frame (or the
    last frame it was seen in), far from where it is now.
    """
    T, H, W = request.frames, request.height, request.width
    _, _, size, _ = _layout(request.layout, H, W)
    background = _detailed_background(request.layout, H, W)
    bar, bar_left = _multi_occluder(request.layout, H, W)
    base_side = max(2, int(round(0.7 * size * min(H, W))))
    sprites = [_detailed_subject(MULTI_OBJECTS * request.subject + j, base_side) for j in range(MULTI_OBJECTS)]
    video = background[:, None].repeat(1, T, 1, 1).clone()
    for f in range(T):
        t = f / max(T - 1, 1)
        for j, sprite in enumerate(sprites):
            x, y, scale, amplitude = _multi_motion(request.template, request.layout, j, t)
            side = max(2, int(round(base_side * scale)))
            look = sprite if side == base_side else torch.nn.functional.interpolate(sprite[None], size=(side, side),
                                                                                    mode="nearest")[0]
            _replace(video[:, f], look, amplitude, int(round(y * H - side / 2)), int(round(x * W - side / 2)))
        video[:, f, :, bar_left:bar_left + bar.shape[-1]] = bar  # the bar lies inside the frame (0.25..0.75 W)
    return video


def _replace(frame: torch.Tensor, sprite: torch.Tensor, amplitude: float, top: int, left: int) -> None:
    """Cover frame [C, H, W] with sprite [C, s, s] where the sprite is non-zero (its shape), blending
    ``amplitude`` of it over the background, clipped at the borders."""
    _, H, W = frame.shape
    s = sprite.shape[-1]
    y0, x0, y1, x1 = max(top, 0), max(left, 0), min(top + s, H), min(left + s, W)
    if y1 > y0 and x1 > x0:
        part = sprite[:, y0 - top:y1 - top, x0 - left:x1 - left]
        inside = (part != 0).any(0, keepdim=True).float() * amplitude
        frame[:, y0:y1, x0:x1] = frame[:, y0:y1, x0:x1] * (1 - inside) + part * inside


def _paste(frame: torch.Tensor, sprite: torch.Tensor, top: int, left: int) -> None:
    """Add a sprite [C, s, s] to frame [C, H, W] at (top, left), clipped at the borders."""
    _, H, W = frame.shape
    s = sprite.shape[-1]
    y0, x0, y1, x1 = max(top, 0), max(left, 0), min(top + s, H), min(left + s, W)
    if y1 > y0 and x1 > x0:
        frame[:, y0:y1, x0:x1] += sprite[:, y0 - top:y1 - top, x0 - left:x1 - left]


def clip_vision_stand_in(first_frame: torch.Tensor) -> torch.Tensor:
    """A [257, 1280] CLIP-vision-like embedding of a latent first frame [16, 1, H, W].

    16 x 16 patch tokens plus a class token, through one fixed seeded projection, so similar
    frames give similar embeddings as real CLIP-vision features do.
    """
    patches = torch.nn.functional.adaptive_avg_pool2d(first_frame[:, 0][None], (16, 16))[0]
    tokens = patches.flatten(1).T  # [256, 16]
    projection = torch.randn(LATENT_CHANNELS, CLIP_DIM, generator=_generator("clip-projection")) / 4
    tokens = torch.tanh(tokens @ projection)
    return torch.cat([tokens.mean(0, keepdim=True), tokens], dim=0)


def template_text(template: str, tokens: int = 16) -> torch.Tensor:
    """The template's text conditioning [L, 4096] (a fixed embedding per template)."""
    return torch.randn(tokens, TEXT_DIM, generator=_generator("text", template)) * 0.2


def generate_request(request: I2VRequest) -> RequestTensors:
    """All tensors of one request; deterministic in the request's fields."""
    video = render_video(request)
    first = video[:, :1].clone()
    return RequestTensors(video=video, first_frame=first, clip_vision=clip_vision_stand_in(first),
                          text=template_text(request.template, request.text_tokens))


def i2v_conditioning(tensors: RequestTensors):
    """ComfyUI CONDITIONING (positive, negative) plus the empty latent, as WanImageToVideo makes them.

    The first latent frame is the condition (mask 0 there, 1 elsewhere); the CLIP-vision
    stand-in rides along as ``clip_vision_output``. Needs ComfyUI importable.
    """
    from comfy.clip_vision import Output

    video = tensors.video[None]  # [1, 16, T, H, W]
    concat = torch.zeros_like(video)
    concat[:, :, :1] = tensors.first_frame[None]
    mask = torch.ones((1, 1, *video.shape[2:]))
    mask[:, :, :1] = 0.0
    clip = Output()
    clip.penultimate_hidden_states = tensors.clip_vision[None]
    clip.image_embeds = tensors.clip_vision[None, 0, :1024]
    extras = {"concat_latent_image": concat, "concat_mask": mask, "clip_vision_output": clip}
    positive = [[tensors.text[None], dict(extras)]]
    negative = [[torch.zeros_like(tensors.text[None]), dict(extras)]]
    return positive, negative, {"samples": torch.zeros_like(video)}
