"""The files of a checkpoint folder, written and read back (see `checkpoint.py`).

Safetensors files are written one leaf at a time, gathering each just before it
goes to the file and hashing its bytes (XXH3) on the way; reading checks every
header against its file before anything is read, and every tensor against its
checksum. `state.json` names the files and holds the checksums.
"""

import dataclasses
import json
import math
import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import xxhash

from .._files import with_path
from ..distributed._host import to_host

__all__ = [
    "CHECKSUM",
    "DEFAULT_MAX_SHARD_BYTES",
    "FORMAT",
    "STATE",
    "VERSION",
    "CheckpointError",
    "Stored",
    "host_array",
    "is_key",
    "read_group",
    "read_state",
    "stored_as",
    "verify_groups",
    "write_group",
    "write_text",
]

FORMAT = "redcoast-checkpoint"
VERSION = 2  # 2: checksums; version 1 checkpoints still load (without verification)
STATE = "state.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
CHECKSUM = "xxh3_64"

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


# --------------------------------------------------------------------------- leaves


def is_key(leaf: Any) -> bool:
    """Whether `leaf` is an array of PRNG keys (stored as its key data)."""
    return isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def host_array(leaf: Any) -> np.ndarray:
    """The whole array on this host; every process must call this for every leaf."""
    data = jax.random.key_data(leaf) if is_key(leaf) else leaf
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


def stored_as(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype `leaf` is stored with."""
    if is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, leaf)
        return tuple(data.shape), np.dtype(data.dtype)
    return tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype)


# --------------------------------------------------------------------------- writing


def _plan_files(
    stem: str, leaves: list[tuple[str, Any]], max_bytes: int
) -> list[tuple[str, list[int]]]:
    """Group leaves (by index) into files of at most `max_bytes`, HF style names."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, (_, leaf) in enumerate(leaves):
        shape, dtype = stored_as(leaf)
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
) -> dict[str, str]:
    """Stream leaves into one safetensors file, gathering each just before it is written.

    Returns each key's checksum, computed on the bytes as they go to the file.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for key, leaf in leaves:
        shape, dtype = stored_as(leaf)
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
            host = np.ascontiguousarray(host_array(leaf))  # all processes gather
            if handle is not None:
                data = host.reshape(-1).view(np.uint8).data  # the bytes, without a copy
                handle.write(data)
                sums[key] = xxhash.xxh3_64_hexdigest(data)
            del host
        if handle is not None:
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        raise with_path(err, path) from err
    finally:
        if handle is not None:
            handle.close()
    return sums


def write_text(path: Path, text: str) -> None:
    try:
        with open(path, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        raise with_path(err, path) from err


def write_group(
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
            math.prod(stored_as(leaf)[0]) * stored_as(leaf)[1].itemsize for _, leaf in leaves
        )
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_text(folder / f"{stem}.safetensors.index.json", json.dumps(index, indent=2))
    return [name for name, _ in files], sums


# --------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class Stored:
    file: Path
    key: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(file: Path, key: str, entry: Any, base: int) -> Stored:
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
    return Stored(file, key, dtype, tuple(shape), base + offsets[0], nbytes)


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


def _read_header(file: Path) -> dict[str, Stored]:
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


def read_group(folder: Path, names: list[str]) -> dict[str, Stored]:
    stored: dict[str, Stored] = {}
    for name in names:
        stored.update(_read_header(folder / name))
    return stored


def read_state(folder: Path) -> dict[str, Any]:
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


# --------------------------------------------------------------------------- checksums


def _verify(stored: dict[str, Stored], sums: Mapping[str, str]) -> None:
    """Check each tensor against its checksum, hashing the file's memory map in place."""
    by_file: dict[Path, list[Stored]] = {}
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


def verify_groups(state: dict[str, Any], groups: Mapping[str, dict[str, Stored]]) -> None:
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
