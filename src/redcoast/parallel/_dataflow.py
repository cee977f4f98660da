"""How weights feed matmuls: an abstract interpreter of jaxprs.

`trace_dataflow(example_call, model)` traces `example_call(model)` with
`jax.make_jaxpr` (abstract shapes, no FLOPs) and walks the jaxpr once, keeping for
every value a small abstract state (`Value`): which weight it still is, which
matmuls' outputs reach it, which of its axes carry which weight axis. Each primitive
has a rule in `RULES`; primitives without one are treated as elementwise, unless
they call sub-jaxprs on arrays: those, and equations whose params `_jaxpr.py` cannot
read (a layout a new JAX release brought), get the conservative rule
(`conservative`): the weights they touch are replicated and the plan says why. The
result, a `Dataflow`, says for every matmul weight which of its axes are contracted
and which are produced, which matmuls feed it, which weights only gate or scale
other values, and which vectors are added to which matmul's output. The decisions
built on it live in `_tp_rules.py`.

Every primitive name and param is read through `_jaxpr.py`, never here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np

from . import _active, _jaxpr
from ._dataflow_state import DATA, EMPTY, Axes, join
from ._dataflow_state import NO_USE as NO_USE
from ._dataflow_state import Dataflow as Dataflow
from ._dataflow_state import Use as Use
from ._dataflow_state import Value as Value
from ._jaxpr import UnknownLayout

__all__ = ["NO_USE", "RULES", "Dataflow", "Use", "Value", "conservative", "trace_dataflow"]


def reshape_groups(src: tuple[int, ...], dst: tuple[int, ...], axis: int) -> tuple[int, int] | None:
    """The dst axes [i, j) holding exactly src axis `axis` after a row-major reshape."""
    pre = math.prod(src[:axis])
    end = pre * src[axis]
    prefix = [1]
    for d in dst:
        prefix.append(prefix[-1] * d)
    if pre not in prefix or end not in prefix:
        return None
    i = prefix.index(pre)
    j = len(prefix) - 1 - prefix[::-1].index(end)
    # Size-1 axes around the group belong to neither side; keep the tightest group.
    while i < j and dst[i] == 1 and math.prod(dst[i + 1 : j]) == src[axis]:
        i += 1
    return (i, j) if i < j else None


# --------------------------------------------------------------------------- axis maps

# An axis map takes (equation, src shape, dst shape) and gives, for every src axis, the
# dst axis that holds it unchanged (None when it is merged, split or dropped).
AxisMap = Callable[[Any, tuple[int, ...], tuple[int, ...]], list[int | None]]


def _map_transpose(eqn: Any, src: tuple, dst: tuple) -> list[int | None]:
    perm = _jaxpr.transpose_permutation(eqn)
    return [perm.index(a) for a in range(len(src))]


def _map_squeeze(eqn: Any, src: tuple, dst: tuple) -> list[int | None]:
    dropped = set(_jaxpr.squeeze_dimensions(eqn))
    out: list[int | None] = []
    k = 0
    for a in range(len(src)):
        out.append(None if a in dropped else k)
        k += a not in dropped
    return out


def _map_broadcast(eqn: Any, src: tuple, dst: tuple) -> list[int | None]:
    dims = _jaxpr.broadcast_dimensions(eqn)
    return [d if src[a] == dst[d] else None for a, d in enumerate(dims)]


def _map_reshape(eqn: Any, src: tuple, dst: tuple) -> list[int | None]:
    out: list[int | None] = []
    for a in range(len(src)):
        group = reshape_groups(src, dst, a)
        out.append(group[0] if group is not None and group[1] - group[0] == 1 else None)
    return out


def _map_same(eqn: Any, src: tuple, dst: tuple) -> list[int | None]:
    return list(range(len(src))) if len(src) == len(dst) else [None] * len(src)


def _by_name(table: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
    return {name: value for names, value in table.items() for name in names}


AXIS_MAPS: dict[str, AxisMap] = _by_name(
    {
        _jaxpr.TRANSPOSE: _map_transpose,
        _jaxpr.SQUEEZE: _map_squeeze,
        _jaxpr.BROADCAST_IN_DIM: _map_broadcast,
        _jaxpr.RESHAPE: _map_reshape,
        _jaxpr.SLICE: _map_same,
    }
)
"""Primitive name -> its axis map: ops that move, drop or add axes and keep the rest."""


def _remap(axes: Axes, mapping: list[int | None], ndim: int) -> Axes:
    new: list[int | None] = [None] * ndim
    for a, d in enumerate(mapping):
        if d is not None:
            new[d] = axes[a]
    return tuple(new)


# --------------------------------------------------------------------------- the walk


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(getattr(atom, "aval", None), "shape", ()))


class _Walk:
    """One walk over a jaxpr; `RULES` are called with it to record what they see."""

    def __init__(self, shapes: list[tuple[int, ...]] | None = None) -> None:
        self.flow = Dataflow()
        self.shapes = shapes or []

    def jaxpr(self, jaxpr: Any, ins: list[Value], consts: list[Value]) -> list[Value]:
        env: dict[Any, Value] = {}
        for var, state in zip(jaxpr.constvars, consts, strict=True):
            env[var] = state
        for var, state in zip(jaxpr.invars, ins, strict=True):
            env[var] = state

        def read(atom: Any) -> Value:
            return env.get(atom, EMPTY) if _jaxpr.is_var(atom) else EMPTY

        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [read(a) for a in eqn.invars])
            for var, state in zip(eqn.outvars, outs, strict=True):
                env[var] = state
        return [read(a) for a in jaxpr.outvars]

    def eqn(self, eqn: Any, ins: list[Value]) -> list[Value]:
        """One equation through its rule; the conservative rule when it cannot be read."""
        rule = RULES.get(_jaxpr.name(eqn))
        if rule is None and _jaxpr.has_sub_jaxprs(eqn):
            why = "no rule follows its sub-jaxprs"
            return conservative(self, eqn, ins, why)
        try:
            return (rule or elementwise)(self, eqn, ins)
        except UnknownLayout as err:
            return conservative(self, eqn, ins, err.what)

    def sub(self, jaxpr: Any, ins: list[Value]) -> list[Value]:
        """An open sub-jaxpr (from `_jaxpr`) on `ins`; its own consts are data."""
        return self.jaxpr(jaxpr, ins, [DATA] * len(jaxpr.constvars))

    def fixed_point(
        self, body: Any, consts: list[Value], carry: list[Value], xs: list[Value]
    ) -> list[Value]:
        nc = len(carry)
        outs: list[Value] = []
        for _ in range(6):
            outs = self.sub(body, consts + carry + xs)
            new = [join(a, b) for a, b in zip(carry, outs[:nc], strict=True)]
            if new == carry:
                break
            carry = new
        return [join(a, b) for a, b in zip(carry, outs[:nc], strict=True)] + outs[nc:]


Rule = Callable[[_Walk, Any, list[Value]], list[Value]]


def conservative(walk: _Walk, eqn: Any, ins: list[Value], why: str) -> list[Value]:
    """An equation the walk cannot read: replicate the weights it touches, note it.

    Nothing is assumed about what the equation does inside: every weight among its
    operands is recorded in `Dataflow.touched` (the plan replicates it, whatever
    matmuls elsewhere say), the primitive and `why` in `Dataflow.opaque` (the plan
    prints them), and its results carry every input's taint and data but no weight
    or features, so no later decision leans on axes it cannot have followed.

    Args:
        walk: the walk.
        eqn: the equation.
        ins: its operands' states.
        why: what the walk could not read, for the plan's note.

    Returns:
        The results' states.
    """
    name = _jaxpr.name(eqn)
    walk.flow.opaque.setdefault(name, why)
    for s in ins:
        if s.weight is not None:
            walk.flow.touched.setdefault(s.weight[0], name)
    taint = frozenset().union(*(s.taint for s in ins))
    data = any(s.data for s in ins)
    return [
        Value(taint=taint if _is_float(getattr(v.aval, "dtype", None)) else frozenset(), data=data)
        for v in eqn.outvars
    ]


def _gate_out(walk: _Walk, gated: frozenset[int]) -> None:
    walk.flow.gated |= gated


def elementwise(walk: _Walk, eqn: Any, ins: list[Value]) -> list[Value]:
    """Any primitive without a rule: taint flows from every input to every output.

    Two refinements make gates visible: an operand that was broadcast up to the shape
    of the others (a per-example scale, a router's weight per expert) passes its
    matmuls on as gates rather than as features, and integer or boolean outputs
    (argmax, top-k indices, comparisons) carry no features at all.
    """
    n_out = len(eqn.outvars)
    out_shapes = [_shape(v) for v in eqn.outvars]
    in_shapes = [_shape(a) for a in eqn.invars]
    weight = _weight_passthrough(eqn, ins, in_shapes, out_shapes)
    if weight is not None:
        return [Value(weight=weight)] + [EMPTY] * (n_out - 1)
    data = any(s.data for s in ins)
    size = math.prod(out_shapes[0]) if len(out_shapes) == 1 else 0
    # Broadcast here (size-1 axes against full ones) or just before.
    smaller = [s.bcast or math.prod(shape) < size for s, shape in zip(ins, in_shapes, strict=True)]
    full = [s for s, small in zip(ins, smaller, strict=True) if not small]
    if full and len(full) < len(ins) and any(s.data or s.taint for s in full):
        kept = frozenset().union(*(s.taint for s in full))
        _gate_out(walk, frozenset().union(*(s.taint for s in ins)) - kept)
        taint = kept
    else:
        taint = frozenset().union(*(s.taint for s in ins)) if ins else frozenset()
    _tie(walk, eqn, ins, in_shapes, out_shapes)
    feat = _feat(walk, eqn, ins, in_shapes, out_shapes)
    name = _jaxpr.name(eqn)
    if name in _jaxpr.BROADCAST_IN_DIM:
        # An activation broadcast up to a larger shape scales or shifts what it meets.
        bcast = math.prod(out_shapes[0]) > math.prod(in_shapes[0]) and bool(ins[0].taint)
    elif name in AXIS_MAPS:
        bcast = False
    else:
        bcast = any(s.bcast for s in ins) and all(s.bcast or not (s.data or s.taint) for s in ins)
    outs = []
    for i, var in enumerate(eqn.outvars):
        discrete = not _is_float(getattr(var.aval, "dtype", None))
        outs.append(
            Value(
                taint=frozenset() if discrete else taint,
                data=data,
                feat=feat if i == 0 and not discrete else None,
                bcast=bcast and not discrete,
            )
        )
    return outs


def _is_float(dtype: Any) -> bool:
    try:
        return bool(np.issubdtype(dtype, np.inexact))
    except TypeError:  # PRNG key types and other extended dtypes
        return False


def _weight_passthrough(
    eqn: Any, ins: list[Value], in_shapes: list[tuple[int, ...]], out_shapes: list[tuple[int, ...]]
) -> tuple[int, Axes] | None:
    """A weight only cast, transposed, sliced, broadcast or reshaped is still that weight."""
    weighted = [i for i, s in enumerate(ins) if s.weight is not None]
    if len(weighted) != 1 or len(out_shapes) != 1:
        return None
    k = weighted[0]
    if any(s.data or s.taint or s.weight is not None for i, s in enumerate(ins) if i != k):
        return None
    weight = ins[k].weight
    assert weight is not None
    leaf, axes = weight
    src, dst = in_shapes[k], out_shapes[0]
    axis_map = AXIS_MAPS.get(_jaxpr.name(eqn))
    if axis_map is not None:
        return leaf, _remap(axes, axis_map(eqn, src, dst), len(dst))
    if src == dst and len(ins) <= 3:
        # casts, copies and elementwise ops with constants (w * scale)
        return leaf, axes
    return None


def _feat(
    walk: _Walk,
    eqn: Any,
    ins: list[Value],
    in_shapes: list[tuple[int, ...]],
    out_shapes: list[tuple[int, ...]],
) -> tuple[int, Axes] | None:
    """Follow a matmul's output axes through ops that keep them."""
    carriers = [(i, s.feat) for i, s in enumerate(ins) if s.feat is not None and not s.bcast]
    if not carriers or len(out_shapes) != 1:
        return None
    k, feat = carriers[0]
    assert feat is not None
    leaf, axes = feat
    src, dst = in_shapes[k], out_shapes[0]
    axis_map = AXIS_MAPS.get(_jaxpr.name(eqn))
    if axis_map is None:
        return feat if src == dst else None
    if _jaxpr.name(eqn) in _jaxpr.RESHAPE:
        use = walk.flow.uses.get(leaf)
        for a, leaf_axis in enumerate(axes):
            group = reshape_groups(src, dst, a)
            if use and leaf_axis in use.out_axes and group and group[1] - group[0] > 1:
                # The reshape that splits a matmul's output features reads its heads.
                count = math.prod(dst[group[0] : group[1] - 1])
                walk.flow.heads.setdefault(leaf, count)
                if src[a] == walk.shapes[leaf][leaf_axis] and 1 < count < src[a]:
                    # All of them, not a slice (MLA's shared rotated key part).
                    walk.flow.whole_heads.setdefault(leaf, count)
    return leaf, _remap(axes, axis_map(eqn, src, dst), len(dst))


def _tie(
    walk: _Walk,
    eqn: Any,
    ins: list[Value],
    in_shapes: list[tuple[int, ...]],
    out_shapes: list[tuple[int, ...]],
) -> None:
    """A weight added to (or multiplied into) a matmul's output is tied to its axes."""
    if len(ins) != 2 or len(out_shapes) != 1:
        return
    for w, m in ((ins[0], ins[1]), (ins[1], ins[0])):
        if w.weight is None or m.feat is None:
            continue
        leaf, waxes = w.weight
        mleaf, maxes = m.feat
        pairs = {
            wa: ma
            for wa, ma in zip(waxes, maxes, strict=False)
            if wa is not None and ma is not None
        }
        if pairs and leaf not in walk.flow.uses:
            walk.flow.ties.setdefault(leaf, (mleaf, pairs))


def dot_general(walk: _Walk, eqn: Any, ins: list[Value]) -> list[Value]:
    """A matmul: record how the weight operand is used; its output carries its features."""
    lhs, rhs = ins
    (lc, rc), (lb, rb) = _jaxpr.dot_dimensions(eqn)
    out_shape = _shape(eqn.outvars[0])
    if (lhs.weight is None) == (rhs.weight is None):
        return [_activation_dot(walk, lhs, rhs, (lc, rc))]
    w_is_lhs = lhs.weight is not None
    w, x = (lhs, rhs) if w_is_lhs else (rhs, lhs)
    assert w.weight is not None
    leaf, axes = w.weight
    wc, wb = (lc, lb) if w_is_lhs else (rc, rb)
    xc, xb = (rc, rb) if w_is_lhs else (lc, lb)
    ndim = len(axes)
    free = [d for d in range(ndim) if d not in wc and d not in wb]
    in_axes = tuple(a for a in (axes[d] for d in wc) if a is not None)
    out_axes = tuple(a for a in (axes[d] for d in free) if a is not None)
    batch_axes = tuple(a for a in (axes[d] for d in wb) if a is not None)
    flow = walk.flow
    use = flow.uses.get(leaf)
    if use is None:
        x_elems = math.prod(_shape(eqn.invars[1 if w_is_lhs else 0]))
        flow.uses[leaf] = Use(
            in_axes, out_axes, batch_axes, set(x.taint), math.prod(out_shape), x_elems
        )
        flow.order.append(leaf)
    else:
        if (use.in_axes, use.out_axes) != (in_axes, out_axes):
            flow.conflicts.add(leaf)
        use.taint |= x.taint
    flow.reaching |= x.taint
    # dot_general's output axes: batch, then lhs free, then rhs free.
    x_ndim = len(_shape(eqn.invars[1 if w_is_lhs else 0]))
    x_free = x_ndim - len(xc) - len(xb)
    w_free = [axes[d] for d in free]
    out: list[int | None] = [axes[d] for d in wb]
    out += w_free + [None] * x_free if w_is_lhs else [None] * x_free + w_free
    return [Value(taint=frozenset({leaf}), data=x.data, feat=(leaf, tuple(out)))]


def _activation_dot(walk: _Walk, lhs: Value, rhs: Value, contract: tuple) -> Value:
    """A product of two activations (attention scores, a mixture's combine).

    When one side contracts a matmul's output features against an axis of the other
    side that is nobody's features -- a router's weight per expert against the stacked
    experts' outputs -- that matmul selects among branches: a gate.
    """
    taint = lhs.taint | rhs.taint
    if lhs.taint and rhs.taint:
        walk.flow.attended |= taint
    sides = ((lhs, contract[0], rhs, contract[1]), (rhs, contract[1], lhs, contract[0]))
    for a, ac, b, bc in sides:
        if a.feat is None or not a.taint:
            continue
        leaf, axes = a.feat
        use = walk.flow.uses.get(leaf)
        feature = use is not None and any(axes[d] in use.out_axes for d in ac)
        b_feature = b.feat is not None and any(
            b.feat[1][d] is not None
            and b.feat[1][d] in walk.flow.uses.get(b.feat[0], NO_USE).out_axes
            for d in bc
        )
        if feature and not b_feature:
            _gate_out(walk, a.taint - b.taint)
            taint = b.taint
    return Value(taint=taint, data=lhs.data or rhs.data)


def conv_general_dilated(walk: _Walk, eqn: Any, ins: list[Value]) -> list[Value]:
    """A convolution with a weight kernel: output features on its `O` axis, input on `I`."""
    lhs, rhs = ins
    if rhs.weight is None or lhs.weight is not None:
        return elementwise(walk, eqn, ins)
    leaf, axes = rhs.weight
    out_spec, in_spec, feature = _jaxpr.conv_channels(eqn)
    out_axis, in_axis = axes[out_spec], axes[in_spec]
    flow = walk.flow
    if leaf not in flow.uses:
        flow.uses[leaf] = Use(
            tuple(a for a in (in_axis,) if a is not None),
            tuple(a for a in (out_axis,) if a is not None),
            (),
            set(lhs.taint),
            math.prod(_shape(eqn.outvars[0])),
            math.prod(_shape(eqn.invars[0])),
            stem=lhs.data and not lhs.taint,
        )
        flow.order.append(leaf)
    flow.reaching |= lhs.taint
    ndim = len(_shape(eqn.outvars[0]))
    feat: list[int | None] = [None] * ndim
    feat[feature] = out_axis
    return [Value(taint=frozenset({leaf}), data=lhs.data, feat=(leaf, tuple(feat)))]


def lookup(walk: _Walk, eqn: Any, ins: list[Value]) -> list[Value]:
    """A gather or dynamic slice from a table: an embedding, or a stacked layer's slice."""
    if not ins or ins[0].weight is None:
        return elementwise(walk, eqn, ins)
    leaf, axes = ins[0].weight
    by_data = any(s.data for s in ins[1:])
    walk.flow.lookups.setdefault(leaf, set()).add(by_data)
    if by_data:
        elems = math.prod(_shape(eqn.outvars[0]))
        walk.flow.looked_up[leaf] = walk.flow.looked_up.get(leaf, 0) + elems
    if _jaxpr.name(eqn) in _jaxpr.DYNAMIC_SLICE and not by_data:
        # A loop indexing stacked layers (w[i]) keeps the weight.
        return [Value(weight=(leaf, axes))]
    # Looked-up rows are whole (a vocabulary-split table is all-reduced), whatever
    # computed the indices: in a generation loop they are the argmax of the head's
    # logits, and passing the head's taint on would flip every layer after it.
    return [Value(data=True)]


def _slice_leading(s: Value) -> Value:
    weight = None if s.weight is None else (s.weight[0], s.weight[1][1:])
    feat = None if s.feat is None else (s.feat[0], s.feat[1][1:])
    return Value(weight=weight, taint=s.taint, data=s.data, feat=feat)


def _stack_leading(s: Value) -> Value:
    weight = None if s.weight is None else (s.weight[0], (None, *s.weight[1]))
    feat = None if s.feat is None else (s.feat[0], (None, *s.feat[1]))
    return Value(weight=weight, taint=s.taint, data=s.data, feat=feat)


def scan(walk: _Walk, eqn: Any, ins: list[Value]) -> list[Value]:
    """`lax.scan`: the body sees one slice of each `xs`; carries iterate to a fixed point."""
    loop = _jaxpr.scan_loop(eqn)
    nconst, ncarry = loop.n_consts, loop.n_carry
    consts, carry, xs = ins[:nconst], ins[nconst : nconst + ncarry], ins[nconst + ncarry :]
    for s in xs:
        if s.weight is not None and s.weight[1] and s.weight[1][0] is not None:
            walk.flow.stacked.setdefault(s.weight[0], set()).add(s.weight[1][0])
    outs = walk.fixed_point(loop.body, consts, carry, [_slice_leading(s) for s in xs])
    return outs[:ncarry] + [_stack_leading(s) for s in outs[ncarry:]]


def while_loop(walk: _Walk, eqn: Any, ins: list[Value]) -> list[Value]:
    """`lax.while_loop`: the body's carries iterate to a fixed point."""
    loop = _jaxpr.while_loop(eqn)
    start = loop.skip + loop.n_consts
    return walk.fixed_point(loop.body, ins[loop.skip : start], ins[start:], [])


def cond(walk: _Walk, eqn: Any, ins: list[Value]) -> list[Value]:
    """`lax.cond` / `switch`: every branch is followed and their results joined."""
    outs: list[Value] | None = None
    for branch in _jaxpr.cond_branches(eqn):
        res = walk.sub(branch, ins[1:])
        outs = res if outs is None else [join(a, b) for a, b in zip(outs, res, strict=True)]
    return outs or [EMPTY] * len(eqn.outvars)


def call(walk: _Walk, eqn: Any, ins: list[Value]) -> list[Value]:
    """`jit`, `checkpoint`, custom derivatives: the sub-jaxpr they call on their operands."""
    return walk.sub(_jaxpr.called_jaxpr(eqn), ins)


RULES: dict[str, Rule] = _by_name(
    {
        _jaxpr.DOT_GENERAL: dot_general,
        _jaxpr.CONV: conv_general_dilated,
        _jaxpr.GATHER: lookup,
        _jaxpr.DYNAMIC_SLICE: lookup,
        _jaxpr.SCAN: scan,
        _jaxpr.WHILE: while_loop,
        _jaxpr.COND: cond,
        tuple(_jaxpr.CALLS): call,
    }
)
"""Primitive name -> its rule; any other primitive is `elementwise`, or `conservative`
when it carries sub-jaxprs."""


def trace_dataflow(example_call: Callable[[Any], Any], model: Any) -> Dataflow:
    """Trace `example_call(model)` on abstract shapes and follow how weights feed matmuls.

    Args:
        example_call: `model -> outputs`, e.g. `lambda m: jax.vmap(m)(x)`.
        model: the model; its array leaves (in `eqx.filter(model, eqx.is_array)` order)
            are the leaves the result's indices refer to.

    Returns:
        A `Dataflow`.

    Raises:
        ValueError: when `example_call` fails while being traced.

    Example:
        >>> flow = trace_dataflow(lambda m: jax.vmap(m)(x), model)
        >>> flow.order   # the matmul weights, in the order the data meets them
    """
    arrays, static = eqx.partition(model, eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(arrays)

    def run(*flat: Any) -> Any:
        return example_call(eqx.combine(jax.tree_util.tree_unflatten(treedef, list(flat)), static))

    abstract = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
    try:
        with _active.dataflow_trace():
            closed = jax.make_jaxpr(run)(*abstract)
    except Exception as err:
        raise ValueError(
            f"example_call raised {type(err).__name__} while being traced: {err}\n"
            "example_call must run the model on an example input, e.g. "
            "`example_call=lambda m: jax.vmap(m)(x)` or `lambda m: loss_fn(m, batch, key)`."
        ) from err
    walk = _Walk([tuple(leaf.shape) for leaf in leaves])
    flow = walk.flow
    jaxpr = _jaxpr.open_jaxpr(closed)
    if jaxpr is None:  # nothing to walk: everything is replicated, and the plan says why
        flow.opaque["make_jaxpr"] = f"it returned a {type(closed).__name__}, not a jaxpr"
        flow.touched = dict.fromkeys(range(len(leaves)), "make_jaxpr")
        return flow
    ins = [Value(weight=(i, tuple(range(len(leaf.shape))))) for i, leaf in enumerate(leaves)]
    outs = walk.sub(jaxpr, ins)
    for state in outs:
        flow.reaching |= state.taint
    flow.gates = {leaf for leaf in flow.gated if leaf not in flow.reaching}
    return flow
