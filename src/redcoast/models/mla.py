"""Multi-head latent attention (MLA, DeepSeek-V2), as DeepSeek-V3 and Moonlight have it.

Each token is projected to a small latent, `kv_lora_rank` features normed by
`kv_a_layernorm`, from which `kv_b_proj` makes every head's key and value, and to
`qk_rope_head_dim` more features that rotate with the token's position and that every
head shares as the rest of its key; the queries go through a low-rank pair of their own
(`q_a_proj`, `q_a_layernorm`, `q_b_proj`), or one `q_proj`. `MLAttention` computes it as
`transformers`' `DeepseekV3Attention` does, its scale with YaRN's `mscale_all_dim`
correction included, and caches the latent, as `transformers` does: generation attends
to the cached latents directly, `kv_b_proj` folded into the queries and the output
(`MLAttention.cached`).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from einops import rearrange
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray, Real

from .._checks import check_range
from ..nn import (
    AbstractProjection,
    AbstractQuantized,
    Implementation,
    attention,
    check_implementation,
    dense,
    normalise,
)
from .rope import RoPE

__all__ = ["LATENT_EPS", "LatentCache", "MLAttention", "yarn_mscale"]

# transformers' DeepseekV3RMSNorm of the query and key/value latents takes its default eps.
LATENT_EPS = 1e-6


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `scale` times longer (DeepSeek's
    `yarn_get_mscale`): `0.1 * mscale * ln(scale) + 1`, or 1 for `scale <= 1`."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class LatentCache(eqx.Module):
    """What one `MLAttention` layer caches of the tokens seen so far: each token's
    latent -- its `kv_lora_rank` features after `kv_a_layernorm`, then its rotated
    `qk_rope_head_dim` key features -- as transformers' DeepseekV3 caches them.

    Slot `i` holds position `i`; slots not yet written are zeros and masked out. With
    scanned layers the array carries a leading layer axis.
    """

    latent: Float[Array, "*layers max_len width"]


def _same_width(*xs: Array) -> tuple[Array, ...]:
    """Each array padded with zero features up to the widest: a query and key so padded
    give the same scores, a value so padded the same first features of the output."""
    width = max(x.shape[-1] for x in xs)
    return tuple(jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])]) for x in xs)


def _weight(
    layer: eqx.nn.Linear | AbstractProjection | AbstractQuantized, n_in: int, dtype: DTypeLike
) -> Float[Array, "out in"]:
    """The `(out, in)` matrix a bias-free projection multiplies by: a Linear's weight, or
    what a LoRA-adapted or quantized one computes, read off the identity."""
    if isinstance(layer, eqx.nn.Linear):
        return layer.weight.astype(dtype)
    return dense(layer, jnp.eye(n_in, dtype=dtype)).T


class MLAttention(eqx.Module):
    """Multi-head latent attention (DeepSeek-V2), causal: transformers' `DeepseekV3Attention`.

    Args:
        hidden_size: width of the input and output.
        num_heads: attention heads.
        q_lora_rank: width of the queries' latent (`q_a_proj`, `q_a_layernorm`,
            `q_b_proj`); `None` for one `q_proj`.
        kv_lora_rank: width of the keys' and values' latent (`kv_lora_rank`).
        qk_nope_head_dim: features of each query and key head that do not rotate.
        qk_rope_head_dim: features of each query head that rotate, and of the rotated
            key part every head shares.
        v_head_dim: width of each value head.
        rope: the rotation (`rotary_dim == qk_rope_head_dim`).
        interleaved: the rotated features are pairs `(0, 1), (2, 3), ...`
            (`rope_interleave`), taken apart into halves before rotating as
            transformers' `apply_rotary_pos_emb_interleave` does.
        scale: multiplies the scores (`DeepseekV3Config.softmax_scale`); default `1 /
            sqrt(qk_nope_head_dim + qk_rope_head_dim)`.
        bias: `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` have biases
            (`attention_bias`).
        recompute_scores: keep only queries, keys and values for the backward pass
            (remat's `"attention"` policy).
        implementation: how `rc.nn.attention` computes.
        key: for the initialisation.

    Example:
        >>> attn = MLAttention(32, 4, q_lora_rank=None, kv_lora_rank=16,
        ...     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        ...     rope=RoPE.default(4), key=jax.random.key(0))
        >>> attn(jnp.ones((10, 32))).shape
        (10, 32)
    """

    q_proj: eqx.nn.Linear | None
    q_a_proj: eqx.nn.Linear | None
    q_a_layernorm: eqx.nn.RMSNorm | None
    q_b_proj: eqx.nn.Linear | None
    kv_a_proj_with_mqa: eqx.nn.Linear
    kv_a_layernorm: eqx.nn.RMSNorm
    kv_b_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)
    kv_lora_rank: int = eqx.field(static=True)
    qk_nope_head_dim: int = eqx.field(static=True)
    v_head_dim: int = eqx.field(static=True)
    rope: RoPE = eqx.field(static=True)
    interleaved: bool = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    recompute_scores: bool = eqx.field(static=True)
    implementation: Implementation = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope: RoPE,
        interleaved: bool = False,
        scale: float | None = None,
        bias: bool = False,
        recompute_scores: bool = False,
        implementation: Implementation = "auto",
        key: PRNGKeyArray,
    ):
        if rope.rotary_dim != qk_rope_head_dim:
            raise ValueError(
                f"rope rotates {rope.rotary_dim} features; MLA's rotated part of each head "
                f"has qk_rope_head_dim={qk_rope_head_dim}."
            )
        kq, ka, kb, kk, kv, ko = jax.random.split(key, 6)
        qk, h = qk_nope_head_dim + qk_rope_head_dim, num_heads
        low_rank = q_lora_rank is not None
        self.q_proj = (
            None if low_rank else eqx.nn.Linear(hidden_size, h * qk, use_bias=False, key=kq)
        )
        self.q_a_proj = (
            eqx.nn.Linear(hidden_size, q_lora_rank, use_bias=bias, key=ka) if low_rank else None
        )
        self.q_a_layernorm = (
            eqx.nn.RMSNorm(q_lora_rank, eps=LATENT_EPS, use_bias=False) if low_rank else None
        )
        self.q_b_proj = (
            eqx.nn.Linear(q_lora_rank, h * qk, use_bias=False, key=kb) if low_rank else None
        )
        width = kv_lora_rank + qk_rope_head_dim
        self.kv_a_proj_with_mqa = eqx.nn.Linear(hidden_size, width, use_bias=bias, key=kk)
        self.kv_a_layernorm = eqx.nn.RMSNorm(kv_lora_rank, eps=LATENT_EPS, use_bias=False)
        kv_out = h * (qk_nope_head_dim + v_head_dim)
        self.kv_b_proj = eqx.nn.Linear(kv_lora_rank, kv_out, use_bias=False, key=kv)
        self.o_proj = eqx.nn.Linear(h * v_head_dim, hidden_size, use_bias=bias, key=ko)
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.v_head_dim = v_head_dim
        self.rope = rope
        self.interleaved = interleaved
        # Explicit: rc.nn.attention's default would read the padded width (`_same_width`).
        self.scale = qk**-0.5 if scale is None else scale
        self.recompute_scores = recompute_scores
        self.implementation = check_implementation(implementation)

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        positions: Real[Array, " seq"] | None = None,
        segment_ids: Int[Array, " seq"] | None = None,
    ) -> Float[Array, "seq hidden"]:
        """Attend causally within `x`, and within each document when `segment_ids` say
        which one each token belongs to; `positions` default to `0, 1, ..., seq - 1`.

        Every head's key and value are made from the latents (`kv_b_proj`), the rotated
        part of the key shared by all heads, as transformers computes them.
        """
        pos = jnp.arange(x.shape[0]) if positions is None else positions
        q = self._queries(x, pos)
        latent = self._latent(x, pos)
        c, k_rot = latent[:, : self.kv_lora_rank], latent[:, self.kv_lora_rank :]
        kv = rearrange(dense(self.kv_b_proj, c), "s (h d) -> s h d", h=self.num_heads)
        k_nope, v = kv[..., : self.qk_nope_head_dim], kv[..., self.qk_nope_head_dim :]
        k_rot = jnp.broadcast_to(k_rot[:, None, :], (*k_nope.shape[:2], k_rot.shape[-1]))
        k = jnp.concatenate([k_nope, k_rot], axis=-1)
        out = attention(
            *_same_width(q, k, v),
            causal=True,
            scale=self.scale,
            segment_ids=segment_ids,
            recompute=self.recompute_scores,
            implementation=self.implementation,
        )
        out = out[..., : self.v_head_dim]
        return dense(self.o_proj, rearrange(out, "s h d -> s (h d)"))

    def cached(
        self,
        x: Float[Array, "seq hidden"],
        positions: Real[Array, " seq"],
        cache: LatentCache,
        index: Int[Array, ""] | int,
    ) -> tuple[Float[Array, "seq hidden"], LatentCache]:
        """Attend from `x` to the cached tokens and itself, and cache `x`'s latents.

        The scores are the queries' against the latents themselves: each head's
        `kv_b_proj` key rows folded into its query (`q_nope @ W_k` has `kv_lora_rank`
        features), its value rows applied to the weighted latents after. That is
        MLA's inference form: one key/value "head" of `kv_lora_rank +
        qk_rope_head_dim` features for all heads, never expanded per head.

        Args:
            x: the new tokens' hidden states (the whole prompt, or one token per step).
            positions: their positions.
            cache: earlier tokens' latents, in slots `[0, index)`.
            index: the slot of `x[0]`; `x` goes to slots `[index, index + seq)`.

        Returns:
            The attention output and the cache with `x`'s latents written.

        Raises:
            ValueError: an int `index` leaves no room for `x` in the cache.
            RuntimeError: when the computation runs, an array `index` leaves no room.
        """
        seq, rank = x.shape[0], self.kv_lora_rank
        index = check_range(
            index,
            0,
            cache.latent.shape[0] - seq + 1,
            f"index (the cache slot of the first of {seq} new tokens)",
            f"the cache has {cache.latent.shape[0]} slots; make it longer with "
            "init_cache(max_len).",
        )
        q = self._queries(x, positions)
        new = self._latent(x, positions).astype(cache.latent.dtype)
        stored = jax.lax.dynamic_update_slice_in_dim(cache.latent, new, index, 0)
        w = _weight(self.kv_b_proj, rank, q.dtype)
        w = rearrange(w, "(h d) r -> h d r", h=self.num_heads)
        w_k, w_v = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]
        q_nope, q_rot = q[..., : self.qk_nope_head_dim], q[..., self.qk_nope_head_dim :]
        q = jnp.concatenate([jnp.einsum("shn,hnr->shr", q_nope, w_k), q_rot], axis=-1)
        keys = stored.astype(q.dtype)[:, None, :]
        values = keys.at[..., rank:].set(0)
        # Query t sits in slot index + t and sees slots up to its own.
        visible = jnp.arange(keys.shape[0])[None, :] <= (index + jnp.arange(seq))[:, None]
        out = attention(q, keys, values, mask=visible, scale=self.scale)[..., :rank]
        out = jnp.einsum("shr,hvr->shv", out, w_v)
        return dense(self.o_proj, rearrange(out, "s h d -> s (h d)")), LatentCache(stored)

    def init_cache(self, max_len: int, dtype: DTypeLike) -> LatentCache:
        """An empty cache of `max_len` slots for this layer's latents."""
        width = self.kv_lora_rank + self.rope.rotary_dim
        return LatentCache(jnp.zeros((max_len, width), dtype))

    def _queries(
        self, x: Float[Array, "seq hidden"], positions: Real[Array, " seq"]
    ) -> Float[Array, "seq heads qk"]:
        """Each head's query, its last `qk_rope_head_dim` features rotated."""
        if self.q_proj is not None:
            q = dense(self.q_proj, x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = dense(self.q_b_proj, normalise(self.q_a_layernorm, dense(self.q_a_proj, x)))
        q = rearrange(q, "s (h d) -> s h d", h=self.num_heads)
        q_nope, q_rot = q[..., : self.qk_nope_head_dim], q[..., self.qk_nope_head_dim :]
        return jnp.concatenate([q_nope, self._rotate(q_rot, positions)], axis=-1)

    def _latent(
        self, x: Float[Array, "seq hidden"], positions: Real[Array, " seq"]
    ) -> Float[Array, "seq width"]:
        """Each token's normed `kv_lora_rank` latent and its rotated shared key part."""
        compressed = dense(self.kv_a_proj_with_mqa, x)
        c, k_rot = compressed[:, : self.kv_lora_rank], compressed[:, self.kv_lora_rank :]
        k_rot = self._rotate(k_rot[:, None, :], positions)[:, 0]
        return jnp.concatenate([normalise(self.kv_a_layernorm, c), k_rot], axis=-1)

    def _rotate(
        self, x: Float[Array, "seq heads rope"], positions: Real[Array, " seq"]
    ) -> Float[Array, "seq heads rope"]:
        if self.interleaved:  # pairs (0, 1), (2, 3), ... -> halves (0, 2, ...), (1, 3, ...)
            x = rearrange(x, "s h (d two) -> s h (two d)", two=2)
        return self.rope(x, positions)
