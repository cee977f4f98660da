"""Per-device memory of one compiled train step under each precision and remat policy.

A GPT-2-shaped model (8 layers, 256 wide, 8 heads, vocabulary 512, sequences of 128)
is split over a 2 x 4 mesh of simulated CPU devices by the dataflow rules; the global
batch of 16 sequences is sharded `P("data")`. For each policy the step `fit` runs
(`rc.train_step`, AdamW) is compiled, never run, and `memory_analysis()` gives the
per-device bytes: `temp` (activations and other temporaries: what remat trades) and
`args` (parameters, optimizer state and batch: what pure-bf16 halves).

Targets: temporaries with `remat="full"` at most half of `remat="none"` (scanned layers).

Caveats of the CPU backend, visible in the table: XLA:CPU has no bfloat16 matmul and
rewrites each one into float32 (with converts around it), so bf16 compute does not
shrink temporaries here as it does on GPU/TPU; and with unrolled layers (`--unrolled`)
its scheduler moves the recomputation of a rematerialised block next to its forward
pass, so remat saves nothing there. Scanned layers pin the recomputation inside the
backward loop.

Run: python scripts/bench_memory_policies.py   (about 2 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc
from redcoast.models import GPT2, GPT2Config

CONFIG = GPT2Config(vocab_size=512, n_positions=128, n_embd=256, n_layer=8, n_head=8)
BATCH, SEQ = 16, 128


def loss_fn(model: GPT2, batch: dict[str, jax.Array], key: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(batch["ids"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1], batch["ids"][:, 1:]
    ).mean()


def measure(precision: str, remat: str, *, scan: bool) -> dict[str, Any]:
    """Compile one train step and read its per-device memory."""
    mesh = rc.make_mesh(4)
    ids = jax.device_put(jnp.zeros((BATCH, SEQ), jnp.int32), NamedSharding(mesh, P("data")))
    batch = {"ids": ids}
    model = GPT2(CONFIG, scan_layers=scan, remat=remat, key=jax.random.key(0))
    model = rc.place(model, mesh, example_call=lambda m: loss_fn(m, batch, jax.random.key(0)))
    if precision == "pure-bf16":
        model = rc.cast(model, jnp.bfloat16)
    optimizer = optax.adamw(1e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = rc.train_step(loss_fn, optimizer, mesh=mesh, precision=precision, jit=False)
    start = time.perf_counter()
    compiled = jax.jit(step).lower(model, opt_state, batch, jax.random.key(0)).compile()
    memory = compiled.memory_analysis()
    return {
        "precision": precision,
        "remat": remat,
        "layers": "scan" if scan else "unrolled",
        "temp_mib": memory.temp_size_in_bytes / 2**20,
        "args_mib": memory.argument_size_in_bytes / 2**20,
        "compile_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unrolled", action="store_true", help="also measure unrolled layers")
    parser.add_argument("--out", default="bench-results/bench_memory_policies.json")
    args = parser.parse_args()
    rows = []
    print(f"{'layers':>8} {'precision':>10} {'remat':>5} {'temp MiB':>9} {'args MiB':>9}")
    for scan in (True, False) if args.unrolled else (True,):
        for precision in ("fp32", "bf16", "pure-bf16"):
            for remat in ("none", "dots", "full"):
                row = measure(precision, remat, scan=scan)
                rows.append(row)
                print(
                    f"{row['layers']:>8} {precision:>10} {remat:>5} "
                    f"{row['temp_mib']:9.1f} {row['args_mib']:9.1f}",
                    flush=True,
                )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
