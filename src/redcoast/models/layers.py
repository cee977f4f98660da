"""Transformer building blocks shared by every model: attention, MLPs, rotary embeddings.

Each block works on one unbatched sequence, Equinox style; batch with `jax.vmap`.
Projections are plain `eqx.nn.Linear` layers named like Hugging Face's
(`q_proj`, `k_proj`, `v_proj`, `o_proj`), run with `redcoast.nn.dense`; attention is
`redcoast.nn.attention`, so the parallelisms act on the zoo as on any model built
from those pieces.

The decoder zoo (GPT-2, LLaMA, OPT, GPT-J) is these blocks arranged differently:
`DecoderBlock` is serial (`x + attn(norm(x))`, then `x + mlp(norm(x))`) or, without
a second norm, GPT-J's parallel `x + attn(h) + mlp(h)`. Attention has a cached path
(`Attention.cached`) that writes keys and values into a `KVCache` for generation.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from einops import rearrange
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray, Real

from ..nn import Implementation, Norm, attention, check_implementation, dense, normalise
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
        recompute_scores: keep only Q, K and V for the backward pass and compute the
            scores again there (remat's `"attention"` policy).
        implementation: how `rc.nn.attention` computes (`"auto"`, `"einsum"`,
            `"blockwise"`, `"cudnn"`, `"pallas"`; see its docstring).
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
    recompute_scores: bool = eqx.field(static=True)
    implementation: Implementation = eqx.field(static=True)

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
        recompute_scores: bool = False,
        implementation: Implementation = "auto",
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
        self.recompute_scores = recompute_scores
        self.implementation = check_implementation(implementation)

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        positions: Real[Array, " seq"] | None = None,
        segment_ids: Int[Array, " seq"] | None = None,
    ) -> Float[Array, "seq hidden"]:
        """Attend causally within `x`, and within each document when `segment_ids` say
        which one each token belongs to; `positions` default to `0, 1, ..., seq - 1`."""
        pos = jnp.arange(x.shape[0]) if positions is None else positions
        q, k, v = self._qkv(x, pos)
        out = attention(
            q,
            k,
            v,
            causal=True,
            segment_ids=segment_ids,
            recompute=self.recompute_scores,
            implementation=self.implementation,
        )
        return dense(self.o_proj, rearrange(out, "s h d -> s (h d)"))

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
        out = attention(q, keys.astype(q.dtype), values.astype(q.dtype), mask=visible)
        return dense(self.o_proj, rearrange(out, "s h d -> s (h d)")), KVCache(keys, values)

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
        segment_ids: Int[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, "seq hidden"], KVCache | None]:
        """Run the layer on one sequence.

        Args:
            x: hidden states.
            positions: the position of each token, for rotary embeddings.
            cache: keys and values of earlier tokens; `None` to attend within `x` only.
            index: with a cache, the slot of `x[0]` (see `Attention.cached`).
            segment_ids: without a cache, the document of each token: a token attends
                within its own (documents packed into one row).

        Returns:
            The new hidden states, and the cache with `x`'s keys and values written
            (`None` without a cache).
        """
        h = normalise(self.attn_norm, x)
        if cache is None:
            attn = self.attn(h, positions, segment_ids)
        else:
            attn, cache = self.attn.cached(h, positions, cache, index)
        if self.mlp_norm is None:
            return x + attn + self.mlp(h), cache
        x = x + attn
        return x + self.mlp(normalise(self.mlp_norm, x)), cache
