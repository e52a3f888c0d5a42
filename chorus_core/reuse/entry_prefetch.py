"""A bank entry's masks, loaded off the critical path and served in the kernel's format.

A hit must cost nothing per request on the prompt's thread. :class:`EntryPrefetch` loads,
verifies and inflates the matched entry in a worker thread that starts before sampling, layer by
layer (several layer sets at once on a small pool, handed out in layer order): each layer set
stays packed bits on the host (an eighth of a bool map, no unpacking) with its row counts. At the first sparse call of a step bucket, each of its layers goes to the GPU
(asynchronous copies from pinned memory) and becomes live-block lists there, with whole-tensor
ops and no host sync; every later call of that bucket reuses the same tensors.

Why on the device: at 720p x 40 layers the host-side unpacking and live lists took 3-4.5 s per
bucket on an H200's host, so a hit that runs sparse from its first step waited 3.8 s for it
(tests/benchmarks/results/few_step_h200_720p.md); the same work is milliseconds on the GPU.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional

import numpy as np
import torch

from .._siblings import import_sibling
from ..attention.mask_provider import PreparedMask
from ..attention.masks import unpack_bits

_POPCOUNT = np.array([bin(byte).count("1") for byte in range(256)], dtype=np.uint8)
# Layer sets decoded at once by a hit's worker. Inflating (zlib), checking and counting release the
# GIL, so a few threads cut the wait of a hit's first step, which needs every layer of bucket 0;
# one core stays for the sampling thread, and more than four would compete with ComfyUI's own work.
# Cores this process may run on (a container or taskset can allow fewer than the machine has).
_USABLE_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
DECODE_THREADS = max(1, min(4, _USABLE_CORES - 1))
# Longest the sampling thread waits for the worker without any progress (a layer set decoded, the
# entry read): a PostgreSQL server that stops answering mid-read never holds a generation longer.
STALL_S = 30.0
CANCEL_JOIN_S = 2.0  # a cancelled run waits this long at most for its worker (one layer set's decode)


def row_counts(packed: np.ndarray) -> np.ndarray:
    """Set bits per row of packed bits: int32 ``[..., rows]`` (numpy 2's popcount ufunc, else a table)."""
    bits = np.bitwise_count(packed) if hasattr(np, "bitwise_count") else _POPCOUNT[packed]
    return bits.sum(-1, dtype=np.int32)


@dataclass
class HostLayer:
    """One layer set of a step bucket as packed bits on the host, ready for upload."""

    packed: torch.Tensor  # uint8 [H, nq, ceil(nk / 8)], padding cleared (pinned when the run is on a GPU)
    counts: torch.Tensor  # int32 [H, nq]: key blocks kept per query block
    most: int  # the largest count: the live lists' width, known here so the device needs no sync
    density: float  # share of blocks kept

    @classmethod
    def from_packed(cls, packed: np.ndarray, nk: int, pin: bool) -> "HostLayer":
        """:raises ValueError: when a query block keeps no key block (the kernel needs one per row)"""
        counts = row_counts(packed)
        if counts.size and counts.min() <= 0:
            h, r = np.argwhere(counts <= 0)[0]
            raise ValueError(f"mask has a query block with no key block (head {h}, query block {r}); "
                             "the entry cannot serve attention")
        packed_t, counts_t = torch.from_numpy(packed), torch.from_numpy(counts)
        if pin:
            packed_t, counts_t = packed_t.pin_memory(), counts_t.pin_memory()
        return cls(packed_t, counts_t, int(counts.max(initial=1)), float(counts.sum()) / max(1, counts.size * nk))

    def to_device(self, nk: int, block_size: tuple[int, int], seq_len: int, device) -> PreparedMask:
        """The layer's kernel-ready mask on ``device``: upload, unpack and live lists, all queued."""
        block_sparse = import_sibling("kernels.block_sparse")
        blocks = (-(-seq_len // block_size[0]), -(-seq_len // block_size[1]))
        if (self.packed.shape[1], nk) != blocks or self.packed.shape[2] != -(-nk // 8):
            # assume_valid below skips the kernel's checks: never for ids beyond this sequence
            raise ValueError(f"the masks have {self.packed.shape[1]} query and {nk} key blocks; this run's "
                             f"{seq_len} tokens make {blocks[0]} and {blocks[1]}")
        live = unpack_bits(self.packed.to(device, non_blocking=True), nk)
        counts = self.counts.to(device, non_blocking=True)
        mask = block_sparse.live_lists_to_mask(live[None], counts[None], self.most, block_size[0], block_size[1],
                                               seq_len)
        # Valid by construction (every row counted non-empty on the host, ids ascending from the sort).
        return PreparedMask(mask.assume_valid(), self.density)


@dataclass
class DeviceBucket:
    """One step bucket on the run's device: each layer's PreparedMask, built at its first call."""

    index: int
    masks: dict = field(default_factory=dict)  # layer -> PreparedMask


@dataclass
class PrefetchTimings:
    load_ms: float = 0.0  # row, blob read, digest check, safetensors parse (worker)
    decode_ms: float = 0.0  # every bucket inflated and counted (worker)
    first_bucket_ms: float = 0.0  # from the worker's start until bucket 0 is ready: what a hit's first step needs
    decode_threads: int = 1
    wait_ms: float = 0.0  # what the sampling thread waited for the worker (the critical-path cost)
    upload_ms: float = 0.0  # host-side time to queue uploads and live-list ops (the GPU work is async)
    buckets: list = field(default_factory=list)  # per bucket: decode ms


class PrefetchCancelled(Exception):
    """The run the prefetch served has ended (cancelled or failed)."""


class EntryPrefetch:
    """Loads an entry in a worker thread and hands out its buckets as they become ready.

    :param open_entry: returns a context manager that yields the entry's
        :class:`~chorus_core.bank.EntryMasks` (entered in the worker, on a connection of its own,
        and left once every bucket is decoded)
    :param pin: pin host arrays (the run is on a CUDA device), so uploads are asynchronous
    :param decode_threads: layer sets decoded at once (default :data:`DECODE_THREADS`)
    """

    def __init__(self, open_entry: Callable[[], ContextManager], pin: bool = False, decode_threads: int | None = None):
        self._open_entry, self._pin = open_entry, pin
        self._decode_threads = max(1, decode_threads or DECODE_THREADS)
        self._cond = threading.Condition()
        self._entry = None
        self._host: dict[tuple[int, int], HostLayer] = {}  # (bucket, layer) -> host layer
        self._error: Optional[BaseException] = None
        self._done = False
        self._progress = 0  # bumps at every publish: what a stalled load is told by
        self._cancelled = threading.Event()
        self._device: Optional[DeviceBucket] = None
        self.timings = PrefetchTimings(decode_threads=self._decode_threads)
        self._thread = threading.Thread(target=self._work, name="chorus-entry-prefetch", daemon=True)
        self._thread.start()

    # ---- worker

    def _work(self) -> None:
        try:
            started = time.perf_counter()
            with self._open_entry() as entry:
                self.timings.load_ms = (time.perf_counter() - started) * 1e3
                self._publish(entry=entry)
                with ThreadPoolExecutor(self._decode_threads, thread_name_prefix="chorus-entry-decode") as pool:
                    for bucket in range(len(entry.step_buckets)):
                        self._decode_bucket(entry, bucket, pool)
                        if bucket == 0:
                            self.timings.first_bucket_ms = round((time.perf_counter() - started) * 1e3, 2)
            self.timings.decode_ms = sum(self.timings.buckets)
        except BaseException as exc:  # handed to the sampling thread, which runs as a miss
            self._publish(error=exc)
        finally:
            self._publish(done=True)

    def _decode_bucket(self, entry, bucket: int, pool: ThreadPoolExecutor) -> None:
        """Every layer of ``bucket`` decoded on ``pool`` and published in layer order, so the first
        layers serve soonest. A damaged layer set is reported here, on the worker's own thread:
        the pool's threads never touch the bank."""
        begun, nk = time.perf_counter(), entry.shape[-1]
        decode = lambda layer: self._host_layer(entry, bucket, layer, nk)  # noqa: E731
        for layer, (host, reason) in enumerate(pool.map(decode, range(entry.shape[1]))):
            if self._cancelled.is_set():
                raise PrefetchCancelled("the run ended: no more layer sets are decoded")
            if reason is not None:
                entry.report_corrupt(reason)  # raises: the entry cannot serve
            self._publish(layer=((bucket, layer), host))
        self.timings.buckets.append(round((time.perf_counter() - begun) * 1e3, 2))

    def _host_layer(self, entry, bucket: int, layer: int, nk: int) -> tuple:
        packed, reason = entry.packed_block_map_or_reason(bucket, layer)
        return (None, reason) if reason is not None else (HostLayer.from_packed(packed, nk, self._pin), None)

    def _publish(self, entry=None, layer=None, error=None, done=False) -> None:
        with self._cond:
            if entry is not None:
                self._entry = entry
            if layer is not None and not self._cancelled.is_set():  # never refill what cancel() freed
                self._host[layer[0]] = layer[1]
            if error is not None:
                self._error = error
            self._done = self._done or done
            self._progress += 1
            self._cond.notify_all()

    # ---- sampling thread

    def _wait_for(self, ready: Callable[[], bool]) -> None:
        """Wait until ``ready()``; the worker must make progress at least every :data:`STALL_S`
        seconds (a bank server that stopped answering mid-read), else the run goes on as a miss."""
        started = time.perf_counter()
        with self._cond:
            progress = self._progress
            deadline = time.monotonic() + STALL_S
            while not ready():
                if self._error is not None:
                    raise RuntimeError(f"the bank entry could not be loaded: {self._error}") from self._error
                if self._done:
                    raise RuntimeError("the bank entry has fewer step buckets or layers than asked for")
                if self._progress != progress:
                    progress, deadline = self._progress, time.monotonic() + STALL_S
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the bank entry did not arrive: its load made no progress for {STALL_S:g} s "
                                       "(a bank server that stopped answering?)")
                self._cond.wait(left)
        self.timings.wait_ms += (time.perf_counter() - started) * 1e3

    def entry(self):
        """The loaded entry (waits for the load, not for the decode)."""
        self._wait_for(lambda: self._entry is not None)
        return self._entry

    def layer_mask(self, bucket: int, layer: int, block_size: tuple[int, int], seq_len: int, device) -> PreparedMask:
        """Layer ``layer`` of bucket ``bucket`` on ``device``, built once; a new bucket drops the
        previous bucket's tensors first."""
        if self._device is None or self._device.index != bucket:
            self._device = DeviceBucket(bucket)  # frees the previous bucket before allocating this one
        prepared = self._device.masks.get(layer)
        if prepared is None:
            self._wait_for(lambda: (bucket, layer) in self._host)
            started = time.perf_counter()
            nk = self._entry.shape[-1]
            prepared = self._host[(bucket, layer)].to_device(nk, block_size, seq_len, device)
            self._device.masks[layer] = prepared
            self.timings.upload_ms += (time.perf_counter() - started) * 1e3
        return prepared

    def cancel(self) -> None:
        """The run was cancelled or failed: free the host buffers now and stop the worker before its
        next layer set (waited for at most :data:`CANCEL_JOIN_S`; it keeps nothing after)."""
        self._cancelled.set()
        with self._cond:
            self._device, self._host, self._entry = None, {}, None
            self._cond.notify_all()
        self._thread.join(CANCEL_JOIN_S)

    def join(self, timeout: float = 60.0) -> None:
        """Wait for the worker (after sampling it has long finished) and free what it holds.

        Pinned host buffers may still feed an upload in flight: torch's pinned-memory allocator
        keeps a block until the copies that use it are done, so dropping them here is safe.
        """
        self._thread.join(timeout)
        with self._cond:
            self._device, self._host, self._entry = None, {}, None
