"""The causal language-modelling loss, with a mask of the tokens it counts.

Rows come as `rc.text.packed` / `rc.text.padded` make them: `input_ids` and a
`loss_mask` marking the tokens whose prediction counts (a completion, not its
prompt or padding). Token `t` is predicted from the tokens before it, so the loss
at `t` is counted when `loss_mask[t]` is true. Packed rows also carry
`segment_ids` and `positions` (each document attends to itself alone, its
positions restarting at 0), which the model is given; the first token of a
document is then not predicted from the end of the one before it.
"""

from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..nn._loss import cross_entropy, map_logits
from .moe import SparseMoE, load_balancing_loss, router_z_loss, routing_metrics

ArrayLike = Array | np.ndarray


def next_token_nll(
    model: Callable[[Int[Array, " seq"]], Float[Array, "seq vocab"]],
    input_ids: Int[ArrayLike, "batch seq"],
    loss_mask: Bool[ArrayLike, "batch seq"] | None = None,
    *,
    segment_ids: Int[ArrayLike, "batch seq"] | None = None,
    positions: Int[ArrayLike, "batch seq"] | None = None,
    pixel_values: Float[ArrayLike, "batch images channels height width"] | None = None,
    chunk_tokens: int | Literal["auto"] | None = None,
) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
    """Each row's summed next-token negative log-likelihood, and how many tokens it counts.

    With `chunk_tokens`, the zoo's decoders score a row's tokens a chunk at a time
    (`rc.nn.map_logits`): at Llama 3's 128,256-token vocabulary and 4,096 tokens,
    `"auto"` makes a LoRA step's float32 logits and their gradient (2.1 GB each) 16
    chunks' (`scripts/bench_chunked_loss.py`).

    Args:
        model: a decoder called on one sequence of ids, returning `(seq, vocab)` logits
            (the zoo's `GPT2`, `Llama`, `OPT`, `GPTJ`, or a model of one's own); with
            `segment_ids` or `positions` it is called with them as keywords.
        input_ids: the rows.
        loss_mask: which tokens count as targets; all but the first of each row when
            omitted.
        segment_ids: which document each token belongs to (packed rows); a token
            whose document differs from the one before it is not a target.
        positions: each token's position within its document.
        pixel_values: each row's images, for a vision-language model (`rc.models.Llava`),
            called with them as a keyword.
        chunk_tokens: tokens of a row whose logits are computed at once, each chunk's
            again in the backward pass (see `rc.nn.map_logits`); `"auto"`: chosen by
            the vocabulary and length; None (default): the whole rows at once.

    Returns:
        `(nll, count)`, each `(batch,)` and float32: perplexity over rows is
        `exp(nll.sum() / count.sum())`.

    Example:
        >>> nll, n = next_token_nll(model, batch["input_ids"], batch["loss_mask"])
    """
    ids = jnp.asarray(input_ids)
    extra = {
        name: jnp.asarray(given)
        for name, given in (("segment_ids", segment_ids), ("positions", positions))
        if given is not None
    }
    for name, given in extra.items():
        if given.shape != ids.shape:
            raise ValueError(
                f"next_token_nll: {name} of shape {given.shape} do not match input_ids of "
                f"shape {ids.shape}; give one per token."
            )
    if pixel_values is not None:
        pixels = jnp.asarray(pixel_values)
        if pixels.shape[:1] != ids.shape[:1]:
            raise ValueError(
                f"next_token_nll: pixel_values of shape {pixels.shape} for {ids.shape[0]} rows; "
                "give each row its images, (batch, images, channels, height, width)."
            )
        extra["pixel_values"] = pixels
    # The model reads whole rows, a length that splits evenly over devices (context
    # parallelism) and is the one the rows were made with. Position t is scored on token
    # t + 1 in float32, the zoo's logits a chunk of tokens at a time at large
    # vocabularies (the planner compiles the same).
    labels = jnp.roll(ids, -1, axis=1)
    nll = map_logits(model, ids, cross_entropy, labels, extra=extra, chunk_tokens=chunk_tokens)
    return _counted(nll, ids, loss_mask, extra.get("segment_ids"))


def _counted(
    nll: Float[Array, "batch seq"],
    ids: Int[Array, "batch seq"],
    loss_mask: Bool[ArrayLike, "batch seq"] | None,
    segment_ids: Int[Array, "batch seq"] | None = None,
) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
    # The last position, which has no next token, counts for nothing.
    counted = jnp.ones(ids.shape, bool) if loss_mask is None else jnp.asarray(loss_mask, bool)
    has_next = jnp.arange(ids.shape[1]) < ids.shape[1] - 1
    if segment_ids is not None:  # a document's first token is not predicted from another's
        has_next = has_next & (segment_ids == jnp.roll(segment_ids, -1, axis=1))
    weight = (jnp.roll(counted, -1, axis=1) & has_next).astype(jnp.float32)
    return jnp.where(weight > 0, nll, 0.0).sum(-1), weight.sum(-1)


def lm_loss(
    model: Callable[[Int[Array, " seq"]], Float[Array, "seq vocab"]],
    batch: Mapping[str, Any],
    key: PRNGKeyArray | None = None,
    *,
    chunk_tokens: int | Literal["auto"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """The mean next-token cross-entropy over the counted tokens of a batch: a `loss_fn`.

    Args:
        model: as for `next_token_nll`.
        batch: `{"input_ids": (batch, seq)}` and optionally `"loss_mask"`,
            `"segment_ids"` and `"positions"` (`rc.text.collate` of `rc.text` rows),
            and a vision-language model's `"pixel_values"` (`rc.vision.collate`).
        key: unused (the zoo's decoders have no dropout); there for `fit`'s signature.
        chunk_tokens: as for `next_token_nll` (`functools.partial(lm_loss,
            chunk_tokens="auto")` is a `loss_fn` that scores the logits in chunks).

    Returns:
        `(loss, {"tokens": the number of tokens counted})`.

    Example:
        >>> rc.fit(model, opt, rows, collate_fn=rc.text.collate, loss_fn=rc.models.lm_loss, ...)
    """
    del key
    nll, count = next_token_nll(
        model,
        batch["input_ids"],
        batch.get("loss_mask"),
        segment_ids=batch.get("segment_ids"),
        positions=batch.get("positions"),
        pixel_values=batch.get("pixel_values"),
        chunk_tokens=chunk_tokens,
    )
    total = count.sum()
    return nll.sum() / jnp.maximum(total, 1.0), {"tokens": total}


def moe_lm_loss(
    model: Any,
    batch: Mapping[str, Any],
    key: PRNGKeyArray | None = None,
    *,
    router_z_loss_coef: float = 0.0,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """`lm_loss` plus the routers' load-balancing loss of a mixture of experts: a `loss_fn`.

    `lm_loss + router_aux_loss_coef * load_balancing_loss`, what `transformers`'
    `MixtralForCausalLM` (and `Qwen3MoeForCausalLM`) returns as its loss with
    `output_router_logits=True`; a config without `router_aux_loss_coef` (DeepSeek-V3,
    balanced by its routers' bias instead) adds none and reports none. Every token of
    the batch counts in the balance (a batch's `"attention_mask"`, when it has one,
    says which), whatever its `loss_mask`. `router_z_loss_coef` adds ST-MoE's router z-loss
    (`functools.partial(moe_lm_loss, router_z_loss_coef=1e-3)`).

    Args:
        model: a model with experts (`rc.models.Mixtral`, LoRA-adapted or not).
        batch: as for `lm_loss`.
        key: unused.
        router_z_loss_coef: the weight of `router_z_loss`.

    Returns:
        `(loss, metrics)`: the tokens counted, `aux_loss` (the load-balancing loss, with
        a coefficient),
        `z_loss` with a coefficient, and `routing_metrics` of the batch (how evenly the
        experts were chosen; with a capacity dispatch, the share of routings dropped).

    Example:
        >>> rc.fit(mixtral, opt, rows, collate_fn=rc.text.collate,
        ...        loss_fn=rc.models.moe_lm_loss, ...)
    """
    del key
    ids = jnp.asarray(batch["input_ids"])
    extra = {k: jnp.asarray(batch[k]) for k in ("positions", "segment_ids") if k in batch}
    logits, router, chosen = jax.vmap(lambda ids, extra: model.with_routing(ids, **extra))(
        ids, extra
    )
    nll = cross_entropy(logits, jnp.roll(ids, -1, axis=1))
    nll, count = _counted(nll, ids, batch.get("loss_mask"), extra.get("segment_ids"))
    total = count.sum()
    n_experts, top_k = model.config.experts
    mask = batch.get("attention_mask")
    loss = nll.sum() / jnp.maximum(total, 1.0)
    metrics = {"tokens": total}
    coef = getattr(model.config, "router_aux_loss_coef", None)
    if coef is not None:
        aux = load_balancing_loss(router, top_k, mask)
        loss = loss + coef * aux
        metrics["aux_loss"] = aux
    if router_z_loss_coef:
        z = router_z_loss(router, None if mask is None else jnp.asarray(mask)[:, None, :])
        loss = loss + router_z_loss_coef * z
        metrics["z_loss"] = z
    capacity = _capacity(model)
    metrics |= routing_metrics(chosen, n_experts, capacity_factor=capacity)
    return loss, metrics


def _capacity(model: Any) -> float | None:
    """The capacity factor the model's mixtures dispatch with, or None (dropless, dense)."""
    for leaf in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, SparseMoE)):
        if isinstance(leaf, SparseMoE) and not isinstance(leaf.dispatch, str):
            return float(leaf.dispatch)
    return None
