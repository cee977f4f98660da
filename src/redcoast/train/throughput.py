"""How fast a run goes: tokens per step, FLOPs per step, and the devices' peak.

`fit` logs `tokens_per_s`, `step_s` and, where the device's peak is known, `mfu`
(model FLOPs utilisation) with every record of `metrics.jsonl`.

Tokens: what `loss_fn` reports as its `tokens` aux (`rc.models.lm_loss` does: the
tokens whose prediction counts), else the ones of the batch's `loss_mask` (or
`attention_mask`), else rows x positions of its first integer array of two or more
axes (token ids); a batch with none of these (images, tables) has no tokens/s.

FLOPs: XLA's `cost_analysis()` of the compiled step, which counts what one device
runs (the partitioned program). XLA counts a loop's body once, whatever its trip
count, so for a step with loops (`scan_layers=True`, gradient accumulation) the
matrix products of each `lax.scan`'s body are counted from the step's jaxpr (times
its length) and their missing iterations added, divided over the devices. The
count includes what remat recomputes. MFU is FLOPs per second per device over the
device's bfloat16 dense peak: `REDCOAST_PEAK_FLOPS` (FLOP/s per device) when set,
else `PEAK_FLOPS` by `device_kind`. A CPU's is not assumed: its vector units, their
number and its clock under load vary too much, and simulated devices share its
cores; without a peak `fit`'s last line says why it shows no MFU (`no_peak_note`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .._checks import positive_env
from ..parallel import _jaxpr

__all__ = [
    "ENV_PEAK",
    "PEAK_FLOPS",
    "matmul_flops",
    "no_peak_note",
    "peak_flops",
    "step_flops",
    "step_tokens",
]

ENV_PEAK = "REDCOAST_PEAK_FLOPS"
"""A device's peak FLOP/s, for accelerators `PEAK_FLOPS` does not know (e.g. `312e12`)."""

PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    # (a pattern of jax.Device.device_kind, bfloat16 dense FLOP/s of one JAX device)
    (r"^TPU v2", 22.5e12),  # a JAX device is one of a chip's two cores
    (r"^TPU v3", 61.5e12),
    (r"^TPU v4", 275e12),
    (r"^TPU v5 ?(lite|e)", 197e12),
    (r"^TPU v5", 459e12),  # v5p
    (r"^TPU v6 ?(lite|e)", 918e12),
    (r"\bH100 PCIe", 756e12),
    (r"\bH100\b", 989e12),
    (r"\bH200\b", 989e12),
    (r"\bA100\b", 312e12),
    (r"\bV100\b", 125e12),
    (r"\bL40S\b", 362e12),
    (r"\bL4\b", 121e12),
)
"""Peaks by `device_kind`, first match wins; from the vendors' data sheets."""


def peak_flops(device: Any) -> float | None:
    """A device's peak FLOP/s: `REDCOAST_PEAK_FLOPS`, else `PEAK_FLOPS`, else None.

    Args:
        device: a `jax.Device`.

    Returns:
        FLOP/s, or None when unknown (every CPU).

    Raises:
        ValueError: `REDCOAST_PEAK_FLOPS` is not a positive number.
    """
    value = positive_env(ENV_PEAK, "a device's peak FLOP/s, e.g. 312e12")
    if value is not None:
        return value
    if getattr(device, "platform", "cpu") == "cpu":
        return None
    kind = str(getattr(device, "device_kind", ""))
    return next((peak for pattern, peak in PEAK_FLOPS if re.search(pattern, kind)), None)


def no_peak_note(device: Any) -> str:
    """Why a run on `device` has no MFU, and how to give its peak.

    Example:
        >>> no_peak_note(jax.devices("cpu")[0])
        "no MFU: a CPU's peak FLOP/s is not assumed (set REDCOAST_PEAK_FLOPS to ..."
    """
    if getattr(device, "platform", "cpu") == "cpu":
        return (
            f"no MFU: a CPU's peak FLOP/s is not assumed (set {ENV_PEAK} to one device's; "
            "a simulated device's is the CPU's over their number)"
        )
    kind = getattr(device, "device_kind", "this")
    return f"no MFU: the peak FLOP/s of a {kind} device is not known (set {ENV_PEAK})"


def step_tokens(
    batch: Any, metrics: Mapping[str, Any], *, micro_batches: int, data_shards: int
) -> jax.Array | None:
    """The tokens one train step learns from (see the module's docstring), traced.

    Args:
        batch: the global batch the step gets.
        metrics: the step's metrics, with `loss_fn`'s aux scalars.
        micro_batches: `accumulate_grad_batches` (aux scalars are their mean).
        data_shards: how many shards the aux scalars were averaged over (the data
            axis under `data_parallel="shard_map"`, else 1).

    Returns:
        A scalar, or None when the batch has nothing to count tokens by.
    """
    if "tokens" in metrics:
        return jnp.asarray(metrics["tokens"], jnp.float32) * (micro_batches * data_shards)
    if isinstance(batch, Mapping):
        for key in ("loss_mask", "attention_mask"):
            if key in batch and jnp.ndim(batch[key]) >= 2:
                return jnp.sum(batch[key] != 0).astype(jnp.float32)
    for x in jax.tree_util.tree_leaves(batch):
        if jnp.ndim(x) >= 2 and jnp.issubdtype(jnp.result_type(x), jnp.integer):
            return jnp.asarray(x.shape[0] * x.shape[1], jnp.float32)
    return None


def _jaxprs(value: Any) -> list[Any]:
    items = value if isinstance(value, tuple | list) else (value,)
    return [j for j in map(_jaxpr.open_jaxpr, items) if j is not None]


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(getattr(atom, "aval", None), "shape", ()))


def _eqn_flops(eqn: Any) -> float:
    """A matrix product's or convolution's FLOPs (2 per multiply-add); 0 for the rest."""
    primitive = _jaxpr.name(eqn)
    out = math.prod(_shape(eqn.outvars[0])) if eqn.outvars else 0
    try:
        if primitive in _jaxpr.DOT_GENERAL:
            (contract, _), _ = _jaxpr.dot_dimensions(eqn)
            lhs = _shape(eqn.invars[0])
            return 2.0 * out * math.prod(lhs[a] for a in contract)
        if primitive == "ragged_dot_general":  # each row meets one group's matrix
            numbers = eqn.params["ragged_dot_dimension_numbers"]
            (contract, _), _ = numbers.dot_dimension_numbers
            lhs = _shape(eqn.invars[0])
            flops = 2.0 * out * math.prod(lhs[a] for a in contract)
            if set(numbers.lhs_ragged_dimensions) & set(contract):  # one output per group
                flops /= max(_shape(eqn.invars[2])[0], 1)
            return flops
        if primitive in _jaxpr.CONV:
            kernel = _shape(eqn.invars[1])
            outputs = kernel[_jaxpr.conv_channels(eqn)[0]]
            return 2.0 * out * math.prod(kernel) / max(outputs, 1)
    except _jaxpr.UnknownLayout:
        return 0.0
    return 0.0


def matmul_flops(jaxpr: Any) -> tuple[float, float]:
    """The FLOPs of a jaxpr's matrix products and convolutions: every iteration of
    each `lax.scan` counted, and each scan's body counted once (as XLA does).

    A `cond` counts its costliest branch; a `while` its body once (its trip count is
    not in the jaxpr); a `shard_map` its body once per device of its mesh; a Pallas
    kernel (`pallas_call`) its body once per point of its grid (blocks a mask lets the
    kernel skip at run time, such as causal attention's, counted as run).

    Args:
        jaxpr: a (closed) jaxpr, e.g. from `jax.make_jaxpr`.

    Returns:
        `(full, once)`.
    """
    jaxpr = _jaxpr.open_jaxpr(jaxpr) or jaxpr
    full = once = 0.0
    for eqn in jaxpr.eqns:
        primitive = _jaxpr.name(eqn)
        if primitive in _jaxpr.COND:
            branches = [matmul_flops(b) for b in _jaxprs(eqn.params.get("branches", ()))]
            full += max((b[0] for b in branches), default=0.0)
            once += max((b[1] for b in branches), default=0.0)
            continue
        inner = [matmul_flops(j) for v in eqn.params.values() for j in _jaxprs(v)]
        sub_full, sub_once = sum(f for f, _ in inner), sum(o for _, o in inner)
        times = 1
        if primitive in _jaxpr.SCAN:
            times = int(eqn.params.get("length", 1))
        elif primitive == "shard_map":
            times = int(getattr(eqn.params.get("mesh"), "size", 1))
        elif primitive == "pallas_call":
            grid = getattr(eqn.params.get("grid_mapping"), "grid", ())
            times = math.prod(g for g in grid if isinstance(g, int))
        flops = _eqn_flops(eqn)
        full += flops + times * sub_full
        once += flops + (sub_once if primitive in _jaxpr.SCAN else times * sub_once)
    return full, once


def step_flops(
    compiled: Any, traced: Callable[[], Any], *, n_devices: int
) -> tuple[float | None, str]:
    """FLOPs one call of a compiled step runs on each device, and how they were counted.

    Args:
        compiled: the `jax.stages.Compiled` step.
        traced: `() -> jaxpr` of the same step, asked for only when the compiled
            program has loops.
        n_devices: the devices the step runs on.

    Returns:
        `(flops, how)`: None when XLA gives no count.
    """
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # some backends have no cost model
        return None, "no cost analysis"
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else None
    flops = float((analysis or {}).get("flops", 0.0))
    if flops <= 0:
        return None, "no cost analysis"
    if not re.search(r"\bwhile\(", compiled.as_text() or ""):
        return flops, "XLA's cost analysis"
    full, once = matmul_flops(traced())
    flops += (full - once) / n_devices
    return flops, "XLA's cost analysis, loops' matrix products counted per iteration"
