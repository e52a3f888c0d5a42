"""A bank's size budget: what it is, which entries are worth least, and what an eviction freed.

The budget lives in the bank's own ``meta`` table (keys ``budget_bytes``, ``budget_entries``), so
every process and machine writing one bank keeps the same one. A writer reads it inside its write
transaction, under the bank's write lock, and evicts there (:meth:`BankStorage._keep_budget`): two
writers can never both believe there is room for their entry. Nothing here touches storage; the
backends call :func:`choose_evictions` with the rows and quarantined blobs they hold.

What counts against the budget: the blob bytes of every healthy entry (as ``stats()["bytes"]``
counts them) plus every quarantined blob still kept for inspection. Quarantined blobs serve no
request, so they go first when room is needed, and they are aged out after
:data:`QUARANTINE_KEEP_S` whatever the budget.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from dataclasses import dataclass, field

import numpy as np

from .errors import BankInvalidArgument
from .merge import VOTES_PREFIX

log = logging.getLogger("chorus")

BYTES_KEY, ENTRIES_KEY = "budget_bytes", "budget_entries"
# Hits gathered this long ago count half as much: traffic drifts (an effect template is retired,
# a new one trends) on a scale of days, and a week keeps a weekly cycle's entries alive.
RECENCY_HALF_LIFE_S = 7 * 24 * 3600.0
# A quarantined blob is kept this long for a person to inspect, then removed by the next write.
QUARANTINE_KEEP_S = 7 * 24 * 3600.0
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)I?B?")


# What an entry costs against the budget: its blob, and the merge votes it keeps in ``meta``
# (outside the blob, one byte per block before compression: unbounded if left uncounted).
COUNTED_ROWS = f"entries e LEFT JOIN meta v ON v.key = '{VOTES_PREFIX}' || e.id WHERE e.status = 'ok'"
COUNTED_BYTES = "COALESCE(e.blob_bytes, 0) + COALESCE(LENGTH(v.value), 0)"
HELD_SQL = f"SELECT COUNT(*) AS n, COALESCE(SUM({COUNTED_BYTES}), 0) AS b FROM {COUNTED_ROWS}"
# the rows choose_evictions takes (``blob_bytes``: the entry's whole cost)
ENTRY_COSTS_SQL = (f"SELECT e.id, {COUNTED_BYTES} AS blob_bytes, e.hits, COALESCE(e.last_hit, e.created) AS last_use, "
                   f"e.created FROM {COUNTED_ROWS}")


@dataclass(frozen=True)
class Budget:
    """Most bytes and most entries a bank keeps; None: no limit of that kind."""

    max_bytes: int | None = None
    max_entries: int | None = None

    @property
    def limited(self) -> bool:
        return self.max_bytes is not None or self.max_entries is not None

    def describe(self) -> str:
        parts = ([human_bytes(self.max_bytes)] if self.max_bytes is not None else []) + \
                ([f"{self.max_entries} entries"] if self.max_entries is not None else [])
        return " and ".join(parts) or "no budget"


@dataclass
class Eviction:
    """What one write removed to keep its bank within budget."""

    entry_ids: list = field(default_factory=list)  # healthy entries evicted, least worth first
    bytes_freed: int = 0  # their blob and vote bytes plus the quarantined blobs removed
    quarantined_removed: int = 0  # quarantined blobs aged out or removed for room
    budget: Budget = Budget()
    written: str | None = None  # the entry whose write made the room (None: setting the budget, an import)

    def __bool__(self) -> bool:
        return bool(self.entry_ids or self.quarantined_removed)

    def line(self) -> str:
        """The report's line, e.g. "bank budget: writing entry 1a2b3c4d evicted 3 entries (25.8 MB freed) ..."."""
        what = f"writing entry {self.written[:8]}" if self.written else "keeping the budget"
        quarantined = f" and {self.quarantined_removed} quarantined blob(s)" if self.quarantined_removed else ""
        return (f"bank budget: {what} evicted {len(self.entry_ids)} entr{'y' if len(self.entry_ids) == 1 else 'ies'}"
                f"{quarantined} ({human_bytes(self.bytes_freed)} freed) to stay within {self.budget.describe()}")

    def to_json(self) -> dict:
        return {"written": self.written, "evicted": len(self.entry_ids), "entry_ids": list(self.entry_ids),
                "bytes_freed": self.bytes_freed, "quarantined_removed": self.quarantined_removed,
                "max_bytes": self.budget.max_bytes, "max_entries": self.budget.max_entries, "line": self.line()}


def human_bytes(n: int) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def parse_size(text) -> int:
    """``"500M"``, ``"20G"``, ``"1048576"`` (or an int) -> bytes (binary units).

    :raises BankInvalidArgument: zero, negative, NaN, infinite or not a size
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _SIZE.fullmatch(str(text).strip().upper())
        value = float(match[1]) * _UNITS[match[2]] if match else math.nan
    if not (math.isfinite(value) and value >= 1):
        raise BankInvalidArgument(f"{str(text)[:40]!r} is not a positive size; write e.g. 20G, 500M or "
                                  "1048576 (bytes).")
    return int(value)


def check_budget(max_bytes, max_entries) -> Budget:
    """A budget from user values: None (no limit) or positive whole numbers.

    :raises BankInvalidArgument: zero, negative, fractional, NaN or infinite
    """
    for name, value in (("max_bytes", max_bytes), ("max_entries", max_entries)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BankInvalidArgument(f"budget {name} must be a positive whole number or None (no limit), got "
                                      f"{value!r}; e.g. max_bytes=20 * 2**30.")
    return Budget(max_bytes, max_entries)


def budget_from_meta(values: dict) -> Budget:
    """The budget stored in a bank's meta rows (``{key: value}``); a damaged value means no limit
    of that kind, never "evict everything"."""
    def positive(key):
        text = str(values.get(key) or "")
        return int(text) if text.isdigit() and int(text) > 0 else None

    return Budget(positive(BYTES_KEY), positive(ENTRIES_KEY))


def worth(hits: int, nbytes: int, last_use: float, now: float) -> float:
    """Expected hits per byte an entry will serve: what a budget of bytes should keep most of.

    Per byte, because the budget is bytes: keeping the entries of most hits per byte keeps the
    most hits in the space (the greedy knapsack). Past hits estimate an entry's future demand;
    +1 because the recording itself came from a request of its kind, so a fresh entry is worth
    one hit, not zero. Demand drifts, so the estimate halves for every
    :data:`RECENCY_HALF_LIFE_S` since the entry's last use (its creation counts as one).
    """
    idle = max(0.0, now - (last_use or 0.0))
    return (max(0, hits or 0) + 1) / max(1, nbytes or 0) * 0.5 ** (idle / RECENCY_HALF_LIFE_S)


def least_worth_first(rows: list[dict], now: float) -> list[dict]:
    """Healthy rows (``id``, ``blob_bytes``, ``hits``, ``last_use``, ``created``) in eviction order:
    least worth first; on equal worth the longer idle, then the older."""
    return sorted(rows, key=lambda r: (worth(r["hits"], r["blob_bytes"], r["last_use"], now),
                                       r["last_use"] or 0.0, r["created"] or 0.0, r["id"]))


def choose_evictions(rows: list[dict], quarantined: list[dict], budget: Budget, now: float,
                     protect=()) -> tuple[list[str], list]:
    """What to remove so the bank fits ``budget``: (entry ids, quarantined blob keys).

    :param rows: the healthy entries, as :func:`least_worth_first` takes them
    :param quarantined: the kept quarantined blobs, ``{"key", "bytes", "moved"}``
    :param protect: entry ids evicted only when nothing else is left (the entry just written:
        evicting it unseen would waste its recording; it goes at a later write if still worth least)
    """
    aged = [q for q in quarantined if now - (q["moved"] or 0.0) > QUARANTINE_KEEP_S]
    kept_q = sorted((q for q in quarantined if q not in aged), key=lambda q: q["moved"] or 0.0)
    total = sum(r["blob_bytes"] or 0 for r in rows) + sum(q["bytes"] for q in kept_q)
    count = len(rows)

    def over() -> bool:
        return ((budget.max_bytes is not None and total > budget.max_bytes)
                or (budget.max_entries is not None and count > budget.max_entries))

    dropped_q = list(aged)
    while kept_q and budget.max_bytes is not None and total > budget.max_bytes:
        q = kept_q.pop(0)  # serves nothing: goes before any entry
        dropped_q.append(q)
        total -= q["bytes"]
    ordered = least_worth_first(rows, now)
    ordered = [r for r in ordered if r["id"] not in protect] + [r for r in ordered if r["id"] in protect]
    doomed = []
    for row in ordered:
        if not over():
            break
        doomed.append(row["id"])
        total, count = total - (row["blob_bytes"] or 0), count - 1
    return doomed, [q["key"] for q in dropped_q]


# ---- prune, by hand: least recently used first (storage.py's prune) ---------------------
def check_prune_limit(name: str, value):
    """A prune limit: None, or a positive whole number; anything else would delete all."""
    if value is None:
        return None
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if ok and isinstance(value, (float, np.floating)):
        ok = bool(np.isfinite(value)) and float(value).is_integer()
    if not ok or value <= 0:
        flag = "--" + name.replace("_", "-")
        raise BankInvalidArgument(
            f"prune: {name} must be a positive whole number, got {value!r}; e.g. {flag} 20G "
            f"or {flag} 5000. A zero, negative, NaN or infinite limit is refused because it would "
            "delete every entry or none; to empty a bank, delete its folder.")
    return int(value)


def prune_order_cut(rows: list[dict], max_bytes, max_entries) -> list[str]:
    """The ids of ``rows`` (in eviction order) to remove until both limits hold."""
    total, count = sum(r["blob_bytes"] or 0 for r in rows), len(rows)
    doomed = []
    for row in rows:
        over_bytes = max_bytes is not None and total > max_bytes
        over_count = max_entries is not None and count > max_entries
        if not (over_bytes or over_count):
            break
        doomed.append(row["id"])
        total, count = total - (row["blob_bytes"] or 0), count - 1
    return doomed


# ---- what this process's writes evicted, for the next report on that bank ----------------
_recent: dict[str, list[Eviction]] = {}
_recent_lock = threading.Lock()
_RECENT_MAX = 32  # per bank: a report shows the latest ones, a process that never reports keeps no more


def note_eviction(bank_label: str, eviction: Eviction) -> None:
    """Remember (and log) an eviction until a report on the same bank takes it."""
    log.info("Chorus: %s (bank %s)", eviction.line(), bank_label)
    with _recent_lock:
        kept = _recent.setdefault(bank_label, [])
        kept.append(eviction)
        del kept[:-_RECENT_MAX]


def take_evictions(bank_label: str) -> list[Eviction]:
    """The evictions this process's writes to the bank made since the last call, oldest first."""
    with _recent_lock:
        return _recent.pop(bank_label, [])
