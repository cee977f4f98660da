"""FSDP's gather at use: a weight split over the data axis is whole there where it is used.

Given weights split over `"data"` and a batch split over `"data"`, XLA's SPMD
partitioner may meet them by gathering the *activations* over the data axis
(less traffic when the batch is small), which makes every device hold the whole
batch's activations -- the opposite of what FSDP is for. So a zoo model records
how its weights are stored (`FSDPModule.fsdp_layout`, a static field that
`rc.place`, `rc.sharded_init`, `from_hf` and `rc.load_checkpoint`
fill in from where they put each array), and its forward pass gathers each
data-split weight where it uses it (`gather`), one layer at a time under
`lax.scan`. Gathered weights are named `GATHERED` so that remat policies
recompute them in the backward pass instead of keeping every layer's whole copy.

The layout is part of the model's static structure, so every trace of the model
gathers the same way: under redcoast's jitted step, under a user's own
`jax.jit` of `rc.train_step(..., jit=False)`, in evaluation and in generation.
A model without a layout (placed without FSDP, or a user's own module) gathers
nothing, and XLA's partitioner alone decides how its weights meet the batch.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from . import _jaxpr
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


def _path(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _floating(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return hasattr(x, "shape") and dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _canonical(sharding: NamedSharding) -> NamedSharding:
    # One name per layout: `P("data", None)` and `P("data")` (what a jitted step may
    # return for what was placed) record alike, so re-placing a trained model keeps
    # its static structure, and with it the optimizer state's.
    spec = list(sharding.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return NamedSharding(sharding.mesh, P(*spec))


@dataclasses.dataclass(frozen=True)
class StoredLayout:
    """How a module's data-split weights are stored: a `NamedSharding` per path.

    Hashable, so that it can be a static field: two models whose weights are
    stored alike trace and compile alike. Only floating-point arrays split over
    the data axis are listed, by their dotted path inside the module
    (`blocks.attn.q_proj.weight`); the optimizer's copies of a module (`mu`,
    `nu`, placed with the same specs) record the same layout as the module.

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

    def __repr__(self) -> str:
        meshes = {tuple(s.mesh.shape.items()) for _, s in self.shardings}
        where = ", ".join(" x ".join(f"{k}={v}" for k, v in m) for m in sorted(meshes))
        return f"StoredLayout({len(self.shardings)} weights split over {DATA!r}; mesh {where})"


class FSDPModule(eqx.Module):
    """A module whose forward pass gathers its data-split weights where it uses them.

    The zoo's language models derive from it. Its `fsdp_layout` is filled in by
    whatever places the model (`record_layout`); the forward pass reads it through
    `layouts(self)` and `gather`.

    Attributes:
        fsdp_layout: how the weights are stored, or `None` (no weight split over the
            data axis; nothing is gathered).
    """

    fsdp_layout: StoredLayout | None = eqx.field(default=None, static=True, kw_only=True)


def _with_layout(module: FSDPModule, layout: StoredLayout | None) -> FSDPModule:
    # A static field is not a pytree leaf that `eqx.tree_at` could reach, and the zoo's
    # `__init__` builds from a config, so the copy's field is set directly.
    new = copy.copy(module)
    object.__setattr__(new, "fsdp_layout", layout)
    return new


def record_layout(tree: PyTree) -> PyTree:
    """`tree` with each `FSDPModule` in it recording how its own arrays are stored.

    Everything that places a model calls it after placing; a user who moves a
    model's arrays by other means calls `rc.place` (which calls it) to record
    where they went.

    Args:
        tree: a model, an optimizer state, or any pytree holding them.

    Returns:
        The same arrays; each `FSDPModule` with `fsdp_layout = StoredLayout.of(module)`.
        `tree` itself when every module already records its layout.
    """

    def is_module(x: Any) -> bool:
        return isinstance(x, FSDPModule)

    def stale(x: Any) -> bool:
        return is_module(x) and StoredLayout.of(x) != x.fsdp_layout

    if not any(map(stale, jax.tree_util.tree_leaves(tree, is_leaf=is_module))):
        return tree

    def one(x: Any) -> Any:
        return _with_layout(x, StoredLayout.of(x)) if stale(x) else x

    return jax.tree_util.tree_map(one, tree, is_leaf=is_module)


def _without_layouts(tree: PyTree) -> PyTree:
    def is_module(x: Any) -> bool:
        return isinstance(x, FSDPModule)

    def one(x: Any) -> Any:
        # Set on every module: a model built by its own __init__ has no such attribute
        # of its own yet, which its tree structure tells apart from an explicit None.
        return _with_layout(x, None) if is_module(x) else x

    return jax.tree_util.tree_map(one, tree, is_leaf=is_module)


def layouts_like(tree: PyTree, model: PyTree) -> PyTree:
    """`tree`, made from `model` before it was placed, with `model`'s recorded layouts.

    A mask or filter built from a model, and the model placed with FSDP afterwards,
    differ only in each `FSDPModule`'s static `fsdp_layout`; this gives `tree` the
    placed model's, so that `eqx.filter(model, tree)` matches. Any other difference
    of structure is left for the caller to report.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    target = jax.tree_util.tree_structure(model)
    if treedef == target or treedef.num_leaves != target.num_leaves:
        return tree
    bare = jax.tree_util.tree_structure(_without_layouts(tree))
    if bare != jax.tree_util.tree_structure(_without_layouts(model)):
        return tree
    return jax.tree_util.tree_unflatten(target, leaves)


def layouts(module: FSDPModule) -> PyTree:
    """`module` with each array replaced by the `Layout` it is gathered with, or `None`.

    The result has the module's structure, so a part's layouts are read by the same
    attribute as the part: `gather(module.blocks, layouts(module).blocks)`.
    """
    use: dict[str, Layout] = {}
    if module.fsdp_layout is not None:
        use = {
            path: Layout(s, NamedSharding(s.mesh, use_spec(s.spec)))
            for path, s in module.fsdp_layout.shardings
        }
    return jax.tree_util.tree_map_with_path(lambda p, _: use.get(_path(p)), module)


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
