"""Per-device memory and collective bytes of attention over a long sequence, split or not.

`rc.context_parallel_attention` is compiled (on abstract shapes: nothing runs) for a
training pass -- the output and the gradients of q, k and v -- over a sequence of 8k
to 32k tokens, unsplit on one device and with the sequence split over 2, 4 and 8
simulated devices, by the ring (`strategy="ring"`) and by gathering the keys and
values (`strategy="all_gather"`). From each compiled program: XLA's temporary memory
per device (`memory_analysis().temp_size_in_bytes`: scores, softmax and workspace),
its inputs and outputs per device, and its collectives, read from the partitioned
HLO by `tests/hlo.py`: "collective MiB" adds up each collective's result on one
device, the bytes a ppermute moves, the whole gathered array for an all-gather.

"unsplit" is the zoo's attention formula (`redcoast.models.Attention`) on one device:
its scores are `heads x seq x seq` float32, the term that the split shrinks.

Run: python scripts/bench_context.py [--seqs 8192 16384 32768] [--heads 4] [--head-dim 64]
     (writes bench-results/bench_context.json)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hlo import collectives

MIB = 2**20


def unsplit(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """The zoo's causal attention on one device (no grouped heads here)."""
    scores = jnp.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((q.shape[0], k.shape[0]), dtype=bool))
    scores = jnp.where(causal[None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("hts,shd->thd", weights, v)


def measure(attention, shape: tuple[int, ...], dtype, sharding, mesh) -> dict[str, float]:
    """Compile the training pass of `attention` on abstract inputs and read its costs."""
    arg = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def train(q: jax.Array, k: jax.Array, v: jax.Array, cotangent: jax.Array):
        out, pullback = jax.vjp(attention, q, k, v)
        return out, pullback(cotangent)

    start = time.perf_counter()
    compiled = jax.jit(train).lower(arg, arg, arg, arg).compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    sent = collectives(compiled.as_text(), mesh) if mesh is not None else []
    return {
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "collective_bytes": int(sum(c.nbytes for c in sent)),
        "collectives": len(sent),
        "compile_seconds": round(seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", default="bench-results/bench_context.json")
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    results = []
    print(
        f"causal attention, {args.heads} heads x {args.head_dim}, {args.dtype}, training pass "
        "(output + gradients of q, k, v); MiB per device"
    )
    print(
        "| tokens | layout | devices | temp | ÷ unsplit | inputs+outputs | collective MiB "
        "| collectives |"
    )
    print("|" + "---|" * 8)
    for seq in args.seqs:
        shape = (seq, args.heads, args.head_dim)
        base = measure(unsplit, shape, dtype, None, None)
        rows = [("unsplit", 1, base)]
        for strategy in ("ring", "all_gather"):
            for n in (2, 4, 8):
                mesh = Mesh(np.asarray(jax.devices()[:n]).reshape(1, n), ("data", "model"))

                def split(q, k, v, mesh=mesh, strategy=strategy):
                    return rc.context_parallel_attention(
                        q, k, v, mesh=mesh, axis="model", causal=True, strategy=strategy
                    )

                sharding = NamedSharding(mesh, P("model"))
                rows.append((strategy, n, measure(split, shape, dtype, sharding, mesh)))
        for layout, n, r in rows:
            io = (r["argument_bytes"] + r["output_bytes"]) / MIB
            print(
                f"| {seq} | {layout} | {n} | {r['temp_bytes'] / MIB:,.1f} "
                f"| {r['temp_bytes'] / base['temp_bytes']:.3f} | {io:,.1f} "
                f"| {r['collective_bytes'] / MIB:,.1f} | {r['collectives']} |",
                flush=True,
            )
            results.append(
                {
                    "tokens": seq,
                    "heads": args.heads,
                    "head_dim": args.head_dim,
                    "dtype": args.dtype,
                    "layout": layout,
                    "devices": n,
                    **r,
                }
            )
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
