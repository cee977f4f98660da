"""Range checks for the zoo's integer inputs: token ids, positions, cache slots.

JAX clamps an out-of-range index instead of failing (`table[999]` of a 50-row
table is row 49), so a wrong id or position would give finite, wrong logits.
Python ints are checked at once and the error shows the value; NumPy arrays and
lists before JAX converts them (`as_int_array`: 64-bit values it would wrap); JAX
arrays when the computation runs, under `jit`, `vmap` and `grad` alike: with
`eqx.error_if` on one device (`EQX_ON_ERROR=off` turns it off), and on several by
a callback on every device.

`eqx.error_if` alone cannot serve a program split over several devices: its
callback runs on device 0 only, and when it raises the other devices wait for
device 0 in the next collective until XLA aborts the whole process
(patrick-kidger/equinox#1232). Reducing the predicate over every device first and
raising on all of them at once (a callback under `shard_map`) leaves no device
waiting.
"""

import os
from typing import Any, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Int

from ..train.data import int32_overflow


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
