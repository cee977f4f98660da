"""Argument checks shared by every module: an error that names the argument and the value."""

import math
import os
from typing import Any

import numpy as np
from beartype import BeartypeConf, beartype
from jaxtyping import jaxtyped

__all__ = ["check_choice", "check_positive", "positive_env", "typechecked"]

typechecked = jaxtyped(typechecker=beartype(conf=BeartypeConf(is_pep484_tower=True)))
"""Check a public function's arguments against its annotations when it is called:
jaxtyping's array shapes and dtypes (`Float[Array, "*batch seq heads head_dim"]`: the
dimensions named alike agree across the arguments) and beartype's types, an int
passing for a float (PEP 484's numeric tower). Called inside `jit`, the check runs
once per trace on the abstract shapes."""


def check_choice(name: str, value: object, choices: tuple[str, ...], hint: str = "") -> Any:
    """`value` itself if it is one of `choices`, else a `ValueError` naming `name`, the
    value and every choice, followed by `hint` (a sentence on what the choices do)."""
    if value not in choices:
        listed = ", ".join(map(repr, choices))
        raise ValueError(
            f"{name} must be one of {listed}; got {value!r}." + (f" {hint}" if hint else "")
        )
    return value


def check_positive(name: str, value: Any, *, optional: bool = True) -> None:
    """Raise a `ValueError` naming `name` unless `value` is an int >= 1 (or None, if optional)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(
            f"{name} must be a positive int{' or None' if optional else ''}, got {value!r}."
        )


def positive_env(name: str, what: str) -> float | None:
    """The positive, finite number in the environment variable `name`, or None when it is
    unset or blank; anything else raises a `ValueError` saying `what` to give."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name}={text!r}: give {what}.")
    return value
