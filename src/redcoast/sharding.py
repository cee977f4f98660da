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
dataflow comes from `jax.make_jaxpr(example_call)` on abstract shapes: no FLOPs
are spent and nothing is materialised. Without `example_call` the rules fall
back to the order in which Linear layers are declared.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .mesh import MODEL

__all__ = [
    "LeafPlan",
    "ShardingPlan",
    "shard",
    "sharding_plan",
    "sharding_report",
    "sharding_rules",
]

COL, ROW, REP = "column", "row", "replicated"

_Q_NAMES = ("query_proj", "q_proj", "query", "wq")
_K_NAMES = ("key_proj", "k_proj", "key", "wk")
_V_NAMES = ("value_proj", "v_proj", "value", "wv")
_O_NAMES = ("output_proj", "o_proj", "out_proj", "dense", "wo")
_HEAD_FIELDS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_KV_HEAD_FIELDS = ("num_kv_heads", "num_key_value_heads", "n_kv_heads")


# --------------------------------------------------------------------------- results


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
    `shard` takes. `str(plan)` is a readable report.
    """

    specs: PyTree
    leaves: tuple[LeafPlan, ...]
    n_model_shards: int
    method: str
    notes: tuple[str, ...] = ()

    def _per_device(self, leaf: LeafPlan) -> float:
        ways = 1
        for entry in leaf.spec:
            names = entry if isinstance(entry, tuple) else (entry,)
            ways *= self.n_model_shards ** sum(name == MODEL for name in names)
        return leaf.nbytes / ways

    @property
    def total_bytes(self) -> int:
        """Bytes of all arrays of the model."""
        return sum(leaf.nbytes for leaf in self.leaves)

    @property
    def bytes_per_device(self) -> int:
        """Bytes of the model that each device of one model-parallel group holds."""
        return int(sum(self._per_device(leaf) for leaf in self.leaves))

    @property
    def replicated_bytes(self) -> int:
        """Bytes of the arrays that are not split at all."""
        return sum(leaf.nbytes for leaf in self.leaves if not _is_split(leaf.spec))

    def __str__(self) -> str:
        rows = [
            (leaf.path, str(leaf.shape), _spec_str(leaf.spec), leaf.reason) for leaf in self.leaves
        ]
        heads = ("path", "shape", "spec", "why")
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads[:3])]
        lines = [
            f"sharding plan: {self.n_model_shards} model shard(s); {self.method}",
            "  ".join(h.ljust(w) for h, w in zip(heads[:3], widths, strict=True)) + "  why",
        ]
        for row in rows:
            lines.append(
                "  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3]
            )
        total = self.total_bytes
        rep = self.replicated_bytes
        lines.append(
            f"bytes per device: {_fmt_bytes(self.bytes_per_device)} of {_fmt_bytes(total)} "
            f"(ideal {_fmt_bytes(total / self.n_model_shards)}); replicated: {_fmt_bytes(rep)} "
            f"({100 * rep / max(total, 1):.1f}% of the model)"
        )
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


def _is_split(spec: P) -> bool:
    return any(entry is not None for entry in spec)


def _spec_str(spec: P) -> str:
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def _fmt_bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- tree helpers


def _key_str(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(path: tuple[Any, ...]) -> str:
    """`blocks.0.attn.query_proj.weight` for a JAX key path."""
    return ".".join(_key_str(k) for k in path)


def _array_leaves(model: PyTree) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))
    return [(path_str(p), leaf) for p, leaf in flat]


def _modules(node: Any, prefix: str = "") -> Iterator[tuple[str, eqx.Module]]:
    """Every `eqx.Module` inside `node`, depth first in declaration order, with its path."""
    if isinstance(node, eqx.Module):
        yield prefix, node
        children: list[tuple[str, Any]] = [
            (f.name, getattr(node, f.name, None)) for f in dataclasses.fields(node)
        ]
    elif isinstance(node, list | tuple):
        children = [(str(i), c) for i, c in enumerate(node)]
    elif isinstance(node, dict):
        children = [(str(k), node[k]) for k in sorted(node)]
    else:
        return
    for name, child in children:
        yield from _modules(child, f"{prefix}.{name}" if prefix else name)


def _first_attr(module: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = getattr(module, name, None)
        if value is not None:
            return value, name
    return None, None


@dataclasses.dataclass
class _ModelInfo:
    """What the module structure says: Linear weights and biases, embeddings, attention."""

    linear_weight: dict[str, str]  # weight path -> bias path ("" when none), declaration order
    embeddings: set[str]
    role: dict[str, str]  # weight path -> "q" | "k" | "v" | "o"
    heads: dict[str, int]  # weight path -> number of heads its output (Q/K/V) or input (O) holds


def _model_info(model: PyTree) -> _ModelInfo:
    linear_weight: dict[str, str] = {}
    embeddings: set[str] = set()
    role: dict[str, str] = {}
    heads: dict[str, int] = {}
    for path, module in _modules(model):
        dot = f"{path}." if path else ""
        if isinstance(module, eqx.nn.Linear):
            linear_weight[dot + "weight"] = dot + "bias" if module.bias is not None else ""
        elif isinstance(module, eqx.nn.Embedding):
            embeddings.add(dot + "weight")
        projections = {
            r: _first_attr(module, names)
            for r, names in (("q", _Q_NAMES), ("k", _K_NAMES), ("v", _V_NAMES), ("o", _O_NAMES))
        }
        if all(isinstance(p, eqx.nn.Linear) for p, _ in projections.values()):
            n_heads, _ = _first_attr(module, _HEAD_FIELDS)
            n_kv, _ = _first_attr(module, _KV_HEAD_FIELDS)
            for r, (_, name) in projections.items():
                wpath = f"{dot}{name}.weight"
                role[wpath] = r
                count = n_kv if (r in "kv" and isinstance(n_kv, int)) else n_heads
                if isinstance(count, int) and count > 0:
                    heads[wpath] = count
    return _ModelInfo(linear_weight, embeddings, role, heads)


# --------------------------------------------------------------------------- dataflow


@dataclasses.dataclass(frozen=True)
class _V:
    """What the walk knows about one jaxpr value.

    weight: (leaf, leaf axis per value axis) when the value is a weight, possibly
        cast, transposed or sliced.
    taint: the matmul weights whose outputs reach this value with no matmul between.
    data: whether the value depends on the example input (not only on iota/literals).
    feat: (leaf, axis) when one axis of this value is still the output-feature
        axis of a matmul, followed until the reshape that splits it into heads.
    """

    weight: tuple[int, tuple[int | None, ...]] | None = None
    taint: frozenset[int] = frozenset()
    data: bool = False
    feat: tuple[int, int] | None = None


_EMPTY = _V()
_DATA = _V(data=True)


def _join(a: _V, b: _V) -> _V:
    return _V(
        weight=a.weight if a.weight == b.weight else None,
        taint=a.taint | b.taint,
        data=a.data or b.data,
        feat=a.feat if a.feat == b.feat else None,
    )


@dataclasses.dataclass
class _Use:
    in_axes: tuple[int, ...]
    out_axes: tuple[int, ...]
    taint: set[int]


def _reshape_groups(
    src: tuple[int, ...], dst: tuple[int, ...], axis: int
) -> tuple[int, int] | None:
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


_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_WEIGHT_UNARY = {"convert_element_type", "copy", "copy_p", "reduce_precision", "slice", "real"}


class _Flow:
    """A walk over a jaxpr that records how weights feed matmuls."""

    def __init__(self, shapes: list[tuple[int, ...]]):
        self.shapes = shapes
        self.uses: dict[int, _Use] = {}
        self.order: list[int] = []
        self.heads: dict[int, int] = {}
        self.lookups: dict[int, set[bool]] = {}  # leaf -> {indices depend on data?}
        self.conflicts: set[int] = set()
        self.opaque: set[str] = set()

    # -- entry points
    def run(self, closed: jcore.ClosedJaxpr, n_leaves: int) -> None:
        jaxpr = closed.jaxpr
        ins = [
            _V(weight=(i, tuple(range(len(self.shapes[i])))), data=False) for i in range(n_leaves)
        ]
        self.walk(jaxpr, ins, [_DATA] * len(jaxpr.constvars))

    def walk(self, jaxpr: jcore.Jaxpr, ins: list[_V], consts: list[_V]) -> list[_V]:
        env: dict[Any, _V] = {}
        for var, state in zip(jaxpr.constvars, consts, strict=True):
            env[var] = state
        for var, state in zip(jaxpr.invars, ins, strict=True):
            env[var] = state

        def read(atom: Any) -> _V:
            return env.get(atom, _EMPTY) if isinstance(atom, jcore.Var) else _EMPTY

        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [read(a) for a in eqn.invars])
            for var, state in zip(eqn.outvars, outs, strict=True):
                env[var] = state
        return [read(a) for a in jaxpr.outvars]

    def _sub(self, sub: Any, ins: list[_V]) -> list[_V]:
        if isinstance(sub, jcore.ClosedJaxpr):
            return self.walk(sub.jaxpr, ins, [_DATA] * len(sub.jaxpr.constvars))
        return self.walk(sub, ins, [_DATA] * len(sub.constvars))

    # -- one equation
    def eqn(self, eqn: Any, ins: list[_V]) -> list[_V]:
        name = eqn.primitive.name
        params = eqn.params
        n_out = len(eqn.outvars)
        if name == "dot_general":
            return [self._dot(eqn, ins)]
        if name == "scan":
            return self._scan(params, ins)
        if name == "while":
            return self._while(params, ins)
        if name == "cond":
            outs: list[_V] | None = None
            for branch in params["branches"]:
                res = self._sub(branch, ins[1:])
                outs = (
                    res if outs is None else [_join(a, b) for a, b in zip(outs, res, strict=True)]
                )
            return outs or [_EMPTY] * n_out
        for key in _CALL_PARAMS:
            sub = params.get(key)
            if isinstance(sub, jcore.ClosedJaxpr | jcore.Jaxpr):
                inner = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
                if len(inner.invars) == len(ins) and len(inner.outvars) == n_out:
                    return self._sub(sub, ins)
        if name in ("gather", "dynamic_slice") and ins and ins[0].weight is not None:
            return [self._lookup(name, eqn, ins)]

        merged = _EMPTY
        for state in ins:
            merged = _join(merged, state) if merged is not _EMPTY else state
        taint = frozenset().union(*(s.taint for s in ins)) if ins else frozenset()
        data = any(s.data for s in ins)
        out_shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
        in_shapes = [tuple(getattr(getattr(a, "aval", None), "shape", ())) for a in eqn.invars]

        weight = self._weight_passthrough(name, params, ins, in_shapes, out_shapes)
        if weight is not None:
            return [_V(weight=weight)] + [_EMPTY] * (n_out - 1)
        if any(p in params for p in _CALL_PARAMS) or name in ("custom_jvp_call", "custom_vjp_call"):
            self.opaque.add(name)
        feat = self._feat(name, params, ins, in_shapes, out_shapes)
        return [_V(taint=taint, data=data, feat=feat if i == 0 else None) for i in range(n_out)]

    def _weight_passthrough(
        self,
        name: str,
        params: Mapping[str, Any],
        ins: list[_V],
        in_shapes: list[tuple[int, ...]],
        out_shapes: list[tuple[int, ...]],
    ) -> tuple[int, tuple[int | None, ...]] | None:
        """A weight only cast, transposed, sliced or reshaped is still that weight."""
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
        if name == "transpose":
            return leaf, tuple(axes[p] for p in params["permutation"])
        if name == "squeeze":
            dropped = {d % len(src) for d in params["dimensions"]}
            return leaf, tuple(a for i, a in enumerate(axes) if i not in dropped)
        if name == "broadcast_in_dim":
            new: list[int | None] = [None] * len(dst)
            for i, d in enumerate(params["broadcast_dimensions"]):
                new[d] = axes[i] if src[i] == dst[d] else None
            return leaf, tuple(new)
        if name == "reshape":
            new = [None] * len(dst)
            for i in range(len(src)):
                group = _reshape_groups(src, dst, i)
                if group is not None and group[1] - group[0] == 1:
                    new[group[0]] = axes[i]
            return leaf, tuple(new)
        if name in _WEIGHT_UNARY or (src == dst and len(ins) <= 3):
            # casts, slices, and elementwise ops with constants (w * scale)
            return leaf, axes if src == dst or name == "slice" else tuple([None] * len(dst))
        return None

    def _feat(
        self,
        name: str,
        params: Mapping[str, Any],
        ins: list[_V],
        in_shapes: list[tuple[int, ...]],
        out_shapes: list[tuple[int, ...]],
    ) -> tuple[int, int] | None:
        """Follow a matmul's output-feature axis; at the reshape that splits it, read heads."""
        carriers = [(i, s.feat) for i, s in enumerate(ins) if s.feat is not None]
        if not carriers or len(out_shapes) != 1:
            return None
        k, feat = carriers[0]
        assert feat is not None
        leaf, axis = feat
        src, dst = in_shapes[k], out_shapes[0]
        if name == "transpose":
            return leaf, list(params["permutation"]).index(axis)
        if name == "broadcast_in_dim":
            return leaf, params["broadcast_dimensions"][axis]
        if name == "reshape":
            group = _reshape_groups(src, dst, axis)
            if group is None:
                return None
            i, j = group
            if j - i == 1:
                return leaf, i
            self.heads.setdefault(leaf, math.prod(dst[i : j - 1]))
            return None
        if src == dst:
            return feat
        return None

    def _dot(self, eqn: Any, ins: list[_V]) -> _V:
        lhs, rhs = ins
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        if (lhs.weight is None) == (rhs.weight is None):
            return _V(taint=lhs.taint | rhs.taint, data=lhs.data or rhs.data)
        w_is_lhs = lhs.weight is not None
        w, x = (lhs, rhs) if w_is_lhs else (rhs, lhs)
        assert w.weight is not None
        leaf, axes = w.weight
        wc, wb = (lc, lb) if w_is_lhs else (rc, rb)
        ndim = len(axes)
        free = [d for d in range(ndim) if d not in wc and d not in wb]
        in_axes = tuple(a for a in (axes[d] for d in wc) if a is not None)
        out_axes = tuple(a for a in (axes[d] for d in free) if a is not None)
        use = self.uses.get(leaf)
        if use is None:
            self.uses[leaf] = _Use(in_axes, out_axes, set(x.taint))
            self.order.append(leaf)
        else:
            if (use.in_axes, use.out_axes) != (in_axes, out_axes):
                self.conflicts.add(leaf)
            use.taint |= x.taint
        feat = None
        if len(free) == 1:
            # dot_general's output axes: batch, then lhs free, then rhs free.
            x_ndim = len(eqn.invars[1 if w_is_lhs else 0].aval.shape)
            x_free = x_ndim - len(rc if w_is_lhs else lc) - len(lb)
            feat = (leaf, len(lb) + (0 if w_is_lhs else x_free))
        return _V(taint=frozenset({leaf}), data=x.data, feat=feat)

    def _lookup(self, name: str, eqn: Any, ins: list[_V]) -> _V:
        weight = ins[0].weight
        assert weight is not None
        leaf, axes = weight
        by_data = any(s.data for s in ins[1:])
        self.lookups.setdefault(leaf, set()).add(by_data)
        if name == "dynamic_slice" and not by_data:
            # A loop indexing stacked layers (w[i]) keeps the weight.
            return _V(weight=(leaf, axes))
        # Looked-up rows are whole (a vocabulary-split table is all-reduced), whatever
        # computed the indices: in a generation loop they are the argmax of the head's
        # logits, and passing the head's taint on would flip every layer after it.
        return _V(data=True)

    def _fixed_point(self, body: Any, consts: list[_V], carry: list[_V], xs: list[_V]) -> list[_V]:
        nc = len(carry)
        outs: list[_V] = []
        for _ in range(6):
            outs = self._sub(body, consts + carry + xs)
            new = [_join(a, b) for a, b in zip(carry, outs[:nc], strict=True)]
            if new == carry:
                break
            carry = new
        return [_join(a, b) for a, b in zip(carry, outs[:nc], strict=True)] + outs[nc:]

    def _scan(self, params: Mapping[str, Any], ins: list[_V]) -> list[_V]:
        nconst, ncarry = params["num_consts"], params["num_carry"]
        consts, carry, xs = ins[:nconst], ins[nconst : nconst + ncarry], ins[nconst + ncarry :]
        sliced = [_slice_leading(s) for s in xs]
        outs = self._fixed_point(params["jaxpr"], consts, carry, sliced)
        return outs[:ncarry] + [_stack_leading(s) for s in outs[ncarry:]]

    def _while(self, params: Mapping[str, Any], ins: list[_V]) -> list[_V]:
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        body_consts, carry = ins[nc : nc + nb], ins[nc + nb :]
        return self._fixed_point(params["body_jaxpr"], body_consts, carry, [])


def _slice_leading(s: _V) -> _V:
    weight = None if s.weight is None else (s.weight[0], s.weight[1][1:])
    feat = None if s.feat is None or s.feat[1] == 0 else (s.feat[0], s.feat[1] - 1)
    return _V(weight=weight, taint=s.taint, data=s.data, feat=feat)


def _stack_leading(s: _V) -> _V:
    weight = None if s.weight is None else (s.weight[0], (None, *s.weight[1]))
    feat = None if s.feat is None else (s.feat[0], s.feat[1] + 1)
    return _V(weight=weight, taint=s.taint, data=s.data, feat=feat)


# --------------------------------------------------------------------------- decisions


@dataclasses.dataclass(frozen=True)
class _Decision:
    kind: str  # COL | ROW | REP
    axis: int | None
    reason: str


def _decide(
    want: str,
    shape: tuple[int, ...],
    out_axis: int | None,
    in_axis: int | None,
    heads: int | None,
    n: int,
    why: str,
) -> _Decision:
    """Apply divisibility: the wanted split, else the other dimension, else replication."""

    def col() -> _Decision | None:
        if out_axis is None or shape[out_axis] % n:
            return None
        if heads is not None:
            if heads % n:
                return None
            return _Decision(COL, out_axis, f"{why}; split by whole heads ({heads} heads)")
        return _Decision(COL, out_axis, why)

    def row() -> _Decision | None:
        if in_axis is None or shape[in_axis] % n:
            return None
        return _Decision(ROW, in_axis, why)

    first, second = (col, row) if want == COL else (row, col)
    got = first()
    if got is not None:
        return got
    if want == COL and heads is not None and heads % n:
        return _Decision(
            REP, None, f"{heads} heads do not divide {n} shards; a head is never split"
        )
    got = second()
    if got is not None:
        dim = shape[out_axis] if want == COL and out_axis is not None else shape[in_axis or 0]
        return dataclasses.replace(
            got,
            reason=f"{want} split wanted but {dim} does not divide {n}: "
            f"fell back to {got.kind} ({why})",
        )
    return _Decision(REP, None, f"no dimension of {shape} divides {n}")


def _axis_spec(ndim: int, axis: int | None) -> P:
    if axis is None:
        return P()
    return P(*[MODEL if i == axis else None for i in range(ndim)])


def _plan_dataflow(
    example_call: Callable[[PyTree], Any],
    model: PyTree,
    info: _ModelInfo,
    paths: list[str],
    shapes: list[tuple[int, ...]],
    n: int,
) -> tuple[dict[int, _Decision], dict[int, _Decision], list[str]]:
    """Matmul and embedding decisions from the traced dataflow."""
    arrays, static = eqx.partition(model, eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(arrays)

    def call(*flat: Any) -> Any:
        return example_call(eqx.combine(jax.tree_util.tree_unflatten(treedef, list(flat)), static))

    abstract = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
    try:
        closed = jax.make_jaxpr(call)(*abstract)
    except Exception as err:
        raise ValueError(
            f"example_call raised {type(err).__name__} while being traced: {err}\n"
            "example_call must run the model on an example input, e.g. "
            "`example_call=lambda m: jax.vmap(m)(x)` or `lambda m: loss_fn(m, batch, key)`."
        ) from err

    flow = _Flow(shapes)
    flow.run(closed, len(leaves))
    notes: list[str] = []
    if flow.opaque:
        notes.append(
            f"the trace contains {sorted(flow.opaque)} whose insides were not followed; "
            "matmuls inside them were not seen"
        )
    index = {p: i for i, p in enumerate(paths)}
    heads = dict(flow.heads)
    for wpath, count in info.heads.items():
        if wpath in index and index[wpath] not in heads and info.role.get(wpath) in ("q", "k", "v"):
            heads[index[wpath]] = count

    # Lookup tables: split on the vocabulary when looked up by data, replicated when only
    # looked up by position (iota), as Megatron-LM does for position embeddings.
    emb: dict[int, _Decision] = {}
    tables = {index[p] for p in info.embeddings if p in index}
    tables |= {i for i, by in flow.lookups.items() if len(shapes[i]) >= 2 and i not in flow.uses}
    for i in sorted(tables):
        by = flow.lookups.get(i, set())
        if by and not any(by):
            emb[i] = _Decision(
                REP, None, "position table (looked up by iota, not by data), as in Megatron-LM"
            )
            continue
        if not by:
            emb[i] = _Decision(REP, None, "embedding not looked up by example_call")
            continue
        emb[i] = _decide(
            COL,
            shapes[i],
            len(shapes[i]) - 2,
            len(shapes[i]) - 1,
            None,
            n,
            "embedding: split on the vocabulary",
        )

    decided: dict[int, _Decision] = dict(emb)
    for _ in range(8):
        changed = False
        for leaf in flow.order:
            if leaf in emb:
                continue
            use = flow.uses[leaf]
            sources = sorted(t for t in use.taint if t != leaf and t in decided)
            split_src = [t for t in sources if decided[t].kind in (COL, REP) and t not in emb]
            split_src += [t for t in sources if t in emb and decided[t].kind == COL]
            if split_src:
                want = ROW
                why = f"input comes split from {paths[split_src[0]]}"
            else:
                want = COL
                why = (
                    "input is whole (after " + paths[sources[0]] + ")"
                    if sources
                    else "first matmul on its input"
                )
            out_axis = use.out_axes[0] if use.out_axes else None
            in_axis = use.in_axes[0] if use.in_axes else None
            d = _decide(want, shapes[leaf], out_axis, in_axis, heads.get(leaf), n, why)
            if decided.get(leaf) != d:
                decided[leaf] = d
                changed = True
        if not changed:
            break
    else:
        notes.append("the dataflow rules did not settle after 8 passes; the last pass is used")
    for leaf in sorted(flow.conflicts):
        notes.append(
            f"{paths[leaf]} is used in matmuls of different orientation; the first one decided"
        )
    return {k: v for k, v in decided.items() if k not in emb}, emb, notes


def _plan_declaration(
    info: _ModelInfo, paths: list[str], shapes: list[tuple[int, ...]], n: int
) -> tuple[dict[int, _Decision], dict[int, _Decision]]:
    index = {p: i for i, p in enumerate(paths)}
    decided: dict[int, _Decision] = {}
    last = ROW
    for wpath in info.linear_weight:
        if wpath not in index:
            continue
        i = index[wpath]
        nd = len(shapes[i])
        role = info.role.get(wpath)
        if role in ("q", "k", "v"):
            want, why = COL, f"attention {role.upper()}: split by heads"
        elif role == "o":
            want, why = ROW, "attention O: split on its input"
        else:
            want = ROW if last == COL else COL
            why = "alternating in declaration order"
        heads = info.heads.get(wpath) if role in ("q", "k", "v") else None
        d = _decide(want, shapes[i], nd - 2, nd - 1, heads, n, why)
        decided[i] = d
        last = ROW if d.kind == ROW else COL
    emb = {
        index[p]: _decide(
            COL,
            shapes[index[p]],
            len(shapes[index[p]]) - 2,
            len(shapes[index[p]]) - 1,
            None,
            n,
            "embedding: split on the vocabulary",
        )
        for p in info.embeddings
        if p in index
    }
    return decided, emb


def _check_n(n_model_shards: int) -> None:
    if isinstance(n_model_shards, bool) or not isinstance(n_model_shards, int | np.integer):
        raise TypeError(f"n_model_shards must be an int, got {type(n_model_shards).__name__}.")
    if n_model_shards < 1:
        raise ValueError(f"n_model_shards must be >= 1, got {n_model_shards}.")


def sharding_plan(
    model: PyTree,
    n_model_shards: int,
    *,
    example_call: Callable[[PyTree], Any] | None = None,
    overrides: Mapping[str, P] | None = None,
) -> ShardingPlan:
    """Find a tensor-parallel `PartitionSpec` for every array of `model`, with reasons.

    Args:
        model: an Equinox module (any pytree whose arrays are the parameters).
        n_model_shards: the size of the mesh's `"model"` axis.
        example_call: `model -> outputs`, run once under `jax.make_jaxpr` on abstract
            shapes (no FLOPs) to follow the dataflow, e.g. `lambda m: jax.vmap(m)(x)`.
            Without it, Linear layers alternate in declaration order.
        overrides: maps glob patterns over dotted paths (`"blocks.*.mlp.*.weight"`) to
            the `PartitionSpec` to use; wins over the rules.

    Returns:
        A `ShardingPlan`; `.specs` is what `shard` takes and `str(plan)` a report.

    Example:
        >>> plan = sharding_plan(model, 2, example_call=lambda m: jax.vmap(m)(x))
        >>> print(plan)   # path, shape, spec and why for every array
        >>> model = shard(model, make_mesh(2), plan.specs)
    """
    _check_n(n_model_shards)
    n = int(n_model_shards)
    leaves = _array_leaves(model)
    if not leaves:
        raise ValueError(
            "the model has no arrays to shard (eqx.filter(model, eqx.is_array) is empty); "
            "pass the Equinox module that holds the parameters."
        )
    paths = [p for p, _ in leaves]
    shapes = [tuple(int(d) for d in leaf.shape) for _, leaf in leaves]
    info = _model_info(model)
    notes: list[str] = []
    if example_call is not None:
        matmuls, emb, flow_notes = _plan_dataflow(example_call, model, info, paths, shapes, n)
        notes.extend(flow_notes)
        method = "rules traced from example_call (dataflow)"
        unseen = [p for p in info.linear_weight if p in paths and paths.index(p) not in matmuls]
        if unseen:
            notes.append(f"{len(unseen)} Linear weight(s) not reached by example_call: replicated")
    else:
        matmuls, emb = _plan_declaration(info, paths, shapes, n)
        method = (
            "no example_call: Linear layers alternate in declaration order "
            "(pass example_call to follow the dataflow)"
        )
        notes.append(method)

    bias_of = {b: w for w, b in info.linear_weight.items() if b}
    index = {p: i for i, p in enumerate(paths)}
    plans: list[LeafPlan] = []
    specs: list[P] = []
    matched: set[str] = set()
    for i, (path, leaf) in enumerate(leaves):
        shape = shapes[i]
        ndim = len(shape)
        d = matmuls.get(i) or emb.get(i)
        if d is not None:
            spec, reason = _axis_spec(ndim, d.axis), f"{d.kind}: {d.reason}"
        elif path in bias_of and index.get(bias_of[path]) in matmuls:
            wd = matmuls[index[bias_of[path]]]
            if wd.kind == COL:
                spec, reason = (
                    _axis_spec(ndim, ndim - 1),
                    "bias of a column-split Linear: split with it",
                )
            else:
                spec, reason = P(), f"bias of a {wd.kind} Linear: replicated"
        elif path in info.linear_weight:
            spec, reason = P(), "Linear weight not reached by example_call: replicated"
        elif ndim <= 1:
            spec, reason = P(), "scalar or vector (norm scale, bias): replicated"
        else:
            spec, reason = P(), "not a matmul weight or lookup table: replicated"
        if n == 1:
            spec, reason = P(), "one model shard: replicated"
        for pattern, override in (overrides or {}).items():
            if fnmatch.fnmatchcase(path, pattern):
                _check_spec(path, shape, override, {MODEL: n})
                spec, reason = override, f"override {pattern!r}"
                matched.add(pattern)
        specs.append(spec)
        plans.append(LeafPlan(path, shape, str(leaf.dtype), spec, reason))
    unmatched = [p for p in (overrides or {}) if p not in matched]
    if unmatched:
        raise ValueError(
            f"override pattern(s) {unmatched} match no array of the model; patterns are globs "
            f"over dotted paths such as {paths[0]!r}."
        )
    spec_tree = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(eqx.filter(model, eqx.is_array)), specs
    )
    return ShardingPlan(spec_tree, tuple(plans), n, method, tuple(notes))


def sharding_rules(
    model: PyTree,
    n_model_shards: int,
    *,
    example_call: Callable[[PyTree], Any] | None = None,
    overrides: Mapping[str, P] | None = None,
) -> PyTree:
    """The `PartitionSpec` tree that `sharding_plan` finds (see there for the arguments).

    Returns:
        A pytree shaped like `eqx.filter(model, eqx.is_array)` with a `PartitionSpec`
        on every array leaf, ready for `shard(model, mesh, specs)`.

    Example:
        >>> specs = sharding_rules(model, 2, example_call=lambda m: jax.vmap(m)(x))
        >>> model = shard(model, make_mesh(2), specs)
    """
    return sharding_plan(
        model, n_model_shards, example_call=example_call, overrides=overrides
    ).specs


# --------------------------------------------------------------------------- placement


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _check_spec(path: str, shape: tuple[int, ...], spec: Any, sizes: Mapping[str, int]) -> None:
    if not isinstance(spec, P):
        raise TypeError(f"{path}: expected a PartitionSpec, got {type(spec).__name__} ({spec!r}).")
    if len(spec) > len(shape):
        raise ValueError(
            f"{path}: spec {_spec_str(spec)} has more entries than the array's shape {shape}."
        )
    for dim, entry in zip(shape, spec, strict=False):
        if entry is None:
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        ways = 1
        for name in names:
            if name not in sizes:
                raise ValueError(
                    f"{path}: spec {_spec_str(spec)} names axis {name!r}; "
                    f"the mesh has {sorted(sizes)}."
                )
            ways *= sizes[name]
        if dim % ways:
            raise ValueError(
                f"{path}: dimension {dim} of shape {shape} does not divide into {ways} shards "
                f"(spec {_spec_str(spec)}); choose another dimension or replicate it with P()."
            )


def _spec_leaves(model: PyTree, specs: PyTree) -> list[tuple[str, Any, P]]:
    if isinstance(specs, ShardingPlan):
        specs = specs.specs
    arrays = eqx.filter(model, eqx.is_array)
    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(arrays)
    flat_s, tree_s = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)
    if tree_a != tree_s:
        have = {path_str(p) for p, _ in flat_a}
        got = {path_str(p) for p, _ in flat_s}
        missing, extra = sorted(have - got), sorted(got - have)
        raise ValueError(
            "the spec tree does not match the model's arrays: "
            f"missing specs for {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"specs for non-arrays {extra[:5]}{'...' if len(extra) > 5 else ''}. "
            "Build specs with redcoast.sharding_rules(model, ...) for this very model."
        )
    return [(path_str(p), a, s) for (p, a), (_, s) in zip(flat_a, flat_s, strict=True)]


def shard(tree: PyTree, mesh: Mesh, specs: PyTree) -> PyTree:
    """Place every array of `tree` on `mesh` with its `PartitionSpec`.

    Args:
        tree: a model (or any pytree) whose arrays are placed; other leaves are kept.
        mesh: from `make_mesh`.
        specs: from `sharding_rules` (or a `ShardingPlan`), shaped like
            `eqx.filter(tree, eqx.is_array)`.

    Returns:
        The same tree with every array a `jax.Array` with `NamedSharding(mesh, spec)`.

    Example:
        >>> model = shard(model, mesh, sharding_rules(model, mesh.shape["model"]))
    """
    entries = _spec_leaves(tree, specs)
    sizes = {name: int(size) for name, size in mesh.shape.items()}
    for path, leaf, spec in entries:
        _check_spec(path, tuple(leaf.shape), spec, sizes)
    shardings = [NamedSharding(mesh, spec) for _, _, spec in entries]
    arrays, static = eqx.partition(tree, eqx.is_array)
    flat, treedef = jax.tree_util.tree_flatten(arrays)
    if jax.process_count() == 1:
        placed = jax.device_put(flat, shardings)
    else:
        placed = [_place_global(x, s) for x, s in zip(flat, shardings, strict=True)]
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, placed), static)


def _place_global(x: Any, sharding: NamedSharding) -> jax.Array:
    """Place an array that every process holds in full onto a multi-process mesh."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def sharding_report(model: PyTree, specs: PyTree, *, n_model_shards: int | None = None) -> str:
    """A table of every array's path, shape and spec, with bytes per device.

    Args:
        model: the model the specs belong to.
        specs: a `ShardingPlan` (whose reasons are shown) or a spec tree.
        n_model_shards: the size of the model axis, for bytes per device; read from
            the model's shardings when omitted.

    Returns:
        The report as text.
    """
    if isinstance(specs, ShardingPlan):
        return str(specs)
    entries = _spec_leaves(model, specs)
    if n_model_shards is None:
        n_model_shards = 1
        for _, leaf, _ in entries:
            sharding = getattr(leaf, "sharding", None)
            if isinstance(sharding, NamedSharding) and MODEL in sharding.mesh.shape:
                n_model_shards = int(sharding.mesh.shape[MODEL])
                break
    _check_n(n_model_shards)
    plans = tuple(
        LeafPlan(path, tuple(int(d) for d in leaf.shape), str(leaf.dtype), spec, "given")
        for path, leaf, spec in entries
    )
    return str(ShardingPlan(specs, plans, int(n_model_shards), "given specs"))
