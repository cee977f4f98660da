"""`fit` and `predict`: the loop around the jitted steps.

The loop keeps the devices busy: a step is dispatched before the previous one's
metrics are read, metrics come back once per logging interval in one transfer,
and everything else on the host (collating the next batch, the progress bar) runs
while the devices compute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import equinox as eqx
import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    step_checkpoint_path,
)
from .data import Batch, CollateFn, batches, check_positive, global_batch_size, to_host
from .logging import Logger, ProgressBar, close_loggers, jsonl_logger
from .mesh import DATA, MODEL, make_mesh, mesh_shape
from .sharding import shard, sharding_rules
from .step import LossFn, PredFn, _donating_jit, _jit_eval_first, _jit_predict, train_step


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What `fit` returns.

    Attributes:
        model: the trained model, sharded on the mesh.
        opt_state: the optimizer state after the last step.
        step: the number of optimizer steps taken.
        history: `"train"`: the logged training records (`step`, `epoch`, `loss`,
            `grad_norm`, `lr`, `steps_per_s`, `examples_per_s`, aux scalars);
            `"eval"`: one record per evaluation (`step`, `epoch`, `eval_loss`,
            `eval_<metric>`); `"best"`: `{"metric", "mode", "value", "step"}` with
            `save_best`; `"timing"`: host seconds per step spent collating
            (`data_s`), dispatching the jitted step (`step_call_s`) and in the rest
            of the loop (`other_s`), measured after the first (compiling) step.
    """

    model: Any
    opt_state: Any
    step: int
    history: dict[str, Any]


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


# ----------------------------------------------------------------------------- placement


def _array_leaves(tree: PyTree) -> list[Any]:
    return jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))


def _redcoast_sharding(x: Any) -> NamedSharding | None:
    """`x`'s sharding if it is placed on a `("data", "model")` mesh."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and tuple(sharding.mesh.axis_names) == (DATA, MODEL):
        return sharding
    return None


def _model_mesh(model: PyTree) -> Mesh | None:
    """The redcoast mesh the model already lives on, if any."""
    for x in _array_leaves(model):
        sharding = _redcoast_sharding(x)
        if sharding is not None:
            return sharding.mesh if isinstance(sharding.mesh, Mesh) else None
    return None


def _on_mesh(x: Any, mesh: Mesh) -> bool:
    sharding = getattr(x, "sharding", None)
    return isinstance(sharding, NamedSharding) and sharding.mesh == mesh


def _place_model(model: PyTree, mesh: Mesh, example_call: Callable[[PyTree], Any]) -> PyTree:
    """Put the model on `mesh`: keep it, re-place it with its own specs, or derive specs."""
    leaves = _array_leaves(model)
    if all(_on_mesh(x, mesh) for x in leaves):
        return model
    n_model = mesh_shape(mesh)[1]
    if all(_redcoast_sharding(x) is not None for x in leaves):
        specs = jax.tree.map(lambda x: x.sharding.spec, eqx.filter(model, eqx.is_array))
    elif n_model > 1:
        specs = sharding_rules(model, n_model, example_call=example_call)
    else:
        specs = jax.tree.map(lambda _: P(), eqx.filter(model, eqx.is_array))
    return shard(model, mesh, specs)


def _replicate_strays(tree: PyTree, mesh: Mesh) -> PyTree:
    """Replicate over `mesh` the arrays not already on it (e.g. optax's step counters)."""

    def place(x: Any) -> Any:
        if not eqx.is_array(x) or _on_mesh(x, mesh):
            return x
        return jax.device_put(x, NamedSharding(mesh, P()))

    return jax.tree.map(place, tree)


# ----------------------------------------------------------------------------- inference


def _unbatch(tree: PyTree, n: int) -> list[Any]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return [jax.tree_util.tree_unflatten(treedef, [x[i] for x in leaves]) for i in range(n)]


def _check_examples(examples: Any, name: str) -> Sequence[Any]:
    if not hasattr(examples, "__len__") or not hasattr(examples, "__getitem__"):
        raise TypeError(
            f"{name} must be a sequence (len() and integer indexing), "
            f"got {type(examples).__name__}."
        )
    if len(examples) == 0:
        raise ValueError(f"{name} is empty; give at least one example.")
    return examples


def _inference(
    model: PyTree,
    it: Iterator[Batch],
    *,
    key: Any,
    loss_step: Callable[..., dict[str, Any]] | None,
    pred_step: Callable[..., Any] | None,
    output_fn: Callable[[Any], Any] | None,
) -> tuple[dict[str, float] | None, list[Any] | None]:
    """One pass over the batches: the weighted eval loss and/or the per-example outputs."""
    losses: list[dict[str, Any]] = []
    outputs: list[Any] = []
    pending: tuple[Any, int] | None = None

    def drain() -> None:
        if pending is not None:
            preds, n_valid = pending
            host = jax.tree.map(lambda x: x[:n_valid], to_host(preds))
            per_example = _unbatch(host, n_valid)
            outputs.extend(per_example if output_fn is None else map(output_fn, per_example))

    for i, batch in enumerate(it):
        k = jax.random.fold_in(key, i)
        if loss_step is not None:
            losses.append(loss_step(model, batch.arrays, k, np.asarray(batch.n_valid, np.int32)))
        if pred_step is not None:
            preds = pred_step(model, batch.arrays, k)
            # Read the previous batch's predictions while this one computes.
            drain()
            pending = (preds, batch.n_valid)
    drain()
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


def predict(
    model: PyTree,
    examples: Sequence[Any],
    *,
    collate_fn: CollateFn,
    pred_fn: PredFn,
    output_fn: Callable[[Any], Any] | None = None,
    mesh: Mesh | None = None,
    per_device_batch_size: int,
    seed: int = 0,
) -> list[Any]:
    """Run `pred_fn` over `examples` on every device; one output per example, in order.

    The last batch is padded (repeating the last example) and the padding dropped.
    Outputs are gathered from all processes, so every process gets the full list.

    Args:
        model: an Equinox model; if it is not on `mesh` it is placed there (split by
            `sharding_rules`, tracing `pred_fn`, when the mesh has a model axis > 1).
        examples: a sequence, the same on every process.
        collate_fn: `(examples: list) -> dict[str, np.ndarray]`.
        pred_fn: `(model, batch, key) -> pytree of arrays`, batch on the leading axis;
            runs under `eqx.nn.inference_mode`.
        output_fn: turns one example's predictions (a pytree of NumPy arrays without
            the batch axis) into the output to return; identity by default.
        mesh: from `make_mesh`; defaults to the model's mesh, else `make_mesh(1)`.
        per_device_batch_size: rows per data-parallel device.
        seed: batch `i` gets the key `fold_in(key(seed), i)`.

    Returns:
        A list with one output per example.

    Example:
        >>> labels = predict(model, test, collate_fn=collate_fn, per_device_batch_size=32,
        ...                  pred_fn=lambda m, b, k: jax.vmap(m)(b["x"]).argmax(-1),
        ...                  output_fn=int)
    """
    examples = _check_examples(examples, "examples")
    mesh = mesh or _model_mesh(model) or make_mesh(1)
    size = global_batch_size(mesh, per_device_batch_size)
    key = jax.random.key(seed)
    it = batches(
        examples, collate_fn=collate_fn, mesh=mesh, batch_size=size, shuffle=False, drop_last=False
    )
    first = next(it)
    model = _place_model(model, mesh, lambda m: pred_fn(m, first.arrays, key))
    _, outputs = _inference(
        model,
        itertools.chain([first], it),
        key=key,
        loss_step=None,
        pred_step=functools.partial(_jit_predict, pred_fn),
        output_fn=output_fn,
    )
    assert outputs is not None
    return outputs


# ----------------------------------------------------------------------------- fit


def _json_default(x: Any) -> Any:
    if isinstance(x, np.ndarray | np.generic):
        return x.tolist()
    if isinstance(x, jax.Array):
        return np.asarray(x).tolist()
    return repr(x)


def _scalar_metrics(metrics: Any) -> dict[str, float]:
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metric_fn must return a dict of numbers, got {type(metrics).__name__}.")
    out = {}
    for k, v in metrics.items():
        if np.ndim(v) != 0:
            raise ValueError(f"metric_fn must return scalars; {k!r} has shape {np.shape(v)}.")
        out[str(k)] = float(v)
    return out


@contextlib.contextmanager
def _stop_requests(enabled: bool) -> Iterator[list[str]]:
    """Catch SIGTERM and SIGINT while training, so the loop can stop after a step.

    Yields the list of signal names caught so far. A second signal of either kind
    goes to the handler that was there before (the default one ends the process
    at once), so a user can still force an exit.
    """
    caught: list[str] = []
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: Any) -> None:
        if caught:
            for sig, old in previous.items():
                signal.signal(sig, old)
            signal.raise_signal(signum)
            return
        caught.append(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, handler) or signal.SIG_DFL
    try:
        yield caught
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any (a collective: all must call)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def _restore_history(path: str, step: int, lead: bool) -> dict[str, list[dict[str, Any]]]:
    """Records of `metrics.jsonl` up to `step`; on process 0, later lines are dropped.

    Lines after the checkpoint were written by the run that was interrupted; the
    resumed run writes those steps again.
    """
    history: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    if not os.path.isfile(path):
        return history
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    kept = [r for r in records if int(r.get("step", 0)) <= step]
    if lead and len(kept) != len(records):
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, path)
    for r in kept:
        history["eval" if any(k.startswith("eval_") for k in r) else "train"].append(r)
    return history


def fit(
    model: PyTree,
    optimizer: optax.GradientTransformation,
    train_examples: Sequence[Any] | Callable[[int], Sequence[Any]],
    *,
    collate_fn: CollateFn,
    loss_fn: LossFn,
    mesh: Mesh | None = None,
    per_device_batch_size: int,
    n_epochs: int | None = None,
    max_steps: int | None = None,
    accumulate_grad_batches: int = 1,
    eval_examples: Sequence[Any] | None = None,
    eval_per_device_batch_size: int | None = None,
    eval_every: int | None = None,
    pred_fn: PredFn | None = None,
    output_fn: Callable[[Any], Any] | None = None,
    metric_fn: Callable[[Sequence[Any], list[Any]], Mapping[str, Any]] | None = None,
    save_best: tuple[str, Literal["max", "min"]] | None = None,
    workdir: str | os.PathLike[str] | None = None,
    save_every: int | None = None,
    save_last: bool = True,
    keep_last_n: int | None = None,
    resume: bool = False,
    seed: int = 0,
    loggers: Sequence[Logger] = (),
    progress: bool = True,
    log_every: int = 10,
    on_nonfinite: Literal["raise", "skip"] = "raise",
    opt_state: PyTree | None = None,
    schedule: Callable[[Any], Any] | None = None,
) -> FitResult:
    """Train `model` on `train_examples` with data and tensor parallelism over `mesh`.

    Each step takes a global batch of `per_device_batch_size * n_data *
    accumulate_grad_batches` examples. Every process shuffles with `seed` and the
    epoch, collates only its own rows, and the step runs on the global batch
    (`train_step`). Step `s` (counting from 0) uses the key `fold_in(key(seed), s)`.
    A last partial batch of an epoch is dropped.

    With a `workdir`, checkpoints go to `workdir/ckpts/step_XXXXXXXX` (every
    `save_every` steps, at the end with `save_last`, and when SIGTERM or SIGINT
    arrives: the current step finishes, a checkpoint is saved and the process
    exits with code 0). `resume=True` continues step-exactly from the newest of
    them: same parameters, optimizer state, position in the epoch's data order
    and random keys, so an interrupted run ends where an uninterrupted one does.
    The best evaluation (`save_best`) is kept apart in `workdir/ckpts/best`, which
    resuming never picks.

    The model and optimizer state are donated to the jitted step: use
    `result.model` afterwards, not the model you passed in if it was already
    placed on `mesh`.

    Args:
        model: an Equinox model. If it is not on `mesh`, it is split with
            `sharding_rules` (tracing `loss_fn` on the first batch) when the mesh has
            a model axis > 1, and replicated otherwise.
        optimizer: an optax optimizer; wrap it in `optax.inject_hyperparams` to log
            the learning rate.
        train_examples: a sequence, or `epoch -> sequence` (same on every process).
        collate_fn: `(examples: list) -> dict[str, np.ndarray]`.
        loss_fn: `(model, batch, key) -> loss` or `(loss, dict_of_scalars)`.
        mesh: from `make_mesh`; defaults to the model's mesh, else `make_mesh(1)`.
        per_device_batch_size: rows per data-parallel device per micro-batch.
        n_epochs: epochs to run; at least one of `n_epochs` and `max_steps`.
        max_steps: optimizer steps to run (stops mid-epoch if reached).
        accumulate_grad_batches: micro-batches per optimizer step.
        eval_examples: a sequence to evaluate on.
        eval_per_device_batch_size: defaults to `per_device_batch_size`.
        eval_every: evaluate every this many steps; default at the end of each
            epoch. The last step is always evaluated.
        pred_fn: `(model, batch, key) -> pytree of arrays`, for eval predictions.
        output_fn: one example's predictions (NumPy) -> output, as in `predict`.
        metric_fn: `(eval_examples, outputs) -> dict of numbers`.
        save_best: `(metric, "max" | "min")`: track the best evaluation (metric is
            `"loss"` or a key of `metric_fn`'s dict) in `history["best"]`, and with a
            `workdir` keep its checkpoint in `workdir/ckpts/best`.
        workdir: where `metrics.jsonl`, `eval/step_XXXXXXXX.json` (metrics and
            outputs of each evaluation) and `ckpts/` are written, by process 0.
        save_every: save a checkpoint every this many steps (needs `workdir`).
        save_last: save a checkpoint after the last step (when `workdir` is set).
        keep_last_n: keep only the newest this many `step_*` checkpoints.
        resume: continue from the newest checkpoint in `workdir/ckpts`, if any.
        seed: the one seed for shuffling and the step keys.
        loggers: callables `(metrics, step) -> None`, called on process 0.
        progress: show a progress bar on process 0.
        log_every: fetch metrics from the devices and log every this many steps (and
            at the last step). A non-finite loss is detected here, so with
            `on_nonfinite="raise"` training stops within `log_every + 1` steps of it.
        on_nonfinite: `"raise"` stops with an error naming the first step whose loss
            was not finite; `"skip"` leaves the model unchanged on such steps.
        opt_state: an optimizer state to continue from; `optimizer.init` otherwise.
        schedule: `count -> lr`, to log the learning rate when the optimizer does not
            expose it.

    Returns:
        A `FitResult` with `model`, `opt_state`, `step` and `history`.

    Example:
        >>> result = fit(model, optax.adamw(1e-3), train, collate_fn=collate_fn,
        ...              loss_fn=loss_fn, mesh=make_mesh(2), per_device_batch_size=8,
        ...              n_epochs=2, eval_examples=val, pred_fn=pred_fn,
        ...              metric_fn=metric_fn, save_best=("accuracy", "max"),
        ...              workdir="runs/x", save_every=500, resume=True)
        >>> result.history["eval"][-1]["eval_accuracy"]
    """
    if n_epochs is None and max_steps is None:
        raise ValueError("fit needs n_epochs or max_steps (or both) to know when to stop.")
    for name, value in (
        ("n_epochs", n_epochs),
        ("max_steps", max_steps),
        ("eval_every", eval_every),
        ("eval_per_device_batch_size", eval_per_device_batch_size),
        ("save_every", save_every),
        ("keep_last_n", keep_last_n),
    ):
        check_positive(name, value)
    check_positive("log_every", log_every, optional=False)
    if on_nonfinite not in ("raise", "skip"):
        raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}.")
    if (output_fn is not None or metric_fn is not None) and pred_fn is None:
        raise ValueError("output_fn and metric_fn work on predictions: pass pred_fn as well.")
    if workdir is None:
        for name, value in (
            ("save_every", save_every),
            ("keep_last_n", keep_last_n),
            ("resume", resume),
        ):
            if value:
                raise ValueError(f"{name} needs a workdir to keep checkpoints in; pass workdir=.")
    best = None
    if save_best is not None:
        if not isinstance(save_best, tuple) or len(save_best) != 2:
            raise ValueError(f"save_best must be (metric_name, 'max' | 'min'), got {save_best!r}.")
        if eval_examples is None:
            raise ValueError("save_best compares evaluations: pass eval_examples as well.")
        best = BestMetric(*save_best)
    if eval_examples is not None:
        eval_examples = _check_examples(eval_examples, "eval_examples")

    mesh = mesh or _model_mesh(model) or make_mesh(1)
    size = global_batch_size(mesh, per_device_batch_size, accumulate_grad_batches)
    eval_size = global_batch_size(mesh, eval_per_device_batch_size or per_device_batch_size)
    base_key = jax.random.key(seed)
    lead = jax.process_index() == 0
    workdir = None if workdir is None else os.fspath(workdir)
    ckpt_dir = None if workdir is None else os.path.join(workdir, "ckpts")
    metrics_path = None if workdir is None else os.path.join(workdir, "metrics.jsonl")
    sinks: list[Logger] = list(loggers)
    if metrics_path is not None:
        sinks.insert(0, jsonl_logger(metrics_path))

    def epoch_examples(epoch: int) -> Sequence[Any]:
        examples = train_examples(epoch) if callable(train_examples) else train_examples
        examples = _check_examples(examples, f"train_examples (epoch {epoch})")
        if len(examples) < size:
            raise ValueError(
                f"train_examples has {len(examples)} examples in epoch {epoch}, fewer than one "
                f"global batch of {size} (per_device_batch_size={per_device_batch_size} x "
                f"{mesh_shape(mesh)[0]} data shards x accumulate_grad_batches="
                f"{accumulate_grad_batches}); the partial batch would be dropped. Use a "
                f"smaller per_device_batch_size."
            )
        return examples

    def epoch_batches(epoch: int, examples: Sequence[Any], start: int = 0) -> Iterator[Batch]:
        return batches(
            examples,
            collate_fn=collate_fn,
            mesh=mesh,
            batch_size=size,
            seed=seed,
            epoch=epoch,
            shuffle=True,
            drop_last=True,
            start=start,
        )

    # Asked for once: train_examples(epoch) may build the examples anew on each call.
    first_examples = epoch_examples(0)
    first = next(epoch_batches(0, first_examples))
    model = _place_model(model, mesh, lambda m: loss_fn(m, first.arrays, base_key))
    if opt_state is None:
        opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    opt_state = _replicate_strays(opt_state, mesh)

    step = epoch = position = 0
    history: dict[str, Any] = {"train": [], "eval": []}
    found = latest_checkpoint(ckpt_dir) if resume and ckpt_dir is not None else None
    if found is not None:
        # Loading into the shardings of the freshly placed model and optimizer state.
        ckpt = load_checkpoint(found, like=model, opt_state_like=opt_state)
        loop = ckpt.state.get("loop", {})
        if loop.get("seed") != seed or loop.get("global_batch_size") != size:
            raise ValueError(
                f"cannot resume step-exactly from {found}: it was saved with seed="
                f"{loop.get('seed')} and a global batch of {loop.get('global_batch_size')}, "
                f"this run has seed={seed} and a global batch of {size}. Use the same seed "
                "and per_device_batch_size x data shards x accumulate_grad_batches, or a "
                "new workdir."
            )
        model, opt_state = ckpt.model, ckpt.opt_state
        step, epoch, position = ckpt.step, int(loop["epoch"]), int(loop["position"])
        if best is not None and loop.get("best") and loop["best"]["metric"] == best.metric:
            best = dataclasses.replace(best, **loop["best"])
        assert metrics_path is not None
        history = _restore_history(metrics_path, step, lead)
        if best is not None and best.value is not None:
            history["best"] = dataclasses.asdict(best)
        if lead:
            print(f"redcoast: resuming from {found} (step {step}, epoch {epoch})", flush=True)

    core = train_step(
        loss_fn,
        optimizer,
        accumulate_grad_batches=accumulate_grad_batches,
        mesh=mesh,
        schedule=schedule,
        skip_nonfinite=on_nonfinite == "skip",
        jit=False,
    )
    step_fn = _donating_jit(
        lambda m, o, batch, key, s: core(m, o, batch, jax.random.fold_in(key, s))
    )
    loss_step = functools.partial(_jit_eval_first, loss_fn)
    pred_step = None if pred_fn is None else functools.partial(_jit_predict, pred_fn)

    total = max_steps
    if not callable(train_examples) and n_epochs is not None:
        per_epoch = n_epochs * (len(train_examples) // size)
        total = per_epoch if max_steps is None else min(max_steps, per_epoch)

    pending: list[tuple[int, int, dict[str, Any]]] = []
    clock = {"t": time.perf_counter(), "step": step}
    timing = {"data_s": 0.0, "step_call_s": 0.0, "other_s": 0.0, "steps": 0}
    last_record: dict[str, Any] = {}

    def emit(record: dict[str, Any], at: int) -> None:
        if lead:
            for sink in sinks:
                sink(record, at)

    def flush(upto: int) -> None:
        """Fetch the metrics of steps <= upto in one transfer; check them; log the last."""
        chunk = [p for p in pending if p[0] <= upto]
        if not chunk:
            return
        del pending[: len(chunk)]
        host = jax.device_get([m for _, _, m in chunk])
        if on_nonfinite == "raise":
            for (s, e, _), m in zip(chunk, host, strict=True):
                if not math.isfinite(float(m["loss"])):
                    raise FloatingPointError(
                        f"the loss is {float(m['loss'])} at step {s} (epoch {e}); training "
                        "stopped. Lower the learning rate or check the data for that step, "
                        "or pass on_nonfinite='skip' to skip such updates."
                    )
        s, e, _ = chunk[-1]
        now = time.perf_counter()
        rate = (s - clock["step"]) / max(now - clock["t"], 1e-9)
        clock.update(t=now, step=s)
        record = {"epoch": e, **{k: float(v) for k, v in host[-1].items()}}
        if "skipped" in record:
            record["skipped"] = sum(float(m["skipped"]) for m in host)
        record.update(steps_per_s=rate, examples_per_s=rate * size)
        history["train"].append({"step": s, **record})
        last_record.clear()
        last_record.update(record)
        emit(record, s)
        bar.show(record)

    def save(path: Path, at: int, at_epoch: int, at_position: int) -> None:
        loop = {
            "epoch": at_epoch,
            "position": at_position,
            "seed": seed,
            "global_batch_size": size,
            "best": None if best is None else dataclasses.asdict(best),
        }
        save_checkpoint(
            path,
            model=model,
            opt_state=opt_state,
            step=at,
            loop=loop,
            rng=np.asarray(jax.random.key_data(base_key)),
            metrics=dict(last_record),
        )

    def evaluate(at: int, at_epoch: int) -> None:
        nonlocal best
        assert eval_examples is not None
        loss_metrics, outputs = _inference(
            model,
            batches(
                eval_examples,
                collate_fn=collate_fn,
                mesh=mesh,
                batch_size=eval_size,
                shuffle=False,
                drop_last=False,
            ),
            key=base_key,
            loss_step=loss_step,
            pred_step=pred_step,
            output_fn=output_fn,
        )
        metrics = dict(loss_metrics or {})
        if metric_fn is not None:
            assert outputs is not None
            metrics.update(_scalar_metrics(metric_fn(eval_examples, outputs)))
        record = {"epoch": at_epoch, **{f"eval_{k}": v for k, v in metrics.items()}}
        history["eval"].append({"step": at, **record})
        emit(record, at)
        bar.show(record)
        if lead and workdir is not None:
            os.makedirs(os.path.join(workdir, "eval"), exist_ok=True)
            with open(os.path.join(workdir, "eval", f"step_{at:08d}.json"), "w") as f:
                json.dump(
                    {"step": at, "epoch": at_epoch, "metrics": metrics, "outputs": outputs},
                    f,
                    default=_json_default,
                )
        if best is not None:
            best, improved = best.update(metrics, at)
            history["best"] = dataclasses.asdict(best)
            if improved and ckpt_dir is not None:
                save(Path(ckpt_dir) / "best", at, at_epoch, position)

    def done() -> bool:
        return (max_steps is not None and step >= max_steps) or (
            n_epochs is not None and epoch >= n_epochs
        )

    stopped_by: str | None = None
    with (
        ProgressBar(total, enabled=progress and lead, completed=step) as bar,
        _stop_requests(ckpt_dir is not None) as caught,
    ):
        try:
            while not done():
                examples = first_examples if epoch == 0 else epoch_examples(epoch)
                n_batches = len(examples) // size
                if epoch == 0 and position == 0:
                    it = itertools.chain([first], epoch_batches(epoch, examples, start=1))
                else:
                    it = epoch_batches(epoch, examples, start=position)
                t_end = time.perf_counter()
                for batch in it:
                    t_call = time.perf_counter()
                    model, opt_state, metrics = step_fn(
                        model, opt_state, batch.arrays, base_key, np.int32(step)
                    )
                    t_ret = time.perf_counter()
                    step += 1
                    position += 1
                    pending.append((step, epoch, metrics))
                    # Logging one step behind leaves this step running on the devices
                    # while the host reads the previous one's metrics.
                    if (step - 1) % log_every == 0 and step > 1:
                        flush(step - 1)
                    last = (max_steps is not None and step >= max_steps) or (
                        position == n_batches and n_epochs is not None and epoch == n_epochs - 1
                    )
                    if eval_examples is not None and (
                        last
                        or (eval_every is not None and step % eval_every == 0)
                        or (eval_every is None and position == n_batches)
                    ):
                        flush(step)
                        evaluate(step, epoch)
                    # Every process must take the same decision: in a multi-process run
                    # the processes agree on a signal at logging boundaries.
                    if (jax.process_count() == 1 or step % log_every == 0 or last) and (
                        _any_process(bool(caught))
                    ):
                        stopped_by = caught[0] if caught else "a signal to another process"
                    if ckpt_dir is not None and (
                        (save_every is not None and step % save_every == 0)
                        or (last and save_last)
                        or stopped_by
                    ):
                        flush(step)
                        save(step_checkpoint_path(ckpt_dir, step), step, epoch, position)
                        if lead and keep_last_n is not None:
                            prune_checkpoints(ckpt_dir, keep_last_n)
                    bar.advance(step)
                    t_next = time.perf_counter()
                    if step > 1:
                        timing["data_s"] += t_call - t_end
                        timing["step_call_s"] += t_ret - t_call
                        timing["other_s"] += t_next - t_ret
                        timing["steps"] += 1
                    t_end = t_next
                    if last or stopped_by:
                        break
                flush(step)
                if stopped_by or (max_steps is not None and step >= max_steps):
                    break
                epoch += 1
                position = 0
        finally:
            if lead:
                close_loggers(sinks)
    if stopped_by:
        assert ckpt_dir is not None
        where = step_checkpoint_path(ckpt_dir, step)
        if lead:
            print(
                f"redcoast: {stopped_by} received; stopped after step {step} and saved "
                f"{where}. Run again with resume=True to continue.",
                file=sys.stderr,
                flush=True,
            )
        raise SystemExit(0)
    n = max(1, timing.pop("steps"))
    history["timing"] = {k: v / n for k, v in timing.items()}
    return FitResult(model=model, opt_state=opt_state, step=step, history=history)
