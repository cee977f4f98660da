"""A sharded sum on 8 simulated devices, one of which reaches it `lag` seconds late.

Stands in for a device thread starved by a busy machine: the other seven wait for it
at XLA:CPU's rendezvous. Run as `python lagging_device.py LAG [--simulate]`;
`--simulate` asks for the devices with `rc.simulate_devices`, otherwise with JAX's
own `jax_num_cpu_devices` (and XLA's default patience).
"""

import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import redcoast as rc

lag = float(sys.argv[1])
if "--simulate" in sys.argv:
    rc.simulate_devices(8)
else:
    jax.config.update("jax_num_cpu_devices", 8)


def late(x):
    if int(x[0]) == 0:  # device 0's shard
        time.sleep(lag)
    return x


def total(x):
    x = jax.pure_callback(late, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return jax.lax.psum(x, "d")


mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
step = jax.jit(jax.shard_map(total, mesh=mesh, in_specs=P("d"), out_specs=P()))
print("sum", float(step(jnp.arange(8.0))[0]), flush=True)
