"""Checkpoints that any mesh can load, any safetensors reader can read, and damage cannot fool.

A checkpoint is a folder:

    model.safetensors          (or model-00001-of-0000N.safetensors + model.safetensors.index.json)
    optimizer.safetensors      (same scheme; only when an optimizer state was saved)
    state.json                 step, the caller's extra values, each leaf's spec, checksums

Keys are dotted pytree paths (`blocks.0.attn.q_proj.weight`). Saving gathers one
leaf at a time and streams it into the file, so host memory stays near the size of
the largest leaf. `state.json` holds `"checksum": "xxh3_64"` and `"checksums":
{"model": {key: "0123456789abcdef"}, "optimizer": {...}}`, the 64-bit XXH3 hash of
each tensor's bytes, computed on the bytes as they are written. XXH3 is a
non-cryptographic hash that catches damage (not tampering) at memory speed, about 7x
the throughput of zlib's CRC32, so it adds little to a save and verifying stays
close to the cost of reading the files (see scripts/bench_checkpoint.py).

Loading checks everything before any array is placed: `state.json`, every file,
each safetensors header (offsets contiguous, in range and equal to shape x itemsize,
the file exactly as long as its header says), every key, shape and dtype (a dtype
that differs from `like` is an error; `dtype=` is the one way to cast floating
arrays), and, with `verify=True` (the default), every tensor's checksum, hashed
straight from the file's memory map. Then each leaf is read straight into its
place on the target mesh (only the slices each device needs).

Durability and the replace invariant. A save writes `.NAME.tmp-HOST-PID-RAND/`,
fsyncs each file and that folder, and renames it into place, then fsyncs the
parent. If `NAME` already holds a checkpoint, it is first renamed to
`.NAME.old-RAND/`, the new one renamed to `NAME`, and the old one deleted. So at
every moment either `NAME` is a complete checkpoint, or `NAME` is absent and a
complete `.NAME.old-*` holds the previous one: `load_checkpoint(NAME)` and
`latest_checkpoint` then read from `.NAME.old-*`, and the next `save_checkpoint`
into that parent folder renames it back (or deletes it once `NAME` is complete).
That next save also deletes temporary folders of saves that were killed: those
written from this host by a process that no longer runs, and those of any host
untouched for `STALE_SECONDS`. Nothing else is ever moved or deleted: a save onto a
file, or onto a folder that is not a redcoast checkpoint, raises `CheckpointError`.
This assumes one writer per parent folder at a time (process 0 of one run), as `fit`
does.

`latest_checkpoint` skips, with a warning naming each folder and the reason,
`step_*` folders whose `state.json` is missing or unreadable or whose files are
missing, truncated or have a bad header. It does not read the tensors (that would
cost a full read of the newest checkpoint at every resume); pass `verify=True` for
that too. Checksums are always checked when the checkpoint is loaded.
"""

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import xxhash
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .._tree_paths import array_leaves, path_str
from ..distributed._host import barrier
from ..parallel._placement import optimizer_specs, specs_by_path
from ._durable import STALE_SECONDS as STALE_SECONDS
from ._durable import agree, put_in_place, refusal, resolve, temporary_path, tidy
from ._format import CHECKSUM as CHECKSUM
from ._format import DEFAULT_MAX_SHARD_BYTES as DEFAULT_MAX_SHARD_BYTES
from ._format import FORMAT as FORMAT
from ._format import STATE as STATE
from ._format import VERSION as VERSION
from ._format import CheckpointError as CheckpointError
from ._format import (
    Stored,
    host_array,
    is_key,
    read_group,
    read_state,
    stored_as,
    verify_groups,
    write_group,
    write_text,
)
from ._run import STEP_PREFIX as STEP_PREFIX
from ._run import latest_checkpoint as latest_checkpoint
from ._run import prune_checkpoints as prune_checkpoints
from ._run import step_checkpoint_path as step_checkpoint_path

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "checkpoint_state",
    "fingerprint",
    "latest_checkpoint",
    "load_checkpoint",
    "prune_checkpoints",
    "save_checkpoint",
    "step_checkpoint_path",
]

RESERVED = frozenset(
    {"format", "version", "step", "files", "specs", "keys", "checksum", "checksums"}
)


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


# --------------------------------------------------------------------------- saving


def _spec_of(leaf: Any) -> list[Any] | None:
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return [list(e) if isinstance(e, tuple) else e for e in sharding.spec]
    return None


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


def _check_step_and_extra(step: Any, extra: dict[str, Any]) -> None:
    if isinstance(step, bool) or not isinstance(step, int | np.integer):
        raise TypeError(
            f"save_checkpoint: step must be an int, the optimizer steps taken; got {step!r} "
            f"({type(step).__name__}), which state.json cannot hold as it is. Pass a whole "
            "number (round it yourself if that is what you mean)."
        )
    if step < 0:
        raise ValueError(f"save_checkpoint: step must be >= 0, got {step}.")
    reserved = RESERVED & set(extra)
    if reserved:
        raise TypeError(f"save_checkpoint: {sorted(reserved)} are reserved names in state.json.")


def _state(
    step: int,
    files: dict[str, Any],
    sums: dict[str, Any],
    model_leaves: list[tuple[str, Any]],
    opt_leaves: list[tuple[str, Any]],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """What `state.json` holds: the format, the step, the files and their checksums,
    the model's specs and key types, and the caller's extra values."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "files": files,
        "specs": {k: _spec_of(v) for k, v in model_leaves},
        "keys": {k: str(jax.random.key_impl(v)) for k, v in model_leaves + opt_leaves if is_key(v)},
        "checksum": CHECKSUM,
        "checksums": sums,
        **extra,
    }


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: PyTree,
    opt_state: PyTree | None = None,
    step: int,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    **extra: Any,
) -> Path:
    """Write a checkpoint folder atomically and durably.

    Every process must call this (each leaf is gathered from all of them); process 0
    writes. The folder appears under its final name only once complete and on disk;
    a previous checkpoint there is replaced without ever being lost (see the module
    docstring). What killed saves left in the same parent folder is cleaned first.

    Args:
        path: the folder to create, or a redcoast checkpoint to replace. A file or any
            other folder there is an error, never overwritten.
        model: the model; its arrays go to `model.safetensors`.
        opt_state: the optimizer state, to `optimizer.safetensors`.
        step: the training step, stored in `state.json`.
        max_shard_bytes: above this, arrays are split over several files with an
            index, as Hugging Face does.
        **extra: JSON-able values (numbers, strings, lists, dicts, small arrays)
            stored in `state.json`, e.g. `epoch=`, `metrics=`.

    Returns:
        The folder's path.

    Raises:
        CheckpointError: `path` is something other than a redcoast checkpoint.
        TypeError: `step` is not an int (2.5 would otherwise be stored as 2).
        OSError: writing failed (disk full, no permission), naming the file; the
            temporary folder is removed and a previous checkpoint at `path` is intact.

    Example:
        >>> save_checkpoint("runs/x/ckpts/step_100", model=model, opt_state=opt_state,
        ...                 step=100, metrics={"loss": 1.3})
    """
    final = Path(path)
    _check_step_and_extra(step, extra)
    model_leaves = array_leaves(model)
    if not model_leaves:
        raise CheckpointError("save_checkpoint: the model has no arrays to save.")
    opt_leaves = array_leaves(opt_state) if opt_state is not None else []
    stored_extra = _jsonable(extra, "extra")
    write = jax.process_index() == 0
    if write:
        tidy(final.parent)
    agree(refusal(final) if write else None)
    tmp = temporary_path(final)
    try:
        if write:
            tmp.mkdir(parents=True)
        files, sums = {}, {}
        files["model"], sums["model"] = write_group(
            tmp, "model", model_leaves, max_shard_bytes, write
        )
        if opt_state is not None:
            files["optimizer"], sums["optimizer"] = write_group(
                tmp, "optimizer", opt_leaves, max_shard_bytes, write
            )
        if write:
            state = _state(int(step), files, sums, model_leaves, opt_leaves, stored_extra)
            write_text(tmp / STATE, json.dumps(state, indent=2))
            put_in_place(tmp, final)
    except BaseException:
        if write:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier(f"redcoast-save-{final.name}")
    return final


# --------------------------------------------------------------------------- loading


def _check(
    stored: dict[str, Stored],
    leaves: list[tuple[str, Any]],
    what: str,
    folder: Path,
    cast: Any = None,
) -> None:
    want = {k for k, _ in leaves}
    missing = sorted(want - set(stored))
    extra = sorted(set(stored) - want)
    if what == "optimizer":
        given = "`opt_state_like`"
        fix = (
            "The checkpoint was saved with another optimizer or other optimizer options: "
            "build `opt_state_like` with the optimizer the checkpoint was saved with (in "
            "fit, pass the run's optimizer), or resume in a new workdir."
        )
    else:
        given = "`like`"
        fix = "Build `like` with the same architecture and config as the saved model."
    if missing or extra:
        raise CheckpointError(
            f"{folder}: the {what} arrays do not match {given}: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}. {fix}"
        )
    for key, leaf in leaves:
        shape, dtype = stored_as(leaf)
        got = stored[key]
        if got.shape != shape:
            raise CheckpointError(
                f"{got.file}: {key!r} has shape {got.shape}, {given} has {shape}. {fix}"
            )
        floats = jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(got.dtype, jnp.floating)
        if got.dtype != dtype and not (cast is not None and floats and not is_key(leaf)):
            raise CheckpointError(
                f"{got.file}: {key!r} is stored as {got.dtype}, `like` has {dtype}. Build "
                f"`like` with dtype {got.dtype}, or pass dtype= to cast floating arrays."
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


def _load_leaf(entry: Stored, leaf: Any, sharding: jax.sharding.Sharding, dtype: Any) -> jax.Array:
    data = np.memmap(entry.file, dtype=entry.dtype, mode="r", offset=entry.start, shape=entry.shape)
    if is_key(leaf):
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
    stored: dict[str, Stored],
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
    mapping = specs_by_path(specs)
    missing = [k for k, _ in array_leaves(model) if k not in mapping]
    if missing:
        raise ValueError(
            f"load_checkpoint: specs has no entry for {missing[:5]}; pass specs for `like`."
        )
    return mapping


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    like: PyTree,
    opt_state_like: PyTree | None = None,
    mesh: Mesh | None = None,
    specs: PyTree | None = None,
    dtype: Any = None,
    verify: bool = True,
) -> Checkpoint:
    """Read a checkpoint folder onto any mesh.

    Everything is checked (files present and complete, headers consistent, every
    key there and no other, shapes and dtypes equal, checksums) before any array is
    placed, so a bad checkpoint raises `CheckpointError` and loads nothing. If a save
    replacing `path` was killed between its two renames, the previous checkpoint is
    read from where it waits (`.NAME.old-*`).

    Args:
        path: a folder written by `save_checkpoint`.
        like: a model of the same structure (e.g. freshly initialised, or
            `eqx.filter_eval_shape` of its constructor); supplies structure and dtypes.
        opt_state_like: an optimizer state of the same structure, to load the saved one.
        mesh: place arrays on this mesh; without it, each array goes where the
            corresponding array of `like` is (or to the first device).
        specs: the `PartitionSpec` tree (or `ShardingPlan`) for the model; optimizer
            moments follow the parameters they belong to. Replicated when omitted.
        dtype: cast floating arrays to this dtype (e.g. `jnp.bfloat16`); without it a
            stored dtype that differs from `like`'s is an error.
        verify: check every tensor's checksum (one streamed read of the files);
            `verify=False` skips that read.

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
    folder = resolve(Path(path))
    state = read_state(folder)
    model_leaves = array_leaves(like)
    stored_model = read_group(folder, state["files"]["model"])
    _check(stored_model, model_leaves, "model", folder, dtype)
    groups = {"model": stored_model}
    stored_opt: dict[str, Stored] = {}
    opt_leaves: list[tuple[str, Any]] = []
    if opt_state_like is not None:
        if "optimizer" not in state["files"]:
            raise CheckpointError(f"{folder}: has no optimizer state; call without opt_state_like.")
        opt_leaves = array_leaves(opt_state_like)
        stored_opt = read_group(folder, state["files"]["optimizer"])
        _check(stored_opt, opt_leaves, "optimizer", folder)
        groups["optimizer"] = stored_opt
    if verify:
        verify_groups(state, groups)
    model_specs = _spec_map(like, specs)
    model = _load_tree(like, stored_model, mesh, model_specs, dtype)
    opt_state = None
    if opt_state_like is not None:
        opt_specs = (
            None if model_specs is None else optimizer_specs(opt_leaves, model_leaves, model_specs)
        )
        opt_state = _load_tree(opt_state_like, stored_opt, mesh, opt_specs, None)
    return Checkpoint(model=model, opt_state=opt_state, step=int(state["step"]), state=state)


def checkpoint_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checked `state.json` of a checkpoint, without reading any tensor.

    Args:
        path: a folder written by `save_checkpoint`.

    Returns:
        Its `state.json`: step, files, checksums and the extra values saved.

    Raises:
        CheckpointError: `state.json` is missing, unreadable or not redcoast's.

    Example:
        >>> checkpoint_state("runs/x/ckpts/step_100")["step"]
        100
    """
    return read_state(resolve(Path(path)))


def fingerprint(tree: PyTree) -> dict[str, Any]:
    """A fingerprint of `tree`'s arrays: XXH3 over every path, shape, dtype and byte.

    A checkpoint of a run that trains part of a model holds only the trainable
    arrays; the fingerprint of the frozen ones tells, at resume, whether the base
    given is the one the adapters were trained on. Arrays are fetched to the host
    one at a time (every process must call this, as for `save_checkpoint`).

    Args:
        tree: a pytree of arrays, e.g. a model's frozen part.

    Returns:
        `{"xxh3_64": hex digest, "arrays": how many, "bytes": their total size}`.

    Example:
        >>> fingerprint(eqx.filter(model, frozen))["xxh3_64"]
        '3f1c0a9e5b2d7c41'
    """
    hasher = xxhash.xxh3_64()
    count = nbytes = 0
    for key, leaf in array_leaves(tree):
        data = np.ascontiguousarray(host_array(leaf))
        hasher.update(f"{key}:{data.shape}:{data.dtype.str}\n".encode())
        hasher.update(data.reshape(-1).view(np.uint8).data)
        count += 1
        nbytes += data.nbytes
    return {"xxh3_64": hasher.hexdigest(), "arrays": count, "bytes": nbytes}
