"""FSDP's gather at use: a weight split over the data axis is whole there where it is used.

Given weights split over `"data"` and a batch split over `"data"`, XLA's SPMD
partitioner may meet them by gathering the *activations* over the data axis
(less traffic when the batch is small), which makes every device hold the whole
batch's activations -- the opposite of what FSDP is for. So a model's forward
pass gathers each data-split weight where it uses it (`gather`), one layer at a
time under `lax.scan`. Gathered weights are named `GATHERED` so that remat
policies recompute them in the backward pass instead of keeping every layer's
whole copy.

Which weights are split, and how, is read from where they are placed
(`StoredLayout.of`), once, by whatever runs the model: redcoast's steps,
evaluation, prediction and generation hand it to the traced computation in their
`Parallelism`, and `layouts(module)` finds a module's weights there. Nothing is
written into the model: its structure is the same wherever its arrays are.
Outside such a computation (a user's own `jax.jit` of a model, with no
`Parallelism` given) nothing is gathered by hand, and XLA's partitioner alone
decides how the weights meet the batch: the same numbers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from . import _active, _jaxpr
from ._sharding_plan import axis_names
from .mesh import DATA

GATHERED = "fsdp_gathered"
"""The `checkpoint_name` of weights gathered for use."""


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


def use_spec(spec: P) -> P:
    """How a weight stored with `spec` is used: whole over the data axis.

    A dimension split over `(a, "data", b)` is used split over `a` alone: gathering
    over the data axis makes each `a` block whole, whereas keeping `b` would name a
    layout that tensor parallelism never asked for (`("data", "model")` is how FSDP
    divides a weight that tensor parallelism replicates).
    """
    entries = []
    for entry in spec:
        names = axis_names(entry)
        kept = names[: names.index(DATA)] if DATA in names else names
        kept = tuple(n for n in kept if n is not None)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*entries)


def data_split(sharding: Any) -> bool:
    """Whether a `NamedSharding` splits over the data axis."""
    return isinstance(sharding, NamedSharding) and any(DATA in axis_names(e) for e in sharding.spec)


def _path(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _floating(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return hasattr(x, "shape") and dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _canonical(sharding: NamedSharding) -> NamedSharding:
    # One name per layout: `P("data", None)` and `P("data")` (what a jitted step may
    # return for what was placed) read alike, so the step after the first finds the
    # first one's program.
    spec = list(sharding.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return NamedSharding(sharding.mesh, P(*spec))


@dataclasses.dataclass(frozen=True)
class StoredLayout:
    """How a model's data-split weights are stored: a `NamedSharding` per path.

    Hashable, so that a step takes it as a static argument: two models whose
    weights are stored alike trace and compile alike. Only floating-point arrays
    split over the data axis are listed, by their dotted path in the model
    (`blocks.attn.q_proj.weight`).

    Attributes:
        shardings: `(path, NamedSharding)` pairs, in the module's leaf order.
    """

    shardings: tuple[tuple[str, NamedSharding], ...]

    @classmethod
    def of(cls, tree: PyTree) -> StoredLayout | None:
        """The layout `tree`'s arrays (or `jax.ShapeDtypeStruct`s) are stored with.

        Returns:
            `None` when no floating-point array is split over the data axis.
        """
        found = tuple(
            (_path(p), _canonical(x.sharding))
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if _floating(x) and data_split(getattr(x, "sharding", None))
        )
        return cls(found) if found else None

    @classmethod
    def carried(cls, tree: PyTree) -> StoredLayout | None:
        """The layout the active computation knows `tree`'s traced arrays by, if any.

        A function that traces the model again (a nested `jit`, as generation's)
        reads it here from the arrays it was given and hands it on to its own trace.
        """
        active = _active.current()
        if active is None:
            return None
        found = tuple(
            (_path(p), active.gathers[id(x)].stored)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if id(x) in active.gathers
        )
        return cls(found) if found else None

    def gathers(self, tree: PyTree) -> dict[int, Layout]:
        """`id(array) -> Layout` for the arrays of `tree` (laid out as the model this
        layout was read from) that are stored split over the data axis."""
        stored = dict(self.shardings)
        found = {}
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            s = stored.get(_path(p))
            if s is not None:
                found[id(x)] = Layout(s, NamedSharding(s.mesh, use_spec(s.spec)))
        return found

    def __repr__(self) -> str:
        meshes = {tuple(s.mesh.shape.items()) for _, s in self.shardings}
        where = ", ".join(" x ".join(f"{k}={v}" for k, v in m) for m in sorted(meshes))
        return f"StoredLayout({len(self.shardings)} weights split over {DATA!r}; mesh {where})"


def layouts(module: PyTree) -> PyTree:
    """`module` with each array replaced by the `Layout` it is gathered with, or `None`.

    The layouts are those of the `Parallelism` active around the computation (see
    `redcoast.parallel._active`); outside one, every entry is `None` and nothing is
    gathered. The result has the module's structure, so a part's layouts are read
    by the same attribute as the part: `gather(module.blocks, layouts(module).blocks)`.
    """
    return _active.gather_layouts(module)


def gathers(specs: PyTree) -> bool:
    """Whether `specs` (a part of `layouts(module)`) gathers any array."""
    return any(isinstance(s, Layout) for s in jax.tree_util.tree_leaves(specs))


def gather(tree: PyTree, specs: PyTree, *, stacked: bool = False) -> PyTree:
    """Each array of `tree` whole over the data axis, as `specs` (from `layouts`) says.

    The gradient of each gathered array is laid out as the array is stored.

    Args:
        tree: a part of the module, or its arrays (`eqx.partition`); a slice of
            stacked layers when `stacked`.
        specs: the same part of `layouts(module)`.
        stacked: `tree` is one slice of stacked layers that `lax.scan` cuts, so each
            layout loses its leading (layer) axis.
    """
    if not gathers(specs):
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    spec_leaves = treedef.flatten_up_to(specs)
    out = [
        _gather_one(x, s.sliced() if stacked else s) if isinstance(s, Layout) else x
        for x, s in zip(leaves, spec_leaves, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def _not_gathered(prim: Any, *_: Any, **params: Any) -> bool:
    # Neither the named weight nor the layout changes that made it: saving the
    # constraint's output would keep the same whole weight under another name.
    if _jaxpr.is_sharding_constraint(prim):
        return False
    return _jaxpr.checkpoint_name(prim, params) != GATHERED


def remat_policy() -> Any:
    """The checkpoint policy that keeps everything but gathered weights."""
    return _not_gathered
