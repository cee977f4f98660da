"""What the encoder-decoders of the zoo (`T5`, `BART`) share, written once.

A model is shared token embeddings, an encoder stack of `EncoderLayer`s (self-attention
and a feed-forward network), a decoder stack of `DecoderLayer`s (causal self-attention,
cross-attention to the encoder's output, a feed-forward network) and a vocabulary head.
Each stack is a tuple of layers, or one layer with stacked arrays run under `lax.scan`.
`AbstractSeq2SeqLM` runs the forward pass, the encoder once plus a cached decoder for
generation, and the Hugging Face import/export; an architecture says how it embeds
tokens and positions, where its norms sit, and how its arrays map to a checkpoint.

Attention projections are named `q_proj`, `k_proj`, `v_proj`, `o_proj`, cross-attention
included, so the sharding rules split all of them Megatron's way: Q/K/V by heads, O on
its input, and both feed-forward networks column- then row-parallel.
"""

import abc
import dataclasses
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from einops import rearrange
from jax.typing import DTypeLike
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray, PyTree, Shaped

from .._checks import as_int_array, check_range
from ..nn import Norm, RematPolicy, attention, normalise, table_dtype
from ..parallel import fsdp
from ..parallel.place import placement_hint
from . import hf
from ._stack import Stack, run_stack
from .layers import MLP, KVCache, SwiGLU


class Seq2SeqAttention(eqx.Module):
    """Multi-head attention from queries `x` to keys and values given separately.

    Self-attention passes `keys_values(x)`; cross-attention passes the encoder output's
    `keys_values`, computed once per sequence and reused at every decoding step. An
    additive bias (T5's relative positions) may be added to the scores.

    Args:
        hidden_size: width of the input and output.
        num_heads: attention heads.
        head_dim: width of one head (T5's `d_kv` need not be `hidden_size / num_heads`).
        use_bias: the four projections have biases (BART) or not (T5).
        scale: multiplies the scores; `head_dim ** -0.5` (BART), 1 (T5, whose
            initialisation folds the scale into the query projection).
        recompute_scores: keep only Q, K and V for the backward pass and compute the
            scores again there (remat's `"attention"` policy).
        key: for the initialisation.

    Example:
        >>> attn = Seq2SeqAttention(32, 4, 8, use_bias=True, scale=8**-0.5, key=jax.random.key(0))
        >>> memory = attn.keys_values(jnp.ones((7, 32)))
        >>> attn(jnp.ones((5, 32)), memory, jnp.ones((5, 7), bool)).shape
        (5, 32)
    """

    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    recompute_scores: bool = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        use_bias: bool,
        scale: float,
        recompute_scores: bool = False,
        key: PRNGKeyArray,
    ):
        kq, kk, kv, ko = jax.random.split(key, 4)
        inner = num_heads * head_dim
        self.q_proj = eqx.nn.Linear(hidden_size, inner, use_bias=use_bias, key=kq)
        self.k_proj = eqx.nn.Linear(hidden_size, inner, use_bias=use_bias, key=kk)
        self.v_proj = eqx.nn.Linear(hidden_size, inner, use_bias=use_bias, key=kv)
        self.o_proj = eqx.nn.Linear(inner, hidden_size, use_bias=use_bias, key=ko)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.recompute_scores = recompute_scores

    def keys_values(self, source: Float[Array, "src hidden"]) -> KVCache:
        """The keys and values of `source`, split into heads (where the rules read the count)."""
        key = rearrange(jax.vmap(self.k_proj)(source), "s (h d) -> s h d", h=self.num_heads)
        value = rearrange(jax.vmap(self.v_proj)(source), "s (h d) -> s h d", h=self.num_heads)
        return KVCache(key, value)

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        memory: KVCache,
        visible: Bool[Array, "seq src"],
        bias: Float[Array, "heads seq src"] | None = None,
    ) -> Float[Array, "seq hidden"]:
        """Attend from each position of `x` to the visible slots of `memory`."""
        q = rearrange(jax.vmap(self.q_proj)(x), "s (h d) -> s h d", h=self.num_heads)
        keys, values = memory.key.astype(q.dtype), memory.value.astype(q.dtype)
        out = attention(
            q,
            keys,
            values,
            mask=visible,
            bias=bias,
            scale=self.scale,
            recompute=self.recompute_scores,
        )
        return jax.vmap(self.o_proj)(rearrange(out, "t h d -> t (h d)"))


def _pre(x: Float[Array, "seq hidden"], norm: Norm, post_norm: bool) -> Float[Array, "seq hidden"]:
    """A sublayer's input: the residual stream, normed first in a pre-norm block (T5)."""
    return x if post_norm else normalise(norm, x)


def _post(
    x: Float[Array, "seq hidden"], out: Float[Array, "seq hidden"], norm: Norm, post_norm: bool
) -> Float[Array, "seq hidden"]:
    """Add a sublayer's output to the residual stream; a post-norm block (BART) norms the sum."""
    return normalise(norm, x + out) if post_norm else x + out


class EncoderLayer(eqx.Module):
    """Bidirectional self-attention, then a feed-forward network, each with a residual.

    Pre-norm (T5): `x + f(norm(x))`; post-norm (BART): `norm(x + f(x))`.
    """

    attn_norm: Norm
    attn: Seq2SeqAttention
    mlp_norm: Norm
    mlp: MLP | SwiGLU
    post_norm: bool = eqx.field(static=True)

    def __call__(
        self,
        x: Float[Array, "src hidden"],
        visible: Bool[Array, "src src"],
        bias: Float[Array, "heads src src"] | None,
    ) -> Float[Array, "src hidden"]:
        """Run the layer on one source sequence; `visible` masks padding."""
        h = _pre(x, self.attn_norm, self.post_norm)
        x = _post(
            x, self.attn(h, self.attn.keys_values(h), visible, bias), self.attn_norm, self.post_norm
        )
        return _post(
            x, self.mlp(_pre(x, self.mlp_norm, self.post_norm)), self.mlp_norm, self.post_norm
        )


class DecoderLayer(eqx.Module):
    """Causal self-attention, cross-attention to the encoder, a feed-forward network."""

    attn_norm: Norm
    attn: Seq2SeqAttention
    cross_norm: Norm
    cross_attn: Seq2SeqAttention
    mlp_norm: Norm
    mlp: MLP | SwiGLU
    post_norm: bool = eqx.field(static=True)

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        memory: KVCache,
        cross_visible: Bool[Array, "seq src"],
        visible: Bool[Array, "seq kv"],
        bias: Float[Array, "heads seq kv"] | None,
        cache: KVCache | None = None,
        index: Int[Array, ""] | int = 0,
    ) -> tuple[Float[Array, "seq hidden"], KVCache | None]:
        """Run the layer on one target sequence.

        Args:
            x: hidden states of the target tokens.
            memory: this layer's cross-attention keys and values of the encoder output.
            cross_visible: which source slots each target token sees (padding masked).
            visible: which self-attention slots each token sees (causal).
            bias: added to the self-attention scores (T5), or `None`.
            cache: keys and values of earlier target tokens; `None` to attend within `x`.
            index: with a cache, the slot of `x[0]`; `x` is written at `[index, index + seq)`.

        Returns:
            The new hidden states, and the cache with `x`'s keys and values (or `None`).
        """
        h = _pre(x, self.attn_norm, self.post_norm)
        own = self.attn.keys_values(h)
        if cache is not None:
            own = jax.tree.map(
                lambda c, n: jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), index, 0),
                cache,
                own,
            )
        x = _post(x, self.attn(h, own, visible, bias), self.attn_norm, self.post_norm)
        h = _pre(x, self.cross_norm, self.post_norm)
        x = _post(x, self.cross_attn(h, memory, cross_visible), self.cross_norm, self.post_norm)
        x = _post(
            x, self.mlp(_pre(x, self.mlp_norm, self.post_norm)), self.mlp_norm, self.post_norm
        )
        return x, None if cache is None else own


def _mask_padded_vocab(logits: Float[Array, "seq vocab"], vocab: int) -> Float[Array, "seq vocab"]:
    # Rows padded for an even split (config.vocab_multiple) are never predicted; a mask
    # keeps the logits split on the vocabulary, where a slice would not.
    if logits.shape[-1] == vocab:
        return logits
    real = jnp.arange(logits.shape[-1]) < vocab
    return jnp.where(real, logits, jnp.finfo(logits.dtype).min)


class AbstractSeq2SeqLM(hf.HFModel):
    """An encoder-decoder language model: shared embeddings, two stacks, a vocabulary head.

    Called on one unbatched source sequence and one target sequence (the decoder input:
    the start token, then the target shifted right), it returns the logits of the next
    target token at every target position; batch it with `jax.vmap`. For generation,
    `encode` runs once, `cross_cache` computes every layer's cross-attention keys and
    values once, and `decode` feeds new target tokens through a key/value cache.
    Concrete models: `T5`, `BART`, and `VisionEncoderDecoder`, whose source is an image.
    Each is constructed with `(config, *, scan_layers=False, remat="none", key)`:
    `scan_layers` stacks each stack's layers and runs them with `lax.scan`, `remat`
    rematerialises each layer in the backward pass (`"none"`, `"dots"`, `"attention"`
    or `"full"`; see `rc.remat`), `key` draws the initialisation.

    Under FSDP each weight is gathered where it is used, as in the decoders
    (`redcoast.fsdp`): the layers' by `run_stack`, one layer at a time, and
    the embeddings, position tables, final norms and head by the architecture's
    `_embed`, `_bias`, `_final` and `_head`.

    Attributes:
        embed_tokens: the token embeddings, shared by encoder, decoder (and a tied head).
        encoder_blocks: the encoder layers.
        decoder_blocks: the decoder layers.
        lm_head: the vocabulary head, or `None` when tied to `embed_tokens`.
    """

    embed_tokens: eqx.AbstractVar[eqx.nn.Embedding]
    encoder_blocks: eqx.AbstractVar[Stack]
    decoder_blocks: eqx.AbstractVar[Stack]
    lm_head: eqx.AbstractVar[eqx.nn.Linear | None]
    config: eqx.AbstractVar[Any]
    remat: eqx.AbstractVar[RematPolicy]

    config_class: ClassVar[type[hf.HFConfig]]
    hf_base_prefix: ClassVar[str] = ""

    @abc.abstractmethod
    def _embed(
        self, ids: Int[Array, " seq"], positions: Int[Array, " seq"], decoder: bool
    ) -> Float[Array, "seq hidden"]:
        """Token (and position) embeddings entering the encoder or the decoder."""

    @abc.abstractmethod
    def _final(self, x: Float[Array, "seq hidden"], decoder: bool) -> Float[Array, "seq hidden"]:
        """What follows the last layer of the encoder or the decoder (a norm, or nothing)."""

    @abc.abstractmethod
    def _bias(
        self, queries: Int[Array, " seq"], keys: Int[Array, " kv"], decoder: bool
    ) -> Float[Array, "heads seq kv"] | None:
        """The self-attention score bias for these query and key positions (T5), or `None`."""

    @abc.abstractmethod
    def _head(self, x: Float[Array, "seq hidden"]) -> Float[Array, "seq vocab"]:
        """Logits from the decoder's output."""

    @property
    @abc.abstractmethod
    def max_positions(self) -> int | None:
        """The longest sequence a position table allows (BART); `None` for T5."""

    @property
    def vocab_size(self) -> int:
        """How many token ids the model knows: valid ids are `[0, vocab_size)`."""
        return int(self.config.vocab_size)

    def special_token(self, name: str) -> int | None:
        """A token id of the config (`eos_token_id`, `decoder_start_token_id`, ...), or `None`.

        Example:
            >>> model.special_token("decoder_start_token_id")
            0
        """
        value = getattr(self.config, name, None)
        value = self.config.get_extra(name) if value is None else value
        if isinstance(value, list):  # transformers allows several EOS ids; the first is used
            value = value[0] if value else None
        return None if value is None else int(value)

    def trace_call(self) -> Array:
        """The call the sharding rules trace when none is given: eight source and target ids.

        The ids come from outside the trace (a constant), which is what the rules take
        for data: made inside it they would look like a position table's iota.
        """
        ids = jnp.asarray(hf.TRACE_IDS)
        return self(ids, ids)

    def generation_source(
        self, source: ArrayLike, attention_mask: ArrayLike | None
    ) -> tuple[Array, Array]:
        """Check a batch of sources for `generate_seq2seq`: token ids `(batch, src)`, and
        their mask (all ones when `None`).

        Raises:
            ValueError: not 2-D integer ids, sources of no tokens, 64-bit ids that JAX
                would wrap to 32 bits, or a mask of another shape.
        """
        ids = as_int_array(source, "input_ids")
        if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(
                f"input_ids must be integer token ids of shape (batch, src_len); got "
                f"{ids.dtype} of shape {ids.shape}. For one source use ids[None]."
            )
        if ids.shape[1] == 0:
            raise ValueError(
                f"input_ids has shape {ids.shape}: sources of no tokens. Each source needs "
                "at least one token (e.g. the tokenizer's EOS token)."
            )
        if attention_mask is None:
            return ids, jnp.ones(ids.shape, jnp.int32)
        mask = as_int_array(attention_mask, "attention_mask")
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask has shape {mask.shape}; input_ids has {ids.shape}.")
        return ids, mask.astype(jnp.int32)

    def _check_ids(self, ids: Int[Array, " seq"], what: str) -> Int[Array, " seq"]:
        # jnp indexing clamps: a wrong id would embed as the last row without an error.
        return check_range(
            ids,
            0,
            self.vocab_size,
            f"{what} (token ids)",
            f"{type(self).__name__} has a vocabulary of {self.vocab_size}; check the "
            "tokenizer matches the model, and pad with a real token id.",
        )

    def _check_length(self, seq: int, what: str) -> None:
        limit = self.max_positions
        if limit is not None and seq > limit:
            raise ValueError(
                f"{what} has {seq} tokens but {type(self).__name__}'s position table has "
                f"{limit} positions (config max_position_embeddings); truncate the sequence."
            )

    def encode(
        self,
        input_ids: Int[Array, " src"],
        attention_mask: Bool[ArrayLike, " src"] | Int[ArrayLike, " src"] | None = None,
    ) -> Float[Array, "src hidden"]:
        """The encoder's output for one source sequence.

        Args:
            input_ids: source token ids.
            attention_mask: 1 for real tokens, 0 for padding (never attended to);
                default: all real.

        Returns:
            The hidden states the decoder attends to.
        """
        seq = input_ids.shape[0]
        self._check_length(seq, "input_ids")
        positions = jnp.arange(seq)
        x = self._embed(self._check_ids(input_ids, "input_ids"), positions, False)
        keep = _mask(attention_mask, seq)
        visible = jnp.broadcast_to(keep[None, :], (seq, seq))
        bias = self._bias(positions, positions, False)

        def layer(block: EncoderLayer, h: Array, _: None) -> tuple[Array, None]:
            return block(h, visible, bias), None

        use = fsdp.layouts(self).encoder_blocks
        x, _ = run_stack(self.encoder_blocks, x, None, layer, use, self.remat)
        return self._final(x, False)

    def cross_cache(self, memory: Float[Array, "src hidden"]) -> Stack:
        """Every decoder layer's cross-attention keys and values of the encoder output.

        Returns:
            One `KVCache` per layer (a tuple), or one stacked `KVCache` for scanned layers.
        """
        _, out = run_stack(
            self.decoder_blocks,
            memory,
            None,
            lambda b, h, _: (h, b.cross_attn.keys_values(h)),
            fsdp.layouts(self).decoder_blocks,
        )
        return out

    def init_cache(self, max_len: int, dtype: DTypeLike | None = None) -> Stack:
        """An empty self-attention cache for one target sequence of up to `max_len` tokens.

        Args:
            max_len: decoder start token plus generated tokens.
            dtype: of the cached keys and values; default: the model's parameter dtype.

        Returns:
            One `KVCache` per decoder layer (a tuple), or one stacked `KVCache`.
        """
        dtype = table_dtype(self.embed_tokens) if dtype is None else dtype

        def empty(block: DecoderLayer) -> KVCache:
            shape = (max_len, block.attn.num_heads, block.attn.head_dim)
            return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

        if isinstance(self.decoder_blocks, tuple):
            return tuple(empty(b) for b in self.decoder_blocks)
        return eqx.filter_vmap(empty)(self.decoder_blocks)

    def decode(
        self,
        decoder_input_ids: Int[Array, " seq"],
        cache: Stack,
        index: Int[Array, ""] | int,
        cross: Stack,
        attention_mask: Bool[ArrayLike, " src"] | Int[ArrayLike, " src"] | None = None,
    ) -> tuple[Float[Array, "seq vocab"], Stack]:
        """The decoder's forward pass for target tokens that continue a cached sequence.

        Args:
            decoder_input_ids: the new target tokens (the start token first, then one per step).
            cache: from `init_cache`, holding the keys and values of positions `< index`.
            index: the position of `decoder_input_ids[0]`.
            cross: from `cross_cache(encode(input_ids))`.
            attention_mask: the source's padding mask given to `encode`.

        Returns:
            The logits of the new tokens and the cache with their keys and values.

        Example:
            >>> memory = model.encode(source)
            >>> cross, cache = model.cross_cache(memory), model.init_cache(16)
            >>> logits, cache = model.decode(jnp.array([start]), cache, 0, cross)
        """
        seq = decoder_input_ids.shape[0]
        slots = jax.tree.leaves(cache)[0].shape[-3]
        what = f"index (the position of the first of {seq} new tokens)"
        index = check_range(
            index, 0, slots - seq + 1, what, f"the cache has {slots} slots; init_cache(max_len)."
        )
        if self.max_positions is not None:
            limit = f"{type(self).__name__}'s position table has {self.max_positions} positions."
            index = check_range(index, 0, self.max_positions - seq + 1, what, limit)
        positions = index + jnp.arange(seq)
        keys = jnp.arange(slots)
        visible = keys[None, :] <= positions[:, None]
        return self._decoder(
            decoder_input_ids, positions, keys, visible, cross, cache, index, attention_mask
        )

    def __call__(
        self,
        input_ids: Int[Array, " src"],
        decoder_input_ids: Int[Array, " seq"],
        *,
        attention_mask: Bool[ArrayLike, " src"] | Int[ArrayLike, " src"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq vocab"]:
        """Next-token logits at every target position, teacher-forced.

        Args:
            input_ids: source token ids of one sequence (vmap for a batch).
            decoder_input_ids: the decoder's input: the start token, then the target
                without its last token.
            attention_mask: 1 for real source tokens, 0 for padding; default all real.
            key: accepted for the Equinox calling convention; unused (no dropout).

        Returns:
            Logits, `(seq, vocab)`.
        """
        del key
        return self._teacher_forced(input_ids, decoder_input_ids, attention_mask)

    def _teacher_forced(
        self,
        source: Shaped[Array, "..."],
        decoder_input_ids: Int[Array, " seq"],
        attention_mask: Bool[ArrayLike, " src"] | Int[ArrayLike, " src"] | None,
    ) -> Float[Array, "seq vocab"]:
        """The forward pass of `__call__` for whatever source `encode` takes (ids, an image)."""
        seq = decoder_input_ids.shape[0]
        self._check_length(seq, "decoder_input_ids")
        positions = jnp.arange(seq)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        with placement_hint():
            cross = self.cross_cache(self.encode(source, attention_mask))
            logits, _ = self._decoder(
                decoder_input_ids, positions, positions, causal, cross, None, 0, attention_mask
            )
        return logits

    def _decoder(
        self,
        ids: Int[Array, " seq"],
        positions: Int[Array, " seq"],
        keys: Int[Array, " kv"],
        visible: Bool[Array, "seq kv"],
        cross: Stack,
        cache: Stack | None,
        index: Int[Array, ""] | int,
        attention_mask: Bool[ArrayLike, " src"] | Int[ArrayLike, " src"] | None,
    ) -> tuple[Float[Array, "seq vocab"], Stack]:
        src = jax.tree.leaves(cross)[0].shape[-3]
        seq = ids.shape[0]
        cross_visible = jnp.broadcast_to(_mask(attention_mask, src)[None, :], (seq, src))
        bias = self._bias(positions, keys, True)
        x = self._embed(self._check_ids(ids, "decoder_input_ids"), positions, True)

        def layer(block: DecoderLayer, h: Array, inputs: tuple) -> tuple[Array, Any]:
            memory, c = inputs
            return block(h, memory, cross_visible, visible, bias, c, index)

        if isinstance(self.decoder_blocks, tuple):
            n = len(self.decoder_blocks)
            per_layer: PyTree = tuple(
                zip(cross, (None,) * n if cache is None else cache, strict=True)
            )
        else:
            per_layer = (cross, cache)
        # Decoding with a cache computes no gradients: nothing to rematerialise.
        policy = self.remat if cache is None else "none"
        use = fsdp.layouts(self).decoder_blocks
        x, new = run_stack(self.decoder_blocks, x, per_layer, layer, use, policy)
        logits = self._head(self._final(x, True))
        return _mask_padded_vocab(logits, self.vocab_size), new


def _mask(
    attention_mask: Bool[ArrayLike, " src"] | Int[ArrayLike, " src"] | None, src: int
) -> Bool[Array, " src"]:
    if attention_mask is None:
        return jnp.ones((src,), bool)
    return jnp.asarray(attention_mask).astype(bool)


def in_stack(maps: list[hf.TensorMap], stack: str) -> list[hf.TensorMap]:
    """The per-layer `maps` with their layers in the model's field `stack`."""
    return [dataclasses.replace(m, stack=stack) for m in maps]
