"""Many hosts: start JAX's distributed runtime from arguments, environment or SLURM.

The same user script runs on one machine or many. `initialize()` looks, in order,
at its explicit arguments, the `REDCOAST_*` environment variables (set by
`redcoast launch`), and SLURM's variables; with none of them it leaves JAX in
single-process mode. `make_mesh` calls it, so `fit` and `predict` need no change
to run on many hosts. `launch` starts N local processes for tests and
experiments on one machine.

With the watchdog on (`redcoast launch` turns it on for its processes; elsewhere
`initialize(watchdog=True)` or `REDCOAST_WATCHDOG=1`), a dead peer never leaves
the others hanging: every process sends a heartbeat through the coordinator's
key-value store, process 0 watches them, and when one falls silent every survivor
exits with `EXIT_PEER_LOST` and a message naming it. Off (the default), redcoast
changes nothing process-wide: no thread, no `sys.excepthook`, no `atexit` hook.
The runtime is started in `_runtime.py`, processes are launched by `_launch.py`,
the watchdog is `_watchdog.py`; `_simulated.py` simulates devices on a CPU and
`_host.py` brings arrays to the host and processes into step.
"""

from ._runtime import DEFAULT_HEARTBEAT_SECONDS as DEFAULT_HEARTBEAT_SECONDS
from ._runtime import ENV_ADDRESS as ENV_ADDRESS
from ._runtime import ENV_HEARTBEAT as ENV_HEARTBEAT
from ._runtime import ENV_NPROCS as ENV_NPROCS
from ._runtime import ENV_RANK as ENV_RANK
from ._runtime import ENV_WATCHDOG as ENV_WATCHDOG
from ._runtime import EXIT_PEER_LOST as EXIT_PEER_LOST
from ._runtime import DistributedConfig as DistributedConfig
from ._runtime import expand_nodelist as expand_nodelist
from ._runtime import free_port as free_port
from ._runtime import heartbeat_timeout as heartbeat_timeout
from ._runtime import initialize as initialize
from ._runtime import launch as launch
from ._runtime import resolve as resolve
from ._runtime import watchdog_enabled as watchdog_enabled
