"""What every decoder-only language model of the zoo shares, written once.

A model is token embeddings (plus learned positions for GPT-2 and OPT), a stack of
`DecoderBlock`s (a tuple, or one block with stacked arrays run under `lax.scan`),
a final norm and a vocabulary head (tied to the token embeddings, or its own
Linear). `AbstractCausalLM` runs that forward pass, the cached forward pass for
generation, and the Hugging Face import/export; an architecture (`GPT2`, `Llama`,
`OPT`, `GPTJ`, the `Decoder` families) only builds those parts from its config
(`build`) and says how they map to a `transformers` checkpoint (`hf_tensors`).
"""

import abc
import copy
import dataclasses
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray, Real

from .._checks import check_positive, check_range
from ..nn import Implementation, RematPolicy, check_remat, table_dtype, tied_logits
from ..parallel import fsdp
from ..parallel.place import placement_hint
from . import hf
from ._stack import run_stack
from .layers import AnyNorm, DecoderBlock, KVCache, LayerAttention, apply_norm

Blocks = tuple[DecoderBlock, ...] | DecoderBlock
"""The layers: a tuple, or one `DecoderBlock` whose arrays have a leading layer axis."""
Cache = tuple[KVCache, ...] | KVCache
"""One `KVCache` per layer, or one stacked `KVCache` for scanned layers."""


class LayerOptions(NamedTuple):
    """How `AbstractCausalLM.build` builds the layers, as the constructor was asked.

    Attributes:
        scan_layers: one block with stacked arrays run under `lax.scan`, not a tuple.
        remat: each block's rematerialisation policy (already checked).
        attention: the attention implementation (`rc.nn.attention`'s).
    """

    scan_layers: bool
    remat: RematPolicy
    attention: Implementation


class CausalLMParts(NamedTuple):
    """What an architecture's `AbstractCausalLM.build` returns: the model's arrays, one
    attribute each (see `AbstractCausalLM`'s attributes)."""

    embed_tokens: eqx.nn.Embedding
    embed_positions: eqx.nn.Embedding | None
    blocks: Blocks
    norm: AnyNorm
    lm_head: eqx.nn.Linear | None


class OutputHead(eqx.Module):
    """A causal LM's final norm and vocabulary head (a Linear, or the token table when
    tied): hidden states to float32 logits, `AbstractCausalLM.output_head()`.

    Attributes:
        norm: the final norm.
        head: the head's Linear, or the token table of a tied head.
        tied: whether `head` is the token table.
        vocab_size: the real vocabulary; rows past it (padded for an even split) are
            never predicted.
        softcap: the logits become `softcap * tanh(logits / softcap)` (Gemma 2), or None.
    """

    norm: AnyNorm
    head: Any
    tied: bool = eqx.field(static=True)
    vocab_size: int = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True)

    def __call__(self, x: Float[Array, "*tokens hidden"]) -> Float[Array, "*tokens vocab"]:
        h = apply_norm(self.norm, x)
        if self.tied:
            logits = tied_logits(self.head, h)
        else:
            flat = jax.vmap(self.head)(h.reshape(-1, h.shape[-1]))
            logits = flat.reshape(*h.shape[:-1], flat.shape[-1])
        # The head's matmul runs in the parameters' dtype; the loss on its output in float32.
        logits = logits.astype(jnp.float32)
        if self.softcap is not None:
            logits = self.softcap * jnp.tanh(logits / self.softcap)
        if logits.shape[-1] == self.vocab_size:
            return logits
        # Rows padded for an even split (config.vocab_multiple) are never predicted;
        # the mask keeps the logits split on the vocabulary, where a slice would not.
        real = jnp.arange(logits.shape[-1]) < self.vocab_size
        return jnp.where(real, logits, jnp.finfo(logits.dtype).min)


class AbstractCausalLM(hf.HFModel):
    """A decoder-only language model: embed, `DecoderBlock`s, final norm, vocabulary head.

    Called on one unbatched sequence of token ids, it returns the logits of the next
    token at every position; batch it with `jax.vmap`. Concrete models: `GPT2`,
    `OPT`, `GPTJ` and the `Decoder` families (`Llama`, `Qwen2`, `Mistral`, ...), each
    constructed alike (`__init__`) from the parts its `build` draws.

    The models follow their parameters' dtype: in bfloat16 the matmuls run in
    bfloat16 while norms and the attention softmax compute in float32, and the
    logits are returned in float32 so that a cross-entropy on them is float32.

    Attributes:
        config: (static) the hyperparameters, named as in the model's config.json.
        embed_tokens: the token embeddings.
        embed_positions: learned position embeddings, or `None` (rotary models).
        blocks: the decoder layers.
        norm: the final norm.
        lm_head: the vocabulary head, or `None` when it is tied to `embed_tokens`.
        remat: (static) each block's rematerialisation policy in the training forward
            pass (`"none"`, `"dots"`, `"attention"`, `"full"`; see `rc.remat`).
    """

    config: Any = eqx.field(static=True)
    embed_tokens: eqx.nn.Embedding
    embed_positions: eqx.nn.Embedding | None
    blocks: Blocks
    norm: AnyNorm
    lm_head: eqx.nn.Linear | None
    remat: RematPolicy = eqx.field(static=True)

    config_class: ClassVar[type[hf.HFConfig]]
    # OPT's position table starts at row 2 (rows 0 and 1 are a fairseq leftover).
    position_offset: ClassVar[int] = 0
    # What transformers puts before the base model's tensor names (`transformer.h.0...`).
    hf_base_prefix: ClassVar[str] = ""

    def __init__(
        self,
        config: Any,
        *,
        scan_layers: bool = False,
        remat: str = "none",
        attention: Implementation = "auto",
        key: PRNGKeyArray,
    ):
        """Build the model from its config, initialised from scratch as `transformers` does.

        Args:
            config: the hyperparameters (the architecture's `config_class`).
            scan_layers: stack the layers and run them with `lax.scan` (faster compiles).
            remat: rematerialise each block in the backward pass: `"none"`, `"dots"`
                (keep the projections' outputs), `"attention"` (all but attention's
                scores) or `"full"` (see `rc.remat`).
            attention: how attention computes: `"auto"`, `"einsum"` (the score matrix
                written out), `"blockwise"` (flash-style blocks that never hold it),
                `"cudnn"` or `"pallas"` (see `rc.nn.attention`).
            key: for the random initialisation; each architecture's docstring says
                how it draws.
        """
        self.config = config
        self.remat = check_remat(remat)
        parts = self.build(config, LayerOptions(scan_layers, self.remat, attention), key)
        self.embed_tokens, self.embed_positions, self.blocks, self.norm, self.lm_head = parts

    @classmethod
    @abc.abstractmethod
    def build(cls, config: Any, how: LayerOptions, key: PRNGKeyArray) -> CausalLMParts:
        """The architecture's arrays for `config`, its layers built `how` the constructor
        was asked, drawn from `key`: what a new architecture defines, with `hf_tensors`.

        Example:
            >>> GPT2.build(config, LayerOptions(False, "none", "auto"), key).lm_head is None
            True
        """

    @classmethod
    def untied(cls, config: Any) -> Any | None:
        """`config` with a head of its own (`tie_word_embeddings=False`) where it ties the
        head to the token table, for a checkpoint whose stored head differs from it."""
        if not getattr(config, "tie_word_embeddings", False):
            return None
        return dataclasses.replace(config, tie_word_embeddings=False)

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the position table allows; `None` for rotary models."""
        if self.embed_positions is None:
            return None
        return self.embed_positions.num_embeddings - self.position_offset

    @property
    def vocab_size(self) -> int:
        """How many token ids the model knows: valid ids are `[0, vocab_size)`.

        Rows padded for an even split (`config.vocab_multiple`) are not among them.
        """
        return int(self.config.vocab_size)

    def trace_call(self) -> Float[Array, "seq vocab"]:
        """The call the sharding rules trace when none is given: eight token ids.

        The ids come from outside the trace (a constant), which is what the rules
        take for data: made inside it they would look like a position table's iota.
        """
        return self(jnp.asarray(hf.TRACE_IDS))

    def __call__(
        self,
        input_ids: Int[Array, " seq"],
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq vocab"]:
        """Next-token logits at every position of one sequence: `output_head()` of `hidden`.

        Args:
            input_ids: token ids of one sequence (vmap for a batch).
            positions: as for `hidden`.
            segment_ids: as for `hidden`.
            key: accepted for the Equinox calling convention; the models have no
                dropout, so it is unused.

        Returns:
            Logits, `(seq, vocab)`, float32.

        Example:
            >>> ids = jnp.arange(8)
            >>> segments = jnp.array([0, 0, 0, 1, 1, 1, 1, 1])   # two documents
            >>> positions = jnp.array([0, 1, 2, 0, 1, 2, 3, 4])
            >>> logits = model(ids, positions=positions, segment_ids=segments)
        """
        del key
        hidden = self.hidden(input_ids, positions=positions, segment_ids=segment_ids)
        with placement_hint():
            return self.output_head()(hidden)

    def hidden(
        self,
        input_ids: Int[Array, " seq"],
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, " seq"] | None = None,
        inputs_embeds: Float[Array, "seq hidden"] | None = None,
        bidirectional_groups: Int[Array, " seq"] | None = None,
    ) -> Float[Array, "seq hidden"]:
        """The last block's output at every position of one sequence, before the final
        norm: what `output_head()` turns into logits (`rc.nn.map_logits` does so a few
        tokens at a time, never holding the whole vocabulary's logits of a row).

        Args:
            input_ids: token ids of one sequence (vmap for a batch).
            positions: each token's position (rotary angles, or the row of the
                position table); default `0, 1, ..., seq - 1`. Documents packed into
                one row restart theirs at 0 (`rc.text.packed`).
            segment_ids: which document each token belongs to; a token then attends
                only to earlier tokens of its own document. Default: one document.
            inputs_embeds: what the first block reads in place of `token_embeddings`
                of `input_ids` (a vision-language model's, image features set in);
                learned positions are still added. Default: the tokens' own.
            bidirectional_groups: each token's group, -1 for none: the tokens of a
                group also see each other's later positions (an image's tokens in
                Gemma 3), within the sliding window (`layers.causal_mask`). Default:
                causal attention alone.

        Returns:
            The hidden states, `(seq, hidden)`.

        Raises:
            ValueError: the sequence is longer than the position table (GPT-2, OPT),
                or `positions`, `segment_ids` or `bidirectional_groups` are not one
                per token.
            RuntimeError: when the computation runs, a token id is outside
                `[0, vocab_size)`, or a position outside the position table (see
                `redcoast._checks.check_range`).

        Example:
            >>> h = model.hidden(jnp.arange(8))
            >>> logits = model.output_head()(h)       # model(jnp.arange(8))
        """
        seq = input_ids.shape[0]
        limit = self.max_positions
        if limit is not None and seq > limit:
            raise ValueError(
                f"input_ids has {seq} tokens but {type(self).__name__}'s position table has "
                f"{limit} positions (config max_position_embeddings / n_positions); the "
                f"sequence length must be in [1, {limit}]. Truncate or split the sequence."
            )
        given_inputs = (
            ("positions", positions),
            ("segment_ids", segment_ids),
            ("bidirectional_groups", bidirectional_groups),
        )
        for name, given in given_inputs:
            if given is not None and given.shape != input_ids.shape:
                raise ValueError(
                    f"{type(self).__name__}: {name} of shape {given.shape} do not match "
                    f"input_ids of shape {input_ids.shape}; give one per token (vmap the "
                    "model over a batch, with its rows' ids, positions and segment ids)."
                )
        if positions is None:
            positions = jnp.arange(seq)
        elif limit is not None:
            positions = check_range(
                positions,
                0,
                limit,
                "positions",
                f"{type(self).__name__}'s position table has {limit} positions.",
            )
        with placement_hint():
            x = self._embed(input_ids, positions, inputs_embeds)
            return self._run_blocks(x, positions, None, 0, segment_ids, bidirectional_groups)[0]

    def decode(
        self,
        input_ids: Int[Array, " seq"],
        cache: Cache,
        index: Int[Array, ""] | int,
        *,
        inputs_embeds: Float[Array, "seq hidden"] | None = None,
        bidirectional_groups: Int[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, "seq vocab"], Cache]:
        """The forward pass for tokens that continue a cached sequence.

        Args:
            input_ids: the new tokens (the whole prompt first, then one per step).
            cache: from `init_cache`, holding the keys and values of positions `< index`.
            index: the position of `input_ids[0]`.
            inputs_embeds: as for `hidden`.
            bidirectional_groups: as for `hidden`, for the new tokens: a group lies
                within one call (the prompt's images, given with the prompt).

        Returns:
            The logits of the new tokens and the cache with their keys and values.

        Raises:
            ValueError: `index` (an int) or the sequence runs past the position table
                or the cache.
            RuntimeError: when the computation runs, a token id is outside
                `[0, vocab_size)`, or a traced `index` runs past the position table
                or the cache (see `redcoast._checks.check_range`).

        Example:
            >>> cache = model.init_cache(max_len=32)
            >>> logits, cache = model.decode(prompt, cache, 0)
            >>> logits, cache = model.decode(next_token[None], cache, prompt.shape[0])
        """
        seq = input_ids.shape[0]
        if self.max_positions is not None:
            index = check_range(
                index,
                0,
                self.max_positions - seq + 1,
                f"index (the position of the first of {seq} new tokens)",
                f"{type(self).__name__}'s position table has {self.max_positions} positions.",
            )
        positions = index + jnp.arange(seq)
        if bidirectional_groups is not None and bidirectional_groups.shape != input_ids.shape:
            raise ValueError(
                f"{type(self).__name__}: bidirectional_groups of shape "
                f"{bidirectional_groups.shape} do not match input_ids of shape "
                f"{input_ids.shape}; give one per new token."
            )
        x = self._embed(input_ids, positions, inputs_embeds)
        x, new, _ = self._run_blocks(x, positions, cache, index, None, bidirectional_groups)
        assert new is not None
        return self.output_head()(x), new

    def init_cache(self, max_len: int, dtype: DTypeLike | None = None) -> Cache:
        """An empty key/value cache for one sequence of up to `max_len` tokens.

        Args:
            max_len: prompt plus generated tokens.
            dtype: of the cached keys and values; default: the model's parameter dtype.

        Returns:
            One `KVCache` per layer (a tuple), or one stacked `KVCache` for scanned layers.
        """
        dtype = table_dtype(self.embed_tokens) if dtype is None else dtype
        if isinstance(self.blocks, DecoderBlock):
            return eqx.filter_vmap(lambda b: b.attn.init_cache(max_len, dtype))(self.blocks)
        return tuple(b.attn.init_cache(max_len, dtype) for b in self.blocks)

    def with_vocab_size(self, vocab_size: int) -> "AbstractCausalLM":
        """The model with `vocab_size` token ids (a tokenizer's added tokens, such as a
        vision-language model's `<image>`), as `transformers`' `resize_token_embeddings`:
        the token table's rows (and an untied head's) kept up to `vocab_size`, new rows
        the mean of the old ones, the config's `vocab_size` changed.

        Raises:
            ValueError: `vocab_size` is not an int >= 1.

        Example:
            >>> model = model.with_vocab_size(tokenizer.vocab_size + 1)   # an added <image>
        """
        check_positive("vocab_size", vocab_size, optional=False)
        config = dataclasses.replace(self.config, vocab_size=vocab_size)
        rows, old = config.padded_vocab_size, self.vocab_size

        def resized(table: Array) -> Array:
            kept = table[: min(vocab_size, old)]
            mean = table[:old].astype(jnp.float32).mean(0, keepdims=True).astype(table.dtype)
            new = jnp.broadcast_to(mean, (rows - kept.shape[0], *table.shape[1:]))
            return jnp.concatenate([kept, new])

        embed = eqx.nn.Embedding(weight=resized(self.embed_tokens.weight))
        model = eqx.tree_at(lambda m: m.embed_tokens, copy.copy(self), embed)
        if self.lm_head is not None:
            head = self.lm_head
            linear = eqx.nn.Linear(
                head.in_features, rows, use_bias=head.bias is not None, key=jax.random.key(0)
            )
            bias = (
                None
                if head.bias is None
                else jnp.concatenate(
                    [
                        head.bias[: min(vocab_size, old)],
                        jnp.zeros((rows - min(vocab_size, old),), head.bias.dtype),
                    ]
                )
            )
            linear = eqx.tree_at(
                lambda m: (m.weight, m.bias),
                linear,
                (resized(head.weight), bias),
                is_leaf=lambda x: x is None,
            )
            model = eqx.tree_at(lambda m: m.lm_head, model, linear)
        object.__setattr__(model, "config", config)  # static: the copy's own
        return model

    def token_embeddings(self, input_ids: Int[Array, " seq"]) -> Float[Array, "seq hidden"]:
        """The tokens' rows of the token table, scaled as the model scales them
        (`embedding_scale`), before any learned position is added: what `hidden`'s
        `inputs_embeds` replaces.

        Raises:
            RuntimeError: when the computation runs, a token id is outside
                `[0, vocab_size)`.
        """
        # jnp indexing clamps: id 999 of a 50-token vocabulary would embed as id 49.
        input_ids = check_range(
            input_ids,
            0,
            self.vocab_size,
            "input_ids (token ids)",
            f"{type(self).__name__} has a vocabulary of {self.vocab_size}; check the "
            "tokenizer matches the model, and pad with a real token id.",
        )
        use = fsdp.layouts(self)
        x = jax.vmap(fsdp.gather(self.embed_tokens, use.embed_tokens))(input_ids)
        if self.embedding_scale is not None:
            # In the table's dtype, as transformers scales Gemma's embeddings.
            x = x * jnp.asarray(self.embedding_scale, jnp.float32).astype(x.dtype)
        return x

    def _embed(
        self,
        input_ids: Int[Array, " seq"],
        positions: Int[Array, " seq"],
        inputs_embeds: Float[Array, "seq hidden"] | None = None,
    ) -> Float[Array, "seq hidden"]:
        if inputs_embeds is None:
            x = self.token_embeddings(input_ids)
        else:
            want = jax.eval_shape(self.token_embeddings, input_ids).shape
            if inputs_embeds.shape != want:
                raise ValueError(
                    f"{type(self).__name__}: inputs_embeds of shape {inputs_embeds.shape} for "
                    f"{input_ids.shape[0]} tokens; give one row of {want[-1]} features per token."
                )
            x = inputs_embeds
        use = fsdp.layouts(self)
        if self.embed_positions is not None:
            table = fsdp.gather(self.embed_positions, use.embed_positions)
            x = x + jax.vmap(table)(positions + self.position_offset)
        return x

    def output_head(self) -> OutputHead:
        """The final norm and the vocabulary head, each array gathered whole once (FSDP):
        `hidden` states to float32 logits, on any number of tokens."""
        use = fsdp.layouts(self)
        norm = fsdp.gather(self.norm, use.norm)
        if self.lm_head is None:
            head = fsdp.gather(self.embed_tokens, use.embed_tokens)
        else:
            head = fsdp.gather(self.lm_head, use.lm_head)
        tied = self.lm_head is None
        return OutputHead(norm, head, tied, self.config.vocab_size, self.logit_softcap)

    def layer_attention(self) -> tuple[LayerAttention, ...] | None:
        """Each layer's window and rotation, when the model says them per layer (the
        decoders of `decoder.py`); `None` when each block's attention has its own."""
        return None

    @property
    def embedding_scale(self) -> float | None:
        """What the token embeddings are multiplied by (Gemma's `sqrt(hidden)`), or `None`."""
        return None

    @property
    def logit_softcap(self) -> float | None:
        """The logits become `cap * tanh(logits / cap)` (Gemma's final soft cap), or `None`."""
        return None

    def _run_blocks(
        self,
        x: Float[Array, "seq hidden"],
        positions: Real[Array, " seq"],
        cache: Cache | None,
        index: Int[Array, ""] | int,
        segment_ids: Int[Array, " seq"] | None = None,
        bidirectional_groups: Int[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, "seq hidden"], Cache | None, Any]:
        """The blocks on `x`: the hidden states, the new cache and the routers' logits
        (one per layer, a tuple or stacked; `None`s for dense MLPs)."""
        # Training runs each block under the remat policy; the cached (decoding) path
        # computes no gradients, so there is nothing to rematerialise.
        policy = self.remat if cache is None else "none"
        blocks = self.blocks
        stacked = not isinstance(blocks, tuple)
        n = 0 if stacked else len(blocks)
        kinds = self.layer_attention()
        distinct = tuple(dict.fromkeys(kinds or ()))
        if len(distinct) <= 1:  # every layer alike: each block's attention has it
            which: Any = None if stacked else (None,) * n
        elif stacked:  # picked at run time, scanned with the layers
            assert kinds is not None
            which = jnp.asarray([distinct.index(k) for k in kinds], jnp.int32)
        else:
            which = kinds

        def layer(
            block: DecoderBlock, h: Float[Array, "seq hidden"], per: Any
        ) -> tuple[Float[Array, "seq hidden"], Any]:
            c, kind = per
            if kind is not None and not isinstance(kind, LayerAttention):
                kind = (distinct, kind)
            h, c, router = block.forward(
                h, positions, c, index, kind, segment_ids, bidirectional_groups
            )
            return h, (c, router)

        use = fsdp.layouts(self).blocks
        if stacked:
            per_layer: Any = (cache, which)
        else:
            caches: Any = (None,) * n if cache is None else cache
            per_layer = tuple(zip(caches, which, strict=True))
        x, outs = run_stack(blocks, x, per_layer, layer, use, policy)
        if stacked:
            new, routers = outs
        else:
            new, routers = tuple(o[0] for o in outs), tuple(o[1] for o in outs)
        return x, None if cache is None else new, routers
