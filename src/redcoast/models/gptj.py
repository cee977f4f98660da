"""GPT-J (Wang & Komatsuzaki 2021): parallel attention + MLP, rotary on part of each head."""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from ..nn import RematPolicy, check_remat
from . import hf
from ._stack import make_stack
from .causal_lm import AbstractCausalLM, Blocks
from .init import normal_init, zero_unused_rows
from .layers import MLP, AnyNorm, Attention, DecoderBlock, activation


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTJConfig(hf.HFConfig):
    """GPT-J's hyperparameters, named as in `transformers.GPTJConfig` (and its config.json).

    Example:
        >>> config = GPTJConfig(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4,
        ...                     rotary_dim=4)
        >>> model = GPTJ(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "gptj"
    architecture: ClassVar[str] = "GPTJForCausalLM"
    sizes: ClassVar[tuple[str, ...]] = (
        "vocab_size",
        "n_positions",
        "n_embd",
        "n_layer",
        "n_head",
        "rotary_dim",
        "n_inner",
    )
    divides: ClassVar[tuple[tuple[str, str], ...]] = (("n_head", "n_embd"),)

    vocab_size: int = 50400
    n_positions: int = 2048
    n_embd: int = 4096
    n_layer: int = 28
    n_head: int = 16
    rotary_dim: int | None = 64
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        # transformers' GPT-J keeps lm_head's bias when tying its weight; not implemented.
        self._require(tie_word_embeddings=(self.tie_word_embeddings, False))
        activation(self.activation_function)


class GPTJ(AbstractCausalLM):
    """GPT-J as an Equinox module, called on one unbatched sequence of token ids.

    Each layer is parallel: `x + attn(ln(x)) + mlp(ln(x))`, one LayerNorm. Rotary
    embeddings rotate the first `rotary_dim` features of each head, pairwise
    interleaved; the head has a bias.

    Args:
        config: the hyperparameters.
        scan_layers: stack the layers and run them with `lax.scan` (faster compiles).
        remat: rematerialise each block in the backward pass: `"none"`, `"dots"`
            (keep the projections' outputs), `"attention"` (all but attention's scores)
            or `"full"` (see `rc.remat`).
        key: for the random initialisation, as `transformers`': weights and embeddings
            N(0, `initializer_range`), zero biases.

    Example:
        >>> config = GPTJConfig(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4,
        ...                     rotary_dim=4)
        >>> model = GPTJ(config, key=jax.random.key(0))
        >>> model(jnp.arange(10)).shape
        (10, 128)
    """

    config: GPTJConfig = eqx.field(static=True)
    embed_tokens: eqx.nn.Embedding
    embed_positions: eqx.nn.Embedding | None
    blocks: Blocks
    norm: AnyNorm
    lm_head: eqx.nn.Linear | None
    remat: RematPolicy = eqx.field(static=True)

    config_class: ClassVar[type[hf.HFConfig]] = GPTJConfig
    hf_base_prefix: ClassVar[str] = "transformer."

    def __init__(
        self,
        config: GPTJConfig,
        *,
        scan_layers: bool = False,
        remat: str = "none",
        key: PRNGKeyArray,
    ):
        c = config
        kt, kh, kb = jax.random.split(key, 3)
        eps = c.layer_norm_epsilon
        head_dim = c.n_embd // c.n_head
        std = c.initializer_range

        def block(k: PRNGKeyArray) -> DecoderBlock:
            ka, km, kr = jax.random.split(k, 3)
            b = DecoderBlock(
                eqx.nn.LayerNorm(c.n_embd, eps=eps),
                Attention(
                    c.n_embd,
                    c.n_head,
                    rotary_dim=c.rotary_dim or head_dim,
                    rope_interleaved=True,
                    recompute_scores=remat == "attention",
                    key=ka,
                ),
                None,
                MLP(
                    c.n_embd,
                    c.n_inner or 4 * c.n_embd,
                    activation=activation(c.activation_function),
                    key=km,
                ),
            )
            return normal_init(b, std, key=kr)

        self.config = config
        self.remat = check_remat(remat)
        tokens = eqx.nn.Embedding(c.padded_vocab_size, c.n_embd, key=kt)
        self.embed_tokens = zero_unused_rows(normal_init(tokens, std, key=kt), c.vocab_size)
        self.embed_positions = None
        self.blocks = make_stack(block, c.n_layer, scan_layers=scan_layers, key=kb)
        self.norm = eqx.nn.LayerNorm(c.n_embd, eps=eps)
        head = eqx.nn.Linear(c.n_embd, c.padded_vocab_size, key=kh)
        self.lm_head = zero_unused_rows(normal_init(head, std, key=kh), c.vocab_size)

    @classmethod
    def hf_tensors(cls, config: GPTJConfig) -> list[hf.TensorMap]:
        """GPT-J's checkpoint names; PyTorch Linears are `(out, in)` like Equinox's."""
        h = "transformer.h.{i}."
        return [
            hf.vocab_rows("transformer.wte.weight", "embed_tokens.weight", config),
            hf.same(h + "ln_1.weight", "attn_norm.weight"),
            hf.same(h + "ln_1.bias", "attn_norm.bias"),
            hf.same(h + "attn.q_proj.weight", "attn.q_proj.weight"),
            hf.same(h + "attn.k_proj.weight", "attn.k_proj.weight"),
            hf.same(h + "attn.v_proj.weight", "attn.v_proj.weight"),
            hf.same(h + "attn.out_proj.weight", "attn.o_proj.weight"),
            hf.same(h + "mlp.fc_in.weight", "mlp.fc_in.weight"),
            hf.same(h + "mlp.fc_in.bias", "mlp.fc_in.bias"),
            hf.same(h + "mlp.fc_out.weight", "mlp.fc_out.weight"),
            hf.same(h + "mlp.fc_out.bias", "mlp.fc_out.bias"),
            hf.same("transformer.ln_f.weight", "norm.weight"),
            hf.same("transformer.ln_f.bias", "norm.bias"),
            hf.vocab_rows("lm_head.weight", "lm_head.weight", config),
            hf.vocab_rows("lm_head.bias", "lm_head.bias", config),
        ]
