"""Collectives in a compiled program: what moves over which mesh axis, and how much.

XLA's SPMD partitioner inserts the collectives a sharding needs; reading them back
out of `compiled.as_text()` is how a layout is checked against Megatron-LM's.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

import numpy as np
from jax.sharding import Mesh

from redcoast.plan._hlo import COLLECTIVES, shape_bytes

__all__ = [
    "Collective",
    "collectives",
    "ring_bytes",
    "scattered_all_reduces",
    "summarize",
    "weight_all_gathers",
]

_OPS = COLLECTIVES
_INSTR = re.compile(r"=\s*(?P<shape>.*?)\s(?P<op>" + "|".join(_OPS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b(pred|[sufc]\d+|bf16|f8\w*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
        op: `all-reduce`, `all-gather`, `reduce-scatter`, `all-to-all` or `collective-permute`.
        axis: the mesh axis its groups span: `"data"`, `"model"`, `"both"`, or `"none"`
            for groups of one device.
        nbytes: bytes of its result on one device.
        shape: the result type as XLA prints it.
        source: the JAX operation it came from (XLA's `op_name` metadata).
        name: the instruction's name (`%all-reduce.3`).
    """

    op: str
    axis: str
    nbytes: int
    shape: str
    source: str
    name: str = ""

    @property
    def dims(self) -> list[tuple[int, ...]]:
        """The dimensions of each array in the result."""
        return [
            tuple(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(self.shape)
        ]


def _groups(line: str, n_devices: int) -> list[list[int]]:
    """The device groups of one instruction, in logical (flattened mesh) ids."""
    match = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if match:
        axes = re.findall(r"'([^']+)'=(\d+)", match.group(1))
        names = [a for a, _ in axes]
        dims = [int(d) for _, d in axes]
        over = {a.strip().strip("'") for a in match.group(2).split(",") if a.strip()}
        ids = np.arange(math.prod(dims)).reshape(dims)
        moved = [i for i, a in enumerate(names) if a in over]
        kept = [i for i, a in enumerate(names) if a not in over]
        arranged = ids.transpose(kept + moved)
        size = math.prod(dims[i] for i in moved)
        return arranged.reshape(-1, size).tolist()
    match = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if match:
        shape = [int(d) for d in match.group(1).split(",")]
        dims = [int(d) for d in match.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if match.group(3):
            ids = ids.transpose([int(p) for p in match.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    match = re.search(r"replica_groups=\{(\{[\d,{}\s]*\})\}", line)
    if match:
        return [
            [int(x) for x in g.split(",") if x.strip()]
            for g in re.findall(r"\{([\d,\s]*)\}", match.group(1))
        ]
    match = re.search(r"source_target_pairs=\{([^=]*)\}", line)
    if match:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", match.group(1))]
    return [list(range(n_devices))]


def _axis(groups: list[list[int]], n_model: int) -> str:
    spans_model = spans_data = False
    for group in groups:
        rows = {i // n_model for i in group}
        cols = {i % n_model for i in group}
        spans_model |= len(cols) > 1
        spans_data |= len(rows) > 1
    if spans_model and spans_data:
        return "both"
    return "model" if spans_model else "data" if spans_data else "none"


def collectives(hlo_text: str, mesh: Mesh) -> list[Collective]:
    """Every collective in a compiled program's HLO text, with the mesh axis it runs over.

    Args:
        hlo_text: `jax.jit(f).lower(...).compile().as_text()`.
        mesh: the `("data", "model")` mesh the program was compiled for.

    Returns:
        One `Collective` per instruction, in program order. Collectives inside loops are
        listed once.

    Example:
        >>> text = jax.jit(step).lower(model, batch).compile().as_text()
        >>> summarize(collectives(text, mesh))
    """
    n_devices = int(mesh.devices.size)
    n_model = int(mesh.shape.get("model", 1))
    found = []
    for line in hlo_text.splitlines():
        match = _INSTR.search(line)
        if match is None:
            continue
        source = re.search(r'op_name="([^"]*)"', line)
        name = re.match(r"\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=", line)
        found.append(
            Collective(
                op=match.group("op"),
                axis=_axis(_groups(line, n_devices), n_model),
                nbytes=shape_bytes(match.group("shape")),
                shape=match.group("shape"),
                source=source.group(1) if source else "",
                name=name.group(1) if name else "",
            )
        )
    return found


def summarize(found: list[Collective]) -> dict[str, dict[str, int]]:
    """Bytes and counts per axis and per operation: `{"model": {"bytes": .., "all-reduce": ..}}`."""
    out: dict[str, Counter[str]] = {}
    for c in found:
        entry = out.setdefault(c.axis, Counter())
        entry["bytes"] += c.nbytes
        entry[c.op] += 1
    return {axis: dict(counts) for axis, counts in out.items()}


def weight_all_gathers(
    found: list[Collective], split_shapes: list[tuple[int, ...]]
) -> list[Collective]:
    """All-gathers over the model axis that rebuild a whole split weight.

    A good tensor-parallel layout never needs these: each device computes with its own
    slice of every weight. Gathering a replicated weight's gradient is not counted.

    Args:
        found: from `collectives`.
        split_shapes: the full shapes of the weights that the layout splits.
    """
    wanted = set(split_shapes)
    return [
        c
        for c in found
        if c.op == "all-gather" and c.axis in ("model", "both") and any(d in wanted for d in c.dims)
    ]


def ring_bytes(found: list[Collective], n: int, scattered: dict[str, int] | None = None) -> float:
    """What each device sends when these collectives run as rings over `n` devices.

    `2 (n-1)/n` of an all-reduce's result, `(n-1)/n` of an all-gather's result and
    of a reduce-scatter's input (`n - 1` times its result); other collectives count
    their result. The bytes `scattered` gives for an all-reduce (from
    `scattered_all_reduces`) count as a reduce-scatter's input.
    """
    share = (n - 1) / n
    scale = {"all-reduce": 2 * share, "all-gather": share, "reduce-scatter": n - 1.0}
    total = 0.0
    for c in found:
        as_scatter = (scattered or {}).get(c.name, 0)
        total += share * as_scatter + scale.get(c.op, 1.0) * (c.nbytes - as_scatter)
    return total


_DEF = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(?:\(.*?\)|\S+)\s+([\w\-]+)\((.*)$")
_HEAD = re.compile(r"^(?:ENTRY\s+)?(%[\w.\-]+)\s.*\{\s*$")
# Slicing commutes with these: slice(add(a, b)) = add(slice(a), slice(b)).
_PASS_THROUGH = (
    *("bitcast", "copy", "reshape", "get-tuple-element", "convert", "negate", "select"),
    *("add", "subtract", "multiply", "divide", "maximum", "minimum"),
)


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    op: str
    operands: tuple[str, ...]
    calls: str
    index: int  # a parameter's or a tuple element's number, else -1
    shape: str


def _operands(rest: str) -> tuple[str, ...]:
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    return tuple(re.findall(r"%[\w.\-]+", rest[:end]))


def _computations(hlo_text: str) -> dict[str, list[_Instr]]:
    comps: dict[str, list[_Instr]] = {}
    current: list[_Instr] | None = None
    for line in hlo_text.splitlines():
        head = _HEAD.match(line)
        if head and not line.startswith(" "):
            current = comps.setdefault(head.group(1), [])
            continue
        match = _DEF.match(line)
        if match and current is not None:
            calls = re.search(r"calls=(%[\w.\-]+)", line)
            op = match.group(2)
            if op == "parameter":
                index = re.match(r"(\d+)\)", match.group(3))
            else:
                index = re.search(r"\bindex=(\d+)", line) if op == "get-tuple-element" else None
            current.append(
                _Instr(
                    match.group(1),
                    op,
                    _operands(match.group(3)),
                    calls.group(1) if calls else "",
                    int(index.group(1)) if index else -1,
                    line.split("=", 1)[1].split(f" {op}(", 1)[0],
                )
            )
    return comps


def scattered_all_reduces(hlo_text: str) -> dict[str, int]:
    """The all-reduces of which each device reads only its own slice: reduce-scatters.

    XLA's SPMD partitioner writes a scattered partial sum as an all-reduce and a
    dynamic slice; the GPU and TPU compilers turn that pair into one reduce-scatter
    (half an all-reduce's ring bytes), and XLA:CPU runs it as it is. An all-reduce's
    result (or an element of a combined one's tuple) counts here when every use of
    it, through bitcasts, copies, elementwise arithmetic (which slicing commutes
    with) and into fusions, ends in the operand a `dynamic-slice` slices.

    Args:
        hlo_text: `compiled.as_text()`.

    Returns:
        For each such all-reduce (by `Collective.name`), the bytes of its result
        read a slice at a time.
    """
    comps = _computations(hlo_text)
    users: dict[str, dict[str, list[tuple[_Instr, int]]]] = {}
    for comp, instrs in comps.items():
        table = users.setdefault(comp, {})
        for instr in instrs:
            for i, operand in enumerate(instr.operands):
                table.setdefault(operand, []).append((instr, i))

    def parameter(comp: str, index: int) -> str | None:
        found = [x.name for x in comps.get(comp, []) if x.op == "parameter" and x.index == index]
        return found[0] if found else None

    def sliced(comp: str, name: str, seen: int = 0) -> bool:
        uses = users.get(comp, {}).get(name, [])
        if not uses or seen > 32:
            return False
        for instr, i in uses:
            if instr.op == "dynamic-slice" and i == 0:
                continue
            if instr.op in _PASS_THROUGH and sliced(comp, instr.name, seen + 1):
                continue
            inner = parameter(instr.calls, i) if instr.op == "fusion" else None
            if inner is not None and sliced(instr.calls, inner, seen + 1):
                continue
            return False
        return True

    out: dict[str, int] = {}
    for comp, instrs in comps.items():
        for instr in instrs:
            if instr.op != "all-reduce":
                continue
            arrays = [shape_bytes(f"{t}[{d}]") for t, d in _ARRAY.findall(instr.shape)]
            if len(arrays) == 1:
                read = arrays if sliced(comp, instr.name) else []
            else:  # a combined all-reduce: each element through its get-tuple-element
                elements = {u.index: u.name for u, _ in users.get(comp, {}).get(instr.name, [])}
                read = [
                    b for k, b in enumerate(arrays) if k in elements and sliced(comp, elements[k])
                ]
            if read:
                out[instr.name] = sum(read)
    return out
