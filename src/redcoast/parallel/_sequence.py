"""Sequence parallelism: the activations between tensor-parallel regions split too.

Under tensor parallelism a column-split projection (weight split on its outputs)
needs its whole input, and a row-split one (split on its inputs) leaves partial
sums that are all-reduced: between them the residual stream, the norms and
whatever else a block computes are held whole on every model shard. Megatron-LM's
sequence parallelism (Korthikanti et al. 2022) keeps those regions split over the
model axis: the all-reduce after a row-split projection becomes a reduce-scatter,
and the input of a column-split one is all-gathered, the same bytes in all.

redcoast splits those activations along their *features*, not along the sequence.
The bytes moved and the memory saved are the same (a reduce-scatter and an
all-gather of each boundary activation; every activation between them at `1/n`),
and the split can be stated from code that sees one token at a time: a user's own
model that calls `jax.vmap(linear)` gets it as the zoo does, with no sequence axis
to name and no condition on the sequence length. Norms then sum their statistics
over the model axis: one float per token and norm, under 0.1% of the boundary
bytes at a width of 1024.

Where to split comes from the placement the sharding rules chose: every projection
whose weight is split on its outputs over the model axis gathers its input; every
one split on its inputs scatters its output (`SequenceParallel.of`). A scattered
output's gradient is gathered once, for both the input's and the weight's
gradient. The gathered input is not kept for the backward pass; it is gathered
again there, as Megatron-LM does (`fsdp.remat_policy`), unless `keep_gathered`
asks to keep it: the bytes of tensor parallelism alone, for a whole copy of each
such input. An embedding table split over the model axis gives a whole output
(`WholeEmbedding`), as under tensor parallelism alone.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray, PyTree

from .._tree_paths import path_str
from ..nn import AbstractProjection, dense
from . import fsdp
from ._sharding_plan import axis_names
from .mesh import MODEL, mesh_shape

__all__ = ["KEEP_GATHERED", "SequenceParallel", "SplitProjection", "WholeEmbedding"]

KEEP_GATHERED = "keep gathered"
"""`fit(sequence_parallel=...)`'s value for a split that keeps each gathered input."""

Projection = eqx.nn.Linear | AbstractProjection


def _is_projection(x: Any) -> bool:
    return isinstance(x, eqx.nn.Linear | AbstractProjection)


def _is_layer(x: Any) -> bool:
    return _is_projection(x) or isinstance(x, eqx.nn.Embedding)


def _linear(layer: Projection) -> eqx.nn.Linear:
    linear = layer.base if isinstance(layer, AbstractProjection) else layer
    if not isinstance(linear, eqx.nn.Linear):
        raise ValueError(
            f"sequence parallelism splits plain Linear projections; this one wraps a "
            f"{type(linear).__name__} (a quantized base). Train a quantized model without "
            "sequence_parallel=, or dequantize it (rc.lora.merge, layer.dequantized())."
        )
    return linear


def _split_on(weight: Any, axis: int) -> bool:
    sharding = getattr(weight, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return False
    spec = tuple(sharding.spec) + (None,) * (weight.ndim - len(sharding.spec))
    return MODEL in axis_names(spec[axis])


def _features(x: Array, mesh: Mesh, entry: str | None) -> Array:
    """`x` with its last axis split over `entry` (or whole), every other axis left open."""
    spec = P(*([P.UNCONSTRAINED] * (x.ndim - 1)), entry)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


@functools.cache
def _scatter(mesh: Mesh) -> Callable[[Array], Array]:
    """`y` with its features split over the model axis; its cotangent is gathered once.

    Left to the partitioner, the cotangent stays split and each of its two uses in
    the projection's backward pass (the input's gradient and the weight's) gathers
    it on its own.
    """

    @jax.custom_vjp
    def scatter(y: Array) -> Array:
        return _features(y, mesh, MODEL)

    def forward(y: Array) -> tuple[Array, None]:
        return _features(y, mesh, MODEL), None

    def backward(_: None, g: Array) -> tuple[Array]:
        return (_features(g, mesh, None),)

    scatter.defvjp(forward, backward)
    return scatter


def _gathered(
    call: Callable[[Any, Array], Array], mesh: Mesh, keep: bool
) -> Callable[[Any, Array], Array]:
    def run(layer: Any, x: Array) -> Array:
        whole = checkpoint_name(_features(x, mesh, None), fsdp.GATHERED)
        return call(layer, whole)

    if keep:  # the whole input stays for the backward pass
        return run
    # The whole input is gathered again in the backward pass instead of being kept.
    return eqx.filter_checkpoint(run, policy=fsdp.remat_policy(), prevent_cse=False)


def _call(layer: Projection, x: Array, key: PRNGKeyArray | None = None) -> Array:
    return layer(x) if key is None else layer(x, key=key)  # type: ignore[call-arg]


class SplitProjection(AbstractProjection):
    """A projection whose input is gathered, or whose output is scattered, over the model axis.

    Called per token (`jax.vmap(layer)(x)`, as a user's model does) or over every
    token at once (`layers.dense`, as the zoo does); either way only the features
    are constrained and every other axis is left to XLA's partitioner.

    Attributes:
        inner: the Linear (or adapter) it stands for.
        mesh: where the model axis is.
        gather: the input arrives split over the model axis and is made whole
            (a column-split projection).
        scatter: the output leaves split over the model axis (a row-split one).
        keep: the gathered input is kept for the backward pass, not gathered again.
    """

    inner: Projection
    mesh: Mesh = eqx.field(static=True)
    gather: bool = eqx.field(static=True)
    scatter: bool = eqx.field(static=True)
    keep: bool = eqx.field(static=True, default=False)

    @property
    def base(self) -> eqx.nn.Linear:  # type: ignore[override]
        return _linear(self.inner)

    def _run(self, call: Callable[[Any, Array], Array], x: Array) -> Array:
        if self.gather:
            y = _gathered(call, self.mesh, self.keep)(self.inner, x)
        else:
            y = call(self.inner, x)
        return _scatter(self.mesh)(y) if self.scatter else y

    def __call__(
        self, x: Float[Array, "*tokens in"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*tokens out"]:
        return self._run(functools.partial(_call, key=key), x)

    def over_tokens(self, x: Float[Array, "*tokens in"]) -> Float[Array, "*tokens out"]:
        return self._run(dense, x)


class WholeEmbedding(eqx.nn.Embedding):
    """An embedding table split over the model axis whose output is whole there.

    The first layer adds a split output to it, so without this the gradient reaching
    the table would arrive split on the features while the table is split on its
    rows, and XLA's partitioner (JAX 0.12) meets that by gathering a table-sized
    gradient. Whole, it is gathered as an activation, as tensor parallelism's is.

    Attributes:
        mesh: where the model axis is.
    """

    mesh: Mesh = eqx.field(static=True)

    def __init__(self, weight: Array, mesh: Mesh):
        super().__init__(weight=weight)
        self.mesh = mesh

    def __call__(
        self, x: Int[ArrayLike, ""], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " features"]:
        return _features(super().__call__(x, key=key), self.mesh, None)


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """Which projections gather their input and which scatter their output.

    Hashable, so that a step takes it as a static argument: two models placed alike
    share one compilation.

    Attributes:
        mesh: the mesh whose model axis the activations are split over.
        gather: dotted paths of the projections split on their outputs.
        scatter: dotted paths of the projections split on their inputs.
        notes: projections split over the model axis that are left as they are, and why.
        embeddings: dotted paths of the `eqx.nn.Embedding`s split over the model
            axis, whose outputs are made whole (`WholeEmbedding`).
        keep_gathered: keep each gathered input for the backward pass instead of
            gathering it again there. It saves one all-gather per gathering
            projection (the model-axis bytes fall to tensor parallelism's where
            the compiler turns scattered all-reduces into reduce-scatters, as
            XLA's GPU and TPU compilers do) and costs a whole copy of each such
            input, as tensor parallelism keeps.
    """

    mesh: Mesh
    gather: tuple[str, ...]
    scatter: tuple[str, ...]
    notes: tuple[str, ...] = ()
    embeddings: tuple[str, ...] = ()
    keep_gathered: bool = False

    @classmethod
    def of(cls, model: PyTree, *, keep_gathered: bool = False) -> SequenceParallel:
        """Read where to split from how `model`'s projections are placed.

        Args:
            model: a model placed on a mesh with a model axis (`rc.place`), or its
                `jax.ShapeDtypeStruct`s with shardings.
            keep_gathered: see the attribute.

        Returns:
            The split: every `eqx.nn.Linear` (or adapter wrapping one) whose weight
            is split over the model axis on its outputs gathers its input; on its
            inputs, scatters its output.

        Raises:
            ValueError: no projection's weight is split over a model axis of more
                than one device (nothing to split the activations by), or the
                arrays are not placed.
        """
        gather: list[str] = []
        scatter: list[str] = []
        notes: list[str] = []
        meshes: set[Mesh] = set()
        embeddings: list[str] = []
        flat = jax.tree_util.tree_leaves_with_path(model, is_leaf=_is_layer)
        for path, layer in flat:
            if isinstance(layer, eqx.nn.Embedding):
                if _split_on(layer.weight, 0) or _split_on(layer.weight, 1):
                    embeddings.append(path_str(path))
                continue
            if not _is_projection(layer):
                continue
            weight = _linear(layer).weight
            sharding = getattr(weight, "sharding", None)
            mesh = getattr(sharding, "mesh", None)
            if not isinstance(mesh, Mesh) or mesh_shape(mesh)[1] < 2:
                continue
            name = path_str(path)
            out_split, in_split = _split_on(weight, -2), _split_on(weight, -1)
            if out_split and in_split:
                notes.append(f"{name}: its weight is split on both axes; left as it is.")
                continue
            if not (out_split or in_split):
                continue
            # A gathered input or a scattered output is split on the features the
            # weight's other axis counts.
            features = weight.shape[-1] if out_split else weight.shape[-2]
            n = mesh_shape(mesh)[1]
            if features % n:
                notes.append(
                    f"{name}: its {features} {'input' if out_split else 'output'} features "
                    f"do not divide over {n} model shards; left as it is."
                )
                continue
            meshes.add(mesh)
            (gather if out_split else scatter).append(name)
        if not meshes:
            raise ValueError(
                "sequence_parallel splits the activations over the model axis by how the "
                "projections are split there, and no eqx.nn.Linear of this model is split "
                "over a model axis of more than one device. Place the model on a mesh "
                "with model shards (rc.make_mesh(n_model_shards) with n_model_shards > 1, "
                "then rc.place), or drop sequence_parallel."
            )
        if len(meshes) > 1:
            raise ValueError(
                f"the model's projections are placed on {len(meshes)} different meshes; "
                "place the whole model on one (rc.place)."
            )
        lists = (tuple(gather), tuple(scatter), tuple(notes), tuple(embeddings))
        return cls(meshes.pop(), *lists, keep_gathered=keep_gathered)

    def __str__(self) -> str:
        lines = [
            f"sequence parallelism over {mesh_shape(self.mesh)[1]} model shards: "
            f"{len(self.gather)} projections gather their input, {len(self.scatter)} "
            "scatter their output",
            *(f"  gather  {p}" for p in self.gather),
            *(f"  scatter {p}" for p in self.scatter),
            *(f"  note: {n}" for n in self.notes),
        ]
        return "\n".join(lines)

    def apply(self, model: PyTree) -> PyTree:
        """`model` with each listed projection wrapped in a `SplitProjection`.

        Call it inside the traced function (the step does), so that the wrapped
        model is only what the loss sees: gradients, optimizer state and
        checkpoints keep the model's own structure.
        """
        gather, scatter = set(self.gather), set(self.scatter)

        def one(path: tuple[Any, ...], layer: Any) -> Any:
            name = path_str(path)
            if isinstance(layer, eqx.nn.Embedding) and name in self.embeddings:
                return WholeEmbedding(layer.weight, self.mesh)
            if not _is_projection(layer):
                return layer
            if name not in gather and name not in scatter:
                return layer
            # `base` is a property here, not the field pyright takes the AbstractVar for.
            return SplitProjection(  # pyright: ignore[reportCallIssue]
                inner=layer,
                mesh=self.mesh,
                gather=name in gather,
                scatter=name in scatter,
                keep=self.keep_gathered,
            )

        return jax.tree_util.tree_map_with_path(one, model, is_leaf=_is_layer)
