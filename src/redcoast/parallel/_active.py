"""The parallelism a traced computation runs under: read by the layers, set by the steps.

A step activates its `Parallelism` while it traces the user's function, and the
building blocks that must act on it read it here: `fsdp.layouts` (which weights
are stored split over the data axis, gathered where they are used) and
`nn.attention` (whether the sequence is split: context parallelism; the mesh a
kernel that XLA cannot partition runs over). Nothing is
stored in the model; outside an activation nothing is active, and the blocks
compute as on one device.

The FSDP layouts are known by the identity of the arrays the step hands to the
user's function: `layouts` finds a module's weights among them. A weight that
reaches a layer otherwise (recomputed by the user's own transformation of the
model) is not gathered by hand, and XLA's partitioner alone decides how it meets
the batch: the same numbers.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax


@dataclasses.dataclass
class Active:
    """What is active while a step traces: the gathers by array identity, the context split.

    Attributes:
        gathers: `id(array) -> fsdp.Layout` of the arrays the step handed over.
        context: the `ContextParallel` the sequence is split by, or None.
        mesh: the mesh the step's parallelism names, or None (`nn.attention`'s
            Pallas kernel runs under a `shard_map` over it).
        attention_calls: how many attention computations consulted the split.
    """

    gathers: dict[int, Any]
    context: Any = None
    mesh: Any = None
    attention_calls: int = 0


_ACTIVE: contextvars.ContextVar[Active | None] = contextvars.ContextVar(
    "redcoast_active", default=None
)


def current() -> Active | None:
    """What is active now, or None outside a step's trace."""
    return _ACTIVE.get()


@contextlib.contextmanager
def activated(active: Active | None) -> Iterator[Active | None]:
    """`active` for the duration of the block (None: nothing), then what was there before."""
    token = _ACTIVE.set(active)
    try:
        yield active
    finally:
        _ACTIVE.reset(token)


_DATAFLOW: contextvars.ContextVar[bool] = contextvars.ContextVar("redcoast_dataflow", default=False)


def tracing_dataflow() -> bool:
    """Whether the sharding rules are tracing the model now (`trace_dataflow`): blocks
    whose fast form hides its matmuls (a mixture's sorted dispatch) then compute in
    the plain form the rules read, the same numbers."""
    return _DATAFLOW.get()


@contextlib.contextmanager
def dataflow_trace() -> Iterator[None]:
    """Mark the block as the sharding rules' trace of a model."""
    token = _DATAFLOW.set(True)
    try:
        yield
    finally:
        _DATAFLOW.reset(token)


def gather_layouts(tree: Any) -> Any:
    """`tree` with each array replaced by the `fsdp.Layout` it is gathered with, or None."""
    active = current()
    gathers = {} if active is None else active.gathers
    return jax.tree.map(lambda x: gathers.get(id(x)), tree)
