"""MaxText beside redcoast: one LLaMA-style decoder, the same data, optimizer and meshes.

MaxText (google/maxtext, 0.2.5 from PyPI) is the reference JAX LLM trainer. This
script builds MaxText's own jitted train step and redcoast's in one process and times
them the same way, on 8 simulated CPU devices.

The model, on both sides: a LLaMA decoder (RMSNorm, RoPE, SwiGLU with SiLU, untied
head), hidden 256, 4 layers, 8 heads of 32 (no grouped K/V), MLP 1024, vocabulary
1024, 128 tokens, global batch 32, float32 weights and compute, layers scanned
(`lax.scan` over stacked weights) and each layer rematerialised whole in the
backward pass (remat "full"). The optimizer, on both sides: AdamW with b1 0.9, b2
0.95, eps 1e-8, weight decay 0.1, a constant learning rate of 1e-3 (MaxText's warm-up
and decay turned off), no gradient clipping (MaxText's default of 1.0 turned off:
redcoast's step does not clip). Each side initialises its weights its own way (the
first losses differ), which changes no shape and no step's work.

- `MaxText`: `pyconfig.initialize` of MaxText's `base.yml` with `hardware=cpu
  skip_jax_distributed_system=true dataset_type=synthetic` and the sizes above
  (`decoder_block=llama2`, `attention=dot_product`, `packing=false`); its train state,
  mesh and shardings from `train_utils.setup_train_loop`, and its jitted step from
  `train_utils.jit_train_and_eval_step`, exactly as MaxText's `train_loop` builds
  them; each step is called as `training_loop_iteration` calls it (inside
  `jax.set_mesh` and the logical axis rules). The batch is one batch of MaxText's
  synthetic data, reused every step.
- `redcoast`: `rc.models.Llama` (`scan_layers=True, remat="full"`, RMSNorm eps 1e-5
  as MaxText's), placed by `rc.place(..., fsdp=True)` on `rc.make_mesh(n_tp)`,
  stepped by `rc.train_step`'s own jitted step (the path `fit` runs), on the same
  token ids, the loss the mean cross-entropy of `targets` given `inputs`, as MaxText's
  on unpadded data.

Meshes: FSDP 8 (MaxText `ici_fsdp_parallelism=8`; redcoast `make_mesh(1)`, every
weight split over the 8-way data axis) and TP 2 x FSDP 4 (MaxText
`ici_fsdp_parallelism=4 ici_tensor_parallelism=2`; redcoast `make_mesh(2)`, FSDP over
the 4-way data axis).

Timing: every step is synchronised (`jax.block_until_ready` on the step's outputs
before the clock is read), for both; each repeat runs `--steps` steps of each
contestant, the contestants in alternating order; steps/s are medians over
`--reps` repeats and the ratio is the median of the paired ratios (redcoast's step
time over MaxText's, same repeat: below 1.0 redcoast is faster). Compile s is the
median of `--compiles` wall times of tracing, lowering and compiling the step after
`jax.clear_caches()`. Memory is `compiled.memory_analysis()` per device: arguments,
temporaries, and the peak (arguments + temporaries + outputs that do not reuse a
donated buffer). FLOPs and bytes accessed are `cost_analysis()`'s; collectives are
counted in the partitioned HLO (`tests/hlo.py`; a loop body's collectives once).

Where MaxText's step does less work than redcoast's, `--variants` measures what that
work costs: a redcoast row without the zoo's token-id range check (MaxText checks no
ids; traced under Equinox's `EQX_ON_ERROR=off`), and the time of `train_step`'s
non-finite check (every updated parameter read once) run alone as its own program.
Repeats then alternate between the order of the rows and its reverse.

`--tpu` compiles instead, for a TPU v5e-8 (`v5e:2x4`, 16 GiB of HBM a chip) on this
CPU machine with the TPU compiler (libtpu; the same JAX and libtpu for both), and
runs nothing. The model: a LLaMA of 953M parameters (hidden 2048, 16 layers, 16
heads of 128, MLP 5632, vocabulary 32000, untied head), 2048 tokens, global batch 32
(4 sequences a chip), bfloat16 compute over float32 weights, AdamW (as above), full
remat, scanned layers; FSDP 8 and TP 2 x FSDP 4.

- `MaxText`: its `train_compile` path, as `python -m
  maxtext.trainers.pre_train.train_compile base.yml compile_topology=v5e-8
  compile_topology_num_slices=1 ...` runs it: `pyconfig.initialize` (the overrides
  above with `dtype=bfloat16 weight_dtype=float32`, the default `hardware=tpu`), the
  mesh of the topology's devices (`train_compile.get_topology_mesh`), the abstract
  train state and batch (`get_shaped_inputs`), its shardings and
  `maxtext_utils.get_functional_train_with_signature`, compiled by
  `train_compile.jit_and_compile`; once with MaxText's default attention
  (`autoselected`: the Pallas splash kernel on TPU) and once with
  `attention=dot_product`.
- `redcoast`: the step `rc.memory_plan(config, target="v5e-8", precision="bf16",
  remat="full", fsdp=True, ...)` compiles (`redcoast.plan._step.trace_step`: the
  train step `fit` runs, on abstract arrays placed by the sharding plan, for the
  topology's devices); attention `implementation="auto"`, the Pallas splash kernel
  on TPU. TP 2 x FSDP 4 takes 8 sequences per data shard (4 a chip, as MaxText's
  `per_device_batch_size=4` there).

Each program is compiled in a process of its own (MaxText sets JAX options for its
compile). Memory per chip: `memory_analysis()`. The estimated step time is
redcoast's planner's roofline on both programs (`redcoast.plan._targets.estimate`:
FLOPs of the traced program's matrix products, each scanned layer as often as it
runs; the compiler's bytes accessed multiplied out over its loops; collective bytes
over the chip's interconnect; v5e's published peak), with tokens/s and MFU (6 x
parameters x tokens over the slice's peak and that time). The compiler's own
`cost_analysis()` figures are printed beside it as they are (it counts a loop's body
once).

`--tpu --moe` compiles a Mixtral the same way (FSDP 8 only), each program in its own
process: 795M parameters, 267M active (hidden 1024, 8 layers, 16 query heads of 64
over 8 K/V heads, 8 SwiGLU experts of 3584 with 2 chosen a token, vocabulary 32000,
untied head), 2048 tokens, 4 sequences a chip. MaxText: `decoder_block=mixtral
num_experts=8 num_experts_per_tok=2` with its base.yml's MoE defaults
(`sparse_matmul=true megablox=true`: dropless, its Pallas grouped matmuls `gmm` and
`tgmm`), and once with `megablox=false` (`jax.lax.ragged_dot`, redcoast's path);
redcoast: `rc.models.Mixtral`, the step `rc.memory_plan(..., target="v5e-8",
precision="bf16", remat="full", fsdp=True)` compiles (experts dispatched "dropless",
`jax.lax.ragged_dot` on TPU). The FLOPs add the grouped matmuls the planner's count
misses (`grouped_flops`), MFU is of the active parameters, and the program's grouped
matmuls are counted in its HLO (`hlo_ops`): XLA:TPU lowers `ragged_dot` to its own
Mosaic kernels (`ragged-dot-none`) or to convolutions that skip the rows outside
each group, never to a dense matmul per expert.

Run: nox -s bench_maxtext -- --reps 5    (the session installs MaxText, its
     decoupled CPU requirements and libtpu in its own venv, never as a redcoast
     dependency)
     nox -s bench_maxtext -- --tpu
     nox -s bench_maxtext -- --tpu --moe
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # hlo.py
from hlo import collectives, summarize

D, L, H, F, V, S, BATCH = 256, 4, 8, 1024, 1024, 128, 32
LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.95, 1e-8, 0.1
LAYOUTS = {"fsdp8": (8, 1), "tp2xfsdp4": (4, 2)}  # name -> (fsdp, tensor)
MAXTEXT, REDCOAST = "MaxText", "redcoast"
NO_ID_CHECK = "redcoast, no token-id check"


@dataclasses.dataclass
class Contestant:
    """A compiled step, a way to run it, and what it was compiled to."""

    name: str
    run: Callable[[int], float]  # n synchronised steps; the last step's loss
    compiled: Any  # jax.stages.Compiled
    compile_s: float
    first_loss: float


def timed_compiles(lower: Callable[[], Any], n: int) -> tuple[Any, float]:
    """Compile `n` times (each after `jax.clear_caches()`); the last executable, median s."""
    seconds, compiled = [], None
    for _ in range(n):
        jax.clear_caches()
        start = time.perf_counter()
        compiled = lower()
        seconds.append(time.perf_counter() - start)
    return compiled, float(np.median(seconds))


# ------------------------------------------------------------------ MaxText


def maxtext_common(fsdp: int, tensor: int, workdir: Path) -> dict[str, Any]:
    """The MaxText settings of both modes: synthetic data, no checkpoints or goodput
    recording, LLaMA-2 blocks, float32 weights, full remat, scanned layers, AdamW at a
    constant rate without clipping, and the mesh."""
    return {
        "base_output_directory": str(workdir),
        "skip_jax_distributed_system": True,
        "dataset_type": "synthetic",
        "enable_checkpointing": False,
        "enable_tensorboard": False,
        "enable_goodput_recording": False,
        "monitor_goodput": False,
        "decoder_block": "llama2",
        "weight_dtype": "float32",
        "packing": False,
        "remat_policy": "full",
        "scan_layers": True,
        "opt_type": "adamw",
        "learning_rate": LR,
        "warmup_steps_fraction": 0.0,
        "learning_rate_final_fraction": 1.0,
        "adam_b1": B1,
        "adam_b2": B2,
        "adam_eps": EPS,
        "adam_weight_decay": WD,
        "gradient_clipping_threshold": 0.0,
        "normalization_layer_epsilon": 1e-5,
        "ici_fsdp_parallelism": fsdp,
        "ici_tensor_parallelism": tensor,
        "steps": 1000,
        "jax_cache_dir": "",  # no persistent compilation cache: compile times are compiles
    }


def maxtext_config(fsdp: int, tensor: int, workdir: Path) -> Any:
    from maxtext.configs import pyconfig

    spec = importlib.util.find_spec("maxtext")
    assert spec is not None and spec.origin is not None
    base = Path(spec.origin).parent / "configs" / "base.yml"
    overrides = {
        "run_name": f"bench_{fsdp}x{tensor}",
        "hardware": "cpu",
        "base_emb_dim": D,
        "base_num_decoder_layers": L,
        "base_num_query_heads": H,
        "base_num_kv_heads": H,
        "head_dim": D // H,
        "base_mlp_dim": F,
        "vocab_size": V,
        "max_target_length": S,
        "per_device_batch_size": BATCH // 8,
        "dtype": "float32",
        "attention": "dot_product",
        **maxtext_common(fsdp, tensor, workdir),
    }
    argv = ["bench", str(base), *(f"{k}={v}" for k, v in overrides.items())]
    return pyconfig.initialize(argv)


def maxtext_contestant(fsdp: int, tensor: int, compiles: int, workdir: Path) -> tuple[Any, Any]:
    """MaxText's step as its `train_loop` builds it; also its synthetic batch (numpy)."""
    from flax import nnx
    from flax.linen import logical_axis_rules
    from maxtext.trainers.pre_train import train
    from maxtext.utils import sharding, train_utils

    config = maxtext_config(fsdp, tensor, workdir)
    jax.config.update("jax_use_shardy_partitioner", config.shardy)
    out = train_utils.setup_train_loop(config, None)
    mesh, state_mesh_shardings, data_loader, rampup, state = out[4], out[2], out[7], out[8], out[10]
    graph, state = nnx.split(state)
    params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_mesh_shardings
    )
    p_train_step, _ = train_utils.jit_train_and_eval_step(
        config,
        graph,
        mesh,
        state,
        state_mesh_shardings,
        train.train_step,
        train.eval_step,
        None,
        params_shardings,
    )
    rules = config.logical_axis_rules
    with jax.set_mesh(mesh), logical_axis_rules(rules):
        batch = data_loader.load_next_batch(rampup_manager=rampup)
    held = [state]

    def lower() -> Any:
        with jax.set_mesh(mesh), logical_axis_rules(rules):
            return p_train_step.lower(held[0], batch).compile()

    compiled, compile_s = timed_compiles(lower, compiles)

    def run(n: int) -> float:
        loss: Any = None
        with jax.set_mesh(mesh), logical_axis_rules(rules):
            for _ in range(n):
                held[0], metrics = p_train_step(held[0], batch)
                loss = metrics["scalar"]["learning/loss"]
                jax.block_until_ready((held[0], metrics))
        return float(loss)

    first = run(1)
    ids = {k: np.asarray(batch[k]) for k in ("inputs", "targets")}
    return Contestant(MAXTEXT, run, compiled, compile_s, first), ids


# ------------------------------------------------------------------ redcoast


def redcoast_loss(model: rc.models.Llama, batch: dict[str, jax.Array], key: Any) -> jax.Array:
    logits = jax.vmap(model)(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def redcoast_contestant(
    name: str, n_tensor: int, ids: dict[str, np.ndarray], compiles: int, *, id_check: bool = True
) -> Contestant:
    """`rc.models.Llama`, FSDP over the data axis, stepped by `rc.train_step` (fit's path).

    With `id_check=False` the step is traced under `EQX_ON_ERROR=off`, Equinox's switch
    that the zoo's token-id range check honours: the check (an all-reduce of one flag
    and a `cond` per step) leaves the program.
    """
    config = rc.models.LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=H,
        max_position_embeddings=S,
        rms_norm_eps=1e-5,
    )
    mesh = rc.make_mesh(n_model_shards=n_tensor)
    batch = {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in ids.items()}
    model = rc.models.Llama(config, scan_layers=True, remat="full", key=jax.random.key(0))
    model = rc.place(model, mesh, example_call=lambda m: redcoast_loss(m, batch, None), fsdp=True)
    opt = optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    step: Any = rc.train_step(redcoast_loss, opt, mesh=mesh)
    key = jax.random.key(0)
    held = [(model, state)]

    def lower() -> Any:
        with errors_off(not id_check):
            return step.lower(*held[0], batch, key).compile().compiled

    compiled, compile_s = timed_compiles(lower, compiles)

    def run(n: int) -> float:
        loss: Any = None
        for _ in range(n):
            m, s, metrics = step(*held[0], batch, key)
            held[0] = (m, s)
            loss = metrics["loss"]
            jax.block_until_ready((m, s, metrics))
        return float(loss)

    with errors_off(not id_check):
        first = run(1)  # traces and compiles the step that later calls reuse
    return Contestant(name, run, compiled, compile_s, first)


@contextlib.contextmanager
def errors_off(off: bool) -> Iterator[None]:
    """`EQX_ON_ERROR=off` while a step is traced (when `off`), restored after."""
    before = os.environ.get("EQX_ON_ERROR")
    if off:
        os.environ["EQX_ON_ERROR"] = "off"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("EQX_ON_ERROR", None)
        else:
            os.environ["EQX_ON_ERROR"] = before


def nonfinite_check_ms(n_tensor: int, reps: int) -> float:
    """Milliseconds of `train_step`'s non-finite check alone, as its own program.

    The check reads every updated parameter once (`isfinite(p).all()` per leaf, and'ed,
    over FSDP-split weights); MaxText's step has none (it computes the norms of the
    raw gradients, the clipped gradients and the parameters instead). Timed on the
    placed parameters of the same model, median of `reps` synchronised calls.
    """
    config = rc.models.LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=H,
        max_position_embeddings=S,
    )
    mesh = rc.make_mesh(n_model_shards=n_tensor)
    model = rc.models.Llama(config, scan_layers=True, remat="full", key=jax.random.key(0))
    ids = jnp.zeros((BATCH, S), jnp.int32)
    model = rc.place(model, mesh, example_call=lambda m: jax.vmap(m)(ids), fsdp=True)
    params = eqx.filter(model, eqx.is_inexact_array)

    @jax.jit
    def check(p: Any) -> jax.Array:
        ok = jnp.bool_(True)
        for leaf in jax.tree.leaves(p):
            ok = ok & jnp.isfinite(leaf).all()
        return ok

    check(params).block_until_ready()
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        check(params).block_until_ready()
        seconds.append(time.perf_counter() - start)
    return 1e3 * float(np.median(seconds))


# ------------------------------------------------------------------ what the programs do

_OP = re.compile(r"=\s*\S.*?\s([a-z][a-z0-9-]*)\(")


def analyse(c: Contestant, n_tensor: int) -> dict[str, Any]:
    """Per-device memory, FLOPs, bytes accessed, op counts and collectives of a program."""
    text = c.compiled.as_text()
    memory = c.compiled.memory_analysis()
    cost = c.compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    args, temp = int(memory.argument_size_in_bytes), int(memory.temp_size_in_bytes)
    fresh = max(int(memory.output_size_in_bytes) - int(memory.alias_size_in_bytes), 0)
    ops = Counter(m.group(1) for m in _OP.finditer(text))
    found = collectives(text, rc.make_mesh(n_model_shards=n_tensor))
    by_op: dict[str, dict[str, int]] = {}
    for col in found:
        entry = by_op.setdefault(col.op, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += col.nbytes
    return {
        "args_bytes": args,
        "temp_bytes": temp,
        "peak_bytes": args + temp + fresh,
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "instructions": sum(ops.values()),
        "ops": dict(ops.most_common()),
        "collectives": by_op,
        "collectives_by_axis": summarize(found),
    }


# ------------------------------------------------------------------ timing


def paired(contestants: list[Contestant], steps: int, reps: int) -> dict[str, Any]:
    """Steps/s of each contestant over `reps` alternating repeats, after one warm-up step."""
    for c in contestants:
        c.run(1)
    rates: dict[str, list[float]] = {c.name: [] for c in contestants}
    last: dict[str, float] = {}
    for r in range(reps):
        order = contestants if r % 2 == 0 else contestants[::-1]
        for c in order:
            start = time.perf_counter()
            last[c.name] = c.run(steps)
            rates[c.name].append(steps / (time.perf_counter() - start))
    base = np.array(rates[MAXTEXT])
    return {
        "steps_per_s": {n: float(np.median(v)) for n, v in rates.items()},
        "all_steps_per_s": rates,
        "time_over_maxtext": {n: float(np.median(base / np.array(v))) for n, v in rates.items()},
        "last_loss": last,
    }


# ------------------------------------------------------------------ TPU: compiled for a v5e-8

TPU_TARGET = "v5e-8"
TPU_SIZES = {"D": 2048, "L": 16, "H": 16, "F": 5632, "V": 32000, "S": 2048, "PER_CHIP": 4}
TPU_CHIPS = 8
# row -> MaxText's `attention`, or redcoast's step with its attention's implementation
BLOCKWISE = "redcoast (blockwise attention)"
TPU_ROWS = {
    "MaxText": "autoselected",
    "MaxText, attention=dot_product": "dot_product",
    REDCOAST: None,
    BLOCKWISE: None,
}


def tpu_environment() -> None:
    """What libtpu needs to compile for a topology on a machine without one, and the
    flag MaxText's `train_compile` sets for its compiles (for both programs)."""
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    flag = "--xla_tpu_spmd_rng_bit_generator_unsafe=true"
    os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {flag}".strip()


def tpu_llama_overrides(attention: str) -> dict[str, Any]:
    """MaxText's sizes of the 953M LLaMA, and its attention."""
    z = TPU_SIZES
    return {
        "base_emb_dim": z["D"],
        "base_num_decoder_layers": z["L"],
        "base_num_query_heads": z["H"],
        "base_num_kv_heads": z["H"],
        "head_dim": z["D"] // z["H"],
        "base_mlp_dim": z["F"],
        "vocab_size": z["V"],
        "max_target_length": z["S"],
        "per_device_batch_size": z["PER_CHIP"],
        "attention": attention,
    }


def tpu_maxtext_config(fsdp: int, tensor: int, model: dict[str, Any], workdir: Path) -> Any:
    """MaxText's config compiled for a v5e-8 (`train_compile`'s), the model's sizes
    and options `model` (`tpu_llama_overrides`, `moe_overrides`)."""
    from maxtext.configs import pyconfig

    spec = importlib.util.find_spec("maxtext")
    assert spec is not None and spec.origin is not None
    base = Path(spec.origin).parent / "configs" / "base.yml"
    overrides = {
        "run_name": f"bench_tpu_{fsdp}x{tensor}",
        "compile_topology": TPU_TARGET,
        "compile_topology_num_slices": 1,
        "dtype": "bfloat16",
        **maxtext_common(fsdp, tensor, workdir),
        **model,  # after the common settings: a Mixtral's `decoder_block` replaces LLaMA-2's
    }
    argv = ["bench", str(base), *(f"{k}={v}" for k, v in overrides.items())]
    return pyconfig.initialize(argv)


def tpu_maxtext(
    fsdp: int, tensor: int, overrides: dict[str, Any], workdir: Path
) -> tuple[Any, Any, int]:
    """MaxText's train step compiled as its `train_compile.main` compiles it.

    Returns the compiled program, the traced one's jaxpr (for the FLOPs) and the
    model's parameter count.
    """
    from flax.core.spmd import logical_axis_rules as axis_rules
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import maxtext_utils, sharding

    jax.config.update("jax_default_prng_impl", "unsafe_rbg")  # as train_compile.main
    config = tpu_maxtext_config(fsdp, tensor, overrides, workdir)
    train_compile.validate_config(config)
    mesh = train_compile.get_topology_mesh(config)
    shaped_args, shaped_kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(
        mesh, config
    )
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_shardings
    )
    input_shardings = sharding.build_zero1_input_state_mesh_shardings(
        config, state_shardings, params_shardings
    )
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    func, in_shard, out_shard, static, donate = maxtext_utils.get_functional_train_with_signature(
        train.train_step, data_sharding, input_shardings, model, config, params_shardings
    )
    compiled = train_compile.jit_and_compile(
        func,
        shaped_args,
        shaped_kwargs,
        mesh,
        in_shard,
        out_shard,
        static,
        donate,
        config,
        axis_rules(config.logical_axis_rules),
    )
    # The same function traced again, as `jit_and_compile` traces it, for its jaxpr.
    with jax.set_mesh(mesh), axis_rules(config.logical_axis_rules):
        jitted = jax.jit(
            func,
            in_shardings=in_shard,
            out_shardings=out_shard,
            static_argnums=static,
            donate_argnums=donate,
        )
        jaxpr = jitted.trace(*shaped_args, **shaped_kwargs).jaxpr
    return compiled, jaxpr, tpu_maxtext_params(shaped_args[0])


def tpu_maxtext_params(state: Any) -> int:
    """Parameters of MaxText's abstract train state (an `nnx.State` of `model` and
    `optimizer`): its model's `nnx.Param`s."""
    from flax import nnx

    params = nnx.state(state["model"], nnx.Param)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def tpu_redcoast(tensor: int, attention: str = "auto") -> tuple[Any, Any, int]:
    """redcoast's train step as `rc.memory_plan(..., target="v5e-8")` compiles it, its
    attention `"auto"` (the Pallas splash kernel there) or another implementation."""
    from redcoast.models.planning import planned
    from redcoast.plan._report import Layout
    from redcoast.plan._step import trace_step
    from redcoast.plan._targets import target_devices, target_named

    z = TPU_SIZES
    config = rc.models.LlamaConfig(
        vocab_size=z["V"],
        hidden_size=z["D"],
        intermediate_size=z["F"],
        num_hidden_layers=z["L"],
        num_attention_heads=z["H"],
        num_key_value_heads=z["H"],
        max_position_embeddings=z["S"],
        rms_norm_eps=1e-5,
    )
    # The global batch is MaxText's: 4 sequences a chip, 4 x tensor per data shard.
    layout = Layout(
        TPU_CHIPS,
        n_model_shards=tensor,
        fsdp=True,
        precision="bf16",
        remat="full",
        per_device_batch_size=z["PER_CHIP"] * tensor,
        seq_len=z["S"],
    )
    devices = target_devices(target_named(TPU_TARGET), TPU_CHIPS)
    traced, common, _ = trace_step(planned(config, attention=attention), layout, None, devices)
    compiled = traced.lower().compile()
    return compiled, traced.jaxpr, int(common["n_params"])


# ------------------------------------------------------------------ TPU: a Mixtral for a v5e-8

# Hidden 1024, 8 layers, 16 query heads of 64 over 8 K/V heads, 8 SwiGLU experts of 3584
# (top 2), vocabulary 32000 (untied head), 2048 tokens, 4 sequences a chip.
MOE_SIZES = {
    "D": 1024,
    "L": 8,
    "H": 16,
    "KV": 8,
    "HD": 64,
    "F": 3584,
    "E": 8,
    "K": 2,
    "V": 32000,
    "S": 2048,
    "PER_CHIP": 4,
}
# row -> MaxText's MoE options over its base.yml defaults (`sparse_matmul=true
# megablox=true`: its Pallas grouped matmul, megablox's `gmm`), or None for redcoast
MOE_ROWS: dict[str, dict[str, Any] | None] = {
    "MaxText": {},
    "MaxText (megablox=false)": {"megablox": False},  # jax.lax.ragged_dot, as redcoast
    REDCOAST: None,
}


def moe_counts() -> tuple[int, int]:
    """The Mixtral's parameters, and those a token uses (its 2 of 8 experts)."""
    z = MOE_SIZES
    attention = z["D"] * z["H"] * z["HD"] * 2 + z["D"] * z["KV"] * z["HD"] * 2
    expert = 3 * z["D"] * z["F"]
    layer = attention + z["D"] * z["E"] + 2 * z["D"]  # router, two norms
    outside = 2 * z["V"] * z["D"] + z["D"]  # embedding, head, final norm
    total = outside + z["L"] * (layer + z["E"] * expert)
    return total, outside + z["L"] * (layer + z["K"] * expert)


def moe_reference_flops() -> dict[str, float]:
    """What a step of the Mixtral must compute at least, on all chips: 6 x active
    parameters x tokens (the forward, the inputs' and the weights' gradients of the
    chosen experts alone, no recomputation) plus attention's scores and weighted sum
    (3 x 4 x S^2 x heads x head_dim a sequence a layer: every block, the causal
    future's too, as the programs' counts take them); and, for scale, the same with
    every expert computing every token (`dense`)."""
    z = MOE_SIZES
    total, active = moe_counts()
    tokens = z["PER_CHIP"] * TPU_CHIPS * z["S"]
    rows = z["PER_CHIP"] * TPU_CHIPS
    attention = 12.0 * z["L"] * rows * z["S"] ** 2 * z["H"] * z["HD"]
    return {
        "active_6nt": 6.0 * active * tokens,
        "attention": attention,
        "reference": 6.0 * active * tokens + attention,
        "dense": 6.0 * total * tokens + attention,
    }


def moe_overrides(options: dict[str, Any]) -> dict[str, Any]:
    """MaxText's Mixtral (`decoder_block=mixtral`) of `MOE_SIZES`, with `options`."""
    z = MOE_SIZES
    return {
        "decoder_block": "mixtral",
        "base_emb_dim": z["D"],
        "base_num_decoder_layers": z["L"],
        "base_num_query_heads": z["H"],
        "base_num_kv_heads": z["KV"],
        "head_dim": z["HD"],
        "base_mlp_dim": z["F"],
        "base_moe_mlp_dim": z["F"],  # "for a fully MoE model, base_mlp_dim must be equal"
        "mlp_activations": '["silu","linear"]',  # as its mixtral-8x7b.yml
        "num_experts": z["E"],
        "num_experts_per_tok": z["K"],
        "vocab_size": z["V"],
        "max_target_length": z["S"],
        "per_device_batch_size": z["PER_CHIP"],
        "rope_max_timescale": 1_000_000,
        **options,
    }


def tpu_redcoast_moe() -> tuple[Any, Any, int]:
    """`rc.models.Mixtral` of `MOE_SIZES`, its step as `rc.memory_plan(...,
    target="v5e-8", precision="bf16", remat="full", fsdp=True)` compiles it: the
    experts dispatched `"dropless"` (`rc.nn.experts`, `jax.lax.ragged_dot` on TPU)."""
    from redcoast.models.planning import planned
    from redcoast.plan._report import Layout
    from redcoast.plan._step import trace_step
    from redcoast.plan._targets import target_devices, target_named

    z = MOE_SIZES
    config = rc.models.MixtralConfig(
        vocab_size=z["V"],
        hidden_size=z["D"],
        intermediate_size=z["F"],
        num_hidden_layers=z["L"],
        num_attention_heads=z["H"],
        num_key_value_heads=z["KV"],
        head_dim=z["HD"],
        max_position_embeddings=z["S"],
        num_local_experts=z["E"],
        num_experts_per_tok=z["K"],
        rms_norm_eps=1e-5,
    )
    layout = Layout(
        TPU_CHIPS,
        n_model_shards=1,
        fsdp=True,
        precision="bf16",
        remat="full",
        per_device_batch_size=z["PER_CHIP"],
        seq_len=z["S"],
    )
    devices = target_devices(target_named(TPU_TARGET), TPU_CHIPS)
    traced, common, _ = trace_step(planned(config), layout, None, devices)
    compiled = traced.lower().compile()
    return compiled, traced.jaxpr, int(common["n_params"])


RAGGED_DOT = ("ragged_dot_general",)


def grouped_flops(jaxpr: Any) -> tuple[float, float]:
    """FLOPs of a jaxpr's grouped matmuls, loops and `shard_map`s counted as
    `matmul_flops` counts them (which the planner's estimate reads); and the part of
    them `matmul_flops` counts already. A grouped matmul multiplies each row only by
    its own group's matrix: 2 x rows x contracted x output features, not num_groups
    times that as a dense matmul per group would be.

    - `jax.lax.ragged_dot_general` (redcoast's dropless experts on TPU, MaxText's
      with `megablox=false`): 2 x the ragged operand's elements x the other's free
      dimensions, as `matmul_flops` counts it too.
    - megablox's Pallas kernels (`gmm`, `tgmm`; MaxText's default): their grid's
      row-tile dimension is dynamic (the tiles in use, known at run time), and
      `matmul_flops` takes it as 1. Counted here as every row tile once: the kernel
      body's FLOPs x its static grid x `m / tm`, which is the length of its tile-to-
      group map (its third operand, `m / tm + groups - 1` entries: a tile that
      straddles two groups is run for each) less `groups - 1` (its second operand,
      the group offsets, has `groups + 1`). The straddling tiles' second runs are
      left out, as the ragged kernels' tile padding is.
    """
    from redcoast.parallel import _jaxpr
    from redcoast.train.throughput import matmul_flops

    def subs(value: Any) -> list[Any]:
        items = value if isinstance(value, tuple | list) else (value,)
        return [j for j in map(_jaxpr.open_jaxpr, items) if j is not None]

    jaxpr = _jaxpr.open_jaxpr(jaxpr) or jaxpr
    total = counted = 0.0
    for eqn in jaxpr.eqns:
        primitive = _jaxpr.name(eqn)
        if primitive in _jaxpr.COND:
            branches = [grouped_flops(b) for b in subs(eqn.params["branches"])]
            best = max(branches, default=(0.0, 0.0))
            total, counted = total + best[0], counted + best[1]
            continue
        times = 1
        if primitive in _jaxpr.SCAN:
            times = int(eqn.params.get("length", 1))
        elif primitive == "shard_map":
            times = int(getattr(eqn.params.get("mesh"), "size", 1))
        elif primitive == "pallas_call":
            grid = getattr(eqn.params.get("grid_mapping"), "grid", ())
            static = math.prod(g for g in grid if isinstance(g, int))
            if len(grid) > sum(isinstance(g, int) for g in grid):  # megablox
                body = matmul_flops(eqn.params["jaxpr"])[0] * static
                offsets, tile_groups = (eqn.invars[i].aval.shape[0] for i in (1, 2))
                total += body * (tile_groups - (offsets - 2))
                counted += body
            continue  # other kernels (attention): not grouped
        for v in eqn.params.values():
            for j in subs(v):
                t, c = grouped_flops(j)
                total, counted = total + times * t, counted + times * c
        if primitive in RAGGED_DOT:
            numbers = eqn.params["ragged_dot_dimension_numbers"]
            (_, contract), (_, batch) = numbers.dot_dimension_numbers
            lhs = eqn.invars[0].aval.shape
            rhs = eqn.invars[1].aval.shape
            bound = {*contract, *batch, *numbers.rhs_group_dimensions}
            free = math.prod(n for d, n in enumerate(rhs) if d not in bound)
            total += 2.0 * math.prod(lhs) * free
            counted += 2.0 * math.prod(lhs) * free
    return total, counted


# The TPU program's ops that say how the experts were computed.
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%([\w-]+?)(?:\.\d+)* = ")  # its name, no suffix


def hlo_ops(text: str) -> dict[str, Any]:
    """What the compiled program computes the experts with (each op of a loop body once).

    XLA:TPU lowers `jax.lax.ragged_dot` to no `ragged-dot` op: a grouped matmul
    becomes either a Mosaic kernel of its own (a `tpu_custom_call` named
    `ragged-dot-none`, beside a `ragged-dot-metadata` call that maps the row tiles to
    their groups) or a `convolution` over every group whose fusion is marked
    `"is_ragged_dot":true` and skips the iterations outside each group's rows
    (`ITERATION_SKIPPER_MODE_GROUP_STARTS`). MaxText's megablox is a Pallas kernel.
    Kernels (`tpu_custom_call`s) are counted by instruction name; also counted:
    matmuls, sorts, gathers, scatters and collectives.
    """
    ops = Counter(m.group(1) for m in _OP.finditer(text))
    keep = (
        "ragged-dot",
        "dot",
        "convolution",
        "custom-call",
        "sort",
        "gather",
        "scatter",
        "all-gather",
        "all-gather-start",
        "reduce-scatter",
        "all-reduce",
        "all-reduce-start",
        "all-to-all",
        "ragged-all-to-all",
        "while",
        "fusion",
    )
    lines = text.splitlines()
    kernels = Counter(
        m.group(1)
        for line in lines
        if 'custom_call_target="tpu_custom_call"' in line and (m := _INSTRUCTION.match(line))
    )
    grouped_convolutions = sum(
        1 for line in lines if " convolution(" in line and 'ragged_dot_general"' in line
    )
    return {
        "ops": {k: ops[k] for k in keep if ops.get(k)},
        "custom_call_targets": dict(Counter(_CUSTOM_CALL.findall(text))),
        "tpu_kernels": dict(kernels),
        "ragged_dot_kernels": kernels.get("ragged-dot-none", 0),
        "ragged_dot_convolutions": grouped_convolutions,
        "is_ragged_dot_fusions": text.count('"is_ragged_dot":true'),
        "group_starts_skippers": text.count("ITERATION_SKIPPER_MODE_GROUP_STARTS"),
    }


# What the TPU compiler's `cost_analysis()` says of a whole program (its other entries
# are per operand and per unit): each loop's body counted once.
COMPILER_COST = ("flops", "bytes accessed", "transcendentals", "optimal_seconds")


def tpu_figures(compiled: Any, jaxpr: Any, n_params: int, *, moe: bool = False) -> dict[str, Any]:
    """Per-chip memory, the compiler's cost figures and the planner's step estimate.

    With `moe` (the Mixtral): the FLOPs are the traced program's matrix products and
    its grouped ones, which `matmul_flops` misses (`grouped_flops`: all of a
    `ragged_dot`'s, most of a megablox kernel's); MFU is of the active parameters
    (`moe_counts`); and the program's expert ops are counted (`hlo_ops`). The
    estimate from `matmul_flops` alone, the planner's own count, is kept beside it
    (`estimate_planner_flops`).
    """
    from redcoast.plan._hlo import collective_bytes, loop_factor
    from redcoast.plan._step import _cost_analysis
    from redcoast.plan._targets import estimate, target_named
    from redcoast.train.throughput import matmul_flops

    sizes = MOE_SIZES if moe else TPU_SIZES
    text = compiled.as_text() or ""
    memory = compiled.memory_analysis()
    cost = _cost_analysis(compiled)
    args, temp = int(memory.argument_size_in_bytes), int(memory.temp_size_in_bytes)
    out, alias = int(memory.output_size_in_bytes), int(memory.alias_size_in_bytes)
    factor = loop_factor(text)
    dots = matmul_flops(jaxpr)[0]
    grouped, counted = grouped_flops(jaxpr) if moe else (0.0, 0.0)
    flops = dots + grouped - counted
    moved = float(cost.get("bytes accessed", 0.0)) * factor
    collectives_ = collective_bytes(text)
    tokens = sizes["PER_CHIP"] * TPU_CHIPS * sizes["S"]
    mfu_params = moe_counts()[1] if moe else n_params

    def estimated(flops: float) -> dict[str, Any]:
        step = estimate(
            target_named(TPU_TARGET),
            devices=TPU_CHIPS,
            flops=flops,
            bytes_per_device=moved,
            collective_bytes=collectives_,
            tokens=tokens,
            n_params=mfu_params,
        )
        assert step is not None
        return dataclasses.asdict(step)

    figures = {
        "args_bytes": args,
        "temp_bytes": temp,
        "output_bytes": out,
        "alias_bytes": alias,
        "peak_bytes": args + temp + max(out - alias, 0),
        "n_params": n_params,
        "tokens": tokens,
        "flops_per_chip": flops / TPU_CHIPS,
        "bytes_per_chip": moved,
        "collective_bytes_per_chip": collectives_,
        "loop_factor": factor,
        "estimate": estimated(flops),
        "compiler_cost": {k: float(cost[k]) for k in COMPILER_COST if k in cost},
        "instructions": len(_OP.findall(text)),
    }
    if moe:
        figures.update(
            active_params=mfu_params,
            planner_flops_per_chip=dots / TPU_CHIPS,
            grouped_flops_per_chip=grouped / TPU_CHIPS,
            estimate_planner_flops=estimated(dots),
            hlo=hlo_ops(text),
        )
    return figures


def tpu_row(
    layout: str, row: str, workdir: Path, hlo_dir: str, moe: bool = False
) -> dict[str, Any]:
    """Compile one row for the v5e-8 (in this process) and measure it."""
    tpu_environment()
    fsdp, tensor = LAYOUTS[layout]
    start = time.perf_counter()
    if moe:
        options = MOE_ROWS[row]
        if options is None:
            compiled, jaxpr, n_params = tpu_redcoast_moe()
        else:
            compiled, jaxpr, n_params = tpu_maxtext(fsdp, tensor, moe_overrides(options), workdir)
    elif (attention := TPU_ROWS[row]) is None:
        implementation = "blockwise" if row == BLOCKWISE else "auto"
        compiled, jaxpr, n_params = tpu_redcoast(tensor, implementation)
    else:
        model = tpu_llama_overrides(attention)
        compiled, jaxpr, n_params = tpu_maxtext(fsdp, tensor, model, workdir)
    seconds = time.perf_counter() - start
    figures = tpu_figures(compiled, jaxpr, n_params, moe=moe)
    figures["compile_s"] = seconds
    if hlo_dir:
        name = re.sub(r"\W+", "_", f"tpu_{'moe_' * moe}{layout}_{row}").strip("_")
        path = Path(hlo_dir, f"{name}.hlo.txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(compiled.as_text())
    return figures


GB = 1e9
TPU_HEADER = (
    "| layout | row | args GB | temp GB | output GB | peak GB | peak / MaxText's | "
    "estimated step ms | step / MaxText's | tokens/s | MFU | compute / memory / "
    "collectives ms | TFLOP per chip | GB moved per chip | compiler: TFLOP, GB accessed "
    "(loop bodies once), optimal s | compile s |"
)


def tpu_table_row(layout: str, row: str, e: dict[str, Any], ref: dict[str, Any]) -> str:
    step, c = e["estimate"], e["compiler_cost"]
    return (
        f"| {layout} | {row} | {e['args_bytes'] / GB:.2f} | {e['temp_bytes'] / GB:.2f} "
        f"| {e['output_bytes'] / GB:.2f} | {e['peak_bytes'] / GB:.2f} "
        f"| {e['peak_bytes'] / ref['peak_bytes']:.2f} | {step['seconds'] * 1e3:,.0f} "
        f"| {step['seconds'] / ref['estimate']['seconds']:.3f} "
        f"| {step['tokens_per_second']:,.0f} | {step['mfu']:.0%} "
        f"| {step['compute'] * 1e3:.0f} / {step['memory'] * 1e3:.0f} / "
        f"{step['communication'] * 1e3:.0f} | {e['flops_per_chip'] / 1e12:.2f} "
        f"| {e['bytes_per_chip'] / GB:.1f} | {c.get('flops', 0.0) / 1e12:.2f}, "
        f"{c.get('bytes accessed', 0.0) / GB:.1f}, {c.get('optimal_seconds', float('nan')):.3g} "
        f"| {e['compile_s']:.0f} |"
    )


MOE_HEADER = (
    "| row | args GB | temp GB | output GB | peak GB | peak / MaxText's | estimated step ms "
    "| step / MaxText's | tokens/s | MFU (active) | compute / memory / collectives ms "
    "| TFLOP per chip (grouped) | / reference | GB moved per chip | grouped matmuls in "
    "the HLO | compile s |"
)


def grouped_ops(hlo: dict[str, Any]) -> str:
    """The program's grouped matmuls: XLA's ragged-dot kernels and skipping convolutions,
    and its Pallas kernels other than attention's (megablox's `gmm` and `tgmm`, some of
    which the compiler names after their `shard_map`)."""
    other = sum(n for k, n in hlo["tpu_kernels"].items() if "splash" not in k and "ragged" not in k)
    return (
        f"{hlo['ragged_dot_kernels']} ragged-dot kernels, {hlo['ragged_dot_convolutions']} "
        f"ragged convolutions, {other} other Pallas kernels"
    )


def moe_table_row(row: str, e: dict[str, Any], ref: dict[str, Any]) -> str:
    step = e["estimate"]
    reference = moe_reference_flops()["reference"] / TPU_CHIPS
    return (
        f"| {row} | {e['args_bytes'] / GB:.2f} | {e['temp_bytes'] / GB:.2f} "
        f"| {e['output_bytes'] / GB:.2f} | {e['peak_bytes'] / GB:.2f} "
        f"| {e['peak_bytes'] / ref['peak_bytes']:.2f} | {step['seconds'] * 1e3:,.0f} "
        f"| {step['seconds'] / ref['estimate']['seconds']:.3f} "
        f"| {step['tokens_per_second']:,.0f} | {step['mfu']:.0%} "
        f"| {step['compute'] * 1e3:.0f} / {step['memory'] * 1e3:.0f} / "
        f"{step['communication'] * 1e3:.0f} | {e['flops_per_chip'] / 1e12:.2f} "
        f"({e['grouped_flops_per_chip'] / 1e12:.2f}) | {e['flops_per_chip'] / reference:.2f} "
        f"| {e['bytes_per_chip'] / GB:.1f} | {grouped_ops(e['hlo'])} | {e['compile_s']:.0f} |"
    )


def moe_main(args: argparse.Namespace) -> None:
    """The Mixtral's rows under FSDP 8, each compiled in a process of its own."""
    import maxtext

    if importlib.util.find_spec("libtpu") is None:
        raise SystemExit("--tpu compiles with libtpu: pip install 'jax[tpu]' (nox installs it)")
    total, active = moe_counts()
    flops = moe_reference_flops()
    results: dict[str, Any] = {
        "args": vars(args),
        "target": TPU_TARGET,
        "model": MOE_SIZES,
        "n_params": total,
        "active_params": active,
        "reference_flops": flops,
        "jax": jax.__version__,
        "libtpu": importlib.metadata.version("libtpu"),
        "maxtext": getattr(maxtext, "__version__", "0.2.5"),
        "load_before": os.getloadavg(),
        "rows": {},
    }
    print(
        f"Mixtral of {total:,} parameters, {active:,} active; per chip: 6 x active x tokens "
        f"{flops['active_6nt'] / TPU_CHIPS / 1e12:.2f} TFLOP + attention "
        f"{flops['attention'] / TPU_CHIPS / 1e12:.2f} = reference "
        f"{flops['reference'] / TPU_CHIPS / 1e12:.2f} TFLOP (every expert on every token: "
        f"{flops['dense'] / TPU_CHIPS / 1e12:.2f})"
    )
    print(MOE_HEADER)
    print("|---" * (MOE_HEADER.count("|") - 1) + "|", flush=True)
    rows = list(MOE_ROWS) if not args.rows else args.rows.split(",")
    entries: dict[str, Any] = results["rows"]
    for row in rows:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp, "row.json")
            command = [sys.executable, __file__, "--moe", "--tpu-row", f"fsdp8:{row}"]
            command += ["--out", str(out), "--workdir", args.workdir]
            command += ["--hlo-dir", args.hlo_dir] if args.hlo_dir else []
            subprocess.run(command, check=True)
            entries[row] = json.loads(out.read_text())
        ref = entries.get("MaxText", entries[row])
        print(moe_table_row(row, entries[row], ref), flush=True)
    for row, e in entries.items():
        print(f"{row}: {e['n_params']:,} parameters; HLO {e['hlo']}")
    print(f"jax {results['jax']}, libtpu {results['libtpu']}, MaxText {results['maxtext']}")
    write_results(results, args.out)


def write_results(results: dict[str, Any], path: str) -> None:
    """The load average after the runs into `results`, then `results` as JSON to `path`."""
    results["load_after"] = os.getloadavg()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"load average before {results['load_before']}, after {results['load_after']}")
    print(f"wrote {out}")


def tpu_main(args: argparse.Namespace) -> None:
    """Every row of every layout, each compiled in a process of its own."""
    import maxtext

    if importlib.util.find_spec("libtpu") is None:
        raise SystemExit("--tpu compiles with libtpu: pip install 'jax[tpu]' (nox installs it)")

    results: dict[str, Any] = {
        "args": vars(args),
        "target": TPU_TARGET,
        "model": TPU_SIZES,
        "jax": jax.__version__,
        "libtpu": importlib.metadata.version("libtpu"),
        "maxtext": getattr(maxtext, "__version__", "0.2.5"),
        "load_before": os.getloadavg(),
        "layouts": {},
    }
    print(TPU_HEADER)
    print("|---" * (TPU_HEADER.count("|") - 1) + "|", flush=True)
    rows = list(TPU_ROWS) if not args.rows else args.rows.split(",")
    for layout in args.layouts.split(","):
        entries: dict[str, Any] = {}
        for row in rows:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp, "row.json")
                command = [sys.executable, __file__, "--tpu-row", f"{layout}:{row}"]
                command += ["--out", str(out), "--workdir", args.workdir]
                command += ["--hlo-dir", args.hlo_dir] if args.hlo_dir else []
                subprocess.run(command, check=True)
                entries[row] = json.loads(out.read_text())
            ref = entries.get("MaxText", entries[row])
            print(tpu_table_row(LAYOUT_NAMES[layout], row, entries[row], ref), flush=True)
        results["layouts"][layout] = entries
    print(f"jax {results['jax']}, libtpu {results['libtpu']}, MaxText {results['maxtext']}")
    write_results(results, args.out)


LAYOUT_NAMES = {"fsdp8": "FSDP 8", "tp2xfsdp4": "TP 2 × FSDP 4"}


# ------------------------------------------------------------------ main

MIB = 2**20
HEADER = (
    "| layout | row | steps/s | time / MaxText's (paired) | compile s | args MiB | temp MiB "
    "| peak MiB | GFLOP | GB accessed | HLO instructions | fusions | all-gather | "
    "reduce-scatter | all-reduce | loss first -> last |"
)


def coll(e: dict[str, Any], op: str) -> str:
    entry = e["collectives"].get(op)
    return "0" if entry is None else f"{entry['count']} ({entry['bytes'] / 1e6:.2f} MB)"


def table_row(layout: str, name: str, e: dict[str, Any]) -> str:
    return (
        f"| {layout} | {name} | {e['steps_per_s']:.3f} | {e['time_over_maxtext']:.3f} "
        f"| {e['compile_s']:.1f} | {e['args_bytes'] / MIB:.1f} | {e['temp_bytes'] / MIB:.1f} "
        f"| {e['peak_bytes'] / MIB:.1f} | {e['flops'] / 1e9:.2f} | {e['bytes_accessed'] / 1e9:.2f} "
        f"| {e['instructions']} | {e['ops'].get('fusion', 0)} | {coll(e, 'all-gather')} "
        f"| {coll(e, 'reduce-scatter')} | {coll(e, 'all-reduce')} "
        f"| {e['first_loss']:.3f} -> {e['last_loss']:.3f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="synchronised steps per timed run")
    parser.add_argument("--reps", type=int, default=5, help="alternating repeats per layout")
    parser.add_argument("--compiles", type=int, default=2, help="compilations per row")
    parser.add_argument("--layouts", default="fsdp8,tp2xfsdp4", help=", ".join(LAYOUTS))
    parser.add_argument("--out", default="bench-results/bench_maxtext.json")
    parser.add_argument("--workdir", default="/tmp/bench_maxtext")
    parser.add_argument(
        "--variants",
        action="store_true",
        help="add redcoast without its token-id check, and time its non-finite check alone",
    )
    parser.add_argument("--hlo-dir", default="", help="write each program's HLO text here")
    parser.add_argument(
        "--tpu",
        action="store_true",
        help="compile both steps of a 953M LLaMA for a TPU v5e-8 (libtpu) and compare "
        "their memory and estimated step time; writes bench-results/bench_maxtext_tpu.json",
    )
    parser.add_argument(
        "--moe",
        action="store_true",
        help="with --tpu: a Mixtral (8 experts, top 2) instead, under FSDP 8; writes "
        "bench-results/bench_maxtext_tpu_moe.json",
    )
    parser.add_argument(
        "--rows",
        default="",
        help="with --tpu, comma-separated: "
        + "; ".join(TPU_ROWS)
        + " (with --moe: "
        + "; ".join(MOE_ROWS)
        + ")",
    )
    parser.add_argument("--tpu-row", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tpu_row:
        layout, row = args.tpu_row.split(":", 1)
        figures = tpu_row(layout, row, Path(args.workdir), args.hlo_dir, moe=args.moe)
        Path(args.out).write_text(json.dumps(figures, indent=2))
        return
    if args.moe and not args.tpu:
        parser.error("--moe compiles for the TPU: give --tpu too")
    if args.tpu:
        if args.out == parser.get_default("out"):
            args.out = f"bench-results/bench_maxtext_tpu{'_moe' * args.moe}.json"
        (moe_main if args.moe else tpu_main)(args)
        return

    import maxtext

    results: dict[str, Any] = {
        "args": vars(args),
        "jax": jax.__version__,
        "maxtext": getattr(maxtext, "__version__", "0.2.5"),
        "load_before": os.getloadavg(),
        "layouts": {},
    }
    print(HEADER)
    print("|---" * (HEADER.count("|") - 1) + "|")
    for layout in args.layouts.split(","):
        fsdp, tensor = LAYOUTS[layout]
        mt, ids = maxtext_contestant(fsdp, tensor, args.compiles, Path(args.workdir))
        rows = [mt, redcoast_contestant(REDCOAST, tensor, ids, args.compiles)]
        if args.variants:
            rows.append(
                redcoast_contestant(NO_ID_CHECK, tensor, ids, args.compiles, id_check=False)
            )
        timing = paired(rows, args.steps, args.reps)
        entries = {}
        for row in rows:
            entry = analyse(row, tensor)
            entry.update(
                steps_per_s=timing["steps_per_s"][row.name],
                all_steps_per_s=timing["all_steps_per_s"][row.name],
                time_over_maxtext=timing["time_over_maxtext"][row.name],
                compile_s=row.compile_s,
                first_loss=row.first_loss,
                last_loss=timing["last_loss"][row.name],
            )
            entries[row.name] = entry
            print(table_row(layout, row.name, entry), flush=True)
            if args.hlo_dir:
                path = Path(args.hlo_dir, f"{layout}_{row.name}.hlo.txt")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(row.compiled.as_text())
        results["layouts"][layout] = entries
        if args.variants:
            ms = nonfinite_check_ms(tensor, 20)
            step_ms = 1e3 / entries[REDCOAST]["steps_per_s"]
            results.setdefault("nonfinite_check_ms", {})[layout] = ms
            share = ms / step_ms
            print(f"| {layout} | non-finite check alone: {ms:.2f} ms = {share:.2%} of a step |")
    write_results(results, args.out)


if __name__ == "__main__":
    main()
