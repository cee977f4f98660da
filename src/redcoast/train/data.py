"""From examples to global batches: shuffle, this process's slice, collate, assemble, pad.

Every process holds the same sequence of examples and the same seed, so all agree
on the order without talking. Each collates only the rows its own devices hold
(redco collates the whole global batch on every host) and
`jax.make_array_from_process_local_data` stitches the pieces into one global
`jax.Array` sharded `P("data")`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
import xxhash
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Int

from .._checks import check_positive, int32_overflow
from ..parallel.mesh import DATA, mesh_shape

CollateFn = Callable[[list[Any]], Mapping[str, Any]]
"""`(examples: list) -> dict[str, np.ndarray]`, the batch on the leading axis."""


@runtime_checkable
class Examples(Protocol):
    """What `fit`, `predict` and `batches` take as examples: `len()` and integer indexing.

    A list, `rc.text` rows, a NumPy array or memmap (one example per leading index)
    and a `datasets.Dataset` all qualify; only the rows a process needs are indexed.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: Any, /) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Batch:
    """One global batch and where its rows came from.

    Attributes:
        arrays: what `collate_fn` returned, as global `jax.Array`s sharded `P("data")`.
        indices: for each row of the global batch, the position of its example in the
            example sequence. Padding rows repeat the last real example.
        n_valid: how many leading rows are real examples; the rest is padding.
    """

    arrays: dict[str, Any]
    indices: Int[np.ndarray, " batch"]
    n_valid: int


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool = True) -> Int[np.ndarray, " n"]:
    """The order in which an epoch visits `n` examples; identical on every process.

    Args:
        n: number of examples.
        seed: the run's seed.
        epoch: the epoch number; each epoch gets its own permutation.
        shuffle: `False` keeps the input order.

    Returns:
        A permutation of `range(n)` as an int64 array.

    Example:
        >>> epoch_order(5, seed=0, epoch=1)
        array([...])   # the same on every host, different for epoch=2
    """
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n).astype(np.int64)


def order_fingerprint(n: int, *, seed: int, epoch: int) -> str:
    """A checksum (xxh3-64, hex) of the order in which an epoch visits `n` examples.

    A checkpoint keeps it beside the dataset's length, so a resumed run can tell
    that it would visit the examples in another order (another NumPy shuffling
    them otherwise) rather than quietly lose step-exactness.

    Args:
        n: number of examples.
        seed: the run's seed.
        epoch: the epoch.

    Returns:
        16 hex digits.

    Example:
        >>> order_fingerprint(1000, seed=0, epoch=3)
        '...'
    """
    order = epoch_order(n, seed=seed, epoch=epoch)
    return xxhash.xxh3_64_hexdigest(order.astype("<i8").tobytes())


def global_batch_size(
    mesh: Mesh,
    per_device_batch_size: int,
    accumulate_grad_batches: int = 1,
    *,
    split_rows: bool = True,
) -> int:
    """Rows per optimizer step: `per_device_batch_size * n_data * accumulate_grad_batches`.

    Args:
        mesh: the `("data", "model")` mesh.
        per_device_batch_size: rows per data-parallel device per micro-batch.
        accumulate_grad_batches: micro-batches per step.
        split_rows: the rows are split over the data axis; `False` (context
            parallelism, which splits each row instead) leaves `n_data` out.

    Returns:
        The global batch size.

    Example:
        >>> global_batch_size(make_mesh(2), 8, 4)   # 8 devices: 4 data shards
        128
    """
    check_positive("per_device_batch_size", per_device_batch_size, optional=False)
    check_positive("accumulate_grad_batches", accumulate_grad_batches, optional=False)
    n_data = mesh_shape(mesh)[0] if split_rows else 1
    return int(per_device_batch_size) * n_data * int(accumulate_grad_batches)


def process_rows(mesh: Mesh, batch_size: int) -> Int[np.ndarray, " local"]:
    """Which rows of a global batch this process's devices hold under `P("data")`.

    Args:
        mesh: the `("data", "model")` mesh.
        batch_size: rows of the global batch; must divide over the data axis.

    Returns:
        Sorted row indices; on a single process, `arange(batch_size)`.

    Example:
        >>> process_rows(make_mesh(1), 16)   # one process
        array([ 0,  1, ..., 15])
    """
    n_data = mesh_shape(mesh)[0]
    if batch_size < 1 or batch_size % n_data:
        raise ValueError(
            f"a global batch of {batch_size} rows does not divide across the mesh's {n_data} "
            f"data shards; use a multiple of {n_data} (per_device_batch_size sets this)."
        )
    sharding = NamedSharding(mesh, P(DATA))
    spans = set()
    for index in sharding.addressable_devices_indices_map((batch_size,)).values():
        rows = slice(None) if index is None else index[0]
        spans.add((rows.start or 0, batch_size if rows.stop is None else rows.stop))
    return np.concatenate([np.arange(a, b) for a, b in sorted(spans)]).astype(np.int64)


def collate_examples(collate_fn: CollateFn, examples: list[Any]) -> dict[str, np.ndarray]:
    """Call `collate_fn` and check it returned a dict of arrays sharing the batch axis.

    Args:
        collate_fn: `(examples: list) -> dict[str, np.ndarray]`.
        examples: the examples of this process's rows.

    Returns:
        The dict, every value converted to a NumPy array.

    Raises:
        TypeError: `collate_fn` did not return a dict.
        ValueError: an array's leading axis differs from `len(examples)`, or an
            array is not numbers or booleans (strings, datetimes, objects).

    Example:
        >>> collate_examples(lambda exs: {"x": np.stack(exs)}, [np.zeros(3)] * 4)["x"].shape
        (4, 3)
    """
    name = getattr(collate_fn, "__name__", "collate_fn")
    out = collate_fn(examples)
    if not isinstance(out, Mapping):
        raise TypeError(
            f"collate_fn ({name}) must return a dict of arrays with the batch on the leading "
            f"axis; for {len(examples)} examples it returned a {type(out).__name__}."
        )
    arrays = {}
    for k, v in out.items():
        try:
            arrays[str(k)] = np.asarray(v)
        except ValueError as e:
            raise ValueError(
                f"collate_fn ({name}) returned a ragged value for {k!r} that NumPy cannot make "
                f"into one array ({e}); pad it to one shape."
            ) from None
    bad = {k: v.shape for k, v in arrays.items() if v.ndim == 0 or v.shape[0] != len(examples)}
    if not arrays or bad:
        shapes = {k: v.shape for k, v in arrays.items()}
        raise ValueError(
            f"collate_fn ({name}) was given {len(examples)} examples and must return arrays "
            f"whose leading axis is {len(examples)}; it returned shapes {shapes}."
        )
    object_arrays = [k for k, v in arrays.items() if v.dtype == object]
    if object_arrays:
        raise ValueError(
            f"collate_fn ({name}) returned ragged or non-numeric values for {object_arrays} "
            f"(NumPy made dtype=object arrays); pad them to one shape."
        )
    other = {
        k: str(v.dtype)
        for k, v in arrays.items()
        # NumPy counts timedelta64 as an integer; JAX holds neither it nor datetime64.
        if v.dtype.kind in "mM" or not (v.dtype == np.bool_ or jnp.issubdtype(v.dtype, jnp.number))
    }
    if other:
        raise ValueError(
            f"collate_fn ({name}) returned arrays JAX cannot hold: {other}; a batch holds "
            "numbers and booleans only. Turn them into numbers in collate_fn: strings into "
            "token or category ids, datetimes and durations into seconds (e.g. "
            "x.astype('datetime64[s]').astype(np.int64)), or leave such fields out of the batch."
        )
    return arrays


def check_int_range(arrays: Mapping[str, np.ndarray]) -> None:
    """Refuse 64-bit integers that JAX would silently wrap when it makes them 32-bit.

    With x64 disabled (JAX's default) an int64 array becomes int32 and a uint64 one
    uint32 by wrapping: 2**40 + 5 arrives as 5. One min and max per 64-bit array.

    Args:
        arrays: a batch, as `collate_fn` returned it.

    Raises:
        ValueError: a 64-bit integer array has values outside the 32-bit range; the
            message names its key, its range and the fix.

    Example:
        >>> check_int_range({"ids": np.array([1, 2**40])})
        Traceback (most recent call last):
        ValueError: batch key 'ids' (int64) has values in [1, 1099511627776], ...
    """
    if jax.config.read("jax_enable_x64"):
        return
    for key, v in arrays.items():
        wraps = int32_overflow(v)
        if wraps is not None:
            low, high, narrow = wraps
            raise ValueError(
                f"batch key {key!r} ({v.dtype}) has values in [{low}, {high}], outside the "
                f"{narrow.dtype} range [{narrow.min}, {narrow.max}] that JAX converts it to "
                "with x64 disabled; they would wrap around silently. Map them into that "
                f"range in collate_fn (e.g. re-index the ids) and cast to {narrow.dtype}, or "
                "enable 64-bit JAX with jax.config.update('jax_enable_x64', True) at start-up."
            )


def make_global(
    local: Mapping[str, np.ndarray], mesh: Mesh, batch_size: int, *, split_rows: bool = True
) -> dict[str, Any]:
    """Assemble this process's rows into global arrays sharded `P("data")` (or whole).

    Args:
        local: the rows `process_rows(mesh, batch_size)` of every array (every row with
            `split_rows=False`).
        mesh: the `("data", "model")` mesh.
        batch_size: the global number of rows.
        split_rows: split the rows over the data axis; `False` gives every device
            every row (context parallelism splits each row inside the step).

    Returns:
        A dict of global `jax.Array`s of leading size `batch_size`.

    Raises:
        ValueError: a 64-bit integer array does not fit JAX's 32 bits (see
            `check_int_range`).

    Example:
        >>> rows = process_rows(mesh, 16)
        >>> batch = make_global({"x": x[rows]}, mesh, 16)
    """
    check_int_range(local)
    sharding = NamedSharding(mesh, P(DATA) if split_rows else P())
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (batch_size, *v.shape[1:]))
        for k, v in local.items()
    }


def batches(
    examples: Examples,
    *,
    collate_fn: CollateFn,
    mesh: Mesh,
    batch_size: int,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    drop_last: bool = True,
    start: int = 0,
    split_rows: bool = True,
) -> Iterator[Batch]:
    """Iterate over one epoch of global batches.

    Args:
        examples: any sequence supporting `len` and integer indexing, the same on every
            process.
        collate_fn: `(examples: list) -> dict[str, np.ndarray]`; called on this
            process's rows only.
        mesh: the `("data", "model")` mesh.
        batch_size: global rows per batch; a multiple of the number of data shards.
        seed: the run's seed (shared by all processes).
        epoch: the epoch, which picks the permutation.
        shuffle: shuffle the examples (training) or keep their order (eval, predict).
        drop_last: drop a last partial batch (training) or pad it by repeating the
            last example (eval, predict; `Batch.n_valid` says how many rows are real).
        start: skip this many batches first, without collating them (to resume
            mid-epoch).
        split_rows: split each batch's rows over the data axis (`batch_size` then a
            multiple of its size); `False` collates every row on every process and
            gives every device the whole batch, for context parallelism.

    Returns:
        An iterator of `Batch`.

    Example:
        >>> for batch in batches(train, collate_fn=collate_fn, mesh=mesh, batch_size=64, epoch=e):
        ...     model, opt_state, metrics = step(model, opt_state, batch.arrays, key)
    """
    n = len(examples)
    if n == 0:
        raise ValueError("the example sequence is empty; there is nothing to batch.")
    rows = process_rows(mesh, batch_size) if split_rows else np.arange(batch_size)
    order = epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle)
    n_batches = n // batch_size if drop_last else -(-n // batch_size)
    for b in range(start, n_batches):
        idx = order[b * batch_size : (b + 1) * batch_size]
        n_valid = len(idx)
        if n_valid < batch_size:
            idx = np.concatenate([idx, np.full(batch_size - n_valid, idx[-1], np.int64)])
        local = collate_examples(collate_fn, [examples[int(i)] for i in idx[rows]])
        yield Batch(make_global(local, mesh, batch_size, split_rows=split_rows), idx, n_valid)
