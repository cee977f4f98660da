"""The decoding loop: prefill once, share the cache among a prompt's samples, step until
done, and stop spending steps on the rows that have ended.

The prompts go through the model once (prefill), filling each layer's cache; the
cache of prompt `b` is then repeated for its `num_samples` rows (`b * G ... b * G +
G - 1`), and each step feeds one token per row and reads the earlier keys and values
back from the cache. The steps are a `lax.while_loop` writing into a fixed-size
buffer, which stops as soon as every row has produced `eos_id`; the buffer starts
full of `eos_id`, which is what a finished row emits, so the tokens are those of a
loop run to the end.

A finished row costs a step as much as a live one. Called outside a trace, `decode`
therefore runs the loop in segments: a segment stops once at most half its rows are
live (half rounded up to a multiple of the devices the rows are split over), and the
next continues with the live rows gathered into a batch of that size (their cache,
last token, position, output so far and index), the finished rows' tokens set aside
in the output. Each size is a program of its own, compiled once: at most log2(rows)
of them. Inside a trace (`jax.jit`, `rc.predict`'s `pred_fn`) the host cannot see
how many rows are live, and one loop steps every row to the end. Both give the same
tokens: row `r` draws step `t`'s token with `fold_in(keys[t], r)`, `keys` the
`max_new_tokens` keys split from the caller's, whichever rows share its batch.

Each program runs under the model's `Parallelism`: on a sharded model XLA splits the
cache by heads, like the K/V projections that fill it, and FSDP gathers each weight
where it is used; rows split over the data axis stay split over it when gathered.
"""

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.core import Tracer
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray

from ..parallel._parallelism import Parallelism
from ._protocol import CausalLM
from ._warpers import Warpers, pick


class Rows(NamedTuple):
    """A batch of rows part way through decoding; each leaf's first axis is the row."""

    state: Any
    """What the model reads back: each layer's cache (or, uncached, the ids so far)."""
    token: Int[Array, " rows"]
    """The last token drawn, which the next step feeds."""
    pos: Int[Array, " rows"]
    """The position that token takes."""
    done: Bool[Array, " rows"]
    """Whether the row has produced `eos_id`."""
    out: Int[Array, "rows new"]
    """The tokens drawn so far, then `eos_id` (or 0 without one)."""
    row: Int[Array, " rows"]
    """The row's index in the output (`b * num_samples + g`)."""


Feed = Callable[[CausalLM, Any, Int[Array, " rows"], Int[Array, " rows"]], tuple[Array, Any]]
"""`(model, state, token, position) -> (logits, state)`: a token of each row through the model."""


def decode(
    model: CausalLM,
    prompt: Int[Array, "batch prompt"],
    lengths: Int[Array, " batch"],
    key: PRNGKeyArray,
    *,
    parallelism: Parallelism,
    num_samples: int,
    inputs: dict[str, Array] | None = None,
    **settings: Any,
) -> tuple[Int[Array, "rows new"], Int[Array, " rows"]]:
    """`num_samples` continuations of each prompt and each one's length (to its first
    `eos_id`, included); row `b * num_samples + g` continues prompt `b`.

    `inputs`: the model's keywords beside the ids, one row per prompt (`sample`'s
    `prompt_inputs`). `settings`: `max_new_tokens`, `warpers`, `eos_id` and
    `use_cache`, as `sample` takes them.
    """
    inputs = {} if inputs is None else inputs
    split, shards = _row_split(prompt)
    sizes = [prompt.shape[0] * num_samples]
    if settings["eos_id"] is not None and not _traced(model, prompt, lengths, key):
        # Halve while that frees a device's share of rows.
        while (half := -(-sizes[-1] // (2 * shards)) * shards) < sizes[-1]:
            sizes.append(half)
    floors = [*sizes[1:], 0]  # a segment ends once its live rows fit the next size
    run = functools.partial(_start, parallelism=parallelism, **settings)
    out, t, rows, live = run(
        model, prompt, lengths, key, inputs, num_samples=num_samples, floor=floors[0]
    )
    for size, floor in zip(sizes[1:], floors[1:], strict=True):
        # Replicated scalars: every process reads the same and takes the same path.
        at, left = (int(x) for x in jax.device_get((t, live)))
        if at == settings["max_new_tokens"] or left == 0:
            break
        run = functools.partial(_resume, parallelism=parallelism, split=split, **settings)
        out, t, rows, live = run(model, out, t, rows, key, size=size, floor=floor)
    return _assemble(out, rows, eos_id=settings["eos_id"])


@eqx.filter_jit
def _start(
    model: CausalLM,
    prompt: Int[Array, "batch prompt"],
    lengths: Int[Array, " batch"],
    key: PRNGKeyArray,
    inputs: dict[str, Array],
    *,
    parallelism: Parallelism,
    num_samples: int,
    floor: int,
    max_new_tokens: int,
    warpers: Warpers,
    eos_id: int | None,
    use_cache: bool,
) -> tuple[Int[Array, "rows new"], Int[Array, ""], Rows, Int[Array, ""]]:
    """The prompts prefilled, each one's rows drawn their first token, then the loop
    until at most `floor` rows are live: `(out, t, rows, live)`, `out` the rows' own."""
    prompt_len = prompt.shape[1]
    keys = jax.random.split(key, max_new_tokens)
    # The padding may be any token (even -1): it never reaches the model, whose
    # token-id check would otherwise reject it.
    prompt = jnp.where(jnp.arange(prompt_len)[None, :] < lengths[:, None], prompt, 0)
    prefill = _prefill_cached if use_cache else _prefill_uncached
    with parallelism.applied(model) as (model, _):
        first, state = prefill(model, prompt, lengths, prompt_len + max_new_tokens, inputs)
        first, state, lengths = jax.tree.map(
            lambda x: jnp.repeat(x, num_samples, axis=0), (first, state, lengths)
        )
        row = jnp.arange(first.shape[0])
        start = jnp.zeros(row.shape, bool)
        token, done = _finish(pick(first, _row_keys(keys[0], row), warpers), start, eos_id)
        fill = 0 if eos_id is None else eos_id
        out = jnp.full((row.size, max_new_tokens), fill, jnp.int32).at[:, 0].set(token)
        rows = Rows(state, token, lengths, done, out, row)
        t, rows, live = _loop(model, jnp.int32(1), rows, keys, floor, warpers, eos_id, use_cache)
    return rows.out, t, rows, live


@eqx.filter_jit
def _resume(
    model: CausalLM,
    out: Int[Array, "total new"],
    t: Int[Array, ""],
    rows: Rows,
    key: PRNGKeyArray,
    *,
    parallelism: Parallelism,
    size: int,
    floor: int,
    split: NamedSharding | None,
    max_new_tokens: int,
    warpers: Warpers,
    eos_id: int | None,
    use_cache: bool,
) -> tuple[Int[Array, "total new"], Int[Array, ""], Rows, Int[Array, ""]]:
    """The rows' tokens so far set in `out` (final for the finished ones), the live rows
    gathered into `size` rows (topped up with finished ones), and the loop until at
    most `floor` of them are live."""
    out = out.at[rows.row].set(rows.out)
    keep = jnp.argsort(rows.done, stable=True)[:size]  # the live rows first
    rows = jax.tree.map(lambda x: x[keep], rows)
    if split is not None:
        # On the data axis as the prompts were (the gather alone may replicate them).
        rows = jax.tree.map(
            lambda x: jax.lax.with_sharding_constraint(
                x, NamedSharding(split.mesh, P(split.spec[0], *[P.UNCONSTRAINED] * (x.ndim - 1)))
            ),
            rows,
        )
    keys = jax.random.split(key, max_new_tokens)
    with parallelism.applied(model) as (model, _):
        return out, *_loop(model, t, rows, keys, floor, warpers, eos_id, use_cache)


@functools.partial(jax.jit, static_argnames="eos_id")
def _assemble(
    out: Int[Array, "total new"], rows: Rows, *, eos_id: int | None
) -> tuple[Int[Array, "total new"], Int[Array, " total"]]:
    """`out` with the last rows' tokens set, and each row's length."""
    out = out.at[rows.row].set(rows.out)
    if eos_id is None:
        return out, jnp.full(out.shape[:1], out.shape[1], jnp.int32)
    ended = out == eos_id
    length = jnp.where(jnp.any(ended, axis=1), jnp.argmax(ended, axis=1) + 1, out.shape[1])
    return out, length.astype(jnp.int32)


def _loop(
    model: CausalLM,
    t: Int[Array, ""],
    rows: Rows,
    keys: Key[Array, " new"],
    floor: int,
    warpers: Warpers,
    eos_id: int | None,
    use_cache: bool,
) -> tuple[Int[Array, ""], Rows, Int[Array, ""]]:
    """Steps from step `t` until the buffer is full or at most `floor` rows are live:
    `(t, rows, live)`."""
    feed: Feed = _feed_cached if use_cache else _feed_uncached

    def going(carry: tuple[Array, Rows]) -> Array:
        t, rows = carry
        return (t < rows.out.shape[1]) & (_live(rows) > floor)

    def step(carry: tuple[Array, Rows]) -> tuple[Array, Rows]:
        t, r = carry
        logits, state = feed(model, r.state, r.token, r.pos)
        token, done = _finish(pick(logits, _row_keys(keys[t], r.row), warpers), r.done, eos_id)
        out = jax.lax.dynamic_update_slice_in_dim(r.out, token[:, None], t, axis=1)
        return t + 1, Rows(state, token, r.pos + 1, done, out, r.row)

    t, rows = jax.lax.while_loop(going, step, (t, rows))
    return t, rows, _live(rows)


def _live(rows: Rows) -> Int[Array, ""]:
    return jnp.sum(~rows.done, dtype=jnp.int32)


def _row_keys(key: PRNGKeyArray, row: Int[Array, " rows"]) -> Key[Array, " rows"]:
    """Each row's key of a step: the step's key folded with the row's index in the
    output, so that a row draws the same whichever rows share its batch."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, row)


def _finish(
    token: Int[Array, " rows"], done: Bool[Array, " rows"], eos_id: int | None
) -> tuple[Int[Array, " rows"], Bool[Array, " rows"]]:
    """The tokens a step emits (`eos_id` for a finished row) and which rows are done."""
    if eos_id is None:
        return token, done
    token = jnp.where(done, eos_id, token)
    return token, done | (token == eos_id)


def _row_split(prompt: Array) -> tuple[NamedSharding | None, int]:
    """How the rows are split over devices: the prompts' row sharding, and its number
    of shards (a batch smaller than that frees no device)."""
    sharding = getattr(prompt, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not sharding.spec or sharding.spec[0] is None:
        return None, 1
    axes = sharding.spec[0] if isinstance(sharding.spec[0], tuple) else (sharding.spec[0],)
    shards = math.prod(sharding.mesh.shape[a] for a in axes)
    return (NamedSharding(sharding.mesh, P(sharding.spec[0])), shards) if shards > 1 else (None, 1)


def _traced(*trees: Any) -> bool:
    """Whether any array of `trees` is a tracer: the call is inside `jit`, `vmap`, ..."""
    return any(isinstance(x, Tracer) for x in jax.tree.leaves(trees))


def _prefill_cached(
    model: CausalLM,
    prompt: Int[Array, "batch prompt"],
    lengths: Int[Array, " batch"],
    total: int,
    inputs: dict[str, Array],
) -> tuple[Float[Array, "batch vocab"], Any]:
    """The logits after each prompt and the cache filled with it (the model reads the
    prompts' `inputs` here, and only here)."""
    one = model.init_cache(total)
    cache = jax.tree.map(lambda c: jnp.zeros((prompt.shape[0], *c.shape), c.dtype), one)
    # Right padding is harmless: slots past a row's length are masked now and
    # overwritten by that row's generated tokens before any query can see them.
    logits, cache = jax.vmap(lambda p, c, x: model.decode(p, c, 0, **x))(prompt, cache, inputs)
    return logits[jnp.arange(prompt.shape[0]), lengths - 1], cache


def _feed_cached(
    model: CausalLM, cache: Any, token: Int[Array, " rows"], pos: Int[Array, " rows"]
) -> tuple[Float[Array, "rows vocab"], Any]:
    logits, cache = jax.vmap(model.decode)(token[:, None], cache, pos)
    return logits[:, 0], cache


def _prefill_uncached(
    model: CausalLM,
    prompt: Int[Array, "batch prompt"],
    lengths: Int[Array, " batch"],
    total: int,
    inputs: dict[str, Array],
) -> tuple[Float[Array, "batch vocab"], tuple[Int[Array, "batch total"], dict[str, Array]]]:
    """As `_prefill_cached`, with the ids so far (and the prompts' inputs) as the state:
    `_feed_uncached` runs the whole sequence through the model at every step (what
    the cache saves: a baseline for benchmarks)."""
    batch, prompt_len = prompt.shape
    ids = jnp.zeros((batch, total), prompt.dtype).at[:, :prompt_len].set(prompt)
    return _logits_at(model, ids, lengths - 1, inputs), (ids, inputs)


def _feed_uncached(
    model: CausalLM, state: tuple[Array, dict[str, Array]], token: Int[Array, " rows"], pos: Array
) -> tuple[Float[Array, "rows vocab"], tuple[Array, dict[str, Array]]]:
    ids, inputs = state
    ids = ids.at[jnp.arange(ids.shape[0]), pos].set(token.astype(ids.dtype))
    return _logits_at(model, ids, pos, inputs), (ids, inputs)


def _logits_at(
    model: CausalLM, ids: Array, pos: Array, inputs: dict[str, Array]
) -> Float[Array, "rows vocab"]:
    return jax.vmap(lambda s, p, x: model(s, **x)[p])(ids, pos, inputs)
