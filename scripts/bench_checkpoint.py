"""Checkpoint save/load time and peak host memory, against raw safetensors, on 8 simulated devices.

A ~100M-parameter LLaMA-shaped model is split over a 2 x 4 mesh. "raw" gathers every
array to the host and calls `safetensors.numpy.save_file` on the whole dict (and
`load_file` + `device_put` to load); redcoast streams one leaf at a time. Peak extra
host memory is the highest resident set size seen during the call minus the one
before it, sampled every 2 ms.

Targets: save time within 1.5x of raw; peak extra memory below 2x the largest leaf.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/bench_checkpoint.py
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc

# The reference models live with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny import TinyLlama

from redcoast.sharding import path_str


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """Wall time and peak extra resident memory of `fn()`."""
    base = rss()
    peak = base
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss())
            time.sleep(0.002)

    thread = threading.Thread(target=sample)
    thread.start()
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(jax.tree_util.tree_leaves(eqx.filter(out, eqx.is_array)) if out else 0)
    elapsed = time.perf_counter() - start
    done.set()
    thread.join()
    return elapsed, max(peak, rss()) - base, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench-results/bench_checkpoint.json")
    args = parser.parse_args()

    model = TinyLlama(args.vocab, args.hidden, args.layers, 12, 12, 2048, key=jax.random.key(0))
    ids = jnp.zeros((1, 8), jnp.int32)
    specs = rc.sharding_rules(model, 4, example_call=lambda m: jax.vmap(m)(ids))
    mesh = rc.make_mesh(4)
    model = rc.shard(model, mesh, specs)
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]
    n_params = sum(x.size for _, x in leaves)
    largest = max(x.nbytes for _, x in leaves)
    total = sum(x.nbytes for _, x in leaves)
    flat_specs = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))
    root = Path(tempfile.mkdtemp(prefix="redcoast-bench-"))

    def raw_save() -> None:
        tensors = {path_str(p): np.asarray(x) for p, x in leaves}
        safetensors.numpy.save_file(tensors, str(root / "raw.safetensors"))

    def ours_save() -> None:
        rc.save_checkpoint(root / "ours", model=model, step=0)

    def raw_load() -> Any:
        tensors = safetensors.numpy.load_file(str(root / "raw.safetensors"))
        return [
            jax.device_put(tensors[path_str(p)], NamedSharding(mesh, s))
            for (p, _), s in zip(leaves, flat_specs, strict=True)
        ]

    def ours_load() -> Any:
        return rc.load_checkpoint(root / "ours", like=model, mesh=mesh, specs=specs).model

    results: dict[str, dict[str, float]] = {}
    try:
        for name, fn in [
            ("raw save", raw_save),
            ("redcoast save", ours_save),
            ("raw load", raw_load),
            ("redcoast load", ours_load),
        ]:
            times, peaks = [], []
            for _ in range(args.repeats):
                elapsed, peak, out = measure(fn)
                del out
                times.append(elapsed)
                peaks.append(peak)
            results[name] = {
                "seconds": float(np.median(times)),
                "peak_extra_bytes": int(max(peaks)),
            }
        loaded = rc.load_checkpoint(root / "ours", like=model, mesh=mesh, specs=specs).model
        for a, b in zip(
            jax.tree_util.tree_leaves(eqx.filter(loaded, eqx.is_array)),
            [x for _, x in leaves],
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"\nmodel: {n_params / 1e6:.1f}M parameters, {total / 2**20:.0f} MiB, "
        f"largest leaf {largest / 2**20:.0f} MiB, mesh 2 x 4, median of {args.repeats}"
    )
    print(f"{'operation':15} {'seconds':>8} {'peak extra MiB':>15} {'x largest leaf':>15}")
    for name, r in results.items():
        print(
            f"{name:15} {r['seconds']:8.2f} {r['peak_extra_bytes'] / 2**20:15.0f} "
            f"{r['peak_extra_bytes'] / largest:15.2f}"
        )
    save_ratio = results["redcoast save"]["seconds"] / results["raw save"]["seconds"]
    load_ratio = results["redcoast load"]["seconds"] / results["raw load"]["seconds"]
    mem = results["redcoast save"]["peak_extra_bytes"] / largest
    print(
        f"\nsave time redcoast/raw: {save_ratio:.2f} (target <= 1.5); load: {load_ratio:.2f}; "
        f"save peak extra memory: {mem:.2f} x largest leaf (target < 2)"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "n_params": n_params,
                "largest_leaf_bytes": largest,
                "results": results,
                "save_ratio": save_ratio,
                "load_ratio": load_ratio,
                "save_peak_over_largest": mem,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
