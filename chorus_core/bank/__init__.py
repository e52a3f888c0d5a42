"""Chorus mask bank: recorded block-sparse attention masks, indexed by request signature.

Public API::

    bank = MaskBank.open(path)                       # folder with bank.sqlite + blobs/
    bank = MaskBank.open("postgresql://chorus@db/chorus?schema=fleet")  # PostgreSQL (psycopg 3)
    entry_id = bank.add_entry(fingerprint=..., layout=..., schedule=..., masks=...,
                              signature=..., density=..., recall=..., tags=[...])
    result = bank.match(signature, fingerprint, layout, threshold=0.9)
    masks = bank.load_masks(result.entry_id)          # EntryMasks; .block_map(bucket, layer)

Both backends implement :class:`BankStorage`. Nothing here imports ComfyUI; open_clip is
imported only by :mod:`.clip_encoder`, psycopg only by :mod:`.pg_store`.
"""

from .encoding import CODEC, decode_block_map, encode_masks
from .errors import BankEntryCorrupt, BankError, BankIncompatible, BankReadOnly, BankUnavailable
from .fingerprint import ModelFingerprint, fingerprint_model
from .matching import MatchResult
from .records import LatentLayout, Schedule, default_step_buckets
from .schema import SCHEMA_VERSION
from .signature import DEFAULT_WEIGHTS, Signature, build_signature
from .store import BankStorage, EntryMasks, MaskBank, compat_key

__all__ = [
    "MaskBank", "BankStorage", "PostgresBank", "EntryMasks", "BankError", "BankEntryCorrupt", "BankReadOnly", "BankIncompatible", "BankUnavailable",
    "Signature", "build_signature", "DEFAULT_WEIGHTS", "ModelFingerprint", "fingerprint_model",
    "MatchResult", "LatentLayout", "Schedule", "default_step_buckets", "SCHEMA_VERSION",
    "encode_masks", "decode_block_map", "CODEC", "compat_key", "ClipImageEncoder",
]


def __getattr__(name):
    if name == "ClipImageEncoder":  # lazy: open_clip is optional for the rest of the bank
        from .clip_encoder import ClipImageEncoder

        return ClipImageEncoder
    if name == "PostgresBank":  # lazy: psycopg is optional (the postgres extra)
        from .pg_store import PostgresBank

        return PostgresBank
    raise AttributeError(name)
