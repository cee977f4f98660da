"""The next token from the logits: greedy, or a sample from the filtered distribution.

The filters run in the order `transformers`' `generate` applies its warpers --
temperature, top-k, top-p, min-p -- so that the same settings sample from the same
distribution.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Key


class Warpers(NamedTuple):
    """How the next token is picked (static: each setting compiles its own program).

    Attributes:
        temperature: 0 for the argmax; else the logits are divided by it and sampled.
        top_k: keep the `top_k` most likely tokens, or None.
        top_p: keep the most likely tokens until their mass reaches `top_p`, or None.
        min_p: keep the tokens at least `min_p` times as likely as the most likely, or None.
    """

    temperature: float
    top_k: int | None
    top_p: float | None
    min_p: float | None


def pick(
    logits: Float[Array, "batch vocab"], keys: Key[Array, " batch"], how: Warpers
) -> Int[Array, " batch"]:
    """The next token of each row: argmax at temperature 0, else a filtered sample drawn
    with the row's own key (`keys`, one a row), whatever the other rows are."""
    if how.temperature == 0.0:
        return _argmax(logits)
    # jax.random.categorical's draw for each row's key (the Gumbel-max trick, the same
    # bits), with its argmax.
    noise = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[-1:], jnp.float32))(keys)
    return _argmax(noise + warp(logits, how))


def warp(logits: Float[Array, "batch vocab"], how: Warpers) -> Float[Array, "batch vocab"]:
    """The logits a sample is drawn from: divided by the temperature (> 0), the
    filtered-out tokens at `-inf`."""
    logits = logits.astype(jnp.float32) / how.temperature
    if how.top_k is not None and how.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, how.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if how.top_p is not None and how.top_p < 1.0:
        # Keep the most likely tokens until their mass reaches top_p (Holtzman et al.
        # 2020): a token stays when the mass of the tokens more likely than it is < top_p.
        ranked = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(before < how.top_p, ranked, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    if how.min_p is not None and how.min_p > 0.0:
        # Min-p (Nguyen et al. 2024), on the probabilities the filters above left, as
        # transformers' MinPLogitsWarper computes them; the most likely token always stays.
        probs = jax.nn.softmax(logits, axis=-1)
        floor = how.min_p * jnp.max(probs, axis=-1, keepdims=True)
        logits = jnp.where(probs < floor, -jnp.inf, logits)
    return logits


def _argmax(x: Float[Array, "batch vocab"]) -> Int[Array, " batch"]:
    """`jnp.argmax(x, axis=-1)` (the first of the largest, or of the NaNs) as two plain
    reductions, which XLA's CPU backend vectorises: its one variadic reduction of
    values and indices it runs an element at a time, ten times slower."""
    top = jnp.max(x, axis=-1, keepdims=True)
    first = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(first, jnp.arange(x.shape[-1]), x.shape[-1]), axis=-1).astype(
        jnp.int32
    )
