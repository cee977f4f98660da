"""`layers.dense`: the zoo's Linear application, its custom gradient and its batching.

`dense` replaces `jax.vmap(linear)` with a matmul whose weight gradient is written
`(x^T g)^T` and which, under `jax.vmap`, computes one weight gradient for the batch.
Its values and gradients must equal `jax.vmap(linear)`'s in every composition, and
the compiled backward pass must not recompute the residual stream's gradient inside
layout copies (what the custom gradient is for).
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redcoast as rc
from redcoast.models.layers import dense

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
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
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


def test_backward_copies_do_not_recompute_the_residual_stream() -> None:
    """Before `dense`, each output projection's weight gradient read the residual
    stream's gradient through a transposing copy into which XLA fused, and so
    recomputed, that gradient's sum over every later layer."""
    config = rc.models.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=4)
    model = rc.models.GPT2(config, key=jax.random.key(0))
    opt = optax.adamw(1e-3)

    def loss_fn(m, batch, key):
        logits = jax.vmap(m)(batch["ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"]).mean()

    step = rc.train_step(loss_fn, opt, jit=False)
    batch = {"ids": jnp.zeros((8, 64), jnp.int32)}
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    hlo = jax.jit(step).lower(model, opt_state, batch, jax.random.key(0)).compile().as_text()
    copies = re.finditer(r"%\S*copy\S*fusion\S* = \S+ fusion\((.*?)\), kind=kLoop", hlo)
    fan_in = [m.group(1).count("%") for m in copies]
    assert fan_in, "no copy fusions found: the HLO text format changed"
    # One wide copy is expected: the token embedding's gradient reads the bottom of
    # the residual stream, where its whole sum is computed once. Before there was
    # one more per output projection (fan-ins 40, 50, 61, 71, 81 and that 92).
    wide = [n for n in fan_in if n >= 20]
    assert len(wide) <= 1, sorted(fan_in)[-6:]
