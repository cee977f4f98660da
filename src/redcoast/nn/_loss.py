"""Softmax cross-entropy in float32 that keeps no float32 copy of the logits, and the
logits of a batch a chunk of tokens at a time."""

from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._checks import typechecked

__all__ = ["CHUNK_ABOVE", "CHUNK_LOGITS", "SplitHead", "cross_entropy", "map_logits"]


@typechecked
def cross_entropy(
    logits: Float[Array, "*batch vocab"], labels: Int[Array, "*batch"]
) -> Float[Array, "*batch"]:
    """Softmax cross-entropy of integer `labels`, in float32 from logits of any float dtype.

    The values and gradients of `optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), labels)`. The label's logit is picked by a sum over the
    vocabulary (every other term 0, so exact) rather than a gather: a reduction, which
    the compilers fuse with the conversion to float32 and the normalizer's, so no
    float32 copy of the `(..., vocab)` logits is kept. Gathered from the converted
    logits, the TPU compiler keeps that copy (4 bytes a logit, 1 GB for 4 x 2048 tokens
    of a 32000-token vocabulary) beside the bfloat16 logits. `rc.models.lm_loss` and
    the planner's losses use it.

    Args:
        logits: unnormalised scores, the vocabulary last.
        labels: the right class of each position, in `[0, vocab)`.

    Returns:
        The negative log-likelihood of each label, float32, of `labels`' shape.

    Raises:
        jaxtyping.TypeCheckError: labels whose shape is not the logits' without the
            vocabulary (naming the parameter and both shapes).

    Example:
        >>> nll = rc.nn.cross_entropy(logits, ids[:, 1:]).mean()
    """
    x = logits.astype(jnp.float32)
    label = jnp.where(labels[..., None] == jnp.arange(x.shape[-1]), x, 0.0).sum(-1)
    return jax.nn.logsumexp(x, axis=-1) - label


# `map_logits(..., chunk_tokens="auto")` cuts a row into chunks when its logits are more
# than `CHUNK_ABOVE` float32 numbers (512 MiB: 1,047 tokens of Llama 3's 128,256-token
# vocabulary, 4,097 of a 32,000-token one), each chunk holding at most `CHUNK_LOGITS` of
# them (128 MiB: 256 tokens of Llama 3's vocabulary). Below, the logits are a small part
# of a step's memory and the recomputation in the backward pass costs more than it saves.
CHUNK_ABOVE = 2**27
CHUNK_LOGITS = 2**25


@runtime_checkable
class SplitHead(Protocol):
    """A language model whose logits are `output_head()(hidden(ids))` (the zoo's
    decoders): `map_logits` then computes the logits a few tokens at a time."""

    def __call__(self, input_ids: Array, **extra: Array) -> Array: ...

    def hidden(self, input_ids: Array, **extra: Array) -> Array: ...

    def output_head(self) -> Callable[[Array], Array]: ...


def map_logits(
    model: Callable[..., Array],
    input_ids: Int[Array, "batch seq"],
    fn: Callable[..., Any],
    *per_token: Array,
    extra: Mapping[str, Array] | None = None,
    chunk_tokens: int | Literal["auto"] | None = None,
) -> Any:
    """`fn(logits, *per_token)` of a batch's logits, with `chunk_tokens` never holding the
    whole vocabulary's logits of every token.

    With `chunk_tokens`, a model with `hidden` and `output_head` (`SplitHead`: the zoo's
    decoders) runs its blocks once; then `fn` gets the logits of a chunk of each row's
    tokens at a time (`lax.map`), and the backward pass computes each chunk's logits
    again rather than keeping them (`jax.checkpoint`): the largest activation of a
    language model's loss at a large vocabulary, `(tokens, vocab)` float32, shrinks to a
    chunk's. A chunk holds every `n`-th token of each row (tokens `k, k + n, ...`): a
    row split into contiguous blocks over devices gives each device its share of every
    chunk. Under tensor parallelism the vocabulary stays split, as the whole logits are.
    Any other model is called on the whole batch and `fn` gets all its logits at once.
    The values are the same either way, as long as `fn` treats each token on its own (a
    per-token loss, a log-probability).

    Args:
        model: called on one row of ids (vmapped here), with `extra` as keywords.
        input_ids: `(batch, seq)`.
        fn: `(logits (batch, tokens, vocab), *per_token of those tokens) -> outputs`,
            each output `(batch, tokens, ...)`.
        *per_token: arrays `(batch, seq, ...)` that `fn` reads beside the logits (the
            labels), cut into the same chunks.
        chunk_tokens: tokens of a row in each chunk; `"auto"`: the whole row when its
            logits are at most `CHUNK_ABOVE` (2**27) numbers, else as few chunks as keep
            each within `CHUNK_LOGITS` (2**25); None (default) or 0: the whole batch's
            logits at once.
        extra: `(batch, seq)` keywords of the model (`positions`, `segment_ids`).

    Returns:
        `fn`'s outputs for every token, `(batch, seq, ...)` each.

    Example:
        >>> labels = jnp.roll(ids, -1, axis=1)
        >>> nll = rc.nn.map_logits(model, ids, rc.nn.cross_entropy, labels, chunk_tokens=256)
    """
    ids, extra = jnp.asarray(input_ids), dict(extra or {})
    if chunk_tokens not in (None, "auto") and (
        isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 0
    ):
        raise ValueError(
            f"chunk_tokens must be an int >= 0 (0: not chunked), 'auto' or None, got "
            f"{chunk_tokens!r}."
        )
    if not isinstance(model, SplitHead) or not chunk_tokens:
        return fn(jax.vmap(lambda i, e: model(i, **e))(ids, extra), *per_token)
    hidden = jax.vmap(lambda i, e: model.hidden(i, **e))(ids, extra)
    head = model.output_head()
    batch, seq = ids.shape
    vocab = jax.eval_shape(head, hidden[0, :1]).shape[-1]
    n = _chunks(seq, vocab, chunk_tokens)
    if n == 1:
        return fn(head(hidden), *per_token)
    pad = -seq % n
    length = (seq + pad) // n

    def split(x: Array) -> Array:  # (batch, seq, ...) -> (n, batch, length, ...)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x
        return jnp.moveaxis(x.reshape(batch, length, n, *x.shape[2:]), 2, 0)

    def join(y: Array) -> Array:  # (n, batch, length, ...) -> (batch, seq, ...)
        y = jnp.moveaxis(y, 0, 2)
        return y.reshape(batch, length * n, *y.shape[3:])[:, :seq]

    @jax.checkpoint
    def chunk(args: tuple[Array, ...]) -> Any:
        h, *rest = args
        return fn(head(h), *rest)

    return jax.tree.map(join, jax.lax.map(chunk, (split(hidden), *map(split, per_token))))


def _chunks(seq: int, vocab: int, chunk_tokens: int | Literal["auto"]) -> int:
    """How many chunks `map_logits` cuts each row's `seq` tokens into: for `"auto"`, a
    divisor of `seq` where one is near (no padding), else the fewest that keep each
    chunk small."""
    if chunk_tokens != "auto":
        return -(-seq // chunk_tokens)
    if seq * vocab <= CHUNK_ABOVE:
        return 1
    n = -(-seq * vocab // CHUNK_LOGITS)
    return next((d for d in range(n, 2 * n) if seq % d == 0), n)
