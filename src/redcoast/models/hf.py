"""Hugging Face checkpoints in and out: config.json + safetensors <-> Equinox models.

A `transformers` `save_pretrained` folder holds `config.json` and either
`model.safetensors` or shards listed in `model.safetensors.index.json`. Each
architecture describes how its arrays map to the checkpoint's tensors with a list
of `TensorMap`s; this module does the rest for all of them:

- `load` (behind `from_hf`, whose options are `LoadOptions`) builds the model's
  skeleton with `eqx.filter_eval_shape` (no memory), then reads, converts, checks
  and places one array at a time, straight onto a mesh when one is given, so host
  memory is bounded by the largest array and no device ever holds more than its
  own slices.
- `save` writes a folder that `transformers.AutoModelForCausalLM.from_pretrained`
  loads.

The configs live in `_hf_config.py`, the tensor maps in `_tensor_maps.py`, and
reading a folder's tensors by name in `_hf_folder.py`; this module re-exports
their public names.
"""

import abc
import dataclasses
import functools
import json
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypedDict, TypeVar, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import PyTree
from safetensors.numpy import save_file

from .._tree_paths import array_leaves, leaves_with_paths, path_str
from ..distributed._host import to_host
from ..nn import AbstractQuantized
from ..parallel._placement import check_specs, host_to_mesh, specs_by_path
from ..parallel.mesh import DATA, MODEL
from ..parallel.sharding import sharding_plan
from ..quant import check_format, quantized_weight
from ._hf_config import HFConfig as HFConfig
from ._hf_config import read_config as read_config
from ._hf_folder import INDEX as INDEX
from ._hf_folder import SAFETENSORS as SAFETENSORS
from ._hf_folder import MissingTensorError as MissingTensorError
from ._hf_folder import SavedTensors as SavedTensors
from ._tensor_maps import TensorMap as TensorMap
from ._tensor_maps import conv1d as conv1d
from ._tensor_maps import experts as experts
from ._tensor_maps import fused_conv1d as fused_conv1d
from ._tensor_maps import fused_qkv as fused_qkv
from ._tensor_maps import same as same
from ._tensor_maps import split_rows as split_rows
from ._tensor_maps import vocab_rows as vocab_rows

# One tensor of the checkpoint in one array of the model: (map, layer, expert, which of
# the map's arrays).
Piece = tuple[TensorMap, int | None, int | None, int]

# The token ids a zoo model's `trace_call` runs on: a constant from outside the
# trace, which the sharding rules take for data.
TRACE_IDS = np.zeros((8,), np.int32)


# --------------------------------------------------------------------------- reading


def _layer_count(model: Any, stack: str = "blocks") -> tuple[int, bool]:
    """How many layers the field `stack` holds, and whether they are stacked (scanned).

    A dotted `stack` names a field of a part (`encoder.blocks`, a ViT's in a
    vision encoder-decoder)."""
    blocks = functools.reduce(getattr, stack.split("."), model)
    if isinstance(blocks, tuple):
        return len(blocks), False
    leaf = jax.tree_util.tree_leaves(blocks)[0]
    return int(leaf.shape[0]), True


def _sources(
    maps: list[TensorMap], layers: Mapping[str, tuple[int, bool]]
) -> dict[str, list[Piece]]:
    """Our leaf path -> the (map, layer, expert, position in map.ours) pieces it is made of.

    A stacked leaf (scanned layers) is made of one piece per layer, a leaf of experts
    of one per expert (per layer and expert, for stacked layers), in that order.
    """
    out: dict[str, list[Piece]] = {}
    for m in maps:
        n_layers, stacked = layers.get(m.stack, (0, False))
        experts: list[int | None] = list(range(m.n_experts)) if m.n_experts else [None]
        for j, ours in enumerate(m.ours):
            if not m.per_layer:
                out[ours] = [(m, None, e, j) for e in experts]
            elif stacked:
                out[f"{m.stack}.{ours}"] = [(m, i, e, j) for i in range(n_layers) for e in experts]
            else:
                for i in range(n_layers):
                    out[f"{m.stack}.{i}.{ours}"] = [(m, i, e, j) for e in experts]
    return out


def _shardings(
    cls: Any, skeleton: PyTree, mesh: Mesh, specs: PyTree | None, fsdp: bool
) -> dict[str, NamedSharding]:
    """Our leaf path -> where it goes; specs are derived by the rules when not given."""
    if specs is None:
        specs = sharding_plan(
            skeleton,
            int(mesh.shape[MODEL]),
            example_call=cls.trace_call,
            fsdp=int(mesh.shape[DATA]) if fsdp else 1,
        ).specs
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
            "(e.g. from rc.sharding_plan on a model built from the same config and "
            "scan_layers), or specs=None to derive them with the rules."
        )
    check_specs(((path, shape, given[path]) for path, shape in shapes.items()), mesh)
    return {path: NamedSharding(mesh, given[path]) for path in shapes}


class LoadOptions(TypedDict, total=False):
    """The options of loading a `transformers` folder, all keywords and all optional.

    `rc.models.from_hf`, `HFModel.from_hf` (`rc.models.Llama.from_hf`, ...) and
    `load` take them alike.

    Attributes:
        mesh: from `rc.make_mesh`; each array is placed straight onto it as it is
            read. Default: none, arrays go to the default device.
        specs: a `PartitionSpec` tree (or `ShardingPlan`) for this model, built with
            the same `scan_layers`. Default: with a mesh, the sharding rules derive
            them from an abstract trace.
        fsdp: with the derived specs, split the weights over the data axis too
            (`rc.sharding_plan`'s `fsdp`, ZeRO-3): each device reads only its shard.
            Default: False.
        dtype: cast floating arrays to this dtype (e.g. `jnp.bfloat16`). Default: as
            stored.
        scan_layers: stack the layers' arrays and run them with `lax.scan`. Default:
            False.
        vocab_multiple: pad the token table and head with rows up to a multiple of
            this (Megatron-LM's `128 * n_model_shards`), so the vocabulary splits
            evenly over the model axis; the padded logits are masked and `to_hf`
            writes the original rows. Default: 1.
        remat: the layers' rematerialisation policy, `"none"`, `"dots"`,
            `"attention"` or `"full"`. Default: `"none"`.
        quantize: `"nf4"` or `"int8"`: every Linear of the layers (not the head)
            becomes a frozen quantized Linear (`rc.quantize`), each weight quantized
            as it is read, so the full-precision weights never sit in memory together.
            Default: None, as stored.
    """

    mesh: Mesh | None
    specs: PyTree | None
    fsdp: bool
    dtype: DTypeLike | None
    scan_layers: bool
    vocab_multiple: int
    remat: str
    quantize: str | None


def check_load_options(options: Mapping[str, Any]) -> None:
    """Raise a `TypeError` for a keyword that `LoadOptions` does not name."""
    unknown = sorted(set(options) - LoadOptions.__optional_keys__)
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {unknown} for loading a transformers folder; "
            f"the options are {sorted(LoadOptions.__optional_keys__)} (see LoadOptions)."
        )


_HFModel = TypeVar("_HFModel", bound="HFModel")


class HFModel(eqx.Module):
    """A zoo model that loads from and saves to `transformers` folders.

    The decoders (`AbstractCausalLM`) and encoder-decoders (`AbstractSeq2SeqLM`)
    derive from it; each architecture says how its arrays map to the checkpoint's
    tensors (`hf_tensors`) and gives its `config_class`.
    """

    # Checkpoint tensors that store a copy of another, the copy's name -> the
    # original's (a tied head's `lm_head.weight` -> the token table): not read while
    # the model ties them, and compared with the original on loading (`stored_config`).
    tied_hf_tensors: ClassVar[Mapping[str, str]] = {}
    # (prefix, another prefix a checkpoint may store the same tensors under): names that
    # releases of transformers spell differently, read either way, written the first.
    hf_aliases: ClassVar[tuple[tuple[str, str], ...]] = ()
    # (checkpoint prefix, module prefix): where transformers' class holds a tensor when
    # that differs from the name it saves it under (see `hf_module`).
    hf_modules: ClassVar[tuple[tuple[str, str], ...]] = ()

    @classmethod
    def hf_module(cls, name: str) -> str:
        """The dotted path of the module holding the checkpoint's tensor `name` in
        `transformers`' class: what PEFT names an adapter after. The name itself,
        except where transformers renames on loading (a LLaVA's `language_model.model.`
        is `model.language_model.`).

        Example:
            >>> Llava.hf_module("language_model.model.layers.0.self_attn.q_proj.weight")
            'model.language_model.layers.0.self_attn.q_proj.weight'
        """
        for saved, held in cls.hf_modules:
            if name.startswith(saved):
                return held + name[len(saved) :]
        return name

    @classmethod
    @abc.abstractmethod
    def hf_tensors(cls, config: Any) -> list[TensorMap]:
        """How this architecture's arrays map to a `transformers` checkpoint's tensors."""

    @classmethod
    def tied_copies(cls, config: Any) -> Mapping[str, str]:
        """The tied copies a checkpoint of `config` may store, copy -> original:
        `tied_hf_tensors`, or those of a part (a vision-language model's decoder)."""
        del config
        return cls.tied_hf_tensors

    @classmethod
    def untied(cls, config: Any) -> Any | None:
        """`config` with an array of its own for each tied copy (`tied_hf_tensors`), for a
        checkpoint that stores the copies with other values; `None` (the default) where
        the architecture has one array for both."""
        del config
        return None

    @classmethod
    def stored_config(cls, config: Any, checkpoint: SavedTensors) -> Any:
        """`config`, read from config.json, made to describe what the checkpoint stores.

        A tied copy (`tied_hf_tensors`) stored with values other than its original's
        (both compared as saved) is the model's own weight, as `transformers` takes
        it: the model is loaded `untied`, with a warning, or refused where the
        architecture cannot hold it. Architectures with parts a checkpoint may leave
        out (ViT's pooler) extend this.

        Raises:
            ValueError: a copy differs from its original and the architecture has one
                array for both.
        """
        differing = _differing_copies(cls, config, checkpoint)
        if not differing:
            return config
        untied = cls.untied(config)
        ties = " and ".join(f"{copy!r} to {original!r}" for copy, original in differing.items())
        held = set() if untied is None else {m.hf for m in cls.hf_tensors(untied)}
        if not held >= differing.keys():
            raise ValueError(
                f"config.json in {checkpoint.folder} ties {ties}, but the checkpoint stores "
                f"them with different values, and {cls.__name__} has one array for both: "
                "loading would drop the stored copy, a model redcoast cannot represent. "
                "Make each copy equal to its original, or leave it out of the checkpoint "
                "(as save_pretrained writes a tied model)."
            )
        warnings.warn(
            f"config.json in {checkpoint.folder} ties {ties} (tie_word_embeddings), but the "
            f"checkpoint stores them with different values: {cls.__name__} is loaded untied, "
            "each a weight of its own, as transformers does, and to_hf writes it untied. "
            'Set "tie_word_embeddings": false in config.json to load it without this warning.',
            UserWarning,
            stacklevel=2,
        )
        return untied

    @classmethod
    def from_hf(cls: type[_HFModel], path: str | Path, **options: Unpack[LoadOptions]) -> _HFModel:
        """Load a `transformers` `save_pretrained` folder (config.json + safetensors).

        Arrays are read, converted (GPT-2's `(in, out)` Conv1D weights transposed, its
        fused Q/K/V split, as the architecture's `hf_tensors` says) and checked one at
        a time. With a `mesh`, each is placed straight onto it with its
        `PartitionSpec`, each device receiving only its slice, so the whole model
        never sits on one device.

        Args:
            path: the folder; `model.safetensors`, or shards listed in
                `model.safetensors.index.json`.
            **options: `mesh`, `specs`, `fsdp`, `dtype`, `scan_layers`,
                `vocab_multiple`, `remat` and `quantize`, each a keyword (see `LoadOptions`).

        Returns:
            The model.

        Raises:
            ValueError: config.json describes another architecture or an unsupported
                variant, a tensor's shape does not match config.json, or the checkpoint
                stores a tied copy with values of its own that the architecture cannot
                hold (see `stored_config`).
            MissingTensorError: a tensor the model needs is not in the checkpoint.
            TypeError: an option that `LoadOptions` does not name.

        Warns:
            UserWarning: config.json ties the head, but the checkpoint stores one of its
                own: the model is loaded untied, as `transformers` loads it.

        Example:
            >>> model = rc.models.Llama.from_hf("tiny-llama", mesh=rc.make_mesh(2))
        """
        return load(cls, path, **options)

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


def load(cls: Any, path: str | Path, **options: Unpack[LoadOptions]) -> Any:
    """Read a `save_pretrained` folder into a model of class `cls` (see `HFModel.from_hf`)."""
    check_load_options(options)
    mesh, specs, fsdp = options.get("mesh"), options.get("specs"), options.get("fsdp", False)
    dtype, remat = options.get("dtype"), options.get("remat", "none")
    scan_layers = options.get("scan_layers", False)
    vocab_multiple = options.get("vocab_multiple", 1)
    quantize = options.get("quantize")
    if quantize is not None:
        check_format(quantize)
    folder = Path(path)
    values = read_config(folder)
    _check_model_type(values, cls, folder)
    config = dataclasses.replace(cls.config_class.from_dict(values), vocab_multiple=vocab_multiple)
    if hasattr(config, "vocab_size"):  # a ViT has no vocabulary
        config.padded_vocab_size  # noqa: B018 - checks vocab_multiple before anything is read
    checkpoint = SavedTensors(folder, cls.hf_base_prefix, cls.hf_aliases)
    config = cls.stored_config(config, checkpoint)
    skeleton = eqx.filter_eval_shape(
        cls, config, scan_layers=scan_layers, remat=remat, key=jax.random.key(0)
    )
    flat, treedef = jax.tree_util.tree_flatten_with_path(skeleton)
    maps = cls.hf_tensors(config)
    layers = {m.stack: _layer_count(skeleton, m.stack) for m in maps if m.per_layer}
    sources = _sources(maps, layers)
    shardings = {} if mesh is None else _shardings(cls, skeleton, mesh, specs, fsdp)
    quantized = _layer_linears(skeleton, sources) if quantize is not None else set()

    leaves = []
    for kp, leaf in flat:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            leaves.append(leaf)
            continue
        name = path_str(kp)
        pieces = sources.get(name)
        if pieces is None:
            raise AssertionError(f"{cls.__name__}.hf_tensors does not say where {name} comes from")
        stacked = pieces[0][1] is not None and layers[pieces[0][0].stack][1]
        host = _read_array(checkpoint, pieces, name, leaf, stacked, cls, folder)
        if dtype is not None and jnp.issubdtype(host.dtype, jnp.floating):
            host = host.astype(dtype)
        sharding = shardings.get(name)
        if name in quantized:
            leaves.append(_quantized(host, quantize or "", name, sharding))
            continue
        leaves.append(jnp.asarray(host) if sharding is None else host_to_mesh(host, sharding))
    _check_unused(checkpoint, cls, folder)
    return _with_biases(jax.tree_util.tree_unflatten(treedef, leaves))


def _layer_linears(skeleton: PyTree, sources: Mapping[str, list[Piece]]) -> set[str]:
    """The weight paths of the Linears inside the layers (read per layer), to quantize."""
    linears = leaves_with_paths(skeleton, lambda x: isinstance(x, eqx.nn.Linear))
    weights = {f"{path}.weight" for path, x in linears if isinstance(x, eqx.nn.Linear)}
    return {w for w in weights if w in sources and sources[w][0][1] is not None}


def _quantized(
    host: np.ndarray, format: str, name: str, sharding: NamedSharding | None
) -> AbstractQuantized:
    """The weight `name` quantized (without its bias, attached by `_with_biases`), its
    arrays placed as the weight's sharding says."""
    layer = quantized_weight(host, format, path=name.removesuffix(".weight"))
    if sharding is None:
        return layer
    none = lambda x: x is None  # noqa: E731
    linear = eqx.tree_at(
        lambda m: (m.weight, m.bias), layer.stand_in(), (sharding.spec, None), is_leaf=none
    )
    specs, _ = layer.specs_from(linear, dict(sharding.mesh.shape))
    return jax.tree.map(
        lambda a, spec: host_to_mesh(np.asarray(a), NamedSharding(sharding.mesh, spec)),
        layer,
        specs,
    )


def _is_quantized(x: Any) -> bool:
    return isinstance(x, AbstractQuantized)


def _with_biases(model: PyTree) -> PyTree:
    """Each Linear whose weight was quantized replaced by its quantized Linear, bias kept."""

    def swap(x: Any) -> Any:
        if isinstance(x, eqx.nn.Linear) and isinstance(x.weight, AbstractQuantized):
            return eqx.tree_at(lambda q: q.bias, x.weight, x.bias, is_leaf=lambda b: b is None)
        return x

    return jax.tree.map(swap, model, is_leaf=lambda x: isinstance(x, eqx.nn.Linear))


def _read_array(
    checkpoint: SavedTensors,
    pieces: list[Piece],
    name: str,
    leaf: jax.ShapeDtypeStruct,
    stacked: bool,
    cls: Any,
    folder: Path,
) -> np.ndarray:
    """The array `name` on the host: its pieces read, converted, checked and stacked
    (on the layer axis of stacked layers, then on the expert axis)."""
    n_experts = pieces[0][0].n_experts
    leading = int(stacked) + int(n_experts > 0)
    want = tuple(leaf.shape[leading:])
    parts = []
    for m, layer, expert, j in pieces:
        hf_name = m.name(layer, expert)
        tensor = checkpoint.get(hf_name, name)
        converted = _convert(m, tensor, hf_name, name, want)[j]
        if tuple(converted.shape) != want:
            raise ValueError(
                f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, but config.json "
                f"implies {name} of shape {tuple(leaf.shape)} (each piece {want}); the "
                "checkpoint was saved with a different config."
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
    if leading == 0:
        return parts[0]
    return np.stack(parts).reshape(leaf.shape[:leading] + want)


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


# What some transformers versions save next to the weights and no model reads: buffers
# (GPT-2's attention masks, rotary frequencies) and T5's cross-attention position bias.
_UNREAD = re.compile(
    r"(\.attn\.(masked_)?bias|\.rotary_emb\.inv_freq"
    r"|^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight)$"
)


def _differing_copies(cls: Any, config: Any, checkpoint: SavedTensors) -> dict[str, str]:
    """The tied copies the checkpoint stores that `config`'s model does not read, whose
    values differ from their originals' (copy -> original). Reading marks each copy
    used: one equal to its original is accounted for, not an unused tensor."""
    read = {m.hf for m in cls.hf_tensors(config)}
    return {
        copy: original
        for copy, original in cls.tied_copies(config).items()
        if copy not in read
        and copy in checkpoint
        and original in checkpoint
        and not np.array_equal(
            checkpoint.get(copy, f"comparing with {original}"),
            checkpoint.get(original, f"comparing with {copy}"),
        )
    }


def _check_unused(checkpoint: SavedTensors, cls: Any, folder: Path) -> None:
    unused = sorted(
        k for k in checkpoint.where if k not in checkpoint.used and not _UNREAD.search(k)
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
    quantized = [
        p for p, x in leaves_with_paths(model, _is_quantized) if isinstance(x, AbstractQuantized)
    ]
    if quantized:
        raise ValueError(
            f"{quantized[:4]}{' ...' if len(quantized) > 4 else ''} are quantized; a transformers "
            "folder holds float weights. Decode them first: rc.quant.dequantize(model), or "
            "rc.lora.merge(model) for adapters on a quantized base."
        )
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
            if not m.n_experts:
                tensors[m.name(layer)] = np.ascontiguousarray(m.to_hf(parts))
                continue
            for e in range(m.n_experts):
                tensors[m.name(layer, e)] = np.ascontiguousarray(
                    m.to_hf(tuple(p[e] for p in parts))
                )
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
