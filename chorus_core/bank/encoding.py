"""Mask encoding: bool block maps ``[S, L, H, nq, nk]`` <-> compressed uint8 tensors.

Codec ``packbits-xor-zlib-v1`` (written by this version; lossless, optionally after
OR-coarsening), per (bucket, layer): ``p`` = bucket 0 as packed bits (``np.packbits`` along key
blocks), ``q`` = a later bucket as the packed XOR with bucket 0 (masks change little across
denoising steps), each zlib level 6. Chosen by measurement on recorded masks
(tests/benchmarks/results/codec_*.md): against ``rowshift-zlib-v1`` it was 7 % smaller on the
masks an H200 recording produced, 5 % larger on structured synthetic masks, and 3-5x faster to
encode and 1.4-3.6x faster to decode, with a few large array operations instead of a Python
loop per query row (so a prefetch thread holds the GIL less while the sampler runs).

Codec ``rowshift-zlib-v1`` (read for entries written before), per (bucket, layer):

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

ROWSHIFT = "rowshift-zlib-v1"
PACKBITS = "packbits-xor-zlib-v1"
CODEC = PACKBITS  # what new entries are written with
CODECS = (PACKBITS, ROWSHIFT)  # what can be read
PART_NAMES = {PACKBITS: ({"p"}, ({"q"},)), ROWSHIFT: (set("cde"), ({"x"}, set("cde")))}  # bucket 0, later buckets
ZLIB_LEVEL = 9  # rowshift's level (the decoder reads any level)
PACKBITS_LEVEL = 6  # see tests/benchmarks/results/codec_*.md


def _pack_indices(mask: np.ndarray, level: int = ZLIB_LEVEL) -> np.ndarray:
    """Sorted flat indices of ``mask`` as zlib-compressed, byte-shuffled uint32 gaps."""
    idx = np.flatnonzero(mask)
    gaps = np.diff(idx, prepend=0).astype("<u4")
    shuffled = gaps.view(np.uint8).reshape(-1, 4).T.tobytes()  # high bytes compress to ~0
    return np.frombuffer(zlib.compress(shuffled, level), dtype=np.uint8)


def _indices(blob: np.ndarray, size: int) -> np.ndarray:
    """Sorted flat indices into an array of ``size`` elements; ValueError for anything else.

    Decompression stops at the largest valid size (4 bytes per possible index), so a blob that
    inflates far beyond it (a zlib bomb) costs at most that much memory and time.
    """
    limit = 4 * size
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(blob.tobytes(), limit + 1)
    except zlib.error as exc:
        raise ValueError(f"mask data does not decompress ({exc})") from exc
    if len(raw) > limit or not inflater.eof:
        raise ValueError(f"mask data inflates beyond the {limit} bytes its shape allows (or is cut short)")
    if len(raw) % 4:
        raise ValueError(f"mask data has {len(raw)} bytes, not a whole number of 4-byte gaps")
    gaps = np.frombuffer(raw, dtype=np.uint8).reshape(4, -1).T.copy().view("<u4").ravel()
    idx = np.cumsum(gaps, dtype=np.int64)
    if idx.size and (idx[-1] >= size or (idx.size > 1 and not (gaps[1:] > 0).all())):
        raise ValueError("mask data holds block indices outside its shape or out of order")
    return idx


def _unpack_indices(blob: np.ndarray, shape) -> np.ndarray:
    size = int(np.prod(shape))
    out = np.zeros(size, dtype=bool)
    out[_indices(blob, size)] = True
    return out.reshape(shape)


def _shift_right(x: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    out[..., 1:] = x[..., :-1]
    return out


def _split(maps: np.ndarray, level: int = ZLIB_LEVEL) -> dict[str, np.ndarray]:
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
    return {"c": _pack_indices(cols, level), "d": _pack_indices(delta, level), "e": _pack_indices(extras, level)}


def _join(parts: dict[str, np.ndarray], shape) -> np.ndarray:
    heads, nq, nk = shape
    cols = _unpack_indices(parts["c"], (heads, nk))
    delta = _unpack_indices(parts["d"], shape)
    window = np.empty(shape, dtype=bool)
    window[:, 0] = delta[:, 0]
    for r in range(1, nq):  # sequential by nature; vectorised over heads
        np.bitwise_xor(delta[:, r, 1:], window[:, r - 1, :-1], out=window[:, r, 1:])
        window[:, r, 0] = delta[:, r, 0]
    window.reshape(-1)[_indices(parts["e"], window.size)] = True
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


class PackedBlockMaps:
    """Block maps ``[S, L, H, nq, nk]`` kept as bits (``np.packbits`` order along ``nk``).

    A recorded 720p-14B entry is 1.7 GB as bool and 210 MB packed; the encoder unpacks one
    (bucket, layer) at a time, so the whole bool array never exists.

    :param packed: uint8 ``[S, L, H, nq, ceil(nk / 8)]`` (numpy or a CPU torch tensor)
    :param nk: key blocks per row
    """

    def __init__(self, packed, nk: int):
        packed = np.asarray(packed.numpy() if hasattr(packed, "numpy") else packed, dtype=np.uint8)
        if packed.ndim != 5 or packed.shape[-1] != -(-nk // 8):
            raise ValueError(f"packed maps must be [S, L, H, nq, ceil({nk}/8)], got {packed.shape}")
        self.nk = int(nk)
        # Bits past nk are padding: zero them, so they can neither hide an empty row nor reach the codec.
        tail = np.uint8((0xFF << ((-self.nk) % 8)) & 0xFF)
        if tail != 0xFF:
            packed = packed.copy()
            packed[..., -1] &= tail
        self.packed = packed

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.nk)

    def layer_set(self, bucket: int, layer: int) -> np.ndarray:
        """bool ``[H, nq, nk]`` of one step bucket and layer."""
        return np.unpackbits(self.packed[bucket, layer], axis=-1, count=self.nk).astype(bool)


def encode_masks(masks, coarsen: int = 1, level: int | None = None,
                 codec: str = CODEC) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Encode bool block maps ``[S, L, H, nq, nk]`` into uint8 tensors and string metadata.

    :param masks: bool torch tensor or numpy array ``[S, L, H, nq, nk]``, or :class:`PackedBlockMaps`
    :param coarsen: OR-pool factor (1 = lossless)
    :param level: zlib level (any level decodes the same way); the codec's default when None
    :param codec: :data:`PACKBITS` (the default) or :data:`ROWSHIFT`
    :return: (tensors for safetensors, metadata for safetensors)
    """
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {', '.join(CODECS)}, got {codec!r}")
    if not isinstance(masks, PackedBlockMaps):
        masks = _as_numpy_bool(masks)
    if len(masks.shape) != 5:
        raise ValueError(f"masks must be [S, L, H, nq, nk], got shape {masks.shape}; "
                         "stack one bool block map per (step bucket, layer, head).")
    s_count, layers, heads, nq, nk = masks.shape

    def stored(s, layer):
        maps = masks.layer_set(s, layer) if isinstance(masks, PackedBlockMaps) else masks[s, layer]
        return coarsen_maps(maps, coarsen)

    encode_layer = _encode_packbits_layer if codec == PACKBITS else _encode_rowshift_layer
    level = level if level is not None else (PACKBITS_LEVEL if codec == PACKBITS else ZLIB_LEVEL)
    tensors = {}
    for layer in range(layers):
        if codec == PACKBITS and coarsen == 1 and isinstance(masks, PackedBlockMaps):
            # a recording is packed already: deflate its bytes, no unpacking on the writer thread
            tensors.update(_encode_packed_layer([masks.packed[s, layer] for s in range(s_count)], layer, level))
        else:
            tensors.update(encode_layer([stored(s, layer) for s in range(s_count)], layer, level))
    stored_blocks = (-(-nq // coarsen), -(-nk // coarsen))
    meta = {"codec": codec, "shape": ",".join(map(str, masks.shape)),
            "stored_blocks": ",".join(map(str, stored_blocks)), "coarsen": str(coarsen)}
    return tensors, meta


def _encode_rowshift_layer(buckets: list[np.ndarray], layer: int, level: int) -> dict[str, np.ndarray]:
    base = buckets[0]
    tensors = {f"b0.l{layer}.{part}": arr for part, arr in _split(base, level).items()}
    for s, current in enumerate(buckets[1:], start=1):
        own = _split(current, level)
        xor = _pack_indices(current ^ base, level)
        if xor.size <= sum(a.size for a in own.values()):
            tensors[f"b{s}.l{layer}.x"] = xor
        else:
            tensors.update({f"b{s}.l{layer}.{p}": a for p, a in own.items()})
    return tensors


def _encode_packbits_layer(buckets: list[np.ndarray], layer: int, level: int) -> dict[str, np.ndarray]:
    return _encode_packed_layer([np.packbits(b, axis=-1) for b in buckets], layer, level)


def _encode_packed_layer(packed: list[np.ndarray], layer: int, level: int) -> dict[str, np.ndarray]:
    """Packed bits per bucket (zero padding) -> ``p`` for bucket 0, ``q`` = XOR with it for the others."""
    def deflate(bits: np.ndarray) -> np.ndarray:
        return np.frombuffer(zlib.compress(np.ascontiguousarray(bits).tobytes(), level), dtype=np.uint8)

    base = packed[0]
    tensors = {f"b0.l{layer}.p": deflate(base)}
    for s, current in enumerate(packed[1:], start=1):
        tensors[f"b{s}.l{layer}.q"] = deflate(current ^ base)
    return tensors


def _inflate_bits(blob: np.ndarray, shape) -> np.ndarray:
    """Bool ``shape`` array from its deflated packed bits (see :func:`_inflate_packed`)."""
    return np.unpackbits(_inflate_packed(blob, shape), axis=-1, count=shape[-1]).view(bool)


def _inflate_packed(blob: np.ndarray, shape) -> np.ndarray:
    """Packed bits (uint8 ``[H, nq, ceil(nk / 8)]``) of a bool ``shape`` array; exactly that many
    bytes or ValueError (a bomb stops at the limit). Padding bits are as stored: see :func:`clear_padding`."""
    heads, rows, cols = shape
    size = heads * rows * -(-cols // 8)
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(blob.tobytes(), size + 1)
    except zlib.error as exc:
        raise ValueError(f"mask data does not decompress ({exc})") from exc
    if len(raw) != size or not inflater.eof:
        raise ValueError(f"mask data inflates to {'more than' if len(raw) > size else len(raw)} bytes, "
                         f"its shape needs {size}")
    return np.frombuffer(raw, dtype=np.uint8).reshape(heads, rows, -1)


def clear_padding(packed: np.ndarray, nk: int) -> np.ndarray:
    """``packed`` (writable) with the bits past ``nk`` in each row's last byte cleared: a stored
    entry's padding is not trusted, and a set padding bit would name a key block that does not exist."""
    if nk % 8:
        packed[..., -1] &= np.uint8((0xFF << (8 - nk % 8)) & 0xFF)
    return packed


def decode_block_map(tensors: dict, meta: dict, bucket: int, layer: int) -> np.ndarray:
    """Decode one layer set (one step bucket, one layer, all heads) to bool ``[H, nq, nk]``.

    :param tensors: the entry's uint8 tensors (from :func:`encode_masks`)
    :param meta: the entry's metadata (from :func:`encode_masks`)
    :param bucket: step bucket index
    :param layer: transformer layer index
    """
    codec = meta.get("codec")
    if codec not in CODECS:
        raise ValueError(f"Unknown mask codec {codec!r}; upgrade Chorus to read it.")
    s_count, layers, heads, nq, nk = _ints(meta, "shape", 5)
    if not (0 <= bucket < s_count and 0 <= layer < layers):
        raise IndexError(f"bucket {bucket} / layer {layer} out of range for an entry "
                         f"with {s_count} buckets and {layers} layers.")
    sq, sk = _ints(meta, "stored_blocks", 2)
    factor = _ints(meta, "coarsen", 1)[0]
    if factor < 1 or -(-nq // factor) != sq or -(-nk // factor) != sk:
        raise ValueError(f"mask metadata is inconsistent: stored blocks {sq}x{sk} at coarsen {factor} "
                         f"for {nq}x{nk} blocks")
    shape = (heads, sq, sk)
    if codec == PACKBITS:
        maps = _inflate_bits(_part(tensors, f"b0.l{layer}.p"), shape)
        if bucket > 0:
            maps = maps ^ _inflate_bits(_part(tensors, f"b{bucket}.l{layer}.q"), shape)
        return _upsample(maps, factor, nq, nk)

    def parts(s):
        names = [f"b{s}.l{layer}.{p}" for p in "cde"]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"mask data lacks {', '.join(missing)}")
        return dict(zip("cde", (_bytes_of(tensors[n]) for n in names)))

    if f"b{bucket}.l{layer}.x" in tensors:
        maps = _join(parts(0), shape) ^ _unpack_indices(_bytes_of(tensors[f"b{bucket}.l{layer}.x"]), shape)
    else:
        maps = _join(parts(bucket), shape)
    return _upsample(maps, factor, nq, nk)


def decode_packed_block_map(tensors: dict, meta: dict, bucket: int, layer: int) -> np.ndarray:
    """One layer set as packed bits, uint8 ``[H, nq, ceil(nk / 8)]`` (``np.packbits`` order, padding
    cleared): what a hit uploads. The shipped codec at full resolution inflates straight to it,
    with no unpacking on the host; other entries are decoded and packed."""
    s_count, layers, heads, nq, nk = _ints(meta, "shape", 5)
    lossless_packbits = meta.get("codec") == PACKBITS and _ints(meta, "coarsen", 1)[0] == 1
    if not lossless_packbits or not (0 <= bucket < s_count and 0 <= layer < layers):
        return np.packbits(decode_block_map(tensors, meta, bucket, layer), axis=-1)  # checks and errors there
    shape = (heads, nq, nk)
    if _ints(meta, "stored_blocks", 2) != (nq, nk):
        raise ValueError(f"mask metadata is inconsistent: stored blocks {meta.get('stored_blocks')} "
                         f"at coarsen 1 for {nq}x{nk} blocks")
    packed = _inflate_packed(_part(tensors, f"b0.l{layer}.p"), shape)
    if bucket > 0:
        packed = packed ^ _inflate_packed(_part(tensors, f"b{bucket}.l{layer}.q"), shape)
    return clear_padding(packed.copy() if bucket == 0 else packed, nk)


def _ints(meta: dict, key: str, count: int) -> tuple[int, ...]:
    """A comma-separated list of ``count`` non-negative ints from the metadata, or ValueError."""
    try:
        values = tuple(int(x) for x in str(meta[key]).split(","))
    except (KeyError, ValueError) as exc:
        raise ValueError(f"mask metadata {key!r} is missing or not integers") from exc
    if len(values) != count or min(values) < 0:
        raise ValueError(f"mask metadata {key!r} must hold {count} non-negative integers, got {meta[key]!r}")
    return values


def _part(tensors: dict, name: str) -> np.ndarray:
    if name not in tensors:
        raise ValueError(f"mask data lacks {name}")
    return _bytes_of(tensors[name])


def _bytes_of(part) -> np.ndarray:
    if not isinstance(part, np.ndarray) or part.dtype != np.uint8 or part.ndim != 1:
        raise ValueError("mask data parts must be 1-D uint8 arrays")
    return part
