"""Where documents come from: files and folders, their signature, decoding, progress."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

Source = str | os.PathLike[str] | Iterable[Any]
"""A file, a folder, a list of `Path`s, or an iterable of documents (strings, or
records for `tokenize_instructions`)."""


def list_files(source: Any, pattern: str) -> list[Path] | None:
    """The files a path or list of `Path`s names, sorted; None when `source` is not paths."""
    if isinstance(source, str | os.PathLike):
        paths = [Path(source)]
    elif (
        isinstance(source, list | tuple)
        and source
        and all(isinstance(p, os.PathLike) for p in source)
    ):
        paths = [Path(p) for p in source]
    else:
        return None
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(
                f
                for f in p.glob(pattern)
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise ValueError(f"no file in {p} matches {pattern!r}; nothing to tokenize.")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise ValueError(f"{p} does not exist; give a file, a folder or a list of Paths.")
    return out


def signature(files: list[Path] | None, texts: Any) -> list[Any] | None:
    """What identifies the sources: each file's path, size and mtime; a hash of a
    sequence of texts; None for a one-shot iterator (which is never reused)."""
    if files is not None:
        return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    if isinstance(texts, Sequence):
        h = hashlib.sha256()
        for t in texts:
            h.update(json.dumps(t, sort_keys=True).encode())
            h.update(b"\x00")
        return [h.hexdigest()]
    return None


def decode(data: bytes, errors: str, where: Callable[[int], str]) -> str:
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{where(err.start)} is not valid UTF-8 ({err.reason} at byte "
            f"{data[err.start : err.start + 4]!r}); pass errors='replace' to tokenize it "
            "with U+FFFD in place of such bytes, or fix the file."
        ) from None


def json_line(line: bytes, path: Any, line_no: int, errors: str) -> Any:
    text = decode(line, errors, lambda b: f"{path}:{line_no}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{line_no} is not valid JSON ({err.msg}).") from None


def describe_keys(record: Any) -> str:
    return str(sorted(record)) if isinstance(record, dict) else type(record).__name__


def progress_bar(total: int | None, enabled: bool, what: str) -> Progress | None:
    if not enabled:
        return None
    columns = [TextColumn(f"[bold]tokenize {what}"), BarColumn(), DownloadColumn()]
    return Progress(*columns, TimeRemainingColumn(), transient=True)
