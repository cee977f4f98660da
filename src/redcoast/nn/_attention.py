"""`attention`: scaled dot-product attention, for the zoo and for a user's own model.

One entry point for every way a model attends: causal or with a mask, a sliding
window (Mistral, Gemma), soft-capped scores (Gemma 2), documents packed into one
row kept apart by segment ids, grouped-query heads, an additive bias (T5), and
recomputed in the backward pass under remat's `"attention"` policy. Inside a step
given context parallelism it runs over the split sequence.

It computes by one of four implementations: the score matrix written out
(`"einsum"`), flash-style blocks in plain JAX that never hold it (`"blockwise"`,
`_blockwise.py`), or the accelerator's own kernels (`"cudnn"` on GPU, `"pallas"` on
TPU, `_kernels.py`); `"auto"` picks among them.
"""

import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._checks import check_choice, typechecked
from ..parallel import _active
from . import _blockwise, _kernels
from ._options import Options
from ._remat import recomputed

__all__ = ["IMPLEMENTATIONS", "Implementation", "attention", "check_implementation"]

Implementation = Literal["auto", "einsum", "blockwise", "cudnn", "pallas"]
"""How `attention` computes; see its docstring."""
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "einsum", "blockwise", "cudnn", "pallas")


def check_implementation(implementation: object) -> Implementation:
    """`implementation` itself if it is one of `IMPLEMENTATIONS`, else a `ValueError`
    listing them: `check_implementation("blockwise")` is `"blockwise"`."""
    return check_choice("implementation", implementation, IMPLEMENTATIONS)


LONG = 1024 * 1024
"""Queries x keys from which `"auto"` runs blockwise on a GPU or TPU whose kernel does
not apply: a score matrix of one head at 1024 tokens."""


def _scores_softmax_values(
    q: Array,
    k: Array,
    v: Array,
    visible: Array | None,
    bias: Array | None,
    scale: float | None,
    softcap: float | None,
) -> Array:
    # Grouped query heads read their key/value head in place (query head i reads head
    # i // group) instead of from copies of the keys and values made for every query
    # head: the copy and its transposition cost more than the products when decoding.
    *batch, seq, heads, dim = q.shape
    kv_seq, kv_heads = k.shape[-3:-1]
    grouped = (*batch, kv_heads, heads // kv_heads)
    q = q.reshape(*batch, seq, *grouped[-2:], dim)
    scores = jnp.einsum("...tkgd,...skd->...kgts", q, k).reshape(*batch, heads, seq, kv_seq)
    # Dividing by the root when no scale is given keeps the decoders' arithmetic exactly.
    scores = scores / math.sqrt(dim) if scale is None else scores * scale
    # Softmax in float32 whatever the weights' dtype, as every HF implementation does.
    scores = scores.astype(jnp.float32)
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.astype(jnp.float32)
    if visible is not None:
        scores = jnp.where(visible[..., None, :, :], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(*grouped, seq, kv_seq)
    return jnp.einsum("...kgts,...skd->...tkgd", weights, v).reshape(*batch, seq, heads, dim)


def _visible(seq: int, kv_seq: int, o: Options) -> Array | None:
    """Which keys each query sees, `(*batch, seq, kv_seq)`, or None for all of them."""
    visible = o.mask
    q_pos, k_pos = jnp.arange(seq)[:, None], jnp.arange(kv_seq)[None, :]
    if o.causal:
        visible = _and(visible, k_pos <= q_pos)
    if o.window is not None:
        visible = _and(visible, k_pos > q_pos - o.window)
    if o.segment_ids is not None:
        theirs = o.segment_ids if o.kv_segment_ids is None else o.kv_segment_ids
        visible = _and(visible, o.segment_ids[..., :, None] == theirs[..., None, :])
    return visible


def _and(a: Array | None, b: Array) -> Array:
    return b if a is None else a & b


def _einsum(
    q: Array, k: Array, v: Array, o: Options, *, scale: float | None, recompute: bool
) -> Array:
    visible = _visible(q.shape[-3], k.shape[-3], o)
    fn = functools.partial(_scores_softmax_values, scale=scale, softcap=o.softcap)
    return recomputed(fn, recompute)(q, k, v, visible, o.bias)


def _blocks(block_size: int | tuple[int, int] | None, seq: int, kv_seq: int) -> tuple[int, int]:
    """`(q_block, kv_block)`: as given, or the largest divisors up to 512."""
    if block_size is None:
        return _blockwise.default_block(seq), _blockwise.default_block(kv_seq)
    if isinstance(block_size, int):
        return block_size, block_size
    return block_size


def _check_blocks(
    block_size: Any, seq: int, kv_seq: int, q_shape: tuple[int, ...], given: bool
) -> tuple[int, int]:
    if given:
        pair = block_size if isinstance(block_size, tuple) else (block_size, block_size)
        if len(pair) != 2 or not all(
            isinstance(b, int | np.integer) and not isinstance(b, bool) and b > 0 for b in pair
        ):
            raise ValueError(
                f"attention: block_size={block_size!r} must be a positive int, or a pair "
                "(query block, key block) of them."
            )
    q_block, kv_block = _blocks(block_size, seq, kv_seq)
    for what, n, b in (("queries", seq, q_block), ("keys", kv_seq, kv_block)):
        if n % b:
            fits = [d for d in (1024, 512, 256, 128, 64) if n % d == 0][:2]
            hint = f" such as {' or '.join(map(str, fits))}" if fits else ""
            raise ValueError(
                f"attention: a block of {b} {what} does not divide the {n} {what} (q "
                f"{tuple(q_shape)}); blockwise attention cuts them into equal blocks. Pass "
                f"block_size= a divisor of {n}{hint}, or pad the rows."
            )
        if not given and b < 64 < n:
            raise ValueError(
                f"attention: no block of 64 to 512 {what} divides the {n} {what} (q "
                f"{tuple(q_shape)}), and smaller blocks would be slow. Pad the rows to a "
                "multiple of 128, pass block_size=, or use implementation='einsum'."
            )
    return int(q_block), int(kv_block)


def _batched(x: Array | None, batch: tuple[int, ...], core: int) -> Array | None:
    """`x` with its leading (batch) axes flattened to one: of size 1 when `x` broadcasts
    over the whole batch, else the batch's size; `core` trailing axes kept."""
    if x is None:
        return None
    lead = x.shape[: x.ndim - core]
    if math.prod(lead) == 1:
        return x.reshape(1, *x.shape[x.ndim - core :])
    x = jnp.broadcast_to(x, (*batch, *x.shape[x.ndim - core :]))
    return x.reshape(-1, *x.shape[x.ndim - core :])


def _blockwise_attention(
    q: Array, k: Array, v: Array, o: Options, *, scale: float | None, blocks: tuple[int, int]
) -> Array:
    batch = q.shape[:-3]
    seq, kv_seq = q.shape[-3], k.shape[-3]
    flat = lambda x: x.reshape(-1, *x.shape[-3:])  # noqa: E731
    spec = _blockwise.Blocks(
        q=blocks[0],
        kv=blocks[1],
        causal=o.causal,
        window=o.window,
        softcap=o.softcap,
        scale=_blockwise.scale_of(q.shape[-1], scale),
    )
    segment_ids, theirs, mask, bias = None, None, o.mask, o.bias
    if o.segment_ids is not None:
        segment_ids = o.segment_ids.reshape(-1, seq)
        theirs = segment_ids if o.kv_segment_ids is None else o.kv_segment_ids.reshape(-1, kv_seq)
    if mask is not None:  # whole (seq, kv_seq) matrices, the batch axes as given
        mask = jnp.broadcast_to(mask.astype(bool), (*mask.shape[:-2], seq, kv_seq))
    if bias is not None:
        bias = bias.reshape((1,) * max(0, 3 - bias.ndim) + bias.shape)
        bias = jnp.broadcast_to(bias, (*bias.shape[:-3], q.shape[-2], seq, kv_seq))
    out = _blockwise.attention(
        flat(q),
        flat(k),
        flat(v),
        spec,
        segment_ids=segment_ids,
        kv_segment_ids=theirs,
        mask=_batched(mask, batch, 2),
        bias=_batched(bias, batch, 3),
    )
    return out.reshape(q.shape)


def _check(q: Array, k: Array, o: Options, implementation: str) -> None:
    check_implementation(implementation)
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if heads % kv_heads:
        raise ValueError(
            f"attention: {heads} query heads cannot share {kv_heads} key/value heads; the "
            "query heads must be a multiple of the key/value heads."
        )
    seq, kv_seq = q.shape[-3], k.shape[-3]
    if o.causal and seq != kv_seq:
        raise ValueError(
            f"attention: causal=True needs as many keys as queries; got {seq} queries and "
            f"{kv_seq} keys. Pass a mask for attention to a cache."
        )
    if o.window is not None and (not o.causal or o.window < 1):
        raise ValueError(
            f"attention: window={o.window!r} is a sliding window over the past: it needs "
            "causal=True and a positive number of positions."
        )
    if o.segment_ids is None and o.kv_segment_ids is not None:
        raise ValueError("attention: kv_segment_ids needs the queries' segment_ids too.")
    if o.segment_ids is not None and o.kv_segment_ids is None and seq != kv_seq:
        raise ValueError(
            f"attention: segment_ids for {seq} queries and {kv_seq} keys; pass the keys' "
            "own as kv_segment_ids."
        )
    batch = q.shape[:-3]
    if o.mask is not None and not _broadcasts(o.mask.shape, (*batch, seq, kv_seq)):
        raise ValueError(
            f"attention: a mask of shape {o.mask.shape} does not fit q {q.shape} and k "
            f"{k.shape}: it says which key each query sees, shape (seq, kv_seq) = "
            f"{(seq, kv_seq)}, or with the batch dimensions {(*batch, seq, kv_seq)}."
        )
    if o.bias is not None and not _broadcasts(o.bias.shape, (*batch, heads, seq, kv_seq)):
        raise ValueError(
            f"attention: a bias of shape {o.bias.shape} does not fit q {q.shape} and k "
            f"{k.shape}: it is added to the scores, shape (heads, seq, kv_seq) = "
            f"{(heads, seq, kv_seq)}, or with batch dimensions that broadcast over "
            f"{batch}."
        )


def _broadcasts(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    """`shape`, of at least two axes, broadcasts to `to`."""
    if len(shape) < 2 or len(shape) > len(to):
        return False
    return all(a in (1, b) for a, b in zip(shape[::-1], to[::-1], strict=False))


def _chosen(implementation: str, q: Array, k: Array, o: Options, block_size: Any) -> str:
    """What `"auto"` runs: the accelerator's kernel where it applies, else on an
    accelerator blockwise for long sequences, else the einsum."""
    if implementation != "auto":
        return implementation
    platform = _kernels.platform()
    if platform == "gpu" and _kernels.cudnn_refusal(q, k, o) is None:
        return "cudnn"
    if platform == "tpu" and _kernels.pallas_refusal(q, k, o) is None:
        return "pallas"
    seq, kv_seq = q.shape[-3], k.shape[-3]
    if platform not in ("gpu", "tpu") or seq * kv_seq < LONG:
        return "einsum"
    if block_size is None:
        q_block, kv_block = _blocks(None, seq, kv_seq)
        if min(q_block, kv_block) < 64:  # no good block divides it: not worth it
            return "einsum"
    return "blockwise"


@typechecked
def attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch kv_seq kv_heads head_dim"],
    v: Float[Array, "*batch kv_seq kv_heads head_dim"],
    *,
    causal: bool = False,
    mask: Bool[Array, "..."] | None = None,
    window: int | None = None,
    segment_ids: Int[Array, "*batch seq"] | None = None,
    kv_segment_ids: Int[Array, "*batch kv_seq"] | None = None,
    bias: Float[Array, "..."] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    recompute: bool = False,
    implementation: Implementation = "auto",
    block_size: int | tuple[int, int] | None = None,
) -> Float[Array, "*batch seq heads head_dim"]:
    """Scaled dot-product attention, split over the sequence when a step asks for it.

    `softmax(cap(q k^T * scale) + bias)` over the visible keys, times `v`, with the
    scores and the softmax in float32 whatever the inputs' dtype (queries that see no
    key average every value, as a softmax over equal scores does). Key/value heads
    fewer than the query heads serve `heads // kv_heads` consecutive query heads
    each (grouped-query attention).

    How it computes (`implementation`):

    - `"einsum"`: the `(heads, seq, kv_seq)` scores written out, then the softmax;
      every option. Memory grows with the square of the sequence. Grouped heads do
      not repeat the keys and values.
    - `"blockwise"`: flash attention in plain JAX (any backend): an online softmax
      over blocks of `block_size` keys for each block of queries, in float32, and a
      backward pass that recomputes each block's scores from `q`, `k`, `v`, the
      output and one log-sum-exp per query. Scores take one block per head; blocks
      no query sees are skipped (causal future, outside the window, no shared
      segment). Grouped heads do not repeat the keys and values. Every option.
    - `"cudnn"`: `jax.nn.dot_product_attention(implementation="cudnn")`, on GPU with
      float16 or bfloat16 inputs and `head_dim` a multiple of 8 up to 128; causal,
      windows; no segment ids, soft-cap, mask or bias.
    - `"pallas"`: the Pallas splash-attention kernel
      (`jax.experimental.pallas.ops.tpu.splash_attention`), on TPU with both lengths
      multiples of 128; causal, windows, soft-caps, segment ids (causal, or keys
      that are the queries' own); no mask or bias. The backward pass runs the
      kernel's forward again. On several devices it runs under `jax.shard_map` over
      the mesh the step's parallelism names (FSDP, sequence or context
      parallelism): rows over `"data"`, heads over `"model"` where they divide.
    - `"auto"` (the default): cuDNN on GPU and Pallas on TPU where they apply (the
      platform of the step's mesh, else of `jax.default_device`, else JAX's default),
      blockwise there where they do not and `seq * kv_seq` reaches 1024 x 1024, the
      einsum below that and on CPU (the simulated devices the planner and the tests
      compile for measure the einsum's program; ask for `"blockwise"` by name).

    Inside a step given context parallelism (`rc.ContextParallel`), causal attention
    with no mask or bias runs as `rc.context_parallel_attention` over the split
    sequence (ring attention; window, soft-cap and segment ids too), so no device
    holds every token; its steps run blockwise unless `implementation="einsum"`.
    A mask or bias is an error naming what to use instead.

    Args:
        q: queries, split into heads.
        k: keys.
        v: values.
        causal: each query sees its own and earlier positions (needs `seq == kv_seq`).
        mask: which keys each query sees, `(seq, kv_seq)` or `(*batch, seq, kv_seq)`,
            or a shape that broadcasts to it (`(*batch, 1, kv_seq)`: padded keys);
            with the other options, a key must pass all of them.
        window: with `causal`, each query sees only the `window` most recent
            positions, its own included (Mistral's `sliding_window`).
        segment_ids: which document each query belongs to, `(*batch, seq)`: a query
            sees keys of its own document only (documents packed into one row).
        kv_segment_ids: the keys' documents, when they are not the queries' own.
        bias: added to the scores (T5's relative positions), `(*batch, heads, seq,
            kv_seq)`, its batch dimensions broadcasting.
        scale: multiplies the scores; default: divides them by `sqrt(head_dim)`.
        softcap: scores become `softcap * tanh(scores / softcap)` (Gemma 2).
        recompute: keep only `q`, `k` and `v` for the backward pass and compute the
            scores again there (remat's `"attention"` policy); the other
            implementations keep no scores anyway.
        implementation: `"auto"`, `"einsum"`, `"blockwise"`, `"cudnn"` or `"pallas"`.
        block_size: queries and keys per block (blockwise, Pallas, and the ring's
            steps), an int or a `(query, key)` pair dividing `seq` and `kv_seq`;
            default: the largest divisor up to 512.

    Returns:
        The attention output, shaped as `q`.

    Raises:
        jaxtyping.TypeCheckError: arrays whose shapes disagree with the annotations
            (`q`, `k`, `v` with other batch dimensions or `head_dim`s, segment ids
            not one per token), or an argument of the wrong type; the message names
            the argument and the sizes bound so far.
        ValueError: heads that do not group, `causal` with `seq != kv_seq`, a
            `window` without `causal`, a mask or a bias whose shape does
            not fit `q` and `k`, a block size that does not divide the sequence, an
            option the implementation asked for does not take (naming one that
            does), or, under context parallelism, an option it cannot split.

    Example:
        >>> q = k = v = jnp.ones((2048, 4, 64))   # (seq, heads, head_dim)
        >>> attention(q, k, v, causal=True, window=512, implementation="blockwise").shape
        (2048, 4, 64)
    """
    o = Options(
        causal=causal,
        mask=mask,
        window=window,
        segment_ids=segment_ids,
        kv_segment_ids=kv_segment_ids,
        bias=bias,
        softcap=softcap,
    )
    _check(q, k, o, implementation)
    seq, kv_seq = q.shape[-3], k.shape[-3]
    active = _active.current()
    if active is not None:
        active.attention_calls += 1
        if active.context is not None:
            if mask is not None or bias is not None or not causal:
                raise ValueError(
                    "context parallelism splits causal attention within one sequence; this "
                    "attention takes a (query, key) mask or bias (an encoder-decoder's "
                    "padding, relative positions, or attention to another sequence), which "
                    "it cannot split. Train such a model with sequence_parallel=True over "
                    "the model axis instead."
                )
            return active.context.attend(
                q,
                k,
                v,
                window=window,
                softcap=softcap,
                scale=scale,
                segment_ids=segment_ids,
                kv_segment_ids=kv_segment_ids,
                blockwise=implementation != "einsum",
                block_size=block_size,
            )
    chosen = _chosen(implementation, q, k, o, block_size)
    if chosen == "einsum":
        return _einsum(q, k, v, o, scale=scale, recompute=recompute)
    if chosen == "cudnn":
        _kernels.refuse("cudnn", _kernels.cudnn_refusal(q, k, o))
        if not _kernels.stand_in():
            return _kernels.cudnn(q, k, v, causal=causal, window=window, scale=scale)
        # Only planned for (no GPU here): the blockwise attention below stands in.
    if chosen == "pallas":
        _kernels.refuse("pallas", _kernels.pallas_refusal(q, k, o))
        return _kernels.pallas(
            q,
            k,
            v,
            causal=causal,
            window=window,
            softcap=softcap,
            scale=scale,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            block_size=block_size,
        )
    blocks = _check_blocks(block_size, seq, kv_seq, q.shape, block_size is not None)
    return _blockwise_attention(q, k, v, o, scale=scale, blocks=blocks)
