"""What `fit` settles before its first step: the options checked, the run's mesh and
global batch, its workdir held and claimed, the model placed, its optimizer state made
or resumed and handed over, and the step built."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import equinox as eqx
import jax
import optax
from jax.sharding import Mesh
from jaxtyping import PyTree

from .._checks import check_positive
from ..checkpoint._io import fingerprint
from ..checkpoint._run import Checkpointing
from ..parallel._context_parallel import ContextParallel
from ..parallel._parallelism import ContextOption, Parallelism, SequenceOption
from ..parallel.mesh import make_mesh, mesh_shape
from ..parallel.place import model_mesh, own_copy, place, release, replicate_strays
from ._resume import Run
from ._resume import resume as resume_run
from .data import global_batch_size
from .evaluate import Evaluation
from .logging import STEP_TOKENS, Logger, jsonl_logger
from .loop import LoopState
from .precision import cast, check_precision, param_dtype
from .step import LossFn, train_step
from .throughput import step_tokens
from .trainable import Trainable, frozen_mask, trainable_mask
from .workdir import claim_workdir, hold_workdir

__all__ = ["check_options", "hand_over", "start"]


def check_options(
    n_epochs: int | None,
    max_steps: int | None,
    log_every: int,
    on_nonfinite: str,
    workdir: Any,
    checkpointing: Checkpointing | None,
    *,
    resume: bool,
    overwrite: bool,
    precision: str,
    data_parallel: str,
    fsdp: bool,
) -> None:
    check_precision(precision)
    if data_parallel == "shard_map" and fsdp:
        raise ValueError(
            "data_parallel='shard_map' keeps a whole copy of the model on every device, "
            "and fsdp=True splits it over the data axis: use one or the other."
        )
    if n_epochs is None and max_steps is None:
        raise ValueError("fit needs n_epochs or max_steps (or both) to know when to stop.")
    check_positive("n_epochs", n_epochs)
    check_positive("max_steps", max_steps)
    check_positive("log_every", log_every, optional=False)
    if resume and overwrite:
        raise ValueError(
            "resume=True continues the run in workdir and overwrite=True deletes it; pass one."
        )
    if on_nonfinite not in ("raise", "skip"):
        raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}.")
    if workdir is None:
        for name, value in (
            ("checkpointing", checkpointing),
            ("resume", resume),
            ("overwrite", overwrite),
        ):
            if value:
                raise ValueError(f"{name} needs a workdir to keep checkpoints in; pass workdir=.")


def hand_over(state: LoopState, given: tuple[Any, Any], donate: bool) -> LoopState:
    """The state the step may donate: the caller's own buffers only when handed over.

    Called last before the first step, so that any error before it leaves the
    caller's arrays as they were.
    """
    if donate:
        release(given, keep=(state.model, state.opt_state))
        return state
    return dataclasses.replace(
        state, model=own_copy(state.model, given), opt_state=own_copy(state.opt_state, given)
    )


def start(
    given: tuple[PyTree, PyTree | None],
    optimizer: optax.GradientTransformation,
    run: Run,
    example_call: Callable[[PyTree], Any],
    *,
    fsdp: bool,
    precision: str,
    sequence_parallel: SequenceOption,
    trainable: Trainable,
    evaluation: Evaluation | None,
    resume: bool,
) -> tuple[Run, LoopState, dict[str, Any], PyTree]:
    """The placed model and its optimizer state, resumed (not yet handed over: see
    `hand_over`), with the run's parallelism and trainable part recorded; the history so
    far; the trainable mask."""
    model, opt_state = given
    placed = place(model, run.mesh, example_call=example_call, fsdp=fsdp)
    if precision == "pure-bf16":
        placed = cast(placed, param_dtype(precision))
    parallelism = Parallelism.of(
        placed, sequence_parallel=sequence_parallel, context_parallel=run.context or False
    )
    run = dataclasses.replace(run, parallelism=parallelism)
    mask = trainable_mask(placed, trainable)
    if trainable is not None:
        frozen = fingerprint(eqx.filter(placed, frozen_mask(placed, mask)))
        run = dataclasses.replace(run, trainable=mask, frozen=frozen)
    opt = optimizer.init(eqx.filter(placed, mask)) if opt_state is None else opt_state
    best = None if evaluation is None else evaluation.best()
    state = LoopState(placed, replicate_strays(opt, run.mesh), best=best)
    history: dict[str, Any] = {"train": [], "eval": []}
    if resume:
        state, history = resume_run(run, state)
    return run, state, history, mask


def _run_step(core: Callable[..., Any], count: Callable[..., Any]) -> Callable[..., Any]:
    """The step of a run: `(model, opt_state, batch, key, step)`, the key folded in inside,
    its metrics with the tokens it learnt from (`count(batch, metrics)`, if any)."""

    def step(m: Any, o: Any, b: Any, k: Any, s: Any) -> tuple[Any, Any, dict[str, Any]]:
        m, o, metrics = core(m, o, b, jax.random.fold_in(k, s))
        tokens = count(b, metrics)
        return m, o, metrics if tokens is None else {**metrics, STEP_TOKENS: tokens}

    return step


def run_of(
    model: PyTree,
    mesh: Mesh | None,
    context_parallel: ContextOption,
    workdir: str | os.PathLike[str] | None,
    seed: int,
    per_device_batch_size: int,
    accumulate_grad_batches: int,
) -> Run:
    """The run's mesh (given, the model's, or one device), context, global batch and folder."""
    mesh = mesh or model_mesh(model) or make_mesh(1)
    context = ContextParallel(mesh) if context_parallel is True else context_parallel or None
    size = global_batch_size(
        mesh, per_device_batch_size, accumulate_grad_batches, split_rows=context is None
    )
    root = None if workdir is None else os.fspath(workdir)
    lead = jax.process_index() == 0
    return Run(mesh, size, seed, jax.random.key(seed), root, lead, context=context)


def step_of(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    run: Run,
    mask: Any,
    accumulate_grad_batches: int,
    schedule: Callable[[Any], Any] | None,
    on_nonfinite: str,
    *,
    precision: str,
    data_parallel: Literal["jit", "shard_map"],
    updates_per_batch: int = 1,
) -> Callable[..., Any]:
    """The run's step (`_run_step`) of `train_step` under the run's parallelism, counting
    the tokens of each batch."""
    core = train_step(
        loss_fn,
        optimizer,
        accumulate_grad_batches=accumulate_grad_batches,
        updates_per_batch=updates_per_batch,
        mesh=run.mesh,
        data_parallel=data_parallel,
        schedule=schedule,
        skip_nonfinite=on_nonfinite == "skip",
        precision=precision,
        trainable=mask,
        parallelism=run.parallelism,
        jit=False,
    )
    shards = mesh_shape(run.mesh)[0] if data_parallel == "shard_map" else 1
    count = functools.partial(
        step_tokens, micro_batches=accumulate_grad_batches, data_shards=shards
    )
    return _run_step(core, count)


@contextlib.contextmanager
def held(run: Run, *, overwrite: bool, resume: bool) -> Iterator[Callable[[], None]]:
    """The run's workdir held (its lock) and claimed for the length of the block; yields
    the check that it is still this run's (nothing to check without a workdir)."""
    if run.root is None:
        yield lambda: None
        return
    with hold_workdir(run.root) as still_held:
        claim_workdir(run.root, overwrite=overwrite, lead=run.lead, resume=resume)
        yield still_held


def sinks(root: str | None, loggers: Sequence[Logger]) -> list[Logger]:
    """Where the metrics go: the user's loggers, and `metrics.jsonl` in the workdir."""
    return [*loggers] if root is None else [jsonl_logger(Path(root, "metrics.jsonl")), *loggers]
