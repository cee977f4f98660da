"""fit's behaviours as hooks, in order: logging, evaluation, the user's own, stops, checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ..checkpoint._run import Checkpointing, prune_checkpoints, step_checkpoint_path
from ._evaluator import eval_hook
from ._resume import Run, saver
from ._signals import stop_hook
from .evaluate import Evaluation
from .logging import MetricsBuffer
from .loop import Hook, LoopState, always

__all__ = ["fit_hooks"]


def _log_hooks(buffer: MetricsBuffer, log_every: int) -> list[Hook]:
    """Keep every step's metrics; fetch them one step behind, and at epoch ends."""
    return [
        always(lambda s: buffer.add(s.step, s.epoch, s.metrics)),
        # Fetching step s - 1 leaves step s running on the devices meanwhile.
        Hook(
            lambda s: buffer.flush(s.step - 1),
            lambda s: s.step > 1 and (s.step - 1) % log_every == 0,
        ),
        Hook(lambda s: buffer.flush(s.step), lambda s: s.epoch_end or s.last),
    ]


def _checkpoint_hook(
    config: Checkpointing,
    ckpt_dir: str,
    *,
    save: Callable[[Path, LoopState], None],
    check: Callable[[], None],
    buffer: MetricsBuffer,
    lead: bool,
) -> Hook:
    """Save `step_*` checkpoints when due and on a stop; prune the run's old ones.

    `check` runs first: it raises when the workdir is no longer this run's.
    """

    def fn(s: LoopState) -> None:
        check()
        buffer.flush(s.step)
        save(step_checkpoint_path(ckpt_dir, s.step), s)
        if lead and config.keep_last_n is not None:
            prune_checkpoints(ckpt_dir, config.keep_last_n)

    def due(s: LoopState) -> bool:
        periodic = config.every is not None and s.step % config.every == 0
        return periodic or (s.last and config.last) or s.stop is not None

    return Hook(fn, due)


def fit_hooks(
    run: Run,
    *,
    buffer: MetricsBuffer,
    log_every: int,
    evaluation: tuple[Evaluation, Callable[[LoopState], dict[str, float]]] | None,
    user: Sequence[Hook],
    caught: list[str],
    checkpointing: Checkpointing,
    still_held: Callable[[], None] = lambda: None,
) -> list[Hook]:
    """fit's behaviours in order: logging, evaluation, the user's hooks, stops, checkpoints.

    `still_held` runs before each checkpoint is written (`fit` checks there that the
    workdir is still its own).
    """
    hooks = _log_hooks(buffer, log_every)
    save = saver(run, buffer)
    if evaluation is not None:
        best = None
        if run.ckpts is not None:
            best_path = Path(run.ckpts, "best")

            def save_best(s: LoopState) -> None:
                still_held()
                save(best_path, s)

            best = save_best
        hooks.append(
            eval_hook(evaluation[0], evaluate=evaluation[1], buffer=buffer, save_best=best)
        )
    hooks += user
    if run.ckpts is not None:
        hooks.append(stop_hook(caught, log_every))
        hooks.append(
            _checkpoint_hook(
                checkpointing,
                run.ckpts,
                save=save,
                check=still_held,
                buffer=buffer,
                lead=run.lead,
            )
        )
    return hooks
