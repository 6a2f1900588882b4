"""Argument checks for the engine's plain-Python parts (no torch, unlike
:mod:`llmnote.ops._validate`, which checks tensors)."""

from __future__ import annotations


def check_int(name: str, value: object, min_value: int | None = None) -> int:
    """``value`` must be an int (not a bool) >= ``min_value``; returns it."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if min_value is not None and value < min_value:
        raise ValueError(f"{name} must be >= {min_value}, got {value}")
    return value
