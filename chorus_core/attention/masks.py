"""Block selection: from block attention mass to bool block maps, and recording them during a run.

A block map is a bool tensor ``[..., nq, nk]`` (usually ``[B, H, nq, nk]``; True = the query
block attends to the key block), the common currency between recording, the bank, the
predictors and the block-sparse kernel. Every row keeps at least one block (the kernel needs
it), the query block's own (diagonal) block by default, and any given sink key blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .._siblings import import_sibling
from ..quality import mass_recall

__all__ = [
    "select_blocks",
    "keep_top_counts",
    "forced_blocks",
    "density_bounds",
    "first_frame_blocks",
    "check_block_map",
    "MaskRecorder",
    "RecordedMasks",
    "pack_bits",
    "unpack_bits",
]


def density_bounds(nk: int, min_density: float = 0.0, max_density: float = 1.0) -> tuple[int, int]:
    """Densities (shares of a row's ``nk`` key blocks) -> kept-block counts ``(lo, hi)``, 1 <= lo <= hi."""
    if not 0.0 <= min_density <= max_density <= 1.0:
        raise ValueError(f"need 0 <= min_density <= max_density <= 1, got {min_density}, {max_density}")
    lo = max(1, math.ceil(min_density * nk - 1e-9))
    hi = max(lo, math.floor(max_density * nk + 1e-9))
    return lo, hi


def forced_blocks(
    nq: int, nk: int, keep_diagonal: bool = True, sink_blocks: Optional[Sequence[int]] = None, device=None
) -> torch.Tensor:
    """bool ``[nq, nk]``: blocks kept whatever their mass (the diagonal and the sink columns)."""
    forced = torch.zeros(nq, nk, dtype=torch.bool, device=device)
    if keep_diagonal:
        # Equal block sizes give nq == nk; otherwise map each query block to the key block at its start.
        rows = torch.arange(nq, device=device)
        forced[rows, (rows * nk) // nq] = True
    if sink_blocks is not None and len(sink_blocks):
        sinks = torch.as_tensor(list(sink_blocks), dtype=torch.long, device=device)
        if int(sinks.min()) < 0 or int(sinks.max()) >= nk:
            raise ValueError(f"sink_blocks must lie in [0, {nk}), got {list(sink_blocks)}")
        forced[:, sinks] = True
    return forced


def first_frame_blocks(tokens_per_frame: int, block_size: int = 128) -> list[int]:
    """Key blocks that hold any token of the first latent frame (the I2V conditioning frame)."""
    return list(range(math.ceil(tokens_per_frame / block_size)))


def keep_top_counts(scores: torch.Tensor, counts: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the ``counts`` highest-scoring blocks, forced blocks first.

    scores ``[..., nq, nk]``, counts int ``[..., nq]``, forced bool broadcastable -> bool ``[..., nq, nk]``.
    Forced blocks are kept even where they outnumber ``counts``.
    """
    order = _forced_first_order(scores, forced)
    return _keep_prefix(order, torch.maximum(counts, forced.sum(-1)))


def _forced_first_order(scores: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """Per row, key-block ids by descending score with the forced blocks in front."""
    ranked = torch.where(forced, torch.inf, scores.float())
    return torch.sort(ranked, dim=-1, descending=True, stable=True).indices


def _keep_prefix(order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """bool map keeping ``order[..., :counts]`` of each row (order ``[..., nk]``, counts ``[...]``)."""
    keep_sorted = torch.arange(order.shape[-1], device=order.device) < counts[..., None]
    return torch.zeros(order.shape, dtype=torch.bool, device=order.device).scatter_(-1, order, keep_sorted)


def select_blocks(
    mass: torch.Tensor,
    top_p: float = 0.9,
    min_density: float = 0.0,
    max_density: float = 1.0,
    keep_diagonal: bool = True,
    sink_blocks: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Top-p block selection. mass ``[..., nq, nk]`` (rows sum to 1) -> bool ``[..., nq, nk]``.

    Per row, take the forced blocks (diagonal, sinks), then blocks by descending mass, until the
    kept mass reaches ``top_p``; the count is then clamped to ``[min_density, max_density] * nk``
    (rounded to whole blocks, at least 1). Forced blocks are always kept, even past the maximum.
    """
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must lie in [0, 1], got {top_p}")
    nq, nk = mass.shape[-2:]
    forced = forced_blocks(nq, nk, keep_diagonal, sink_blocks, mass.device)
    order = _forced_first_order(mass, forced)
    sorted_mass = mass.float().gather(-1, order)
    before = sorted_mass.cumsum(-1) - sorted_mass  # mass kept before each position
    # Positions with before < top_p form a prefix; keeping it reaches top_p.
    needed = (before < top_p).sum(-1)
    lo, hi = density_bounds(nk, min_density, max_density)
    return _keep_prefix(order, torch.maximum(needed.clamp(lo, hi), forced.sum(-1)))


def check_block_map(block_map: torch.Tensor, nq: Optional[int] = None, nk: Optional[int] = None) -> None:
    """Raise ValueError unless ``block_map`` is a bool ``[..., nq, nk]`` map with no empty row."""
    if block_map.dtype != torch.bool:
        raise ValueError(f"a block map is a bool tensor, got {block_map.dtype}")
    shape = tuple(block_map.shape)
    if len(shape) < 2 or (nq is not None and shape[-2] != nq) or (nk is not None and shape[-1] != nk):
        raise ValueError(f"block map must be [..., {nq}, {nk}], got {tuple(block_map.shape)}")
    if not bool(block_map.any(-1).all()):
        raise ValueError("block map has a query block with no key block: keep the diagonal or fall back to dense")


# --------------------------------------------------------------------------------------------
# Recording during a run
# --------------------------------------------------------------------------------------------


def pack_bits(block_map: torch.Tensor) -> torch.Tensor:
    """bool ``[..., nk]`` -> uint8 ``[..., ceil(nk / 8)]``, most significant bit first (``np.packbits`` order)."""
    nk = block_map.shape[-1]
    padded = torch.nn.functional.pad(block_map.to(torch.uint8), (0, (-nk) % 8))
    # made on the device (a host-built tensor would cost a blocking copy per call)
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=block_map.device)
    return (padded.unflatten(-1, (-1, 8)) << shifts).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, nk: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    bits = (packed[..., None] >> shifts) & 1
    return bits.flatten(-2)[..., :nk].bool()


@dataclass
class RecordedMasks:
    """What ``MaskRecorder.finish`` returns: packed block maps on the host, and their recall."""

    packed: torch.Tensor  # uint8 [S, L, H, nq, ceil(nk / 8)] (see pack_bits)
    nk: int
    recall: torch.Tensor  # float [S, L, H]: selected masks' recall against the recorded mass
    mean_recall: float
    density: float  # share of blocks kept over all buckets, layers and heads
    seq_len: int
    block_size: int

    @property
    def block_maps(self) -> torch.Tensor:
        """bool ``[S, L, H, nq, nk]`` (unpacked on demand: 1.7 GB at 720p-14B, so only where needed)."""
        return unpack_bits(self.packed, self.nk)


class MaskRecorder:
    """Accumulates block attention mass per (step bucket, layer) during a run and selects masks on the fly.

    Call ``record(layer, step, q, k)`` from the self-attention override; steps outside every
    bucket cost nothing. The mass of a bucket is the mean over its recorded steps and over the
    batch (cond and uncond share one mask). When a layer's last recorded step of a bucket has
    been seen, its mean is turned into a block map with ``select_blocks`` at once, on the
    device of ``q``, and kept as packed bits; so only the accumulators of the bucket being
    recorded exist at any time (float16 on a GPU: 1.1 GB for 40 layers at 720p-14B) and
    ``finish()`` has almost nothing left to do.

    :param step_buckets: step indices per bucket, e.g. ``[[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]``.
    :param query_stride: estimate block mass from every ``query_stride``-th query (see
        ``kernels.block_mass.block_mass``); 1/stride of the recording cost.
    :param accumulate_dtype: dtype of the running sums (default: float16 on CUDA, float32 elsewhere).
    """

    def __init__(
        self,
        num_layers: int,
        step_buckets: Sequence[Sequence[int]],
        block_size: int = 128,
        top_p: float = 0.9,
        min_density: float = 0.0,
        max_density: float = 1.0,
        keep_diagonal: bool = True,
        sink_blocks: Optional[Sequence[int]] = None,
        query_stride: int = 1,
        accumulate_dtype: Optional[torch.dtype] = None,
    ):
        self.num_layers, self.block_size, self.query_stride = num_layers, block_size, query_stride
        self.select_kwargs = dict(
            top_p=top_p, min_density=min_density, max_density=max_density,
            keep_diagonal=keep_diagonal, sink_blocks=sink_blocks,
        )  # fmt: skip
        self.bucket_of_step = {}
        for s, steps in enumerate(step_buckets):
            for step in steps:
                if step in self.bucket_of_step:
                    raise ValueError(f"step {step} is in more than one bucket")
                self.bucket_of_step[int(step)] = s
        self.last_step = [max(steps) if len(steps) else None for steps in step_buckets]
        self.num_buckets = len(step_buckets)
        self.accumulate_dtype = accumulate_dtype
        self.seq_len: Optional[int] = None
        self._sums: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, layer) -> [H, nq, nk], in flight
        self._counts: dict[tuple[int, int], int] = {}
        self._done: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # packed, recall, kept

    def bucket(self, step: int) -> Optional[int]:
        """The bucket that records ``step``, or None when the step is not recorded."""
        return self.bucket_of_step.get(int(step))

    def record(self, layer: int, step: int, q: torch.Tensor, k: torch.Tensor, heads: Optional[int] = None) -> None:
        """Add the block mass of one self-attention call. q, k ``[B, N, H*D]`` (with heads) or ``[B, H, N, D]``."""
        s = self.bucket(step)
        if s is None:
            return
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        block_mass = import_sibling("kernels.block_mass")
        n = block_mass.to_bhnd(q, heads).shape[2]
        if self.seq_len is None:
            self.seq_len = n
        elif n != self.seq_len:
            raise ValueError(f"recorded N={self.seq_len} before, got N={n}: one recorder per latent grid")
        key = (s, layer)
        if key in self._done:
            return  # a sampler that evaluates a step twice (e.g. heun): the bucket is already selected
        mass = block_mass.block_mass(q, k, heads, self.block_size, query_stride=self.query_stride).mean(0)  # [H, nq, nk]
        dtype = self.accumulate_dtype or (torch.float16 if mass.is_cuda else torch.float32)
        if key in self._sums:
            self._sums[key] += mass.to(dtype)
        else:
            self._sums[key] = mass.to(dtype)
        self._counts[key] = self._counts.get(key, 0) + 1
        if step == self.last_step[s]:
            self._select(key)

    def _select(self, key: tuple[int, int]) -> None:
        """Turn a finished accumulator into packed bits and free it."""
        mean = self._sums.pop(key).float() / self._counts[key]  # [H, nq, nk]
        block_map = select_blocks(mean, **self.select_kwargs)
        recall = mass_recall(mean, block_map, self.seq_len, self.block_size)
        self._done[key] = (pack_bits(block_map), recall, block_map.sum(dtype=torch.int64))

    def finish(self) -> RecordedMasks:
        """The selected masks (packed, on the host) plus their recall against the recorded mass."""
        for key in list(self._sums):
            self._select(key)  # buckets whose last recorded step never came (fewer steps run)
        missing = [(s, l) for s in range(self.num_buckets) for l in range(self.num_layers) if (s, l) not in self._done]
        if missing:
            raise ValueError(
                f"no mass recorded for {len(missing)} (bucket, layer) pairs, first {missing[0]}: "
                "record at least one step of every bucket on every layer"
            )
        keys = [(s, l) for s in range(self.num_buckets) for l in range(self.num_layers)]
        packed = torch.stack([self._done[k][0] for k in keys])
        recall = torch.stack([self._done[k][1] for k in keys]).float()
        kept = torch.stack([self._done[k][2] for k in keys]).sum()
        self._done.clear()
        heads, nq = packed.shape[1:3]
        nk = math.ceil(self.seq_len / self.block_size)
        density = float(kept) / (len(keys) * heads * nq * nk)  # the one host sync of finish()
        return RecordedMasks(packed.unflatten(0, (self.num_buckets, self.num_layers)).cpu(), nk,
                             recall.unflatten(0, (self.num_buckets, self.num_layers)).cpu(),
                             float(recall.mean()), density, self.seq_len, self.block_size)
