"""`layers.dense` and `layers.normalise`: the zoo's Linear and norm applications.

`dense` replaces `jax.vmap(linear)` with one `dot_general` over the tokens flattened
into one axis, so that its weight gradient contracts that one axis; `normalise`
replaces `jax.vmap(norm)` with a closed-form gradient. Their values and gradients
must equal the vmapped modules' in every composition, `dense` must be public JAX
alone (no custom rule that a transformation could meet in the wrong order), and the
compiled step must not recompute the residual stream's gradient inside other
fusions (what both are for).
"""

import re

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redcoast as rc
from redcoast.nn._layers import dense, normalise

LIN = eqx.nn.Linear(3, 6, key=jax.random.key(0))
X = jax.random.normal(jax.random.key(1), (4, 5, 3))


def plain(lin: eqx.nn.Linear, s: jax.Array) -> jax.Array:
    return jax.vmap(lin)(s)


COMPOSITIONS = {
    "vmap": lambda f, lin, x: jax.vmap(lambda s: f(lin, s))(x),
    "no vmap": lambda f, lin, x: f(lin, x.reshape(-1, 3)),
    "vmap of vmap": lambda f, lin, x: jax.vmap(jax.vmap(lambda t: f(lin, t[None])[0]))(x),
    "map under vmap": lambda f, lin, x: jax.vmap(lambda s: jax.lax.map(lambda r: f(lin, r), s))(
        x[..., None, :]
    ),
    "remat under vmap": lambda f, lin, x: jax.vmap(jax.checkpoint(lambda s: f(lin, s)))(x),
}


@pytest.mark.parametrize("name", COMPOSITIONS)
def test_values_and_gradients_equal_vmapped_linear(name: str) -> None:
    compose = COMPOSITIONS[name]

    def loss(f, lin, x):
        return jnp.sin(compose(f, lin, x)).sum()

    want = jax.grad(loss, argnums=(1, 2))(plain, LIN, X)
    got = jax.grad(loss, argnums=(1, 2))(dense, LIN, X)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(compose(dense, LIN, X), compose(plain, LIN, X), rtol=1e-6, atol=1e-6)


def test_per_example_gradients_and_vmapped_weights() -> None:
    def per_example(f):
        return jax.vmap(lambda s: jax.grad(lambda lin: jnp.sin(f(lin, s)).sum())(LIN))(X)

    np.testing.assert_allclose(per_example(dense).weight, per_example(plain).weight, atol=1e-6)
    keys = jax.random.split(jax.random.key(2), 4)
    layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 6, key=k))(keys)
    got = eqx.filter_vmap(dense)(layers, X)
    want = eqx.filter_vmap(plain)(layers, X)
    np.testing.assert_allclose(got, want, atol=1e-6)


def matmul(lin: eqx.nn.Linear, x: jax.Array) -> jax.Array:
    """The plain matmul `dense` stands for."""
    return x @ lin.weight.T + lin.bias


def per_example_grads(f, lin: eqx.nn.Linear, x: jax.Array) -> eqx.nn.Linear:
    return jax.vmap(lambda s: jax.grad(lambda m: jnp.sin(f(m, s)).sum())(lin))(x)


def batch_grads(f, lin: eqx.nn.Linear, x: jax.Array) -> eqx.nn.Linear:
    return jax.grad(lambda m: jnp.sin(jax.vmap(lambda s: f(m, s))(x)).sum())(lin)


@pytest.mark.parametrize("order", ["vmap(grad)", "grad(vmap)"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_gradients_equal_the_plain_matmuls_in_either_order(order: str, jit: bool) -> None:
    grads = per_example_grads if order == "vmap(grad)" else batch_grads
    run = (lambda f: eqx.filter_jit(grads)(f, LIN, X)) if jit else (lambda f: grads(f, LIN, X))
    chex.assert_trees_all_close(run(dense), run(matmul), rtol=1e-5, atol=1e-6)
    if order == "vmap(grad)":  # one gradient per example, not the batch's sum
        assert run(dense).weight.shape == (X.shape[0], *LIN.weight.shape)


def test_second_derivatives_equal_the_plain_matmuls() -> None:
    def curvature(f):
        def weight_gradient_norm(x):
            return (batch_grads(f, LIN, x).weight ** 2).sum()

        return jax.grad(weight_gradient_norm)(X)

    np.testing.assert_allclose(curvature(dense), curvature(matmul), rtol=1e-5, atol=1e-5)


def test_dense_is_one_dot_general_over_flattened_tokens() -> None:
    """No custom rule (custom_vjp, custom_vmap) and no private JAX: a `dot_general`
    that JAX's own transformations handle in any order, whose weight gradient
    contracts a single (flattened) token axis."""
    x = X.reshape(2, 2, 5, 3)
    jaxpr = jax.make_jaxpr(jax.grad(lambda m: dense(m, x).sum()))(LIN)
    prims = {e.primitive.name for e in jaxpr.eqns}
    assert not {p for p in prims if p.startswith("custom")}, prims
    contractions = [
        e.params["dimension_numbers"][0] for e in jaxpr.eqns if e.primitive.name == "dot_general"
    ]
    assert len(contractions) == 2, contractions  # the output, and the weight gradient
    assert all(len(lhs) == len(rhs) == 1 for lhs, rhs in contractions), contractions


def test_gradients_keep_each_primals_dtype() -> None:
    """A float32 adapter reading bfloat16 hidden states (LoRA on a frozen bfloat16
    base): the product promotes, each gradient stays in its primal's dtype."""
    x = X.astype(jnp.bfloat16)
    y = dense(LIN, x)
    assert y.dtype == jnp.float32
    gx, glin = jax.grad(lambda x, m: dense(m, x).sum(), argnums=(0, 1))(x, LIN)
    assert gx.dtype == jnp.bfloat16
    assert glin.weight.dtype == jnp.float32


NORMS = {
    "LayerNorm": eqx.nn.LayerNorm(3, eps=1e-3),
    "LayerNorm without weight or bias": eqx.nn.LayerNorm(3, use_weight=False, use_bias=False),
    "RMSNorm": eqx.nn.RMSNorm(3, eps=1e-3, use_bias=False),
    "RMSNorm with bias": eqx.nn.RMSNorm(3),
}


def _perturbed(norm):
    """`norm` with weights away from their initial ones and zeros, so every term counts."""
    params, static = eqx.partition(norm, eqx.is_array)
    leaves, treedef = jax.tree.flatten(params)
    new = [jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate(leaves)]
    return eqx.combine(jax.tree.unflatten(treedef, new), static)


# Every norm under `jax.vmap`, and the LayerNorm in every composition.
CASES = [(kind, "vmap") for kind in NORMS] + [("LayerNorm", n) for n in COMPOSITIONS if n != "vmap"]


@pytest.mark.parametrize(("kind", "name"), CASES)
def test_normalise_values_and_gradients_equal_vmapped_norm(kind: str, name: str) -> None:
    compose = COMPOSITIONS[name]
    norm = _perturbed(NORMS[kind])

    def loss(f, n, x):
        return jnp.sin(compose(f, n, x) * jnp.arange(1.0, 4.0)).sum()

    got = jax.grad(loss, argnums=(1, 2))(normalise, norm, X)
    want = jax.grad(loss, argnums=(1, 2))(plain, norm, X)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        compose(normalise, norm, X), compose(plain, norm, X), rtol=1e-6, atol=1e-6
    )


def test_normalise_keeps_the_input_dtype_and_computes_in_float32() -> None:
    norm = _perturbed(NORMS["LayerNorm"])
    x = (X * 100).astype(jnp.bfloat16)
    got = normalise(norm, x)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got, jax.vmap(jax.vmap(norm))(x))
    grad = jax.grad(lambda n: normalise(n, x).astype(jnp.float32).sum())(norm)
    assert grad.weight.dtype == jnp.float32


def test_normalise_rejects_a_norm_of_another_shape() -> None:
    with pytest.raises(ValueError, match=r"shape \(4,\) normalises the last axis.*\(5, 3\)"):
        normalise(eqx.nn.LayerNorm(4), X[0])


@pytest.mark.parametrize("arch", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_backward_does_not_recompute_the_residual_stream(arch: str) -> None:
    """The residual stream's gradient is a sum with a term from every later layer.
    Before `dense` and `normalise`, XLA fused that whole sum into the fusions that
    read it (transposing copies for weight gradients, LayerNorm backward terms) and
    computed it again in each: fusions of 40 to 92 inputs in a 4-layer GPT-2."""
    model = {
        "gpt2": lambda: rc.models.GPT2(
            rc.models.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=4),
            key=jax.random.key(0),
        ),
        "llama": lambda: rc.models.Llama(
            rc.models.LlamaConfig(
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            ),
            key=jax.random.key(0),
        ),
    }[arch]()
    opt = optax.adamw(1e-3)

    def loss_fn(m, batch, key):
        logits = jax.vmap(m)(batch["ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"]).mean()

    step = rc.train_step(loss_fn, opt, jit=False)
    batch = {"ids": jnp.zeros((8, 64), jnp.int32)}
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    hlo = jax.jit(step).lower(model, opt_state, batch, jax.random.key(0)).compile().as_text()
    fusions = re.finditer(r"%(\S+) = (\S+) fusion\((.*?)\), kind=", hlo)
    # Scalar outputs are the step's reductions over every gradient (norm, finite check).
    fan_in = sorted(m.group(3).count("%") for m in fusions if not m.group(2).startswith("f32[]"))
    assert len(fan_in) > 100, "few fusions found: the HLO text format changed"
    assert fan_in[-1] < 20, fan_in[-6:]
