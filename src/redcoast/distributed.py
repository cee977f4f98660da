"""Many hosts: start JAX's distributed runtime from arguments, environment or SLURM.

The same user script runs on one machine or many. `initialize()` looks, in order,
at its explicit arguments, the `REDCOAST_*` environment variables (set by
`redcoast launch`), and SLURM's variables; with none of them it leaves JAX in
single-process mode. `launch` starts N local processes for tests and
experiments on one machine.
"""

import contextlib
import dataclasses
import itertools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

import jax

__all__ = ["DistributedConfig", "expand_nodelist", "initialize", "launch", "resolve"]

log = logging.getLogger("redcoast")

ENV_ADDRESS = "REDCOAST_COORDINATOR_ADDRESS"
ENV_NPROCS = "REDCOAST_NUM_PROCESSES"
ENV_RANK = "REDCOAST_PROCESS_ID"
ENV_HEARTBEAT = "REDCOAST_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_SECONDS = 30


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where the coordinator is, how many processes, which one this is, and who said so."""

    coordinator_address: str | None
    num_processes: int
    process_id: int
    source: str  # "arguments" | "environment" | "slurm" | "single process"

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list, expanded: `node[01-03,07]` -> node01, node02, node03, node07.

    Args:
        nodelist: the value of `SLURM_JOB_NODELIST` or `SLURM_STEP_NODELIST`.

    Returns:
        Host names in order; zero padding of ranges is kept.
    """
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist.strip()):
        parts = re.split(r"(\[[^\]]*\])", item)
        choices: list[list[str]] = []
        for part in parts:
            if part.startswith("["):
                options: list[str] = []
                for rng in part[1:-1].split(","):
                    if "-" in rng:
                        lo, hi = rng.split("-", 1)
                        width = len(lo)
                        options += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
                    elif rng:
                        options.append(rng)
                choices.append(options)
            elif part:
                choices.append([part])
        hosts += ["".join(c) for c in itertools.product(*choices)]
    return hosts


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError as err:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer.") from err


def resolve(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] | None = None,
) -> DistributedConfig:
    """Decide the distributed set-up without starting anything.

    Args:
        coordinator_address: `host:port` of process 0.
        num_processes: how many processes in all.
        process_id: this process's rank.
        env: the environment to read (`os.environ` by default).

    Returns:
        A `DistributedConfig`; `source` says whether the arguments, the `REDCOAST_*`
        variables or SLURM decided it.
    """
    env = os.environ if env is None else env
    given = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in given):
        if any(v is None for v in given):
            raise ValueError(
                "initialize(): pass coordinator_address, num_processes and process_id together "
                f"(got {coordinator_address!r}, {num_processes!r}, {process_id!r})."
            )
        assert num_processes is not None and process_id is not None
        return _checked(coordinator_address, num_processes, process_id, "arguments")
    if ENV_ADDRESS in env or ENV_NPROCS in env:
        missing = [v for v in (ENV_ADDRESS, ENV_NPROCS, ENV_RANK) if v not in env]
        if missing:
            raise ValueError(f"{', '.join(missing)} not set; redcoast launch sets all three.")
        return _checked(env[ENV_ADDRESS], _int(env, ENV_NPROCS), _int(env, ENV_RANK), "environment")
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
        ntasks = _int(env, "SLURM_NTASKS")
        if ntasks > 1:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
            if not nodelist:
                raise ValueError(
                    "SLURM_NTASKS > 1 but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is "
                    "set; run under srun, or set REDCOAST_COORDINATOR_ADDRESS."
                )
            host = expand_nodelist(nodelist)[0]
            job = _int(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0
            port = 12000 + job % 20000  # one port per job, the same on every task
            return _checked(f"{host}:{port}", ntasks, _int(env, "SLURM_PROCID"), "slurm")
    return DistributedConfig(None, 1, 0, "single process")


def _checked(address: str | None, n: int, rank: int, source: str) -> DistributedConfig:
    if n < 1 or not 0 <= rank < n:
        raise ValueError(f"process_id {rank} is not in [0, {n}) (from {source}).")
    if n > 1 and (not address or ":" not in address):
        raise ValueError(f"coordinator address {address!r} (from {source}) must be host:port.")
    return DistributedConfig(address, n, rank, source)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    *,
    heartbeat_timeout_seconds: int | None = None,
) -> DistributedConfig:
    """Start `jax.distributed` as the arguments, environment or SLURM say; idempotent.

    Call it before anything touches devices. With no arguments and no
    `REDCOAST_*`/SLURM variables it does nothing (single process).

    Args:
        coordinator_address: `host:port` of process 0.
        num_processes: how many processes in all.
        process_id: this process's rank.
        local_device_ids: the devices this process drives (default: all it sees).
        heartbeat_timeout_seconds: a peer silent this long is declared dead and the
            survivors stop with an error instead of hanging (default
            `REDCOAST_HEARTBEAT_TIMEOUT` or 30).

    Returns:
        The `DistributedConfig` used.

    Example:
        >>> rc.distributed.initialize()          # under srun or redcoast launch
        >>> rc.distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=0)
    """
    config = resolve(coordinator_address, num_processes, process_id)
    if not config.multi_process or jax.distributed.is_initialized():
        return config
    heartbeat = heartbeat_timeout_seconds or int(
        os.environ.get(ENV_HEARTBEAT, DEFAULT_HEARTBEAT_SECONDS)
    )
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
        local_device_ids=local_device_ids,
        heartbeat_timeout_seconds=heartbeat,
        shutdown_timeout_seconds=heartbeat,
        initialization_timeout=max(60, 2 * heartbeat),
    )
    _exit_fast_on_errors()
    if config.process_id == 0:
        log.info(
            "redcoast: %d processes, coordinator %s (from %s)",
            config.num_processes,
            config.coordinator_address,
            config.source,
        )
    return config


def _exit_fast_on_errors() -> None:
    """An uncaught exception ends this process at once, without the shutdown barrier.

    A clean exit waits for every peer at JAX's shutdown barrier; peers blocked in a
    collective with this process never arrive, so the failure would surface only
    after the timeouts. Exiting at once lets the peers' heartbeat checks (or the
    launcher) see it.
    """
    previous = sys.excepthook

    def hook(kind, value, tb) -> None:  # type: ignore[no-untyped-def]
        previous(kind, value, tb)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)

    sys.excepthook = hook


def launch(
    command: Sequence[str],
    *,
    nprocs: int,
    devices_per_proc: int = 1,
    port: int = 23456,
    env: Mapping[str, str] | None = None,
    timeout: int | float | None = None,
) -> int:
    """Run `command` as `nprocs` local processes of `devices_per_proc` simulated CPU devices.

    Output lines are prefixed with the rank. When one process fails the others are
    killed; the result is the first non-zero exit code (0 when all succeed). No
    process outlives the call.

    Args:
        command: the program and its arguments, e.g. `["python", "train.py"]`.
        nprocs: how many processes.
        devices_per_proc: simulated CPU devices in each.
        port: the coordinator's port on 127.0.0.1.
        env: extra environment variables for every process.
        timeout: seconds after which everything is killed and 124 returned.

    Returns:
        The exit code.
    """
    if nprocs < 1 or devices_per_proc < 1:
        raise ValueError("launch needs nprocs >= 1 and devices_per_proc >= 1.")
    if not command:
        raise ValueError("launch needs a command to run, e.g. ['python', 'train.py'].")
    procs: list[subprocess.Popen[bytes]] = []
    lock = threading.Lock()

    def pump(rank: int, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            with lock:
                sys.stdout.write(f"[{rank}] {raw.decode(errors='replace')}")
                sys.stdout.flush()

    base = {**os.environ, **(env or {})}
    for rank in range(nprocs):
        child = {
            **base,
            ENV_ADDRESS: f"127.0.0.1:{port}",
            ENV_NPROCS: str(nprocs),
            ENV_RANK: str(rank),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_proc}",
        }
        procs.append(
            subprocess.Popen(
                list(command),
                env=child,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    pumps = [threading.Thread(target=pump, args=(r, p), daemon=True) for r, p in enumerate(procs)]
    for t in pumps:
        t.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    code = 0
    try:
        while True:
            states = [p.poll() for p in procs]
            failed = [c for c in states if c not in (None, 0)]
            if failed:
                code = failed[0]
                break
            if all(c == 0 for c in states):
                break
            if deadline is not None and time.monotonic() > deadline:
                code = 124
                break
            time.sleep(0.05)
    finally:
        _kill_all(procs)
        for t in pumps:
            t.join(timeout=5)
        for p in procs:
            if p.stdout is not None:
                p.stdout.close()
    return code


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    end = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
