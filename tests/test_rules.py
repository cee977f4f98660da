"""Rules beyond the decoder zoo: gates, stacked experts, sizes that do not divide, raw
vectors; and one test per primitive rule of the dataflow interpreter."""

from __future__ import annotations

from collections.abc import Callable

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from architectures import (
    BERT_LAYOUT,
    DIT_LAYOUT,
    ENC_DEC_LAYOUT,
    MOE_EXPERT_PARALLEL,
    RAW_MLP_LAYOUT,
    SCAN_LAYOUT,
    VIT_LAYOUT,
    BertClassifier,
    DiT,
    EncoderDecoder,
    MoELM,
    RawMLP,
    ScanDecoder,
    ViT,
    layout,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

import redcoast as rc
from redcoast._tree_paths import path_str
from redcoast.parallel._dataflow import trace_dataflow

KEY = jax.random.key(0)
IDS = jax.random.randint(jax.random.key(1), (16, 16), 0, 64)
IMAGES = jax.random.normal(jax.random.key(2), (16, 3, 16, 16))
LATENTS = {"img": jax.random.normal(jax.random.key(3), (16, 4, 8, 8)), "t": jnp.arange(16.0)}

ARCHS = {
    "moe": (lambda: MoELM(key=KEY), IDS, MOE_EXPERT_PARALLEL),
    "dit": (lambda: DiT(key=KEY), LATENTS, DIT_LAYOUT),
    "vit": (lambda: ViT(key=KEY), IMAGES, VIT_LAYOUT),
    "bert": (lambda: BertClassifier(key=KEY), IDS, BERT_LAYOUT),
    "enc-dec": (lambda: EncoderDecoder(key=KEY), IDS, ENC_DEC_LAYOUT),
    "scan": (lambda: ScanDecoder(key=KEY), IDS, SCAN_LAYOUT),
    "raw-mlp": (lambda: RawMLP(key=KEY), IMAGES[:, 0, 0, :].repeat(2, axis=-1), RAW_MLP_LAYOUT),
}


def by_path(model: eqx.Module, specs: object) -> dict[str, tuple]:
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))
    spec = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))
    return {
        path_str(p): tuple(s) + (None,) * (a.ndim - len(s))
        for (p, a), s in zip(flat, spec, strict=True)
    }


def differences(model: eqx.Module, got: object, want: object) -> dict[str, tuple]:
    g, w = by_path(model, got), by_path(model, want)
    return {k: (g[k], w[k]) for k in g if g[k] != w[k]}


def plan(model: eqx.Module, x: object, n: int, **kw: object) -> rc.ShardingPlan:
    return rc.sharding_plan(model, n, example_call=lambda m: jax.vmap(m)(x), **kw)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- four classes


@pytest.mark.parametrize("n", [2, 4])
def test_gates_and_modulations_are_replicated_and_do_not_flip_later_layers(n: int) -> None:
    """A router and adaLN modulations only scale or select: Megatron's layout elsewhere."""
    for name in ("moe", "dit"):
        make, x, hand = ARCHS[name]
        model = make()
        got = plan(model, x, n)
        assert not differences(model, got.specs, layout(model, hand)), name
    assert "gate: its output only scales" in str(got)


def test_stacked_experts_take_one_expert_axis() -> None:
    make, x, hand = ARCHS["moe"]
    model = make()
    for n in (2, 4):
        got = plan(model, x, n)
        assert not differences(model, got.specs, layout(model, hand))
        assert "expert-parallel" in str(got)
    # 3 experts do not divide 2 shards: Megatron within experts, on f for both arrays.
    odd = MoELM(experts=3, key=KEY)
    specs = by_path(odd, plan(odd, x, 2).specs)
    assert specs["blocks.0.moe.w_in"] == (None, None, "model")
    assert specs["blocks.0.moe.w_out"] == (None, "model", None)
    assert specs["blocks.0.moe.b_in"] == (None, "model")


class SwiGLUExperts(eqx.Module):
    """Stacked SwiGLU experts spelled `td,edf->tef`, with experts contracted in `down`."""

    router: eqx.nn.Linear
    gate: Array
    up: Array
    down: Array

    def __init__(self, key: PRNGKeyArray, d: int = 16, f: int = 32, e: int = 4):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.router = eqx.nn.Linear(d, e, use_bias=False, key=k1)
        self.gate = jax.random.normal(k2, (e, d, f)) / 4
        self.up = jax.random.normal(k3, (e, d, f)) / 4
        self.down = jax.random.normal(k4, (e, f, d)) / 6

    def __call__(self, x: Float[Array, "seq d"]) -> Float[Array, "seq d"]:
        weights = jax.nn.softmax(jax.vmap(self.router)(x), axis=-1)
        h = jax.nn.silu(jnp.einsum("td,edf->tef", x, self.gate))
        h = h * jnp.einsum("td,edf->tef", x, self.up) * weights[:, :, None]
        return x + jnp.einsum("tef,efd->td", h, self.down)


def test_swiglu_experts_in_another_spelling_are_consistent() -> None:
    model = SwiGLUExperts(KEY)
    x = jnp.ones((8, 5, 16))
    specs = by_path(model, plan(model, x, 4).specs)
    axes = {specs[k].index("model") for k in ("gate", "up", "down")}
    assert axes == {0}, specs  # the expert axis of all three
    assert specs["router.weight"] == (None, None)


class SwitchExperts(eqx.Module):
    """Top-1 routing with a capacity (Switch Transformer): tokens are dispatched into
    `(experts, capacity, d)` slots by einsum and combined back by the router's weight."""

    router: eqx.nn.Linear
    w_in: Array
    w_out: Array

    def __init__(self, key: PRNGKeyArray, d: int = 16, f: int = 32, e: int = 4):
        k1, k2, k3 = jax.random.split(key, 3)
        self.router = eqx.nn.Linear(d, e, use_bias=False, key=k1)
        self.w_in = jax.random.normal(k2, (e, d, f)) / 4
        self.w_out = jax.random.normal(k3, (e, f, d)) / 6

    def __call__(self, x: Float[Array, "seq d"]) -> Float[Array, "seq d"]:
        experts, capacity = self.w_in.shape[0], 4
        probs = jax.nn.softmax(jax.vmap(self.router)(x), axis=-1)
        onehot = jax.nn.one_hot(jnp.argmax(probs, -1), experts)
        slot = ((jnp.cumsum(onehot, 0) - 1) * onehot).sum(-1).astype(jnp.int32)
        dispatch = onehot[:, :, None] * jax.nn.one_hot(slot, capacity)[:, None, :]
        combine = probs.max(-1)[:, None, None] * dispatch
        slots = jnp.einsum("tec,td->ecd", dispatch, x)
        h = jax.nn.relu(jnp.einsum("ecd,edf->ecf", slots, self.w_in))
        y = jnp.einsum("ecf,efd->ecd", h, self.w_out)
        return x + jnp.einsum("tec,ecd->td", combine, y)


def test_switch_experts_with_capacity_are_expert_parallel() -> None:
    model = SwitchExperts(KEY)
    specs = by_path(model, plan(model, jnp.ones((8, 6, 16)), 4).specs)
    assert specs == {
        "router.weight": (None, None),
        "w_in": ("model", None, None),
        "w_out": ("model", None, None),
    }


def test_a_small_head_that_does_not_divide_is_replicated_by_cost() -> None:
    make, x, hand = ARCHS["vit"]
    model = make()
    got = plan(model, x, 4)
    assert not differences(model, got.specs, layout(model, hand))
    text = str(got)
    assert "head.weight: replicated: column split wanted but 10 does not divide 4" in text
    # Where the other dimension saves more than it moves, latency counted, it still
    # wins (and is listed as a note); shapes only, nothing is allocated.
    mlp = eqx.filter_eval_shape(RawMLP, (4096, 1002, 4096), key=KEY)
    leaves = {leaf.path: leaf for leaf in plan(mlp, jnp.ones((2, 4096)), 4).leaves}
    assert leaves["w.0"].spec == P("model", None)
    assert "fell back to row" in leaves["w.0"].reason


def test_raw_biases_split_with_their_dimension() -> None:
    make, x, hand = ARCHS["raw-mlp"]
    model = make()
    for n in (2, 4):
        got = plan(model, x, n)
        assert not differences(model, got.specs, layout(model, hand))
    assert "b.0" in str(got) and "split with its column dimension" in str(got)


class GatedMLP(eqx.Module):
    """`fc(x * sigmoid(gate(x)))`: a full-width gate, not told from a layer by shape."""

    gate: eqx.nn.Linear
    fc: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.gate = eqx.nn.Linear(16, 16, key=k1)
        self.fc = eqx.nn.Linear(16, 16, key=k2)

    def __call__(self, x: Float[Array, " 16"]) -> Float[Array, " 16"]:
        return self.fc(x * jax.nn.sigmoid(self.gate(x)))


def test_an_override_on_a_gate_changes_the_decisions_after_it() -> None:
    model = GatedMLP(KEY)
    x = jnp.ones((4, 16))
    before = by_path(model, plan(model, x, 4).specs)
    assert before["fc.weight"] == (None, "model")  # input comes split from the gate
    after = plan(model, x, 4, overrides={"gate.weight": P()})
    specs = by_path(model, after.specs)
    assert specs["gate.weight"] == (None, None)
    assert specs["fc.weight"] == ("model", None)  # the replicated gate leaves it whole
    assert "override 'gate.weight'" in str(after)


def test_the_plan_lists_fallbacks_and_guesses_at_the_end() -> None:
    make, x, _ = ARCHS["vit"]
    text = str(plan(make(), x, 4))
    notes = [line for line in text.splitlines() if line.startswith("note: ")]
    assert any(line.startswith("note: head.weight:") for line in notes)
    assert any(line.startswith("note: patch.weight:") for line in notes)
    assert text.splitlines()[-len(notes) :] == notes


# ----------------------------------------------------------------------------- numerics


# The mixture of experts here; the other architectures in `nox -s slow`.
@pytest.mark.parametrize(
    "name", [n if n == "moe" else pytest.param(n, marks=pytest.mark.slow) for n in ARCHS]
)
def test_sharded_equals_unsharded(name: str) -> None:
    make, x, _ = ARCHS[name]
    model = make()
    n = 4 if name != "enc-dec" else 2
    specs = plan(model, x, n).specs

    def loss(m: eqx.Module, x: object) -> Array:
        return jnp.mean(jax.vmap(m)(x) ** 2)

    want = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, x)
    mesh = rc.make_mesh(n)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    got = eqx.filter_jit(eqx.filter_value_and_grad(loss))(rc.place(model, mesh, specs=specs), xs)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- primitive rules


def uses(fn: object, model: object) -> dict:
    flow = trace_dataflow(fn, model)  # type: ignore[arg-type]
    return flow.uses


# Inputs are concrete arrays the traced function closes over, as an example batch is.
X8 = jnp.ones((3, 8))


def test_rule_dot_general_reads_contracted_and_produced_axes_in_any_spelling() -> None:
    w = {"a": jnp.ones((8, 16)), "b": jnp.ones((16, 4))}
    got = uses(lambda m: jnp.einsum("td,df->tf", X8, m["a"]) @ m["b"], w)
    assert (got[0].in_axes, got[0].out_axes, got[0].taint) == ((0,), (1,), set())
    assert (got[1].in_axes, got[1].out_axes, got[1].taint) == ((0,), (1,), {0})
    got = uses(lambda m: jnp.einsum("tf,gf->tg", X8 @ m["a"], m["b"].T @ m["a"].T @ m["a"]), w)
    assert list(got) == [0]  # weight times weight is no layer


def test_rule_batch_axes_of_stacked_experts() -> None:
    w = jnp.ones((4, 8, 16))
    got = uses(lambda m: jnp.einsum("etd,edf->etf", jnp.ones((4, 3, 8)), m), w)
    assert (got[0].batch_axes, got[0].in_axes, got[0].out_axes) == ((0,), (1,), (2,))


def test_rule_conv_reads_output_and_input_channels() -> None:
    conv = eqx.nn.Conv2d(3, 8, 2, key=KEY)
    image = jnp.ones((3, 6, 6))
    got = uses(lambda m: m(image), conv)
    assert (got[0].out_axes, got[0].in_axes, got[0].stem) == ((0,), (1,), True)


def test_rule_gather_tells_data_lookups_from_positions() -> None:
    tables = {"tok": jnp.ones((10, 4)), "pos": jnp.ones((6, 4))}
    flow = trace_dataflow(lambda m: m["tok"][jnp.asarray([1, 2])] + m["pos"][jnp.arange(2)], tables)
    assert flow.lookups == {1: {False}, 0: {True}} or flow.lookups == {0: {False}, 1: {True}}
    by_data = {leaf for leaf, how in flow.lookups.items() if True in how}
    assert len(by_data) == 1


def test_rule_reshape_reads_heads() -> None:
    flow = trace_dataflow(lambda w: (X8 @ w).reshape(3, 4, 4), jnp.ones((8, 16)))
    assert flow.heads == {0: 4}


def test_rule_reduction_then_broadcast_makes_a_gate() -> None:
    def call(m: dict[str, Array]) -> Array:
        g = jax.nn.sigmoid(X8 @ m["gate"]).mean()
        return (X8 * g) @ m["fc"]

    flow = trace_dataflow(call, {"fc": jnp.ones((8, 8)), "gate": jnp.ones((8, 1))})
    assert flow.gates == {1} and flow.uses[0].taint == set()


def _custom_vjp(f: Callable[[Array, Array], Array]) -> Callable[[Array, Array], Array]:
    wrapped = jax.custom_vjp(f)
    wrapped.defvjp(lambda x, w: (f(x, w), None), lambda _, g: (g, None))  # only traced
    return wrapped


@pytest.mark.parametrize(
    "kind", ["scan", "cond", "while", "remat", "jit", "custom_jvp", "custom_vjp"]
)
def test_rule_control_flow_and_calls_are_followed(kind: str) -> None:
    def layer(x: Array, w: Array) -> Array:
        return jax.nn.relu(x @ w)

    w = {"a": jnp.ones((8, 8)), "b": jnp.ones((8, 8))}
    x = X8
    wrap = {
        "scan": lambda f: lambda x, w: jax.lax.scan(lambda c, _: (f(c, w), None), x, None, 2)[0],
        "cond": lambda f: lambda x, w: jax.lax.cond(True, f, lambda x, w: x, x, w),
        "while": lambda f: lambda x, w: jax.lax.fori_loop(0, 2, lambda i, c: f(c, w), x),
        "remat": jax.checkpoint,
        "jit": jax.jit,
        "custom_jvp": lambda f: lambda x, w: jax.nn.gelu(f(x, w)),
        "custom_vjp": _custom_vjp,
    }[kind]
    flow = trace_dataflow(lambda m: layer(wrap(layer)(x, m["a"]), m["b"]), w)
    assert flow.order == [0, 1] and flow.uses[1].taint == {0}, kind
    assert not flow.opaque
