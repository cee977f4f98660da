"""Checkpoint save/load time, checksum cost and peak host memory, against raw safetensors.

A ~100M-parameter LLaMA-shaped model is split over a 2 x 4 mesh of simulated CPU
devices. "raw" gathers every array to the host and calls
`safetensors.numpy.save_file` on the whole dict (and `load_file` + `device_put` to
load); redcoast streams one leaf at a time, computes each tensor's XXH3 hash while
writing, fsyncs, and on load verifies the checksums (`verify=True`, the default)
before placing each leaf. "redcoast save no checksum" is the same save with the
hash replaced by a constant: the baseline for what hashing costs a save.

How memory is measured, and why so. Each operation runs in a fresh process (the
model is rebuilt there), and freed heap is handed back to the system before each
call (`malloc_trim`), because a process reuses memory it freed: measured after
another operation, a load's "extra" memory looked like 20 MiB. "peak" is the
kernel's exact high-water mark of resident memory during the call (VmHWM, reset
through /proc/self/clear_refs) minus the resident memory before it; "file" is the
sampled peak of file-backed pages (the checkpoint's memory map, which the kernel can
drop at any time). On CPU the loaded arrays themselves live in host memory: "held"
is the resident memory still in use when the call returned (the result; "result"
is the size of every device's shards, more than "held" because some shards share
memory with the file's map), and "transient" = peak - held is what the call needed
on top of what it returns: the host memory a load onto accelerators would need.
Time is the median of `--repeats` calls in that process; memory is from the first.

Targets: save time within 1.5x of raw; peak extra memory of a save below 2x the
largest leaf; checksums cost at most 10% (load with verify vs without, save with
the hash vs without).

Run: python scripts/bench_checkpoint.py   (about 2 minutes on 2 cores)
"""

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
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
import redcoast.checkpoint._format

# The reference models live with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny import TinyLlama

from redcoast._tree_paths import path_str

OPERATIONS = [
    "raw save",
    "redcoast save",
    "redcoast save no checksum",
    "raw load",
    "redcoast load verify",
    "redcoast load no verify",
]


def status() -> dict[str, int]:
    """This process's resident memory figures from /proc/self/status, in bytes."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM", "RssFile", "RssShmem"):
                found[name] = int(value.split()[0]) * 1024
    return found


def measure(fn: Callable[[], Any]) -> tuple[float, int, int, int, Any]:
    """Wall time; peak extra resident memory of `fn()`, what of it is still held when
    it returned, and the peak of file-backed pages (sampled every 2 ms)."""
    # Freed heap goes back to the system first, or `fn` would reuse it unseen; the
    # kernel's high-water mark (VmHWM, reset by writing 5 to clear_refs) is exact
    # where a sampling thread, which needs the GIL, can miss a short peak.
    # Dirty pages of earlier writes go to disk first: a save's time would otherwise
    # include, at random, the writeback of the save before it.
    os.sync()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status()
    peak_file = base["RssFile"] + base.get("RssShmem", 0)
    done = threading.Event()

    def sample() -> None:
        nonlocal peak_file
        while not done.is_set():
            now = status()
            peak_file = max(peak_file, now["RssFile"] + now.get("RssShmem", 0))
            time.sleep(0.002)

    thread = threading.Thread(target=sample)
    thread.start()
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(jax.tree_util.tree_leaves(eqx.filter(out, eqx.is_array)) if out else 0)
    elapsed = time.perf_counter() - start
    done.set()
    thread.join()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # so that "held" is what is still in use
    end = status()
    base_file = base["RssFile"] + base.get("RssShmem", 0)
    return (
        elapsed,
        end["VmHWM"] - base["VmRSS"],
        end["VmRSS"] - base["VmRSS"],
        peak_file - base_file,
        out,
    )


def result_bytes(out: Any) -> int:
    """Bytes of every device's shards of the returned arrays."""
    leaves = jax.tree_util.tree_leaves(eqx.filter(out, eqx.is_array)) if out else []
    return sum(s.data.nbytes for x in leaves for s in x.addressable_shards)


def child(args: argparse.Namespace) -> None:
    """Run one operation `args.repeats` times in this fresh process; print JSON."""
    model = TinyLlama(args.vocab, args.hidden, args.layers, 12, 12, 2048, key=jax.random.key(0))
    ids = jnp.zeros((1, 8), jnp.int32)
    specs = rc.sharding_plan(model, 4, example_call=lambda m: jax.vmap(m)(ids)).specs
    mesh = rc.make_mesh(4)
    model = rc.place(model, mesh, specs=specs)
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]
    flat_specs = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))
    root = Path(args.root)

    def raw_save() -> None:
        tensors = {path_str(p): np.asarray(x) for p, x in leaves}
        safetensors.numpy.save_file(tensors, str(root / "raw.safetensors"))

    def ours_save() -> None:
        rc.save_checkpoint(root / "ours", model=model, step=0)

    def ours_save_unhashed() -> None:
        # The same save, every hash replaced by a constant that costs nothing.
        unhashed = types.SimpleNamespace(xxh3_64_hexdigest=lambda data: "0" * 16)
        real, redcoast.checkpoint._format.xxhash = redcoast.checkpoint._format.xxhash, unhashed
        try:
            rc.save_checkpoint(root / "unhashed", model=model, step=0)
        finally:
            redcoast.checkpoint._format.xxhash = real

    def raw_load() -> Any:
        tensors = safetensors.numpy.load_file(str(root / "raw.safetensors"))
        return [
            jax.device_put(tensors[path_str(p)], NamedSharding(mesh, s))
            for (p, _), s in zip(leaves, flat_specs, strict=True)
        ]

    def ours_load(verify: bool) -> Any:
        path = root / "ours"
        return rc.load_checkpoint(path, like=model, mesh=mesh, specs=specs, verify=verify).model

    fns = {
        "raw save": raw_save,
        "redcoast save": ours_save,
        "redcoast save no checksum": ours_save_unhashed,
        "raw load": raw_load,
        "redcoast load verify": lambda: ours_load(True),
        "redcoast load no verify": lambda: ours_load(False),
    }
    runs = []
    for _ in range(args.repeats):
        elapsed, peak, held, file, out = measure(fns[args.child])
        runs.append((elapsed, peak, held, file, result_bytes(out)))
        if args.child.startswith("redcoast load"):
            for a, (_, b) in zip(jax.tree_util.tree_leaves(out), leaves, strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        del out
    first = runs[0]  # the only call whose memory no earlier call has warmed
    print(
        json.dumps(
            {
                "seconds": float(np.median([r[0] for r in runs])),
                "all_seconds": [r[0] for r in runs],
                "peak_extra_bytes": first[1],
                "held_bytes": first[2],
                "peak_extra_file_bytes": first[3],
                "result_bytes": first[4],
            }
        )
    )


def run(op: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", op, "--root", str(root)]
    command += ["--repeats", str(args.repeats), "--vocab", str(args.vocab)]
    command += ["--hidden", str(args.hidden), "--layers", str(args.layers)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench-results/bench_checkpoint.json")
    parser.add_argument("--child", choices=OPERATIONS, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args)
        return

    model = eqx.filter_eval_shape(
        TinyLlama, args.vocab, args.hidden, args.layers, 12, 12, 2048, key=jax.random.key(0)
    )
    shapes = [x for x in jax.tree_util.tree_leaves(model) if isinstance(x, jax.ShapeDtypeStruct)]
    n_params = sum(x.size for x in shapes)
    largest = max(x.size * x.dtype.itemsize for x in shapes)
    total = sum(x.size * x.dtype.itemsize for x in shapes)
    root = Path(tempfile.mkdtemp(prefix="redcoast-bench-"))
    try:
        results = {op: run(op, args, root) for op in OPERATIONS}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"\nmodel: {n_params / 1e6:.1f}M parameters, {total / 2**20:.0f} MiB, "
        f"largest leaf {largest / 2**20:.0f} MiB, mesh 2 x 4, median of {args.repeats}, "
        "each operation in a fresh process"
    )
    mib = 2**20
    print(
        f"{'operation':24} {'seconds':>8} {'peak MiB':>9} {'held MiB':>9} "
        f"{'transient MiB':>14} {'x largest':>10} {'file MiB':>9} {'result MiB':>11}"
    )
    for name, r in results.items():
        transient = r["peak_extra_bytes"] - r["held_bytes"]
        r["transient_bytes"] = transient
        print(
            f"{name:24} {r['seconds']:8.2f} {r['peak_extra_bytes'] / mib:9.0f} "
            f"{r['held_bytes'] / mib:9.0f} {transient / mib:14.0f} "
            f"{transient / largest:10.2f} {r['peak_extra_file_bytes'] / mib:9.0f} "
            f"{r['result_bytes'] / mib:11.0f}"
        )
    seconds = {name: r["seconds"] for name, r in results.items()}
    summary = {
        "save_ratio": seconds["redcoast save"] / seconds["raw save"],
        "load_ratio": seconds["redcoast load verify"] / seconds["raw load"],
        "verify_cost": seconds["redcoast load verify"] / seconds["redcoast load no verify"],
        "save_hash_cost": seconds["redcoast save"] / seconds["redcoast save no checksum"],
        "save_peak_over_largest": results["redcoast save"]["peak_extra_bytes"] / largest,
    }
    print(
        f"\nsave time redcoast/raw: {summary['save_ratio']:.2f} (target <= 1.5); "
        f"load (verified) redcoast/raw: {summary['load_ratio']:.2f}; "
        f"load verify/no verify: {summary['verify_cost']:.2f} (target <= 1.10); "
        f"save checksum/none: {summary['save_hash_cost']:.2f} (target <= 1.10); "
        f"save peak extra memory: {summary['save_peak_over_largest']:.2f} x largest leaf "
        "(target < 2)"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"n_params": n_params, "largest_leaf_bytes": largest, "results": results, **summary},
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
