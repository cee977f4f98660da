"""Putting a model (and what travels with it) on a mesh, once, for everyone.

`fit`, `predict` and a user's own loop all need the same three answers: is this
model already on the mesh, on which specs should it go, and are the arrays the
step is about to donate the caller's own? They live here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PRNGKeyArray, PyTree

from ._placement import shard, sharding_tree
from ._sharding_plan import spec_tree
from .mesh import DATA, MODEL, mesh_shape
from .sharding import sharding_plan


def _array_leaves(tree: PyTree) -> list[Any]:
    return jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))


def _redcoast_sharding(x: Any) -> NamedSharding | None:
    """`x`'s sharding if it is placed on a `("data", "model")` mesh."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and tuple(sharding.mesh.axis_names) == (DATA, MODEL):
        return sharding
    return None


def _on_mesh(x: Any, mesh: Mesh) -> bool:
    sharding = getattr(x, "sharding", None)
    return isinstance(sharding, NamedSharding) and sharding.mesh == mesh


def model_mesh(model: PyTree) -> Mesh | None:
    """The redcoast mesh the model's arrays already live on, or None.

    Args:
        model: any pytree.

    Returns:
        The `("data", "model")` mesh of its first placed array, if any.

    Example:
        >>> mesh = model_mesh(result.model) or make_mesh(1)
    """
    for x in _array_leaves(model):
        sharding = _redcoast_sharding(x)
        if sharding is not None and isinstance(sharding.mesh, Mesh):
            return sharding.mesh
    return None


def place(
    model: PyTree,
    mesh: Mesh,
    *,
    example_call: Callable[[PyTree], Any] | None = None,
    specs: PyTree | None = None,
    fsdp: bool = False,
) -> PyTree:
    """Put `model` on `mesh`, split by the sharding rules when the mesh has a model axis.

    A model already on `mesh` is returned as it is. A model on another redcoast mesh
    keeps its specs. Otherwise the specs are `specs` when given, else
    `sharding_plan(model, n_model_shards, example_call=example_call).specs` on a mesh
    with a model axis > 1 or with `fsdp`, else every array is replicated.

    Args:
        model: an Equinox model (or any pytree of arrays).
        mesh: from `make_mesh`.
        example_call: `model -> output`, traced (no FLOPs) to follow the dataflow;
            without it the rules fall back to declaration order.
        specs: a `PartitionSpec` tree (or `ShardingPlan`) to use instead of the rules.
        fsdp: split the weights over the data axis as well (`sharding_plan`'s `fsdp`).

    Returns:
        The model with every array a `jax.Array` on `mesh`. Arrays that did not have
        to move are the very arrays given (nothing is copied). A zoo model records
        which weights are split over the data axis (`redcoast.fsdp`), also when its
        arrays were already on `mesh`.

    Example:
        >>> model = rc.place(model, rc.make_mesh(2), example_call=lambda m: jax.vmap(m)(x))
    """
    n_data, n_model = mesh_shape(mesh)
    leaves = _array_leaves(model)
    if specs is None:
        if all(_on_mesh(x, mesh) for x in leaves):
            return model
        if all(_redcoast_sharding(x) is not None for x in leaves):
            specs = jax.tree.map(lambda x: x.sharding.spec, eqx.filter(model, eqx.is_array))
        elif n_model > 1 or fsdp:
            specs = sharding_plan(
                model, n_model, example_call=example_call, fsdp=n_data if fsdp else 1
            ).specs
        else:
            specs = jax.tree.map(lambda _: P(), eqx.filter(model, eqx.is_array))
    return shard(model, mesh, specs)


def sharded_init(
    make: Callable[[PRNGKeyArray], PyTree],
    key: PRNGKeyArray,
    mesh: Mesh,
    *,
    example_call: Callable[[PyTree], Any] | None = None,
    specs: PyTree | None = None,
    fsdp: bool = False,
) -> PyTree:
    """Build `make(key)` directly in its shards: no device or host holds the whole model.

    The shapes come from `eqx.filter_eval_shape(make, key)`, the plan is made on
    them, and `make` runs under `jax.jit` with the plan's output shardings, so each
    device computes only its own slice of every array. The arrays equal those of
    `make(key)` built whole (JAX's random bits do not depend on the sharding).

    Args:
        make: `key -> model`, e.g. `lambda k: rc.models.Llama(config, key=k)`.
        key: the initialisation key (the same on every process).
        mesh: from `make_mesh`.
        example_call: `model -> output`, traced on abstract shapes to follow the
            dataflow; zoo language models default to a short sequence of token ids.
        specs: a `PartitionSpec` tree (or `ShardingPlan`) to use instead of the rules.
        fsdp: split the weights over the data axis as well (`sharding_plan`'s `fsdp`).

    Returns:
        The model, every array a `jax.Array` on `mesh` with its spec; pass it to
        `fit` or `predict` on the same mesh.

    Example:
        >>> mesh = rc.make_mesh(n_model_shards=4)
        >>> model = rc.sharded_init(lambda k: rc.models.Llama(config, key=k), key, mesh)
    """
    abstract = eqx.filter_eval_shape(make, key)
    n_data, n_model = mesh_shape(mesh)
    if specs is None:
        if example_call is None:
            # Models that know how to be called (the zoo) say so with `trace_call`.
            example_call = getattr(type(abstract), "trace_call", None)
        specs = sharding_plan(
            abstract, n_model, example_call=example_call, fsdp=n_data if fsdp else 1
        ).specs
    shardings = sharding_tree(abstract, mesh, spec_tree(specs))

    @functools.partial(jax.jit, out_shardings=shardings)
    def build() -> PyTree:
        return eqx.filter(make(key), eqx.is_array)

    _, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return eqx.combine(build(), static)


def replicate_strays(tree: PyTree, mesh: Mesh) -> PyTree:
    """Replicate over `mesh` the arrays of `tree` not already on it (e.g. optax's counters).

    Args:
        tree: an optimizer state or any pytree.
        mesh: from `make_mesh`.

    Returns:
        The tree with every array on `mesh`.
    """

    def one(x: Any) -> Any:
        if not eqx.is_array(x) or _on_mesh(x, mesh):
            return x
        return jax.device_put(x, NamedSharding(mesh, P()))

    return jax.tree.map(one, tree)


def _buffers(x: Any) -> set[int]:
    if not isinstance(x, jax.Array) or x.is_deleted():
        return set()
    return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def own_copy(tree: PyTree, given: PyTree) -> PyTree:
    """`tree` with a fresh copy of every array that shares a buffer with `given`'s arrays.

    A step that donates its inputs deletes their buffers. Placing an array can
    reuse its buffer for the device it was on, so sharing is checked buffer by
    buffer; only the arrays that share one are copied.

    Args:
        tree: what is about to be donated.
        given: what the caller passed in.

    Returns:
        `tree`, sharing no device buffer with `given`.
    """
    theirs: set[int] = set()
    for x in _array_leaves(given):
        theirs |= _buffers(x)

    def one(x: Any) -> Any:
        return jnp.copy(x) if eqx.is_array(x) and _buffers(x) & theirs else x

    return jax.tree.map(one, tree)


def release(given: PyTree, *, keep: PyTree) -> None:
    """Delete the arrays of `given` that share no device buffer with `keep`'s.

    What a caller hands over (`fit(..., donate=True)`) and was placed elsewhere
    would otherwise stay alive as long as the caller's variable does.

    Args:
        given: what the caller passed in.
        keep: what is in use now, and must stay valid.
    """
    kept: set[int] = set()
    for x in _array_leaves(keep):
        kept |= _buffers(x)
    for x in _array_leaves(given):
        if isinstance(x, jax.Array) and not x.is_deleted() and not _buffers(x) & kept:
            x.delete()
