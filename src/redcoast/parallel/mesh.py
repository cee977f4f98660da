"""The device mesh: a ("data", "model") grid over every device of every process."""

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ..distributed import initialize

DATA: str = "data"
MODEL: str = "model"


def divisors(n: int) -> list[int]:
    """The sizes a model axis over `n` devices may have."""
    return [d for d in range(1, n + 1) if n % d == 0]


def make_mesh(n_model_shards: int = 1, *, devices: Sequence[Any] | None = None) -> Mesh:
    """Build the 2-D mesh `("data", "model")` used by every redcoast function.

    Data parallelism runs over the `"data"` axis and tensor parallelism over
    `"model"`. Devices of one process stay next to each other on the model
    axis, so tensor-parallel collectives stay inside a host whenever
    `n_model_shards` is at most the number of local devices.

    It first starts JAX's distributed runtime when the environment asks for
    several processes (`redcoast launch`, SLURM, `REDCOAST_*`; see
    `redcoast.distributed.initialize`), so the mesh spans every process. Build
    the mesh before anything else touches devices. It changes nothing else
    process-wide: the heartbeat watchdog and its `sys.excepthook` start only under
    `redcoast launch` or when asked (`REDCOAST_WATCHDOG=1`).

    Args:
        n_model_shards: how many pieces each weight is split into. Must divide
            the number of devices.
        devices: the devices to use; all devices of all processes by default.

    Returns:
        A `jax.sharding.Mesh` of shape `(n_devices // n_model_shards, n_model_shards)`
        with `Auto` axis types (which Equinox layers need).

    Raises:
        RuntimeError: the environment asks for several processes but JAX already
            started in single-process mode (something touched devices first).

    Example:
        >>> mesh = make_mesh(n_model_shards=2)   # 8 devices -> 4 x 2
        >>> dict(mesh.shape)
        {'data': 4, 'model': 2}
    """
    initialize()  # a no-op for a single process, and once started
    devs = list(jax.devices() if devices is None else devices)
    n = len(devs)
    if n == 0:
        raise ValueError("make_mesh got an empty list of devices; pass at least one device.")
    if isinstance(n_model_shards, bool) or not isinstance(n_model_shards, int | np.integer):
        raise TypeError(f"n_model_shards must be an int, got {type(n_model_shards).__name__}.")
    if n_model_shards < 1 or n % n_model_shards:
        raise ValueError(
            f"n_model_shards={n_model_shards} does not divide the {n} available devices; "
            f"valid values are {divisors(n)}. To simulate more devices on a CPU, call "
            "rc.simulate_devices(8) before anything touches a device."
        )
    # Sort by (process, id) so that consecutive devices -- one row of the model axis --
    # live on the same host.
    devs.sort(key=lambda d: (d.process_index, d.id))
    grid = np.asarray(devs, dtype=object).reshape(n // n_model_shards, n_model_shards)
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
    """`(n_data, n_model)` of a redcoast mesh, with a clear error for any other mesh."""
    if tuple(mesh.axis_names) != (DATA, MODEL):
        raise ValueError(
            f"expected a mesh with axes ('data', 'model'), got {tuple(mesh.axis_names)}; "
            "build one with redcoast.make_mesh(n_model_shards=...)."
        )
    return int(mesh.shape[DATA]), int(mesh.shape[MODEL])
