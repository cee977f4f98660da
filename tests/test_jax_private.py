"""The private JAX names redcoast relies on still exist and mean what they did."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from redcoast import _jax_private
from redcoast._jax_private import (
    PRIVATE_NAMES,
    backends_are_initialized,
    batched_by_current_vmap,
    coordination_client,
    private,
)


@pytest.mark.parametrize("dotted", PRIVATE_NAMES)
def test_private_name_exists(dotted: str) -> None:
    assert private(dotted) is not None, f"JAX {jax.__version__} has no {dotted}"


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


def test_backends_are_initialized() -> None:
    # A fresh process: False until something touches a device.
    code = (
        "import jax; from redcoast._jax_private import backends_are_initialized as b; "
        "before = b(); jax.devices(); print(before, b())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["False", "True"]
    jax.devices()
    assert backends_are_initialized() is True


def test_coordination_client() -> None:
    # No jax.distributed.initialize in the test process: the client is not there yet.
    assert coordination_client() is None


def test_a_missing_private_name_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_jax_private, "private", lambda dotted: None)
    with pytest.raises(RuntimeError, match=r"jax\._src\.distributed\.global_state .*watchdog"):
        coordination_client()
    # Where redcoast can do without the name, it takes the public path.
    assert backends_are_initialized() is False
    assert jax.vmap(lambda x: jnp.float32(batched_by_current_vmap(x)))(jnp.ones(2)).sum() == 0
