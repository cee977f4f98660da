"""A rollout: what a run makes of each batch, with the model as it stands, before its step.

On-policy reinforcement learning trains on samples of the policy being trained: they
cannot be collated ahead, as supervised rows are. `fit(..., rollout=r)` draws and
collates its batches as always (prompts, say), then before each step calls `r` with
the model of that step and the batch; the step trains on what `r` returns (the
prompts' sampled completions, scored). Everything else of the run (checkpoints,
resume, logging, evaluation, the parallelisms) is `fit`'s own: a rollout is one
function of the model, the batch and a key, so a resumed run draws what the
uninterrupted one drew.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

from jaxtyping import PRNGKeyArray

__all__ = ["Rollout"]


class Rollout(abc.ABC):
    """The batch a step trains on, made from the batch `fit` drew and the model as it is.

    Subclass it (`rc.rl`'s sampler is one) and give `fit(..., rollout=)` an instance.

    Attributes:
        updates_per_batch: optimizer updates the step takes on each batch the rollout
            makes (`rc.train_step`'s `updates_per_batch`: PPO's epochs, GRPO's
            `num_iterations`); a step of the run is one rollout and its updates.
    """

    updates_per_batch: int = 1

    @abc.abstractmethod
    def example(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """A batch of the shapes, dtypes and placement the rollout makes of `batch`.

        `fit` places the model by the sharding rules and compiles the step on it before
        anything is sampled, so its values do not matter (zeros do).

        Args:
            batch: the first batch `fit` drew, as `collate_fn` made it (global arrays).
        """

    @abc.abstractmethod
    def __call__(
        self, model: Any, batch: Mapping[str, Any], key: PRNGKeyArray
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """The batch to train on and metrics to log with the step's.

        Called by every process, before each step, with the step's model (placed on
        the mesh; it must not be changed) and the batch `fit` drew.

        Args:
            model: the model the step will update.
            batch: the step's batch as `collate_fn` made it (global arrays).
            key: this step's own key (the same on every process and on resuming).

        Returns:
            `(batch, metrics)`: global arrays of `example`'s shapes and placement, and
            scalars (Python floats) logged beside the step's metrics.
        """
