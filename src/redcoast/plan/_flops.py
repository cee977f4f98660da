"""The FLOPs of a traced step: every matmul, a scanned layer counted as often as it runs.

XLA's cost analysis counts a loop's body once, however many times it runs, so a
model whose layers are stacked under `lax.scan` looks one layer deep to it. The
traced program knows each scan's length: `jaxpr_flops` walks it, counting
`2 x output elements x contraction` for every `dot_general` (the matmuls and
einsums of a model and of its gradient, recomputation included), multiplying a
scan's body by its length and a `shard_map` body (one device's share) by the
devices it runs on. Elementwise work is not counted: beside a transformer's
matmuls it is noise.
"""

from __future__ import annotations

import math
from typing import Any

from ..parallel import _jaxpr

__all__ = ["jaxpr_flops"]


def _dot(eqn: Any) -> float:
    (lhs_contract, _), _ = _jaxpr.dot_dimensions(eqn)
    lhs = eqn.invars[0].aval.shape
    out = eqn.outvars[0].aval.shape
    return 2.0 * math.prod(out) * math.prod(lhs[a] for a in lhs_contract)


def _manual_devices(eqn: Any) -> int:
    mesh = eqn.params.get("mesh")
    axes = eqn.params.get("newly_manual_axes") or eqn.params.get("manual_axes")
    if mesh is None:
        return 1
    names = axes if axes else tuple(mesh.shape)
    return math.prod(int(mesh.shape[a]) for a in names)


def jaxpr_flops(jaxpr: Any) -> float:
    """The FLOPs of every `dot_general` the jaxpr runs, loops and sub-jaxprs included.

    A `while` loop's body counts once (its trip count is not known from the trace);
    a `cond` counts its most expensive branch.
    """
    total = 0.0
    for eqn in jaxpr.eqns:
        kind = _jaxpr.name(eqn)
        if kind in _jaxpr.DOT_GENERAL:
            total += _dot(eqn)
        elif kind in _jaxpr.SCAN:
            length = int(eqn.params.get("length", 1))
            total += length * jaxpr_flops(_jaxpr.open_jaxpr(eqn.params["jaxpr"]))
        elif kind in _jaxpr.COND:
            total += max(jaxpr_flops(b) for b in _jaxpr.cond_branches(eqn))
        elif kind == "shard_map":
            total += _manual_devices(eqn) * jaxpr_flops(_jaxpr.open_jaxpr(eqn.params["jaxpr"]))
        else:
            for value in eqn.params.values():
                for item in value if isinstance(value, tuple | list) else (value,):
                    sub = _jaxpr.open_jaxpr(item)
                    if sub is not None:
                        total += jaxpr_flops(sub)
    return total
