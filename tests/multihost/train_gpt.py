"""Train a small GPT with `rc.fit` on however many processes started this; save what to compare.

Run it as one process (`XLA_FLAGS=--xla_force_host_platform_device_count=8 python
train_gpt.py --out DIR`) or several (`redcoast launch --nprocs 2 --devices-per-proc 4
-- python train_gpt.py --out DIR`): the mesh is 2 x 4 either way, so every run
must give the same numbers. With `--load RUN_DIR` it instead loads the checkpoint
another run wrote and saves what it read.

Each process writes `DIR/rank{R}.json` (its view of the job, the loss history and
the example ids it collated, call by call) and `DIR/preds{R}.npy`; process 0
writes the checkpoint `DIR/ckpt` and, gathered from all processes, the arrays
it holds in `DIR/arrays.npz`.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

import redcoast as rc

# The reference models live with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import TinyGPT

N_MODEL_SHARDS = 4
SEQ = 17
calls: list[list[int]] = []  # the example ids of each collate_fn call, in order


def make_examples(n: int, first_id: int, seed: int) -> list[tuple[int, np.ndarray]]:
    """Counting sequences `(a + b * i) % 64`: learnable, different for every example."""
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, 64, n), rng.integers(1, 8, n)
    return [(first_id + k, (a[k] + b[k] * np.arange(SEQ)) % 64) for k in range(n)]


def collate_fn(examples: list[tuple[int, np.ndarray]]) -> dict[str, np.ndarray]:
    calls.append([i for i, _ in examples])
    return {"ids": np.stack([ids for _, ids in examples]).astype(np.int32)}


def token_logp(model: TinyGPT, ids: jax.Array, key: jax.Array | None) -> jax.Array:
    keys = None if key is None else jax.random.split(key, ids.shape[0])
    logits = jax.vmap(lambda x, k: model(x, key=k))(ids[:, :-1], keys)
    return -optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])


def loss_fn(model: TinyGPT, batch: dict[str, jax.Array], key: jax.Array) -> jax.Array:
    return -token_logp(model, batch["ids"], key).mean()  # dropout on: the key matters


def pred_fn(model: TinyGPT, batch: dict[str, jax.Array], key: jax.Array) -> jax.Array:
    return token_logp(model, batch["ids"], None)


def metric_fn(examples: Any, outputs: list[np.ndarray]) -> dict[str, float]:
    return {"nats": float(-np.mean([o.mean() for o in outputs]))}


def gathered(tree: Any, prefix: str) -> dict[str, np.ndarray]:
    """Every array of `tree` as NumPy, gathered from all processes (all must call)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))
    return {
        prefix + jax.tree_util.keystr(path): np.asarray(
            multihost_utils.process_allgather(leaf, tiled=True)
        )
        for path, leaf in flat
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--load", type=Path, help="a run folder whose ckpt to load instead")
    args = parser.parse_args()

    mesh = rc.make_mesh(N_MODEL_SHARDS)  # first: it starts the distributed runtime
    rank = jax.process_index()
    args.out.mkdir(parents=True, exist_ok=True)
    optimizer = optax.adam(1e-2)
    test = make_examples(10, first_id=2000, seed=2)
    report: dict[str, Any] = {
        "process_index": rank,
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "mesh": dict(mesh.shape),
    }

    if args.load is not None:
        like = TinyGPT(dropout=0.1, key=jax.random.key(1))  # other values, same structure
        ids = np.zeros((2, SEQ - 1), np.int32)
        specs = rc.sharding_plan(
            like, N_MODEL_SHARDS, example_call=lambda m: jax.vmap(eqx.nn.inference_mode(m))(ids)
        ).specs
        ckpt = rc.load_checkpoint(
            args.load / "ckpt",
            like=like,
            opt_state_like=optimizer.init(eqx.filter(like, eqx.is_inexact_array)),
            mesh=mesh,
            specs=specs,
        )
        arrays = {**gathered(ckpt.model, "model"), **gathered(ckpt.opt_state, "opt")}
        model, report["step"] = ckpt.model, ckpt.step
    else:
        train = make_examples(96, first_id=0, seed=0)
        val = make_examples(10, first_id=1000, seed=1)
        result = rc.fit(
            TinyGPT(dropout=0.1, key=jax.random.key(0)),
            optimizer,
            train,
            collate_fn=collate_fn,
            loss_fn=loss_fn,
            mesh=mesh,
            per_device_batch_size=2,
            max_steps=args.steps,
            evaluation=rc.Evaluation(val, pred_fn=pred_fn, metric_fn=metric_fn),
            workdir=args.out / "workdir",
            seed=0,
            progress=False,
            log_every=1,
        )
        rc.save_checkpoint(
            args.out / "ckpt", model=result.model, opt_state=result.opt_state, step=result.step
        )
        arrays = {**gathered(result.model, "model"), **gathered(result.opt_state, "opt")}
        model, report["step"] = result.model, result.step
        report["losses"] = [r["loss"] for r in result.history["train"]]
        report["eval"] = result.history["eval"]

    preds = rc.predict(
        model, test, collate_fn=collate_fn, pred_fn=pred_fn, mesh=mesh, per_device_batch_size=2
    )
    np.save(args.out / f"preds{rank}.npy", np.stack(preds))
    report["calls"] = calls
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    if rank == 0:
        np.savez(args.out / "arrays.npz", **arrays)


if __name__ == "__main__":
    main()
