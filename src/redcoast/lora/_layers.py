"""LoRA layers: `LoRALinear`, and `apply`, `trainable`, `merge` (see `redcoast.lora`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from .._tree_paths import glob_matches, leaves_with_paths, path_str, target_globs
from ..nn import AbstractProjection, AbstractQuantized, AbstractTable, dense

__all__ = [
    "LoRAEmbedding",
    "LoRALinear",
    "adapted_paths",
    "adapters_differ",
    "adapters_record",
    "apply",
    "check_alpha",
    "disabled",
    "lora_layers",
    "merge",
    "trainable",
]

Targets = str | Sequence[str] | Callable[[str, eqx.nn.Linear | AbstractQuantized], bool]
"""What `apply` wraps: globs over the dotted paths of Linears and embedding tables, or
`(path, linear) -> bool` choosing among the Linears."""


class LoRALinear(AbstractProjection):
    """A frozen Linear plus a trainable low-rank update: `base(x) + scale * B(A(dropout(x)))`.

    Stacked layers (a leading layer axis, from `eqx.filter_vmap` or `scan_layers`)
    carry the same leading axes on `lora_a` and `lora_b`. The base may be quantized
    (`rc.quant.NF4Linear`, `Int8Linear`: QLoRA), and then computes in the input's dtype.

    Attributes:
        base: the wrapped Linear, weight `(out, in)`, or a quantized one standing for
            it; frozen in LoRA training.
        lora_a: Linear `in -> rank` without bias, weight `(rank, in)`.
        lora_b: Linear `rank -> out` without bias, weight `(out, rank)`; zeros at
            first, so the wrapped model starts as the base model.
        dropout: applied to the input of `lora_a` only, as in PEFT.
        scale: `alpha / rank`.
    """

    base: eqx.nn.Linear | AbstractQuantized
    lora_a: eqx.nn.Linear
    lora_b: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    scale: float = eqx.field(static=True)

    @property
    def rank(self) -> int:
        """The rank of the update."""
        return self.lora_a.out_features  # type: ignore[return-value]

    def _dropped(self, x: Array, key: PRNGKeyArray | None) -> Array:
        if self.dropout.p == 0 or self.dropout.inference:
            return x
        if key is None:
            raise ValueError(
                f"LoRA dropout={self.dropout.p} draws random bits, but this layer was called "
                "without key=. The zoo's models pass no key to their projections: use "
                "dropout=0.0 with them (or eqx.nn.inference_mode for evaluation); in your own "
                "model, call the layer with key=."
            )
        return self.dropout(x, key=key)

    def _sum(self, base: Array, update: Array, like: Array) -> Array:
        return (base.astype(like.dtype) + self.scale * update).astype(like.dtype)

    def __call__(
        self, x: Float[Array, " in_features"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " out_features"]:
        """On one input vector, as `eqx.nn.Linear`; `key` drives the dropout."""
        base = self.base(_base_input(self.base, x))
        return self._sum(base, self.lora_b(self.lora_a(self._dropped(x, key))), x)

    def over_tokens(self, x: Float[Array, "*tokens in"]) -> Float[Array, "*tokens out"]:
        """On every row of `x` at once, through the zoo's `dense` matmuls (no dropout key)."""
        base = dense(self.base, _base_input(self.base, x))
        return self._sum(base, dense(self.lora_b, dense(self.lora_a, self._dropped(x, None))), x)


def _base_input(base: eqx.nn.Linear | AbstractQuantized, x: Array) -> Array:
    # A plain base computes in its own dtype (a frozen bfloat16 base stays bfloat16);
    # a quantized one decodes its weight in the input's dtype.
    return x if isinstance(base, AbstractQuantized) else x.astype(base.weight.dtype)


def _weight_shape(layer: eqx.nn.Linear | AbstractQuantized) -> tuple[int, ...]:
    return layer.weight_shape if isinstance(layer, AbstractQuantized) else layer.weight.shape


class LoRAEmbedding(AbstractTable):
    """A frozen embedding table plus a trainable low-rank update: rows of `W + scale * A B`.

    As PEFT's LoRA on an `nn.Embedding`: `A` starts at zero and `B` normal, and no
    dropout. A head tied to the table (GPT-2's) sees the update too, computed as
    `h W^T + scale * (h B^T) A^T` without forming `W + A B`.

    Attributes:
        base: the wrapped table, weight `(vocab, features)`; frozen in LoRA training.
        lora_a: a table `vocab -> rank`, weight `(vocab, rank)` (PEFT's
            `lora_embedding_A` transposed); zeros at first.
        lora_b: Linear `rank -> features` without bias, weight `(features, rank)`
            (PEFT's `lora_embedding_B`).
        scale: `alpha / rank`.
    """

    base: eqx.nn.Embedding
    lora_a: eqx.nn.Embedding
    lora_b: eqx.nn.Linear
    scale: float = eqx.field(static=True)

    @property
    def rank(self) -> int:
        """The rank of the update."""
        return self.lora_a.weight.shape[-1]

    def __call__(
        self, x: Int[Array, ""], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " features"]:
        """The row of token `x`, as `eqx.nn.Embedding` (`key` is not used)."""
        row = self.base(x)
        update = self.lora_b.weight @ self.lora_a(x).astype(self.lora_b.weight.dtype)
        return (row.astype(update.dtype) + self.scale * update).astype(row.dtype)

    def logits(self, h: Float[Array, "*tokens features"]) -> Float[Array, "*tokens vocab"]:
        """`h` against every row of the updated table."""
        base = h @ self.base.weight.T
        low = (h.astype(self.lora_b.weight.dtype) @ self.lora_b.weight) @ self.lora_a.weight.T
        return (base.astype(low.dtype) + self.scale * low).astype(base.dtype)


_LAYERS = eqx.nn.Linear | AbstractQuantized | AbstractProjection | eqx.nn.Embedding | AbstractTable
_BASES = eqx.nn.Linear | AbstractQuantized | eqx.nn.Embedding
_ADAPTERS = LoRALinear | LoRAEmbedding


def _projections(model: PyTree) -> tuple[list[tuple[str, Any]], Any]:
    """Every Linear, table and wrapper of either in `model` (not looking inside them)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        model, is_leaf=lambda x: isinstance(x, _LAYERS)
    )
    return [(path_str(p), x) for p, x in flat], treedef


def _already_adapted(paths: list[str], what: str) -> ValueError:
    return ValueError(
        f"{what}: {paths[:6]}{' ...' if len(paths) > 6 else ''} already carry LoRA adapters "
        "(LoRALinear / LoRAEmbedding), and an adapter is not adapted again. Fold them into "
        "their base with rc.lora.merge and adapt the merged model, or start from the base "
        "model."
    )


def _selected(found: list[tuple[str, Any]], targets: Targets) -> list[bool]:
    linears = [(p, x) for p, x in found if isinstance(x, _BASES)]
    adapted = [(p, x) for p, x in found if isinstance(x, _ADAPTERS)]
    if callable(targets):
        # The predicate sees an adapted layer's base Linear, as it saw it before apply.
        again = [p for p, x in adapted if isinstance(x, LoRALinear) and targets(p, x.base)]
        if again:
            raise _already_adapted(again, "rc.lora.apply")
        chosen = [
            isinstance(x, eqx.nn.Linear | AbstractQuantized) and bool(targets(p, x))
            for p, x in found
        ]
    else:
        globs = target_globs(targets)
        again = [p for p, _ in adapted if any(glob_matches(p, g) for g in globs)]
        if again:
            raise _already_adapted(again, "rc.lora.apply")
        unmatched = [g for g in globs if not any(glob_matches(p, g) for p, _ in linears)]
        if unmatched:
            raise ValueError(
                f"LoRA target(s) {unmatched} match no eqx.nn.Linear or eqx.nn.Embedding of the "
                "model. Targets are globs over their dotted paths, such as "
                f"{[p for p, _ in linears[:4]]}; a bare name like 'q_proj' matches every path "
                "ending in it."
            )
        chosen = [
            isinstance(x, _BASES) and any(glob_matches(p, g) for g in globs) for p, x in found
        ]
    if not any(chosen):
        raise ValueError(
            "targets select no eqx.nn.Linear or eqx.nn.Embedding of the model; they are "
            f"{[p for p, _ in linears[:6]]}{' ...' if len(linears) > 6 else ''}."
        )
    return chosen


def check_alpha(alpha: Any, what: str = "alpha") -> float:
    """`alpha` as a float; a `ValueError` naming it unless it is a finite real number > 0."""
    real = isinstance(alpha, numbers.Real) and not isinstance(alpha, bool)
    # alpha=0 would make every update zero (training nothing, silently); nan or inf
    # would only show as a nan loss at the first step.
    if not real or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(
            f"{what} must be a finite number > 0 (the update is scaled by alpha / rank), got "
            f"{alpha!r}. Pass a positive alpha, such as 2 x rank (the default 16 for rank 8)."
        )
    return float(alpha)


def _check_rank(path: str, rank: int, n_in: int, n_out: int, names: tuple[str, str]) -> None:
    if rank > min(n_in, n_out):
        raise ValueError(
            f"LoRA rank={rank} is larger than {path}'s dimensions ({n_in} {names[0]}, {n_out} "
            f"{names[1]}): a rank above {min(n_in, n_out)} adds parameters without adding "
            "rank. Use a smaller rank, or leave this layer out of targets."
        )


def _wrap_table(
    path: str,
    table: eqx.nn.Embedding,
    *,
    rank: int,
    alpha: float | int,
    dtype: DTypeLike,
    key: PRNGKeyArray,
) -> LoRAEmbedding:
    *layers, vocab, features = table.weight.shape
    _check_rank(path, rank, vocab, features, ("rows", "features"))
    # PEFT's init for embeddings: A zeros, B standard normal.
    a = eqx.nn.Embedding(weight=jnp.zeros((*layers, vocab, rank), dtype))
    b = eqx.nn.Linear(rank, features, use_bias=False, key=key)
    b = eqx.tree_at(lambda m: m.weight, b, jax.random.normal(key, (*layers, features, rank), dtype))
    return LoRAEmbedding(table, a, b, alpha / rank)


def _wrap(
    path: str,
    linear: eqx.nn.Linear | AbstractQuantized,
    *,
    rank: int,
    alpha: float | int,
    dropout: float | int,
    dtype: DTypeLike,
    key: PRNGKeyArray,
) -> LoRALinear:
    *layers, n_out, n_in = _weight_shape(linear)
    _check_rank(path, rank, n_in, n_out, ("in", "out"))
    # PEFT's default init of A: kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)).
    bound = 1.0 / math.sqrt(n_in)
    a = jax.random.uniform(key, (*layers, rank, n_in), dtype, -bound, bound)
    lora_a = eqx.nn.Linear(n_in, rank, use_bias=False, key=key)
    lora_b = eqx.nn.Linear(rank, n_out, use_bias=False, key=key)
    lora_a = eqx.tree_at(lambda m: m.weight, lora_a, a)
    lora_b = eqx.tree_at(lambda m: m.weight, lora_b, jnp.zeros((*layers, n_out, rank), dtype))
    return LoRALinear(linear, lora_a, lora_b, eqx.nn.Dropout(dropout), alpha / rank)


def apply(
    model: PyTree,
    targets: Targets,
    *,
    rank: int = 8,
    alpha: float | int = 16.0,
    dropout: float | int = 0.0,
    dtype: DTypeLike = jnp.float32,
    key: PRNGKeyArray,
) -> PyTree:
    """Wrap the Linears `targets` selects in `LoRALinear`s, its tables in `LoRAEmbedding`s.

    Args:
        model: any Equinox model; its `eqx.nn.Linear` layers (the zoo's projections
            are such Linears), quantized Linears (`rc.quantize`) and
            `eqx.nn.Embedding` tables can be targets.
        targets: globs over their dotted paths (`"blocks.*.attn.q_proj"`); a bare
            name matches every path ending in it (`["q_proj", "v_proj"]`, as PEFT's
            `target_modules`; `"embed_tokens"` for the zoo's token table). Or a
            predicate `(path, linear) -> bool` choosing among the Linears.
        rank: the rank `r` of each update.
        alpha: the update is scaled by `alpha / rank`.
        dropout: dropout rate on the Linear adapters' input, as PEFT's
            `lora_dropout` (tables have none, as in PEFT). It needs a key at call
            time; the zoo's models pass none, so keep 0 there.
        dtype: of `lora_a` and `lora_b` (float32 by default, as PEFT keeps adapters,
            whatever the base's dtype).
        key: for the random factor's init (a Linear's `lora_a`, a table's
            `lora_b`; the other starts at zero).

    Returns:
        The model with the targets wrapped; the rest is the same objects.

    Raises:
        ValueError: a glob matches no Linear or table, the targets select none,
            `rank` exceeds a target's `min(in, out)`, `alpha` is not a finite number
            > 0, or a target is already adapted (a `LoRALinear` or `LoRAEmbedding`:
            `merge` the model first, or apply to the base model).

    Example:
        >>> model = rc.lora.apply(GPT2(config, key=k1), ["q_proj", "v_proj"], key=k2)
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}.")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}.")
    alpha = check_alpha(alpha)
    found, treedef = _projections(model)
    chosen = _selected(found, targets)
    keys = iter(jax.random.split(key, sum(chosen)))
    leaves = [
        x
        if not pick
        else _wrap_table(p, x, rank=rank, alpha=alpha, dtype=dtype, key=next(keys))
        if isinstance(x, eqx.nn.Embedding)
        else _wrap(p, x, rank=rank, alpha=alpha, dropout=dropout, dtype=dtype, key=next(keys))
        for (p, x), pick in zip(found, chosen, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _lora_layers(model: PyTree, what: str) -> tuple[list[Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten(model, is_leaf=lambda x: isinstance(x, _ADAPTERS))
    if not any(isinstance(x, _ADAPTERS) for x in leaves):
        raise ValueError(f"rc.lora.{what}: the model has no LoRA layers; use rc.lora.apply first.")
    return leaves, treedef


def lora_layers(model: PyTree) -> list[tuple[str, LoRALinear]]:
    """Every `LoRALinear` of `model` with its dotted path (`blocks.0.attn.q_proj`)."""
    found = leaves_with_paths(model, lambda x: isinstance(x, LoRALinear))
    return [(path, x) for path, x in found if isinstance(x, LoRALinear)]


def trainable(model: PyTree) -> PyTree:
    """The filter selecting only the adapters: True for every `lora_a` and `lora_b` weight.

    Args:
        model: a model with `LoRALinear` layers.

    Returns:
        A tree of bools shaped like `model`, for `fit(..., trainable=...)`.

    Example:
        >>> rc.fit(model, optimizer, train, trainable=rc.lora.trainable(model), ...)
    """
    leaves, treedef = _lora_layers(model, "trainable")

    def mark(x: Any) -> Any:
        if not isinstance(x, _ADAPTERS):
            return jax.tree.map(lambda _: False, x)
        flags = jax.tree.map(lambda _: False, x)
        return eqx.tree_at(lambda m: (m.lora_a.weight, m.lora_b.weight), flags, (True, True))

    return jax.tree_util.tree_unflatten(treedef, [mark(x) for x in leaves])


def merge(model: PyTree) -> PyTree:
    """The model with every adapter folded back: plain Linears `W + scale * B A` and tables.

    The sum is computed in float32 and stored in the base weight's dtype; a quantized
    base is decoded first (to the dtype its weight had before quantization).

    Args:
        model: a model with `LoRALinear` or `LoRAEmbedding` layers.

    Returns:
        The same model with plain `eqx.nn.Linear`s and `eqx.nn.Embedding`s, e.g.
        for `to_hf` or serving.

    Example:
        >>> plain = rc.lora.merge(result.model)
    """
    leaves, treedef = _lora_layers(model, "merge")

    def fold(x: Any) -> Any:
        if not isinstance(x, _ADAPTERS):
            return x
        base = x.base.dequantized() if isinstance(x.base, AbstractQuantized) else x.base
        w = base.weight
        a, b = x.lora_a.weight.astype(jnp.float32), x.lora_b.weight.astype(jnp.float32)
        # (out, r) @ (r, in) for a Linear; (vocab, r) @ (r, features) for a table.
        update = (
            jnp.matmul(b, a)
            if isinstance(x, LoRALinear)
            else jnp.matmul(a, jnp.swapaxes(b, -1, -2))
        )
        merged = (w.astype(jnp.float32) + x.scale * update).astype(w.dtype)
        return eqx.tree_at(lambda m: m.weight, base, merged)

    return jax.tree_util.tree_unflatten(treedef, [fold(x) for x in leaves])


class _BaseLinear(AbstractProjection):
    """An adapter switched off: its frozen Linear alone, as the model had it before `apply`.

    The Linear stays under the adapter's `base` field, so a weight keeps its path
    (`q_proj.base.weight`): the sharding rules and an FSDP layout recorded on the
    model find it there, and the reference pass gathers it as the trained pass does.
    """

    base: eqx.nn.Linear | AbstractQuantized

    def __call__(
        self, x: Float[Array, " in_features"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " out_features"]:
        return self.base(x)

    def over_tokens(self, x: Float[Array, "*tokens in"]) -> Float[Array, "*tokens out"]:
        return dense(self.base, x)


class _BaseTable(AbstractTable):
    """A table adapter switched off: the frozen table alone (and the head tied to it)."""

    base: eqx.nn.Embedding

    def __call__(
        self, x: Int[Array, ""], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " features"]:
        return self.base(x)

    def logits(self, h: Float[Array, "*tokens features"]) -> Float[Array, "*tokens vocab"]:
        return h @ self.base.weight.T


def disabled(model: PyTree) -> PyTree:
    """The model with its LoRA adapters switched off: the base model, from the same arrays.

    Each `LoRALinear` computes its frozen Linear alone and each `LoRAEmbedding` its
    frozen table alone, exactly as before `apply`; no weight is copied (the result
    holds the very arrays of `model`), so it serves as the reference model of
    preference tuning inside the same step (`rc.preference.dpo_loss`). Wrap its
    outputs in `jax.lax.stop_gradient` there: no gradient is meant to reach it.

    Args:
        model: a model with `LoRALinear` or `LoRAEmbedding` layers.

    Returns:
        The same model, each adapter replaced by a module computing its base only
        (which keeps the base weight's path, so its sharding and FSDP layout hold).

    Raises:
        ValueError: the model has no LoRA layers.

    Example:
        >>> ref_logits = jax.lax.stop_gradient(jax.vmap(rc.lora.disabled(model))(ids))
    """
    leaves, treedef = _lora_layers(model, "disabled")
    off = [
        _BaseLinear(x.base)
        if isinstance(x, LoRALinear)
        else _BaseTable(x.base)
        if isinstance(x, LoRAEmbedding)
        else x
        for x in leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, off)


def adapted_paths(model: PyTree) -> list[str]:
    """The dotted paths of every `LoRALinear` and `LoRAEmbedding` of `model`."""
    found = leaves_with_paths(model, lambda x: isinstance(x, _ADAPTERS))
    return [path for path, x in found if isinstance(x, _ADAPTERS)]


def adapters_record(model: PyTree) -> dict[str, Any] | None:
    """What `model`'s adapters compute beyond their arrays, for a checkpoint to record.

    A checkpoint's arrays do not hold it: `scale` is a static field and dropout's
    rate a float, so a resume with another alpha or dropout would load the same
    arrays into a model computing something else.

    Args:
        model: any model, with or without LoRA layers.

    Returns:
        None without adapters; else `{"summary": "...", "layers": {path: {"kind",
        "rank", "scale", "dropout"}}}`, JSON-able, equal for models whose adapters
        compute alike (see `adapters_differ`).
    """
    layers: dict[str, dict[str, Any]] = {}
    for path, x in leaves_with_paths(model, lambda x: isinstance(x, _ADAPTERS)):
        if isinstance(x, _ADAPTERS):
            layers[path] = {
                "kind": type(x).__name__,
                "rank": int(x.rank),
                "scale": float(x.scale),
                "dropout": float(x.dropout.p) if isinstance(x, LoRALinear) else 0.0,
            }
    if not layers:
        return None
    return {"summary": _summary(layers), "layers": layers}


def _setting(layer: dict[str, Any]) -> str:
    alpha = layer["scale"] * layer["rank"]
    return f"rank {layer['rank']}, alpha {alpha:.8g}, dropout {layer['dropout']:g}"


def _summary(layers: dict[str, dict[str, Any]]) -> str:
    """`blocks.*.attn.q_proj x2, blocks.*.attn.v_proj x2 (LoRALinear rank 4, alpha 8,
    dropout 0)`: the paths of each setting, layer indices folded, settings joined by `; `."""
    groups: dict[str, dict[str, int]] = {}
    for path, layer in layers.items():
        # Layer indices folded: a 32-layer model reads as one entry per projection.
        pattern = ".".join("*" if part.isdigit() else part for part in path.split("."))
        counts = groups.setdefault(f"{layer['kind']} {_setting(layer)}", {})
        counts[pattern] = counts.get(pattern, 0) + 1
    return "; ".join(
        ", ".join(f"{p} x{n}" if n > 1 else p for p, n in counts.items()) + f" ({setting})"
        for setting, counts in groups.items()
    )


def adapters_differ(saved: dict[str, Any] | None, now: dict[str, Any] | None) -> list[str]:
    """How two `adapters_record`s differ, one readable line per difference; [] if alike."""
    if saved == now:
        return []
    if saved is None or now is None:
        return [
            f"saved with {'no adapters' if saved is None else saved['summary']}, now "
            f"{'no adapters' if now is None else now['summary']}"
        ]
    old, new = saved["layers"], now["layers"]
    lines = []
    gone = [p for p in old if p not in new]
    added = [p for p in new if p not in old]
    if gone:
        lines.append(f"adapted when saved, not now: {_few(gone)}")
    if added:
        lines.append(f"adapted now, not when saved: {_few(added)}")
    changed = [p for p in old if p in new and old[p] != new[p]]
    lines += [
        f"{p}: saved {old[p]['kind']} {_setting(old[p])}, now {new[p]['kind']} {_setting(new[p])}"
        for p in changed[:3]
    ]
    if len(changed) > 3:
        lines.append(f"and {len(changed) - 3} more layers changed")
    return lines


def _few(paths: list[str]) -> str:
    return f"{paths[:6]}{f' and {len(paths) - 6} more' if len(paths) > 6 else ''}"
