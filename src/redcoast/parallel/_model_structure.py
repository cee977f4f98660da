"""What a model's module structure says, before any trace.

Its Linear weights (with their biases) in declaration order, its lookup tables,
and the attention modules: a module whose fields hold query, key, value and
output projections (Linear layers, or modules wrapping one as `base`) is
attention, and a head-count field on it says how many heads Q, K and V hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import equinox as eqx
from jaxtyping import PyTree

__all__ = ["ModelInfo", "model_info"]

_Q_NAMES = ("query_proj", "q_proj", "query", "wq")
_K_NAMES = ("key_proj", "k_proj", "key", "wk")
_V_NAMES = ("value_proj", "v_proj", "value", "wv")
_O_NAMES = ("output_proj", "o_proj", "out_proj", "dense", "wo")
_HEAD_FIELDS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_KV_HEAD_FIELDS = ("num_kv_heads", "num_key_value_heads", "n_kv_heads")


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
class ModelInfo:
    """What the module structure says: Linear weights and biases, embeddings, attention."""

    linear_weight: dict[str, str]  # weight path -> bias path ("" when none), declaration order
    embeddings: set[str]
    role: dict[str, str]  # weight path -> "q" | "k" | "v" | "o"
    heads: dict[str, int]  # weight path -> number of heads its output (Q/K/V) or input (O) holds
    # Linear weights inside a module wrapping a table as `base` (LoRA on an embedding):
    # low-rank factors beside the table.
    table_factors: set[str] = dataclasses.field(default_factory=set)


def _linear_path(module: Any) -> str | None:
    """Where a projection's Linear sits in it: `""` for a Linear itself, `".base"` for a
    module wrapping one (a LoRA layer), None when it is neither."""
    if isinstance(module, eqx.nn.Linear):
        return ""
    if isinstance(getattr(module, "base", None), eqx.nn.Linear):
        return ".base"
    return None


def model_info(model: PyTree) -> ModelInfo:
    linear_weight: dict[str, str] = {}
    embeddings: set[str] = set()
    role: dict[str, str] = {}
    heads: dict[str, int] = {}
    table_factors: set[str] = set()
    for path, module in _modules(model):
        dot = f"{path}." if path else ""
        if isinstance(getattr(module, "base", None), eqx.nn.Embedding):
            table_factors |= {
                f"{dot}{f.name}.weight"
                for f in dataclasses.fields(module)
                if isinstance(getattr(module, f.name, None), eqx.nn.Linear)
            }
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
    return ModelInfo(linear_weight, embeddings, role, heads, table_factors)
