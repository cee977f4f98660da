"""Evaluation: what to evaluate on and how (`Evaluation`), the best value so far
(`BestMetric`), one pass of the jitted eval/predict steps over a sequence, and
`predict` over a sequence of examples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh
from jaxtyping import PyTree

from .._checks import check_positive
from .._progress import Progress, compiling
from ..distributed._host import to_host
from ..parallel._context_parallel import ContextParallel
from ..parallel._parallelism import ContextOption, Parallelism, SequenceOption, check_options
from ..parallel.mesh import make_mesh
from ..parallel.place import model_mesh, place
from .data import Batch, CollateFn, Examples, batches, global_batch_size
from .inference_step import predict_step
from .step import PredFn

MetricFn = Callable[[Examples, list[Any]], Mapping[str, Any]]
"""`(examples, outputs) -> {name: number}`."""


def check_examples(examples: Any, name: str) -> Examples:
    """Raise unless `examples` is a non-empty sequence; return it.

    Args:
        examples: what the caller passed.
        name: the argument's name, for the error.

    Returns:
        `examples`.
    """
    if not hasattr(examples, "__len__") or not hasattr(examples, "__getitem__"):
        raise TypeError(
            f"{name} must be a sequence (len() and integer indexing), "
            f"got {type(examples).__name__}."
        )
    if len(examples) == 0:
        raise ValueError(f"{name} is empty; give at least one example.")
    return examples


@dataclasses.dataclass(frozen=True)
class BestMetric:
    """The best value of one eval metric so far, and the rule for "better".

    Attributes:
        metric: a key of the eval metrics (`"loss"` for the eval loss, otherwise a
            key of `metric_fn`'s dict).
        mode: `"max"` or `"min"`.
        value: the best value seen, None before the first evaluation.
        step: the step at which it was seen.

    Example:
        >>> best = BestMetric("accuracy", "max")
        >>> best, improved = best.update({"accuracy": 0.9}, step=100)   # improved
        >>> best, improved = best.update({"accuracy": 0.8}, step=200)   # not improved
    """

    metric: str
    mode: Literal["max", "min"]
    value: float | None = None
    step: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or self.mode not in ("max", "min"):
            raise ValueError(
                "save_best must be (metric_name, 'max' | 'min'), "
                f"got ({self.metric!r}, {self.mode!r})."
            )

    def update(self, metrics: Mapping[str, Any], step: int) -> tuple[BestMetric, bool]:
        """Compare one evaluation's metrics with the best so far.

        Args:
            metrics: the evaluation's metrics, keyed as `metric_fn` returns them plus
                `"loss"`.
            step: the step of this evaluation.

        Returns:
            `(new_best, improved)`. A non-finite value never improves; ties do not
            improve, so the earliest best is kept.
        """
        if self.metric not in metrics:
            raise KeyError(
                f"save_best names the metric {self.metric!r}, but the evaluation produced "
                f"{sorted(metrics)}; use one of those."
            )
        value = float(metrics[self.metric])
        if not math.isfinite(value):
            return self, False
        if self.value is not None and not (
            value > self.value if self.mode == "max" else value < self.value
        ):
            return self, False
        return dataclasses.replace(self, value=value, step=int(step)), True


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What `fit` evaluates on, when, and which checkpoint it keeps for it.

    Every evaluation computes the eval loss (`loss_fn` per example under inference
    mode); with `pred_fn` it also collects one output per example and scores them
    with `metric_fn`; with `model_fn` it adds the metrics `model_fn` computes from the
    model itself (the LM Evaluation Harness's tasks: `rc.eval.harness_metrics`).

    Attributes:
        examples: a sequence, the same on every process; may be None with `model_fn`.
        pred_fn: `(model, batch, key) -> pytree of arrays`, for predictions.
        output_fn: one example's predictions (NumPy) -> output, as in `predict`.
        metric_fn: `(examples, outputs) -> dict of numbers`.
        every: evaluate every this many steps; by default at the end of each epoch.
            The last step is always evaluated.
        per_device_batch_size: defaults to `fit`'s.
        save_best: `(metric, "max" | "min")`: track the best evaluation (`"loss"` or
            a key of `metric_fn`'s or `model_fn`'s dict) in `history["best"]`, and
            with a `workdir` keep its checkpoint in `workdir/ckpts/best`.
        model_fn: `model -> dict of numbers`, run on the live model (on its mesh) at
            each evaluation; logged as `eval_<name>` beside the loss.

    Example:
        >>> rc.Evaluation(val, pred_fn=pred_fn, output_fn=int, every=500,
        ...               metric_fn=lambda exs, outs: {"acc": np.mean(...)},
        ...               save_best=("acc", "max"))
    """

    examples: Examples | None = None
    pred_fn: PredFn | None = None
    output_fn: Callable[[Any], Any] | None = None
    metric_fn: MetricFn | None = None
    every: int | None = None
    per_device_batch_size: int | None = None
    save_best: tuple[str, Literal["max", "min"]] | None = None
    model_fn: Callable[[Any], Mapping[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.examples is not None or self.model_fn is None:
            check_examples(self.examples, "Evaluation.examples")
        elif self.pred_fn is not None:
            raise ValueError("Evaluation: pred_fn predicts on examples; pass examples as well.")
        check_positive("Evaluation.every", self.every)
        check_positive("Evaluation.per_device_batch_size", self.per_device_batch_size)
        if (self.output_fn is not None or self.metric_fn is not None) and self.pred_fn is None:
            raise ValueError(
                "Evaluation: output_fn and metric_fn work on predictions; pass pred_fn as well."
            )
        if self.save_best is not None:
            if not isinstance(self.save_best, tuple) or len(self.save_best) != 2:
                raise ValueError(
                    f"save_best must be (metric_name, 'max' | 'min'), got {self.save_best!r}."
                )
            BestMetric(*self.save_best)

    def best(self) -> BestMetric | None:
        """A fresh `BestMetric` for `save_best`, or None."""
        return None if self.save_best is None else BestMetric(*self.save_best)


def scalar_metrics(metrics: Any) -> dict[str, float]:
    """`metric_fn`'s dict as `{str: float}`, with an error naming the metric that is wrong.

    Args:
        metrics: what `metric_fn` returned.

    Returns:
        The metrics as Python floats.

    Raises:
        TypeError: not a dict, or a value that is not a number (a string, None).
        ValueError: a value that is not a scalar.
    """
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metric_fn must return a dict of numbers, got {type(metrics).__name__}.")
    out = {}
    for k, v in metrics.items():
        if np.ndim(v) != 0:
            raise ValueError(f"metric_fn must return scalars; {k!r} has shape {np.shape(v)}.")
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError):
            raise TypeError(
                f"metric_fn must return numbers; {k!r} is {v!r} ({type(v).__name__}). Return "
                "a number, or log text elsewhere."
            ) from None
    return out


def _unbatch(tree: PyTree, n: int) -> list[Any]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return [jax.tree_util.tree_unflatten(treedef, [x[i] for x in leaves]) for i in range(n)]


def inference(
    model: PyTree,
    it: Iterator[Batch],
    *,
    key: Any,
    loss_step: Callable[..., dict[str, Any]] | None,
    pred_step: Callable[..., Any] | None,
    output_fn: Callable[[Any], Any] | None,
    on_batch: Callable[[int], None] = lambda n_valid: None,
) -> tuple[dict[str, float] | None, list[Any] | None]:
    """One pass over the batches: the weighted eval loss and/or the per-example outputs.

    Batch `i` gets the key `fold_in(key, i)`. A batch's predictions are read while
    the next one computes. `on_batch(n_valid)` is called once each batch's steps
    are called (the first call returns once they are compiled).

    Args:
        model: the model, on the batches' mesh.
        it: padded batches (`Batch.n_valid` real rows each).
        key: the pass's key.
        loss_step: `(model, arrays, key, n_valid) -> {"loss", "weight", ...}`, or None.
        pred_step: `(model, arrays, key) -> predictions`, or None.
        output_fn: one example's predictions -> output; identity when None.

    Returns:
        `(loss_metrics, outputs)`, each None when its step is None.
    """
    losses: list[dict[str, Any]] = []
    outputs: list[Any] = []
    pending: tuple[Any, int] | None = None
    for i, batch in enumerate(it):
        k = jax.random.fold_in(key, i)
        if loss_step is not None:
            losses.append(loss_step(model, batch.arrays, k, np.asarray(batch.n_valid, np.int32)))
        if pred_step is not None:
            preds = pred_step(model, batch.arrays, k)
            if pending is not None:
                outputs.extend(_outputs(*pending, output_fn))
            pending = (preds, batch.n_valid)
        on_batch(batch.n_valid)
    if pending is not None:
        outputs.extend(_outputs(*pending, output_fn))
    loss_metrics = None
    if loss_step is not None:
        host = jax.device_get(losses)
        weight = sum(float(m["weight"]) for m in host)
        loss_metrics = {
            k: sum(float(m[k]) * float(m["weight"]) for m in host) / weight
            for k in host[0]
            if k != "weight"
        }
    return loss_metrics, (outputs if pred_step is not None else None)


def _outputs(preds: Any, n_valid: int, output_fn: Callable[[Any], Any] | None) -> list[Any]:
    host = jax.tree.map(lambda x: x[:n_valid], to_host(preds))
    per_example = _unbatch(host, n_valid)
    return per_example if output_fn is None else [output_fn(o) for o in per_example]


def predict(
    model: PyTree,
    examples: Examples,
    *,
    collate_fn: CollateFn,
    pred_fn: PredFn,
    output_fn: Callable[[Any], Any] | None = None,
    mesh: Mesh | None = None,
    per_device_batch_size: int,
    seed: int = 0,
    precision: str = "fp32",
    sequence_parallel: SequenceOption = False,
    context_parallel: ContextOption = False,
    progress: bool = True,
) -> list[Any]:
    """Run `pred_fn` over `examples` on every device; one output per example, in order.

    The last batch is padded (repeating the last example) and the padding dropped.
    Outputs are gathered from all processes, so every process gets the full list.
    The model's arrays are only read.

    With `progress`, process 0 says how long the predict step took to compile and
    shows the examples done: a bar in a terminal, else a line every 30 s
    (`REDCOAST_PROGRESS_SECONDS`) and at the end.

    Args:
        model: an Equinox model; if it is not on `mesh` it is placed there (`place`,
            tracing `pred_fn` on the first batch).
        examples: a sequence, the same on every process.
        collate_fn: `(examples: list) -> dict[str, np.ndarray]`.
        pred_fn: `(model, batch, key) -> pytree of arrays`, batch on the leading axis;
            runs under `eqx.nn.inference_mode`.
        output_fn: turns one example's predictions (a pytree of NumPy arrays without
            the batch axis) into the output to return; identity by default.
        mesh: from `make_mesh`; defaults to the model's mesh, else `make_mesh(1)`.
        per_device_batch_size: rows per data-parallel device.
        seed: batch `i` gets the key `fold_in(key(seed), i)`.
        precision: `"bf16"` / `"pure-bf16"` run `pred_fn` on the model cast to
            bfloat16 (see `predict_step`).
        sequence_parallel: split the activations between tensor-parallel regions
            over the model axis as well (as for `fit`).
        context_parallel: split every sequence over the data axis instead of the
            rows (as for `fit`): batches of `per_device_batch_size` whole rows.
        progress: report the compilation and the examples done (see above).

    Returns:
        A list with one output per example.

    Example:
        >>> labels = predict(model, test, collate_fn=collate_fn, per_device_batch_size=32,
        ...                  pred_fn=lambda m, b, k: jax.vmap(m)(b["x"]).argmax(-1),
        ...                  output_fn=int)
    """
    examples = check_examples(examples, "examples")
    check_options(sequence_parallel, context_parallel)
    mesh = mesh or model_mesh(model) or make_mesh(1)
    context = ContextParallel(mesh) if context_parallel is True else context_parallel or None
    size = global_batch_size(mesh, per_device_batch_size, split_rows=context is None)
    key = jax.random.key(seed)
    it = batches(
        examples,
        collate_fn=collate_fn,
        mesh=mesh,
        batch_size=size,
        shuffle=False,
        drop_last=False,
        split_rows=context is None,
    )
    first = next(it)
    model = place(model, mesh, example_call=lambda m: pred_fn(m, first.arrays, key))
    with _progress_of_batches(len(examples), progress and jax.process_index() == 0) as done:
        _, outputs = inference(
            model,
            itertools.chain([first], it),
            key=key,
            loss_step=None,
            pred_step=predict_step(
                pred_fn,
                precision=precision,
                parallelism=Parallelism.of(
                    model, sequence_parallel=sequence_parallel, context_parallel=context or False
                ),
            ),
            output_fn=output_fn,
            on_batch=done,
        )
    assert outputs is not None
    return outputs


@contextlib.contextmanager
def _progress_of_batches(total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """`done(n_valid)` for each batch: the first call ends the compilation's label
    (`compiling the predict step… 3.1 s`) and starts the bar over the examples."""
    label = compiling("compiling the predict step", enabled=enabled)
    bar = Progress("predict", total, unit="example", enabled=enabled)
    with contextlib.ExitStack() as stack:
        stack.enter_context(label)
        first = True

        def done(n_valid: int) -> None:
            nonlocal first
            if first:
                first = False
                stack.close()  # the label's time, printed before the bar starts
                stack.enter_context(bar)
            bar.advance(n_valid)

        yield done
