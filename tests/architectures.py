"""Architectures beyond the decoder zoo, written from their papers, each with a hand layout.

Every model is called on one example and batched with `jax.vmap`. Each `*_layout`
function is the tensor-parallel layout an engineer would write by hand for it, by
path, independently of redcoast's rules (which tests and `scripts/bench_comm.py`
compare against them):

- `MoELM`: a decoder whose MLP is a top-2 mixture of stacked experts (Shazeer et al.
  2017; Fedus et al. 2021), `w_in (E, d, f)` / `w_out (E, f, d)` applied with einsum.
  Hand layouts: expert-parallel (experts split whole) and Megatron within experts.
- `DiT`: a diffusion transformer with adaLN-Zero modulation (Peebles & Xie 2023):
  a patch convolution, a timestep MLP, `shift, scale, gate = split(mod(c))`.
- `ViT`: conv patch embedding, a class token, an odd number of classes
  (Dosovitskiy et al. 2021).
- `BertClassifier`: a BERT encoder with pooler and classifier (Devlin et al. 2019).
- `EncoderDecoder`: a transformer encoder-decoder with cross-attention (Vaswani 2017).
- `ScanDecoder`: decoder blocks stacked on a leading layer axis, run with `lax.scan`.
- `RawMLP`: an MLP of raw arrays applied with einsum, biases included.
"""

from __future__ import annotations

import fnmatch
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from redcoast._tree_paths import path_str

M = "model"
COL_W, ROW_W, COL_B = P(M, None), P(None, M), P(M)


def layout(model: eqx.Module, table: dict[str, P]) -> PyTree:
    """Specs by glob over dotted paths (last match wins); everything else replicated."""

    def spec(path: tuple, leaf: Array) -> P:
        name = path_str(path)
        found = P()
        for pattern, s in table.items():
            if fnmatch.fnmatchcase(name, pattern):
                found = s
        return P(*([None] * (leaf.ndim - len(found))), *found) if len(found) else P()

    return jax.tree_util.tree_map_with_path(spec, eqx.filter(model, eqx.is_array))


def _causal(seq: int) -> Array:
    return jnp.tril(jnp.ones((seq, seq), dtype=bool))


def _mha(hidden: int, heads: int, key: PRNGKeyArray) -> eqx.nn.MultiheadAttention:
    return eqx.nn.MultiheadAttention(
        heads, hidden, use_query_bias=True, use_value_bias=True, use_output_bias=True, key=key
    )


MHA_LAYOUT = {
    "*.attn.query_proj.weight": COL_W,
    "*.attn.key_proj.weight": COL_W,
    "*.attn.value_proj.weight": COL_W,
    "*.attn.query_proj.bias": COL_B,
    "*.attn.value_proj.bias": COL_B,
    "*.attn.output_proj.weight": ROW_W,
    "*.fc1.weight": COL_W,
    "*.fc1.bias": COL_B,
    "*.fc2.weight": ROW_W,
}


class Block(eqx.Module):
    """Pre-LN transformer block: attention, then a GELU MLP (`fc1`, `fc2`)."""

    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, hidden: int, heads: int, ffn: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(hidden), eqx.nn.LayerNorm(hidden)
        self.attn = _mha(hidden, heads, k1)
        self.fc1 = eqx.nn.Linear(hidden, ffn, key=k2)
        self.fc2 = eqx.nn.Linear(ffn, hidden, key=k3)

    def mlp(self, x: Float[Array, "seq hidden"]) -> Float[Array, "seq hidden"]:
        return jax.vmap(lambda h: self.fc2(jax.nn.gelu(self.fc1(h))))(x)

    def __call__(
        self, x: Float[Array, "seq hidden"], mask: Array | None = None
    ) -> Float[Array, "seq hidden"]:
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=mask)
        return x + self.mlp(jax.vmap(self.ln2)(x))


# ----------------------------------------------------------------------------- MoE


class MoE(eqx.Module):
    """Top-2 mixture of GELU experts stacked in arrays; every expert sees every token
    and the router's renormalised top-2 weights combine them (einsum throughout)."""

    router: eqx.nn.Linear
    w_in: Array
    b_in: Array
    w_out: Array

    def __init__(self, hidden: int, ffn: int, experts: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.router = eqx.nn.Linear(hidden, experts, use_bias=False, key=k1)
        self.w_in = jax.random.normal(k2, (experts, hidden, ffn)) / math.sqrt(hidden)
        self.b_in = jnp.zeros((experts, ffn))
        self.w_out = jax.random.normal(k3, (experts, ffn, hidden)) / math.sqrt(ffn)

    def __call__(self, x: Float[Array, "seq hidden"]) -> Float[Array, "seq hidden"]:
        probs = jax.nn.softmax(jax.vmap(self.router)(x), axis=-1)
        kth = jax.lax.top_k(probs, 2)[0][:, -1:]
        gates = jnp.where(probs >= kth, probs, 0.0)
        gates = gates / gates.sum(-1, keepdims=True)
        h = jax.nn.gelu(jnp.einsum("td,edf->etf", x, self.w_in) + self.b_in[:, None, :])
        y = jnp.einsum("etf,efd->etd", h, self.w_out)
        return jnp.einsum("etd,te->td", y, gates)


class MoEBlock(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    moe: MoE

    def __init__(self, hidden: int, heads: int, ffn: int, experts: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(hidden), eqx.nn.LayerNorm(hidden)
        self.attn = _mha(hidden, heads, k1)
        self.moe = MoE(hidden, ffn, experts, key=k2)

    def __call__(self, x: Float[Array, "seq hidden"]) -> Float[Array, "seq hidden"]:
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=_causal(x.shape[0]))
        return x + self.moe(jax.vmap(self.ln2)(x))


class MoELM(eqx.Module):
    """A decoder LM with mixture-of-experts MLPs and a tied head."""

    embed: eqx.nn.Embedding
    pos: Array
    blocks: list[MoEBlock]
    ln: eqx.nn.LayerNorm

    def __init__(
        self,
        vocab: int = 64,
        hidden: int = 32,
        layers: int = 2,
        heads: int = 4,
        ffn: int = 64,
        experts: int = 4,
        seq: int = 16,
        *,
        key: PRNGKeyArray,
    ):
        keys = jax.random.split(key, layers + 1)
        self.embed = eqx.nn.Embedding(vocab, hidden, key=keys[0])
        self.pos = 0.02 * jnp.ones((seq, hidden))
        self.blocks = [MoEBlock(hidden, heads, ffn, experts, key=k) for k in keys[1:]]
        self.ln = eqx.nn.LayerNorm(hidden)

    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(ids) + self.pos[: ids.shape[0]]
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.ln)(x) @ self.embed.weight.T


_ATTN = {k: v for k, v in MHA_LAYOUT.items() if ".attn." in k}
MOE_EXPERT_PARALLEL = {
    "embed.weight": COL_W,
    **_ATTN,
    "*.moe.w_in": P(M, None, None),
    "*.moe.b_in": P(M, None),
    "*.moe.w_out": P(M, None, None),
}
MOE_MEGATRON = {
    "embed.weight": COL_W,
    **_ATTN,
    "*.moe.w_in": P(None, None, M),
    "*.moe.b_in": P(None, M),
    "*.moe.w_out": P(None, M, None),
}


# ----------------------------------------------------------------------------- DiT


class DiTBlock(eqx.Module):
    """adaLN-Zero: `shift, scale, gate` for attention and MLP come from `mod(c)`."""

    mod: eqx.nn.Linear
    block: Block

    def __init__(self, hidden: int, heads: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.mod = eqx.nn.Linear(hidden, 6 * hidden, key=k1)
        self.block = Block(hidden, heads, 4 * hidden, key=k2)

    def __call__(
        self, x: Float[Array, "seq hidden"], c: Float[Array, " hidden"]
    ) -> Float[Array, "seq hidden"]:
        s1, sc1, g1, s2, sc2, g2 = jnp.split(self.mod(jax.nn.silu(c)), 6)
        b = self.block
        h = jax.vmap(b.ln1)(x) * (1 + sc1) + s1
        x = x + g1 * b.attn(h, h, h)
        h = jax.vmap(b.ln2)(x) * (1 + sc2) + s2
        return x + g2 * b.mlp(h)


class DiT(eqx.Module):
    """Patchify (conv), timestep MLP, adaLN-Zero blocks, modulated linear decoder."""

    patch: eqx.nn.Conv2d
    pos: Array
    t1: eqx.nn.Linear
    t2: eqx.nn.Linear
    blocks: list[DiTBlock]
    final_mod: eqx.nn.Linear
    final_ln: eqx.nn.LayerNorm
    out: eqx.nn.Linear
    p: int = eqx.field(static=True)

    def __init__(
        self,
        channels: int = 4,
        size: int = 8,
        p: int = 2,
        hidden: int = 32,
        layers: int = 2,
        heads: int = 4,
        *,
        key: PRNGKeyArray,
    ):
        keys = jax.random.split(key, layers + 5)
        self.p = p
        self.patch = eqx.nn.Conv2d(channels, hidden, p, stride=p, key=keys[0])
        self.pos = 0.02 * jnp.ones(((size // p) ** 2, hidden))
        self.t1 = eqx.nn.Linear(hidden, 4 * hidden, key=keys[1])
        self.t2 = eqx.nn.Linear(4 * hidden, hidden, key=keys[2])
        self.blocks = [DiTBlock(hidden, heads, key=k) for k in keys[5:]]
        self.final_mod = eqx.nn.Linear(hidden, 2 * hidden, key=keys[3])
        self.final_ln = eqx.nn.LayerNorm(hidden, use_weight=False, use_bias=False)
        self.out = eqx.nn.Linear(hidden, p * p * channels, key=keys[4])

    def __call__(self, x: dict[str, Array]) -> Float[Array, "patches out"]:
        img, t = x["img"], x["t"]
        h = self.patch(img)
        h = h.reshape(h.shape[0], -1).T + self.pos
        half = self.t1.in_features // 2
        freqs = jnp.exp(-jnp.log(10_000.0) * jnp.arange(half) / half)
        emb = jnp.concatenate([jnp.cos(t * freqs), jnp.sin(t * freqs)])
        c = self.t2(jax.nn.silu(self.t1(emb)))
        for block in self.blocks:
            h = block(h, c)
        shift, scale = jnp.split(self.final_mod(jax.nn.silu(c)), 2)
        h = jax.vmap(self.final_ln)(h) * (1 + scale) + shift
        return jax.vmap(self.out)(h)


DIT_LAYOUT = {
    # The timestep MLP as a Megatron pair, every adaLN modulation replicated (it acts on
    # one vector per example), the patch convolution replicated, blocks Megatron.
    "t1.weight": COL_W,
    "t1.bias": COL_B,
    "t2.weight": ROW_W,
    **{f"blocks.*.block.{k[2:]}": v for k, v in MHA_LAYOUT.items()},
    "out.weight": COL_W,
    "out.bias": COL_B,
}

# The zoo's text-conditioned DiT (`redcoast.models.DiT`) by hand: Megatron blocks, the
# timestep MLP a column-row pair, the word table split on the vocabulary (Megatron's
# token embedding), the output projection column-parallel (Megatron's output head, as
# DIT_LAYOUT), adaLN modulations and the patch convolution replicated.
ZOO_DIT_LAYOUT = {
    "words.weight": COL_W,
    "time_in.weight": COL_W,
    "time_in.bias": COL_B,
    "time_out.weight": ROW_W,
    **{f"blocks.*.attn.{p}_proj.weight": COL_W for p in "qkv"},
    **{f"blocks.*.attn.{p}_proj.bias": COL_B for p in "qkv"},
    "blocks.*.attn.o_proj.weight": ROW_W,
    "blocks.*.mlp.fc_in.weight": COL_W,
    "blocks.*.mlp.fc_in.bias": COL_B,
    "blocks.*.mlp.fc_out.weight": ROW_W,
    "out.weight": COL_W,
    "out.bias": COL_B,
}


# ----------------------------------------------------------------------------- ViT


class ViT(eqx.Module):
    """Conv patch embedding, class token, learned positions, blocks, a linear head."""

    patch: eqx.nn.Conv2d
    cls: Array
    pos: Array
    blocks: list[Block]
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(
        self,
        channels: int = 3,
        size: int = 16,
        p: int = 4,
        hidden: int = 32,
        layers: int = 2,
        heads: int = 4,
        classes: int = 10,
        *,
        key: PRNGKeyArray,
    ):
        keys = jax.random.split(key, layers + 2)
        self.patch = eqx.nn.Conv2d(channels, hidden, p, stride=p, key=keys[0])
        self.cls = jnp.zeros((1, hidden))
        self.pos = 0.02 * jnp.ones(((size // p) ** 2 + 1, hidden))
        self.blocks = [Block(hidden, heads, 4 * hidden, key=k) for k in keys[2:]]
        self.ln = eqx.nn.LayerNorm(hidden)
        self.head = eqx.nn.Linear(hidden, classes, key=keys[1])

    def __call__(self, img: Float[Array, "c h w"]) -> Float[Array, " classes"]:
        h = self.patch(img)
        h = jnp.concatenate([self.cls, h.reshape(h.shape[0], -1).T]) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h[0]))


VIT_LAYOUT = dict(MHA_LAYOUT)  # patch conv and a 10-class head replicated


# ----------------------------------------------------------------------------- BERT


class BertClassifier(eqx.Module):
    """BERT: token + position + segment embeddings, post-LN blocks, pooler, classifier."""

    word: eqx.nn.Embedding
    position: eqx.nn.Embedding
    ln: eqx.nn.LayerNorm
    blocks: list[Block]
    pooler: eqx.nn.Linear
    classifier: eqx.nn.Linear

    def __init__(
        self,
        vocab: int = 64,
        hidden: int = 32,
        layers: int = 2,
        heads: int = 4,
        seq: int = 16,
        classes: int = 3,
        *,
        key: PRNGKeyArray,
    ):
        keys = jax.random.split(key, layers + 4)
        self.word = eqx.nn.Embedding(vocab, hidden, key=keys[0])
        self.position = eqx.nn.Embedding(seq, hidden, key=keys[1])
        self.ln = eqx.nn.LayerNorm(hidden)
        self.blocks = [Block(hidden, heads, 4 * hidden, key=k) for k in keys[4:]]
        self.pooler = eqx.nn.Linear(hidden, hidden, key=keys[2])
        self.classifier = eqx.nn.Linear(hidden, classes, key=keys[3])

    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, " classes"]:
        pos = jnp.arange(ids.shape[0])
        x = jax.vmap(self.ln)(jax.vmap(self.word)(ids) + jax.vmap(self.position)(pos))
        for block in self.blocks:
            x = block(x)
        return self.classifier(jnp.tanh(self.pooler(x[0])))


BERT_LAYOUT = {"word.weight": COL_W, **MHA_LAYOUT}  # pooler and classifier replicated


# ----------------------------------------------------------------------------- enc-dec


class DecoderBlock(eqx.Module):
    block: Block
    ln_x: eqx.nn.LayerNorm
    cross: eqx.nn.MultiheadAttention

    def __init__(self, hidden: int, heads: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.block = Block(hidden, heads, 4 * hidden, key=k1)
        self.ln_x = eqx.nn.LayerNorm(hidden)
        self.cross = _mha(hidden, heads, k2)

    def __call__(
        self, x: Float[Array, "seq hidden"], memory: Float[Array, "src hidden"]
    ) -> Float[Array, "seq hidden"]:
        b = self.block
        h = jax.vmap(b.ln1)(x)
        x = x + b.attn(h, h, h, mask=_causal(x.shape[0]))
        x = x + self.cross(jax.vmap(self.ln_x)(x), memory, memory)
        return x + b.mlp(jax.vmap(b.ln2)(x))


class EncoderDecoder(eqx.Module):
    """Shared embeddings, an encoder stack, a decoder stack with cross-attention, tied head."""

    embed: eqx.nn.Embedding
    encoder: list[Block]
    ln_enc: eqx.nn.LayerNorm
    decoder: list[DecoderBlock]
    ln_dec: eqx.nn.LayerNorm

    def __init__(
        self,
        vocab: int = 64,
        hidden: int = 32,
        layers: int = 2,
        heads: int = 4,
        *,
        key: PRNGKeyArray,
    ):
        keys = jax.random.split(key, 2 * layers + 1)
        self.embed = eqx.nn.Embedding(vocab, hidden, key=keys[0])
        self.encoder = [Block(hidden, heads, 4 * hidden, key=k) for k in keys[1 : layers + 1]]
        self.decoder = [DecoderBlock(hidden, heads, key=k) for k in keys[layers + 1 :]]
        self.ln_enc, self.ln_dec = eqx.nn.LayerNorm(hidden), eqx.nn.LayerNorm(hidden)

    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        memory = jax.vmap(self.embed)(ids[::-1])
        for block in self.encoder:
            memory = block(memory)
        memory = jax.vmap(self.ln_enc)(memory)
        x = jax.vmap(self.embed)(ids)
        for block in self.decoder:
            x = block(x, memory)
        return jax.vmap(self.ln_dec)(x) @ self.embed.weight.T


ENC_DEC_LAYOUT = {
    "embed.weight": COL_W,
    **MHA_LAYOUT,
    **{k.replace("*.attn.", "*.cross."): v for k, v in MHA_LAYOUT.items() if ".attn." in k},
}


# ----------------------------------------------------------------------------- scan


class ScanDecoder(eqx.Module):
    """Decoder blocks created with `eqx.filter_vmap` and run with `lax.scan`."""

    embed: eqx.nn.Embedding
    blocks: Block
    ln: eqx.nn.LayerNorm

    def __init__(
        self,
        vocab: int = 64,
        hidden: int = 32,
        layers: int = 2,
        heads: int = 4,
        *,
        key: PRNGKeyArray,
    ):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(vocab, hidden, key=k1)
        self.blocks = eqx.filter_vmap(lambda k: Block(hidden, heads, 4 * hidden, key=k))(
            jax.random.split(k2, layers)
        )
        self.ln = eqx.nn.LayerNorm(hidden)

    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        params, static = eqx.partition(self.blocks, eqx.is_array)
        mask = _causal(ids.shape[0])

        def body(x: Array, p: PyTree) -> tuple[Array, None]:
            return eqx.combine(p, static)(x, mask), None

        x = jax.lax.scan(body, jax.vmap(self.embed)(ids), params)[0]
        return jax.vmap(self.ln)(x) @ self.embed.weight.T


SCAN_LAYOUT = {
    "embed.weight": COL_W,
    **{k.replace("*.", "blocks."): v for k, v in MHA_LAYOUT.items()},
}


# ----------------------------------------------------------------------------- raw MLP


class RawMLP(eqx.Module):
    """`relu(x @ w1 + b1) @ w2 + b2`, twice, with raw arrays and einsum."""

    w: list[Array]
    b: list[Array]

    def __init__(self, sizes: tuple[int, ...] = (32, 64, 32, 64, 32), *, key: PRNGKeyArray):
        keys = jax.random.split(key, len(sizes) - 1)
        self.w = [
            jax.random.normal(k, (a, b)) / math.sqrt(a)
            for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
        ]
        self.b = [jnp.zeros((b,)) for b in sizes[1:]]

    def __call__(self, x: Float[Array, " d"]) -> Float[Array, " d"]:
        for i, (w, b) in enumerate(zip(self.w, self.b, strict=True)):
            x = jnp.einsum("d,df->f", x, w) + b
            x = jax.nn.relu(x) if i < len(self.w) - 1 else x
        return x


# Weights are stored (in, out), so a column split is on axis 1.
RAW_MLP_LAYOUT = {
    "w.0": ROW_W,
    "b.0": COL_B,
    "w.1": COL_W,
    "w.2": ROW_W,
    "b.2": COL_B,
    "w.3": COL_W,
}
