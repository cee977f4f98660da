"""`train`: an RL run as `fit` with a rollout: sample, score, step.

The prompts are tokenized once and become `fit`'s examples; `fit` draws, shuffles and
splits them as any examples, and before each step its `rollout` (`GroupRollout`)
samples their completions on the model being trained and scores them; the step is
`rc.rl.policy_loss` (or `rloo_loss`) through `rc.train_step`, `num_iterations`
updates a batch. Checkpoints, resume, logging, evaluation, FSDP, tensor and sequence
parallelism, several hosts and `trainable=` are `fit`'s own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from .. import lora
from .. import sampling as sampling_
from ..parallel.mesh import make_mesh
from ..parallel.place import model_mesh, place
from ..text import Tokenizer, load_tokenizer
from ..train.evaluate import Evaluation
from ..train.fit import FitResult, fit
from ..train.precision import cast
from ._algorithms import GRPO, Algorithm
from ._losses import token_logps
from ._rewards import RewardFn, reward_names, score
from ._rollout import GroupRollout, decode, record_fields

__all__ = ["load_prompts", "train"]

# Prompts are padded to a multiple of this: a handful of programs for any prompt set.
PROMPT_MULTIPLE = 16


def load_prompts(prompts: Sequence[Mapping[str, Any]] | str | os.PathLike[str]) -> list[dict]:
    """The prompt records, from a sequence or a `.jsonl` file, each checked for its `prompt`.

    Args:
        prompts: records, each with a `prompt` (a string, or chat messages
            `[{"role": ..., "content": ...}, ...]`) and any fields the reward functions
            read; or the path of a `.jsonl` file of them.

    Returns:
        The records as a list of dicts.

    Raises:
        ValueError: no records, a record that is not a mapping, or one without a
            non-empty `prompt` (naming the file and line, or the record's number).
    """
    if isinstance(prompts, str | os.PathLike):
        path = Path(prompts)
        records, where = [], []
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}, line {n}: not JSON ({err}).") from None
                where.append(f"{path}, line {n}")
    else:
        records, where = list(prompts), [f"prompt record {i}" for i in range(len(prompts))]
    if not records:
        raise ValueError("train got no prompts; give records with a 'prompt' each.")
    for record, at in zip(records, where, strict=True):
        if not isinstance(record, Mapping):
            raise ValueError(f"{at} is {type(record).__name__}, not a record (a dict).")
        prompt = record.get("prompt")
        if not prompt or not isinstance(prompt, str | list):
            raise ValueError(
                f"{at} has no 'prompt' (a non-empty string, or chat messages); it has "
                f"{sorted(record)}."
            )
    return [dict(r) for r in records]


def _prompt_ids(tokenizer: Tokenizer, prompt: str | list) -> list[int]:
    """A prompt's token ids: the tokenizer's prefix (BOS) and the text, or a chat
    through the tokenizer's chat template with the assistant's turn opened."""
    if isinstance(prompt, str):
        return tokenizer.prefix + tokenizer.encode([prompt])[0]
    template = getattr(tokenizer.hf, "chat_template", None)
    if not template:
        raise ValueError(
            f"a chat prompt needs the tokenizer's chat template, and {tokenizer.name} has "
            "none; give the prompts as text, or a tokenizer folder with a chat template."
        )
    text = tokenizer.hf.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return tokenizer.fast.encode(text, add_special_tokens=False).ids


def _examples(
    records: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, max_length: int | None
) -> list[dict[str, Any]]:
    """`fit`'s examples: each prompt's ids (the last `max_length` when longer, as TRL
    keeps them), its record's index, and the one padded width of them all."""
    ids = [_prompt_ids(tokenizer, r["prompt"]) for r in records]
    if max_length is not None:
        ids = [i[-max_length:] for i in ids]
    longest = max(len(i) for i in ids)
    width = sampling_.bucket_length(longest, multiple=PROMPT_MULTIPLE, max_length=max_length)
    return [
        {"prompt_ids": np.asarray(i, np.int32), "prompt_index": n, "width": width}
        for n, i in enumerate(ids)
    ]


def _collate(examples: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    ids = np.zeros((len(examples), max(e["width"] for e in examples)), np.int32)
    for row, e in enumerate(examples):
        ids[row, : len(e["prompt_ids"])] = e["prompt_ids"]
    return {
        "prompt_ids": ids,
        "prompt_lengths": np.array([len(e["prompt_ids"]) for e in examples], np.int32),
        "prompt_index": np.array([e["prompt_index"] for e in examples], np.int32),
    }


def _evaluation(
    records: list[dict],
    tokenizer: Tokenizer,
    rewards: Sequence[RewardFn],
    names: Sequence[str],
    algorithm: Algorithm,
    eos_id: int,
    every: int | None,
    max_length: int | None,
) -> Evaluation:
    """Greedy completions of held-out prompts, scored by the reward functions: each
    function's mean, the weighted sum's (`reward`) and the completions' mean length."""
    weights = np.asarray(algorithm.reward_weights or [1.0] * len(rewards))

    def pred_fn(model: Any, batch: Mapping[str, Any], key: Any) -> dict[str, Any]:
        out = sampling_.sample(
            model,
            batch["prompt_ids"],
            prompt_lengths=batch["prompt_lengths"],
            max_new_tokens=algorithm.max_new_tokens,
            temperature=0.0,
            eos_id=eos_id,
            key=key,
        )
        return {"tokens": out.tokens, "lengths": out.lengths, "index": batch["prompt_index"]}

    def metric_fn(examples: Any, outputs: Sequence[Any]) -> dict[str, float]:
        which = [int(o["index"]) for o in outputs]
        chat = [not isinstance(records[i]["prompt"], str) for i in which]
        completions = [
            decode(tokenizer, o["tokens"], int(o["lengths"]), c)
            for o, c in zip(outputs, chat, strict=True)
        ]
        fields = {
            "completion_ids": [o["tokens"][: int(o["lengths"])].tolist() for o in outputs],
            **record_fields(records, which),
        }
        got = score(rewards, names, [records[i]["prompt"] for i in which], completions, fields)
        metrics = {f"rewards/{n}/mean": float(np.nanmean(got[:, j])) for j, n in enumerate(names)}
        metrics["reward"] = float(np.mean(np.nansum(got * weights, axis=1)))
        metrics["completions/mean_length"] = float(np.mean([o["lengths"] for o in outputs]))
        return metrics

    return Evaluation(
        _examples(records, tokenizer, max_length),
        pred_fn=pred_fn,
        output_fn=lambda o: {k: np.asarray(v) for k, v in o.items()},
        metric_fn=metric_fn,
        every=every,
    )


def _reference(
    model: Any, reference: Any, algorithm: Algorithm, place_model: Callable[[Any], Any]
) -> tuple[Any, Any]:
    """The model to train (placed, when a copy of it is the reference) and the reference:
    None for LoRA's adapters switched off, or the frozen copy or model given."""
    if not algorithm.needs_reference:
        return model, None
    if reference == "auto":
        reference = "lora" if _has_lora(model) else "copy"
    if reference == "lora":
        if not _has_lora(model):
            raise ValueError(
                "reference='lora' is the model with its LoRA adapters off, and this model has "
                "none; apply them (rc.lora.apply) or pass reference='copy'."
            )
        return model, None
    placed = place_model(model)
    if reference == "copy":
        # bfloat16, as TRL's reference of a bfloat16 policy: half the policy's float32.
        return placed, cast(placed, jnp.bfloat16)
    if isinstance(reference, str):
        raise ValueError(
            f"reference must be 'auto', 'lora', 'copy' or a model placed like the policy, "
            f"got {reference!r}."
        )
    return placed, reference


def _has_lora(model: Any) -> bool:
    try:
        lora.disabled(model)
    except ValueError:
        return False
    return True


def train(
    model: Any,
    optimizer: optax.GradientTransformation,
    prompts: Sequence[Mapping[str, Any]] | str | os.PathLike[str],
    *,
    rewards: RewardFn | Sequence[RewardFn],
    tokenizer: Any,
    per_device_batch_size: int,
    algorithm: Algorithm | None = None,
    reference: Any = "auto",
    max_prompt_length: int | None = None,
    eval_prompts: Sequence[Mapping[str, Any]] | str | os.PathLike[str] | None = None,
    eval_every: int | None = None,
    **fit_options: Any,
) -> FitResult:
    """Train a causal LM by reinforcement learning from rewards a program computes.

    Each step takes `per_device_batch_size` prompts a data-parallel device (the
    global batch, as `fit` counts it), samples `algorithm.num_generations`
    completions of each on the model being trained (no copy, placed as the step has
    it), scores them with every reward function, and takes `algorithm.num_iterations`
    optimizer steps on them with the algorithm's loss. It is `rc.fit` with a rollout
    (`rc.rl.GroupRollout`): checkpoints, `resume=True` (the same completions drawn
    again: the sampling key is the step's), logging (the step's metrics with the
    rewards', completions' and the sampling's seconds), FSDP, tensor parallelism,
    several hosts and `trainable=` all work as in `fit`. A step of the run is one
    batch of prompts and its updates.

    A reward function is TRL's: `reward(prompts, completions, **fields) -> list`,
    one float (or None, "not scored") per completion, called with the prompts
    (repeated for each of their completions), the completions' text (a chat prompt's
    as `[{"role": "assistant", "content": ...}]`), their `completion_ids`, and every
    other field of the prompts' records, each as a list.

    Args:
        model: a causal LM that `rc.sampling.sample` runs (any `rc.models` decoder or
            one meeting `rc.sampling.CausalLM`), with or without LoRA adapters or a
            quantized base.
        optimizer: an optax optimizer.
        prompts: records with a `prompt` (text, or chat messages) and the fields the
            rewards read, or a `.jsonl` file of them.
        rewards: one reward function or several (their weights: the algorithm's
            `reward_weights`).
        tokenizer: the model's tokenizer: a folder, a `tokenizer.json`, or a tokenizer
            object (`rc.text.load_tokenizer`); its end-of-sequence token ends a
            completion.
        per_device_batch_size: prompts a data-parallel device per step.
        algorithm: `rc.rl.GRPO(...)` (the default, with TRL's defaults) or
            `rc.rl.RLOO(...)`.
        reference: for a KL penalty (`beta > 0`): `"auto"` (`"lora"` when the model has
            LoRA adapters, else `"copy"`), `"lora"` (the model with its adapters off:
            no memory), `"copy"` (a frozen bfloat16 copy of the model as given, placed
            like it),
            or a model of your own placed like the policy (e.g. `rc.cast(...,
            jnp.bfloat16)` of it, or quantized).
        max_prompt_length: keep the last this many tokens of longer prompts; prompts
            are padded to a multiple of 16 tokens.
        eval_prompts: held-out prompt records: every `eval_every` steps (and at the
            end) their greedy completions are scored, logged as `eval_reward`,
            `eval_rewards/{name}/mean` and `eval_completions/mean_length`.
        eval_every: steps between evaluations; default: at each epoch's end.
        **fit_options: `rc.fit`'s other options (`mesh`, `max_steps`, `n_epochs`,
            `workdir`, `resume`, `trainable`, `fsdp`, `precision`, `checkpointing`,
            `accumulate_grad_batches`, `seed`, `hooks`, ...).

    Returns:
        `fit`'s `FitResult`.

    Raises:
        ValueError: prompts without a `prompt`, a tokenizer without an end-of-sequence
            token, a fit option this function sets itself, or a bad reference.
        RuntimeError: a reward function raised (naming it and the prompt).

    Example:
        >>> def correct(prompts, completions, answer, **_):
        ...     return [float(c.strip() == a) for c, a in zip(completions, answer)]
        >>> result = rc.rl.train(model, optax.adamw(1e-5), tasks, rewards=correct,
        ...                      tokenizer="checkpoints/gpt2", per_device_batch_size=2,
        ...                      algorithm=rc.rl.GRPO(num_generations=8, max_new_tokens=32),
        ...                      mesh=mesh, max_steps=100, workdir="runs/grpo")
    """
    taken = sorted({"collate_fn", "loss_fn", "rollout", "evaluation"} & set(fit_options))
    if taken:
        raise ValueError(
            f"rc.rl.train sets {taken} itself (the prompts' collation, the algorithm's loss, "
            "the rollout and the evaluation of eval_prompts); leave them out."
        )
    algorithm = GRPO() if algorithm is None else algorithm
    rewards = tuple(rewards) if isinstance(rewards, Sequence) else (rewards,)
    if not rewards or not all(callable(f) for f in rewards):
        raise ValueError(f"rewards must be reward functions (callables), got {rewards!r}.")
    names = tuple(reward_names(rewards))
    records = load_prompts(prompts)
    tok = load_tokenizer(tokenizer)
    if tok.eos_id is None:
        raise ValueError(
            f"{tok.name} has no end-of-sequence token to end a completion with; load it "
            "with rc.text.load_tokenizer(..., eos_id=ID)."
        )
    examples = _examples(records, tok, max_prompt_length)
    mesh = fit_options.get("mesh") or model_mesh(model) or make_mesh(1)
    fit_options["mesh"] = mesh
    seq = examples[0]["width"] + algorithm.max_new_tokens

    def place_model(m: Any) -> Any:
        # The policy's forward on one rollout row: the dataflow its loss traces.
        ids = jnp.zeros((1, seq), jnp.int32)
        call = lambda m: token_logps(m, ids)  # noqa: E731
        return place(m, mesh, example_call=call, fsdp=bool(fit_options.get("fsdp", False)))

    model, frozen = _reference(model, reference, algorithm, place_model)
    if eval_prompts is not None:
        fit_options["evaluation"] = _evaluation(
            load_prompts(eval_prompts),
            tok,
            rewards,
            names,
            algorithm,
            tok.eos_id,
            eval_every,
            max_prompt_length,
        )
    rollout = GroupRollout(
        records=records,
        tokenizer=tok,
        rewards=rewards,
        names=names,
        algorithm=algorithm,
        eos_id=tok.eos_id,
        reference=frozen,
        precision=fit_options.get("precision", "fp32"),
    )
    return fit(
        model,
        optimizer,
        examples,
        collate_fn=_collate,
        loss_fn=algorithm.loss_fn(),
        per_device_batch_size=per_device_batch_size,
        rollout=rollout,
        **fit_options,
    )
