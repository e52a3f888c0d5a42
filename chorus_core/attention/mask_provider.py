"""Where the sparse-attention patch gets its block maps: the two kinds of mask source and simple ones.

Sources whose masks are known before the model runs (:class:`KnownMasks`: a bank hit, the prior,
static maps, dense) are planned a model call ahead; sources that make masks from q and k
(:class:`ObservedMasks`: online prediction, the recorder) are shown each call first.

The patch (``sparse_patch.py``) asks a source, once per (layer, step bucket, batch chunks) of a
run, for a bool block map ``[B, H, nq, nk]`` (True = the query block attends to the key block);
``None`` means "run this layer dense". Block ``r`` covers tokens ``[r * block_q, (r + 1) * block_q)``
of the (t, h, w)-raster video tokens; ``nq = ceil(N / block_q)``, ``nk = ceil(N / block_k)``.

Batch dimension of a returned map: 1 (same mask for every element), ``len(cond_or_uncond)`` (one
per batch chunk, e.g. cond and uncond) or the full attention batch (one per element).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

import torch

COND, UNCOND = 0, 1  # ComfyUI's values in transformer_options["cond_or_uncond"]


@dataclass(frozen=True)
class SamplingCall:
    """What one sampling run is: the guider's model (with every patch applied after Chorus), the
    latent it starts from, the sampler and the sigma schedule (ComfyUI's OUTER_SAMPLE arguments)."""

    model_patcher: Any
    latent_image: Optional[torch.Tensor]
    sampler: Any
    sigmas: Optional[torch.Tensor]


@runtime_checkable
class RunSource(Protocol):
    """Makes each sampling run's state, choosing its mask provider (Chorus Sparse Attention: a hit
    or a miss per run), and hears how the run ended; installed where a fixed provider would be."""

    block_size: tuple[int, int]

    def begin_run(self, sampling: SamplingCall, step_callbacks: list, dense_attention: str):
        """This run's holder (a ``sparse_run.SparseRun`` with its provider chosen), made before its
        first model call; ``step_callbacks`` and ``dense_attention`` are the installed patch's."""
        ...

    def end_run(self, succeeded: bool) -> None:
        """After the run's last model call: report and record on success, release on failure."""
        ...


@dataclass(frozen=True)
class PreparedMask:
    """A kernel-ready mask and its density, known on the host, so using it costs no host sync."""

    mask: Any  # kernels.block_sparse.BlockSparseMask
    density: float


class MaskSource:
    """Base of every mask source the sparse patch serves. Derive from one of its two kinds:

    * :class:`KnownMasks`: the masks are decided before the model runs (a bank hit, the population
      prior, static maps, dense). The patch plans a whole model call's masks ahead (the path a
      compiled model keeps one graph on).
    * :class:`ObservedMasks`: the masks come from each call's q and k (online prediction, the
      recorder). The patch shows each self-attention call to :meth:`observe` first, then asks.

    A wrapper (dense warm-up, recording, a hit with an online fallback) derives from this base and
    says per step, through :meth:`observes`, which kind it is at that step.
    """

    block_size: tuple[int, int]  # (block_q, block_k) in tokens

    def step_bucket(self, step: int) -> Hashable:
        """Steps with equal buckets get equal masks; the patch converts a map once per bucket."""
        return step

    def block_map(self, layer: int, step: int, cond_or_uncond: list[int], num_heads: int, seq_len: int,
                  device: torch.device) -> Optional[torch.Tensor]:
        """bool ``[B, num_heads, nq, nk]`` (B as in the module docstring), or None for dense."""
        raise NotImplementedError

    def observes(self, step: int) -> bool:
        """True when this source looks at q and k during ``step``."""
        return False

    def observe(self, layer, step, cond_or_uncond, q, k, heads, skip_reshape) -> None:
        """See one self-attention call's q and k before :meth:`block_map` is asked for it."""

    def prepared_mask(self, layer, step, cond_or_uncond, num_heads, seq_len, batch, device) -> Optional[PreparedMask]:
        """The kernel-ready mask of one call; None runs it dense. By default the block map is
        converted here (one host sync, once per step bucket); a bank entry answers ready-made."""
        block_map = self.block_map(layer, step, list(cond_or_uncond), num_heads, seq_len, device)
        if block_map is None:
            return None
        from .._siblings import import_sibling

        block_sparse = import_sibling("kernels.block_sparse")
        block_map = match_batch(block_map, len(cond_or_uncond), batch).to(device)
        mask = block_sparse.block_map_to_mask(block_map, *self.block_size, seq_len)
        return PreparedMask(mask, mask.density)


class KnownMasks(MaskSource):
    """Masks known before the model runs: never observes q and k."""

    def observes(self, step: int) -> bool:
        return False


class ObservedMasks(MaskSource):
    """Masks made from each call's q and k: observes every step."""

    def observes(self, step: int) -> bool:
        return True

    def observe(self, layer, step, cond_or_uncond, q, k, heads, skip_reshape) -> None:
        raise NotImplementedError


class DenseProvider(KnownMasks):
    """Every layer dense: the patched model computes exactly what the unpatched one does."""

    def __init__(self, block_size: tuple[int, int] = (128, 128)):
        self.block_size = tuple(block_size)

    def step_bucket(self, step: int) -> Hashable:
        return None  # one answer for all steps

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device) -> None:
        return None


class StaticBlockMapProvider(KnownMasks):
    """Fixed block maps per step bucket and layer (a bank hit, or a test's hand-made masks).

    :param block_maps: one mapping ``layer -> bool [Bm, H, nq, nk]`` per step bucket; a layer
        missing from a bucket runs dense. ``Bm`` is 1 (shared by cond and uncond) or 2 (index 0
        for cond, 1 for uncond, picked per batch chunk).
    :param block_size: ``(block_q, block_k)`` the maps were made with.
    :param bucket_starts: first step of each bucket, ascending from 0; ``(0,)`` = one bucket.
    """

    def __init__(
        self,
        block_maps: Sequence[Mapping[int, torch.Tensor]],
        block_size: tuple[int, int],
        bucket_starts: Sequence[int] = (0,),
    ):
        if len(block_maps) != len(bucket_starts):
            raise ValueError(f"{len(block_maps)} block-map buckets but {len(bucket_starts)} bucket_starts")
        if list(bucket_starts) != sorted(set(bucket_starts)) or bucket_starts[0] != 0:
            raise ValueError(f"bucket_starts must rise strictly from 0, got {list(bucket_starts)}")
        for bucket in block_maps:
            for layer, block_map in bucket.items():
                if block_map.dim() != 4 or block_map.shape[0] not in (1, 2):
                    raise ValueError(
                        f"layer {layer}: block map must be [1 or 2, H, nq, nk], got {tuple(block_map.shape)}"
                    )
        self.block_maps = [dict(bucket) for bucket in block_maps]
        self.block_size = tuple(block_size)
        self.bucket_starts = list(bucket_starts)

    @classmethod
    def for_all_steps(cls, layer_maps: Mapping[int, torch.Tensor], block_size: tuple[int, int]):
        """One map per layer, used at every step."""
        return cls([layer_maps], block_size)

    def step_bucket(self, step: int) -> int:
        return bucket_index(self.bucket_starts, step)

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device) -> Optional[torch.Tensor]:
        block_map = self.block_maps[self.step_bucket(step)].get(layer)
        if block_map is None:
            return None
        self._check_shape(layer, block_map, num_heads, seq_len)
        if block_map.shape[0] == 1:
            return block_map.to(device)
        return block_map.to(device)[list(cond_or_uncond)]

    def _check_shape(self, layer, block_map, num_heads, seq_len) -> None:
        # A map made for another resolution or model must fail loudly, never be stretched.
        nq, nk = (math.ceil(seq_len / b) for b in self.block_size)
        if tuple(block_map.shape[1:]) != (num_heads, nq, nk):
            raise ValueError(
                f"layer {layer}: block map has shape {tuple(block_map.shape)}, but this model runs "
                f"{num_heads} heads over {seq_len} tokens, which needs [*, {num_heads}, {nq}, {nk}] "
                f"with blocks {self.block_size}"
            )


class DenseWarmupProvider(MaskSource):
    """Dense for the first ``warmup_steps`` steps, the steps from ``dense_from_step`` on, and
    ``dense_layers``; ``inner`` otherwise.

    Early steps set the layout of the video and are the most sensitive to attention errors; some
    users of step-distilled models keep the last step dense too (``dense_from_step``).
    """

    def __init__(self, inner: MaskSource, warmup_steps: int = 0, dense_layers: Sequence[int] = (),
                 dense_from_step: Optional[int] = None):
        self.inner = inner
        self.warmup_steps = int(warmup_steps)
        self.dense_layers = frozenset(dense_layers)
        self.dense_from_step = None if dense_from_step is None else int(dense_from_step)
        self.block_size = tuple(inner.block_size)

    def dense_step(self, step: int) -> bool:
        """True for a step that runs dense on every layer (a warm-up or a last step)."""
        return step < self.warmup_steps or (self.dense_from_step is not None and step >= self.dense_from_step)

    def step_bucket(self, step: int) -> Hashable:
        # Dense steps get their own buckets so a dense answer is never reused for a later
        # step that the inner provider puts in the same bucket.
        if self.dense_step(step):
            return ("dense", step)
        return ("inner", self.inner.step_bucket(step))

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device) -> Optional[torch.Tensor]:
        if self.dense_step(step) or layer in self.dense_layers:
            return None
        return self.inner.block_map(layer, step, cond_or_uncond, num_heads, seq_len, device)

    def prepared_mask(self, layer, step, cond_or_uncond, num_heads, seq_len, batch, device) -> Optional[PreparedMask]:
        if self.dense_step(step) or layer in self.dense_layers:
            return None
        return self.inner.prepared_mask(layer, step, cond_or_uncond, num_heads, seq_len, batch, device)

    def observes(self, step: int) -> bool:
        return not self.dense_step(step) and self.inner.observes(step)

    def observe(self, layer, step, cond_or_uncond, q, k, heads, skip_reshape) -> None:
        # Only where the inner provider will be asked: online prediction costs time.
        if not self.dense_step(step) and layer not in self.dense_layers:
            self.inner.observe(layer, step, cond_or_uncond, q, k, heads, skip_reshape)


def bucket_index(bucket_starts: Sequence[int], step: int) -> int:
    """Index of the last bucket whose first step is at or before ``step`` (starts ascend from 0)."""
    return max(i for i, start in enumerate(bucket_starts) if start <= step)


def match_batch(block_map: torch.Tensor, chunks: int, batch: int) -> torch.Tensor:
    """Map batch 1 (broadcast), one per element, or one per batch chunk (repeated over the chunk)."""
    n = block_map.shape[0]
    if n in (1, batch):
        return block_map
    if n == chunks and batch % chunks == 0:
        return block_map.repeat_interleave(batch // chunks, dim=0)
    raise ValueError(
        f"provider returned a block map for batch {n}; this call has batch {batch} in {chunks} "
        f"chunk(s) (cond_or_uncond), so the map's batch must be 1, {chunks} or {batch}"
    )
