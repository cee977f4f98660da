"""What the `redcoast` commands share: simulated devices and the model's shards."""

import os
import re
from typing import Any

import click

# `--devices` of the commands that run on simulated devices.
DEVICES_OPTION: dict[str, Any] = {
    "type": click.IntRange(min=1),
    "default": None,
    "help": "Simulated CPU devices of this process  [default: the count XLA_FLAGS forces "
    "(`redcoast launch --devices-per-proc` sets it), else 8]",
}

devices = click.option("--devices", **DEVICES_OPTION)


def shards(default: int) -> Any:
    """The `--n-model-shards` option, `default` shards unless given."""
    return click.option(
        "-n",
        "--n-model-shards",
        type=click.IntRange(min=1),
        default=default,
        show_default=True,
        help="Tensor-parallel shards.",
    )


def simulate_devices(n: int | None) -> None:
    """Ask for `n` simulated CPU devices (by default the count XLA_FLAGS forces, which
    `redcoast launch` sets for each of its processes, else 8); only possible before
    JAX's backend starts.

    Asking again for the number the running backend already has is fine (tests run
    the command in a process whose backend has started).
    """
    from .distributed._simulated import simulate_devices as simulate

    if n is None:
        forced = re.search(
            r"xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", "")
        )
        n = int(forced.group(1)) if forced else 8
    try:
        simulate(n)
    except RuntimeError as err:
        raise click.ClickException(str(err)) from err
