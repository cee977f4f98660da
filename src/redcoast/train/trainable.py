"""Which arrays of a model train: an Equinox-style filter resolved to a tree of bools.

Training part of a model (a LoRA adapter, the head of a classifier) means the
step differentiates, and the optimizer keeps state for and updates, only the
trainable arrays; the frozen ones pass through the step untouched. The step
splits the model with `eqx.partition` on the mask this module computes, so
frozen arrays get no gradient, no optimizer moments and no weight decay.

A filter is one of:

- `None`: every floating-point array (training the whole model);
- a predicate on leaves (`eqx.is_inexact_array`), or a pytree of bools or
  predicates matching a prefix of the model, as `eqx.partition` takes them;
- a path glob (`"*.q_proj.*"`) or a sequence of them, matched with `fnmatch`
  against the dotted paths that `rc.sharding_plan` reports
  (`blocks.0.attn.q_proj.weight`).

Only floating-point arrays can train: integer arrays and everything that is not
an array stay frozen whatever the filter says. A quantized Linear (`rc.quantize`)
is frozen too: `None` leaves it out, and a filter that selects its scales is an
error.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import equinox as eqx
import jax
from jaxtyping import PyTree

from .._tree_paths import path_str
from ..nn import AbstractQuantized

Trainable = str | Sequence[str] | Callable[[Any], bool] | PyTree | None
"""What `fit(trainable=...)` and `train_step(trainable=...)` accept (see the module docstring)."""


class _Frozen:
    """What a leaf the filter leaves out is replaced with, told apart from any leaf."""


_FROZEN = _Frozen()


def _is_globs(trainable: Any) -> TypeGuard[str | Sequence[str]]:
    if isinstance(trainable, str):
        return True
    return (
        isinstance(trainable, list | tuple)
        and len(trainable) > 0
        and all(isinstance(g, str) for g in trainable)
    )


def _glob_mask(model: PyTree, globs: Sequence[str]) -> PyTree:
    flat, treedef = jax.tree_util.tree_flatten_with_path(model)
    paths = [path_str(p) for p, _ in flat]
    floating = [eqx.is_inexact_array(x) for _, x in flat]
    unmatched = [
        g
        for g in globs
        if not any(ok and fnmatch.fnmatchcase(p, g) for p, ok in zip(paths, floating, strict=True))
    ]
    if unmatched:
        examples = [p for p, ok in zip(paths, floating, strict=True) if ok][:4]
        raise ValueError(
            f"trainable glob(s) {unmatched} match no floating-point array of the model. Globs "
            f"are matched against dotted paths such as {examples}; e.g. '*.q_proj.*' selects "
            "every q_proj's weight and bias."
        )
    mask = [
        ok and any(fnmatch.fnmatchcase(p, g) for g in globs)
        for p, ok in zip(paths, floating, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, mask)


def trainable_mask(model: PyTree, trainable: Trainable = None) -> PyTree:
    """A tree of bools shaped like `model`: True for each array that trains.

    Args:
        model: an Equinox model.
        trainable: a filter (see the module docstring); `None` selects every
            floating-point array.

    Returns:
        A pytree with the structure of `model`, a bool in place of each leaf; pass
        it to `eqx.partition` / `eqx.filter`.

    Raises:
        ValueError: a glob matches no floating-point array (the message shows the
            paths globs are matched against), or the filter selects nothing.
        TypeError: `trainable` is none of the accepted kinds.

    Example:
        >>> mask = rc.trainable_mask(model, "*.q_proj.*")
        >>> opt_state = optimizer.init(eqx.filter(model, mask))
    """
    if trainable is None:
        mask = jax.tree.map(eqx.is_inexact_array, model)
    elif _is_globs(trainable):
        globs = [trainable] if isinstance(trainable, str) else list(trainable)
        mask = _glob_mask(model, globs)
    else:
        try:
            kept = eqx.filter(model, trainable, replace=_FROZEN)
        except (ValueError, TypeError) as err:
            raise TypeError(
                "trainable must be None, a path glob or a sequence of globs, a predicate on "
                "leaves, or a pytree of bools/predicates matching the model's structure (as "
                f"eqx.partition takes); got {type(trainable).__name__}: {err}"
            ) from err
        mask = jax.tree.map(lambda x: x is not _FROZEN and eqx.is_inexact_array(x), kept)
    mask = _quantized_frozen(model, mask, explicit=trainable is not None)
    if not any(jax.tree_util.tree_leaves(mask)):
        raise ValueError(
            "trainable selects no floating-point array of the model, so there is nothing to "
            "train. Check the filter (frozen arrays are those it leaves out)."
        )
    return mask


def _quantized_frozen(model: PyTree, mask: PyTree, *, explicit: bool) -> PyTree:
    """`mask` with every quantized Linear's arrays frozen; a filter that names them fails."""
    picked: list[str] = []

    def freeze(kp: Any, m: Any, x: Any) -> Any:
        if not isinstance(x, AbstractQuantized):
            return m
        if any(jax.tree_util.tree_leaves(m)):
            picked.append(path_str(kp))
        return jax.tree.map(lambda _: False, m)

    is_quantized = lambda x: isinstance(x, AbstractQuantized)  # noqa: E731
    frozen = jax.tree_util.tree_map_with_path(freeze, mask, model, is_leaf=is_quantized)
    if picked and explicit:
        raise ValueError(
            f"trainable selects arrays of the quantized Linears {picked[:6]}"
            f"{' ...' if len(picked) > 6 else ''}: their codes and scales are a frozen base and "
            "never train. Train adapters on them (rc.lora.apply, then "
            "trainable=rc.lora.trainable(model)), or dequantize what should train "
            "(layer.dequantized()) before training it."
        )
    return frozen


def frozen_mask(model: PyTree, mask: PyTree) -> PyTree:
    """True for each array of `model` that `mask` leaves frozen (integer ones too: the
    codes of a quantized base).

    Args:
        model: an Equinox model.
        mask: from `trainable_mask`.

    Returns:
        A tree of bools shaped like `model`.
    """
    return jax.tree.map(lambda x, m: eqx.is_array(x) and not m, model, mask)
