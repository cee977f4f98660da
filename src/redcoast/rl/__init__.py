"""Reinforcement learning from verifiable rewards: GRPO, its relatives, and RLOO.

For each prompt the sampler draws `G` completions, the reward functions score them,
and the policy is pushed towards the better ones. A batch holds one row per
completion, `G` consecutive rows a prompt: `input_ids` (the prompt's tokens, then
the completion's, right-padded), `completion_mask` (1 at the completion's tokens
that count) and `advantages`; per-token arrays are aligned to the tokens.

- `_advantages.py`: rewards to advantages on the host, in NumPy: `group_advantages`
  (GRPO's group baseline, scaled by the group's or the batch's spread or not at all;
  or GDPO's per-function normalisation) and `rloo_advantages` (RLOO's leave-one-out
  baseline, with its KL penalty in the reward), each with the metrics TRL logs.
- `_losses.py`: the policy's `loss_fn`s, pure JAX: `policy_loss` (GRPO, BNPO,
  Dr. GRPO, DAPO, CISPO, SAPO, LUSPO, VESPO; token or sequence (GSPO) importance
  weights; the k3 KL penalty; INTELLECT-2's two-sided clip) and `rloo_loss`; and
  `token_logps`, each token's log-probability under a model (a batch's `old_logps`
  and `ref_logps`).

Every formula, default and metric is TRL 1.16's (`GRPOTrainer`, `RLOOTrainer`); the
tests run TRL's own code on the same numbers.

Example:
    >>> advantages, reward_metrics = rc.rl.group_advantages(rewards, num_generations=8)
    >>> batch = {"input_ids": ids, "completion_mask": mask, "advantages": advantages}
    >>> loss_fn = functools.partial(rc.rl.policy_loss, loss_type="dapo", epsilon_high=0.28)
    >>> step = rc.train_step(loss_fn, optax.adamw(1e-6))
"""

from ._advantages import group_advantages as group_advantages
from ._advantages import rloo_advantages as rloo_advantages
from ._algorithms import GRPO as GRPO
from ._algorithms import RLOO as RLOO
from ._losses import LOSS_TYPES as LOSS_TYPES
from ._losses import LossType as LossType
from ._losses import policy_loss as policy_loss
from ._losses import rloo_loss as rloo_loss
from ._losses import token_logps as token_logps
from ._rewards import RewardFn as RewardFn
from ._rollout import GroupRollout as GroupRollout
from ._train import load_prompts as load_prompts
from ._train import train as train
