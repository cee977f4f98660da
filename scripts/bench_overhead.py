"""What `rc.fit` costs over a hand-written `jax.jit` loop, on 8 simulated devices.

Both loops train the same small GPT with the same jitted step (`rc.train_step`), the
same shardings (the model split by the dataflow rules, the batch `P("data")`) and the
same data, collated by the same `collate_fn`. The hand-written loop indexes the
examples, collates, `device_put`s and calls the step; `fit` adds shuffling, host-local
assembly, metric fetches, logging and the rest of its bookkeeping. Each repeat times
`--steps` steps of each after a warm-up (compilation excluded), the two in alternating
order; the figure is the median of the paired ratios fit/hand of steps per second.

Target: ratio >= 0.97. Also reported: host seconds per step `fit` spends outside the
jitted call (collating the next batch, logging, the progress bar).

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/bench_overhead.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc

# The reference models live with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny import TinyGPT

VOCAB, SEQ = 256, 64


def collate_fn(examples: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {"ids": np.stack(examples).astype(np.int32)}


def loss_fn(model: TinyGPT, batch: dict[str, jax.Array], key: jax.Array) -> jax.Array:
    ids = batch["ids"]
    logits = jax.vmap(model)(ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def new_model() -> TinyGPT:
    return TinyGPT(VOCAB, 128, 2, 4, SEQ, key=jax.random.key(0))


def time_fit(
    examples: list[np.ndarray], mesh: Mesh, batch: int, warmup: int, steps: int
) -> tuple[float, dict[str, float]]:
    """Seconds for `steps` steps of `fit` after `warmup`, from its logger's timestamps."""
    stamps: dict[int, float] = {}

    def clock(metrics: dict[str, Any], step: int) -> None:
        stamps[step] = time.perf_counter()

    result = rc.fit(
        new_model(),
        optax.adamw(1e-3),
        examples,
        collate_fn=collate_fn,
        loss_fn=loss_fn,
        mesh=mesh,
        per_device_batch_size=batch,
        max_steps=warmup + steps,
        log_every=warmup,
        loggers=[clock],
        progress=True,
    )
    # The logger sees step s once its metrics are on the host, i.e. after step s ran.
    jax.block_until_ready(result.model)
    end = time.perf_counter()
    return end - stamps[warmup], result.history["timing"]


def time_hand(examples: list[np.ndarray], mesh: Mesh, batch: int, warmup: int, steps: int) -> float:
    """Seconds for `steps` steps of a plain loop over the same jitted step."""
    n_data = mesh.shape["data"]
    size = batch * n_data
    model = new_model()
    specs = rc.sharding_plan(
        model,
        mesh.shape["model"],
        example_call=lambda m: loss_fn(m, collate_fn(examples[:2]), None),
    ).specs
    model = rc.place(model, mesh, specs=specs)
    optimizer = optax.adamw(1e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    core = rc.train_step(loss_fn, optimizer, mesh=mesh, jit=False)
    key = jax.random.key(0)

    # As fit does: the step key derived inside the jitted call, not by a separate dispatch.
    @eqx.filter_jit(donate="all")
    def step(model: TinyGPT, opt_state: Any, batch: Any, i: Any) -> Any:
        return core(model, opt_state, batch, jax.random.fold_in(key, i))

    sharding = NamedSharding(mesh, P("data"))
    order = np.random.default_rng(0).permutation(len(examples))
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            jax.block_until_ready(model)
            start = time.perf_counter()
        idx = order[(i * size) % len(examples) :][:size]
        host = collate_fn([examples[j] for j in idx])
        batch_arrays = jax.device_put(host, sharding)
        model, opt_state, _ = step(model, opt_state, batch_arrays, np.int32(i))
    jax.block_until_ready(model)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--per-device-batch-size", type=int, default=4)
    parser.add_argument("--out", default="bench-results/bench_overhead.json")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    examples = [rng.integers(0, VOCAB, SEQ + 1, dtype=np.int64) for _ in range(4096)]
    rows = []
    for n_model in (4, 1):
        mesh = rc.make_mesh(n_model)
        ratios, fit_rates, hand_rates, outside = [], [], [], []
        for r in range(args.repeats):
            pair: dict[str, float] = {}
            for which in ("fit", "hand") if r % 2 == 0 else ("hand", "fit"):
                if which == "fit":
                    seconds, timing = time_fit(
                        examples, mesh, args.per_device_batch_size, args.warmup, args.steps
                    )
                    outside.append(timing["data_s"] + timing["other_s"])
                else:
                    seconds = time_hand(
                        examples, mesh, args.per_device_batch_size, args.warmup, args.steps
                    )
                pair[which] = args.steps / seconds
            fit_rates.append(pair["fit"])
            hand_rates.append(pair["hand"])
            ratios.append(pair["fit"] / pair["hand"])
        n_data = mesh.shape["data"]
        rows.append(
            {
                "mesh": f"{n_data}x{n_model}",
                "fit_steps_per_s": float(np.median(fit_rates)),
                "hand_steps_per_s": float(np.median(hand_rates)),
                "ratio_median": float(np.median(ratios)),
                "ratios": [float(x) for x in ratios],
                "fit_host_ms_per_step_outside_jit": 1e3 * float(np.median(outside)),
            }
        )

    print(f"\nsmall GPT, {args.steps} timed steps, median of {args.repeats} paired runs")
    print(f"{'mesh':6} {'fit step/s':>11} {'hand step/s':>12} {'fit/hand':>9} {'host ms/step':>13}")
    for row in rows:
        print(
            f"{row['mesh']:6} {row['fit_steps_per_s']:11.2f} {row['hand_steps_per_s']:12.2f} "
            f"{row['ratio_median']:9.3f} {row['fit_host_ms_per_step_outside_jit']:13.2f}"
        )
    print("target: fit/hand >= 0.97")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
