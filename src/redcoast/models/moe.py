"""Sparse mixtures of experts (Shazeer et al. 2017) as today's families have them.

`SparseMoE` routes each token to its `top_k` experts and applies only those
(`rc.nn.experts`: the tokens sorted by expert and a grouped matmul; or a capacity
per expert; or every expert on every token, the same numbers). Its `Router` picks
the experts as the family does:

| family | scores | top-k weights |
|---|---|---|
| Mixtral | softmax | renormalised to sum to one |
| Qwen3-MoE | softmax | renormalised when `norm_topk_prob` |
| DeepSeek-V3 | sigmoid (+ bias to choose) | renormalised, times a scale |

DeepSeek-V3 adds a per-expert bias to the sigmoid scores to choose the experts (not to
their weights), chooses within the best `topk_group` of `n_group` groups of experts,
renormalises when `norm_topk_prob` and multiplies by `routed_scaling_factor`.

DeepSeek's shared experts (`shared`) see every token beside the routed ones.

`load_balancing_loss` is `transformers`' `load_balancing_loss_func` (Fedus et al.
2021, eqs. 4-6): the fraction of routings each expert receives times the mean
router probability it gets, summed over experts and scaled by their number.
`router_z_loss` is ST-MoE's (Zoph et al. 2022): the mean squared log-sum-exp of the
router's logits. `routing_metrics` says how evenly the routings spread and what a
capacity drops.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from ..nn import dense
from ..nn import experts as routed_experts
from ..nn._experts import _check_dispatch

__all__ = [
    "Router",
    "SparseMoE",
    "load_balancing_loss",
    "route_layers",
    "router_z_loss",
    "routing_metrics",
    "with_dispatch",
]


@dataclasses.dataclass(frozen=True)
class Router:
    """How a mixture picks each token's experts from the router's logits.

    Attributes:
        scoring: `"softmax"` over the experts (Mixtral, Qwen3-MoE) or each expert's
            `"sigmoid"` (DeepSeek-V3).
        normalize: the chosen experts' scores are divided by their sum (Mixtral
            always; `norm_topk_prob` of Qwen3-MoE and DeepSeek-V3).
        n_group: the experts form this many equal groups (`n_group`)...
        topk_group: ...and a token chooses within its `topk_group` best groups, a
            group scored by its two best experts (DeepSeek-V3).
        scale: the weights are multiplied by it (`routed_scaling_factor`).
    """

    scoring: Literal["softmax", "sigmoid"] = "softmax"
    normalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0

    def check(self, num_experts: int, top_k: int) -> None:
        """Raise a ValueError for a routing these experts cannot make."""
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"Router: scoring={self.scoring!r}; use 'softmax' or 'sigmoid'.")
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"top_k (num_experts_per_tok) must be in [1, {num_experts}] for "
                f"{num_experts} experts; got {top_k}."
            )
        if num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"Router: {num_experts} experts in n_group={self.n_group} groups, of which "
                f"topk_group={self.topk_group} are kept: the groups must divide the experts "
                "and 1 <= topk_group <= n_group."
            )
        if top_k > self.topk_group * num_experts // self.n_group:
            raise ValueError(
                f"Router: top_k={top_k} experts cannot be chosen within topk_group="
                f"{self.topk_group} groups of {num_experts // self.n_group} experts."
            )

    def route(
        self,
        logits: Float[Array, "*tokens experts"],
        top_k: int,
        bias: Float[Array, " experts"] | None = None,
    ) -> tuple[Int[Array, "*tokens k"], Float[Array, "*tokens k"]]:
        """Each token's `top_k` experts and their weights (float32), from its logits.

        `bias` is added to the sigmoid scores for choosing the experts, not to their
        weights (DeepSeek-V3's `e_score_correction_bias`).
        """
        logits = logits.astype(jnp.float32)
        if self.scoring == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
            weights, chosen = jax.lax.top_k(scores, top_k)
        else:
            scores = jax.nn.sigmoid(logits)
            choice = scores if bias is None else scores + jax.lax.stop_gradient(bias)
            if self.n_group > 1:
                choice = self._within_groups(choice)
            chosen = jax.lax.top_k(choice, top_k)[1]
            weights = jnp.take_along_axis(scores, chosen, axis=-1)
        if self.normalize:
            eps = 1e-20 if self.scoring == "sigmoid" else 0.0
            weights = weights / (weights.sum(-1, keepdims=True) + eps)
        return chosen, weights * self.scale

    def _within_groups(self, choice: Array) -> Array:
        """The scores of experts outside each token's `topk_group` best groups set to -inf."""
        *lead, n = choice.shape
        grouped = choice.reshape(*lead, self.n_group, n // self.n_group)
        group_scores = jax.lax.top_k(grouped, min(2, n // self.n_group))[0].sum(-1)
        best = jax.lax.top_k(group_scores, self.topk_group)[1]
        keep = jax.nn.one_hot(best, self.n_group, dtype=jnp.bool_).any(-2)
        return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)


class Dispatching(eqx.Module):
    """How a `SparseMoE` dispatches (`rc.nn.experts`' `dispatch`): a field of its own,
    holding no array, so that `eqx.tree_at` can swap it (`with_dispatch`)."""

    dispatch: str | float = eqx.field(static=True)


class SparseMoE(eqx.Module):
    """Top-k routing over SwiGLU experts stacked on an expert axis.

    Attributes:
        gate: the router, a Linear from the hidden size to one logit per expert
            (transformers' `gate`).
        w1: every expert's gate projection, `(experts, ffn, hidden)`.
        w3: every expert's up projection, `(experts, ffn, hidden)`.
        w2: every expert's down projection, `(experts, hidden, ffn)`.
        score_bias: added to the scores to choose the experts (DeepSeek-V3's
            `e_score_correction_bias`), or None. Loaded and kept: no gradient
            reaches it (a weight-decaying optimizer should leave it out).
        shared: the shared experts every token goes through (a `SwiGLU`), or None.
        top_k: experts per token (`num_experts_per_tok`).
        router: how the experts are chosen.
        activation: of the gate projection (SiLU).
        how: `rc.nn.experts`' dispatch (`dispatch`): `"dropless"` (only the chosen experts
            compute), `"dense"` (every expert every token) or a capacity factor.

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
    score_bias: Float[Array, " experts"] | None
    shared: Any
    top_k: int = eqx.field(static=True)
    router: Router = eqx.field(static=True)
    activation: Callable[[Array], Array] = eqx.field(static=True)
    how: Dispatching

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        num_experts: int,
        top_k: int,
        router: Router = Router(),
        score_bias: bool = False,
        shared_intermediate_size: int | None = None,
        activation: Callable[[Array], Array] = jax.nn.silu,
        dispatch: str | float = "dropless",
        std: float = 0.02,
        key: PRNGKeyArray,
    ):
        router.check(num_experts, top_k)
        _check_dispatch(dispatch)
        kg, k1, k3, k2, ks = jax.random.split(key, 5)
        self.gate = eqx.nn.Linear(hidden_size, num_experts, use_bias=False, key=kg)
        inner = (num_experts, intermediate_size, hidden_size)
        self.w1 = std * jax.random.normal(k1, inner)
        self.w3 = std * jax.random.normal(k3, inner)
        self.w2 = std * jax.random.normal(k2, (num_experts, hidden_size, intermediate_size))
        self.score_bias = jnp.zeros((num_experts,), jnp.float32) if score_bias else None
        if shared_intermediate_size:
            from .layers import SwiGLU  # layers holds the blocks that hold a SparseMoE

            self.shared = SwiGLU(
                hidden_size, shared_intermediate_size, activation=activation, key=ks
            )
        else:
            self.shared = None
        self.top_k = top_k
        self.router = router
        self.activation = activation
        self.how = Dispatching(dispatch)

    @property
    def dispatch(self) -> str | float:
        """`rc.nn.experts`' dispatch (see `with_dispatch` to change it)."""
        return self.how.dispatch

    def __call__(self, x: Float[Array, "seq hidden"]) -> Float[Array, "seq hidden"]:
        """The mixture's output for every token."""
        return self.routed(x)[0]

    def route(
        self, router_logits: Float[Array, "*tokens experts"]
    ) -> tuple[Int[Array, "*tokens k"], Float[Array, "*tokens k"]]:
        """Each token's experts and their weights, from the router's logits."""
        return self.router.route(router_logits, self.top_k, self.score_bias)

    def logits(self, x: Float[Array, "seq hidden"]) -> Float[Array, "seq experts"]:
        """The router's logits (float32 for a sigmoid router, as DeepSeek-V3 has them)."""
        if self.router.scoring == "sigmoid":
            w = self.gate.weight.astype(jnp.float32)
            return jnp.einsum("td,ed->te", x.astype(jnp.float32), w)
        return dense(self.gate, x)

    def routed(
        self, x: Float[Array, "seq hidden"]
    ) -> tuple[Float[Array, "seq hidden"], Float[Array, "seq experts"]]:
        """The mixture's output and the router's logits (for `load_balancing_loss`)."""
        logits = self.logits(x)
        chosen, weights = self.route(logits)
        y = routed_experts(
            x,
            chosen,
            weights,
            self.w1,
            self.w3,
            self.w2,
            activation=self.activation,
            dispatch=self.dispatch,
        )
        if self.shared is not None:
            y = y + self.shared(x)
        return y, logits


def route_layers(
    model: Any, router_logits: Float[Array, "layers *tokens experts"]
) -> Int[Array, "layers *tokens k"]:
    """Every mixture layer's chosen experts, from its router's logits (the `SparseMoE`s
    of `model` in layer order: a tuple of layers, or one stacked under `lax.scan`)."""
    mixtures = [
        leaf
        for leaf in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, SparseMoE))
        if isinstance(leaf, SparseMoE)
    ]
    if len(mixtures) == 1 and mixtures[0].w1.ndim == 4:  # scanned layers
        return eqx.filter_vmap(lambda m, lg: m.route(lg)[0])(mixtures[0], router_logits)
    if len(mixtures) != router_logits.shape[0]:
        raise ValueError(
            f"route_layers: {len(mixtures)} mixture layers for router logits of "
            f"{router_logits.shape[0]} layers."
        )
    return jnp.stack([m.route(lg)[0] for m, lg in zip(mixtures, router_logits, strict=True)])


def with_dispatch(model: Any, dispatch: str | float) -> Any:
    """`model` with every `SparseMoE` in it dispatching by `dispatch` (see `rc.nn.experts`).

    Example:
        >>> dense = rc.models.with_dispatch(mixtral, "dense")
        >>> capped = rc.models.with_dispatch(mixtral, 1.25)
    """
    _check_dispatch(dispatch)

    def mixtures(tree: Any) -> list[Dispatching]:
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, SparseMoE))
        return [leaf.how for leaf in leaves if isinstance(leaf, SparseMoE)]

    n = len(mixtures(model))
    return eqx.tree_at(mixtures, model, [Dispatching(dispatch)] * n) if n else model


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


def router_z_loss(
    router_logits: Float[ArrayLike, "*tokens experts"],
    mask: Bool[ArrayLike, "..."] | None = None,
) -> Float[Array, ""]:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): the mean over tokens (and
    layers) of `logsumexp(router_logits)^2`, which keeps the logits small.

    Args:
        router_logits: any leading axes, e.g. `(batch, layers, seq, experts)`.
        mask: which tokens count, broadcasting to the leading axes; all by default.

    Example:
        >>> z = router_z_loss(router)
    """
    z = jax.nn.logsumexp(jnp.asarray(router_logits, jnp.float32), axis=-1) ** 2
    weight = (
        jnp.ones_like(z) if mask is None else jnp.broadcast_to(jnp.asarray(mask, z.dtype), z.shape)
    )
    return jnp.sum(z * weight) / jnp.maximum(weight.sum(), 1.0)


def routing_metrics(
    chosen: Int[ArrayLike, "batch layers seq k"],
    num_experts: int,
    *,
    capacity_factor: float | None = None,
) -> dict[str, Float[Array, ""]]:
    """How the routings of a batch spread over the experts, as metrics to log.

    Args:
        chosen: every layer's chosen experts for every token of the batch
            (`with_routing` of a model under `jax.vmap`).
        num_experts: the experts of a layer.
        capacity_factor: the dispatch's capacity factor, to count what it drops.

    Returns:
        `expert_load_max`: the busiest expert's share of its layer's routings, times
        the number of experts (1.0 is an even spread; `num_experts` is every token
        to one expert), the largest over layers. `experts_idle`: the share of the
        (layer, expert) pairs no token chose. With `capacity_factor`,
        `routings_dropped`: the share of the routings over the capacity of their
        expert in their sequence (what `SparseMoE` with that dispatch leaves out).

    Example:
        >>> logits, routing = jax.vmap(model.with_routing)(ids)
        >>> routing_metrics(routing.chosen, 8, capacity_factor=1.25)
    """
    chosen = jnp.asarray(chosen)
    batch, layers, seq, k = chosen.shape
    counts = jax.nn.one_hot(chosen, num_experts, dtype=jnp.float32).sum(-2)  # (b, l, s, e)
    per_layer = counts.sum((0, 2))  # (l, e)
    share = per_layer / jnp.maximum(per_layer.sum(-1, keepdims=True), 1.0)
    out = {
        "expert_load_max": jnp.max(share) * num_experts,
        "experts_idle": jnp.mean((per_layer == 0).astype(jnp.float32)),
    }
    if capacity_factor is not None:
        cap = max(1, math.ceil(capacity_factor * seq * k / num_experts))
        per_row = counts.sum(2)  # (b, l, e)
        over = jnp.maximum(per_row - cap, 0.0).sum()
        out["routings_dropped"] = over / (batch * layers * seq * k)
    return out
