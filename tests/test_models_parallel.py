"""The decoder zoo split over devices: Megatron layouts, sharded training, sharded generation.

Models are built from redcoast's own configs (hidden 32, 2 layers), so these tests
need no transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tiny import drawn, megatron_specs

import redcoast as rc
from redcoast._tree_paths import path_str

ARCHS = ("gpt2", "llama", "opt", "gptj")
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 128, (8, 16)), jnp.int32)


CONFIGS = {
    "gpt2": rc.models.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4),
    "llama": rc.models.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "opt": rc.models.OPTConfig(
        vocab_size=128,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
    ),
    "gptj": rc.models.GPTJConfig(
        vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4, rotary_dim=4
    ),
}


@functools.cache
def build(arch: str, *, scan_layers: bool = False) -> rc.models.AbstractCausalLM:
    """One model per architecture, shared by the tests (models are immutable; no test
    donates them). The arrays are drawn on the host into the shapes the constructor
    gives, which compiles nothing (eager initialisation compiles every op)."""
    return drawn(rc.models.ARCHITECTURES[arch], CONFIGS[arch], scan_layers=scan_layers)


def spec_leaves(tree: object) -> list[P]:
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, P))


def layout(model: eqx.Module, specs: object) -> dict[str, tuple]:
    """Path -> spec padded to the array's rank, so `P("model")` and `P("model", None)` agree."""
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))
    return {
        path_str(p): tuple(s) + (None,) * (a.ndim - len(s))
        for (p, a), s in zip(flat, spec_leaves(specs), strict=True)
    }


def loss_fn(model: rc.models.AbstractCausalLM, batch: dict, key: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(batch["ids"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("scan_layers", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_sharding_rules_give_megatron_layout(arch: str, n: int, scan_layers: bool) -> None:
    model = build(arch, scan_layers=scan_layers)
    plan = rc.sharding_plan(model, n, example_call=lambda m: jax.vmap(m)(IDS))
    got, want = layout(model, plan.specs), layout(model, megatron_specs(model, n))
    assert got == want, {p: (got[p], want[p]) for p in got if got[p] != want[p]}
    stacked = (None,) if scan_layers else ()
    q = "blocks.attn.q_proj.weight" if scan_layers else "blocks.1.attn.q_proj.weight"
    assert got[q] == (*stacked, "model", None)
    assert plan.bytes_per_device < 0.75 * plan.total_bytes


def test_kv_heads_that_do_not_divide_are_replicated_and_reported() -> None:
    model = build("llama")  # 4 query heads, 2 key/value heads
    split = layout(model, rc.sharding_plan(model, 2, example_call=lambda m: jax.vmap(m)(IDS)).specs)
    assert split["blocks.0.attn.k_proj.weight"] == ("model", None)
    plan = rc.sharding_plan(model, 4, example_call=lambda m: jax.vmap(m)(IDS))
    four = layout(model, plan.specs)
    assert four["blocks.0.attn.k_proj.weight"] == (None, None)
    assert four["blocks.0.attn.v_proj.weight"] == (None, None)
    assert four["blocks.0.attn.q_proj.weight"] == ("model", None)
    assert "2 heads do not divide 4 shards" in str(plan)


def test_rules_traced_through_generate_give_the_same_layout() -> None:
    # In the decoding loop the head's argmax becomes the next token's embedding index;
    # that must not count as the head's output flowing into the first layer.
    model = build("gpt2")
    by_forward = rc.sharding_plan(model, 4, example_call=lambda m: jax.vmap(m)(IDS)).specs
    by_generate = rc.sharding_plan(
        model, 4, example_call=lambda m: rc.models.generate(m, IDS[:, :8], max_new_tokens=4)
    ).specs
    assert layout(model, by_generate) == layout(model, by_forward)


@pytest.mark.parametrize("arch", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_a_vocabulary_that_divides_nothing_is_padded_split_masked_and_saved_whole(
    arch: str, tmp_path: Path
) -> None:
    config = dataclasses.replace(CONFIGS[arch], vocab_size=101)
    whole = rc.models.ARCHITECTURES[arch](config, key=jax.random.key(0))
    # Unpadded, 101 rows divide no shard count: the table is not split on the hidden
    # dimension (that would all-reduce every logit); the plan says how to fix it.
    plan = rc.sharding_plan(whole, 4, example_call=lambda m: jax.vmap(m)(IDS % 101))
    assert layout(whole, plan.specs)["embed_tokens.weight"] != (None, "model")
    assert "pad the vocabulary to a multiple of 512" in str(plan)
    padded = rc.models.ARCHITECTURES[arch](
        dataclasses.replace(config, vocab_multiple=128 * 4), key=jax.random.key(0)
    )
    assert padded.embed_tokens.weight.shape[0] == 512
    plan = rc.sharding_plan(padded, 4, example_call=lambda m: jax.vmap(m)(IDS % 101))
    assert layout(padded, plan.specs)["embed_tokens.weight"] == ("model", None)
    logits = jax.vmap(padded)(IDS % 101)
    assert logits.shape[-1] == 512
    assert bool(jnp.all(logits[..., 101:] == jnp.finfo(logits.dtype).min))
    # to_hf writes the original vocabulary, which loads back unpadded with equal logits.
    padded.to_hf(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 101
    assert "vocab_multiple" not in (tmp_path / "config.json").read_text()
    loaded = type(padded).from_hf(tmp_path)
    assert loaded.embed_tokens.weight.shape[0] == 101
    np.testing.assert_allclose(jax.vmap(loaded)(IDS % 101), logits[..., :101], rtol=1e-5, atol=1e-5)
    # Asked to, from_hf pads again; the padding rows are not valid token ids.
    repadded = type(padded).from_hf(tmp_path, vocab_multiple=128 * 4)
    assert repadded.embed_tokens.weight.shape[0] == 512 and repadded.vocab_size == 101
    np.testing.assert_allclose(jax.vmap(repadded)(IDS % 101), logits, rtol=1e-5, atol=1e-5)
    with pytest.raises((eqx.EquinoxRuntimeError, jax.errors.JaxRuntimeError), match=r"\[0, 101\)"):
        jax.block_until_ready(repadded(jnp.array([101])))


# ----------------------------------------------------------------------------- numerics


# GPT-2 here; the other architectures in `nox -s slow`.
@pytest.mark.parametrize(
    "arch", [a if a == "gpt2" else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS]
)
def test_sharded_train_step_equals_unsharded(arch: str) -> None:
    model = build(arch)
    batch = {"ids": IDS}
    key = jax.random.key(0)
    mesh = rc.make_mesh(4)  # 2 x 4
    specs = rc.sharding_plan(model, 4, example_call=lambda m: loss_fn(m, batch, key)).specs
    sharded = rc.place(model, mesh, specs=specs)
    optimizer = optax.sgd(0.5)
    # Jitted here without donation: the unsharded model is shared with other tests, and
    # placing it may alias its buffers.
    step = eqx.filter_jit(rc.train_step(loss_fn, optimizer, jit=False))
    results = []
    for m, b in [
        (sharded, jax.device_put(batch, NamedSharding(mesh, P("data")))),
        (model, batch),
    ]:
        state = optimizer.init(eqx.filter(m, eqx.is_inexact_array))
        results.append(step(m, state, b, key))
    (got, _, got_metrics), (want, _, want_metrics) = results
    np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(got_metrics["grad_norm"], want_metrics["grad_norm"], rtol=1e-5)
    got_leaves = jax.tree_util.tree_leaves(eqx.filter(got, eqx.is_array))
    want_leaves = jax.tree_util.tree_leaves(eqx.filter(want, eqx.is_array))
    for g, w, spec in zip(got_leaves, want_leaves, spec_leaves(specs), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
        assert g.sharding.spec == spec  # the step keeps the layout


def test_from_hf_onto_a_mesh_and_generate_under_predict(tmp_path: Path) -> None:
    model = build("llama", scan_layers=True)
    model.to_hf(tmp_path)
    mesh = rc.make_mesh(4)
    specs = rc.sharding_plan(model, 4, example_call=lambda m: jax.vmap(m)(IDS)).specs
    sharded = rc.models.Llama.from_hf(tmp_path, mesh=mesh, scan_layers=True)
    given = rc.models.Llama.from_hf(tmp_path, mesh=mesh, specs=specs, scan_layers=True)
    for a, b, w, spec in zip(
        jax.tree_util.tree_leaves(eqx.filter(sharded, eqx.is_array)),
        jax.tree_util.tree_leaves(eqx.filter(given, eqx.is_array)),
        jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)),
        spec_leaves(specs),
        strict=True,
    ):
        assert a.sharding == b.sharding == NamedSharding(mesh, spec)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w))

    # fsdp=True reads each weight straight into its shard of the FSDP layout.
    fsdp_specs = rc.sharding_plan(model, 4, example_call=lambda m: jax.vmap(m)(IDS), fsdp=2).specs
    split = rc.models.Llama.from_hf(tmp_path, mesh=mesh, scan_layers=True, fsdp=True)
    for a, w, spec in zip(
        jax.tree_util.tree_leaves(eqx.filter(split, eqx.is_array)),
        jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)),
        spec_leaves(fsdp_specs),
        strict=True,
    ):
        assert a.sharding == NamedSharding(mesh, spec)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
    assert any("data" in str(s) for s in spec_leaves(fsdp_specs))

    lengths = np.array([8, 5, 3, 8, 6, 7], np.int32)
    examples = [{"ids": np.asarray(IDS[i, :8]), "length": lengths[i]} for i in range(6)]

    def collate_fn(rows: list[dict]) -> dict[str, np.ndarray]:
        return {
            "ids": np.stack([r["ids"] for r in rows]),
            "length": np.array([r["length"] for r in rows], np.int32),
        }

    def pred_fn(m: rc.models.AbstractCausalLM, batch: dict, key: jax.Array) -> jax.Array:
        return rc.models.generate(m, batch["ids"], prompt_lengths=batch["length"], max_new_tokens=6)

    got = rc.predict(
        sharded,
        examples,
        collate_fn=collate_fn,
        pred_fn=pred_fn,
        mesh=mesh,
        per_device_batch_size=2,
    )
    want = rc.models.generate(model, IDS[:6, :8], prompt_lengths=lengths, max_new_tokens=6)
    assert [np.asarray(g).tolist() for g in got] == np.asarray(want).tolist()


def test_loading_with_specs_for_another_model_is_an_error(tmp_path: Path) -> None:
    model = build("gpt2")
    model.to_hf(tmp_path)
    mesh = rc.make_mesh(2)
    wrong = rc.sharding_plan(build("gpt2", scan_layers=True), 2).specs
    with pytest.raises(ValueError, match=r"specs has no PartitionSpec for \['blocks.0.attn_norm"):
        rc.models.GPT2.from_hf(tmp_path, mesh=mesh, specs=wrong)


def test_cache_config_and_activation_names_are_public() -> None:
    model = rc.models.Llama(CONFIGS["llama"], key=jax.random.key(0))
    cache = model.init_cache(8)
    assert len(cache) == 2 and all(isinstance(c, rc.models.KVCache) for c in cache)
    assert cache[0].key.shape == (8, 2, 8)  # slots, K/V heads, head dim
    assert isinstance(model.config, rc.models.HFConfig)
    assert rc.models.activation("silu") is jax.nn.silu
    with pytest.raises(ValueError, match="unsupported activation 'swishy'"):
        rc.models.activation("swishy")
