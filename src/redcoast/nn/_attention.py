"""`attention`: scaled dot-product attention, for the zoo and for a user's own model.

One entry point for every way a model attends: causal or with a mask, a sliding
window (Mistral, Gemma), soft-capped scores (Gemma 2), documents packed into one
row kept apart by segment ids, grouped-query heads, an additive bias (T5), and
recomputed in the backward pass under remat's `"attention"` policy. Inside a step
given context parallelism it runs over the split sequence.
"""

import functools
import math

import jax
import jax.numpy as jnp
from einops import repeat
from jaxtyping import Array, Bool, Float, Int

from ..parallel import _active
from ._remat import recomputed

__all__ = ["attention"]


def _scores_softmax_values(
    q: Array,
    k: Array,
    v: Array,
    visible: Array | None,
    bias: Array | None,
    scale: float | None,
    softcap: float | None,
) -> Array:
    scores = jnp.einsum("...thd,...shd->...hts", q, k)
    # Dividing by the root when no scale is given keeps the decoders' arithmetic exactly.
    scores = scores / math.sqrt(q.shape[-1]) if scale is None else scores * scale
    # Softmax in float32 whatever the weights' dtype, as every HF implementation does.
    scores = scores.astype(jnp.float32)
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.astype(jnp.float32)
    if visible is not None:
        scores = jnp.where(visible[..., None, :, :], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("...hts,...shd->...thd", weights, v)


def _visible(
    seq: int,
    kv_seq: int,
    *,
    causal: bool,
    window: int | None,
    mask: Array | None,
    segment_ids: Array | None,
    kv_segment_ids: Array | None,
) -> Array | None:
    """Which keys each query sees, `(*batch, seq, kv_seq)`, or None for all of them."""
    visible = mask
    q_pos, k_pos = jnp.arange(seq)[:, None], jnp.arange(kv_seq)[None, :]
    if causal:
        visible = _and(visible, k_pos <= q_pos)
    if window is not None:
        visible = _and(visible, k_pos > q_pos - window)
    if segment_ids is not None:
        theirs = segment_ids if kv_segment_ids is None else kv_segment_ids
        visible = _and(visible, segment_ids[..., :, None] == theirs[..., None, :])
    return visible


def _and(a: Array | None, b: Array) -> Array:
    return b if a is None else a & b


def attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch kv_seq kv_heads head_dim"],
    v: Float[Array, "*batch kv_seq kv_heads head_dim"],
    *,
    causal: bool = False,
    mask: Bool[Array, "*batch seq kv_seq"] | None = None,
    window: int | None = None,
    segment_ids: Int[Array, "*batch seq"] | None = None,
    kv_segment_ids: Int[Array, "*batch kv_seq"] | None = None,
    bias: Float[Array, "*#batch heads seq kv_seq"] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    recompute: bool = False,
) -> Float[Array, "*batch seq heads head_dim"]:
    """Scaled dot-product attention, split over the sequence when a step asks for it.

    `softmax(cap(q k^T * scale) + bias)` over the visible keys, times `v`, with the
    scores and the softmax in float32 whatever the inputs' dtype (queries that see no
    key average every value, as a softmax over equal scores does). Key/value heads
    fewer than the query heads serve `heads // kv_heads` consecutive query heads
    each (grouped-query attention).

    Inside a step given context parallelism (`rc.ContextParallel`), causal attention
    with no mask or bias runs as `rc.context_parallel_attention` over the split
    sequence, so no device holds every token; anything else it cannot split is an
    error naming what to use instead.

    Args:
        q: queries, split into heads.
        k: keys.
        v: values.
        causal: each query sees its own and earlier positions (needs `seq == kv_seq`).
        mask: which keys each query sees, `(seq, kv_seq)`; with the other options, a
            key must pass all of them.
        window: with `causal`, each query sees only the `window` most recent
            positions, its own included (Mistral's `sliding_window`).
        segment_ids: which document each query belongs to: a query sees keys of its
            own document only (documents packed into one row).
        kv_segment_ids: the keys' documents, when they are not the queries' own.
        bias: added to the scores (T5's relative positions).
        scale: multiplies the scores; default: divides them by `sqrt(head_dim)`.
        softcap: scores become `softcap * tanh(scores / softcap)` (Gemma 2).
        recompute: keep only `q`, `k` and `v` for the backward pass and compute the
            scores again there (remat's `"attention"` policy).

    Returns:
        The attention output, shaped as `q`.

    Raises:
        ValueError: heads that do not group, `causal` with `seq != kv_seq`, a
            `window` without `causal`, segment ids that do not match the sequence,
            or, under context parallelism, an option it cannot split.

    Example:
        >>> q = k = v = jnp.ones((10, 4, 8))   # (seq, heads, head_dim)
        >>> attention(q, k, v, causal=True, window=4).shape
        (10, 4, 8)
    """
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if heads % kv_heads:
        raise ValueError(
            f"attention: {heads} query heads cannot share {kv_heads} key/value heads; the "
            "query heads must be a multiple of the key/value heads."
        )
    seq, kv_seq = q.shape[-3], k.shape[-3]
    if causal and seq != kv_seq:
        raise ValueError(
            f"attention: causal=True needs as many keys as queries; got {seq} queries and "
            f"{kv_seq} keys. Pass a mask for attention to a cache."
        )
    if window is not None and (not causal or window < 1):
        raise ValueError(
            f"attention: window={window!r} is a sliding window over the past: it needs "
            "causal=True and a positive number of positions."
        )
    if segment_ids is not None and segment_ids.shape[-1] != seq:
        raise ValueError(
            f"attention: segment_ids of shape {segment_ids.shape} do not match the {seq} "
            "queries; give one segment id per token."
        )
    if kv_segment_ids is not None and kv_segment_ids.shape[-1] != kv_seq:
        raise ValueError(
            f"attention: kv_segment_ids of shape {kv_segment_ids.shape} do not match the "
            f"{kv_seq} keys; give one segment id per key."
        )
    if segment_ids is None and kv_segment_ids is not None:
        raise ValueError("attention: kv_segment_ids needs the queries' segment_ids too.")
    if segment_ids is not None and kv_segment_ids is None and seq != kv_seq:
        raise ValueError(
            f"attention: segment_ids for {seq} queries and {kv_seq} keys; pass the keys' "
            "own as kv_segment_ids."
        )
    active = _active.current()
    if active is not None:
        active.attention_calls += 1
        if active.context is not None:
            if mask is not None or bias is not None or not causal:
                raise ValueError(
                    "context parallelism splits causal attention within one sequence; this "
                    "attention takes a (query, key) mask or bias (an encoder-decoder's "
                    "padding, relative positions, or attention to another sequence), which "
                    "it cannot split. Train such a model with sequence_parallel=True over "
                    "the model axis instead."
                )
            unsplit = {"window": window, "softcap": softcap, "segment_ids": segment_ids}
            asked = [name for name, value in unsplit.items() if value is not None]
            if asked:
                raise ValueError(
                    f"context parallelism does not yet split attention with {', '.join(asked)}; "
                    "train without context_parallel, or with sequence_parallel=True."
                )
            return active.context.attend(q, k, v)
    if heads != kv_heads:
        group = heads // kv_heads
        k = repeat(k, "... s h d -> ... s (h g) d", g=group)
        v = repeat(v, "... s h d -> ... s (h g) d", g=group)
    visible = _visible(
        seq,
        kv_seq,
        causal=causal,
        window=window,
        mask=mask,
        segment_ids=segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    fn = functools.partial(_scores_softmax_values, scale=scale, softcap=softcap)
    return recomputed(fn, recompute)(q, k, v, visible, bias)
