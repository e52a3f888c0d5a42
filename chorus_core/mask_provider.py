"""Where the sparse-attention patch gets its block maps: the provider protocol and simple providers.

The patch (``sparse_patch.py``) asks a provider, once per (layer, step bucket, batch chunks) of a
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


@runtime_checkable
class MaskProvider(Protocol):
    """Block maps for block-sparse self-attention, per (layer, step, batch chunks)."""

    #: (block_q, block_k) in tokens; the maps' nq/nk follow from it and the sequence length.
    block_size: tuple[int, int]

    def step_bucket(self, step: int) -> Hashable:
        """Steps with equal buckets get equal maps; the patch converts a map once per bucket."""
        ...

    def block_map(
        self, layer: int, step: int, cond_or_uncond: list[int], num_heads: int, seq_len: int, device: torch.device
    ) -> Optional[torch.Tensor]:
        """bool ``[B, num_heads, nq, nk]`` (B as in the module docstring), or None for dense."""
        ...

    # Optional: ``observe(layer, step, cond_or_uncond, q, k, heads, skip_reshape)`` is called with
    # each self-attention call's q and k just before ``block_map`` (online prediction, recording).
    # Optional: ``prepared_mask(layer, step, cond_or_uncond, num_heads, seq_len, batch, device)``
    # returns a ready :class:`PreparedMask` (a bank entry built before sampling); the patch then
    # never converts a block map (see :func:`serve_prepared_mask`).


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
    """Chooses the mask provider of each sampling run (Chorus Sparse Attention: a hit or a miss
    per run), and hears how the run ended; installed where a fixed provider would be."""

    block_size: tuple[int, int]

    def begin_run(self, sampling: SamplingCall) -> MaskProvider:
        """This run's provider, chosen before its first model call."""
        ...

    def end_run(self, succeeded: bool) -> None:
        """After the run's last model call: report and record on success, release on failure."""
        ...


@dataclass(frozen=True)
class PreparedMask:
    """A kernel-ready mask and its density, known on the host, so using it costs no host sync."""

    mask: Any  # kernels.block_sparse.BlockSparseMask
    density: float


class DenseProvider:
    """Every layer dense: the patched model computes exactly what the unpatched one does."""

    def __init__(self, block_size: tuple[int, int] = (128, 128)):
        self.block_size = tuple(block_size)

    def step_bucket(self, step: int) -> Hashable:
        return None  # one answer for all steps

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device) -> None:
        return None


class StaticBlockMapProvider:
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


class DenseWarmupProvider:
    """Dense for the first ``warmup_steps`` steps, the steps from ``dense_from_step`` on, and
    ``dense_layers``; ``inner`` otherwise.

    Early steps set the layout of the video and are the most sensitive to attention errors; some
    users of step-distilled models keep the last step dense too (``dense_from_step``).
    """

    def __init__(self, inner: MaskProvider, warmup_steps: int = 0, dense_layers: Sequence[int] = (),
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
        return ("inner", step_bucket_of(self.inner, step))

    def block_map(self, layer, step, cond_or_uncond, num_heads, seq_len, device) -> Optional[torch.Tensor]:
        if self.dense_step(step) or layer in self.dense_layers:
            return None
        return self.inner.block_map(layer, step, cond_or_uncond, num_heads, seq_len, device)

    def prepared_mask(self, layer, step, cond_or_uncond, num_heads, seq_len, batch, device) -> Optional[PreparedMask]:
        if self.dense_step(step) or layer in self.dense_layers:
            return None
        return serve_prepared_mask(self.inner, layer, step, cond_or_uncond, num_heads, seq_len, batch, device)

    def observes(self, step: int) -> bool:
        return not self.dense_step(step) and observes(self.inner, step)

    def observe(self, layer, step, cond_or_uncond, q, k, heads, skip_reshape) -> None:
        # Only where the inner provider will be asked: online prediction costs time.
        observer = getattr(self.inner, "observe", None)
        if observer is not None and not self.dense_step(step) and layer not in self.dense_layers:
            observer(layer, step, cond_or_uncond, q, k, heads, skip_reshape)


def bucket_index(bucket_starts: Sequence[int], step: int) -> int:
    """Index of the last bucket whose first step is at or before ``step`` (starts ascend from 0)."""
    return max(i for i, start in enumerate(bucket_starts) if start <= step)


def step_bucket_of(provider, step: int) -> Hashable:
    """The provider's bucket for ``step``; a provider without ``step_bucket`` buckets per step."""
    step_bucket = getattr(provider, "step_bucket", None)
    return step if step_bucket is None else step_bucket(step)


def observes(provider, step: int) -> bool:
    """True when ``provider`` looks at q and k during ``step`` (online prediction, recording).

    Such masks exist only once the attention call is reached; every other provider's masks are
    known before the model runs, which is what lets a compiled model run them without a graph
    break. A provider without ``observes(step)`` observes whenever it has ``observe``.
    """
    method = getattr(provider, "observes", None)
    if method is not None:
        return bool(method(step))
    return callable(getattr(provider, "observe", None))


def serve_prepared_mask(provider, layer, step, cond_or_uncond, num_heads, seq_len, batch, device) -> Optional[PreparedMask]:
    """The provider's mask for one call, ready for the kernel; None runs the call dense.

    A provider with ``prepared_mask`` answers directly; otherwise its block map is converted here
    (one host sync in ``block_map_to_mask``, once per step bucket; online prediction's bucket is the step).
    """
    prepared = getattr(provider, "prepared_mask", None)
    if prepared is not None:
        return prepared(layer, step, cond_or_uncond, num_heads, seq_len, batch, device)
    block_map = provider.block_map(layer, step, list(cond_or_uncond), num_heads, seq_len, device)
    if block_map is None:
        return None
    from ._siblings import import_sibling

    block_sparse = import_sibling("kernels.block_sparse")
    block_map = match_batch(block_map, len(cond_or_uncond), batch).to(device)
    block_q, block_k = provider.block_size
    mask = block_sparse.block_map_to_mask(block_map, block_q, block_k, seq_len)
    return PreparedMask(mask, mask.density)


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
