"""Token-level evaluation on the sharded model: log-likelihoods of continuations, and
continuations generated until a condition holds.

Requests come in any order and of any length. They are sorted by length, so that each
batch holds requests of about one length, and each batch is padded to a few lengths
(`bucket`): `rc.predict` compiles one program per padded length and splits the rows
over the data axis of the model's mesh.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from .. import sampling
from ..nn._loss import cross_entropy, map_logits
from ..sampling._warpers import _argmax
from ..train.evaluate import predict

__all__ = ["bucket", "continuations", "loglikelihoods"]

Tokens = Sequence[int]


def bucket(length: int, limit: int | None) -> int:
    """The padded length of a batch whose longest row has `length` tokens, at most
    `limit`: the next power of two from 16 up to 256, then the next multiple of 256 (a
    few lengths to compile, and a long row padded by less than half)."""
    padded = max(16, 1 << (length - 1).bit_length()) if length <= 256 else -(-length // 256) * 256
    return padded if limit is None else min(padded, limit)


def _order(lengths: Sequence[int]) -> list[int]:
    """Indices longest first (a batch's first row sets its padded length)."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def _unsort(order: list[int], values: list[Any]) -> list[Any]:
    out: list[Any] = [None] * len(order)
    for i, v in zip(order, values, strict=True):
        out[i] = v
    return out


def _greedy(logits: Array) -> Array:
    """`jnp.argmax` over the vocabulary, as the sampler takes it (two reductions, which
    XLA's CPU backend vectorises; the variadic one it runs an element at a time)."""
    return _argmax(logits.reshape(-1, logits.shape[-1])).reshape(logits.shape[:-1])


def _scores(
    model: Any, batch: dict[str, Array], key: Any
) -> dict[str, Float[Array, " batch"] | Bool[Array, " batch"]]:
    """Each row's summed log-probability of its scored tokens, and whether each of them
    is the most likely next token (float32; the logits a chunk at a time at large
    vocabularies)."""
    del key

    def per_token(logits: Array, labels: Int[Array, "batch tokens"]) -> tuple[Array, Array]:
        return -cross_entropy(logits, labels), _greedy(logits) == labels

    logp, hit = map_logits(model, batch["ids"], per_token, batch["targets"], chunk_tokens="auto")
    scored = batch["scored"]
    return {
        "logprob": jnp.where(scored, logp, 0.0).sum(-1),
        "greedy": jnp.all(hit | ~scored, axis=-1),
    }


def _shared_scores(
    model: Any, batch: dict[str, Array], key: Any
) -> dict[str, Float[Array, "batch k"] | Bool[Array, "batch k"]]:
    """`_scores` of each row's `k` requests: the row's prefix decoded into the cache
    once (its logits unused, so never computed), then each request's own tokens decoded
    from position `start`."""
    del key

    def row(prefix: Array, start: Array, fed: Array, targets: Array, scored: Array) -> Any:
        cache = model.init_cache(prefix.shape[0] + fed.shape[-1])
        _, cache = model.decode(prefix, cache, 0)

        def one(ids: Array, labels: Array, counted: Array) -> tuple[Array, Array]:
            logits, _ = model.decode(ids, cache, start)
            logp = -cross_entropy(logits, labels)
            hit = _greedy(logits) == labels
            return jnp.where(counted, logp, 0.0).sum(), jnp.all(hit | ~counted)

        return jax.vmap(one)(fed, targets, scored)

    parts = (batch[k] for k in ("prefix", "start", "fed", "targets", "scored"))
    logprob, greedy = jax.vmap(row)(*parts)
    return {"logprob": logprob, "greedy": greedy}


@functools.cache
def _generator(
    n: int, eos_id: int | None, temperature: float, top_k: int | None, top_p: float | None
) -> Callable[[Any, dict[str, Array], Any], Array]:
    """The `pred_fn` that continues a batch by `n` tokens: one function per setting, so
    that rounds and calls of the same shapes share their compilation."""

    def pred_fn(model: Any, batch: dict[str, Array], key: Any) -> Array:
        return sampling.generate(
            model,
            batch["ids"],
            prompt_lengths=batch["lengths"],
            max_new_tokens=n,
            eos_id=eos_id,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            key=key,
        )

    return pred_fn


def loglikelihoods(
    model: Any,
    requests: Sequence[tuple[Tokens, Tokens]],
    *,
    max_length: int,
    mesh: Mesh | None = None,
    per_device_batch_size: int = 8,
    progress: bool = False,
) -> list[tuple[float, bool]]:
    """`log p(continuation | context)` of each request, and whether greedy decoding
    would produce the continuation, as the LM Evaluation Harness's `hf` backend scores
    them.

    A request longer than `max_length + 1` tokens loses its context's first tokens: the
    model reads the last `max_length` tokens before each scored one (the harness's
    left truncation).

    Args:
        model: a decoder of the zoo (called on one row of ids), placed on `mesh` or not.
        requests: `(context, continuation)` token ids; the context of at least one token
            (the harness uses BOS or EOS for an empty one), the continuation of at least
            one and at most `max_length`.
        max_length: the most tokens the model reads at once (its context).
        mesh: from `make_mesh`; defaults to the model's.
        per_device_batch_size: requests per data-parallel device at once.
        progress: report the compilation and the requests done (`rc.predict`).

    Returns:
        `(log-probability, is_greedy)` per request, in order; float32 sums.

    Raises:
        ValueError: an empty context or continuation, or a continuation longer than
            `max_length`.

    Example:
        >>> [(logprob, greedy)] = rc.eval.loglikelihoods(
        ...     model, [([464, 3290], [318, 257])], max_length=1024)
    """
    wholes = []
    for i, (context, continuation) in enumerate(requests):
        if not context or not continuation:
            raise ValueError(
                f"request {i} has a context of {len(context)} and a continuation of "
                f"{len(continuation)} tokens; each needs at least one token (give an empty "
                "context as the BOS or EOS token, as the harness does)."
            )
        if len(continuation) > max_length:
            raise ValueError(
                f"request {i}'s continuation has {len(continuation)} tokens, more than the "
                f"model reads at once (max_length={max_length}): it cannot be scored whole. "
                "Shorten it, or score it as a rolling log-likelihood."
            )
        whole = (list(context) + list(continuation))[-(max_length + 1) :]
        wholes.append((whole, len(continuation)))
    how = {"mesh": mesh, "per_device_batch_size": per_device_batch_size, "progress": progress}
    # Requests whose context (less its last token) others share are grouped: the model
    # reads that prefix once into a key/value cache and each request's own tokens after it.
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (whole, n) in enumerate(wholes):
        groups.setdefault(tuple(whole[: len(whole) - 1 - n]), []).append(i)
    cached = _cached(model)
    plain = [g for prefix, g in groups.items() if not prefix or not cached]
    shared = [g for prefix, g in groups.items() if prefix and cached]
    out: list[Any] = [None] * len(wholes)
    if plain:
        alone = [i for g in plain for i in g]
        scores = _score_alone(model, [wholes[i] for i in alone], max_length, how)
        for i, score in zip(alone, scores, strict=True):
            out[i] = score
    if shared:
        members = [[wholes[i] for i in g] for g in shared]
        for g, scores in zip(shared, _score_shared(model, members, max_length, how), strict=True):
            for i, score in zip(g, scores, strict=True):
                out[i] = score
    return out


def _fill(
    ids: np.ndarray, targets: np.ndarray, scored: np.ndarray, tokens: list[int], n: int
) -> None:
    """One request's row: its tokens but the last read, each one's next token its
    target, and the targets of its last `n` tokens (the continuation) scored."""
    ids[: len(tokens) - 1] = tokens[:-1]
    targets[: len(tokens) - 1] = tokens[1:]
    scored[len(tokens) - 1 - n : len(tokens) - 1] = True


def _cached(model: Any) -> bool:
    return hasattr(model, "init_cache") and hasattr(model, "decode")


def _score_alone(
    model: Any, rows: list[tuple[list[int], int]], max_length: int, how: dict[str, Any]
) -> list[tuple[float, bool]]:
    """Each request a row of its own, run through the model whole."""

    def collate(batch: list[tuple[list[int], int]]) -> dict[str, np.ndarray]:
        width = bucket(max(len(w) - 1 for w, _ in batch), max_length)
        ids = np.zeros((len(batch), width), np.int32)
        targets = np.zeros_like(ids)
        scored = np.zeros(ids.shape, bool)
        for r, (whole, n) in enumerate(batch):
            _fill(ids[r], targets[r], scored[r], whole, n)
        return {"ids": ids, "targets": targets, "scored": scored}

    order = _order([len(w) for w, _ in rows])
    out = predict(
        model,
        [rows[i] for i in order],
        collate_fn=collate,
        pred_fn=_scores,
        output_fn=lambda o: (float(o["logprob"]), bool(o["greedy"])),
        **how,
    )
    return _unsort(order, out)


def _score_shared(
    model: Any, groups: list[list[tuple[list[int], int]]], max_length: int, how: dict[str, Any]
) -> list[list[tuple[float, bool]]]:
    """Requests of one prefix together: the prefix read into the cache once, each
    request's tokens after it (its last context token and its continuation) decoded
    from there."""

    def width(group: list[tuple[list[int], int]]) -> int:
        # At most max_length - 1: a shared prefix has a token, and its continuations at
        # most max_length - 1.
        return bucket(max(n for _, n in group), max_length - 1)

    def collate(batch: list[list[tuple[list[int], int]]]) -> dict[str, np.ndarray]:
        fed_width = max(map(width, batch))
        # The shared part a row reads first: its positions and the fed tokens' must fit
        # the model's `max_length` positions.
        starts = [min(len(g[0][0]) - 1 - g[0][1], max_length - fed_width) for g in batch]
        room = max_length - fed_width
        prefix = np.zeros((len(batch), bucket(max(max(starts), 1), room)), np.int32)
        k = max(len(g) for g in batch)
        fed = np.zeros((len(batch), k, fed_width), np.int32)
        targets = np.zeros_like(fed)
        scored = np.zeros(fed.shape, bool)
        for r, (group, start) in enumerate(zip(batch, starts, strict=True)):
            prefix[r, :start] = group[0][0][:start]
            for j, (whole, n) in enumerate(group):
                _fill(fed[r, j], targets[r, j], scored[r, j], whole[start:], n)
        return {
            "prefix": prefix,
            "start": np.array(starts, np.int32),
            "fed": fed,
            "targets": targets,
            "scored": scored,
        }

    order = sorted(
        range(len(groups)),
        key=lambda g: (-len(groups[g]), -width(groups[g]), -len(groups[g][0][0])),
    )
    out = predict(
        model,
        [groups[i] for i in order],
        collate_fn=collate,
        pred_fn=_shared_scores,
        output_fn=lambda o: [
            (float(a), bool(b)) for a, b in zip(o["logprob"], o["greedy"], strict=True)
        ],
        **how,
    )
    return _unsort(order, [s[: len(groups[g])] for g, s in zip(order, out, strict=True)])


def continuations(
    model: Any,
    prompts: Sequence[Tokens],
    *,
    max_new_tokens: int,
    done: Callable[[list[int]], bool] = lambda _: False,
    eos_id: int | Sequence[int] | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    first_round: int = 16,
    mesh: Mesh | None = None,
    per_device_batch_size: int = 8,
    progress: bool = False,
) -> list[list[int]]:
    """Each prompt continued (greedily by default) until `done` says its new tokens are
    enough, it produced `eos_id`, or it has `max_new_tokens`.

    The continuations grow in rounds of `first_round` tokens, then twice as many each
    round (the key/value-cache generation, `rc.sampling.generate`); after each round
    `done` reads every row's tokens so far (the harness's stop sequences), and only the
    rows not done go on: a batch whose answers end in a few tokens costs a few steps,
    not `max_new_tokens`. Greedy decoding gives the tokens of one uninterrupted
    generation.

    Args:
        model: a decoder of the zoo, placed on `mesh` or not.
        prompts: token ids, each of at least one token; a prompt plus `max_new_tokens`
            must fit the model's positions.
        max_new_tokens: the most tokens a continuation gets.
        done: `new tokens -> bool`, true once a continuation may stop.
        eos_id: a row that produces it (or one of them) stops there, the token kept.
        temperature, top_k, top_p: sampling, as `rc.sampling.generate`; 0 is greedy.
        seed: sampling's seed; each round and batch draws with a key of its own.
        first_round: the tokens of the first round.
        mesh: from `make_mesh`; defaults to the model's.
        per_device_batch_size: prompts per data-parallel device at once.
        progress: report the compilations and the prompts done (`rc.predict`).

    Returns:
        The new tokens of each prompt, in order: up to and including `eos_id` when it
        came, at most `max_new_tokens`, possibly past the point where `done` became
        true (the end of its round).

    Example:
        >>> newline = lambda t: "\\n" in tokenizer.decode(t)
        >>> rc.eval.continuations(model, [ids], max_new_tokens=64, done=newline)
    """
    if not all(len(p) for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. the BOS token).")
    limit = getattr(model, "max_positions", None)
    ends = [] if eos_id is None else [eos_id] if isinstance(eos_id, int) else list(eos_id)
    new: list[list[int]] = [[] for _ in prompts]
    live, made, size, round_ = list(range(len(prompts))), 0, max(1, first_round), 0
    while live and made < max_new_tokens:
        n = min(size, max_new_tokens - made)
        rows = [list(prompts[i]) + new[i] for i in live]
        order = _order([len(r) for r in rows])
        cap = None if limit is None else limit - n
        if cap is not None and len(rows[order[0]]) > cap:
            raise ValueError(
                f"a prompt of {len(prompts[live[order[0]]])} tokens and {max_new_tokens} new "
                f"ones exceed the model's {limit} positions; truncate the prompts to "
                f"{cap + n - max_new_tokens} tokens or ask for fewer new tokens."
            )

        def collate(batch: list[list[int]], cap: int | None = cap) -> Any:
            width = bucket(max(len(r) for r in batch), cap)
            ids = np.zeros((len(batch), width), np.int32)
            for r, row in enumerate(batch):
                ids[r, : len(row)] = row
            return {"ids": ids, "lengths": np.array([len(r) for r in batch], np.int32)}

        out = predict(
            model,
            [rows[i] for i in order],
            collate_fn=collate,
            pred_fn=_generator(n, ends[0] if ends else None, float(temperature), top_k, top_p),
            output_fn=lambda t: np.asarray(t).tolist(),
            mesh=mesh,
            per_device_batch_size=per_device_batch_size,
            seed=hash((seed, round_)) & 0x7FFFFFFF,
            progress=progress,
        )
        still = []
        for i, tokens in zip(live, _unsort(order, out), strict=True):
            end = next((t for t, token in enumerate(tokens) if token in ends), None)
            new[i] += tokens if end is None else tokens[: end + 1]
            if not (end is not None or done(new[i])):
                still.append(i)
        live, made, size, round_ = still, made + n, 2 * size, round_ + 1
    return new
