"""FSDP's gather at use: a weight split over the data axis is whole there where it is used.

Given weights split over `"data"` and a batch split over `"data"`, XLA's SPMD
partitioner may meet them by gathering the *activations* over the data axis
(less traffic when the batch is small), which makes every device hold the whole
batch's activations -- the opposite of what FSDP is for. So the train step says
which weights are split over the data axis (`stored_shardings`, set around the jitted
call; `gather_at_use`, inside the traced loss), and a model gathers each one
where it uses it (`gather`), one layer at a time under `lax.scan`
(`layer_specs`). Gathered weights are named `GATHERED` so that remat policies
recompute them in the backward pass instead of keeping every layer's whole copy.

Outside such a step every function here is a no-op, so models stay usable as
plain functions.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from . import _jaxpr
from .mesh import DATA
from .rematerialisation import remat

GATHERED = "fsdp_gathered"
"""The `checkpoint_name` of weights gathered for use."""

_STORED: contextvars.ContextVar[tuple[Any, ...] | None] = contextvars.ContextVar(
    "redcoast_fsdp_stored", default=None
)
_USE: contextvars.ContextVar[dict[int, Layout] | None] = contextvars.ContextVar(
    "redcoast_fsdp_use", default=None
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a weight is stored (split over data) and how it is used (whole over data)."""

    stored: NamedSharding
    use: NamedSharding

    def sliced(self) -> Layout:
        """The layout of one slice of a stacked weight (its leading axis dropped)."""
        mesh = self.stored.mesh
        return Layout(
            NamedSharding(mesh, P(*self.stored.spec[1:])),
            NamedSharding(mesh, P(*self.use.spec[1:])),
        )


def _gather_one(x: jax.Array, layout: Layout) -> jax.Array:
    # The inner constraint is a no-op going forward (x is stored so); its transpose
    # sends the gradient back to the stored layout at once (a reduce-scatter), so a
    # scan's stacked gradients stay split over the data axis, as FSDP keeps them.
    stored = jax.lax.with_sharding_constraint(x, layout.stored)
    return checkpoint_name(jax.lax.with_sharding_constraint(stored, layout.use), GATHERED)


def _names(entry: Any) -> tuple[Any, ...]:
    return entry if isinstance(entry, tuple) else (entry,)


def use_spec(spec: P) -> P:
    """How a weight stored with `spec` is used: whole over the data axis.

    A dimension split over `(a, "data", b)` is used split over `a` alone: gathering
    over the data axis makes each `a` block whole, whereas keeping `b` would name a
    layout that tensor parallelism never asked for (`("data", "model")` is how FSDP
    divides a weight that tensor parallelism replicates).
    """
    entries = []
    for entry in spec:
        names = _names(entry)
        kept = names[: names.index(DATA)] if DATA in names else names
        kept = tuple(n for n in kept if n is not None)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*entries)


def data_split(sharding: Any) -> bool:
    """Whether a `NamedSharding` splits over the data axis."""
    return isinstance(sharding, NamedSharding) and any(DATA in _names(e) for e in sharding.spec)


@contextlib.contextmanager
def stored_shardings(shardings: Sequence[Any] | None) -> Iterator[None]:
    """While tracing a step: how each parameter is stored, in `tree_leaves` order.

    Args:
        shardings: one `NamedSharding` (or `None`) per leaf of
            `eqx.filter(model, eqx.is_inexact_array)`; `None` (or none splitting over
            the data axis) turns gathering off.
    """
    stored = tuple(shardings) if shardings and any(map(data_split, shardings)) else None
    token = _STORED.set(stored)
    try:
        yield
    finally:
        _STORED.reset(token)


@contextlib.contextmanager
def gather_at_use(params: PyTree) -> Iterator[None]:
    """Inside the traced loss: map each parameter (by identity) to its spec of use."""
    stored = _STORED.get()
    leaves = jax.tree_util.tree_leaves(params)
    if stored is None or len(stored) != len(leaves):
        yield
        return
    use = {
        id(x): Layout(s, NamedSharding(s.mesh, use_spec(s.spec)))
        for x, s in zip(leaves, stored, strict=True)
        if data_split(s)
    }
    token = _USE.set(use)
    try:
        yield
    finally:
        _USE.reset(token)


def layer_specs(tree: PyTree, *, stacked: bool) -> PyTree | None:
    """The `Layout` of each array of `tree`, or `None` when nothing is to gather.

    Args:
        tree: a module's arrays as the model received them.
        stacked: the arrays are stacked layers that `lax.scan` slices; the specs are
            then those of one slice (the leading axis dropped).
    """
    use = _USE.get()
    if not use:
        return None
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    specs = [use.get(id(x)) for x in leaves]
    if all(s is None for s in specs):
        return None
    if stacked:
        specs = [None if s is None else s.sliced() for s in specs]
    return jax.tree_util.tree_unflatten(treedef, specs)


def gather(tree: PyTree, specs: PyTree | None) -> PyTree:
    """Each array of `tree` whole over the data axis, as `specs` (from `layer_specs`) says.

    The gradient of each gathered array is laid out as the array is stored.
    """
    if specs is None:
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    spec_leaves = treedef.flatten_up_to(specs)
    out = [x if s is None else _gather_one(x, s) for x, s in zip(leaves, spec_leaves, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, out)


def gathered(tree: PyTree) -> PyTree:
    """`tree` (a module used as it is, not sliced by a scan) gathered for use."""
    return gather(tree, layer_specs(tree, stacked=False))


def _not_gathered(prim: Any, *_: Any, **params: Any) -> bool:
    # Neither the named weight nor the layout changes that made it: saving the
    # constraint's output would keep the same whole weight under another name.
    if _jaxpr.is_sharding_constraint(prim):
        return False
    return _jaxpr.checkpoint_name(prim, params) != GATHERED


def remat_policy() -> Any:
    """The checkpoint policy that keeps everything but gathered weights."""
    return _not_gathered


def under_policy(fn: Callable[..., Any], policy: str, gathering: bool) -> Callable[..., Any]:
    """`fn` (one layer) under the remat policy; while gathering, even `"none"`
    recomputes the gathered weights in the backward pass instead of keeping
    every layer's whole copy."""
    if gathering and policy == "none":
        return eqx.filter_checkpoint(fn, policy=remat_policy())
    return remat(fn, policy)
