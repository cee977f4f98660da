"""Quantized Linears in a sharding plan: planned as the Linear each stands for.

A quantized Linear (`rc.nn.AbstractQuantized`) holds codes and scales, not a
weight, and decodes its weight inside the computation. The rules plan a model in
which each is replaced by its `stand_in()`, a Linear of the weight's shape over
arrays that take no memory, traced exactly as the Linear it stands for; then each
module turns that Linear's specs into its own arrays' (`specs_from`): codes and
block scales split as the weight's rows, and as its columns only where whole
blocks fall to each shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PyTree

from .._tree_paths import array_leaves, leaves_with_paths, path_str
from ..nn import AbstractQuantized
from ._sharding_plan import LeafPlan, ShardingPlan, is_spec

__all__ = ["stand_ins", "translated"]


def _is_quantized(x: Any) -> bool:
    return isinstance(x, AbstractQuantized)


def stand_ins(model: PyTree) -> tuple[PyTree, dict[str, AbstractQuantized]]:
    """`model` with every quantized Linear replaced by its stand-in, and those found by path."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_quantized)
    found: dict[str, AbstractQuantized] = {}
    leaves = []
    for kp, x in flat:
        if isinstance(x, AbstractQuantized):
            found[path_str(kp)] = x
            leaves.append(x.stand_in())
        else:
            leaves.append(x)
    return jax.tree_util.tree_unflatten(treedef, leaves), found


def _spec_or_linear(x: Any) -> bool:
    return is_spec(x) or isinstance(x, eqx.nn.Linear)


def translated(
    plan: ShardingPlan, model: PyTree, found: dict[str, AbstractQuantized], sizes: dict[str, int]
) -> ShardingPlan:
    """The plan of `model` from `plan`, its stand-in's: each quantized Linear's arrays
    split from its stand-in's specs, every other array as planned."""
    by_path = {leaf.path: leaf for leaf in plan.leaves}
    notes = list(plan.notes)
    reasons: dict[str, str] = {}

    def swap(kp: Any, x: Any) -> Any:
        path = path_str(kp)
        if path not in found:
            return x
        spec, note = found[path].specs_from(x, sizes)
        reasons[path] = f"{by_path[path + '.weight'].reason}; quantized: split with the weight"
        if note:
            reasons[path] += f"; {note}"
            notes.append(f"{path}: {note}")
        return spec

    spec_tree = jax.tree_util.tree_map_with_path(swap, plan.specs, is_leaf=_spec_or_linear)
    specs = dict(leaves_with_paths(spec_tree, is_leaf=is_spec))
    leaves = []
    for path, leaf in array_leaves(model):
        owner = next((q for q in found if path.startswith(q + ".")), None)
        if owner is None:
            leaves.append(by_path[path])
            continue
        shape = tuple(int(d) for d in leaf.shape)
        leaves.append(LeafPlan(path, shape, str(leaf.dtype), specs[path], reasons[owner]))
    return dataclasses.replace(plan, specs=spec_tree, leaves=tuple(leaves), notes=tuple(notes))
