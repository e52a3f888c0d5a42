"""Exceptions of the mask bank. Every message says what to do next."""


class BankError(Exception):
    """Base class of every mask bank error; callers fall back to dense attention on it."""


class BankReadOnly(BankError):
    """A write was attempted on a bank opened with ``read_only=True`` or on a read-only path."""


class BankEntryCorrupt(BankError):
    """An entry's blob is missing, truncated or fails its digest; it has been quarantined.

    :param entry_id: the entry that was quarantined
    """

    def __init__(self, entry_id: str, reason: str):
        self.entry_id = entry_id
        self.reason = reason
        super().__init__(
            f"Mask bank entry {entry_id} is corrupt ({reason}); it was moved to quarantine. "
            "Run this request with dense attention (or an online predictor) and record it again; "
            "run `python -m chorus_core.bank verify PATH` to check the rest of the bank."
        )


class BankIncompatible(BankError):
    """Masks handed to the bank do not fit the layout or schedule they are stored under."""
