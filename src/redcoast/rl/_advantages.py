"""Advantages from rewards: GRPO's group baseline and RLOO's leave-one-out baseline.

Rewards are small (a few numbers a completion), so they are computed on the host in
NumPy, in float64, and the advantages handed to the step as float32. The layout is
the sampler's: `num_generations` consecutive rows a prompt. A reward function that
returned None for a completion is NaN in its column (TRL's convention): the functions
are combined with their weights and `nansum`, a completion every function skipped is
left out of its group's statistics and gets advantage 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import einops
import numpy as np
import numpy.typing as npt
from jax.typing import ArrayLike
from jaxtyping import Float, Real

from .._checks import check_choice, check_positive

__all__ = ["group_advantages", "rloo_advantages"]

Metrics = dict[str, float]

# TRL's: it keeps a group whose rewards are all equal from dividing by zero.
STD_EPS = 1e-4


def _nanmean(x: np.ndarray, axis: int | None = None, keepdims: bool = False) -> np.ndarray:
    """The mean of the non-NaN values, NaN where there are none (silently, like torch)."""
    seen = ~np.isnan(x)
    total = np.where(seen, x, 0.0).sum(axis=axis, keepdims=keepdims)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(total / seen.sum(axis=axis, keepdims=keepdims))


def _nanstd(x: np.ndarray, axis: int | None = None, keepdims: bool = False) -> np.ndarray:
    """The sample standard deviation (Bessel's correction) of the non-NaN values, NaN
    where fewer than two: TRL's `nanstd`."""
    deviation = x - _nanmean(x, axis=axis, keepdims=True)
    variance = _nanmean(deviation**2, axis=axis, keepdims=keepdims)
    count = (~np.isnan(x)).sum(axis=axis, keepdims=keepdims)
    with np.errstate(divide="ignore", invalid="ignore"):
        correction = np.where(count > 1, count / (count - 1), np.nan)
    return np.asarray(np.sqrt(variance * correction))


def _spread(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """`_nanstd`, but zero where there is one value only (a group of one, a batch of
    one): TRL's convention, which calls such a group flat."""
    n = x.size if axis is None else x.shape[axis]
    return _nanstd(x, axis=axis) if n > 1 else np.zeros_like(_nanmean(x, axis=axis))


def _per_function(rewards: Any, num_generations: Any, what: str) -> np.ndarray:
    """The rewards as a `(rows, functions)` float64 array, checked against the groups."""
    check_positive(f"{what}: num_generations", num_generations, optional=False)
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim == 1:
        r = r[:, None]
    if r.ndim != 2 or r.shape[0] == 0 or r.shape[1] == 0:
        raise ValueError(
            f"{what}: rewards must be (rows,) or (rows, n_functions), one row per completion "
            f"and NaN where a function returned None; got shape {np.shape(rewards)}."
        )
    if r.shape[0] % num_generations:
        raise ValueError(
            f"{what}: {r.shape[0]} rows are not whole groups of num_generations="
            f"{num_generations}; rows g*G ... g*G+G-1 must be prompt g's completions."
        )
    return r


def _weights(weights: Sequence[float] | None, n: int, what: str) -> np.ndarray:
    if weights is None:
        return np.ones(n)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,):
        raise ValueError(
            f"{what}: weights must hold one number per reward function ({n}), got {list(w)}."
        )
    return w


def _names(names: Sequence[str] | None, n: int, what: str) -> list[str]:
    if names is None:
        return [f"reward_{i}" for i in range(n)]
    if len(names) != n or len(set(names)) != n:
        raise ValueError(
            f"{what}: names must name each of the {n} reward functions once, got {list(names)}."
        )
    return list(names)


def _weighted_sum(values: np.ndarray, w: np.ndarray, unscored: npt.ArrayLike) -> np.ndarray:
    """Each row's weighted sum of the values it has (`nansum`), NaN on the `unscored`
    rows: those no reward function scored."""
    total = np.where(np.isnan(values), 0.0, values * w).sum(axis=1)
    return np.where(unscored, np.nan, total)


def _reward_metrics(r: np.ndarray, w: np.ndarray, names: list[str]) -> Metrics:
    """What TRL logs of the rewards themselves: each function's mean and spread over
    the completions it scored, and the weighted sum's over the scorable ones."""
    metrics: Metrics = {}
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = float(_nanmean(r[:, i]))
        metrics[f"rewards/{name}/std"] = float(_nanstd(r[:, i]))
    total = _weighted_sum(r, w, np.isnan(r).all(axis=1))
    metrics["reward"] = float(_nanmean(total))
    metrics["reward_std"] = float(_nanstd(total))
    return metrics


def _zero_fraction(std: np.ndarray) -> float:
    # torch.isclose(std, 0)'s tolerance; a NaN spread (one scorable completion) is not zero.
    return float(np.isclose(std, 0.0, rtol=1e-5, atol=1e-8).mean())


def group_advantages(
    rewards: Real[np.ndarray, " rows *functions"] | Sequence[Any],
    num_generations: int,
    *,
    scale_rewards: Literal["group", "batch", "none"] = "group",
    weights: Sequence[float] | None = None,
    names: Sequence[str] | None = None,
    aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize",
) -> tuple[Float[np.ndarray, " rows"], Metrics]:
    """GRPO's advantages: each completion's reward against its group's, as TRL 1.16 has them.

    With `aggregation="sum_then_normalize"` (TRL's default) a completion's reward is
    the weighted sum of its functions' rewards, and its advantage that reward minus
    its group's mean, divided by (the spread + 1e-4) of its group (`"group"`, GRPO), of
    the whole batch (`"batch"`, PPO Lite), or by nothing (`"none"`, Dr. GRPO, which
    finds the division biased towards easy and hard prompts). With
    `"normalize_then_sum"` (GDPO) each function's rewards are first normalised within
    their group, then summed with the weights, and the sums normalised over the
    batch; `scale_rewards` does not apply (as in TRL). Spreads are sample standard
    deviations. Completions no function scored get advantage 0.

    Args:
        rewards: `(rows, n_functions)` (or `(rows,)` for one function): each reward
            function's reward of each completion, NaN where it returned None; rows
            `g*G ... g*G+G-1` are prompt `g`'s `G = num_generations` completions.
        num_generations: completions a prompt, `G`.
        scale_rewards: what the centred rewards are divided by: the group's spread,
            the batch's, or nothing.
        weights: one weight a function (TRL's `reward_weights`); 1 each by default.
        names: one name a function, for the metrics (TRL uses the functions'
            `__name__`); `reward_0`, `reward_1`, ... by default.
        aggregation: TRL's `multi_objective_aggregation`.

    Returns:
        `(advantages, metrics)`: `(rows,)` float32, and the floats TRL logs:
        `rewards/{name}/mean` and `rewards/{name}/std` (each function over the
        completions it scored), `reward` and `reward_std` (the weighted sum), and
        `frac_reward_zero_std` (the fraction of completions whose group, or batch,
        has rewards all alike: no signal).

    Raises:
        ValueError: rows that are not whole groups, or weights, names or settings that
            do not fit.

    References:
        Shao et al. 2024, *DeepSeekMath* (GRPO, arXiv 2402.03300); Liu et al. 2025,
        *Understanding R1-Zero-Like Training: A Critical Perspective* (Dr. GRPO, arXiv
        2503.20783); PPO Lite's batch scaling (arXiv 2508.08221); *GDPO: Group
        reward-Decoupled Normalization Policy Optimization for Multi-reward RL
        Optimization* (arXiv 2601.05242). TRL's
        `GRPOTrainer._generate_and_score_completions` computes the same.

    Example:
        >>> rewards = np.stack([correct(completions), formatted(completions)], axis=1)
        >>> advantages, metrics = rc.rl.group_advantages(
        ...     rewards, 8, weights=[1.0, 0.2], names=["correct", "formatted"])
        >>> batch = {**batch, "advantages": advantages}
    """
    what = "group_advantages"
    r = _per_function(rewards, num_generations, what)
    check_choice(f"{what}: scale_rewards", scale_rewards, ("group", "batch", "none"))
    check_choice(f"{what}: aggregation", aggregation, ("sum_then_normalize", "normalize_then_sum"))
    w, names = _weights(weights, r.shape[1], what), _names(names, r.shape[1], what)
    g, unscored = num_generations, np.isnan(r).all(axis=1)
    if aggregation == "sum_then_normalize":
        total = _weighted_sum(r, w, unscored)
        grouped = einops.rearrange(total, "(prompts g) -> prompts g", g=g)
        if scale_rewards == "batch":
            std = np.full_like(total, _spread(total))
        else:  # "none" divides by nothing, but its spread still says which groups are flat
            std = np.repeat(_spread(grouped, axis=1), g)
        advantages = total - np.repeat(_nanmean(grouped, axis=1), g)
        if scale_rewards != "none":
            advantages = advantages / (std + STD_EPS)
    else:
        grouped = einops.rearrange(r, "(prompts g) f -> prompts g f", g=g)
        mean = _nanmean(grouped, axis=1, keepdims=True)
        spread = _nanstd(grouped, axis=1, keepdims=True) if g > 1 else np.zeros_like(mean)
        normed = einops.rearrange((grouped - mean) / (spread + STD_EPS), "p g f -> (p g) f")
        total = _weighted_sum(normed, w, unscored)
        std = np.full_like(total, _spread(total))
        advantages = (total - _nanmean(total)) / (std + STD_EPS)
    metrics = _reward_metrics(r, w, names) | {"frac_reward_zero_std": _zero_fraction(std)}
    return np.nan_to_num(advantages, nan=0.0).astype(np.float32), metrics


def _sequence_kl(
    logps: ArrayLike | None, ref_logps: ArrayLike | None, mask: ArrayLike | None, rows: int
) -> tuple[np.ndarray, float]:
    """Each completion's summed `log p - log ref` over its counted tokens, and the mean
    per token: RLOO's first-order KL estimate."""
    if logps is None or ref_logps is None or mask is None:
        raise ValueError(
            "rloo_advantages with beta > 0 takes the KL penalty from logps, ref_logps and "
            "completion_mask, each (rows, seq): the sampling policy's and the reference's "
            "log-probabilities of each token (rc.rl.token_logps) and the completions' mask. "
            "Pass them, or beta=0.0 for no penalty."
        )
    lp, ref = np.asarray(logps, np.float64), np.asarray(ref_logps, np.float64)
    m = np.asarray(mask).astype(np.float64)
    if not lp.shape == ref.shape == m.shape or lp.ndim != 2 or lp.shape[0] != rows:
        raise ValueError(
            f"rloo_advantages: logps {lp.shape}, ref_logps {ref.shape} and completion_mask "
            f"{m.shape} must all be (rows, seq) with the rewards' {rows} rows."
        )
    per_token = np.where(m > 0, lp - ref, 0.0) * m
    return per_token.sum(axis=1), float(per_token.sum() / max(m.sum(), 1.0))


def rloo_advantages(
    rewards: Real[np.ndarray, " rows *functions"] | Sequence[Any],
    num_generations: int,
    *,
    beta: float = 0.05,
    logps: Float[ArrayLike, "rows seq"] | None = None,
    ref_logps: Float[ArrayLike, "rows seq"] | None = None,
    completion_mask: ArrayLike | None = None,
    weights: Sequence[float] | None = None,
    names: Sequence[str] | None = None,
    normalize: bool = False,
    reward_clip_range: tuple[float, float] | None = None,
) -> tuple[Float[np.ndarray, " rows"], Metrics]:
    """RLOO's advantages: each reward against the mean of its group's other rewards.

    As TRL 1.16's `RLOOTrainer`: a completion's reward is the weighted sum of its
    functions' rewards, clipped to `reward_clip_range` if given, minus `beta` times
    its KL estimate `sum_t (log p(y_t) - log ref(y_t))` over its tokens (the
    sampling policy's log-probabilities; the first-order estimate of the RLOO paper,
    which can be negative); its advantage is that minus the mean of the other
    completions of its group that were scored. With `normalize` the advantages are
    then standardised over the batch (with 1e-4 added to the spread). A completion no
    function scored, or alone in its group in being scored, gets advantage 0.

    Args:
        rewards: `(rows, n_functions)` or `(rows,)`, NaN where a function returned
            None; `num_generations` consecutive rows a prompt.
        num_generations: completions a prompt.
        beta: the KL penalty's weight (TRL's default, 0.05); 0 for none.
        logps: `(rows, seq)`, the sampling policy's log-probability of each token
            (`rc.rl.token_logps`, at the sampling temperature); needed when `beta > 0`.
        ref_logps: `(rows, seq)`, the reference model's, alike.
        completion_mask: `(rows, seq)`, 1 at the completions' counted tokens.
        weights: one weight a function; 1 each by default.
        names: one name a function, for the metrics.
        normalize: standardise the advantages over the batch (TRL's
            `normalize_advantages`).
        reward_clip_range: `(low, high)` to clip the summed rewards to, before the
            KL penalty.

    Returns:
        `(advantages, metrics)`: `(rows,)` float32, and TRL's metrics:
        `rewards/{name}/mean`, `rewards/{name}/std`, `reward`, `reward_std` (of the
        weighted sums, before clipping and penalty), `frac_reward_zero_std` (of the
        groups, after them) and, when `beta > 0`, `kl` (the mean per token).

    Raises:
        ValueError: rows that are not whole groups, a setting out of range, or
            `beta > 0` without the log-probabilities.

    References:
        Ahmadian et al. 2024, *Back to Basics: Revisiting REINFORCE Style Optimization
        for Learning from Human Feedback in LLMs* (arXiv 2402.14740); Kool et al. 2019,
        *Buy 4 REINFORCE Samples, Get a Baseline for Free!* TRL's
        `RLOOTrainer._generate_and_score_completions` computes the same.

    Example:
        >>> logps = rc.rl.token_logps(model, batch["input_ids"])
        >>> ref = rc.rl.token_logps(reference, batch["input_ids"])
        >>> advantages, metrics = rc.rl.rloo_advantages(
        ...     rewards, 4, logps=logps, ref_logps=ref, completion_mask=batch["completion_mask"])
    """
    what = "rloo_advantages"
    r = _per_function(rewards, num_generations, what)
    if not isinstance(beta, int | float) or not np.isfinite(beta) or beta < 0:
        raise ValueError(f"{what}: beta must be a finite number >= 0, got {beta!r}.")
    if reward_clip_range is not None and not (
        len(reward_clip_range) == 2 and reward_clip_range[0] <= reward_clip_range[1]
    ):
        raise ValueError(
            f"{what}: reward_clip_range must be (low, high) with low <= high, "
            f"got {reward_clip_range!r}."
        )
    w, names = _weights(weights, r.shape[1], what), _names(names, r.shape[1], what)
    metrics = _reward_metrics(r, w, names)
    total = _weighted_sum(r, w, np.isnan(r).all(axis=1))
    if reward_clip_range is not None:
        total = np.clip(total, *reward_clip_range)
    if beta:
        kl, metrics["kl"] = _sequence_kl(logps, ref_logps, completion_mask, r.shape[0])
        total = total - beta * kl
    g = num_generations
    grouped = einops.rearrange(total, "(prompts g) -> prompts g", g=g)
    if g > 1:
        scored = (~np.isnan(grouped)).sum(axis=1, keepdims=True)
        others = np.where(np.isnan(grouped), 0.0, grouped).sum(axis=1, keepdims=True) - grouped
        with np.errstate(divide="ignore", invalid="ignore"):
            baseline = others / (scored - 1)
        advantages = total - einops.rearrange(baseline, "prompts g -> (prompts g)")
    else:
        advantages = np.zeros_like(total)
    if normalize:
        advantages = (advantages - _nanmean(advantages)) / (_nanstd(advantages) + STD_EPS)
    metrics["frac_reward_zero_std"] = _zero_fraction(_spread(grouped, axis=1))
    return np.nan_to_num(advantages, nan=0.0).astype(np.float32), metrics
