"""Chunk checksums of a token folder's large files: taken while writing, checked on first read.

`tokens.bin` and `mask.bin` may be larger than memory, so each is hashed (xxh3-64)
per chunk of `CHUNK_BYTES` as it is written, and the digests go to `checksums.bin`.
A reader verifies a chunk the first time a read touches it: opening a folder costs
nothing, a flipped byte is found before its row reaches a model, and each chunk is
hashed once per process. Reads go through `os.pread` on a file descriptor, never a
memory map, so a file truncated while in use is an error naming it, not a SIGBUS.
"""

from __future__ import annotations

import os
import weakref
from array import array
from pathlib import Path

import numpy as np
import xxhash

CHUNK_BYTES = 1 << 20
"""Bytes of `tokens.bin` or `mask.bin` under one checksum: about 100 µs of hashing."""


class ChunkedWriter:
    """Writes a file and takes the xxh3-64 of every `chunk_bytes` of it."""

    def __init__(self, path: Path, chunk_bytes: int = CHUNK_BYTES):
        self.file = open(path, "wb")  # noqa: SIM115 (closed by `close`)
        self.chunk_bytes, self.filled = chunk_bytes, 0
        self.hasher, self.digests = xxhash.xxh3_64(), array("Q")

    def write(self, data: bytes) -> None:
        self.file.write(data)
        view = memoryview(data)
        while view:
            take = min(len(view), self.chunk_bytes - self.filled)
            self.hasher.update(view[:take])
            self.filled += take
            view = view[take:]
            if self.filled == self.chunk_bytes:
                self.digests.append(self.hasher.intdigest())
                self.hasher.reset()
                self.filled = 0

    def close(self, *, sync: bool) -> array:
        """Close the file (flushed to disk when `sync`); the digests of its chunks."""
        if sync:
            self.file.flush()
            os.fsync(self.file.fileno())
        self.file.close()
        if self.filled:
            self.digests.append(self.hasher.intdigest())
            self.hasher.reset()
            self.filled = 0
        return self.digests


def n_chunks(size: int, chunk_bytes: int) -> int:
    return -(-size // chunk_bytes)


class CheckedFile:
    """A file read with `os.pread`, each chunk checked against its digest on first touch."""

    def __init__(self, path: Path, size: int, digests: np.ndarray, chunk_bytes: int):
        self.path, self.size, self.chunk_bytes = path, size, chunk_bytes
        self.digests = [int(d) for d in digests]
        self.verified = bytearray(len(self.digests))
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        weakref.finalize(self, os.close, self.fd)

    def read(self, offset: int, out: np.ndarray) -> np.ndarray:
        """Fill `out` with the bytes from `offset` on, verifying the chunks they lie in.

        Raises:
            ValueError: a chunk does not match its checksum, or the file is shorter
                than the bytes wanted (truncated while in use).
        """
        nbytes = out.nbytes
        if nbytes == 0:
            return out
        first, last = offset // self.chunk_bytes, (offset + nbytes - 1) // self.chunk_bytes
        for chunk in range(first, last + 1):
            if not self.verified[chunk]:
                self._verify(chunk)
        got = os.preadv(self.fd, [out.data], offset)
        if got != nbytes:
            self._short(offset, nbytes)
        return out

    def _verify(self, chunk: int) -> None:
        start = chunk * self.chunk_bytes
        want = min(self.chunk_bytes, self.size - start)
        data = os.pread(self.fd, want, start)
        if len(data) != want:
            self._short(start, want)
        if xxhash.xxh3_64_intdigest(data) != self.digests[chunk]:
            raise ValueError(
                f"{self.path}: bytes [{start}, {start + want}) do not match their checksum "
                f"in {self.path.parent / 'checksums.bin'} (written with the folder): the file "
                f"changed on disk after it was written. Delete {self.path.parent} and tokenize "
                "again."
            )
        self.verified[chunk] = 1

    def _short(self, offset: int, nbytes: int) -> None:
        found = os.fstat(self.fd).st_size
        raise ValueError(
            f"{self.path}: bytes [{offset}, {offset + nbytes}) were wanted, but the file holds "
            f"{found} bytes (it was {self.size} when opened): it was truncated while in use. "
            f"Delete {self.path.parent} and tokenize again."
        )
