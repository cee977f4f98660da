"""The two rules give Megatron-LM's layout, and sharded programs compute what unsharded ones do."""

from __future__ import annotations

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo import collectives, summarize, weight_all_gathers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray
from tiny import DeepMLP, TinyGPT, TinyGPTJ, TinyLlama, megatron_specs

import redcoast as rc
from redcoast._tree_paths import path_str

SEQ = 16
IDS = jax.random.randint(jax.random.key(1), (8, SEQ), 0, 64)
FEATURES = jax.random.normal(jax.random.key(2), (8, 64))

MODELS = {
    "gpt": lambda: TinyGPT(hidden=64, heads=8, key=jax.random.key(0)),
    "llama": lambda: TinyLlama(hidden=64, heads=8, kv_heads=2, ffn=128, key=jax.random.key(0)),
    "gptj": lambda: TinyGPTJ(hidden=64, heads=8, key=jax.random.key(0)),
    "mlp": lambda: DeepMLP(key=jax.random.key(0)),
}


def inputs(name: str) -> Array:
    return FEATURES if name == "mlp" else IDS


def loss(model: eqx.Module, x: Array) -> Array:
    out = jax.vmap(model)(x)
    if out.ndim == 2:  # DeepMLP: a regression loss
        return jnp.mean(out**2)
    logp = jax.nn.log_softmax(out, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp[:, :-1], x[:, 1:, None], axis=-1))


def leaves(tree: object) -> list[object]:
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, P))


def paths_and_specs(specs: object) -> dict[str, P]:
    flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))
    return {path_str(p): s for p, s in flat}


def normalise(spec: P, ndim: int) -> tuple:
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return entries


def assert_same_layout(model: eqx.Module, got: object, want: object) -> None:
    arrays = paths_and_specs(
        jax.tree_util.tree_map(lambda a: a.ndim, eqx.filter(model, eqx.is_array))
    )
    got_, want_ = paths_and_specs(got), paths_and_specs(want)
    assert got_.keys() == want_.keys()
    wrong = {
        p: (got_[p], want_[p])
        for p in got_
        if normalise(got_[p], arrays[p]) != normalise(want_[p], arrays[p])  # type: ignore[arg-type]
    }
    assert not wrong, f"layout differs from Megatron-LM's: {wrong}"


# ----------------------------------------------------------------------------- mesh


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_mesh_covers_every_device(n: int) -> None:
    mesh = rc.make_mesh(n)
    assert mesh.axis_names == ("data", "model")
    assert dict(mesh.shape) == {"data": 8 // n, "model": n}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


@pytest.mark.parametrize("n", [0, 3, 16, -2])
def test_mesh_rejects_shards_that_do_not_divide(n: int) -> None:
    with pytest.raises(ValueError, match=r"8 available devices; valid values are \[1, 2, 4, 8\]"):
        rc.make_mesh(n)


def test_mesh_on_chosen_devices() -> None:
    mesh = rc.make_mesh(2, devices=jax.devices()[:4])
    assert dict(mesh.shape) == {"data": 2, "model": 2}
    with pytest.raises(TypeError, match="n_model_shards"):
        rc.make_mesh(2.0)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("n", [2, 4, 8])
def test_dataflow_rules_give_megatron_layout(name: str, n: int) -> None:
    model = MODELS[name]()
    x = inputs(name)
    specs = rc.sharding_plan(model, n, example_call=lambda m: jax.vmap(m)(x)).specs
    assert_same_layout(model, specs, megatron_specs(model, n))


def test_swiglu_declared_down_gate_up_follows_the_dataflow() -> None:
    model = MODELS["llama"]()
    traced = paths_and_specs(
        rc.sharding_plan(model, 2, example_call=lambda m: jax.vmap(m)(IDS)).specs
    )
    assert traced["blocks.0.mlp.gate_proj.weight"] == P("model", None)
    assert traced["blocks.0.mlp.up_proj.weight"] == P("model", None)
    assert traced["blocks.0.mlp.down_proj.weight"] == P(None, "model")
    # Declaration order (down, gate, up) gets it wrong, and the plan says it fell back.
    plan = rc.sharding_plan(model, 2)
    by_order = paths_and_specs(plan.specs)
    assert by_order["blocks.0.mlp.down_proj.weight"] == P("model", None)
    assert "declaration order" in str(plan)


def test_gqa_kv_heads_that_do_not_divide_are_replicated_and_reported() -> None:
    model = MODELS["llama"]()  # 2 KV heads
    plan = rc.sharding_plan(model, 4, example_call=lambda m: jax.vmap(m)(IDS))
    specs = paths_and_specs(plan.specs)
    assert specs["blocks.0.attn.k_proj.weight"] == P()
    assert specs["blocks.0.attn.q_proj.weight"] == P("model", None)
    assert "2 heads do not divide 4 shards" in str(plan)


class Wide(eqx.Module):
    """Q/K/V whose output (2 heads of 16) divides 4 shards only by cutting heads."""

    attn: rc.models.Attention

    def __init__(self, key: PRNGKeyArray):
        self.attn = rc.models.Attention(32, 2, key=key)

    def __call__(self, x: Float[Array, "seq 32"]) -> Float[Array, "seq 32"]:
        return self.attn(x)


def test_heads_are_read_from_the_reshape_and_never_split() -> None:
    model = Wide(jax.random.key(0))
    x = jnp.ones((2, 5, 32))
    specs = paths_and_specs(rc.sharding_plan(model, 4, example_call=lambda m: jax.vmap(m)(x)).specs)
    assert specs["attn.q_proj.weight"] == P()
    assert specs["attn.o_proj.weight"] == P(None, "model")  # whole input: a local slice
    specs2 = paths_and_specs(
        rc.sharding_plan(model, 2, example_call=lambda m: jax.vmap(m)(x)).specs
    )
    assert specs2["attn.q_proj.weight"] == P("model", None)


class StackedMLP(eqx.Module):
    """Residual MLP blocks stacked on a leading layer axis and run with `lax.scan`."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, layers: int, key: PRNGKeyArray):
        def make(k: PRNGKeyArray) -> tuple[eqx.nn.Linear, eqx.nn.Linear]:
            k1, k2 = jax.random.split(k)
            return eqx.nn.Linear(16, 64, key=k1), eqx.nn.Linear(64, 16, key=k2)

        self.up, self.down = eqx.filter_vmap(make)(jax.random.split(key, layers))

    def __call__(self, x: Float[Array, " 16"]) -> Float[Array, " 16"]:
        def body(h: Array, layer: tuple[eqx.nn.Linear, eqx.nn.Linear]) -> tuple[Array, None]:
            up, down = layer
            return h + down(jax.nn.gelu(up(h))), None

        return jax.lax.scan(body, x, (self.up, self.down))[0]


def test_stacked_layers_keep_the_rule_on_their_last_two_axes() -> None:
    model = StackedMLP(3, jax.random.key(0))
    x = jnp.ones((4, 16))
    specs = paths_and_specs(rc.sharding_plan(model, 4, example_call=lambda m: jax.vmap(m)(x)).specs)
    assert normalise(specs["up.weight"], 3) == (None, "model", None)
    assert normalise(specs["up.bias"], 2) == (None, "model")
    assert normalise(specs["down.weight"], 3) == (None, None, "model")
    assert normalise(specs["down.bias"], 2) == (None, None)
    # Without a trace, declaration order on the last two axes gives the same here.
    by_order = paths_and_specs(rc.sharding_plan(model, 4).specs)
    assert normalise(by_order["up.weight"], 3) == (None, "model", None)


# ----------------------------------------------------------------------------- numerics


def value_and_grad(model: eqx.Module, x: Array) -> tuple[Array, object]:
    params, static = eqx.partition(model, eqx.is_inexact_array)
    fn = jax.jit(lambda p, x: jax.value_and_grad(lambda p: loss(eqx.combine(p, static), x))(p))
    return fn(params, x)


# GPT and the MLP at 4 shards here; the rest in `nox -s slow`.
@pytest.mark.parametrize(
    "name", [n if n in ("gpt", "mlp") else pytest.param(n, marks=pytest.mark.slow) for n in MODELS]
)
@pytest.mark.parametrize(
    "n", [pytest.param(2, marks=pytest.mark.slow), 4, pytest.param(8, marks=pytest.mark.slow)]
)
def test_sharded_loss_and_grads_equal_unsharded(name: str, n: int) -> None:
    model = MODELS[name]()
    x = inputs(name)
    want_loss, want_grads = value_and_grad(model, x)
    mesh = rc.make_mesh(n)
    specs = rc.sharding_plan(model, n, example_call=lambda m: jax.vmap(m)(x)).specs
    sharded = rc.place(model, mesh, specs=specs)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    got_loss, got_grads = value_and_grad(sharded, xs)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    chex.assert_trees_all_close(got_grads, want_grads, rtol=1e-5, atol=1e-6)


def model_axis_traffic(model: eqx.Module, specs: object, n: int, x: Array) -> dict[str, int]:
    """Bytes and counts of the model axis's collectives in a compiled gradient step."""
    mesh = rc.make_mesh(n)
    sharded = rc.place(model, mesh, specs=specs)
    params, static = eqx.partition(sharded, eqx.is_inexact_array)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    fn = jax.jit(lambda p, x: jax.grad(lambda p: loss(eqx.combine(p, static), x))(p))
    found = collectives(fn.lower(params, xs).compile().as_text(), mesh)
    split = [
        tuple(leaf.shape)
        for leaf, spec in zip(leaves(eqx.filter(model, eqx.is_array)), leaves(specs), strict=True)
        if any(e is not None for e in spec)
    ]
    traffic = summarize(found).get("model", {"bytes": 0})
    return {**traffic, "weight all-gathers": len(weight_all_gathers(found, split))}


@pytest.mark.parametrize(
    "name", [n if n in ("gpt", "mlp") else pytest.param(n, marks=pytest.mark.slow) for n in MODELS]
)
def test_compiled_traffic_matches_megatron_with_no_weight_all_gathers(name: str) -> None:
    model = MODELS[name]()
    x = inputs(name)
    ours = model_axis_traffic(
        model, rc.sharding_plan(model, 4, example_call=lambda m: jax.vmap(m)(x)).specs, 4, x
    )
    ref = model_axis_traffic(model, megatron_specs(model, 4), 4, x)
    assert ours["bytes"] <= 1.02 * ref["bytes"], (ours, ref)
    assert ours["weight all-gathers"] == 0, ours
    assert ours.get("all-reduce", 0) > 0


def test_shard_places_every_leaf_with_its_spec() -> None:
    model = MODELS["gpt"]()
    mesh = rc.make_mesh(4)
    specs = rc.sharding_plan(model, 4, example_call=lambda m: jax.vmap(m)(IDS)).specs
    sharded = rc.place(model, mesh, specs=specs)
    for leaf, spec in zip(leaves(eqx.filter(sharded, eqx.is_array)), leaves(specs), strict=True):
        assert isinstance(leaf, jax.Array)
        assert leaf.sharding == NamedSharding(mesh, spec)
    # the static parts are untouched
    assert sharded.blocks[0].attn.num_heads == model.blocks[0].attn.num_heads


# ----------------------------------------------------------------------------- report


def test_report_names_every_leaf_and_the_bytes() -> None:
    model = MODELS["gpt"]()
    plan = rc.sharding_plan(model, 4, example_call=lambda m: jax.vmap(m)(IDS))
    text = str(plan)
    for path in paths_and_specs(plan.specs):
        assert path in text
    assert "bytes per device" in text and "replicated" in text
    assert plan.bytes_per_device < plan.total_bytes / 4 * 1.2
    assert 0 < plan.replicated_bytes < 0.1 * plan.total_bytes
    given = str(rc.ShardingPlan.given(model, plan.specs, n_model_shards=4))
    assert "given" in given
    assert rc.ShardingPlan.given(model, plan.specs, n_model_shards=4).bytes_per_device == (
        plan.bytes_per_device
    )
    sharded = rc.place(model, rc.make_mesh(4), specs=plan)
    assert str(rc.ShardingPlan.given(sharded, plan.specs)) == given
    # The old names, for one release: each says what to use instead.
    with pytest.warns(DeprecationWarning, match=r"sharding_plan\(\.\.\.\)\.specs"):
        old = rc.sharding_rules(model, 4, example_call=lambda m: jax.vmap(m)(IDS))
    assert paths_and_specs(old) == paths_and_specs(plan.specs)
    with pytest.warns(DeprecationWarning, match="ShardingPlan.given"):
        assert rc.sharding_report(model, plan) == text


def test_overrides_win_and_typos_are_caught() -> None:
    model = MODELS["gpt"]()
    plan = rc.sharding_plan(
        model,
        4,
        example_call=lambda m: jax.vmap(m)(IDS),
        overrides={"blocks.*.mlp.fc_in.weight": P(None, "model")},
    )
    specs = paths_and_specs(plan.specs)
    assert specs["blocks.1.mlp.fc_in.weight"] == P(None, "model")
    assert "override" in str(plan)
    with pytest.raises(ValueError, match="match no array"):
        rc.sharding_plan(model, 4, overrides={"blocks.*.mlp.fc_inn.weight": P()})
    odd = DeepMLP((64, 10, 64), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"layers.0.weight: dimension 10 .* into 4 shards"):
        rc.sharding_plan(odd, 4, overrides={"layers.0.weight": P("model", None)})


# ----------------------------------------------------------------------------- bad input


def test_a_model_with_no_arrays_is_an_error() -> None:
    with pytest.raises(ValueError, match="no arrays"):
        rc.sharding_plan(eqx.nn.Lambda(jnp.tanh), 2)


def test_a_spec_tree_that_does_not_match_is_an_error() -> None:
    gpt, mlp = MODELS["gpt"](), MODELS["mlp"]()
    with pytest.raises(ValueError, match="spec tree does not match"):
        rc.place(gpt, rc.make_mesh(2), specs=rc.sharding_plan(mlp, 2).specs)


def test_bad_specs_are_errors_naming_the_leaf() -> None:
    model = MODELS["mlp"]()
    specs = jax.tree_util.tree_map(lambda _: P(), eqx.filter(model, eqx.is_array))
    bad = eqx.tree_at(
        lambda s: s.layers[0].weight, specs, P("modle"), is_leaf=lambda x: isinstance(x, P)
    )
    with pytest.raises(ValueError, match=r"layers.0.weight.*names axis 'modle'"):
        rc.place(model, rc.make_mesh(2), specs=bad)


def test_more_shards_than_any_dimension_falls_back_and_reports() -> None:
    model = DeepMLP((3, 5, 3), key=jax.random.key(0))
    plan = rc.sharding_plan(model, 8, example_call=lambda m: jax.vmap(m)(jnp.ones((2, 3))))
    assert all(spec == P() for spec in leaves(plan.specs))
    assert "no dimension of (5, 3) divides 8" in str(plan)


def test_uneven_layers_fall_back_to_the_other_dimension() -> None:
    model = DeepMLP((64, 128, 10), key=jax.random.key(0))
    plan = rc.sharding_plan(model, 4, example_call=lambda m: jax.vmap(m)(jnp.ones((2, 64))))
    specs = paths_and_specs(plan.specs)
    assert specs["layers.0.weight"] == P("model", None)
    assert specs["layers.1.weight"] == P(None, "model")
    # A small layer whose outputs do not divide stays replicated: the two collectives a
    # step of the other split cost more (their latency) than the 2 KB it would save.
    model = DeepMLP((64, 10, 64), key=jax.random.key(0))
    plan = rc.sharding_plan(model, 4, example_call=lambda m: jax.vmap(m)(jnp.ones((2, 64))))
    specs = paths_and_specs(plan.specs)
    assert specs["layers.0.weight"] == P()
    assert "would add 2 collectives a step" in str(plan)
    assert specs["layers.1.weight"] == P("model", None)
    # A large one falls back to the other dimension (shapes only: nothing is allocated).
    big = eqx.filter_eval_shape(DeepMLP, (4096, 1002, 4096), key=jax.random.key(0))
    plan = rc.sharding_plan(big, 4, example_call=lambda m: jax.vmap(m)(jnp.ones((2, 4096))))
    leaves = {leaf.path: leaf for leaf in plan.leaves}
    assert leaves["layers.0.weight"].spec == P(None, "model")  # 1002 outputs: rows instead
    assert "fell back to row" in leaves["layers.0.weight"].reason
    assert leaves["layers.1.weight"].spec == P("model", None)  # its input is whole again


def test_example_call_that_raises_is_a_clear_error() -> None:
    model = MODELS["mlp"]()
    with pytest.raises(ValueError, match="example_call raised TypeError"):
        rc.sharding_plan(model, 2, example_call=lambda m: m(jnp.ones((3,))))


def test_shapes_are_checked_at_the_model_boundary() -> None:
    # The package's models are checked (jaxtyping + beartype over `redcoast`).
    config = rc.models.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=4)
    model = rc.models.GPT2(config, key=jax.random.key(0))
    with pytest.raises(Exception, match=r"(?i)type-check|shape|dimension"):
        model(jnp.zeros((2, SEQ), jnp.int32))  # a batch where one sequence is expected
