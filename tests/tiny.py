"""Small reference architectures and their Megatron-LM layouts, for tests and benchmarks.

Each stands for a family the sharding rules must get right:

- `TinyGPT`: `eqx.nn.MultiheadAttention` + GELU MLP, learned positions, tied head.
- `TinyLlama`: separate Q/K/V/O Linears with grouped-query heads, RMSNorm, RoPE,
  and a SwiGLU MLP whose fields are declared down, gate, up.
- `TinyGPTJ`: GPT-J's parallel block, attention and MLP reading the same input.
- `DeepMLP`: a plain stack of Linear layers.

All are called on one unbatched input and batched with `jax.vmap`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from redcoast.models.layers import MLP, Attention, SwiGLU
from redcoast.parallel.mesh import MODEL


class GPTBlock(eqx.Module):
    """Pre-LN block: `x + attn(ln(x))`, then `x + mlp(ln(x))`, with `eqx.nn.MultiheadAttention`."""

    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: MLP
    dropout: eqx.nn.Dropout

    def __init__(self, hidden: int, heads: int, *, dropout: float = 0.0, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.ln1 = eqx.nn.LayerNorm(hidden)
        self.attn = eqx.nn.MultiheadAttention(
            heads,
            hidden,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            key=ka,
        )
        self.ln2 = eqx.nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, 4 * hidden, key=km)
        self.dropout = eqx.nn.Dropout(dropout)

    def __call__(
        self, x: Float[Array, "seq hidden"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq hidden"]:
        seq = x.shape[0]
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        h = jax.vmap(self.ln1)(x)
        mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        x = x + self.dropout(self.attn(h, h, h, mask=mask), key=k1)
        return x + self.dropout(self.mlp(jax.vmap(self.ln2)(x)), key=k2)


class TinyGPT(eqx.Module):
    """A GPT-2-shaped language model: token and position embeddings, tied output head."""

    embed: eqx.nn.Embedding
    pos_embed: eqx.nn.Embedding
    blocks: tuple[GPTBlock, ...]
    ln_f: eqx.nn.LayerNorm

    def __init__(
        self,
        vocab: int = 64,
        hidden: int = 32,
        layers: int = 2,
        heads: int = 4,
        max_len: int = 32,
        *,
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        keys = jax.random.split(key, layers + 2)
        self.embed = eqx.nn.Embedding(vocab, hidden, key=keys[0])
        self.pos_embed = eqx.nn.Embedding(max_len, hidden, key=keys[1])
        self.blocks = tuple(GPTBlock(hidden, heads, dropout=dropout, key=k) for k in keys[2:])
        self.ln_f = eqx.nn.LayerNorm(hidden)

    def __call__(
        self, ids: Int[Array, " seq"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(ids) + jax.vmap(self.pos_embed)(jnp.arange(ids.shape[0]))
        keys = (
            [None] * len(self.blocks)
            if key is None
            else list(jax.random.split(key, len(self.blocks)))
        )
        for block, k in zip(self.blocks, keys, strict=True):
            x = block(x, key=k)
        return jax.vmap(self.ln_f)(x) @ self.embed.weight.T


class LlamaBlock(eqx.Module):
    """Pre-RMSNorm block with grouped-query attention, RoPE and SwiGLU."""

    input_norm: eqx.nn.RMSNorm
    attn: Attention
    post_norm: eqx.nn.RMSNorm
    mlp: SwiGLU

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        head_dim = hidden // heads
        self.input_norm = eqx.nn.RMSNorm(hidden, use_bias=False)
        self.attn = Attention(hidden, heads, num_kv_heads=kv_heads, rotary_dim=head_dim, key=ka)
        self.post_norm = eqx.nn.RMSNorm(hidden, use_bias=False)
        self.mlp = SwiGLU(hidden, ffn, key=km)

    def __call__(self, x: Float[Array, "seq hidden"]) -> Float[Array, "seq hidden"]:
        x = x + self.attn(jax.vmap(self.input_norm)(x))
        return x + self.mlp(jax.vmap(self.post_norm)(x))


class TinyLlama(eqx.Module):
    """A LLaMA-shaped language model with an untied output head."""

    embed: eqx.nn.Embedding
    blocks: tuple[LlamaBlock, ...]
    norm: eqx.nn.RMSNorm
    lm_head: eqx.nn.Linear

    def __init__(
        self,
        vocab: int = 64,
        hidden: int = 32,
        layers: int = 2,
        heads: int = 4,
        kv_heads: int = 2,
        ffn: int = 64,
        *,
        key: PRNGKeyArray,
    ):
        keys = jax.random.split(key, layers + 2)
        self.embed = eqx.nn.Embedding(vocab, hidden, key=keys[0])
        self.blocks = tuple(LlamaBlock(hidden, heads, kv_heads, ffn, key=k) for k in keys[2:])
        self.norm = eqx.nn.RMSNorm(hidden, use_bias=False)
        self.lm_head = eqx.nn.Linear(hidden, vocab, use_bias=False, key=keys[1])

    def __call__(
        self, ids: Int[Array, " seq"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq vocab"]:
        del key
        x = jax.vmap(self.embed)(ids)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.lm_head)(jax.vmap(self.norm)(x))


class GPTJBlock(eqx.Module):
    """GPT-J's parallel block: `x + attn(ln(x)) + mlp(ln(x))`, partial rotary."""

    ln: eqx.nn.LayerNorm
    attn: Attention
    mlp: MLP

    def __init__(self, hidden: int, heads: int, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.ln = eqx.nn.LayerNorm(hidden)
        head_dim = hidden // heads
        self.attn = Attention(
            hidden, heads, rotary_dim=head_dim // 2, rope_interleaved=True, out_bias=False, key=ka
        )
        self.mlp = MLP(hidden, 4 * hidden, key=km)

    def __call__(self, x: Float[Array, "seq hidden"]) -> Float[Array, "seq hidden"]:
        h = jax.vmap(self.ln)(x)
        return x + self.attn(h) + self.mlp(h)


class TinyGPTJ(eqx.Module):
    """A GPT-J-shaped language model with an untied, biased output head."""

    embed: eqx.nn.Embedding
    blocks: tuple[GPTJBlock, ...]
    ln_f: eqx.nn.LayerNorm
    lm_head: eqx.nn.Linear

    def __init__(
        self,
        vocab: int = 64,
        hidden: int = 32,
        layers: int = 2,
        heads: int = 4,
        *,
        key: PRNGKeyArray,
    ):
        keys = jax.random.split(key, layers + 2)
        self.embed = eqx.nn.Embedding(vocab, hidden, key=keys[0])
        self.blocks = tuple(GPTJBlock(hidden, heads, key=k) for k in keys[2:])
        self.ln_f = eqx.nn.LayerNorm(hidden)
        self.lm_head = eqx.nn.Linear(hidden, vocab, key=keys[1])

    def __call__(
        self, ids: Int[Array, " seq"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq vocab"]:
        del key
        x = jax.vmap(self.embed)(ids)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.lm_head)(jax.vmap(self.ln_f)(x))


class DeepMLP(eqx.Module):
    """A stack of Linear layers with ReLU between them."""

    layers: tuple[eqx.nn.Linear, ...]

    def __init__(self, sizes: tuple[int, ...] = (64, 128, 128, 128, 128, 16), *, key: PRNGKeyArray):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = tuple(
            eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys, strict=True)
        )

    def __call__(
        self, x: Float[Array, " features"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " out"]:
        del key
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


_COLUMN = (
    "query_proj",
    "key_proj",
    "value_proj",
    "q_proj",
    "q_b_proj",  # MLA's up-projections to every head's query, and key and value
    "kv_b_proj",
    "k_proj",
    "v_proj",
    "fc_in",
    "gate_proj",
    "up_proj",
    "lm_head",
)
_ROW = ("output_proj", "o_proj", "fc_out", "down_proj")
_TOKEN_EMBEDDINGS = ("embed", "embed_tokens")
_EXPERTS = ("w1", "w2", "w3")  # rc.models.SparseMoE's stacked experts


def _first_attention(model: eqx.Module) -> eqx.Module | None:
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, tuple):
        return blocks[0].attn if blocks else None
    return getattr(blocks, "attn", None)


_LORA_PARTS = ("base", "lora_a", "lora_b")


def _lora_spec(owner: str, part: str, leaf: Array, base: P) -> P:
    """A LoRA adapter beside a Megatron-split base, as Megatron-based LoRA splits it: A
    replicated and B column-parallel beside a column-parallel base; A row-parallel and B
    replicated beside a row-parallel one; both replicated beside a replicated base."""
    if part == "base" or not any(base):
        return base if part == "base" else P()
    column = owner in _COLUMN
    if (part == "lora_b") == column:
        return base
    return P()


def megatron_specs(model: eqx.Module, n_model_shards: int) -> PyTree:
    """The layout Megatron-LM (Shoeybi et al. 2019) uses, written out by hand by layer name.

    Column-parallel Q/K/V, MLP input and output head (bias split with them), row-parallel
    O and MLP output, a vocabulary-parallel token embedding, and everything else
    (norms, position tables, routers) replicated; Q or K/V whose heads do not divide the
    shards are replicated (Megatron's grouped-query attention with fewer groups than
    shards); stacked experts split whole over the shards (expert parallelism, Megatron's
    MoE layout), or within each expert when their number does not divide the shards.
    Multi-head latent attention (DeepSeek's MLA) as Megatron-based MLA splits it: the
    low-rank `q_a_proj` and `kv_a_proj_with_mqa` replicated (their whole outputs are
    normed), `q_b_proj` and `kv_b_proj` column-parallel by whole heads, `o_proj` row.
    Stacked layers (scanned) keep the layout on their trailing axes; a LoRA layer's
    base splits as the layer, its adapters as `_lora_spec` says. `DeepMLP`
    alternates column, row, column, ... Covers the tiny models and the decoder zoo;
    the reference the sharding rules are checked against.
    """
    attn = _first_attention(model)
    heads: dict[str, int] = {}
    if attn is not None:
        q = attn.num_heads  # pyright: ignore[reportAttributeAccessIssue]
        kv = getattr(attn, "num_kv_heads", None) or q
        heads = {"q_proj": q, "query_proj": q, "q_b_proj": q, "kv_b_proj": q}
        heads.update({name: kv for name in ("k_proj", "v_proj", "key_proj", "value_proj")})

    def spec(path: tuple, leaf: Array) -> P:
        names = [str(getattr(k, "name", getattr(k, "idx", k))) for k in path]
        if len(names) < 2:  # BART's final_logits_bias: split with the vocabulary it biases
            return P(MODEL) if names == ["final_logits_bias"] else P()
        owner, kind = names[-2], names[-1]
        if owner in _LORA_PARTS and len(names) >= 3:
            return _lora_spec(names[-3], owner, leaf, spec(path[:-2] + path[-1:], leaf))
        if isinstance(model, DeepMLP):
            column = int(names[1]) % 2 == 0
            if kind == "weight":
                return P(MODEL, None) if column else P(None, MODEL)
            return P(MODEL) if column else P()
        if owner == "mlp" and kind in _EXPERTS:
            # Mixtral's stacked experts, expert-parallel: each shard holds whole experts
            # (Megatron-LM's MoE layout); within each expert when they do not divide.
            if leaf.shape[-3] % n_model_shards == 0:
                trailing = (MODEL, None, None)
            else:
                trailing = (None, None, MODEL) if kind == "w2" else (None, MODEL, None)
            return P(*([None] * (leaf.ndim - 3)), *trailing)
        if owner in _TOKEN_EMBEDDINGS and kind == "weight" and len(names) == 2:
            trailing: tuple = (MODEL, None)
        elif owner in heads and heads[owner] % n_model_shards:
            return P()
        elif owner in _COLUMN:
            trailing = (MODEL, None) if kind == "weight" else (MODEL,)
        elif owner in _ROW and kind == "weight":
            trailing = (None, MODEL)
        else:
            return P()
        return P(*([None] * (leaf.ndim - len(trailing))), *trailing)

    return jax.tree_util.tree_map_with_path(spec, eqx.filter(model, eqx.is_array))


def drawn(cls: type, config: object, *, scan_layers: bool = False) -> eqx.Module:
    """A model of `cls` whose arrays are drawn on the host into the shapes the
    constructor gives, which compiles nothing (eager initialisation compiles every op)."""
    skeleton = eqx.filter_eval_shape(cls, config, scan_layers=scan_layers, key=jax.random.key(0))
    rng = np.random.default_rng(0)

    def draw(leaf: object) -> object:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        return jnp.asarray(rng.normal(0.0, 0.3, leaf.shape).astype(leaf.dtype))

    return jax.tree_util.tree_map(draw, skeleton)


DECODERS = {"gpt2": "GPT2", "llama": "Llama", "opt": "OPT", "gptj": "GPTJ"}
"""The zoo's decoder architectures: `model_type` -> class name in `redcoast.models`."""


def hf_decoder_config(
    arch: str, *, vocab: int, width: int, gpt2_layers: int = 2, eos_token_id: int = 1
) -> object:
    """A small `transformers` config of a zoo decoder: `width` wide, 2 layers (GPT-2:
    `gpt2_layers`), 4 heads, MLPs twice as wide, 64 positions."""
    import transformers  # the `hf` extra; only the tests that compare with it call this

    common = dict(vocab_size=vocab, pad_token_id=1, bos_token_id=0, eos_token_id=eos_token_id)
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_positions=64, n_embd=width, n_layer=gpt2_layers, n_head=4, **common
        )
    if arch == "llama":
        return transformers.LlamaConfig(
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **common,
        )
    if arch == "opt":
        return transformers.OPTConfig(
            hidden_size=width,
            ffn_dim=2 * width,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=width,
            **common,
        )
    return transformers.GPTJConfig(
        n_positions=64, n_embd=width, n_layer=2, n_head=4, rotary_dim=width // 8, **common
    )


FAMILIES = {
    "llama3": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
    "mixtral": "Mixtral",
    "qwen3_moe": "Qwen3Moe",
    "gemma2": "Gemma2",
    "gemma3": "Gemma3",
    "phi3": "Phi3",
}
"""Today's families on the shared decoder: a name here -> class name in `redcoast.models`."""


def family_config(
    name: str,
    *,
    vocab: int = 128,
    width: int = 32,
    layers: int = 3,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 64,
    window: int = 5,
    experts: int = 4,
) -> object:
    """A small redcoast config of a family of `FAMILIES`, each with its variants on: Llama
    3's scaled RoPE and tied head, Qwen 2's Q/K/V biases and windows above layer 1, Qwen
    3's query/key norms, Mistral's window, Mixtral's experts (Qwen3-MoE's: more, narrower,
    three a token), Gemma's soft caps and
    local layers (Gemma 3's with their own RoPE base), Phi-3's fused projections."""
    import redcoast as rc

    common = dict(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
    )
    head_dim = {"head_dim": width // heads}
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    m = rc.models
    configs = {
        "llama3": lambda: m.LlamaConfig(
            **common, rope_theta=500000.0, rope_scaling=llama3, tie_word_embeddings=True
        ),
        "qwen2": lambda: m.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=window, max_window_layers=1
        ),
        "qwen3": lambda: m.Qwen3Config(**common, **head_dim),
        "mistral": lambda: m.MistralConfig(**common, sliding_window=window),
        "mixtral": lambda: m.MixtralConfig(**common, num_local_experts=experts),
        "qwen3_moe": lambda: m.Qwen3MoeConfig(
            **common,
            **head_dim,
            moe_intermediate_size=ffn // 2,
            num_experts=2 * experts,
            num_experts_per_tok=3,
        ),
        "gemma2": lambda: m.Gemma2Config(
            **common, **head_dim, sliding_window=window, query_pre_attn_scalar=width // heads
        ),
        "gemma3": lambda: m.Gemma3TextConfig(
            **common,
            **head_dim,
            sliding_window=window,
            sliding_window_pattern=2,
            query_pre_attn_scalar=width // heads,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
        "phi3": lambda: m.Phi3Config(**common, sliding_window=window),
    }
    return configs[name]()
