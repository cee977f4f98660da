"""What `fit` settles before its first step: the options checked, and the model
placed, its optimizer state made or resumed, and handed over."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import optax
from jaxtyping import PyTree

from .._checks import check_positive
from ..checkpoint._io import fingerprint
from ..checkpoint._run import Checkpointing
from ..parallel._parallelism import Parallelism, SequenceOption
from ..parallel.place import own_copy, place, release, replicate_strays
from ._resume import Run
from ._resume import resume as resume_run
from .evaluate import Evaluation
from .loop import LoopState
from .precision import cast, check_precision, param_dtype
from .trainable import Trainable, frozen_mask, trainable_mask

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
