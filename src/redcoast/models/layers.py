"""Transformer building blocks shared by every model: attention, MLPs, rotary embeddings.

Each block works on one unbatched sequence, Equinox style; batch with `jax.vmap`.
Projections are plain `eqx.nn.Linear` layers named like Hugging Face's
(`q_proj`, `k_proj`, `v_proj`, `o_proj`), which is what `redcoast.sharding_rules`
recognises as attention.

The decoder zoo (GPT-2, LLaMA, OPT, GPT-J) is these blocks arranged differently:
`DecoderBlock` is serial (`x + attn(norm(x))`, then `x + mlp(norm(x))`) or, without
a second norm, GPT-J's parallel `x + attn(h) + mlp(h)`. Attention has a cached path
(`Attention.cached`) that writes keys and values into a `KVCache` for generation.
"""

import abc
import functools
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from einops import rearrange, repeat
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, Real

from ..rematerialisation import PROJECTION, recomputed
from .checks import check_range


def gelu(x: Array) -> Array:
    """The exact GELU (Hendrycks & Gimpel 2016), `x * Phi(x)`; Hugging Face's `"gelu"`."""
    return jax.nn.gelu(x, approximate=False)


def gelu_tanh(x: Array) -> Array:
    """GELU's tanh approximation; Hugging Face's `"gelu_new"` (GPT-2, GPT-J)."""
    return jax.nn.gelu(x, approximate=True)


# Named module-level functions (not lambdas or partials) so that two models built
# from the same config compare equal as static pytree data and share compilations.
ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu": gelu,
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}


def activation(name: str) -> Callable[[Array], Array]:
    """The activation function Hugging Face configs call `name` (`"gelu_new"`, `"silu"`, ...).

    Args:
        name: the `activation_function` / `hidden_act` string of a config.json.

    Returns:
        The function.

    Example:
        >>> activation("relu")(jnp.array([-1.0, 2.0]))
        Array([0., 2.], dtype=float32)
    """
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}.")
    return ACTIVATIONS[name]


class AbstractProjection(eqx.Module):
    """A module that stands where a block has a Linear, wrapping one (`base`).

    Adapters such as `rc.lora.LoRALinear` replace a block's Linear without the block
    knowing: `dense` hands them every token at once (`over_tokens`), so they keep the
    fast matmul path, and the sharding rules read `base` as the Linear it stands for.
    """

    base: eqx.AbstractVar[eqx.nn.Linear]

    @abc.abstractmethod
    def over_tokens(self, x: Float[Array, "*tokens in"]) -> Float[Array, "*tokens out"]:
        """The module on every row of `x` (features last)."""


class AbstractTable(eqx.Module):
    """A module that stands where a model has its token table, wrapping one (`base`).

    Called on one id as `eqx.nn.Embedding` is; `logits` stands for the table as an
    output head tied to it, so a wrapper such as `rc.lora.LoRAEmbedding` changes
    the input and the tied head alike.
    """

    base: eqx.AbstractVar[eqx.nn.Embedding]

    @abc.abstractmethod
    def __call__(
        self, x: Int[Array, ""], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " features"]:
        """The row of token `x`."""

    @abc.abstractmethod
    def logits(self, h: Float[Array, "*tokens features"]) -> Float[Array, "*tokens vocab"]:
        """`h` against every row: the logits of a head tied to the table."""


def tied_logits(
    table: eqx.nn.Embedding | AbstractTable, h: Float[Array, "*tokens features"]
) -> Float[Array, "*tokens vocab"]:
    """The logits of an output head tied to `table`: `h` against each of its rows."""
    return table.logits(h) if isinstance(table, AbstractTable) else h @ table.weight.T


def table_dtype(table: eqx.nn.Embedding | AbstractTable) -> DTypeLike:
    """The dtype of the token table (the wrapped one's, for an `AbstractTable`)."""
    return (table.base if isinstance(table, AbstractTable) else table).weight.dtype


def dense(
    layer: eqx.nn.Linear | AbstractProjection, x: Float[Array, "*tokens in"]
) -> Float[Array, "*tokens out"]:
    """`layer` on every row of `x`: `jax.vmap(layer)(x)` as one matmul over the rows.

    The token axes are flattened into one before the matmul (a free reshape), so
    `jax.grad` writes the weight gradient as `g^T x` (`g` the output's gradient)
    contracting that one axis: a matmul XLA:CPU runs on both operands as they lie.
    Contracting several token axes instead makes XLA first copy `g` (or `x`)
    transposed into a `(features, tokens)` matrix, and fuse into that copy the
    elementwise work that produces it. Under `jax.vmap` the batch axis is a second
    contracting axis of the batch's weight gradient, which XLA meets with such a
    copy; only JAX's own transformations of a `dot_general` are involved, so `dense`
    composes with every `jax.vmap`, `jax.grad` and `jax.jit`, to any order.

    Args:
        layer: the Linear (weight `(out, in)`, optional bias `(out,)`), or a module
            wrapping one (`AbstractProjection`), which computes over the tokens itself.
        x: inputs, features last.

    Returns:
        `x @ layer.weight.T + layer.bias`.

    Example:
        >>> layer = eqx.nn.Linear(32, 64, key=jax.random.key(0))
        >>> dense(layer, jnp.ones((10, 32))).shape
        (10, 64)
    """
    if isinstance(layer, AbstractProjection):
        return layer.over_tokens(x)
    rows = x.reshape(-1, x.shape[-1])
    y = jax.lax.dot_general(rows, layer.weight, (((1,), (1,)), ((), ())))
    # Named, so that remat's "dots" policy keeps the output by name (`PROJECTION`).
    y = checkpoint_name(y.reshape(*x.shape[:-1], y.shape[-1]), PROJECTION)
    return y if layer.bias is None else y + layer.bias


def rotate(
    x: Float[Array, "seq heads head_dim"],
    positions: Real[Array, " seq"],
    *,
    rotary_dim: int,
    base: float = 10000.0,
    interleaved: bool = False,
) -> Float[Array, "seq heads head_dim"]:
    """Rotary position embedding (Su et al. 2021) on the first `rotary_dim` features of each head.

    Args:
        x: queries or keys, split into heads.
        positions: the position of each token.
        rotary_dim: how many features of each head rotate (GPT-J rotates part of a head).
        base: the frequency base.
        interleaved: rotate pairs `(0, 1), (2, 3), ...` (GPT-J) instead of the halves
            `(i, i + rotary_dim / 2)` (GPT-NeoX, LLaMA).

    Returns:
        `x` with its first `rotary_dim` features rotated.
    """
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    inv_freq = 1.0 / (base ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # (seq, rotary_dim/2)
    cos = jnp.cos(angles)[:, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, None, :].astype(x.dtype)
    if interleaved:
        even, odd = rot[..., 0::2], rot[..., 1::2]
        rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
        rotated = rotated.reshape(rot.shape)
    else:
        half = rotary_dim // 2
        first, second = rot[..., :half], rot[..., half:]
        rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return jnp.concatenate([rotated, rest], axis=-1)


class KVCache(eqx.Module):
    """Keys and values of one attention layer for the tokens seen so far.

    Slot `i` holds position `i` of the sequence; slots not yet written are zeros and
    masked out. With scanned (stacked) layers both arrays carry a leading layer axis.
    """

    key: Float[Array, "*layers max_len kv_heads head_dim"]
    value: Float[Array, "*layers max_len kv_heads head_dim"]


class Attention(eqx.Module):
    """Causal multi-head attention with grouped-query heads and optional rotary positions.

    Q, K and V are split into heads right after their projection, which is where the
    sharding rules read the head count from.

    Args:
        hidden_size: width of the input and output.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention); default `num_heads`.
        head_dim: width of one head; default `hidden_size // num_heads`.
        rotary_dim: features of each head rotated by RoPE; 0 for no rotary positions.
        rope_base: RoPE's frequency base (`rope_theta`).
        rope_interleaved: rotate pairs `(0, 1), (2, 3), ...` (GPT-J) instead of halves.
        qkv_bias: Q, K and V projections have biases.
        out_bias: the output projection has a bias.
        key: for the initialisation.

    Example:
        >>> attn = Attention(32, 4, num_kv_heads=2, rotary_dim=8, key=jax.random.key(0))
        >>> attn(jnp.ones((10, 32))).shape
        (10, 32)
    """

    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rotary_dim: int = eqx.field(static=True)
    rope_base: float = eqx.field(static=True)
    rope_interleaved: bool = eqx.field(static=True)
    recompute_scores: bool = eqx.field(static=True, default=False)
    # A `redcoast.ContextParallel` when the sequence is split over a mesh axis.
    context: Any = eqx.field(static=True, default=None)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        rotary_dim: int = 0,
        rope_base: float = 10000.0,
        rope_interleaved: bool = False,
        qkv_bias: bool = False,
        out_bias: bool = False,
        key: PRNGKeyArray,
    ):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}."
            )
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q_proj = eqx.nn.Linear(hidden_size, num_heads * head_dim, use_bias=qkv_bias, key=kq)
        self.k_proj = eqx.nn.Linear(hidden_size, num_kv_heads * head_dim, use_bias=qkv_bias, key=kk)
        self.v_proj = eqx.nn.Linear(hidden_size, num_kv_heads * head_dim, use_bias=qkv_bias, key=kv)
        self.o_proj = eqx.nn.Linear(num_heads * head_dim, hidden_size, use_bias=out_bias, key=ko)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.rope_base = rope_base
        self.rope_interleaved = rope_interleaved

    def __call__(
        self, x: Float[Array, "seq hidden"], positions: Real[Array, " seq"] | None = None
    ) -> Float[Array, "seq hidden"]:
        """Attend causally within `x`; `positions` default to `0, 1, ..., seq - 1`."""
        seq = x.shape[0]
        pos = jnp.arange(seq) if positions is None else positions
        q, k, v = self._qkv(x, pos)
        if self.context is not None:  # the sequence is split: `ContextParallel.attend`
            out = self.context.attend(q, k, v)
            return dense(self.o_proj, rearrange(out, "s h d -> s (h d)"))
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        return self._attend(q, k, v, causal)

    def cached(
        self,
        x: Float[Array, "seq hidden"],
        positions: Real[Array, " seq"],
        cache: KVCache,
        index: Int[Array, ""] | int,
    ) -> tuple[Float[Array, "seq hidden"], KVCache]:
        """Attend from `x` to everything cached so far plus `x` itself, and cache `x`'s keys.

        Args:
            x: the new tokens' hidden states (the whole prompt, or one token per step).
            positions: their positions, for rotary embeddings.
            cache: keys and values of earlier tokens, in slots `[0, index)`.
            index: the slot of `x[0]`; `x` is written to slots `[index, index + seq)`.

        Returns:
            The attention output and the cache with `x`'s keys and values written.

        Raises:
            ValueError: an int `index` leaves no room for `x` in the cache.
            RuntimeError: when the computation runs, an array `index` leaves no
                room for `x` in the cache (see `checks.check_range`).
        """
        seq = x.shape[0]
        # dynamic_update_slice clamps the start: a write past the end would silently
        # overwrite the last slots instead.
        index = check_range(
            index,
            0,
            cache.key.shape[0] - seq + 1,
            f"index (the cache slot of the first of {seq} new tokens)",
            f"the cache has {cache.key.shape[0]} slots; make it longer with init_cache(max_len).",
        )
        q, k, v = self._qkv(x, positions)
        keys = jax.lax.dynamic_update_slice_in_dim(cache.key, k.astype(cache.key.dtype), index, 0)
        values = jax.lax.dynamic_update_slice_in_dim(
            cache.value, v.astype(cache.value.dtype), index, 0
        )
        # Query t sits in slot index + t and sees slots up to its own; later slots are
        # empty (zeros) and must not be attended to.
        slots = jnp.arange(keys.shape[0])
        visible = slots[None, :] <= (index + jnp.arange(seq))[:, None]
        out = self._attend(q, keys.astype(q.dtype), values.astype(q.dtype), visible)
        return out, KVCache(keys, values)

    def init_cache(self, max_len: int, dtype: DTypeLike) -> KVCache:
        """An empty cache of `max_len` slots for this layer's keys and values."""
        shape = (max_len, self.num_kv_heads, self.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def _qkv(
        self, x: Float[Array, "seq hidden"], positions: Real[Array, " seq"]
    ) -> tuple[
        Float[Array, "seq heads head_dim"],
        Float[Array, "seq kv_heads head_dim"],
        Float[Array, "seq kv_heads head_dim"],
    ]:
        # Split into heads right after each projection: the sharding rules read the
        # head count from this reshape.
        q = rearrange(dense(self.q_proj, x), "s (h d) -> s h d", h=self.num_heads)
        k = rearrange(dense(self.k_proj, x), "s (h d) -> s h d", h=self.num_kv_heads)
        v = rearrange(dense(self.v_proj, x), "s (h d) -> s h d", h=self.num_kv_heads)
        if self.rotary_dim:
            q = self._rotate(q, positions)
            k = self._rotate(k, positions)
        return q, k, v

    def _attend(
        self,
        q: Float[Array, "seq heads head_dim"],
        k: Float[Array, "kv_seq kv_heads head_dim"],
        v: Float[Array, "kv_seq kv_heads head_dim"],
        visible: Bool[Array, "seq kv_seq"],
    ) -> Float[Array, "seq hidden"]:
        group = self.num_heads // self.num_kv_heads
        if group > 1:  # each key/value head serves `group` query heads in a row
            k = repeat(k, "s h d -> s (h g) d", g=group)
            v = repeat(v, "s h d -> s (h g) d", g=group)
        mix = functools.partial(_mix, root=math.sqrt(self.head_dim))
        return dense(self.o_proj, recomputed(mix, self.recompute_scores)(q, k, v, visible))

    def _rotate(
        self, x: Float[Array, "seq heads head_dim"], positions: Real[Array, " seq"]
    ) -> Float[Array, "seq heads head_dim"]:
        return rotate(
            x,
            positions,
            rotary_dim=self.rotary_dim,
            base=self.rope_base,
            interleaved=self.rope_interleaved,
        )


def _mix(
    q: Float[Array, "seq heads head_dim"],
    k: Float[Array, "kv_seq heads head_dim"],
    v: Float[Array, "kv_seq heads head_dim"],
    visible: Bool[Array, "seq kv_seq"],
    *,
    root: float,
) -> Float[Array, "seq hidden"]:
    """Scaled dot-product attention over the visible keys, heads merged back."""
    scores = jnp.einsum("thd,shd->hts", q, k) / root
    # Softmax in float32 whatever the weights' dtype, as every HF implementation does.
    scores = jnp.where(visible[None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return rearrange(jnp.einsum("hts,shd->thd", weights, v), "t h d -> t (h d)")


class MLP(eqx.Module):
    """Two Linear layers with an activation between them (GPT-2, OPT, GPT-J)."""

    fc_in: eqx.nn.Linear
    fc_out: eqx.nn.Linear
    activation: Callable[[Array], Array] = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: Callable[[Array], Array] = jax.nn.gelu,
        use_bias: bool = True,
        key: PRNGKeyArray,
    ):
        k1, k2 = jax.random.split(key)
        self.fc_in = eqx.nn.Linear(hidden_size, intermediate_size, use_bias=use_bias, key=k1)
        self.fc_out = eqx.nn.Linear(intermediate_size, hidden_size, use_bias=use_bias, key=k2)
        self.activation = activation

    def __call__(self, x: Float[Array, "seq hidden"]) -> Float[Array, "seq hidden"]:
        return dense(self.fc_out, self.activation(dense(self.fc_in, x)))


class SwiGLU(eqx.Module):
    """The gated MLP of LLaMA: `down(silu(gate(x)) * up(x))` (Shazeer 2020).

    The fields are declared down-first on purpose. Splitting by declaration order
    gets this layer wrong (down, gate, up -> column, row, column); the dataflow rules
    see gate and up read the same input and down read their product.
    """

    down_proj: eqx.nn.Linear
    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    activation: Callable[[Array], Array] = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: Callable[[Array], Array] = jax.nn.silu,
        use_bias: bool = False,
        key: PRNGKeyArray,
    ):
        kd, kg, ku = jax.random.split(key, 3)
        self.down_proj = eqx.nn.Linear(intermediate_size, hidden_size, use_bias=use_bias, key=kd)
        self.gate_proj = eqx.nn.Linear(hidden_size, intermediate_size, use_bias=use_bias, key=kg)
        self.up_proj = eqx.nn.Linear(hidden_size, intermediate_size, use_bias=use_bias, key=ku)
        self.activation = activation

    def __call__(self, x: Float[Array, "seq hidden"]) -> Float[Array, "seq hidden"]:
        gate = self.activation(dense(self.gate_proj, x))
        return dense(self.down_proj, gate * dense(self.up_proj, x))


Norm = eqx.nn.LayerNorm | eqx.nn.RMSNorm


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _normalise(
    x: Array, weight: Array | None, bias: Array | None, eps: float, centre: bool
) -> Array:
    return _normalise_fwd(x, weight, bias, eps, centre)[0]


_NormResiduals = tuple[Array, Array | None, Array, Array | None, Array | None]


def _standardised(x: Array, mean: Array | None, rstd: Array) -> Array:
    x = x.astype(rstd.dtype)
    return (x if mean is None else x - mean) * rstd


def _normalise_fwd(
    x: Array, weight: Array | None, bias: Array | None, eps: float, centre: bool
) -> tuple[Array, _NormResiduals]:
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = xf.mean(-1, keepdims=True) if centre else None
    centred = xf if mean is None else xf - mean
    rstd = jax.lax.rsqrt((centred * centred).mean(-1, keepdims=True) + eps)
    y = centred * rstd
    if weight is not None:
        y = weight.astype(y.dtype) * y
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y.astype(x.dtype), (x, mean, rstd, weight, bias)


def _normalise_bwd(
    eps: float, centre: bool, res: _NormResiduals, g: Array
) -> tuple[Array, Array | None, Array | None]:
    del eps, centre
    x, mean, rstd, weight, bias = res
    xhat = _standardised(x, mean, rstd)
    g = g.astype(xhat.dtype)
    tokens = tuple(range(g.ndim - 1))
    a = g if weight is None else g * weight.astype(g.dtype)
    da = a - xhat * (a * xhat).mean(-1, keepdims=True)
    if mean is not None:
        da = da - a.mean(-1, keepdims=True)
    dw = None if weight is None else (g * xhat).sum(tokens).astype(weight.dtype)
    db = None if bias is None else g.sum(tokens).astype(bias.dtype)
    return (rstd * da).astype(x.dtype), dw, db


_normalise.defvjp(_normalise_fwd, _normalise_bwd)


def normalise(norm: Norm, x: Float[Array, "*tokens features"]) -> Float[Array, "*tokens features"]:
    """`norm` (a LayerNorm or RMSNorm) on every row of `x`, with a closed-form gradient.

    Equals `jax.vmap(norm)(x)`: computed in at least float32, returned in `x`'s
    dtype. The gradient is written out as one expression per row
    (`rstd * (a - mean(a) - xhat * mean(a * xhat))`, `a = g * weight`) instead of
    `jax.grad`'s trace of the mean, the variance and the square root. Between
    layers the residual stream's gradient is the previous one plus this term, and
    with `jax.grad`'s many small terms XLA fused the whole chain (one term from
    every later layer, up to 92 inputs) into each consumer and computed it again
    there; this one is kept once per layer.

    Args:
        norm: an `eqx.nn.LayerNorm` or `eqx.nn.RMSNorm` over the last axis.
        x: inputs, features last.

    Returns:
        The normalised rows, scaled and shifted by the norm's weight and bias.

    Example:
        >>> normalise(eqx.nn.LayerNorm(32), jnp.ones((10, 32))).shape
        (10, 32)
    """
    if norm.shape != x.shape[-1:]:
        raise ValueError(
            f"{type(norm).__name__} of shape {norm.shape} normalises the last axis; it got "
            f"an input of shape {x.shape}. Build it with shape (features,) = {x.shape[-1:]}."
        )
    centre = isinstance(norm, eqx.nn.LayerNorm)
    return _normalise(x, norm.weight, norm.bias, norm.eps, centre)


class DecoderBlock(eqx.Module):
    """A pre-norm decoder layer, serial or parallel.

    Serial (GPT-2, OPT, LLaMA): `x + attn(attn_norm(x))`, then `x + mlp(mlp_norm(x))`.
    Parallel (GPT-J, `mlp_norm=None`): `x + attn(h) + mlp(h)` with `h = attn_norm(x)`.

    Attributes:
        attn_norm: the norm before attention (and, in a parallel block, before the MLP).
        attn: the self-attention.
        mlp_norm: the norm before the MLP; `None` for a parallel block.
        mlp: the feed-forward network.

    Example:
        >>> k1, k2 = jax.random.split(jax.random.key(0))
        >>> block = DecoderBlock(eqx.nn.LayerNorm(32), Attention(32, 4, key=k1),
        ...                      eqx.nn.LayerNorm(32), MLP(32, 128, key=k2))
        >>> y, _ = block(jnp.ones((10, 32)), jnp.arange(10))
    """

    attn_norm: Norm
    attn: Attention
    mlp_norm: Norm | None
    mlp: MLP | SwiGLU

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        positions: Real[Array, " seq"],
        cache: KVCache | None = None,
        index: Int[Array, ""] | int = 0,
    ) -> tuple[Float[Array, "seq hidden"], KVCache | None]:
        """Run the layer on one sequence.

        Args:
            x: hidden states.
            positions: the position of each token, for rotary embeddings.
            cache: keys and values of earlier tokens; `None` to attend within `x` only.
            index: with a cache, the slot of `x[0]` (see `Attention.cached`).

        Returns:
            The new hidden states, and the cache with `x`'s keys and values written
            (`None` without a cache).
        """
        h = normalise(self.attn_norm, x)
        if cache is None:
            attn = self.attn(h, positions)
        else:
            attn, cache = self.attn.cached(h, positions, cache, index)
        if self.mlp_norm is None:
            return x + attn + self.mlp(h), cache
        x = x + attn
        return x + self.mlp(normalise(self.mlp_norm, x)), cache
