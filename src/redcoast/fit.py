"""`fit` and `predict`: the three callbacks, a mesh, and a loop of small parts.

`fit` validates its options, places the model, resumes when asked, and hands a
`LoopState` to `run_loop` with its behaviours as hooks: the metrics buffer (one
device-to-host transfer per logging interval, one step behind the devices),
evaluation, signal stops and checkpoints. A user's hooks run beside them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, ParamSpec

import equinox as eqx
import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from jaxtyping import PyTree

from .checkpoint import (
    checkpoint_state,
    fingerprint,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    step_checkpoint_path,
)
from .data import (
    Batch,
    CollateFn,
    Examples,
    barrier,
    batches,
    check_positive,
    global_batch_size,
    order_fingerprint,
)
from .evaluate import Evaluation, check_examples, inference, scalar_metrics
from .logging import Logger, MetricsBuffer, ProgressBar, close_loggers, jsonl_logger, read_jsonl
from .loop import Hook, LoopState, always, run_loop
from .mesh import make_mesh, mesh_shape
from .place import model_mesh, own_copy, place, release, replicate_strays
from .precision import cast, check_precision, param_dtype
from .step import LossFn, PredFn, donating_jit, jit_eval_first, predict_step, train_step
from .trainable import Trainable, frozen_mask, trainable_mask
from .workdir import hold_workdir


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


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """When `fit` writes `workdir/ckpts/step_XXXXXXXX` checkpoints, and how many it keeps.

    Attributes:
        every: save every this many steps.
        last: save after the last step (and when a signal stops the run).
        keep_last_n: keep only the newest this many `step_*` checkpoints of the run.

    Example:
        >>> rc.fit(..., workdir="runs/x", checkpointing=rc.Checkpointing(every=500, keep_last_n=3))
    """

    every: int | None = None
    last: bool = True
    keep_last_n: int | None = None

    def __post_init__(self) -> None:
        check_positive("Checkpointing.every", self.every)
        check_positive("Checkpointing.keep_last_n", self.keep_last_n)


# ----------------------------------------------------------------------------- predict


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
) -> list[Any]:
    """Run `pred_fn` over `examples` on every device; one output per example, in order.

    The last batch is padded (repeating the last example) and the padding dropped.
    Outputs are gathered from all processes, so every process gets the full list.
    The model's arrays are only read.

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

    Returns:
        A list with one output per example.

    Example:
        >>> labels = predict(model, test, collate_fn=collate_fn, per_device_batch_size=32,
        ...                  pred_fn=lambda m, b, k: jax.vmap(m)(b["x"]).argmax(-1),
        ...                  output_fn=int)
    """
    examples = check_examples(examples, "examples")
    mesh = mesh or model_mesh(model) or make_mesh(1)
    size = global_batch_size(mesh, per_device_batch_size)
    key = jax.random.key(seed)
    it = batches(
        examples, collate_fn=collate_fn, mesh=mesh, batch_size=size, shuffle=False, drop_last=False
    )
    first = next(it)
    model = place(model, mesh, example_call=lambda m: pred_fn(m, first.arrays, key))
    _, outputs = inference(
        model,
        itertools.chain([first], it),
        key=key,
        loss_step=None,
        pred_step=predict_step(pred_fn, precision=precision),
        output_fn=output_fn,
    )
    assert outputs is not None
    return outputs


# ----------------------------------------------------------------------------- the run's folder

_RUN_FILES = ("ckpts", "metrics.jsonl", "eval")


def _claim_workdir(workdir: str, *, resume: bool, overwrite: bool, lead: bool) -> None:
    """A workdir belongs to one run: refuse a fresh run where another run left its files."""
    if resume and overwrite:
        raise ValueError(
            "resume=True continues the run in workdir and overwrite=True deletes it; pass one."
        )
    found = [
        name
        for name in _RUN_FILES
        if os.path.isfile(os.path.join(workdir, name))
        or (os.path.isdir(os.path.join(workdir, name)) and os.listdir(os.path.join(workdir, name)))
    ]
    if resume or not found:
        return
    if not overwrite:
        raise FileExistsError(
            f"workdir {workdir} already holds a run ({', '.join(found)}). Pass resume=True to "
            "continue that run, overwrite=True to delete its checkpoints and logs and start "
            "afresh, or a new or empty workdir."
        )
    if lead:
        for name in found:
            path = os.path.join(workdir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    barrier("redcoast-claim-workdir")


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
    resumed run writes those steps again. So is a torn last line (skipped with a
    warning by `read_jsonl`), which the next line must not be appended to.
    """
    history: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    if not os.path.isfile(path):
        return history
    records, unfinished = read_jsonl(path)
    kept = [r for r in records if int(r.get("step", 0)) <= step]
    if lead and (unfinished or len(kept) != len(records)):
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, path)
    for r in kept:
        history["eval" if any(k.startswith("eval_") for k in r) else "train"].append(r)
    return history


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every part of one `fit` call shares."""

    mesh: Mesh
    size: int  # the global batch of one optimizer step
    seed: int
    key: Any
    root: str | None  # the workdir
    lead: bool  # process 0, which writes
    # epoch -> {"n_examples", "order"}: what a checkpoint records of the epoch's data.
    data: Callable[[int], dict[str, Any]] | None = None
    # With a trainable filter: its mask (checkpoints hold what it selects) and the
    # fingerprint of the frozen arrays, which a checkpoint records and resume checks.
    trainable: Any = None
    frozen: dict[str, Any] | None = None

    def saved_part(self, model: Any) -> Any:
        """What a checkpoint holds of `model`: its trainable arrays, or all of it."""
        return model if self.trainable is None else eqx.filter(model, self.trainable)

    @property
    def ckpts(self) -> str | None:
        return None if self.root is None else os.path.join(self.root, "ckpts")


def _resume(run: _Run, state: LoopState) -> tuple[LoopState, dict[str, Any]]:
    """The state of the newest checkpoint of the run, checked against its seed and batch."""
    history: dict[str, Any] = {"train": [], "eval": []}
    assert run.root is not None and run.ckpts is not None
    found = latest_checkpoint(run.ckpts)
    if found is None:
        return state, history
    _check_base(found, checkpoint_state(found).get("loop", {}).get("frozen"), run.frozen)
    # Loaded into the shardings of the freshly placed model and optimizer state.
    ckpt = load_checkpoint(found, like=run.saved_part(state.model), opt_state_like=state.opt_state)
    model = ckpt.model
    if run.trainable is not None:
        model = eqx.combine(model, eqx.filter(state.model, run.trainable, inverse=True))
    loop = ckpt.state.get("loop", {})
    if loop.get("seed") != run.seed or loop.get("global_batch_size") != run.size:
        raise ValueError(
            f"cannot resume step-exactly from {found}: it was saved with seed="
            f"{loop.get('seed')} and a global batch of {loop.get('global_batch_size')}, "
            f"this run has seed={run.seed} and a global batch of {run.size}. Use the same "
            "seed and per_device_batch_size x data shards x accumulate_grad_batches, or a "
            "new workdir."
        )
    _check_data(found, loop, run)
    best = state.best
    if best is not None and loop.get("best") and loop["best"]["metric"] == best.metric:
        best = dataclasses.replace(best, **loop["best"])
    history = _restore_history(os.path.join(run.root, "metrics.jsonl"), ckpt.step, run.lead)
    if run.lead:
        print(f"redcoast: resuming from {found} (step {ckpt.step}, epoch {loop['epoch']})")
    resumed = dataclasses.replace(
        state,
        model=model,
        opt_state=ckpt.opt_state,
        step=ckpt.step,
        epoch=int(loop["epoch"]),
        position=int(loop["position"]),
        best=best,
    )
    return resumed, history


def _check_base(found: Path, saved: dict[str, Any] | None, now: dict[str, Any] | None) -> None:
    """Refuse to resume a partly trained run on a frozen base other than its own."""
    if saved == now:
        return
    if saved is None:
        raise ValueError(
            f"cannot resume from {found}: it holds a whole model, saved by a run without "
            "trainable=, and this run trains part of the model. Resume without trainable=, "
            "or start the partial run in a new workdir."
        )
    if now is None:
        raise ValueError(
            f"cannot resume from {found}: it holds only the trainable arrays of a run with "
            "trainable=, on a frozen base of "
            f"{saved['arrays']} arrays ({saved['bytes']} bytes). Pass the same trainable= "
            "and the same base model."
        )
    raise ValueError(
        f"cannot resume from {found}: its trainable arrays were trained on another frozen "
        f"base ({saved['arrays']} arrays, {saved['bytes']} bytes, xxh3_64 "
        f"{saved['xxh3_64']}) than this run's ({now['arrays']} arrays, {now['bytes']} bytes, "
        f"xxh3_64 {now['xxh3_64']}). Pass the base model the run started from (the same "
        "weights, dtypes and trainable=), or a new workdir."
    )


def _check_data(found: Path, loop: dict[str, Any], run: _Run) -> None:
    """Refuse to resume on other data: the saved position would point into another order."""
    if "n_examples" not in loop or run.data is None:  # saved before redcoast recorded it
        return
    epoch = int(loop["epoch"])
    now = run.data(epoch)
    if now["n_examples"] != loop["n_examples"]:
        raise ValueError(
            f"cannot resume step-exactly from {found}: epoch {epoch} had "
            f"{loop['n_examples']} training examples when it was saved, and this run's "
            f"train_examples has {now['n_examples']}. The saved position ({loop['position']} "
            "batches into the epoch) would skip or repeat examples. Pass the same "
            "train_examples, or start afresh in a new workdir (or with overwrite=True)."
        )
    if now["order"] != loop["order"]:
        raise ValueError(
            f"cannot resume step-exactly from {found}: epoch {epoch}'s order of its "
            f"{now['n_examples']} examples (seed {run.seed}) is not the saved one (checksum "
            f"{now['order']}, saved {loop['order']}): NumPy shuffles them differently here "
            "(another NumPy version?). Resume with the NumPy that saved the run, or start "
            "afresh in a new workdir."
        )


def _report_stop(run: _Run, state: LoopState) -> None:
    if state.stop is None or not run.lead:
        return
    saved = "" if run.ckpts is None else f"; saved {step_checkpoint_path(run.ckpts, state.step)}"
    print(
        f"redcoast: stopped after step {state.step} ({state.stop}){saved}. Run again with "
        "resume=True to continue.",
        file=sys.stderr,
        flush=True,
    )


def _summary(state: LoopState, history: dict[str, Any], seconds: float) -> str:
    """One line on how the run ended: steps, time, and the last logged metrics."""
    shown = ("loss", "grad_norm", "lr")
    last = history["train"][-1] if history["train"] else {}
    parts = [f"{k} {last[k]:.4g}" for k in shown if isinstance(last.get(k), float)]
    if history["eval"]:
        evals = history["eval"][-1]
        parts += [f"{k} {v:.4g}" for k, v in evals.items() if k.startswith("eval_")]
    metrics = f": {', '.join(parts)}" if parts else ""
    return f"redcoast: {state.step} steps in {seconds:.1f} s{metrics}"


# ----------------------------------------------------------------------------- fit's hooks


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


def _eval_hook(
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


def _evaluator(
    run: _Run,
    evaluation: Evaluation,
    loss_fn: LossFn,
    collate_fn: CollateFn,
    batch_size: int,
    emit: Callable[[dict[str, Any], int], None],
    records: list[dict[str, Any]],
    precision: str,
) -> Callable[[LoopState], dict[str, float]]:
    """`state -> metrics`: one evaluation, logged, and written to `workdir/eval`."""
    eval_dir = None if run.root is None or not run.lead else os.path.join(run.root, "eval")
    mesh, key = run.mesh, run.key
    loss_step = functools.partial(jit_eval_first, loss_fn, precision=precision)
    pred_step = (
        None
        if evaluation.pred_fn is None
        else predict_step(evaluation.pred_fn, precision=precision)
    )

    def evaluate(s: LoopState) -> dict[str, float]:
        loss_metrics, outputs = inference(
            s.model,
            batches(
                evaluation.examples,
                collate_fn=collate_fn,
                mesh=mesh,
                batch_size=batch_size,
                shuffle=False,
                drop_last=False,
            ),
            key=key,
            loss_step=loss_step,
            pred_step=pred_step,
            output_fn=evaluation.output_fn,
        )
        metrics = dict(loss_metrics or {})
        if evaluation.metric_fn is not None:
            assert outputs is not None
            metrics.update(scalar_metrics(evaluation.metric_fn(evaluation.examples, outputs)))
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


def _saver(run: _Run, buffer: MetricsBuffer) -> Callable[[Path, LoopState], None]:
    """`(path, state) -> None`: a checkpoint that resumes this run step-exactly."""

    def save(path: Path, s: LoopState) -> None:
        loop = {
            "epoch": s.epoch,
            "position": s.position,
            "seed": run.seed,
            "global_batch_size": run.size,
            "best": None if s.best is None else dataclasses.asdict(s.best),
            **({} if run.data is None else run.data(s.epoch)),
            **({} if run.frozen is None else {"frozen": run.frozen}),
        }
        save_checkpoint(
            path,
            model=run.saved_part(s.model),
            opt_state=s.opt_state,
            step=s.step,
            loop=loop,
            rng=np.asarray(jax.random.key_data(run.key)),
            metrics=dict(buffer.last),
        )

    return save


def _checkpoint_hook(
    config: Checkpointing,
    ckpt_dir: str,
    *,
    save: Callable[[Path, LoopState], None],
    buffer: MetricsBuffer,
    lead: bool,
) -> Hook:
    """Save `step_*` checkpoints when due and on a stop; prune the run's old ones."""

    def fn(s: LoopState) -> None:
        buffer.flush(s.step)
        save(step_checkpoint_path(ckpt_dir, s.step), s)
        if lead and config.keep_last_n is not None:
            prune_checkpoints(ckpt_dir, config.keep_last_n)

    def due(s: LoopState) -> bool:
        periodic = config.every is not None and s.step % config.every == 0
        return periodic or (s.last and config.last) or s.stop is not None

    return Hook(fn, due)


def _stop_hook(caught: list[str], log_every: int) -> Hook:
    """Stop after a signal; in a multi-process run every process agrees, at logging steps."""

    def fn(s: LoopState) -> LoopState | None:
        if not _any_process(bool(caught)):
            return None
        why = f"{caught[0]} received" if caught else "a signal to another process"
        return dataclasses.replace(s, stop=why)

    def due(s: LoopState) -> bool:
        return s.stop is None and (jax.process_count() == 1 or s.step % log_every == 0 or s.last)

    return Hook(fn, due)


def _hooks(
    run: _Run,
    *,
    buffer: MetricsBuffer,
    log_every: int,
    evaluation: tuple[Evaluation, Callable[[LoopState], dict[str, float]]] | None,
    user: Sequence[Hook],
    caught: list[str],
    checkpointing: Checkpointing,
) -> list[Hook]:
    """fit's behaviours in order: logging, evaluation, the user's hooks, stops, checkpoints."""
    hooks = _log_hooks(buffer, log_every)
    save = _saver(run, buffer)
    if evaluation is not None:
        best = None if run.ckpts is None else functools.partial(save, Path(run.ckpts, "best"))
        hooks.append(
            _eval_hook(evaluation[0], evaluate=evaluation[1], buffer=buffer, save_best=best)
        )
    hooks += user
    if run.ckpts is not None:
        hooks.append(_stop_hook(caught, log_every))
        hooks.append(
            _checkpoint_hook(checkpointing, run.ckpts, save=save, buffer=buffer, lead=run.lead)
        )
    return hooks


def _check_options(
    n_epochs: int | None,
    max_steps: int | None,
    log_every: int,
    on_nonfinite: str,
    workdir: Any,
    checkpointing: Checkpointing | None,
    *,
    resume: bool,
    overwrite: bool,
) -> None:
    if n_epochs is None and max_steps is None:
        raise ValueError("fit needs n_epochs or max_steps (or both) to know when to stop.")
    check_positive("n_epochs", n_epochs)
    check_positive("max_steps", max_steps)
    check_positive("log_every", log_every, optional=False)
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


def _epochs(
    train_examples: Examples | Callable[[int], Examples],
    *,
    collate_fn: CollateFn,
    mesh: Mesh,
    size: int,
    seed: int,
) -> tuple[
    Batch, Callable[[int, int], tuple[Iterator[Batch], int]], Callable[[int], dict[str, Any]]
]:
    """The first batch (collated once, to trace `loss_fn`), `(epoch, start) -> batches`, and
    `epoch -> {"n_examples", "order"}` (its length and `order_fingerprint`) for checkpoints."""

    def examples_of(epoch: int) -> Examples:
        examples = train_examples(epoch) if callable(train_examples) else train_examples
        examples = check_examples(examples, f"train_examples (epoch {epoch})")
        if len(examples) < size:
            raise ValueError(
                f"train_examples has {len(examples)} examples in epoch {epoch}, fewer than one "
                f"global batch of {size} (per_device_batch_size x {mesh_shape(mesh)[0]} data "
                "shards x accumulate_grad_batches); the partial batch would be dropped. Use "
                "a smaller per_device_batch_size."
            )
        return examples

    # Asked for once an epoch: train_examples(epoch) may build the examples anew on each call.
    held: dict[int, Examples] = {0: examples_of(0)}

    def examples(epoch: int) -> Examples:
        if epoch not in held:
            held.clear()
            held[epoch] = examples_of(epoch)
        return held[epoch]

    first_examples = held[0]
    kw: dict[str, Any] = {"collate_fn": collate_fn, "mesh": mesh, "batch_size": size, "seed": seed}
    first = next(batches(first_examples, epoch=0, **kw))

    def epoch_batches(epoch: int, start: int) -> tuple[Iterator[Batch], int]:
        those = examples(epoch)
        if epoch == 0 and start == 0:
            it = itertools.chain([first], batches(those, epoch=0, start=1, **kw))
        else:
            it = batches(those, epoch=epoch, start=start, **kw)
        return it, len(those) // size

    @functools.lru_cache(maxsize=2)
    def data(epoch: int) -> dict[str, Any]:
        n = len(examples(epoch))
        return {"n_examples": n, "order": order_fingerprint(n, seed=seed, epoch=epoch)}

    return first, epoch_batches, data


def _total_steps(
    train_examples: Any, n_epochs: int | None, max_steps: int | None, size: int
) -> int | None:
    if callable(train_examples) or n_epochs is None:
        return max_steps
    per_run = n_epochs * (len(train_examples) // size)
    return per_run if max_steps is None else min(max_steps, per_run)


_P = ParamSpec("_P")


def _one_live_run(fit: Callable[_P, FitResult]) -> Callable[_P, FitResult]:
    """`fit` holding its workdir (`hold_workdir`) from before its first read to its return."""

    @functools.wraps(fit)
    def holding(*args: _P.args, **kwargs: _P.kwargs) -> FitResult:
        workdir: Any = kwargs.get("workdir")
        if workdir is None:
            return fit(*args, **kwargs)
        with hold_workdir(workdir):
            return fit(*args, **kwargs)

    return holding


# Over 80 lines: 26 of them are the signature, and the body is one sequence (options,
# placement, resume, the step, the hooks, the loop) that reads best in one place.
@_one_live_run
def fit(
    model: PyTree,
    optimizer: optax.GradientTransformation,
    train_examples: Examples | Callable[[int], Examples],
    *,
    collate_fn: CollateFn,
    loss_fn: LossFn,
    mesh: Mesh | None = None,
    per_device_batch_size: int,
    n_epochs: int | None = None,
    max_steps: int | None = None,
    accumulate_grad_batches: int = 1,
    evaluation: Evaluation | None = None,
    workdir: str | os.PathLike[str] | None = None,
    checkpointing: Checkpointing | None = None,
    resume: bool = False,
    overwrite: bool = False,
    seed: int = 0,
    hooks: Sequence[Hook] = (),
    loggers: Sequence[Logger] = (),
    progress: bool = True,
    log_every: int = 10,
    on_nonfinite: Literal["raise", "skip"] = "raise",
    opt_state: PyTree | None = None,
    donate: bool = False,
    schedule: Callable[[Any], Any] | None = None,
    fsdp: bool = False,
    precision: str = "fp32",
    data_parallel: Literal["jit", "shard_map"] = "jit",
    trainable: Trainable = None,
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
    are deleted, so the run holds one copy of the model, as `rc.plan` counts.

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

    A workdir is held by one live run: before reading anything there, `fit` (on
    process 0) takes an OS lock on `workdir/.redcoast.lock`, released when `fit`
    returns or raises, or by the kernel when the process dies. Another `fit` given
    the workdir meanwhile, fresh or resuming, stops at once with
    `WorkdirInUseError` naming the holder's process id and host; a killed run's
    workdir can be resumed at once.

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
        mesh: from `make_mesh`; defaults to the model's mesh, else `make_mesh(1)`.
        per_device_batch_size: rows per data-parallel device per micro-batch.
        n_epochs: epochs to run; at least one of `n_epochs` and `max_steps`.
        max_steps: optimizer steps to run (stops mid-epoch if reached).
        accumulate_grad_batches: micro-batches per optimizer step.
        evaluation: what to evaluate on and when (`Evaluation`).
        workdir: the run's folder, written by process 0.
        checkpointing: when to save `step_*` checkpoints (`Checkpointing`); needs a
            workdir, where the default is `Checkpointing()` (after the last step).
        resume: continue from the newest checkpoint in `workdir/ckpts`, if any.
        overwrite: delete another run's checkpoints and logs found in `workdir`.
        seed: the one seed for shuffling and the step keys.
        hooks: `Hook`s (e.g. `every(n, fn)`) run after the built-in logging and
            evaluation, before checkpointing; a hook may return the state to go on
            with (setting `stop` ends the run after a checkpoint). In a
            multi-process run every process must take the same decisions.
        loggers: callables `(metrics, step) -> None`, called on process 0.
        progress: show a progress bar on process 0, and one line at the end: steps,
            seconds and the last logged metrics.
        log_every: fetch metrics from the devices and log every this many steps (and
            at epoch ends, evaluations and checkpoints).
        on_nonfinite: the step checks the loss, the gradient norm and the updated
            parameters. `"raise"` stops with an error naming the first step where
            one was not finite, within `log_every + 1` steps and before any
            checkpoint of it is written; `"skip"` leaves the model and optimizer
            state unchanged on such steps and counts them in `skipped`.
        opt_state: an optimizer state to continue from; `optimizer.init` otherwise.
        donate: hand `model` (and `opt_state`) over: their arrays are used in place,
            or deleted once placed elsewhere, never copied; use `FitResult.model`
            afterwards. For a model that fills the devices, e.g. from `sharded_init`.
        schedule: `count -> lr`, to log the learning rate.
        fsdp: when `fit` places the model, split its weights over the data axis as
            well (ZeRO-3: parameters, gradients and optimizer state divided by every
            device; see `sharding_plan`). A model already on `mesh` (from
            `sharded_init`, say) keeps its layout.
        precision: `"fp32"`, `"bf16"` (float32 master weights, bfloat16 compute) or
            `"pure-bf16"` (the model is cast to bfloat16 before `optimizer.init`); see
            `train_step`. Evaluation runs in the same precision.
        data_parallel: `"jit"` (XLA partitions the global step; any mesh) or
            `"shard_map"` (an explicit per-device step with the gradients averaged
            over `"data"`; the model is replicated, so the mesh has one model shard
            and `fsdp` is off); see `train_step`.
        trainable: which arrays train (see `rc.trainable_mask`): `None` for every
            floating-point array, or a pytree of bools, a predicate on leaves, or
            path globs such as `"*.q_proj.*"`; `rc.lora.trainable(model)` selects a
            LoRA model's adapters. Frozen arrays get no gradient, optimizer state or
            update, and come back bit-identical; they may be stored in a lower
            precision than the trainable ones (`rc.cast` them before `fit`).

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
    options = (n_epochs, max_steps, log_every, on_nonfinite, workdir, checkpointing)
    _check_options(*options, resume=resume, overwrite=overwrite)
    check_precision(precision)
    if data_parallel == "shard_map" and fsdp:
        raise ValueError(
            "data_parallel='shard_map' keeps a whole copy of the model on every device, "
            "and fsdp=True splits it over the data axis: use one or the other."
        )
    mesh = mesh or model_mesh(model) or make_mesh(1)
    size = global_batch_size(mesh, per_device_batch_size, accumulate_grad_batches)
    root = None if workdir is None else os.fspath(workdir)
    run = _Run(mesh, size, seed, jax.random.key(seed), root, jax.process_index() == 0)
    if root is not None:
        _claim_workdir(root, resume=resume, overwrite=overwrite, lead=run.lead)
    first, epoch_batches, data = _epochs(
        train_examples, collate_fn=collate_fn, mesh=mesh, size=size, seed=seed
    )
    run = dataclasses.replace(run, data=data)
    placed = place(model, mesh, example_call=lambda m: loss_fn(m, first.arrays, run.key), fsdp=fsdp)
    if precision == "pure-bf16":
        placed = cast(placed, param_dtype(precision))
    mask = trainable_mask(placed, trainable)
    if trainable is not None:
        frozen = fingerprint(eqx.filter(placed, frozen_mask(placed, mask)))
        run = dataclasses.replace(run, trainable=mask, frozen=frozen)
    opt = optimizer.init(eqx.filter(placed, mask)) if opt_state is None else opt_state
    best = None if evaluation is None else evaluation.best()
    state = LoopState(placed, replicate_strays(opt, mesh), best=best)
    history: dict[str, Any] = {"train": [], "eval": []}
    if resume:
        state, history = _resume(run, state)
    # The step donates what it is given: the caller's own buffers only when handed over.
    given = (model, opt_state)
    if donate:
        release(given, keep=(state.model, state.opt_state))
    else:
        state = dataclasses.replace(
            state, model=own_copy(state.model, given), opt_state=own_copy(state.opt_state, given)
        )
    core = train_step(
        loss_fn,
        optimizer,
        accumulate_grad_batches=accumulate_grad_batches,
        mesh=mesh,
        data_parallel=data_parallel,
        schedule=schedule,
        skip_nonfinite=on_nonfinite == "skip",
        precision=precision,
        trainable=mask,
        jit=False,
    )
    jitted = donating_jit(lambda m, o, b, k, s: core(m, o, b, jax.random.fold_in(k, s)))
    sinks = [*loggers] if root is None else [jsonl_logger(Path(root, "metrics.jsonl")), *loggers]
    total = _total_steps(train_examples, n_epochs, max_steps, size)
    with (
        ProgressBar(total, enabled=progress and run.lead, completed=state.step) as bar,
        _stop_requests(root is not None) as caught,
    ):

        def emit(record: dict[str, Any], at: int) -> None:
            if run.lead:
                for sink in sinks:
                    sink(record, at)
            bar.show(record)

        buffer = MetricsBuffer(
            emit=emit,
            examples_per_step=size,
            raise_nonfinite=on_nonfinite == "raise",
            step=state.step,
            records=history["train"],
        )
        evaluate = None
        if evaluation is not None:
            eval_size = global_batch_size(
                mesh, evaluation.per_device_batch_size or per_device_batch_size
            )
            evaluate = _evaluator(
                run, evaluation, loss_fn, collate_fn, eval_size, emit, history["eval"], precision
            )
        builtin = _hooks(
            run,
            buffer=buffer,
            log_every=log_every,
            evaluation=(evaluation, evaluate) if evaluation and evaluate else None,
            user=hooks,
            caught=caught,
            checkpointing=checkpointing or Checkpointing(),
        )
        try:
            state, history["timing"] = run_loop(
                state,
                step_fn=lambda m, o, b, s: jitted(m, o, b, run.key, np.int32(s)),
                epoch_batches=epoch_batches,
                hooks=[*builtin, always(lambda s: bar.advance(s.step))],
                n_epochs=n_epochs,
                max_steps=max_steps,
            )
            buffer.flush(state.step)
        finally:
            if run.lead:
                close_loggers(sinks)
    _report_stop(run, state)
    if progress and run.lead:
        print(_summary(state, history, time.perf_counter() - started), flush=True)
    if state.best is not None and (state.best.value is not None or history["eval"]):
        history["best"] = dataclasses.asdict(state.best)
    return FitResult(state.model, state.opt_state, state.step, history, stopped_by=state.stop)
