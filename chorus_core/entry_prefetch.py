"""A bank entry's masks, loaded off the critical path and served in the kernel's format.

A hit must cost nothing per request on the prompt's thread. :class:`EntryPrefetch` loads,
verifies and decodes the matched entry in a worker thread that starts before sampling (the dense
warm-up step hides it), turning each step bucket into live-block lists on the host. At the first
sparse call of a bucket every layer of it goes to the GPU (asynchronous copies from pinned memory);
every later call of that bucket reuses the same tensors, with no host sync, no validation and no
allocation.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional

import numpy as np
import torch

from ._siblings import import_sibling
from .mask_provider import PreparedMask


def live_lists(block_map: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bool ``[H, nq, nk]`` -> ascending key-block ids ``[H, nq, max_live]`` (0-padded) and counts int32 ``[H, nq]``.

    Ids are int16 (half the host memory and upload; Wan's 720p has 591 key blocks), int32 past 32,767.

    :raises ValueError: when a query block keeps no key block (the kernel needs one per row)
    """
    heads, nq, nk = block_map.shape
    counts = block_map.sum(-1, dtype=np.int32)
    if counts.size and counts.min() <= 0:
        h, r = np.argwhere(counts <= 0)[0]
        raise ValueError(f"mask has a query block with no key block (head {h}, query block {r}); "
                         "the entry cannot serve attention")
    flat = np.flatnonzero(block_map)  # row-major, so ids ascend within each row
    rows, cols = np.divmod(flat, nk)
    per_row = counts.ravel()
    first_slot = np.cumsum(per_row) - per_row
    slots = np.arange(flat.size) - np.repeat(first_slot, per_row)
    dtype = np.int16 if nk <= np.iinfo(np.int16).max else np.int32
    ids = np.zeros((heads * nq, max(1, int(per_row.max(initial=1)))), dtype=dtype)
    ids[rows, slots] = cols
    return ids.reshape(heads, nq, -1), counts


@dataclass
class HostBucket:
    """One step bucket of an entry, every layer, as host arrays ready for upload."""

    live_blocks: list  # per layer: int16/int32 [H, nq, max_live of that layer] (pinned when the run is on a GPU)
    live_counts: list  # per layer: int32 [H, nq]
    densities: list[float]  # per layer: share of blocks kept

    @classmethod
    def from_maps(cls, maps: list[np.ndarray], pin: bool) -> "HostBucket":
        lists = [live_lists(m) for m in maps]  # padded per layer: one dense layer must not widen all
        ids = [torch.from_numpy(layer_ids) for layer_ids, _ in lists]
        counts = [torch.from_numpy(c) for _, c in lists]
        if pin:
            ids, counts = [t.pin_memory() for t in ids], [t.pin_memory() for t in counts]
        nk = maps[0].shape[-1]
        return cls(ids, counts, [float(c.sum()) / (c.size * nk) for _, c in lists])


@dataclass
class DeviceBucket:
    """One step bucket on the run's device: one BlockSparseMask per layer, built once."""

    index: int
    masks: list  # PreparedMask per layer


@dataclass
class PrefetchTimings:
    load_ms: float = 0.0  # row, blob read, digest check, safetensors parse (worker)
    decode_ms: float = 0.0  # every bucket decoded and turned into live-block lists (worker)
    wait_ms: float = 0.0  # what the sampling thread waited for the worker (the critical-path cost)
    upload_ms: float = 0.0  # host-side time to queue bucket uploads (the copies themselves are async)
    buckets: list = field(default_factory=list)  # per bucket: decode ms


class EntryPrefetch:
    """Loads an entry in a worker thread and hands out its buckets as they become ready.

    :param open_entry: returns a context manager that yields the entry's
        :class:`~chorus_core.bank.EntryMasks` (entered in the worker, on a connection of its own,
        and left once every bucket is decoded)
    :param pin: pin host arrays (the run is on a CUDA device), so uploads are asynchronous
    """

    def __init__(self, open_entry: Callable[[], ContextManager], pin: bool = False):
        self._open_entry, self._pin = open_entry, pin
        self._cond = threading.Condition()
        self._entry = None
        self._host: dict[int, HostBucket] = {}
        self._error: Optional[BaseException] = None
        self._done = False
        self._device: Optional[DeviceBucket] = None
        self.timings = PrefetchTimings()
        self._thread = threading.Thread(target=self._work, name="chorus-entry-prefetch", daemon=True)
        self._thread.start()

    # ---- worker

    def _work(self) -> None:
        try:
            started = time.perf_counter()
            with self._open_entry() as entry:
                self.timings.load_ms = (time.perf_counter() - started) * 1e3
                self._publish(entry=entry)
                layers = entry.shape[1]
                for bucket in range(len(entry.step_buckets)):
                    begun = time.perf_counter()
                    maps = [entry.block_map(bucket, layer).numpy() for layer in range(layers)]
                    host = HostBucket.from_maps(maps, self._pin)
                    self.timings.buckets.append(round((time.perf_counter() - begun) * 1e3, 2))
                    self._publish(bucket=(bucket, host))
            self.timings.decode_ms = sum(self.timings.buckets)
        except BaseException as exc:  # handed to the sampling thread, which runs as a miss
            self._publish(error=exc)
        finally:
            self._publish(done=True)

    def _publish(self, entry=None, bucket=None, error=None, done=False) -> None:
        with self._cond:
            if entry is not None:
                self._entry = entry
            if bucket is not None:
                self._host[bucket[0]] = bucket[1]
            if error is not None:
                self._error = error
            self._done = self._done or done
            self._cond.notify_all()

    # ---- sampling thread

    def _wait_for(self, ready: Callable[[], bool]) -> None:
        started = time.perf_counter()
        with self._cond:
            while not ready():
                if self._error is not None:
                    raise RuntimeError(f"the bank entry could not be loaded: {self._error}") from self._error
                if self._done:
                    raise RuntimeError("the bank entry has fewer step buckets than asked for")
                self._cond.wait()
        self.timings.wait_ms += (time.perf_counter() - started) * 1e3

    def entry(self):
        """The loaded entry (waits for the load, not for the decode)."""
        self._wait_for(lambda: self._entry is not None)
        return self._entry

    def device_bucket(self, bucket: int, block_size: tuple[int, int], seq_len: int, device) -> DeviceBucket:
        """Bucket ``bucket`` on ``device``; uploaded once, the previous bucket's tensors dropped."""
        if self._device is not None and self._device.index == bucket:
            return self._device
        self._wait_for(lambda: bucket in self._host)
        started = time.perf_counter()
        host = self._host[bucket]
        self._device = None  # free the previous bucket before allocating this one
        BlockSparseMask = import_sibling("kernels.block_sparse").BlockSparseMask
        masks = []
        for ids, counts, density in zip(host.live_blocks, host.live_counts, host.densities):
            # Valid by construction (live_lists checked every row on the host): no check on the GPU.
            mask = BlockSparseMask(ids.to(device, non_blocking=True).to(torch.int32)[None],
                                   counts.to(device, non_blocking=True)[None], block_size[0], block_size[1], seq_len)
            masks.append(PreparedMask(mask.assume_valid(), density))
        self._device = DeviceBucket(bucket, masks)
        self.timings.upload_ms += (time.perf_counter() - started) * 1e3
        return self._device

    def join(self, timeout: float = 60.0) -> None:
        """Wait for the worker (after sampling it has long finished) and free what it holds.

        Pinned host buffers may still feed an upload in flight: torch's pinned-memory allocator
        keeps a block until the copies that use it are done, so dropping them here is safe.
        """
        self._thread.join(timeout)
        with self._cond:
            self._device, self._host, self._entry = None, {}, None
