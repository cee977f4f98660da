"""Verdicts for the hardware people rent: LLaMA-2-7B on TPU slices and LLaMA-7B on one GPU.

Each row is one `rc.memory_plan(..., target=...)`: the real AdamW train step compiled
on abstract shapes, for a TPU slice by the TPU compiler (libtpu, `pip install
'redcoast[tpu]'`; it runs on a machine without a TPU), for a GPU from the CPU
compiler's program (blockwise attention where cuDNN's would run, without the float32
copies of bfloat16 values only XLA:CPU makes). bf16 compute (fp32 weights and AdamW
state for a full fine-tune; a bfloat16 frozen base for LoRA rank 8 on every
projection), full remat, scanned layers, one
sequence per device; FSDP over the slice for the full fine-tunes. The step time is
the planner's roofline at the hardware's published peak (a lower bound; see
`redcoast.plan._targets.StepEstimate`).

`--families` plans today's checkpoints instead (Llama 3.x, Qwen 2.5 / 3, Mistral,
Mixtral, Gemma 2, Phi-3): LoRA rank 16 on every projection of a bfloat16 base, 4096
tokens, full remat, scanned layers, on one 24 GB GPU (an L4) and one 16 GB TPU v5e chip.

Run: python scripts/plan_targets.py [--families] [--only TARGET[,TARGET...]]
     (writes bench-results/plan_targets.json or plan_targets_families.json; with
     `--only`, the rows for those targets replace theirs there, the rest are kept)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROWS = [
    # model, tokens, target, LoRA rank (0: full fine-tune), FSDP
    ("llama-2-7b", 2048, "v5e-8", 0, True),
    ("llama-2-7b", 4096, "v5e-8", 0, True),
    ("llama-2-7b", 2048, "v5e-8", 8, False),
    ("llama-2-7b", 4096, "v5e-8", 8, False),
    ("llama-2-7b", 2048, "v5p-8", 0, True),
    ("llama-2-7b", 4096, "v5p-8", 0, True),
    ("llama-2-7b", 2048, "v5p-8", 8, False),
    ("llama-7b", 2048, "l4-24gb", 8, False),
    ("llama-7b", 2048, "h100-80gb", 0, False),
]
FAMILIES = [
    "llama-3.2-1b",
    "llama-3.1-8b",
    "qwen2.5-7b",
    "qwen3-8b",
    "mistral-7b",
    "mixtral-8x7b",
    "gemma-2-9b",
    "phi-3-mini",
]
# Mixtral's experts are stacked arrays, not Linears, and its router has 8 outputs (less
# than the rank): its adapters go on the attention projections, as PEFT users set them.
LORA_TARGETS = {"mixtral-8x7b": "q_proj,k_proj,v_proj,o_proj"}
FAMILY_ROWS = [
    (model, 4096, target, 16, False) for model in FAMILIES for target in ("l4-24gb", "v5e-1")
]


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", action="store_true", help="today's checkpoints")
    parser.add_argument(
        "--only", metavar="TARGET[,TARGET...]", help="plan these targets' rows, keep the rest"
    )
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    families, table = args.families, FAMILY_ROWS if args.families else ROWS
    targets = {row[2] for row in table}
    only = None if args.only is None else set(args.only.split(","))
    if only is not None and only - targets:
        sys.exit(f"--only: no rows for {sorted(only - targets)}; the targets: {sorted(targets)}")

    import redcoast as rc
    from redcoast._units import fmt_bytes

    rc.simulate_devices(1)
    rows = []
    print(
        "| model | tokens | target | training | peak per device | verdict "
        "| estimated step | tokens/s | MFU | planned in |"
    )
    print("|" + "---|" * 10)
    for model, seq, target, rank, fsdp in table:
        if only is not None and target not in only:
            continue
        start = time.perf_counter()
        plan = rc.memory_plan(
            model,
            target=target,
            devices=None if target.startswith("v") else 1,
            fsdp=fsdp,
            seq_len=seq,
            precision="bf16",
            remat="full",
            lora_rank=rank,
            lora_targets=LORA_TARGETS.get(model) if rank else None,
            max_batch=False,
        )
        seconds = time.perf_counter() - start
        step = plan.estimate
        training = f"LoRA rank {rank}" if rank else ("full, FSDP" if fsdp else "full")
        training += " (attention)" if rank and model in LORA_TARGETS else ""
        verdict = "fits" if plan.fits else "does not fit"
        print(
            f"| {model} | {seq} | {target} | {training} | {fmt_bytes(plan.peak)} | {verdict} "
            f"| {step.seconds * 1e3:,.0f} ms | {step.tokens_per_second:,.0f} "
            f"| {step.mfu:.0%} | {seconds:.0f} s |"
            if step is not None
            else f"| {model} | {seq} | {target} | {training} | {fmt_bytes(plan.peak)} "
            f"| {verdict} | | | | {seconds:.0f} s |",
            flush=True,
        )
        rows.append({"model": model, "tokens": seq, "target": target, **plan.to_dict()})
    out = Path(f"bench-results/plan_targets{'_families' if families else ''}.json")
    out.parent.mkdir(exist_ok=True)
    if only is not None and out.exists():
        kept = [row for row in json.loads(out.read_text()) if row["target"] not in only]
        order = {row[:3]: i for i, row in enumerate(table)}
        rows = sorted(kept + rows, key=lambda r: order[(r["model"], r["tokens"], r["target"])])
    out.write_text(json.dumps(rows, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
