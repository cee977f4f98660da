"""Transformer building blocks shared by every model: attention, MLPs, rotary embeddings.

Each block works on one unbatched sequence, Equinox style; batch with `jax.vmap`.
Projections are plain `eqx.nn.Linear` layers named like Hugging Face's
(`q_proj`, `k_proj`, `v_proj`, `o_proj`), run with `redcoast.nn.dense`; attention is
`redcoast.nn.attention`, so the parallelisms act on the zoo as on any model built
from those pieces.

The decoder zoo is these blocks arranged differently: `DecoderBlock` is serial
(`x + attn(norm(x))`, then `x + mlp(norm(x))`), GPT-J's parallel `x + attn(h) +
mlp(h)` without a second norm, or Gemma's with a norm after each part too. Attention
takes grouped-query heads, a scaled rotation (`rope.RoPE`), a sliding window, per-head
query/key norms and soft-capped scores, and has a cached path (`Attention.cached`)
that writes keys and values into a `KVCache` for generation; the MLP is a plain one,
a gated one (`SwiGLU`, GeGLU with another activation) or a mixture of experts
(`moe.SparseMoE`).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from einops import rearrange
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, Real

from .._checks import check_range
from ..nn import Implementation, Norm, attention, check_implementation, dense, normalise
from .moe import SparseMoE
from .rope import RoPE
from .rope import rotate as rotate


def gelu(x: Array) -> Array:
    """The exact GELU (Hendrycks & Gimpel 2016), `x * Phi(x)`; Hugging Face's `"gelu"`."""
    return jax.nn.gelu(x, approximate=False)


def gelu_tanh(x: Array) -> Array:
    """GELU's tanh approximation; Hugging Face's `"gelu_new"` (GPT-2, GPT-J)."""
    return jax.nn.gelu(x, approximate=True)


def quick_gelu(x: Array) -> Array:
    """CLIP's GELU approximation, `x * sigmoid(1.702 x)` (Hugging Face's `"quick_gelu"`)."""
    return x * jax.nn.sigmoid(1.702 * x)


# Named module-level functions (not lambdas or partials) so that two models built
# from the same config compare equal as static pytree data and share compilations.
ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu": gelu,
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "quick_gelu": quick_gelu,
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


class KVCache(eqx.Module):
    """Keys and values of one attention layer for the tokens seen so far.

    Slot `i` holds position `i` of the sequence; slots not yet written are zeros and
    masked out. With scanned (stacked) layers both arrays carry a leading layer axis.
    """

    key: Float[Array, "*layers max_len kv_heads head_dim"]
    value: Float[Array, "*layers max_len kv_heads head_dim"]


class OffsetRMSNorm(eqx.Module):
    """RMSNorm scaled by `1 + weight` (Gemma): `x / rms(x) * (1 + weight)`, in float32.

    The checkpoint stores `weight` (zeros at initialisation), and so does this module,
    so that a round trip through `to_hf` gives back the very bits it read.

    Example:
        >>> norm = OffsetRMSNorm(32)
        >>> apply_norm(norm, jnp.ones((10, 32))).shape
        (10, 32)
    """

    weight: Float[Array, " features"]
    eps: float = eqx.field(static=True)

    def __init__(self, features: int, *, eps: float = 1e-6):
        self.weight = jnp.zeros((features,))
        self.eps = eps

    def as_rmsnorm(self) -> eqx.nn.RMSNorm:
        """The same norm as a plain `eqx.nn.RMSNorm` whose scale is `1 + weight` (float32)."""
        norm = eqx.nn.RMSNorm(self.weight.shape, eps=self.eps, use_bias=False)
        return eqx.tree_at(lambda n: n.weight, norm, 1.0 + self.weight.astype(jnp.float32))


AnyNorm = Norm | OffsetRMSNorm
"""A norm of the zoo: `rc.nn`'s LayerNorm or RMSNorm, or Gemma's `OffsetRMSNorm`."""


def apply_norm(
    norm: AnyNorm, x: Float[Array, "*tokens features"]
) -> Float[Array, "*tokens features"]:
    """`rc.nn.normalise` for any norm of the zoo (a Gemma norm as its `1 + weight` RMSNorm)."""
    return normalise(norm.as_rmsnorm() if isinstance(norm, OffsetRMSNorm) else norm, x)


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """What may differ from one layer's attention to the next: its window and its rotation.

    Attributes:
        window: each query sees only the `window` most recent positions, its own
            included (a sliding window); `None` for every earlier position.
        rope: the rotation of queries and keys; `None` for none.
    """

    window: int | None = None
    rope: RoPE | None = None


PerLayer = LayerAttention | tuple[tuple[LayerAttention, ...], Int[Array, ""]]
"""A layer's `LayerAttention`, or the distinct ones of a model and this layer's index
among them (an array: scanned layers of different kinds pick theirs with `lax.switch`)."""


def causal_mask(
    query: Int[Array, "seq 1"],
    slots: Int[Array, "1 kv_seq"],
    window: int | None,
    groups: Int[Array, " seq"] | None = None,
    kv_groups: Int[Array, " kv_seq"] | None = None,
) -> Bool[Array, "seq kv_seq"]:
    """Which key slots each query sees: its own and earlier ones, and, given `groups`,
    every slot of its group (`transformers`' `block_sequence_ids`: tokens with the same
    group id >= 0 see each other both ways, -1 is no group), all within the sliding
    `window` of the most recent positions (which a group's later tokens always are).

    Args:
        query: each query's slot, a column.
        slots: the keys' slots, a row.
        window: the sliding window, or `None`.
        groups: each query's group; default: no groups, the causal mask alone.
        kv_groups: each key slot's group; default: `groups` (keys are the queries).

    Returns:
        The mask, `True` where the query sees the key.

    Example:
        >>> at = jnp.arange(4)
        >>> causal_mask(at[:, None], at[None, :], None, jnp.array([-1, 0, 0, -1]))[1, 2]
        Array(True, dtype=bool)
    """
    visible = slots <= query
    if groups is not None:
        theirs = groups if kv_groups is None else kv_groups
        visible = visible | ((groups[:, None] == theirs[None, :]) & (groups[:, None] >= 0))
    if window is not None:
        visible = visible & (slots > query - window)
    return visible


class Attention(eqx.Module):
    """Causal multi-head attention: grouped-query heads, rotary positions, sliding windows,
    per-head query/key norms and soft-capped scores, each optional.

    Q, K and V are split into heads right after their projection, which is where the
    sharding rules read the head count from. The rotation and window are the module's
    own (`layer`) unless the call gives a layer's (`PerLayer`): models whose layers
    differ (Gemma's local and global layers) pass each layer's at the call.

    Args:
        hidden_size: width of the input and output.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention); default `num_heads`.
        head_dim: width of one head; default `hidden_size // num_heads`.
        rotary_dim: features of each head rotated by RoPE; 0 for no rotary positions.
        rope_base: RoPE's frequency base (`rope_theta`).
        rope_interleaved: rotate pairs `(0, 1), (2, 3), ...` (GPT-J) instead of halves.
        rope: a scaled rotation (`RoPE`), instead of `rotary_dim` and `rope_base`.
        window: a sliding window (see `LayerAttention`).
        qkv_bias: Q, K and V projections have biases.
        out_bias: the output projection has a bias.
        qk_norm: builds the norm of each query and key head over its `head_dim`
            features, applied before the rotation (Qwen 3, Gemma 3); `None` for none.
        scale: multiplies the scores; default `1 / sqrt(head_dim)`.
        softcap: scores become `softcap * tanh(scores / softcap)` (Gemma 2).
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
    q_norm: AnyNorm | None
    k_norm: AnyNorm | None
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    layer: LayerAttention = eqx.field(static=True)
    scale: float | None = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True)
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
        rope: RoPE | None = None,
        window: int | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: Callable[[int], AnyNorm] | None = None,
        scale: float | None = None,
        softcap: float | None = None,
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
        self.q_norm = None if qk_norm is None else qk_norm(head_dim)
        self.k_norm = None if qk_norm is None else qk_norm(head_dim)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        if rope is None and rotary_dim:
            rope = RoPE.default(rotary_dim, rope_base, interleaved=rope_interleaved)
        self.layer = LayerAttention(window, rope)
        self.scale = scale
        self.softcap = softcap
        self.recompute_scores = recompute_scores
        self.implementation = check_implementation(implementation)

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        positions: Real[Array, " seq"] | None = None,
        layer: PerLayer | None = None,
        segment_ids: Int[Array, " seq"] | None = None,
        bidirectional_groups: Int[Array, " seq"] | None = None,
    ) -> Float[Array, "seq hidden"]:
        """Attend causally within `x`, and within each document when `segment_ids` say
        which one each token belongs to; `positions` default to `0, 1, ..., seq - 1`.

        `bidirectional_groups` (see `causal_mask`): the tokens of a group also
        see each other's later positions (an image's tokens in Gemma 3), a mask that
        the `"cudnn"` and `"pallas"` kernels do not take."""
        pos = jnp.arange(x.shape[0]) if positions is None else positions
        q, k, v = self._qkv(x)
        if bidirectional_groups is not None and self.implementation in ("cudnn", "pallas"):
            raise ValueError(
                "Attention: bidirectional_groups make a (query, key) mask, which "
                f"implementation={self.implementation!r} does not take; build the model with "
                "attention='auto', 'einsum' or 'blockwise'."
            )

        def attend(kind: LayerAttention, q: Array, k: Array, v: Array) -> Array:
            q, k = self._rotate(kind, q, k, pos)
            causal, window, mask = True, kind.window, None
            if bidirectional_groups is not None:
                slots = jnp.arange(x.shape[0])
                causal, window = False, None
                mask = causal_mask(
                    slots[:, None], slots[None, :], kind.window, bidirectional_groups
                )
            return attention(
                q,
                k,
                v,
                causal=causal,
                mask=mask,
                window=window,
                scale=self.scale,
                softcap=self.softcap,
                segment_ids=segment_ids,
                recompute=self.recompute_scores,
                implementation=self.implementation,
            )

        out = self._per_layer(layer, attend, q, k, v)
        return dense(self.o_proj, rearrange(out, "s h d -> s (h d)"))

    def cached(
        self,
        x: Float[Array, "seq hidden"],
        positions: Real[Array, " seq"],
        cache: KVCache,
        index: Int[Array, ""] | int,
        layer: PerLayer | None = None,
        bidirectional_groups: Int[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, "seq hidden"], KVCache]:
        """Attend from `x` to everything cached so far plus `x` itself, and cache `x`'s keys.

        Args:
            x: the new tokens' hidden states (the whole prompt, or one token per step).
            positions: their positions, for rotary embeddings.
            cache: keys and values of earlier tokens, in slots `[0, index)`.
            index: the slot of `x[0]`; `x` is written to slots `[index, index + seq)`.
            layer: this layer's window and rotation, when not the module's own.
            bidirectional_groups: `x`'s groups (see `causal_mask`), whose tokens
                also see each other's later positions; a group lies within one call.

        Returns:
            The attention output and the cache with `x`'s keys and values written.

        Raises:
            ValueError: an int `index` leaves no room for `x` in the cache.
            RuntimeError: when the computation runs, an array `index` leaves no
                room for `x` in the cache (see `redcoast._checks.check_range`).
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
        q, k, v = self._qkv(x)

        def attend(
            kind: LayerAttention, q: Array, k: Array, v: Array, cache: KVCache
        ) -> tuple[Array, KVCache]:
            q, k = self._rotate(kind, q, k, positions)
            keys = jax.lax.dynamic_update_slice_in_dim(
                cache.key, k.astype(cache.key.dtype), index, 0
            )
            values = jax.lax.dynamic_update_slice_in_dim(
                cache.value, v.astype(cache.value.dtype), index, 0
            )
            # Query t sits in slot index + t and sees slots up to its own (and, in a
            # sliding window, the window's most recent ones); later slots are empty.
            slots = jnp.arange(keys.shape[0])[None, :]
            query = (index + jnp.arange(seq))[:, None]
            in_slots = None
            if bidirectional_groups is not None:
                empty = jnp.full(keys.shape[:1], -1, bidirectional_groups.dtype)
                in_slots = jax.lax.dynamic_update_slice(empty, bidirectional_groups, (index,))
            visible = causal_mask(query, slots, kind.window, bidirectional_groups, in_slots)
            out = attention(
                q,
                keys.astype(q.dtype),
                values.astype(q.dtype),
                mask=visible,
                scale=self.scale,
                softcap=self.softcap,
            )
            return out, KVCache(keys, values)

        out, cache = self._per_layer(layer, attend, q, k, v, cache)
        return dense(self.o_proj, rearrange(out, "s h d -> s (h d)")), cache

    def init_cache(self, max_len: int, dtype: DTypeLike) -> KVCache:
        """An empty cache of `max_len` slots for this layer's keys and values."""
        shape = (max_len, self.num_kv_heads, self.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def _per_layer(self, layer: PerLayer | None, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(kind, *args)` with this layer's kind: a static one, or one picked at run time."""
        if layer is None:
            return fn(self.layer, *args)
        if isinstance(layer, LayerAttention):
            return fn(layer, *args)
        kinds, which = layer
        return jax.lax.switch(which, [functools.partial(fn, kind) for kind in kinds], *args)

    def _qkv(
        self, x: Float[Array, "seq hidden"]
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
        if self.q_norm is not None and self.k_norm is not None:
            q, k = apply_norm(self.q_norm, q), apply_norm(self.k_norm, k)
        return q, k, v

    @staticmethod
    def _rotate(
        kind: LayerAttention, q: Array, k: Array, positions: Real[Array, " seq"]
    ) -> tuple[Array, Array]:
        if kind.rope is None:
            return q, k
        return kind.rope(q, positions), kind.rope(k, positions)


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
    """A pre-norm decoder layer, serial or parallel, with optional norms after each part.

    Serial (GPT-2, OPT, LLaMA): `x + attn(attn_norm(x))`, then `x + mlp(mlp_norm(x))`.
    Parallel (GPT-J, `mlp_norm=None`): `x + attn(h) + mlp(h)` with `h = attn_norm(x)`.
    Gemma adds a norm after attention and after the MLP, inside each residual branch:
    `x + post_attn_norm(attn(attn_norm(x)))`.

    Attributes:
        attn_norm: the norm before attention (and, in a parallel block, before the MLP).
        attn: the self-attention.
        mlp_norm: the norm before the MLP; `None` for a parallel block.
        mlp: the feed-forward network: an `MLP`, a `SwiGLU`, or a `SparseMoE` whose
            router's logits `forward` returns.
        post_attn_norm: the norm of attention's output, or `None`.
        post_mlp_norm: the norm of the MLP's output, or `None`.

    Example:
        >>> k1, k2 = jax.random.split(jax.random.key(0))
        >>> block = DecoderBlock(eqx.nn.LayerNorm(32), Attention(32, 4, key=k1),
        ...                      eqx.nn.LayerNorm(32), MLP(32, 128, key=k2))
        >>> y, _ = block(jnp.ones((10, 32)), jnp.arange(10))
    """

    attn_norm: AnyNorm
    attn: Attention
    mlp_norm: AnyNorm | None
    mlp: MLP | SwiGLU | SparseMoE
    post_attn_norm: AnyNorm | None = None
    post_mlp_norm: AnyNorm | None = None

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
        x, cache, _ = self.forward(x, positions, cache, index, segment_ids=segment_ids)
        return x, cache

    def forward(
        self,
        x: Float[Array, "seq hidden"],
        positions: Real[Array, " seq"],
        cache: KVCache | None = None,
        index: Int[Array, ""] | int = 0,
        layer: PerLayer | None = None,
        segment_ids: Int[Array, " seq"] | None = None,
        bidirectional_groups: Int[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, "seq hidden"], KVCache | None, Float[Array, "seq experts"] | None]:
        """`__call__` with this layer's attention kind, also returning the router's logits;
        `bidirectional_groups` as for `Attention` (with or without a cache).

        Returns:
            The new hidden states, the cache (or `None`), and the MoE router's logits
            (`None` for a dense MLP).
        """
        h = apply_norm(self.attn_norm, x)
        if cache is None:
            attn = self.attn(h, positions, layer, segment_ids, bidirectional_groups)
        else:
            attn, cache = self.attn.cached(h, positions, cache, index, layer, bidirectional_groups)
        if self.post_attn_norm is not None:
            attn = apply_norm(self.post_attn_norm, attn)
        if self.mlp_norm is None:
            y, router = self._mlp(h)
            return x + attn + y, cache, router
        x = x + attn
        y, router = self._mlp(apply_norm(self.mlp_norm, x))
        if self.post_mlp_norm is not None:
            y = apply_norm(self.post_mlp_norm, y)
        return x + y, cache, router

    def _mlp(
        self, h: Float[Array, "seq hidden"]
    ) -> tuple[Float[Array, "seq hidden"], Float[Array, "seq experts"] | None]:
        if isinstance(self.mlp, SparseMoE):
            return self.mlp.routed(h)
        return self.mlp(h), None
