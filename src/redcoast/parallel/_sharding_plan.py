"""A sharding plan as a value: a `PartitionSpec` and a reason for every array.

`ShardingPlan` is what `sharding_plan` returns and what `place(..., specs=)` takes; `str(plan)`
is the report: path, shape, spec and why for every array, the bytes each device
holds, and a note for every fallback, default or guess.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .mesh import DATA, MODEL

__all__ = ["LeafPlan", "ShardingPlan", "fmt_bytes", "spec_str", "spec_tree"]


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
        fsdp = f" x {self.fsdp} data shard(s) (FSDP)" if self.fsdp > 1 else ""
        lines = [
            f"sharding plan: {self.n_model_shards} model shard(s){fsdp}; {self.method}",
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


def fmt_bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def spec_tree(specs: PyTree) -> PyTree:
    """The spec tree of a `ShardingPlan`, or `specs` as it is when it is one already."""
    return specs.specs if isinstance(specs, ShardingPlan) else specs
