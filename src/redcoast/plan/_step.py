"""The train step `memory_plan` measures: built as `fit` runs it, on abstract shapes, compiled.

The model (a `PlannedModel`) is built with `eqx.filter_eval_shape`, placed by the
sharding plan (tensor parallelism, FSDP), given LoRA adapters and an AdamW state
when asked, and the step is lowered and compiled for the layout's devices; XLA's
memory analysis gives the bytes, and the shardings the parameters' and state's own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PRNGKeyArray, PyTree

from .._tree_paths import leaves_with_paths, path_str
from ..nn._loss import cross_entropy, map_logits
from ..parallel._context_parallel import ContextParallel
from ..parallel._parallelism import Parallelism
from ..parallel._placement import optimizer_specs, sharding_tree
from ..parallel._quantized import stand_ins
from ..parallel._sharding_plan import ShardingPlan
from ..parallel.mesh import DATA, make_mesh
from ..parallel.sharding import sharding_plan
from ..train.step import LossFn
from ..train.throughput import matmul_flops
from ._hlo import collective_bytes, cpu_float32_copies, loop_factor
from ._report import RL, Layout, LoRA

__all__ = [
    "Measured",
    "PlannedModel",
    "compile_step",
    "compile_traced",
    "grpo",
    "local_bytes",
    "placed_params",
    "plan_specs",
    "trace_step",
    "with_lora",
]


def next_token_loss(
    model: Any,
    batch: dict[str, jax.Array],
    key: jax.Array,
    *,
    chunk_tokens: int | Literal["auto"] | None = None,
) -> jax.Array:
    """A language model's loss on rows of `seq_len + 1` ids: each next token, from the rest;
    with `chunk_tokens`, the logits a chunk of tokens at a time (`rc.nn.map_logits`)."""
    del key
    ids = batch["input_ids"]
    if chunk_tokens is not None:
        nll = map_logits(model, ids[:, :-1], cross_entropy, ids[:, 1:], chunk_tokens=chunk_tokens)
        return nll.mean()
    logits = jax.vmap(model)(ids[:, :-1])
    return cross_entropy(logits, ids[:, 1:]).mean()


def whole_rows_loss(model: Any, batch: dict[str, jax.Array], key: jax.Array) -> jax.Array:
    """`next_token_loss` with the model run on rows of exactly `seq_len` ids, as context
    parallelism splits them; the last position predicts nothing."""
    del key
    ids = batch["input_ids"]
    logits = jax.vmap(model)(ids)[:, :-1]
    return cross_entropy(logits, ids[:, 1:]).mean()


@dataclasses.dataclass(frozen=True)
class PlannedModel:
    """A model as `memory_plan` sees it: how to build it, its loss, and its limits.

    Attributes:
        name: how the report names it.
        build: `remat policy -> (key -> model)`; a factory that decides its own
            remat ignores the policy (`remats=False`).
        loss_fn: the train step's loss on `{"input_ids": int32 (rows, seq_len + 1)}`.
        whole_rows_loss: the loss on rows of exactly `seq_len` ids, as context
            parallelism gives them (`rc.models.lm_loss` does so).
        example_call: what the sharding rules trace (`model -> output`); default
            `loss_fn` on a row of 8 ids.
        heads: attention heads, which the model axis must divide; None if unknown.
        positions: the longest sequence the model takes; None if unlimited.
        no_context_parallel: why context parallelism cannot split this model (an
            encoder-decoder's masks), or None.
        no_sampling: why `rc.sampling` cannot sample this model, so no RL step can be
            planned for it (an encoder-decoder, the DiT), or None.
        remats: `build` honours the remat policy, so a search may try them.
    """

    name: str
    build: Callable[[str], Callable[[PRNGKeyArray], Any]]
    loss_fn: LossFn = next_token_loss
    whole_rows_loss: LossFn = whole_rows_loss
    example_call: Callable[[Any], Any] | None = None
    heads: int | None = None
    positions: int | None = None
    no_context_parallel: str | None = None
    no_sampling: str | None = None
    remats: bool = True

    @classmethod
    def of_factory(cls, make: Callable[[PRNGKeyArray], Any]) -> PlannedModel:
        """A factory `key -> causal LM` (token ids in, logits out), planned as it is."""
        return cls("model", lambda _remat: make, remats=False)

    def factory(self, remat: str, lora: LoRA | None) -> Callable[[PRNGKeyArray], Any]:
        """`key -> model` under `remat`, with the adapters of `lora`."""
        make = self.build(remat)
        return make if lora is None else with_lora(make, lora)

    def trace(self, model: Any) -> Any:
        """The call the sharding rules trace."""
        if self.example_call is not None:
            return self.example_call(model)
        ids = jnp.zeros((1, 9), jnp.int32)
        return self.loss_fn(model, {"input_ids": ids}, jax.random.key(0))


def _not_head(path: str, linear: Any) -> bool:
    del linear
    return path.split(".")[-1] != "lm_head"


def with_lora(make: Callable[[PRNGKeyArray], Any], lora: LoRA) -> Callable[[PRNGKeyArray], Any]:
    """`make` with `rc.lora.apply` on its model (quantized first with `lora.quantize`);
    works under `eqx.filter_eval_shape`."""
    from ..lora._layers import apply
    from ..quant import quantize

    def made(key: PRNGKeyArray) -> Any:
        model_key, lora_key = jax.random.split(key)
        model = make(model_key)
        if lora.quantize is not None:
            model = quantize(model, _not_head, lora.quantize)
        targets = _not_head if lora.targets is None else list(lora.targets)
        return apply(model, targets, rank=lora.rank, key=lora_key)

    return made


def _lora_arrays(
    abstract: PyTree, params: PyTree, lora: LoRA | None
) -> tuple[PyTree, PyTree, PyTree | None]:
    """For the arrays `params` of the model `abstract`: (`params` with frozen leaves in
    `lora.frozen_dtype`, the trainable ones, the step's trainable mask or `None`)."""
    if lora is None:
        return params, params, None
    from ..lora._layers import trainable

    mask = trainable(abstract)
    on_params = jax.tree.map(
        lambda m, x: m if isinstance(x, jax.ShapeDtypeStruct) else None, mask, abstract
    )

    def store(x: Any, trains: bool) -> Any:
        if trains or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jax.ShapeDtypeStruct(x.shape, jnp.dtype(lora.frozen_dtype), sharding=x.sharding)

    return jax.tree.map(store, params, on_params), eqx.filter(params, on_params), mask


def _abstract(tree: PyTree, shardings: PyTree, dtype: Any = None) -> PyTree:
    def one(leaf: Any, sharding: Any) -> Any:
        d = leaf.dtype if dtype is None or not jnp.issubdtype(leaf.dtype, jnp.floating) else dtype
        return jax.ShapeDtypeStruct(leaf.shape, d, sharding=sharding)

    return jax.tree.map(one, tree, shardings)


def _n_params(model: PyTree) -> int:
    """The model's parameters, a quantized Linear counting the weight it stands for."""
    weights, _ = stand_ins(model)
    leaves = jax.tree_util.tree_leaves(weights)
    return sum(math.prod(x.shape) for x in leaves if hasattr(x, "shape"))


def _is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def local_bytes(tree: PyTree) -> int:
    """Bytes of one device's shards of the abstract arrays of `tree`."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def plan_specs(abstract: Any, layout: Layout, model: PlannedModel) -> ShardingPlan:
    n_data = layout.devices // layout.n_model_shards
    return sharding_plan(
        abstract,
        layout.n_model_shards,
        example_call=model.trace,
        fsdp=n_data if layout.fsdp else 1,
    )


def placed_params(
    model: PlannedModel,
    key: PRNGKeyArray,
    layout: Layout,
    mesh: Mesh,
    lora: LoRA | None,
) -> tuple[PyTree, PyTree, PyTree, PyTree | None]:
    """The model's arrays, abstract and placed by the sharding plan: (the arrays in the
    dtypes they are stored in, the rest of the model, the trainable arrays, the step's
    trainable mask or `None`)."""
    abstract = eqx.filter_eval_shape(model.factory(layout.remat, lora), key)
    specs = plan_specs(abstract, layout, model).specs
    shardings = sharding_tree(abstract, mesh, specs)
    arrays, static = eqx.partition(abstract, _is_abstract)
    master = jnp.bfloat16 if layout.precision == "pure-bf16" else None
    placed = eqx.combine(_abstract(arrays, shardings, master), static)
    params, static = eqx.partition(placed, _is_abstract)
    params, trained, mask = _lora_arrays(placed, params, lora)
    return params, static, trained, mask


def _placed_opt_state(
    optimizer: optax.GradientTransformation, trained: PyTree, params: PyTree, mesh: Mesh
) -> PyTree:
    """The optimizer state of `trained`, abstract, each moment split as its parameter."""
    state = jax.eval_shape(optimizer.init, trained)
    flat_params = leaves_with_paths(params)
    flat_state, state_def = jax.tree_util.tree_flatten_with_path(state)
    state_specs = optimizer_specs(
        [(path_str(p), x) for p, x in flat_state],
        flat_params,
        {k: x.sharding.spec for k, x in flat_params},
    )
    return jax.tree_util.tree_unflatten(
        state_def,
        [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, state_specs[k]))
            for k, x in ((path_str(p), x) for p, x in flat_state)
        ],
    )


@dataclasses.dataclass(frozen=True)
class Measured:
    """What one compile of the step says, per device unless named otherwise.

    Attributes:
        n_params: parameters of the model (all devices).
        params, opt_state, gradients: bytes of each on one device.
        temporaries: XLA's temporary bytes (gradients, activations, workspace).
        peak: arguments + temporaries + outputs that do not reuse donated inputs.
        seconds: time to lower and compile.
        flops: the step's FLOPs on all devices, a scanned layer counted as often as it
            runs, recomputation included (counted on the traced program: every
            matmul and einsum).
        bytes_accessed: bytes one device reads and writes: the compiler's count, each
            loop's body multiplied out as often as it runs (`_hlo.loop_factor`).
        collective_bytes: bytes collectives produce on one device, loops counted.
        cpu_copies: bytes that float32 copies of bfloat16 weights and activations add,
            which only XLA:CPU makes (0 on other compilers; `cpu_float32_copies`).
        tokens: tokens of the global batch.
        refused: the compiler's message when it refused the step as larger than
            the device (the TPU compiler does); `temporaries` is then its figure.
        loop_flops, loop_bytes, loop_collective_bytes: FLOPs (all devices), bytes
            and collectives' bytes (one device) of one run of the loops whose trip
            count the program does not fix (sampling's decode loop, which stops when
            every row has ended), counted once in `flops`, `bytes_accessed` and
            `collective_bytes`; 0 for a program without.
    """

    n_params: int
    params: int
    opt_state: int
    gradients: int
    temporaries: int
    peak: int
    seconds: float
    flops: float
    tokens: int
    bytes_accessed: float
    collective_bytes: int
    cpu_copies: int
    refused: str | None = None
    loop_flops: float = 0.0
    loop_bytes: float = 0.0
    loop_collective_bytes: int = 0

    def traffic(self, *, gpu: bool) -> float:
        """Bytes one device moves: the compiler's count; for a GPU, whose program is
        not XLA:CPU's (bfloat16 computed in float32, fewer fusions), what any program
        must move: every argument read and every output and temporary written and
        read once, without the CPU's float32 copies."""
        if not gpu:
            return self.bytes_accessed
        return float(self.peak + self.temporaries - 2 * self.cpu_copies)


def _loss_and_batch(
    model: PlannedModel, layout: Layout, mesh: Mesh, lora: LoRA | None
) -> tuple[Callable[..., Any], dict[str, Any], int, dict[str, Any]]:
    """The step's loss, its abstract batch, the tokens one step trains on, and the
    step's options these imply (context parallelism)."""
    options: dict[str, Any] = {}
    n_data = layout.devices // layout.n_model_shards
    if layout.context_parallel:
        # Whole rows on every device, as `fit` gives them, split inside the step; the
        # model reads `seq_len` tokens either way.
        rows, tokens, spec = layout.per_device_batch_size, layout.seq_len, P()
        options["context_parallel"] = ContextParallel(mesh)
        loss = model.whole_rows_loss
    else:
        rows, tokens, spec = layout.per_device_batch_size * n_data, layout.seq_len + 1, P(DATA)
        loss = model.loss_fn
    batch = {
        "input_ids": jax.ShapeDtypeStruct(
            (rows, tokens), jnp.int32, sharding=NamedSharding(mesh, spec)
        )
    }
    trained = rows * layout.seq_len
    if layout.preference is not None:
        loss, batch = _preference(layout.preference, lora, rows, layout.seq_len, mesh)
        trained *= 2  # both answers of each pair
    if layout.rl is not None:
        loss, batch = _rl_batch(layout.rl, rows, layout.seq_len, mesh)
        trained = math.prod(batch["input_ids"].shape)  # every completion with its prompt
    return loss, batch, trained, options


def trace_step(
    model: PlannedModel,
    layout: Layout,
    lora: LoRA | None = None,
    devices: list[Any] | None = None,
) -> tuple[jax.stages.Traced, dict[str, Any], list[Any]]:
    """The step `compile_step` measures, traced on abstract shapes and not yet compiled.

    Args: as `compile_step`'s.

    Returns:
        `(traced, common, devices)`: the traced step (`.lower().compile()` compiles what
        `fit` would run), what is known of it before compiling (parameters, bytes of
        the parameters, optimizer state and gradients per device, FLOPs, tokens, and
        under `batch` the bytes of one device's batch), and the devices it is for.
    """
    from ..train.step import train_step

    devices = list(jax.devices()[: layout.devices] if devices is None else devices)
    mesh = make_mesh(layout.n_model_shards, devices=devices)
    key = jax.random.key(0)
    params, static, trained, mask = placed_params(model, key, layout, mesh, lora)
    optimizer = optax.adamw(1e-4)
    state = _placed_opt_state(optimizer, trained, params, mesh)
    loss, batch, tokens, options = _loss_and_batch(model, layout, mesh, lora)
    if layout.precision != "fp32":
        options["precision"] = layout.precision
    if mask is not None:
        options["trainable"] = mask
    # The step reads how the abstract model is split (FSDP, sequence parallelism) from
    # the arrays' shardings, as it reads it from real ones when it is jitted itself.
    parallelism = Parallelism.of(
        eqx.combine(params, static),
        sequence_parallel=layout.sequence_parallel,
        context_parallel=options.pop("context_parallel", False),
    )
    step = train_step(loss, optimizer, mesh=mesh, jit=False, parallelism=parallelism, **options)

    def run(p: Any, s: Any, b: Any, k: Any) -> Any:
        model, s, metrics = step(eqx.combine(p, static), s, b, k)
        return eqx.filter(model, eqx.is_array), s, metrics

    key_shape = jax.eval_shape(lambda: key)
    # Traced once: the jaxpr counts the FLOPs, its lowering is compiled.
    traced = jax.jit(run, donate_argnums=(0, 1)).trace(params, state, batch, key_shape)
    common = {
        "n_params": _n_params(eqx.combine(params, static)),
        "params": local_bytes(params),
        "opt_state": local_bytes(state),
        "gradients": local_bytes(trained),  # one gradient per trainable parameter
        "flops": matmul_flops(traced.jaxpr)[0],
        "tokens": tokens,
        "batch": local_bytes(batch),
    }
    return traced, common, devices


def compile_step(
    model: PlannedModel,
    layout: Layout,
    lora: LoRA | None = None,
    devices: list[Any] | None = None,
) -> Measured:
    """Build, lower and compile the step of `model` under `layout` and measure it.

    Args:
        model: what to plan.
        layout: how the step is laid out.
        lora: LoRA's settings, or None.
        devices: the devices to compile for (a TPU topology's, say); default this
            process's first `layout.devices`.
    """
    start = time.perf_counter()
    traced, common, devices = trace_step(model, layout, lora, devices)
    return compile_traced(traced, common, start=start, on_cpu=devices[0].platform == "cpu")


def compile_traced(
    traced: jax.stages.Traced,
    common: dict[str, Any],
    *,
    start: float,
    on_cpu: bool,
    open_loop: bool = False,
) -> Measured:
    """Lower and compile a traced program and measure it (`seconds` since `start`).

    Args:
        traced: the program, traced on abstract arguments.
        common: what is known of it before compiling, as `trace_step` gives it: its
            `batch` (the bytes of its inputs besides parameters and optimizer state)
            counts among the arguments of a program the compiler refuses.
        start: when its tracing began.
        on_cpu: compiled by XLA:CPU, whose float32 copies are counted.
        open_loop: the program has a loop whose trip count it does not fix (sampling's
            decode loop): measure one run of it too (`Measured.loop_bytes`).
    """
    common = dict(common)
    inputs = common.pop("batch")
    try:
        compiled = traced.lower().compile()
    except jax.errors.JaxRuntimeError as err:
        # The TPU compiler refuses a program larger than the chip, saying by how much.
        temp = _refused_temporaries(str(err))
        if temp is None:
            raise
        arguments = common["params"] + common["opt_state"] + inputs
        return Measured(
            **common,
            temporaries=temp,
            peak=arguments + temp,
            seconds=time.perf_counter() - start,
            bytes_accessed=0.0,
            collective_bytes=0,
            cpu_copies=0,
            refused=str(err).split("\n")[0],
        )
    seconds = time.perf_counter() - start
    return _measured(compiled, common, seconds, on_cpu=on_cpu, open_loop=open_loop)


def _measured(
    compiled: Any, common: dict[str, Any], seconds: float, *, on_cpu: bool, open_loop: bool
) -> Measured:
    """`Measured` from a compiled program (`common` as `trace_step` gives it, less its
    `batch`): its memory, bytes, collectives and copies (and one run of its open loop's)."""
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(f"XLA gave no memory analysis for {jax.default_backend()}.")
    temp = int(stats.temp_size_in_bytes)
    outputs = int(stats.output_size_in_bytes) - int(stats.alias_size_in_bytes)
    text = compiled.as_text() or ""
    counted = float(_cost_analysis(compiled).get("bytes accessed", 0.0))
    once = loop_factor(text)
    loop: dict[str, Any] = {}
    if open_loop:
        loop["loop_bytes"] = counted * (loop_factor(text, unbounded=2) - once)
        loop["loop_collective_bytes"] = collective_bytes(text, unbounded=2) - collective_bytes(text)
    return Measured(
        **common,
        temporaries=temp,
        peak=int(stats.argument_size_in_bytes) + temp + max(outputs, 0),
        seconds=seconds,
        bytes_accessed=counted * once,
        collective_bytes=collective_bytes(text),
        cpu_copies=cpu_float32_copies(text) if on_cpu else 0,
        **loop,
    )


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _refused_temporaries(message: str) -> int | None:
    """The temporaries the TPU compiler says a program larger than its chip needs:
    `... required for HLO temporaries (16.20G) exceeds available HBM (15.75G)` or
    `HLO temp 63.79G`; None for any other error."""
    found = re.search(r"HLO temp(?:oraries \(|\s+)([\d.]+)([KMGT])", message)
    if "RESOURCE_EXHAUSTED" not in message or found is None:
        return None
    return int(float(found[1]) * _UNITS[found[2]])


def _preference(
    kind: str, lora: LoRA | None, rows: int, seq_len: int, mesh: Mesh
) -> tuple[LossFn, dict[str, jax.ShapeDtypeStruct]]:
    """The preference loss `fit` would run, and a batch of `rows` pairs for it: both
    answers of each pair, and for DPO without adapters the reference's precomputed
    log-probabilities (`rc.preference.precompute_reference`)."""
    from ..train import preference

    rows_split = NamedSharding(mesh, P(DATA))
    batch = {
        f"{answer}_{field}": jax.ShapeDtypeStruct((rows, seq_len), dtype, sharding=rows_split)
        for answer in ("chosen", "rejected")
        for field, dtype in (("ids", jnp.int32), ("mask", jnp.bool_))
    }
    if kind == "dpo":
        reference = "lora" if lora is not None else "precomputed"
        if lora is None:
            for answer in ("chosen", "rejected"):
                batch[f"ref_{answer}_logp"] = jax.ShapeDtypeStruct(
                    (rows,), jnp.float32, sharding=rows_split
                )
        return functools.partial(preference.dpo_loss, reference=reference), batch
    losses = {"simpo": preference.simpo_loss, "orpo": preference.orpo_loss}
    return losses[kind], batch


def grpo(rl: RL) -> Any:
    """The `rc.rl.GRPO` settings an RL plan's step runs: `rl`'s, TRL's defaults otherwise."""
    from ..rl import GRPO

    return GRPO(num_generations=rl.num_generations, max_new_tokens=rl.max_new_tokens, beta=rl.beta)


def _rl_batch(
    rl: RL, prompts: int, prompt_len: int, mesh: Mesh
) -> tuple[LossFn, dict[str, jax.ShapeDtypeStruct]]:
    """The loss `rc.rl.train` runs, and the batch its rollout makes of `prompts` prompts
    of `prompt_len` tokens (`rc.rl.GroupRollout.example`): a row per completion, the
    prompt and `max_new_tokens`, with its mask, advantage and token count, and the
    reference's log-probabilities under a KL penalty."""
    algorithm = grpo(rl)
    rows, seq = prompts * rl.num_generations, prompt_len + rl.max_new_tokens
    shapes = {
        "input_ids": ((rows, seq), jnp.int32),
        "completion_mask": ((rows, seq), jnp.bool_),
        "advantages": ((rows,), jnp.float32),
        "tokens_per_row": ((rows,), jnp.float32),
    }
    if algorithm.needs_reference:
        shapes["ref_logps"] = ((rows, seq), jnp.float32)
    split = NamedSharding(mesh, P(DATA))
    batch = {k: jax.ShapeDtypeStruct(*shape, sharding=split) for k, shape in shapes.items()}
    return algorithm.loss_fn(), batch


def _cost_analysis(compiled: Any) -> dict[str, Any]:
    """The compiler's cost analysis as one dict (JAX versions return a dict or a list)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    return dict(cost or {})
