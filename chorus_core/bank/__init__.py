"""Chorus mask bank: recorded block-sparse attention masks, indexed by request signature.

Public API::

    bank = open_bank(path)                           # folder with bank.sqlite + blobs/
    bank = open_bank("postgresql://chorus@db/chorus?schema=fleet")  # PostgreSQL (psycopg 3)
    entry_id = bank.add_entry(fingerprint=..., layout=..., schedule=..., masks=...,
                              signature=..., density=..., recall=..., tags=[...])
    result = bank.match(signature, fingerprint, layout, threshold=0.9)
    masks = bank.load_masks(result.entry_id)          # EntryMasks; .block_map(bucket, layer)

``MaskBank.open(location)`` is the same as ``open_bank(location)``. Both backends implement
:class:`BankStorage` (:mod:`.storage`): the folder bank in :mod:`.sqlite_store`, the
PostgreSQL bank in :mod:`.pg_store`; neither imports the other, and only this package module
chooses between them. Nothing here imports ComfyUI; open_clip is imported only by
:mod:`.clip_encoder`, psycopg only by :mod:`.pg_store`.
"""

from .bank_url import is_bank_url
from .encoding import CODEC, decode_block_map, encode_masks
from .entry_masks import EntryMasks
from .errors import BankEntryCorrupt, BankError, BankIncompatible, BankReadOnly, BankUnavailable
from .fingerprint import ModelFingerprint, fingerprint_model
from .matching import MatchResult
from .records import LatentLayout, Schedule, default_step_buckets
from .rows import compat_key
from .schema import SCHEMA_VERSION
from .signature import DEFAULT_WEIGHTS, Signature, build_signature
from .sqlite_store import SQLiteBank
from .storage import BankStorage

__all__ = [
    "open_bank", "MaskBank", "BankStorage", "PostgresBank", "EntryMasks", "BankError", "BankEntryCorrupt", "BankReadOnly", "BankIncompatible", "BankUnavailable",
    "Signature", "build_signature", "DEFAULT_WEIGHTS", "ModelFingerprint", "fingerprint_model",
    "MatchResult", "LatentLayout", "Schedule", "default_step_buckets", "SCHEMA_VERSION",
    "encode_masks", "decode_block_map", "CODEC", "compat_key", "ClipImageEncoder",
]


def open_bank(location, read_only: bool = False, create: bool = True) -> BankStorage:
    """Open (and by default create) the bank at ``location``, choosing its backend.

    :param location: a folder holding ``bank.sqlite`` and ``blobs/`` (a :class:`MaskBank`),
        or a bank URL ``postgresql://USER@HOST:PORT/DATABASE?schema=NAME`` (see
        :mod:`.bank_url`; a :class:`~chorus_core.bank.pg_store.PostgresBank`)
    :param read_only: open without ever writing (no hit counts either); a bank on a
        read-only folder or mount opens this way
    :param create: create the folder (or schema) and database when missing
    :raises BankError: when the bank is missing, damaged, not a Chorus bank, or newer
    :raises BankReadOnly: when a writable bank was asked for on a read-only location
    """
    if is_bank_url(location):
        return _open_postgres(location, read_only, create)
    return MaskBank.open_folder(location, read_only=read_only, create=create)


class MaskBank(SQLiteBank):
    """The folder bank under its documented name. Its :meth:`open` takes any location, as
    :func:`open_bank` does (a URL gives a PostgresBank): it lives here, above both backends,
    so that neither backend module has to import the other."""

    @classmethod
    def open(cls, location, read_only: bool = False, create: bool = True) -> BankStorage:
        """Alias of :func:`open_bank` (kept: nodes, tests and scripts call it)."""
        return open_bank(location, read_only=read_only, create=create)


def _open_postgres(url: str, read_only: bool, create: bool) -> BankStorage:
    try:
        from .pg_store import PostgresBank  # psycopg is needed only for PostgreSQL banks
    except ImportError as exc:
        raise BankError(f"PostgreSQL mask banks need psycopg 3 ({exc}); install it with "
                        "`pip install 'psycopg[binary]>=3.1'` in ComfyUI's Python.") from None
    return PostgresBank.open(url, read_only=read_only, create=create)


def __getattr__(name):
    if name == "ClipImageEncoder":  # lazy: open_clip is optional for the rest of the bank
        from .clip_encoder import ClipImageEncoder

        return ClipImageEncoder
    if name == "PostgresBank":  # lazy: psycopg is optional (the postgres extra)
        from .pg_store import PostgresBank

        return PostgresBank
    raise AttributeError(name)
