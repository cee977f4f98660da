"""fit's evaluation: one pass over the examples, logged and written to `workdir/eval`,
and the hook that runs it when due and keeps the best checkpoint."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._resume import Run
from .data import CollateFn, batches
from .evaluate import Evaluation, inference, scalar_metrics
from .inference_step import jit_eval_first, predict_step
from .logging import MetricsBuffer
from .loop import Hook, LoopState
from .step import LossFn

__all__ = ["eval_hook", "evaluator"]


def evaluator(
    run: Run,
    evaluation: Evaluation,
    loss_fn: LossFn | None,
    collate_fn: CollateFn,
    batch_size: int,
    emit: Callable[[dict[str, Any], int], None],
    records: list[dict[str, Any]],
    precision: str,
) -> Callable[[LoopState], dict[str, float]]:
    """`state -> metrics`: one evaluation, logged, and written to `workdir/eval`."""
    eval_dir = None if run.root is None or not run.lead else os.path.join(run.root, "eval")
    mesh, key = run.mesh, run.key
    loss_step = (
        None
        if loss_fn is None
        else functools.partial(
            jit_eval_first, loss_fn, precision=precision, parallelism=run.parallelism
        )
    )
    pred_step = (
        None
        if evaluation.pred_fn is None
        else predict_step(evaluation.pred_fn, precision=precision, parallelism=run.parallelism)
    )

    def evaluate(s: LoopState) -> dict[str, float]:
        metrics: dict[str, float] = {}
        outputs = None
        if evaluation.examples is not None:
            loss_metrics, outputs = inference(
                s.model,
                batches(
                    evaluation.examples,
                    collate_fn=collate_fn,
                    mesh=mesh,
                    batch_size=batch_size,
                    shuffle=False,
                    drop_last=False,
                    split_rows=run.context is None,
                ),
                key=key,
                loss_step=loss_step,
                pred_step=pred_step,
                output_fn=evaluation.output_fn,
            )
            metrics.update(loss_metrics or {})
        if evaluation.metric_fn is not None:
            assert evaluation.examples is not None and outputs is not None
            metrics.update(scalar_metrics(evaluation.metric_fn(evaluation.examples, outputs)))
        if evaluation.model_fn is not None:
            metrics.update(scalar_metrics(evaluation.model_fn(s.model)))
        record = {"epoch": s.epoch, **{f"eval_{k}": v for k, v in metrics.items()}}
        records.append({"step": s.step, **record})
        emit(record, s.step)
        if eval_dir is not None:
            os.makedirs(eval_dir, exist_ok=True)
            with open(os.path.join(eval_dir, f"step_{s.step:08d}.json"), "w") as f:
                dump = {"step": s.step, "epoch": s.epoch, "metrics": metrics, "outputs": outputs}
                json.dump(dump, f, default=_json_default)
        return metrics

    return evaluate


def _json_default(x: Any) -> Any:
    if isinstance(x, np.ndarray | np.generic | jax.Array):
        return np.asarray(x).tolist()
    return repr(x)


def eval_hook(
    evaluation: Evaluation,
    *,
    evaluate: Callable[[LoopState], dict[str, float]],
    buffer: MetricsBuffer,
    save_best: Callable[[LoopState], None] | None,
) -> Hook:
    """Evaluate when due; track the best metric and keep its checkpoint."""

    def fn(s: LoopState) -> LoopState | None:
        buffer.flush(s.step)
        metrics = evaluate(s)
        if s.best is None:
            return None
        best, improved = s.best.update(metrics, s.step)
        s = dataclasses.replace(s, best=best)
        if improved and save_best is not None:
            save_best(s)
        return s

    n = evaluation.every
    return Hook(fn, lambda s: s.last or (s.step % n == 0 if n is not None else s.epoch_end))
