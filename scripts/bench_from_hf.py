"""Peak host memory of `from_hf` onto a mesh, against the largest tensor it reads.

A `transformers` LLaMA (hidden 1024, 8 layers, vocabulary 32000; 0.16B parameters,
0.64 GB in float32) is saved with `save_pretrained`, then loaded by
`rc.models.Llama.from_hf(..., mesh=4 x 2)` with unrolled and with scanned layers.
Host memory is what Python and NumPy allocate while loading (`tracemalloc`): the
tensors read, converted and handed to the devices; the devices' own buffers are
not counted (on a CPU they are host memory too, but on an accelerator they are
not). Needs the `hf` extra (torch, transformers).

Run: python scripts/bench_from_hf.py   (writes bench-results/bench_from_hf.json)
"""

from __future__ import annotations

import json
import os
import tempfile
import tracemalloc
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import torch
import transformers

import redcoast as rc


def main() -> None:
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        hf_model.save_pretrained(folder)
        sizes = {n: p.numel() * 4 for n, p in hf_model.named_parameters()}
        largest = max(sizes.values())
        total = sum(sizes.values())
        del hf_model
        mesh = rc.make_mesh(2)
        print(f"checkpoint {total / 1e6:.0f} MB; largest tensor {largest / 1e6:.0f} MB")
        print("| layers | peak host memory | ÷ largest tensor | ÷ checkpoint |")
        print("|---|---|---|---|")
        for scan in (False, True):
            tracemalloc.start()
            model = rc.models.Llama.from_hf(folder, mesh=mesh, scan_layers=scan)
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            del model
            name = "scanned" if scan else "unrolled"
            print(
                f"| {name} | {peak / 1e6:.0f} MB | {peak / largest:.2f} | {peak / total:.2f} |",
                flush=True,
            )
            rows.append({"layers": name, "peak": peak, "largest": largest, "total": total})
    out = Path("bench-results/bench_from_hf.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
