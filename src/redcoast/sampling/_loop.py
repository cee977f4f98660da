"""The decoding loop: prefill once, share the cache among a prompt's samples, step until done.

The prompts go through the model once (prefill), filling each layer's cache; the
cache of prompt `b` is then repeated for its `num_samples` rows (`b * G ... b * G +
G - 1`), and each step feeds one token per row and reads the earlier keys and values
back from the cache. The steps are a `lax.while_loop` writing into a fixed-size
buffer, which stops as soon as every row has produced `eos_id`; the buffer starts
full of `eos_id`, which is what a finished row emits, so the tokens are those of a
loop run to the end. Step `t` draws with the `t`-th of `max_new_tokens` keys split
from the caller's key whether or not the loop stops early.

Everything runs inside one `eqx.filter_jit` (one program per shapes and settings),
under the model's `Parallelism`: on a sharded model XLA splits the cache by heads,
like the K/V projections that fill it, and FSDP gathers each weight where it is used.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..parallel._parallelism import Parallelism
from ._protocol import CausalLM
from ._warpers import Warpers, pick

Feed = Callable[[Any, Int[Array, " rows"], Int[Array, " rows"]], tuple[Array, Any]]
"""`(state, token, position) -> (logits, state)`: one token of every row through the model."""


@eqx.filter_jit
def decode_jit(
    model: CausalLM, *args: Any, parallelism: Parallelism, **settings: Any
) -> tuple[Int[Array, "rows new"], Int[Array, " rows"]]:
    """`decode_loop`, compiled, with the model's FSDP gathers known from the given arrays."""
    with parallelism.applied(model) as (model, _):
        return decode_loop(model, *args, **settings)


def decode_loop(
    model: CausalLM,
    prompt: Int[Array, "batch prompt"],
    lengths: Int[Array, " batch"],
    key: PRNGKeyArray,
    *,
    num_samples: int,
    max_new_tokens: int,
    warpers: Warpers,
    eos_id: int | None,
    use_cache: bool,
) -> tuple[Int[Array, "rows new"], Int[Array, " rows"]]:
    """`num_samples` continuations of each prompt and each one's length (to its first
    `eos_id`, included); row `b * num_samples + g` continues prompt `b`."""
    prompt_len = prompt.shape[1]
    total = prompt_len + max_new_tokens
    keys = jax.random.split(key, max_new_tokens)
    # The padding may be any token (even -1): it never reaches the model, whose
    # token-id check would otherwise reject it.
    prompt = jnp.where(jnp.arange(prompt_len)[None, :] < lengths[:, None], prompt, 0)
    start = _prefill_cached if use_cache else _prefill_uncached
    first, state, feed = start(model, prompt, lengths, total)
    first, state, lengths = jax.tree.map(
        lambda x: jnp.repeat(x, num_samples, axis=0), (first, state, lengths)
    )
    rows = first.shape[0]

    def finish(token: Array, done: Array) -> tuple[Array, Array]:
        if eos_id is None:
            return token, done
        token = jnp.where(done, eos_id, token)
        return token, done | (token == eos_id)

    token, done = finish(pick(first, keys[0], warpers), jnp.zeros(rows, bool))
    fill = 0 if eos_id is None else eos_id
    out = jnp.full((rows, max_new_tokens), fill, jnp.int32).at[:, 0].set(token)

    def going(carry: tuple[Any, ...]) -> Array:
        t, *_, done, _ = carry
        return (t < max_new_tokens) & ~jnp.all(done)

    def step(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        t, state, token, pos, done, out = carry
        logits, state = feed(state, token, pos)
        token, done = finish(pick(logits, keys[t], warpers), done)
        out = jax.lax.dynamic_update_slice_in_dim(out, token[:, None], t, axis=1)
        return t + 1, state, token, pos + 1, done, out

    carry = (jnp.int32(1), state, token, lengths, done, out)
    out = jax.lax.while_loop(going, step, carry)[-1]
    if eos_id is None:
        return out, jnp.full((rows,), max_new_tokens, jnp.int32)
    ended = out == eos_id
    length = jnp.where(jnp.any(ended, axis=1), jnp.argmax(ended, axis=1) + 1, max_new_tokens)
    return out, length.astype(jnp.int32)


def _prefill_cached(
    model: CausalLM, prompt: Int[Array, "batch prompt"], lengths: Int[Array, " batch"], total: int
) -> tuple[Float[Array, "batch vocab"], Any, Feed]:
    """The logits after each prompt, the cache filled with it, and a step reading it."""
    one = model.init_cache(total)
    cache = jax.tree.map(lambda c: jnp.zeros((prompt.shape[0], *c.shape), c.dtype), one)
    # Right padding is harmless: slots past a row's length are masked now and
    # overwritten by that row's generated tokens before any query can see them.
    logits, cache = jax.vmap(model.decode, in_axes=(0, 0, None))(prompt, cache, 0)

    def feed(cache: Any, token: Array, pos: Array) -> tuple[Array, Any]:
        logits, cache = jax.vmap(model.decode)(token[:, None], cache, pos)
        return logits[:, 0], cache

    return logits[jnp.arange(prompt.shape[0]), lengths - 1], cache, feed


def _prefill_uncached(
    model: CausalLM, prompt: Int[Array, "batch prompt"], lengths: Int[Array, " batch"], total: int
) -> tuple[Float[Array, "batch vocab"], Any, Feed]:
    """As `_prefill_cached`, with the whole sequence through the model at every step:
    what the cache saves (a baseline for benchmarks)."""
    batch, prompt_len = prompt.shape
    ids = jnp.zeros((batch, total), prompt.dtype).at[:, :prompt_len].set(prompt)

    def logits_at(ids: Array, pos: Array) -> Array:
        return jax.vmap(lambda s, p: model(s)[p])(ids, pos)

    def feed(ids: Any, token: Array, pos: Array) -> tuple[Array, Any]:
        ids = ids.at[jnp.arange(ids.shape[0]), pos].set(token.astype(ids.dtype))
        return logits_at(ids, pos), ids

    return logits_at(ids, lengths - 1), ids, feed
