"""Sums that pin what a testbed request renders, for tests that check the workload is unchanged.

A byte checksum of the rendered tensors is not usable: torch's CPU kernels round differently on
different processors (the same code gave other last bits on an Intel Xeon than on an AMD EPYC).
These sums, compared at a relative 1e-6, still change when any value, pixel or frame changes.
"""

import torch


def request_sums(tensors) -> list:
    """sum |video|, sum video^2, sum |clip_vision|, sum |text|, sum video x position (flat index / numel)."""
    video = tensors.video.double()
    position = torch.arange(video.numel(), dtype=torch.float64).reshape(video.shape) / video.numel()
    return [float(x) for x in (video.abs().sum(), (video * video).sum(), tensors.clip_vision.double().abs().sum(),
                               tensors.text.double().abs().sum(), (video * position).sum())]
