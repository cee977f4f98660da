"""Stopping a run on SIGTERM or SIGINT after its current step, every process together."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from .loop import Hook, LoopState

__all__ = ["stop_hook", "stop_requests"]


@contextlib.contextmanager
def stop_requests(enabled: bool) -> Iterator[list[str]]:
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


def stop_hook(caught: list[str], log_every: int) -> Hook:
    """Stop after a signal; in a multi-process run every process agrees, at logging steps."""

    def fn(s: LoopState) -> LoopState | None:
        if not _any_process(bool(caught)):
            return None
        why = f"{caught[0]} received" if caught else "a signal to another process"
        return dataclasses.replace(s, stop=why)

    def due(s: LoopState) -> bool:
        return s.stop is None and (jax.process_count() == 1 or s.step % log_every == 0 or s.last)

    return Hook(fn, due)
