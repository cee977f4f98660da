"""A sparse mixture of experts (Shazeer et al. 2017) as Mixtral has it, and its balancing loss.

`SparseMoE` routes each token to its `top_k` experts: a softmax over every expert's
router logit, the `top_k` largest kept and renormalised to sum to one, as
`transformers`' `MixtralSparseMoeBlock` does. The experts are SwiGLU MLPs whose
weights are stacked on a leading expert axis (`w1`, `w3`, `w2` of every expert in one
array each), applied with `einsum`: every expert computes every token and the routing
weights, zero outside a token's `top_k`, combine them. That is exact, and it is what
the sharding rules read as experts: they split the expert axis over the model axis
(expert parallelism), or within each expert when the experts do not divide the
shards. It costs `num_experts / top_k` times the FLOPs of computing only the chosen
experts.

`load_balancing_loss` is `transformers`' `load_balancing_loss_func` (Fedus et al.
2021, eqs. 4-6): the fraction of routings each expert receives times the mean
router probability it gets, summed over experts and scaled by their number.
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from ..nn import dense

__all__ = ["SparseMoE", "load_balancing_loss"]


class SparseMoE(eqx.Module):
    """Top-k routing over SwiGLU experts stacked on an expert axis (Mixtral's MLP).

    Attributes:
        gate: the router, a Linear from the hidden size to one logit per expert
            (transformers' `block_sparse_moe.gate`).
        w1: every expert's gate projection, `(experts, ffn, hidden)`.
        w3: every expert's up projection, `(experts, ffn, hidden)`.
        w2: every expert's down projection, `(experts, hidden, ffn)`.
        top_k: experts per token (`num_experts_per_tok`).
        activation: of the gate projection (SiLU).

    Example:
        >>> moe = SparseMoE(32, 64, num_experts=4, top_k=2, key=jax.random.key(0))
        >>> y, router_logits = moe.routed(jnp.ones((10, 32)))
        >>> router_logits.shape
        (10, 4)
    """

    gate: eqx.nn.Linear
    w1: Float[Array, "experts ffn hidden"]
    w3: Float[Array, "experts ffn hidden"]
    w2: Float[Array, "experts hidden ffn"]
    top_k: int = eqx.field(static=True)
    activation: Callable[[Array], Array] = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        num_experts: int,
        top_k: int,
        activation: Callable[[Array], Array] = jax.nn.silu,
        std: float = 0.02,
        key: PRNGKeyArray,
    ):
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"top_k (num_experts_per_tok) must be in [1, {num_experts}] for "
                f"{num_experts} experts; got {top_k}."
            )
        kg, k1, k3, k2 = jax.random.split(key, 4)
        self.gate = eqx.nn.Linear(hidden_size, num_experts, use_bias=False, key=kg)
        inner = (num_experts, intermediate_size, hidden_size)
        self.w1 = std * jax.random.normal(k1, inner)
        self.w3 = std * jax.random.normal(k3, inner)
        self.w2 = std * jax.random.normal(k2, (num_experts, hidden_size, intermediate_size))
        self.top_k = top_k
        self.activation = activation

    def __call__(self, x: Float[Array, "seq hidden"]) -> Float[Array, "seq hidden"]:
        """The mixture's output for every token."""
        return self.routed(x)[0]

    def routed(
        self, x: Float[Array, "seq hidden"]
    ) -> tuple[Float[Array, "seq hidden"], Float[Array, "seq experts"]]:
        """The mixture's output and the router's logits (for `load_balancing_loss`)."""
        logits = dense(self.gate, x)
        weights = routing_weights(logits, self.top_k)
        h = self.activation(jnp.einsum("td,efd->etf", x, self.w1))
        h = h * jnp.einsum("td,efd->etf", x, self.w3)
        y = jnp.einsum("etf,edf->etd", h, self.w2)
        return jnp.einsum("etd,te->td", y, weights.astype(y.dtype)), logits


def routing_weights(logits: Float[Array, "seq experts"], top_k: int) -> Float[Array, "seq experts"]:
    """Each token's weight for each expert: the renormalised softmax of its `top_k`, else 0."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    # A 0/1 mask of the chosen experts times the probabilities, elementwise: the sharding
    # rules read the router's output as a gate on the experts rather than as features.
    chosen = jax.lax.top_k(probs, top_k)[1]
    mask = jax.nn.one_hot(chosen, probs.shape[-1], dtype=probs.dtype).sum(-2)
    kept = jnp.where(mask > 0, probs, 0.0)
    return kept / kept.sum(-1, keepdims=True)


def load_balancing_loss(
    router_logits: Float[ArrayLike, "batch layers seq experts"],
    top_k: int,
    mask: Bool[ArrayLike, "batch seq"] | None = None,
) -> Float[Array, ""]:
    """The auxiliary load-balancing loss of a batch, as `transformers` computes it.

    Every layer's routings of every (unmasked) token of the batch are pooled:
    `experts * sum_e f_e * P_e`, with `f_e` the fraction of the `top_k` choices that
    went to expert `e` (counted per choice, so `sum_e f_e = top_k`) and `P_e` its mean
    router probability. It is 1 * `top_k` for a perfectly even router.

    Args:
        router_logits: the logits of every layer's router for every token
            (`Mixtral.with_router_logits` under `jax.vmap`).
        top_k: experts per token (`num_experts_per_tok`).
        mask: which tokens count (transformers' `attention_mask`); all by default.

    Returns:
        The loss, a float32 scalar.

    Example:
        >>> logits, router = jax.vmap(model.with_router_logits)(ids)
        >>> aux = load_balancing_loss(router, model.config.num_experts_per_tok)
    """
    logits = jnp.asarray(router_logits, jnp.float32)
    experts = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    chosen = jax.lax.top_k(probs, top_k)[1]
    counts = jax.nn.one_hot(chosen, experts, dtype=jnp.float32).sum(-2)
    if mask is None:
        weight = jnp.ones(logits.shape[:-1], jnp.float32)
    else:
        weight = jnp.broadcast_to(jnp.asarray(mask, jnp.float32)[:, None, :], logits.shape[:-1])
    rows = jnp.maximum(weight.sum(), 1.0)
    tokens_per_expert = (counts * weight[..., None]).reshape(-1, experts).sum(0) / rows
    prob_per_expert = (probs * weight[..., None]).reshape(-1, experts).sum(0) / rows
    return experts * jnp.sum(tokens_per_expert * prob_per_expert)
