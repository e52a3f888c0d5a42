"""Checks that keep bad rows, blobs and export files from doing harm: ids, names, sizes,
safetensors headers, block maps, and the rebuilding of a row from untrusted values.

Everything here is pure (no file or database access) so each check is cheap and testable.
A failed check raises ``ValueError`` with the reason; the store turns it into quarantine or
a :class:`~chorus_core.bank.errors.BankError` that says what to do.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass

import numpy as np

from .encoding import CODECS, PART_NAMES, PackedBlockMaps
from .fingerprint import ModelFingerprint
from .records import LatentLayout, Schedule
from .signature import COMPONENTS, DIM

ENTRY_ID = re.compile(r"[0-9a-f]{32}")  # uuid4().hex, as add_entry makes them
SHA256 = re.compile(r"[0-9a-f]{64}")
BLOB_SUFFIX = ".safetensors"

# Bounds of a shape Chorus will store or decode. Wan 2.1 720p x 81 frames is 3 buckets x
# 40 layers x 40 heads x 591 x 591 blocks (14 M elements per layer set); these leave room
# for longer or larger videos while refusing shapes that ask for tens of GiB.
MAX_BUCKETS = 64
MAX_LAYERS = 256
MAX_HEADS = 256
MAX_LAYER_ELEMENTS = 2 ** 28  # one decoded [H, nq, nk] bool map: at most 256 MiB
MAX_HEADER_BYTES = 16 * 2 ** 20
MAX_STEPS = 10_000
MAX_SIGMAS = MAX_STEPS + 1
MAX_SIGMAS_TEXT = 32 * MAX_SIGMAS  # a float's repr and ", " take at most 26 characters
_TENSOR_NAME = re.compile(r"b(\d+)\.l(\d+)\.([cdexpq])")


def load_json(text, what: str):
    """``json.loads`` of untrusted text whose every failure is a ValueError naming ``what``.

    ``json.loads`` raises RecursionError for deep nesting and a bare ValueError for an integer
    of more digits than Python converts; both would escape handlers that expect
    JSONDecodeError (the CLI called them "a Chorus bug").
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} is not valid JSON (nested more than "
                         f"{sys.getrecursionlimit()} levels deep)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what} is not valid JSON ({exc})") from None
    except ValueError:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise ValueError(f"{what} is not valid JSON (holds a number of more than "
                         f"{sys.get_int_max_str_digits()} digits)") from None
    except TypeError:
        raise ValueError(f"{what} is not JSON text") from None


def is_entry_id(value) -> bool:
    return isinstance(value, str) and ENTRY_ID.fullmatch(value) is not None


def is_sha256(value) -> bool:
    return isinstance(value, str) and SHA256.fullmatch(value) is not None


def blob_name(sha: str) -> str:
    """The only blob name Chorus uses: derived from the content digest, never from a row."""
    if not is_sha256(sha):
        raise ValueError(f"blob sha256 {sha!r} is not 64 lowercase hex digits")
    return sha + BLOB_SUFFIX


def inside(folder_real: str, path) -> bool:
    """Whether ``path`` lies inside ``folder_real`` (an already resolved folder) once its
    parent folders are resolved; the last component is not followed, so a symlink placed
    in the bank counts as inside and can be moved without touching its target."""
    path = os.fspath(path)
    parent = os.path.realpath(os.path.dirname(path))
    full = os.path.join(parent, os.path.basename(path))
    return os.path.commonpath([folder_real, full]) == folder_real and full != folder_real


# ---- shapes and sizes -------------------------------------------------------------------
def check_shape_bounds(shape) -> None:
    """Refuse shapes no sane entry has, before anything is allocated for them."""
    s_count, layers, heads, nq, nk = shape
    if min(shape) < 1:
        raise ValueError(f"mask shape {tuple(shape)} has an empty dimension")
    if s_count > MAX_BUCKETS or layers > MAX_LAYERS or heads > MAX_HEADS \
            or heads * nq * nk > MAX_LAYER_ELEMENTS:
        raise ValueError(
            f"mask shape {tuple(shape)} is larger than Chorus stores (at most {MAX_BUCKETS} "
            f"buckets, {MAX_LAYERS} layers, {MAX_HEADS} heads and {MAX_LAYER_ELEMENTS} "
            "blocks per layer)")


def max_blob_bytes(shape) -> int:
    """Largest blob a valid entry of ``shape`` can have: 4x its raw bit size plus headers.

    The codec stores kept-block indices; unstructured random masks, its worst case, cost at
    most ~1.6 bits per block after zlib (measured at 5-95 % density), so 32 bits per 8 blocks
    is a generous ceiling that still refuses a 2 GB file in place of a 1 MB entry.
    """
    s_count, layers, heads, nq, nk = (int(x) for x in shape)
    raw = -(-(s_count * layers * heads * nq * nk) // 8)
    return 4 * raw + 512 * s_count * layers + 2 ** 20


def expected_shape(schedule: Schedule, fingerprint: ModelFingerprint, layout: LatentLayout) -> tuple:
    """(buckets, layers, heads, nq, nk) that an entry with these records must have."""
    return (len(schedule.step_buckets), fingerprint.layers, fingerprint.heads, *layout.blocks)


# ---- masks ------------------------------------------------------------------------------
def check_block_map(maps: np.ndarray, shape) -> None:
    """A decoded ``[H, nq, nk]`` map: right shape, bool, and every query row keeps a block
    (an empty row has no key to attend to and makes the kernel's softmax undefined)."""
    if tuple(maps.shape) != tuple(shape):
        raise ValueError(f"decoded block map has shape {tuple(maps.shape)}, "
                         f"the entry declares {tuple(shape)}")
    if maps.dtype != bool:
        raise ValueError(f"decoded block map has dtype {maps.dtype}, expected bool")
    empty = ~maps.any(axis=-1)
    if empty.any():
        head, row = (int(x) for x in np.argwhere(empty)[0])
        raise ValueError(f"block map has {int(empty.sum())} empty query rows "
                         f"(first: head {head}, query block {row})")


def check_packed_block_map(packed: np.ndarray, shape) -> None:
    """A decoded layer set as packed bits (padding cleared): ``[H, nq, ceil(nk / 8)]`` uint8 for the
    declared bool ``shape`` ``[H, nq, nk]``, and every query row keeps a block (a row of zero bytes keeps none)."""
    heads, nq, nk = shape
    if tuple(packed.shape) != (heads, nq, -(-nk // 8)) or packed.dtype != np.uint8:
        raise ValueError(f"decoded packed block map is {packed.dtype} {tuple(packed.shape)}, "
                         f"the entry declares bool {tuple(shape)}")
    empty = ~packed.any(axis=-1)
    if empty.any():
        head, row = (int(x) for x in np.argwhere(empty)[0])
        raise ValueError(f"block map has {int(empty.sum())} empty query rows "
                         f"(first: head {head}, query block {row})")


def check_masks(masks) -> None:
    """Masks handed to ``add_entry``: bool ``[S, L, H, nq, nk]`` (or PackedBlockMaps) with no empty query row."""
    # Packing pads with zero bits, so a row of packed bytes is all zero exactly when the row keeps nothing.
    empty = ~(masks.packed if isinstance(masks, PackedBlockMaps) else masks).any(axis=-1)
    if empty.any():
        s, layer, head, row = (int(x) for x in np.argwhere(empty)[0])
        raise ValueError(f"{int(empty.sum())} query rows keep no key block (first: bucket {s}, "
                         f"layer {layer}, head {head}, query block {row})")


# ---- safetensors header -----------------------------------------------------------------
def header_length(data: bytes, total: int) -> int:
    """Bytes of the JSON header of a ``total``-byte safetensors file, from its first 8 bytes."""
    if total < 8 or len(data) < 8:
        raise ValueError(f"blob of {total} bytes is too short for a safetensors header")
    size = int.from_bytes(data[:8], "little")
    if size > min(MAX_HEADER_BYTES, total - 8):
        raise ValueError(f"safetensors header declares {size} bytes, the blob has {total}")
    return size


def read_header(data: bytes, total: int | None = None) -> dict:
    """The JSON header of a safetensors file, without loading any tensor.

    :param data: the file, or (with ``total``) just its first ``8 + header`` bytes, so a
        large blob's header can be checked before the rest is read
    :param total: the whole file's size (default: ``len(data)``)
    """
    total = len(data) if total is None else total
    size = header_length(data, total)
    if len(data) < 8 + size:
        raise ValueError(f"safetensors header is cut short ({len(data) - 8} of {size} bytes)")
    header = load_json(data[8:8 + size], "safetensors header")
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    header["__data_bytes__"] = total - 8 - size
    return header


def check_header(header: dict, shape) -> dict:
    """Check a blob's header against the shape its row declares; return the Chorus metadata.

    Only uint8 1-D tensors with the codec's names, spans that tile the data exactly, and
    metadata whose codec, shape, coarsening and stored grid match ``shape``.
    """
    header = dict(header)
    data_bytes = header.pop("__data_bytes__")
    meta = _chorus_meta(header.pop("__metadata__", None), shape)
    spans, names = [], {}
    for name, info in header.items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"unexpected tensor {name[:80]!r} in the blob")
        if not isinstance(info, dict) or info.get("dtype") != "U8":
            raise ValueError(f"tensor {name} is not uint8")
        dims, offsets = info.get("shape"), info.get("data_offsets")
        if not (_int_list(dims, 1) and _int_list(offsets, 2)) or offsets[1] - offsets[0] != dims[0]:
            raise ValueError(f"tensor {name} has a malformed shape or span")
        spans.append(tuple(offsets))
        names.setdefault((int(match[1]), int(match[2])), set()).add(match[3])
    _check_spans(sorted(spans), data_bytes)
    _check_parts(names, shape, meta["codec"])
    return meta


def check_part_sizes(header: dict, shape, meta: dict) -> None:
    """Each tensor of a header (already passed :func:`check_header`) no larger than its part
    can be for one layer set of ``shape`` (:func:`max_part_bytes`): with spans that tile the
    data, the whole blob is then never larger than its layout needs, known from the header."""
    for name, info in header.items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            continue  # __metadata__, __data_bytes__
        most = max_part_bytes(match[3], shape[2], meta["stored_blocks"])
        if info["shape"][0] > most:
            raise ValueError(f"tensor {name} declares {info['shape'][0]} bytes; that part of "
                             f"one layer set needs at most {most} for this layout")


def zlib_bound(size: int) -> int:
    """Most bytes ``zlib.compress`` can make of ``size`` input bytes (zlib's compressBound)."""
    return size + (size >> 12) + (size >> 14) + (size >> 25) + 13


def max_part_bytes(part: str, heads: int, stored_blocks: str) -> int:
    """Most bytes one codec part of one layer set can take: zlib's bound on what it deflates.

    ``p``/``q`` (packbits) deflate the packed bits of ``[H, nq, nk]``; ``c`` (rowshift) deflates
    4-byte gaps of indices into ``[H, nk]``, ``d``/``e``/``x`` into ``[H, nq, nk]``.
    """
    nq, nk = (int(x) for x in stored_blocks.split(","))
    raw = {"p": heads * nq * -(-nk // 8), "q": heads * nq * -(-nk // 8),
           "c": 4 * heads * nk}.get(part, 4 * heads * nq * nk)
    return zlib_bound(raw)


def _int_list(value, length) -> bool:
    return (isinstance(value, list) and len(value) == length
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value))


def _chorus_meta(raw, shape) -> dict:
    try:
        meta = load_json(raw["chorus"], "blob metadata")
    except (TypeError, KeyError, ValueError):
        raise ValueError("blob metadata has no Chorus record") from None
    if not isinstance(meta, dict) or meta.get("codec") not in CODECS:
        raise ValueError(f"blob codec {meta.get('codec') if isinstance(meta, dict) else None!r} "
                         f"is not one of {', '.join(CODECS)}")
    declared = ",".join(map(str, shape))
    if meta.get("shape") != declared:
        raise ValueError(f"blob declares mask shape {str(meta.get('shape'))[:80]!r}, "
                         f"its row's model, layout and schedule say {declared!r}")
    nq, nk = shape[3], shape[4]
    coarsen = meta.get("coarsen")
    if not (isinstance(coarsen, str) and coarsen.isdigit() and 1 <= int(coarsen) <= max(nq, nk)):
        raise ValueError(f"blob declares coarsening {str(coarsen)[:20]!r}")
    c = int(coarsen)
    if meta.get("stored_blocks") != f"{-(-nq // c)},{-(-nk // c)}":
        raise ValueError(f"blob declares stored blocks {str(meta.get('stored_blocks'))[:40]!r}, "
                         f"coarsening {c} of {nq}x{nk} gives {-(-nq // c)},{-(-nk // c)}")
    return {k: meta[k] for k in ("codec", "shape", "stored_blocks", "coarsen")}


def _check_spans(spans, data_bytes: int) -> None:
    end = 0
    for start, stop in spans:
        if start != end:
            raise ValueError("tensor spans overlap or leave gaps")
        end = stop
    if end != data_bytes:
        raise ValueError(f"tensors cover {end} bytes, the blob holds {data_bytes}")


def _check_parts(names: dict, shape, codec: str) -> None:
    s_count, layers = shape[0], shape[1]
    first, later = PART_NAMES[codec]
    for (s, layer), parts in names.items():
        if s >= s_count or layer >= layers:
            raise ValueError(f"tensor for bucket {s} / layer {layer} is outside shape {tuple(shape)}")
    for layer in range(layers):
        if names.get((0, layer)) != first:
            raise ValueError(f"bucket 0 of layer {layer} lacks its {'/'.join(sorted(first))} parts")
        for s in range(1, s_count):
            if names.get((s, layer)) not in later:
                raise ValueError(f"bucket {s} of layer {layer} has parts {sorted(names.get((s, layer), ()))}, "
                                 f"expected {' or '.join('/'.join(sorted(p)) for p in later)}")


# ---- rows -------------------------------------------------------------------------------
@dataclass(frozen=True)
class EntrySpec:
    """What a row says its entry is; every value checked."""

    fingerprint: ModelFingerprint
    layout: LatentLayout
    schedule: Schedule
    shape: tuple

    @property
    def max_blob_bytes(self) -> int:
        return max_blob_bytes(self.shape)


def _positive_int(row, key, limit=2 ** 31) -> int:
    value = row.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
        raise ValueError(f"{key} must be a positive integer, got {str(value)[:40]!r}")
    return value


def _text(row, key, limit=64) -> str:
    value = row.get(key)
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"{key} must be text of at most {limit} characters")
    return value


def finite(value, key, low=-math.inf, high=math.inf, optional=False):
    if value is None and optional:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) \
            or not _isfinite(value) or not low <= value <= high:
        raise ValueError(f"{key} must be a finite number in [{low}, {high}], got {str(value)[:40]!r}")
    return float(value)


def _isfinite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float (JSON allows 4300 digits)
        return False


def parse_fingerprint(text) -> ModelFingerprint:
    fields = load_json(text, "fingerprint")
    try:
        fp = ModelFingerprint(architecture=_text(fields, "architecture"),
                              dim=_positive_int(fields, "dim"),
                              layers=_positive_int(fields, "layers", MAX_LAYERS),
                              heads=_positive_int(fields, "heads", MAX_HEADS),
                              in_dim=_positive_int(fields, "in_dim"),
                              digest=_text(fields, "digest", 128))
    except (TypeError, AttributeError):
        raise ValueError("fingerprint is not a JSON model fingerprint") from None
    return fp


def entry_spec(row: dict) -> EntrySpec:
    """Rebuild and check the records of a row (from the index or from an export file)."""
    fp = parse_fingerprint(row.get("fingerprint"))
    layout = LatentLayout(grid=(_positive_int(row, "grid_t", 4096), _positive_int(row, "grid_h", 4096),
                                _positive_int(row, "grid_w", 4096)),
                          token_order=_text(row, "token_order", 16),
                          block_size=(_positive_int(row, "block_q", 4096),
                                      _positive_int(row, "block_k", 4096)))
    try:
        buckets = load_json(row.get("step_buckets"), "step_buckets")
        if not (isinstance(buckets, list) and 0 < len(buckets) <= MAX_BUCKETS
                and all(_int_list(b, 2) for b in buckets)):
            raise ValueError
        steps = _positive_int(row, "steps", MAX_STEPS)
        sampler, scheduler = _text(row, "sampler"), _text(row, "scheduler")
        shift = finite(row.get("shift"), "shift")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"step buckets unreadable ({exc or 'not a list of [start, end]'})") from None
    sigmas = parse_sigmas(row.get("sigmas"))
    try:
        schedule = Schedule(steps=steps, sampler=sampler, scheduler=scheduler, shift=shift,
                            step_buckets=buckets, sigmas=sigmas)
    except Exception as exc:  # BankIncompatible: buckets not contiguous, sigmas unfit
        raise ValueError(str(exc)) from None
    shape = expected_shape(schedule, fp, layout)
    check_shape_bounds(shape)
    return EntrySpec(fp, layout, schedule, shape)


def parse_sigmas(text) -> list | None:
    """A row's ``sigmas`` column (JSON text of a list of numbers, or None) as a list of
    finite floats; their count and order are the Schedule's to check against its steps.

    :raises ValueError: naming ``sigmas``: not text, too long, not JSON, not a list of numbers
    """
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError("sigmas must be JSON text of a list of numbers (or null)")
    if len(text) > MAX_SIGMAS_TEXT:
        raise ValueError(f"sigmas text is {len(text)} characters long, more than the "
                         f"{MAX_SIGMAS} values a schedule of {MAX_STEPS} steps can hold")
    values = load_json(text, "sigmas")
    if not isinstance(values, list) or not 0 < len(values) <= MAX_SIGMAS:
        raise ValueError(f"sigmas must be a list of 1 to {MAX_SIGMAS} numbers")
    return [finite(v, f"sigmas[{i}]", 0.0) for i, v in enumerate(values)]


SIGNATURE_NORM_TOLERANCE = 1e-3  # float32 rounding of a unit vector is ~1e-7


def signature_bytes(value, key) -> bytes | None:
    """A signature component as stored: None or DIM float32 values, finite, of unit length.

    Chorus only ever stores unit vectors; any other length in an export was put there by
    hand, and would score beyond the metric (a vector 1000x too long took every match).
    """
    if value is None:
        return None
    if not isinstance(value, bytes) or len(value) != DIM * 4:
        raise ValueError(f"{key} must be {DIM} float32 values")
    vec = np.frombuffer(value, np.float32)
    if not np.isfinite(vec).all():
        raise ValueError(f"{key} holds NaN or infinite values")
    norm = float(np.linalg.norm(vec.astype(np.float64)))
    if abs(norm - 1.0) > SIGNATURE_NORM_TOLERANCE:
        raise ValueError(f"{key} has norm {norm:.4g}, not 1: signatures are unit vectors, so "
                         "this row was altered after its export")
    return value


def tags_json(value) -> str:
    tags = load_json(value, "tags") if value is not None else []
    if not (isinstance(tags, list) and len(tags) <= 64
            and all(isinstance(t, str) and len(t) <= 200 for t in tags)):
        raise ValueError("tags must be a list of at most 64 texts of at most 200 characters")
    return json.dumps(sorted(set(tags)))


SIGNATURE_COLUMNS = tuple(f"sig_{c}" for c in COMPONENTS)
