"""Preference tuning: DPO, IPO, SimPO and ORPO as `loss_fn`s over pairs of answers.

After supervised fine-tuning, a model is tuned on pairs: a prompt with a chosen
and a rejected answer (`rc.text.tokenize_preferences`, `rc.text.paired`). Each loss
here is a plain `loss_fn(model, batch, key) -> (loss, metrics)`; its settings are
keyword arguments, bound with `functools.partial`. Both answers of every pair run
in one forward pass (chosen and rejected rows concatenated on the batch axis), and
an answer's log-probability is the sum of its tokens' (TRL's convention; SimPO and
ORPO average them over the answer's tokens, as their papers and TRL do).

DPO and IPO compare the model with a reference, the model before tuning, without
a second copy of it in the step:

- LoRA (`reference="lora"`): the reference is the same model with its adapters
  switched off (`rc.lora.disabled`), run in the same step under
  `jax.lax.stop_gradient`.
- A full fine-tune (`reference="precomputed"`): `precompute_reference` runs the
  model once over the rows before training (`rc.predict`) and stores each answer's
  log-probability in a memory-mapped file; its rows carry them as
  `ref_chosen_logp` and `ref_rejected_logp`.

The metrics are TRL's: `rewards/chosen`, `rewards/rejected` (the implicit rewards,
beta times the log-ratio to the reference for DPO and IPO, beta times the average
log-probability for SimPO and ORPO), `rewards/accuracies` (how often the chosen
reward is the larger), `rewards/margins`, and `logps/chosen`, `logps/rejected`.

References:
    Rafailov et al. 2023, *Direct Preference Optimization: Your Language Model is
    Secretly a Reward Model* (DPO; arXiv 2305.18290). Azar et al. 2023, *A General
    Theoretical Paradigm to Understand Learning from Human Preferences* (IPO; arXiv
    2310.12036). Meng et al. 2024, *SimPO: Simple Preference Optimization with a
    Reference-Free Reward* (arXiv 2405.14734). Hong et al. 2024, *ORPO: Monolithic
    Preference Optimization without Reference Model* (arXiv 2403.07691). TRL's
    `DPOTrainer`, `CPOTrainer` and `ORPOTrainer` (1.16) compute the same losses.

Example:
    >>> pairs = rc.text.paired(rc.text.tokenize_preferences(src, tok, "cache/pairs"), 256)
    >>> lora = rc.lora.apply(model, ["q_proj", "v_proj"], key=jax.random.key(0))
    >>> rc.fit(lora, optax.adamw(5e-4), pairs, collate_fn=rc.text.collate,
    ...        loss_fn=functools.partial(rc.preference.dpo_loss, beta=0.1),
    ...        trainable=rc.lora.trainable(lora), ...)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .. import lora
from .._files import check_output_file, written_whole
from ..text import collate
from .evaluate import predict

__all__ = [
    "ReferencedRows",
    "dpo_loss",
    "orpo_loss",
    "pair_logps",
    "precompute_reference",
    "simpo_loss",
]

Model = Callable[[Int[Array, " seq"]], Float[Array, "seq vocab"]]
Metrics = dict[str, Float[Array, ""]]


def _next_token_logps(model: Model, ids: Int[Array, "rows seq"]) -> Float[Array, "rows seq"]:
    """The log-probability of token `t + 1` at position `t` (the last position's is
    meaningless, and never counted), as `rc.models.next_token_nll` scores it; here
    because the framework imports no model code."""
    logits = jax.vmap(model)(ids)
    target = jnp.roll(ids, -1, axis=1)
    return -optax.softmax_cross_entropy_with_integer_labels(logits, target).astype(jnp.float32)


def _next_token_weight(mask: Bool[Array, "rows seq"]) -> Float[Array, "rows seq"]:
    """1 where the next token is one `mask` counts (a row's first token never is)."""
    has_next = jnp.arange(mask.shape[1]) < mask.shape[1] - 1
    return (jnp.roll(mask.astype(bool), -1, axis=1) & has_next).astype(jnp.float32)


def _answers(
    model: Model, batch: Mapping[str, Any]
) -> tuple[Float[Array, "rows seq"], Float[Array, "rows seq"], Int[Array, "rows seq"]]:
    """Every next token's log-probability, the answer weights, and the ids: chosen rows
    first, then rejected ones, in one forward pass."""
    try:
        ids = jnp.concatenate(
            [jnp.asarray(batch["chosen_ids"]), jnp.asarray(batch["rejected_ids"])]
        )
        mask = jnp.concatenate(
            [jnp.asarray(batch["chosen_mask"]), jnp.asarray(batch["rejected_mask"])]
        )
    except KeyError as err:
        raise ValueError(
            f"a preference batch needs 'chosen_ids', 'chosen_mask', 'rejected_ids' and "
            f"'rejected_mask'; it lacks {err.args[0]!r} (it has {sorted(batch)}). Make rows "
            "with rc.text.paired and batch them with rc.text.collate."
        ) from None
    return _next_token_logps(model, ids), _next_token_weight(mask), ids


def _halves(x: Array) -> tuple[Array, Array]:
    n = x.shape[0] // 2
    return x[:n], x[n:]


def pair_logps(
    model: Model, batch: Mapping[str, Any], *, average: bool = False
) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
    """Each pair's chosen and rejected answer log-probabilities, from one forward pass.

    Args:
        model: a decoder called on one sequence of ids, returning `(seq, vocab)` logits.
        batch: `{"chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask"}`, each
            `(batch, seq)` (`rc.text.collate` of `rc.text.paired` rows).
        average: divide each sum by the answer's number of tokens.

    Returns:
        `(chosen, rejected)`, each `(batch,)` float32: the log-probability of the
        answer's tokens given the prompt, summed (or averaged).

    Example:
        >>> pred_fn = lambda m, batch, key: dict(zip(("chosen", "rejected"), pair_logps(m, batch)))
    """
    logps, weight, _ = _answers(model, batch)
    total, count = (logps * weight).sum(-1), weight.sum(-1)
    return _halves(total / jnp.maximum(count, 1.0) if average else total)


def _log_sigmoid_loss(logits: Array, label_smoothing: float) -> Array:
    # Conservative DPO (Mitchell 2023): a label flipped with probability label_smoothing.
    return -(1 - label_smoothing) * jax.nn.log_sigmoid(logits) - label_smoothing * (
        jax.nn.log_sigmoid(-logits)
    )


def _metrics(reward_c: Array, reward_r: Array, logp_c: Array, logp_r: Array) -> Metrics:
    reward_c, reward_r, logp_c, logp_r = jax.lax.stop_gradient((reward_c, reward_r, logp_c, logp_r))
    return {
        "rewards/chosen": reward_c.mean(),
        "rewards/rejected": reward_r.mean(),
        "rewards/accuracies": (reward_c > reward_r).astype(jnp.float32).mean(),
        "rewards/margins": (reward_c - reward_r).mean(),
        "logps/chosen": logp_c.mean(),
        "logps/rejected": logp_r.mean(),
    }


def _check(beta: Any, label_smoothing: Any, what: str) -> None:
    if not isinstance(beta, int | float) or not math.isfinite(beta) or beta <= 0:
        raise ValueError(f"{what}: beta must be a finite number > 0, got {beta!r}.")
    if not isinstance(label_smoothing, int | float) or not 0 <= label_smoothing < 0.5:
        raise ValueError(
            f"{what}: label_smoothing is the chance a pair's labels are flipped and must be in "
            f"[0, 0.5), got {label_smoothing!r}."
        )


def _reference(model: Model, batch: Mapping[str, Any], reference: str) -> Any:
    """The reference DPO compares with: the batch's precomputed log-probabilities, or
    the model with its adapters switched off."""
    if reference == "precomputed":
        if "ref_chosen_logp" not in batch or "ref_rejected_logp" not in batch:
            raise ValueError(
                "dpo_loss(reference='precomputed') reads 'ref_chosen_logp' and "
                f"'ref_rejected_logp' from the batch, which has {sorted(batch)}. Make the rows "
                "with rc.preference.precompute_reference(model, rows, path, ...) before "
                "training, or tune LoRA adapters with reference='lora'."
            )
        return (
            jnp.asarray(batch["ref_chosen_logp"], jnp.float32),
            jnp.asarray(batch["ref_rejected_logp"], jnp.float32),
        )
    try:
        return lora.disabled(model)
    except ValueError:
        raise ValueError(
            "dpo_loss(reference='lora') takes the reference from the model with its LoRA "
            "adapters switched off, but this model has none. Apply them (rc.lora.apply), or "
            "for a full fine-tune precompute the reference (rc.preference.precompute_reference) "
            "and pass reference='precomputed'."
        ) from None


def _chosen_nll(logps: Array, weight: Array) -> Array:
    """The mean negative log-likelihood of the chosen rows' counted tokens (all pairs'
    tokens together, as one cross-entropy)."""
    lp, w = _halves(logps)[0], _halves(weight)[0]
    return -(lp * w).sum() / jnp.maximum(w.sum(), 1.0)


def dpo_loss(
    model: Model,
    batch: Mapping[str, Any],
    key: PRNGKeyArray | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid",
    reference: Literal["lora", "precomputed"] = "lora",
    sft_weight: float = 0.0,
) -> tuple[Float[Array, ""], Metrics]:
    """Direct Preference Optimization (or IPO) on a batch of pairs: a `loss_fn`.

    With `h = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))`,
    answers' log-probabilities summed over their tokens, the loss is the mean over
    pairs of `-log sigmoid(beta h)` (`"sigmoid"`, DPO; with `label_smoothing` e,
    `-(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)`, conservative DPO), or of
    `(h' - 1 / (2 beta))^2` (`"ipo"`, IPO), where `h'` uses log-probabilities
    averaged over each answer's tokens, as TRL does. `sft_weight` adds that many times
    the chosen answers' negative log-likelihood per token (RPO; TRL's `loss_type=
    ["sigmoid", "sft"]`), which keeps the chosen answers' likelihood from falling.
    Rewards are `beta` times each answer's log-ratio to the reference.

    Args:
        model: a decoder called on one sequence of ids, returning `(seq, vocab)` logits.
        batch: `{"chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask"}`, each
            `(batch, seq)`, and with `reference="precomputed"` `"ref_chosen_logp"` and
            `"ref_rejected_logp"`, each `(batch,)`.
        key: unused; there for `fit`'s signature.
        beta: how far from the reference the model may move (DPO's beta; IPO's tau).
        label_smoothing: the chance a pair's labels are wrong, in `[0, 0.5)`
            (sigmoid only).
        loss_type: `"sigmoid"` (DPO) or `"ipo"`.
        reference: `"lora"`, the model with its adapters switched off
            (`rc.lora.disabled`), run in the same step without gradient; or
            `"precomputed"`, the batch's `ref_*_logp` (`precompute_reference`).
        sft_weight: the weight of the chosen answers' negative log-likelihood.

    Returns:
        `(loss, metrics)`, the metrics TRL's `DPOTrainer` logs (`rewards/chosen`,
        `rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`,
        `logps/rejected`), means over the pairs, and `nll_loss` when `sft_weight` is
        not 0.

    Raises:
        ValueError: a setting out of range, a batch without the keys, or a reference
            that is not there (no adapters for `"lora"`, no `ref_*_logp` for
            `"precomputed"`).

    References:
        Rafailov et al. 2023, *Direct Preference Optimization* (arXiv 2305.18290);
        Azar et al. 2023, *A General Theoretical Paradigm to Understand Learning from
        Human Preferences* (IPO, arXiv 2310.12036).

    Example:
        >>> loss_fn = functools.partial(rc.preference.dpo_loss, beta=0.1)
        >>> rc.fit(lora_model, opt, rows, collate_fn=rc.text.collate, loss_fn=loss_fn,
        ...        trainable=rc.lora.trainable(lora_model), ...)
    """
    del key
    _check(beta, label_smoothing, "dpo_loss")
    if loss_type not in ("sigmoid", "ipo"):
        raise ValueError(f"dpo_loss: loss_type must be 'sigmoid' or 'ipo', got {loss_type!r}.")
    if reference not in ("lora", "precomputed"):
        raise ValueError(f"dpo_loss: reference must be 'lora' or 'precomputed', got {reference!r}.")
    if loss_type == "ipo" and label_smoothing:
        raise ValueError("dpo_loss: label_smoothing applies to loss_type='sigmoid' only.")
    ref = _reference(model, batch, reference)
    logps, weight, ids = _answers(model, batch)
    chosen, rejected = _halves((logps * weight).sum(-1))
    if reference == "lora":  # the same rows through the base model, without gradient
        ref_logps = jax.lax.stop_gradient(_next_token_logps(ref, ids))
        ref = _halves((ref_logps * weight).sum(-1))
    ref_chosen, ref_rejected = ref
    ratio_c, ratio_r = chosen - ref_chosen, rejected - ref_rejected
    if loss_type == "ipo":
        n_c, n_r = _halves(jnp.maximum(weight.sum(-1), 1.0))
        losses = (ratio_c / n_c - ratio_r / n_r - 1 / (2 * beta)) ** 2
    else:
        losses = _log_sigmoid_loss(beta * (ratio_c - ratio_r), label_smoothing)
    loss, metrics = losses.mean(), _metrics(beta * ratio_c, beta * ratio_r, chosen, rejected)
    if sft_weight:
        nll = _chosen_nll(logps, weight)
        loss = loss + sft_weight * nll
        metrics["nll_loss"] = jax.lax.stop_gradient(nll)
    return loss, metrics


def simpo_loss(
    model: Model,
    batch: Mapping[str, Any],
    key: PRNGKeyArray | None = None,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    sft_weight: float = 0.0,
) -> tuple[Float[Array, ""], Metrics]:
    """SimPO on a batch of pairs, no reference model: a `loss_fn`.

    The reward of an answer is `beta` times its log-probability averaged over its
    tokens; the loss is the mean of `-log sigmoid(reward_chosen - reward_rejected -
    gamma)` (with `label_smoothing` as in `dpo_loss`), plus `sft_weight` times the
    chosen answers' negative log-likelihood per token (TRL's `cpo_alpha`; SimPO
    itself has none). TRL's `CPOTrainer(loss_type="simpo")` with `simpo_gamma=gamma`.

    Args:
        model: a decoder called on one sequence of ids, returning `(seq, vocab)` logits.
        batch: `{"chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask"}`, each
            `(batch, seq)`.
        key: unused; there for `fit`'s signature.
        beta: the reward's scale (the paper uses 2 to 2.5).
        gamma: the target reward margin.
        label_smoothing: the chance a pair's labels are wrong, in `[0, 0.5)`.
        sft_weight: the weight of the chosen answers' negative log-likelihood.

    Returns:
        `(loss, metrics)`: TRL's metrics (`logps/*` are per-token averages here), and
        `nll_loss` when `sft_weight` is not 0.

    Raises:
        ValueError: a setting out of range, or a batch without the keys.

    References:
        Meng et al. 2024, *SimPO: Simple Preference Optimization with a Reference-Free
        Reward* (arXiv 2405.14734).

    Example:
        >>> loss_fn = functools.partial(rc.preference.simpo_loss, beta=2.0, gamma=0.5)
    """
    del key
    _check(beta, label_smoothing, "simpo_loss")
    logps, weight, _ = _answers(model, batch)
    avg_c, avg_r = _halves((logps * weight).sum(-1) / jnp.maximum(weight.sum(-1), 1.0))
    losses = _log_sigmoid_loss(beta * (avg_c - avg_r) - gamma, label_smoothing)
    metrics = _metrics(beta * avg_c, beta * avg_r, avg_c, avg_r)
    loss = losses.mean()
    if sft_weight:
        nll = _chosen_nll(logps, weight)
        loss = loss + sft_weight * nll
        metrics["nll_loss"] = jax.lax.stop_gradient(nll)
    return loss, metrics


def _log1mexp(x: Array) -> Array:
    """`log(1 - exp(x))` for `x < 0`, each branch fed only the inputs it is exact for
    (so neither sends a NaN gradient through `where`)."""
    t = -math.log(2.0)
    low, high = jnp.minimum(x, t), jnp.maximum(x, t)
    return jnp.where(x < t, jnp.log1p(-jnp.exp(low)), jnp.log(-jnp.expm1(high)))


def orpo_loss(
    model: Model,
    batch: Mapping[str, Any],
    key: PRNGKeyArray | None = None,
    *,
    beta: float = 0.1,
) -> tuple[Float[Array, ""], Metrics]:
    """ORPO on a batch of pairs, no reference model: a `loss_fn`.

    With `p` an answer's log-probability averaged over its tokens and
    `odds = p - log(1 - exp(p))`, the loss is the chosen sequences' negative
    log-likelihood per token minus `beta` times the mean of `log sigmoid(odds_chosen
    - odds_rejected)`. As in the ORPO authors' code and TRL's `ORPOTrainer`, that
    likelihood counts the prompt's tokens as well as the answer's.

    Args:
        model: a decoder called on one sequence of ids, returning `(seq, vocab)` logits.
        batch: `{"chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask"}`, each
            `(batch, seq)`.
        key: unused; there for `fit`'s signature.
        beta: the weight of the odds-ratio term (the paper's lambda).

    Returns:
        `(loss, metrics)`: TRL's metrics (rewards `beta` times the average
        log-probability, `logps/*` averages), `nll_loss`, `log_odds_ratio` (the mean
        log-sigmoid) and `log_odds_chosen` (the mean log odds ratio).

    Raises:
        ValueError: `beta` out of range, or a batch without the keys.

    References:
        Hong et al. 2024, *ORPO: Monolithic Preference Optimization without Reference
        Model* (arXiv 2403.07691).

    Example:
        >>> rc.fit(model, opt, rows, collate_fn=rc.text.collate,
        ...        loss_fn=rc.preference.orpo_loss, ...)
    """
    del key
    _check(beta, 0.0, "orpo_loss")
    logps, weight, _ = _answers(model, batch)
    avg_c, avg_r = _halves((logps * weight).sum(-1) / jnp.maximum(weight.sum(-1), 1.0))
    log_odds = (avg_c - avg_r) - (_log1mexp(avg_c) - _log1mexp(avg_r))
    ratio = jax.nn.log_sigmoid(log_odds)
    # Every token up to the answer's last: the prompt and the answer, not the padding.
    mask = jnp.concatenate([jnp.asarray(batch["chosen_mask"]), jnp.asarray(batch["rejected_mask"])])
    upto = jnp.flip(jnp.cumsum(jnp.flip(mask.astype(jnp.int32), -1), -1), -1) > 0
    nll = _chosen_nll(logps, _next_token_weight(upto))
    metrics = _metrics(beta * avg_c, beta * avg_r, avg_c, avg_r)
    metrics |= jax.lax.stop_gradient(
        {"nll_loss": nll, "log_odds_ratio": ratio.mean(), "log_odds_chosen": log_odds.mean()}
    )
    return nll - beta * ratio.mean(), metrics


class ReferencedRows(Sequence[dict[str, Any]]):
    """Preference rows with the reference's log-probabilities of both answers beside them.

    Row `i` is `rows[i]` with `ref_chosen_logp` and `ref_rejected_logp` (float32
    scalars) from a memory-mapped `(n, 2)` array; see `precompute_reference`.
    Slicing gives a view.

    Attributes:
        rows: the rows.
        values: `(len(rows), 2)`: each pair's chosen and rejected log-probability.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        values: Float[np.ndarray, "n 2"],
        start: int = 0,
        stop: int | None = None,
    ):
        if len(values) != len(rows):
            raise ValueError(
                f"the reference holds {len(values)} pairs, but there are {len(rows)} rows; "
                "compute it for these rows (rc.preference.precompute_reference)."
            )
        self.rows, self.values = rows, values
        self.start, self.stop = start, len(rows) if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> ReferencedRows: ...
    def __getitem__(self, i: int | slice) -> dict[str, Any] | ReferencedRows:
        if isinstance(i, slice):
            a, b, step = i.indices(len(self))
            if step != 1:
                raise ValueError("rows can be sliced with step 1 only.")
            return ReferencedRows(self.rows, self.values, self.start + a, self.start + max(a, b))
        i = int(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        j = self.start + i % len(self)
        chosen, rejected = (np.float32(v) for v in self.values[j])
        return {**self.rows[j], "ref_chosen_logp": chosen, "ref_rejected_logp": rejected}


def precompute_reference(
    model: Model,
    rows: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    per_device_batch_size: int,
    mesh: jax.sharding.Mesh | None = None,
    collate_fn: Callable[[list[Any]], dict[str, np.ndarray]] = collate,
    precision: str = "fp32",
) -> ReferencedRows:
    """The reference log-probabilities of every pair, computed once before training.

    A full fine-tune changes the very weights the reference is, so DPO's reference
    is taken from the model before training: one `rc.predict` pass over `rows`,
    written to `path` (a `.npy` of `(len(rows), 2)` float32, its folder made if
    missing, written under a temporary name and renamed when complete, by process
    0) and read back memory mapped. A path that cannot be written (a folder, a file
    where its folder would be, no permission) is refused before the pass. It is
    computed afresh on every call, from the model given: pass the model before
    training, also when resuming.

    Args:
        model: the reference (the model as training starts).
        rows: preference rows (`rc.text.paired`).
        path: the `.npy` file to write, e.g. beside the token folder.
        per_device_batch_size: rows per data-parallel device.
        mesh: from `make_mesh`; defaults as `rc.predict`'s.
        collate_fn: batches rows; `rc.text.collate` by default.
        precision: as `rc.predict`'s.

    Returns:
        `ReferencedRows`: `rows` with `ref_chosen_logp` and `ref_rejected_logp`, for
        `dpo_loss(..., reference="precomputed")`.

    Example:
        >>> train = rc.preference.precompute_reference(model, rows, "cache/pairs.ref.npy",
        ...                                            mesh=mesh, per_device_batch_size=8)
        >>> loss_fn = functools.partial(rc.preference.dpo_loss, reference="precomputed")
    """

    path = Path(path)
    # Every process reads the file back, so each sees the same folder and verdict.
    check_output_file(path, "precompute_reference: path")

    def pred_fn(m: Model, batch: Mapping[str, Any], key: PRNGKeyArray) -> dict[str, Array]:
        chosen, rejected = pair_logps(m, batch)
        return {"chosen": chosen, "rejected": rejected}

    out = predict(
        model,
        rows,
        collate_fn=collate_fn,
        pred_fn=pred_fn,
        mesh=mesh,
        per_device_batch_size=per_device_batch_size,
        precision=precision,
    )
    if jax.process_index() == 0:
        values = np.array([(o["chosen"], o["rejected"]) for o in out], np.float32)
        path.parent.mkdir(parents=True, exist_ok=True)
        with written_whole(path) as f:
            np.save(f, values.reshape(len(out), 2))
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"redcoast reference {path}")
    return ReferencedRows(rows, np.load(path, mmap_mode="r"))
