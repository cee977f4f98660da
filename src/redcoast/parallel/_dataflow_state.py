"""The dataflow interpreter's state: what it knows about each value, what it records.

A `Value` is the abstract state of one jaxpr value during the walk; `Use` is how
one weight is used by matmuls; `Dataflow` is everything the walk found, which the
sharding rules read.
"""

from __future__ import annotations

import dataclasses

__all__ = ["DATA", "EMPTY", "NO_USE", "Axes", "Dataflow", "Use", "Value", "join"]

# Axis origin: for each axis of a value, the leaf axis it holds (None: none).
Axes = tuple[int | None, ...]


@dataclasses.dataclass(frozen=True)
class Value:
    """What the walk knows about one jaxpr value.

    weight: (leaf, leaf axis per value axis) when the value is a weight, possibly
        cast, transposed, sliced, broadcast or reshaped.
    taint: the matmul weights whose outputs reach this value with no matmul between,
        except through a gate (see `Dataflow.gates`).
    data: whether the value depends on the example input (not only on iota/literals).
    feat: (leaf, leaf axis per value axis) for the matmul whose output this value
        still is, through elementwise ops and reshapes that keep its axes.
    bcast: the value was broadcast to a larger shape and so scales or shifts whatever
        it is combined with, rather than carrying features of its own.
    """

    weight: tuple[int, Axes] | None = None
    taint: frozenset[int] = frozenset()
    data: bool = False
    feat: tuple[int, Axes] | None = None
    bcast: bool = False


EMPTY = Value()
DATA = Value(data=True)


def join(a: Value, b: Value) -> Value:
    return Value(
        weight=a.weight if a.weight == b.weight else None,
        taint=a.taint | b.taint,
        data=a.data or b.data,
        feat=a.feat if a.feat == b.feat else None,
        bcast=a.bcast and b.bcast,
    )


@dataclasses.dataclass
class Use:
    """How one weight is used by matmuls (the first use decides; others are checked).

    in_axes: leaf axes contracted with the input.
    out_axes: leaf axes that appear in the output as features.
    batch_axes: leaf axes that are batch dimensions of the matmul (stacked experts).
    taint: the matmuls whose outputs reach this weight's input.
    out_elems: elements of the matmul's output (for cost estimates).
    in_elems: elements of the matmul's other operand (for cost estimates).
    stem: the input is the example's data itself, reached through no matmul.
    """

    in_axes: tuple[int, ...]
    out_axes: tuple[int, ...]
    batch_axes: tuple[int, ...]
    taint: set[int]
    out_elems: int
    in_elems: int = 0
    stem: bool = False


NO_USE = Use((), (), (), set(), 0)  # what an array no matmul uses would have


@dataclasses.dataclass
class Dataflow:
    """What a walk over the traced jaxpr found; leaves are indices into the flat arrays.

    uses: matmul weights and how they are used, in `order` of first use.
    heads: leaf -> number of heads its output is reshaped into.
    whole_heads: those of `heads` whose whole output features are so reshaped, not
        only a slice of them.
    lookups: leaf -> {whether the indices of a gather from it depend on data}.
    looked_up: leaf -> elements gathered from it by data (for cost estimates).
    gates: matmul weights whose outputs only scale, shift or select other values
        (multiplied in after a broadcast, or contracted against another branch's
        outputs) and never reach another matmul's input or the result as features.
    ties: vector leaf -> (matmul leaf, {vector axis: matmul leaf axis}) for arrays
        added to (or multiplied into) a matmul's output: they split with it.
    conflicts: leaves used in matmuls of different orientation.
    opaque: primitive -> why the walk did not follow it (no rule for its sub-jaxprs, or
        params `_jaxpr.py` cannot read); each got the conservative rule.
    touched: weight leaf -> the opaque primitive that read it (it is replicated).
    gated: matmuls seen passing through a gate somewhere (`gates` is those of them
        whose outputs never reach a matmul's input or the result otherwise).
    reaching: matmuls whose outputs reach some matmul's input or the result.
    attended: matmuls whose outputs reach a product of two activations that both
        carry matmul outputs (attention's scores and weighted values), no matmul between.
    stacked: leaf -> its axes a loop iterates over (the layer axis of scanned layers).
    """

    uses: dict[int, Use] = dataclasses.field(default_factory=dict)
    order: list[int] = dataclasses.field(default_factory=list)
    heads: dict[int, int] = dataclasses.field(default_factory=dict)
    whole_heads: dict[int, int] = dataclasses.field(default_factory=dict)
    lookups: dict[int, set[bool]] = dataclasses.field(default_factory=dict)
    looked_up: dict[int, int] = dataclasses.field(default_factory=dict)
    gates: set[int] = dataclasses.field(default_factory=set)
    ties: dict[int, tuple[int, dict[int, int]]] = dataclasses.field(default_factory=dict)
    conflicts: set[int] = dataclasses.field(default_factory=set)
    opaque: dict[str, str] = dataclasses.field(default_factory=dict)
    touched: dict[int, str] = dataclasses.field(default_factory=dict)
    gated: set[int] = dataclasses.field(default_factory=set)
    reaching: set[int] = dataclasses.field(default_factory=set)
    attended: set[int] = dataclasses.field(default_factory=set)
    stacked: dict[int, set[int]] = dataclasses.field(default_factory=dict)
