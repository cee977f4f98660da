"""GPT-J (Wang & Komatsuzaki 2021): parallel attention + MLP, rotary on part of each head."""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from . import hf
from ._stack import make_stack
from .causal_lm import AbstractCausalLM, CausalLMParts, LayerOptions
from .gpt2 import GPTConfig
from .init import normal_init, token_embeddings, vocab_head
from .layers import MLP, Attention, DecoderBlock, activation


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTJConfig(GPTConfig):
    """GPT-J's hyperparameters, named as in `transformers.GPTJConfig` (and its config.json).

    Example:
        >>> config = GPTJConfig(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4,
        ...                     rotary_dim=4)
        >>> model = GPTJ(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "gptj"
    architecture: ClassVar[str] = "GPTJForCausalLM"
    sizes: ClassVar[tuple[str, ...]] = (*GPTConfig.sizes, "rotary_dim")

    vocab_size: int = 50400
    n_positions: int = 2048
    n_embd: int = 4096
    n_layer: int = 28
    n_head: int = 16
    rotary_dim: int | None = 64
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        # transformers' GPT-J keeps lm_head's bias when tying its weight; not implemented.
        self._require(tie_word_embeddings=(self.tie_word_embeddings, False))


class GPTJ(AbstractCausalLM):
    """GPT-J as an Equinox module, called on one unbatched sequence of token ids.

    Each layer is parallel: `x + attn(ln(x)) + mlp(ln(x))`, one LayerNorm. Rotary
    embeddings rotate the first `rotary_dim` features of each head, pairwise
    interleaved; the head has a bias.

    Constructed with `(config, *, scan_layers, remat, attention, key)` (see
    `AbstractCausalLM.__init__`). Initialised as `transformers` does: weights and
    embeddings N(0, `initializer_range`), zero biases.

    Example:
        >>> config = GPTJConfig(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4,
        ...                     rotary_dim=4)
        >>> model = GPTJ(config, key=jax.random.key(0))
        >>> model(jnp.arange(10)).shape
        (10, 128)
    """

    config_class: ClassVar[type[hf.HFConfig]] = GPTJConfig
    hf_base_prefix: ClassVar[str] = "transformer."

    @classmethod
    def build(cls, config: GPTJConfig, how: LayerOptions, key: PRNGKeyArray) -> CausalLMParts:
        c = config
        kt, kh, kb = jax.random.split(key, 3)
        eps = c.layer_norm_epsilon
        std = c.initializer_range

        def block(k: PRNGKeyArray) -> DecoderBlock:
            ka, km, kr = jax.random.split(k, 3)
            b = DecoderBlock(
                eqx.nn.LayerNorm(c.n_embd, eps=eps),
                Attention(
                    c.n_embd,
                    c.n_head,
                    rotary_dim=c.rotary_dim or c.n_embd // c.n_head,
                    rope_interleaved=True,
                    recompute_scores=how.remat == "attention",
                    implementation=how.attention,
                    key=ka,
                ),
                None,
                MLP(
                    c.n_embd,
                    c.inner_size,
                    activation=activation(c.activation_function),
                    key=km,
                ),
            )
            return normal_init(b, std, key=kr)

        return CausalLMParts(
            embed_tokens=token_embeddings(c, c.n_embd, std, key=kt),
            embed_positions=None,
            blocks=make_stack(block, c.n_layer, scan_layers=how.scan_layers, key=kb),
            norm=eqx.nn.LayerNorm(c.n_embd, eps=eps),
            lm_head=vocab_head(c, c.n_embd, std, key=kh, use_bias=True),
        )

    @classmethod
    def hf_tensors(cls, config: GPTJConfig) -> list[hf.TensorMap]:
        """GPT-J's checkpoint names; PyTorch Linears are `(out, in)` like Equinox's."""
        h = "transformer.h.{i}."
        maps = [
            hf.vocab_rows("transformer.wte.weight", "embed_tokens.weight", config),
            hf.same("transformer.ln_f.weight", "norm.weight"),
            hf.same("transformer.ln_f.bias", "norm.bias"),
            hf.vocab_rows("lm_head.weight", "lm_head.weight", config),
            hf.vocab_rows("lm_head.bias", "lm_head.bias", config),
        ]
        for theirs, ours, kinds in [
            ("ln_1", "attn_norm", ("weight", "bias")),
            ("attn.q_proj", "attn.q_proj", ("weight",)),
            ("attn.k_proj", "attn.k_proj", ("weight",)),
            ("attn.v_proj", "attn.v_proj", ("weight",)),
            ("attn.out_proj", "attn.o_proj", ("weight",)),
            ("mlp.fc_in", "mlp.fc_in", ("weight", "bias")),
            ("mlp.fc_out", "mlp.fc_out", ("weight", "bias")),
        ]:
            maps.extend(hf.same(f"{h}{theirs}.{kind}", f"{ours}.{kind}") for kind in kinds)
        return maps
