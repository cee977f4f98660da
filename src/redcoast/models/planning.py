"""The zoo planned: `rc.memory_plan` takes a preset name, a config.json or a zoo config.

`planned` describes a zoo model to the planner (`redcoast.plan.planner.PlannedModel`):
how to build it at each remat policy (stacked layers, as a large model is built),
its loss (next-token cross-entropy; an encoder-decoder reads the sequence as its
own source; the text-conditioned DiT's is its noise-prediction loss, with prompts of
`seq_len` ids), its heads and positions, and why context parallelism cannot split an
encoder-decoder or the DiT. `memory_plan` and `sharding_plan_of` take what `planned` takes,
or what the planner takes itself (a `PlannedModel`, or a factory of any model).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from ..nn._loss import cross_entropy
from ..parallel._sharding_plan import ShardingPlan
from ..plan import planner
from ..plan._report import Layout, LoRA, MemoryPlan
from .auto import model_class
from .dit import DiT, DiTConfig, noise_prediction_loss
from .hf import HFConfig, read_config
from .loss import lm_loss
from .presets import PRESETS, preset
from .seq2seq import AbstractSeq2SeqLM
from .vision_encoder_decoder import VisionEncoderDecoder

__all__ = ["memory_plan", "planned", "sharding_plan_of"]

Plannable = str | HFConfig | DiTConfig | planner.PlannedModel | Callable[[PRNGKeyArray], Any]
"""What `memory_plan` takes: a preset name, a config.json path (or its folder), a zoo
config (a `DiTConfig` too), a `PlannedModel`, or a factory `key -> causal LM`."""


def _resolve(model: str | HFConfig) -> tuple[str, type[Any], HFConfig]:
    """A preset name, a config.json (or its folder), or a config -> (name, class, config)."""
    if isinstance(model, HFConfig):
        return type(model).__name__, model_class(model.to_dict(), type(model).__name__), model
    if model in PRESETS:
        cls, config = preset(model)
        return model, cls, config
    path = Path(model)
    if path.is_file() or (path / "config.json").is_file():
        folder = path if path.is_dir() else path.parent
        values = read_config(folder if path.is_dir() else path)
        cls = model_class(values, str(model))
        return str(model), cls, cls.config_class.from_dict(values)
    raise ValueError(
        f"unknown model {model!r}: not a preset ({', '.join(PRESETS)}) and not a config.json."
    )


def _first_int(config: HFConfig, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _seq2seq_loss(model: Any, batch: dict[str, jax.Array], key: jax.Array) -> jax.Array:
    """Source and target of the same length: the sequence and itself shifted."""
    del key
    ids = batch["input_ids"]
    logits = jax.vmap(lambda s, d: model(s, d))(ids[:, :-1], ids[:, :-1])
    return cross_entropy(logits, ids[:, 1:]).mean()


def _caption_loss(model: Any, batch: dict[str, jax.Array], key: jax.Array) -> jax.Array:
    """Captions of `seq_len` tokens, each of an image of the encoder's size (blank: the
    memory and FLOPs of a step do not depend on the pixels)."""
    del key
    ids = batch["input_ids"]
    e = model.config.encoder
    pixels = jnp.zeros((ids.shape[0], e.num_channels, e.image_size, e.image_size))
    logits = jax.vmap(model)(pixels, ids[:, :-1])
    return cross_entropy(logits, ids[:, 1:]).mean()


def _vlm_loss(model: Any, batch: dict[str, jax.Array], key: jax.Array) -> jax.Array:
    """Rows of `seq_len` tokens opening with one image's placeholders (a blank image of
    the tower's size: the memory and FLOPs of a step do not depend on the pixels)."""
    del key
    c = model.config
    v, n = c.vision_config, c.image_tokens
    ids = batch["input_ids"]
    if ids.shape[1] <= n + 1:
        raise ValueError(
            f"seq_len={ids.shape[1]} leaves no text beside an image's {n} tokens; plan a "
            f"{type(model).__name__} with seq_len above {n + 1}."
        )
    ids = ids.at[:, :n].set(c.image_token_index)
    pixels = jnp.zeros((ids.shape[0], 1, v.num_channels, v.image_size, v.image_size))
    logits = jax.vmap(model)(ids[:, :-1], pixels)
    return cross_entropy(logits, ids[:, 1:]).mean()


def _dit_loss(model: Any, batch: dict[str, jax.Array], key: jax.Array) -> jax.Array:
    """The noise-prediction loss of prompts of `seq_len` token ids, each with an image of
    the DiT's size (blank: the memory and FLOPs of a step do not depend on the pixels)."""
    prompts = batch["input_ids"]
    c = model.config
    images = jnp.zeros((prompts.shape[0], c.channels, c.image_size, c.image_size))
    return noise_prediction_loss(model, images, prompts, key)


_NO_SAMPLING = (
    "an RL step samples completions with rc.sampling, which continues the prompts of a "
    "causal LM (a decoder: GPT-2, OPT, LLaMA, Qwen, ...); not {}."
)


def _planned_dit(config: DiTConfig) -> planner.PlannedModel:
    """The DiT as the planner sees it: prompts of `seq_len` ids, no remat policies, and
    no context parallelism (its sequence is the image's patches)."""
    return planner.PlannedModel(
        "DiT",
        lambda _remat: lambda key: DiT(config, key=key),
        loss_fn=_dit_loss,
        whole_rows_loss=_dit_loss,
        heads=config.num_heads,
        no_context_parallel=(
            "context parallelism splits a causal decoder's sequence; the DiT's sequence is "
            "its image's patches, attended whole. Plan it without context_parallel."
        ),
        no_sampling=_NO_SAMPLING.format("the DiT, which denoises images"),
        remats=False,
    )


def _whole_rows_loss(
    model: Any,
    batch: dict[str, jax.Array],
    key: jax.Array,
    *,
    chunk_tokens: int | Literal["auto"] | None = None,
) -> jax.Array:
    """The decoders' loss on rows of exactly `seq_len` tokens (`rc.models.lm_loss`)."""
    return lm_loss(model, batch, key, chunk_tokens=chunk_tokens)[0]


def planned(
    model: str | HFConfig | DiTConfig, *, attention: str | None = None
) -> planner.PlannedModel:
    """A zoo preset, config.json or config described to the planner.

    Args:
        model: a preset name, a config.json path (or its folder), or a zoo config.
        attention: the attention's `implementation` for the zoo's decoders (see
            `rc.nn.attention`); default their own, `"auto"`.

    Raises:
        ValueError: an unknown preset, a file that is not a config.json, or a
            `model_type` the zoo does not have.
    """
    if isinstance(model, DiTConfig):
        return _planned_dit(model)
    name, cls, config = _resolve(model)

    def build(remat: str) -> Callable[[PRNGKeyArray], Any]:
        options: dict[str, Any] = {"scan_layers": True}
        if remat != "none":
            options["remat"] = remat
        if attention is not None:
            options["attention"] = attention
        return lambda key: cls(config, key=key, **options)

    seq2seq = issubclass(cls, AbstractSeq2SeqLM)
    captions = issubclass(cls, VisionEncoderDecoder)
    images = hasattr(config, "vision_config")  # a vision-language model
    heads = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads")
    # The decoder's heads and positions: a captioner's GPT-2, a vision-language model's.
    text = getattr(config, "decoder", None) or getattr(config, "text_config", config)
    loss = planner.next_token_loss
    if captions or seq2seq or images:
        loss = _caption_loss if captions else _vlm_loss if images else _seq2seq_loss
    return planner.PlannedModel(
        name,
        build,
        loss_fn=loss,
        whole_rows_loss=_vlm_loss if images else _whole_rows_loss,
        example_call=cls.trace_call,
        heads=_first_int(text, heads),
        positions=_first_int(text, ("max_position_embeddings", "n_positions")),
        no_context_parallel=(
            "context parallelism splits the decoders' causal attention (GPT-2, OPT, GPT-J, "
            "LLaMA); an encoder-decoder's or a vision-language model's inputs cannot be "
            "split. Plan it with sequence_parallel (--sequence-parallel) instead."
            if seq2seq or images
            else None
        ),
        no_sampling=(
            _NO_SAMPLING.format(f"{name}, an encoder-decoder")
            if seq2seq or captions
            else _NO_SAMPLING.format(f"{name}, which reads images")
            if images
            else None
        ),
    )


def _plannable(model: Plannable) -> planner.PlannedModel | Callable[[PRNGKeyArray], Any]:
    return planned(model) if isinstance(model, str | HFConfig | DiTConfig) else model


def memory_plan(
    model: Plannable, *, loss_chunks: int | Literal["auto"] | None = None, **options: Any
) -> MemoryPlan:
    """`redcoast.plan.planner.memory_plan` for a preset name, config.json or zoo config too.

    Args:
        model: a preset name (`"llama-7b"`, see `redcoast.models.presets.PRESETS`),
            a `config.json` path (or its folder), a zoo config, a `PlannedModel`,
            or a factory `key -> causal LM` (it then decides its own remat).
        loss_chunks: plan a decoder's loss as `rc.models.lm_loss(...,
            chunk_tokens=loss_chunks)` computes it, the logits a chunk of tokens at a
            time (`rc.nn.map_logits`): `"auto"` or the tokens of a chunk.
        **options: as for `redcoast.plan.planner.memory_plan` (devices, n_model_shards,
            fsdp, seq_len, precision, remat, device_memory, search, lora_rank, ...).

    Returns:
        A `MemoryPlan`; `str()` is a readable report, `.to_dict()` JSON.

    Example:
        >>> print(rc.memory_plan("llama-7b", devices=4, n_model_shards=4, seq_len=1024,
        ...                      remat="full", device_memory="40GB"))
    """
    found = _plannable(model)
    if loss_chunks is not None:
        found = _in_chunks(found, loss_chunks, options)
    return planner.memory_plan(found, **options)


def _in_chunks(
    found: planner.PlannedModel | Callable[[PRNGKeyArray], Any],
    chunk_tokens: int | Literal["auto"],
    options: dict[str, Any],
) -> planner.PlannedModel:
    """`found` with its language-model loss computed in chunks of `chunk_tokens`."""
    if chunk_tokens != "auto" and (
        isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
    ):
        raise ValueError(
            f"loss_chunks must be 'auto' or an int >= 1 (tokens), got {chunk_tokens!r}."
        )
    if not isinstance(found, planner.PlannedModel) or found.loss_fn is not planner.next_token_loss:
        raise ValueError(
            "loss_chunks plans a decoder's language-model loss (rc.models.lm_loss with "
            "chunk_tokens): give a zoo decoder's preset, config.json or config."
        )
    if options.get("preference") is not None or options.get("rl") is not None:
        raise ValueError(
            "loss_chunks plans rc.models.lm_loss; a preference or RL step's log-probabilities "
            "are planned whole. Plan one or the other."
        )
    return dataclasses.replace(
        found,
        name=f"{found.name} (loss in chunks: {chunk_tokens})",
        loss_fn=functools.partial(planner.next_token_loss, chunk_tokens=chunk_tokens),
        whole_rows_loss=functools.partial(_whole_rows_loss, chunk_tokens=chunk_tokens),
    )


def sharding_plan_of(
    model: str | HFConfig | DiTConfig | planner.PlannedModel,
    layout: Layout,
    lora: LoRA | None = None,
) -> ShardingPlan:
    """The `ShardingPlan` `memory_plan` uses for `model` under `layout`."""
    found = planned(model) if isinstance(model, str | HFConfig | DiTConfig) else model
    return planner.sharding_plan_of(found, layout, lora)
