"""Per-device memory of a ~1B-parameter model's train step under each layout, from XLA.

`rc.memory_plan` compiles the AdamW train step of the zoo's `llama-1b` preset (1.24B
parameters, scanned layers; 1024 tokens, one sequence per device) for 8 simulated
devices on abstract shapes and reads `memory_analysis()`. Each row is a layout:
tensor parallelism only, FSDP only, both, then with bf16 compute and with remat.
"floor" is the model's parameters + AdamW state divided by all 8 devices.

Targets: parameters + optimizer state per device <= 1.10 x the floor under FSDP and
TP x FSDP; activations with full remat <= 0.5 x without.

A second table splits the activations: `llama-1b` at 2048 tokens on one device,
then on n = 2, 4, 8 devices of tensor parallelism without and with sequence
parallelism (`rc.SequenceParallel`), and with remat's `"attention"` policy.
Target: activations per device with sequence parallelism <= 1.15 x one device's / n.

A third table splits the sequence itself: `llama-1b` given 16384 positions, one
sequence of 2048 to 16384 tokens on one device, then on 8 devices under TP 8 + SP,
context parallelism over all 8 (`rc.ContextParallel`, ring attention), the same
with FSDP, and TP 2 + SP x CP 4. Target: activations per device under CP 8 <= 1.15
x one device's / 8.

Run: python scripts/bench_memory.py   (writes bench-results/bench_memory.json)
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

MODEL = "llama-1b"
LAYOUTS = [
    # name, n_model_shards, fsdp, precision, remat
    ("TP 8", 8, False, "fp32", "none"),
    ("FSDP 8", 1, True, "fp32", "none"),
    ("TP 2 x FSDP 4", 2, True, "fp32", "none"),
    ("TP 2 x FSDP 4, bf16", 2, True, "bf16", "none"),
    ("TP 2 x FSDP 4, remat dots", 2, True, "fp32", "dots"),
    ("TP 2 x FSDP 4, remat full", 2, True, "fp32", "full"),
    ("TP 2 x FSDP 4, bf16, remat full", 2, True, "bf16", "full"),
]


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", 8)
    import redcoast as rc

    results = []
    print(f"{MODEL}, 8 devices, 1024 tokens, 1 sequence per device; GiB per device")
    print(
        "| layout | params | AdamW state | params + state | floor | ÷ floor "
        "| activations | peak | compile |"
    )
    print("|" + "---|" * 9)
    for name, n_model, fsdp, precision, remat in LAYOUTS:
        r = rc.memory_plan(
            MODEL,
            devices=8,
            n_model_shards=n_model,
            fsdp=fsdp,
            precision=precision,
            remat=remat,
            seq_len=1024,
            max_batch=False,
        )
        master = 4 if precision != "pure-bf16" else 2
        floor = r.n_params * 3 * master / 8
        held = r.params + r.opt_state
        print(
            f"| {name} | {gib(r.params)} | {gib(r.opt_state)} | {gib(held)} | {gib(floor)} "
            f"| {held / floor:.2f} | {gib(r.activations)} | {gib(r.peak)} "
            f"| {r.compile_seconds:.0f} s |",
            flush=True,
        )
        results.append({"name": name, "floor": floor, **r.to_dict()})
    by = {r["name"]: r for r in results}
    full = by["TP 2 x FSDP 4, remat full"]["activations"]
    none = by["TP 2 x FSDP 4"]["activations"]
    print(f"activations, full remat / none: {full / none:.2f} (target <= 0.5)")
    split = activations_split(rc)
    context = activations_context(rc)
    out = Path("bench-results/bench_memory.json")
    out.parent.mkdir(exist_ok=True)
    figures = {"layouts": results, "sequence_parallel": split, "context_parallel": context}
    out.write_text(json.dumps(figures, indent=2) + "\n")


def activations_split(rc: Any) -> list[dict[str, Any]]:
    """Activations per device with and without sequence parallelism, 2048 tokens."""
    print(f"\n{MODEL}, 2048 tokens, 1 sequence per data shard; activations in GiB per device")
    print(
        "| devices | TP | TP + SP | one device / n | TP + SP ÷ (one device / n) "
        "| TP + SP, remat attention |"
    )
    print("|" + "---|" * 6)

    def acts(n: int, sp: bool, remat: str = "none") -> int:
        r = rc.memory_plan(
            MODEL,
            devices=n,
            n_model_shards=n,
            seq_len=2048,
            sequence_parallel=sp,
            remat=remat,
            max_batch=False,
        )
        return r.activations

    one = acts(1, False)
    rows = []
    for n in (2, 4, 8):
        tp, sp, attention = acts(n, False), acts(n, True), acts(n, True, "attention")
        share = one / n
        rows.append(
            {
                "devices": n,
                "one_device": one,
                "tp": tp,
                "tp_sp": sp,
                "tp_sp_remat_attention": attention,
                "ratio": sp / share,
            }
        )
        print(
            f"| {n} | {gib(tp)} | {gib(sp)} | {gib(share)} | {sp / share:.2f} | {gib(attention)} |",
            flush=True,
        )
    print(f"one device: {gib(one)} GiB; target: TP + SP <= 1.15 x one device / n")
    return rows


def activations_context(rc: Any) -> list[dict[str, Any]]:
    """Activations and peak per device with the sequence split over devices, one sequence."""
    from redcoast.models.presets import preset

    config = dataclasses.replace(preset(MODEL)[1], max_position_embeddings=16384)
    layouts = {
        "one device": {"devices": 1},
        "TP 8 + SP": {"devices": 8, "n_model_shards": 8, "sequence_parallel": True},
        "CP 8": {"devices": 8, "context_parallel": True},
        "FSDP 8 + CP": {"devices": 8, "fsdp": True, "context_parallel": True},
        "TP 2 + SP x CP 4": {
            "devices": 8,
            "n_model_shards": 2,
            "sequence_parallel": True,
            "context_parallel": True,
        },
    }
    print(f"\n{MODEL} with 16384 positions, 1 sequence; activations (peak) in GiB per device")
    print("| tokens | " + " | ".join(layouts) + " | CP 8 ÷ (one device / 8) |")
    print("|" + "---|" * (len(layouts) + 2))
    rows = []
    for seq in (2048, 8192, 16384):
        plans = {
            name: rc.memory_plan(config, seq_len=seq, max_batch=False, **kw)
            for name, kw in layouts.items()
        }
        ratio = plans["CP 8"].activations / (plans["one device"].activations / 8)
        cells = " | ".join(f"{gib(p.activations)} ({gib(p.peak)})" for p in plans.values())
        print(f"| {seq} | {cells} | {ratio:.2f} |", flush=True)
        rows.append({"tokens": seq, "ratio": ratio, **{n: p.to_dict() for n, p in plans.items()}})
    print("target: CP 8 <= 1.15 x one device / 8")
    return rows


if __name__ == "__main__":
    main()
