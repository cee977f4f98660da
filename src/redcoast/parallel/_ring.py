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
  per head, never against the whole sequence. The gradient is a second trip around
  the ring (a custom VJP): each key/value block travels with its gradient
  accumulators and comes home after the last step, so the backward pass keeps only
  the inputs, the output and two numbers per query from the forward.
- `strategy="all_gather"`: every device gathers the whole keys and values
  (`jax.lax.all_gather`) and attends its queries to them: fewer, larger collectives
  and plain autodiff, but scores of `seq / n` queries against all `seq` keys.

With `causal=True` device `i`'s queries see all of blocks `< i`, block `i` causally,
and nothing of blocks `> i`: the ring skips those blocks' arithmetic.

The numbers are those of the zoo's attention (`redcoast.models.Attention`): scores
scaled by `1 / sqrt(head_dim)`, masked with float32's lowest value (so a query that
sees no key at all averages every value, as a softmax over equal scores does), the
softmax in float32 whatever the inputs' dtype, and grouped-query heads (each
key/value head serves `heads // kv_heads` consecutive query heads).
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from . import _active

__all__ = ["context_parallel_attention"]

_LOWEST = float(jnp.finfo(jnp.float32).min)
_F32 = jnp.float32
STRATEGIES = ("ring", "all_gather")


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What every device needs to know about the split: static, hashable."""

    axis: str
    size: int
    causal: bool
    scale: float


# Shapes inside the split, on one device: queries `(b k g t d)` -- batch, key/value
# head, query head within its group, query token, feature -- and keys/values
# `(b s k d)`; scores and probabilities `(b k g t s)`; running statistics `(b k g t)`.


def _scores(q: Array, k: Array, visible: Array, scale: float) -> Array:
    scores = jnp.einsum("bkgtd,bskd->bkgts", q, k, preferred_element_type=_F32) * scale
    return jnp.where(visible, scores, _LOWEST)


def _weighted_values(p: Array, v: Array) -> Array:
    return jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v, preferred_element_type=_F32)


def _visible(mask: Array, *, diagonal: bool) -> Array:
    """Which keys of a block each query sees, broadcast to `(b 1 1 t s)`.

    `diagonal`: the block holds the same positions as the queries (causal).
    """
    visible = mask[:, None, None, None, :]
    if diagonal:
        n = mask.shape[1]
        visible = visible & jnp.tril(jnp.ones((n, n), dtype=bool))
    return visible


def _first_block(q: Array, k: Array, v: Array, visible: Array, scale: float) -> tuple[Array, ...]:
    scores = _scores(q, k, visible, scale)
    m = scores.max(-1)
    p = jnp.exp(scores - m[..., None])
    return _weighted_values(p, v), m, p.sum(-1)


def _next_block(
    state: tuple[Array, ...], q: Array, k: Array, v: Array, visible: Array, scale: float
) -> tuple[Array, ...]:
    o, m, total = state
    scores = _scores(q, k, visible, scale)
    m_new = jnp.maximum(m, scores.max(-1))
    rescale = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[..., None])
    return o * rescale[..., None] + _weighted_values(p, v), m_new, total * rescale + p.sum(-1)


def _unseen_block(state: tuple[Array, ...], v: Array) -> tuple[Array, ...]:
    """A block wholly in every query's future: all its scores are the lowest float.

    Such a score weighs `exp(lowest - m)`: 0 once a query has seen a key, 1 for a
    query that has seen none yet (`m` still the lowest float), which then averages
    every value as the unsplit softmax does. No `(t, s)` arithmetic is needed.
    """
    o, m, total = state
    weight = jnp.exp(_LOWEST - m)
    values = v.astype(_F32).sum(1)[:, :, None, None, :]  # (b k 1 1 d)
    return o + weight[..., None] * values, m, total + weight * v.shape[1]


def _ring_permute(x: Array, layout: _Layout) -> Array:
    """Send `x` to the next device of the ring; receive the previous device's."""
    pairs = [(j, (j + 1) % layout.size) for j in range(layout.size)]
    return jax.lax.ppermute(x, layout.axis, pairs)


def _grouped(q: Array, kv_heads: int) -> Array:
    return rearrange(q, "b t (k g) d -> b k g t d", k=kv_heads)


def _ungrouped(x: Array) -> Array:
    return rearrange(x, "b k g t d -> b t (k g) d")


def _ring_forward(
    layout: _Layout, q: Array, k: Array, v: Array, mask: Array
) -> tuple[Array, tuple[Array, ...]]:
    qg = _grouped(q, k.shape[2])
    me = jax.lax.axis_index(layout.axis)
    block = (k, v, mask)
    state = _first_block(qg, k, v, _visible(mask, diagonal=layout.causal), layout.scale)
    for step in range(1, layout.size):
        # Now the block of device me - step. Its hop depends only on the previous block,
        # not on the arithmetic with it, so the two can overlap.
        block = jax.tree.map(lambda x: _ring_permute(x, layout), block)
        bk, bv, bmask = block

        def seen(
            st: tuple[Array, ...], bk: Array = bk, bv: Array = bv, bmask: Array = bmask
        ) -> tuple[Array, ...]:
            return _next_block(st, qg, bk, bv, _visible(bmask, diagonal=False), layout.scale)

        if layout.causal:  # the block came from device me - step: in the past iff step <= me
            state = jax.lax.cond(step <= me, seen, lambda st, bv=bv: _unseen_block(st, bv), state)
        else:
            state = seen(state)
    o, m, total = state
    out = _ungrouped(o / total[..., None]).astype(q.dtype)
    return out, (q, k, v, mask, out, m, total)


def _block_grads(
    q: Array,
    k: Array,
    v: Array,
    visible: Array,
    do: Array,
    stats: tuple[Array, Array, Array],
    scale: float,
) -> tuple[Array, Array, Array]:
    """The gradients `(dq, dk, dv)`, in float32, that one key/value block contributes."""
    m, total, delta = stats
    p = jnp.exp(_scores(q, k, visible, scale) - m[..., None]) / total[..., None]
    dv = jnp.einsum("bkgts,bkgtd->bskd", p, do)
    dp = jnp.einsum("bkgtd,bskd->bkgts", do, v, preferred_element_type=_F32)
    # Masked scores are constants (a `where`): no gradient reaches q or k through them.
    ds = jnp.where(visible, p * (dp - delta[..., None]), 0.0)
    dq = jnp.einsum("bkgts,bskd->bkgtd", ds, k, preferred_element_type=_F32) * scale
    dk = jnp.einsum("bkgts,bkgtd->bskd", ds, q, preferred_element_type=_F32) * scale
    return dq, dk, dv


def _add_unseen_block_grads(
    grads: tuple[Array, Array, Array], v: Array, do: Array, stats: tuple[Array, Array, Array]
) -> tuple[Array, Array, Array]:
    """`grads` plus those of a block wholly in the queries' future (see `_unseen_block`).

    Only the values get a gradient: masked scores pass none to the queries or keys.
    """
    m, total, _ = stats
    weight = jnp.exp(_LOWEST - m) / total  # (b k g t)
    per_key = jnp.einsum("bkgt,bkgtd->bkd", weight, do)[:, None]  # the same for every key
    dq, dk, dv = grads
    return dq, dk, dv + per_key


def _ring_backward(
    layout: _Layout, residuals: tuple[Array, ...], g: Array
) -> tuple[Array, Array, Array, None]:
    # The barrier starts this ring once the cotangent is there, not during the forward.
    (q, k, v, mask, out, m, total), g = jax.lax.optimization_barrier((residuals, g))
    kv_heads = k.shape[2]
    qg = _grouped(q, kv_heads)
    do = _grouped(g.astype(_F32), kv_heads)
    delta = (do * _grouped(out.astype(_F32), kv_heads)).sum(-1)
    stats = (m, total, delta)
    me = jax.lax.axis_index(layout.axis)
    # Each key/value block travels with its gradient accumulators; after the last step
    # device `me` holds block me + 1's, which one more hop takes home. Keys and values
    # travel stacked: the forward's hops, one for each, are then not the same ppermutes
    # of the same blocks, which XLA would merge, keeping every block received in the
    # forward alive until the backward (the whole sequence's keys and values).
    block = (jnp.stack([k, v]), mask)
    dq, dk, dv = _block_grads(
        qg, k, v, _visible(mask, diagonal=layout.causal), do, stats, layout.scale
    )
    for step in range(1, layout.size):
        block = jax.tree.map(lambda x: _ring_permute(x, layout), block)
        dk, dv = _ring_permute(jnp.stack([dk, dv]), layout)
        (bk, bv), bmask = block

        def seen(
            acc: tuple[Array, Array, Array], bk: Array = bk, bv: Array = bv, bmask: Array = bmask
        ) -> tuple[Array, Array, Array]:
            grads = _block_grads(
                qg, bk, bv, _visible(bmask, diagonal=False), do, stats, layout.scale
            )
            return acc[0] + grads[0], acc[1] + grads[1], acc[2] + grads[2]

        if layout.causal:  # the block came from device me - step: in the past iff step <= me
            dq, dk, dv = jax.lax.cond(
                step <= me,
                seen,
                lambda acc, bv=bv: _add_unseen_block_grads(acc, bv, do, stats),
                (dq, dk, dv),
            )
        else:
            dq, dk, dv = seen((dq, dk, dv))
    if layout.size > 1:
        dk, dv = _ring_permute(jnp.stack([dk, dv]), layout)
    return _ungrouped(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


def _make_ring(layout: _Layout) -> Callable[[Array, Array, Array, Array], Array]:
    """Ring attention on one device's blocks, with its gradient as a second ring."""

    @jax.custom_vjp
    def ring(q: Array, k: Array, v: Array, mask: Array) -> Array:
        return _ring_forward(layout, q, k, v, mask)[0]

    def fwd(q: Array, k: Array, v: Array, mask: Array) -> tuple[Array, tuple[Array, ...]]:
        return _ring_forward(layout, q, k, v, mask)

    def bwd(residuals: tuple[Array, ...], g: Array) -> tuple[Array, Array, Array, None]:
        return _ring_backward(layout, residuals, g)

    ring.defvjp(fwd, bwd)
    return ring


def _gathered(layout: _Layout, q: Array, k: Array, v: Array, mask: Array) -> Array:
    """This device's queries against the whole sequence's keys and values, gathered."""
    gather = lambda x: jax.lax.all_gather(x, layout.axis, axis=1, tiled=True)  # noqa: E731
    k_all, v_all, mask_all = gather(k), gather(v), gather(mask)
    qg = _grouped(q, k.shape[2])
    visible = mask_all[:, None, None, None, :]
    if layout.causal:
        t = q.shape[1]
        first = jax.lax.axis_index(layout.axis) * t
        positions = first + jnp.arange(t)
        visible = visible & (jnp.arange(k_all.shape[1])[None, :] <= positions[:, None])
    weights = jax.nn.softmax(_scores(qg, k_all, visible, layout.scale), axis=-1)
    out = jnp.einsum("bkgts,bskd->bkgtd", weights.astype(v.dtype), v_all)
    return _ungrouped(out).astype(q.dtype)


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
) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if axis not in mesh.axis_names:
        raise ValueError(
            f"axis={axis!r} is not an axis of this mesh, whose axes are "
            f"{dict(mesh.shape)}. Pass one of {list(mesh.axis_names)} as the sequence axis, "
            "or build a mesh with one, e.g. jax.make_mesh((n,), ('seq',), "
            "axis_types=(jax.sharding.AxisType.Auto,))."
        )
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
    if q.ndim < 3 or k.ndim != q.ndim or v.shape != k.shape:
        raise ValueError(
            "q must be (*batch, seq, heads, head_dim) and k, v (*batch, kv_seq, kv_heads, "
            f"head_dim) with the same batch dimensions; got q {q.shape}, k {k.shape}, "
            f"v {v.shape}."
        )
    batch, (seq, heads, head_dim) = q.shape[:-3], q.shape[-3:]
    kv_seq, kv_heads, kv_dim = k.shape[-3:]
    if k.shape[:-3] != batch or kv_dim != head_dim:
        raise ValueError(
            f"k and v must be (*batch, kv_seq, kv_heads, head_dim) = {(*batch, '...', head_dim)} "
            f"to match q {q.shape}; got {k.shape}."
        )
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
        if not (jnp.issubdtype(mask.dtype, jnp.bool_) or jnp.issubdtype(mask.dtype, jnp.integer)):
            raise TypeError(f"mask must hold booleans or integers (1 = attend), got {mask.dtype}.")
    _check_split("the query sequence", seq, axis, mesh)
    if kv_seq != seq:
        _check_split("the key/value sequence", kv_seq, axis, mesh)


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
) -> Float[Array, "*batch seq heads head_dim"]:
    """Attention whose sequence is split over the mesh axis `axis`: context parallelism.

    Device `i` of the axis holds (and returns) the `i`-th contiguous block of the
    sequence, so no device holds every token's activations: a sequence longer than
    one device's share still trains. The result, and its gradient, equal the unsplit
    attention's (`softmax(q k^T * scale + mask) v` with the softmax in float32, as in
    `redcoast.models.Attention`). Only the sequence axis is split by hand
    (`jax.shard_map` over `axis` alone); the other mesh axes stay with the compiler,
    so a batch split over `"data"` stays split.

    `strategy="ring"` is ring attention (Liu et al. 2023): the key/value blocks go
    around the ring of devices with `jax.lax.ppermute`, folded into each device's
    queries by the online softmax; a device holds the scores of its queries against
    one block of keys at a time, `(seq / n)^2` per head, and the gradient is a second
    trip around the ring. `strategy="all_gather"` gathers the whole keys and values
    on every device (`jax.lax.all_gather`): fewer, larger collectives, but scores of
    `seq / n` queries against all `seq` keys.

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

    Returns:
        The attention output of every query, shaped as `q`, split over `axis` along the
        sequence.

    Raises:
        ValueError: `axis` is not an axis of `mesh`; its size does not divide the
            sequence; `mask` is not a key padding mask (a `(seq, kv_seq)` matrix cannot
            be split: use `causal=True` for the causal one); `causal` with
            `seq != kv_seq`; head counts that do not group.

    Example:
        >>> mesh = jax.make_mesh((8,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> q = k = v = jnp.ones((2, 4096, 8, 64))   # (batch, seq, heads, head_dim)
        >>> out = context_parallel_attention(q, k, v, mesh=mesh, axis="seq", causal=True)
        >>> out.shape, out.sharding.spec
        ((2, 4096, 8, 64), P(None, 'seq'))
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    mask = None if mask is None else jnp.asarray(mask)
    _check(q, k, v, mask, mesh, axis, causal, strategy)
    active = _active.current()
    if active is not None:  # a split attention of the model a step runs
        active.attention_calls += 1
    batch = q.shape[:-3]
    keep = jnp.ones(k.shape[:-2], dtype=bool) if mask is None else mask.astype(bool)
    flat = int(np.prod(batch, dtype=np.int64))
    q4 = q.reshape(flat, *q.shape[-3:])
    k4, v4 = k.reshape(flat, *k.shape[-3:]), v.reshape(flat, *v.shape[-3:])
    keep2 = keep.reshape(flat, k.shape[-3])
    layout = _Layout(
        axis=axis,
        size=int(mesh.shape[axis]),
        causal=causal,
        scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale),
    )
    if strategy == "ring":
        local: Callable[..., Array] = _make_ring(layout)
    else:
        local = lambda *blocks: _gathered(layout, *blocks)  # noqa: E731
    split = P(None, axis)
    out = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(split, split, split, split),
        out_specs=split,
        axis_names={axis},
    )(q4, k4, v4, keep2)
    return out.reshape(q.shape)
