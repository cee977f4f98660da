"""The settings of an RL run: how completions are sampled, scored into advantages and trained on.

`GRPO` and `RLOO` are frozen records of TRL 1.16's `GRPOConfig` and `RLOOConfig`
settings under the same names and defaults (the ones redcoast computes), each saying
which loss and advantages it uses. The sampling settings are shared.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from .._checks import check_choice, check_positive
from ._advantages import group_advantages, rloo_advantages
from ._losses import LOSS_TYPES, LossType, policy_loss, rloo_loss

__all__ = ["GRPO", "RLOO", "Algorithm"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Sampling:
    """How each prompt's completions are drawn."""

    num_generations: int = 8
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    mask_truncated_completions: bool = False
    num_iterations: int = 1

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_positive(f"{name}: num_generations", self.num_generations, optional=False)
        check_positive(f"{name}: max_new_tokens", self.max_new_tokens, optional=False)
        check_positive(f"{name}: num_iterations", self.num_iterations, optional=False)
        if not isinstance(self.temperature, int | float) or not self.temperature > 0:
            raise ValueError(
                f"{name}: temperature must be > 0 (the policy's samples, and the log-"
                f"probabilities the loss divides by it), got {self.temperature!r}."
            )

    @property
    def sample_options(self) -> dict[str, Any]:
        """`rc.sampling.sample`'s options for these completions (all but the prompts,
        their lengths, `eos_id` and the key)."""
        return {
            "num_samples": self.num_generations,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
        }

    @property
    def needs_reference(self) -> bool:
        """Whether the run computes the reference model's log-probabilities."""
        return float(getattr(self, "beta", 0.0)) > 0

    @property
    def needs_old_logps(self) -> bool:
        """Whether the batch carries the sampling policy's log-probabilities."""
        return self.num_iterations > 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPO(_Sampling):
    """Group Relative Policy Optimization and its relatives, TRL 1.16's `GRPOConfig` names.

    Each prompt's `num_generations` completions are scored, their rewards centred on
    the group's mean (and scaled, `scale_rewards`), and the policy trained on them with
    `rc.rl.policy_loss` (`loss_type`: `"dapo"`, TRL's default, `"grpo"`, `"dr_grpo"`,
    `"bnpo"`, `"cispo"`, `"sapo"`, ...), `num_iterations` optimizer updates on each
    batch of completions. See `policy_loss` and `group_advantages` for the settings.

    Example:
        >>> rc.rl.GRPO(num_generations=8, max_new_tokens=64, loss_type="dr_grpo",
        ...            scale_rewards="none", epsilon_high=0.28)
    """

    loss_type: LossType = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: Literal["token", "sequence"] = "token"
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    scale_rewards: Literal["group", "batch", "none"] = "group"
    reward_weights: Sequence[float] | None = None
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = (
        "sum_then_normalize"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("GRPO: loss_type", self.loss_type, LOSS_TYPES)

    def loss_fn(self) -> Callable[..., Any]:
        """The `loss_fn` of these settings (`rc.rl.policy_loss`, bound)."""
        return functools.partial(
            policy_loss,
            loss_type=self.loss_type,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            delta=self.delta,
            beta=self.beta,
            use_bias_correction_kl=self.use_bias_correction_kl,
            importance_sampling_level=self.importance_sampling_level,
            temperature=self.temperature,
            max_completion_length=self.max_new_tokens,
        )

    def advantages(
        self, rewards: np.ndarray, names: Sequence[str], **_: Any
    ) -> tuple[np.ndarray, dict[str, float]]:
        """The completions' advantages and the reward metrics (`group_advantages`)."""
        return group_advantages(
            rewards,
            self.num_generations,
            scale_rewards=self.scale_rewards,
            weights=self.reward_weights,
            names=names,
            aggregation=self.multi_objective_aggregation,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLOO(_Sampling):
    """REINFORCE Leave-One-Out, TRL 1.16's `RLOOConfig` names and defaults.

    Each completion's baseline is the mean reward of the other completions of its
    prompt; the KL divergence to the reference (`beta`) is subtracted from the reward,
    and the policy trained with `rc.rl.rloo_loss` (PPO's clip on whole completions).

    Example:
        >>> rc.rl.RLOO(num_generations=4, max_new_tokens=64, beta=0.05)
    """

    num_generations: int = 2
    beta: float = 0.05
    epsilon: float = 0.2
    epsilon_high: float | None = None
    normalize_advantages: bool = False
    reward_clip_range: tuple[float, float] | None = None
    reward_weights: Sequence[float] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_generations < 2:
            raise ValueError(
                "RLOO: num_generations must be >= 2: each completion's baseline is the mean "
                f"of the others of its prompt; got {self.num_generations}."
            )

    @property
    def needs_old_logps(self) -> bool:
        # The KL penalty in the reward reads the sampling policy's log-probabilities.
        return self.num_iterations > 1 or self.beta > 0

    def loss_fn(self) -> Callable[..., Any]:
        """The `loss_fn` of these settings (`rc.rl.rloo_loss`, bound)."""
        return functools.partial(
            rloo_loss,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            temperature=self.temperature,
        )

    def advantages(
        self,
        rewards: np.ndarray,
        names: Sequence[str],
        *,
        old_logps: np.ndarray | None = None,
        ref_logps: np.ndarray | None = None,
        completion_mask: np.ndarray | None = None,
    ) -> tuple[np.ndarray, dict[str, float]]:
        """The completions' advantages and the reward metrics (`rloo_advantages`)."""
        return rloo_advantages(
            rewards,
            self.num_generations,
            beta=self.beta,
            logps=old_logps,
            ref_logps=ref_logps,
            completion_mask=completion_mask,
            weights=self.reward_weights,
            names=names,
            normalize=self.normalize_advantages,
            reward_clip_range=self.reward_clip_range,
        )


Algorithm = GRPO | RLOO
