"""Stable names of functions and types, for digests and cache keys (never ``id()``, which a new
object of the same code changes)."""

from __future__ import annotations

import functools


def callable_name(function) -> str:
    """``module.qualname`` of a function (``partial(...)`` around a partial's), else its type's."""
    if isinstance(function, functools.partial):
        return f"partial({callable_name(function.func)})"
    name = getattr(function, "__qualname__", None)
    return f"{getattr(function, '__module__', '')}.{name}" if name else type_name(function)


def type_name(value) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"
