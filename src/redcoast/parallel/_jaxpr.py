"""Everything redcoast reads from a jaxpr: primitive names, equation params, sub-jaxprs.

JAX documents what a jaxpr is but not the params of its equations, and they change
between releases: from JAX 0.11 on, `scan` describes its operands with `ft_in` /
`ft_out` where 0.10 had `num_consts` / `num_carry`, sub-jaxprs are open `Jaxpr`s
(`ClosedJaxpr` became an alias of it) and `closed_call` is named `eval_jaxpr`. The
dataflow interpreter (`_dataflow.py`) and FSDP's remat policy (`fsdp.py`) read
equations only through the functions here. Each reader either returns what it
promises, checked against the equation's own operands and results, or raises
`UnknownLayout` naming the primitive and what it could not read -- never a
`KeyError` from deep inside a rule. The interpreter answers `UnknownLayout` with its
conservative rule (the weights the equation touches are replicated, and the plan
says so), so a JAX release that changes a layout costs a note in the plan, not a
crash.

This is a module of its own rather than part of `_jax_private.py` because nothing
here is private JAX: jaxprs come from `jax.make_jaxpr` and their classes from
`jax.extend.core`. What moves is the *layout* of public objects, which calls for
validation and a fallback where `_jax_private.py` pins imports. Primitives are
matched by name, as a jaxpr prints them, not by the objects `jax.extend.core`
happens to export.

`tests/test_jaxpr.py` checks each reader on equations traced by the installed JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jax.extend import core as jcore

__all__ = [
    "BROADCAST_IN_DIM",
    "CALLS",
    "COND",
    "CONV",
    "DOT_GENERAL",
    "DYNAMIC_SLICE",
    "GATHER",
    "RESHAPE",
    "SCAN",
    "SLICE",
    "SQUEEZE",
    "TRANSPOSE",
    "WHILE",
    "Loop",
    "UnknownLayout",
    "broadcast_dimensions",
    "called_jaxpr",
    "checkpoint_name",
    "cond_branches",
    "conv_channels",
    "dot_dimensions",
    "has_sub_jaxprs",
    "is_sharding_constraint",
    "is_var",
    "name",
    "open_jaxpr",
    "scan_loop",
    "squeeze_dimensions",
    "transpose_permutation",
    "while_loop",
]

# Primitive names: a tuple, for a primitive JAX renames, keeps the old name beside the new.
SCAN = ("scan",)
WHILE = ("while",)
COND = ("cond",)
DOT_GENERAL = ("dot_general",)
CONV = ("conv_general_dilated",)
GATHER = ("gather",)
DYNAMIC_SLICE = ("dynamic_slice",)
TRANSPOSE = ("transpose",)
SQUEEZE = ("squeeze",)
BROADCAST_IN_DIM = ("broadcast_in_dim",)
RESHAPE = ("reshape",)
SLICE = ("slice",)
CALLS: Mapping[str, str] = {
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "eval_jaxpr": "call_jaxpr",  # `closed_call` from JAX 0.11 on
    "remat2": "jaxpr",  # `jax.checkpoint`
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}
"""Primitives that call a sub-jaxpr on exactly their operands -> the param holding it."""

_NAME = ("name",)  # `jax.ad_checkpoint.checkpoint_name`
_SHARDING_CONSTRAINT = ("sharding_constraint",)


class UnknownLayout(Exception):
    """An equation whose params are not laid out as any JAX release redcoast knows."""

    def __init__(self, primitive: str, what: str) -> None:
        """Name the primitive and what could not be read from it.

        Args:
            primitive: the equation's primitive name.
            what: what was missing or inconsistent, e.g. "no num_consts or ft_in".
        """
        super().__init__(f"{primitive}: {what}")
        self.primitive = primitive
        self.what = what


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop's body and how the equation's operands split into its groups.

    The operands are `consts + carry + xs` (scan: `xs` are sliced along their
    leading axis; while: there are none, and the body's consts follow the
    condition's, which `skip` counts). The results are `carry + ys`.
    """

    body: Any
    skip: int
    n_consts: int
    n_carry: int


def name(eqn: Any) -> str:
    """The name of an equation's primitive (`"scan"`, `"dot_general"`, ...)."""
    return str(getattr(getattr(eqn, "primitive", None), "name", "?"))


def is_var(atom: Any) -> bool:
    """Whether a jaxpr atom is a variable (not a literal)."""
    return isinstance(atom, jcore.Var) and not isinstance(atom, jcore.Literal)


def open_jaxpr(sub: Any) -> Any | None:
    """The open jaxpr (with `constvars`, `invars`, `outvars`, `eqns`) a param holds, or None.

    In JAX 0.10 sub-jaxprs are often `ClosedJaxpr`s wrapping a `Jaxpr`; from 0.11 on
    both names are one class, which carries its consts itself.
    """
    if isinstance(sub, jcore.Jaxpr):
        return sub
    if isinstance(sub, jcore.ClosedJaxpr):
        return sub.jaxpr
    return None


def has_sub_jaxprs(eqn: Any) -> bool:
    """Whether a param of the equation holds a jaxpr (directly or in a tuple) on arrays.

    A jaxpr on scalars only is a combiner (a scatter's update, a reduction's monoid)
    applied elementwise, not a computation the equation calls on its operands.
    """
    for value in eqn.params.values():
        items = value if isinstance(value, tuple | list) else (value,)
        for item in items:
            jaxpr = open_jaxpr(item)
            if jaxpr is not None and any(_ndim(v) for v in [*jaxpr.invars, *jaxpr.outvars]):
                return True
    return False


def _arity(eqn: Any, body: Any, n_in: int, n_out: int, what: str) -> Any:
    """`body` as an open jaxpr, if it takes `n_in` operands and gives `n_out` results."""
    jaxpr = open_jaxpr(body)
    if jaxpr is None:
        raise UnknownLayout(name(eqn), f"{what} is {type(body).__name__}, not a jaxpr")
    if (len(jaxpr.invars), len(jaxpr.outvars)) != (n_in, n_out):
        raise UnknownLayout(
            name(eqn),
            f"{what} takes {len(jaxpr.invars)} operands and gives {len(jaxpr.outvars)} results; "
            f"the equation has {n_in} and {n_out}",
        )
    return jaxpr


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _group_sizes(eqn: Any, param: str, groups: int) -> list[int] | None:
    """Leaf counts of the groups of a flat-tree param (`ft_in` of scan from JAX 0.11 on)."""
    tree = eqn.params.get(param)
    try:
        parts = tree.unpack()  # type: ignore[union-attr]
        sizes = [len(p) for p in parts]
    except (AttributeError, TypeError):
        return None
    return sizes if len(sizes) == groups else None


def scan_loop(eqn: Any) -> Loop:
    """`lax.scan`'s body and its operand groups (`consts`, `carry`, `xs`).

    JAX 0.10: params `num_consts`, `num_carry`, `jaxpr` (a `ClosedJaxpr`).
    JAX 0.11, 0.12: `ft_in` (a flat tree of the three groups), `ft_out`, `jaxpr`.

    Raises:
        UnknownLayout: neither layout, or group sizes the operands contradict.
    """
    params = eqn.params
    n_in, n_out = len(eqn.invars), len(eqn.outvars)
    nconst, ncarry = _int(params.get("num_consts")), _int(params.get("num_carry"))
    if nconst is None or ncarry is None:
        sizes = _group_sizes(eqn, "ft_in", 3)
        if sizes is None:
            raise UnknownLayout(
                name(eqn), "neither num_consts/num_carry nor a three-group ft_in in its params"
            )
        nconst, ncarry, nxs = sizes
        if nconst + ncarry + nxs != n_in:
            raise UnknownLayout(name(eqn), f"ft_in groups {sizes} do not add up to {n_in} operands")
    if nconst < 0 or ncarry < 0 or nconst + ncarry > n_in or ncarry > n_out:
        raise UnknownLayout(name(eqn), f"{nconst} consts and {ncarry} carries do not fit")
    body = _arity(eqn, params.get("jaxpr"), n_in, n_out, "its jaxpr")
    return Loop(body, 0, nconst, ncarry)


def while_loop(eqn: Any) -> Loop:
    """`lax.while_loop`'s body and its operand groups (`cond consts`, `body consts`, `carry`).

    Params `cond_nconsts`, `body_nconsts`, `body_jaxpr` in every release redcoast knows.

    Raises:
        UnknownLayout: a missing param, or counts the operands contradict.
    """
    params = eqn.params
    nc, nb = _int(params.get("cond_nconsts")), _int(params.get("body_nconsts"))
    if nc is None or nb is None:
        raise UnknownLayout(name(eqn), "no cond_nconsts/body_nconsts in its params")
    ncarry = len(eqn.invars) - nc - nb
    if nc < 0 or nb < 0 or ncarry != len(eqn.outvars):
        raise UnknownLayout(
            name(eqn), f"{nc} + {nb} consts leave {ncarry} carries for {len(eqn.outvars)} results"
        )
    body = _arity(eqn, params.get("body_jaxpr"), nb + ncarry, ncarry, "its body_jaxpr")
    return Loop(body, nc, nb, ncarry)


def cond_branches(eqn: Any) -> list[Any]:
    """`lax.cond` / `lax.switch`'s branches; each takes the operands after the index.

    Raises:
        UnknownLayout: no `branches`, or a branch of another arity.
    """
    branches = eqn.params.get("branches")
    if not isinstance(branches, tuple | list) or not branches:
        raise UnknownLayout(name(eqn), "no branches in its params")
    n_in, n_out = len(eqn.invars) - 1, len(eqn.outvars)
    return [_arity(eqn, b, n_in, n_out, f"branch {i}") for i, b in enumerate(branches)]


def called_jaxpr(eqn: Any) -> Any:
    """The sub-jaxpr a call-like primitive (see `CALLS`) runs on exactly its operands.

    Raises:
        UnknownLayout: not a known call, no such param, or another arity (a custom
            rule's consts, say).
    """
    param = CALLS.get(name(eqn))
    if param is None:
        raise UnknownLayout(name(eqn), "not a call primitive redcoast knows")
    if param not in eqn.params:
        raise UnknownLayout(name(eqn), f"no {param} in its params")
    return _arity(eqn, eqn.params[param], len(eqn.invars), len(eqn.outvars), param)


def _ints(eqn: Any, value: Any, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise UnknownLayout(name(eqn), f"{what} is {value!r}, not a sequence of ints") from None
    return out


def _ndim(atom: Any) -> int:
    return len(getattr(getattr(atom, "aval", None), "shape", ()))


def _param(eqn: Any, key: str) -> Any:
    if key not in eqn.params:
        raise UnknownLayout(name(eqn), f"no {key} in its params")
    return eqn.params[key]


def dot_dimensions(
    eqn: Any,
) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]:
    """`dot_general`'s `((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))`.

    Raises:
        UnknownLayout: no `dimension_numbers`, or axes the operands do not have.
    """
    dn = _param(eqn, "dimension_numbers")
    try:
        (lc, rc), (lb, rb) = dn
    except (TypeError, ValueError):
        msg = f"dimension_numbers {dn!r} are not ((lc, rc), (lb, rb))"
        raise UnknownLayout(name(eqn), msg) from None
    lc, lb = _ints(eqn, lc, "lhs axes"), _ints(eqn, lb, "lhs axes")
    rc, rb = _ints(eqn, rc, "rhs axes"), _ints(eqn, rb, "rhs axes")
    lhs, rhs = _ndim(eqn.invars[0]), _ndim(eqn.invars[1])
    if any(not 0 <= a < lhs for a in lc + lb) or any(not 0 <= a < rhs for a in rc + rb):
        raise UnknownLayout(name(eqn), f"dimension_numbers {dn!r} name axes the operands lack")
    return (lc, rc), (lb, rb)


def conv_channels(eqn: Any) -> tuple[int, int, int]:
    """`conv_general_dilated`'s kernel output-channel axis, kernel input-channel axis and
    the result's feature axis.

    Raises:
        UnknownLayout: `dimension_numbers` without `rhs_spec` / `out_spec`.
    """
    dn = _param(eqn, "dimension_numbers")
    try:
        rhs = _ints(eqn, dn.rhs_spec, "rhs_spec")
        out = _ints(eqn, dn.out_spec, "out_spec")
    except AttributeError:
        msg = f"dimension_numbers {dn!r} have no rhs_spec/out_spec"
        raise UnknownLayout(name(eqn), msg) from None
    if len(rhs) < 2 or len(out) < 2:
        raise UnknownLayout(name(eqn), f"dimension_numbers {dn!r} are too short")
    return rhs[0], rhs[1], out[1]


def transpose_permutation(eqn: Any) -> tuple[int, ...]:
    """`transpose`'s permutation (result axis i is operand axis `perm[i]`)."""
    perm = _ints(eqn, _param(eqn, "permutation"), "permutation")
    if sorted(perm) != list(range(_ndim(eqn.invars[0]))):
        raise UnknownLayout(name(eqn), f"permutation {perm} does not permute the operand's axes")
    return perm


def squeeze_dimensions(eqn: Any) -> tuple[int, ...]:
    """`squeeze`'s dropped operand axes, non-negative."""
    ndim = _ndim(eqn.invars[0])
    dims = _ints(eqn, _param(eqn, "dimensions"), "dimensions")
    if any(not -ndim <= d < ndim for d in dims):
        raise UnknownLayout(name(eqn), f"dimensions {dims} are not axes of the operand")
    return tuple(d % ndim for d in dims)


def broadcast_dimensions(eqn: Any) -> tuple[int, ...]:
    """`broadcast_in_dim`'s result axis for each operand axis."""
    dims = _ints(eqn, _param(eqn, "broadcast_dimensions"), "broadcast_dimensions")
    if len(dims) != _ndim(eqn.invars[0]):
        raise UnknownLayout(name(eqn), f"broadcast_dimensions {dims} do not cover the operand")
    return dims


def checkpoint_name(primitive: Any, params: Mapping[str, Any]) -> str | None:
    """The name `jax.ad_checkpoint.checkpoint_name` gave a value, as a remat policy sees it.

    Args:
        primitive: the primitive a remat policy is called with.
        params: its params.

    Returns:
        The name, or None when `primitive` is not the naming primitive.
    """
    if getattr(primitive, "name", None) not in _NAME:
        return None
    value = params.get("name")
    return value if isinstance(value, str) else None


def is_sharding_constraint(primitive: Any) -> bool:
    """Whether `primitive` is `jax.lax.with_sharding_constraint`'s."""
    return getattr(primitive, "name", None) in _SHARDING_CONSTRAINT
