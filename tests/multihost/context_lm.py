"""Train a small zoo GPT-2 with `rc.fit(context_parallel=True)`; write its losses.

Every sequence is split over the data axis of a 2 x 4 mesh, whichever processes
hold its devices: each process collates every row of a batch (`split_rows=False`),
and one row's blocks live on devices of both processes under 2 x 4 processes x
devices. `--no-context` trains the same model without the split, for reference.
Writes `DIR/rank{R}.json` with the losses, the evaluation and the example ids
collated.
"""

import argparse
import json
from pathlib import Path

import jax
import numpy as np
import optax

import redcoast as rc

calls: list[list[int]] = []


def collate_fn(examples: list[tuple[int, np.ndarray]]) -> dict[str, np.ndarray]:
    calls.append([i for i, _ in examples])
    return {"input_ids": np.stack([ids for _, ids in examples]).astype(np.int32)}


def loss_fn(model, batch, key):
    return rc.models.lm_loss(model, batch, key)[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-context", action="store_true")
    args = parser.parse_args()
    mesh = rc.make_mesh(2)  # first: it starts the distributed runtime
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 64, 24), rng.integers(1, 8, 24)
    rows = [(i, (a[i] + b[i] * np.arange(16)) % 64) for i in range(24)]
    config = rc.models.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    context = not args.no_context
    result = rc.fit(
        rc.models.GPT2(config, key=jax.random.key(0)),
        optax.adam(1e-2),
        rows[:20],
        collate_fn=collate_fn,
        loss_fn=loss_fn,
        mesh=mesh,
        # 4 rows a step either way: whole on every device, or one per data shard.
        per_device_batch_size=4 if context else 1,
        context_parallel=context,
        max_steps=5,
        evaluation=rc.Evaluation(rows[20:]),
        progress=False,
        log_every=1,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "losses": [r["loss"] for r in result.history["train"]],
        "eval": result.history["eval"],
        "calls": calls,
    }
    (args.out / f"rank{jax.process_index()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
