"""Arrays onto a mesh by their `PartitionSpec`s.

A spec is checked against its array's shape and the mesh (the error names the
array, the axis and the fix), turned into a `NamedSharding`, and the array placed:
with `jax.device_put` in one process, and from each process's full host copy,
each device receiving only its slice, across several.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .._tree_paths import leaves_with_paths
from ._sharding_plan import is_spec, spec_leaves, spec_str, spec_tree

__all__ = [
    "abstract_arrays",
    "check_spec",
    "check_specs",
    "host_to_mesh",
    "is_spec",
    "optimizer_specs",
    "shard",
    "sharding_tree",
    "spec_leaves",
    "specs_by_path",
]


def abstract_arrays(tree: PyTree) -> PyTree:
    """`tree` with each `jax.ShapeDtypeStruct` leaf a zero-stride NumPy array of its shape.

    What `eqx.filter_eval_shape` returns becomes a model whose leaves are arrays to
    `eqx.is_array` (and to the sharding rules, which read only shapes and dtypes),
    at no memory cost: every element is the same zero in memory.

    Args:
        tree: a pytree, e.g. `eqx.filter_eval_shape(make_model, key)`.

    Returns:
        The same structure, abstract leaves replaced.
    """
    return jax.tree_util.tree_map(
        lambda s: (
            np.broadcast_to(np.zeros((), s.dtype), s.shape)
            if isinstance(s, jax.ShapeDtypeStruct)
            else s
        ),
        tree,
    )


def check_spec(path: str, shape: tuple[int, ...], spec: Any, sizes: Mapping[str, int]) -> None:
    """Raise, naming `path`, unless `spec` fits `shape` on a mesh of axis `sizes`."""
    if not isinstance(spec, P):
        raise TypeError(f"{path}: expected a PartitionSpec, got {type(spec).__name__} ({spec!r}).")
    if len(spec) > len(shape):
        raise ValueError(
            f"{path}: spec {spec_str(spec)} has more entries than the array's shape {shape}."
        )
    for dim, entry in zip(shape, spec, strict=False):
        if entry is None:
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        ways = 1
        for name in names:
            if name not in sizes:
                raise ValueError(
                    f"{path}: spec {spec_str(spec)} names axis {name!r}; "
                    f"the mesh has {sorted(sizes)}."
                )
            ways *= sizes[name]
        if dim % ways:
            raise ValueError(
                f"{path}: dimension {dim} of shape {shape} does not divide into {ways} shards "
                f"(spec {spec_str(spec)}); choose another dimension or replicate it with P()."
            )


def check_specs(entries: Iterable[tuple[str, tuple[int, ...], Any]], mesh: Mesh) -> None:
    """`check_spec` for every `(path, shape, spec)`, on the axis sizes of `mesh`."""
    sizes = {name: int(size) for name, size in mesh.shape.items()}
    for path, shape, spec in entries:
        check_spec(path, shape, spec, sizes)


def specs_by_path(specs: PyTree) -> dict[str, Any]:
    """Dotted path -> spec for a spec tree (or `ShardingPlan`)."""
    return dict(leaves_with_paths(spec_tree(specs), is_spec))


def sharding_tree(tree: PyTree, mesh: Mesh, specs: PyTree) -> PyTree:
    """`NamedSharding(mesh, spec)` for every array (or abstract array) of `tree`.

    Args:
        tree: a model, or its `eqx.filter_eval_shape`.
        mesh: from `make_mesh`.
        specs: a `PartitionSpec` tree (or `ShardingPlan`) shaped like its arrays.

    Returns:
        A tree shaped like `eqx.filter(tree, eqx.is_array)` with a sharding per array;
        it raises, naming the array, when a spec does not fit its shape or the mesh.
    """
    specs = spec_tree(specs)
    tree = abstract_arrays(tree)
    check_specs(((path, tuple(x.shape), spec) for path, x, spec in spec_leaves(tree, specs)), mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)


def optimizer_specs(
    opt_leaves: list[tuple[str, Any]],
    model_leaves: list[tuple[str, Any]],
    model_specs: Mapping[str, P],
) -> dict[str, P]:
    """Specs for an optimizer state's leaves: moments mirror the parameters.

    A leaf whose path ends with a parameter's path and has its shape takes that
    parameter's spec; the rest (step counters, factored statistics) are replicated.

    Args:
        opt_leaves: `(path, leaf)` of the optimizer state (`path_str` paths).
        model_leaves: `(path, leaf)` of the parameters.
        model_specs: parameter path -> its `PartitionSpec`.

    Returns:
        Optimizer leaf path -> `PartitionSpec`.
    """
    shapes = {k: tuple(v.shape) for k, v in model_leaves}
    out = {}
    for key, leaf in opt_leaves:
        match = [
            m
            for m in model_specs
            if (key == m or key.endswith("." + m)) and shapes.get(m) == tuple(leaf.shape)
        ]
        out[key] = model_specs[max(match, key=len)] if match else P()
    return out


def shard(tree: PyTree, mesh: Mesh, specs: PyTree) -> PyTree:
    """Place every array of `tree` on `mesh` with its `PartitionSpec`.

    Args:
        tree: a model (or any pytree) whose arrays are placed; other leaves are kept.
        mesh: from `make_mesh`.
        specs: from `sharding_plan` (a `ShardingPlan` or its `.specs`), shaped like
            `eqx.filter(tree, eqx.is_array)`.

    Returns:
        The same tree with every array a `jax.Array` with `NamedSharding(mesh, spec)`;
        a zoo model in it records which weights are split over the data axis, so that
        its forward pass gathers them (`redcoast.fsdp`).

    Example:
        >>> model = shard(model, mesh, sharding_plan(model, mesh.shape["model"]))
    """
    entries = spec_leaves(tree, specs)
    check_specs(((path, tuple(x.shape), spec) for path, x, spec in entries), mesh)
    shardings = [NamedSharding(mesh, spec) for _, _, spec in entries]
    arrays, static = eqx.partition(tree, eqx.is_array)
    flat, treedef = jax.tree_util.tree_flatten(arrays)
    if jax.process_count() == 1:
        placed = jax.device_put(flat, shardings)
    else:
        placed = [_place_global(x, s) for x, s in zip(flat, shardings, strict=True)]
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, placed), static)


def _place_global(x: Any, sharding: NamedSharding) -> jax.Array:
    """Place an array that every process holds in full onto a multi-process mesh."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)
    return host_to_mesh(np.asarray(x), sharding)


def host_to_mesh(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """An array this process holds in full on the host, placed with `sharding`.

    Each device receives only its slice, so no device ever holds the whole array;
    with several processes, each must hold the same `host`.
    """
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
