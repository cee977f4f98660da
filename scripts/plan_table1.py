"""The paper's Table 1, row by row: can redcoast fine-tune each model on that hardware?

RedCoast (Tan et al. 2023, Table 1) fine-tunes these models in fp32 with AdamW. For
each row `rc.memory_plan(..., search=True)` compiles the real train step on abstract shapes
for that many simulated devices and reports the cheapest layout that fits each
device's memory (no remat before attention's before dots before full; without
sequence parallelism before with; fewer model shards first; plain data parallelism
before FSDP), with XLA's peak per device, the largest per-device batch and the
longest sequence (at one sequence per device, up to the model's positions) that
layout fits. One row plans LLaMA-2-7B (LLaMA-7B's shape with 4096 positions) at
4096 tokens; a last row asks what arithmetic says cannot fit (LLaMA-7B on one 40 GB
device: 16 bytes a parameter is 108 GB). Memory sizes are GiB (a "40 GB" A100 has
40 GiB). Per-device batch: 1.

Run: python scripts/plan_table1.py   (writes bench-results/plan_table1.json)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

ROWS = [
    # model, seq_len, hardware, devices, GiB per device
    ("gpt2-large", 512, "2 x 10 GB", 2, 10),
    ("bart-large", 1024, "2 x 10 GB", 2, 10),
    ("llama-7b", 1024, "4 x 40 GB", 4, 40),
    ("llama-2-7b", 4096, "4 x 40 GB", 4, 40),
    ("gpt-j-6b", 1024, "4 x 40 GB", 4, 40),
    ("t5-xxl", 512, "2 hosts x 4 x 32 GB", 8, 32),
    ("opt-13b", 1024, "2 hosts x 4 x 32 GB", 8, 32),
    ("opt-66b", 512, "16 hosts x 4 x 32 GB", 64, 32),
    ("llama-7b", 1024, "1 x 40 GB", 1, 40),
]


def main() -> None:
    jax.config.update("jax_num_cpu_devices", max(r[3] for r in ROWS))
    import redcoast as rc

    rows = []
    print(
        "| model | tokens | hardware | verdict | layout chosen | peak per device "
        "| largest batch | longest sequence | planned in |"
    )
    print("|" + "---|" * 9)
    for model, seq, hardware, devices, gib in ROWS:
        start = time.perf_counter()
        result = rc.memory_plan(
            model,
            devices=devices,
            seq_len=seq,
            device_memory=f"{gib}GiB",
            search=True,
            longest_seq=True,
        )
        seconds = time.perf_counter() - start
        verdict = "fits" if result.fits else "does not fit"
        layout = str(result.layout) if result.fits else "none fits"
        peak = f"{result.peak / 2**30:.1f} GiB"
        batch = "" if result.max_batch is None else str(result.max_batch)
        longest = "" if result.max_seq_len is None else str(result.max_seq_len)
        print(
            f"| {model} | {seq} | {hardware} | {verdict} | {layout} | {peak} | {batch} "
            f"| {longest} | {seconds:.0f} s |",
            flush=True,
        )
        rows.append(
            {
                "model": model,
                "seq_len": seq,
                "hardware": hardware,
                "seconds": seconds,
                **result.to_dict(),
            }
        )
    out = Path("bench-results/plan_table1.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
