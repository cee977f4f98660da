"""The programs an RL step runs beside its train step, compiled on abstract shapes.

Each step of `rc.rl.train` first samples `num_generations` completions of every
prompt with `rc.sampling.sample` on the model being trained, placed as the step has
it; with a KL penalty (`beta > 0`) it then computes the reference's log-probabilities
of those rows (`rc.rl.token_logps` under `rc.predict_step`, the rollout's own
function: the model with its LoRA adapters off, or a frozen copy of it); the train
step (`_step.py`) trains on them. `measure_rl` traces both programs on
`jax.ShapeDtypeStruct`s, so no weight is made, compiles them for the layout's devices,
and reads each one's memory and cost as the train step's are read. Each program's
peak adds what the run holds beside it and is not its argument: the optimizer state
while sampling, and the frozen reference copy in every program.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .._checks import check_choice, check_positive
from ..parallel import _jaxpr
from ..parallel._parallelism import Parallelism
from ..parallel.mesh import DATA, make_mesh
from ..train.throughput import matmul_flops
from ._report import RL, RL_ALGORITHMS, Layout, LoRA, RLStep
from ._step import Measured, PlannedModel, compile_traced, grpo, local_bytes, placed_params
from ._targets import Target, decode_estimate, estimate

__all__ = ["check_rl", "check_sampling", "measure_rl", "rl_settings"]

# What `rc.sampling.sample` needs of a model beyond its call (`rc.sampling.CausalLM`).
_CACHED = ("vocab_size", "max_positions", "init_cache", "decode")


def rl_settings(
    rl: str | None,
    num_generations: int | None,
    max_new_tokens: int | None,
    beta: float | None,
    reference_dtype: str | None,
) -> RL | None:
    """`memory_plan`'s RL options as an `RL`, each checked; None without `rl`."""
    if rl is None:
        given = {"num_generations": num_generations, "max_new_tokens": max_new_tokens, "beta": beta}
        named = [name for name, value in given.items() if value is not None]
        if named:
            raise ValueError(
                f"{', '.join(named)} set an RL step, which rl= asks to plan: pass rl='grpo' "
                "(redcoast plan --rl grpo)."
            )
        return None
    check_choice("rl", rl, RL_ALGORITHMS, "rc.rl.train's GRPO is planned.")
    defaults = RL()
    settings = RL(
        rl,
        defaults.num_generations if num_generations is None else num_generations,
        defaults.max_new_tokens if max_new_tokens is None else max_new_tokens,
        defaults.beta if beta is None else beta,
    )
    check_positive("num_generations", settings.num_generations, optional=False)
    check_positive("max_new_tokens", settings.max_new_tokens, optional=False)
    if isinstance(settings.beta, bool) or not isinstance(settings.beta, int | float):
        raise ValueError(f"beta must be a number >= 0 (the KL penalty's weight), got {beta!r}.")
    if not settings.beta >= 0:
        raise ValueError(f"beta must be >= 0 (the KL penalty's weight; 0: none), got {beta!r}.")
    copy = reference_dtype if settings.beta > 0 else None
    return dataclasses.replace(settings, beta=float(settings.beta), reference_dtype=copy)


def check_rl(layout: Layout, rl: RL, model: PlannedModel) -> None:
    """An RL step is planned as `rc.rl.train` runs it: on a model `rc.sampling` samples,
    with whole rows on each device."""
    if layout.preference is not None:
        raise ValueError(
            f"plan preference tuning ({layout.preference}) or an RL step, not both: "
            "preference= or rl=."
        )
    if layout.context_parallel:
        raise ValueError(
            "an RL step samples and trains on whole rows on each device; plan it without "
            "context_parallel (remat or sequence_parallel keep long rows small)."
        )
    check_sampling(model)
    positions, new = model.positions, rl.max_new_tokens
    if positions is not None and layout.seq_len + new > positions:
        raise ValueError(
            f"an RL step's rows are the prompt and its completion: {layout.seq_len} + {new} "
            f"tokens, longer than the model's {positions} positions; plan shorter prompts "
            "(seq_len) or fewer max_new_tokens."
        )


def measure_rl(
    model: PlannedModel,
    layout: Layout,
    lora: LoRA | None,
    devices: list[Any] | None,
    *,
    target: Target,
    train: Measured,
) -> RLStep:
    """Compile the sampler of an RL step (and the reference's pass) and measure them.

    Args:
        model: what is planned.
        layout: the layout, with its `rl` settings.
        lora: LoRA's settings, or None.
        devices: the devices to compile for (a TPU topology's); default this
            process's first `layout.devices`.
        target: the hardware, for the time estimates.
        train: the train step's measurement (its optimizer state is held while
            sampling; its peak is the train step's).

    """
    rl = layout.rl
    assert rl is not None, "measure_rl plans an RL layout"
    start = time.perf_counter()
    devices = list(jax.devices()[: layout.devices] if devices is None else devices)
    mesh = make_mesh(layout.n_model_shards, devices=devices)
    params, static, _, _ = placed_params(model, jax.random.key(0), layout, mesh, lora)
    on_cpu = devices[0].platform == "cpu"
    gpu = target.kind == "gpu"
    copy = _reference_copy(params, rl, lora)
    copy_bytes = 0 if copy is None else local_bytes(copy)

    traced, common, cache = _sampler(params, static, layout, mesh)
    sampler = compile_traced(traced, common, start=start, on_cpu=on_cpu, open_loop=True)
    floor = _weights_read(params) + cache
    decode = decode_estimate(
        target,
        devices=layout.devices,
        flops=(sampler.flops - sampler.loop_flops, sampler.loop_flops),
        bytes_per_device=_decode_bytes(sampler, floor, gpu=gpu),
        collective_bytes=(
            sampler.collective_bytes - sampler.loop_collective_bytes,
            sampler.loop_collective_bytes,
        ),
        steps=rl.max_new_tokens - 1,
        tokens=sampler.tokens,
        floor=floor,
    )
    copies = sampler.cpu_copies if gpu else 0
    reference_peak = reference_seconds = None
    refused = sampler.refused
    if rl.beta > 0:
        traced, common = _reference(params if copy is None else copy, static, layout, mesh, lora)
        ref = compile_traced(traced, common, start=time.perf_counter(), on_cpu=on_cpu)
        held = train.opt_state + (0 if copy is None else train.params)
        reference_peak = ref.peak - (ref.cpu_copies if gpu else 0) + held
        refused = refused or ref.refused
        timed = estimate(
            target,
            devices=layout.devices,
            flops=ref.flops,
            bytes_per_device=ref.traffic(gpu=gpu),
            collective_bytes=ref.collective_bytes,
            tokens=ref.tokens,
            n_params=train.n_params,
        )
        reference_seconds = None if timed is None or ref.refused else timed.seconds
    train_copies = train.cpu_copies if gpu else 0
    return RLStep(
        train_peak=train.peak - train_copies + copy_bytes,
        sampling_peak=sampler.peak - copies + train.opt_state + copy_bytes,
        cache=cache,
        reference_peak=reference_peak,
        reference_copy=copy_bytes,
        sampling=None if sampler.refused else decode,
        reference_seconds=reference_seconds,
        compile_seconds=time.perf_counter() - start,
        refused=refused,
    )


def check_sampling(model: PlannedModel) -> None:
    """Raise a `ValueError` saying why, unless `rc.sampling` can sample `model`: a causal
    LM with a cached forward pass (`rc.sampling.CausalLM`)."""
    if model.no_sampling is not None:
        raise ValueError(model.no_sampling)
    abstract = eqx.filter_eval_shape(model.build("none"), jax.random.key(0))
    missing = [name for name in _CACHED if not hasattr(abstract, name)]
    if missing:
        raise ValueError(
            "an RL step samples its completions with rc.sampling, which needs a causal LM "
            f"with a cached forward pass (rc.sampling.CausalLM); {type(abstract).__name__} "
            f"has no {', '.join(missing)}. Plan RL for a decoder."
        )


def _sampler(
    params: PyTree, static: PyTree, layout: Layout, mesh: Mesh
) -> tuple[jax.stages.Traced, dict[str, Any], int]:
    """`rc.sampling.sample` as the rollout calls it, traced on the placed model and a
    batch of prompts; what is known of it before compiling (as `trace_step`'s), and
    the bytes of one device's key/value cache."""
    from .. import sampling

    rl = layout.rl
    assert rl is not None
    algorithm = grpo(rl)
    n_data = layout.devices // layout.n_model_shards
    prompts = layout.per_device_batch_size * n_data
    split = NamedSharding(mesh, P(DATA))
    ids = jax.ShapeDtypeStruct((prompts, layout.seq_len), jnp.int32, sharding=split)
    lengths = jax.ShapeDtypeStruct((prompts,), jnp.int32, sharding=split)
    key = jax.eval_shape(lambda: jax.random.key(0))
    # Read from the placement as `sample` reads it from a placed model (FSDP's gathers);
    # active around the call, so that `sample` finds it on the traced arrays.
    parallelism = Parallelism.of(eqx.combine(params, static))

    def run(p: PyTree, ids: jax.Array, lengths: jax.Array, key: jax.Array) -> Any:
        with parallelism.applied(eqx.combine(p, static)) as (model, _):
            return sampling.sample(
                model, ids, prompt_lengths=lengths, eos_id=0, key=key, **algorithm.sample_options
            )

    traced = jax.jit(run).trace(params, ids, lengths, key)
    rows = prompts * rl.num_generations
    common = _forward_only(params, traced, rows * rl.max_new_tokens, (ids, lengths))
    common["loop_flops"] = _loop_flops(traced.jaxpr)
    return traced, common, _cache_bytes(params, static, layout, rows)


def _cache_bytes(params: PyTree, static: PyTree, layout: Layout, rows: int) -> int:
    """One device's key/value cache: a row's (`init_cache` of the prompt and the new
    tokens) times the rows, split as the sampler splits it: rows over the data axis,
    heads over the model axis."""
    rl = layout.rl
    assert rl is not None
    one = jax.eval_shape(
        lambda p: eqx.combine(p, static).init_cache(layout.seq_len + rl.max_new_tokens), params
    )
    row = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(one))
    return row * rows // layout.devices


def _weights_read(params: PyTree) -> int:
    """Bytes of the weights one device computes with: its shards over the model axis,
    whole over the data axis (FSDP gathers each weight where it is used)."""

    def kept(entry: Any) -> Any:
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        names = tuple(n for n in names if n != DATA)
        return names[0] if len(names) == 1 else names or None

    total = 0
    for x in jax.tree.leaves(params):
        spec = P(*(kept(entry) for entry in x.sharding.spec))
        shape = NamedSharding(x.sharding.mesh, spec).shard_shape(x.shape)
        total += math.prod(shape) * x.dtype.itemsize
    return total


def _decode_bytes(sampler: Measured, floor: int, *, gpu: bool) -> tuple[float, float]:
    """Bytes one device moves (outside the decode loop, in one decode step): the
    compiler's count; for a GPU (the CPU compiler's program is not its), what any
    program must move: in a decode step `floor`, every weight and the cache read
    once, outside it every argument and temporary once."""
    if not gpu:
        return sampler.bytes_accessed - sampler.loop_bytes, sampler.loop_bytes
    return max(sampler.traffic(gpu=True) - floor, 0.0), float(floor)


def _loop_flops(jaxpr: Any) -> float:
    """FLOPs of one run of the bodies of the `while` loops in `jaxpr` and the jaxprs it
    calls (`matmul_flops` counts each body once, not knowing how often it runs)."""
    total = 0.0
    for eqn in (_jaxpr.open_jaxpr(jaxpr) or jaxpr).eqns:
        if _jaxpr.name(eqn) in _jaxpr.WHILE:
            total += matmul_flops(_jaxpr.while_loop(eqn).body)[0]
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if _jaxpr.open_jaxpr(sub) is not None:
                    total += _loop_flops(sub)
    return total


def _reference_copy(params: PyTree, rl: RL, lora: LoRA | None) -> PyTree | None:
    """The frozen copy a full fine-tune's KL penalty reads, placed as the policy in
    `rl.reference_dtype`; None where there is none (no penalty, or LoRA's adapters off)."""
    if rl.beta == 0 or lora is not None or rl.reference_dtype is None:
        return None
    dtype = jnp.dtype(rl.reference_dtype)

    def stored(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        kind = dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        return jax.ShapeDtypeStruct(x.shape, kind, sharding=x.sharding)

    return jax.tree.map(stored, params)


def _reference(
    params: PyTree, static: PyTree, layout: Layout, mesh: Mesh, lora: LoRA | None
) -> tuple[jax.stages.Traced, dict[str, Any]]:
    """The rollout's pass for `ref_logps`, traced: each token's log-probability over
    every row of prompt and completion, under the model with its adapters off (LoRA)
    or the reference copy `params`."""
    from ..rl._rollout import _logps_fn
    from ..train.inference_step import predict_step

    rl = layout.rl
    assert rl is not None
    rows = layout.per_device_batch_size * (layout.devices // layout.n_model_shards)
    rows *= rl.num_generations
    seq = layout.seq_len + rl.max_new_tokens
    ids = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=NamedSharding(mesh, P(DATA)))
    pred = predict_step(
        _logps_fn(grpo(rl).temperature, lora is not None),
        precision=layout.precision,
        parallelism=Parallelism.of(eqx.combine(params, static)),
        jit=False,
    )

    def run(p: PyTree, ids: jax.Array) -> Any:
        return pred(eqx.combine(p, static), {"input_ids": ids}, jax.random.key(0))

    traced = jax.jit(run).trace(params, ids)
    return traced, _forward_only(params, traced, rows * ids.shape[1], ids)


def _forward_only(params: PyTree, traced: Any, tokens: int, batch: Any) -> dict[str, Any]:
    """The figures of a program that trains nothing (the sampler, the reference's pass):
    its parameters' bytes, matmul FLOPs, tokens and batch bytes."""
    return {
        "n_params": 0,
        "params": local_bytes(params),
        "opt_state": 0,
        "gradients": 0,
        "flops": matmul_flops(traced.jaxpr)[0],
        "tokens": tokens,
        "batch": local_bytes(batch),
    }
