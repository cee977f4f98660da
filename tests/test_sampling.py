"""rc.sampling: many samples per prompt, min-p, stopping at EOS, buckets, any mesh.

A model of the user's own (`Bigram`: the next token's logits are a row of a table,
its cache the tokens seen) shows the protocol is all sampling needs, and makes each
step's outcome known; the zoo's Llama shows the cache shared by a prompt's samples
and sampling on a mesh.
"""

from __future__ import annotations

import collections
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tiny import drawn

import redcoast as rc
from redcoast.sampling._warpers import Warpers, pick, warp

VOCAB = 16
# What each traced `Bigram` saw: the cache lengths of its traces, the shape of the
# token ids each row's decode call was fed when run, and how many rows were fed one
# token at each position.
TRACES: list[int] = []
FED: collections.Counter[tuple[int, ...]] = collections.Counter()
AT: collections.Counter[int] = collections.Counter()


def _fed(ids: np.ndarray, index: np.ndarray) -> None:
    FED.update([ids.shape])
    if ids.shape == (1,):
        AT.update([int(index)])


class Bigram(eqx.Module):
    """A causal LM of the user's own: the logits after token `t` are `table[t]`."""

    table: jax.Array

    @property
    def vocab_size(self) -> int:
        return self.table.shape[0]

    @property
    def max_positions(self) -> int | None:
        return None

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        return self.table[input_ids]

    def init_cache(self, max_len: int) -> jax.Array:
        TRACES.append(max_len)
        return jnp.zeros((max_len,), jnp.int32)

    def decode(
        self, input_ids: jax.Array, cache: jax.Array, index: jax.Array | int
    ) -> tuple[jax.Array, jax.Array]:
        # Under the sampler's vmap the callback runs once for each row.
        jax.debug.callback(_fed, input_ids, index)
        return self.table[input_ids], jax.lax.dynamic_update_slice(cache, input_ids, (index,))


def counting() -> Bigram:
    """Token `t` is followed by `t + 1` (mod VOCAB), surely at greedy."""
    return Bigram(10.0 * jnp.roll(jnp.eye(VOCAB), 1, axis=1))


@functools.cache
def llama() -> rc.models.Llama:
    config = rc.models.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return drawn(rc.models.Llama, config)


IDS = np.random.default_rng(0).integers(0, 128, (4, 8)).astype(np.int32)
LENGTHS = np.array([8, 3, 5, 6], np.int32)


def test_a_model_of_the_users_own_samples_and_stops_once_every_row_has_ended() -> None:
    model = counting()
    assert isinstance(model, rc.sampling.CausalLM)
    assert isinstance(llama(), rc.sampling.CausalLM)
    prompts = jnp.array([[3, 4, 9], [5, 6, 0]])  # the second is 2 tokens long
    FED.clear()
    out = rc.sampling.sample(
        model,
        prompts,
        prompt_lengths=jnp.array([3, 2]),
        num_samples=3,
        max_new_tokens=12,
        temperature=0.0,
        eos_id=12,
        key=jax.random.key(0),
    )
    # Row b * 3 + g is prompt b's: 10, 11, 12 then EOS; 7, 8, ..., 12 then EOS.
    want = [[10, 11, 12, *[12] * 9]] * 3 + [[7, 8, 9, 10, 11, 12, *[12] * 6]] * 3
    assert out.tokens.tolist() == want
    assert out.lengths.tolist() == [3] * 3 + [6] * 3
    # The 2 prompts fed once (not once per sample), then 5 steps of one token a row: 2
    # of the 6 rows, then, the first prompt's rows ended, 3 of the other 3 alone. The
    # loop stopped when the last row ended, 6 tokens in, not at 12.
    assert FED == {(3,): 2, (1,): 6 * 2 + 3 * 3}

    FED.clear()
    never = rc.sampling.sample(
        model, prompts, max_new_tokens=12, temperature=0.0, eos_id=14, key=jax.random.key(0)
    )
    assert never.tokens.tolist() == [[10, 11, 12, 13, *[14] * 8], list(range(1, 13))]
    assert never.lengths.tolist() == [5, 12]  # the second row never reaches token 14
    assert FED[(1,)] == 2 * 4 + 1 * 7  # the second row alone once the first ended


def _steps_fed() -> dict[int, int]:
    """How many rows each step fed, for 1-token prompts: step `t` feeds position `t`
    (position 0 is the prompts' prefill)."""
    return {at: rows for at, rows in AT.items() if at > 0}


def test_finished_rows_stop_costing_steps_and_draw_what_they_would_have() -> None:
    # EOS (token 0) about once in 10 steps: lengths spread as in a rollout.
    table = jax.random.normal(jax.random.key(1), (VOCAB, VOCAB)).at[:, 0].add(1.0)
    model, prompts = Bigram(table), jnp.array([[3], [7]])
    settings = dict(num_samples=16, max_new_tokens=64, eos_id=0, key=jax.random.key(2))
    AT.clear()
    out = rc.sampling.sample(model, prompts, **settings)
    compacted = _steps_fed()
    AT.clear()
    # Inside a trace the host cannot see which rows are live: one loop, every row.
    plain = jax.jit(lambda m, p: rc.sampling.sample(m, p, **settings))(model, prompts)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)

    # The steps ran while a row was live.
    lengths = np.asarray(out.lengths)
    steps = range(1, int(lengths.max()))
    assert len(steps) < 64 - 10 and lengths.mean() < 12
    assert _steps_fed() == {t: 32 for t in steps}
    # Compacted, each step fed every live row, and fewer than twice as many.
    live = {t: int((lengths > t).sum()) for t in steps}
    assert compacted.keys() == live.keys()
    assert all(live[t] <= compacted[t] < 2 * live[t] for t in steps), (compacted, live)
    assert min(compacted.values()) == 1 and set(compacted.values()) <= {32, 16, 8, 4, 2, 1}
    assert sum(compacted.values()) < 0.4 * 32 * len(steps)


def test_a_model_without_the_protocol_is_named() -> None:
    # (At test time jaxtyping checks the annotation first.)
    with pytest.raises(TypeError, match=r"(?i)type-check|Linear has no vocab_size, max_pos"):
        rc.sampling.sample(
            eqx.nn.Linear(2, 2, key=jax.random.key(0)),  # type: ignore[arg-type]
            jnp.ones((1, 2), jnp.int32),
            max_new_tokens=2,
            key=jax.random.key(0),
        )


def test_a_prompts_samples_share_its_prefill_and_draw_as_separate_rows() -> None:
    model, key = llama(), jax.random.key(3)
    settings = dict(max_new_tokens=6, temperature=1.0, top_k=20, key=key)
    grouped = rc.sampling.sample(model, IDS, prompt_lengths=LENGTHS, num_samples=3, **settings)
    repeated = rc.sampling.sample(
        model, np.repeat(IDS, 3, axis=0), prompt_lengths=np.repeat(LENGTHS, 3), **settings
    )
    assert grouped.tokens.shape == (12, 6)
    np.testing.assert_array_equal(grouped.tokens, repeated.tokens)
    assert len({tuple(row) for row in grouped.tokens[:3].tolist()}) > 1  # not one sample thrice
    # One sample per prompt is generate's continuation, for the same key.
    one = rc.sampling.sample(model, IDS, prompt_lengths=LENGTHS, **settings)
    np.testing.assert_array_equal(
        one.tokens, rc.models.generate(model, IDS, prompt_lengths=LENGTHS, **settings)
    )


@pytest.mark.parametrize(
    "how",
    [
        Warpers(1.0, None, None, 0.1),
        Warpers(0.7, 40, None, 0.05),
        Warpers(1.3, None, 0.9, 0.2),
        Warpers(0.5, 10, 0.8, 0.3),
        Warpers(2.0, 50, 0.95, None),
    ],
)
def test_the_filters_keep_what_transformers_warpers_keep(how: Warpers) -> None:
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits = np.random.default_rng(0).normal(0.0, 3.0, (8, 100)).astype(np.float32)
    chain = [lp.TemperatureLogitsWarper(how.temperature)]
    chain += [lp.TopKLogitsWarper(how.top_k)] if how.top_k else []
    chain += [lp.TopPLogitsWarper(how.top_p)] if how.top_p else []
    chain += [lp.MinPLogitsWarper(how.min_p)] if how.min_p else []
    want = lp.LogitsProcessorList(chain)(None, torch.tensor(logits)).softmax(-1).numpy()
    got = np.asarray(jax.nn.softmax(warp(jnp.asarray(logits), how), axis=-1))
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, atol=1e-6)
    kept = (got > 0).sum(axis=1)
    assert kept.max() < 100 and kept.sum() > len(kept)  # the filters left some choice


def test_samples_follow_the_filtered_distribution() -> None:
    logits = jnp.asarray(np.random.default_rng(1).normal(0.0, 2.0, (VOCAB, VOCAB)), jnp.float32)
    how = Warpers(0.8, None, None, 0.1)
    out = rc.sampling.sample(
        Bigram(logits),
        jnp.array([[5]]),
        num_samples=4000,
        max_new_tokens=1,
        temperature=how.temperature,
        min_p=how.min_p,
        key=jax.random.key(0),
    )
    expected = np.asarray(jax.nn.softmax(warp(logits[5:6], how)))[0]
    counts = np.bincount(np.asarray(out.tokens[:, 0]), minlength=VOCAB)
    assert (counts[expected == 0] == 0).all() and (expected > 0).sum() > 2
    # Each count within 5 standard deviations of its binomial mean.
    sd = np.sqrt(4000 * expected * (1 - expected))
    assert (np.abs(counts - 4000 * expected) <= 5 * sd + 1).all(), (counts, 4000 * expected)


def test_the_draw_and_the_argmax_are_jax_own() -> None:
    # The sampler's argmax and Gumbel draw, written for the CPU's speed, must give the
    # very tokens jax.random.categorical and jnp.argmax give: generate's tokens as before.
    logits = jnp.asarray(np.random.default_rng(2).normal(0.0, 1.0, (64, 300)), jnp.float32)
    logits = logits.at[0].set(0.0).at[1, 7].set(jnp.nan).at[1, 9].set(jnp.nan)  # ties, NaNs
    greedy = Warpers(0.0, None, None, None)
    keys = jax.random.split(jax.random.key(0), 64)
    assert pick(logits, keys, greedy).tolist() == jnp.argmax(logits, axis=-1).tolist()
    sampled = Warpers(1.0, None, None, None)
    for key in jax.random.split(jax.random.key(1), 4):
        keys = jax.random.split(key, 62)  # a key for each row
        want = jax.vmap(jax.random.categorical)(keys, logits[2:])
        assert pick(logits[2:], keys, sampled).tolist() == want.tolist()


def test_prompts_padded_to_one_bucket_compile_once() -> None:
    model, key = counting(), jax.random.key(0)
    rng = np.random.default_rng(0)
    TRACES.clear()
    for longest in (10, 30, 64, 70):
        prompts = [rng.integers(0, VOCAB, n) for n in (longest, 3, 7)]
        ids, lengths = rc.sampling.pad_prompts(prompts, multiple=64)
        assert lengths.tolist() == [longest, 3, 7] and ids.dtype == np.int32
        out = rc.sampling.sample(
            model, ids, prompt_lengths=lengths, num_samples=2, max_new_tokens=4, key=key
        )
        assert out.tokens.shape == (6, 4)
    assert TRACES == [64 + 4, 128 + 4]  # one program per bucket

    ids, lengths = rc.sampling.pad_prompts([[5, 6, 7], [8]], multiple=4, pad_id=-1)
    assert ids.tolist() == [[5, 6, 7, -1], [8, -1, -1, -1]] and lengths.tolist() == [3, 1]
    assert rc.sampling.bucket_length(70, max_length=100) == 100
    with pytest.raises(ValueError, match="longer than max_length=100"):
        rc.sampling.pad_prompts([np.zeros(101, int)], max_length=100)
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        rc.sampling.pad_prompts([[1], []])
    with pytest.raises(ValueError, match="outside the int32"):
        rc.sampling.pad_prompts([np.array([2**40])])
    with pytest.raises(ValueError, match="integer token ids; got float"):
        rc.sampling.pad_prompts([np.array([1.5])])


@pytest.mark.parametrize(("n_model_shards", "fsdp"), [(2, False), (4, True)])
def test_sampling_on_a_mesh_draws_what_one_device_draws(n_model_shards: int, fsdp: bool) -> None:
    # The same bits for the global shape however it is split: JAX's partitionable threefry.
    assert jax.config.jax_threefry_partitionable
    # The token most likely on average, 4 times as likely (its head row scaled), is EOS:
    # rows end early, and once 8 of the 16 are live they are gathered into 8 rows (2
    # or 4 a device of the data axis, some moved between devices).
    model = llama()
    eos = int(jax.vmap(model)(IDS).mean(axis=(0, 1)).argmax())
    model = eqx.tree_at(lambda m: m.lm_head.weight, model, model.lm_head.weight.at[eos].mul(4.0))
    mesh = rc.make_mesh(n_model_shards)  # 8 devices: 4 x 2, or 2 x 4
    sharded = rc.place(model, mesh, example_call=lambda m: jax.vmap(m)(IDS), fsdp=fsdp)
    ids = jax.device_put(IDS, NamedSharding(mesh, P("data")))
    settings = dict(
        prompt_lengths=LENGTHS,
        num_samples=4,
        max_new_tokens=12,
        min_p=0.05,
        eos_id=eos,
        key=jax.random.key(7),
    )
    want = rc.sampling.sample(model, IDS, **settings)
    assert np.sort(want.lengths)[16 // 2 - 1] < want.lengths.max() - 1  # steps at 8 rows
    got = rc.sampling.sample(sharded, ids, **settings)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    inside = jax.jit(lambda m, i: rc.sampling.sample(m, i, **settings))(sharded, ids)
    np.testing.assert_array_equal(inside.tokens, want.tokens)


def test_sampling_settings_are_checked() -> None:
    model, key, ids = counting(), jax.random.key(0), jnp.ones((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        rc.sampling.sample(model, ids, max_new_tokens=2, num_samples=0, key=key)
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
        rc.sampling.sample(model, ids, max_new_tokens=2, min_p=1.5, key=key)
    with pytest.raises(ValueError, match="eos_id=16 is not a token id of a vocabulary of 16"):
        rc.sampling.sample(model, ids, max_new_tokens=2, eos_id=VOCAB, key=key)
