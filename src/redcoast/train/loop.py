"""The training loop: a small function over a frozen state; every behaviour is a hook.

`run_loop` only feeds batches to the jitted step and advances the counters. After
each step it hands the new `LoopState` to each due `Hook` in order; a hook may
return a new state (evaluation records the best metric, a stop request sets
`stop`). Logging, evaluation, checkpointing and signal handling in `fit` are
hooks like the ones a user adds with `every(n, fn)`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from .._checks import check_positive
from .data import Batch
from .evaluate import BestMetric


@dataclasses.dataclass(frozen=True)
class LoopState:
    """Where training stands after a step.

    Attributes:
        model: the model after the step (on the mesh).
        opt_state: the optimizer state after the step.
        step: optimizer steps taken.
        epoch: the epoch this step belongs to (from 0).
        position: batches of this epoch done.
        metrics: this step's metrics as device scalars (reading them waits for the
            step; `fit`'s logging reads them in batches).
        epoch_end: this step finished its epoch.
        last: this step is the run's last.
        stop: why the run stops early (a signal's name), or None.
        best: the best evaluation so far, when tracked.
    """

    model: Any
    opt_state: Any
    step: int = 0
    epoch: int = 0
    position: int = 0
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    epoch_end: bool = False
    last: bool = False
    stop: str | None = None
    best: BestMetric | None = None


@dataclasses.dataclass(frozen=True)
class Hook:
    """A behaviour run after the steps for which `when(state)` is true.

    Attributes:
        fn: `state -> None` (observe) or `state -> LoopState` (the state to continue
            with).
        when: `state -> bool`.

    Example:
        >>> Hook(lambda s: print(s.step), when=lambda s: s.epoch_end)
    """

    fn: Callable[[LoopState], LoopState | None]
    when: Callable[[LoopState], bool]


def every(n: int, fn: Callable[[LoopState], LoopState | None], *, at_last: bool = True) -> Hook:
    """A hook run every `n` optimizer steps (and after the last one, by default).

    Args:
        n: the interval in steps.
        fn: `state -> None`, or `state -> LoopState` to change what the loop continues
            with (for example `dataclasses.replace(state, stop="early stopping")`).
        at_last: also run after the run's last step.

    Returns:
        The hook, for `fit(..., hooks=[...])`.

    Example:
        >>> def report(state):
        ...     print(state.step, float(state.metrics["loss"]))
        >>> rc.fit(..., hooks=[rc.every(100, report)])
    """
    check_positive("every: n", n, optional=False)
    return Hook(fn, lambda s: s.step % n == 0 or (at_last and s.last))


def always(fn: Callable[[LoopState], LoopState | None]) -> Hook:
    """A hook run after every step."""
    return Hook(fn, lambda s: True)


StepFn = Callable[[Any, Any, Any, Any], tuple[Any, Any, dict[str, Any]]]
"""`(model, opt_state, batch_arrays, step) -> (model, opt_state, metrics)`."""
EpochFn = Callable[[int, int], tuple[Iterable[Batch], int]]
"""`(epoch, start) -> (the epoch's batches from batch start on, batches in the epoch)`."""


def run_loop(
    state: LoopState,
    *,
    step_fn: StepFn,
    epoch_batches: EpochFn,
    hooks: Sequence[Hook],
    n_epochs: int | None,
    max_steps: int | None,
) -> tuple[LoopState, dict[str, float]]:
    """Run steps from `state` until `n_epochs` or `max_steps`, or a hook sets `stop`.

    Args:
        state: where to start (a fresh or resumed state).
        step_fn: the jitted step; it receives the step number to fold into its key.
        epoch_batches: the batches of an epoch, from a position on.
        hooks: run in order after every step for which they are due.
        n_epochs: stop after this many epochs (None: no limit).
        max_steps: stop after this many optimizer steps (None: no limit).

    Returns:
        The final state, and host seconds per step spent collating (`data_s`),
        dispatching the step (`step_call_s`) and in the hooks (`other_s`), measured
        after the first step of this call (which compiles).

    Raises:
        Whatever a step, a hook or the batches raise, with the last state the loop
        reached (after the last step that completed, and the hooks run on it) as
        the exception's `loop_state` attribute.
    """
    timing = np.zeros(3)
    timed = 0
    try:
        while not (
            (max_steps is not None and state.step >= max_steps)
            or (n_epochs is not None and state.epoch >= n_epochs)
        ):
            it, n_batches = epoch_batches(state.epoch, state.position)
            t_end = time.perf_counter()
            for batch in it:
                t_call = time.perf_counter()
                state, t_ret = _step(state, batch, step_fn, n_batches, n_epochs, max_steps)
                for hook in hooks:
                    if hook.when(state):
                        state = hook.fn(state) or state
                t_next = time.perf_counter()
                if timed:
                    timing += (t_call - t_end, t_ret - t_call, t_next - t_ret)
                timed += 1
                t_end = t_next
                if state.last or state.stop is not None:
                    break
            if state.stop is not None or state.last:
                break
            state = dataclasses.replace(state, epoch=state.epoch + 1, position=0, epoch_end=False)
    except BaseException as err:
        # The last state reached, for the caller to keep (a `fit` that raises hands it on).
        if not hasattr(err, "loop_state"):  # a nested loop's own is nearer the fault
            err.loop_state = state  # type: ignore[attr-defined]
        raise
    n = max(1, timed - 1)
    return state, dict(
        zip(("data_s", "step_call_s", "other_s"), (timing / n).tolist(), strict=True)
    )


def _step(
    state: LoopState,
    batch: Batch,
    step_fn: StepFn,
    n_batches: int,
    n_epochs: int | None,
    max_steps: int | None,
) -> tuple[LoopState, float]:
    """The state after one step on `batch`, and when the step call returned."""
    model, opt_state, metrics = step_fn(state.model, state.opt_state, batch.arrays, state.step)
    returned = time.perf_counter()
    step, position = state.step + 1, state.position + 1
    epoch_end = position == n_batches
    last = (max_steps is not None and step >= max_steps) or (
        epoch_end and n_epochs is not None and state.epoch == n_epochs - 1
    )
    new = dataclasses.replace(
        state,
        model=model,
        opt_state=opt_state,
        metrics=metrics,
        step=step,
        position=position,
        epoch_end=epoch_end,
        last=last,
    )
    return new, returned
