"""Each process contributes its rank + 1 to a sum over every device of every process."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc

config = rc.distributed.initialize()
if len(sys.argv) > 1 and sys.argv[1] == "fail" and config.process_id == 1:
    os._exit(3)  # a crash: no clean shutdown
mesh = rc.make_mesh(1)
local = np.full((jax.local_device_count(),), config.process_id + 1, np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
print(
    f"rank {config.process_id} of {config.num_processes}: devices {jax.device_count()} "
    f"sum {float(total)}",
    flush=True,
)
