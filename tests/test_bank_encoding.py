"""Mask codec: lossless round trips, cross-bucket deltas, OR-coarsening."""

import numpy as np
import pytest

from chorus_core.bank import decode_block_map, encode_masks
from chorus_core.bank.encoding import CODECS, PACKBITS, ROWSHIFT, coarsen_maps

both_codecs = pytest.mark.parametrize("codec", CODECS)


def banded(heads=3, n=40, seed=0):
    """Local windows + global columns + isolated extras, like real block masks."""
    rng = np.random.default_rng(seed)
    i = np.arange(n)
    maps = np.stack([np.abs(i[:, None] - i[None, :]) <= rng.integers(1, 5) for _ in range(heads)])
    maps[:, :, rng.integers(0, n, 2)] = True
    maps |= rng.random(maps.shape) < 0.01
    return maps


def decode_all(tensors, meta, shape):
    return np.stack([np.stack([decode_block_map(tensors, meta, s, l) for l in range(shape[1])])
                     for s in range(shape[0])])


@both_codecs
@pytest.mark.parametrize("kind", ["random", "banded", "empty", "full"])
def test_lossless_round_trip(kind, codec):
    rng = np.random.default_rng(1)
    if kind == "random":
        masks = rng.random((3, 2, 3, 37, 41)) < 0.2
    elif kind == "banded":
        masks = np.stack([np.stack([banded(seed=s * 2 + l) for l in range(2)]) for s in range(3)])
    else:
        masks = np.full((2, 2, 3, 16, 16), kind == "full")
    tensors, meta = encode_masks(masks, codec=codec)
    assert meta["codec"] == codec
    assert (decode_all(tensors, meta, masks.shape) == masks).all()
    assert all(t.dtype == np.uint8 for t in tensors.values())


@pytest.mark.parametrize("codec, names", [(ROWSHIFT, ["b0.l0.c", "b0.l0.d", "b0.l0.e", "b1.l0.x"]),
                                          (PACKBITS, ["b0.l0.p", "b1.l0.q"])])
def test_similar_buckets_are_stored_as_deltas(codec, names):
    base = banded(seed=3)
    later = base.copy()
    later[0, 5, 30] ^= True
    masks = np.stack([base[None], later[None]])
    tensors, meta = encode_masks(masks, codec=codec)
    assert sorted(tensors) == names
    assert (decode_block_map(tensors, meta, 1, 0) == later).all()
    if codec == PACKBITS:  # one flipped block: the delta compresses to far less than the base
        assert tensors["b1.l0.q"].size < tensors["b0.l0.p"].size


def test_new_entries_use_the_packed_bits_codec():
    assert encode_masks(np.ones((1, 1, 1, 4, 4), bool))[1]["codec"] == PACKBITS


@pytest.mark.parametrize("size, message", [(3, "inflates to 3 bytes"), (10_000, "inflates to more than")])
def test_packed_bits_of_the_wrong_size_are_refused(size, message):
    import zlib

    tensors, meta = encode_masks(np.ones((1, 1, 2, 8, 8), bool))
    tensors["b0.l0.p"] = np.frombuffer(zlib.compress(bytes(size)), np.uint8)
    with pytest.raises(ValueError, match=message):
        decode_block_map(tensors, meta, 0, 0)


@both_codecs
def test_coarsened_storage_is_a_superset(codec):
    masks = banded(seed=4)[None, None]
    tensors, meta = encode_masks(masks, coarsen=2, codec=codec)
    out = decode_block_map(tensors, meta, 0, 0)
    assert out.shape == masks.shape[2:] and (out >= masks[0, 0]).all()
    assert (coarsen_maps(out, 2) == coarsen_maps(masks[0, 0], 2)).all()


def test_torch_input_and_errors():
    import torch

    masks = torch.rand(1, 1, 2, 8, 8) < 0.5
    tensors, meta = encode_masks(masks)
    assert (decode_block_map(tensors, meta, 0, 0) == masks[0, 0].numpy()).all()
    with pytest.raises(ValueError, match=r"\[S, L, H, nq, nk\]"):
        encode_masks(np.zeros((2, 8, 8), bool))
    with pytest.raises(IndexError, match="out of range"):
        decode_block_map(tensors, meta, 1, 0)


def test_packed_recordings_encode_to_the_same_bytes_as_their_bool_maps():
    from chorus_core.bank.encoding import PackedBlockMaps

    rng = np.random.default_rng(5)
    masks = rng.random((3, 2, 3, 9, 13)) < 0.3
    packed = np.packbits(masks, axis=-1)
    packed[..., -1] |= 0b111  # padding bits past nk = 13 set, as a careless packer might leave them
    direct, meta = encode_masks(PackedBlockMaps(packed, 13))
    assert direct.keys() == encode_masks(masks)[0].keys()
    assert all(np.array_equal(direct[k], v) for k, v in encode_masks(masks)[0].items())
    assert (decode_all(direct, meta, masks.shape) == masks).all()


@both_codecs
@pytest.mark.parametrize("coarsen", [1, 2])
def test_packed_decode_is_the_packed_bool_decode(codec, coarsen):
    """What a hit uploads (packed bits, inflated without unpacking for the shipped codec) is the
    bool decode, packed: every bucket (base and XOR delta) and layer, a width that is not a whole byte."""
    from chorus_core.bank.encoding import decode_packed_block_map

    rng = np.random.default_rng(5)
    masks = rng.random((3, 2, 3, 21, 43)) < 0.2
    tensors, meta = encode_masks(masks, codec=codec, coarsen=coarsen)
    for s in range(3):
        for layer in range(2):
            packed = decode_packed_block_map(tensors, meta, s, layer)
            expected = np.packbits(decode_block_map(tensors, meta, s, layer), axis=-1)
            assert packed.dtype == np.uint8 and packed.flags.writeable
            assert np.array_equal(packed, expected)


def test_set_padding_bits_in_a_stored_entry_are_cleared():
    """A hostile entry's padding bits would name key blocks past the last one: they never reach the kernel."""
    import zlib

    from chorus_core.bank.encoding import decode_packed_block_map

    masks = np.zeros((1, 1, 1, 2, 11), bool)
    masks[..., 0] = True
    tensors, meta = encode_masks(masks)
    raw = np.packbits(masks[0, 0], axis=-1)
    raw[..., -1] |= 0b00011111  # the 5 bits past column 10
    tensors["b0.l0.p"] = np.frombuffer(zlib.compress(raw.tobytes()), np.uint8)
    assert np.array_equal(decode_packed_block_map(tensors, meta, 0, 0), np.packbits(masks[0, 0], axis=-1))
