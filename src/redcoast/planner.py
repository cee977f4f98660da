"""Will it fit? The real train step, compiled on abstract shapes, measured by XLA.

`plan` builds a zoo model's AdamW train step exactly as `fit` runs it -- the
sharding plan (tensor parallelism, FSDP), the precision and remat policies, the
global batch split over the data axis -- on `jax.ShapeDtypeStruct`s, so nothing
is allocated, compiles it for the requested devices, and reads per-device bytes
from `compiled.memory_analysis()`. Parameters and optimizer state come from the
shardings (exact); gradients are one copy of the parameters in the master dtype;
temporaries (gradients, activations, workspace) and the peak come from XLA.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PRNGKeyArray, PyTree

from ._placement import optimizer_specs, sharding_tree
from ._sharding_plan import ShardingPlan
from ._tree_paths import leaves_with_paths, path_str
from .fsdp import record_layout
from .mesh import DATA, make_mesh
from .models import ARCHITECTURES, AbstractSeq2SeqLM
from .models.hf import HFConfig, read_config
from .models.presets import PRESETS, preset
from .sharding import sharding_plan

PRECISIONS = ("fp32", "bf16", "pure-bf16")
REMATS = ("none", "dots", "full")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str | int) -> int:
    """`"32GB"` -> 32e9, `"40GiB"` -> 40 * 2**30, `"512B"` -> 512; ints are bytes already.

    A string needs its unit: `"40"` is refused, since whether 40 bytes or 40 GB was
    meant cannot be known, and 40 bytes would make every layout fail.

    Raises:
        ValueError: not a number followed by a unit (B, KB, MB, GB, TB, KiB..TiB).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"device memory {text!r} is not a size; write a number and a unit, e.g. 32GB, "
            "40GiB or 16000000000B."
        )
    if not unit:
        raise ValueError(
            f"device memory {text!r} has no unit; write {match.group(1)}GB, "
            f"{match.group(1)}GiB, or {match.group(1)}B if bytes are meant."
        )
    return int(float(match.group(1)) * _UNITS[unit])


def fmt_bytes(n: int | float) -> str:
    """Bytes in GB (10**9) with one decimal, or MB below 1 GB."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a train step is laid out over devices, and run.

    Attributes:
        devices: all devices of all hosts.
        n_model_shards: the size of the model axis (tensor parallelism).
        fsdp: split weights, gradients and optimizer state over the data axis too.
        precision: `"fp32"`, `"bf16"` (fp32 master weights, bf16 compute) or
            `"pure-bf16"`.
        remat: the zoo's per-block policy, `"none"`, `"dots"` or `"full"`.
        per_device_batch_size: sequences per data-parallel device.
        seq_len: tokens per sequence.
    """

    devices: int
    n_model_shards: int = 1
    fsdp: bool = False
    precision: str = "fp32"
    remat: str = "none"
    per_device_batch_size: int = 1
    seq_len: int = 1024

    def __str__(self) -> str:
        parts = [f"TP {self.n_model_shards}"] if self.n_model_shards > 1 else []
        n_data = self.devices // self.n_model_shards
        parts.append(f"FSDP {n_data}" if self.fsdp else f"DP {n_data}")
        return (
            " x ".join(parts) + f", {self.precision}, remat {self.remat}, "
            f"batch {self.per_device_batch_size}/device"
        )


@dataclasses.dataclass(frozen=True)
class LoRA:
    """What a LoRA plan trains: rank-`rank` adapters on `targets`, the rest frozen.

    Attributes:
        rank: the adapters' rank.
        targets: globs over the Linears' paths (`rc.lora.apply`), or `None` for
            every Linear but the output head: each block's attention and MLP
            projections. PEFT's LLaMA default is q_proj and v_proj only (Hu et al.'s
            choice under a fixed parameter budget); QLoRA (Dettmers et al. 2023)
            found adapters on every linear layer needed to match full fine-tuning.
            On LLaMA-7B at rank 8 that is 20.0M trainable parameters against 4.2M.
        frozen_dtype: the dtype frozen weights are stored in; bfloat16 by default,
            since they get no gradient or update and only have to be read.
    """

    rank: int
    targets: tuple[str, ...] | None = None
    frozen_dtype: str = "bfloat16"

    def describe(self) -> str:
        """`LoRA rank 8 on q_proj, v_proj, frozen weights bfloat16` and the like."""
        where = (
            "the attention and MLP projections (every Linear but the head)"
            if self.targets is None
            else ", ".join(self.targets)
        )
        return f"LoRA rank {self.rank} on {where}, frozen weights {self.frozen_dtype}"


_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
_DTYPES |= {"fp16": "float16", "float16": "float16"}


def _lora_settings(
    rank: int, targets: str | tuple[str, ...] | list[str] | None, frozen_dtype: Any
) -> LoRA | None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"lora_rank must be an int >= 0 (0: no LoRA), got {rank!r}.")
    if rank == 0:
        if targets is not None or frozen_dtype is not None:
            raise ValueError("lora_targets and frozen_dtype need lora_rank > 0.")
        return None
    if isinstance(targets, str):
        targets = tuple(t.strip() for t in targets.split(",") if t.strip())
    if frozen_dtype is None or isinstance(frozen_dtype, str):
        name = _DTYPES.get((frozen_dtype or "bf16").lower(), "")
    else:
        name = str(jnp.dtype(frozen_dtype).name)
    if name not in _DTYPES.values():
        raise ValueError(
            f"frozen_dtype {frozen_dtype!r}: choose bf16, fp16 or fp32 (or a jnp dtype of those)."
        )
    return LoRA(rank, None if targets is None else tuple(targets), name)


def _not_head(path: str, linear: Any) -> bool:
    del linear
    return path.split(".")[-1] != "lm_head"


def _with_lora(make: Callable[[PRNGKeyArray], Any], lora: LoRA) -> Callable[[PRNGKeyArray], Any]:
    """`make` with `rc.lora.apply` on its model; works under `eqx.filter_eval_shape`."""
    from ._lora import apply

    def made(key: PRNGKeyArray) -> Any:
        model_key, lora_key = jax.random.split(key)
        targets = _not_head if lora.targets is None else list(lora.targets)
        return apply(make(model_key), targets, rank=lora.rank, key=lora_key)

    return made


def _lora_arrays(
    abstract: PyTree, params: PyTree, lora: LoRA | None
) -> tuple[PyTree, PyTree, PyTree | None]:
    """For the arrays `params` of the model `abstract`: (`params` with frozen leaves in
    `lora.frozen_dtype`, the trainable ones, the step's trainable mask or `None`)."""
    if lora is None:
        return params, params, None
    from ._lora import trainable

    mask = trainable(abstract)
    on_params = jax.tree.map(
        lambda m, x: m if isinstance(x, jax.ShapeDtypeStruct) else None, mask, abstract
    )

    def store(x: Any, trains: bool) -> Any:
        if trains or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jax.ShapeDtypeStruct(x.shape, jnp.dtype(lora.frozen_dtype), sharding=x.sharding)

    return jax.tree.map(store, params, on_params), eqx.filter(params, on_params), mask


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one compiled train step, and the verdict.

    Attributes:
        model: what was planned.
        n_params: parameters of the model.
        layout: the layout compiled.
        params: bytes of parameters per device.
        opt_state: bytes of optimizer state per device.
        gradients: bytes of gradients per device (one copy of the parameters in the
            master dtype, split as they are; part of `temporaries`).
        temporaries: XLA's temporary bytes (gradients, activations, workspace).
        peak: arguments + temporaries + outputs that do not reuse donated inputs: the
            step as `fit(..., donate=True)` runs it (see `peak_keeping_model`).
        device_memory: the budget, or `None`.
        max_batch: the largest per-device batch that fits, when asked and known.
        compile_seconds: time to compile the step.
        tried: other layouts compiled on the way (`--search`), with their peaks.
        lora: the LoRA settings of a LoRA plan, else `None`.
        n_trainable: parameters that train (all of them without LoRA).
    """

    model: str
    n_params: int
    layout: Layout
    params: int
    opt_state: int
    gradients: int
    temporaries: int
    peak: int
    device_memory: int | None
    max_batch: int | None = None
    compile_seconds: float = 0.0
    tried: tuple[tuple[str, int | None], ...] = ()
    lora: LoRA | None = None
    n_trainable: int | None = None

    @property
    def activations(self) -> int:
        """Temporaries other than the gradients: activations and workspace."""
        return max(self.temporaries - self.gradients, 0)

    @property
    def fits(self) -> bool | None:
        """Whether the peak is within `device_memory` (`None` without a budget)."""
        return None if self.device_memory is None else self.peak <= self.device_memory

    @property
    def peak_keeping_model(self) -> int:
        """The peak of `rc.fit` without `donate=True`, which keeps the model it was
        given valid: one more copy of the parameters beside the step's `peak`."""
        return self.peak + self.params

    def _verdict(self, peak: int) -> str:
        if self.device_memory is None:
            return ""
        return ", fits" if peak <= self.device_memory else ", does not fit"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary of every figure."""
        out = dataclasses.asdict(self)
        out["layout"] = dataclasses.asdict(self.layout)
        out["activations"] = self.activations
        out["fits"] = self.fits
        out["peak_keeping_model"] = self.peak_keeping_model
        return out

    def _lora_lines(self) -> list[str]:
        if self.lora is None:
            return []
        trained = self.n_trainable or 0
        return [
            f"{self.lora.describe()}: {trained:,} trainable parameters "
            f"({100 * trained / self.n_params:.2f}%); gradients and optimizer state for them only"
        ]

    def __str__(self) -> str:
        verdict = {None: "", True: "fits", False: "does not fit"}[self.fits]
        budget = "" if self.device_memory is None else f" of {fmt_bytes(self.device_memory)}"
        lines = [
            f"{self.model}: {self.n_params / 1e9:.2f}B parameters, {self.layout.seq_len} tokens, "
            f"{self.layout.devices} devices",
            f"layout: {self.layout}",
            *self._lora_lines(),
            f"per device: parameters {fmt_bytes(self.params)}, optimizer state "
            f"{fmt_bytes(self.opt_state)}, gradients {fmt_bytes(self.gradients)}, "
            f"activations and workspace {fmt_bytes(self.activations)}",
            f"peak: {fmt_bytes(self.peak)}{budget}" + (f": {verdict}" if verdict else ""),
            f"rc.fit hands the model over with donate=True and runs at this peak; without it "
            f"fit keeps the model given valid: {fmt_bytes(self.peak_keeping_model)}"
            + self._verdict(self.peak_keeping_model),
        ]
        if self.max_batch is not None:
            lines.append(f"largest per-device batch that fits: {self.max_batch}")
        if self.tried:
            lines.append(
                "tried: "
                + "; ".join(
                    f"{layout}: {'skipped, parameters alone exceed' if p is None else fmt_bytes(p)}"
                    for layout, p in self.tried
                )
            )
        lines.append(f"compiled in {self.compile_seconds:.1f} s")
        return "\n".join(lines)


# --------------------------------------------------------------------------- models


def _resolve(model: str | HFConfig) -> tuple[str, type[Any], HFConfig]:
    """A preset name, a config.json (or its folder), or a config -> (name, class, config)."""
    if isinstance(model, HFConfig):
        return type(model).__name__, _class_of(model.model_type), model
    if model in PRESETS:
        cls, config = preset(model)
        return model, cls, config
    path = Path(model)
    if path.is_file() or (path / "config.json").is_file():
        folder = path if path.is_dir() else path.parent
        values = read_config(folder if path.is_dir() else path)
        cls = _class_of(values.get("model_type"))
        return str(model), cls, cls.config_class.from_dict(values)
    raise ValueError(
        f"unknown model {model!r}: not a preset ({', '.join(PRESETS)}) and not a config.json."
    )


def _class_of(model_type: Any) -> type[Any]:
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"model_type {model_type!r} is not in the zoo; supported: {sorted(ARCHITECTURES)}."
        )
    return ARCHITECTURES[model_type]


def _heads(config: HFConfig) -> int | None:
    for name in ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _factory(cls: type[Any], config: HFConfig, remat: str) -> Callable[[PRNGKeyArray], Any]:
    options: dict[str, Any] = {"scan_layers": True}
    if remat != "none":
        options["remat"] = remat
    return lambda key: cls(config, key=key, **options)


# --------------------------------------------------------------------------- the step


def _loss(model: Any, batch: dict[str, jax.Array], key: jax.Array) -> jax.Array:
    del key
    ids = batch["input_ids"]
    if isinstance(model, AbstractSeq2SeqLM):
        # Source and target of the same length: the sequence and itself shifted.
        logits = jax.vmap(lambda s, d: model(s, d))(ids[:, :-1], ids[:, :-1])
    else:
        logits = jax.vmap(model)(ids[:, :-1])
    labels = ids[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels
    ).mean()


def _abstract(tree: PyTree, shardings: PyTree, dtype: Any = None) -> PyTree:
    def one(leaf: Any, sharding: Any) -> Any:
        d = leaf.dtype if dtype is None or not jnp.issubdtype(leaf.dtype, jnp.floating) else dtype
        return jax.ShapeDtypeStruct(leaf.shape, d, sharding=sharding)

    return jax.tree.map(one, tree, shardings)


def _is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _local_bytes(tree: PyTree) -> int:
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def _plan_specs(abstract: Any, layout: Layout) -> ShardingPlan:
    n_data = layout.devices // layout.n_model_shards
    return sharding_plan(
        abstract,
        layout.n_model_shards,
        example_call=getattr(type(abstract), "trace_call", None),
        fsdp=n_data if layout.fsdp else 1,
    )


def sharding_plan_of(
    model: str | HFConfig, layout: Layout, lora: LoRA | None = None
) -> ShardingPlan:
    """The `ShardingPlan` `plan` uses for a preset or config under `layout` (with the
    adapters of `lora`, a `MemoryPlan.lora`)."""
    _, cls, config = _resolve(model)
    make = _factory(cls, config, layout.remat)
    abstract = eqx.filter_eval_shape(
        make if lora is None else _with_lora(make, lora), jax.random.key(0)
    )
    return _plan_specs(abstract, layout)


def _compile(
    make: Callable[[PRNGKeyArray], Any], layout: Layout, lora: LoRA | None = None
) -> tuple[int, int, int, int, int, int, float]:
    """(n_params, params, opt_state, gradients, temporaries, peak, seconds) per device."""
    from .step import train_step

    devices = jax.devices()[: layout.devices]
    mesh = make_mesh(layout.n_model_shards, devices=devices)
    n_data = layout.devices // layout.n_model_shards
    key = jax.random.key(0)
    abstract = eqx.filter_eval_shape(make, key)
    specs = _plan_specs(abstract, layout).specs
    shardings = sharding_tree(abstract, mesh, specs)
    arrays, static = eqx.partition(abstract, _is_abstract)
    master = jnp.bfloat16 if layout.precision == "pure-bf16" else None
    # The model records its FSDP layout from the abstract arrays' shardings, as
    # `rc.place` does from real ones, so the step gathers as `fit`'s does.
    placed = record_layout(eqx.combine(_abstract(arrays, shardings, master), static))
    params, static = eqx.partition(placed, _is_abstract)
    params, trained, mask = _lora_arrays(placed, params, lora)
    optimizer = optax.adamw(1e-4)
    state = jax.eval_shape(optimizer.init, trained)
    flat_params = leaves_with_paths(params)
    flat_state, state_def = jax.tree_util.tree_flatten_with_path(state)
    state_specs = optimizer_specs(
        [(path_str(p), x) for p, x in flat_state],
        flat_params,
        {k: x.sharding.spec for k, x in flat_params},
    )
    state = jax.tree_util.tree_unflatten(
        state_def,
        [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, state_specs[k]))
            for k, x in ((path_str(p), x) for p, x in flat_state)
        ],
    )
    batch = {
        "input_ids": jax.ShapeDtypeStruct(
            (layout.per_device_batch_size * n_data, layout.seq_len + 1),
            jnp.int32,
            sharding=NamedSharding(mesh, P(DATA)),
        )
    }
    options: dict[str, Any] = {}
    if layout.precision != "fp32":
        options["precision"] = layout.precision
    if mask is not None:
        options["trainable"] = mask
    step = train_step(_loss, optimizer, mesh=mesh, jit=False, **options)

    def run(p: Any, s: Any, b: Any, k: Any) -> Any:
        model, s, metrics = step(eqx.combine(p, static), s, b, k)
        return eqx.filter(model, eqx.is_array), s, metrics

    key_shape = jax.eval_shape(lambda: key)
    start = time.perf_counter()
    lowered = jax.jit(run, donate_argnums=(0, 1)).lower(params, state, batch, key_shape)
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(f"XLA gave no memory analysis for {jax.default_backend()}.")
    param_bytes = _local_bytes(params)
    state_bytes = _local_bytes(state)
    n_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))
    grads = _local_bytes(trained)  # one gradient per trainable parameter, in its dtype
    temp = int(stats.temp_size_in_bytes)
    outputs = int(stats.output_size_in_bytes) - int(stats.alias_size_in_bytes)
    peak = int(stats.argument_size_in_bytes) + temp + max(outputs, 0)
    return n_params, param_bytes, state_bytes, grads, temp, peak, seconds


# --------------------------------------------------------------------------- planning


def _check_layout(layout: Layout, config: HFConfig | None) -> None:
    if layout.precision not in PRECISIONS:
        raise ValueError(f"precision {layout.precision!r}: choose one of {PRECISIONS}.")
    if layout.remat not in REMATS:
        raise ValueError(f"remat {layout.remat!r}: choose one of {REMATS}.")
    for name in ("devices", "n_model_shards", "per_device_batch_size", "seq_len"):
        value = getattr(layout, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    if layout.devices % layout.n_model_shards:
        raise ValueError(
            f"{layout.n_model_shards} model shards do not divide {layout.devices} devices."
        )
    heads = None if config is None else _heads(config)
    if heads is not None and heads % layout.n_model_shards:
        raise ValueError(
            f"{layout.n_model_shards} model shards do not divide the model's {heads} attention "
            f"heads; choose a divisor of {heads}."
        )
    positions = None if config is None else getattr(config, "max_position_embeddings", None)
    positions = positions or (None if config is None else getattr(config, "n_positions", None))
    if isinstance(positions, int) and layout.seq_len > positions:
        raise ValueError(
            f"seq_len {layout.seq_len} is longer than the model's {positions} positions."
        )
    if jax.device_count() < layout.devices:
        raise ValueError(
            f"planning for {layout.devices} devices needs {layout.devices} devices to compile "
            f"for; this process has {jax.device_count()}. Simulate them with "
            f'jax.config.update("jax_num_cpu_devices", {layout.devices}) before JAX starts, '
            "or run `redcoast plan`, which does."
        )


def _measure(
    name: str,
    make: Callable[[PRNGKeyArray], Any],
    layout: Layout,
    device_memory: int | None,
    lora: LoRA | None = None,
) -> MemoryPlan:
    n_params, params, state, grads, temp, peak, seconds = _compile(make, layout, lora)
    n_trainable = n_params
    if lora is not None:
        from ._lora import trainable

        abstract = eqx.filter_eval_shape(make, jax.random.key(0))
        kept = eqx.filter(abstract, trainable(abstract))
        n_trainable = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(kept))
    return MemoryPlan(
        name,
        n_params,
        layout,
        params,
        state,
        grads,
        temp,
        peak,
        device_memory,
        None,
        seconds,
        lora=lora,
        n_trainable=n_trainable,
    )


def _max_batch(
    name: str, make: Callable[[PRNGKeyArray], Any], first: MemoryPlan, budget: int
) -> int | None:
    """The largest per-device batch whose peak fits: linear in the batch, then checked."""
    b = first.layout.per_device_batch_size
    if first.peak > budget:
        return None
    second = _measure(
        name, make, dataclasses.replace(first.layout, per_device_batch_size=2 * b), None, first.lora
    )
    slope = (second.peak - first.peak) / b
    if slope <= 0:
        return None
    guess = b + int((budget - first.peak) // slope)
    for _ in range(4):
        if guess <= b:
            return b
        layout = dataclasses.replace(first.layout, per_device_batch_size=guess)
        peak = _measure(name, make, layout, None, first.lora).peak
        if peak <= budget:
            return guess
        guess = b + int((guess - b) * budget / peak) - 1
    return b


def _candidates(layout: Layout, config: HFConfig | None) -> Iterator[Layout]:
    """Layouts cheapest first: no remat before dots before full; fewer model shards first
    (tensor parallelism moves activations in every layer); without FSDP before with."""
    heads = None if config is None else _heads(config)
    shards = [
        t
        for t in range(1, min(layout.devices, 8) + 1)
        if layout.devices % t == 0 and (heads is None or heads % t == 0)
    ]
    for remat in REMATS:
        for t in shards:
            for split in (False, True):
                yield dataclasses.replace(layout, n_model_shards=t, fsdp=split, remat=remat)


def _floor(n_params: int, layout: Layout, lora: LoRA | None = None) -> float:
    """Parameters + AdamW state + gradients per device if perfectly divided (with LoRA,
    the frozen parameters alone)."""
    master = 2 if layout.precision == "pure-bf16" else 4
    if lora is not None:
        master = jnp.dtype(lora.frozen_dtype).itemsize / 4
    ways = layout.devices if layout.fsdp else layout.n_model_shards
    return n_params * (4 * master) / ways


def plan(
    model: str | HFConfig | Callable[[PRNGKeyArray], Any],
    *,
    devices: int,
    n_model_shards: int = 1,
    fsdp: bool = False,
    seq_len: int = 1024,
    per_device_batch_size: int = 1,
    precision: str = "fp32",
    remat: str = "none",
    device_memory: int | str | None = None,
    search: bool = False,
    max_batch: bool = True,
    lora_rank: int = 0,
    lora_targets: str | list[str] | tuple[str, ...] | None = None,
    frozen_dtype: Any = None,
) -> MemoryPlan:
    """Compile the AdamW train step for `devices` devices on abstract shapes and measure it.

    Args:
        model: a preset name (`"llama-7b"`, see `redcoast.models.presets.PRESETS`), a
            `config.json` path (or its folder), a zoo config, or a factory
            `key -> causal LM` (it then decides its own remat).
        devices: how many devices; this process must have that many (simulate them
            on a CPU with `jax_num_cpu_devices`; `redcoast plan` does).
        n_model_shards: the model axis size (tensor parallelism).
        fsdp: split weights, gradients and optimizer state over the data axis too.
        seq_len: tokens per sequence.
        per_device_batch_size: sequences per data-parallel device.
        precision: `"fp32"`, `"bf16"` or `"pure-bf16"`.
        remat: `"none"`, `"dots"` or `"full"` (zoo models).
        device_memory: memory per device to judge fit: a string with its unit
            (`"32GB"`, `"40GiB"`; a bare `"40"` is refused) or an int of bytes.
        search: find the cheapest layout that fits `device_memory` instead (see
            `_candidates` for the order); the given layout is the first tried.
        max_batch: with `device_memory`, also find the largest per-device batch that
            fits (two or three more compiles).
        lora_rank: above 0, plan LoRA fine-tuning: `rc.lora.apply` with this rank,
            and a step with `trainable=rc.lora.trainable(model)`, so frozen weights
            get no gradient and no optimizer state.
        lora_targets: globs (or one comma-separated string) over the Linears' paths
            to adapt; by default every Linear but the output head, i.e. each
            block's attention and MLP projections (see `LoRA`).
        frozen_dtype: the dtype of frozen weights with LoRA, `"bf16"` (the default),
            `"fp16"` or `"fp32"`.

    Returns:
        A `MemoryPlan`; `str()` is a readable report, `.to_dict()` JSON.

    Raises:
        ValueError: an unknown model, or a layout that cannot work (shards that do
            not divide the devices or the heads, too few devices, bad names); the
            message says which and what would.

    Example:
        >>> print(rc.plan("llama-7b", devices=4, n_model_shards=4, seq_len=1024,
        ...               remat="full", device_memory="40GB"))
    """
    budget = None if device_memory is None else parse_bytes(device_memory)
    lora = _lora_settings(lora_rank, lora_targets, frozen_dtype)
    layout = Layout(devices, n_model_shards, fsdp, precision, remat, per_device_batch_size, seq_len)
    if callable(model) and not isinstance(model, str | HFConfig):
        if remat != "none" or search:
            raise ValueError(
                "a model factory decides its own remat; pass a preset or config to plan "
                "remat or to search layouts."
            )
        name, config, make_for = "model", None, (lambda _r, f=model: f)
    else:
        name, cls, config = _resolve(model)
        make_for = lambda r: _factory(cls, config, r)  # noqa: E731
    if lora is not None:
        plain = make_for
        make_for = lambda r: _with_lora(plain(r), lora)  # noqa: E731
    _check_layout(layout, config)
    if search:
        if budget is None:
            raise ValueError("search needs device_memory, the budget a layout must fit in.")
        result = _search(name, make_for, layout, config, budget, lora)
    else:
        result = _measure(name, make_for(remat), layout, budget, lora)
    if max_batch and budget is not None and result.fits:
        found = _max_batch(name, make_for(result.layout.remat), result, budget)
        result = dataclasses.replace(result, max_batch=found)
    return result


def _search(
    name: str,
    make_for: Callable[[str], Callable[[PRNGKeyArray], Any]],
    layout: Layout,
    config: HFConfig | None,
    budget: int,
    lora: LoRA | None = None,
) -> MemoryPlan:
    tried: list[tuple[str, int | None]] = []
    abstract = eqx.filter_eval_shape(make_for("none"), jax.random.key(0))
    arrays = eqx.filter(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    n_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(arrays))
    last: MemoryPlan | None = None
    for candidate in _candidates(layout, config):
        if _floor(n_params, candidate, lora) > budget:
            tried.append((str(candidate), None))
            continue
        last = _measure(name, make_for(candidate.remat), candidate, budget, lora)
        if last.fits:
            return dataclasses.replace(last, tried=tuple(tried))
        tried.append((str(candidate), last.peak))
    if last is None:
        # Arithmetic ruled out every layout; compile the most frugal one to show by how much.
        frugal = list(_candidates(layout, config))[-1]
        tried.pop()
        last = _measure(name, make_for(frugal.remat), frugal, budget, lora)
    return dataclasses.replace(last, tried=tuple(tried))
