"""The one place redcoast reads JAX's private internals (`jax._src`).

Each private name is looked up when first needed, not at import, so a JAX release
that moves one cannot stop `import redcoast`: where redcoast can do without it
(`batched_by_current_vmap`, `backends_are_initialized`) it falls back to the
public behaviour, and where it cannot (`coordination_client`) it raises an error
naming the missing name. `PRIVATE_NAMES` lists them all; `tests/test_jax_private.py`
checks each against the installed JAX, so a release that moves one fails that test
by name instead of quietly costing speed or a clear error somewhere else.

Jaxpr equations are public objects with unstable params; they are read in
`_jaxpr.py`, not here.
"""

import functools
import importlib
from typing import Any

__all__ = [
    "PRIVATE_NAMES",
    "backends_are_initialized",
    "batched_by_current_vmap",
    "coordination_client",
    "private",
]

PRIVATE_NAMES: tuple[str, ...] = (
    "jax._src.core.trace_ctx",
    "jax._src.interpreters.batching.BatchTrace",
    "jax._src.interpreters.batching.BatchTracer",
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


def batched_by_current_vmap(x: Any) -> bool:
    """Whether `x` is being batched by the innermost transformation, a `jax.vmap`.

    True inside `jax.vmap(f)` for an `x` that carries the mapped axis; False outside
    any vmap, for values the vmap does not map, and inside a transformation nested
    within the vmap (e.g. `jax.grad` under `jax.vmap`), where `x` belongs to that
    inner transformation. False too on a JAX without the private names it reads:
    callers then take their unbatched path, which is always correct.

    Args:
        x: any value.

    Returns:
        Whether a primitive applied to `x` now is batched by the current vmap.

    Example:
        >>> jax.vmap(lambda x: batched_by_current_vmap(x) or x)(jnp.ones((2, 3)))
    """
    trace_ctx = private("jax._src.core.trace_ctx")
    batch_trace = private("jax._src.interpreters.batching.BatchTrace")
    batch_tracer = private("jax._src.interpreters.batching.BatchTracer")
    if trace_ctx is None or batch_trace is None or batch_tracer is None:
        return False
    trace = trace_ctx.trace
    return isinstance(trace, batch_trace) and isinstance(x, batch_tracer) and x._trace is trace


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
