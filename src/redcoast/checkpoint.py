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
import math
import mmap
import os
import re
import shutil
import socket
import struct
import time
import uuid
import warnings
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

from ._placement import optimizer_specs, specs_by_path
from ._tree_paths import array_leaves, path_str
from .data import barrier, to_host
from .fsdp import record_layout

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

FORMAT = "redcoast-checkpoint"
VERSION = 2  # 2: checksums; version 1 checkpoints still load (without verification)
STATE = "state.json"
STEP_PREFIX = "step_"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
CHECKSUM = "xxh3_64"
STALE_SECONDS = 24 * 3600
RESERVED = frozenset(
    {"format", "version", "step", "files", "specs", "keys", "checksum", "checksums"}
)

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


def _is_key(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _host(leaf: Any) -> np.ndarray:
    """The whole array on this host; every process must call this for every leaf."""
    data = jax.random.key_data(leaf) if _is_key(leaf) else leaf
    if not isinstance(data, jax.Array) or not data.is_fully_addressable:
        return to_host(data)
    # Assembled here from the shards because `np.asarray` of a sharded array keeps
    # its host copy cached on the array for as long as the array lives: a save
    # would leave a second copy of the model in host memory.
    out = np.empty(data.shape, data.dtype)
    for shard in data.addressable_shards:
        if shard.replica_id == 0:
            out[shard.index] = np.asarray(shard.data)
    return out


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


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's entry to disk (what makes a rename durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _with_path(err: OSError, path: Path) -> OSError:
    """The same error (same errno, so the same subclass) naming the file it happened to."""
    if err.filename is not None:
        return err
    return OSError(err.errno, err.strerror or os.strerror(err.errno or 0), str(path))


def _write_safetensors(
    path: Path, leaves: list[tuple[str, Any]], write: bool, metadata: Mapping[str, str]
) -> dict[str, str]:
    """Stream leaves into one safetensors file, gathering each just before it is written.

    Returns each key's checksum, computed on the bytes as they go to the file.
    """
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
    sums: dict[str, str] = {}
    handle = open(path, "wb") if write else None  # noqa: SIM115 - closed below
    try:
        if handle is not None:
            handle.write(struct.pack("<Q", len(raw)))
            handle.write(raw)
        for key, leaf in leaves:
            host = np.ascontiguousarray(_host(leaf))  # all processes gather
            if handle is not None:
                data = host.reshape(-1).view(np.uint8).data  # the bytes, without a copy
                handle.write(data)
                sums[key] = xxhash.xxh3_64_hexdigest(data)
            del host
        if handle is not None:
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        raise _with_path(err, path) from err
    finally:
        if handle is not None:
            handle.close()
    return sums


def _write_text(path: Path, text: str) -> None:
    try:
        with open(path, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        raise _with_path(err, path) from err


def _write_group(
    folder: Path, stem: str, leaves: list[tuple[str, Any]], max_bytes: int, write: bool
) -> tuple[list[str], dict[str, str]]:
    files = _plan_files(stem, leaves, max_bytes)
    sums: dict[str, str] = {}
    for name, indices in files:
        sums.update(
            _write_safetensors(folder / name, [leaves[i] for i in indices], write, {"format": "np"})
        )
    if len(files) > 1 and write:
        weight_map = {leaves[i][0]: name for name, indices in files for i in indices}
        total = sum(
            math.prod(_abstract(leaf)[0]) * _abstract(leaf)[1].itemsize for _, leaf in leaves
        )
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_text(folder / f"{stem}.safetensors.index.json", json.dumps(index, indent=2))
    return [name for name, _ in files], sums


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


def _agree(error: str | None) -> None:
    """Raise `error` (found on process 0) on every process, so none waits for the others."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flag = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
        if error is None and int(flag):
            error = "save_checkpoint: process 0 refused the path; see its error."
    if error is not None:
        raise CheckpointError(error)


def _is_checkpoint(folder: Path) -> bool:
    """Whether `folder` holds a `state.json` of our format (its tensors are not read)."""
    try:
        return json.loads((folder / STATE).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _refusal(final: Path) -> str | None:
    """Why `final` must not be replaced, or None when it is absent or one of ours."""
    if not final.exists() and not final.is_symlink():
        return None
    if final.is_symlink() or not final.is_dir():
        what = "a symbolic link" if final.is_symlink() else "a file"
    elif _is_checkpoint(final):
        return None
    else:
        what = f"a folder without a redcoast {STATE}"
    return (
        f"save_checkpoint: {final} is {what}, not a redcoast checkpoint; nothing was written "
        "or moved. Save to another path, or move it away first."
    )


_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")
_OLD = re.compile(r"^\.(?P<name>.+)\.old-[0-9a-f]{8}$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tidy(parent: Path) -> None:
    """Undo what killed saves left in `parent` (see the module docstring); process 0 only."""
    if not parent.is_dir():
        return
    host, now = socket.gethostname(), time.time()
    for child in parent.iterdir():
        tmp, old = _TMP.match(child.name), _OLD.match(child.name)
        if tmp is not None and child.is_dir():
            pid = int(tmp["pid"])
            mine = tmp["host"] == host and pid != os.getpid() and not _alive(pid)
            if mine or now - child.stat().st_mtime > STALE_SECONDS:
                shutil.rmtree(child, ignore_errors=True)
        elif old is not None and child.is_dir():
            final = parent / old["name"]
            # With the new checkpoint in place the old one is garbage, even half
            # deleted (a kill during its removal leaves it without state.json).
            if _is_checkpoint(final):
                shutil.rmtree(child, ignore_errors=True)
            elif _is_checkpoint(child) and not final.exists() and not final.is_symlink():
                child.rename(final)  # the kill came between the two renames of a replace
                _fsync(parent)


def _put_in_place(tmp: Path, final: Path) -> None:
    """Rename the complete `tmp` to `final`, keeping the previous one until it is there."""
    _fsync(tmp)
    parent = final.parent
    if final.exists():
        trash = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(trash)
        try:
            tmp.rename(final)
        except BaseException:
            trash.rename(final)
            raise
        _fsync(parent)
        shutil.rmtree(trash)
    else:
        tmp.rename(final)
    _fsync(parent)


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
    model_leaves = array_leaves(model)
    if not model_leaves:
        raise CheckpointError("save_checkpoint: the model has no arrays to save.")
    opt_leaves = array_leaves(opt_state) if opt_state is not None else []
    stored_extra = _jsonable(extra, "extra")
    write = jax.process_index() == 0
    if write:
        _tidy(final.parent)
    _agree(_refusal(final) if write else None)
    tag = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = final.with_name(f".{final.name}.tmp-{tag}")
    try:
        if write:
            tmp.mkdir(parents=True)
        files, sums = {}, {}
        files["model"], sums["model"] = _write_group(
            tmp, "model", model_leaves, max_shard_bytes, write
        )
        if opt_state is not None:
            files["optimizer"], sums["optimizer"] = _write_group(
                tmp, "optimizer", opt_leaves, max_shard_bytes, write
            )
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
                "checksum": CHECKSUM,
                "checksums": sums,
                **stored_extra,
            }
            _write_text(tmp / STATE, json.dumps(state, indent=2))
            _put_in_place(tmp, final)
    except BaseException:
        if write:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier(f"redcoast-save-{final.name}")
    return final


# --------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class _Stored:
    file: Path
    key: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(file: Path, key: str, entry: Any, base: int) -> _Stored:
    """One header entry, checked: a known dtype, a shape, offsets spanning shape x itemsize."""
    bad = f"{file}: the safetensors header of {key!r} is damaged"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CheckpointError(f"{bad}: {entry!r} lacks dtype, shape or data_offsets.")
    if entry["dtype"] not in _DTYPES:
        raise CheckpointError(
            f"{file}: {key!r} has dtype {entry['dtype']}, which redcoast cannot read."
        )
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(_is_size(d) for d in shape):
        raise CheckpointError(f"{bad}: shape {shape!r} is not a list of sizes.")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_size, offsets)):
        raise CheckpointError(f"{bad}: data_offsets {offsets!r} is not [begin, end].")
    dtype = _DTYPES[entry["dtype"]]
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise CheckpointError(
            f"{bad}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but shape "
            f"{tuple(shape)} of {entry['dtype']} needs {nbytes}."
        )
    return _Stored(file, key, dtype, tuple(shape), base + offsets[0], nbytes)


def _header(file: Path) -> tuple[int, Any]:
    """The header's length and its parsed JSON."""
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
        except ValueError as err:
            raise CheckpointError(
                f"{file}: the safetensors header is not valid JSON ({err})."
            ) from err
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object.")
    return n, header


def _read_header(file: Path) -> dict[str, _Stored]:
    """Every tensor of a safetensors file, checked to tile the file exactly, in order."""
    n, header = _header(file)
    size = file.stat().st_size
    entries = sorted(
        (_entry(file, key, entry, 8 + n) for key, entry in header.items() if key != "__metadata__"),
        key=lambda e: e.start,
    )
    expected = 8 + n
    for e in entries:
        if e.start != expected:
            raise CheckpointError(
                f"{file}: {e.key!r} starts at byte {e.start}, where the previous tensor ends at "
                f"{expected}: the header's data_offsets overlap or leave a gap; it is damaged."
            )
        expected += e.nbytes
        if expected > size:
            raise CheckpointError(
                f"{file}: truncated; {e.key!r} ends at byte {expected}, the file has {size}."
            )
    if expected != size:
        raise CheckpointError(
            f"{file}: {size - expected} bytes after the last tensor; the header says the "
            f"file ends at byte {expected}. It is damaged."
        )
    return {e.key: e for e in entries}


def _read_group(folder: Path, names: list[str]) -> dict[str, _Stored]:
    stored: dict[str, _Stored] = {}
    for name in names:
        stored.update(_read_header(folder / name))
    return stored


def _check(
    stored: dict[str, _Stored],
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
        shape, dtype = _abstract(leaf)
        got = stored[key]
        if got.shape != shape:
            raise CheckpointError(
                f"{got.file}: {key!r} has shape {got.shape}, {given} has {shape}. {fix}"
            )
        floats = jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(got.dtype, jnp.floating)
        if got.dtype != dtype and not (cast is not None and floats and not _is_key(leaf)):
            raise CheckpointError(
                f"{got.file}: {key!r} is stored as {got.dtype}, `like` has {dtype}. Build "
                f"`like` with dtype {got.dtype}, or pass dtype= to cast floating arrays."
            )


def _verify(stored: dict[str, _Stored], sums: Mapping[str, str]) -> None:
    """Check each tensor against its checksum, hashing the file's memory map in place."""
    by_file: dict[Path, list[_Stored]] = {}
    for entry in stored.values():
        by_file.setdefault(entry.file, []).append(entry)
    for file, entries in by_file.items():
        for e in entries:
            if e.key not in sums:
                raise CheckpointError(
                    f"{file}: {e.key!r} has no checksum in {STATE}; the checkpoint is "
                    "damaged. Pass verify=False to load it unchecked."
                )
        # Hashing the map, not a copy read into a buffer, makes verifying about 6x
        # cheaper (no copy out of the page cache); the pages stay the kernel's to drop.
        with (
            open(file, "rb") as handle,
            mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
        ):
            view = memoryview(mapped)
            try:
                for e in entries:
                    if e.start + e.nbytes > len(view):
                        raise CheckpointError(f"{file}: truncated while reading {e.key!r}.")
                    digest = xxhash.xxh3_64_hexdigest(view[e.start : e.start + e.nbytes])
                    if digest != sums[e.key]:
                        raise CheckpointError(
                            f"{file}: {e.key!r} fails its checksum ({CHECKSUM} {digest}, "
                            f"{STATE} says {sums[e.key]}): the file is damaged. Load an "
                            "earlier checkpoint, or pass verify=False to read it anyway."
                        )
            finally:
                view.release()


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
    mapping = specs_by_path(specs)
    missing = [k for k, _ in array_leaves(model) if k not in mapping]
    if missing:
        raise ValueError(
            f"load_checkpoint: specs has no entry for {missing[:5]}; pass specs for `like`."
        )
    return mapping


def _resolve(folder: Path) -> Path:
    """`folder`, or the complete `.NAME.old-*` that a save killed between its renames left."""
    if folder.exists() or not folder.parent.is_dir():
        return folder
    for child in sorted(folder.parent.iterdir()):
        old = _OLD.match(child.name)
        if old is not None and old["name"] == folder.name and _is_checkpoint(child):
            return child
    return folder


def _read_state(folder: Path) -> dict[str, Any]:
    state_file = folder / STATE
    if not state_file.is_file():
        raise CheckpointError(
            f"{state_file}: missing; {folder} is not a complete redcoast checkpoint."
        )
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{state_file}: not valid JSON ({err}).") from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else None
        raise CheckpointError(f"{state_file}: not a redcoast checkpoint (format {got!r}).")
    if int(state.get("version", 0)) > VERSION:
        raise CheckpointError(
            f"{state_file}: format version {state['version']} is newer than this redcoast reads "
            f"({VERSION}); upgrade redcoast."
        )
    files = state.get("files")
    if not isinstance(files, dict) or not isinstance(files.get("model"), list):
        raise CheckpointError(f"{state_file}: has no list of model files; it is damaged.")
    return state


def _verify_groups(state: dict[str, Any], groups: Mapping[str, dict[str, _Stored]]) -> None:
    """Check checksums; a version 1 checkpoint has none, and is read unchecked."""
    if "checksums" not in state and int(state.get("version", 0)) < 2:
        return
    if state.get("checksum") != CHECKSUM or not isinstance(state.get("checksums"), dict):
        raise CheckpointError(
            f"{STATE}: checksum {state.get('checksum')!r} is not {CHECKSUM!r} or checksums "
            "are missing; the checkpoint is damaged. Pass verify=False to load it unchecked."
        )
    for group, stored in groups.items():
        _verify(stored, state["checksums"].get(group, {}))


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
    folder = _resolve(Path(path))
    state = _read_state(folder)
    model_leaves = array_leaves(like)
    stored_model = _read_group(folder, state["files"]["model"])
    _check(stored_model, model_leaves, "model", folder, dtype)
    groups = {"model": stored_model}
    stored_opt: dict[str, _Stored] = {}
    opt_leaves: list[tuple[str, Any]] = []
    if opt_state_like is not None:
        if "optimizer" not in state["files"]:
            raise CheckpointError(f"{folder}: has no optimizer state; call without opt_state_like.")
        opt_leaves = array_leaves(opt_state_like)
        stored_opt = _read_group(folder, state["files"]["optimizer"])
        _check(stored_opt, opt_leaves, "optimizer", folder)
        groups["optimizer"] = stored_opt
    if verify:
        _verify_groups(state, groups)
    model_specs = _spec_map(like, specs)
    # A zoo model (and the optimizer's copies of it) record the layout they now have,
    # which `specs` may have changed from `like`'s.
    model = record_layout(_load_tree(like, stored_model, mesh, model_specs, dtype))
    opt_state = None
    if opt_state_like is not None:
        opt_specs = (
            None if model_specs is None else optimizer_specs(opt_leaves, model_leaves, model_specs)
        )
        opt_state = record_layout(_load_tree(opt_state_like, stored_opt, mesh, opt_specs, None))
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
    return _read_state(_resolve(Path(path)))


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
        data = np.ascontiguousarray(_host(leaf))
        hasher.update(f"{key}:{data.shape}:{data.dtype.str}\n".encode())
        hasher.update(data.reshape(-1).view(np.uint8).data)
        count += 1
        nbytes += data.nbytes
    return {"xxh3_64": hasher.hexdigest(), "arrays": count, "bytes": nbytes}


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


def _step_folders(folder: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """`step_*` folders in `folder` (or the `.step_*.old-*` a killed replace left), oldest first."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = {}
    for child in root.iterdir():
        old = _OLD.match(child.name)
        name = child.name if old is None else old["name"]
        digits = name[len(STEP_PREFIX) :]
        if not (name.startswith(STEP_PREFIX) and digits.isdigit() and child.is_dir()):
            continue
        if old is None or (not (root / name).exists() and _is_checkpoint(child)):
            found[int(digits)] = child
    return sorted(found.items())


def _validate(folder: Path, verify: bool) -> None:
    """Raise `CheckpointError` unless every file `state.json` names is whole (and, with
    `verify`, matches its checksums)."""
    state = _read_state(folder)
    groups = {group: _read_group(folder, names) for group, names in state["files"].items()}
    if verify:
        _verify_groups(state, groups)


def latest_checkpoint(folder: str | os.PathLike[str], *, verify: bool = False) -> Path | None:
    """The newest undamaged training checkpoint in a run's checkpoint folder.

    Only `step_*` folders count: a best-metric checkpoint (`best/`) is never
    "latest", so resuming never rolls training back to an older best. Newer folders
    that are damaged (state.json missing or unreadable, a file missing, truncated or
    with a bad header) are skipped with a warning naming each and why. Tensors are
    not read unless `verify=True`: `load_checkpoint` checks them anyway.

    Args:
        folder: the run's checkpoint folder (`fit` uses `workdir/ckpts`).
        verify: also check every tensor's checksum (a full read of each candidate).

    Returns:
        The folder of the highest step that passed, or None when there is none.

    Example:
        >>> ckpt = load_checkpoint(latest_checkpoint("runs/x/ckpts"), like=model)
    """
    for _, path in reversed(_step_folders(folder)):
        try:
            _validate(path, verify)
        except CheckpointError as err:
            warnings.warn(f"latest_checkpoint: skipping {path}: {err}", stacklevel=2)
            continue
        return path
    return None


def prune_checkpoints(folder: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the newest `keep` `step_*` checkpoints (call on process 0 only).

    Args:
        folder: the run's checkpoint folder.
        keep: how many of the newest to keep (at least 1).

    Returns:
        The folders deleted.

    Example:
        >>> prune_checkpoints("runs/x/ckpts", keep=3)
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}.")
    complete = [path for _, path in _step_folders(folder) if _is_checkpoint(path)]
    old = complete[:-keep]
    for path in old:
        shutil.rmtree(path)
    return old
