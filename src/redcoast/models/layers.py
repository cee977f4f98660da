"""Transformer building blocks shared by every model: attention, MLPs, rotary embeddings.

Each block works on one unbatched sequence, Equinox style; batch with `jax.vmap`.
Projections are plain `eqx.nn.Linear` layers named like Hugging Face's
(`q_proj`, `k_proj`, `v_proj`, `o_proj`), which is what `redcoast.sharding_rules`
recognises as attention.
"""

import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray


def rotate(
    x: Float[Array, "seq heads head_dim"],
    positions: Float[Array, " seq"],
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


class Attention(eqx.Module):
    """Causal multi-head attention with grouped-query heads and optional rotary positions.

    Q, K and V are split into heads right after their projection, which is where the
    sharding rules read the head count from.
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
        self, x: Float[Array, "seq hidden"], positions: Float[Array, " seq"] | None = None
    ) -> Float[Array, "seq hidden"]:
        seq = x.shape[0]
        q = jax.vmap(self.q_proj)(x).reshape(seq, self.num_heads, self.head_dim)
        k = jax.vmap(self.k_proj)(x).reshape(seq, self.num_kv_heads, self.head_dim)
        v = jax.vmap(self.v_proj)(x).reshape(seq, self.num_kv_heads, self.head_dim)
        if self.rotary_dim:
            pos = jnp.arange(seq, dtype=jnp.float32) if positions is None else positions
            q = self._rotate(q, pos)
            k = self._rotate(k, pos)
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = jnp.repeat(k, group, axis=1)
            v = jnp.repeat(v, group, axis=1)
        scores = jnp.einsum("thd,shd->hts", q, k) / math.sqrt(self.head_dim)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal[None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("hts,shd->thd", weights, v).reshape(seq, self.num_heads * self.head_dim)
        return jax.vmap(self.o_proj)(out)

    def _rotate(
        self, x: Float[Array, "seq heads head_dim"], positions: Float[Array, " seq"]
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
        return jax.vmap(self.fc_out)(self.activation(jax.vmap(self.fc_in)(x)))


class SwiGLU(eqx.Module):
    """The gated MLP of LLaMA: `down(silu(gate(x)) * up(x))` (Shazeer 2020).

    The fields are declared down-first on purpose. Splitting by declaration order
    gets this layer wrong (down, gate, up -> column, row, column); the dataflow rules
    see gate and up read the same input and down read their product.
    """

    down_proj: eqx.nn.Linear
    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear

    def __init__(self, hidden_size: int, intermediate_size: int, *, key: PRNGKeyArray):
        kd, kg, ku = jax.random.split(key, 3)
        self.down_proj = eqx.nn.Linear(intermediate_size, hidden_size, use_bias=False, key=kd)
        self.gate_proj = eqx.nn.Linear(hidden_size, intermediate_size, use_bias=False, key=kg)
        self.up_proj = eqx.nn.Linear(hidden_size, intermediate_size, use_bias=False, key=ku)

    def __call__(self, x: Float[Array, "seq hidden"]) -> Float[Array, "seq hidden"]:
        gate = jax.nn.silu(jax.vmap(self.gate_proj)(x))
        return jax.vmap(self.down_proj)(gate * jax.vmap(self.up_proj)(x))
