"""Where documents come from: files and folders, their fingerprints, decoding, progress."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import xxhash

from .._progress import BYTES, Progress
from ._token_file import is_token_folder

Source = str | os.PathLike[str] | Iterable[Any]
"""A file, a folder, a list of `Path`s, or an iterable of documents (strings, or
records for `tokenize_instructions`)."""


def list_files(source: Any, pattern: str, *, output: Path) -> list[Path] | None:
    """The files a path or list of `Path`s names, sorted; None when `source` is not paths.

    Each file comes once, by its real path (`_once`): a symlink in a folder beside the
    file it points to is read once.

    Files inside a token folder (one redcoast wrote, is writing, or `output`, the one
    this call writes) are never input: a folder's are skipped, and one named on its
    own is refused.

    Raises:
        ValueError: a path that does not exist, a folder with no file to read, a token
            folder's file named as input, or a list of strings that are all paths of
            existing files (strings are documents; see `_refuse_paths_as_text`).
    """
    if isinstance(source, str | os.PathLike):
        paths = [Path(source)]
    elif (
        isinstance(source, list | tuple)
        and source
        and all(isinstance(p, os.PathLike) for p in source)
    ):
        paths = [Path(p) for p in source]
    else:
        _refuse_paths_as_text(source)
        return None
    skipped = _TokenFolders(output)
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            if skipped.holds(p, p):
                raise ValueError(
                    f"{p} is a token folder (redcoast's output), not text; give the folder "
                    "or files of the text itself."
                )
            found = sorted(
                f
                for f in p.glob(pattern)
                if f.is_file()
                and not any(part.startswith(".") for part in f.relative_to(p).parts)
                and not skipped.holds(f.parent, p)
            )
            if not found:
                also = " (files of token folders are never read)" if skipped.found else ""
                raise ValueError(f"no file in {p} matches {pattern!r}{also}; nothing to tokenize.")
            out += found
        elif p.is_file():
            if skipped.holds(p.parent, p.parent):
                raise ValueError(
                    f"{p} is a file of a token folder (redcoast's output), not text; give "
                    "the text files themselves."
                )
            out.append(p)
        else:
            raise ValueError(f"{p} does not exist; give a file, a folder or a list of Paths.")
    return _once(out)


def _once(files: list[Path]) -> list[Path]:
    """Each file once, by its real path: a symlink beside its target (or a file named
    twice) would otherwise be tokenized twice. The first name found is kept."""
    seen: set[Path] = set()
    out = []
    for f in files:
        real = f.resolve()
        if real not in seen:
            seen.add(real)
            out.append(f)
    return out


class _TokenFolders:
    """Which folders are token folders (or `output`), each folder looked at once."""

    def __init__(self, output: Path):
        self.output = output.resolve()
        self.known: dict[Path, bool] = {}
        self.found = False

    def holds(self, folder: Path, root: Path) -> bool:
        """`folder`, or one of its parents up to `root`, is a token folder."""
        while True:
            if folder not in self.known:
                mine = is_token_folder(folder) or folder.resolve() == self.output
                self.known[folder] = mine
                self.found |= mine
            if self.known[folder]:
                return True
            if folder == root or folder.parent == folder:
                return False
            folder = folder.parent


def _refuse_paths_as_text(source: Any) -> None:
    """Refuse a list of strings that are all paths of existing files.

    Strings are documents, so `glob.glob("corpus/*.txt")` would tokenize the paths.
    Cheap: the check stops at the first string that is not such a path (a document
    almost always is not), and never reads an iterator.
    """
    if not isinstance(source, list | tuple) or not source:
        return
    for s in source:
        if not isinstance(s, str) or len(s) > 4096 or "\n" in s or not os.path.isfile(s):
            return
    raise ValueError(
        f"source is a {type(source).__name__} of {len(source)} strings that are all paths "
        f"of existing files (the first: {source[0]!r}), and strings are read as the "
        "documents' text: the paths themselves would be tokenized. To read the files, "
        "pass them as Paths (`[Path(p) for p in paths]`) or pass their folder (tokenize "
        "chooses its files with pattern=)."
    )


def hashed(chunks: Iterable[bytes], path: Path, into: list[list[Any]]) -> Iterator[bytes]:
    """Pass a file's `chunks` through; when they end, append its fingerprint to `into`.

    The fingerprint (`[resolved path, bytes, xxh3-64 of them]`) is taken from the very
    bytes tokenized, so a file that changes while it is read is not mistaken later
    for the one tokenized.
    """
    h, size = xxhash.xxh3_64(), 0
    for chunk in chunks:
        h.update(chunk)
        size += len(chunk)
        yield chunk
    into.append([str(path.resolve()), size, h.hexdigest()])


def same_sources(files: list[Path] | None, texts: list[str] | None) -> Callable[[Any], bool]:
    """A judge of the `sources` a token folder stored: the same `files` (see
    `_same_files`), or the same `texts` signature; never for a one-shot iterator."""
    if files is None:
        return lambda stored: texts is not None and stored == texts
    memo: dict[Path, str] = {}  # hashes taken once per call, however often asked
    return lambda stored: _same_files(stored, files, memo)


def _same_files(stored: Any, files: list[Path], memo: dict[Path, str]) -> bool:
    """The files are those fingerprinted in `stored`: the same resolved paths in order,
    the same sizes, and, only when all those match, the same xxh3-64 of their content.

    The modification time is not compared: a file rewritten with its size and time
    kept (`cp -p`, `rsync -t`, `tar x`) differs in content, and a file only touched
    does not.
    """
    if not isinstance(stored, list) or len(stored) != len(files):
        return False
    for entry, f in zip(stored, files, strict=True):
        if not isinstance(entry, list) or len(entry) != 3:
            return False
        if entry[0] != str(f.resolve()) or entry[1] != f.stat().st_size:
            return False
    for entry, f in zip(stored, files, strict=True):
        if f not in memo:
            memo[f] = _file_hash(f)
        if memo[f] != entry[2]:
            return False
    return True


def _file_hash(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def text_signature(texts: Any) -> list[str] | None:
    """A hash of a sequence of texts (or records); None for a one-shot iterator, which
    is never reused."""
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


def progress_bar(total: int | None, enabled: bool, what: str, unit: str = BYTES) -> Progress:
    """Tokenizing's progress: bytes of files (or records) done, while process 0 reads."""
    return Progress(f"tokenize {what}", total, unit=unit, enabled=enabled, transient=True)
