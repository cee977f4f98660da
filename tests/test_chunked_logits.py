"""The losses over a large vocabulary, computed a chunk of tokens at a time
(`rc.nn.map_logits`): the same values and gradients as over the whole logits, sharded
or not, in a fraction of the memory."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from click.testing import CliRunner
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc
import redcoast.nn._loss as chunking
from redcoast.cli import main
from redcoast.models import Gemma2Config, LlamaConfig

VOCAB = 96
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
CONFIGS = {
    "llama": LlamaConfig(**SMALL),  # an untied head
    # A tied head with Gemma 2's final soft cap, and a table padded past the vocabulary.
    "gemma2-padded": dataclasses.replace(
        Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=1.0, sliding_window=8),
        vocab_multiple=128,
    ),
}
ROWS = np.random.default_rng(0).integers(0, VOCAB, (4, 13)).astype(np.int32)  # 13: padded


def model_of(name: str, **options) -> eqx.Module:
    config = CONFIGS[name]
    cls = rc.models.Gemma2 if name.startswith("gemma") else rc.models.Llama
    return cls(config, key=jax.random.key(0), **options)


def loss_and_grads(model: eqx.Module, **options) -> tuple[jax.Array, eqx.Module]:
    batch = {"input_ids": jnp.asarray(ROWS)}
    mask = jnp.asarray(np.arange(13) % 4 != 0)[None].repeat(4, 0)  # some tokens not counted

    def loss(m: eqx.Module) -> jax.Array:
        return rc.models.lm_loss(m, {**batch, "loss_mask": mask}, **options)[0]

    return eqx.filter_jit(eqx.filter_value_and_grad(loss))(model)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_loss_in_chunks_equals_the_loss_on_the_whole_logits(name, monkeypatch) -> None:
    model = model_of(name, scan_layers=True)
    whole, whole_grads = loss_and_grads(model)
    # Each row's 13 tokens padded to 4 chunks of 4.
    chunked, grads = loss_and_grads(model, chunk_tokens=4)
    np.testing.assert_allclose(float(chunked), float(whole), rtol=1e-6)
    assert_close(grads, whole_grads)
    # "auto": the whole rows up to CHUNK_ABOVE logits, else chunks of CHUNK_LOGITS at most,
    # a number that divides the row where one is near, else padded (13 is prime).
    assert chunking._chunks(13, 128, "auto") == chunking._chunks(4096, 32000, "auto") == 1
    assert chunking._chunks(4096, 128256, "auto") == 16
    assert chunking._chunks(6000, 128256, "auto") == 24  # 23 of 6,000 tokens would not divide
    monkeypatch.setattr(chunking, "CHUNK_ABOVE", 1000)
    monkeypatch.setattr(chunking, "CHUNK_LOGITS", 500)
    assert (chunking._chunks(13, 128, "auto"), chunking._chunks(13, 96, "auto")) == (4, 3)
    auto, _ = loss_and_grads(model, chunk_tokens="auto")
    np.testing.assert_allclose(float(auto), float(whole), rtol=1e-6)


def assert_close(got: eqx.Module, want: eqx.Module) -> None:
    """Equal to float32 rounding: a gradient summed over chunks is summed in another
    order (the tied table's, of every chunk's logits)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


@pytest.mark.slow
def test_a_sharded_step_with_the_loss_in_chunks_equals_one_device() -> None:
    """The vocabulary split over the model axis (its log-sum-exp reduced across shards),
    the rows over the data axis and the weights stored split (FSDP)."""

    def steps(model: eqx.Module, mesh: jax.sharding.Mesh | None, chunk: int | None) -> tuple:
        batch = {"input_ids": jnp.asarray(ROWS[:, :12])}
        loss_fn = functools.partial(rc.models.lm_loss, chunk_tokens=chunk)
        if mesh is not None:
            model = rc.place(
                model, mesh, example_call=lambda m: rc.models.lm_loss(m, batch)[0], fsdp=True
            )
            batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        optimizer = optax.sgd(0.5)
        state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        step = eqx.filter_jit(rc.train_step(loss_fn, optimizer, jit=False))
        losses = []
        for i in range(2):
            model, state, metrics = step(model, state, batch, jax.random.key(i))
            losses.append(float(metrics["loss"]))
        return losses, model

    want = steps(model_of("gemma2-padded"), None, None)
    got = steps(model_of("gemma2-padded"), rc.make_mesh(2, devices=jax.devices()[:4]), 3)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert_close(got[1], want[1])


def test_the_planner_counts_the_chunks_and_they_hold_a_fraction_of_the_logits() -> None:
    """The AdamW step at 512 tokens of a 32,768-token vocabulary, planned whole and with
    `loss_chunks=64` (as `lm_loss(..., chunk_tokens=64)` runs): a row's float32 logits
    (64 MiB) and their gradient dominate the whole one; the chunks hold an eighth."""
    config = dataclasses.replace(CONFIGS["llama"], vocab_size=32768, max_position_embeddings=512)
    options = dict(devices=1, seq_len=512, max_batch=False)
    whole = rc.memory_plan(config, **options)
    chunked = rc.memory_plan(config, loss_chunks=64, **options)
    row = 512 * 32768 * 4
    assert whole.temporaries >= 2 * row  # the logits and their gradient
    assert whole.peak - chunked.peak >= row, (whole.peak, chunked.peak)
    assert "(loss in chunks: 64)" in str(chunked)
    with pytest.raises(ValueError, match="a preference or RL step's log-probabilities"):
        rc.memory_plan(config, loss_chunks="auto", rl="grpo", **options)
    with pytest.raises(ValueError, match="loss_chunks must be 'auto' or an int >= 1"):
        rc.memory_plan(config, loss_chunks=0, **options)
    bad = CliRunner().invoke(main, ["plan", "gpt2", "--loss-chunks", "many"])
    assert bad.exit_code == 2 and "give 'auto' or a number of tokens" in bad.output


def test_bad_chunk_sizes_and_models_without_a_split_head() -> None:
    model = model_of("llama")
    ids = jnp.asarray(ROWS)
    with pytest.raises(ValueError, match="chunk_tokens must be an int >= 0"):
        rc.nn.map_logits(model, ids, rc.nn.cross_entropy, ids, chunk_tokens=-1)
    # A model of one's own (no `hidden` / `output_head`) gets its whole logits at once.
    seen = []

    def fn(logits: jax.Array, labels: jax.Array) -> jax.Array:
        seen.append(logits.shape)
        return rc.nn.cross_entropy(logits, labels)

    plain = jax.jit(lambda i: rc.nn.map_logits(lambda r: model(r), i, fn, i, chunk_tokens=4))
    split = jax.jit(lambda i: rc.nn.map_logits(model, i, fn, i, chunk_tokens=4))
    np.testing.assert_allclose(split(ids), plain(ids), rtol=1e-6)
    assert seen == [(4, 4, VOCAB), (4, 13, VOCAB)]


def test_a_decoder_is_its_output_head_on_its_hidden_states() -> None:
    model = model_of("gemma2-padded")
    ids = jnp.asarray(ROWS[0])
    head = model.output_head()
    assert isinstance(head, rc.models.OutputHead) and isinstance(model, rc.nn.SplitHead)
    np.testing.assert_array_equal(head(model.hidden(ids)), model(ids))
