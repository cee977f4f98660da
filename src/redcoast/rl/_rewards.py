"""Calling the user's reward functions, TRL's way, with errors that name the function and prompt.

A reward function is `reward(prompts, completions, **fields) -> list[float | None]`:
one prompt and one completion per sampled completion (each prompt repeated for its
group), `completion_ids` their token ids, and each other field of the prompt's record
as a list of the same length. None means "this function does not score this
completion" (TRL's convention): it becomes NaN, which the advantages leave out.
Everything else a function does wrong stops the run with its name and a prompt.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["RewardFn", "reward_names", "score"]

RewardFn = Callable[..., Sequence[float | None]]
"""`reward(prompts, completions, **fields) -> one float (or None) per completion`."""


def reward_names(rewards: Sequence[RewardFn]) -> list[str]:
    """Each function's `__name__` (TRL's metric names), numbered where names repeat."""
    names = [getattr(f, "__name__", type(f).__name__) for f in rewards]
    return [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]


def _shown(prompt: Any) -> str:
    text = repr(prompt)
    return text if len(text) <= 200 else text[:200] + "..."


def _call(
    fn: RewardFn, name: str, prompts: list[Any], completions: list[Any], fields: dict[str, list]
) -> Any:
    """`fn` on the completions; an exception is re-raised naming `fn` and the first prompt
    it fails on (found by scoring the completions one at a time)."""
    try:
        return fn(prompts=prompts, completions=completions, **fields)
    except Exception as err:
        culprit = prompts[0]
        for i in range(len(prompts)):
            one = {k: v[i : i + 1] for k, v in fields.items()}
            try:
                fn(prompts=prompts[i : i + 1], completions=completions[i : i + 1], **one)
            except Exception:
                culprit = prompts[i]
                break
        raise RuntimeError(
            f"reward function {name!r} raised {type(err).__name__}: {err} (on the prompt "
            f"{_shown(culprit)}). A reward function is called as reward(prompts=..., "
            f"completions=..., {', '.join(sorted(fields))}) with one entry per completion; "
            "make it return a float (or None) for each."
        ) from err


def score(
    rewards: Sequence[RewardFn],
    names: Sequence[str],
    prompts: list[Any],
    completions: list[Any],
    fields: Mapping[str, list],
) -> np.ndarray:
    """Every reward function's reward of every completion: `(completions, functions)`
    float64, NaN where a function returned None.

    Args:
        rewards: the functions.
        names: their names, for the errors.
        prompts: one per completion (a prompt repeated for each of its completions).
        completions: the decoded completions.
        fields: `completion_ids` and the records' other fields, one entry per completion.

    Raises:
        RuntimeError: a function raised (naming it and the first prompt it fails on).
        ValueError: a function returned the wrong number of values, a value that is not
            a number or None, or a NaN or infinite one (naming it and the prompt).
    """
    out = np.empty((len(completions), len(rewards)))
    for j, (fn, name) in enumerate(zip(rewards, names, strict=True)):
        got = _call(fn, name, prompts, completions, dict(fields))
        try:
            values = list(got)
        except TypeError:
            values = None
        if values is None or len(values) != len(completions):
            count = "not a sequence" if values is None else f"{len(values)} values"
            raise ValueError(
                f"reward function {name!r} returned {count} for {len(completions)} "
                f"completions (the first of the prompt {_shown(prompts[0])}); it must return "
                "one float (or None) per completion, in order."
            )
        for i, v in enumerate(values):
            if v is None:
                out[i, j] = math.nan
                continue
            if not isinstance(v, int | float | np.number):
                raise ValueError(
                    f"reward function {name!r} returned {v!r} ({type(v).__name__}) for a "
                    f"completion of the prompt {_shown(prompts[i])}; return a float, or None "
                    "for a completion it does not score."
                )
            if not math.isfinite(float(v)):
                raise ValueError(
                    f"reward function {name!r} returned {v} for a completion of the prompt "
                    f"{_shown(prompts[i])}: rewards must be finite numbers (None, not NaN, "
                    "for a completion the function does not score)."
                )
            out[i, j] = float(v)
    return out
