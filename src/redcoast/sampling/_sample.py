"""`sample` and `generate`: the settings checked, the prompts made arrays, the loop run."""

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Int, PRNGKeyArray

from .._checks import as_int_array, check_positive, check_range
from ..parallel._parallelism import Parallelism
from ._loop import decode
from ._protocol import CausalLM
from ._warpers import Warpers

_MEMBERS = ("vocab_size", "max_positions", "__call__", "init_cache", "decode")


class Samples(NamedTuple):
    """What `sample` returns.

    Attributes:
        tokens: `(batch * num_samples, max_new_tokens)`; row `b * num_samples + g` is
            sample `g` of prompt `b`. After a row's first `eos_id` it holds `eos_id`.
        lengths: `(batch * num_samples,)`: each row's tokens up to and including its
            first `eos_id`, or `max_new_tokens` when it has none.
    """

    tokens: Int[Array, "rows new"]
    lengths: Int[Array, " rows"]


def sample(
    model: CausalLM,
    prompt_ids: Int[ArrayLike, "batch prompt"],
    *,
    max_new_tokens: int,
    key: PRNGKeyArray,
    num_samples: int = 1,
    prompt_lengths: Int[ArrayLike, " batch"] | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    eos_id: int | None = None,
    prompt_inputs: Mapping[str, Any] | None = None,
) -> Samples:
    """`num_samples` continuations of each prompt, each prompt prefilled once for all of them.

    The loop stops as soon as every row has produced `eos_id`. Called outside a trace,
    finished rows stop costing steps: once at most half the rows are live, the live
    ones continue as a batch half the size (halved again and again, down to a row a
    data-parallel device), each size a program compiled once. Inside `jax.jit` (a
    `pred_fn` under `rc.predict`, say) one loop steps every row until the last ends.
    Both draw the same tokens: a row's draws depend on the key and its index alone.
    Compiled once per (model, shapes, settings): pad prompts of changing lengths to a
    few lengths with `pad_prompts`. Works on a model placed on a mesh (tensor
    parallel, FSDP; rows split over the data axis stay split); the same key gives the
    same samples on any mesh (JAX's partitionable threefry draws the same bits
    however the rows are split).

    Args:
        model: a `CausalLM` (any decoder of `rc.models`).
        prompt_ids: token ids in `[0, vocab_size)`, one prompt per row; shorter prompts
            are right-padded (with any integer) and their lengths given in
            `prompt_lengths`.
        max_new_tokens: how many tokens each sample has room for.
        key: draws the samples: row `r`'s token at step `t` with `fold_in(keys[t], r)`,
            `keys` the `max_new_tokens` keys split from it (so a longer
            `max_new_tokens` draws other samples).
        num_samples: how many samples of each prompt (GRPO's group size).
        prompt_lengths: the length of each prompt; default: every row is full.
        temperature: the logits are divided by it before sampling; 0 takes the argmax.
        top_k: keep only the `top_k` most likely tokens.
        top_p: keep the most likely tokens until their probability reaches `top_p`.
        min_p: keep the tokens at least `min_p` times as likely as the most likely one
            (Nguyen et al. 2024). The filters apply in `transformers`' order:
            temperature, top-k, top-p, min-p.
        eos_id: a row that produced this token is finished and emits only it.
        prompt_inputs: what the model reads beside the prompts' ids, as keywords of
            its `decode` (and `__call__`): arrays with one row per prompt, such as a
            vision-language model's `{"pixel_values": images}`. Default: none.

    Returns:
        `Samples(tokens, lengths)`, `batch * num_samples` rows.

    Raises:
        TypeError: `model` lacks a member of `CausalLM`.
        ValueError: a bad setting, empty prompts, prompt_lengths outside
            `[1, prompt_len]`, 64-bit ids that JAX would wrap to 32 bits, or the
            prompt plus `max_new_tokens` longer than the model's positions.
        RuntimeError: (when the computation runs; see `redcoast._checks.check_range`)
            traced prompt_lengths outside `[1, prompt_len]`, or a prompt token id
            outside `[0, vocab_size)`.

    Example:
        >>> ids, lengths = rc.sampling.pad_prompts(prompts, max_length=2048 - 256)
        >>> out = rc.sampling.sample(model, ids, prompt_lengths=lengths, num_samples=8,
        ...                          max_new_tokens=256, eos_id=2, key=key)
        >>> out.tokens.shape, out.lengths.shape
        ((64, 256), (64,))
    """
    check_positive("num_samples", num_samples, optional=False)
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] or None, got {min_p!r}.")
    tokens, lengths = _run(
        model,
        prompt_ids,
        prompt_lengths,
        key,
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        warpers=Warpers(temperature, top_k, top_p, min_p),
        eos_id=eos_id,
        use_cache=True,
        prompt_inputs=prompt_inputs,
    )
    return Samples(tokens, lengths)


def generate(
    model: CausalLM,
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
    prompt_inputs: Mapping[str, Any] | None = None,
) -> Int[Array, "batch new"]:
    """Continue a batch of prompts, one token at a time, with a key/value cache.

    Compiled once per (model, shapes, settings); works inside `jax.jit`, so it can be
    a `pred_fn` under `rc.predict` on a sharded model. `sample` with `num_samples=1`:
    the same tokens for the same key, and outside a trace the rows that have produced
    `eos_id` stop costing steps.

    Args:
        model: a `CausalLM` (any decoder of `rc.models`).
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
        eos_id: a row that produced this token produces only it from then on; the
            loop stops once every row has.
        key: for sampling; required when `temperature > 0`.
        use_cache: `False` runs the whole sequence through the model at every step
            (the same tokens, more FLOPs; a baseline for benchmarks).
        prompt_inputs: as for `sample` (a vision-language model's images).

    Returns:
        The new tokens, `(batch, max_new_tokens)` (the prompt not included).

    Raises:
        TypeError: `model` lacks a member of `CausalLM`.
        ValueError: a bad setting, empty prompts, prompt_lengths outside
            `[1, prompt_len]`, 64-bit ids that JAX would wrap to 32 bits, or the
            prompt plus `max_new_tokens` longer than the model's position table.
        RuntimeError: (when the computation runs; see `redcoast._checks.check_range`)
            traced prompt_lengths outside `[1, prompt_len]`, or a prompt token id
            outside `[0, vocab_size)`.

    Example:
        >>> prompts = jnp.array([[5, 6, 7, 0], [8, 9, 10, 11]])
        >>> new = generate(model, prompts, prompt_lengths=jnp.array([3, 4]), max_new_tokens=8)
        >>> pred_fn = lambda m, batch, key: generate(
        ...     m, batch["ids"], prompt_lengths=batch["length"], max_new_tokens=8)
    """
    tokens, _ = _run(
        model,
        prompt_ids,
        prompt_lengths,
        key,
        num_samples=1,
        max_new_tokens=max_new_tokens,
        warpers=Warpers(temperature, top_k, top_p, None),
        eos_id=eos_id,
        use_cache=use_cache,
        prompt_inputs=prompt_inputs,
    )
    return tokens


def _run(
    model: CausalLM,
    prompt_ids: Int[ArrayLike, "batch prompt"],
    prompt_lengths: Int[ArrayLike, " batch"] | None,
    key: PRNGKeyArray | None,
    *,
    max_new_tokens: int,
    warpers: Warpers,
    eos_id: int | None,
    prompt_inputs: Mapping[str, Any] | None,
    **settings: Any,
) -> tuple[Int[Array, "rows new"], Int[Array, " rows"]]:
    """The settings and prompts checked, then the compiled loop."""
    missing = [name for name in _MEMBERS if not hasattr(model, name)]
    if missing:
        raise TypeError(
            f"{type(model).__name__} has no {', '.join(missing)}: sampling needs a causal "
            "LM with a cached forward pass (see rc.sampling.CausalLM)."
        )
    warpers = _check_settings(max_new_tokens, warpers)
    if warpers.temperature > 0 and key is None:
        raise ValueError(
            f"temperature={warpers.temperature} samples the next token and needs key=; "
            "pass a jax.random.key, or temperature=0 for greedy decoding."
        )
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
    inputs = dict(prompt_inputs or {})
    for name, value in inputs.items():
        rows = getattr(value, "shape", (None,))[:1]
        if rows != (batch,):
            raise ValueError(
                f"prompt_inputs[{name!r}] has shape {getattr(value, 'shape', None)}; give "
                f"one row per prompt, {batch} rows (the prompts' batch) first."
            )
    return decode(
        model,
        prompt,
        _prompt_lengths(prompt_lengths, batch, prompt_len),
        jax.random.key(0) if key is None else key,
        max_new_tokens=max_new_tokens,
        warpers=warpers,
        eos_id=eos_id,
        parallelism=Parallelism.of(model),
        inputs={k: jnp.asarray(v) for k, v in inputs.items()},
        **settings,
    )


def _check_settings(max_new_tokens: Any, warpers: Warpers) -> Warpers:
    """The decoding settings, each with an error that names it; the floats as floats,
    so that `temperature=1` and `temperature=1.0` share a compilation."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    temperature, top_k, top_p, min_p = warpers
    if not (isinstance(temperature, int | float) and math.isfinite(temperature)) or (
        temperature < 0
    ):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}.")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}.")
    as_float = [None if x is None else float(x) for x in (top_p, min_p)]
    return Warpers(float(temperature), top_k, *as_float)


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
    try:  # inside jit, or split over several processes: checked when it runs
        host = np.asarray(lengths) if lengths.is_fully_addressable else None
    except jax.errors.ConcretizationTypeError:
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
