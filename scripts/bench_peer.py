"""redcoast beside redco, FSDP and a hand-written step: the same GPT, data and optimizer.

The paper's Figure 2 (GPT-J-6B on 4 x A100) puts RedCoast's automatic tensor
parallelism beside FSDP and Alpa. This script puts redcoast beside the package a user
would otherwise pick, on one machine, in one run.

Part 1, on 8 simulated CPU devices at meshes (data x model) 8x1, 4x2 and 2x4: one GPT
(vocabulary 1024, hidden 256, 4 layers, 8 heads, 128 tokens, tied head, GPT-2's
initialisation: N(0, 0.02) weights and embeddings, N(0, 0.02 / sqrt(2 * layers)) for
the residual projections, zero biases, unit LayerNorms), 32 sequences of real text
(the bytes of `pydoc_data.topics`), `optax.adamw(1e-3)`, each step on all 32. Every
row starts from the very same weights, so every row's losses agree to float rounding
(a layout or step that changed the arithmetic would show there). Rows:

- `redco`: the same GPT written once as a Flax linen module (its own initialisers are
  GPT-2's too; it starts from the zoo model's weights, kernels transposed to Flax's
  `(in, out)`), split by redco 0.4.23's rules and stepped by its
  `default_train_step` exactly as its `Trainer` builds it
  (`pjit` over its `("dp", "mp")` mesh; at 8x1 redco has no mesh and `pmap`s the
  step over replicated state). Only when `redco` and `flax` import (`nox -s
  bench_peer` installs them; they are never redcoast dependencies).
- `hand jax.jit, zoo GPT (Megatron)`: `rc.models.GPT2` with Megatron-LM's layout
  written by path, stepped by a plain `jax.jit` of `value_and_grad` + the optax
  update: what `rc.train_step` adds, and nothing else, differs from `redcoast TP`.
- `hand jax.jit, plain GPT (Megatron)`: the same GPT written directly in JAX as a
  user tuning for this backend would (`plain_gpt2`: weights `(in, out)`, `x @ w + b`
  on the residual stream reshaped to `(batch * seq, hidden)`, so each matmul and its
  weight gradient contracts one token axis, the Flax module's parameters),
  Megatron-LM's layout written by path, the same plain `jax.jit` step: a program a
  user would write by hand without redcoast.
- `redcoast TP`: `rc.models.GPT2` split by `rc.sharding_plan` (at 8x1: replicated,
  plain data parallelism), stepped by `rc.train_step` as `fit` steps it: its own
  jitted step, donating the model and optimizer state, called with the model.
- `redcoast TP x FSDP`: the plan with `fsdp=n_data` (every weight also split over the
  data axis, gathered layer by layer where used); at 8x1 that is pure FSDP, labelled
  `redcoast FSDP`.

Every row is compiled ahead of time, and its executable's `memory_analysis()`
(per-device argument and temporary bytes), `cost_analysis()` and HLO (collective
bytes per step and mesh axis, `tests/hlo.py`) are read. The other rows time that very
executable; redcoast's rows time calls of `rc.train_step`'s jitted step, the path
`fit` runs (which compiles at its first call), and read the executable its `lower`
gives for the same arguments. The layers are unrolled in every row (the zoo's
default, and the Flax module's), so no collective sits inside a loop and the HLO's
collectives are the step's; the script checks that there is no `while`.

Timing: the machine is shared and noisy, so each repeat runs `--steps` steps of every
row back to back in rotating order; steps/s are medians over repeats, and the ratios
are medians of the paired ratios (same repeat). Compile s is the median of three
wall times of tracing, lowering and compiling, each after `jax.clear_caches()`.
Every row runs the same number of
steps (1 + 1 warm-up + reps x steps); the loss reported is the first step's and the
last step's (each before its update), so the rows' final losses are comparable.

Part 2 (a second table, an estimate, not a measurement): the step time of each layout
on a named accelerator = per-device FLOPs / peak + the time of each collective at the
accelerator's per-device interconnect bandwidth with ring factors (all-reduce
2(n-1)/n x bytes, all-gather (n-1)/n x gathered bytes, reduce-scatter (n-1)/n x
unreduced bytes), compute and communication not overlapped, the same arithmetic for
every row. `tests/hlo.py` names the mesh axes a collective spans, not its group size: a
group over `model` is taken to hold n_model devices, over `data` n_data, and over both
axes all 8 (an upper bound: XLA sometimes groups fewer devices across both axes).
`cost_analysis()` of an SPMD program counts one device's FLOPs (a matmul
split 8 ways reports 1/8 of its FLOPs at 8x1 and at 1x8 alike; checked on this JAX).
The program is float32 and the estimate keeps its bytes; its FLOPs run at the peak
JAX's default matmul precision uses for float32: TF32 tensor cores on an A100,
one-pass bfloat16 on a TPU.

Part 3, on one device: forward + backward of the zoo's GPT-2 against `plain_gpt2`, the
same architecture written directly in JAX (weights `(in, out)`, `x @ w + b` on
`(batch * seq, hidden)`), on the same weights.

Run: nox -s bench_peer      (or, in an environment with redco==0.4.23, flax and tqdm:
     python scripts/bench_peer.py --reps 7)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc
from redcoast._tree_paths import path_str

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # hlo.py
from hlo import collectives, summarize

V, D, H, L, S = 1024, 256, 8, 4, 128
N_SEQ = 32
LR = 1e-3
TP, FSDP, REDCO = "redcoast TP", "redcoast TP x FSDP", "redco"
HAND, PLAIN = "hand jax.jit, zoo GPT (Megatron)", "hand jax.jit, plain GPT (Megatron)"
Runner = Callable[[int], float]  # run n steps, return the last step's loss
COMPILES = 3  # compilations per row; compile time is their median


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """Published peak rates of one accelerator, for the estimate."""

    name: str
    flops_per_s: float  # float32 matmuls at JAX's default precision
    link_bytes_per_s: float  # per device, one direction, for a ring over the group
    source: str


ACCELERATORS = (
    Accelerator(
        "A100 80GB SXM (NVLink)",
        156e12,  # TF32 tensor cores, dense
        300e9,  # third-generation NVLink: 600 GB/s per GPU both directions
        "NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4)",
    ),
    Accelerator(
        "TPU v4",
        275e12,  # bfloat16 peak per chip; f32 matmuls run one bf16 pass by default
        100e9,  # an ICI ring over one torus axis: 2 links x 50 GB/s (400 Gb/s) each way
        "Google Cloud TPU v4 docs; Jouppi et al. 2023, TPU v4 (ISCA)",
    ),
)


# ------------------------------------------------------------------ model and data


def text_ids() -> np.ndarray:
    """`N_SEQ` sequences of `S` tokens: consecutive bytes of English text from CPython."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    data = np.frombuffer(text, dtype=np.uint8)[: N_SEQ * S]
    return data.reshape(N_SEQ, S).astype(np.int32)


def cross_entropy(logits: jax.Array, ids: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def zoo_loss(model: rc.models.GPT2, batch: dict[str, jax.Array], key: Any) -> jax.Array:
    return cross_entropy(jax.vmap(model)(batch["ids"]), batch["ids"])


def new_zoo_model() -> rc.models.GPT2:
    config = rc.models.GPT2Config(vocab_size=V, n_positions=S, n_embd=D, n_layer=L, n_head=H)
    return rc.models.GPT2(config, key=jax.random.key(0))


def flax_gpt() -> Any:
    """The zoo's GPT-2 written as a Flax linen module, with GPT-2's initialisation."""
    import flax.linen as nn

    normal = nn.initializers.normal
    residual = 0.02 / math.sqrt(2 * L)

    def dense(features: int, name: str, std: float = 0.02) -> nn.Dense:
        return nn.Dense(features, kernel_init=normal(std), name=name)

    class Attn(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            q, k, v = (dense(D, n)(x) for n in ("q_proj", "k_proj", "v_proj"))
            b, s, _ = x.shape
            q, k, v = (t.reshape(b, s, H, D // H) for t in (q, k, v))
            w = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D // H)
            w = jnp.where(jnp.tril(jnp.ones((s, s), bool)), w, jnp.finfo(w.dtype).min)
            o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(w, -1), v).reshape(b, s, D)
            return dense(D, "o_proj", residual)(o)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = x + Attn(name="attn")(nn.LayerNorm(1e-5, name="ln_1")(x))
            h = dense(4 * D, "fc_in")(nn.LayerNorm(1e-5, name="ln_2")(x))
            return x + dense(D, "fc_out", residual)(jax.nn.gelu(h, approximate=True))

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, ids: jax.Array) -> jax.Array:
            emb = nn.Embed(V, D, embedding_init=normal(0.02), name="wte")
            pos = self.param("wpe", normal(0.02), (S, D))
            x = emb(ids) + pos[: ids.shape[1]]
            for i in range(L):
                x = Block(name=f"h_{i}")(x)
            return emb.attend(nn.LayerNorm(1e-5, name="ln_f")(x))

    return GPT()


def flax_params(zoo: rc.models.GPT2) -> dict[str, Any]:
    """The zoo model's weights as the Flax module's parameters (kernels are `(in, out)`)."""

    def dense(layer: eqx.nn.Linear) -> dict[str, jax.Array]:
        assert layer.bias is not None
        return {"kernel": layer.weight.T, "bias": layer.bias}

    def norm(layer: Any) -> dict[str, jax.Array]:
        return {"scale": layer.weight, "bias": layer.bias}

    out: dict[str, Any] = {
        "wte": {"embedding": zoo.embed_tokens.weight},
        "wpe": zoo.embed_positions.weight,
        "ln_f": norm(zoo.norm),
    }
    for i, block in enumerate(zoo.blocks):
        attn = block.attn
        out[f"h_{i}"] = {
            "ln_1": norm(block.attn_norm),
            "attn": {n: dense(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
            "ln_2": norm(block.mlp_norm),
            "fc_in": dense(block.mlp.fc_in),
            "fc_out": dense(block.mlp.fc_out),
        }
    return out


def redco_available() -> str | None:
    """None when redco and flax import; otherwise why not."""
    try:
        import flax  # noqa: F401
        import redco  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


# ------------------------------------------------------------------ the rows


@dataclasses.dataclass
class Row:
    """One contestant on one mesh: its compiled step, how to run it, what it holds."""

    name: str
    run: Runner
    compiled: Any  # jax.stages.Compiled: the very executable `run` calls
    compile_s: float
    first_loss: float
    state_bytes: int  # parameters + optimizer state on one device
    logical_bytes: int  # parameters + optimizer state of the whole model, once


def local_bytes(tree: Any) -> int:
    """Bytes of `tree`'s arrays held by one device (the first)."""
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    return sum(x.addressable_shards[0].data.nbytes for x in leaves)


def logical_bytes(tree: Any) -> int:
    """Bytes of `tree`'s arrays, each counted once whatever its sharding."""
    return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def compile_row(
    name: str,
    lower: Callable[[], Any],
    step: Callable[[Any, Any], tuple[Any, Any]],
    state: Any,
    *,
    logical: int,
) -> Row:
    """Compile a step ahead of time and take its first step with the executable.

    Compile time is the median over `COMPILES` compilations of tracing, lowering and
    compiling, each after `jax.clear_caches()`: the first compilation on a mesh also
    pays for warming up the process, whichever row comes first.

    Args:
        name: the row's label.
        lower: `() -> jax.stages.Lowered` of the step.
        step: `(compiled, state) -> (state, loss)`, one call of the executable.
        state: what the step carries from call to call (parameters, optimizer state).
        logical: the bytes of the parameters and optimizer state, each once.
    """
    seconds = []
    for _ in range(COMPILES):
        jax.clear_caches()
        start = time.perf_counter()
        compiled = lower().compile()
        seconds.append(time.perf_counter() - start)
    per_device = local_bytes(state)
    held = [state]

    def run(n: int) -> float:
        loss: Any = None
        for _ in range(n):
            held[0], loss = step(compiled, held[0])
        return float(np.asarray(loss).ravel()[0])

    first = run(1)
    return Row(name, run, compiled, float(np.median(seconds)), first, per_device, logical)


def redcoast_row(mesh: Mesh, ids: np.ndarray, *, fsdp: bool) -> Row:
    """`rc.models.GPT2` split by `rc.sharding_plan` (over the data axis too with `fsdp`).

    Stepped as `fit` steps it: `rc.train_step`'s own jitted step (donating the model
    and optimizer state), called with the model itself; `step.lower` gives the program
    that call runs, for the compile time and the analysis.
    """
    n_data, n_model = mesh.shape["data"], mesh.shape["model"]
    model = new_zoo_model()
    batch = {"ids": jax.device_put(ids, NamedSharding(mesh, P("data")))}
    plan = rc.sharding_plan(
        model,
        n_model,
        example_call=lambda m: zoo_loss(m, batch, None),
        fsdp=n_data if fsdp else 1,
    )
    model = rc.place(model, mesh, specs=plan.specs)
    opt = optax.adamw(LR)
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    train: Any = rc.train_step(zoo_loss, opt, mesh=mesh)
    key = jax.random.key(0)

    def step(_: Any, state: Any) -> tuple[Any, Any]:
        m, s, metrics = train(*state, batch, key)
        return (m, s), metrics["loss"]

    def lower() -> Any:
        return _Analysed(train.lower(model, opt_state, batch, key))

    name = (FSDP if n_model > 1 else "redcoast FSDP") if fsdp else TP
    total = logical_bytes((model, opt_state))
    return compile_row(name, lower, step, (model, opt_state), logical=total)


@dataclasses.dataclass(frozen=True)
class _Analysed:
    """`train_step`'s lowering, compiled to the `jax.stages.Compiled` the analysis reads."""

    lowered: Any

    def compile(self) -> Any:
        return self.lowered.compile().compiled


MEGATRON = {  # path suffix -> spec of the zoo's (out, in) weights
    "q_proj.weight": P("model", None),
    "k_proj.weight": P("model", None),
    "v_proj.weight": P("model", None),
    "q_proj.bias": P("model"),
    "k_proj.bias": P("model"),
    "v_proj.bias": P("model"),
    "o_proj.weight": P(None, "model"),
    "fc_in.weight": P("model", None),
    "fc_in.bias": P("model"),
    "fc_out.weight": P(None, "model"),
    "embed_tokens.weight": P("model", None),
}


def megatron_specs(model: eqx.Module) -> Any:
    """Megatron-LM's layout of the zoo's GPT-2, written by path."""

    def spec(path: tuple, leaf: Any) -> P:
        name = path_str(path)
        return next((s for k, s in MEGATRON.items() if name.endswith(k)), P())

    return jax.tree_util.tree_map_with_path(spec, eqx.filter(model, eqx.is_array))


PLAIN_MEGATRON = {  # path suffix -> spec of `flax_params`' (in, out) kernels
    **{f"['{n}']['kernel']": P(None, "model") for n in ("q_proj", "k_proj", "v_proj", "fc_in")},
    **{f"['{n}']['bias']": P("model") for n in ("q_proj", "k_proj", "v_proj", "fc_in")},
    "['o_proj']['kernel']": P("model", None),
    "['fc_out']['kernel']": P("model", None),
    "['wte']['embedding']": P("model", None),
}


def jit_row(
    name: str,
    mesh: Mesh,
    ids: np.ndarray,
    params: Any,
    specs: Any,
    loss: Callable[[Any, jax.Array], jax.Array],
) -> Row:
    """`params` placed by `specs`, stepped by a plain `jax.jit` of `value_and_grad` + AdamW."""
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    opt = optax.adamw(LR)
    opt_state = opt.init(params)
    batch = jax.device_put(ids, NamedSharding(mesh, P("data")))

    def train(params: Any, opt_state: Any, ids: jax.Array) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(loss)(params, ids)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    jitted = jax.jit(train, donate_argnums=(0, 1))

    def step(compiled: Any, state: Any) -> tuple[Any, Any]:
        p, s, value = compiled(*state, batch)
        return (p, s), value

    total = logical_bytes((params, opt_state))
    return compile_row(
        name,
        lambda: jitted.lower(params, opt_state, batch),
        step,
        (params, opt_state),
        logical=total,
    )


def hand_row(mesh: Mesh, ids: np.ndarray) -> Row:
    """The zoo's GPT-2 in Megatron-LM's layout, stepped by a plain `jax.jit`."""
    model = new_zoo_model()
    params, static = eqx.partition(model, eqx.is_array)

    def loss(p: Any, ids: jax.Array) -> jax.Array:
        return zoo_loss(eqx.combine(p, static), {"ids": ids}, None)

    return jit_row(HAND, mesh, ids, params, megatron_specs(model), loss)


def plain_row(mesh: Mesh, ids: np.ndarray) -> Row:
    """GPT-2 written directly in JAX (`plain_gpt2`), Megatron-LM's layout, a plain `jax.jit`."""
    params = flax_params(new_zoo_model())

    def spec(path: tuple, leaf: Any) -> P:
        name = jax.tree_util.keystr(path)
        return next((s for k, s in PLAIN_MEGATRON.items() if name.endswith(k)), P())

    specs = jax.tree_util.tree_map_with_path(spec, params)
    return jit_row(
        PLAIN, mesh, ids, params, specs, lambda p, ids: cross_entropy(plain_gpt2(p, ids), ids)
    )


def redco_row(n_data: int, n_model: int, ids: np.ndarray) -> Row:
    """redco 0.4.23's rules and train step, as its `Trainer.setup_running_step` builds them."""
    from flax.core.frozen_dict import freeze
    from flax.jax_utils import replicate
    from flax.training import train_state
    from flax.training.common_utils import shard, shard_prng_key
    from jax.experimental.pjit import pjit
    from redco.deployers import partition_utils as pu
    from redco.trainers.utils import default_train_step

    model = flax_gpt()
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, S), jnp.int32))
    params = freeze(flax_params(new_zoo_model()))
    if jax.tree.structure(params) != jax.tree.structure(freeze(shapes["params"])):
        raise RuntimeError("the Flax GPT's parameters are not the zoo GPT-2's")
    opt = optax.adamw(LR)

    def loss_fn(rng: Any, state: Any, params: Any, batch: Any, is_training: bool) -> Any:
        return cross_entropy(state.apply_fn({"params": params}, batch["ids"]), batch["ids"])

    mesh = pu.get_mesh(n_model)  # None for one model shard: redco's Trainer then pmaps
    train = functools.partial(
        default_train_step,
        loss_fn=loss_fn,
        lr_schedule_fn=None,
        mesh=mesh,
        compute_dtype=jnp.float32,
    )
    key = jax.random.key(0)
    if mesh is None:
        opt_state = opt.init(params)
        total = logical_bytes((params, opt_state))
        state = replicate(
            train_state.TrainState(
                step=0, apply_fn=model.apply, params=params, tx=opt, opt_state=opt_state
            )
        )
        batch, keys = shard({"ids": ids}), shard_prng_key(key)
        pmapped = jax.pmap(train, axis_name="dp")

        def pmap_step(compiled: Any, state: Any) -> tuple[Any, Any]:
            state, metrics = compiled(keys, state, batch)
            return state, metrics["loss"]

        lower = lambda: pmapped.lower(keys, state, batch)  # noqa: E731
        return compile_row(REDCO, lower, pmap_step, state, logical=total)
    spec = pu.get_params_spec(params, pu.get_sharding_rules(params, n_model))
    params = pu.shard_params(params, spec, mesh)
    opt_spec = pu.get_opt_state_spec(params, spec, opt)
    opt_state = pu.shard_params(opt.init(params), opt_spec, mesh)
    state = train_state.TrainState(
        step=0, apply_fn=model.apply, params=params, tx=opt, opt_state=opt_state
    )
    state_spec = train_state.TrainState(
        step=None, apply_fn=model.apply, params=spec, tx=opt, opt_state=opt_spec
    )
    pjitted = pjit(
        train,
        in_shardings=(None, state_spec, {"ids": P("dp")}),
        out_shardings=(state_spec, None),
        donate_argnums=(1,),
    )
    batch = {"ids": jax.device_put(ids.reshape(n_data, -1, S), NamedSharding(mesh, P("dp")))}

    def lower() -> Any:
        # redco's Trainer enters `with mesh:` (deprecated by this JAX, which warns) for
        # pjit to resolve its PartitionSpecs.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with mesh:
                return pjitted.lower(key, state, batch)

    def step(compiled: Any, state: Any) -> tuple[Any, Any]:
        state, metrics = compiled(key, state, batch)
        return state, metrics["loss"]

    total = logical_bytes((params, opt_state))
    return compile_row(REDCO, lower, step, state, logical=total)


# ------------------------------------------------------------------ what the program does


def analyse(row: Row, mesh: Mesh) -> dict[str, Any]:
    """Memory, FLOPs and collectives of a row's compiled step, per device."""
    text = row.compiled.as_text()
    if " while(" in text:
        raise RuntimeError(
            f"{row.name}'s step has a loop; its collectives would be counted once per "
            "loop instead of once per iteration. Unroll the layers."
        )
    memory = row.compiled.memory_analysis()
    cost = row.compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    found = collectives(text, mesh)
    by_axis = summarize(found)
    args, temp = int(memory.argument_size_in_bytes), int(memory.temp_size_in_bytes)
    # Outputs that do not reuse a donated argument's buffer add to the peak: redco's
    # pmapped step (as its Trainer builds it) donates nothing.
    fresh = max(int(memory.output_size_in_bytes) - int(memory.alias_size_in_bytes), 0)
    return {
        "args_bytes": args,
        "temp_bytes": temp,
        "peak_bytes": args + temp + fresh,
        "flops": float(cost["flops"]),
        "collectives": by_axis,
        "collective_list": [[c.op, c.axis, c.nbytes] for c in found],
        "state_bytes": row.state_bytes,
        "state_floor_bytes": row.logical_bytes / mesh.devices.size,
    }


# ------------------------------------------------------------------ the estimate


def collective_seconds(op: str, nbytes: float, group: int, bandwidth: float) -> float:
    """Time of one ring collective over `group` devices at `bandwidth` bytes/s per device.

    Args:
        op: the HLO operation (`all-reduce`, `all-gather`, `reduce-scatter`,
            `all-to-all`, `collective-permute`).
        nbytes: its result on one device, as `tests/hlo.py` counts it: the whole
            array for an all-reduce or an all-gather, one shard for a reduce-scatter.
        group: devices taking part.
        bandwidth: bytes per second each device sends (and receives).

    Returns:
        Seconds: all-reduce 2(n-1)/n x bytes, all-gather (n-1)/n x the gathered
        bytes, reduce-scatter (n-1)/n x the n shards it reduces, all-to-all (n-1)/n x
        bytes, collective-permute its bytes; over `bandwidth`.

    Example:
        >>> collective_seconds("all-reduce", 1e9, 4, 100e9)  # 2 * 3/4 * 1 GB at 100 GB/s
        0.015
    """
    if group <= 1:
        return 0.0
    share = (group - 1) / group
    moved = {
        "all-reduce": 2 * share * nbytes,
        "all-gather": share * nbytes,
        "reduce-scatter": share * nbytes * group,
        "all-to-all": share * nbytes,
    }.get(op, nbytes)
    return moved / bandwidth


def estimate(
    flops: float, found: list[list[Any]], n_data: int, n_model: int, accelerator: Accelerator
) -> dict[str, float]:
    """Step time of a compiled step on `accelerator`: compute, then communication.

    Args:
        flops: one device's FLOPs per step (`cost_analysis()["flops"]`).
        found: `[op, axis, bytes]` of each collective of the step (`tests/hlo.py`);
            a collective over `"model"` spans `n_model` devices, over `"data"`
            `n_data`, over `"both"` all of them (at most: the HLO may group fewer).
        n_data: the mesh's data axis.
        n_model: the mesh's model axis.
        accelerator: the peak rates.

    Returns:
        Milliseconds: `compute_ms`, `comm_ms` and their sum `step_ms` (no overlap).
    """
    groups = {"model": n_model, "data": n_data, "both": n_data * n_model, "none": 1}
    comm = sum(
        collective_seconds(op, nbytes, groups[axis], accelerator.link_bytes_per_s)
        for op, axis, nbytes in found
    )
    compute = flops / accelerator.flops_per_s
    return {"compute_ms": 1e3 * compute, "comm_ms": 1e3 * comm, "step_ms": 1e3 * (compute + comm)}


# ------------------------------------------------------------------ timing


def paired(runners: dict[str, Runner], steps: int, reps: int, reference: str) -> dict[str, Any]:
    """Steps/s of each runner over `reps` repeats in rotating order, after one warm-up step.

    Returns medians of steps/s, medians of the paired ratios `reference / other` (same
    repeat), and each runner's last loss.
    """
    names = list(runners)
    for run in runners.values():
        run(1)
    rates: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, float] = {}
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            losses[name] = runners[name](steps)
            rates[name].append(steps / (time.perf_counter() - start))
    ratios = {
        n: float(np.median(np.array(rates[reference]) / np.array(rates[n])))
        for n in names
        if n != reference
    }
    return {
        "steps_per_s": {n: float(np.median(v)) for n, v in rates.items()},
        "ratio": ratios,
        "last_loss": losses,
    }


# ------------------------------------------------------------------ one device


def plain_gpt2(params: dict[str, Any], ids: jax.Array) -> jax.Array:
    """GPT-2's forward pass on a batch of sequences, written directly on `flax_params`.

    The residual stream is kept as one `(batch * seq, hidden)` matrix, so every weight's
    matmul, and its gradient, contracts one token axis (XLA:CPU's matmuls take one);
    only attention sees `(batch, seq, heads, head_dim)`.
    """

    def layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]

    def dense(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        return x @ p["kernel"] + p["bias"]

    b, s = ids.shape
    x = (params["wte"]["embedding"][ids] + params["wpe"][:s]).reshape(b * s, D)
    causal = jnp.tril(jnp.ones((s, s), bool))
    for i in range(L):
        p = params[f"h_{i}"]
        h = layer_norm(x, p["ln_1"])
        q, k, v = (
            dense(h, p["attn"][n]).reshape(b, s, H, D // H) for n in ("q_proj", "k_proj", "v_proj")
        )
        w = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D // H)
        w = jax.nn.softmax(jnp.where(causal, w, jnp.finfo(w.dtype).min), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b * s, D)
        x = x + dense(o, p["attn"]["o_proj"])
        h = jax.nn.gelu(dense(layer_norm(x, p["ln_2"]), p["fc_in"]), approximate=True)
        x = x + dense(h, p["fc_out"])
    logits = layer_norm(x, params["ln_f"]) @ params["wte"]["embedding"].T
    return logits.reshape(b, s, -1)


def one_device(ids: np.ndarray, steps: int, reps: int) -> dict[str, Any]:
    """Forward + backward of the zoo's GPT-2 and of the plain one, on one device."""
    device = jax.devices()[0]
    batch = jax.device_put(jnp.asarray(ids[:8]), device)
    zoo_params, static = eqx.partition(jax.device_put(new_zoo_model(), device), eqx.is_array)
    plain_params = jax.device_put(flax_params(new_zoo_model()), device)

    @jax.jit
    def zoo_grad(p: Any, ids: jax.Array) -> tuple[jax.Array, Any]:
        return jax.value_and_grad(lambda p: zoo_loss(eqx.combine(p, static), {"ids": ids}, None))(p)

    @jax.jit
    def plain_grad(p: Any, ids: jax.Array) -> tuple[jax.Array, Any]:
        return jax.value_and_grad(lambda p: cross_entropy(plain_gpt2(p, ids), ids))(p)

    def runner(fn: Callable[..., Any], params: Any) -> Runner:
        def run(n: int) -> float:
            for _ in range(n):
                value, grads = fn(params, batch)
            jax.block_until_ready(grads)
            return float(value)

        return run

    runners = {
        "zoo GPT2": runner(zoo_grad, zoo_params),
        "plain GPT-2": runner(plain_grad, plain_params),
    }
    compile_s = {}
    for name, run in runners.items():
        start = time.perf_counter()
        run(1)
        compile_s[name] = time.perf_counter() - start
    return {**paired(runners, steps, reps, "zoo GPT2"), "compile_s": compile_s}


# ------------------------------------------------------------------ tables

MIB, MB = 2**20, 1e6
TABLE_1 = (
    "| mesh | row | steps/s | TP / row (paired) | compile s | args MiB | temp MiB | peak MiB "
    "| param+opt MiB (x floor) | model-axis MB | data-axis MB | both-axes MB | loss first -> last |"
)
TABLE_2 = (
    "| mesh | row | GFLOP / device | "
    + " | ".join(f"{a.name}: compute + comm = step ms" for a in ACCELERATORS)
    + " |"
)


def axis_mb(entry: dict[str, Any], axis: str) -> float:
    return entry["collectives"].get(axis, {}).get("bytes", 0) / MB


def table_1_row(shape: str, name: str, e: dict[str, Any]) -> str:
    ratio = "" if e["ratio"] is None else f"{e['ratio']:.2f}"
    floor = e["state_bytes"] / e["state_floor_bytes"]
    return (
        f"| {shape} | {name} | {e['steps_per_s']:.2f} | {ratio} | {e['compile_s']:.1f} "
        f"| {e['args_bytes'] / MIB:.1f} | {e['temp_bytes'] / MIB:.1f} "
        f"| {e['peak_bytes'] / MIB:.1f} "
        f"| {e['state_bytes'] / MIB:.1f} ({floor:.2f}) | {axis_mb(e, 'model'):.2f} "
        f"| {axis_mb(e, 'data'):.2f} | {axis_mb(e, 'both'):.2f} "
        f"| {e['first_loss']:.3f} -> {e['last_loss']:.3f} |"
    )


def table_2_row(shape: str, name: str, e: dict[str, Any]) -> str:
    cells = [
        f"{t['compute_ms']:.3f} + {t['comm_ms']:.3f} = {t['step_ms']:.3f}"
        for t in (e["estimate"][a.name] for a in ACCELERATORS)
    ]
    return f"| {shape} | {name} | {e['flops'] / 1e9:.2f} | " + " | ".join(cells) + " |"


def targets(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets on one mesh: met or not, with the numbers."""
    out: dict[str, Any] = {}
    tp = rows[TP]
    fsdp = next(e for n, e in rows.items() if "FSDP" in n)
    out["fsdp_state_over_floor"] = fsdp["state_bytes"] / fsdp["state_floor_bytes"]
    out["fsdp_within_1.10_of_floor"] = out["fsdp_state_over_floor"] <= 1.10
    if REDCO in rows:
        redco = rows[REDCO]
        out["tp_over_redco_steps_per_s"] = redco["ratio"]
        out["tp_at_least_redco_speed"] = redco["ratio"] >= 1.0
        out["tp_model_bytes_at_most_redco"] = axis_mb(tp, "model") <= axis_mb(redco, "model")
        out["tp_peak_bytes_at_most_redco"] = tp["peak_bytes"] <= redco["peak_bytes"]
        out["tp_args_plus_temp_at_most_redco"] = (
            tp["args_bytes"] + tp["temp_bytes"] <= redco["args_bytes"] + redco["temp_bytes"]
        )
    for name in (HAND, PLAIN):
        out[f"tp_over_{name}_steps_per_s"] = rows[name]["ratio"]
    out["tp_at_least_hand_speed"] = min(rows[n]["ratio"] for n in (HAND, PLAIN)) >= 1.0
    finals = [e["last_loss"] for e in rows.values()]
    out["final_loss_spread"] = (max(finals) - min(finals)) / min(finals)
    return out


# ------------------------------------------------------------------ main


def bench_mesh(shape: str, ids: np.ndarray, args: argparse.Namespace, redco: bool) -> Any:
    """Every row on one mesh: built, timed, analysed; table 1's rows printed."""
    n_data, n_model = (int(x) for x in shape.split("x"))
    mesh = rc.make_mesh(n_model_shards=n_model)
    if mesh.shape["data"] != n_data:
        raise ValueError(f"mesh {shape} needs {n_data * n_model} devices; JAX has {mesh.size}.")
    rows = [redcoast_row(mesh, ids, fsdp=False)]
    if redco:
        rows.append(redco_row(n_data, n_model, ids))
    rows += [hand_row(mesh, ids), plain_row(mesh, ids), redcoast_row(mesh, ids, fsdp=True)]
    timing = paired({r.name: r.run for r in rows}, args.steps, args.reps, TP)
    entries = {}
    for row in rows:
        entry = analyse(row, mesh)
        entry.update(
            steps_per_s=timing["steps_per_s"][row.name],
            ratio=timing["ratio"].get(row.name),
            compile_s=row.compile_s,
            first_loss=row.first_loss,
            last_loss=timing["last_loss"][row.name],
            estimate={
                a.name: estimate(entry["flops"], entry["collective_list"], n_data, n_model, a)
                for a in ACCELERATORS
            },
        )
        entries[row.name] = entry
        print(table_1_row(shape, row.name, entry), flush=True)
    return {"rows": entries, "targets": targets(entries)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per timed run")
    parser.add_argument("--reps", type=int, default=5, help="paired repeats per mesh")
    parser.add_argument("--meshes", default="8x1,4x2,2x4", help="data x model meshes")
    parser.add_argument("--out", default="bench-results/bench_peer.json")
    args = parser.parse_args()

    ids = text_ids()
    missing = redco_available()
    results: dict[str, Any] = {
        "args": vars(args),
        "redco_skipped": missing,
        "steps_per_row": 2 + args.reps * args.steps,
        "accelerators": [dataclasses.asdict(a) for a in ACCELERATORS],
        "meshes": {},
    }
    if missing:
        print(f"redco rows skipped: {missing} (nox -s bench_peer installs redco and flax)")
    print(TABLE_1)
    print("|---" * (TABLE_1.count("|") - 1) + "|")
    for shape in args.meshes.split(","):
        results["meshes"][shape] = bench_mesh(shape, ids, args, redco=not missing)
    print()
    print("Estimate (not measured):", "; ".join(f"{a.name}: {a.source}" for a in ACCELERATORS))
    print(TABLE_2)
    print("|---" * (TABLE_2.count("|") - 1) + "|")
    for shape, mesh_result in results["meshes"].items():
        for name, entry in mesh_result["rows"].items():
            print(table_2_row(shape, name, entry))
    print()
    res = one_device(ids, args.steps * 3, args.reps)
    results["one_device"] = res
    print("| 1 device, fwd+bwd, batch 8 | steps/s | compile s |")
    print("|---|---|---|")
    for name, rate in res["steps_per_s"].items():
        print(f"| {name} | {rate:.2f} | {res['compile_s'][name]:.1f} |")
    print(f"time ratio zoo / plain (paired median): {1 / res['ratio']['plain GPT-2']:.2f}")
    for shape, mesh_result in results["meshes"].items():
        print(f"targets {shape}: " + json.dumps(mesh_result["targets"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
