"""Sums that pin what a testbed request renders, for tests that check the workload is unchanged.

A byte checksum of the rendered tensors is not usable: torch's CPU kernels round differently on
different processors (the same code gave other last bits on an Intel Xeon than on an AMD EPYC).
These sums, compared at a relative 1e-6 (absolute 1e-4), still change when a value, a pixel, a
frame or a row changes or moves, or a sign flips: besides plain sums they hold each tensor's
projection onto fixed random weights.
"""

import pytest
import torch

TOLERANCE = {"rel": 1e-6, "abs": 1e-4}


def _projection(x: torch.Tensor, seed: int) -> float:
    weights = torch.randn(x.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return float((x.double().flatten() * weights).sum())


def request_sums(tensors) -> list:
    """sum |video|, sum video^2, sum |clip_vision|, sum |text|, sum video x position (flat index /
    numel), then the projections of video, first_frame, clip_vision and text (seeds 0-3)."""
    video = tensors.video.double()
    position = torch.arange(video.numel(), dtype=torch.float64).reshape(video.shape) / video.numel()
    plain = [video.abs().sum(), (video * video).sum(), tensors.clip_vision.double().abs().sum(),
             tensors.text.double().abs().sum(), (video * position).sum()]
    projections = [_projection(getattr(tensors, name), seed)
                   for seed, name in enumerate(("video", "first_frame", "clip_vision", "text"))]
    return [float(x) for x in plain] + projections


def assert_renders(tensors, expected: list) -> None:
    assert request_sums(tensors) == pytest.approx(expected, **TOLERANCE)
