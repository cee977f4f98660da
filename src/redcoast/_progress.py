"""Progress a person can follow: a bar in a terminal, a line at intervals in a log.

`fit`, `predict`, `rc.text.tokenize` and `redcoast plan` report through `Progress`.
When stdout is a terminal (or a notebook) rich draws a bar that updates in place.
Anywhere else (a file, a pipe, a scheduler's log) such a bar would appear only when
it ends, so a line is printed instead every `REDCOAST_PROGRESS_SECONDS` seconds (30
unless the environment says otherwise) and once at the end: what, how far, how
fast, the time left and the latest figures. `compiling` labels the wait for XLA,
`heartbeat` a wait with nothing to count, `while_silent` a stretch of someone else's
code that prints only now and then; all three say every interval that the wait goes
on. A rate is written one way everywhere (`rate`): `2.31 steps/s` at one or more a
second, `36.7 s/step` when slower.

Nothing global is installed: a `Progress` writes to stdout while it is open, and a
heartbeat's thread lives as long as its `with` block.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.errors import LiveError
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as _Rich
from rich.text import Text

from ._checks import positive_env
from ._units import fmt_bytes

__all__ = [
    "ENV_SECONDS",
    "Progress",
    "compiling",
    "counted",
    "duration",
    "elapsed",
    "heartbeat",
    "interactive",
    "rate",
    "while_silent",
]

ENV_SECONDS = "REDCOAST_PROGRESS_SECONDS"
"""Seconds between two progress lines when stdout is not a terminal (default 30)."""
_DEFAULT_SECONDS = 30.0
BYTES = "byte"
"""The unit whose counts are written as sizes (`12.3 MB`)."""


def interactive() -> bool:
    """Whether stdout is a terminal or a notebook, where a bar can update in place."""
    console = Console(file=sys.stdout)
    return console.is_terminal or console.is_jupyter


def line_seconds() -> float:
    """Seconds between progress lines: `REDCOAST_PROGRESS_SECONDS`, else 30."""
    seconds = positive_env(ENV_SECONDS, "a positive number of seconds, e.g. 30")
    return _DEFAULT_SECONDS if seconds is None else seconds


def duration(seconds: int | float) -> str:
    """`4s`, `3m 05s`, `2h 01m`: a duration as a log line shows it."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def elapsed(seconds: float) -> str:
    """`8.3 s` under a minute, `1m 42s` from one on: how long something took."""
    return f"{seconds:.1f} s" if seconds < 60 else duration(seconds)


def _plural(noun: str) -> str:
    return noun + ("es" if noun.endswith(("s", "sh", "ch", "x")) else "s")


def _noun(n: int | float, noun: str) -> str:
    """`noun` as it goes with the count `n`: `device` for 1, else `devices`, `processes`."""
    return noun if round(n) == 1 else _plural(noun)


def counted(n: int | float, noun: str) -> str:
    """`1 device`, `4 devices`, `1,024 tokens`: a count and its noun, in agreement."""
    return f"{round(n):,} {_noun(n, noun)}"


def _figure(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def rate(per_second: float, unit: str) -> str:
    """A rate, one way wherever it is shown: `2.31 steps/s` at one or more a second,
    `36.7 s/step` when slower; `BYTES` as a size a second (`1.2 MB/s`)."""
    if unit == BYTES:
        return f"{fmt_bytes(per_second)}/s"
    if per_second >= 1:
        figure = _figure(per_second)
        return f"{figure} {unit if figure == '1' else _plural(unit)}/s"
    return f"{_figure(1 / per_second)} s/{unit}"


def _count(n: int | float, unit: str) -> str:
    return fmt_bytes(n) if unit == BYTES else f"{round(n):,}"


class _Rate(ProgressColumn):
    """The rate the caller measured (`Progress.update(rate=...)`), else rich's estimate."""

    def __init__(self, unit: str):
        super().__init__()
        self._unit = unit

    def render(self, task: Task) -> Text:
        speed = task.fields.get("rate") or task.finished_speed or task.speed
        text = "" if not speed else rate(speed, self._unit)
        return Text(text, style="progress.data.speed")


class _Left(ProgressColumn):
    """The time left at the rate `_Rate` shows."""

    def render(self, task: Task) -> Text:
        speed = task.fields.get("rate") or task.speed
        if task.finished or task.total is None or not speed:
            return Text("")
        left = duration((task.total - task.completed) / speed)
        return Text(f"ETA {left}", style="progress.remaining")


class Progress:
    """How far a task has come, shown while it runs, on process 0 only (callers decide).

    In a terminal: a rich bar with the count, rate, time left and `info`. Elsewhere:
    `"{what}: 120/300 steps (40%), 2.31 steps/s, ETA 1m 17s; {info}"` every
    `seconds` (see `line_seconds`) and at the end. When another rich display is
    already live (a `predict` inside a `fit` hook), lines are printed instead, above it.
    The rate is the count's own over the last interval, unless the caller gives a
    better one: `fit` counts a step when it is dispatched, and gives the rate of the
    steps the devices finished.

    Args:
        what: the label (`"train"`, `"predict"`, `"tokenize corpus/"`).
        total: the count at the end, or None when unknown.
        unit: what is counted, singular (`"step"`, `"example"`); `BYTES` writes sizes.
        enabled: show anything at all (normally `progress and jax.process_index() == 0`).
        completed: the count already done (a resumed run).
        transient: in a terminal, remove the bar when done.
        live: draw a bar (True) or print lines (False); default: whether stdout is a
            terminal (`interactive`).
        seconds: between two lines; default `line_seconds()`.
        clock: the time in seconds (tests pass a fake one).

    Example:
        >>> with Progress("train", 300, unit="step") as p:
        ...     for step in range(1, 301):
        ...         p.update(step, info="loss 2.31")
    """

    def __init__(
        self,
        what: str,
        total: int | float | None,
        *,
        unit: str = "step",
        enabled: bool = True,
        completed: int | float = 0,
        transient: bool = False,
        live: bool | None = None,
        seconds: int | float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.what, self.total, self.unit = what, total, unit
        self._enabled = enabled
        self._done = completed
        self._info = ""
        self._rate: float | None = None  # the caller's, when it gives one
        self._clock = clock
        self._seconds = seconds
        self._bar: _Rich | None = None
        self._task: object = None
        self._transient = transient
        self._live = live
        self._open = False
        # Lines: when and where the last one was printed, and whether one is due at the end.
        self._last = (0.0, completed)
        self._printed: int | float | None = None  # the count of the last line; None before one

    def __enter__(self) -> Progress:
        if not self._enabled:
            return self
        if self._live if self._live is not None else interactive():
            self._bar = self._rich()
            try:
                self._bar.start()
            except LiveError:  # another bar is on screen: lines go above it
                self._bar = None
        if self._bar is None and self._seconds is None:
            self._seconds = line_seconds()
        self._last = (self._clock(), self._done)
        self._open = True
        return self

    def _rich(self) -> _Rich:
        count = DownloadColumn() if self.unit == BYTES else MofNCompleteColumn()
        bar = _Rich(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            count,
            _Rate(self.unit),
            _Left(),
            TextColumn("{task.fields[info]}"),
            transient=self._transient,
            refresh_per_second=4,
        )
        self._task = bar.add_task(
            self.what, total=self.total, completed=int(self._done), info="", rate=None
        )
        return bar

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._open:
            return
        self._open = False
        if self._bar is not None:
            self._bar.stop()
        elif self._printed != self._done:  # the end, unless the last line showed it
            self._line(self._clock())

    @property
    def done(self) -> int | float:
        """The count done so far."""
        return self._done

    def update(
        self, completed: int | float, info: str | None = None, rate: float | None = None
    ) -> None:
        """Set the count done (and the figures shown beside it, and the rate a second
        the caller measured, when given)."""
        if not self._open:
            return
        self._done = completed
        if info is not None:
            self._info = info
        if rate is not None:
            self._rate = rate
        if self._bar is not None:
            self._bar.update(self._task, completed=completed, info=self._info, rate=self._rate)  # type: ignore[arg-type]
            return
        now = self._clock()
        assert self._seconds is not None
        if now - self._last[0] >= self._seconds:
            self._line(now)

    def advance(self, by: int | float, info: str | None = None) -> None:
        """Add `by` to the count done."""
        self.update(self._done + by, info)

    def _line(self, now: float) -> None:
        then, before = self._last
        per_second = self._rate or ((self._done - before) / (now - then) if now > then else None)
        unit = "" if self.unit == BYTES else f" {_noun(self.total or self._done, self.unit)}"
        if self.total:
            head = f"{_count(self._done, self.unit)}/{_count(self.total, self.unit)}{unit}"
            head += f" ({100 * self._done / self.total:.0f}%)"
        else:
            head = f"{_count(self._done, self.unit)}{unit}"
        parts = [head]
        if per_second:
            parts.append(rate(per_second, self.unit))
            if self.total and self._done < self.total:
                parts.append(f"ETA {duration((self.total - self._done) / per_second)}")
        info = f"; {self._info}" if self._info else ""
        print(f"{self.what}: {', '.join(parts)}{info}", flush=True)
        self._last = (now, self._done)
        self._printed = self._done


def _terminal(live: bool | None) -> bool:
    return live if live is not None else interactive()


@contextlib.contextmanager
def _spinner(what: str) -> Iterator[None]:
    """A spinner and the time elapsed, in a terminal, while the block runs (nothing
    when another rich display is live: its lines already say that work goes on)."""
    spinner = _Rich(SpinnerColumn(), TextColumn(what), TimeElapsedColumn(), transient=True)
    spinner.add_task(what, total=None)
    try:
        spinner.start()
    except LiveError:
        yield
        return
    try:
        yield
    finally:
        spinner.stop()


@contextlib.contextmanager
def _every(
    seconds: float, say: Callable[[float], None], poll: float | None = None
) -> Iterator[None]:
    """`say(seconds since the start)` every `seconds` (or, with `poll`, asked every
    `poll` seconds), from a thread that ends with the block."""
    done = threading.Event()
    started = time.monotonic()

    def beat() -> None:
        while not done.wait(seconds if poll is None else poll):
            say(time.monotonic() - started)

    thread = threading.Thread(target=beat, name="redcoast-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextlib.contextmanager
def compiling(
    what: str,
    *,
    enabled: bool = True,
    live: bool | None = None,
    seconds: int | float | None = None,
) -> Iterator[None]:
    """Label the block with the time it took: `compiling the train step… 12.3 s`.

    In a log the label comes first and its time after; a block longer than `seconds`
    (`line_seconds()`) says so in between, `what: 30s so far`, then ends with
    `what… 1m 12s`. In a terminal a spinner shows the time while it lasts. Nothing
    when not `enabled`.
    """
    if not enabled:
        yield
        return
    terminal = _terminal(live)
    opened = not terminal  # the label's line, left open for its time
    if opened:
        print(f"{what}…", end="", flush=True)

    def say(t: float) -> None:
        nonlocal opened
        print(("\n" if opened else "") + f"{what}: {duration(t)} so far", flush=True)
        opened = False

    def end(text: str) -> None:
        print(f" {text}" if opened else f"{what}… {text}", flush=True)

    every = line_seconds() if seconds is None else seconds
    started = time.perf_counter()
    try:
        with _spinner(what) if terminal else _every(every, say):
            yield
    except BaseException:
        end("failed")
        raise
    end(elapsed(time.perf_counter() - started))


@contextlib.contextmanager
def heartbeat(
    what: str, *, enabled: bool = True, live: bool | None = None, seconds: int | float | None = None
) -> Iterator[None]:
    """Show that `what` is still going while the block runs, with nothing to count.

    In a terminal a spinner and the time elapsed; elsewhere a line `what: 1m 00s so
    far` every `seconds` (`line_seconds()` by default), from a thread that ends with
    the block.
    """
    if not enabled:
        yield
        return
    if _terminal(live):
        with _spinner(what):
            yield
        return
    every = line_seconds() if seconds is None else seconds
    with _every(every, lambda t: print(f"{what}: {duration(t)} so far", flush=True)):
        yield


class _Watched:
    """stdout, with the time of its last write and whether that write ended a line."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.last = time.monotonic()
        self.line_open = False

    def write(self, text: str) -> int:
        if text:
            self.last = time.monotonic()
            self.line_open = not text.endswith("\n")
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def while_silent(
    what: str, *, live: bool | None = None, seconds: int | float | None = None
) -> Iterator[None]:
    """Say `what: still working, 2m 30s so far` whenever the block has printed nothing
    for `seconds` (`line_seconds()`): for code that reports its own progress only in
    places, such as an example's `main` building its model before training.

    Only when stdout is a log: in a terminal the block's own bars and spinners are
    live displays, which a spinner of this one would turn into lines. A line the
    block left open (a `compiling` label) is its own: nothing is added to it.
    """
    if _terminal(live):
        yield
        return
    every = line_seconds() if seconds is None else seconds
    watched = _Watched(sys.stdout)

    def say(t: float) -> None:
        if not watched.line_open and time.monotonic() - watched.last >= every:
            print(f"{what}: still working, {duration(t)} so far", flush=True)

    # Checked every half second (or sooner for short intervals): a silence is told
    # within that of its end.
    beats = _every(every, say, poll=min(every, 1.0) / 2)
    with contextlib.redirect_stdout(watched), beats:  # type: ignore[arg-type]
        yield
