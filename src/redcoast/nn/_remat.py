"""Rematerialisation: trade compute for memory by recomputing a function in the backward pass.

A policy says what a wrapped function keeps for the backward pass:

- `"none"`: everything its forward pass produces (no rematerialisation);
- `"dots"`: only matmul outputs without batch dimensions -- a transformer block's
  projections, not its attention scores -- and recomputes the rest;
- `"full"`: nothing but its inputs; the whole function runs again in the backward
  pass;
- `"attention"`: everything but attention's scores, softmax and weighted sum,
  which are recomputed from the queries, keys and values (Korthikanti et al.
  2022's selective recomputation: the activations that grow with the square of the
  sequence, for a few percent more compute).

The zoo's blocks take the policy as their model's `remat` field; a user's own
model opts in by wrapping its block call with `remat`, and for `"attention"` by
calling `rc.nn.attention(..., recompute=True)`.
"""

from collections.abc import Callable
from typing import Any, Literal, TypeVar

import equinox as eqx
import jax
from jaxtyping import Array

from .._checks import check_choice

RematPolicy = Literal["none", "dots", "full", "attention"]
"""What a rematerialised function keeps for the backward pass (see the module docstring)."""
REMAT_POLICIES: tuple[str, ...] = ("none", "dots", "full", "attention")

PROJECTION = "projection"
"""The `checkpoint_name` of a projection's output (`layers.dense`), which `"dots"` keeps
by name: the output itself, after the reshape that restores its token axes."""

_F = TypeVar("_F", bound=Callable[..., object])


def check_remat(policy: object) -> RematPolicy:
    """`policy` itself if it is one of `REMAT_POLICIES`, else a `ValueError` listing them
    and what each keeps: `check_remat("dots")` is `"dots"`."""
    return check_choice(
        "remat",
        policy,
        REMAT_POLICIES,
        "'full' recomputes each block in the backward pass, 'dots' keeps its matmul "
        "outputs, 'attention' all but attention's scores, 'none' keeps everything.",
    )


def remat(fn: _F, policy: str) -> _F:
    """`fn` under `jax.checkpoint` with a named policy: recompute it in the backward pass.

    Wrap the call of one layer (a transformer block) so that its activations are
    recomputed instead of stored between the forward and the backward pass: memory
    for activations then grows with the number of layers only through the layers'
    inputs. Arguments may be any pytrees (Equinox modules included); non-array
    leaves are static (`eqx.filter_checkpoint`).

    Args:
        fn: the function to rematerialise.
        policy: `"none"` returns `fn` itself; `"dots"` saves matmul outputs without
            batch dimensions (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`)
            and outputs named `PROJECTION` (the zoo's projections, `layers.dense`);
            `"full"` saves nothing inside `fn`; `"attention"` returns `fn` itself,
            since only the zoo's attention knows its score region (its models
            recompute it there).

    Returns:
        The wrapped function, same signature and results as `fn`.

    Raises:
        ValueError: an unknown policy.

    Example:
        >>> block_fn = rc.remat(lambda block, x: block(x), "full")
        >>> for block in model.blocks:
        ...     x = block_fn(block, x)
    """
    check_remat(policy)
    if policy in ("none", "attention"):
        return fn
    saveable = (
        jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            jax.checkpoint_policies.save_only_these_names(PROJECTION),
        )
        if policy == "dots"
        else jax.checkpoint_policies.nothing_saveable
    )
    return eqx.filter_checkpoint(fn, policy=saveable)  # type: ignore[return-value]


def recomputed(fn: Callable[..., Array], recompute: bool) -> Callable[..., Array]:
    """`fn`, or `fn` recomputed in the backward pass from its inputs (`recompute`).

    An attention layer's score region (scores, softmax, weighted sum) runs through it,
    so that remat's `"attention"` policy keeps the queries, keys and values and not
    the `heads x seq x seq` arrays between them. It is a `jax.custom_vjp` whose
    residuals are the inputs, not a nested `jax.checkpoint`: a checkpoint around the
    whole block (FSDP's, which recomputes gathered weights) decides what to keep of
    everything traced inside it, nested checkpoints included, and would keep the
    scores again.
    """
    if not recompute:
        return fn

    @jax.custom_vjp
    def run(*args: Any) -> Array:
        return fn(*args)

    def forward(*args: Any) -> tuple[Array, tuple[Any, ...]]:
        return fn(*args), args

    def backward(args: tuple[Any, ...], grad: Array) -> tuple[Any, ...]:
        return jax.vjp(fn, *args)[1](grad)

    run.defvjp(forward, backward)
    return run
