"""Autoregressive generation with a key/value cache, batched and compiled once per shape.

The prompt goes through the model once (prefill), filling each layer's `KVCache`;
then each step feeds one token per sequence and reads its keys and values back
from the cache, so a step costs one token's forward pass instead of the whole
sequence's. The loop is a `lax.scan` inside one `eqx.filter_jit`, which makes
`generate` usable as a `pred_fn` under `rc.predict` on a sharded model: XLA
splits the cache by heads, like the K/V projections that fill it.
"""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from ..parallel._parallelism import Parallelism
from .causal_lm import AbstractCausalLM
from .checks import as_int_array, check_range


def _pick(
    logits: Float[Array, "batch vocab"],
    key: PRNGKeyArray,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> Int[Array, " batch"]:
    """The next token of each row: argmax at temperature 0, else a filtered sample."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:
        # Keep the most likely tokens until their mass reaches top_p (Holtzman et al.
        # 2020): a token stays when the mass of the tokens more likely than it is < top_p.
        ranked = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(before < top_p, ranked, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@eqx.filter_jit
def _generate(
    model: AbstractCausalLM, *args: Any, parallelism: Parallelism, **settings: Any
) -> Int[Array, "batch new"]:
    # The model's FSDP gathers, known here by the arrays this trace was given.
    with parallelism.applied(model) as (model, _):
        return _loop(model, *args, **settings)


def _loop(
    model: AbstractCausalLM,
    prompt: Int[Array, "batch prompt"],
    lengths: Int[Array, " batch"],
    key: PRNGKeyArray,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    eos_id: int | None,
    use_cache: bool,
) -> Int[Array, "batch new"]:
    batch, prompt_len = prompt.shape
    total = prompt_len + max_new_tokens
    keys = jax.random.split(key, max_new_tokens)
    rows = jnp.arange(batch)
    # The padding may be any token (even -1): it never reaches the model, whose
    # token-id check would otherwise reject it.
    prompt = jnp.where(jnp.arange(prompt_len)[None, :] < lengths[:, None], prompt, 0)

    if use_cache:
        one = model.init_cache(total)
        state = jax.tree.map(lambda c: jnp.zeros((batch, *c.shape), c.dtype), one)
        # Right padding is harmless: slots past a row's length are masked now and
        # overwritten by that row's generated tokens before any query can see them.
        logits, state = jax.vmap(model.decode, in_axes=(0, 0, None))(prompt, state, 0)
        first = logits[rows, lengths - 1]

        def feed(state: Any, token: Array, pos: Array) -> tuple[Array, Any]:
            logits, state = jax.vmap(model.decode)(token[:, None], state, pos)
            return logits[:, 0], state

    else:
        # The whole sequence through the model at every step: what the cache saves.
        state = jnp.zeros((batch, total), prompt.dtype).at[:, :prompt_len].set(prompt)

        def logits_at(ids: Array, pos: Array) -> Array:
            return jax.vmap(lambda s, p: model(s)[p])(ids, pos)

        first = logits_at(state, lengths - 1)

        def feed(state: Any, token: Array, pos: Array) -> tuple[Array, Any]:
            assert isinstance(state, jax.Array)
            state = state.at[rows, pos].set(token.astype(state.dtype))
            return logits_at(state, pos), state

    def finish(token: Array, done: Array) -> tuple[Array, Array]:
        if eos_id is None:
            return token, done
        token = jnp.where(done, eos_id, token)
        return token, done | (token == eos_id)

    token, done = finish(_pick(first, keys[0], temperature, top_k, top_p), jnp.zeros(batch, bool))

    def step(
        carry: tuple[Any, Array, Array, Array], k: PRNGKeyArray
    ) -> tuple[tuple[Any, Array, Array, Array], Array]:
        state, token, pos, done = carry
        logits, state = feed(state, token, pos)
        token, done = finish(_pick(logits, k, temperature, top_k, top_p), done)
        return (state, token, pos + 1, done), token

    _, rest = jax.lax.scan(step, (state, token, lengths, done), keys[1:])
    return jnp.concatenate([token[:, None], rest.T], axis=1)


def _check_settings(
    max_new_tokens: Any, temperature: Any, key: Any, top_k: Any, top_p: Any
) -> None:
    """`generate`'s decoding settings, each with an error that names it."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if not (isinstance(temperature, int | float) and math.isfinite(temperature)) or (
        temperature < 0
    ):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}.")
    if temperature > 0 and key is None:
        raise ValueError(
            f"temperature={temperature} samples the next token and needs key=; pass a "
            "jax.random.key, or temperature=0 for greedy decoding."
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}.")


def _prompt_lengths(
    prompt_lengths: Int[ArrayLike, " batch"] | None, batch: int, prompt_len: int
) -> Int[Array, " batch"]:
    """Each prompt's length in `[1, prompt_len]`: checked now when known, else when run."""
    if prompt_lengths is None:
        return jnp.full((batch,), prompt_len, jnp.int32)
    lengths = as_int_array(prompt_lengths, "prompt_lengths").astype(jnp.int32)
    if lengths.shape != (batch,):
        raise ValueError(
            f"prompt_lengths must have shape ({batch},), one per prompt; got {lengths.shape}."
        )
    try:
        host = np.asarray(lengths)
    except jax.errors.TracerArrayConversionError:  # inside jit: checked at run time
        host = None
    if host is not None and (host.min() < 1 or host.max() > prompt_len):
        raise ValueError(
            f"prompt_lengths must be in [1, {prompt_len}] (the padded prompt length); "
            f"got {host.tolist()}."
        )
    return check_range(
        lengths,
        1,
        prompt_len + 1,
        "prompt_lengths",
        f"Each prompt has at least 1 and at most {prompt_len} tokens (the padded length).",
    )


def generate(
    model: AbstractCausalLM,
    prompt_ids: Int[ArrayLike, "batch prompt"],
    *,
    max_new_tokens: int,
    prompt_lengths: Int[ArrayLike, " batch"] | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    key: PRNGKeyArray | None = None,
    use_cache: bool = True,
) -> Int[Array, "batch new"]:
    """Continue a batch of prompts, one token at a time, with a key/value cache.

    Compiled once per (model, shapes, settings); works inside `jax.jit`, so it can be
    a `pred_fn` under `rc.predict` on a sharded model.

    Args:
        model: a `GPT2`, `Llama`, `OPT` or `GPTJ`.
        prompt_ids: token ids in `[0, vocab_size)`, one prompt per row; shorter prompts
            are right-padded (with any integer) and their lengths given in
            `prompt_lengths`.
        max_new_tokens: how many tokens to generate for each prompt.
        prompt_lengths: the length of each prompt; default: every row is full.
        temperature: 0 for greedy decoding (argmax); otherwise logits are divided by
            it and the next token sampled.
        top_k: when sampling, keep only the `top_k` most likely tokens.
        top_p: when sampling, keep the most likely tokens until their probability
            reaches `top_p` (nucleus sampling).
        eos_id: a row that produced this token produces only it from then on.
        key: for sampling; required when `temperature > 0`.
        use_cache: `False` runs the whole sequence through the model at every step
            (the same tokens, more FLOPs; a baseline for benchmarks).

    Returns:
        The new tokens, `(batch, max_new_tokens)` (the prompt not included).

    Raises:
        ValueError: a bad setting, empty prompts, prompt_lengths outside
            `[1, prompt_len]`, 64-bit ids that JAX would wrap to 32 bits, or the
            prompt plus `max_new_tokens` longer than the model's position table.
        RuntimeError: (when the computation runs; see `checks.check_range`) traced
            prompt_lengths outside `[1, prompt_len]`, or a prompt token id outside
            `[0, vocab_size)`.

    Example:
        >>> prompts = jnp.array([[5, 6, 7, 0], [8, 9, 10, 11]])
        >>> new = generate(model, prompts, prompt_lengths=jnp.array([3, 4]), max_new_tokens=8)
        >>> pred_fn = lambda m, batch, key: generate(
        ...     m, batch["ids"], prompt_lengths=batch["length"], max_new_tokens=8)
    """
    _check_settings(max_new_tokens, temperature, key, top_k, top_p)
    prompt = as_int_array(prompt_ids, "prompt_ids")
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(
            f"prompt_ids must be integer token ids of shape (batch, prompt_len); got "
            f"{prompt.dtype} of shape {prompt.shape}. For one prompt use ids[None]."
        )
    batch, prompt_len = prompt.shape
    if prompt_len == 0:
        raise ValueError(
            f"prompt_ids has shape {prompt.shape}: prompts of no tokens. Each prompt needs at "
            "least one token to continue (e.g. the tokenizer's BOS token)."
        )
    vocab = model.vocab_size
    if eos_id is not None and not 0 <= eos_id < vocab:
        raise ValueError(f"eos_id={eos_id} is not a token id of a vocabulary of {vocab}.")
    limit = model.max_positions
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"the prompt ({prompt_len} tokens) plus max_new_tokens={max_new_tokens} exceed "
            f"the {limit} positions of {type(model).__name__}'s position table."
        )
    lengths = _prompt_lengths(prompt_lengths, batch, prompt_len)
    return _generate(
        model,
        prompt,
        lengths,
        jax.random.key(0) if key is None else key,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=top_k,
        top_p=None if top_p is None else float(top_p),
        eos_id=eos_id,
        use_cache=use_cache,
        parallelism=Parallelism.of(model),
    )
