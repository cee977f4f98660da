"""Blockwise attention in plain JAX: an online softmax over blocks of keys, no score matrix.

Flash attention's algorithm (Dao et al. 2022; Rabe and Staats 2021, *Self-attention
Does Not Need O(n^2) Memory*) written with `lax.scan` and `lax.fori_loop`, so it runs
on any backend and XLA partitions it like any other program. The queries are cut into
blocks of `Blocks.q` and the keys into blocks of `Blocks.kv`. A scan runs over the
query blocks; inside it a loop over the key blocks folds each into a running maximum,
sum and weighted sum per query, in float32. Memory for scores is one `(q, kv)` block
per head, whatever the sequence's length.

Blocks that no query of a block sees are not visited: the loop's bounds come from
arithmetic on block indices for causal attention and sliding windows (a query block
stops at its diagonal and starts at its window's first block), and a `lax.cond`
skips a block that shares no segment id, has no unpadded key, or is empty in an
explicit mask. (Under `jax.vmap` the `cond`'s predicate is batched and becomes a
`select`, which computes the block anyway: the bounds still skip.)

The backward pass is a custom VJP that keeps `q`, `k`, `v`, the output and each
query's log-sum-exp, and recomputes each visited block's scores (flash attention's
backward). Gradients reach `q`, `k`, `v` and an additive bias.

The same pieces serve ring attention (`parallel/_ring.py`), which folds one key
block per device into the same state: `fold` and `grads` take where a run of keys
starts in the whole sequence, so causal and window bounds hold across devices.

Shapes, as in the ring: queries grouped by key/value head `(b k g t d)` -- batch,
key/value head, query head within its group, query token, feature; keys and values
`(b s k d)`; running statistics `(b k g t)`. Grouped-query heads never repeat the
keys and values in memory.

The numbers are those of `rc.nn.attention`'s einsum: scores masked with float32's
lowest value, the softmax in float32, and a query that sees no key at all gets the
mean of every value (a softmax over equal scores).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from einops import rearrange
from jax import lax
from jaxtyping import Array

__all__ = [
    "LOWEST",
    "Blocks",
    "Pairwise",
    "State",
    "Tokens",
    "attention",
    "default_block",
    "finish",
    "fold",
    "full_like",
    "grads",
    "grouped",
    "init_state",
    "scale_of",
    "ungrouped",
    "unseen_value_grads",
]

_F32 = jnp.float32
LOWEST = float(jnp.finfo(jnp.float32).min)
"""The score of a key a query does not see."""

DEFAULT_BLOCK = 512
"""The largest block `default_block` picks."""


@dataclasses.dataclass(frozen=True)
class Blocks:
    """What every block computes, static: block sizes and the score function.

    Attributes:
        q: queries per block.
        kv: keys per block.
        causal: a query sees keys at its own position and before.
        window: with `causal`, only the `window` most recent positions.
        softcap: scores become `softcap * tanh(scores / softcap)`.
        scale: multiplies `q . k`.
    """

    q: int
    kv: int
    causal: bool = False
    window: int | None = None
    softcap: float | None = None
    scale: float = 1.0


class Tokens(NamedTuple):
    """A run of tokens: where it starts in the whole sequence, and what it holds.

    Attributes:
        start: the position of its first token (an int, or a traced int32 scalar in
            the ring); causal and window masks compare positions.
        segment_ids: `(b, n)`, which document each token belongs to, or None.
        valid: `(b, n)` bools, False for a key no query sees (padding), or None.
    """

    start: Any = 0
    segment_ids: Array | None = None
    valid: Array | None = None


class Pairwise(NamedTuple):
    """What is given per (query, key) pair: an explicit mask and an additive bias.

    Attributes:
        mask: `(b or 1, t, s)` bools, True where the query sees the key, or None.
        bias: `(b or 1, k, g, t, s)`, added to the scores (after the soft cap), or None.
    """

    mask: Array | None = None
    bias: Array | None = None


State = tuple[Array, Array, Array]
"""The online softmax per query: weighted sum `(b k g t d)`, maximum and sum `(b k g t)`."""

_Acc = tuple[Array, Array, Array, Array | None]
"""The backward pass's accumulators in a query block's loop: dq, dk, dv, dbias."""

_C = TypeVar("_C")


def default_block(n: int, largest: int = DEFAULT_BLOCK) -> int:
    """The largest divisor of `n` up to `largest`: the block size when none is given."""
    if n <= largest:
        return n
    return max(d for d in range(1, largest + 1) if n % d == 0)


def grouped(x: Array, kv_heads: int) -> Array:
    """`(b t h d)` to `(b k g t d)`: query heads grouped by the key/value head they share."""
    return rearrange(x, "b t (k g) d -> b k g t d", k=kv_heads)


def ungrouped(x: Array) -> Array:
    """`(b k g t d)` back to `(b t h d)`."""
    return rearrange(x, "b k g t d -> b t (k g) d")


def full_like(x: Array, shape: tuple[int, ...], value: float) -> Array:
    """A float32 array of `value`, varying over the manual mesh axes `x` varies over
    (inside `jax.shard_map`), so loops may carry it beside arrays computed from `x`."""
    return jnp.full_like(x, value, dtype=_F32, shape=shape)


def init_state(q: Array) -> State:
    """The state before any key: nothing summed, the maximum at the lowest float."""
    stats = q.shape[:-1]
    return full_like(q, q.shape, 0.0), full_like(q, stats, LOWEST), full_like(q, stats, 0.0)


def finish(state: State, mean_value: Array) -> tuple[Array, Array]:
    """The output `(b k g t d)` in float32 and each query's log-sum-exp `(b k g t)`.

    A query that saw no key gets `mean_value` (`(b k 1 1 d)`, the mean of every value,
    as a softmax over equal scores gives) and a log-sum-exp of +inf, so that the
    backward pass gives it no block's weights.
    """
    o, m, total = state
    seen = total > 0
    out = jnp.where(seen[..., None], o / jnp.where(seen, total, 1.0)[..., None], mean_value)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)
    return out, lse


def _block(x: Array, j: Any, size: int, axis: int) -> Array:
    return lax.dynamic_slice_in_dim(x, j * size, size, axis=axis)


def _add_block(x: Array, block: Array, j: Any, size: int) -> Array:
    """`x` with `block` added to its `j`-th block along axis 1."""
    return lax.dynamic_update_slice_in_dim(x, _block(x, j, size, 1) + block, j * size, 1)


def _and(a: Array | None, b: Array | None) -> Array | None:
    if a is None:
        return b
    return a if b is None else a & b


def _kv_range(spec: Blocks, i: Any, offset: Any, n_kv: int) -> tuple[Any, Any]:
    """Which key blocks `[lo, hi)` query block `i` may see, by position alone.

    `offset`: the key-block index of the first query, `queries.start - keys.start`.
    """
    lo: Any = 0
    hi: Any = n_kv
    first = offset + i * spec.q
    if spec.causal:
        hi = jnp.clip((first + spec.q - 1) // spec.kv + 1, 0, n_kv)
    if spec.window is not None:
        lo = jnp.clip((first - spec.window + 1) // spec.kv, 0, n_kv)
    return lo, hi


def _visible(
    spec: Blocks,
    first: Any,
    j: Any,
    q_seg: Array | None,
    keys: Tokens,
    mask: Array | None,
) -> Array | None:
    """Which keys of block `j` each query of a block sees, `(b, 1, 1, q, kv)`; None: all.

    `first`: the first query's position relative to the keys' start; `q_seg`, `mask`:
    the query block's segment ids and mask rows.
    """
    visible = None
    if spec.causal or spec.window is not None:
        q_pos = first + jnp.arange(spec.q)[:, None]
        k_pos = j * spec.kv + jnp.arange(spec.kv)[None, :]
        # A window needs causal (checked by the callers): keys at or before the query.
        position = k_pos <= q_pos
        if spec.window is not None:
            position = position & (k_pos > q_pos - spec.window)
        visible = position[None]
    if q_seg is not None:
        assert keys.segment_ids is not None
        k_seg = _block(keys.segment_ids, j, spec.kv, 1)
        visible = _and(visible, q_seg[:, :, None] == k_seg[:, None, :])
    if keys.valid is not None:
        visible = _and(visible, _block(keys.valid, j, spec.kv, 1)[:, None, :])
    if mask is not None:
        visible = _and(visible, _block(mask, j, spec.kv, 2))
    return None if visible is None else visible[:, None, None]


def _may_see(
    spec: Blocks, queries: Tokens, keys: Tokens, mask: Array | None, n_q: int, n_kv: int
) -> Array | None:
    """`(n_q, n_kv)`: whether any query of a block may see any key of another, by segment
    ids, key padding and the explicit mask (any row of the batch); None: all may."""

    def blocks(x: Array, size: int) -> Array:
        return x.reshape(x.shape[0], -1, size)

    may = None
    if queries.segment_ids is not None:
        assert keys.segment_ids is not None
        qs, ks = blocks(queries.segment_ids, spec.q), blocks(keys.segment_ids, spec.kv)
        # Ranges of ids that do not overlap share no id (exact for sorted ids, as packed
        # documents have; a superset otherwise, and the mask inside decides).
        low = qs.min(-1)[:, :, None] <= ks.max(-1)[:, None, :]
        may = low & (ks.min(-1)[:, None, :] <= qs.max(-1)[:, :, None])
    if keys.valid is not None:
        may = _and(may, blocks(keys.valid, spec.kv).any(-1)[:, None, :])
    if mask is not None:
        m = mask.reshape(mask.shape[0], n_q, spec.q, n_kv, spec.kv).any((2, 4))
        may = _and(may, m)
    return None if may is None else may.any(0)


def _scores(q: Array, k: Array, spec: Blocks) -> tuple[Array, Array | None]:
    """Scores `(b k g q kv)` in float32, soft-capped, and the capped ones' `tanh` (or None)."""
    scores = jnp.einsum("bkgtd,bskd->bkgts", q, k, preferred_element_type=_F32) * spec.scale
    if spec.softcap is None:
        return scores, None
    tanh = jnp.tanh(scores / spec.softcap)
    return spec.softcap * tanh, tanh


def _q_blocks(x: Array, size: int) -> Array:
    """`(b k g t ...)` to `(n b k g size ...)`: the scan's query blocks on the leading axis."""
    b, kh, g, t = x.shape[:4]
    return jnp.moveaxis(x.reshape(b, kh, g, t // size, size, *x.shape[4:]), 3, 0)


def _q_unblocked(x: Array) -> Array:
    n, b, kh, g, size = x.shape[:5]
    return jnp.moveaxis(x, 0, 3).reshape(b, kh, g, n * size, *x.shape[5:])


def _rows(x: Array | None, i: Any, size: int, axis: int) -> Array | None:
    return None if x is None else _block(x, i, size, axis)


class _Grid(NamedTuple):
    """The query blocks against the key blocks: what `fold` and `grads` visit.

    Attributes:
        spec: block sizes and the score function.
        queries, keys, pairwise: as `fold` takes them, defaults filled in.
        n_q, n_kv: how many query and key blocks.
        offset: the first query's position relative to the keys' start.
        may: `(n_q, n_kv)`, which blocks may see each other (`_may_see`); None: all.
    """

    spec: Blocks
    queries: Tokens
    keys: Tokens
    pairwise: Pairwise
    n_q: int
    n_kv: int
    offset: Any
    may: Array | None


def _grid(
    q: Array,
    k: Array,
    spec: Blocks,
    queries: Tokens | None,
    keys: Tokens | None,
    pairwise: Pairwise | None,
) -> _Grid:
    queries, keys, pairwise = queries or Tokens(), keys or Tokens(), pairwise or Pairwise()
    n_q, n_kv = q.shape[3] // spec.q, k.shape[1] // spec.kv
    offset = queries.start - keys.start
    may = _may_see(spec, queries, keys, pairwise.mask, n_q, n_kv)
    return _Grid(spec, queries, keys, pairwise, n_q, n_kv, offset, may)


class _QueryRows(NamedTuple):
    """What query block `i` reads of the per-query inputs, once for all its key blocks.

    Attributes:
        first: its first query's position relative to the keys' start.
        segment_ids: its rows of the queries' segment ids, or None.
        mask: its rows of the explicit mask, or None.
        bias: its rows of the bias, or None.
    """

    first: Any
    segment_ids: Array | None
    mask: Array | None
    bias: Array | None


def _query_rows(grid: _Grid, i: Any) -> _QueryRows:
    size = grid.spec.q
    return _QueryRows(
        grid.offset + i * size,
        _rows(grid.queries.segment_ids, i, size, 1),
        _rows(grid.pairwise.mask, i, size, 1),
        _rows(grid.pairwise.bias, i, size, 3),
    )


def _block_scores(
    grid: _Grid, rows: _QueryRows, qb: Array, kb: Array, j: Any
) -> tuple[Array, Array | None, Array | None]:
    """A query block's scores against key block `j` (`kb`), bias added and the keys it
    does not see at `LOWEST`; the soft cap's `tanh` (`_scores`); and which keys each
    query sees (`_visible`)."""
    spec = grid.spec
    scores, tanh = _scores(qb, kb, spec)
    if rows.bias is not None:
        scores = scores + _block(rows.bias, j, spec.kv, 4).astype(_F32)
    visible = _visible(spec, rows.first, j, rows.segment_ids, grid.keys, rows.mask)
    if visible is not None:
        scores = jnp.where(visible, scores, LOWEST)
    return scores, tanh, visible


def _over_key_blocks(grid: _Grid, i: Any, attend: Callable[[Any, _C], _C], init: _C) -> _C:
    """`attend(j, carry)` from `init` over the key blocks `j` query block `i` may see:
    the loop's bounds leave out those its position rules out (`_kv_range`), and a
    `lax.cond` skips those `grid.may` does."""

    def step(j: Any, carry: _C) -> _C:
        if grid.may is None:
            return attend(j, carry)
        return lax.cond(grid.may[i, j], attend, lambda _, carry: carry, j, carry)

    lo, hi = _kv_range(grid.spec, i, grid.offset, grid.n_kv)
    return lax.fori_loop(lo, hi, step, init)


def fold(
    state: State,
    q: Array,
    k: Array,
    v: Array,
    spec: Blocks,
    queries: Tokens | None = None,
    keys: Tokens | None = None,
    pairwise: Pairwise | None = None,
) -> State:
    """`state` with the keys `k` and values `v` folded in: every query block against every
    key block it may see, one `(q, kv)` block of scores at a time.

    Args:
        state: the running state of the queries `q` (`init_state`).
        q: queries `(b k g t d)`.
        k: keys `(b s k d)`.
        v: values `(b s k d)`.
        spec: block sizes and the score function; they must divide `t` and `s`.
        queries: where the queries start, their segment ids (default: at 0, none).
        keys: where the keys start, their segment ids and padding.
        pairwise: an explicit mask and bias over these queries and keys.
    """
    grid = _grid(q, k, spec, queries, keys, pairwise)

    def query_block(_: None, xs: tuple[Any, ...]) -> tuple[None, State]:
        i, qb, st = xs
        rows = _query_rows(grid, i)

        def attend(j: Any, st: State) -> State:
            o, m, total = st
            kb, vb = _block(k, j, spec.kv, 1), _block(v, j, spec.kv, 1)
            scores, _, visible = _block_scores(grid, rows, qb, kb, j)
            m_new = jnp.maximum(m, scores.max(-1))
            p = jnp.exp(scores - m_new[..., None])
            if visible is not None:  # a query that has seen nothing yet adds nothing
                p = jnp.where(visible, p, 0.0)
            rescale = jnp.exp(m - m_new)
            values = jnp.einsum(
                "bkgts,bskd->bkgtd", p.astype(v.dtype), vb, preferred_element_type=_F32
            )
            return o * rescale[..., None] + values, m_new, total * rescale + p.sum(-1)

        return None, _over_key_blocks(grid, i, attend, st)

    blocked = tuple(_q_blocks(x, spec.q) for x in (q, *state))
    _, new = lax.scan(query_block, None, (jnp.arange(grid.n_q), blocked[0], blocked[1:]))
    o, m, total = (_q_unblocked(x) for x in new)
    return o, m, total


def grads(
    q: Array,
    k: Array,
    v: Array,
    do: Array,
    lse: Array,
    delta: Array,
    spec: Blocks,
    queries: Tokens | None = None,
    keys: Tokens | None = None,
    pairwise: Pairwise | None = None,
) -> tuple[Array, Array, Array, Array | None]:
    """The gradients `(dq, dk, dv, dbias)`, in float32, that the keys `k` contribute.

    Args:
        q, k, v, spec, queries, keys, pairwise: as for `fold`.
        do: the output's cotangent `(b k g t d)`, float32.
        lse: each query's log-sum-exp over every key it sees (`finish`).
        delta: `sum(do * out, -1)` per query, `(b k g t)`.

    Returns:
        `dq` shaped as `q`, `dk` and `dv` as `k`, and the bias's gradient (shaped as
        `pairwise.bias`) or None.
    """
    grid = _grid(q, k, spec, queries, keys, pairwise)
    dk0 = full_like(q, k.shape, 0.0)
    dv0 = full_like(q, v.shape, 0.0)

    def query_block(
        carry: tuple[Array, Array], xs: tuple[Any, ...]
    ) -> tuple[tuple[Array, Array], tuple[Array, Array | None]]:
        i, qb, dob, lseb, deltab = xs
        rows = _query_rows(grid, i)
        dbias0 = None if rows.bias is None else full_like(qb, rows.bias.shape, 0.0)

        def attend(j: Any, acc: _Acc) -> _Acc:
            dq, dk, dv, dbias = acc
            kb, vb = _block(k, j, spec.kv, 1), _block(v, j, spec.kv, 1)
            scores, tanh, _ = _block_scores(grid, rows, qb, kb, j)
            # Zero wherever the query does not see the key (or saw none: lse is +inf),
            # so the masked scores pass no gradient, as through the einsum's `where`.
            p = jnp.exp(scores - lseb[..., None])
            dp = jnp.einsum("bkgtd,bskd->bkgts", dob, vb, preferred_element_type=_F32)
            ds = p * (dp - deltab[..., None])
            if dbias is not None:
                d = ds.sum(0, keepdims=True) if dbias.shape[0] != ds.shape[0] else ds
                dbias = lax.dynamic_update_slice_in_dim(
                    dbias, _block(dbias, j, spec.kv, 4) + d, j * spec.kv, 4
                )
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            dq = dq + jnp.einsum("bkgts,bskd->bkgtd", ds, kb, preferred_element_type=_F32)
            dk_j = jnp.einsum("bkgts,bkgtd->bskd", ds, qb, preferred_element_type=_F32)
            dv_j = jnp.einsum("bkgts,bkgtd->bskd", p, dob)
            return dq, _add_block(dk, dk_j, j, spec.kv), _add_block(dv, dv_j, j, spec.kv), dbias

        dq0 = full_like(qb, qb.shape, 0.0)
        dq, dk, dv, dbias = _over_key_blocks(grid, i, attend, (dq0, *carry, dbias0))
        return (dk, dv), (dq * spec.scale, dbias)

    xs = (jnp.arange(grid.n_q), *(_q_blocks(x, spec.q) for x in (q, do, lse, delta)))
    (dk, dv), (dq, dbias) = lax.scan(query_block, (dk0, dv0), xs)
    if dbias is not None:  # (n b k g q s) -> the bias's (b k g t s)
        dbias = _q_unblocked(dbias)
    return _q_unblocked(dq), dk * spec.scale, dv, dbias


def unseen_value_grads(do: Array, lse: Array, n_keys: int) -> Array:
    """`(b k d)`: the gradient each value gets from the queries that saw no key (each
    averaged all `n_keys` values with weight `1 / n_keys`)."""
    unseen = jnp.isinf(lse)[..., None]
    return jnp.where(unseen, do, 0.0).sum((2, 3)) / n_keys


def _forward(
    spec: Blocks,
    q: Array,
    k: Array,
    v: Array,
    bias: Array | None,
    segments: tuple[Array, Array] | None,
    mask: Array | None,
) -> tuple[Array, tuple[Any, ...]]:
    kv_heads = k.shape[2]
    qg = grouped(q, kv_heads)
    queries, keys = _tokens(segments)
    pairwise = Pairwise(mask, bias)
    state = fold(init_state(qg), qg, k, v, spec, queries, keys, pairwise)
    mean_value = v.astype(_F32).mean(1)[:, :, None, None, :]
    out, lse = finish(state, mean_value)
    out = ungrouped(out).astype(q.dtype)
    return out, (q, k, v, bias, segments, mask, out, lse)


def _tokens(segments: tuple[Array, Array] | None) -> tuple[Tokens, Tokens]:
    if segments is None:
        return Tokens(), Tokens()
    return Tokens(segment_ids=segments[0]), Tokens(segment_ids=segments[1])


def _backward(spec: Blocks, residuals: tuple[Any, ...], g: Array) -> tuple[Any, ...]:
    q, k, v, bias, segments, mask, out, lse = residuals
    kv_heads = k.shape[2]
    qg = grouped(q, kv_heads)
    do = grouped(g.astype(_F32), kv_heads)
    delta = (do * grouped(out.astype(_F32), kv_heads)).sum(-1)
    queries, keys = _tokens(segments)
    dq, dk, dv, dbias = grads(qg, k, v, do, lse, delta, spec, queries, keys, Pairwise(mask, bias))
    dv = dv + unseen_value_grads(do, lse, k.shape[1])[:, None]
    dbias = None if bias is None else dbias.astype(bias.dtype)  # type: ignore[union-attr]
    return (
        ungrouped(dq).astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        dbias,
        None,
        None,
    )


def _attend_impl(
    spec: Blocks,
    q: Array,
    k: Array,
    v: Array,
    bias: Array | None,
    segments: tuple[Array, Array] | None,
    mask: Array | None,
) -> Array:
    return _forward(spec, q, k, v, bias, segments, mask)[0]


_attend = jax.custom_vjp(_attend_impl, nondiff_argnums=(0,))
_attend.defvjp(_forward, _backward)


def attention(
    q: Array,
    k: Array,
    v: Array,
    spec: Blocks,
    *,
    segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    mask: Array | None = None,
    bias: Array | None = None,
) -> Array:
    """Blockwise attention of `q` `(b t h d)` to `k`, `v` `(b s k d)`: the output `(b t h d)`.

    Args:
        q, k, v: queries, keys and values, one batch axis; `h` a multiple of `k`.
        spec: block sizes (dividing `t` and `s`) and the score function.
        segment_ids, kv_segment_ids: `(b t)` and `(b s)` document ids, or None.
        mask: `(b or 1, t, s)` bools, or None.
        bias: `(b or 1, h, t, s)`, or None; its gradient is computed.
    """
    segments = None if segment_ids is None else (segment_ids, kv_segment_ids)
    if bias is not None:
        bias = rearrange(bias, "b (k g) t s -> b k g t s", k=k.shape[2])
    return _attend(spec, q, k, v, bias, segments, mask)


def scale_of(head_dim: int, scale: float | None) -> float:
    """The factor the scores are multiplied by: `scale`, else `1 / sqrt(head_dim)`."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
