"""The one place redcoast reads JAX's private internals (`jax._src`).

Each private name is looked up when first needed, not at import, so a JAX release
that moves one cannot stop `import redcoast`: where redcoast can do without it
(`backends_are_initialized`) it falls back to the public behaviour, and where it
cannot (`coordination_client`) it raises an error naming the missing name.
`PRIVATE_NAMES` lists them all; `tests/test_jax_private.py` checks each against the
installed JAX, so a release that moves one fails that test by name instead of
quietly costing a clear error somewhere else. No model's forward pass reads any.

Jaxpr equations are public objects with unstable params; they are read in
`_jaxpr.py`, not here.
"""

import functools
import importlib
from typing import Any

__all__ = [
    "PRIVATE_NAMES",
    "backends_are_initialized",
    "coordination_client",
    "private",
]

PRIVATE_NAMES: tuple[str, ...] = (
    "jax._src.xla_bridge.backends_are_initialized",
    "jax._src.distributed.global_state",
)
"""Every private JAX name redcoast uses, as `module.attribute`."""


@functools.cache
def private(dotted: str) -> Any | None:
    """The object at `dotted` (one of `PRIVATE_NAMES`), or None when this JAX lacks it.

    Args:
        dotted: `"jax._src.module.attribute"`.

    Returns:
        The object, or None.

    Example:
        >>> private("jax._src.xla_bridge.backends_are_initialized")
        <function backends_are_initialized at ...>
    """
    module, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def _require(dotted: str, needed_for: str) -> Any:
    found = private(dotted)
    if found is None:
        import jax

        raise RuntimeError(
            f"redcoast needs JAX's private {dotted} for {needed_for}, and JAX "
            f"{jax.__version__} does not have it. Install a JAX that redcoast supports "
            "(see its pyproject.toml) or a redcoast that knows this JAX release."
        )
    return found


def backends_are_initialized() -> bool:
    """Whether JAX has created its backends (touched devices) in this process.

    False on a JAX without the private function: the caller's check, which only
    improves an error message, is then skipped.

    Returns:
        Whether the backends exist.
    """
    started = private("jax._src.xla_bridge.backends_are_initialized")
    return bool(started()) if started is not None else False


def coordination_client() -> Any:
    """The client of `jax.distributed`'s coordination service (its key-value store).

    Returns:
        The client, or None before `jax.distributed.initialize`.

    Raises:
        RuntimeError: this JAX keeps its distributed state elsewhere.
    """
    state = _require("jax._src.distributed.global_state", "the multi-process watchdog")
    return state.client
