"""Generation for the encoder-decoders: greedy, sampling and beam search, compiled once.

The encoder runs once per source; each decoder layer's cross-attention keys and
values of its output are computed once too, and the decoder's self-attention keys
and values go into a cache, so a step costs one target token's forward pass. The
loop is a `lax.scan` inside one `eqx.filter_jit`, which makes `generate_seq2seq`
usable as a `pred_fn` under `rc.predict` on a sharded model.

Beam search follows `transformers`' vectorised beam search step for step (Wolf et
al. 2020): the `2 * num_beams` best continuations of all beams, hypotheses that end
in EOS scored `sum log p / length ** length_penalty`, and the same early-stopping
rule, so that on the same weights both return the same tokens.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray, Shaped

from ..parallel._parallelism import Parallelism
from .seq2seq import AbstractSeq2SeqLM

# transformers' "impossible" score: added to beams that must not be chosen.
_NEVER = -1.0e9


def _force(
    scores: Float[Array, "rows vocab"], token: int | None, when: Array
) -> Float[Array, "rows vocab"]:
    """Only `token` possible (score 0, others -inf) where `when` holds."""
    if token is None:
        return scores
    forced = jnp.where(jnp.arange(scores.shape[-1]) == token, 0.0, -jnp.inf)
    return jnp.where(when, forced, scores)


def _gather(x: Array, index: Int[Array, "batch k"]) -> Array:
    """`x[b, index[b, j]]` for every batch row `b` and slot `j` (axis 1 gathered)."""
    index = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


@eqx.filter_jit
def _generate(
    model: AbstractSeq2SeqLM, *args: Any, parallelism: Parallelism, **settings: Any
) -> Int[Array, "batch new"]:
    # The model's FSDP gathers, known here by the arrays this trace was given.
    with parallelism.applied(model) as (model, _):
        return _loop(model, *args, **settings)


def _loop(
    model: AbstractSeq2SeqLM,
    input_ids: Shaped[Array, "batch ..."],  # token ids, or a VisionEncoderDecoder's images
    mask: Int[Array, "batch src"],
    key: PRNGKeyArray,
    *,
    max_new_tokens: int,
    num_beams: int,
    length_penalty: float,
    early_stopping: bool | str,
    temperature: float,
    tokens: tuple[int | None, int, int, int | None, int | None],
) -> Int[Array, "batch new"]:
    eos, start, pad, forced_bos, forced_eos = tokens
    batch, n, k = input_ids.shape[0], max_new_tokens, num_beams
    memory = jax.vmap(model.encode)(input_ids, mask)
    cross = jax.vmap(model.cross_cache)(memory)

    def per_beam(x: Array) -> Array:
        return jnp.repeat(x, k, axis=0)

    cross, mask = jax.tree.map(per_beam, cross), per_beam(mask)
    one = model.init_cache(n)
    cache = jax.tree.map(lambda c: jnp.zeros((batch * k, *c.shape), c.dtype), one)

    def logits_at(cache: Any, token: Array, t: Array) -> tuple[Array, Any]:
        decode = jax.vmap(model.decode, in_axes=(0, 0, None, 0, 0))
        logits, cache = decode(token[:, None], cache, t, cross, mask)
        scores = logits[:, 0].astype(jnp.float32)
        # transformers' forced-BOS / forced-EOS logits processors.
        scores = _force(scores, forced_bos, t == 0)
        return _force(scores, forced_eos, t == n - 1), cache

    first = jnp.full((batch * k,), start, jnp.int32)
    if k == 1:
        return _greedy(logits_at, cache, first, key, n, temperature, eos, pad)
    return _beam_search(logits_at, cache, first, n, k, length_penalty, early_stopping, eos, pad)


def _greedy(
    logits_at: Any,
    cache: Any,
    first: Array,
    key: PRNGKeyArray,
    n: int,
    temperature: float,
    eos: int | None,
    pad: int,
) -> Int[Array, "batch new"]:
    def step(carry: tuple[Any, Array, Array], inputs: tuple[Array, Array]) -> tuple[Any, Array]:
        cache, token, done = carry
        t, k = inputs
        scores, cache = logits_at(cache, token, t)
        if temperature == 0.0:
            token = jnp.argmax(scores, axis=-1).astype(jnp.int32)
        else:
            token = jax.random.categorical(k, scores / temperature, axis=-1).astype(jnp.int32)
        token = jnp.where(done, pad, token)
        done = done if eos is None else done | (token == eos)
        return (cache, token, done), token

    done = jnp.zeros(first.shape, bool)
    _, out = jax.lax.scan(step, (cache, first, done), (jnp.arange(n), jax.random.split(key, n)))
    return out.T


def _beam_search(
    logits_at: Any,
    cache: Any,
    first: Array,
    n: int,
    k: int,
    length_penalty: float,
    early_stopping: bool | str,
    eos: int | None,
    pad: int,
) -> Int[Array, "batch new"]:
    batch = first.shape[0] // k
    wide = 2 * k  # transformers keeps (1 + number of EOS ids) * num_beams candidates
    in_top_k = jnp.arange(wide) < k

    def step(carry: tuple, t: Array) -> tuple[tuple, None]:
        cache, token, seqs, scores, done_seqs, done_scores, done, improvable = carry
        logits, cache = logits_at(cache, token, t)
        vocab = logits.shape[-1]
        logp = jax.nn.log_softmax(logits, axis=-1).reshape(batch, k, vocab) + scores[:, :, None]
        top, index = jax.lax.top_k(logp.reshape(batch, k * vocab), wide)
        parent, new = index // vocab, (index % vocab).astype(jnp.int32)
        cand = _gather(seqs, parent).at[:, :, t].set(new)
        ends = jnp.broadcast_to(t == n - 1, new.shape)
        ends = ends if eos is None else ends | (new == eos)
        # The best k candidates that did not end keep running.
        running = top + ends * _NEVER
        keep = jax.lax.top_k(running, k)[1]
        seqs, scores, parent = _gather(cand, keep), _gather(running, keep), _gather(parent, keep)
        # Ended candidates among the best k join the finished hypotheses if they beat them.
        ended = ends & in_top_k[None, :]
        final = top / (t + 1).astype(jnp.float32) ** length_penalty
        full = jnp.all(done, axis=-1, keepdims=True) & (early_stopping is True)
        final = final + full * _NEVER + (~improvable) * _NEVER + (~ended) * _NEVER
        merged = jnp.concatenate([done_scores, final], axis=1)
        best = jax.lax.top_k(merged, k)[1]
        done_seqs = _gather(jnp.concatenate([done_seqs, cand], axis=1), best)
        done = _gather(jnp.concatenate([done, ended], axis=1), best)
        done_scores = _gather(merged, best)
        rows = (jnp.arange(batch)[:, None] * k + parent).reshape(-1)
        cache = jax.tree.map(lambda c: c[rows], cache)
        token = seqs[:, :, t].reshape(-1)
        # Can a running beam still beat the worst finished one? (transformers' heuristic)
        length = n if early_stopping == "never" and length_penalty > 0 else t + 1
        best_running = scores[:, :1] / jnp.asarray(length, jnp.float32) ** length_penalty
        worst = jnp.where(done, jnp.min(done_scores, axis=1, keepdims=True), _NEVER)
        improvable = improvable & jnp.any(best_running > worst, axis=-1, keepdims=True)
        return (cache, token, seqs, scores, done_seqs, done_scores, done, improvable), None

    seqs = jnp.full((batch, k, n), pad, jnp.int32)
    # Only the first beam is live at the start, so the beams do not all pick the same tokens.
    scores = jnp.where(jnp.arange(k) == 0, 0.0, _NEVER)[None].repeat(batch, axis=0)
    done_scores = jnp.full((batch, k), _NEVER)
    done = jnp.zeros((batch, k), bool)
    improvable = jnp.ones((batch, 1), bool)
    carry = (cache, first, seqs, scores, seqs, done_scores, done, improvable)
    carry, _ = jax.lax.scan(step, carry, jnp.arange(n))
    return carry[4][:, 0]


def _check(
    max_new_tokens: Any,
    num_beams: Any,
    temperature: Any,
    key: Any,
    early_stopping: Any,
) -> None:
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be an int >= 1, got {num_beams!r}.")
    if not isinstance(temperature, int | float) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}.")
    if temperature > 0 and num_beams > 1:
        raise ValueError(
            f"temperature={temperature} samples, which beam search (num_beams={num_beams}) "
            "does not; pass num_beams=1 to sample or temperature=0 for beam search."
        )
    if temperature > 0 and key is None:
        raise ValueError(f"temperature={temperature} samples the next token and needs key=.")
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}.")


def generate_seq2seq(
    model: AbstractSeq2SeqLM,
    input_ids: Shaped[ArrayLike, " batch *source"],
    *,
    max_new_tokens: int,
    attention_mask: Int[ArrayLike, "batch src"] | Bool[ArrayLike, "batch src"] | None = None,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    temperature: float = 0.0,
    key: PRNGKeyArray | None = None,
    eos_token_id: int | None = None,
    decoder_start_token_id: int | None = None,
    pad_token_id: int | None = None,
    forced_bos_token_id: int | None = None,
    forced_eos_token_id: int | None = None,
) -> Int[Array, "batch new"]:
    """Generate target sequences for a batch of sources: greedy, sampled or beam search.

    Compiled once per (model, shapes, settings); works inside `jax.jit`, so it can be a
    `pred_fn` under `rc.predict` on a sharded model. The token ids default to the
    model's config (`model.special_token`), as `transformers`' `generate` does.

    Args:
        model: a `T5`, `BART` or `VisionEncoderDecoder`.
        input_ids: source token ids, one source per row, right-padded; for a
            `VisionEncoderDecoder`, images `(batch, channels, height, width)`.
        max_new_tokens: the longest target to generate (the start token not counted).
        attention_mask: 1 for real source tokens, 0 for padding; default all real.
        num_beams: 1 for greedy decoding or sampling; more for beam search.
        length_penalty: a finished hypothesis scores `sum log p / length ** length_penalty`;
            above 1 favours longer targets, below 1 shorter ones.
        early_stopping: `True` stops a row once it has `num_beams` finished hypotheses;
            `False` and `"never"` as in transformers (when a better one is impossible).
        temperature: with `num_beams=1`, 0 is greedy; above 0 samples from
            `softmax(logits / temperature)`.
        key: for sampling.
        eos_token_id: a sequence ends with this token; `None`: the config's.
        decoder_start_token_id: the decoder's first input; `None`: the config's (T5: pad).
        pad_token_id: fills the positions after a sequence ended; `None`: the config's.
        forced_bos_token_id: the first generated token; `None`: the config's (BART's
            multilingual variants set it).
        forced_eos_token_id: the token at the last position, when reached; `None`: the config's.

    Returns:
        The generated tokens, `(batch, max_new_tokens)`, without the start token; after
        EOS, `pad_token_id`.

    Raises:
        ValueError: a bad setting, empty sources, 64-bit ids that JAX would wrap to
            32 bits, or a token id outside the vocabulary.

    Example:
        >>> new = generate_seq2seq(model, batch["src"], attention_mask=batch["mask"],
        ...                        max_new_tokens=32, num_beams=4, length_penalty=0.8)
    """
    _check(max_new_tokens, num_beams, temperature, key, early_stopping)
    if model.max_positions is not None and max_new_tokens > model.max_positions:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} is more than {type(model).__name__}'s decoder "
            f"has positions ({model.max_positions}); ask for at most {model.max_positions}."
        )
    ids, mask = model.generation_source(input_ids, attention_mask)

    def token(given: int | None, name: str, fallback: int | None = None) -> int | None:
        value = model.special_token(name) if given is None else given
        value = fallback if value is None else value
        if value is not None and not 0 <= value < model.vocab_size:
            raise ValueError(
                f"{name}={value} is not a token id of a vocabulary of {model.vocab_size}."
            )
        return value

    pad = token(pad_token_id, "pad_token_id", 0)
    start = token(decoder_start_token_id, "decoder_start_token_id", pad)
    assert pad is not None and start is not None
    tokens = (
        token(eos_token_id, "eos_token_id"),
        start,
        pad,
        token(forced_bos_token_id, "forced_bos_token_id"),
        token(forced_eos_token_id, "forced_eos_token_id"),
    )
    return _generate(
        model,
        ids,
        mask.astype(jnp.int32),
        jax.random.key(0) if key is None else key,
        max_new_tokens=max_new_tokens,
        num_beams=num_beams,
        length_penalty=float(length_penalty),
        early_stopping=early_stopping,
        temperature=float(temperature),
        tokens=tokens,
        parallelism=Parallelism.of(model),
    )
