"""The tensor-parallel split of each weight: the two rules, decided weight by weight.

From the traced dataflow (`_dataflow.py`): matmuls alternate column and row splits
along it, attention's Q, K and V split by whole heads and O on its input, lookup
tables on the vocabulary, low-rank branches as the matmul beside them, stacked
experts by one expert axis per mixture, and vectors added to a matmul's output
with it. Without a trace, Linear layers alternate in declaration order. Every
split passes the divisibility check of `_decide`, which falls back to the other
dimension or to replication and says why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .._units import fmt_bytes
from ._dataflow import trace_dataflow
from ._dataflow_state import NO_USE, Dataflow, Use
from ._model_structure import ModelInfo
from .mesh import MODEL

__all__ = [
    "COL",
    "COLLECTIVE_LATENCY_BYTES",
    "REP",
    "ROW",
    "Decision",
    "axis_spec",
    "plan_dataflow",
    "plan_declaration",
]

COL, ROW, REP = "column", "row", "replicated"


@dataclasses.dataclass(frozen=True)
class Decision:
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
) -> Decision:
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

    def col() -> Decision | None:
        if out_axis is None or shape[out_axis] % n:
            return None
        if heads is not None:
            if heads % n:
                return None
            return Decision(COL, out_axis, f"{why}; split by whole heads ({heads} heads)")
        return Decision(COL, out_axis, why)

    def row() -> Decision | None:
        if in_axis is None or shape[in_axis] % n:
            return None
        return Decision(ROW, in_axis, why)

    first, second = (col, row) if want == COL else (row, col)
    got = first()
    if got is not None:
        return got
    if want == COL and heads is not None and heads % n:
        return Decision(
            REP, None, f"{heads} heads do not divide {n} shards; a head is never split", True
        )
    got = second()
    dim = shape[out_axis] if want == COL and out_axis is not None else shape[in_axis or 0]
    if got is None:
        return Decision(REP, None, f"no dimension of {shape} divides {n}", True)
    saved = math.prod(shape) * itemsize * (1 - 1 / n)
    cost = None if comm_bytes is None else comm_bytes + 2 * COLLECTIVE_LATENCY_BYTES
    if cost is not None and cost > saved:
        return Decision(
            REP,
            None,
            f"{want} split wanted but {dim} does not divide {n}; a {got.kind} split would add "
            f"2 collectives a step (~{fmt_bytes(cost)} with their latency) to save "
            f"{fmt_bytes(saved)} per device: replicated ({why})",
            True,
        )
    return dataclasses.replace(
        got,
        reason=f"{want} split wanted but {dim} does not divide {n}: "
        f"fell back to {got.kind} ({why})",
        guess=True,
    )


def axis_spec(ndim: int, axis: int | None) -> P:
    if axis is None:
        return P()
    return P(*[MODEL if i == axis else None for i in range(ndim)])


def _from_spec(spec: P, use: Use | None, pattern: str) -> Decision:
    """The decision an override amounts to, so that the dataflow rules build on it."""
    axes = [i for i, e in enumerate(spec) if e is not None]
    if not axes:
        return Decision(REP, None, f"override {pattern!r}")
    kind = ROW if use is not None and axes[0] in use.in_axes else COL
    return Decision(kind, axes[0], f"override {pattern!r}")


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
    flow: Dataflow, info: ModelInfo, paths: list[str], shapes: list[tuple[int, ...]], n: int
) -> dict[int, Decision]:
    """Lookup tables: split on the vocabulary when looked up by data, replicated when only
    looked up by position (iota), as Megatron-LM does for position embeddings."""
    index = {p: i for i, p in enumerate(paths)}
    emb: dict[int, Decision] = {}
    tables = {index[p] for p in info.embeddings if p in index}
    tables |= {i for i, by in flow.lookups.items() if len(shapes[i]) >= 2 and i not in flow.uses}
    for i in sorted(tables):
        by = flow.lookups.get(i, set())
        if by and not any(by):
            emb[i] = Decision(
                REP, None, "position table (looked up by iota, not by data), as in Megatron-LM"
            )
            continue
        if not by:
            emb[i] = Decision(REP, None, "embedding not looked up by example_call", True)
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
    decided: dict[int, Decision],
    info: ModelInfo,
    paths: list[str],
    shapes: list[tuple[int, ...]],
    heads: dict[int, int],
    n: int,
) -> Decision:
    use = flow.uses[leaf]
    if leaf in flow.gates:
        return Decision(
            REP,
            None,
            "gate: its output only scales, shifts or selects; replicated, which moves nothing",
            True,
        )
    if use.stem and len(shapes[leaf]) > 2:
        return Decision(
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
    elif (fed := _feeds_heads(leaf, flow, info, paths)) is not None:
        return Decision(
            REP,
            None,
            f"its output feeds {fed}, which splits by heads and reads it whole (a "
            "projection into attention, such as an encoder-decoder's enc_to_dec_proj or "
            "MLA's low-rank q_a_proj and kv_a_proj_with_mqa): replicated, as Megatron-LM "
            "keeps the residual stream whole",
        )
    else:
        want = COL
        why = (
            "input is whole (after " + paths[sources[0]] + ")"
            if sources
            else "first matmul on its input"
        )
        if info.role.get(paths[leaf]) is None and _makes_heads(leaf, flow, info, paths):
            why += "; its output is reshaped into the heads attention reads"
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


def _makes_heads(leaf: int, flow: Dataflow, info: ModelInfo, paths: list[str]) -> bool:
    """Whether `leaf` is an attention Q, K or V: named so in an attention module, or,
    whatever its name, a matmul whose whole output is reshaped into heads that enter
    attention (a product of two matmuls' outputs): MLA's `q_b_proj` and `kv_b_proj`."""
    if info.role.get(paths[leaf]) in ("q", "k", "v"):
        return True
    return leaf in flow.whole_heads and leaf in flow.attended


def _feeds_heads(leaf: int, flow: Dataflow, info: ModelInfo, paths: list[str]) -> str | None:
    """The path of an attention Q, K or V that reads `leaf`'s output, when `leaf` is
    not itself one of attention's projections; else `None`."""
    if info.role.get(paths[leaf]) is not None or _makes_heads(leaf, flow, info, paths):
        return None
    for other in flow.order:
        if leaf in flow.uses[other].taint and _makes_heads(other, flow, info, paths):
            return paths[other]
    return None


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
    decided: Mapping[int, Decision],
    paths: list[str],
    shapes: list[tuple[int, ...]],
    n: int,
) -> Decision:
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
        return Decision(ROW, use.in_axes[-1], f"{why}: split on its input, never its rank")
    if role == "up" and kind == COL and shapes[leaf][use.out_axes[-1]] % n == 0:
        return Decision(COL, use.out_axes[-1], f"{why}: split on its output, never its rank")
    return Decision(REP, None, f"{why}: replicated, its rank never split")


def _expert_groups(
    flow: Dataflow,
    decided: dict[int, Decision],
    fixed: Mapping[int, Decision],
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
                decided[g] = Decision(kind, _expert_axis(flow.uses[g]), why)
        elif meg_ok:
            for g in group:
                d = decided[g]
                decided[g] = dataclasses.replace(
                    d, reason=d.reason + f"; Megatron within experts, as {paths[out_leaf]}"
                )


def plan_dataflow(
    example_call: Callable[[PyTree], Any],
    model: PyTree,
    info: ModelInfo,
    paths: list[str],
    shapes: list[tuple[int, ...]],
    n: int,
    overrides: Mapping[int, tuple[str, P]],
) -> tuple[dict[int, Decision], dict[int, Decision], dict[int, Decision], list[str], Dataflow]:
    """Matmul, embedding and tied-vector decisions from the traced dataflow (and the flow).

    Overrides are decisions fixed before the rules run, so that what reads an
    overridden weight's output follows from the override.
    """
    flow = trace_dataflow(example_call, model)
    notes = _opaque_notes(flow, paths)
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
        leaf: Decision(REP, None, why.format(prim))
        for leaf, prim in flow.touched.items()
        if leaf not in fixed
    }
    forced |= {i: d for i, d in _table_factors(info, index).items() if i not in fixed}
    emb = {
        i: d
        for i, d in _embedding_decisions(flow, info, paths, shapes, n).items()
        if i not in fixed and i not in forced
    }
    decided: dict[int, Decision] = {**emb, **fixed, **forced}
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
    tied = _tied_decisions(flow, decided, paths, shapes, n)
    matmuls = {k: v for k, v in decided.items() if k not in emb and k not in fixed}
    return matmuls, emb, tied, notes, flow


def _opaque_notes(flow: Dataflow, paths: list[str]) -> list[str]:
    """A note for each primitive the interpreter could not follow, naming what it reads."""
    notes = []
    for prim, why in sorted(flow.opaque.items()):
        read = sorted(paths[leaf] for leaf, p in flow.touched.items() if p == prim)
        notes.append(
            f"the dataflow interpreter could not follow `{prim}` ({why}): matmuls inside it "
            f"were not seen and the {len(read)} weight(s) it reads are replicated"
            + (f" ({', '.join(read[:4])}{', ...' if len(read) > 4 else ''})" if read else "")
            + "; to split them, give their specs in overrides= (or use a redcoast that "
            "knows this JAX release)"
        )
    return notes


def _tied_decisions(
    flow: Dataflow,
    decided: Mapping[int, Decision],
    paths: list[str],
    shapes: list[tuple[int, ...]],
    n: int,
) -> dict[int, Decision]:
    """Vectors added to (or multiplied into) a split matmul's output split with it."""
    tied: dict[int, Decision] = {}
    for vec, (mleaf, pairs) in flow.ties.items():
        d = decided.get(mleaf)
        if vec in decided or d is None or d.kind == REP or d.axis is None:
            continue
        for vaxis, maxis in pairs.items():
            if maxis == d.axis and shapes[vec][vaxis] % n == 0:
                why = f"added to {paths[mleaf]}'s output: split with its {d.kind} dimension"
                tied[vec] = Decision(COL, vaxis, why)
    return tied


def _table_factors(info: ModelInfo, index: Mapping[str, int]) -> dict[int, Decision]:
    """LoRA on a table: its `(features, rank)` factor is replicated, its rank never split.

    The rows looked up from the table and from its `(vocab, rank)` factor, both split
    on the vocabulary, come out whole after their all-reduce; so does the update.
    """
    why = "low-rank factor beside a table: replicated, its rank never split"
    return {index[p]: Decision(REP, None, why) for p in info.table_factors if p in index}


def plan_declaration(
    info: ModelInfo, paths: list[str], shapes: list[tuple[int, ...]], n: int
) -> tuple[dict[int, Decision], dict[int, Decision]]:
    index = {p: i for i, p in enumerate(paths)}
    decided: dict[int, Decision] = _table_factors(info, index)
    last = ROW
    for wpath in info.linear_weight:
        if wpath not in index or index[wpath] in decided:
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
