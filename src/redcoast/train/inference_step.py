"""Eval and predict steps: `loss_fn` and `pred_fn` under inference mode, pure and jitted.

Like the train step they see the *global* batch; evaluation computes each
example's loss on a batch of that one example, so padding rows weigh nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..parallel._parallelism import ContextOption, Parallelism, SequenceOption, with_parallelism
from .precision import check_precision, for_compute
from .step import LossFn, PredFn, batch_size, describe_shapes, split_loss


def _eval(
    loss_fn: LossFn,
    model: Any,
    batch: Any,
    key: Any,
    weights: Float[Array, " batch"] | None = None,
    *,
    precision: str = "fp32",
    parallelism: Parallelism | None = None,
) -> dict[str, Array]:
    """`loss_fn` per example under inference mode; the weighted means and the weight."""
    model = for_compute(eqx.nn.inference_mode(model), precision)
    size = batch_size(batch)
    with (parallelism or Parallelism()).applied(model, batch) as (model, batch):

        def one(example: Any) -> tuple[Array, dict[str, Array]]:
            single = jax.tree.map(lambda x: x[None], example)
            return split_loss(loss_fn(model, single, key), single)

        losses, aux = jax.vmap(one)(batch)
    w = jnp.ones(size, jnp.float32) if weights is None else weights.astype(jnp.float32)
    total = w.sum()
    denom = jnp.maximum(total, jnp.finfo(jnp.float32).tiny)
    out = {"loss": (w * losses).sum() / denom, "weight": total}
    out.update({k: (w * v).sum() / denom for k, v in aux.items()})
    return out


def _eval_first(
    loss_fn: LossFn,
    model: Any,
    batch: Any,
    key: Any,
    n_valid: Int[Array, ""],
    *,
    precision: str = "fp32",
    parallelism: Parallelism | None = None,
) -> dict[str, Array]:
    """`_eval` counting only the first `n_valid` rows; the rest is padding."""
    weights = (jnp.arange(batch_size(batch)) < n_valid).astype(jnp.float32)
    return _eval(loss_fn, model, batch, key, weights, precision=precision, parallelism=parallelism)


def _predict(
    pred_fn: PredFn,
    model: Any,
    batch: Any,
    key: Any,
    *,
    precision: str = "fp32",
    parallelism: Parallelism | None = None,
) -> Any:
    """`pred_fn` under inference mode, its output checked for the batch axis."""
    size = batch_size(batch)
    model = for_compute(eqx.nn.inference_mode(model), precision)
    with (parallelism or Parallelism()).applied(model, batch) as (model, batch):
        out = pred_fn(model, batch, key)
    leaves = jax.tree_util.tree_leaves(out)
    if not leaves or any(jnp.ndim(x) == 0 or jnp.shape(x)[0] != size for x in leaves):
        raise ValueError(
            f"pred_fn must return a pytree of arrays with the batch on the leading axis; "
            f"for a batch of {size} ({describe_shapes(batch)}) it returned {describe_shapes(out)}."
        )
    return out


# Jitted once here, with the callback as a static argument: every step built for the
# same loss_fn / pred_fn shares one compilation cache, so calling `predict` (or
# building an eval step) again does not compile again.
_jit_eval = eqx.filter_jit(_eval)
jit_eval_first = eqx.filter_jit(_eval_first)
_jit_predict = eqx.filter_jit(_predict)


def eval_step(
    loss_fn: LossFn,
    *,
    precision: str = "fp32",
    sequence_parallel: SequenceOption = False,
    context_parallel: ContextOption = False,
    parallelism: Parallelism | None = None,
    jit: bool = True,
) -> Callable[..., dict[str, Array]]:
    """An evaluation step: `loss_fn` per example under `eqx.nn.inference_mode`.

    Each example's loss is `loss_fn` on a batch of that one example, so padding rows
    can be weighted out exactly and batches of different fill combine correctly:
    `sum(m["loss"] * m["weight"]) / sum(m["weight"])` over batches.

    Args:
        loss_fn: as for `train_step`.
        precision: `"fp32"`, or `"bf16"` / `"pure-bf16"`: `loss_fn` sees the model's
            floating arrays cast to bfloat16; the metrics are float32.
        sequence_parallel: as for `train_step`.
        context_parallel: as for `train_step`.
        parallelism: as for `train_step`.
        jit: wrap the step in `eqx.filter_jit` (no donation); steps of the same
            `loss_fn` share their compilations.

    Returns:
        `(model, batch, key, weights=None) -> metrics` with `loss` (and each aux
        scalar) the `weights`-weighted mean over the batch, and `weight` the sum of
        the weights (the batch size when `weights` is None).

    Example:
        >>> evaluate = eval_step(loss_fn)
        >>> evaluate(model, batch, jax.random.key(0))["loss"]
    """
    check_precision(precision)
    step = functools.partial(_jit_eval if jit else _eval, loss_fn, precision=precision)
    options = {"sequence_parallel": sequence_parallel, "context_parallel": context_parallel}
    return with_parallelism(step, **options, mesh=None, given=parallelism)


def predict_step(
    pred_fn: PredFn,
    *,
    precision: str = "fp32",
    sequence_parallel: SequenceOption = False,
    context_parallel: ContextOption = False,
    parallelism: Parallelism | None = None,
    jit: bool = True,
) -> Callable[..., Any]:
    """A prediction step: `pred_fn` under `eqx.nn.inference_mode`, output checked.

    Args:
        pred_fn: `(model, batch, key) -> pytree of arrays`, each with the batch on the
            leading axis.
        precision: `"fp32"`, or `"bf16"` / `"pure-bf16"`: `pred_fn` sees the model's
            floating arrays cast to bfloat16.
        sequence_parallel: as for `train_step`.
        context_parallel: as for `train_step` (the uncached forward; generation runs
            its cached steps without it).
        parallelism: as for `train_step`.
        jit: wrap the step in `eqx.filter_jit` (no donation); steps of the same
            `pred_fn` share their compilations.

    Returns:
        `(model, batch, key) -> predictions`.

    Example:
        >>> predict = predict_step(lambda m, b, k: jax.vmap(m)(b["x"]).argmax(-1))
        >>> labels = predict(model, batch, jax.random.key(0))
    """
    check_precision(precision)
    step = functools.partial(_jit_predict if jit else _predict, pred_fn, precision=precision)
    options = {"sequence_parallel": sequence_parallel, "context_parallel": context_parallel}
    return with_parallelism(step, **options, mesh=None, given=parallelism)
