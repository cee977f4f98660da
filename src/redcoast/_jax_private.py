"""The one place redcoast reads JAX's private internals (`jax._src`).

`tests/test_jax_private.py` checks each name here against the installed JAX, so a
JAX release that moves one fails that test by name instead of failing elsewhere.
"""

from typing import Any

from jax._src import core as _core
from jax._src.interpreters import batching as _batching


def batched_by_current_vmap(x: Any) -> bool:
    """Whether `x` is being batched by the innermost transformation, a `jax.vmap`.

    True inside `jax.vmap(f)` for an `x` that carries the mapped axis; False outside
    any vmap, for values the vmap does not map, and inside a transformation nested
    within the vmap (e.g. `jax.grad` under `jax.vmap`), where `x` belongs to that
    inner transformation.

    Args:
        x: any value.

    Returns:
        Whether a primitive applied to `x` now is batched by the current vmap.

    Example:
        >>> jax.vmap(lambda x: batched_by_current_vmap(x) or x)(jnp.ones((2, 3)))
    """
    trace = _core.trace_ctx.trace
    return (
        isinstance(trace, _batching.BatchTrace)
        and isinstance(x, _batching.BatchTracer)
        and x._trace is trace
    )
