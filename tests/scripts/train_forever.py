"""Train a small MLP with `rc.fit` for a very long time; a test kills one process.

Every process prints `rank R pid P batch B` as it collates, so the test knows when
training is under way and which process to kill. Arguments: a tag (to find the
processes with pgrep), and optionally a workdir, where fit saves a checkpoint
when the processes are asked to stop with SIGTERM.
"""

import os
import sys

import equinox as eqx
import jax
import numpy as np
import optax

import redcoast as rc

mesh = rc.make_mesh(1)  # starts the distributed runtime from REDCOAST_* variables
rank = jax.process_index()
rng = np.random.default_rng(0)
examples = [(x, float(x.sum() > 0)) for x in rng.normal(size=(64, 8)).astype(np.float32)]
calls = [0]


def collate_fn(batch: list) -> dict[str, np.ndarray]:
    calls[0] += 1
    print(f"rank {rank} pid {os.getpid()} batch {calls[0]}", flush=True)
    return {"x": np.stack([x for x, _ in batch]), "y": np.array([y for _, y in batch])}


def loss_fn(model: eqx.nn.MLP, batch: dict, key: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(batch["x"])[:, 0]
    return optax.sigmoid_binary_cross_entropy(logits, batch["y"]).mean()


model = eqx.nn.MLP(8, 1, 16, 2, key=jax.random.key(0))
result = rc.fit(
    model,
    optax.sgd(1e-2),
    examples,
    collate_fn=collate_fn,
    loss_fn=loss_fn,
    mesh=mesh,
    per_device_batch_size=2,
    max_steps=10**9,
    n_epochs=10**9,
    progress=False,
    # Processes agree on a SIGTERM at logging steps; without a workdir there is
    # nothing to save, and fewer logs mean fewer host round trips.
    log_every=10 if len(sys.argv) > 2 else 1000,
    workdir=sys.argv[2] if len(sys.argv) > 2 else None,
)
if result.stopped_by is None:
    print("unreachable: training ended", flush=True)
