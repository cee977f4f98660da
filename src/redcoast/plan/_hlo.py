"""Reading a compiled program's text: sizes, loops, collectives, and the CPU's own copies.

XLA prints a compiled program as computations of instructions. A scanned layer
stack is a `while` whose body runs `known_trip_count` times, so what the body
does counts that many times (`multipliers`), and so do the bytes it moves
(`bytes_accessed`); a loop that stops on a value it computes (sampling's decode
loop, which ends when every row has) runs as often as the caller says (`unbounded`).
Collectives are read with their result sizes (`collective_bytes`). XLA:CPU computes
bfloat16 matmuls in float32: it converts bfloat16 weights and saved activations to
float32 copies that no GPU or TPU program makes (`cpu_float32_copies`).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

__all__ = [
    "bytes_accessed",
    "collective_bytes",
    "cpu_float32_copies",
    "loop_factor",
    "multipliers",
    "shape_bytes",
]

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_ARRAY = re.compile(r"\b(pred|[sufc]\d+|bf16|f8\w*)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16}
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"\b(body|condition|calls|to_apply|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*?)\)")
# Instructions that name or regroup buffers without reading them, and the loops and
# calls whose bodies are counted on their own.
_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
    "conditional", "call", "after-all", "partition-id", "replica-id", "opt-barrier",
}  # fmt: skip
_PASS_THROUGH = ("convert", "bitcast", "copy")
_SLICES = ("slice", "dynamic-slice")
_FUSED = re.compile(r"\bcalls=%?([\w.\-]+)")
_COLLECTIVE = re.compile(r"=\s*(?P<shape>.*?)\s(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def _dtype_bytes(name: str) -> float:
    if name in _BITS:
        return _BITS[name] / 8
    return int(re.sub(r"\D", "", name) or "8") / 8


def shape_bytes(shape: str) -> int:
    """Bytes of the arrays an XLA type names: `f32[8,128]`, `(bf16[4], s32[])`."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        total += math.prod(int(d) for d in dims.split(",") if d) * _dtype_bytes(dtype)
    return int(total)


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    """Each computation's instruction lines, and the entry computation's name."""
    found: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _HEADER.match(line) if current is None else None
        if header:
            current = header[2]
            found[current] = []
            if header[1]:
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None:
            found[current].append(line)
    return found, entry


def _calls(
    text: str, unbounded: int = 1
) -> tuple[dict[str, list[str]], str, dict[str, list[tuple[str, int, bool]]]]:
    """Computations, the entry's name, and each computation's callees: (name, times per
    run of the caller, whether the callee is a body of its own — a loop's or a branch —
    rather than fused into or applied by one instruction)."""
    comps, entry = _computations(text)
    edges: dict[str, list[tuple[str, int, bool]]] = defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            n = _trip_count(line, comps, unbounded) if " while(" in line else 1
            for kind, callees in _CALLS.findall(line):
                own = kind in ("body", "condition", "branch_computations") or " call(" in line
                for callee in callees.strip("{}").replace("%", "").split(","):
                    if callee.strip():
                        edges[name].append((callee.strip(), n, own))
    return comps, entry, edges


def _trip_count(line: str, comps: dict[str, list[str]], unbounded: int = 1) -> int:
    """How many times a `while` runs: its `known_trip_count` (XLA:CPU, GPU), else the
    bound its condition compares the counter with (`i < N`, counting from 0 by 1, as
    `lax.scan` and `fori_loop` do, and XLA:TPU's windowed matmuls with an unsigned
    counter) when that comparison is all the condition computes, else `unbounded` times
    (a loop that stops on a value it computes, `i < N and not done`: sampling's)."""
    trips = _TRIPS.search(line)
    if trips:
        return int(trips[1])
    condition = re.search(r"\bcondition=%?([\w.\-]+)", line)
    body = comps.get(condition[1], []) if condition else []
    bound = re.compile(r"=\s*[su]32\[\]\S*\s+constant\((\d+)\)")
    constants = [int(m[1]) for m in map(bound.search, body) if m]
    compares = [ln for ln in body if " compare(" in ln and "direction=LT" in ln]
    counted = len(constants) == 1 and len(compares) == 1 and "ROOT " in compares[0]
    return constants[0] if counted else unbounded


def multipliers(text: str, *, own_bodies: bool = False, unbounded: int = 1) -> dict[str, int]:
    """How many times each computation runs per run of the program.

    A `while`'s body and condition run as often as the loop does (`_trip_count`; a
    loop whose trip count the program does not fix, `unbounded` times); fusions,
    calls and reductions run once per use. With
    `own_bodies`, only the computations whose instructions run one by one: the
    entry, loop bodies and conditions, branches and calls (not what is fused into or
    applied by one instruction).
    """
    _, entry, edges = _calls(text, unbounded)
    counts: dict[str, int] = defaultdict(int)

    def visit(name: str, times: int, depth: int) -> None:
        counts[name] += times
        if depth < 64:
            for callee, n, own in edges.get(name, []):
                if own or not own_bodies:
                    visit(callee, times * n, depth + 1)

    if entry:
        visit(entry, 1, 0)
    return dict(counts)


def bytes_accessed(text: str, *, once: bool = False, unbounded: int = 1) -> int:
    """Bytes one device reads and writes per run: every instruction's operands and
    result, a loop's body counted as often as it runs (`unbounded` times where the
    program does not fix it; every body once with `once`).

    What XLA's cost analysis counts (equal to it on a program without loops), but per
    run of each loop body rather than once: an instruction or fusion reads its
    operands and writes its result; instructions that only name buffers (parameters,
    tuples, bitcasts) move nothing. A layer stack's body reads one layer of each
    stacked array (a slice reads the slice, not the stack) and writes one
    layer of each stacked result in place (a dynamic update writes the update).
    """
    comps, _ = _computations(text)
    total = 0
    for name, n in multipliers(text, own_bodies=True, unbounded=unbounded).items():
        n = 1 if once else n
        types: dict[str, str] = {}
        moved = 0
        for line in comps.get(name, []):
            found = _INSTRUCTION.match(line)
            if not found:
                continue
            result, shape, op, operands = found.groups()
            types[result] = shape
            if op in _FREE:
                continue
            sizes = [shape_bytes(types.get(_operand_name(o), "")) for o in operands.split(",")]
            fused = _FUSED.search(line) if op == "fusion" else None
            reads, written = _slices(comps.get(fused[1], []) if fused else [line], comps)
            if op == "dynamic-update-slice" and len(sizes) > 1:
                written = sizes[1]  # in place: the update, whose size the line does not show
            moved += sum(reads.get(i, size) for i, size in enumerate(sizes))
            moved += shape_bytes(shape) if written is None else written
        total += moved * n
    return total


def loop_factor(text: str, unbounded: int = 1) -> float:
    """How many times more bytes a run moves than a count of each loop body once:
    what a compiler's cost analysis (which counts a body once) is multiplied by (a
    loop whose trip count the program does not fix run `unbounded` times).

    The ratio of `bytes_accessed` with loops counted to the same count with every
    body once, so the two compilers' own ways of counting (XLA:TPU's asynchronous
    copies, its multi-output fusions) stay theirs.
    """
    loops = bytes_accessed(text, unbounded=unbounded)
    once = bytes_accessed(text, once=True)
    return loops / once if once else 1.0


def _operand_name(operand: str) -> str:
    """`%dot.2` of `f32[8] %dot.2` or `/*index=5*/%dot.2`."""
    return re.sub(r"/\*.*?\*/", "", operand).strip().split(" ")[-1].lstrip("%")


def _slices(
    lines: list[str], comps: dict[str, list[str]] | None = None
) -> tuple[dict[int, int], int | None]:
    """What an instruction (or a fused computation) reads of its operands and writes,
    where slices make it less than the whole: {operand index: bytes read} for an
    operand read only through dynamic slices, and the bytes written when its result
    is a dynamic update in place (None otherwise). With the program's computations
    `comps`, an operand passed on to a nested fusion is read as that fusion reads it
    (XLA:TPU slices one layer of a stacked weight in a fusion inside the matmul's)."""
    matched = [(m.groups(), line) for line in lines if (m := _INSTRUCTION.match(line))]
    found = [groups for groups, _ in matched]
    if not found:
        return {}, None
    params = {name: int(ops) for name, _, op, ops in found if op == "parameter"}
    if len(found) == 1:  # one instruction: its operands are 0, 1, ...
        name, shape, op, ops = found[0]
        params = {_operand_name(o): i for i, o in enumerate(ops.split(","))}
    users: dict[str, list[tuple[str, str, int, int]]] = defaultdict(list)
    by_name = {name: (shape, op, ops) for name, shape, op, ops in found}
    for (name, shape, op, ops), line in matched:
        nested = _FUSED.search(line) if op == "fusion" and comps is not None else None
        inner = _slices(comps.get(nested[1], []), comps)[0] if comps and nested else {}
        for position, operand in enumerate(ops.split(",")):
            if position in inner:  # read as the nested fusion reads its parameter
                how = "dynamic-slice" if inner[position] else "dynamic-update-slice"
                users[_operand_name(operand)].append((name, how, 0, inner[position]))
            else:
                users[_operand_name(operand)].append((name, op, position, shape_bytes(shape)))

    def uses(name: str) -> list[tuple[str, int, int]]:
        """Who reads `name`: (op, operand position, bytes of its result), looking
        through conversions (XLA:CPU converts a bfloat16 stack to float32 around an
        update in place; other compilers update it as it is)."""
        found_uses = []
        for user, op, position, size in users.get(name, []):
            if op in _PASS_THROUGH:
                found_uses += uses(user)
            else:
                found_uses.append((op, position, size))
        return found_uses

    reads: dict[int, int] = {}
    for param, index in params.items():
        read = uses(param)
        # Read through slices (what they take of it) and updated in place (nothing):
        # a scatter of one slot a row, which XLA:TPU runs as a loop over the rows,
        # reads the slot it may keep and writes it back into the whole buffer.
        if read and all(
            pos == 0 and op in (*_SLICES, "dynamic-update-slice") for op, pos, _ in read
        ):
            reads[index] = sum(size for op, _, size in read if op in _SLICES)
    root, (_, op, ops) = found[-1][0], found[-1][1:]
    while op in _PASS_THROUGH and _operand_name(ops) in by_name:
        root = _operand_name(ops)
        _, op, ops = by_name[root]
    if op != "dynamic-update-slice":
        return reads, None
    update = _operand_name(ops.split(",")[1])
    return reads, shape_bytes(by_name[update][0]) if update in by_name else None


def collective_bytes(text: str, unbounded: int = 1) -> int:
    """Bytes that collectives produce on one device per run, each counted as often as its
    computation runs (a loop whose trip count the program does not fix, `unbounded` times).

    An asynchronous start counts its results, not the operands its result names too.
    XLA:TPU writes an asynchronous collective as fusions that each name it: one that
    starts it, ones that compute while it runs, one that finishes it; it is counted
    once, where it starts. A reduce-scatter it fuses as an all-reduce of the whole
    array followed by a slice (a fusion calling `all-reduce-scatter...`) is counted
    as the reduce-scatter it is, by the fusion's result.
    """
    comps, _ = _computations(text)
    times = multipliers(text, unbounded=unbounded)
    finishing: dict[str, list[bool]] = defaultdict(list)
    for lines in comps.values():
        for line in lines:
            fused, found = _FUSED.search(line), _INSTRUCTION.match(line)
            if fused and found:
                finishing[fused[1]].append(found[1].startswith("async-collective-done"))
    total = 0
    for name, lines in comps.items():
        if name.startswith(("async_collective_fusion", "all-reduce-scatter")) or (
            finishing.get(name) and all(finishing[name])
        ):
            continue
        for line in lines:
            found = _COLLECTIVE.search(line)
            if found and "-done(" not in line:
                total += shape_bytes(_started(found["shape"], line)) * times.get(name, 1)
            elif re.search(r"\bfusion\(.*\bcalls=%?all-reduce-scatter", line):
                shape = _INSTRUCTION.match(line)
                total += shape_bytes(shape[2] if shape else "") * times.get(name, 1)
    return total


def _started(shape: str, line: str) -> str:
    """What a collective produces: its result, or for an asynchronous start whose result
    is a tuple (its operands, its results, then contexts: `collective-permute-start`,
    `all-gather-start`) the second element, the results."""
    if not re.search(r"-start\(", line) or not shape.startswith("("):
        return shape
    parts, depth, begin = [], 0, 1
    for i, char in enumerate(shape):
        if char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
        if (char == "," and depth == 1) or depth == 0:
            parts.append(shape[begin:i])
            begin = i + 1
        if depth == 0:
            break
    return parts[1] if len(parts) >= 2 else shape


def cpu_float32_copies(text: str) -> int:
    """Bytes XLA:CPU's float32 copies of bfloat16 values add to the step's peak.

    XLA:CPU has no bfloat16 matmul: at the top level it converts bfloat16 values to
    float32 for the float32 matmuls of the layer loops, and GPU and TPU compilers
    multiply bfloat16 as it is. Two kinds of copy, each an instruction of the entry
    computation that only converts one bfloat16 value to float32 of its shape:
    - of a parameter (a frozen bfloat16 weight), made once and kept through the
      step while the parameter lives on: the whole copy is extra;
    - of a computed value (a stack of activations the forward loop saved for the
      backward one): where the conversion is the value's only use, the bfloat16
      value dies there and a GPU would keep it instead, so half the copy is extra
      (bfloat16 is half of float32); where it is used again, all of it.
    Both are taken as live at the peak, which the backward loop's start is.
    """
    comps, entry = _computations(text)
    found = [m for line in comps.get(entry, []) if (m := _INSTRUCTION.match(line))]
    kinds = {m[1]: (m[2], m[3]) for m in found}  # name -> (its type, its op)
    uses = Counter(
        name for m in found for name in re.findall(r"%([\w.\-]+)", m.string.split("=", 1)[1])
    )
    total = 0.0
    for m in found:
        shape = re.fullmatch(r"f32\[([\d,]*)\]\S*", m[2])
        operands = [o.split()[-1].lstrip("%") for o in m[4].split(",") if o.strip()]
        if shape is None or m[3] not in ("convert", "fusion") or len(operands) != 1:
            continue
        source_type, source_op = kinds.get(operands[0], ("", ""))
        if not re.match(rf"bf16\[{shape[1]}\](\{{|$)", source_type):
            continue
        if m[3] == "fusion" and not _only_converts(comps, m.string):
            continue
        copy = shape_bytes(f"f32[{shape[1]}]")
        total += copy if source_op == "parameter" or uses[operands[0]] > 1 else copy / 2
    return int(total)


def _only_converts(comps: dict[str, list[str]], line: str) -> bool:
    """Whether the fused computation a fusion calls does nothing but convert (and
    regroup) its one parameter."""
    fused = _FUSED.search(line)
    body = comps.get(fused[1], []) if fused else []
    ops = {found[3] for instruction in body if (found := _INSTRUCTION.match(instruction))}
    return bool(ops) and ops <= {"parameter", "convert", "bitcast", "copy", "reshape"}
