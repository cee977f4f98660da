"""The private JAX names redcoast relies on still exist and mean what they did."""

import jax
import jax.numpy as jnp

from redcoast._jax_private import batched_by_current_vmap


def test_batched_by_current_vmap() -> None:
    seen: list[bool] = []

    def probe(x: jax.Array) -> jax.Array:
        seen.append(batched_by_current_vmap(x))
        return x

    probe(jnp.ones(3))  # no vmap
    jax.vmap(probe)(jnp.ones((2, 3)))  # batched by this vmap
    jax.vmap(lambda k: probe(jnp.ones(3)) * k)(jnp.ones(2))  # not mapped by it
    jax.vmap(lambda x: jax.grad(lambda y: probe(y).sum())(x))(jnp.ones((2, 3)))  # grad inside
    jax.grad(lambda w: jax.vmap(lambda x: probe(x) * w)(jnp.ones((2, 3))).sum())(1.0)
    assert seen == [False, True, False, False, True]
