"""Compile time of a zoo model's train step as it grows deeper: scanned against unrolled.

A GPT-2-shaped model (width 512, 8 heads, vocabulary 8192, 128 tokens) with 4, 16
and 64 layers; the AdamW train step is compiled for a 4 x 2 mesh on abstract shapes
(`rc.memory_plan`, nothing allocated). With `scan_layers=True` (what `rc.memory_plan` and the
presets use) one layer is compiled whatever the depth; unrolled, every layer is.
Median of 3 compiles, after one warm-up compile.

Target: scanned, 64 layers <= 1.5 x 4 layers.

Run: python scripts/bench_compile.py   (writes bench-results/bench_compile.json)
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

DEPTHS = (4, 16, 64)
UNROLLED_DEPTHS = (4, 16)


def main() -> None:
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", 8)
    import redcoast as rc

    def seconds(layers: int, scan: bool) -> float:
        config = rc.models.GPT2Config(
            vocab_size=8192, n_positions=128, n_embd=512, n_layer=layers, n_head=8
        )
        make = lambda k: rc.models.GPT2(config, scan_layers=scan, key=k)  # noqa: E731
        runs = [
            rc.memory_plan(make, devices=8, n_model_shards=2, seq_len=128, max_batch=False)
            for _ in range(3)
        ]
        return statistics.median(r.compile_seconds for r in runs)

    seconds(2, True)  # warm-up: the first compile of a process also pays for JAX's own start
    rows = []
    print("| layers | scanned | unrolled |")
    print("|---|---|---|")
    for layers in DEPTHS:
        scanned = seconds(layers, True)
        unrolled = seconds(layers, False) if layers in UNROLLED_DEPTHS else None
        rows.append({"layers": layers, "scanned_s": scanned, "unrolled_s": unrolled})
        shown = "" if unrolled is None else f"{unrolled:.1f} s"
        print(f"| {layers} | {scanned:.1f} s | {shown} |", flush=True)
    ratio = rows[-1]["scanned_s"] / rows[0]["scanned_s"]
    print(f"scanned, {DEPTHS[-1]} layers / {DEPTHS[0]} layers: {ratio:.2f} (target <= 1.5)")
    out = Path("bench-results/bench_compile.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "ratio_64_over_4": ratio}, indent=2) + "\n")


if __name__ == "__main__":
    main()
