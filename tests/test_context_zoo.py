"""Context parallelism for whole models: the zoo trains with every sequence split over devices.

With `rc.ContextParallel` the data axis splits each sequence instead of the rows,
and the zoo's decoder attention runs `rc.context_parallel_attention` over it. A
train step equals the one-device step (rtol 1e-5) for GPT-2, a scanned LLaMA and
a user's model that calls `rc.context_parallel_attention` itself, with tensor
parallelism, FSDP and sequence parallelism beside it and a batch smaller than the
data axis; evaluation, prediction and `fit` equal their runs without it; the
compiled step passes key/value blocks around the ring and keeps a fraction of one
device's activations; and what it cannot split is refused.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from einops import rearrange
from hlo import collectives
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray
from tiny import drawn

import redcoast as rc
from redcoast.parallel._parallelism import check_options

ROWS = np.random.default_rng(0).integers(0, 128, (8, 16)).astype(np.int32)


def lm_loss(model: eqx.Module, batch: dict, key: PRNGKeyArray) -> Array:
    return rc.models.lm_loss(model, batch, key)[0]


def zoo(arch: str, scan_layers: bool = False, positions: int = 32) -> eqx.Module:
    configs = {
        "gpt2": rc.models.GPT2Config(
            vocab_size=128, n_positions=positions, n_embd=32, n_layer=2, n_head=4
        ),
        "llama": rc.models.LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=positions,
        ),
    }
    return drawn(rc.models.ARCHITECTURES[arch], configs[arch], scan_layers=scan_layers)


class UserLM(eqx.Module):
    """A user's own causal LM: one attention block, computed by `rc.context_parallel_attention`
    when a mesh is given, else by `eqx.nn.MultiheadAttention` on the whole sequence."""

    embed: eqx.nn.Embedding
    attn: eqx.nn.MultiheadAttention
    head: eqx.nn.Linear
    mesh: Mesh | None = eqx.field(static=True)

    def __init__(self, mesh: Mesh | None, *, key: PRNGKeyArray):
        ke, ka, kh = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(128, 32, key=ke)
        self.attn = eqx.nn.MultiheadAttention(4, 32, key=ka)
        self.head = eqx.nn.Linear(32, 128, key=kh)
        self.mesh = mesh

    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(ids)
        if self.mesh is None:
            causal = jnp.tril(jnp.ones((ids.shape[0], ids.shape[0]), bool))
            h = self.attn(x, x, x, mask=causal)
        else:
            a = self.attn

            def split(proj: eqx.nn.Linear) -> Float[Array, "seq heads head_dim"]:
                return rearrange(jax.vmap(proj)(x), "s (h d) -> s h d", h=a.num_heads)

            q, k, v = split(a.query_proj), split(a.key_proj), split(a.value_proj)
            o = rc.context_parallel_attention(q, k, v, mesh=self.mesh, axis="data", causal=True)
            h = jax.vmap(a.output_proj)(rearrange(o, "s h d -> s (h d)"))
        return jax.vmap(self.head)(x + h)


def steps(
    model: eqx.Module,
    rows: Int[np.ndarray, "batch seq"],
    n_model: int | None,
    *,
    accumulate: int = 1,
    documents: dict | None = None,
    **options,
) -> tuple[eqx.Module, list[float]]:
    """Two SGD steps; on one device (`n_model=None`) or on `make_mesh(n_model)` with
    every sequence split over the data axis, the batch given whole to every device
    (with `documents`: the rows' `segment_ids` and `positions`)."""
    batch = {"input_ids": jnp.asarray(rows), **(documents or {})}
    key = jax.random.key(0)
    context = None
    if n_model is not None:
        mesh = rc.make_mesh(n_model)
        fsdp = options.pop("fsdp", False)
        model = rc.place(model, mesh, example_call=lambda m: lm_loss(m, batch, key), fsdp=fsdp)
        batch = jax.device_put(batch, NamedSharding(mesh, P()))
        context = rc.ContextParallel(mesh)
        if options.pop("sequence_parallel", False):
            options["sequence_parallel"] = rc.SequenceParallel.of(model)
    optimizer = optax.sgd(0.5)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = eqx.filter_jit(
        rc.train_step(
            lm_loss,
            optimizer,
            accumulate_grad_batches=accumulate,
            context_parallel=context,
            jit=False,
            **options,
        )
    )
    losses = []
    for i in range(2):
        model, state, metrics = step(model, state, batch, jax.random.fold_in(key, i))
        losses.append(float(metrics["loss"]))
    return model, losses


def assert_same(got: tuple, want: tuple) -> None:
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    got_leaves = jax.tree.leaves(eqx.filter(got[0], eqx.is_array))
    want_leaves = jax.tree.leaves(eqx.filter(want[0], eqx.is_array))
    for g, w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_scanned_llama_on_4x2_with_two_rows_equals_one_device() -> None:
    # Two rows of 16 tokens: fewer rows than the 4 data shards, each row split in 4.
    rows = ROWS[:2]
    assert_same(steps(zoo("llama", True), rows, 2), steps(zoo("llama", True), rows, None))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "scan", "n_model", "options"),
    [
        ("gpt2", False, 1, {"accumulate": 2}),
        ("gpt2", False, 2, {"sequence_parallel": True}),
        ("llama", True, 2, {"fsdp": True, "sequence_parallel": True}),
        ("llama", False, 4, {}),
    ],
    ids=["gpt2-cp8-accumulate", "gpt2-cp4-tp2-sp", "llama-scan-cp4-tp2-fsdp-sp", "llama-cp2-tp4"],
)
def test_the_step_equals_one_device_beside_every_other_split(arch, scan, n_model, options):
    want = steps(zoo(arch, scan), ROWS, None, accumulate=options.get("accumulate", 1))
    assert_same(steps(zoo(arch, scan), ROWS, n_model, **options), want)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "options"),
    [("gpt2", {"sequence_parallel": True}), ("llama", {"fsdp": True})],
    ids=["gpt2-cp4-tp2-sp", "llama-scan-cp4-tp2-fsdp"],
)
def test_packed_documents_split_over_the_ring_equal_one_device(arch: str, options: dict) -> None:
    # Documents crossing the 4 devices' blocks of each row, and one within a block.
    lengths = [[3, 9, 4], [11, 5], [16], [2, 2, 12]]
    segments = [np.repeat(np.arange(len(ls)), ls) for ls in lengths]
    positions = [np.concatenate([np.arange(n) for n in ls]) for ls in lengths]
    documents = {
        "segment_ids": jnp.asarray(np.stack(segments), jnp.int32),
        "positions": jnp.asarray(np.stack(positions), jnp.int32),
    }
    rows = ROWS[:4]
    want = steps(zoo(arch, arch == "llama"), rows, None, documents=documents)
    got = steps(zoo(arch, arch == "llama"), rows, 2, documents=documents, **options)
    assert_same(got, want)


def test_a_users_model_with_its_own_split_attention_equals_one_device() -> None:
    # The batch split along the sequence by ContextParallel, the attention by the
    # model's own call of rc.context_parallel_attention.
    mesh = rc.make_mesh(1)
    rows = ROWS[:2]
    got = steps(UserLM(mesh, key=jax.random.key(0)), rows, 1)
    want = steps(UserLM(None, key=jax.random.key(0)), rows, None)
    assert_same(got, want)


@pytest.mark.slow
def test_evaluation_and_prediction_equal_them_without_the_split() -> None:
    mesh = rc.make_mesh(2)
    batch = {"input_ids": jnp.asarray(ROWS[:2])}
    model = rc.place(zoo("gpt2"), mesh, example_call=lambda m: lm_loss(m, batch, None))
    context = rc.ContextParallel(mesh)
    key = jax.random.key(0)
    want = rc.eval_step(lm_loss)(model, batch, key)
    got = rc.eval_step(lm_loss, context_parallel=context)(model, batch, key)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5)

    def logits(m, b, k):
        return jax.vmap(m)(b["input_ids"])

    want_logits = rc.predict_step(logits)(model, batch, key)
    got_logits = rc.predict_step(logits, context_parallel=context)(model, batch, key)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5)


def compiled_step(n_devices: int, seq: int, context: bool) -> jax.stages.Compiled:
    mesh = rc.make_mesh(1, devices=jax.devices()[:n_devices])
    model = rc.place(zoo("llama", True, positions=seq), mesh)
    optimizer = optax.sgd(0.1)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    batch = {"input_ids": jax.device_put(jnp.zeros((1, seq), jnp.int32), NamedSharding(mesh, P()))}
    cp = rc.ContextParallel(mesh) if context else None
    step = rc.train_step(lm_loss, optimizer, context_parallel=cp)
    return step.lower(model, state, batch, jax.random.key(0)).compile().compiled


@pytest.mark.slow
def test_the_step_passes_blocks_around_the_ring_and_keeps_a_fraction_of_the_activations():
    one = compiled_step(1, 1024, False).memory_analysis().temp_size_in_bytes
    compiled = compiled_step(8, 1024, True)
    split = compiled.memory_analysis().temp_size_in_bytes
    # One sequence of 1024 tokens over 8 devices: each holds 128 tokens' activations
    # and (128 x 128)-score blocks instead of (1024 x 1024).
    assert split < 0.2 * one
    found = collectives(compiled.as_text(), rc.make_mesh(1))
    assert "collective-permute" in {c.op for c in found}


@pytest.mark.slow  # the steps' equalities above are its fast siblings
def test_fit_and_predict_with_context_parallelism_equal_them_without() -> None:
    rows = [{"input_ids": r} for r in ROWS]

    def collate(examples: list) -> dict:
        return {"input_ids": np.stack([e["input_ids"] for e in examples])}

    def run(context_parallel: bool) -> rc.FitResult:
        return rc.fit(
            zoo("gpt2"),
            optax.adamw(1e-2),
            rows,
            collate_fn=collate,
            loss_fn=lm_loss,
            mesh=rc.make_mesh(2),
            # 4 rows a step: split over the 4 data shards, or whole, 2 micro-batches.
            per_device_batch_size=2 if context_parallel else 1,
            accumulate_grad_batches=2 if context_parallel else 1,
            context_parallel=context_parallel,
            max_steps=2,
            evaluation=rc.Evaluation(rows[:3], every=2),
            progress=False,
        )

    got, want = run(True), run(False)
    train = [r["loss"] for r in got.history["train"]]
    np.testing.assert_allclose(train, [r["loss"] for r in want.history["train"]], rtol=1e-5)
    np.testing.assert_allclose(
        got.history["eval"][-1]["eval_loss"], want.history["eval"][-1]["eval_loss"], rtol=1e-5
    )

    def logits(m, b, k):
        return jax.vmap(m)(b["input_ids"])

    # Three rows: in batches of 2 whole rows (the last padded), or one per data shard.
    common = {"collate_fn": collate, "pred_fn": logits, "output_fn": np.asarray}
    split = rc.predict(
        got.model, rows[:3], per_device_batch_size=2, context_parallel=True, **common
    )
    plain = rc.predict(got.model, rows[:3], per_device_batch_size=1, **common)
    np.testing.assert_allclose(np.stack(split), np.stack(plain), atol=1e-5)


def test_a_sequence_the_data_axis_does_not_divide_is_refused_naming_the_lengths() -> None:
    with pytest.raises(ValueError) as error:
        steps(zoo("gpt2"), ROWS[:, :15], 2)
    message = str(error.value)
    assert "'data' axis of size 4" in message and "15 tokens" in message
    assert "Make the rows 16 tokens long" in message


class PlainMLP(eqx.Module):
    """Tokens that never meet: nothing for context parallelism to split."""

    embed: eqx.nn.Embedding
    head: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        ke, kh = jax.random.split(key)
        self.embed = eqx.nn.Embedding(128, 32, key=ke)
        self.head = eqx.nn.Linear(32, 128, key=kh)

    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        return jax.vmap(self.head)(jax.vmap(self.embed)(ids))


def test_what_context_parallelism_cannot_split_is_refused() -> None:
    mesh = rc.make_mesh(2)
    context = rc.ContextParallel(mesh)
    t5 = drawn(
        rc.models.T5,
        rc.models.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4),
    )
    batch = {
        "input_ids": jnp.zeros((2, 8), jnp.int32),
        "labels": jnp.zeros((2, 8), jnp.int32),
    }

    def t5_loss(model, b, key):
        logits = jax.vmap(model)(b["input_ids"], b["labels"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

    with pytest.raises(ValueError, match=r"\(query, key\) mask or bias.*sequence_parallel=True"):
        rc.eval_step(t5_loss, context_parallel=context)(t5, batch, jax.random.key(0))
    # A user's model whose attention is eqx.nn.MultiheadAttention, and one without any:
    # their tokens would be gathered whole (or there is nothing to split).
    for model in (UserLM(None, key=jax.random.key(0)), PlainMLP(key=jax.random.key(0))):
        with pytest.raises(ValueError, match=r"attends through neither rc.nn.attention"):
            steps(model, ROWS[:2], 1)
    with pytest.raises(ValueError, match="axis='seq' is not an axis of this mesh"):
        rc.ContextParallel(mesh, axis="seq")
    # Under the tests' type checking the annotation refuses it first.
    with pytest.raises((ValueError, TypeError), match="strategy"):
        rc.ContextParallel(mesh, strategy="tree")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"rc.ContextParallel\(mesh\); got str"):
        check_options(False, "ring")
    with pytest.raises(ValueError, match="data_parallel='jit' with context_parallel"):
        rc.train_step(
            lm_loss, optax.sgd(0.1), mesh=mesh, data_parallel="shard_map", context_parallel=context
        )
