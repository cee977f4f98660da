"""Context parallelism: attention over a sequence split along a mesh axis.

Each device holds one contiguous block of the sequence: its queries, keys, values
and key padding mask. `context_parallel_attention` computes the attention of the
whole sequence without any device ever holding all of it:

- `strategy="ring"` (Liu et al. 2023, *Ring Attention with Blockwise Transformers*):
  the key/value blocks travel around the ring of devices (`jax.lax.ppermute`), one
  hop per step, and each device folds every block it receives into its queries'
  result with the online softmax (a running maximum and sum per query, in float32,
  as flash attention does). The ring is unrolled, one step per device of the axis,
  so XLA can overlap each hop with the arithmetic on the block in hand. A device
  holds scores for one block of queries against one block of keys, `(seq / n)^2`
  per head, never against the whole sequence -- or, with `block_size`, blocks of
  that many queries and keys within each step (blockwise attention,
  `nn/_blockwise.py`, whose arithmetic every step runs). The gradient is a second
  trip around the ring (a custom VJP): each key/value block travels with its
  gradient accumulators and comes home after the last step, so the backward pass
  keeps only the inputs, the output and one number per query from the forward.
- `strategy="all_gather"`: every device gathers the whole keys and values
  (`jax.lax.all_gather`) and attends its queries to them: fewer, larger collectives
  and plain autodiff, but scores of `seq / n` queries against all `seq` keys.

With `causal=True` device `i`'s queries see all of blocks `< i`, block `i` causally,
and nothing of blocks `> i`: the ring skips those blocks' arithmetic, as it skips
blocks wholly outside a sliding `window` and blocks that share no segment id with
the queries (documents packed into one row; the segment ids travel with the keys).
Scores may be soft-capped (`softcap`).

The numbers are those of `rc.nn.attention`: scores scaled by `1 / sqrt(head_dim)`,
masked with float32's lowest value (so a query that sees no key at all averages
every value, as a softmax over equal scores does), the softmax in float32 whatever
the inputs' dtype, and grouped-query heads (each key/value head serves
`heads // kv_heads` consecutive query heads).
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from .._checks import typechecked
from ..nn._blockwise import (
    LOWEST,
    Blocks,
    Tokens,
    default_block,
    finish,
    fold,
    full_like,
    grads,
    grouped,
    init_state,
    scale_of,
    ungrouped,
    unseen_value_grads,
)
from . import _active

__all__ = ["context_parallel_attention"]

_F32 = jnp.float32
STRATEGIES = ("ring", "all_gather")


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What every device needs to know about the split: static, hashable.

    `blocks` are the block sizes within one device's share of the sequence (the whole
    share: one block of scores per ring step) and the score function; `n_keys` the
    whole sequence's keys.
    """

    axis: str
    size: int
    blocks: Blocks
    n_keys: int
    segments: bool


# Shapes inside the split, on one device: queries `(b k g t d)` -- batch, key/value
# head, query head within its group, query token, feature -- and keys/values
# `(b s k d)`; scores and probabilities `(b k g t s)`; running statistics `(b k g t)`.
# The arithmetic of each step is `nn/_blockwise.py`'s, which skips the blocks of a
# step that no query sees (the causal future, outside the window, no shared segment).


def _ring_permute(x: Array, layout: _Layout) -> Array:
    """Send `x` to the next device of the ring; receive the previous device's."""
    pairs = [(j, (j + 1) % layout.size) for j in range(layout.size)]
    return jax.lax.ppermute(x, layout.axis, pairs)


def _split(layout: _Layout, q: Array, k: Array, keep: Array, segments: tuple[Array, ...]):
    """This device's queries, and where the block of keys `k` that came from `step`
    devices back starts, as `Tokens`."""
    me = jax.lax.axis_index(layout.axis)
    q_seg = segments[0] if layout.segments else None
    queries = Tokens(start=me * q.shape[1], segment_ids=q_seg)

    def keys(step: int, keep: Array, kv_seg: Array | None) -> Tokens:
        source = (me - step) % layout.size
        return Tokens(start=source * k.shape[1], segment_ids=kv_seg, valid=keep)

    return queries, keys


def _ring_forward(
    layout: _Layout, q: Array, k: Array, v: Array, keep: Array, *segments: Array
) -> tuple[Array, tuple[Any, ...]]:
    qg = grouped(q, k.shape[2])
    queries, keys = _split(layout, q, k, keep, segments)
    kv_seg = segments[1] if layout.segments else None
    block = (k, v, keep, kv_seg)
    state = init_state(qg)
    value_sum = full_like(k, (k.shape[0], k.shape[2], k.shape[3]), 0.0)
    for step in range(layout.size):
        if step:
            # Now the block of device me - step. Its hop depends only on the previous
            # block, not on the arithmetic with it, so the two can overlap.
            block = jax.tree.map(lambda x: _ring_permute(x, layout), block)
        bk, bv, bkeep, bseg = block
        state = fold(state, qg, bk, bv, layout.blocks, queries, keys(step, bkeep, bseg))
        value_sum = value_sum + bv.astype(_F32).sum(1)
    # A query that sees no key averages every value of the sequence.
    out, lse = finish(state, (value_sum / layout.n_keys)[:, :, None, None, :])
    out = ungrouped(out).astype(q.dtype)
    return out, (q, k, v, keep, segments, out, lse)


def _ring_backward(layout: _Layout, residuals: tuple[Any, ...], g: Array) -> tuple[Any, ...]:
    # The barrier starts this ring once the cotangent is there, not during the forward.
    (q, k, v, keep, segments, out, lse), g = jax.lax.optimization_barrier((residuals, g))
    kv_heads = k.shape[2]
    qg = grouped(q, kv_heads)
    do = grouped(g.astype(_F32), kv_heads)
    delta = (do * grouped(out.astype(_F32), kv_heads)).sum(-1)
    queries, keys = _split(layout, q, k, keep, segments)
    # What this device's queries that saw no key give every value of the sequence.
    unseen = unseen_value_grads(do, lse, layout.n_keys)[:, None]
    kv_seg = segments[1] if layout.segments else None
    # Each key/value block travels with its gradient accumulators; after the last step
    # device `me` holds block me + 1's, which one more hop takes home. Keys and values
    # travel stacked: the forward's hops, one for each, are then not the same ppermutes
    # of the same blocks, which XLA would merge, keeping every block received in the
    # forward alive until the backward (the whole sequence's keys and values).
    block = (jnp.stack([k, v]), keep, kv_seg)

    def block_grads(step: int, block: tuple[Any, ...]) -> tuple[Array, Array]:
        (bk, bv), bkeep, bseg = block
        dq, dk, dv, _ = grads(
            qg, bk, bv, do, lse, delta, layout.blocks, queries, keys(step, bkeep, bseg)
        )
        return dq, jnp.stack([dk, dv + unseen])

    dq, dkv = block_grads(0, block)
    for step in range(1, layout.size):
        block = jax.tree.map(lambda x: _ring_permute(x, layout), block)
        dkv = _ring_permute(dkv, layout)
        dq_step, dkv_step = block_grads(step, block)
        dq, dkv = dq + dq_step, dkv + dkv_step
    if layout.size > 1:
        dkv = _ring_permute(dkv, layout)
    dk, dv = dkv
    no_segments = tuple(None for _ in segments)
    return (
        ungrouped(dq).astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        None,
        *no_segments,
    )


def _make_ring(layout: _Layout) -> Callable[..., Array]:
    """Ring attention on one device's blocks, with its gradient as a second ring."""

    @jax.custom_vjp
    def ring(q: Array, k: Array, v: Array, keep: Array, *segments: Array) -> Array:
        return _ring_forward(layout, q, k, v, keep, *segments)[0]

    def fwd(q: Array, k: Array, v: Array, keep: Array, *segments: Array) -> tuple[Array, Any]:
        return _ring_forward(layout, q, k, v, keep, *segments)

    def bwd(residuals: tuple[Any, ...], g: Array) -> tuple[Any, ...]:
        return _ring_backward(layout, residuals, g)

    ring.defvjp(fwd, bwd)
    return ring


def _gathered(
    layout: _Layout, q: Array, k: Array, v: Array, keep: Array, *segments: Array
) -> Array:
    """This device's queries against the whole sequence's keys and values, gathered."""
    gather = lambda x: jax.lax.all_gather(x, layout.axis, axis=1, tiled=True)  # noqa: E731
    k_all, v_all, keep_all = gather(k), gather(v), gather(keep)
    qg = grouped(q, k.shape[2])
    spec = layout.blocks
    visible = keep_all[:, None, :]
    t = q.shape[1]
    positions = (jax.lax.axis_index(layout.axis) * t + jnp.arange(t))[:, None]
    key_positions = jnp.arange(k_all.shape[1])[None, :]
    if spec.causal:
        visible = visible & (key_positions <= positions)
    if spec.window is not None:
        visible = visible & (key_positions > positions - spec.window)
    if layout.segments:
        q_seg, kv_seg = segments[0], gather(segments[1])
        visible = visible & (q_seg[:, :, None] == kv_seg[:, None, :])
    scores = jnp.einsum("bkgtd,bskd->bkgts", qg, k_all, preferred_element_type=_F32) * spec.scale
    if spec.softcap is not None:
        scores = spec.softcap * jnp.tanh(scores / spec.softcap)
    scores = jnp.where(visible[:, None, None], scores, LOWEST)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->bkgtd", weights.astype(v.dtype), v_all)
    return ungrouped(out).astype(q.dtype)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_split(what: str, length: int, axis: str, mesh: Mesh) -> None:
    size = int(mesh.shape[axis])
    if length % size:
        fitting = [a for a in mesh.axis_names if length % int(mesh.shape[a]) == 0]
        others = f"; this mesh's axes that divide it: {fitting}" if fitting else ""
        raise ValueError(
            f"context_parallel_attention splits the sequence over the {axis!r} axis of "
            f"size {size}, and {what} of {length} tokens is not a multiple of {size}. Pad "
            f"the sequence to {math.ceil(length / size) * size} tokens (and mask the padding "
            f"with `mask`), or split over an axis whose size divides {length} (sizes that "
            f"do: {_divisors(length)}){others}."
        )


def _check(
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    mesh: Mesh,
    axis: str,
    causal: bool,
    strategy: str,
    window: int | None = None,
    segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
) -> None:
    if axis not in mesh.axis_names:
        raise ValueError(
            f"axis={axis!r} is not an axis of this mesh, whose axes are "
            f"{dict(mesh.shape)}. Pass one of {list(mesh.axis_names)} as the sequence axis, "
            "or build a mesh with one, e.g. jax.make_mesh((n,), ('seq',), "
            "axis_types=(jax.sharding.AxisType.Auto,))."
        )
    batch, (seq, heads), (kv_seq, kv_heads) = q.shape[:-3], q.shape[-3:-1], k.shape[-3:-1]
    if heads % kv_heads:
        raise ValueError(
            f"q has {heads} heads, which is not a multiple of k and v's {kv_heads} heads; "
            "with grouped-query attention each key/value head serves heads // kv_heads "
            "query heads."
        )
    if causal and kv_seq != seq:
        raise ValueError(
            f"causal attention needs as many keys as queries; got {seq} queries and {kv_seq} "
            "keys. Pass causal=False for cross-attention."
        )
    if mask is not None:
        expected = (*batch, kv_seq)
        if mask.shape != expected:
            if mask.shape[-2:] == (seq, kv_seq) or mask.ndim == len(expected) + 1:
                raise ValueError(
                    f"context_parallel_attention cannot split a mask of shape {mask.shape}, a "
                    "(query, key) matrix: each device holds one block of the keys, and the "
                    "masks it splits are a key padding mask of shape (*batch, kv_seq) = "
                    f"{expected} (`mask`) and the causal mask (`causal=True`), alone or "
                    "together. For another pattern use unsplit attention."
                )
            raise ValueError(
                f"mask must be a key padding mask of shape (*batch, kv_seq) = {expected} "
                f"(True or 1 for a key to attend to); got shape {mask.shape}."
            )
    if window is not None and (not causal or window < 1):
        raise ValueError(
            f"window={window!r} is a sliding window over the past: it needs causal=True "
            "and a positive number of positions."
        )
    if kv_segment_ids is not None and segment_ids is None:
        raise ValueError(
            "kv_segment_ids (the keys' documents) must come with the queries' segment_ids."
        )
    if segment_ids is not None and kv_segment_ids is None and kv_seq != seq:
        raise ValueError(
            f"segment_ids for {seq} queries and {kv_seq} keys; pass the keys' own as "
            "kv_segment_ids."
        )
    _check_split("the query sequence", seq, axis, mesh)
    if kv_seq != seq:
        _check_split("the key/value sequence", kv_seq, axis, mesh)


@typechecked
def context_parallel_attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch kv_seq kv_heads head_dim"],
    v: Float[Array, "*batch kv_seq kv_heads head_dim"],
    *,
    mesh: Mesh,
    axis: str,
    causal: bool,
    mask: Bool[Array, "..."] | Int[Array, "..."] | None = None,
    scale: float | None = None,
    strategy: Literal["ring", "all_gather"] = "ring",
    window: int | None = None,
    softcap: float | None = None,
    segment_ids: Int[Array, "*batch seq"] | None = None,
    kv_segment_ids: Int[Array, "*batch kv_seq"] | None = None,
    block_size: int | tuple[int, int] | None = None,
) -> Float[Array, "*batch seq heads head_dim"]:
    """Attention whose sequence is split over the mesh axis `axis`: context parallelism.

    Device `i` of the axis holds (and returns) the `i`-th contiguous block of the
    sequence, so no device holds every token's activations: a sequence longer than
    one device's share still trains. The result, and its gradient, equal the unsplit
    attention's (`rc.nn.attention`: `softmax(cap(q k^T * scale)) v` over the visible
    keys, with the softmax in float32). Only the sequence axis is split by hand
    (`jax.shard_map` over `axis` alone); the other mesh axes stay with the compiler,
    so a batch split over `"data"` stays split.

    `strategy="ring"` is ring attention (Liu et al. 2023): the key/value blocks go
    around the ring of devices with `jax.lax.ppermute`, folded into each device's
    queries by the online softmax; a device holds the scores of its queries against
    one block of keys at a time, `(seq / n)^2` per head (or blocks of `block_size`
    within it), and the gradient is a second trip around the ring.
    `strategy="all_gather"` gathers the whole keys and values on every device
    (`jax.lax.all_gather`): fewer, larger collectives, but scores of `seq / n`
    queries against all `seq` keys.

    The ring's gradient is a custom VJP: `jax.grad` and `jax.vjp` work, forward-mode
    differentiation (`jax.jvp`, `jax.jacfwd`) does not. Under `causal=True` device `i`
    computes `i + 1` of the `n` blocks, so the last device of the axis sets the pace.

    Args:
        q: queries, split into heads.
        k: keys; fewer heads than `q` is grouped-query attention (each key/value head
            serves `heads // kv_heads` consecutive query heads).
        v: values, shaped as `k`.
        mesh: the device mesh.
        axis: the mesh axis the sequence is split over (the `"model"` or `"data"` axis of
            `redcoast.make_mesh`, or a dedicated one); its size must divide `seq` and
            `kv_seq`.
        causal: each query attends to its own and earlier positions only (needs
            `seq == kv_seq`); device `i`'s queries skip the blocks after `i`.
        mask: a key padding mask of shape `(*batch, kv_seq)`, True (or 1) for a key to
            attend to; split over `axis` like the keys. A query that sees no key at all
            gets the mean of every value, as the unsplit softmax gives.
        scale: multiplies the scores; default `1 / sqrt(head_dim)`.
        strategy: `"ring"` or `"all_gather"`.
        window: with `causal`, each query sees only the `window` most recent positions
            (its own included); blocks wholly before the window are skipped.
        softcap: scores become `softcap * tanh(scores / softcap)`.
        segment_ids: `(*batch, seq)`, which document each query belongs to: a query sees
            keys of its own document only; blocks sharing no document are skipped.
        kv_segment_ids: the keys' documents, `(*batch, kv_seq)`, when they are not the
            queries' own.
        block_size: queries and keys per block within each device's share (an int or
            a `(query, key)` pair dividing `seq / n` and `kv_seq / n`); default: the
            whole share, one block of scores per ring step.

    Returns:
        The attention output of every query, shaped as `q`, split over `axis` along the
        sequence.

    Raises:
        jaxtyping.TypeCheckError: `q`, `k`, `v` or the segment ids with shapes that
            disagree (batch dimensions, `head_dim`, one segment id per token), a mask
            that holds neither booleans nor integers, a `mesh` that is not a `Mesh`, or
            a `strategy` other than `"ring"` and `"all_gather"`.
        ValueError: `axis` is not an axis of `mesh`; its size does not divide the
            sequence; `mask` is not a key padding mask (a `(seq, kv_seq)` matrix cannot
            be split: use `causal=True` for the causal one); `causal` with
            `seq != kv_seq`; head counts that do not group; a `window` without
            `causal`; `kv_segment_ids` without `segment_ids`; a block size that
            does not divide a device's share.

    Example:
        >>> mesh = jax.make_mesh((8,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> q = k = v = jnp.ones((2, 4096, 8, 64))   # (batch, seq, heads, head_dim)
        >>> out = context_parallel_attention(q, k, v, mesh=mesh, axis="seq", causal=True)
        >>> out.shape, out.sharding.spec
        ((2, 4096, 8, 64), P(None, 'seq'))
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    mask = None if mask is None else jnp.asarray(mask)
    _check(q, k, v, mask, mesh, axis, causal, strategy, window, segment_ids, kv_segment_ids)
    active = _active.current()
    if active is not None:  # a split attention of the model a step runs
        active.attention_calls += 1
    batch = q.shape[:-3]
    seq, kv_seq = q.shape[-3], k.shape[-3]
    size = int(mesh.shape[axis])
    keep = jnp.ones(k.shape[:-2], dtype=bool) if mask is None else mask.astype(bool)
    flat = int(np.prod(batch, dtype=np.int64))
    q4 = q.reshape(flat, *q.shape[-3:])
    k4, v4 = k.reshape(flat, *k.shape[-3:]), v.reshape(flat, *v.shape[-3:])
    segments: tuple[Array, ...] = ()
    if segment_ids is not None:
        theirs = segment_ids if kv_segment_ids is None else kv_segment_ids
        segments = (segment_ids.reshape(flat, seq), theirs.reshape(flat, kv_seq))
    blocks = _blocks(block_size, seq // size, kv_seq // size, q.shape)
    layout = _Layout(
        axis=axis,
        size=size,
        blocks=Blocks(
            q=blocks[0],
            kv=blocks[1],
            causal=causal,
            window=window,
            softcap=softcap,
            scale=scale_of(q.shape[-1], scale),
        ),
        n_keys=kv_seq,
        segments=bool(segments),
    )
    if strategy == "ring":
        local: Callable[..., Array] = _make_ring(layout)
    else:
        local = lambda *blocks: _gathered(layout, *blocks)  # noqa: E731
    split = P(None, axis)
    args = (q4, k4, v4, keep.reshape(flat, kv_seq), *segments)
    out = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(split for _ in args),
        out_specs=split,
        axis_names={axis},
        # Under jax.vmap, JAX 0.10's check of varying axes trips on the loop index of
        # the blocks (a `mul` of it "must match"); the ring needs no such check.
        check_vma=False,
    )(*args)
    return out.reshape(q.shape)


def _blocks(
    block_size: int | tuple[int, int] | None, seq: int, kv_seq: int, q_shape: tuple[int, ...]
) -> tuple[int, int]:
    """Block sizes within one device's `seq` queries and `kv_seq` keys."""
    if block_size is None:
        return seq, kv_seq
    pair = block_size if isinstance(block_size, tuple) else (block_size, block_size)
    for what, n, b in (("queries", seq, pair[0]), ("keys", kv_seq, pair[1])):
        if isinstance(b, bool) or not isinstance(b, int | np.integer) or b < 1 or n % b:
            raise ValueError(
                f"context_parallel_attention: block_size={block_size!r} does not divide "
                f"each device's {n} {what} (q {tuple(q_shape)} split over the axis); pass a "
                f"divisor of {n} such as {default_block(n)}."
            )
    return int(pair[0]), int(pair[1])
