"""Mask encoding: bool block maps ``[S, L, H, nq, nk]`` <-> compressed uint8 tensors.

Codec ``rowshift-zlib-v1`` (lossless, optionally after OR-coarsening), per (bucket, layer):

* ``c``: key columns that every query row keeps (global columns, first-frame keys);
* ``e``: isolated kept blocks (no kept neighbour in the row), the "extras";
* ``d``: the rest (local 3D windows) as the XOR with the previous row shifted by one block,
  because in raster token order the window moves one key block per query block;
* buckets after the first are stored as their XOR with bucket 0 (``x``) when that is smaller,
  because masks change little across denoising steps.

Each part is a sorted index set, stored as byte-shuffled gaps compressed with zlib (level 9;
LZMA is 7 % smaller but 4x slower to decode, and decoding sits on the generation path).
With ``coarsen=c`` the maps are OR-pooled over c x c blocks first: a superset, so recall never
drops, at the price of a higher density; decoding upsamples back to the stored block grid.
"""

from __future__ import annotations

import zlib

import numpy as np

CODEC = "rowshift-zlib-v1"


def _pack_indices(mask: np.ndarray) -> np.ndarray:
    """Sorted flat indices of ``mask`` as zlib-compressed, byte-shuffled uint32 gaps."""
    idx = np.flatnonzero(mask)
    gaps = np.diff(idx, prepend=0).astype("<u4")
    shuffled = gaps.view(np.uint8).reshape(-1, 4).T.tobytes()  # high bytes compress to ~0
    return np.frombuffer(zlib.compress(shuffled, 9), dtype=np.uint8)


def _indices(blob: np.ndarray) -> np.ndarray:
    raw = np.frombuffer(zlib.decompress(blob.tobytes()), dtype=np.uint8)
    gaps = raw.reshape(4, -1).T.copy().view("<u4").ravel()
    return np.cumsum(gaps, dtype=np.int64)


def _unpack_indices(blob: np.ndarray, shape) -> np.ndarray:
    out = np.zeros(int(np.prod(shape)), dtype=bool)
    out[_indices(blob)] = True
    return out.reshape(shape)


def _shift_right(x: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    out[..., 1:] = x[..., :-1]
    return out


def _split(maps: np.ndarray) -> dict[str, np.ndarray]:
    """[H, nq, nk] bool -> parts c, d, e (see module docstring)."""
    cols = maps.all(axis=1)  # [H, nk]
    rest = maps & ~cols[:, None, :]
    left = _shift_right(rest)
    right = np.zeros_like(rest)
    right[..., :-1] = rest[..., 1:]
    extras = rest & ~left & ~right
    window = rest & ~extras
    delta = window.copy()
    delta[:, 1:] ^= _shift_right(window[:, :-1])
    return {"c": _pack_indices(cols), "d": _pack_indices(delta), "e": _pack_indices(extras)}


def _join(parts: dict[str, np.ndarray], shape) -> np.ndarray:
    heads, nq, nk = shape
    cols = _unpack_indices(parts["c"], (heads, nk))
    delta = _unpack_indices(parts["d"], shape)
    window = np.empty(shape, dtype=bool)
    window[:, 0] = delta[:, 0]
    for r in range(1, nq):  # sequential by nature; vectorised over heads
        np.bitwise_xor(delta[:, r, 1:], window[:, r - 1, :-1], out=window[:, r, 1:])
        window[:, r, 0] = delta[:, r, 0]
    window.reshape(-1)[_indices(parts["e"])] = True
    window |= cols[:, None, :]
    return window


def coarsen_maps(maps: np.ndarray, factor: int) -> np.ndarray:
    """OR-pool the last two axes by ``factor`` (a superset of the input at a coarser grid)."""
    if factor == 1:
        return maps
    nq, nk = maps.shape[-2:]
    pq, pk = (-nq) % factor, (-nk) % factor
    pad = [(0, 0)] * (maps.ndim - 2) + [(0, pq), (0, pk)]
    m = np.pad(maps, pad)
    shape = m.shape[:-2] + ((nq + pq) // factor, factor, (nk + pk) // factor, factor)
    return m.reshape(shape).any(axis=(-3, -1))


def _upsample(maps: np.ndarray, factor: int, nq: int, nk: int) -> np.ndarray:
    if factor == 1:
        return maps
    return np.repeat(np.repeat(maps, factor, axis=-2), factor, axis=-1)[..., :nq, :nk]


def _as_numpy_bool(masks) -> np.ndarray:
    if hasattr(masks, "detach"):  # torch tensor, without importing torch here
        masks = masks.detach().cpu().numpy()
    masks = np.asarray(masks)
    if masks.dtype != bool:
        masks = masks != 0
    return masks


def encode_masks(masks, coarsen: int = 1) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Encode bool block maps ``[S, L, H, nq, nk]`` into uint8 tensors and string metadata.

    :param masks: bool torch tensor or numpy array ``[S, L, H, nq, nk]``
    :param coarsen: OR-pool factor (1 = lossless)
    :return: (tensors for safetensors, metadata for safetensors)
    """
    masks = _as_numpy_bool(masks)
    if masks.ndim != 5:
        raise ValueError(f"masks must be [S, L, H, nq, nk], got shape {masks.shape}; "
                         "stack one bool block map per (step bucket, layer, head).")
    s_count, layers, heads, nq, nk = masks.shape
    stored = coarsen_maps(masks, coarsen)
    tensors = {}
    for layer in range(layers):
        base = stored[0, layer]
        for part, arr in _split(base).items():
            tensors[f"b0.l{layer}.{part}"] = arr
        for s in range(1, s_count):
            own = _split(stored[s, layer])
            xor = _pack_indices(stored[s, layer] ^ base)
            if xor.size <= sum(a.size for a in own.values()):
                tensors[f"b{s}.l{layer}.x"] = xor
            else:
                tensors.update({f"b{s}.l{layer}.{p}": a for p, a in own.items()})
    meta = {"codec": CODEC, "shape": ",".join(map(str, masks.shape)),
            "stored_blocks": ",".join(map(str, stored.shape[-2:])), "coarsen": str(coarsen)}
    return tensors, meta


def decode_block_map(tensors: dict, meta: dict, bucket: int, layer: int) -> np.ndarray:
    """Decode one layer set (one step bucket, one layer, all heads) to bool ``[H, nq, nk]``.

    :param tensors: the entry's uint8 tensors (from :func:`encode_masks`)
    :param meta: the entry's metadata (from :func:`encode_masks`)
    :param bucket: step bucket index
    :param layer: transformer layer index
    """
    if meta.get("codec") != CODEC:
        raise ValueError(f"Unknown mask codec {meta.get('codec')!r}; upgrade Chorus to read it.")
    s_count, layers, heads, nq, nk = (int(x) for x in meta["shape"].split(","))
    if not (0 <= bucket < s_count and 0 <= layer < layers):
        raise IndexError(f"bucket {bucket} / layer {layer} out of range for an entry "
                         f"with {s_count} buckets and {layers} layers.")
    sq, sk = (int(x) for x in meta["stored_blocks"].split(","))
    shape = (heads, sq, sk)

    def parts(s):
        return {p: tensors[f"b{s}.l{layer}.{p}"] for p in "cde"}

    if f"b{bucket}.l{layer}.x" in tensors:
        maps = _join(parts(0), shape) ^ _unpack_indices(tensors[f"b{bucket}.l{layer}.x"], shape)
    else:
        maps = _join(parts(bucket), shape)
    return _upsample(maps, int(meta["coarsen"]), nq, nk)
