"""The examples `redcoast run` offers: found, listed, described and imported.

An example is a file in `examples/` with a `main(...)` whose keyword arguments,
each with a default and a plain type, become the command's options; its
docstring's `Args:` section gives their help. They are read from the source, not
by importing it, so that `--help` stays instant and JAX's backend unstarted.
"""

import ast
import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import click

__all__ = ["Option", "arg_help", "describe", "example_names", "examples_dir", "load_example"]

# `main`'s annotations, as written, and the click type of each.
_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of an example: its name, type, default and help."""

    name: str
    type: type
    default: Any
    help: str


def examples_dir() -> Path:
    """`examples/` next to the package (installed wheel) or at the source tree's root."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "examples", here.parents[1] / "examples"):
        if candidate.is_dir():
            return candidate
    raise click.ClickException(
        "cannot find the examples folder; run from a redcoast source tree or install the wheel."
    )


def example_names() -> list[str]:
    return sorted(p.stem for p in examples_dir().glob("*.py") if not p.stem.startswith("_"))


def load_example(name: str) -> ModuleType:
    """Import `examples/<name>.py`; its folder goes on `sys.path` so examples can share code."""
    folder = examples_dir()
    path = folder / f"{name}.py"
    if not path.is_file():
        raise click.ClickException(f"no example named {name!r}; choose one of {example_names()}.")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(f"redcoast_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as err:
        raise click.ClickException(
            f"example {name!r} needs the package {err.name!r}; install the examples' "
            "dependencies with `pip install 'redcoast[examples]'`."
        ) from err
    return module


def arg_help(docstring: str) -> dict[str, str]:
    """The `Args:` section of a Google-style docstring, as `{name: text}`."""
    lines = docstring.splitlines()
    stripped = [line.strip() for line in lines]
    if "Args:" not in stripped:
        return {}
    body = []
    for line in lines[stripped.index("Args:") + 1 :]:
        if line.strip() and not line.startswith(" "):  # the next section
            break
        if line.strip():
            body.append(line)
    if not body:
        return {}
    indent = min(len(line) - len(line.lstrip()) for line in body)
    out: dict[str, str] = {}
    name = ""
    for line in body:
        if len(line) - len(line.lstrip()) == indent:
            head, _, text = line.strip().partition(":")
            name = head.split()[0]
            out[name] = text.strip()
        else:
            out[name] += " " + line.strip()
    return out


def describe(path: Path) -> tuple[str, list[Option]]:
    """An example's docstring and its `main`'s keyword options, read without importing it.

    Reading the source (not importing the module) keeps `--help` instant and leaves
    JAX's backend unstarted, so `--devices` can still be applied.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    doc = ast.get_docstring(tree) or ""
    mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    if not mains:
        raise click.ClickException(f"{path} has no main(...) function to run.")
    fn = mains[0]
    args = fn.args.args + fn.args.kwonlyargs
    defaults = [None] * (len(fn.args.args) - len(fn.args.defaults)) + list(fn.args.defaults)
    defaults += list(fn.args.kw_defaults)
    helps = arg_help(ast.get_docstring(fn) or "")
    options = []
    for arg, default in zip(args, defaults, strict=True):
        if default is None:
            raise click.ClickException(
                f"{path.name}: main's argument {arg.arg!r} has no default; every option of an "
                "example needs one."
            )
        annotation = ast.unparse(arg.annotation) if arg.annotation else "str"
        base = annotation.removesuffix(" | None")
        if base not in _TYPES:
            raise click.ClickException(
                f"{path.name}: main's argument {arg.arg!r} is annotated {annotation!r}; "
                f"options must be one of {sorted(_TYPES)} (or `... | None`)."
            )
        value = ast.literal_eval(default)
        options.append(Option(arg.arg, _TYPES[base], value, helps.get(arg.arg, "")))
    return doc, options
