"""Where metrics go: a progress bar, `metrics.jsonl`, and optional TensorBoard / wandb sinks.

A logger is any callable `(metrics: dict, step: int) -> None`. Loggers that hold a
resource also have a `close()` method, which `fit` calls when training ends. All
of this runs on the host with plain Python floats: `fit` fetches the device values
once per logging interval, never per call here.
"""

from __future__ import annotations

import errno
import importlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType, TracebackType
from typing import Any

import jax

from .._progress import Progress, rate

Logger = Callable[[dict[str, Any], int], None]
"""`(metrics, step) -> None`."""

STEP_TOKENS = "_step_tokens"
"""The metric a step adds with its count of tokens; records show `tokens_per_s` instead."""


def _import_extra(module: str, extra: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"this logger needs {module!r}, which is not installed; "
            f"install it with `pip install 'redcoast[{extra}]'`."
        ) from e


def _json_value(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def jsonl_logger(path: str | os.PathLike[str]) -> Logger:
    """Append one JSON line `{"step": step, **metrics}` per call to `path`.

    The file is opened and closed on every call, so nothing leaks if training dies
    and another process can tail it. Each line goes out in one `write` to a file
    opened for appending, so a reader never sees half of one next to a whole other;
    only a write cut short (disk full, power loss) can leave a torn last line, which
    `read_jsonl` skips. Non-finite floats are written as strings (`"nan"`, `"inf"`)
    to keep every line valid JSON.

    Args:
        path: the `.jsonl` file; its folder is created if needed.

    Returns:
        The logger.

    Example:
        >>> log = jsonl_logger("runs/x/metrics.jsonl")
        >>> log({"loss": 0.5, "lr": 1e-3}, 10)
    """
    path = os.fspath(path)

    def log(metrics: dict[str, Any], step: int) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        record = {"step": int(step), **{k: _json_value(v) for k, v in metrics.items()}}
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            written = os.write(fd, line)
            if written != len(line):  # a regular file takes all of it unless the disk is full
                raise OSError(errno.ENOSPC, f"wrote {written} of {len(line)} bytes", path)
        finally:
            os.close(fd)

    return log


def read_jsonl(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], bool]:
    """The records of a `.jsonl` file that `jsonl_logger` wrote, and whether its end is torn.

    A last line that is not complete JSON is what a write cut short leaves (the disk
    filled, the machine lost power); it is skipped with a warning naming the file
    and line. A bad line anywhere else is damage redcoast did not cause, and an
    error.

    Args:
        path: the file.

    Returns:
        `(records, unfinished)`: every complete record in order, and whether the
        file ends in anything but a whole line (a torn line, or a last record
        without its newline), which a writer must rewrite before appending to it.

    Raises:
        ValueError: a line other than the last is not a JSON object; the message
            names the file and the line.

    Example:
        >>> records, unfinished = read_jsonl("runs/x/metrics.jsonl")
    """
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip(b" \t\r\0")]
    records: list[dict[str, Any]] = []
    for position, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
            continue
        if position == len(numbered) - 1:
            warnings.warn(
                f"{os.fspath(path)}: line {number} is not complete JSON, the end of a write "
                f"cut short (disk full, power loss); skipping it: {line[:80]!r}",
                stacklevel=2,
            )
            return records, True
        raise ValueError(
            f"{os.fspath(path)}: line {number} of {len(lines)} is not a JSON object "
            f"({line[:80]!r}). Only a last line can be torn by an interrupted write; "
            "repair or delete this line (or the file, losing the history) and run again."
        )
    return records, bool(lines[-1])


class _TensorBoard:
    def __init__(self, logdir: str, **kwargs: Any):
        self._writer = _import_extra("tensorboardX", "tensorboard").SummaryWriter(logdir, **kwargs)

    def __call__(self, metrics: dict[str, Any], step: int) -> None:
        for k, v in metrics.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                self._writer.add_scalar(k, v, step)

    def close(self) -> None:
        self._writer.close()


def tensorboard_logger(logdir: str | os.PathLike[str], **kwargs: Any) -> Logger:
    """Write every numeric metric as a TensorBoard scalar (needs the `tensorboard` extra).

    Args:
        logdir: the event folder.
        **kwargs: passed to `tensorboardX.SummaryWriter`.

    Returns:
        The logger, with a `close()` method that `fit` calls at the end.

    Example:
        >>> rc.fit(..., loggers=[tensorboard_logger("runs/x/tb")])
    """
    return _TensorBoard(os.fspath(logdir), **kwargs)


class _Wandb:
    def __init__(self, **init_kwargs: Any):
        self._wandb = _import_extra("wandb", "wandb")
        self._run = self._wandb.init(**init_kwargs)

    def __call__(self, metrics: dict[str, Any], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def wandb_logger(**init_kwargs: Any) -> Logger:
    """Log every metric to Weights & Biases (needs the `wandb` extra).

    Args:
        **init_kwargs: passed to `wandb.init` (`project=`, `name=`, `config=`, ...).

    Returns:
        The logger, with a `close()` method (finishing the run) that `fit` calls.

    Example:
        >>> rc.fit(..., loggers=[wandb_logger(project="redcoast-demo")])
    """
    return _Wandb(**init_kwargs)


def close_loggers(loggers: Iterable[Logger]) -> None:
    """Call `close()` on every logger that has one.

    Args:
        loggers: the loggers given to `fit`.

    Example:
        >>> close_loggers([jsonl_logger("m.jsonl"), tensorboard_logger("tb")])
    """
    for logger in loggers:
        close = getattr(logger, "close", None)
        if callable(close):
            close()


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def describe_speed(metrics: Mapping[str, Any], *, steps: bool = True) -> list[str]:
    """`12,345 tokens/s`, `4.76 steps/s` (or `36.7 s/step`, `_progress.rate`), `MFU
    31%`: what a record says of the speed; the step rate left out when not `steps`."""
    parts = []
    if isinstance(metrics.get("tokens_per_s"), float):
        parts.append(f"{metrics['tokens_per_s']:,.0f} tokens/s")
    if steps and isinstance(metrics.get("step_s"), float) and metrics["step_s"] > 0:
        parts.append(rate(1 / metrics["step_s"], "step"))
    if isinstance(metrics.get("mfu"), float):
        parts.append(f"MFU {100 * metrics['mfu']:.1f}%")
    return parts


def median_speed(records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """The median `tokens_per_s`, `step_s` and `mfu` of a run's logged records.

    Args:
        records: `FitResult.history["train"]`.

    Returns:
        Each of the three that the records have.

    Example:
        >>> median_speed(result.history["train"])
        {'tokens_per_s': 41234.5, 'step_s': 0.0124}
    """
    records = list(records)
    out = {}
    for key in ("tokens_per_s", "step_s", "mfu"):
        values = sorted(r[key] for r in records if isinstance(r.get(key), float))
        if values:
            mid = len(values) // 2
            out[key] = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return out


class ProgressBar:
    """Progress over optimizer steps with the latest loss, learning rate and speed.

    A rich bar when stdout is a terminal; otherwise a line every
    `REDCOAST_PROGRESS_SECONDS` (30) and at the end (`redcoast._progress.Progress`).
    Use as a context manager; when `enabled` is false every method does nothing, so
    callers need no branches for non-zero processes.

    Args:
        total: the number of steps, or None when unknown.
        enabled: show progress (normally `jax.process_index() == 0 and progress`).
        description: the label on the left.
        completed: steps already done (when resuming).
        **how: `live`, `seconds`, `clock`, as `Progress` takes them.

    Example:
        >>> with ProgressBar(100) as bar:
        ...     for step in range(1, 101):
        ...         bar.advance(step)
        ...         bar.show({"loss": 0.1, "lr": 1e-3})
    """

    def __init__(
        self,
        total: int | None,
        *,
        enabled: bool = True,
        description: str = "train",
        completed: int = 0,
        **how: Any,
    ):
        self._progress = Progress(
            description, total, unit="step", enabled=enabled, completed=completed, **how
        )
        self._latest: dict[str, Any] = {}

    def __enter__(self) -> ProgressBar:
        self._progress.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._progress.__exit__(exc_type, exc, tb)

    def advance(self, step: int) -> None:
        """Mark `step` optimizer steps as done (dispatched: the devices may still run them)."""
        self._progress.update(step)

    def show(self, metrics: Mapping[str, Any]) -> None:
        """Show `loss`, `lr` (and eval metrics, if present) and the speed next to the bar.

        The bar's rate is the record's `step_s`, measured over steps the devices
        finished: the bar's own count moves as steps are dispatched, which can run
        ahead of the devices by the steps between two records.
        """
        keys = ("loss", "lr", "eval_loss", "tokens_per_s", "step_s", "mfu")
        self._latest.update({k: metrics[k] for k in keys if k in metrics})
        shown = [f"{k} {_fmt(self._latest[k])}" for k in keys[:3] if k in self._latest]
        info = "  ".join(shown + describe_speed(self._latest, steps=False))
        step_s = self._latest.get("step_s")
        per_second = 1 / step_s if isinstance(step_s, float) and step_s > 0 else None
        self._progress.update(self._progress.done, info, rate=per_second)


def _nonfinite_error(step: int, epoch: int, metrics: Mapping[str, Any]) -> FloatingPointError:
    loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
    if not math.isfinite(loss):
        what = f"the loss is {loss}"
    elif not math.isfinite(norm):
        what = f"the gradient norm is {norm} (the loss, {loss:.4g}, is finite)"
    else:
        what = "an updated parameter is not finite (the loss and gradient norm are)"
    return FloatingPointError(
        f"step {step} (epoch {epoch}): {what}; training stopped before anything of that "
        "step was saved. Lower the learning rate or check the data for that step, or pass "
        "on_nonfinite='skip' to skip such updates."
    )


class MetricsBuffer:
    """The device metrics of recent steps, fetched in one transfer per flush, then logged.

    Reading a step's metrics waits for that step, so `fit` adds every step's metrics
    here and flushes once per logging interval, one step behind the devices.

    Args:
        emit: `(record, step) -> None`, called with the record of the last step of
            each flush (the sinks and the progress bar).
        examples_per_step: the global batch, for `examples_per_s`.
        raise_nonfinite: raise `FloatingPointError` naming the first step whose loss,
            gradient norm or parameters were not finite.
        step: the step training starts from, for the first rate.
        records: the list the logged records are appended to (`history["train"]`).
        flops_per_step: FLOPs one step runs on each device (`throughput.step_flops`).
        peak_flops: a device's peak FLOP/s; with `flops_per_step`, records get `mfu`.
        clock: the time in seconds (tests pass a fake one).

    Each record holds the last step's metrics and, over the steps since the
    previous record, `steps_per_s`, `examples_per_s`, `step_s` (seconds per step),
    `tokens_per_s` (when the step counts tokens: `STEP_TOKENS`, see
    `throughput.step_tokens`) and `mfu` (FLOPs per second per device over the peak).

    Example:
        >>> buffer = MetricsBuffer(emit=print, examples_per_step=64, raise_nonfinite=True)
        >>> buffer.add(1, 0, metrics); buffer.flush(1)
    """

    def __init__(
        self,
        *,
        emit: Callable[[dict[str, Any], int], None],
        examples_per_step: int,
        raise_nonfinite: bool,
        step: int = 0,
        records: list[dict[str, Any]] | None = None,
        flops_per_step: float | None = None,
        peak_flops: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self._emit = emit
        self._flops = flops_per_step
        self._peak = peak_flops
        self._now = clock
        self._size = examples_per_step
        self._raise = raise_nonfinite
        self._pending: list[tuple[int, int, dict[str, Any]]] = []
        self._clock = (clock(), step)
        self.records: list[dict[str, Any]] = [] if records is None else records
        self.last: dict[str, Any] = {}

    def add(self, step: int, epoch: int, metrics: dict[str, Any]) -> None:
        """Keep `metrics` (device scalars) of `step` until the next flush."""
        self._pending.append((step, epoch, metrics))

    def flush(self, upto: int) -> None:
        """Fetch the metrics of the steps <= `upto`, check them, and log the last."""
        chunk = [p for p in self._pending if p[0] <= upto]
        if not chunk:
            return
        del self._pending[: len(chunk)]
        host = jax.device_get([m for _, _, m in chunk])
        if self._raise:
            for (s, e, _), m in zip(chunk, host, strict=True):
                if float(m.get("nonfinite", 0.0)):
                    raise _nonfinite_error(s, e, m)
        s, e, _ = chunk[-1]
        now = self._now()
        steps, seconds = s - self._clock[1], max(now - self._clock[0], 1e-9)
        rate = steps / seconds
        self._clock = (now, s)
        hidden = ("nonfinite", STEP_TOKENS)
        record = {"epoch": e, **{k: float(v) for k, v in host[-1].items() if k not in hidden}}
        if "skipped" in record:
            record["skipped"] = sum(float(m["skipped"]) for m in host)
        record.update(steps_per_s=rate, examples_per_s=rate * self._size)
        if steps > 0:
            record["step_s"] = seconds / steps
        if all(STEP_TOKENS in m for m in host):
            record["tokens_per_s"] = sum(float(m[STEP_TOKENS]) for m in host) / seconds
        if self._flops is not None and self._peak is not None:
            record["mfu"] = self._flops * rate / self._peak
        self.records.append({"step": s, **record})
        self.last = record
        self._emit(record, s)
