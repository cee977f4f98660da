"""Tensor-parallel specs for every weight, from two rules that follow the dataflow.

The rules (Equinox stores `eqx.nn.Linear.weight` as `(out, in)`):

1. Attention: Q, K and V are split on their output dimension by whole heads,
   O on its input dimension.
2. Fully connected: consecutive matmuls alternate "column" (output dimension)
   and "row" (input dimension) splits *along the dataflow*. A matmul whose
   input was produced by a column-split matmul -- through elementwise ops,
   reshapes, norms or attention -- is split by rows; matmuls reading the same
   value are split alike.

Rule 1 is rule 2 applied to attention (Q, K and V read the same input; O reads
what they produced), plus the constraint that a split never cuts a head. The
dataflow comes from `jax.make_jaxpr(example_call)` on abstract shapes (no FLOPs
are spent and nothing is materialised), read by the interpreter in `_dataflow.py`.
Without `example_call` the rules fall back to the order in which Linear layers
are declared.

And beyond the two rules: a matmul whose output only gates, scales or selects (a
router, an adaLN modulation) is replicated and never makes a later input split;
overrides are fixed before the rules run, so what reads an overridden weight
follows from it; stacked experts take one expert axis per mixture, expert-
parallel or Megatron within experts, by estimated cost; a size that does not
divide falls back to the other dimension only when that saves more bytes than it
moves, a collective's latency counted; vectors added to a matmul's output split with it. A
quantized Linear (`rc.quantize`) is planned as the Linear it stands for, its codes and block
scales split with that weight's rows, and with its columns only where whole blocks fall to
each shard (`_quantized.py`). Every fallback, default or guess is listed as a note at the
end of the plan.

Here the plan is put together: overrides, the rules' decisions (`_tp_rules.py`, on
what `_model_structure.py` reads from the modules), FSDP's data axis and the
reason for every leaf. The plan's type and report are in `_sharding_plan.py`;
placing arrays by their specs in `_placement.py` (`rc.place` is the public way in).
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .._tree_paths import array_leaves
from ._model_structure import ModelInfo, model_info
from ._placement import abstract_arrays as abstract_arrays
from ._placement import check_spec
from ._placement import optimizer_specs as optimizer_specs
from ._placement import sharding_tree as sharding_tree
from ._quantized import stand_ins, translated
from ._sharding_plan import LeafPlan as LeafPlan
from ._sharding_plan import ShardingPlan as ShardingPlan
from ._tp_rules import COL as COL
from ._tp_rules import COLLECTIVE_LATENCY_BYTES as COLLECTIVE_LATENCY_BYTES
from ._tp_rules import REP as REP
from ._tp_rules import ROW as ROW
from ._tp_rules import Decision, axis_spec, plan_dataflow, plan_declaration
from .mesh import DATA, MODEL

__all__ = [
    "LeafPlan",
    "ShardingPlan",
    "abstract_arrays",
    "optimizer_specs",
    "sharding_plan",
    "sharding_report",
    "sharding_rules",
]


def _check_n(n: int, name: str = "n_model_shards") -> None:
    if isinstance(n, bool) or not isinstance(n, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(n).__name__}.")
    if n < 1:
        raise ValueError(f"{name} must be >= 1, got {n}.")


def _decisions(
    example_call: Callable[[PyTree], Any] | None,
    model: PyTree,
    info: Any,
    paths: list[str],
    shapes: list[tuple[int, ...]],
    n: int,
    fixed: dict[int, tuple[str, P]],
) -> tuple[Any, Any, dict[int, Decision], dict[int, set[int]], str, list[str]]:
    """How each Linear and table is split: from the traced dataflow with `example_call`,
    else in declaration order; with the stacked axes, the method and its notes."""
    if example_call is None:
        matmuls, emb = plan_declaration(info, paths, shapes, n)
        method = (
            "no example_call: Linear layers alternate in declaration order "
            "(pass example_call to follow the dataflow)"
        )
        return matmuls, emb, {}, {}, method, [method]
    matmuls, emb, tied, flow_notes, flow = plan_dataflow(
        example_call, model, info, paths, shapes, n, fixed
    )
    notes = list(flow_notes)
    unseen = [p for p in info.linear_weight if p in paths and paths.index(p) not in matmuls]
    unseen = [p for p in unseen if paths.index(p) not in fixed]
    if unseen:
        notes.append(f"{len(unseen)} Linear weight(s) not reached by example_call: replicated")
    return matmuls, emb, tied, flow.stacked, "rules traced from example_call (dataflow)", notes


def sharding_plan(
    model: PyTree,
    n_model_shards: int,
    *,
    example_call: Callable[[PyTree], Any] | None = None,
    overrides: Mapping[str, P] | None = None,
    fsdp: int = 1,
) -> ShardingPlan:
    """Find a tensor-parallel `PartitionSpec` for every array of `model`, with reasons.

    With `fsdp > 1` every weight is also split over the `"data"` axis (ZeRO-3 /
    FSDP): on the largest dimension the tensor-parallel spec leaves whole and
    `fsdp` divides (never a scanned layer axis), else together with the model axis
    on its split dimension when that divides, else not at all (listed in the
    notes). Parameters, gradients and optimizer state are then divided by every
    device; XLA gathers each weight where it is used and reduce-scatters its
    gradient.

    Args:
        model: an Equinox module (any pytree whose arrays are the parameters); its
            leaves may be `jax.ShapeDtypeStruct`s (`eqx.filter_eval_shape` of the
            constructor), so a model can be planned before it exists.
        n_model_shards: the size of the mesh's `"model"` axis.
        example_call: `model -> outputs`, run once under `jax.make_jaxpr` on abstract
            shapes (no FLOPs) to follow the dataflow, e.g. `lambda m: jax.vmap(m)(x)`.
            Without it, Linear layers alternate in declaration order.
        overrides: maps glob patterns over dotted paths (`"blocks.*.mlp.*.weight"`) to
            the `PartitionSpec` to use; wins over the rules.
        fsdp: the size of the mesh's `"data"` axis to split the weights over as well;
            1 for none.

    Returns:
        A `ShardingPlan`; `.specs` is what `place(..., specs=)` takes and `str(plan)` a report.

    Example:
        >>> plan = sharding_plan(model, 2, example_call=lambda m: jax.vmap(m)(x))
        >>> print(plan)   # path, shape, spec and why for every array
        >>> model = place(model, make_mesh(2), specs=plan.specs)
    """
    _check_n(n_model_shards)
    _check_n(fsdp, "fsdp")
    n = int(n_model_shards)
    model = abstract_arrays(model)
    stand_in, quantized = stand_ins(model)
    if quantized:
        # Planned as the Linears they stand for; their codes and scales follow.
        plan = sharding_plan(stand_in, n, example_call=example_call, overrides=overrides, fsdp=fsdp)
        return translated(plan, model, quantized, {MODEL: n, DATA: int(fsdp)})
    leaves = array_leaves(model)
    if not leaves:
        raise ValueError(
            "the model has no arrays to shard (eqx.filter(model, eqx.is_array) is empty); "
            "pass the Equinox module that holds the parameters."
        )
    paths = [p for p, _ in leaves]
    shapes = [tuple(int(d) for d in leaf.shape) for _, leaf in leaves]
    info = model_info(model)
    fixed = _match_overrides(overrides or {}, paths, shapes, n)
    matmuls, emb, tied, stacked, method, notes = _decisions(
        example_call, model, info, paths, shapes, n, fixed
    )
    plans: list[LeafPlan] = []
    specs: list[P] = []
    for i, (path, leaf) in enumerate(leaves):
        spec, reason, guess = _leaf_spec(i, path, shapes[i], info, paths, matmuls, emb, tied)
        if n == 1:
            spec, reason, guess = P(), "one model shard: replicated", False
        if i in fixed:
            pattern, spec = fixed[i]
            reason, guess = f"override {pattern!r}", False
        if guess:
            notes.append(f"{path}: {reason}")
        if fsdp > 1:
            with_data, why = _fsdp_spec(spec, shapes[i], stacked.get(i, set()), n, int(fsdp))
            reason = f"{reason}; {why}"
            if with_data is None:
                notes.append(f"{path} {shapes[i]}: {why}")
            spec = spec if with_data is None else with_data
        specs.append(spec)
        plans.append(LeafPlan(path, shapes[i], str(leaf.dtype), spec, reason))
    spec_tree = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(eqx.filter(model, eqx.is_array)), specs
    )
    return ShardingPlan(spec_tree, tuple(plans), n, method, tuple(notes), int(fsdp))


def _trimmed(entries: list[Any]) -> P:
    """A spec without trailing `None`s, as the arrays' own shardings report it."""
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return P(*entries)


def _fsdp_spec(
    spec: P, shape: tuple[int, ...], stacked: set[int], n_model: int, n_data: int
) -> tuple[P | None, str]:
    """`spec` with the data axis added for FSDP, and why; `None` when it cannot be."""
    entries: list[Any] = [*spec, *([None] * (len(shape) - len(spec)))]
    if any(DATA in (e if isinstance(e, tuple) else (e,)) for e in entries):
        return spec, "FSDP: the spec already names the data axis"
    free = [a for a, e in enumerate(entries) if e is None and a not in stacked and shape[a] > 1]
    split_on_model = any(MODEL in (e if isinstance(e, tuple) else (e,)) for e in entries)
    if not split_on_model and n_model > 1:
        # Left whole by tensor parallelism: divide it by every device, not only the data axis.
        both = [a for a in free if shape[a] % (n_data * n_model) == 0]
        if both:
            axis = max(both, key=lambda a: (shape[a], -a))
            entries[axis] = (DATA, MODEL)
            return _trimmed(entries), f"FSDP over data and model on dimension {axis}"
    whole = [a for a in free if shape[a] % n_data == 0]
    if whole:
        axis = max(whole, key=lambda a: (shape[a], -a))
        entries[axis] = DATA
        return _trimmed(entries), f"FSDP on dimension {axis}"
    for axis, e in enumerate(entries):
        if e == MODEL and shape[axis] % (n_model * n_data) == 0:
            entries[axis] = (MODEL, DATA)
            return _trimmed(entries), f"FSDP with the model axis on dimension {axis}"
    return None, f"FSDP: no dimension divides into {n_data} data shards; replicated over data"


def _match_overrides(
    overrides: Mapping[str, P], paths: list[str], shapes: list[tuple[int, ...]], n: int
) -> dict[int, tuple[str, P]]:
    """Leaf index -> (pattern, spec) for every override; the last matching pattern wins."""
    fixed: dict[int, tuple[str, P]] = {}
    matched: set[str] = set()
    for i, path in enumerate(paths):
        for pattern, override in overrides.items():
            if fnmatch.fnmatchcase(path, pattern):
                check_spec(path, shapes[i], override, {MODEL: n})
                fixed[i] = (pattern, override)
                matched.add(pattern)
    unmatched = [p for p in overrides if p not in matched]
    if unmatched:
        raise ValueError(
            f"override pattern(s) {unmatched} match no array of the model; patterns are globs "
            f"over dotted paths such as {paths[0]!r}."
        )
    return fixed


def _leaf_spec(
    i: int,
    path: str,
    shape: tuple[int, ...],
    info: ModelInfo,
    paths: list[str],
    matmuls: Mapping[int, Decision],
    emb: Mapping[int, Decision],
    tied: Mapping[int, Decision],
) -> tuple[P, str, bool]:
    """One leaf's spec, the reason, and whether it was a fallback or a guess."""
    ndim = len(shape)
    d = matmuls.get(i) or emb.get(i)
    if d is not None:
        return axis_spec(ndim, d.axis), f"{d.kind}: {d.reason}", d.guess
    if i in tied:
        return axis_spec(ndim, tied[i].axis), tied[i].reason, False
    bias_of = {b: w for w, b in info.linear_weight.items() if b}
    weight = paths.index(bias_of[path]) if path in bias_of and bias_of[path] in paths else None
    if weight is not None and weight in matmuls:
        wd = matmuls[weight]
        if wd.kind == COL:
            return axis_spec(ndim, ndim - 1), "bias of a column-split Linear: split with it", False
        return P(), f"bias of a {wd.kind} Linear: replicated", False
    if path in info.linear_weight:
        return P(), "Linear weight not reached by example_call: replicated", True
    if ndim <= 1:
        return P(), "scalar or vector (norm scale, bias): replicated", False
    return P(), "not a matmul weight or lookup table: replicated", ndim >= 2


def sharding_rules(
    model: PyTree,
    n_model_shards: int,
    *,
    example_call: Callable[[PyTree], Any] | None = None,
    overrides: Mapping[str, P] | None = None,
    fsdp: int = 1,
) -> PyTree:
    """Deprecated: `sharding_plan(...).specs`, which this returns (see there)."""
    warnings.warn(
        "rc.sharding_rules(...) is rc.sharding_plan(...).specs; the old name goes in the "
        "next release.",
        DeprecationWarning,
        stacklevel=2,
    )
    return sharding_plan(
        model, n_model_shards, example_call=example_call, overrides=overrides, fsdp=fsdp
    ).specs


def sharding_report(model: PyTree, specs: PyTree, *, n_model_shards: int | None = None) -> str:
    """Deprecated: `str(plan)` for a `ShardingPlan`, `str(ShardingPlan.given(model, specs))`
    for a spec tree, which this returns."""
    warnings.warn(
        "rc.sharding_report is str(plan), or str(rc.ShardingPlan.given(model, specs)) for "
        "specs made elsewhere; the old name goes in the next release.",
        DeprecationWarning,
        stacklevel=2,
    )
    if isinstance(specs, ShardingPlan):
        return str(specs)
    return str(ShardingPlan.given(model, specs, n_model_shards=n_model_shards))
