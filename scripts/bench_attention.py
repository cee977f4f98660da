"""Memory and time of attention that writes out its scores against blockwise attention.

Two measures, each compiled on abstract shapes (nothing runs, nothing is allocated):

- **attention alone**: the training pass of `rc.nn.attention` (the output and the
  gradients of q, k and v), causal, 16 query heads sharing 4 key/value heads of 64
  features, one row, with `implementation="einsum"` (the `(heads, seq, seq)` scores
  written out) and `"blockwise"` (flash-style blocks of 512, a custom VJP that
  recomputes them), at each sequence length;
- **a LLaMA step**: the loss and gradients (`rc.models.lm_loss`) of a LLaMA of
  llama-1b's width (2048 wide, 16 heads, 8 key/value heads, 5632-wide MLP; `--layers`
  layers, scanned, no remat) on one row of packed documents (segment ids and
  positions), with each implementation.

- **whole models** (`--whole`): the AdamW train step of the zoo's `llama-1b` (1.24B
  parameters, 16 scanned layers, given `--whole-seqs` positions), one sequence, on 8
  simulated devices under TP 8 + SP and FSDP 8 + CP (ring attention), as
  `rc.memory_plan` compiles it, with each implementation: its activations and peak.

From each compiled program XLA's temporary memory (`memory_analysis()`:
activations, scores and workspace beyond the inputs and outputs). With `--time`,
the attention's training pass at 2,048 tokens also runs (after a warm-up; the
median of `--reps` runs of each, back to back).

With `--tpu` (JAX with `libtpu` installed, no TPU needed) the attention alone is
compiled for one chip of a TPU v5e (`jax.experimental.topologies`) in bfloat16,
with segment ids, by the einsum, blockwise and the Pallas splash kernel.

Run: python scripts/bench_attention.py [--seqs 2048 8192 32768] [--layers 2] [--time] [--tpu]
     [--whole [--whole-seqs 8192 32768]]
     (writes bench-results/bench_attention.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp

import redcoast as rc

MIB = 2**20
IMPLEMENTATIONS = ("einsum", "blockwise")


def attention_pass(implementation: str):
    """The training pass of causal grouped-query attention: output and input gradients."""

    def train(q: jax.Array, k: jax.Array, v: jax.Array, cotangent: jax.Array):
        def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return rc.nn.attention(q, k, v, causal=True, implementation=implementation)

        out, pullback = jax.vjp(attend, q, k, v)
        return out, pullback(cotangent)

    return train


def attention_shapes(seq: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    q = jax.ShapeDtypeStruct((seq, 16, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((seq, 4, 64), jnp.float32)
    return q, kv, kv, q


def temp_mib(fn, *args) -> tuple[float, float]:
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    return compiled.memory_analysis().temp_size_in_bytes / MIB, seconds


def llama_step_temp(seq: int, layers: int, implementation: str) -> tuple[float, float]:
    config = rc.models.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=seq,
    )
    model = eqx.filter_eval_shape(
        rc.models.Llama,
        config,
        scan_layers=True,
        attention=implementation,
        key=jax.random.key(0),
    )
    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))

    def step(params, batch):
        def loss(params):
            return rc.models.lm_loss(eqx.combine(params, static), batch)[0]

        return jax.value_and_grad(loss)(params)

    row = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    batch = {"input_ids": row, "segment_ids": row, "positions": row}
    return temp_mib(step, params, batch)


WHOLE_LAYOUTS = {
    "TP 8 + SP": {"n_model_shards": 8, "sequence_parallel": True},
    "FSDP 8 + CP": {"fsdp": True, "context_parallel": True},
}


def whole_model_rows(seqs: list[int]) -> list[dict[str, object]]:
    """llama-1b's train step on 8 devices per layout and implementation: activations and
    peak per device (GiB), from `rc.memory_plan`."""
    import dataclasses

    from redcoast.models.planning import planned
    from redcoast.models.presets import preset

    config = dataclasses.replace(preset("llama-1b")[1], max_position_embeddings=max(seqs))
    rows = []
    print("\nllama-1b train step, 8 devices, one sequence: activations (peak) GiB per device")
    print(f"{'tokens':>8} {'layout':>12} {'einsum':>16} {'blockwise':>16} {'ratio':>7}")
    for seq in seqs:
        for layout, options in WHOLE_LAYOUTS.items():
            row: dict[str, object] = {"tokens": seq, "layout": layout}
            for implementation in IMPLEMENTATIONS:
                model = planned(config, attention=implementation)
                plan = rc.memory_plan(model, devices=8, seq_len=seq, max_batch=False, **options)
                row[implementation] = plan.to_dict()
            einsum, blockwise = (row[i] for i in IMPLEMENTATIONS)
            assert isinstance(einsum, dict) and isinstance(blockwise, dict)
            ratio = blockwise["activations"] / einsum["activations"]
            row["ratio"] = ratio
            shown = [
                f"{d['activations'] / 2**30:.2f} ({d['peak'] / 2**30:.2f})"
                for d in (einsum, blockwise)
            ]
            print(f"{seq:>8} {layout:>12} {shown[0]:>16} {shown[1]:>16} {ratio:>7.3f}", flush=True)
            rows.append(row)
    return rows


def tpu_attention_temp(seq: int, implementation: str) -> float | None:
    """The training pass with segment ids, bfloat16, compiled for one TPU v5e chip;
    None when the compiler finds it does not fit the chip's 16 GB."""
    from jax.experimental import topologies

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    on_chip = jax.sharding.SingleDeviceSharding(device)
    q = jax.ShapeDtypeStruct((seq, 16, 128), jnp.bfloat16, sharding=on_chip)
    kv = jax.ShapeDtypeStruct((seq, 4, 128), jnp.bfloat16, sharding=on_chip)
    segments = jax.ShapeDtypeStruct((seq,), jnp.int32, sharding=on_chip)

    def train(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array):
        def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            out = rc.nn.attention(
                q, k, v, causal=True, segment_ids=segment_ids, implementation=implementation
            )
            return out.astype(jnp.float32).sum()

        return jax.value_and_grad(attend, (0, 1, 2))(q, k, v)

    with jax.default_device(device):  # the platform rc.nn.attention compiles for
        try:
            compiled = jax.jit(train).lower(q, kv, kv, segments).compile()
        except jax.errors.JaxRuntimeError as error:
            if "RESOURCE_EXHAUSTED" not in str(error):
                raise
            return None
    return compiled.memory_analysis().temp_size_in_bytes / MIB


def time_attention(seq: int, reps: int) -> dict[str, float]:
    keys = jax.random.split(jax.random.key(0), 4)
    args = [
        jax.random.normal(key, shape.shape, shape.dtype)
        for key, shape in zip(keys, attention_shapes(seq), strict=True)
    ]
    runs = {name: jax.jit(attention_pass(name)) for name in IMPLEMENTATIONS}
    for fn in runs.values():
        jax.block_until_ready(fn(*args))
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="*", default=[2048, 8192, 32768])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--llama-seqs", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tpu", action="store_true")
    parser.add_argument("--whole", action="store_true")
    parser.add_argument("--whole-seqs", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--out", type=Path, default=Path("bench-results/bench_attention.json"))
    args = parser.parse_args()
    if args.whole and "host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", 8)

    results: dict[str, object] = {"load_average": os.getloadavg()[0]}
    rows = []
    print("attention alone (training pass, 16 query heads, 4 kv heads, head_dim 64)")
    print(f"{'tokens':>8} {'einsum MiB':>12} {'blockwise MiB':>14} {'ratio':>7}")
    for seq in args.seqs:
        einsum, _ = temp_mib(attention_pass("einsum"), *attention_shapes(seq))
        blockwise, _ = temp_mib(attention_pass("blockwise"), *attention_shapes(seq))
        rows.append({"tokens": seq, "einsum_mib": einsum, "blockwise_mib": blockwise})
        print(f"{seq:>8} {einsum:>12.1f} {blockwise:>14.1f} {blockwise / einsum:>7.3f}")
    results["attention"] = rows

    rows = []
    print(f"\nLLaMA step, llama-1b width, {args.layers} layers, one packed row")
    print(f"{'tokens':>8} {'einsum MiB':>12} {'blockwise MiB':>14} {'ratio':>7}")
    for seq in args.llama_seqs:
        einsum, _ = llama_step_temp(seq, args.layers, "einsum")
        blockwise, _ = llama_step_temp(seq, args.layers, "blockwise")
        rows.append({"tokens": seq, "einsum_mib": einsum, "blockwise_mib": blockwise})
        print(f"{seq:>8} {einsum:>12.1f} {blockwise:>14.1f} {blockwise / einsum:>7.3f}")
    results["llama_step"] = rows

    if args.tpu:
        rows = []
        print("\nattention alone on one TPU v5e chip (bfloat16, segment ids, head_dim 128)")
        print(f"{'tokens':>8} {'einsum MiB':>12} {'blockwise MiB':>14} {'pallas MiB':>11}")
        for seq in args.seqs:
            row: dict[str, float | None] = {"tokens": seq}
            for name in ("einsum", "blockwise", "pallas"):
                row[f"{name}_mib"] = tpu_attention_temp(seq, name)
            rows.append(row)
            shown = [
                "too big" if row[f"{n}_mib"] is None else f"{row[f'{n}_mib']:.1f}"
                for n in ("einsum", "blockwise", "pallas")
            ]
            print(f"{seq:>8} {shown[0]:>12} {shown[1]:>14} {shown[2]:>11}")
        results["tpu_v5e_attention"] = rows

    if args.whole:
        results["whole_model"] = whole_model_rows(args.whole_seqs)

    if args.time:
        seconds = time_attention(2048, args.reps)
        results["seconds_at_2048"] = seconds
        ratio = seconds["einsum"] / seconds["blockwise"]
        print(
            f"\ntraining pass at 2048 tokens: einsum {seconds['einsum']:.3f} s, blockwise "
            f"{seconds['blockwise']:.3f} s (blockwise speed {ratio:.2f} x the einsum's)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
