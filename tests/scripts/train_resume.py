"""Train a small dropout MLP with `rc.fit` on 8 simulated devices (mesh 4 x 2).

Usage: train_resume.py WORKDIR OUT.npz [--resume] [--kill-at STEP] [--term-at STEP]
    [--pause-at STEP] [--together DIR N]

`--kill-at S` sends SIGKILL to this process when the metrics of step S are logged
(the checkpoint of the step before has been written); `--term-at S` sends SIGTERM
instead, which `fit` answers by saving and exiting with code 0; `--pause-at S`
creates WORKDIR.paused there and sleeps until the process is killed. `--together
DIR N` calls `fit` only once N processes given the same DIR are ready, so that
they start it together. Without these, the trained parameters are written to
OUT.npz. The process prints `pid P` first.
"""

import argparse
import os
import signal
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax

import redcoast as rc


class DropoutMLP(eqx.Module):
    hidden: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.hidden = eqx.nn.Linear(6, 32, key=k1)
        self.dropout = eqx.nn.Dropout(0.3)
        self.out = eqx.nn.Linear(32, 2, key=k2)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        return self.out(self.dropout(jax.nn.relu(self.hidden(x)), key=key))


def examples(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    x = np.random.default_rng(seed).normal(size=(n, 6)).astype(np.float32)
    return [{"x": a, "y": np.int32(a[0] + a[1] > 0)} for a in x]


def collate_fn(batch: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {"x": np.stack([e["x"] for e in batch]), "y": np.stack([e["y"] for e in batch])}


def loss_fn(model: DropoutMLP, batch: dict[str, jax.Array], key: jax.Array) -> jax.Array:
    keys = jax.random.split(key, batch["x"].shape[0])
    logits = jax.vmap(model)(batch["x"], key=keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def main() -> None:
    # Before JAX's backend starts, which happens at the first computation.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("out")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--term-at", type=int)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--pause-at", type=int)
    parser.add_argument("--together", nargs=2)
    args = parser.parse_args()
    print(f"pid {os.getpid()}", flush=True)

    def interrupt(metrics: dict, step: int) -> None:
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.term_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if step == args.pause_at:
            Path(f"{args.workdir}.paused").touch()
            time.sleep(3600)

    if args.together is not None:
        ready, n = Path(args.together[0]), int(args.together[1])
        (ready / f"ready.{os.getpid()}").touch()
        while len(list(ready.glob("ready.*"))) < n:
            time.sleep(0.001)

    schedule = optax.linear_schedule(0.05, 0.0, args.max_steps)
    result = rc.fit(
        DropoutMLP(jax.random.key(0)),
        optax.inject_hyperparams(optax.adam)(learning_rate=schedule),
        examples(64, seed=0),  # 8 steps per epoch: 10 steps cross into epoch 1
        collate_fn=collate_fn,
        loss_fn=loss_fn,
        mesh=rc.make_mesh(2),
        per_device_batch_size=2,
        max_steps=args.max_steps,
        evaluation=rc.Evaluation(examples(12, seed=1), every=5),
        workdir=args.workdir,
        checkpointing=rc.Checkpointing(every=2, keep_last_n=2),
        resume=args.resume,
        log_every=1,
        loggers=[interrupt],
        progress=False,
    )
    leaves = jax.tree_util.tree_leaves(eqx.filter(result.model, eqx.is_array))
    np.savez(args.out, *[np.asarray(x) for x in leaves], step=result.step)


if __name__ == "__main__":
    main()
