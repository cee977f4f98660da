"""Starting JAX's distributed runtime (see `redcoast.distributed`)."""

import dataclasses
import itertools
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from .._jax_private import backends_are_initialized
from ._launch import (
    ENV_ADDRESS,
    ENV_HEARTBEAT,
    ENV_NPROCS,
    ENV_RANK,
    ENV_WATCHDOG,
    free_port,
    launch,
)
from ._watchdog import EXIT_PEER_LOST as EXIT_PEER_LOST
from ._watchdog import start_watchdog

__all__ = [
    "DEFAULT_HEARTBEAT_SECONDS",
    "ENV_ADDRESS",
    "ENV_HEARTBEAT",
    "ENV_NPROCS",
    "ENV_RANK",
    "ENV_WATCHDOG",
    "EXIT_PEER_LOST",
    "DistributedConfig",
    "expand_nodelist",
    "free_port",
    "heartbeat_timeout",
    "initialize",
    "launch",
    "resolve",
    "watchdog_enabled",
]

DEFAULT_HEARTBEAT_SECONDS = 30
"""A process silent this long is declared lost (override: `REDCOAST_HEARTBEAT_TIMEOUT`)."""


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
        nodelist: the value of `SLURM_JOB_NODELIST` or `SLURM_STEP_NODELIST`, e.g.
            `gpu-[1-2],cpu3` or `rack[1-2]-n[01-04]`.

    Returns:
        Host names in order; zero padding of ranges is kept.

    Raises:
        ValueError: the list is empty or malformed (unbalanced brackets, a range
            that is not `lo-hi` over integers).

    Example:
        >>> expand_nodelist("gpu-[1-2],cpu3")
        ['gpu-1', 'gpu-2', 'cpu3']
    """
    text = nodelist.strip()
    items = re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text)
    # What is left of an item once its [..] groups are removed must hold no bracket.
    bad = [i for i in items if re.search(r"[\[\]]", re.sub(r"\[[^\[\]]*\]", "", i))]
    if not items or bad or ",".join(items) != text:
        raise ValueError(
            f"cannot read the SLURM node list {nodelist!r}: expected host names and bracketed "
            "ranges separated by commas, e.g. 'node[01-04,07],gpu3'."
        )
    hosts: list[str] = []
    for item in items:
        choices: list[list[str]] = []
        for part in re.split(r"(\[[^\]]*\])", item):
            if part.startswith("["):
                choices.append(_expand_range(part[1:-1], nodelist))
            elif part:
                choices.append([part])
        hosts += ["".join(c) for c in itertools.product(*choices)]
    return hosts


def _expand_range(spec: str, nodelist: str) -> list[str]:
    """`01-03,07` -> 01, 02, 03, 07 (the inside of one pair of brackets)."""
    options: list[str] = []
    for rng in spec.split(","):
        lo, _, hi = rng.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(
                f"cannot read the SLURM node list {nodelist!r}: {rng!r} is not a number or a "
                "range lo-hi."
            )
        options += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi or lo) + 1)]
    return options


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


def heartbeat_timeout(
    seconds: int | float | None = None, env: Mapping[str, str] | None = None
) -> float:
    """How long a process may stay silent before the others declare it lost.

    Args:
        seconds: an explicit value; wins over the environment.
        env: the environment to read `REDCOAST_HEARTBEAT_TIMEOUT` from (`os.environ`
            by default).

    Returns:
        Seconds, `DEFAULT_HEARTBEAT_SECONDS` when neither says.

    Example:
        >>> heartbeat_timeout(env={"REDCOAST_HEARTBEAT_TIMEOUT": "10"})
        10.0
    """
    env = os.environ if env is None else env
    raw: Any = seconds if seconds is not None else env.get(ENV_HEARTBEAT, DEFAULT_HEARTBEAT_SECONDS)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        where = "heartbeat_timeout_seconds" if seconds is not None else ENV_HEARTBEAT
        raise ValueError(f"{where}={raw!r} must be a positive number of seconds.")
    return value


def watchdog_enabled(watchdog: bool | None = None, env: Mapping[str, str] | None = None) -> bool:
    """Whether `initialize` starts the heartbeat watchdog and the fast-exit excepthook.

    Args:
        watchdog: an explicit choice; wins over the environment.
        env: the environment to read `REDCOAST_WATCHDOG` from (`os.environ` by
            default); `"1"` turns the watchdog on, `"0"` or unset leaves it off.

    Returns:
        `True` to start it.

    Raises:
        ValueError: `REDCOAST_WATCHDOG` is neither `"0"` nor `"1"`.

    Example:
        >>> watchdog_enabled(env={"REDCOAST_WATCHDOG": "1"})
        True
    """
    if watchdog is not None:
        return bool(watchdog)
    env = os.environ if env is None else env
    raw = env.get(ENV_WATCHDOG, "0").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{ENV_WATCHDOG}={raw!r} must be 1 (watchdog on) or 0 (off).")
    return raw == "1"


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    *,
    heartbeat_timeout_seconds: int | float | None = None,
    watchdog: bool | None = None,
) -> DistributedConfig:
    """Start `jax.distributed` as the arguments, environment or SLURM say; idempotent.

    `make_mesh` calls this, so scripts built on `make_mesh`, `fit` and `predict`
    run unchanged under `redcoast launch` or `srun`; call it yourself only if
    something must touch devices before the mesh is built. With no arguments and
    no `REDCOAST_*`/SLURM variables it does nothing (single process).

    With the watchdog on (`watchdog=True`, or `REDCOAST_WATCHDOG=1`, which
    `redcoast launch` sets), every process sends a heartbeat through the
    coordinator from a daemon thread. When a process stays silent for
    `heartbeat_timeout_seconds`, every survivor prints which one was lost and
    exits with `EXIT_PEER_LOST` instead of hanging in a collective (a survivor may
    stop sooner with the transport's own error: gloo can abort on a killed peer's
    half-sent message). It also replaces `sys.excepthook` so that an uncaught
    exception ends the process at once (exit code 1) without waiting at JAX's
    shutdown barrier, so its peers notice. These end the process with `os._exit`,
    which is why they are off by default: then a dead peer is noticed only by
    JAX's own heartbeat, later and without its name.

    Under SLURM, JAX gives each task the device numbered by its `SLURM_LOCALID`
    (one task per GPU); pass `local_device_ids` to drive several devices per task.

    Args:
        coordinator_address: `host:port` of process 0.
        num_processes: how many processes in all.
        process_id: this process's rank.
        local_device_ids: the devices this process drives (default: all it sees).
        heartbeat_timeout_seconds: a peer silent this long is declared lost
            (default `REDCOAST_HEARTBEAT_TIMEOUT`, else `DEFAULT_HEARTBEAT_SECONDS`).
            Survivors exit within 1.4 times this. Used only with the watchdog.
        watchdog: start the heartbeat watchdog and the fast-exit excepthook; default
            `REDCOAST_WATCHDOG` (`1` on, else off).

    Returns:
        The `DistributedConfig` used.

    Raises:
        RuntimeError: several processes are asked for, but JAX already started in
            single-process mode because something touched devices first.

    Example:
        >>> rc.distributed.initialize()          # under srun or redcoast launch
        >>> rc.distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=0)
    """
    config = resolve(coordinator_address, num_processes, process_id)
    if not config.multi_process or jax.distributed.is_initialized():
        return config
    timeout = heartbeat_timeout(heartbeat_timeout_seconds)
    watch = watchdog_enabled(watchdog)
    _check_backend_not_started(config)
    # JAX's own heartbeat stays as a backstop, later than redcoast's, whose message
    # names the lost process; 30 s here gives JAX 55 s.
    backstop = math.ceil(1.5 * timeout) + 10
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
        local_device_ids=local_device_ids,
        # redcoast already read the environment; JAX's SLURM detection only picks
        # the task's local device there.
        cluster_detection_method=None if config.source == "slurm" else "deactivate",
        heartbeat_timeout_seconds=backstop,
        shutdown_timeout_seconds=backstop,
        # Hosts of a cluster job can start minutes apart; this is JAX's default.
        initialization_timeout=300,
    )
    if watch:
        start_watchdog(config.process_id, config.num_processes, config.coordinator_address, timeout)
    if config.process_id == 0:
        print(
            f"redcoast: {config.num_processes} processes, coordinator "
            f"{config.coordinator_address} (from {config.source}); "
            + (
                f"a process silent for {timeout:g} s stops the run"
                if watch
                else f"watchdog off ({ENV_WATCHDOG}=1 turns it on)"
            ),
            flush=True,
        )
    return config


def _check_backend_not_started(config: DistributedConfig) -> None:
    # jax.distributed.initialize must come before JAX creates its backend; its own
    # error does not say which call came first or what redcoast expected.
    if backends_are_initialized():
        raise RuntimeError(
            f"redcoast: the environment asks for {config.num_processes} processes (from "
            f"{config.source}; this is process {config.process_id}), but JAX has already "
            "started in single-process mode: something touched devices (jax.devices(), "
            "jax.random.key, an array, a jitted call) before the distributed runtime "
            "started. Call rc.distributed.initialize() (or rc.make_mesh) at the top of the "
            "script, before any other JAX call."
        )
