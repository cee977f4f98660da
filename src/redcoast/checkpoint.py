"""Checkpoints that any mesh can load and any safetensors reader can read.

A checkpoint is a folder:

    model.safetensors          (or model-00001-of-0000N.safetensors + model.safetensors.index.json)
    optimizer.safetensors      (same scheme; only when an optimizer state was saved)
    state.json                 step, the caller's extra values, each leaf's spec

Keys are dotted pytree paths (`blocks.0.attn.q_proj.weight`). Saving gathers one
leaf at a time and streams it into the file, so host memory stays near the size of
the largest leaf; the folder is written under a temporary name and renamed into
place when complete, so a crash never leaves a folder that looks valid. Loading
checks every file, key and shape first, then reads each leaf straight into its
place on the target mesh (only the slices each device needs).
"""

import dataclasses
import json
import math
import os
import shutil
import struct
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .data import to_host
from .sharding import path_str

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

FORMAT = "redcoast-checkpoint"
VERSION = 1
STATE = "state.json"
STEP_PREFIX = "step_"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

_DTYPES = {
    "F64": np.dtype("float64"),
    "F32": np.dtype("float32"),
    "F16": np.dtype("float16"),
    "BF16": np.dtype(jnp.bfloat16),
    "I64": np.dtype("int64"),
    "I32": np.dtype("int32"),
    "I16": np.dtype("int16"),
    "I8": np.dtype("int8"),
    "U64": np.dtype("uint64"),
    "U32": np.dtype("uint32"),
    "U16": np.dtype("uint16"),
    "U8": np.dtype("uint8"),
    "BOOL": np.dtype("bool"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded as asked: says which file and key."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What `load_checkpoint` returns.

    Attributes:
        model: the model with the saved arrays, placed as asked.
        opt_state: the optimizer state, or None when not asked for or not saved.
        step: the step it was saved at.
        state: everything in `state.json`, including the extra values given to
            `save_checkpoint`.
    """

    model: PyTree
    opt_state: PyTree | None
    step: int
    state: dict[str, Any]


# --------------------------------------------------------------------------- leaves


def _leaves(tree: PyTree) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))
    return [(path_str(p), leaf) for p, leaf in flat]


def _is_key(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _host(leaf: Any) -> np.ndarray:
    """The whole array on this host; every process must call this for every leaf."""
    return to_host(jax.random.key_data(leaf) if _is_key(leaf) else leaf)


def _spec_of(leaf: Any) -> list[Any] | None:
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return [list(e) if isinstance(e, tuple) else e for e in sharding.spec]
    return None


# --------------------------------------------------------------------------- writing


def _abstract(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    if _is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, leaf)
        return tuple(data.shape), np.dtype(data.dtype)
    return tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype)


def _plan_files(
    stem: str, leaves: list[tuple[str, Any]], max_bytes: int
) -> list[tuple[str, list[int]]]:
    """Group leaves (by index) into files of at most `max_bytes`, HF style names."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, (_, leaf) in enumerate(leaves):
        shape, dtype = _abstract(leaf)
        nbytes = math.prod(shape) * dtype.itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    if len(groups) == 1:
        return [(f"{stem}.safetensors", groups[0])]
    n = len(groups)
    return [(f"{stem}-{k + 1:05d}-of-{n:05d}.safetensors", g) for k, g in enumerate(groups)]


def _write_safetensors(
    path: Path, leaves: list[tuple[str, Any]], write: bool, metadata: Mapping[str, str]
) -> None:
    """Stream leaves into one safetensors file, gathering each just before it is written."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for key, leaf in leaves:
        shape, dtype = _abstract(leaf)
        if dtype not in _NAMES:
            raise CheckpointError(f"{key}: dtype {dtype} cannot be stored in safetensors.")
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {
            "dtype": _NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    handle = open(path, "wb") if write else None  # noqa: SIM115 - closed below
    try:
        if handle is not None:
            handle.write(struct.pack("<Q", len(raw)))
            handle.write(raw)
        for _, leaf in leaves:
            host = np.ascontiguousarray(_host(leaf))  # all processes gather
            if handle is not None:
                handle.write(host.tobytes(order="C"))
            del host
    finally:
        if handle is not None:
            handle.close()


def _write_group(
    folder: Path, stem: str, leaves: list[tuple[str, Any]], max_bytes: int, write: bool
) -> list[str]:
    files = _plan_files(stem, leaves, max_bytes)
    for name, indices in files:
        _write_safetensors(folder / name, [leaves[i] for i in indices], write, {"format": "np"})
    if len(files) > 1 and write:
        weight_map = {leaves[i][0]: name for name, indices in files for i in indices}
        total = sum(
            math.prod(_abstract(leaf)[0]) * _abstract(leaf)[1].itemsize for _, leaf in leaves
        )
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return [name for name, _ in files]


def _jsonable(value: Any, what: str) -> Any:
    if isinstance(value, np.generic | jax.Array) and np.ndim(value) == 0:
        return np.asarray(value).item()
    if isinstance(value, np.ndarray | jax.Array):
        return np.asarray(value).tolist()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, f"{what}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v, what) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(
        f"save_checkpoint: {what} is a {type(value).__name__}, which state.json cannot hold; "
        "pass numbers, strings, lists, dicts or arrays."
    )


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: PyTree,
    opt_state: PyTree | None = None,
    step: int,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    **extra: Any,
) -> Path:
    """Write a checkpoint folder atomically.

    Every process must call this (each leaf is gathered from all of them); process 0
    writes. The folder appears under its final name only once complete.

    Args:
        path: the folder to create (replaced if it exists).
        model: the model; its arrays go to `model.safetensors`.
        opt_state: the optimizer state, to `optimizer.safetensors`.
        step: the training step, stored in `state.json`.
        max_shard_bytes: above this, arrays are split over several files with an
            index, as Hugging Face does.
        **extra: JSON-able values (numbers, strings, lists, dicts, small arrays)
            stored in `state.json`, e.g. `epoch=`, `metrics=`.

    Returns:
        The folder's path.

    Example:
        >>> save_checkpoint("runs/x/ckpts/step_100", model=model, opt_state=opt_state,
        ...                 step=100, metrics={"loss": 1.3})
    """
    final = Path(path)
    reserved = {"format", "version", "step", "files", "specs", "keys"} & set(extra)
    if reserved:
        raise TypeError(f"save_checkpoint: {sorted(reserved)} are reserved names in state.json.")
    write = jax.process_index() == 0
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    if write:
        tmp.mkdir(parents=True)
    model_leaves = _leaves(model)
    if not model_leaves:
        raise CheckpointError("save_checkpoint: the model has no arrays to save.")
    opt_leaves = _leaves(opt_state) if opt_state is not None else []
    try:
        files = {"model": _write_group(tmp, "model", model_leaves, max_shard_bytes, write)}
        if opt_state is not None:
            files["optimizer"] = _write_group(tmp, "optimizer", opt_leaves, max_shard_bytes, write)
        if write:
            state = {
                "format": FORMAT,
                "version": VERSION,
                "step": int(step),
                "files": files,
                "specs": {k: _spec_of(v) for k, v in model_leaves},
                "keys": {
                    k: str(jax.random.key_impl(v))
                    for k, v in model_leaves + opt_leaves
                    if _is_key(v)
                },
                **_jsonable(extra, "extra"),
            }
            (tmp / STATE).write_text(json.dumps(state, indent=2))
            if final.exists():
                trash = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
                final.rename(trash)
                tmp.rename(final)
                shutil.rmtree(trash)
            else:
                tmp.rename(final)
    except BaseException:
        if write:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier(f"redcoast-save-{final.name}")
    return final


# --------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class _Stored:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file


def _read_header(file: Path) -> dict[str, _Stored]:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing; the checkpoint folder is incomplete.")
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated ({size} bytes), not a safetensors file.")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(
                f"{file}: truncated; its header says {n} bytes, the file has {size}."
            )
        try:
            header = json.loads(handle.read(n))
        except json.JSONDecodeError as err:
            raise CheckpointError(
                f"{file}: the safetensors header is not valid JSON ({err})."
            ) from err
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        if 8 + n + end > size:
            raise CheckpointError(
                f"{file}: truncated; {key!r} ends at byte {8 + n + end}, the file has {size}."
            )
        if entry["dtype"] not in _DTYPES:
            raise CheckpointError(
                f"{file}: {key!r} has dtype {entry['dtype']}, which redcoast cannot read."
            )
        out[key] = _Stored(file, _DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + n + begin)
    return out


def _read_group(folder: Path, names: list[str]) -> dict[str, _Stored]:
    stored: dict[str, _Stored] = {}
    for name in names:
        stored.update(_read_header(folder / name))
    return stored


def _check(
    stored: dict[str, _Stored], leaves: list[tuple[str, Any]], what: str, folder: Path
) -> None:
    want = {k for k, _ in leaves}
    missing = sorted(want - set(stored))
    extra = sorted(set(stored) - want)
    if missing or extra:
        raise CheckpointError(
            f"{folder}: the {what} arrays do not match `like`: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}. "
            "Build `like` with the same architecture and config as the saved model."
        )
    for key, leaf in leaves:
        shape, _ = _abstract(leaf)
        if stored[key].shape != shape:
            raise CheckpointError(
                f"{stored[key].file}: {key!r} has shape {stored[key].shape}, `like` has {shape}."
            )


def _target_sharding(
    key: str, leaf: Any, mesh: Mesh | None, specs: Mapping[str, P] | None
) -> jax.sharding.Sharding:
    if mesh is not None:
        spec = P() if specs is None else specs.get(key, P())
        return NamedSharding(mesh, spec)
    sharding = getattr(leaf, "sharding", None)
    if isinstance(leaf, jax.Array) and sharding is not None:
        return sharding
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _load_leaf(entry: _Stored, leaf: Any, sharding: jax.sharding.Sharding, dtype: Any) -> jax.Array:
    data = np.memmap(entry.file, dtype=entry.dtype, mode="r", offset=entry.start, shape=entry.shape)
    if _is_key(leaf):
        impl = jax.random.key_impl(leaf)
        raw = jax.make_array_from_callback(entry.shape, sharding, lambda idx: np.array(data[idx]))
        return jax.random.wrap_key_data(raw, impl=impl)
    target = np.dtype(leaf.dtype)
    if dtype is not None and jnp.issubdtype(target, jnp.floating):
        target = np.dtype(dtype)
    return jax.make_array_from_callback(
        entry.shape, sharding, lambda idx: np.asarray(data[idx]).astype(target, copy=False)
    )


def _load_tree(
    like: PyTree,
    stored: dict[str, _Stored],
    mesh: Mesh | None,
    specs: Mapping[str, P] | None,
    dtype: Any,
) -> PyTree:
    arrays, static = eqx.partition(like, eqx.is_array)
    flat, treedef = jax.tree_util.tree_flatten_with_path(arrays)
    loaded = []
    for p, leaf in flat:
        key = path_str(p)
        loaded.append(
            _load_leaf(stored[key], leaf, _target_sharding(key, leaf, mesh, specs), dtype)
        )
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, loaded), static)


def _spec_map(model: PyTree, specs: PyTree | None) -> dict[str, P] | None:
    if specs is None:
        return None
    flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))
    mapping = {path_str(p): s for p, s in flat}
    missing = [k for k, _ in _leaves(model) if k not in mapping]
    if missing:
        raise ValueError(
            f"load_checkpoint: specs has no entry for {missing[:5]}; pass specs for `like`."
        )
    return mapping


def _optimizer_specs(
    opt_leaves: list[tuple[str, Any]],
    model_leaves: list[tuple[str, Any]],
    model_specs: Mapping[str, P],
) -> dict[str, P]:
    """Optimizer moments mirror the parameters: a leaf whose path ends with a parameter's
    path and has its shape takes that parameter's spec; the rest (step counters,
    factored statistics) are replicated."""
    shapes = {k: _abstract(v)[0] for k, v in model_leaves}
    out = {}
    for key, leaf in opt_leaves:
        match = [
            m
            for m in model_specs
            if (key == m or key.endswith("." + m)) and shapes.get(m) == _abstract(leaf)[0]
        ]
        out[key] = model_specs[max(match, key=len)] if match else P()
    return out


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    like: PyTree,
    opt_state_like: PyTree | None = None,
    mesh: Mesh | None = None,
    specs: PyTree | None = None,
    dtype: Any = None,
) -> Checkpoint:
    """Read a checkpoint folder onto any mesh.

    Everything is checked (files present and complete, every key there and no
    other, shapes equal) before any array is placed, so a bad checkpoint raises
    `CheckpointError` and loads nothing.

    Args:
        path: a folder written by `save_checkpoint`.
        like: a model of the same structure (e.g. freshly initialised, or
            `eqx.filter_eval_shape` of its constructor); supplies structure and dtypes.
        opt_state_like: an optimizer state of the same structure, to load the saved one.
        mesh: place arrays on this mesh; without it, each array goes where the
            corresponding array of `like` is (or to the first device).
        specs: the `PartitionSpec` tree for the model (from `sharding_rules`); optimizer
            moments follow the parameters they belong to. Replicated when omitted.
        dtype: cast floating arrays to this dtype (e.g. `jnp.bfloat16`).

    Returns:
        A `Checkpoint` with `model`, `opt_state`, `step` and `state`.

    Example:
        >>> ckpt = load_checkpoint("runs/x/ckpts/step_100", like=model, mesh=mesh, specs=specs)
        >>> model = ckpt.model
    """
    if path is None:
        raise TypeError(
            "load_checkpoint got path=None; latest_checkpoint returns None when a folder "
            "holds no complete checkpoint. Check the folder, or train first."
        )
    if specs is not None and mesh is None:
        raise ValueError("load_checkpoint: specs need a mesh to place arrays on; pass mesh= too.")
    folder = Path(path)
    state_file = folder / STATE
    if not state_file.is_file():
        raise CheckpointError(
            f"{state_file}: missing; {folder} is not a complete redcoast checkpoint."
        )
    try:
        state = json.loads(state_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{state_file}: not valid JSON ({err}).") from err
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"{state_file}: not a redcoast checkpoint (format {state.get('format')!r})."
        )
    if int(state.get("version", 0)) > VERSION:
        raise CheckpointError(
            f"{state_file}: format version {state['version']} is newer than this redcoast reads "
            f"({VERSION}); upgrade redcoast."
        )
    model_leaves = _leaves(like)
    stored_model = _read_group(folder, state["files"]["model"])
    _check(stored_model, model_leaves, "model", folder)
    stored_opt: dict[str, _Stored] = {}
    opt_leaves: list[tuple[str, Any]] = []
    if opt_state_like is not None:
        if "optimizer" not in state["files"]:
            raise CheckpointError(f"{folder}: has no optimizer state; call without opt_state_like.")
        opt_leaves = _leaves(opt_state_like)
        stored_opt = _read_group(folder, state["files"]["optimizer"])
        _check(stored_opt, opt_leaves, "optimizer", folder)
    model_specs = _spec_map(like, specs)
    model = _load_tree(like, stored_model, mesh, model_specs, dtype)
    opt_state = None
    if opt_state_like is not None:
        opt_specs = (
            None if model_specs is None else _optimizer_specs(opt_leaves, model_leaves, model_specs)
        )
        opt_state = _load_tree(opt_state_like, stored_opt, mesh, opt_specs, None)
    return Checkpoint(model=model, opt_state=opt_state, step=int(state["step"]), state=state)


# --------------------------------------------------------------------------- a run's folder


def step_checkpoint_path(folder: str | os.PathLike[str], step: int) -> Path:
    """Where a run keeps its checkpoint of `step`: `folder/step_00000100`.

    Args:
        folder: the run's checkpoint folder (`fit` uses `workdir/ckpts`).
        step: the optimizer step.

    Returns:
        The path; zero-padded so that names sort by step.

    Example:
        >>> step_checkpoint_path("runs/x/ckpts", 100)
        PosixPath('runs/x/ckpts/step_00000100')
    """
    return Path(folder) / f"{STEP_PREFIX}{int(step):08d}"


def _step_checkpoints(folder: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete `step_*` checkpoints in `folder`, oldest first."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        digits = child.name[len(STEP_PREFIX) :]
        if child.name.startswith(STEP_PREFIX) and digits.isdigit() and (child / STATE).is_file():
            found.append((int(digits), child))
    return sorted(found)


def latest_checkpoint(folder: str | os.PathLike[str]) -> Path | None:
    """The newest complete training checkpoint in a run's checkpoint folder.

    Only `step_*` folders count: a best-metric checkpoint (`best/`) is never
    "latest", so resuming never rolls training back to an older best. Folders are
    renamed into place only when complete, so an interrupted save is never chosen.

    Args:
        folder: the run's checkpoint folder (`fit` uses `workdir/ckpts`).

    Returns:
        The folder of the highest step, or None when there is none.

    Example:
        >>> ckpt = load_checkpoint(latest_checkpoint("runs/x/ckpts"), like=model)
    """
    found = _step_checkpoints(folder)
    return found[-1][1] if found else None


def prune_checkpoints(folder: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the newest `keep` `step_*` checkpoints (call on process 0 only).

    Args:
        folder: the run's checkpoint folder.
        keep: how many of the newest to keep (at least 1).

    Returns:
        The folders deleted.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}.")
    old = [path for _, path in _step_checkpoints(folder)[:-keep]]
    for path in old:
        shutil.rmtree(path)
    return old
