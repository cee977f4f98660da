"""A stack of layers, built and run one way for every model of the zoo.

A stack is a tuple of layers, or one layer whose arrays carry a leading layer axis
(built with `eqx.filter_vmap`), run under `lax.scan` so that a deep model compiles
one layer instead of all of them; the sharding rules follow the scan and split
every stacked weight on its last two axes. Each layer runs under the model's
rematerialisation policy (under `"attention"`, its attention layers, built with
`recompute_scores`, recompute their scores), and under FSDP its weights are
gathered where it runs, one layer at a time (`redcoast.fsdp`).
"""

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from ..nn import remat
from ..parallel import fsdp

_Layer = TypeVar("_Layer", bound=eqx.Module)

Stack = tuple[Any, ...] | Any
"""Layers: a tuple, or one layer whose arrays carry a leading layer axis (scanned)."""

LayerFn = Callable[
    [Any, Float[Array, "seq hidden"], PyTree], tuple[Float[Array, "seq hidden"], PyTree]
]
"""`(layer, x, per_layer_input) -> (x, per_layer_output)`: runs one layer."""


def make_stack(
    make: Callable[[PRNGKeyArray], _Layer], n_layers: int, *, scan_layers: bool, key: PRNGKeyArray
) -> tuple[_Layer, ...] | _Layer:
    """`n_layers` layers from `make(key)`: a tuple, or one layer with stacked arrays.

    Args:
        make: builds one layer from a key.
        n_layers: how many.
        scan_layers: stack them (run under `lax.scan`, compiled once) instead of a tuple.
        key: split into one key per layer.

    Returns:
        The layers.
    """
    keys = jax.random.split(key, n_layers)
    if scan_layers:
        return eqx.filter_vmap(make)(keys)
    return tuple(make(k) for k in keys)


def _under_policy(fn: Callable[..., Any], policy: str, gathering: bool) -> Callable[..., Any]:
    # While gathering, even "none" recomputes the gathered weights in the backward
    # pass instead of keeping every layer's whole copy.
    if gathering and policy in ("none", "attention"):
        return eqx.filter_checkpoint(fn, policy=fsdp.remat_policy())
    return remat(fn, policy)


def run_stack(
    layers: Stack,
    x: Float[Array, "seq hidden"],
    per_layer: PyTree,
    fn: LayerFn,
    use: PyTree,
    policy: str = "none",
) -> tuple[Float[Array, "seq hidden"], PyTree]:
    """Thread `x` through the layers: `x, out = fn(layer, x, per_layer[i])` for each.

    Args:
        layers: a tuple, or stacked layers (then `lax.scan`).
        x: the hidden states entering the first layer.
        per_layer: one input per layer (a tuple, or stacked arrays for stacked layers),
            or `None`.
        fn: runs one layer.
        use: the layers' part of the model's `fsdp.layouts`: under FSDP each layer's
            weights are gathered where it runs.
        policy: the remat policy each layer runs under (`rc.remat`).

    Returns:
        The last layer's hidden states and the layers' outputs (a tuple, or stacked).
    """
    if not isinstance(layers, tuple):
        params, static = eqx.partition(layers, eqx.is_array)

        def one(p: PyTree, h: Array, extra: PyTree) -> tuple[Array, PyTree]:
            return fn(eqx.combine(fsdp.gather(p, use, stacked=True), static), h, extra)

        run = _under_policy(one, policy, fsdp.gathers(use))

        def body(h: Array, layer: tuple[PyTree, PyTree]) -> tuple[Array, PyTree]:
            return run(layer[0], h, layer[1])

        return jax.lax.scan(body, x, (params, per_layer))
    outs = []
    for i, (layer, specs) in enumerate(zip(layers, use, strict=True)):
        params, static = eqx.partition(layer, eqx.is_array)

        def each(p: PyTree, h: Array, extra: PyTree, static: Any = static, specs: Any = specs):
            return fn(eqx.combine(fsdp.gather(p, specs), static), h, extra)

        run = _under_policy(each, policy, fsdp.gathers(specs))
        x, out = run(params, x, None if per_layer is None else per_layer[i])
        outs.append(out)
    return x, tuple(outs)
