"""The private JAX names redcoast relies on still exist and mean what they did."""

import subprocess
import sys

import jax
import pytest

from redcoast import _jax_private
from redcoast._jax_private import (
    PRIVATE_NAMES,
    backends_are_initialized,
    coordination_client,
    private,
)


@pytest.mark.parametrize("dotted", PRIVATE_NAMES)
def test_private_name_exists(dotted: str) -> None:
    assert private(dotted) is not None, f"JAX {jax.__version__} has no {dotted}"


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
