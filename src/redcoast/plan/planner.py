"""Will it fit? The real train step, compiled on abstract shapes, measured by XLA.

`memory_plan` builds a model's AdamW train step exactly as `fit` runs it -- the
sharding plan (tensor parallelism, FSDP), the precision and remat policies, the
global batch split over the data axis -- on `jax.ShapeDtypeStruct`s, so nothing
is allocated, compiles it for the requested devices, and reads per-device bytes
from `compiled.memory_analysis()`. A model is planned as a `PlannedModel`: how to
build it, its loss, and its limits; `rc.memory_plan` (in `redcoast.models.planning`)
makes one from a zoo preset or config, and a factory of any model is planned as a
language model. Parameters and optimizer state come from the
shardings (exact); gradients are one copy of the parameters in the master dtype;
temporaries (gradients, activations, workspace) and the peak come from XLA.

Here are the search over layouts and the largest batch; the step itself is built
and compiled in `_step.py`, and what is reported (`MemoryPlan`, `Layout`)
is in `_report.py`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from .._checks import check_choice
from .._units import fmt_bytes as fmt_bytes
from .._units import parse_bytes as parse_bytes
from ..nn._kernels import planned_for
from ..parallel._sharding_plan import ShardingPlan
from ..quant import check_format
from ._report import PRECISIONS as PRECISIONS
from ._report import PREFERENCES as PREFERENCES
from ._report import REMATS as REMATS
from ._report import RL as RL
from ._report import RL_ALGORITHMS as RL_ALGORITHMS
from ._report import Layout as Layout
from ._report import LoRA as LoRA
from ._report import MemoryPlan as MemoryPlan
from ._rl import check_rl, measure_rl, rl_settings
from ._step import PlannedModel as PlannedModel
from ._step import compile_step, plan_specs
from ._step import next_token_loss as next_token_loss
from ._targets import TARGETS as TARGETS
from ._targets import Target, estimate, target_devices, target_named

_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
_DTYPES |= {"fp16": "float16", "float16": "float16"}


def _frozen_dtype(frozen_dtype: Any) -> str:
    """The dtype name frozen weights are stored in: bfloat16 unless asked otherwise."""
    if frozen_dtype is None or isinstance(frozen_dtype, str):
        name = _DTYPES.get((frozen_dtype or "bf16").lower(), "")
    else:
        name = str(jnp.dtype(frozen_dtype).name)
    if name not in _DTYPES.values():
        raise ValueError(
            f"frozen_dtype {frozen_dtype!r}: choose bf16, fp16 or fp32 (or a jnp dtype of those)."
        )
    return name


def _lora_settings(
    rank: int,
    targets: str | tuple[str, ...] | list[str] | None,
    frozen_dtype: Any,
    quantize: str | None = None,
    *,
    reference_copy: bool = False,
) -> LoRA | None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"lora_rank must be an int >= 0 (0: no LoRA), got {rank!r}.")
    if quantize is not None:
        check_format(quantize)
    if rank == 0:
        if (
            targets is not None
            or quantize is not None
            or (frozen_dtype is not None and not reference_copy)
        ):
            raise ValueError(
                "lora_targets, frozen_dtype and quantize need lora_rank > 0: a quantized base "
                "is frozen, and trains only through adapters (without LoRA, frozen_dtype is "
                "the dtype of an RL plan's reference copy, with rl and beta > 0)."
            )
        return None
    if isinstance(targets, str):
        targets = tuple(t.strip() for t in targets.split(",") if t.strip())
    name = _frozen_dtype(frozen_dtype)
    return LoRA(rank, None if targets is None else tuple(targets), name, quantize)


def sharding_plan_of(model: PlannedModel, layout: Layout, lora: LoRA | None = None) -> ShardingPlan:
    """The `ShardingPlan` `memory_plan` uses for `model` under `layout` (with the adapters
    of `lora`, a `MemoryPlan.lora`)."""
    abstract = eqx.filter_eval_shape(model.factory(layout.remat, lora), jax.random.key(0))
    return plan_specs(abstract, layout, model)


# --------------------------------------------------------------------------- planning


def _check_context(layout: Layout, model: PlannedModel) -> None:
    if not layout.context_parallel:
        return
    n_data = layout.devices // layout.n_model_shards
    if n_data < 2:
        raise ValueError(
            "context parallelism splits every sequence over the data axis, and this layout "
            f"has 1 data shard ({layout.devices} devices, {layout.n_model_shards} model "
            "shards); plan it with fewer model shards than devices."
        )
    if layout.seq_len % n_data:
        fitting = -(-layout.seq_len // n_data) * n_data
        raise ValueError(
            f"context parallelism splits every sequence over the {n_data} data shards, and "
            f"seq_len {layout.seq_len} is not a multiple of {n_data}; plan {fitting} tokens."
        )
    if model.no_context_parallel is not None:
        raise ValueError(model.no_context_parallel)


def _check_layout(layout: Layout, model: PlannedModel, *, compiles_here: bool) -> None:
    if layout.preference is not None and layout.preference not in PREFERENCES:
        raise ValueError(f"preference {layout.preference!r}: choose one of {PREFERENCES}.")
    if layout.preference is not None and layout.context_parallel:
        raise ValueError(
            "preference tuning is planned with whole pairs on each device; plan it without "
            "context_parallel (sequence_parallel or remat keep long pairs small)."
        )
    if layout.rl is not None:
        check_rl(layout, layout.rl, model)
    if layout.precision not in PRECISIONS:
        raise ValueError(f"precision {layout.precision!r}: choose one of {PRECISIONS}.")
    if layout.remat not in REMATS:
        raise ValueError(f"remat {layout.remat!r}: choose one of {REMATS}.")
    for name in ("devices", "n_model_shards", "per_device_batch_size", "seq_len"):
        value = getattr(layout, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    if layout.devices % layout.n_model_shards:
        raise ValueError(
            f"{layout.n_model_shards} model shards do not divide {layout.devices} devices."
        )
    _check_context(layout, model)
    if layout.sequence_parallel and layout.n_model_shards < 2:
        raise ValueError(
            "sequence parallelism splits activations over the model axis, and this layout "
            "has 1 model shard; plan it with n_model_shards > 1 (-n/--n-model-shards)."
        )
    heads = model.heads
    if heads is not None and heads % layout.n_model_shards:
        raise ValueError(
            f"{layout.n_model_shards} model shards do not divide the model's {heads} attention "
            f"heads; choose a divisor of {heads}."
        )
    positions = model.positions
    if positions is not None and layout.seq_len > positions:
        raise ValueError(
            f"seq_len {layout.seq_len} is longer than the model's {positions} positions."
        )
    if compiles_here and jax.device_count() < layout.devices:
        raise ValueError(
            f"planning for {layout.devices} devices needs {layout.devices} devices to compile "
            f"for; this process has {jax.device_count()}. Simulate them with "
            f"rc.simulate_devices({layout.devices}) before JAX starts, or run `redcoast "
            "plan`, which does."
        )


@dataclasses.dataclass(frozen=True)
class _Job:
    """What one `memory_plan` call plans: the model, its adapters, the hardware; and
    every layout it has compiled a step for so far, for the report."""

    model: PlannedModel
    lora: LoRA | None
    target: Target
    compiled: list[Layout] = dataclasses.field(default_factory=list)


def _measure(job: _Job, layout: Layout, device_memory: int | None) -> MemoryPlan:
    devices = target_devices(job.target, layout.devices)
    # For a GPU, the CPU compiler's program attends as a GPU would: blockwise where
    # cuDNN's fused attention would run (no score matrix), not by the CPU's einsum.
    with planned_for("gpu" if job.target.kind == "gpu" else None):
        found = compile_step(job.model, layout, job.lora, devices=devices)
        rl_step = None
        if layout.rl is not None:
            rl_step = measure_rl(
                job.model, layout, job.lora, devices, target=job.target, train=found
            )
    job.compiled.append(layout)
    n_trainable = found.n_params
    if job.lora is not None:
        from ..lora._layers import trainable

        make = job.model.factory(layout.remat, job.lora)
        abstract = eqx.filter_eval_shape(make, jax.random.key(0))
        kept = eqx.filter(abstract, trainable(abstract))
        n_trainable = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(kept))
    # A GPU runs bfloat16 matmuls as they are: what XLA:CPU copies to float32 is left out.
    gpu = job.target.kind == "gpu"
    copies = found.cpu_copies if gpu else 0
    moved = found.traffic(gpu=gpu)
    step = (
        None
        if found.refused
        else estimate(
            job.target,
            devices=layout.devices,
            flops=found.flops,
            bytes_per_device=float(moved),
            collective_bytes=found.collective_bytes,
            tokens=found.tokens,
            n_params=found.n_params,
            n_trainable=n_trainable,
        )
    )
    return MemoryPlan(
        job.model.name,
        found.n_params,
        layout,
        found.params,
        found.opt_state,
        found.gradients,
        found.temporaries - copies,
        found.peak - copies if rl_step is None else rl_step.peak,
        device_memory,
        compile_seconds=found.seconds + (0.0 if rl_step is None else rl_step.compile_seconds),
        seconds=found.seconds,
        lora=job.lora,
        n_trainable=n_trainable,
        target=job.target.name,
        cpu_copies=copies,
        estimate=step,
        refused=found.refused,
        rl_step=rl_step,
    )


def _max_batch(job: _Job, first: MemoryPlan, budget: int) -> int | None:
    """The largest per-device batch whose peak fits: linear in the batch, then checked."""
    b = first.layout.per_device_batch_size
    if first.peak > budget:
        return None
    second = _measure(job, dataclasses.replace(first.layout, per_device_batch_size=2 * b), None)
    slope = (second.peak - first.peak) / b
    if slope <= 0:
        return None
    guess = b + int((budget - first.peak) // slope)
    for _ in range(4):
        if guess <= b:
            return b
        layout = dataclasses.replace(first.layout, per_device_batch_size=guess)
        peak = _measure(job, layout, None).peak
        if peak <= budget:
            return guess
        guess = b + int((guess - b) * budget / peak) - 1
    return b


def _longest_seq(job: _Job, first: MemoryPlan, budget: int) -> int | None:
    """The longest sequence whose peak fits: doubling, then halving the gap to 128 tokens.

    Stops at the model's positions (an RL step's prompts, at them less the completion),
    or at 32 times the planned length.
    """
    if first.peak > budget:
        return None
    cap = job.model.positions or 32 * first.layout.seq_len
    if job.model.positions is not None and first.layout.rl is not None:
        cap -= first.layout.rl.max_new_tokens

    def fits(seq: int) -> bool:
        layout = dataclasses.replace(first.layout, seq_len=seq)
        return _measure(job, layout, None).peak <= budget

    fit, fail = first.layout.seq_len, None
    while fail is None and fit < cap:
        trial = min(2 * fit, cap)
        fit, fail = (trial, None) if fits(trial) else (fit, trial)
    while fail is not None and fail - fit > 128:
        mid = fit + (fail - fit) // 2 // 128 * 128
        if mid == fit:
            break
        fit, fail = (mid, fail) if fits(mid) else (fit, mid)
    return fit


RANKINGS = ("memory", "time")
"""What a search ranks the layouts that fit by (`memory_plan`'s `rank_by`)."""


def _tokens_per_second(plan: MemoryPlan) -> float:
    """The train step's estimated tokens per second; an RL step's, its rows' tokens over
    the time of all its programs."""
    if plan.estimate is None:
        return 0.0
    if plan.rl_step is None:
        return plan.estimate.tokens_per_second
    seconds = plan.rl_seconds
    if seconds is None:
        return 0.0
    return plan.estimate.tokens_per_second * plan.estimate.seconds / seconds


def _candidates(layout: Layout, model: PlannedModel) -> Iterator[Layout]:
    """Layouts cheapest first: no remat before attention's before dots before full;
    within each, layouts without sequence parallelism before those with it; fewer
    model shards first (tensor parallelism moves activations in every layer); without
    FSDP before with. Asked for context parallelism, every layout without it comes
    first: it makes the step's batch `n_data` times smaller."""
    heads = model.heads
    shards = [
        t
        for t in range(1, min(layout.devices, 8) + 1)
        if layout.devices % t == 0 and (heads is None or heads % t == 0)
    ]
    for cp in (False, True) if layout.context_parallel else (False,):
        for remat in REMATS:
            for sp in (False, True):
                for t in shards:
                    for split in (False, True):
                        candidate = dataclasses.replace(
                            layout,
                            n_model_shards=t,
                            fsdp=split,
                            remat=remat,
                            sequence_parallel=sp,
                            context_parallel=cp,
                        )
                        if (t > 1 or not sp) and (not cp or _splits(candidate)):
                            yield candidate


def _splits(layout: Layout) -> bool:
    """Context parallelism has a data axis to split the sequence over, evenly."""
    n_data = layout.devices // layout.n_model_shards
    return n_data > 1 and layout.seq_len % n_data == 0


def _floor(n_params: int, layout: Layout, lora: LoRA | None = None) -> float:
    """Parameters + AdamW state + gradients per device if perfectly divided (with LoRA,
    the frozen parameters alone)."""
    master = 2 if layout.precision == "pure-bf16" else 4
    if lora is not None:
        # A quantized base stores its projections in half a byte (NF4) or one (int8).
        stored = {"nf4": 0.5, "int8": 1.0}.get(lora.quantize or "")
        master = (stored or jnp.dtype(lora.frozen_dtype).itemsize) / 4
    ways = layout.devices if layout.fsdp else layout.n_model_shards
    return n_params * (4 * master) / ways


def memory_plan(
    model: PlannedModel | Callable[[PRNGKeyArray], Any],
    *,
    devices: int | None = None,
    target: str = "cpu",
    n_model_shards: int = 1,
    fsdp: bool = False,
    seq_len: int = 1024,
    per_device_batch_size: int = 1,
    precision: str = "fp32",
    remat: str = "none",
    sequence_parallel: bool = False,
    context_parallel: bool = False,
    preference: str | None = None,
    rl: str | None = None,
    num_generations: int | None = None,
    max_new_tokens: int | None = None,
    beta: float | None = None,
    device_memory: int | str | None = None,
    search: bool = False,
    rank_by: str = "memory",
    max_batch: bool = True,
    longest_seq: bool = False,
    lora_rank: int = 0,
    lora_targets: str | list[str] | tuple[str, ...] | None = None,
    frozen_dtype: Any = None,
    quantize: str | None = None,
) -> MemoryPlan:
    """Compile the AdamW train step for `devices` devices on abstract shapes and measure it.

    Args:
        model: a `PlannedModel`, or a factory `key -> causal LM` (one sequence of
            token ids in, logits out; it then decides its own remat). `rc.memory_plan`
            also takes a zoo preset name (`"llama-7b"`), a `config.json` path (or
            its folder) or a zoo config (`redcoast.models.planning`).
        devices: how many devices; this process must have that many (simulate them
            on a CPU with `jax_num_cpu_devices`; `redcoast plan` does).
        n_model_shards: the model axis size (tensor parallelism).
        fsdp: split weights, gradients and optimizer state over the data axis too.
        seq_len: tokens per sequence.
        per_device_batch_size: sequences per data-parallel device.
        precision: `"fp32"`, `"bf16"` or `"pure-bf16"`.
        remat: `"none"`, `"attention"`, `"dots"` or `"full"` (zoo models; `rc.remat`).
        sequence_parallel: split the activations between tensor-parallel regions
            over the model axis too (`rc.SequenceParallel`); needs n_model_shards > 1.
        context_parallel: split every sequence over the data axis instead of the
            rows (`rc.ContextParallel`, the decoders): `per_device_batch_size` rows
            reach every device, `1 / n_data` of each; `search` tries it after every
            layout without it.
        preference: `"dpo"`, `"simpo"` or `"orpo"`: plan preference tuning
            (`rc.preference`) on `per_device_batch_size` pairs per device, both
            answers of `seq_len` tokens; DPO's reference is the model with its
            adapters off under LoRA, else log-probabilities precomputed beside the rows.
        rl: `"grpo"`: plan a step of `rc.rl.train` with `rc.rl.GRPO`'s settings (TRL's
            defaults but these): `per_device_batch_size` prompts of `seq_len` tokens a
            device. Its programs are compiled one by one: the sampler
            (`rc.sampling.sample` on the model as the step places it, every prompt's
            `num_generations` completions with a key/value cache of the prompt and
            `max_new_tokens`), with `beta > 0` the reference's log-probabilities (a
            forward pass over the rows), and the train step (`rc.rl.policy_loss` on
            `per_device_batch_size x num_generations` rows of `seq_len +
            max_new_tokens` tokens). The peak is the largest of theirs, the time
            estimate their sum (`RLStep`); the optimizer state is held while
            sampling.
        num_generations: with `rl`, completions of each prompt (default 8).
        max_new_tokens: with `rl`, the longest completion (default 256).
        beta: with `rl`, the KL penalty's weight (default 0, TRL's). Above 0, the
            reference is the model with its adapters off under LoRA, else a frozen
            copy of the model on every device, stored in `frozen_dtype` (bfloat16 by
            default: pass `rc.rl.train` a reference of that dtype, as its
            `reference="copy"` copies the model in its own).
        device_memory: memory per device to judge fit: a string with its unit
            (`"32GB"`, `"40GiB"`; a bare `"40"` is refused) or an int of bytes.
        search: find the cheapest layout that fits `device_memory` instead (see
            `_candidates` for the order); the given layout is the first tried.
        rank_by: what `search` returns: `"memory"`, the first layout in that order
            that fits; `"time"`, of every layout that fits, the one with the most
            tokens per second by the step-time estimate (`StepEstimate`, a roofline:
            it compiles every layout whose weights could fit, so it takes longer).
        max_batch: with `device_memory`, also find the largest per-device batch that
            fits (two or three more compiles).
        longest_seq: with `device_memory`, also find the longest sequence that fits
            at the planned batch, up to the model's positions (a compile per probe:
            doubling, then halving the gap to 128 tokens).
        lora_rank: above 0, plan LoRA fine-tuning: `rc.lora.apply` with this rank,
            and a step with `trainable=rc.lora.trainable(model)`, so frozen weights
            get no gradient and no optimizer state.
        lora_targets: globs (or one comma-separated string) over the Linears' paths
            to adapt; by default every Linear but the output head, i.e. each
            block's attention and MLP projections (see `LoRA`).
        frozen_dtype: the dtype of frozen weights with LoRA, `"bf16"` (the default),
            `"fp16"` or `"fp32"`; without LoRA, of an RL plan's reference copy.
        quantize: with LoRA, `"nf4"` (QLoRA) or `"int8"`: every Linear but the head
            quantized (`rc.quantize`), decoded in `frozen_dtype` inside the step.

    Returns:
        A `MemoryPlan`; `str()` is a readable report, `.to_dict()` JSON.

    Raises:
        ValueError: an unknown model, or a layout that cannot work (shards that do
            not divide the devices or the heads, too few devices, bad names); the
            message says which and what would.

    Example:
        >>> print(rc.memory_plan("llama-7b", devices=4, n_model_shards=4, seq_len=1024,
        ...               remat="full", device_memory="40GB"))
    """
    started = time.perf_counter()
    hardware = target_named(target)
    devices = hardware.devices if devices is None else devices
    if devices is None:
        raise ValueError(f"say how many devices to plan for: devices= (--devices) for {target}.")
    if device_memory is None and hardware.memory is not None:
        device_memory = hardware.memory
    budget = None if device_memory is None else parse_bytes(device_memory)
    copies = rl is not None and bool(beta)  # a full fine-tune's KL penalty: a reference copy
    lora = _lora_settings(lora_rank, lora_targets, frozen_dtype, quantize, reference_copy=copies)
    reference = _frozen_dtype(frozen_dtype) if copies and lora is None else None
    layout = Layout(devices, n_model_shards, fsdp, precision, remat, per_device_batch_size, seq_len)
    layout = dataclasses.replace(
        layout,
        sequence_parallel=sequence_parallel,
        context_parallel=context_parallel,
        preference=preference,
        rl=rl_settings(rl, num_generations, max_new_tokens, beta, reference),
    )
    if not isinstance(model, PlannedModel):
        if not callable(model):
            raise TypeError(
                f"model must be a PlannedModel or a factory key -> model, got "
                f"{type(model).__name__}; rc.memory_plan takes zoo presets and configs too."
            )
        if remat != "none" or search:
            raise ValueError(
                "a model factory decides its own remat; pass a preset or config to plan "
                "remat or to search layouts."
            )
        model = PlannedModel.of_factory(model)
    job = _Job(model, lora, hardware)
    _check_layout(layout, model, compiles_here=hardware.kind != "tpu")
    check_choice("rank_by", rank_by, RANKINGS)
    if rank_by != "memory" and not search:
        raise ValueError(
            f"rank_by={rank_by!r} ranks the layouts a search tries: pass search=True "
            "(redcoast plan --search)."
        )
    if search:
        if budget is None:
            raise ValueError("search needs device_memory, the budget a layout must fit in.")
        result = _search(job, layout, budget, by_time=rank_by == "time")
    else:
        result = _measure(job, layout, budget)
    layouts = len(job.compiled)
    if max_batch and budget is not None and result.fits:
        result = dataclasses.replace(result, max_batch=_max_batch(job, result, budget))
    batches = len(job.compiled) - layouts
    if longest_seq and budget is not None and result.fits:
        result = dataclasses.replace(result, max_seq_len=_longest_seq(job, result, budget))
    lengths = len(job.compiled) - layouts - batches
    return dataclasses.replace(
        result, compiles=(layouts, batches, lengths), seconds=time.perf_counter() - started
    )


def _search(job: _Job, layout: Layout, budget: int, *, by_time: bool = False) -> MemoryPlan:
    """The first layout of `_candidates` that fits; `by_time`, of all that fit, the one
    with the most estimated tokens per second (the earliest among equals)."""
    tried: list[tuple[str, int | None]] = []
    fitting: list[MemoryPlan] = []
    abstract = eqx.filter_eval_shape(job.model.build("none"), jax.random.key(0))
    arrays = eqx.filter(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    n_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(arrays))
    last: MemoryPlan | None = None
    for candidate in _candidates(layout, job.model):
        if _floor(n_params, candidate, job.lora) > budget:
            tried.append((str(candidate), None))
            continue
        last = _measure(job, candidate, budget)
        if last.fits and not by_time:
            return dataclasses.replace(last, tried=tuple(tried))
        if last.fits:
            fitting.append(last)
        tried.append((str(candidate), last.peak))
    if fitting:
        best = max(fitting, key=_tokens_per_second)  # max keeps the first of equals
        tried = [t for t in tried if t[0] != str(best.layout)]
        return dataclasses.replace(best, tried=tuple(tried))
    if last is None:
        # Arithmetic ruled out every layout; compile the most frugal one to show by how much.
        frugal = list(_candidates(layout, job.model))[-1]
        tried.pop()
        last = _measure(job, frugal, budget)
    return dataclasses.replace(last, tried=tuple(tried))
