"""Hugging Face checkpoints in and out: config.json + safetensors <-> Equinox models.

A `transformers` `save_pretrained` folder holds `config.json` and either
`model.safetensors` or shards listed in `model.safetensors.index.json`. Each
architecture describes how its arrays map to the checkpoint's tensors with a list
of `TensorMap`s; this module does the rest for all of them:

- `load` builds the model's skeleton with `eqx.filter_eval_shape` (no memory),
  then reads, converts, checks and places one array at a time, straight onto a
  mesh when one is given, so host memory is bounded by the largest array and no
  device ever holds more than its own slices.
- `save` writes a folder that `transformers.AutoModelForCausalLM.from_pretrained`
  loads.
"""

import dataclasses
import functools
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import PyTree
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from .._placement import check_specs, host_to_mesh, specs_by_path
from .._tree_paths import array_leaves, leaves_with_paths, path_str
from ..data import to_host
from ..fsdp import record_layout
from ..mesh import DATA, MODEL
from ..sharding import sharding_rules

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"

# The token ids a zoo model's `trace_call` runs on: a constant from outside the
# trace, which the sharding rules take for data.
TRACE_IDS = np.zeros((8,), np.int32)


class MissingTensorError(KeyError):
    """A tensor the model needs is not in the checkpoint."""

    def __str__(self) -> str:
        # KeyError's own __str__ shows the repr of the message, quotes and escapes included.
        return str(self.args[0])


# --------------------------------------------------------------------------- configs

# A TypeVar rather than typing.Self, which beartype rejects on undecorated classes.
_Config = TypeVar("_Config", bound="HFConfig")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFConfig:
    """Base of the architectures' configs: fields named as in Hugging Face's config.json.

    Keys the dataclass does not name (token ids, dropout rates, `transformers_version`,
    ...) are kept in `extra` as JSON text, so that `to_dict` gives back what
    `from_dict` read; keeping them as text keeps the config hashable, which it must
    be as static data of a model.

    Every field is checked when a config is made, whether from code or from
    config.json: its value must have the field's type (`n_layer: "2"` and
    `n_head: 2.0` are errors), the architecture's `sizes` must be at least 1, and
    each pair of `divides` must divide evenly; the error names the field. An
    architecture's own `__post_init__` calls `super().__post_init__()` first.
    """

    model_type: ClassVar[str] = ""
    architecture: ClassVar[str] = ""
    # Fields that count something (layers, heads, features, positions): >= 1 when set.
    sizes: ClassVar[tuple[str, ...]] = ()
    # (heads, width) pairs: `width` must be a multiple of `heads`, as each head takes
    # an equal share of the features (transformers refuses other configs too).
    divides: ClassVar[tuple[tuple[str, str], ...]] = ()
    extra: tuple[tuple[str, str], ...] = ()
    # Not in config.json: the token table and head get rows up to a multiple of this
    # (Megatron-LM's make-vocab-size-divisible-by, 128 x model shards) so that the
    # vocabulary splits evenly; the padded logits are masked and `to_hf` drops the rows.
    vocab_multiple: int = 1

    def __post_init__(self) -> None:
        name = type(self).__name__
        hints = _field_types(type(self))
        for f in dataclasses.fields(self):
            if f.name in hints and f.name != "extra":
                _check_type(name, f.name, getattr(self, f.name), hints[f.name])
        for field in (*self.sizes, "vocab_multiple"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ValueError(
                    f"{name}: {field} must be at least 1, got {value}; fix it in config.json "
                    "(or where the config is built)."
                )
        for heads, width in self.divides:
            h, w = getattr(self, heads), getattr(self, width)
            if h is not None and w is not None and w % h:
                fits = [d for d in range(1, w + 1) if w % d == 0]
                raise ValueError(
                    f"{name}: {width}={w} is not a multiple of {heads}={h} ({w} / {h} = "
                    f"{w / h:.3g}), so the heads cannot share it equally; transformers cannot "
                    f"build this model either. Use a {heads} that divides {w} "
                    f"({', '.join(map(str, fits))}), or change {width}."
                )

    @property
    def padded_vocab_size(self) -> int:
        """`vocab_size` rounded up to a multiple of `vocab_multiple`."""
        vocab = int(getattr(self, "vocab_size"))  # noqa: B009 (each zoo config defines it)
        if self.vocab_multiple < 1:
            raise ValueError(f"vocab_multiple must be >= 1, got {self.vocab_multiple}.")
        return -(-vocab // self.vocab_multiple) * self.vocab_multiple

    @classmethod
    def from_dict(cls: type[_Config], values: Mapping[str, Any]) -> _Config:
        """A config from the parsed `config.json` of a `transformers` model.

        Args:
            values: the JSON object; keys this config does not name go to `extra`.

        Returns:
            The config.

        Raises:
            ValueError: if the config asks for a variant of the architecture that
                redcoast does not implement (the message names the key).

        Example:
            >>> GPT2Config.from_dict(json.load(open("gpt2/config.json"))).n_layer
            12
        """
        values = cls._normalise(dict(values))
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "vocab_multiple"}
        known = {k: v for k, v in values.items() if k in names}
        extra = tuple(
            sorted(
                (k, json.dumps(v))
                for k, v in values.items()
                if k not in names and k not in ("model_type", "architectures")
            )
        )
        return cls(**known, extra=extra)

    @classmethod
    def from_json(cls: type[_Config], path: str | Path) -> _Config:
        """A config from a `config.json` file, or the folder holding one."""
        return cls.from_dict(read_config(path))

    def to_dict(self) -> dict[str, Any]:
        """The `config.json` object `transformers` reads back into the same model."""
        out: dict[str, Any] = {k: json.loads(v) for k, v in self.extra}
        for f in dataclasses.fields(self):
            if f.name not in ("extra", "vocab_multiple"):
                out[f.name] = getattr(self, f.name)
        out["model_type"] = self.model_type
        out["architectures"] = [self.architecture]
        return dict(sorted(out.items()))

    @classmethod
    def _normalise(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Map other spellings of a key onto the field name (overridden per architecture)."""
        return values

    def get_extra(self, name: str, default: Any = None) -> Any:
        """A config.json value this config does not name as a field (e.g. `eos_token_id`)."""
        for k, v in self.extra:
            if k == name:
                return json.loads(v)
        return default

    def _require(self, **settings: tuple[Any, Any]) -> None:
        """Raise for each `name=(value, supported)` whose value is not the supported one."""
        for name, (got, want) in settings.items():
            if got != want:
                raise ValueError(
                    f"{type(self).__name__}: {name}={got!r} is not supported (only "
                    f"{name}={want!r}); this variant of {self.model_type} is not implemented."
                )


# A field's type -> the Python values that have it, and how an error calls it.
_TYPES: dict[Any, tuple[tuple[type, ...], str]] = {
    int: ((int,), "an int"),
    float: ((int, float), "a number"),
    bool: ((bool,), "true or false"),
    str: ((str,), "a string"),
}


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_type(config: str, field: str, value: Any, hint: Any) -> None:
    """Raise a `TypeError` naming `field` unless `value` has the type `hint` says."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = typing.get_args(hint) if union else (hint,)
    if value is None and type(None) in options:
        return
    wanted = [t for t in options if t in _TYPES]
    if not wanted:  # a type this check does not know (the extras, a tuple): not checked
        return
    for t in wanted:
        # bool is an int to Python; a JSON true where a count belongs is still an error.
        if isinstance(value, _TYPES[t][0]) and (t is bool or not isinstance(value, bool)):
            return
    names = [_TYPES[t][1] for t in wanted] + (["null"] if type(None) in options else [])
    quoted = " (without quotes)" if isinstance(value, str) else ""
    raise TypeError(
        f"{config}: {field} must be {' or '.join(names)}, got {value!r} "
        f"({type(value).__name__}); write it as such{quoted} in config.json, or where the "
        "config is built."
    )


def read_config(path: str | Path) -> dict[str, Any]:
    """Parse `config.json` from a checkpoint folder (or the file itself).

    Args:
        path: the folder written by `save_pretrained`, or its `config.json`.

    Returns:
        The JSON object.

    Raises:
        FileNotFoundError: there is no such file.
        ValueError: the file is not JSON, or holds something other than an object;
            the message names the file (and the line).
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"no config.json at {file}; pass the folder written by "
            "`transformers` `save_pretrained` (or by `model.to_hf`)."
        )
    with open(file) as f:
        try:
            values = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{file} is not valid JSON: {err.msg} at line {err.lineno}, column "
                f"{err.colno}. Repair it, or write it again with save_pretrained."
            ) from None
    if not isinstance(values, dict):
        raise ValueError(
            f"{file} holds a JSON {type(values).__name__}, not the object of settings a "
            'config.json holds ({"model_type": ..., ...}).'
        )
    return values


# --------------------------------------------------------------------------- tensor maps


def _one(x: np.ndarray) -> tuple[np.ndarray, ...]:
    return (x,)


def _first(xs: tuple[np.ndarray, ...]) -> np.ndarray:
    return xs[0]


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """How one checkpoint tensor becomes one or more arrays of the model, and back.

    Attributes:
        hf: the tensor's name in the checkpoint; `{i}` stands for the layer index.
        ours: dotted paths of the model's arrays it fills. In a per-layer map they are
            relative to one block (`attn.q_proj.weight`).
        to_ours: checkpoint tensor -> the arrays of `ours`, in order.
        to_hf: the arrays of `ours` -> the checkpoint tensor.
        stack: in a per-layer map, the model's field that holds the layers
            (`blocks`; an encoder-decoder has `encoder_blocks` and `decoder_blocks`).
    """

    hf: str
    ours: tuple[str, ...]
    to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]] = _one
    to_hf: Callable[[tuple[np.ndarray, ...]], np.ndarray] = _first
    stack: str = "blocks"

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


def same(hf: str, ours: str) -> TensorMap:
    """A tensor stored as the model stores it (PyTorch `nn.Linear` is `(out, in)` too)."""
    return TensorMap(hf, (ours,))


def _transpose(x: np.ndarray) -> tuple[np.ndarray, ...]:
    return (np.ascontiguousarray(x.T),)


def _transpose_back(xs: tuple[np.ndarray, ...]) -> np.ndarray:
    return np.ascontiguousarray(xs[0].T)


def conv1d(hf: str, ours: str) -> TensorMap:
    """GPT-2's `Conv1D` weight, stored `(in, out)`: transposed to Equinox's `(out, in)`."""
    return TensorMap(hf, (ours,), _transpose, _transpose_back)


def vocab_rows(hf: str, ours: str, config: HFConfig) -> TensorMap:
    """A tensor with a row per token: padded with zero rows up to the config's
    `padded_vocab_size` on loading, written back with `vocab_size` rows."""
    vocab, padded = int(getattr(config, "vocab_size")), config.padded_vocab_size  # noqa: B009

    def pad(x: np.ndarray) -> tuple[np.ndarray, ...]:
        if x.shape[0] != vocab:
            raise ValueError(f"expected {vocab} rows (vocab_size), got {x.shape[0]}")
        return (np.concatenate([x, np.zeros((padded - vocab, *x.shape[1:]), x.dtype)]),)

    def unpad(xs: tuple[np.ndarray, ...]) -> np.ndarray:
        return xs[0][:vocab]

    return TensorMap(hf, (ours,), pad, unpad)


def _split3_weight(x: np.ndarray) -> tuple[np.ndarray, ...]:
    if x.ndim != 2 or x.shape[1] % 3:
        raise ValueError(f"expected (in, 3 * out), got shape {x.shape}")
    return tuple(np.ascontiguousarray(p) for p in np.split(x.T, 3, axis=0))


def _join3_weight(xs: tuple[np.ndarray, ...]) -> np.ndarray:
    return np.ascontiguousarray(np.concatenate(xs, axis=0).T)


def _split3_bias(x: np.ndarray) -> tuple[np.ndarray, ...]:
    if x.ndim != 1 or x.shape[0] % 3:
        raise ValueError(f"expected (3 * out,), got shape {x.shape}")
    return tuple(np.ascontiguousarray(p) for p in np.split(x, 3, axis=0))


def _join3_bias(xs: tuple[np.ndarray, ...]) -> np.ndarray:
    return np.concatenate(xs, axis=0)


def fused_qkv(hf: str, q: str, k: str, v: str, *, bias: bool) -> TensorMap:
    """GPT-2's `c_attn`: Q, K and V in one Conv1D, split into three Linears.

    Separate projections are what the sharding rules recognise as attention, and
    they let each be split by heads on its own.
    """
    if bias:
        return TensorMap(hf, (q, k, v), _split3_bias, _join3_bias)
    return TensorMap(hf, (q, k, v), _split3_weight, _join3_weight)


# --------------------------------------------------------------------------- reading


class _Checkpoint:
    """The tensors of a save_pretrained folder, single file or sharded, read lazily.

    Checkpoints of the bare base model (`GPT2Model`, `OPTModel`, ...), such as the
    original GPT-2 and OPT releases, name their tensors without the base model's
    prefix (`h.0.ln_1.weight` for `transformer.h.0.ln_1.weight`); both are found.
    """

    def __init__(self, folder: Path, base_prefix: str):
        self.folder = folder
        self.base_prefix = base_prefix
        self.used: set[str] = set()
        self._open: dict[Path, Any] = {}
        single, index = folder / SAFETENSORS, folder / INDEX
        if single.is_file():
            self.where = dict.fromkeys(self._handle(single).keys(), single)
        elif index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.where = {str(k): folder / v for k, v in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise ValueError(
                    f"{index} is not a safetensors index ({type(err).__name__}: {err}); it "
                    'must be a JSON object with a "weight_map" of tensor name -> file. Write '
                    "the checkpoint again with save_pretrained."
                ) from None
        else:
            found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
            raise FileNotFoundError(
                f"{folder} has neither {SAFETENSORS} nor {INDEX} (found {found}); "
                "save the model with `save_pretrained(path)` (safetensors is the default)."
            )

    def get(self, name: str, needed_for: str) -> np.ndarray:
        bare = name.removeprefix(self.base_prefix)
        if name not in self.where and bare in self.where:
            name = bare
        self.used.add(name)
        file = self.where.get(name)
        if file is None:
            raise MissingTensorError(
                f"the checkpoint in {self.folder} has no tensor {name!r} (needed for "
                f"{needed_for}); config.json and the safetensors file do not match."
            )
        handle = self._handle(file)
        if name not in handle.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
            raise MissingTensorError(
                f"{file.name} has no tensor {name!r} although {INDEX} lists it there "
                f"(needed for {needed_for})."
            )
        try:
            return handle.get_tensor(name)
        except SafetensorError as err:
            raise ValueError(f"{file}: cannot read tensor {name!r} ({err}).") from None

    def _handle(self, file: Path) -> Any:
        """The open safetensors file, with errors that name it (a truncated copy, say)."""
        if file not in self._open:
            if not file.is_file():
                raise FileNotFoundError(
                    f"{file} is missing: the checkpoint in {self.folder} lists tensors there."
                )
            try:
                self._open[file] = safe_open(file, framework="numpy")
            except SafetensorError as err:
                raise ValueError(
                    f"{file} is not a complete safetensors file ({err}): it may be truncated "
                    "(an interrupted download or copy). Fetch or save it again."
                ) from None
        return self._open[file]


def _layer_count(model: Any, stack: str = "blocks") -> tuple[int, bool]:
    """How many layers the field `stack` holds, and whether they are stacked (scanned)."""
    blocks = getattr(model, stack)
    if isinstance(blocks, tuple):
        return len(blocks), False
    leaf = jax.tree_util.tree_leaves(blocks)[0]
    return int(leaf.shape[0]), True


def _sources(
    maps: list[TensorMap], layers: Mapping[str, tuple[int, bool]]
) -> dict[str, list[tuple[TensorMap, int | None, int]]]:
    """Our leaf path -> the (map, layer, position in map.ours) pieces it is made of.

    A stacked leaf (scanned layers) is made of one piece per layer.
    """
    out: dict[str, list[tuple[TensorMap, int | None, int]]] = {}
    for m in maps:
        n_layers, stacked = layers.get(m.stack, (0, False))
        for j, ours in enumerate(m.ours):
            if not m.per_layer:
                out[ours] = [(m, None, j)]
            elif stacked:
                out[f"{m.stack}.{ours}"] = [(m, i, j) for i in range(n_layers)]
            else:
                for i in range(n_layers):
                    out[f"{m.stack}.{i}.{ours}"] = [(m, i, j)]
    return out


def _shardings(
    cls: Any, skeleton: PyTree, mesh: Mesh, specs: PyTree | None, fsdp: bool
) -> dict[str, NamedSharding]:
    """Our leaf path -> where it goes; specs are derived by the rules when not given."""
    if specs is None:
        specs = sharding_rules(
            skeleton,
            int(mesh.shape[MODEL]),
            example_call=cls.trace_call,
            fsdp=int(mesh.shape[DATA]) if fsdp else 1,
        )
    shapes = {
        path: tuple(s.shape)
        for path, s in leaves_with_paths(skeleton)
        if isinstance(s, jax.ShapeDtypeStruct)
    }
    given = {path: s for path, s in specs_by_path(specs).items() if isinstance(s, P)}
    missing = [a for a in shapes if a not in given]
    if missing:
        raise ValueError(
            f"specs has no PartitionSpec for {missing[:5]}; pass the specs of this very model "
            "(e.g. from rc.sharding_rules on a model built from the same config and "
            "scan_layers), or specs=None to derive them with the rules."
        )
    check_specs(((path, shape, given[path]) for path, shape in shapes.items()), mesh)
    return {path: NamedSharding(mesh, given[path]) for path in shapes}


_HFModel = TypeVar("_HFModel", bound="HFModel")


class HFModel(eqx.Module):
    """A zoo model that loads from and saves to `transformers` folders.

    The decoders (`AbstractCausalLM`) and encoder-decoders (`AbstractSeq2SeqLM`)
    derive from it; each architecture says how its arrays map to the checkpoint's
    tensors (`hf_tensors`) and gives its `config_class`.
    """

    @classmethod
    def from_hf(
        cls: type[_HFModel],
        path: str | Path,
        *,
        mesh: Mesh | None = None,
        specs: PyTree | None = None,
        fsdp: bool = False,
        dtype: DTypeLike | None = None,
        scan_layers: bool = False,
        vocab_multiple: int = 1,
        remat: str = "none",
    ) -> _HFModel:
        """Load a `transformers` `save_pretrained` folder (config.json + safetensors).

        Arrays are read, converted (GPT-2's `(in, out)` Conv1D weights transposed, its
        fused Q/K/V split, as the architecture's `hf_tensors` says) and checked one at
        a time. With a `mesh`, each is placed
        straight onto it with its `PartitionSpec`, each device receiving only its
        slice, so the whole model never sits on one device.

        Args:
            path: the folder; `model.safetensors`, or shards listed in
                `model.safetensors.index.json`.
            mesh: from `rc.make_mesh`; without it arrays go to the default device.
            specs: a `PartitionSpec` tree (or `ShardingPlan`) for this model, built
                with the same `scan_layers`; when a mesh is given without specs, the
                sharding rules derive them from an abstract trace.
            fsdp: with the derived specs, split the weights over the data axis too
                (`rc.sharding_plan`'s `fsdp`): each device reads only its shard.
            dtype: cast floating arrays to this dtype; default: as stored.
            scan_layers: stack the layers' arrays and run them with `lax.scan`.
            vocab_multiple: pad the token table and head with rows up to a multiple of
                this (Megatron-LM's `128 * n_model_shards`), so the vocabulary splits
                evenly over the model axis; the padded logits are masked and `to_hf`
                writes the original rows.
            remat: the layers' rematerialisation policy (`"none"`, `"dots"`, `"full"`).

        Returns:
            The model.

        Raises:
            ValueError: config.json describes another architecture or an unsupported
                variant, or a tensor's shape does not match config.json.
            MissingTensorError: a tensor the model needs is not in the checkpoint.

        Example:
            >>> model = rc.models.Llama.from_hf("tiny-llama", mesh=rc.make_mesh(2))
        """
        return load(
            cls,
            path,
            mesh=mesh,
            specs=specs,
            fsdp=fsdp,
            dtype=dtype,
            scan_layers=scan_layers,
            vocab_multiple=vocab_multiple,
            remat=remat,
        )

    def to_hf(self, path: str | Path) -> None:
        """Write `config.json` and `model.safetensors` that `transformers` loads.

        With several processes every process must call it (split arrays are gathered);
        process 0 writes.

        Args:
            path: the folder to write (created if missing).

        Example:
            >>> model.to_hf("out")
            >>> transformers.AutoModel.from_pretrained("out")
        """
        save(self, path)


def load(
    cls: Any,
    path: str | Path,
    *,
    mesh: Mesh | None = None,
    specs: PyTree | None = None,
    fsdp: bool = False,
    dtype: DTypeLike | None = None,
    scan_layers: bool = False,
    vocab_multiple: int = 1,
    remat: str = "none",
) -> Any:
    """Read a `save_pretrained` folder into a model of class `cls` (see `from_hf`)."""
    folder = Path(path)
    values = read_config(folder)
    _check_model_type(values, cls, folder)
    config = dataclasses.replace(cls.config_class.from_dict(values), vocab_multiple=vocab_multiple)
    config.padded_vocab_size  # noqa: B018 - checks vocab_multiple before anything is read
    skeleton = eqx.filter_eval_shape(
        cls, config, scan_layers=scan_layers, remat=remat, key=jax.random.key(0)
    )
    flat, treedef = jax.tree_util.tree_flatten_with_path(skeleton)
    maps = cls.hf_tensors(config)
    layers = {m.stack: _layer_count(skeleton, m.stack) for m in maps if m.per_layer}
    sources = _sources(maps, layers)
    checkpoint = _Checkpoint(folder, cls.hf_base_prefix)
    shardings = {} if mesh is None else _shardings(cls, skeleton, mesh, specs, fsdp)

    leaves = []
    for kp, leaf in flat:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            leaves.append(leaf)
            continue
        name = path_str(kp)
        pieces = sources.get(name)
        if pieces is None:
            raise AssertionError(f"{cls.__name__}.hf_tensors does not say where {name} comes from")
        parts = []
        stacked = pieces[0][1] is not None and layers[pieces[0][0].stack][1]
        for m, layer, j in pieces:
            hf_name = m.hf if layer is None else m.hf.format(i=layer)
            tensor = checkpoint.get(hf_name, name)
            want = tuple(leaf.shape[1:] if stacked else leaf.shape)
            converted = _convert(m, tensor, hf_name, name, want)[j]
            if tuple(converted.shape) != want:
                raise ValueError(
                    f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, but config.json "
                    f"implies {name} of shape {want}; the checkpoint was saved with a "
                    "different config."
                )
            floats = jnp.issubdtype(converted.dtype, jnp.floating)
            if floats != jnp.issubdtype(leaf.dtype, jnp.floating):
                raise ValueError(
                    f"tensor {hf_name!r} of the checkpoint in {folder} is {converted.dtype}, "
                    f"but {cls.__name__}'s {name} is a {leaf.dtype} weight: loaded as it is, "
                    "training would never update it. The checkpoint does not hold this "
                    "architecture's weights; save the model's floating-point weights."
                )
            parts.append(converted)
        host = np.stack(parts) if stacked else parts[0]
        if dtype is not None and jnp.issubdtype(host.dtype, jnp.floating):
            host = host.astype(dtype)
        sharding = shardings.get(name)
        leaves.append(jnp.asarray(host) if sharding is None else host_to_mesh(host, sharding))
    _check_unused(checkpoint, cls, folder)
    return record_layout(jax.tree_util.tree_unflatten(treedef, leaves))


def _convert(
    m: TensorMap, tensor: np.ndarray, hf_name: str, ours: str, want: tuple[int, ...]
) -> tuple[np.ndarray, ...]:
    try:
        return m.to_ours(tensor)
    except ValueError as err:
        raise ValueError(
            f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, which cannot become {ours} "
            f"of shape {want} ({err}); the checkpoint was saved with a different config."
        ) from err


# Buffers some transformers versions save next to the weights; they hold no parameters.
_BUFFERS = re.compile(r"(\.attn\.(masked_)?bias|\.rotary_emb\.inv_freq)$")


def _check_unused(checkpoint: _Checkpoint, cls: Any, folder: Path) -> None:
    unused = sorted(
        k
        for k in checkpoint.where
        if k not in checkpoint.used and not _BUFFERS.search(k) and k not in cls.tied_hf_tensors
    )
    if unused:
        raise ValueError(
            f"the checkpoint in {folder} has tensors {cls.__name__} does not use: "
            f"{unused[:8]}{'...' if len(unused) > 8 else ''}; config.json (e.g. the number "
            "of layers or the tied head) does not describe these weights."
        )


def _check_model_type(values: Mapping[str, Any], cls: Any, folder: Path) -> None:
    got = values.get("model_type")
    want = cls.config_class.model_type
    if got != want:
        raise ValueError(
            f"config.json in {folder} describes model_type={got!r} "
            f"(architectures={values.get('architectures')}); {cls.__name__}.from_hf reads "
            f"model_type={want!r}. rc.models.from_hf picks the class from config.json."
        )


# --------------------------------------------------------------------------- writing


def save(model: Any, path: str | Path) -> None:
    """Write `model` as a folder `transformers` loads (see `to_hf`)."""
    folder = Path(path)
    arrays = dict(array_leaves(model))
    tensors: dict[str, np.ndarray] = {}
    for m in type(model).hf_tensors(model.config):
        n_layers, stacked = _layer_count(model, m.stack) if m.per_layer else (0, False)
        hosts = {}
        for ours in m.ours:
            if not m.per_layer:
                hosts[ours] = to_host(arrays[ours])
            elif stacked:
                hosts[ours] = to_host(arrays[f"{m.stack}.{ours}"])
        for layer in range(n_layers) if m.per_layer else [None]:
            if layer is None:
                parts = tuple(hosts[ours] for ours in m.ours)
            elif stacked:
                parts = tuple(hosts[ours][layer] for ours in m.ours)
            else:
                parts = tuple(to_host(arrays[f"{m.stack}.{layer}.{ours}"]) for ours in m.ours)
            name = m.hf if layer is None else m.hf.format(i=layer)
            tensors[name] = np.ascontiguousarray(m.to_hf(parts))
    values = model.config.to_dict()
    values.pop("torch_dtype", None)
    values["dtype"] = str(next(iter(tensors.values())).dtype)
    if jax.process_index() != 0:
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "config.json", "w") as f:
        json.dump(values, f, indent=2, sort_keys=True)
        f.write("\n")
    # transformers refuses safetensors files without this metadata.
    save_file(tensors, folder / SAFETENSORS, metadata={"format": "pt"})
