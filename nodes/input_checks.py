"""Checks shared by the nodes' ``validate_inputs``.

ComfyUI 0.3.64 passes ``validate_inputs`` only the inputs it names, reports a failure once on
each of them, and skips its own min/max and option checks for exactly those inputs. So each
node's method names only the inputs of its rule, checks their ranges itself, and lets a linked
input (``None`` at validation, known only when the node runs) through.
"""

from __future__ import annotations


def fraction_window_problem(start_name: str, start, end_name: str, end) -> str | None:
    """A start/end pair of schedule fractions: both in [0, 1], start not after end."""
    if start is None or end is None:
        return None
    for name, value in ((start_name, start), (end_name, end)):
        if not 0.0 <= value <= 1.0:
            return f"{name} must be between 0 and 1 (a fraction of the sigma schedule), got {value}."
    if start > end:
        return f"{start_name} ({start}) must not be after {end_name} ({end}): both are fractions of the schedule, 0 to 1."
    return None


def density_range_problem(min_density, max_density) -> str | None:
    """The share of key blocks kept per query block: 0.01 to 1, min_density not above max_density."""
    if min_density is None or max_density is None:
        return None
    for name, value in (("min_density", min_density), ("max_density", max_density)):
        if not 0.01 <= value <= 1.0:
            return f"{name} must be between 0.01 and 1 (a share of key blocks), got {value}."
    if min_density > max_density:
        return f"min_density ({min_density}) must not exceed max_density ({max_density})."
    return None
