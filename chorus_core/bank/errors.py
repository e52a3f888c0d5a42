"""Exceptions of the mask bank. Every message says what to do next."""


class BankError(Exception):
    """Base class of every mask bank error; callers fall back to dense attention on it."""


class BankReadOnly(BankError):
    """A write was attempted on a bank opened with ``read_only=True`` or on a read-only path."""


class BankInvalidArgument(BankError, ValueError):
    """An argument that would make a bank command do harm or nothing (e.g. a negative limit)."""


class BankEntryCorrupt(BankError):
    """An entry's blob is missing, damaged or cannot serve its layout; it has been quarantined
    (or, in a read-only bank, is skipped for the rest of the process).

    :param entry_id: the entry that was quarantined
    :param reason: what is wrong with it
    :param moved: False when the bank is read-only and nothing was moved
    """

    def __init__(self, entry_id: str, reason: str, moved: bool = True):
        self.entry_id = entry_id
        self.reason = reason
        self.moved = moved
        where = ("it was moved to quarantine" if moved else
                 "the bank is read-only, so it would be quarantined but nothing was moved; "
                 "this process skips it from now on")
        super().__init__(
            f"Mask bank entry {entry_id} is corrupt ({reason}); {where}. "
            "The request that matched it runs as an online-prediction miss (dense with miss_mode "
            "\"dense\") and, in a writable bank, records a fresh entry; "
            "run `python -m chorus_core.bank verify PATH` to check the rest of the bank."
        )


class BankIncompatible(BankError):
    """Masks handed to the bank do not fit the layout or schedule they are stored under."""


class BankUnavailable(BankError):
    """A bank server (PostgreSQL) cannot be reached or the connection was lost; the request
    runs as a miss and the next call reconnects. The message names the host, never a password."""
