"""`redcoast launch`: run one command as N local processes of a multi-process JAX job.

Each process gets the `REDCOAST_*` variables that `distributed.initialize` reads
(the coordinator on 127.0.0.1, the number of processes, its rank) and its own
simulated CPU devices. The launcher prefixes output with the rank, names the first
process to fail, and never lets a process outlive it. `redcoast.distributed`
re-exports `launch` and `free_port`.
"""

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ._simulated import SIMULATED_XLA_FLAGS

__all__ = [
    "ENV_ADDRESS",
    "ENV_HEARTBEAT",
    "ENV_NPROCS",
    "ENV_RANK",
    "ENV_WATCHDOG",
    "free_port",
    "launch",
]

ENV_ADDRESS = "REDCOAST_COORDINATOR_ADDRESS"
ENV_NPROCS = "REDCOAST_NUM_PROCESSES"
ENV_RANK = "REDCOAST_PROCESS_ID"
ENV_HEARTBEAT = "REDCOAST_HEARTBEAT_TIMEOUT"
ENV_WATCHDOG = "REDCOAST_WATCHDOG"

# What Gloo prints for every connection it makes (24 lines for 2 processes of 4
# devices): hidden unless asked for, since it says nothing a user acts on. Its threads
# write at once, so two such lines may come interleaved: "[Gloo] Rank [Gloo] Rank 0 is
# connected ..." and then "1 is connected ...".
_CONNECTION_NOISE = re.compile(rb"^(?:\[Gloo\] Rank )*\d+ is connected to \d+ peer ranks\.")

_FAILURE_GRACE_SECONDS = 5.0
_STOP_GRACE_SECONDS = 30.0  # SLURM's default KillWait between SIGTERM and SIGKILL


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, for a local coordinator.

    Args:
        host: the interface to probe.

    Returns:
        The port number.

    Example:
        >>> launch(["python", "train.py"], nprocs=2, port=free_port())
    """
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _signals_stop_children() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP to the launcher raise, so its children get stopped too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Interrupted(signum)

    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _spawn(
    command: Sequence[str],
    rank: int,
    nprocs: int,
    devices_per_proc: int,
    port: int,
    env: Mapping[str, str],
) -> subprocess.Popen[bytes]:
    """Process `rank` of a local job, in a session of its own, its output piped."""
    child = {
        **env,
        ENV_ADDRESS: f"127.0.0.1:{port}",
        ENV_NPROCS: str(nprocs),
        ENV_RANK: str(rank),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_proc} "
        + SIMULATED_XLA_FLAGS,
    }
    return subprocess.Popen(
        list(command),
        env=child,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _await_exits(
    exits: queue.Queue[tuple[int, int]],
    procs: list[subprocess.Popen[bytes]],
    timeout: int | float | None,
    say: Callable[[str], None],
) -> tuple[int, float]:
    """Wait for every process until the first failure or the timeout: (exit code, grace).

    After a failure the others are likely blocked in a collective with the dead
    process: no use waiting. After the timeout they are healthy and may be saving a
    checkpoint (fit does on SIGTERM): they get time.
    """
    nprocs = len(procs)
    deadline = None if timeout is None else time.monotonic() + timeout
    for _ in range(nprocs):
        try:
            rank, code = exits.get(
                timeout=None if deadline is None else max(0.0, deadline - time.monotonic())
            )
        except queue.Empty:
            say(
                f"timed out after {timeout:g} s; stopping all {nprocs} processes "
                f"(SIGTERM, then SIGKILL after {_STOP_GRACE_SECONDS:g} s)."
            )
            return 124, _STOP_GRACE_SECONDS
        if code != 0:
            others = sum(p.poll() is None for p in procs)
            say(
                f"process {rank} {_describe(code)} first; stopping the other "
                f"{others} running process{'es' if others != 1 else ''}."
            )
            return code, _FAILURE_GRACE_SECONDS
    return 0, _FAILURE_GRACE_SECONDS


def launch(
    command: Sequence[str],
    *,
    nprocs: int,
    devices_per_proc: int = 1,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    timeout: int | float | None = None,
    verbose: bool = False,
) -> int:
    """Run `command` as `nprocs` local processes of `devices_per_proc` simulated CPU devices.

    Output lines are prefixed with the rank; Gloo's line for each connection it
    makes is left out unless `verbose`. When one process fails, the launcher
    says which (on stderr) and stops the others (SIGTERM, SIGKILL 5 s later); the
    result is that first non-zero exit code (0 when all succeed, minus the signal
    number for a process killed by a signal). When the launcher itself gets
    SIGTERM, SIGINT or SIGHUP, or `timeout` passes, it sends SIGTERM to every
    process and gives them 30 s to finish (`fit` with a `workdir` saves a
    checkpoint and exits), then SIGKILL; a second signal kills them at once. No
    process outlives the call.

    Args:
        command: the program and its arguments, e.g. `["python", "train.py"]`.
        nprocs: how many processes.
        devices_per_proc: simulated CPU devices in each.
        port: the coordinator's port on 127.0.0.1; a free one by default.
        env: extra environment variables for every process. `REDCOAST_WATCHDOG=1` is
            set unless `env` says otherwise (see `initialize`).
        timeout: seconds after which everything is stopped and 124 returned.
        verbose: pass on every line the processes print, Gloo's connections too.

    Returns:
        The exit code.

    Example:
        >>> launch(["python", "train.py"], nprocs=2, devices_per_proc=4)
        0
    """
    if nprocs < 1 or devices_per_proc < 1:
        raise ValueError("launch needs nprocs >= 1 and devices_per_proc >= 1.")
    if not command:
        raise ValueError("launch needs a command to run, e.g. ['python', 'train.py'].")
    # One function: the processes, the output lock and the exit queue are shared by
    # the reader threads, the signal handlers and the wait below, as closures.
    port = free_port() if port is None else port
    procs: list[subprocess.Popen[bytes]] = []
    lock = threading.Lock()

    # Each process's exit is queued by its own thread the moment it happens, so the
    # first failure is named correctly even when others follow a few ms later.
    exits: queue.Queue[tuple[int, int]] = queue.Queue()

    def pump(rank: int, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            if not verbose and _CONNECTION_NOISE.match(raw):
                continue
            with lock:
                sys.stdout.write(f"[{rank}] {raw.decode(errors='replace')}")
                sys.stdout.flush()

    def watch(rank: int, proc: subprocess.Popen[bytes]) -> None:
        exits.put((rank, proc.wait()))

    def say(message: str) -> None:
        with lock:
            sys.stdout.flush()
            sys.stderr.write(f"redcoast launch: {message}\n")
            sys.stderr.flush()

    # The watchdog names a dead process to every survivor; `env` may turn it off.
    base = {**os.environ, ENV_WATCHDOG: "1", **(env or {})}
    pumps: list[threading.Thread] = []
    code, grace = 0, _FAILURE_GRACE_SECONDS
    with _signals_stop_children():
        try:
            for rank in range(nprocs):
                procs.append(_spawn(command, rank, nprocs, devices_per_proc, port, base))
                for target in (pump, watch):
                    pumps.append(
                        threading.Thread(target=target, args=(rank, procs[-1]), daemon=True)
                    )
                    pumps[-1].start()
            code, grace = _await_exits(exits, procs, timeout, say)
        except _Interrupted as stop:
            code, grace = -stop.signum, _STOP_GRACE_SECONDS
            say(
                f"got {stop}; stopping all {nprocs} processes (SIGTERM, then SIGKILL after "
                f"{grace:g} s or at a second signal)."
            )
        finally:
            try:
                _kill_all(procs, grace)
            except _Interrupted:
                say("second signal: killing every process now.")
                _kill_all(procs, 0.0)
            for t in pumps:
                t.join(timeout=5)
            for p in procs:
                if p.stdout is not None:
                    p.stdout.close()
    return code


def _kill_all(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM every process group still running, then SIGKILL what is left after `grace` s."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    end = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
