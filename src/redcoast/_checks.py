"""Argument checks shared by every module: an error that names the argument and the value."""

from typing import Any

import numpy as np

__all__ = ["check_positive"]


def check_positive(name: str, value: Any, *, optional: bool = True) -> None:
    """Raise a `ValueError` naming `name` unless `value` is an int >= 1 (or None, if optional)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(
            f"{name} must be a positive int{' or None' if optional else ''}, got {value!r}."
        )
