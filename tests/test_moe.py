"""Mixtures of experts: tokens sent only to their experts, by every family's router.

`rc.nn.experts` sorts the routings by expert and applies each expert to its own
(`"dropless"`), or fills a capacity per expert; both must give the numbers of every
expert computing every token (`"dense"`), forward and backward, split over devices as
on one. The routers must choose what transformers' choose, and the metrics must say
what a capacity dropped.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc
from redcoast.models import Router, SparseMoE
from redcoast.parallel import _active

HIDDEN, FFN, TOKENS, ROWS = 16, 24, 12, 4
ROUTERS = {
    "mixtral": dict(router=Router(), num_experts=8, top_k=2),
    "qwen3_moe": dict(router=Router(normalize=False), num_experts=8, top_k=3),
    "deepseek_v3": dict(
        router=Router(scoring="sigmoid", n_group=4, topk_group=2, scale=2.5),
        num_experts=8,
        top_k=3,
        score_bias=True,
        shared_intermediate_size=FFN,
    ),
}


def mixture(name: str, **options) -> SparseMoE:
    moe = SparseMoE(HIDDEN, FFN, **ROUTERS[name], **options, std=0.3, key=jax.random.key(0))
    moe = eqx.tree_at(lambda m: m.gate.weight, moe, moe.gate.weight * 5.0)
    if moe.score_bias is not None:  # a correction that changes the choice
        moe = eqx.tree_at(lambda m: m.score_bias, moe, jnp.linspace(-0.3, 0.3, 8))
    return moe


X = jax.random.normal(jax.random.key(1), (ROWS, TOKENS, HIDDEN))
PROBE = jnp.cos(jnp.arange(HIDDEN, dtype=jnp.float32))


def loss(moe: SparseMoE, x: jax.Array) -> jax.Array:
    return jnp.sum(jax.vmap(moe)(x) * PROBE)


def value_and_grads(moe: SparseMoE, x: jax.Array = X) -> tuple:
    params, static = eqx.partition(moe, eqx.is_inexact_array)
    run = jax.jit(jax.value_and_grad(lambda p, x: loss(eqx.combine(p, static), x), (0, 1)))
    value, (g_params, g_x) = run(params, x)
    return value, jax.tree.leaves(g_params), g_x


def assert_close(got: tuple, want: tuple, tol: float = 2e-5) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=tol)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, atol=tol, rtol=tol)
    np.testing.assert_allclose(got[2], want[2], atol=tol, rtol=tol)


@pytest.mark.parametrize("name", list(ROUTERS))
def test_only_the_chosen_experts_compute_the_every_expert_numbers(name: str) -> None:
    want = value_and_grads(mixture(name, dispatch="dense"))
    assert_close(value_and_grads(mixture(name)), want)  # dropless, blocked on CPU
    # A capacity that no expert can fill drops nothing.
    assert_close(value_and_grads(mixture(name, dispatch=float(ROUTERS[name]["num_experts"]))), want)


def test_the_ragged_grouped_matmul_is_the_blocked_one() -> None:
    # `jax.lax.ragged_dot` (what TPUs run) against the blocks CPUs run; one sequence
    # unbatched, the batch under vmap.
    moe = mixture("qwen3_moe")
    chosen, weights = moe.route(jax.vmap(moe.logits)(X))
    args = (X, chosen, weights, moe.w1, moe.w3, moe.w2)

    def run(grouped: str) -> tuple:
        def f(x, w, w1, w3, w2):
            y = jax.vmap(lambda x, c, w: rc.nn.experts(x, c, w, w1, w3, w2, grouped=grouped))(
                x, chosen, w
            )
            return jnp.sum(y * PROBE)

        return jax.jit(jax.value_and_grad(f, (0, 1, 2, 3, 4)))(*args[:1], *args[2:])

    (v_r, g_r), (v_b, g_b) = run("ragged"), run("blocked")
    np.testing.assert_allclose(v_r, v_b, rtol=1e-5)
    for r, b in zip(g_r, g_b, strict=True):
        np.testing.assert_allclose(r, b, atol=2e-5)
    one = rc.nn.experts(X[0], chosen[0], weights[0], moe.w1, moe.w3, moe.w2, grouped="ragged")
    dense = rc.nn.experts(X[0], chosen[0], weights[0], moe.w1, moe.w3, moe.w2, dispatch="dense")
    np.testing.assert_allclose(one, dense, atol=2e-5)


def test_routers_choose_what_transformers_routers_choose() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    routers = {
        "mixtral": MixtralTopKRouter(
            transformers.MixtralConfig(hidden_size=HIDDEN, num_local_experts=8)
        ),
        "qwen3_moe": Qwen3MoeTopKRouter(
            transformers.Qwen3MoeConfig(
                hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False
            )
        ),
        "deepseek_v3": DeepseekV3TopkRouter(
            transformers.DeepseekV3Config(
                hidden_size=HIDDEN,
                n_routed_experts=8,
                num_experts_per_tok=3,
                n_group=4,
                topk_group=2,
                routed_scaling_factor=2.5,
            )
        ),
    }
    x = np.asarray(X.reshape(-1, HIDDEN))
    for name, theirs in routers.items():
        moe = mixture(name)
        with torch.no_grad():
            theirs.weight.copy_(torch.tensor(np.asarray(moe.gate.weight)))
            if moe.score_bias is not None:
                theirs.e_score_correction_bias.copy_(torch.tensor(np.asarray(moe.score_bias)))
            _, t_weights, t_chosen = theirs(torch.tensor(x))
        chosen, weights = moe.route(moe.logits(jnp.asarray(x)))
        order, t_order = np.argsort(chosen, -1), np.argsort(t_chosen.numpy(), -1)
        np.testing.assert_array_equal(
            np.take_along_axis(np.asarray(chosen), order, -1),
            np.take_along_axis(t_chosen.numpy(), t_order, -1),
            err_msg=name,
        )
        np.testing.assert_allclose(
            np.take_along_axis(np.asarray(weights), order, -1),
            np.take_along_axis(t_weights.float().numpy(), t_order, -1),
            rtol=1e-5,
            err_msg=name,
        )


MESHES = {"experts": ((4, 2), 8), "within-experts": ((2, 4), 6)}


@pytest.mark.parametrize(
    "split", [s if s == "experts" else pytest.param(s, marks=pytest.mark.slow) for s in MESHES]
)
def test_experts_split_over_devices_equal_one_device(split: str) -> None:
    # Rows over "data" and experts over "model" (whole experts, or within each when 6
    # experts do not divide 4 shards); dropless and with a capacity that drops.
    shape, n = MESHES[split]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), ("data", "model"))
    for dispatch in ("dropless", 1.0):
        moe = SparseMoE(
            HIDDEN, FFN, num_experts=n, top_k=2, dispatch=dispatch, key=jax.random.key(2)
        )
        want = value_and_grads(moe)
        params, static = eqx.partition(moe, eqx.is_inexact_array)

        def run(p, x, static=static):
            def f(p, x):
                return loss(eqx.combine(p, static), x)

            with _active.activated(_active.Active(gathers={}, mesh=mesh)):
                return jax.value_and_grad(f, (0, 1))(p, x)

        x = jax.device_put(X, NamedSharding(mesh, P("data")))
        value, (g_params, g_x) = jax.jit(run)(params, x)
        assert_close((value, jax.tree.leaves(g_params), g_x), want)


def tiny_mixtral(**changes) -> rc.models.Mixtral:
    config = rc.models.MixtralConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        **changes,
    )
    return rc.models.Mixtral(config, key=jax.random.key(3))


def test_a_router_sending_everything_to_two_experts_runs_and_the_metrics_say_so() -> None:
    # Zero router weights: every expert ties, and top-k takes experts 0 and 1 for all.
    model = tiny_mixtral()
    model = eqx.tree_at(
        lambda m: [b.mlp.gate.weight for b in m.blocks],
        model,
        [jnp.zeros_like(b.mlp.gate.weight) for b in model.blocks],
    )
    ids = jax.random.randint(jax.random.key(4), (2, TOKENS), 0, 64)
    batch = {"input_ids": ids}
    moe_lm_loss = eqx.filter_jit(rc.models.moe_lm_loss)
    loss_dropless, metrics = moe_lm_loss(model, batch)
    loss_dense, _ = moe_lm_loss(rc.models.with_dispatch(model, "dense"), batch)
    np.testing.assert_allclose(loss_dropless, loss_dense, rtol=1e-6)
    # Experts 0 and 1 take half of the routings each: 2 x an even share of 4 experts.
    assert float(metrics["expert_load_max"]) == pytest.approx(2.0)
    assert float(metrics["experts_idle"]) == pytest.approx(0.5)
    assert "routings_dropped" not in metrics
    # A capacity of 1.0: each expert takes ceil(12 * 2 / 4) = 6 of a row's 12 routings.
    capped = rc.models.with_dispatch(model, 1.0)
    loss_capped, metrics = moe_lm_loss(capped, batch)
    assert float(metrics["routings_dropped"]) == pytest.approx(0.5)
    assert np.isfinite(float(loss_capped)) and float(loss_capped) != float(loss_dense)


def test_capacity_keeps_the_first_routings_of_each_expert_in_token_order() -> None:
    moe = mixture("mixtral", dispatch=1.0)
    x = X[0]
    chosen, weights = moe.route(moe.logits(x))
    got = np.asarray(moe(x))
    cap = math.ceil(TOKENS * 2 / 8)
    seen = np.zeros(8, int)
    keep = np.zeros(chosen.shape, bool)
    for t in range(TOKENS):
        for j in range(2):
            e = int(chosen[t, j])
            keep[t, j] = seen[e] < cap
            seen[e] += 1
    assert 0 < keep.sum() < keep.size  # some dropped, some kept
    want = rc.nn.experts(x, chosen, weights * keep, moe.w1, moe.w3, moe.w2, dispatch="dense")
    np.testing.assert_allclose(got, want, atol=1e-5)
    metrics = rc.models.routing_metrics(chosen[None, None], 8, capacity_factor=1.0)
    assert float(metrics["routings_dropped"]) == pytest.approx(1 - keep.mean())


def test_bad_dispatches_and_routers_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="capacity factor"):
        rc.models.with_dispatch(tiny_mixtral(), "sparse")
    with pytest.raises(ValueError, match="capacity factor"):
        rc.models.with_dispatch(tiny_mixtral(), -1.0)
    with pytest.raises(ValueError, match="n_group"):
        SparseMoE(8, 8, num_experts=6, top_k=2, router=Router(n_group=4), key=jax.random.key(0))
    with pytest.raises(ValueError, match="top_k"):
        SparseMoE(8, 8, num_experts=4, top_k=5, key=jax.random.key(0))
    moe = mixture("mixtral")
    with pytest.raises(jaxtyping.TypeCheckError, match="w_down"):  # its shape, checked
        rc.nn.experts(X[0], *moe.route(moe.logits(X[0])), moe.w1, moe.w3, moe.w1)


def test_the_rules_still_split_whole_experts() -> None:
    # The rules read the dense form of the mixture (the sorted dispatch hides its
    # matmuls): experts over the model axis, the router replicated.
    model = tiny_mixtral()
    ids = jnp.zeros((2, TOKENS), jnp.int32)
    plan = rc.sharding_plan(model, 2, example_call=lambda m: jax.vmap(m)(ids))
    specs = {
        rc._tree_paths.path_str(p): s
        for p, s in jax.tree_util.tree_leaves_with_path(
            plan.specs, is_leaf=lambda s: isinstance(s, P)
        )
    }
    assert specs["blocks.0.mlp.w1"] == P("model", None, None)
    assert specs["blocks.0.mlp.w2"] == P("model", None, None)
    assert tuple(specs["blocks.0.mlp.gate.weight"]) in ((), (None, None))
    assert dataclasses.is_dataclass(Router())


def test_the_planner_counts_each_routing_once_in_a_ragged_dot() -> None:
    # The planner's FLOPs count (its step-time estimate for a TPU, which runs the
    # dropless dispatch as ragged dots): each row meets one expert's matrix, forward
    # and in both gradients, not every expert's.
    from redcoast.nn._kernels import planned_for
    from redcoast.train.throughput import matmul_flops

    moe = mixture("qwen3_moe")
    params, static = eqx.partition(moe, eqx.is_inexact_array)

    def f(p: SparseMoE, x: jax.Array) -> jax.Array:
        return loss(eqx.combine(p, static), x)

    with planned_for("tpu"):
        flops = matmul_flops(jax.make_jaxpr(jax.grad(f, (0, 1)))(params, X))[0]
    routings, n = ROWS * TOKENS * 3, 8
    chosen = 18 * HIDDEN * FFN * routings  # three matmuls, forward and backward
    router = 6 * HIDDEN * n * ROWS * TOKENS
    assert flops == chosen + router


def test_the_router_z_loss_is_st_moes_and_moe_lm_loss_adds_it() -> None:
    logits = jax.random.normal(jax.random.key(5), (2, 3, TOKENS, 4))
    mask = jnp.arange(TOKENS) < 9
    want = np.mean(np.asarray(jax.nn.logsumexp(logits, -1))[..., :9] ** 2)
    got = rc.models.router_z_loss(logits, mask)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    model = tiny_mixtral()
    batch = {"input_ids": jax.random.randint(jax.random.key(6), (2, TOKENS), 0, 64)}
    batch["attention_mask"] = jnp.ones((2, TOKENS), bool).at[1, 9:].set(False)
    moe_lm_loss = eqx.filter_jit(rc.models.moe_lm_loss)
    plain, _ = moe_lm_loss(model, batch)
    with_z, metrics = moe_lm_loss(model, batch, router_z_loss_coef=0.1)
    np.testing.assert_allclose(with_z - plain, 0.1 * metrics["z_loss"], rtol=1e-5)
