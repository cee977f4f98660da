"""Does a real `fit` cost what the planner says? Peak host memory of a few real steps.

On simulated CPU devices every device's memory is host memory, so the process's
peak resident set is the real figure to hold against 8 x the planner's per-device
peak. Each row runs in a fresh process: `rc.sharded_init` of a zoo preset (scanned
layers, TP x FSDP over 8 devices), then a few AdamW steps on random token rows

- through `rc.fit(..., donate=True)`, which hands the model over;
- through `rc.fit` as it is, which keeps the model it was given valid (a copy);
- through a loop of `rc.train_step`, the step alone.

Usage: python scripts/bench_fit_memory.py [--model gpt2-medium] [--steps 3] [--rows ROW ...]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROWS = ("plan", "fit(donate=True)", "fit", "train_step loop")
RESULTS = Path("bench-results")


def child(row: str, model: str, n_model: int, seq_len: int, steps: int) -> dict[str, float]:
    """One row, in this process; returns its figures."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import equinox as eqx
    import numpy as np
    import optax

    import redcoast as rc

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if row == "plan":
        plan = rc.memory_plan(model, devices=8, n_model_shards=n_model, fsdp=True, seq_len=seq_len)
        return {
            "peak": plan.peak,
            "peak_keeping_model": plan.peak_keeping_model,
            "params": plan.params,
        }
    cls, config = rc.models.preset(model)
    mesh = rc.make_mesh(n_model)
    net = rc.sharded_init(
        lambda k: cls(config, scan_layers=True, key=k), jax.random.key(0), mesh, fsdp=True
    )
    rng = np.random.default_rng(0)
    rows = [
        rng.integers(0, config.vocab_size, seq_len + 1, dtype=np.int32)
        for _ in range(steps * mesh.shape["data"])
    ]
    optimizer = optax.adamw(1e-4)
    losses = []
    if row == "train_step loop":
        step = rc.train_step(rc.models.lm_loss, optimizer, mesh=mesh)
        opt_state = optimizer.init(eqx.filter(net, eqx.is_inexact_array))
        it = rc.batches(
            rows,
            collate_fn=lambda ex: {"input_ids": np.stack(ex)},
            mesh=mesh,
            batch_size=mesh.shape["data"],
        )
        for i, batch in enumerate(it):
            net, opt_state, metrics = step(
                net, opt_state, batch.arrays, jax.random.fold_in(jax.random.key(0), i)
            )
            losses.append(float(metrics["loss"]))
    else:
        result = rc.fit(
            net,
            optimizer,
            rows,
            collate_fn=lambda ex: {"input_ids": np.stack(ex)},
            loss_fn=rc.models.lm_loss,
            mesh=mesh,
            per_device_batch_size=1,
            max_steps=steps,
            log_every=1,
            progress=False,
            donate=row == "fit(donate=True)",
        )
        losses = [r["loss"] for r in result.history["train"]]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_rss": peak, "base_rss": base, "loss_last": losses[-1]}


def run_row(row: str, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    command = [sys.executable, __file__, "--child", row, "--model", args.model]
    command += ["--n-model-shards", str(args.n_model_shards), "--seq-len", str(args.seq_len)]
    command += ["--steps", str(args.steps)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{row} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-medium")
    parser.add_argument("--n-model-shards", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", choices=ROWS)
    parser.add_argument(
        "--rows", nargs="+", choices=ROWS[1:], default=ROWS[1:], help="which runs (default: all)"
    )
    args = parser.parse_args()
    if args.child:
        figures = child(args.child, args.model, args.n_model_shards, args.seq_len, args.steps)
        print(json.dumps(figures))
        return
    results = {row: run_row(row, args) for row in ("plan", *args.rows)}
    planned = 8 * results["plan"]["peak"]
    gb = 1e9
    print(
        f"{args.model}, TP {args.n_model_shards} x FSDP {8 // args.n_model_shards}, "
        f"{args.seq_len} tokens, {args.steps} AdamW steps, 8 simulated devices; "
        f"8 x planned peak: {planned / gb:.2f} GB (without donate: "
        f"{8 * results['plan']['peak_keeping_model'] / gb:.2f} GB)"
    )
    print("| run | peak host memory | ÷ 8 x planned peak | process before the model | last loss |")
    print("|---|---|---|---|---|")
    for row in args.rows:
        r = results[row]
        print(
            f"| {row} | {r['peak_rss'] / gb:.2f} GB | {r['peak_rss'] / planned:.3f} | "
            f"{r['base_rss'] / gb:.2f} GB | {r['loss_last']:.4f} |"
        )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"bench_fit_memory_{args.model}.json"
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
