"""Arrays to the host and processes in step: what every multi-process part needs."""

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["barrier", "to_host"]


def to_host(tree: Any) -> Any:
    """Every array of `tree` as a NumPy array, whole, on every process.

    Arrays split over several processes are gathered (a collective: every process
    must call this for the same tree); the rest are copied from the devices.

    Args:
        tree: a pytree of arrays, e.g. a step's predictions.

    Returns:
        The same pytree with NumPy leaves.

    Example:
        >>> to_host({"logits": predictions})["logits"].shape
        (64, 10)
    """

    def one(x: Any) -> np.ndarray:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (nothing on one process).

    Args:
        name: the same on every process, distinct per barrier.
    """
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
