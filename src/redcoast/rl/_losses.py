"""The policy's loss on sampled completions: GRPO and its relatives, and RLOO's.

A batch holds one row per completion: `input_ids`, the prompt's tokens followed by
the completion's and then padding (right-padded, so a row's positions are 0, 1, ...
as it was sampled); `completion_mask`, 1 at the completion's tokens that count (not
at the prompt, the padding, or after the end-of-sequence token); and `advantages`,
one a row (`group_advantages`, `rloo_advantages`). Per-token arrays are aligned to
the tokens: `logps[:, t]` is `log p(input_ids[:, t] | input_ids[:, :t])`, and 0 at
position 0. Optional: `old_logps`, the sampling policy's (when a batch is trained on
more than once; without them the ratio to it is 1, with the gradient of the current
policy's), `ref_logps`, the reference model's (for the KL penalty), and
`tokens_per_row`, on every row the mean number of completion tokens a row of the whole
optimizer step's batch counts (for the losses normalised by the step's token count,
whatever micro-batches or data shards the step splits the batch into).

Log-probabilities and entropies are float32, from the logits divided by the
sampling temperature, as TRL 1.16's `GRPOTrainer` and `RLOOTrainer` compute them.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._checks import check_choice, check_positive

__all__ = ["policy_loss", "rloo_loss", "token_logps"]

Model = Callable[[Int[Array, " seq"]], Float[Array, "seq vocab"]]
Metrics = dict[str, Float[Array, ""]]
LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
# PPO's clipped surrogate, with its clip-ratio metrics.
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
KEYS = ("input_ids", "completion_mask", "advantages")


# ----------------------------------------------------------------------------- log-probs


def _logps_and_entropy(
    model: Model, input_ids: Int[Array, "rows seq"], temperature: float
) -> tuple[Float[Array, "rows seq"], Float[Array, "rows seq"]]:
    """Each token's log-probability given those before it, and the entropy of the
    distribution it was drawn from, both float32 and 0 at position 0."""
    logits = jax.vmap(model)(input_ids)[:, :-1].astype(jnp.float32) / temperature
    log_p = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_p, input_ids[:, 1:, None], axis=-1)[..., 0]
    # A metric only: no gradient flows back through the whole distribution.
    log_p = jax.lax.stop_gradient(log_p)
    entropy = -jnp.sum(jnp.where(log_p > -jnp.inf, jnp.exp(log_p) * log_p, 0.0), axis=-1)
    first = jnp.zeros_like(picked[:, :1])
    return jnp.concatenate([first, picked], axis=1), jnp.concatenate([first, entropy], axis=1)


def token_logps(
    model: Model, input_ids: Int[ArrayLike, "rows seq"], *, temperature: float = 1.0
) -> Float[Array, "rows seq"]:
    """Each token's log-probability under `model`, aligned to the tokens.

    What a batch's `old_logps` (the sampling policy's, kept when a batch is trained
    on more than once) and `ref_logps` (the reference model's) hold.

    Args:
        model: a decoder called on one sequence of ids, returning `(seq, vocab)` logits.
        input_ids: `(rows, seq)`, right-padded rows of prompt and completion.
        temperature: the sampling temperature; the logits are divided by it, as
            TRL does for the policy and the reference alike.

    Returns:
        `(rows, seq)` float32: `log p(input_ids[:, t] | input_ids[:, :t])` at `t`, and
        0 at position 0.

    Example:
        >>> ref_logps = eqx.filter_jit(rc.rl.token_logps)(reference, batch["input_ids"])
        >>> batch = {**batch, "ref_logps": ref_logps}
    """
    _check_number("token_logps: temperature", temperature, low=0.0)
    return _logps_and_entropy(model, jnp.asarray(input_ids), temperature)[0]


# ----------------------------------------------------------------------------- the batch


@dataclasses.dataclass(frozen=True)
class _Rollout:
    """A batch's completions as the losses see them: float32 per token, aligned to the
    tokens and zero outside the counted ones (so ratios there are exactly 1)."""

    logps: Float[Array, "rows seq"]  # the policy being trained, with gradient
    old: Float[Array, "rows seq"]  # the policy that sampled the completions
    ref: Float[Array, "rows seq"] | None  # the reference, when the KL penalty needs it
    entropy: Float[Array, "rows seq"]
    mask: Float[Array, "rows seq"]
    advantages: Float[Array, "rows 1"]
    tokens_per_row: Float[Array, ""] | None  # the optimizer step's, if given


def _field(batch: Mapping[str, Any], key: str, shape: tuple[int, ...], what: str) -> Array:
    x = jnp.asarray(batch[key])
    if x.shape != shape:
        each = "a row" if len(shape) == 1 else "a token"
        raise ValueError(
            f"{what}: the batch's {key!r} is {x.shape}; it must be {shape}, one {each} of "
            "input_ids."
        )
    return x


def _rollout(model: Model, batch: Mapping[str, Any], temperature: float, what: str) -> _Rollout:
    missing = [k for k in KEYS if k not in batch]
    if missing:
        raise ValueError(
            f"{what} reads {list(KEYS)} from the batch; it lacks {missing} (it has "
            f"{sorted(batch)}). A row is one sampled completion: 'input_ids' the prompt's "
            "tokens followed by the completion's, right-padded; 'completion_mask' 1 at the "
            "completion's tokens that count; 'advantages' from rc.rl.group_advantages (or "
            "rc.rl.rloo_advantages)."
        )
    ids = jnp.asarray(batch["input_ids"])
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(
            f"{what}: input_ids must be (rows, seq) integers, got {ids.dtype}{ids.shape}."
        )
    mask = _field(batch, "completion_mask", ids.shape, what).astype(jnp.float32)
    advantages = _field(batch, "advantages", ids.shape[:1], what).astype(jnp.float32)
    counted = mask > 0
    given = {
        key: jnp.where(counted, _field(batch, key, ids.shape, what).astype(jnp.float32), 0.0)
        for key in ("old_logps", "ref_logps")
        if key in batch
    }
    tokens_per_row = None
    if "tokens_per_row" in batch:
        per_row = _field(batch, "tokens_per_row", ids.shape[:1], what)
        tokens_per_row = per_row.astype(jnp.float32).max()
    logps, entropy = _logps_and_entropy(model, ids, temperature)
    logps = jnp.where(counted, logps, 0.0)
    return _Rollout(
        logps=logps,
        old=given.get("old_logps", jax.lax.stop_gradient(logps)),
        ref=given.get("ref_logps"),
        entropy=entropy,
        mask=mask,
        advantages=advantages[:, None],
        tokens_per_row=tokens_per_row,
    )


# ----------------------------------------------------------------------------- settings


def _check_number(name: str, value: Any, *, low: float, inclusive: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (value == low and not inclusive):
        bound = f">= {low:g}" if inclusive else f"> {low:g}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class _Settings:
    """`policy_loss`'s settings, `epsilon_high` resolved."""

    loss_type: str
    epsilon: float
    epsilon_high: float
    delta: float | None
    beta: float
    use_bias_correction_kl: bool
    importance_sampling_level: str
    temperature: float
    max_completion_length: int | None
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float

    @property
    def sequence(self) -> bool:
        return self.importance_sampling_level == "sequence"


def _check_settings(s: _Settings) -> None:
    """Raise on a setting out of range; warn of the combinations TRL 1.16 warns of
    (and runs)."""
    what = "policy_loss"
    hint = (
        "dapo (TRL's default) divides the summed token losses by the step's token count; "
        "grpo averages each completion's tokens first."
    )
    check_choice(f"{what}: loss_type", s.loss_type, LOSS_TYPES, hint)
    check_choice(
        f"{what}: importance_sampling_level", s.importance_sampling_level, ("token", "sequence")
    )
    positive = (
        "epsilon",
        "epsilon_high",
        "temperature",
        "sapo_temperature_pos",
        "sapo_temperature_neg",
    )
    for name in positive:
        _check_number(f"{what}: {name}", getattr(s, name), low=0.0)
    for name in ("beta", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
        _check_number(f"{what}: {name}", getattr(s, name), low=0.0, inclusive=True)
    if s.delta is not None:
        if s.loss_type not in CLIPPED:
            raise ValueError(
                f"{what}: delta caps the ratio of the clipped losses {list(CLIPPED)}; "
                f"loss_type={s.loss_type!r} has no use for it."
            )
        _check_number(f"{what}: delta (INTELLECT-2's two-sided clip)", s.delta, low=1.0)
    check_positive(f"{what}: max_completion_length", s.max_completion_length)
    if s.loss_type == "dr_grpo" and s.max_completion_length is None:
        raise ValueError(
            f"{what}: loss_type='dr_grpo' divides the summed token losses by rows x "
            "max_completion_length; pass the sampler's max_completion_length."
        )
    if s.sequence and s.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        warnings.warn(
            f"{what}: with importance_sampling_level='sequence', loss_type={s.loss_type!r} "
            "sums per-token terms, which weights each completion by its length instead of "
            "optimising the per-sequence objective; GSPO's setup is loss_type='grpo'.",
            stacklevel=3,
        )
    if s.loss_type == "luspo" and not s.sequence:
        warnings.warn(
            f"{what}: LUSPO is defined with importance_sampling_level='sequence'.", stacklevel=3
        )
    if s.loss_type == "vespo" and s.sequence:
        warnings.warn(
            f"{what}: VESPO weighs whole sequences itself; importance_sampling_level should "
            "be 'token'.",
            stacklevel=3,
        )


# ----------------------------------------------------------------------------- the pieces


def _mean(x: Float[Array, " rows #seq"], mask: Float[Array, "rows seq"]) -> Float[Array, ""]:
    """TRL's batch mean of a metric: over the counted tokens of a per-token `x`, over
    the rows of a per-sequence one."""
    if x.shape[1] == 1:
        return x.mean()
    return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def _per_row(
    x: Float[Array, " rows #seq"], mask: Float[Array, "rows seq"]
) -> Float[Array, " rows"]:
    """Each row's mean over its counted tokens; NaN for a row with none, which the
    clip metrics' `nanmin` and `nanmax` skip, as TRL's do."""
    if x.shape[1] == 1:
        return x[:, 0]
    count = mask.sum(-1)
    return jnp.where(count > 0, (x * mask).sum(-1) / jnp.maximum(count, 1.0), jnp.nan)


def _log_weights(r: _Rollout, sequence: bool) -> Float[Array, " rows #seq"]:
    """The log importance weight of the current policy over the sampling one: per
    token, or per completion as the mean over its tokens (GSPO)."""
    log_ratio = r.logps - r.old
    if not sequence:
        return log_ratio
    return (log_ratio * r.mask).sum(-1, keepdims=True) / jnp.maximum(
        r.mask.sum(-1, keepdims=True), 1.0
    )


def _k3(r: _Rollout) -> Float[Array, "rows seq"]:
    """Schulman's k3 estimate of KL(policy || reference) per token: unbiased, >= 0."""
    assert r.ref is not None
    d = r.ref - r.logps
    return jnp.exp(d) - d - 1.0


def _clip_metrics(coef: Float[Array, " rows #seq"], r: _Rollout, s: _Settings) -> Metrics:
    low = ((coef < 1 - s.epsilon) & (r.advantages < 0)).astype(jnp.float32)
    high = ((coef > 1 + s.epsilon_high) & (r.advantages > 0)).astype(jnp.float32)
    return {
        "clip_ratio/low_mean": _mean(low, r.mask),
        "clip_ratio/high_mean": _mean(high, r.mask),
        "clip_ratio/region_mean": _mean(jnp.maximum(low, high), r.mask),
        "clip_ratio/low_min": jnp.nanmin(_per_row(low, r.mask)),
        "clip_ratio/high_max": jnp.nanmax(_per_row(high, r.mask)),
    }


def _gamma_weights(r: _Rollout, s: _Settings) -> Float[Array, "rows 1"]:
    """VESPO's weight of each completion, `phi(w) = exp(lambda) w^k exp(-lambda w)` of its
    sequence-level ratio `w` (so `phi(1) = 1`), in log space and without gradient."""
    log_w = (jnp.clip(r.logps - r.old, -20.0, 20.0) * r.mask).sum(-1, keepdims=True)
    log_w = jnp.clip(log_w, math.log(1e-8), 20.0)
    up = r.advantages >= 0
    k = jnp.where(up, s.vespo_k_pos, s.vespo_k_neg)
    lam = jnp.maximum(jnp.where(up, s.vespo_lambda_pos, s.vespo_lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jax.lax.stop_gradient(jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0))


def _surrogate(
    coef: Float[Array, " rows #seq"], r: _Rollout, s: _Settings
) -> tuple[Float[Array, " rows #seq"], Metrics]:
    """The policy term of each token's loss (to be minimised), and its metrics."""
    a = r.advantages
    if s.loss_type == "cispo":
        # CISPO clips the weight, not the update: every token keeps its gradient.
        weight = jax.lax.stop_gradient(jnp.minimum(coef, s.epsilon_high))
        clipped = ((coef > s.epsilon_high) & (a > 0)).astype(jnp.float32)
        return -weight * a * r.logps, {"cispo_clip_ratio": _mean(clipped, r.mask)}
    if s.loss_type == "sapo":
        tau = jnp.where(a > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
        return -jax.nn.sigmoid(tau * (coef - 1.0)) * 4.0 / tau * a, {}
    if s.loss_type == "vespo":
        phi = _gamma_weights(r, s)
        return -phi * a * r.logps, {"vespo/phi_seq_mean": phi.mean()}
    clipped = jnp.clip(coef, 1 - s.epsilon, 1 + s.epsilon_high)
    if s.delta is not None:
        coef = jnp.minimum(coef, s.delta)
    return -jnp.minimum(coef * a, clipped * a), _clip_metrics(coef, r, s)


def _reduce(per_token: Float[Array, " rows #seq"], r: _Rollout, s: _Settings) -> Float[Array, ""]:
    """The batch's loss from the per-token losses, normalised as `loss_type` says."""
    summed = per_token * r.mask
    if s.loss_type in ("grpo", "sapo"):
        return (summed.sum(-1) / jnp.maximum(r.mask.sum(-1), 1.0)).mean()
    if s.loss_type == "bnpo":
        return summed.sum() / jnp.maximum(r.mask.sum(), 1.0)
    if s.loss_type == "dr_grpo":
        assert s.max_completion_length is not None
        return summed.sum() / (summed.shape[0] * s.max_completion_length)
    if s.loss_type == "luspo":
        return summed.sum(-1).mean()
    # The step averages equal micro-batches' (and data shards') losses: each one's share
    # of the step's token count is its rows times the step's tokens per row.
    rows = summed.shape[0]
    total = r.mask.sum() if r.tokens_per_row is None else r.tokens_per_row * rows
    return summed.sum() / jnp.maximum(total, 1.0)


# ----------------------------------------------------------------------------- the losses


def policy_loss(
    model: Model,
    batch: Mapping[str, Any],
    key: PRNGKeyArray | None = None,
    *,
    loss_type: LossType = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    use_bias_correction_kl: bool = True,
    importance_sampling_level: Literal["token", "sequence"] = "token",
    temperature: float = 1.0,
    max_completion_length: int | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
) -> tuple[Float[Array, ""], Metrics]:
    """GRPO's policy loss and its relatives on a batch of sampled completions: a `loss_fn`.

    With `w` the importance weight `pi(y_t) / pi_old(y_t)` of each token (or, with
    `importance_sampling_level="sequence"`, GSPO's `exp` of the mean log-ratio over
    the completion, shared by its tokens) and `A` the completion's advantage, each
    counted token's loss is

    - `grpo`, `bnpo`, `dr_grpo`, `dapo`, `luspo`: PPO's clipped surrogate
      `-min(w A, clip(w, 1 - epsilon, 1 + epsilon_high) A)`, `w` first capped at
      `delta` when given (INTELLECT-2's two-sided clip);
    - `cispo`: `-min(w, epsilon_high) A log pi(y_t)`, the capped weight without
      gradient (MiniMax-M1; `epsilon_high` is its epsilon_max, about 5);
    - `sapo`: `-4 sigmoid(tau (w - 1)) / tau A`, a soft gate for the clip, `tau` the
      temperature for positive or for other advantages;
    - `vespo`: `-phi(W) A log pi(y_t)`, `phi` a gamma-shaped weight of the completion's
      whole ratio `W`, without gradient;

    plus, with `beta > 0`, `beta` times the k3 estimate `exp(r) - r - 1` (`r = log
    ref(y_t) - log pi(y_t)`) of the KL divergence to the reference, multiplied by `w`
    when `use_bias_correction_kl` (DeepSeek-V3.2's unbiased gradient; TRL's default).
    The batch's loss is then the mean over completions of each one's mean over its
    tokens (`grpo`, `sapo`), the sum over all tokens divided by the batch's token
    count (`bnpo`), by rows x `max_completion_length` (`dr_grpo`), by the optimizer
    step's token count (`dapo`, `cispo`, `vespo`), or the mean over completions of
    each one's sum (`luspo`). All as TRL 1.16's `GRPOTrainer` computes them.

    Args:
        model: a decoder called on one sequence of ids, returning `(seq, vocab)` logits.
        batch: `input_ids` `(rows, seq)`, `completion_mask` `(rows, seq)` and
            `advantages` `(rows,)`; optionally `old_logps` and `ref_logps` `(rows, seq)`
            (`token_logps` of the sampling policy and the reference) and
            `tokens_per_row` `(rows,)`: on each row, the optimizer step's completion
            tokens over its rows. The step averages the losses of its micro-batches
            (and, under `data_parallel="shard_map"`, of its data shards), so `dapo`,
            `cispo` and `vespo` divide a part's token sum by its rows times this
            figure, and the step's loss is its token sum over its token count however
            it is split. Without it a batch divides by its own count: right for a
            step that does not split it.
        key: unused; there for `fit`'s signature.
        loss_type: the loss, above.
        epsilon: the clip's lower width (and upper, unless `epsilon_high`).
        epsilon_high: the clip's upper width (DAPO's clip-higher recommends 0.28);
            CISPO's cap.
        delta: the cap of the unclipped ratio, > 1.
        beta: the KL penalty's weight; > 0 needs `ref_logps` in the batch.
        use_bias_correction_kl: multiply the KL estimate by the importance weight.
        importance_sampling_level: `"token"` or `"sequence"` (GSPO).
        temperature: the sampling temperature, which the logits are divided by.
        max_completion_length: the sampler's longest completion; `dr_grpo` needs it.
        sapo_temperature_pos: SAPO's temperature for positive advantages.
        sapo_temperature_neg: SAPO's temperature for the others.
        vespo_k_pos: VESPO's power for advantages >= 0.
        vespo_lambda_pos: VESPO's decay for advantages >= 0.
        vespo_k_neg: VESPO's power for negative advantages.
        vespo_lambda_neg: VESPO's decay for negative advantages.

    Returns:
        `(loss, metrics)`, float32 scalars named as TRL logs them, over the batch this
        function sees: `entropy` (mean over counted tokens), `kl` (when `beta > 0`),
        and for the clipped losses `clip_ratio/low_mean`, `clip_ratio/high_mean`,
        `clip_ratio/region_mean` (the fraction of tokens, or of completions at the
        sequence level, whose update the clip stopped), `clip_ratio/low_min` and
        `clip_ratio/high_max` (over completions); `cispo_clip_ratio` for `cispo`,
        `vespo/phi_seq_mean` for `vespo`.

    Raises:
        ValueError: a setting out of range, a batch without the keys or of the wrong
            shapes, or `beta > 0` without `ref_logps`.

    Warns:
        UserWarning: the combinations TRL warns of (a token-summing loss at the
            sequence level, `luspo` at the token level, `vespo` at the sequence level).

    References:
        Shao et al. 2024, *DeepSeekMath* (GRPO, arXiv 2402.03300); Yu et al. 2025,
        *DAPO: An Open-Source LLM Reinforcement Learning System at Scale* (arXiv
        2503.14476); Liu et al. 2025, *Understanding R1-Zero-Like Training* (Dr. GRPO,
        arXiv 2503.20783); Zheng et al. 2025, *Group Sequence Policy Optimization*
        (GSPO, arXiv 2507.18071); MiniMax 2025, *MiniMax-M1* (CISPO, arXiv 2506.13585);
        *Soft Adaptive Policy Optimization* (SAPO, arXiv 2511.20347); *INTELLECT-2*
        (arXiv 2505.07291); *DeepSeek-V3.2* (arXiv 2512.02556); LUSPO (arXiv
        2602.05261); VESPO (arXiv 2602.10693); Schulman 2020, *Approximating KL
        Divergence* (k3). TRL's `GRPOTrainer._compute_loss` (1.16) computes the same.

    Example:
        >>> loss_fn = functools.partial(rc.rl.policy_loss, loss_type="dapo", epsilon_high=0.28)
        >>> step = rc.train_step(loss_fn, optax.adamw(1e-6))
        >>> model, opt_state, metrics = step(model, opt_state, batch, key)
    """
    del key
    s = _Settings(
        loss_type=loss_type,
        epsilon=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        delta=delta,
        beta=beta,
        use_bias_correction_kl=use_bias_correction_kl,
        importance_sampling_level=importance_sampling_level,
        temperature=temperature,
        max_completion_length=max_completion_length,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg,
    )
    _check_settings(s)
    if s.beta > 0 and "ref_logps" not in batch:
        raise ValueError(
            f"policy_loss(beta={s.beta}) penalises the KL divergence to the reference, from "
            f"the batch's 'ref_logps', which it lacks (it has {sorted(batch)}). Add "
            "rc.rl.token_logps(reference, input_ids, temperature=...) as 'ref_logps', or "
            "pass beta=0.0."
        )
    r = _rollout(model, batch, s.temperature, "policy_loss")
    coef = jnp.exp(_log_weights(r, s.sequence))
    per_token, metrics = _surrogate(coef, r, s)
    if s.beta > 0:
        kl = _k3(r) * coef if s.use_bias_correction_kl else _k3(r)
        per_token = per_token + s.beta * kl
        metrics["kl"] = _mean(kl, r.mask)
    metrics["entropy"] = _mean(r.entropy, r.mask)
    return _reduce(per_token, r, s), jax.lax.stop_gradient(metrics)


def rloo_loss(
    model: Model,
    batch: Mapping[str, Any],
    key: PRNGKeyArray | None = None,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    temperature: float = 1.0,
) -> tuple[Float[Array, ""], Metrics]:
    """RLOO's policy loss: PPO's clipped surrogate on whole completions, a `loss_fn`.

    The importance weight is that of the whole completion, `w = pi(y) / pi_old(y)`
    (its tokens' log-probabilities summed), and the loss the mean over completions of
    `-min(w A, clip(w, 1 - epsilon, 1 + epsilon_high) A)`, `A` from
    `rloo_advantages` (which carries the KL penalty in the reward): TRL 1.16's
    `RLOOTrainer._compute_loss`.

    Args:
        model: a decoder called on one sequence of ids, returning `(seq, vocab)` logits.
        batch: `input_ids`, `completion_mask` `(rows, seq)`, `advantages` `(rows,)`,
            and optionally the sampling policy's `old_logps` `(rows, seq)`.
        key: unused; there for `fit`'s signature.
        epsilon: the clip's lower width (and upper, unless `epsilon_high`).
        epsilon_high: the clip's upper width.
        temperature: the sampling temperature, which the logits are divided by.

    Returns:
        `(loss, metrics)`: `entropy` (mean over counted tokens), and over completions
        `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean`,
        `clip_ratio/low_min`, `clip_ratio/high_max`.

    Raises:
        ValueError: a setting out of range, or a batch without the keys.

    References:
        Ahmadian et al. 2024, *Back to Basics: Revisiting REINFORCE Style Optimization
        for Learning from Human Feedback in LLMs* (arXiv 2402.14740).

    Example:
        >>> loss_fn = functools.partial(rc.rl.rloo_loss, epsilon=0.2)
    """
    del key
    _check_number("rloo_loss: epsilon", epsilon, low=0.0)
    if epsilon_high is not None:
        _check_number("rloo_loss: epsilon_high", epsilon_high, low=0.0)
    _check_number("rloo_loss: temperature", temperature, low=0.0)
    high = epsilon if epsilon_high is None else epsilon_high
    r = _rollout(model, batch, temperature, "rloo_loss")
    coef = jnp.exp((r.logps - r.old).sum(-1))
    a = r.advantages[:, 0]
    clipped = jnp.clip(coef, 1 - epsilon, 1 + high)
    loss = -jnp.minimum(coef * a, clipped * a).mean()
    low_clip = ((coef < 1 - epsilon) & (a < 0)).astype(jnp.float32)
    high_clip = ((coef > 1 + high) & (a > 0)).astype(jnp.float32)
    metrics = {
        "entropy": _mean(r.entropy, r.mask),
        "clip_ratio/low_mean": low_clip.mean(),
        "clip_ratio/low_min": low_clip.min(),
        "clip_ratio/high_mean": high_clip.mean(),
        "clip_ratio/high_max": high_clip.max(),
        "clip_ratio/region_mean": jnp.maximum(low_clip, high_clip).mean(),
    }
    return loss, jax.lax.stop_gradient(metrics)
