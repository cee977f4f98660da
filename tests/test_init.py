"""The zoo initialised from scratch as `transformers` does it.

For each architecture, a freshly built redcoast model and a freshly built
`transformers` model of the same config must start at the loss of a uniform guess
on random tokens (ln V), and every parameter must have the mean and standard
deviation of its `transformers` counterpart, matched by checkpoint name through
`to_hf`. Needs the `hf` extra (torch, transformers).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file
from tiny import DECODERS, hf_decoder_config

import redcoast as rc

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 512
ARCHS = tuple(DECODERS)
CLASSES = DECODERS
IDS = np.random.default_rng(0).integers(0, VOCAB, (8, 64)).astype(np.int32)
# Relative tolerance on each parameter's mean and standard deviation. The smallest
# randomly drawn tensors have 64 x 64 entries, whose sample std is within ~1.1% of
# the true one and whose mean is within ~1.6% of a std (one sigma): 10% is > 4 sigma
# apart yet far below the factor-of-2 difference of GPT-2's scaled projections.
RTOL = 0.1


def hf_config(arch: str) -> object:
    return hf_decoder_config(arch, vocab=VOCAB, width=64, gpt2_layers=4, eos_token_id=2)


def ours(arch: str, *, scan_layers: bool = False) -> rc.models.AbstractCausalLM:
    cls = getattr(rc.models, CLASSES[arch])
    config = cls.config_class.from_dict(hf_config(arch).to_dict())  # type: ignore[attr-defined]
    return cls(config, scan_layers=scan_layers, key=jax.random.key(0))


def theirs(arch: str) -> object:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(hf_config(arch)).eval()


@eqx.filter_jit
def loss(model: rc.models.AbstractCausalLM, ids: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


@pytest.mark.parametrize(
    "arch",
    [a if a == "gpt2" else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS],
)
def test_initial_loss_is_a_uniform_guess(arch: str) -> None:
    uniform = math.log(VOCAB)
    for scan_layers in (False, True):
        got = float(loss(ours(arch, scan_layers=scan_layers), jnp.asarray(IDS)))
        assert abs(got - uniform) < 0.1, (scan_layers, got, uniform)
    with torch.no_grad():
        ids = torch.tensor(IDS, dtype=torch.long)
        want = float(theirs(arch)(ids, labels=ids).loss)  # type: ignore[operator]
    assert abs(want - uniform) < 0.1, (want, uniform)


@pytest.mark.parametrize("arch", ARCHS)
def test_parameter_statistics_match_transformers(arch: str, tmp_path: Path) -> None:
    reference = {k: v.float().numpy() for k, v in theirs(arch).state_dict().items()}  # type: ignore[attr-defined]
    for scan_layers in (False, True):
        ours(arch, scan_layers=scan_layers).to_hf(tmp_path / str(scan_layers))
        tensors = load_file(tmp_path / str(scan_layers) / "model.safetensors")
        assert len(tensors) >= 10
        for name, got in tensors.items():
            want = reference[name]
            assert got.shape == want.shape, name
            scale = float(want.std())
            assert abs(float(got.std()) - scale) <= RTOL * scale + 1e-7, (name, got.std(), scale)
            assert abs(float(got.mean()) - float(want.mean())) <= RTOL * scale + 1e-7, name


def test_gpt2_residual_projections_are_scaled() -> None:
    model = ours("gpt2")
    assert isinstance(model.blocks, tuple)
    std = 0.02 / math.sqrt(2 * 4)
    for block in model.blocks:
        assert isinstance(block.mlp, rc.models.MLP)
        for weight in (block.attn.o_proj.weight, block.mlp.fc_out.weight, block.attn.q_proj.weight):
            want = 0.02 if weight is block.attn.q_proj.weight else std
            assert abs(float(weight.std()) - want) <= RTOL * want


def test_padded_and_padding_rows_are_zero() -> None:
    config = rc.models.OPTConfig.from_dict(
        {**hf_config("opt").to_dict(), "vocab_size": 500}  # type: ignore[attr-defined]
    )
    config = dataclasses.replace(config, vocab_multiple=128)
    table = np.asarray(rc.models.OPT(config, key=jax.random.key(0)).embed_tokens.weight)
    assert table.shape[0] == 512
    assert not table[500:].any() and not table[1].any()  # padded rows; pad_token_id 1
    used = np.delete(table[:500], 1, axis=0)
    assert (np.abs(used).sum(axis=1) > 0).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_abstract_init_with_stacked_layers_allocates_nothing(arch: str) -> None:
    cls = getattr(rc.models, CLASSES[arch])
    config = cls.config_class.from_dict(hf_config(arch).to_dict())  # type: ignore[attr-defined]
    abstract = eqx.filter_eval_shape(cls, config, scan_layers=True, key=jax.random.key(0))
    leaves = jax.tree_util.tree_leaves(abstract)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert abstract.blocks.attn.q_proj.weight.shape == (2 if arch != "gpt2" else 4, 64, 64)


def test_an_architecture_is_its_build_the_constructor_is_shared() -> None:
    """A decoder defined by `build` alone gets the zoo's constructor, its checks and its
    forward pass; `build` is asked for the layers as the constructor was."""
    asked: list[rc.models.LayerOptions] = []

    class Tiny(rc.models.AbstractCausalLM):
        config_class = rc.models.GPT2Config

        @classmethod
        def build(cls, config, how, key):
            asked.append(how)
            kt, ka, km = jax.random.split(key, 3)
            block = rc.models.DecoderBlock(
                eqx.nn.LayerNorm(32),
                rc.models.Attention(32, 4, implementation=how.attention, key=ka),
                eqx.nn.LayerNorm(32),
                rc.models.MLP(32, 64, activation=jax.nn.gelu, key=km),
            )
            tokens = eqx.nn.Embedding(config.vocab_size, 32, key=kt)
            return rc.models.CausalLMParts(tokens, None, (block,), eqx.nn.LayerNorm(32), None)

        @classmethod
        def hf_tensors(cls, config):
            return []

    config = rc.models.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4)
    model = Tiny(config, remat="dots", attention="blockwise", key=jax.random.key(0))
    assert asked == [rc.models.LayerOptions(False, "dots", "blockwise")]
    assert model.remat == "dots" and model.config == config
    assert model(jnp.arange(10)).shape == (10, 64)
    with pytest.raises(ValueError, match=r"remat must be one of .*got 'some'"):
        Tiny(config, remat="some", key=jax.random.key(0))
    assert len(asked) == 1  # refused before anything is built
