"""The watchdog: a process that dies or hangs stops every other one, with a message.

Every process sends a heartbeat through the coordinator's key-value store and
process 0 watches them; when one falls silent every survivor exits with
`EXIT_PEER_LOST`, naming it. An uncaught exception ends its process at once, so
its silence is seen. `rc.distributed.initialize` starts it when asked (see
`distributed.py`).
"""

import atexit
import contextlib
import itertools
import os
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import NoReturn

import jax

from .._jax_private import coordination_client
from ._launch import ENV_HEARTBEAT

__all__ = ["EXIT_PEER_LOST", "silent_peers", "start_watchdog"]

EXIT_PEER_LOST = 75
"""Exit code of a survivor that stops because another process was lost (EX_TEMPFAIL:
the run can be resumed from its last checkpoint)."""


_ALIVE = "redcoast/alive/"
_LOST = "redcoast/lost/"
_DONE = "done"
# Error texts of a collective whose peer vanished (gloo over TCP, the coordination service).
_TRANSPORT = re.compile(r"gloo|connection|socket|peer|unavailable|heartbeat", re.IGNORECASE)


def start_watchdog(rank: int, n: int, coordinator: str | None, timeout: float) -> None:
    """Start the heartbeat thread and make uncaught exceptions end the process at once.

    Args:
        rank: this process's index.
        n: the number of processes.
        coordinator: the coordinator's address, named when it cannot be reached.
        timeout: seconds of silence after which a process is declared lost.
    """
    _exit_fast_on_errors(rank, n, timeout)
    _watch_peers(rank, n, coordinator, timeout)


def _names(ranks: Sequence[int]) -> str:
    return f"process {ranks[0]}" if len(ranks) == 1 else f"processes {', '.join(map(str, ranks))}"


def _stop(rank: int, n: int, why: str, *, linger: float = 0.0) -> NoReturn:
    """Say why on stderr, wait `linger` seconds, and end the process with `EXIT_PEER_LOST`."""
    sys.stdout.flush()
    sys.stderr.write(
        f"redcoast: process {rank} of {n} is stopping (exit code {EXIT_PEER_LOST}): {why}\n"
    )
    sys.stderr.flush()
    time.sleep(linger)
    os._exit(EXIT_PEER_LOST)


def silent_peers(
    entries: Sequence[tuple[str, str]],
    seen: Mapping[int, tuple[str, float]],
    now: float,
    timeout: float,
) -> tuple[list[int], dict[int, tuple[str, float]]]:
    """Which peers have not advanced their heartbeat for `timeout` seconds.

    Args:
        entries: `(key, value)` pairs under `redcoast/alive/`, the value a counter
            or `"done"` for a process that finished.
        seen: for each watched rank, its last value and when (monotonic) it changed.
        now: the current monotonic time.
        timeout: seconds of silence that make a peer lost.

    Returns:
        The lost ranks (sorted) and the updated `seen`; finished ranks leave `seen`.
    """
    values = {int(key.rsplit("/", 1)[-1]): value for key, value in entries}
    updated: dict[int, tuple[str, float]] = {}
    for rank, (value, since) in seen.items():
        current = values.get(rank, value)
        if current == _DONE:
            continue
        updated[rank] = (value, since) if current == value else (current, now)
    lost = sorted(r for r, (_, since) in updated.items() if now - since > timeout)
    return lost, updated


def _watch_peers(rank: int, n: int, coordinator: str | None, timeout: float) -> None:
    """Start the heartbeat thread: every process beats, process 0 watches the others.

    Process 0 alone reads every heartbeat (one request per interval, however many
    hosts); when it declares peers lost it records them for the others, which
    read that one key and stop naming them. A peer is declared lost between
    `timeout` and `timeout + 2 * interval` after its last beat, and every survivor
    has stopped `2 * interval` later: within 1.4 x `timeout` in all.
    """
    # One function: the heartbeat thread and the atexit hook share the client, the
    # lock and the stopping flag of this call, which closures keep in one place.
    # jax.distributed keeps its client private; its key-value store is the one
    # channel every process already shares with the coordinator.
    client = coordination_client()
    interval = min(5.0, max(0.2, timeout / 10))
    stopping = threading.Event()
    lock = threading.Lock()

    def finish() -> None:
        # A process that ends normally says so, so that the watcher does not take
        # the end of its heartbeats for a death while the others still work.
        with lock:
            stopping.set()
            with contextlib.suppress(Exception):
                client.key_value_set(f"{_ALIVE}{rank}", _DONE, allow_overwrite=True)

    def run() -> None:
        start = time.monotonic()
        seen = {r: ("", start) for r in range(1, n)}
        for beat in itertools.count():
            if stopping.wait(interval):
                return
            try:
                with lock:
                    if stopping.is_set():
                        return
                    client.key_value_set(f"{_ALIVE}{rank}", str(beat), allow_overwrite=True)
                if rank == 0:
                    lost, seen = silent_peers(
                        client.key_value_dir_get(_ALIVE), seen, time.monotonic(), timeout
                    )
                    for r in lost:
                        client.key_value_set(f"{_LOST}{r}", "lost", allow_overwrite=True)
                else:
                    lost = sorted(
                        int(k.rsplit("/", 1)[-1]) for k, _ in client.key_value_dir_get(_LOST)
                    )
            except Exception as err:
                if stopping.is_set():
                    return
                reason = str(err).splitlines()[0] if str(err) else type(err).__name__
                _stop(
                    rank,
                    n,
                    f"the coordination service on this process failed ({reason})."
                    if rank == 0
                    else f"process 0, the coordinator at {coordinator}, cannot "
                    f"be reached ({reason}); it died or its host is unreachable. See its log.",
                )
            if lost and not stopping.is_set():
                _stop(
                    rank,
                    n,
                    f"{_names(lost)} sent no heartbeat for {timeout:g} s: it died or hung "
                    f"(see its log for why). Set {ENV_HEARTBEAT} to change how long to wait.",
                    # Process 0 hosts the coordinator: while others survive, it stays
                    # long enough for them to read the verdict before it goes away.
                    linger=2 * interval if rank == 0 and len(lost) < n - 1 else 0.0,
                )

    atexit.register(finish)
    threading.Thread(target=run, name="redcoast-heartbeat", daemon=True).start()


def _exit_fast_on_errors(rank: int, n: int, timeout: float) -> None:
    """An uncaught exception ends this process at once, without the shutdown barrier.

    A clean exit waits for every peer at JAX's shutdown barrier; peers blocked in a
    collective with this process never arrive, so the failure would surface only
    after the timeouts. Exiting at once lets the peers' heartbeat check see it.
    When the error is a collective that lost its peer, the heartbeat thread gets
    the time to name the lost process before this one exits.
    """
    previous = sys.excepthook

    def hook(kind, value, tb) -> None:  # type: ignore[no-untyped-def]
        previous(kind, value, tb)
        if isinstance(value, jax.errors.JaxRuntimeError) and _TRANSPORT.search(str(value)):
            sys.stderr.write(
                f"redcoast: process {rank} of {n}: a "
                "collective failed, most likely because another process died; waiting up "
                f"to {1.4 * timeout:g} s for the heartbeat check to name it.\n"
            )
            sys.stderr.flush()
            time.sleep(1.4 * timeout)  # the heartbeat thread exits the process first
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)

    sys.excepthook = hook
