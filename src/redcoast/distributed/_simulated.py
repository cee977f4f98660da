"""Simulated CPU devices, for machines without an accelerator (and for tests)."""

import os

import jax
import numpy as np

from .._progress import counted

# XLA:CPU runs each simulated device's part of a collective on a thread of its own,
# and the threads meet at a rendezvous. A thread still waiting there 20 s after the
# warning XLA prints (its fixed 20 s in jaxlib 0.10) ends the whole process with
# SIGABRT after this many seconds more (40 by default): on a busy machine (two cores
# compiling beside a test suite) one starved device thread is enough. Simulated
# devices have no peer that can die, so waiting longer is always right.
CPU_COLLECTIVE_PATIENCE_S = 600
"""Seconds a simulated device waits at a collective, after XLA's warning, before XLA
ends the process (`--xla_cpu_collective_call_terminate_timeout_seconds`)."""

SIMULATED_XLA_FLAGS = (
    f"--xla_cpu_collective_call_terminate_timeout_seconds={CPU_COLLECTIVE_PATIENCE_S}"
)
"""What `simulate_devices` adds to `XLA_FLAGS`; a process started with
`XLA_FLAGS="--xla_force_host_platform_device_count=8 <these>"` gets the same."""


def simulate_devices(n: int) -> None:
    """Run this process on `n` simulated CPU devices, patient with a loaded machine.

    Sets `jax_num_cpu_devices` and adds `SIMULATED_XLA_FLAGS` to the environment's
    `XLA_FLAGS` (unless already there), which raises XLA:CPU's timeout for a device
    waiting at a collective from 40 to `CPU_COLLECTIVE_PATIENCE_S` seconds: without
    it, a machine busy with other work can kill the process (SIGABRT, "Termination
    timeout ... exceeded") in the middle of a sharded step. It changes this
    process's JAX configuration and environment, as asked; call it before anything
    touches a device (`redcoast demo --devices`, `redcoast run --devices` and the
    test suite do).

    Args:
        n: how many devices to simulate.

    Raises:
        RuntimeError: JAX already started with another number of devices.

    Example:
        >>> rc.simulate_devices(8)
        >>> mesh = rc.make_mesh(n_model_shards=2)   # 4 x 2
    """
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"simulate_devices needs a positive int, got {n!r}.")
    if "JAX_PLATFORMS" not in os.environ:  # JAX read it when imported: tell it too
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_collective_call_terminate_timeout_seconds" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {SIMULATED_XLA_FLAGS}".strip()
    try:
        jax.config.update("jax_num_cpu_devices", int(n))
    except RuntimeError as err:  # the backend already started
        # The devices of this process: each process of a job simulates its own.
        if jax.local_device_count() != n:
            raise RuntimeError(
                f"cannot simulate {counted(n, 'device')}: JAX already started with "
                f"{jax.local_device_count()} in this process. Call simulate_devices before "
                "anything touches a device (the first jax.devices(), array or make_mesh)."
            ) from err
