"""The loss of a 128k-token vocabulary in chunks: a LoRA step's memory and time, planned.

Each row plans one LoRA train step of a Llama 3 checkpoint's architecture (rank 16 on
every projection of a bfloat16 base, bf16 compute, full remat, scanned layers, one
sequence) with `rc.memory_plan`, twice: with the planner's loss over the whole logits
(every token's float32 logits over 128,256 classes held at once, and their gradient),
and with the logits a chunk of tokens at a time, recomputed in the backward pass
(`loss_chunks="auto"`: `rc.models.lm_loss(..., chunk_tokens="auto")`, which runs
`rc.nn.map_logits`). For a GPU (an L4) from the CPU compiler's program, for a TPU v5e chip by the
TPU compiler (`pip install 'redcoast[tpu]'`); the step time is the planner's roofline
at the hardware's peak. `logits` is one copy of the whole float32 logits
(tokens x vocabulary x 4 bytes); `saved` is what chunking takes off the peak, in such
copies; `chunk` the share of a row's logits one chunk holds.

Run: python scripts/bench_chunked_loss.py [--only TARGET[,TARGET...]]
     (prints a table; writes bench-results/chunked_loss.json; with `--only`, the rows
     for those targets replace theirs there, the rest are kept)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROWS = [
    # model, tokens, target
    ("llama-3.2-1b", 4096, "l4-24gb"),
    ("llama-3.2-1b", 8192, "l4-24gb"),
    ("llama-3.1-8b", 4096, "l4-24gb"),
    ("llama-3.1-8b", 8192, "l4-24gb"),
    ("llama-3.2-1b", 4096, "v5e-1"),
    ("llama-3.2-1b", 8192, "v5e-1"),
]
VOCAB = 128_256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", metavar="TARGET[,TARGET...]", help="plan these targets' rows")
    only = parser.parse_args().only
    targets = None if only is None else set(only.split(","))

    import redcoast as rc
    import redcoast.nn._loss as chunking
    from redcoast._units import fmt_bytes

    rc.simulate_devices(1)
    print(
        "| model | tokens | target | logits | peak, whole | peak, chunks | saved | chunk "
        "| step, whole | step, chunks | planned in |"
    )
    print("|" + "---|" * 11)
    rows = []
    for model, seq, target in ROWS:
        if targets is not None and target not in targets:
            continue
        start = time.perf_counter()
        plans = {
            how: rc.memory_plan(
                model,
                target=target,
                devices=1,
                seq_len=seq,
                precision="bf16",
                remat="full",
                lora_rank=16,
                max_batch=False,
                loss_chunks=chunks,
            )
            for how, chunks in (("whole", None), ("chunks", "auto"))
        }
        seconds = time.perf_counter() - start
        logits = seq * VOCAB * 4
        whole, chunks = plans["whole"], plans["chunks"]
        saved = (whole.peak - chunks.peak) / logits
        share = 1 / chunking._chunks(seq, VOCAB, "auto")

        def step(plan: rc.MemoryPlan) -> str:
            return "" if plan.estimate is None else f"{plan.estimate.seconds * 1e3:,.0f} ms"

        print(
            f"| {model} | {seq} | {target} | {fmt_bytes(logits)} | {fmt_bytes(whole.peak)} "
            f"| {fmt_bytes(chunks.peak)} | {saved:.2f} | {share:.3f} | {step(whole)} "
            f"| {step(chunks)} | {seconds:.0f} s |",
            flush=True,
        )
        rows.append(
            {
                "model": model,
                "tokens": seq,
                "target": target,
                "logits_bytes": logits,
                "chunk_share": share,
                "saved_logits": saved,
                "whole": whole.to_dict(),
                "chunks": chunks.to_dict(),
            }
        )
    out = Path("bench-results/chunked_loss.json")
    out.parent.mkdir(exist_ok=True)
    if targets is not None and out.exists():  # the other targets' rows are kept
        kept = [row for row in json.loads(out.read_text()) if row["target"] not in targets]
        order = {row: i for i, row in enumerate(ROWS)}
        rows = sorted(kept + rows, key=lambda r: order[(r["model"], r["tokens"], r["target"])])
    out.write_text(json.dumps(rows, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
