"""The rollout of an RL run: each prompt's group sampled on the model being trained, scored
by the reward functions, and made into the batch the policy's loss trains on.

`fit` draws batches of prompts (`prompt_ids`, `prompt_lengths` and `prompt_index`, the
record each came from) and, before each step, calls `GroupRollout` with the step's
model. It samples `num_generations` completions of every prompt with that very model
(placed as the step has it: no copy), joins each to its prompt in one right-padded
row, decodes the rows this process holds and scores them with the reward functions,
gathers the rewards of every process, and computes the advantages; with `beta > 0` or
`num_iterations > 1` it adds the reference's and the sampling policy's log-probabilities.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from .. import lora
from .. import sampling as sampling_
from ..distributed._host import to_host
from ..parallel.mesh import DATA
from ..text import Tokenizer
from ..train.data import make_global, process_rows
from ..train.inference_step import predict_step
from ..train.rollout import Rollout
from ._algorithms import RLOO, Algorithm
from ._losses import token_logps
from ._rewards import RewardFn, score

__all__ = ["GroupRollout", "decode", "record_fields"]


def decode(tokenizer: Tokenizer, ids: np.ndarray, length: int, chat: bool) -> Any:
    """A completion as the reward functions see it: its text (special tokens left out),
    or TRL's one assistant message for a chat prompt."""
    text = tokenizer.fast.decode([int(t) for t in ids[:length]], skip_special_tokens=True)
    return [{"role": "assistant", "content": text}] if chat else text


def record_fields(records: Sequence[Mapping[str, Any]], rows: Sequence[int]) -> dict[str, list]:
    """The records' fields other than `prompt`, one list entry per row (TRL's kwargs)."""
    keys = sorted({k for i in set(rows) for k in records[i] if k != "prompt"})
    return {k: [records[i].get(k) for i in rows] for k in keys}


@functools.partial(jax.jit, static_argnames=("group", "pad_id", "mask_truncated"))
def _join(
    prompt_ids: Int[Array, "batch prompt"],
    prompt_lengths: Int[Array, " batch"],
    tokens: Int[Array, "rows new"],
    lengths: Int[Array, " rows"],
    *,
    group: int,
    pad_id: int,
    mask_truncated: bool,
) -> tuple[Int[Array, "rows seq"], Bool[Array, "rows seq"], Array]:
    """Each completion after its prompt in one right-padded row, the mask of its counted
    tokens, and the tokens per row: what the policy's loss reads."""
    prompts = jnp.repeat(prompt_ids, group, axis=0)
    start = jnp.repeat(prompt_lengths, group)[:, None]
    width, new = prompts.shape[1], tokens.shape[1]
    at = jnp.arange(width + new)[None, :]
    from_completion = jnp.take_along_axis(tokens, jnp.clip(at - start, 0, new - 1), axis=1)
    end = start + lengths[:, None]
    ids = jnp.where(at < start, jnp.pad(prompts, ((0, 0), (0, new))), from_completion)
    ids = jnp.where(at < end, ids, pad_id)
    mask = (at >= start) & (at < end)
    if mask_truncated:  # no end-of-sequence token: a completion cut off by the limit
        ended = jnp.take_along_axis(ids, jnp.maximum(end - 1, 0), axis=1) == pad_id
        mask = mask & ended
    per_row = jnp.full(ids.shape[:1], mask.sum() / ids.shape[0], jnp.float32)
    return ids, mask, per_row


def _rows_sharding(x: Array) -> NamedSharding:
    sharding = x.sharding
    assert isinstance(sharding, NamedSharding), "fit's batches are NamedSharding arrays"
    return NamedSharding(sharding.mesh, P(DATA))


def _all_rows(mesh: Mesh, local: np.ndarray, rows: np.ndarray, total: int) -> np.ndarray:
    """Every process's `local` values of its `rows`, as one array of `total` rows."""
    if jax.process_count() == 1:
        return local
    every = multihost_utils.process_allgather({"rows": rows, "values": local})
    out = np.empty((total, *local.shape[1:]), local.dtype)
    out[np.asarray(every["rows"]).reshape(-1)] = np.asarray(every["values"]).reshape(
        -1, *local.shape[1:]
    )
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class GroupRollout(Rollout):
    """Sample, score and compute advantages for each batch of prompts (see the module).

    Attributes:
        records: the prompts' records (`prompt` and the fields the rewards read);
            batches name theirs by `prompt_index`.
        tokenizer: decodes the completions for the reward functions.
        rewards: the reward functions.
        names: their names (metrics and errors).
        algorithm: `GRPO` or `RLOO`.
        eos_id: the token that ends a completion.
        reference: the frozen reference model for the KL penalty, placed like the
            policy; None with LoRA, whose reference is the model with its adapters off.
        precision: the run's precision policy, for the log-probabilities.
    """

    records: Sequence[Mapping[str, Any]]
    tokenizer: Tokenizer
    rewards: tuple[RewardFn, ...]
    names: tuple[str, ...]
    algorithm: Algorithm
    eos_id: int
    reference: Any = None
    precision: str = "fp32"

    @property
    def updates_per_batch(self) -> int:  # type: ignore[override]
        return self.algorithm.num_iterations

    def _keys(self) -> tuple[str, ...]:
        keys = ["input_ids", "completion_mask", "advantages", "tokens_per_row"]
        if self.algorithm.needs_old_logps:
            keys.append("old_logps")
        if self.algorithm.needs_reference:
            keys.append("ref_logps")
        return tuple(keys)

    def example(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        prompts = batch["prompt_ids"]
        rows = prompts.shape[0] * self.algorithm.num_generations
        seq = prompts.shape[1] + self.algorithm.max_new_tokens
        sharding = _rows_sharding(prompts)
        shapes = {
            "input_ids": ((rows, seq), jnp.int32),
            "completion_mask": ((rows, seq), jnp.bool_),
            "advantages": ((rows,), jnp.float32),
            "tokens_per_row": ((rows,), jnp.float32),
            "old_logps": ((rows, seq), jnp.float32),
            "ref_logps": ((rows, seq), jnp.float32),
        }
        return {k: jax.device_put(jnp.zeros(*shapes[k]), sharding) for k in self._keys()}

    def _logps(self, model: Any, ids: Array, *, reference: bool) -> Array:
        """Each token's log-probability (`token_logps`) under the policy or the reference."""
        base = reference and self.reference is None
        if reference and self.reference is not None:
            model = self.reference
        pred_fn = _logps_fn(self.algorithm.temperature, base)
        return predict_step(pred_fn, precision=self.precision)(
            model, {"input_ids": ids}, jax.random.key(0)
        )

    def __call__(
        self, model: Any, batch: Mapping[str, Any], key: PRNGKeyArray
    ) -> tuple[dict[str, Any], dict[str, float]]:
        a = self.algorithm
        started = time.perf_counter()
        prompts, prompt_lengths = batch["prompt_ids"], batch["prompt_lengths"]
        out = sampling_.sample(
            model,
            prompts,
            prompt_lengths=prompt_lengths,
            eos_id=self.eos_id,
            key=key,
            **a.sample_options,
        )
        ids, mask, per_row = _join(
            prompts,
            prompt_lengths,
            out.tokens,
            out.lengths,
            group=a.num_generations,
            pad_id=self.eos_id,
            mask_truncated=a.mask_truncated_completions,
        )
        sharding = _rows_sharding(prompts)
        made: dict[str, Any] = {
            "input_ids": jax.device_put(ids, sharding),
            "completion_mask": jax.device_put(mask, sharding),
            "tokens_per_row": jax.device_put(per_row, sharding),
        }
        if a.needs_old_logps:
            made["old_logps"] = jax.device_put(self._logps(model, ids, reference=False), sharding)
        if a.needs_reference:
            made["ref_logps"] = jax.device_put(self._logps(model, ids, reference=True), sharding)
        tokens, lengths, index = to_host((out.tokens, out.lengths, batch["prompt_index"]))
        sampled = time.perf_counter()

        total = tokens.shape[0]
        mesh = sharding.mesh
        assert isinstance(mesh, Mesh), "fit's batches live on a concrete mesh"
        rows = process_rows(mesh, total)
        which = [int(index[r // a.num_generations]) for r in rows]
        chat = [not isinstance(self.records[i]["prompt"], str) for i in which]
        fields = {
            "completion_ids": [tokens[r, : lengths[r]].tolist() for r in rows],
            **record_fields(self.records, which),
        }
        local = score(
            self.rewards,
            self.names,
            [self.records[i]["prompt"] for i in which],
            [
                decode(self.tokenizer, tokens[r], int(lengths[r]), c)
                for r, c in zip(rows, chat, strict=True)
            ],
            fields,
        )
        rewards = _all_rows(mesh, local, rows, total)
        extra = {}
        if isinstance(a, RLOO) and a.beta > 0:
            extra = {
                "old_logps": np.asarray(to_host(made["old_logps"])),
                "ref_logps": np.asarray(to_host(made["ref_logps"])),
                "completion_mask": np.asarray(to_host(made["completion_mask"])),
            }
        advantages, metrics = a.advantages(rewards, self.names, **extra)
        made["advantages"] = make_global(
            {"advantages": advantages[rows].astype(np.float32)}, mesh, total
        )["advantages"]
        metrics.update(_length_metrics(lengths, tokens, self.eos_id))
        metrics["time/sampling_s"] = sampled - started
        metrics["time/rewards_s"] = time.perf_counter() - sampled
        return {k: made[k] for k in self._keys()}, metrics


def _length_metrics(lengths: np.ndarray, tokens: np.ndarray, eos_id: int) -> dict[str, float]:
    """TRL's completion metrics: lengths, and the share cut off before their end."""
    last = tokens[np.arange(len(lengths)), np.maximum(lengths - 1, 0)]
    ended = last == eos_id
    metrics = {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(1.0 - ended.mean()),
    }
    if ended.any():
        metrics["completions/mean_terminated_length"] = float(lengths[ended].mean())
    return metrics


@functools.cache
def _logps_fn(temperature: float, base: bool) -> Any:
    """A `pred_fn` of each token's log-probability, made once per setting so that every
    step's calls share one compiled program; `base` switches LoRA adapters off."""

    def pred_fn(model: Any, batch: Mapping[str, Any], key: PRNGKeyArray) -> Array:
        del key
        model = lora.disabled(model) if base else model
        return token_logps(model, batch["input_ids"], temperature=temperature)

    return pred_fn
