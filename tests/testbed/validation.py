"""A held-out loss for training: the flow loss on clips of subjects no training clip shows, at
fixed noise levels and fixed noise, so it is comparable between steps and between chunks.

Training samples a fixed pool (templates x subjects x layouts, generated once per chunk), so the
training loss keeps falling while the model learns those clips by heart (entropy16k: 0.18 at step
2,000, 0.03 at 6,000); the held-out loss is what says when a design has reached its plateau
(issue 23, item 2). It uses the training families with new subjects, on one training layout and
one layout no training clip uses: it measures generalising to new pictures and placements, not
to new motions (the held-out family is the quality table's).
"""

from __future__ import annotations

import torch

from .models import flow_loss_at, make_batch
from chorus_core.testbed.workload import I2VRequest

VALIDATION_SIGMAS = (0.1, 0.3, 0.5, 0.7, 0.9)
# Training uses subjects 0.., the quality table 100-399. The workload's seed hash is weak (subject
# 503 renders as 260 does), so the base is the first from 500 whose subjects' seeds collide with
# none of 0-15 and 100-499 (tests/test_testbed_sharp.py checks it).
VALIDATION_SUBJECT_BASE = 584
VALIDATION_SEED = 4242


def validation_requests(config, size) -> list:
    """One clip per training family and layout: layout 0 (trained on) and the first layout past
    ``train_layouts`` (never trained on), each family with a subject of its own."""
    frames, height, width = size
    layouts = (0, config.train_layouts)
    return [I2VRequest(template, VALIDATION_SUBJECT_BASE + i, layout, frames, height, width, texture=config.texture)
            for i, template in enumerate(config.train_templates) for layout in layouts]


class ValidationSet:
    """Held-out long clips with their noise drawn once; ``loss(model, ...)`` draws no random numbers,
    so measuring it leaves an exact resume exact."""

    def __init__(self, config, device: str, workers: int = 1):
        self.batch = make_batch(validation_requests(config, config.long_size), workers=workers).to(device)
        gen = torch.Generator().manual_seed(VALIDATION_SEED)
        self.noise = torch.randn(self.batch.x0.shape, generator=gen).to(self.batch.x0.device)
        self.chunk = max(1, config.batch_long)  # as many clips per forward as a training step holds

    def __len__(self) -> int:
        return len(self.batch.x0)

    @torch.no_grad()
    def loss(self, model, transformer_options, autocast: bool) -> float:
        """Mean velocity MSE over the clips and ``VALIDATION_SIGMAS``."""
        device = self.batch.x0.device
        total, count = 0.0, 0
        for start in range(0, len(self), self.chunk):
            idx = torch.arange(start, min(start + self.chunk, len(self)), device=device)
            part, noise = self.batch.select(idx), self.noise[idx]
            for sigma in VALIDATION_SIGMAS:
                t = torch.full((len(idx),), sigma, device=device)
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                    total += float(flow_loss_at(model, part, t, noise, transformer_options)) * len(idx)
                count += len(idx)
        return total / count
