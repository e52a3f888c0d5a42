"""Masks of one bank entry, decoded layer by layer only when a sampler step asks for them."""

from __future__ import annotations

import numpy as np

from . import validation
from .encoding import decode_block_map, decode_packed_block_map
from .records import LatentLayout, Schedule


class EntryMasks:
    """Decoded-on-demand masks of one entry.

    :param entry_id: the entry
    :param schedule: the schedule the masks were recorded under
    :param layout: the latent layout
    :param on_corrupt: called with a reason when a layer set cannot be decoded or is
        invalid (shape, empty query row); the bank's callback quarantines the entry and
        raises BankEntryCorrupt. Without it (a cached prior) decoding errors propagate as is.
    """

    def __init__(self, entry_id: str, schedule: Schedule, layout: LatentLayout,
                 tensors: dict, meta: dict, on_corrupt=None):
        self.entry_id, self.schedule, self.layout = entry_id, schedule, layout
        self._tensors, self._meta, self._on_corrupt = tensors, meta, on_corrupt
        self.shape = tuple(int(x) for x in meta["shape"].split(","))  # (S, L, H, nq, nk)

    @property
    def step_buckets(self) -> list[tuple[int, int]]:
        return self.schedule.step_buckets

    def block_map_numpy(self, bucket_index: int, layer: int) -> np.ndarray:
        """Bool numpy ``[H, nq, nk]`` for one step bucket and layer, checked (no empty row).

        :raises IndexError: bucket or layer out of range
        :raises BankEntryCorrupt: the stored map cannot be decoded or is invalid
        """
        return self._decoded(bucket_index, layer, decode_block_map, validation.check_block_map)

    def packed_block_map_or_reason(self, bucket_index: int, layer: int) -> tuple:
        """``(packed, None)`` as :meth:`packed_block_map` gives, or ``(None, reason)`` when the layer
        set is unusable, without touching the bank: safe on any thread, several at once (the
        hit's decode pool). The caller hands a reason to :meth:`report_corrupt` on one thread.

        :raises IndexError: bucket or layer out of range
        """
        return self._attempt(bucket_index, layer, decode_packed_block_map, validation.check_packed_block_map)

    def report_corrupt(self, reason: str) -> None:
        """Quarantine the entry for ``reason`` (or skip it, read-only) and raise BankEntryCorrupt;
        ValueError when the entry has no bank behind it (a cached prior)."""
        if self._on_corrupt is None:
            raise ValueError(reason)
        self._on_corrupt(reason)  # quarantines (or skips, read-only) and raises BankEntryCorrupt
        raise AssertionError("on_corrupt must raise")

    def _decoded(self, bucket_index: int, layer: int, decode, check) -> np.ndarray:
        # checked whatever the source: a prior's maps reach the kernel as an entry's do
        maps, reason = self._attempt(bucket_index, layer, decode, check)
        if reason is not None:
            self.report_corrupt(reason)
        return maps

    def _attempt(self, bucket_index: int, layer: int, decode, check) -> tuple:
        self._check_range(bucket_index, layer)
        try:
            maps = decode(self._tensors, self._meta, bucket_index, layer)
            check(maps, self.shape[2:])
            return maps, None
        except Exception as exc:  # ValueError (bounded decode, checks), zlib.error, IndexError
            return None, f"bucket {bucket_index} layer {layer} unusable: {type(exc).__name__}: {exc}"

    def _check_range(self, bucket_index: int, layer: int) -> None:
        s_count, layers = self.shape[:2]
        if not (0 <= bucket_index < s_count and 0 <= layer < layers):
            raise IndexError(f"bucket {bucket_index} / layer {layer} out of range for an entry "
                             f"with {s_count} buckets and {layers} layers.")

    def packed_block_map(self, bucket_index: int, layer: int) -> np.ndarray:
        """Packed bits uint8 ``[H, nq, ceil(nk / 8)]`` of one step bucket and layer, checked (no
        empty row; padding cleared): what a hit uploads, about 10x cheaper than :meth:`block_map_numpy`
        plus live lists on the host.

        :raises IndexError: bucket or layer out of range
        :raises BankEntryCorrupt: the stored map cannot be decoded or is invalid
        """
        return self._decoded(bucket_index, layer, decode_packed_block_map, validation.check_packed_block_map)

    def block_map(self, bucket_index: int, layer: int):
        """Bool torch tensor ``[H, nq, nk]`` for one step bucket and layer (about 15 ms CPU).

        :param bucket_index: index into :attr:`step_buckets`
        :param layer: transformer block index
        """
        import torch

        return torch.from_numpy(self.block_map_numpy(bucket_index, layer))
