"""The configs of the zoo's architectures, read from and written to `config.json`."""

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

__all__ = ["HFConfig", "read_config"]

# A TypeVar rather than typing.Self, which beartype rejects on undecorated classes.
_Config = TypeVar("_Config", bound="HFConfig")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFConfig:
    """Base of the architectures' configs: fields named as in Hugging Face's config.json.

    Keys the dataclass does not name (token ids, dropout rates, `transformers_version`,
    ...) are kept in `extra` as JSON text, so that `to_dict` gives back what
    `from_dict` read; keeping them as text keeps the config hashable, which it must
    be as static data of a model.

    Every field is checked when a config is made, whether from code or from
    config.json: its value must have the field's type (`n_layer: "2"` and
    `n_head: 2.0` are errors), the architecture's `sizes` must be at least 1, and
    each pair of `divides` must divide evenly; the error names the field. An
    architecture's own `__post_init__` calls `super().__post_init__()` first.
    """

    model_type: ClassVar[str] = ""
    architecture: ClassVar[str] = ""
    # Fields that count something (layers, heads, features, positions): >= 1 when set.
    sizes: ClassVar[tuple[str, ...]] = ()
    # (heads, width) pairs: `width` must be a multiple of `heads`, as each head takes
    # an equal share of the features (transformers refuses other configs too).
    divides: ClassVar[tuple[tuple[str, str], ...]] = ()
    # The special tokens' ids transformers' config class takes when config.json gives
    # none (`pad_token_id`, ...); `token_id` reads them and `to_dict` writes them.
    token_ids: ClassVar[Mapping[str, int | None]] = {}
    extra: tuple[tuple[str, str], ...] = ()
    # Not in config.json: the token table and head get rows up to a multiple of this
    # (Megatron-LM's make-vocab-size-divisible-by, 128 x model shards) so that the
    # vocabulary splits evenly; the padded logits are masked and `to_hf` drops the rows.
    vocab_multiple: int = 1

    def __post_init__(self) -> None:
        name = type(self).__name__
        hints = _field_types(type(self))
        for f in dataclasses.fields(self):
            if f.name in hints and f.name != "extra":
                _check_type(name, f.name, getattr(self, f.name), hints[f.name])
        for field in (*self.sizes, "vocab_multiple"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ValueError(
                    f"{name}: {field} must be at least 1, got {value}; fix it in config.json "
                    "(or where the config is built)."
                )
        for heads, width in self.divides:
            h, w = getattr(self, heads), getattr(self, width)
            if h is not None and w is not None and w % h:
                fits = [d for d in range(1, w + 1) if w % d == 0]
                raise ValueError(
                    f"{name}: {width}={w} is not a multiple of {heads}={h} ({w} / {h} = "
                    f"{w / h:.3g}), so the heads cannot share it equally; transformers cannot "
                    f"build this model either. Use a {heads} that divides {w} "
                    f"({', '.join(map(str, fits))}), or change {width}."
                )

    @property
    def padded_vocab_size(self) -> int:
        """`vocab_size` rounded up to a multiple of `vocab_multiple`."""
        vocab = int(getattr(self, "vocab_size"))  # noqa: B009 (each zoo config defines it)
        if self.vocab_multiple < 1:
            raise ValueError(f"vocab_multiple must be >= 1, got {self.vocab_multiple}.")
        return -(-vocab // self.vocab_multiple) * self.vocab_multiple

    @classmethod
    def from_dict(cls: type[_Config], values: Mapping[str, Any]) -> _Config:
        """A config from the parsed `config.json` of a `transformers` model.

        Args:
            values: the JSON object; keys this config does not name go to `extra`.

        Returns:
            The config.

        Raises:
            ValueError: if the config asks for a variant of the architecture that
                redcoast does not implement (the message names the key).

        Example:
            >>> GPT2Config.from_dict(json.load(open("gpt2/config.json"))).n_layer
            12
        """
        values = cls._normalise(dict(values))
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "vocab_multiple"}
        known = {k: v for k, v in values.items() if k in names}
        extra = tuple(
            sorted(
                (k, json.dumps(v))
                for k, v in values.items()
                if k not in names and k not in ("model_type", "architectures")
            )
        )
        return cls(**known, extra=extra)

    @classmethod
    def from_json(cls: type[_Config], path: str | Path) -> _Config:
        """A config from a `config.json` file, or the folder holding one."""
        return cls.from_dict(read_config(path))

    def to_dict(self) -> dict[str, Any]:
        """The `config.json` object `transformers` reads back into the same model."""
        out: dict[str, Any] = {k: json.loads(v) for k, v in self.extra}
        for f in dataclasses.fields(self):
            if f.name not in ("extra", "vocab_multiple"):
                out[f.name] = getattr(self, f.name)
        # Written out whether given or not: transformers would take its own defaults,
        # ids its embedding refuses (a padding row past a small vocabulary).
        out.update({name: self.token_id(name) for name in self.token_ids if name not in out})
        out["model_type"] = self.model_type
        out["architectures"] = [self.architecture]
        return dict(sorted(out.items()))

    @classmethod
    def _normalise(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Map other spellings of a key onto the field name (overridden per architecture)."""
        return values

    def get_extra(self, name: str, default: Any = None) -> Any:
        """A config.json value this config does not name as a field (e.g. `eos_token_id`)."""
        for k, v in self.extra:
            if k == name:
                return json.loads(v)
        return default

    def token_id(self, name: str) -> Any:
        """A special token's id (`pad_token_id`, `bos_token_id`, `eos_token_id`): as
        config.json (or the code building the config) gives it, else transformers'
        default for the architecture (`token_ids`) where the vocabulary has that token,
        else `None`.

        Example:
            >>> Phi3Config(vocab_size=64).token_id("pad_token_id") is None  # 32000 is past it
            True
        """
        if name in {f.name for f in dataclasses.fields(self)}:
            return getattr(self, name)
        if any(k == name for k, _ in self.extra):
            return self.get_extra(name)
        default = self.token_ids.get(name)
        vocab = getattr(self, "vocab_size", None)
        return default if default is not None and vocab is not None and default < vocab else None

    def _require(self, **settings: tuple[Any, Any]) -> None:
        """Raise for each `name=(value, supported)` whose value is not the supported one."""
        for name, (got, want) in settings.items():
            if got != want:
                raise ValueError(
                    f"{type(self).__name__}: {name}={got!r} is not supported (only "
                    f"{name}={want!r}); this variant of {self.model_type} is not implemented."
                )


# A field's type -> the Python values that have it, and how an error calls it.
_TYPES: dict[Any, tuple[tuple[type, ...], str]] = {
    int: ((int,), "an int"),
    float: ((int, float), "a number"),
    bool: ((bool,), "true or false"),
    str: ((str,), "a string"),
}


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_type(config: str, field: str, value: Any, hint: Any) -> None:
    """Raise a `TypeError` naming `field` unless `value` has the type `hint` says."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = typing.get_args(hint) if union else (hint,)
    if value is None and type(None) in options:
        return
    if isinstance(value, tuple) and any(typing.get_origin(t) is tuple for t in options):
        return  # a list in config.json, read as a tuple (a LLaVA's feature layers)
    wanted = [t for t in options if t in _TYPES]
    if not wanted:  # a type this check does not know (the extras, a tuple): not checked
        return
    for t in wanted:
        # bool is an int to Python; a JSON true where a count belongs is still an error.
        if isinstance(value, _TYPES[t][0]) and (t is bool or not isinstance(value, bool)):
            return
    names = [_TYPES[t][1] for t in wanted] + (["null"] if type(None) in options else [])
    quoted = " (without quotes)" if isinstance(value, str) else ""
    raise TypeError(
        f"{config}: {field} must be {' or '.join(names)}, got {value!r} "
        f"({type(value).__name__}); write it as such{quoted} in config.json, or where the "
        "config is built."
    )


def read_config(path: str | Path) -> dict[str, Any]:
    """Parse `config.json` from a checkpoint folder (or the file itself).

    Args:
        path: the folder written by `save_pretrained`, or its `config.json`.

    Returns:
        The JSON object.

    Raises:
        FileNotFoundError: there is no such file.
        ValueError: the file is not JSON, or holds something other than an object;
            the message names the file (and the line).
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"no config.json at {file}; pass the folder written by "
            "`transformers` `save_pretrained` (or by `model.to_hf`)."
        )
    with open(file) as f:
        try:
            values = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{file} is not valid JSON: {err.msg} at line {err.lineno}, column "
                f"{err.colno}. Repair it, or write it again with save_pretrained."
            ) from None
    if not isinstance(values, dict):
        raise ValueError(
            f"{file} holds a JSON {type(values).__name__}, not the object of settings a "
            'config.json holds ({"model_type": ..., ...}).'
        )
    return values
