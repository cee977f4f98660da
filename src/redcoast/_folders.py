"""A `transformers` checkpoint folder read as a model, for the framework's parts that take
a folder (the harness's `path=`). The reader is the zoo's `from_hf`, which the public
surface (`redcoast/__init__.py`, where the framework and the zoo join) hands in: no
framework module imports the zoo."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

_readers: list[Callable[..., Any]] = []


def read_with(reader: Callable[..., Any]) -> None:
    """Make `reader` (`(path, **options) -> model`) the one `read_folder` calls."""
    _readers[:] = [reader]


def read_folder(path: str | Path, **options: Any) -> Any:
    """The model in the checkpoint folder `path`, loaded with `options` (`mesh`, `fsdp`,
    `dtype`, as `rc.models.from_hf` takes them)."""
    if not _readers:
        raise RuntimeError(
            "no checkpoint reader is set: import redcoast, whose __init__ hands in "
            "rc.models.from_hf."
        )
    return _readers[0](path, **options)
