"""Dotted paths of pytree leaves: the names that plans, checkpoints and filters use.

A leaf's path is the field names, sequence indices and dict keys from the root to
it, joined with dots: `blocks.0.attn.query_proj.weight`. Sharding plans report
and override weights by it, checkpoints key their tensors by it, and trainable
and LoRA filters match globs against it.
"""

import fnmatch
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PyTree

__all__ = ["array_leaves", "glob_matches", "leaves_with_paths", "path_str", "target_globs"]


def _key_str(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(path: tuple[Any, ...]) -> str:
    """`blocks.0.attn.query_proj.weight` for a JAX key path."""
    return ".".join(_key_str(k) for k in path)


def leaves_with_paths(
    tree: PyTree, is_leaf: Callable[[Any], bool] | None = None
) -> list[tuple[str, Any]]:
    """Every leaf of `tree` with its dotted path, in `jax.tree_util` flattening order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(path_str(p), leaf) for p, leaf in flat]


def array_leaves(tree: PyTree) -> list[tuple[str, Any]]:
    """The array leaves of `tree` (`eqx.is_array`), each with its dotted path."""
    return leaves_with_paths(eqx.filter(tree, eqx.is_array))


def glob_matches(path: str, glob: str) -> bool:
    """Whether `glob` matches `path`; a bare name matches the end of a path, as PEFT's
    `target_modules` do (`"q_proj"` matches `blocks.0.attn.q_proj`)."""
    return fnmatch.fnmatchcase(path, glob) or fnmatch.fnmatchcase(path, "*." + glob)


def target_globs(targets: Any) -> list[str]:
    """`targets`, a glob or a sequence of globs, as a list of globs; a `TypeError` for
    an empty sequence or one holding anything but strings."""
    globs = [targets] if isinstance(targets, str) else list(targets)
    if not globs or not all(isinstance(g, str) for g in globs):
        raise TypeError(
            "targets must be a glob, a sequence of globs, or a predicate "
            f"(path, linear) -> bool; got {targets!r}."
        )
    return globs
