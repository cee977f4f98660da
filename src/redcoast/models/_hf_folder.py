"""The tensors of a `save_pretrained` folder, single file or sharded, read by name."""

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

__all__ = ["INDEX", "SAFETENSORS", "MissingTensorError", "SavedTensors"]

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class MissingTensorError(KeyError):
    """A tensor the model needs is not in the checkpoint."""

    def __str__(self) -> str:
        # KeyError's own __str__ shows the repr of the message, quotes and escapes included.
        return str(self.args[0])


class SavedTensors:
    """The tensors of a save_pretrained folder, single file or sharded, read lazily.

    Checkpoints of the bare base model (`GPT2Model`, `OPTModel`, ...), such as the
    original GPT-2 and OPT releases, name their tensors without the base model's
    prefix (`h.0.ln_1.weight` for `transformer.h.0.ln_1.weight`); both are found. So
    are names another release of `transformers` writes: `aliases` pairs a prefix of
    the names asked for with another it may be stored under (a LLaVA's
    `vision_tower.` with `vision_tower.vision_model.`).
    """

    def __init__(self, folder: Path, base_prefix: str, aliases: tuple[tuple[str, str], ...] = ()):
        self.folder = folder
        self.base_prefix = base_prefix
        self.aliases = aliases
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

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._stored(name) in self.where

    def _stored(self, name: str) -> str:
        """The name `name` is stored under: itself, without the base model's prefix, or
        with an alias of its prefix."""
        if name in self.where:
            return name
        bare = name.removeprefix(self.base_prefix)
        if bare in self.where:
            return bare
        for ours, other in self.aliases:
            if name.startswith(ours) and (stored := other + name[len(ours) :]) in self.where:
                return stored
        return name

    def get(self, name: str, needed_for: str) -> np.ndarray:
        name = self._stored(name)
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
