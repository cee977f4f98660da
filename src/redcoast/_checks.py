"""Argument checks shared by every module: an error that names the argument and the value.

Integer inputs (token ids, positions, cache slots, prompt lengths) are checked by
range: JAX clamps an out-of-range index instead of failing (`table[999]` of a
50-row table is row 49), so a wrong id or position would give finite, wrong
logits. Python ints are checked at once and the error shows the value; NumPy
arrays and lists before JAX converts them (`as_int_array`: 64-bit values it would
wrap); JAX arrays when the computation runs, under `jit`, `vmap` and `grad` alike:
with `eqx.error_if` on one device (`EQX_ON_ERROR=off` turns it off), and on
several by a callback on every device.

`eqx.error_if` alone cannot serve a program split over several devices: its
callback runs on device 0 only, and when it raises the other devices wait for
device 0 in the next collective until XLA aborts the whole process
(patrick-kidger/equinox#1232). Reducing the predicate over every device first and
raising on all of them at once (a callback under `shard_map`) leaves no device
waiting.
"""

import math
import os
from typing import Any, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from beartype import BeartypeConf, beartype
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Int, jaxtyped

__all__ = [
    "as_int_array",
    "check_choice",
    "check_positive",
    "check_range",
    "int32_overflow",
    "positive_env",
    "typechecked",
]

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


def int32_overflow(x: np.ndarray) -> tuple[int, int, np.iinfo] | None:
    """`(min, max, the 32-bit range)` when 64-bit integers `x` hold a value outside the
    32-bit range JAX converts them to with x64 disabled, else None (other dtypes too)."""
    if x.dtype not in (np.int64, np.uint64) or x.size == 0:
        return None
    narrow = np.iinfo(np.int32 if x.dtype == np.int64 else np.uint32)
    low, high = int(x.min()), int(x.max())
    return (low, high, narrow) if low < narrow.min or high > narrow.max else None


@overload
def check_range(x: int, low: int, high: int, what: str, fix: str) -> int: ...


@overload
def check_range(
    x: Int[Array, "..."], low: int, high: int, what: str, fix: str
) -> Int[Array, "..."]: ...


def check_range(
    x: Int[Array, "..."] | int, low: int, high: int, what: str, fix: str
) -> Int[Array, "..."] | int:
    """`x` itself, after checking that every value of it lies in `[low, high)`.

    Args:
        x: a Python int (checked now) or an integer array (checked when it is computed;
            use the returned array, or the check is dropped as dead code).
        low: the smallest valid value.
        high: one past the largest valid value.
        what: names the argument and says what it is, e.g. `"input_ids (token ids)"`.
        fix: what the caller can do about it.

    Returns:
        `x`, unchanged.

    Raises:
        ValueError: a Python int out of range.
        RuntimeError: when the computation runs, an array value out of range:
            `eqx.EquinoxRuntimeError` under `eqx.filter_jit` or eagerly on one device,
            `jax.errors.JaxRuntimeError` under `jax.jit` or on several devices; the
            message is the same.

    Example:
        >>> ids = check_range(ids, 0, 50, "input_ids (token ids)", "check the tokenizer.")
    """
    if isinstance(x, int | np.integer):
        if not low <= x < high:
            raise ValueError(f"{what} must be in [{low}, {high}); got {x}. {fix}")
        return int(x)
    if low >= high:
        raise ValueError(f"{what}: no value is valid (the range [{low}, {high}) is empty). {fix}")
    bad = (x < low) | (x >= high)
    msg = f"{what} must be in [{low}, {high}); got a value outside it. {fix}"
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    if mesh is None or mesh.empty or mesh.size == 1:
        return eqx.error_if(x, bad, msg)
    if os.environ.get("EQX_ON_ERROR") == "off":  # as eqx.error_if does
        return x
    return _error_if_on_every_device(x, bad, msg, mesh)


def _error_if_on_every_device(
    x: Int[Array, "..."], bad: Bool[Array, "..."], msg: str, mesh: jax.sharding.AbstractMesh
) -> Int[Array, "..."]:
    def raise_if(pred: Any) -> np.ndarray:
        if pred:
            raise ValueError(msg)
        return np.zeros((), np.bool_)

    def on_each_device(pred: Array) -> Array:
        # The host is called only on failure: a callback per step would sync each step.
        return jax.lax.cond(
            pred,
            lambda p: jax.pure_callback(raise_if, jax.ShapeDtypeStruct((), jnp.bool_), p),
            lambda p: jnp.zeros((), jnp.bool_),
            pred,
        )

    # Any batch element (vmap) on any device (the reduction makes it replicated).
    pred = eqx.internal.unvmap_any(jnp.any(bad))
    flag = jax.shard_map(on_each_device, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(
        pred
    )
    # The flag is always False; the select keeps the callback from being dead code.
    return jnp.where(flag, jnp.zeros_like(x), x)


def as_int_array(x: Any, what: str) -> Array:
    """`jnp.asarray(x)`, refusing 64-bit integers that JAX would wrap to 32 bits.

    With x64 disabled (JAX's default) `jnp.asarray` turns an int64 array into int32
    by wrapping: 2**32 + 5 arrives as 5, a valid token id. JAX arrays (and tracers)
    are already converted and pass through.

    Args:
        x: a JAX array, or a NumPy array or nested list of ints.
        what: names the argument in the error, e.g. `"prompt_ids"`.

    Returns:
        The JAX array.

    Raises:
        ValueError: a 64-bit integer value outside the 32-bit range.

    Example:
        >>> as_int_array(np.array([[5, 2**32 + 5]]), "prompt_ids")
        Traceback (most recent call last):
        ValueError: prompt_ids (int64) has values in [5, 4294967301], ...
    """
    if isinstance(x, jax.Array) or jax.config.read("jax_enable_x64"):
        return jnp.asarray(x)
    host = np.asarray(x)
    wraps = int32_overflow(host)
    if wraps is not None:
        low, high, narrow = wraps
        raise ValueError(
            f"{what} ({host.dtype}) has values in [{low}, {high}], outside the "
            f"{narrow.dtype} range JAX converts it to with x64 disabled: they would wrap "
            f"around silently ({2**32 + 5} becoming 5). Token ids and lengths fit in "
            "int32; check what produced these values."
        )
    return jnp.asarray(host)
