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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

ArrayLike = Array | np.ndarray


def next_token_nll(
    model: Callable[[Int[Array, " seq"]], Float[Array, "seq vocab"]],
    input_ids: Int[ArrayLike, "batch seq"],
    loss_mask: Bool[ArrayLike, "batch seq"] | None = None,
    *,
    segment_ids: Int[ArrayLike, "batch seq"] | None = None,
    positions: Int[ArrayLike, "batch seq"] | None = None,
) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
    """Each row's summed next-token negative log-likelihood, and how many tokens it counts.

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
    # The model reads whole rows, a length that splits evenly over devices (context
    # parallelism) and is the one the rows were made with; position t is scored on
    # token t + 1, and the last position, which has no next token, counts for nothing.
    logits = jax.vmap(lambda ids, extra: model(ids, **extra))(ids, extra)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.roll(ids, -1, axis=1))
    counted = jnp.ones(ids.shape, bool) if loss_mask is None else jnp.asarray(loss_mask, bool)
    has_next = jnp.arange(ids.shape[1]) < ids.shape[1] - 1
    if "segment_ids" in extra:  # a document's first token is not predicted from another's
        seg = extra["segment_ids"]
        has_next = has_next & (seg == jnp.roll(seg, -1, axis=1))
    weight = (jnp.roll(counted, -1, axis=1) & has_next).astype(jnp.float32)
    return jnp.where(weight > 0, nll, 0.0).sum(-1), weight.sum(-1)


def lm_loss(
    model: Callable[[Int[Array, " seq"]], Float[Array, "seq vocab"]],
    batch: Mapping[str, Any],
    key: PRNGKeyArray | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """The mean next-token cross-entropy over the counted tokens of a batch: a `loss_fn`.

    Args:
        model: as for `next_token_nll`.
        batch: `{"input_ids": (batch, seq)}` and optionally `"loss_mask"`,
            `"segment_ids"` and `"positions"` (`rc.text.collate` of `rc.text` rows).
        key: unused (the zoo's decoders have no dropout); there for `fit`'s signature.

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
    )
    total = count.sum()
    return nll.sum() / jnp.maximum(total, 1.0), {"tokens": total}
