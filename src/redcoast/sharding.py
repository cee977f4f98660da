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
moves, a collective's latency counted; vectors added to a matmul's output split with it. Every
fallback, default or guess is listed as a note at the end of the plan.
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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from ._dataflow import NO_USE, Dataflow, Use, trace_dataflow
from ._tree_paths import array_leaves, path_str
from .fsdp import record_layout
from .mesh import DATA, MODEL

__all__ = [
    "LeafPlan",
    "ShardingPlan",
    "abstract_arrays",
    "optimizer_specs",
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
    `shard` takes. `str(plan)` is a readable report. `fsdp` is the number of data
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
            (leaf.path, str(leaf.shape), _spec_str(leaf.spec), leaf.reason) for leaf in self.leaves
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
            f"bytes per device: {_fmt_bytes(self.bytes_per_device)} of {_fmt_bytes(total)} "
            f"(ideal {_fmt_bytes(total / (self.n_model_shards * self.fsdp))}); "
            f"replicated: {_fmt_bytes(rep)} "
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


def abstract_arrays(tree: PyTree) -> PyTree:
    """`tree` with each `jax.ShapeDtypeStruct` leaf a zero-stride NumPy array of its shape.

    What `eqx.filter_eval_shape` returns becomes a model whose leaves are arrays to
    `eqx.is_array` (and to the sharding rules, which read only shapes and dtypes),
    at no memory cost: every element is the same zero in memory.

    Args:
        tree: a pytree, e.g. `eqx.filter_eval_shape(make_model, key)`.

    Returns:
        The same structure, abstract leaves replaced.
    """
    return jax.tree_util.tree_map(
        lambda s: (
            np.broadcast_to(np.zeros((), s.dtype), s.shape)
            if isinstance(s, jax.ShapeDtypeStruct)
            else s
        ),
        tree,
    )


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


def _linear_path(module: Any) -> str | None:
    """Where a projection's Linear sits in it: `""` for a Linear itself, `".base"` for a
    module wrapping one (a LoRA layer), None when it is neither."""
    if isinstance(module, eqx.nn.Linear):
        return ""
    if isinstance(getattr(module, "base", None), eqx.nn.Linear):
        return ".base"
    return None


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
        if all(_linear_path(p) is not None for p, _ in projections.values()):
            n_heads, _ = _first_attr(module, _HEAD_FIELDS)
            n_kv, _ = _first_attr(module, _KV_HEAD_FIELDS)
            for r, (p, name) in projections.items():
                wpath = f"{dot}{name}{_linear_path(p)}.weight"
                role[wpath] = r
                count = n_kv if (r in "kv" and isinstance(n_kv, int)) else n_heads
                if isinstance(count, int) and count > 0:
                    heads[wpath] = count
    return _ModelInfo(linear_weight, embeddings, role, heads)


# --------------------------------------------------------------------------- decisions


@dataclasses.dataclass(frozen=True)
class _Decision:
    """One weight's split. `guess` marks a fallback, default or guess the plan lists."""

    kind: str  # COL | ROW | REP
    axis: int | None
    reason: str
    guess: bool = False


# What a collective's fixed latency is worth in bytes moved: about 10 us at the
# ~100 GB/s of NVLink or TPU ICI. A split that adds collectives must save more.
COLLECTIVE_LATENCY_BYTES = 1 << 20


def _decide(
    want: str,
    shape: tuple[int, ...],
    out_axis: int | None,
    in_axis: int | None,
    heads: int | None,
    n: int,
    why: str,
    comm_bytes: float | None = None,
    itemsize: int = 4,
) -> _Decision:
    """Apply divisibility: the wanted split, else the cheaper of the other dimension and
    replication.

    `comm_bytes` estimates what splitting on the other dimension adds per step (the
    matmul's input and output moved once each); replication adds nothing but keeps
    `(1 - 1/n)` of the weight's bytes on every device. A split on the other dimension
    also adds two collectives a step (forward and backward), and a collective costs a
    fixed latency however small it is (`COLLECTIVE_LATENCY_BYTES` each), so the other
    dimension is used only when it saves more bytes than it moves, latency counted:
    small weights (a classifier's head) stay replicated, as Megatron-LM keeps them.
    """

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
            REP, None, f"{heads} heads do not divide {n} shards; a head is never split", True
        )
    got = second()
    dim = shape[out_axis] if want == COL and out_axis is not None else shape[in_axis or 0]
    if got is None:
        return _Decision(REP, None, f"no dimension of {shape} divides {n}", True)
    saved = math.prod(shape) * itemsize * (1 - 1 / n)
    cost = None if comm_bytes is None else comm_bytes + 2 * COLLECTIVE_LATENCY_BYTES
    if cost is not None and cost > saved:
        return _Decision(
            REP,
            None,
            f"{want} split wanted but {dim} does not divide {n}; a {got.kind} split would add "
            f"2 collectives a step (~{_fmt_bytes(cost)} with their latency) to save "
            f"{_fmt_bytes(saved)} per device: replicated ({why})",
            True,
        )
    return dataclasses.replace(
        got,
        reason=f"{want} split wanted but {dim} does not divide {n}: "
        f"fell back to {got.kind} ({why})",
        guess=True,
    )


def _axis_spec(ndim: int, axis: int | None) -> P:
    if axis is None:
        return P()
    return P(*[MODEL if i == axis else None for i in range(ndim)])


def _from_spec(spec: P, use: Use | None, pattern: str) -> _Decision:
    """The decision an override amounts to, so that the dataflow rules build on it."""
    axes = [i for i, e in enumerate(spec) if e is not None]
    if not axes:
        return _Decision(REP, None, f"override {pattern!r}")
    kind = ROW if use is not None and axes[0] in use.in_axes else COL
    return _Decision(kind, axes[0], f"override {pattern!r}")


def _expert_axis(use: Use) -> int | None:
    """The axis of a weight that stacks experts (or heads): a batch axis of its matmul,
    else the leading one of two output or two contracted axes (`(E, d, f)`)."""
    if use.batch_axes:
        return use.batch_axes[0]
    if len(use.out_axes) >= 2:
        return min(use.out_axes)
    if len(use.in_axes) >= 2:
        return min(use.in_axes)
    return None


def _embedding_decisions(
    flow: Dataflow, info: _ModelInfo, paths: list[str], shapes: list[tuple[int, ...]], n: int
) -> dict[int, _Decision]:
    """Lookup tables: split on the vocabulary when looked up by data, replicated when only
    looked up by position (iota), as Megatron-LM does for position embeddings."""
    index = {p: i for i, p in enumerate(paths)}
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
            emb[i] = _Decision(REP, None, "embedding not looked up by example_call", True)
            continue
        nd = len(shapes[i])
        use = flow.uses.get(i)
        # Split on the hidden dimension instead, the looked-up rows are gathered, and a
        # tied table (also the head) all-reduces full-vocabulary logits.
        comm = 4.0 * flow.looked_up.get(i, 0)
        if use is not None:
            comm += 4.0 * (use.out_elems + use.in_elems)
        d = _decide(
            COL, shapes[i], nd - 2, nd - 1, None, n, "embedding: split on the vocabulary", comm
        )
        if d.guess and d.kind != COL:
            d = dataclasses.replace(
                d,
                reason=d.reason + f"; pad the vocabulary to a multiple of {128 * n} to split it",
            )
        emb[i] = d
    return emb


def _matmul_decision(
    leaf: int,
    flow: Dataflow,
    decided: dict[int, _Decision],
    info: _ModelInfo,
    paths: list[str],
    shapes: list[tuple[int, ...]],
    heads: dict[int, int],
    n: int,
) -> _Decision:
    use = flow.uses[leaf]
    if leaf in flow.gates:
        return _Decision(
            REP,
            None,
            "gate: its output only scales, shifts or selects; replicated, which moves nothing",
            True,
        )
    if use.stem and len(shapes[leaf]) > 2:
        return _Decision(
            REP,
            None,
            "stem convolution on the raw input: replicated, as Megatron-LM's ViT does; "
            "splitting it would split the residual stream",
            True,
        )
    sources = sorted(t for t in use.taint if t != leaf and t in decided)
    # Only a column-split source makes the input split; a replicated one never does.
    split_src = [t for t in sources if decided[t].kind == COL]
    if split_src:
        want, why = ROW, f"input comes split from {paths[split_src[0]]}"
    elif info.role.get(paths[leaf]) == "o":
        want, why = ROW, "attention O: split on its input"
    else:
        want = COL
        why = (
            "input is whole (after " + paths[sources[0]] + ")"
            if sources
            else "first matmul on its input"
        )
    expert = _expert_axis(use)
    outs = [a for a in use.out_axes if a != expert]
    ins = [a for a in use.in_axes if a != expert]
    comm = 4.0 * (use.out_elems + use.in_elems)
    return _decide(
        want,
        shapes[leaf],
        outs[-1] if outs else None,
        ins[-1] if ins else None,
        heads.get(leaf),
        n,
        why,
        comm,
    )


def _sizes(leaf: int, use: Use, shapes: list[tuple[int, ...]]) -> tuple[int, int] | None:
    """A matmul weight's (input, output) feature sizes, None when not a plain matmul."""
    if not use.in_axes or not use.out_axes:
        return None
    return shapes[leaf][use.in_axes[-1]], shapes[leaf][use.out_axes[-1]]


def _shared_prefix(a: str, b: str) -> int:
    """How many leading path components `a` and `b` share."""
    return next(
        (i for i, (x, y) in enumerate(zip(a.split("."), b.split("."), strict=False)) if x != y),
        min(a.count("."), b.count(".")) + 1,
    )


def _low_rank_branches(
    flow: Dataflow, paths: list[str], shapes: list[tuple[int, ...]]
) -> dict[int, tuple[str, int, int]]:
    """Low-rank branches beside a full matmul: leaf -> (`"down"` | `"up"`, partner, full).

    A branch is `down` (in -> r) then `up` (r -> out), `up` reading only `down`'s
    output, with `r` below both sizes, beside a `full` matmul (in -> out) that reads
    the same input: a LoRA adapter and its base weight, whoever wrote them. Of several
    such matmuls (Q, K and V read one input), the nearest in the module tree is taken.
    """
    found: dict[int, tuple[str, int, int]] = {}
    for up in flow.order:
        use = flow.uses[up]
        if len(use.taint) != 1:
            continue
        (down,) = use.taint
        if down not in flow.uses:
            continue
        up_sizes, down_sizes = _sizes(up, use, shapes), _sizes(down, flow.uses[down], shapes)
        if up_sizes is None or down_sizes is None:
            continue
        (n_in, rank), (rank_in, n_out) = down_sizes, up_sizes
        if rank != rank_in or rank >= min(n_in, n_out):
            continue
        taint = flow.uses[down].taint
        beside = [
            f
            for f in flow.order
            if f not in (down, up)
            and flow.uses[f].taint == taint
            and _sizes(f, flow.uses[f], shapes) == (n_in, n_out)
        ]
        if beside:
            full = max(beside, key=lambda f: _shared_prefix(paths[f], paths[down]))
            found[down] = ("down", up, full)
            found[up] = ("up", down, full)
    return found


def _low_rank_decision(
    leaf: int,
    branch: tuple[str, int, int],
    flow: Dataflow,
    decided: Mapping[int, _Decision],
    paths: list[str],
    shapes: list[tuple[int, ...]],
    n: int,
) -> _Decision:
    """A low-rank factor splits as the full matmul beside it, never on its rank.

    Beside a row-split matmul (input split), `down` is split on its input and `up`,
    reading `down`'s partial sums, is replicated: the branch's output joins the full
    matmul's before their one all-reduce. Beside a column-split matmul (input whole),
    `down` is replicated and `up` split on its output, as the full matmul's output is.
    """
    role, _, full = branch
    use = flow.uses[leaf]
    kind = decided[full].kind if full in decided else REP
    rank = shapes[leaf][use.out_axes[-1] if role == "down" else use.in_axes[-1]]
    why = f"low-rank factor (rank {rank}) beside {paths[full]}, {kind}"
    if role == "down" and kind == ROW and shapes[leaf][use.in_axes[-1]] % n == 0:
        return _Decision(ROW, use.in_axes[-1], f"{why}: split on its input, never its rank")
    if role == "up" and kind == COL and shapes[leaf][use.out_axes[-1]] % n == 0:
        return _Decision(COL, use.out_axes[-1], f"{why}: split on its output, never its rank")
    return _Decision(REP, None, f"{why}: replicated, its rank never split")


def _expert_groups(
    flow: Dataflow,
    decided: dict[int, _Decision],
    fixed: Mapping[int, _Decision],
    paths: list[str],
    shapes: list[tuple[int, ...]],
    n: int,
) -> None:
    """One expert axis per mixture: expert-parallel or Megatron within experts, by cost.

    A mixture is a stacked-expert matmul reading other stacked-expert matmuls' outputs
    (`w_out` after `w_in`, or `down` after `gate` and `up`). Splitting the experts keeps
    the expert axis whole through `w_out` when it is a batch axis there, so only the
    combined output is reduced; Megatron within experts reduces `w_out`'s whole output.
    """
    for out_leaf in flow.order:
        use = flow.uses[out_leaf]
        e_out = _expert_axis(use)
        if e_out is None or out_leaf in fixed:
            continue
        ins = [t for t in sorted(use.taint) if _expert_axis(flow.uses.get(t, NO_USE)) is not None]
        ins = [t for t in ins if t in decided and t not in fixed]
        if not ins:
            continue
        group = [*ins, out_leaf]
        experts = shapes[out_leaf][e_out]
        ep_ok = all(shapes[g][_expert_axis(flow.uses[g]) or 0] % n == 0 for g in group)
        meg_ok = all(decided[g].kind != REP for g in group)
        meg_cost = use.out_elems
        ep_cost = use.out_elems / experts if e_out in use.batch_axes else use.out_elems
        if ep_ok and (not meg_ok or ep_cost <= meg_cost):
            why = (
                f"expert-parallel: {experts} experts split whole (est. {ep_cost:.0f} vs "
                f"{meg_cost:.0f} elements reduced by Megatron within experts)"
            )
            for g in group:
                kind = ROW if g == out_leaf else COL
                decided[g] = _Decision(kind, _expert_axis(flow.uses[g]), why)
        elif meg_ok:
            for g in group:
                d = decided[g]
                decided[g] = dataclasses.replace(
                    d, reason=d.reason + f"; Megatron within experts, as {paths[out_leaf]}"
                )


def _plan_dataflow(
    example_call: Callable[[PyTree], Any],
    model: PyTree,
    info: _ModelInfo,
    paths: list[str],
    shapes: list[tuple[int, ...]],
    n: int,
    overrides: Mapping[int, tuple[str, P]],
) -> tuple[dict[int, _Decision], dict[int, _Decision], dict[int, _Decision], list[str], Dataflow]:
    """Matmul, embedding and tied-vector decisions from the traced dataflow (and the flow).

    Overrides are decisions fixed before the rules run, so that what reads an
    overridden weight's output follows from the override.
    """
    flow = trace_dataflow(example_call, model)
    notes: list[str] = []
    for prim, why in sorted(flow.opaque.items()):
        read = sorted(paths[leaf] for leaf, p in flow.touched.items() if p == prim)
        notes.append(
            f"the dataflow interpreter could not follow `{prim}` ({why}): matmuls inside it "
            f"were not seen and the {len(read)} weight(s) it reads are replicated"
            + (f" ({', '.join(read[:4])}{', ...' if len(read) > 4 else ''})" if read else "")
            + "; to split them, give their specs in overrides= (or use a redcoast that "
            "knows this JAX release)"
        )
    index = {p: i for i, p in enumerate(paths)}
    heads = dict(flow.heads)
    for wpath, count in info.heads.items():
        if wpath in index and index[wpath] not in heads and info.role.get(wpath) in ("q", "k", "v"):
            heads[index[wpath]] = count

    fixed = {i: _from_spec(spec, flow.uses.get(i), pat) for i, (pat, spec) in overrides.items()}
    # What an equation the interpreter cannot follow reads is replicated before the rules
    # run, like an override (and an override still wins).
    why = "read by `{}`, which the dataflow interpreter cannot follow"
    forced = {
        leaf: _Decision(REP, None, why.format(prim))
        for leaf, prim in flow.touched.items()
        if leaf not in fixed
    }
    emb = {
        i: d
        for i, d in _embedding_decisions(flow, info, paths, shapes, n).items()
        if i not in fixed and i not in forced
    }
    decided: dict[int, _Decision] = {**emb, **fixed, **forced}
    branches = _low_rank_branches(flow, paths, shapes)
    for _ in range(8):
        changed = False
        for leaf in flow.order:
            if leaf in emb or leaf in fixed or leaf in forced:
                continue
            if leaf in branches:
                d = _low_rank_decision(leaf, branches[leaf], flow, decided, paths, shapes, n)
            else:
                d = _matmul_decision(leaf, flow, decided, info, paths, shapes, heads, n)
            if decided.get(leaf) != d:
                decided[leaf] = d
                changed = True
        if not changed:
            break
    else:
        notes.append("the dataflow rules did not settle after 8 passes; the last pass is used")
    _expert_groups(flow, decided, fixed | forced, paths, shapes, n)
    for leaf in sorted(flow.conflicts):
        notes.append(
            f"{paths[leaf]} is used in matmuls of different orientation; the first one decided"
        )
    tied: dict[int, _Decision] = {}
    for vec, (mleaf, pairs) in flow.ties.items():
        d = decided.get(mleaf)
        if vec in decided or d is None or d.kind == REP or d.axis is None:
            continue
        for vaxis, maxis in pairs.items():
            if maxis == d.axis and shapes[vec][vaxis] % n == 0:
                why = f"added to {paths[mleaf]}'s output: split with its {d.kind} dimension"
                tied[vec] = _Decision(COL, vaxis, why)
    matmuls = {k: v for k, v in decided.items() if k not in emb and k not in fixed}
    return matmuls, emb, tied, notes, flow


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


def _check_n(n: int, name: str = "n_model_shards") -> None:
    if isinstance(n, bool) or not isinstance(n, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(n).__name__}.")
    if n < 1:
        raise ValueError(f"{name} must be >= 1, got {n}.")


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
        A `ShardingPlan`; `.specs` is what `shard` takes and `str(plan)` a report.

    Example:
        >>> plan = sharding_plan(model, 2, example_call=lambda m: jax.vmap(m)(x))
        >>> print(plan)   # path, shape, spec and why for every array
        >>> model = shard(model, make_mesh(2), plan.specs)
    """
    _check_n(n_model_shards)
    _check_n(fsdp, "fsdp")
    n = int(n_model_shards)
    model = abstract_arrays(model)
    leaves = array_leaves(model)
    if not leaves:
        raise ValueError(
            "the model has no arrays to shard (eqx.filter(model, eqx.is_array) is empty); "
            "pass the Equinox module that holds the parameters."
        )
    paths = [p for p, _ in leaves]
    shapes = [tuple(int(d) for d in leaf.shape) for _, leaf in leaves]
    info = _model_info(model)
    fixed = _match_overrides(overrides or {}, paths, shapes, n)
    notes: list[str] = []
    tied: dict[int, _Decision] = {}
    stacked: dict[int, set[int]] = {}
    if example_call is not None:
        matmuls, emb, tied, flow_notes, flow = _plan_dataflow(
            example_call, model, info, paths, shapes, n, fixed
        )
        stacked = flow.stacked
        notes.extend(flow_notes)
        method = "rules traced from example_call (dataflow)"
        unseen = [p for p in info.linear_weight if p in paths and paths.index(p) not in matmuls]
        unseen = [p for p in unseen if paths.index(p) not in fixed]
        if unseen:
            notes.append(f"{len(unseen)} Linear weight(s) not reached by example_call: replicated")
    else:
        matmuls, emb = _plan_declaration(info, paths, shapes, n)
        method = (
            "no example_call: Linear layers alternate in declaration order "
            "(pass example_call to follow the dataflow)"
        )
        notes.append(method)

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
                _check_spec(path, shapes[i], override, {MODEL: n})
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
    info: _ModelInfo,
    paths: list[str],
    matmuls: Mapping[int, _Decision],
    emb: Mapping[int, _Decision],
    tied: Mapping[int, _Decision],
) -> tuple[P, str, bool]:
    """One leaf's spec, the reason, and whether it was a fallback or a guess."""
    ndim = len(shape)
    d = matmuls.get(i) or emb.get(i)
    if d is not None:
        return _axis_spec(ndim, d.axis), f"{d.kind}: {d.reason}", d.guess
    if i in tied:
        return _axis_spec(ndim, tied[i].axis), tied[i].reason, False
    bias_of = {b: w for w, b in info.linear_weight.items() if b}
    weight = paths.index(bias_of[path]) if path in bias_of and bias_of[path] in paths else None
    if weight is not None and weight in matmuls:
        wd = matmuls[weight]
        if wd.kind == COL:
            return _axis_spec(ndim, ndim - 1), "bias of a column-split Linear: split with it", False
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
    """The `PartitionSpec` tree that `sharding_plan` finds (see there for the arguments).

    Returns:
        A pytree shaped like `eqx.filter(model, eqx.is_array)` with a `PartitionSpec`
        on every array leaf, ready for `shard(model, mesh, specs)`.

    Example:
        >>> specs = sharding_rules(model, 2, example_call=lambda m: jax.vmap(m)(x))
        >>> model = shard(model, make_mesh(2), specs)
    """
    return sharding_plan(
        model, n_model_shards, example_call=example_call, overrides=overrides, fsdp=fsdp
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


def sharding_tree(tree: PyTree, mesh: Mesh, specs: PyTree) -> PyTree:
    """`NamedSharding(mesh, spec)` for every array (or abstract array) of `tree`.

    Args:
        tree: a model, or its `eqx.filter_eval_shape`.
        mesh: from `make_mesh`.
        specs: a `PartitionSpec` tree (or `ShardingPlan`) shaped like its arrays.

    Returns:
        A tree shaped like `eqx.filter(tree, eqx.is_array)` with a sharding per array;
        it raises, naming the array, when a spec does not fit its shape or the mesh.
    """
    if isinstance(specs, ShardingPlan):
        specs = specs.specs
    tree = abstract_arrays(tree)
    sizes = {name: int(size) for name, size in mesh.shape.items()}
    for path, leaf, spec in _spec_leaves(tree, specs):
        _check_spec(path, tuple(leaf.shape), spec, sizes)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def optimizer_specs(
    opt_leaves: list[tuple[str, Any]],
    model_leaves: list[tuple[str, Any]],
    model_specs: Mapping[str, P],
) -> dict[str, P]:
    """Specs for an optimizer state's leaves: moments mirror the parameters.

    A leaf whose path ends with a parameter's path and has its shape takes that
    parameter's spec; the rest (step counters, factored statistics) are replicated.

    Args:
        opt_leaves: `(path, leaf)` of the optimizer state (`path_str` paths).
        model_leaves: `(path, leaf)` of the parameters.
        model_specs: parameter path -> its `PartitionSpec`.

    Returns:
        Optimizer leaf path -> `PartitionSpec`.
    """
    shapes = {k: tuple(v.shape) for k, v in model_leaves}
    out = {}
    for key, leaf in opt_leaves:
        match = [
            m
            for m in model_specs
            if (key == m or key.endswith("." + m)) and shapes.get(m) == tuple(leaf.shape)
        ]
        out[key] = model_specs[max(match, key=len)] if match else P()
    return out


def shard(tree: PyTree, mesh: Mesh, specs: PyTree) -> PyTree:
    """Place every array of `tree` on `mesh` with its `PartitionSpec`.

    Args:
        tree: a model (or any pytree) whose arrays are placed; other leaves are kept.
        mesh: from `make_mesh`.
        specs: from `sharding_rules` (or a `ShardingPlan`), shaped like
            `eqx.filter(tree, eqx.is_array)`.

    Returns:
        The same tree with every array a `jax.Array` with `NamedSharding(mesh, spec)`;
        a zoo model in it records which weights are split over the data axis, so that
        its forward pass gathers them (`redcoast.fsdp`).

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
    return record_layout(eqx.combine(jax.tree_util.tree_unflatten(treedef, placed), static))


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
