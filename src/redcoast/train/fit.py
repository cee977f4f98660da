"""`fit`: the three callbacks, a mesh, and a loop of small parts (`predict` is in `evaluate.py`).

`fit` validates its options, places the model, resumes when asked, and hands a
`LoopState` to `run_loop` with its behaviours as hooks: the metrics buffer (one
device-to-host transfer per logging interval, one step behind the devices),
evaluation, signal stops and checkpoints. A user's hooks run beside them.

Those parts live beside it: each epoch's examples and batches in `_fit_data.py`,
the hooks in `_fit_hooks.py` (evaluation in `_evaluator.py`, signal stops in
`_signals.py`), what a checkpoint records of the loop and resuming from it in
`_resume.py`, the workdir's claim and lock in `workdir.py`, and `Checkpointing`
with the run's checkpoint folder in `checkpoint/_run.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, cast

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import PyTree

from .._progress import compiling, counted, elapsed
from ..checkpoint._io import step_checkpoint_path
from ..checkpoint._run import Checkpointing as Checkpointing
from ..parallel._parallelism import ContextOption, SequenceOption, check_options
from ._evaluator import evaluator as _evaluator
from ._fit_data import epochs as _epochs
from ._fit_data import total_steps as _total_steps
from ._fit_hooks import fit_hooks as _hooks
from ._fit_setup import check_options as _check_options
from ._fit_setup import hand_over as _hand_over
from ._fit_setup import held, run_of, sinks, step_of
from ._fit_setup import start as _start
from ._resume import Run as _Run
from ._signals import stop_requests as _stop_requests
from .data import Batch, CollateFn, Examples, global_batch_size
from .evaluate import Evaluation
from .logging import (
    Logger,
    MetricsBuffer,
    ProgressBar,
    close_loggers,
    describe_speed,
    median_speed,
)
from .loop import Hook, LoopState, always, run_loop
from .rollout import Rollout
from .step import LossFn, donating_jit
from .throughput import no_peak_note, peak_flops, step_flops
from .trainable import Trainable

# The rollout's keys are `fold_in(fold_in(key(seed), ROLLOUT_STREAM), step)`.
ROLLOUT_STREAM = 0x5EED


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What `fit` returns.

    Attributes:
        model: the trained model, sharded on the mesh.
        opt_state: the optimizer state after the last step.
        step: the number of optimizer steps taken.
        history: `"train"`: the logged training records (`step`, `epoch`, `loss`,
            `grad_norm`, `lr`, `steps_per_s`, `examples_per_s`, `step_s`,
            `tokens_per_s` and `mfu` where known (see `redcoast.train.throughput`),
            aux scalars); `"flops"`: a step's FLOPs per device, how they were
            counted and the peak, where the devices' peak is known;
            `"eval"`: one record per evaluation (`step`, `epoch`, `eval_loss`,
            `eval_<metric>`); `"best"`: `{"metric", "mode", "value", "step"}` with
            `save_best`; `"timing"`: host seconds per step spent collating
            (`data_s`), dispatching the jitted step (`step_call_s`) and in the
            hooks (`other_s`), measured after the first (compiling) step.
        stopped_by: why training stopped before its end (`"SIGTERM"`, `"SIGINT"`,
            or what a hook set), None when it ran to the end.
    """

    model: Any
    opt_state: Any
    step: int
    history: dict[str, Any]
    stopped_by: str | None = None


# ----------------------------------------------------------------------------- fit


def _report_stop(run: _Run, state: LoopState) -> None:
    if state.stop is None or not run.lead:
        return
    saved = "" if run.ckpts is None else f"; saved {step_checkpoint_path(run.ckpts, state.step)}"
    print(
        f"redcoast: stopped after step {state.step} ({state.stop}){saved}. To continue, run "
        "fit again with the same workdir and resume=True (a command's --resume option).",
        file=sys.stderr,
        flush=True,
    )


def _summary(state: LoopState, history: dict[str, Any], seconds: float, device: Any) -> str:
    """One line on how the run ended: steps, time, the last logged metrics, and the
    speed (with why there is no MFU, when there is none)."""
    shown = ("loss", "grad_norm", "lr")
    last = history["train"][-1] if history["train"] else {}
    parts = [f"{k} {last[k]:.4g}" for k in shown if isinstance(last.get(k), float)]
    if history["eval"]:
        evals = history["eval"][-1]
        parts += [f"{k} {v:.4g}" for k, v in evals.items() if k.startswith("eval_")]
    speed = median_speed(history["train"])
    parts += describe_speed(speed)
    if speed and "mfu" not in speed:
        flops = history.get("flops")
        parts.append(no_peak_note(device) if flops is None else f"no MFU: {flops['counted']}")
    metrics = f": {', '.join(parts)}" if parts else ""
    return f"redcoast: {counted(state.step, 'step')} in {elapsed(seconds)}{metrics}"


@dataclasses.dataclass(frozen=True)
class _Loop:
    """How long `fit` runs, what it reports, and what else runs between steps."""

    n_epochs: int | None
    max_steps: int | None
    total: int | None  # steps, for the progress bar; None when unknown
    on_nonfinite: str
    log_every: int
    sinks: list[Logger]
    progress: bool
    hooks: Sequence[Hook]
    checkpointing: Checkpointing
    # Before each checkpoint: raises when the workdir is no longer this run's.
    still_held: Callable[[], None]
    # The evaluation, and `(emit, records) -> evaluate` (`_evaluator` given the rest).
    evaluate: tuple[Evaluation, Callable[..., Callable[[LoopState], Any]]] | None


def _keep_state(err: BaseException, start: LoopState, lead: bool) -> None:
    """Leave the run's last state in `err` (`loop_state`), with a note saying where it is.

    The caller's own arrays may be gone (handed over with `donate=True`, or donated to
    the step); the state the loop reached is what remains of the run.
    """
    state = getattr(err, "loop_state", None)
    if not isinstance(state, LoopState):
        state = start
        err.loop_state = state  # type: ignore[attr-defined]
    arrays = [
        x for x in jax.tree.leaves((state.model, state.opt_state)) if isinstance(x, jax.Array)
    ]
    if any(x.is_deleted() for x in arrays):
        where = (
            f"the model and optimizer state after step {state.step} were donated to the step "
            "that failed and are gone; resume from the newest checkpoint"
        )
    else:
        where = (
            f"the model and optimizer state after step {state.step} are this error's "
            "`loop_state.model` and `loop_state.opt_state`"
        )
    if lead and isinstance(err, Exception):
        err.add_note(f"redcoast: fit stopped by this error; {where}.")


def _evaluation_of(
    run: _Run,
    evaluation: Evaluation | None,
    loss_fn: LossFn | None,
    collate_fn: CollateFn,
    per_device_batch_size: int,
    *,
    precision: str,
) -> tuple[Evaluation, Callable[..., Callable[[LoopState], Any]]] | None:
    """The evaluation and `(emit, records) -> evaluate`, or None without one; no eval loss
    without `loss_fn`."""
    if evaluation is None:
        return None
    per_device = evaluation.per_device_batch_size or per_device_batch_size
    size = global_batch_size(run.mesh, per_device, split_rows=run.context is None)
    make = functools.partial(
        _evaluator, run, evaluation, loss_fn, collate_fn, size, precision=precision
    )
    return evaluation, make


def _hand_over_and_train(
    run: _Run,
    state: LoopState,
    history: dict[str, Any],
    traced: Callable[..., Any],
    first: Batch,
    epoch_batches: Callable[[int, int], tuple[Iterator[Batch], int]],
    loop: _Loop,
    given: tuple[Any, Any],
    donate: bool,
    rollout: Rollout | None,
) -> LoopState:
    """Compile the first step, hand the caller's arrays over, and train.

    The first step is traced and compiled while the caller's arrays are still theirs,
    so a `loss_fn` or shape error leaves them as they were; its first call runs this
    program. With a rollout, `first` is the rollout's `example` of the first batch,
    and each step trains on what the rollout makes of its batch with the step's
    model, its metrics beside the step's. Where the devices' peak is known, the
    compiled program's FLOPs are counted (`throughput.step_flops`) for the records'
    MFU. From the hand-over on, an error carries the run's state (`_keep_state`).
    """
    step = donating_jit(traced)
    args = (state.model, state.opt_state, first.arrays, run.key, np.int32(state.step))
    with compiling("compiling the train step", enabled=loop.progress and run.lead):
        compiled = cast(Any, step).lower(*args).compile()
    peak = peak_flops(run.mesh.devices.flat[0])
    flops = None
    if peak is not None:
        flops, how = step_flops(
            compiled.compiled,
            lambda: eqx.filter_make_jaxpr(traced)(*args)[0],
            n_devices=run.mesh.size,
        )
        history["flops"] = {"per_device_step": flops, "counted": how, "peak": peak}
    state = _hand_over(state, given, donate)

    def step_fn(m: Any, o: Any, b: Any, s: int) -> tuple[Any, Any, dict[str, Any]]:
        if rollout is None:
            return step(m, o, b, run.key, np.int32(s))
        b, made = rollout(m, b, jax.random.fold_in(rollout_key, s))
        m, o, metrics = step(m, o, b, run.key, np.int32(s))
        return m, o, {**metrics, **made}

    # The rollout draws from a stream of its own, beside the steps' `fold_in(key, step)`.
    rollout_key = jax.random.fold_in(run.key, ROLLOUT_STREAM)
    try:
        return _train(
            run,
            state,
            history,
            step_fn,
            epoch_batches,
            loop,
            (flops, peak),
        )
    except BaseException as err:
        _keep_state(err, state, run.lead)
        raise


def _train(
    run: _Run,
    state: LoopState,
    history: dict[str, Any],
    step_fn: Callable[..., Any],
    epoch_batches: Callable[[int, int], tuple[Iterator[Batch], int]],
    loop: _Loop,
    speed: tuple[float | None, float | None] = (None, None),
) -> LoopState:
    """Run the loop with `fit`'s hooks: logging, evaluation, stops, checkpoints, the user's.

    `speed` is a step's FLOPs per device and a device's peak FLOP/s, for MFU. Fills
    `history` ("train", "eval", "timing") and returns the last state.
    """
    bar = ProgressBar(loop.total, enabled=loop.progress and run.lead, completed=state.step)
    with bar, _stop_requests(run.root is not None) as caught:

        def emit(record: dict[str, Any], at: int) -> None:
            if run.lead:
                for sink in loop.sinks:
                    sink(record, at)
            bar.show(record)

        buffer = MetricsBuffer(
            emit=emit,
            examples_per_step=run.size,
            raise_nonfinite=loop.on_nonfinite == "raise",
            step=state.step,
            records=history["train"],
            flops_per_step=speed[0],
            peak_flops=speed[1],
        )
        evaluating = None
        if loop.evaluate is not None:
            evaluation, make = loop.evaluate
            evaluating = (evaluation, make(emit, history["eval"]))
        builtin = _hooks(
            run,
            buffer=buffer,
            log_every=loop.log_every,
            evaluation=evaluating,
            user=loop.hooks,
            caught=caught,
            checkpointing=loop.checkpointing,
            still_held=loop.still_held,
        )
        try:
            state, history["timing"] = run_loop(
                state,
                step_fn=step_fn,
                epoch_batches=epoch_batches,
                # The bar counts a step before the hooks: a record they show is of it.
                hooks=[always(lambda s: bar.advance(s.step)), *builtin],
                n_epochs=loop.n_epochs,
                max_steps=loop.max_steps,
            )
            buffer.flush(state.step)
        finally:
            if run.lead:
                close_loggers(loop.sinks)
    return state


def _finish(
    run: _Run, state: LoopState, history: dict[str, Any], progress: bool, seconds: float
) -> FitResult:
    """The result, after reporting how the run stopped (and a summary line)."""
    _report_stop(run, state)
    if progress and run.lead:
        print(_summary(state, history, seconds, run.mesh.devices.flat[0]), flush=True)
    if state.best is not None and (state.best.value is not None or history["eval"]):
        history["best"] = dataclasses.asdict(state.best)
    return FitResult(state.model, state.opt_state, state.step, history, stopped_by=state.stop)


# The signature names fit's thirty options, grouped as the Args below group them, which
# makes the function long; its body is a sequence of calls to the parts above.
def fit(
    model: PyTree,
    optimizer: optax.GradientTransformation,
    train_examples: Examples | Callable[[int], Examples],
    *,
    collate_fn: CollateFn,
    loss_fn: LossFn,
    per_device_batch_size: int,
    accumulate_grad_batches: int = 1,
    trainable: Trainable = None,
    precision: str = "fp32",
    on_nonfinite: Literal["raise", "skip"] = "raise",
    n_epochs: int | None = None,
    max_steps: int | None = None,
    mesh: Mesh | None = None,
    fsdp: bool = False,
    sequence_parallel: SequenceOption = False,
    context_parallel: ContextOption = False,
    data_parallel: Literal["jit", "shard_map"] = "jit",
    opt_state: PyTree | None = None,
    donate: bool = False,
    seed: int = 0,
    workdir: str | os.PathLike[str] | None = None,
    evaluation: Evaluation | None = None,
    checkpointing: Checkpointing | None = None,
    resume: bool = False,
    overwrite: bool = False,
    log_every: int = 10,
    loggers: Sequence[Logger] = (),
    progress: bool = True,
    schedule: Callable[[Any], Any] | None = None,
    hooks: Sequence[Hook] = (),
    rollout: Rollout | None = None,
) -> FitResult:
    """Train `model` on `train_examples` with data and tensor parallelism over `mesh`.

    Each step takes a global batch of `per_device_batch_size * n_data *
    accumulate_grad_batches` examples. Every process shuffles with `seed` and the
    epoch, collates only its own rows, and the step runs on the global batch
    (`train_step`). Step `s` (counting from 0) uses the key `fold_in(key(seed), s)`.
    A last partial batch of an epoch is dropped.

    The step donates its inputs. By default `fit` never invalidates arrays it was
    given: those of `model` or `opt_state` it would donate as they are are copied
    first, so `model` stays usable after `fit` (for another `fit`, or to evaluate the
    starting point) at the cost of one more copy of the parameters for the run.
    `donate=True` hands them over instead: no copy is made and the arrays given
    are deleted, so the run holds one copy of the model, as `rc.memory_plan` counts.

    A `workdir` belongs to one run. There, `metrics.jsonl` gets the logged records,
    `eval/step_XXXXXXXX.json` each evaluation's metrics and outputs, and `ckpts/`
    the checkpoints: `step_XXXXXXXX` as `checkpointing` says (by default after the
    last step), and `best` for `evaluation.save_best`, which resuming never picks.
    `resume=True` continues step-exactly from the newest complete `step_*`
    checkpoint: same parameters, optimizer state, position in the epoch's data
    order and keys; a checkpoint records its epoch's number of examples and a
    checksum of their order, and resuming on other data is an error. A fresh run in
    a workdir that holds another run's files stops with an error unless
    `overwrite=True`, which deletes them first. With `trainable=`, checkpoints hold
    the trainable arrays and their optimizer state only, plus a fingerprint of the
    frozen arrays (`state.json`'s `loop.frozen`); resuming on another base, or with
    or without a filter unlike the saved run, is an error.

    A workdir is held by one live run: every option is checked first, then, before
    reading anything there, `fit` (on process 0) takes an OS lock on the workdir
    folder (`workdir/.redcoast.lock` names the holder), released when `fit` returns
    or raises, or by the kernel when the process dies. Another `fit` given the
    workdir meanwhile, fresh or resuming, stops at once with `WorkdirInUseError`
    naming the holder's process id and host; a killed run's workdir can be resumed
    at once. A workdir deleted or replaced while the run trains stops it before its
    next checkpoint.

    Nothing is lost when `fit` raises: before its first step nothing of the
    caller's is touched (with `donate=True` too); from then on (a step, a hook, a
    `collate_fn` failing) the error's `loop_state` attribute holds the last state
    the run reached (`.model`, `.opt_state`, `.step`), and a note on the error
    says so.

    Every `log_every` steps a record goes to `workdir/metrics.jsonl`, the `loggers`
    and `history["train"]`: the loss, gradient norm, learning rate and aux scalars of
    the last step, and over the steps since the previous record `steps_per_s`,
    `examples_per_s`, `step_s` and `tokens_per_s`, which counts `loss_fn`'s `tokens`
    aux (`rc.models.lm_loss` returns one: the tokens whose prediction counts), else
    the ones of the batch's `loss_mask` (or `attention_mask`), else rows x length of
    its first integer array of two axes (token ids); a batch without one has no
    tokens/s. Where a device's peak FLOP/s is known (`REDCOAST_PEAK_FLOPS`, or the
    accelerators of `redcoast.train.throughput.PEAK_FLOPS`; never CPUs) records get
    `mfu` too: the compiled step's FLOPs per device (XLA's cost analysis, loops'
    matrix products counted per iteration) per second over that peak.

    With a workdir, SIGTERM and SIGINT (Ctrl-C) stop the run after the current
    step: a checkpoint is saved, the handlers that were there before are restored
    and `FitResult.stopped_by` names the signal. A second signal goes to the
    previous handler at once.

    Args:
        model: an Equinox model, placed on `mesh` by `place` (split by the sharding
            rules, tracing `loss_fn` on the first batch, when the mesh has a model
            axis > 1).
        optimizer: an optax optimizer; wrap it in `optax.inject_hyperparams` to log
            the learning rate (or pass `schedule`).
        train_examples: a sequence, or `epoch -> sequence` (same on every process).
        collate_fn: `(examples: list) -> dict[str, np.ndarray]`.
        loss_fn: `(model, batch, key) -> loss` or `(loss, dict_of_scalars)`.
        per_device_batch_size: rows per data-parallel device per micro-batch.
        accumulate_grad_batches: micro-batches per optimizer step.
        trainable: which arrays train (see `rc.trainable_mask`): `None` for every
            floating-point array, or a pytree of bools, a predicate on leaves, or
            path globs such as `"*.q_proj.*"`; `rc.lora.trainable(model)` selects a
            LoRA model's adapters. Frozen arrays get no gradient, optimizer state or
            update, and come back bit-identical; they may be stored in a lower
            precision than the trainable ones (`rc.cast` them before `fit`).
        precision: `"fp32"`, `"bf16"` (float32 master weights, bfloat16 compute) or
            `"pure-bf16"` (the model is cast to bfloat16 before `optimizer.init`); see
            `train_step`. Evaluation runs in the same precision.
        on_nonfinite: the step checks the loss, the gradient norm and the updated
            parameters. `"raise"` stops with an error naming the first step where
            one was not finite, within `log_every + 1` steps and before any
            checkpoint of it is written; `"skip"` leaves the model and optimizer
            state unchanged on such steps and counts them in `skipped`.
        n_epochs: epochs to run; at least one of `n_epochs` and `max_steps`.
        max_steps: optimizer steps to run (stops mid-epoch if reached).
        mesh: from `make_mesh`; defaults to the model's mesh, else `make_mesh(1)`.
        fsdp: when `fit` places the model, split its weights over the data axis as
            well (ZeRO-3: parameters, gradients and optimizer state divided by every
            device; see `sharding_plan`). A model already on `mesh` (from
            `sharded_init`, say) keeps its layout.
        sequence_parallel: split the activations between tensor-parallel regions
            over the model axis as well (`rc.SequenceParallel`), in training and
            evaluation; needs a mesh with a model axis > 1. `"keep gathered"`
            keeps each gathered input for the backward pass instead of gathering
            it again: fewer model-axis bytes, more memory (`keep_gathered`); an
            `rc.SequenceParallel` gives the split itself.
        context_parallel: split every sequence over the data axis instead of the
            rows (`rc.ContextParallel`, or one of your own for another axis or
            strategy), in training and evaluation: each step's
            `per_device_batch_size * accumulate_grad_batches` rows reach every
            device, which holds `1 / n_data` of each, so a batch smaller than the
            data axis (one long sequence) trains on every device. For causal models
            attending through `rc.nn.attention` (the zoo's decoders); rows must be
            a multiple of `n_data` tokens.
        data_parallel: `"jit"` (XLA partitions the global step; any mesh) or
            `"shard_map"` (an explicit per-device step with the gradients averaged
            over `"data"`; the model is replicated, so the mesh has one model shard
            and `fsdp` is off); see `train_step`.
        opt_state: an optimizer state to continue from; `optimizer.init` otherwise.
        donate: hand `model` (and `opt_state`) over: their arrays are used in place,
            or deleted once placed elsewhere, never copied; use `FitResult.model`
            afterwards. For a model that fills the devices, e.g. from `sharded_init`.
        seed: the one seed for shuffling and the step keys.
        workdir: the run's folder, written by process 0.
        evaluation: what to evaluate on and when (`Evaluation`).
        checkpointing: when to save `step_*` checkpoints (`Checkpointing`); needs a
            workdir, where the default is `Checkpointing()` (after the last step).
        resume: continue from the newest checkpoint in `workdir/ckpts`, if any.
        overwrite: delete another run's checkpoints and logs found in `workdir`.
        log_every: fetch metrics from the devices and log every this many steps (and
            at epoch ends, evaluations and checkpoints).
        loggers: callables `(metrics, step) -> None`, called on process 0.
        progress: on process 0, say how long the train step took to compile, show
            the steps done with the latest metrics and speed (a bar when stdout is a
            terminal, else a line every 30 s, `REDCOAST_PROGRESS_SECONDS`, and at the
            end), then one line: steps, seconds, the last metrics and median speed.
        schedule: `count -> lr`, to log the learning rate.
        hooks: `Hook`s (e.g. `every(n, fn)`) run after the built-in logging and
            evaluation, before checkpointing; a hook may return the state to go on
            with (setting `stop` ends the run after a checkpoint). In a
            multi-process run every process must take the same decisions.
        rollout: an `rc.Rollout` (on-policy RL: `rc.rl.train` passes one): before
            each step, `rollout(model, batch, key)` makes the batch the step trains
            on from the collated one and the step's model (with a key of its own,
            the same on resuming), and `rollout.updates_per_batch` optimizer steps
            train on it; the model is placed and the step compiled on
            `rollout.example(first_batch)`. Evaluation then computes no eval loss
            (a batch of examples is not one `loss_fn` reads), only `pred_fn`'s.

    Returns:
        A `FitResult` with `model`, `opt_state`, `step`, `history` and `stopped_by`.

    Example:
        >>> result = fit(model, optax.adamw(1e-3), train, collate_fn=collate_fn,
        ...              loss_fn=loss_fn, mesh=make_mesh(2), per_device_batch_size=8,
        ...              n_epochs=2, workdir="runs/x", resume=True,
        ...              evaluation=Evaluation(val, pred_fn=pred_fn, metric_fn=metric_fn,
        ...                                    save_best=("accuracy", "max")),
        ...              checkpointing=Checkpointing(every=500, keep_last_n=3))
        >>> result.history["eval"][-1]["eval_accuracy"]
    """
    started = time.perf_counter()
    how: dict[str, Any] = {"precision": precision, "data_parallel": data_parallel}
    options = (n_epochs, max_steps, log_every, on_nonfinite, workdir, checkpointing)
    _check_options(*options, resume=resume, overwrite=overwrite, fsdp=fsdp, **how)
    check_options(sequence_parallel, context_parallel)
    run = run_of(
        model, mesh, context_parallel, workdir, seed, per_device_batch_size, accumulate_grad_batches
    )
    # Every option is checked before the workdir is touched; from here on it is held.
    with held(run, overwrite=overwrite, resume=resume) as still_held:
        first, epoch_batches, run = _epochs(train_examples, collate_fn=collate_fn, run=run)
        if rollout is not None:
            first = dataclasses.replace(first, arrays=rollout.example(first.arrays))
        run, state, history, mask = _start(
            (model, opt_state),
            optimizer,
            run,
            lambda m: loss_fn(m, first.arrays, run.key),
            fsdp=fsdp,
            precision=precision,
            sequence_parallel=sequence_parallel,
            trainable=trainable,
            evaluation=evaluation,
            resume=resume,
        )
        updates = 1 if rollout is None else rollout.updates_per_batch
        step = step_of(
            loss_fn,
            optimizer,
            run,
            mask,
            accumulate_grad_batches,
            schedule,
            on_nonfinite,
            updates_per_batch=updates,
            **how,
        )
        loop = _Loop(
            n_epochs=n_epochs,
            max_steps=max_steps,
            total=_total_steps(train_examples, n_epochs, max_steps, run.size),
            on_nonfinite=on_nonfinite,
            log_every=log_every,
            sinks=sinks(run.root, loggers),
            progress=progress,
            hooks=hooks,
            checkpointing=checkpointing or Checkpointing(),
            still_held=still_held,
            evaluate=_evaluation_of(
                run,
                evaluation,
                loss_fn if rollout is None else None,
                collate_fn,
                per_device_batch_size,
                precision=precision,
            ),
        )
        state = _hand_over_and_train(
            run,
            state,
            history,
            step,
            first,
            epoch_batches,
            loop,
            (model, opt_state),
            donate,
            rollout,
        )
        return _finish(run, state, history, progress, time.perf_counter() - started)
