"""A sharding plan as a value: a `PartitionSpec` and a reason for every array.

`ShardingPlan` is what `sharding_plan` returns and what `place(..., specs=)` takes; `str(plan)`
is the report: path, shape, spec and why for every array, the bytes each device
holds, and a note for every fallback, default or guess.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .._progress import counted
from .._tree_paths import path_str
from .._units import fmt_bytes
from .mesh import DATA, MODEL

__all__ = [
    "LeafPlan",
    "ShardingPlan",
    "axis_names",
    "is_spec",
    "spec_leaves",
    "spec_str",
    "spec_tree",
]


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one array leaf is split, and why."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: P
    reason: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """A `PartitionSpec` for every array of a model, with the reason for each.

    `specs` has the structure of `eqx.filter(model, eqx.is_array)` and is what
    `place(..., specs=)` takes. `str(plan)` is a readable report. `fsdp` is the number of data
    shards the weights are also split over (1: none).
    """

    specs: PyTree
    leaves: tuple[LeafPlan, ...]
    n_model_shards: int
    method: str
    notes: tuple[str, ...] = ()
    fsdp: int = 1

    @classmethod
    def given(
        cls, model: PyTree, specs: PyTree, *, n_model_shards: int | None = None
    ) -> ShardingPlan:
        """The plan of specs made elsewhere (by hand, or read from another run): `str()` of
        it reports them as `str(rc.sharding_plan(...))` reports the rules'.

        Args:
            model: the model the specs belong to (arrays, or `jax.ShapeDtypeStruct`s).
            specs: a spec tree shaped like `eqx.filter(model, eqx.is_array)`.
            n_model_shards: the size of the model axis, for bytes per device; read from
                the model's shardings when omitted (1 when it has none).

        Example:
            >>> print(rc.ShardingPlan.given(model, megatron_specs))
        """
        entries = spec_leaves(model, specs)
        if n_model_shards is None:
            n_model_shards = 1
            for _, leaf, _ in entries:
                sharding = getattr(leaf, "sharding", None)
                if isinstance(sharding, NamedSharding) and MODEL in sharding.mesh.shape:
                    n_model_shards = int(sharding.mesh.shape[MODEL])
                    break
        if (
            isinstance(n_model_shards, bool)
            or not isinstance(n_model_shards, int)
            or (n_model_shards < 1)
        ):
            raise ValueError(f"n_model_shards must be an int >= 1, got {n_model_shards!r}.")
        plans = tuple(
            LeafPlan(path, tuple(int(d) for d in leaf.shape), str(leaf.dtype), spec, "given")
            for path, leaf, spec in entries
        )
        return cls(spec_tree(specs), plans, int(n_model_shards), "given specs")

    def _per_device(self, leaf: LeafPlan) -> float:
        ways = 1
        for entry in leaf.spec:
            names = entry if isinstance(entry, tuple) else (entry,)
            ways *= self.n_model_shards ** sum(name == MODEL for name in names)
            ways *= self.fsdp ** sum(name == DATA for name in names)
        return leaf.nbytes / ways

    @property
    def total_bytes(self) -> int:
        """Bytes of all arrays of the model."""
        return sum(leaf.nbytes for leaf in self.leaves)

    @property
    def bytes_per_device(self) -> int:
        """Bytes of the model that each device holds."""
        return int(sum(self._per_device(leaf) for leaf in self.leaves))

    @property
    def replicated_bytes(self) -> int:
        """Bytes of the arrays that are not split at all."""
        return sum(leaf.nbytes for leaf in self.leaves if not _is_split(leaf.spec))

    def __str__(self) -> str:
        rows = [
            (leaf.path, str(leaf.shape), spec_str(leaf.spec), leaf.reason) for leaf in self.leaves
        ]
        heads = ("path", "shape", "spec", "why")
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads[:3])]
        fsdp = f" x {counted(self.fsdp, 'data shard')} (FSDP)" if self.fsdp > 1 else ""
        lines = [
            f"sharding plan: {counted(self.n_model_shards, 'model shard')}{fsdp}; {self.method}",
            "  ".join(h.ljust(w) for h, w in zip(heads[:3], widths, strict=True)) + "  why",
        ]
        for row in rows:
            lines.append(
                "  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3]
            )
        total = self.total_bytes
        rep = self.replicated_bytes
        lines.append(
            f"bytes per device: {fmt_bytes(self.bytes_per_device)} of {fmt_bytes(total)} "
            f"(ideal {fmt_bytes(total / (self.n_model_shards * self.fsdp))}); "
            f"replicated: {fmt_bytes(rep)} "
            f"({100 * rep / max(total, 1):.1f}% of the model)"
        )
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


def _is_split(spec: P) -> bool:
    return any(entry is not None for entry in spec)


def spec_str(spec: P) -> str:
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def is_spec(x: Any) -> bool:
    """Whether `x` is a `PartitionSpec` (the leaves of a spec tree)."""
    return isinstance(x, P)


def spec_leaves(model: PyTree, specs: PyTree) -> list[tuple[str, Any, P]]:
    """`(path, array, spec)` for every array of `model`; raises unless the trees match."""
    specs = spec_tree(specs)
    arrays = eqx.filter(model, eqx.is_array)
    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(arrays)
    flat_s, tree_s = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    if tree_a != tree_s:
        have = {path_str(p) for p, _ in flat_a}
        got = {path_str(p) for p, _ in flat_s}
        missing, extra = sorted(have - got), sorted(got - have)
        raise ValueError(
            "the spec tree does not match the model's arrays: "
            f"missing specs for {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"specs for non-arrays {extra[:5]}{'...' if len(extra) > 5 else ''}. "
            "Build specs with redcoast.sharding_plan(model, ...).specs for this very model."
        )
    return [(path_str(p), a, s) for (p, a), (_, s) in zip(flat_a, flat_s, strict=True)]


def axis_names(entry: Any) -> tuple[Any, ...]:
    """The mesh axes one entry of a `PartitionSpec` names: `"data"`, `("data", "model")`."""
    return entry if isinstance(entry, tuple) else (entry,)


def spec_tree(specs: PyTree) -> PyTree:
    """The spec tree of a `ShardingPlan`, or `specs` as it is when it is one already."""
    return specs.specs if isinstance(specs, ShardingPlan) else specs
