"""Sequence parallelism: activations split over the model axis, numbers unchanged.

A step with `sequence_parallel` equals the unsharded step for the zoo's decoders
(unrolled and scanned), T5, and a model written here with plain `eqx.nn.Linear`
layers called per token; the compiled program gathers activations, never a weight,
and keeps fewer bytes than tensor parallelism alone.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo import collectives, ring_bytes, scattered_all_reduces, weight_all_gathers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray
from tiny import drawn

import redcoast as rc

IDS = jnp.asarray(np.random.default_rng(0).integers(0, 128, (8, 16)), jnp.int32)


def lm_loss(model: eqx.Module, batch: dict, key: PRNGKeyArray) -> Array:
    logits = jax.vmap(model)(batch["ids"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()


class Block(eqx.Module):
    """A user's own pre-norm block: Linears called per token, dropout on both branches."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, width: int, *, key: PRNGKeyArray):
        ka, ku, kd = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.attn = eqx.nn.MultiheadAttention(4, width, key=ka)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.up = eqx.nn.Linear(width, 4 * width, key=ku)
        self.down = eqx.nn.Linear(4 * width, width, key=kd)
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(
        self, x: Float[Array, "seq width"], key: PRNGKeyArray
    ) -> Float[Array, "seq width"]:
        k1, k2 = jax.random.split(key)
        h = jax.vmap(self.norm1)(x)
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        x = x + self.dropout(self.attn(h, h, h, mask=causal), key=k1)
        h = jax.vmap(self.norm2)(x)
        mlp = jax.vmap(lambda t: self.down(jax.nn.gelu(self.up(t))))(h)
        return x + self.dropout(mlp, key=k2)


class UserLM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: tuple[Block, ...]
    head: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        ke, kh, *kb = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(128, 32, key=ke)
        self.blocks = tuple(Block(32, key=k) for k in kb)
        self.head = eqx.nn.Linear(32, 128, key=kh)

    def __call__(self, ids: Int[Array, " seq"], key: PRNGKeyArray) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(ids)
        for block, k in zip(self.blocks, jax.random.split(key, len(self.blocks)), strict=True):
            x = block(x, k)
        return jax.vmap(self.head)(x)


def user_loss(model: UserLM, batch: dict, key: PRNGKeyArray) -> Array:
    keys = jax.random.split(key, batch["ids"].shape[0])
    logits = jax.vmap(model)(batch["ids"][:, :-1], keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()


def zoo(arch: str, scan_layers: bool) -> eqx.Module:
    configs = {
        "gpt2": rc.models.GPT2Config(
            vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4
        ),
        "llama": rc.models.LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
    }
    return drawn(rc.models.ARCHITECTURES[arch], configs[arch], scan_layers=scan_layers)


def t5() -> eqx.Module:
    config = rc.models.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4
    )
    return drawn(rc.models.T5, config, scan_layers=True)


def t5_loss(model: eqx.Module, batch: dict, key: PRNGKeyArray) -> Array:
    src, tgt = batch["ids"][:, :8], batch["ids"][:, 8:]
    logits = jax.vmap(lambda s, t: model(s, t))(src, tgt[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tgt[:, 1:]).mean()


CASES = {
    "gpt2": (lambda: zoo("gpt2", False), lm_loss),
    "llama-scan": (lambda: zoo("llama", True), lm_loss),
    "t5": (t5, t5_loss),
    "user": (lambda: UserLM(key=jax.random.key(1)), user_loss),
}


def steps(model: eqx.Module, loss_fn, mesh, *, fsdp: bool = False, sequence_parallel=False):
    """Two SGD steps; the model placed on `mesh` (None: one device, unplaced)."""
    batch = {"ids": IDS}
    key = jax.random.key(0)
    if mesh is not None:
        call = lambda m: loss_fn(m, batch, key)  # noqa: E731
        model = rc.place(model, mesh, example_call=call, fsdp=fsdp)
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    optimizer = optax.sgd(0.5)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    # Unjitted and jitted here without donation: the models are built per test.
    step = eqx.filter_jit(rc.train_step(loss_fn, optimizer, jit=False))
    keep = sequence_parallel == "keep gathered"
    split = rc.SequenceParallel.of(model, keep_gathered=keep) if sequence_parallel else False
    if split:
        step = eqx.filter_jit(rc.train_step(loss_fn, optimizer, jit=False, sequence_parallel=split))
    losses = []
    for i in range(2):
        model, state, metrics = step(model, state, batch, jax.random.fold_in(key, i))
        losses.append(float(metrics["loss"]))
    return model, losses


def assert_same(got: tuple, want: tuple) -> None:
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    got_leaves = jax.tree_util.tree_leaves(eqx.filter(got[0], eqx.is_array))
    want_leaves = jax.tree_util.tree_leaves(eqx.filter(want[0], eqx.is_array))
    for g, w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


# In `nox -s slow`; the user's model on 2 x 4 below is the fast sibling.
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sequence_parallel_step_equals_the_unsharded_step(case: str) -> None:
    make, loss_fn = CASES[case]
    want = steps(make(), loss_fn, None)
    got = steps(make(), loss_fn, rc.make_mesh(4), sequence_parallel=True)
    assert_same(got, want)


@pytest.mark.slow
def test_sequence_parallel_with_fsdp_equals_the_unsharded_step() -> None:
    want = steps(zoo("llama", True), lm_loss, None)
    got = steps(zoo("llama", True), lm_loss, rc.make_mesh(2), fsdp=True, sequence_parallel=True)
    assert_same(got, want)


@pytest.mark.slow
def test_keeping_the_gathered_inputs_gives_the_same_step() -> None:
    want = steps(zoo("llama", True), lm_loss, None)
    got = steps(zoo("llama", True), lm_loss, rc.make_mesh(4), sequence_parallel="keep gathered")
    assert_same(got, want)


@pytest.mark.parametrize("n_model", [4, pytest.param(2, marks=pytest.mark.slow)])
def test_dropout_keys_give_the_same_numbers_on_every_mesh(n_model: int) -> None:
    """The user's model draws dropout masks: split over 2 x 4 (or 4 x 2) with sequence
    parallelism, it gives the numbers of one device."""
    want = steps(UserLM(key=jax.random.key(1)), user_loss, None)
    mesh = rc.make_mesh(n_model)
    assert_same(steps(UserLM(key=jax.random.key(1)), user_loss, mesh, sequence_parallel=True), want)


def test_where_the_split_comes_from_the_placement() -> None:
    model = rc.place(
        zoo("llama", True),
        rc.make_mesh(2),  # the 2 key/value heads split too
        example_call=lambda m: lm_loss(m, {"ids": IDS}, jax.random.key(0)),
    )
    split = rc.SequenceParallel.of(model)
    assert set(split.gather) == {
        "blocks.attn.q_proj",
        "blocks.attn.k_proj",
        "blocks.attn.v_proj",
        "blocks.mlp.gate_proj",
        "blocks.mlp.up_proj",
        "lm_head",
    }
    assert set(split.scatter) == {"blocks.attn.o_proj", "blocks.mlp.down_proj"}
    # The vocabulary-split table's output is made whole: its gradient then reaches the
    # table whole, not split on the features across the table's rows.
    assert split.embeddings == ("embed_tokens",)
    # Wrapping changes nothing a caller reads: the same logits.
    x = IDS[0]
    np.testing.assert_allclose(split.apply(model)(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_program_gathers_activations_and_keeps_fewer_bytes() -> None:
    mesh = rc.make_mesh(4)
    batch = jax.device_put({"ids": IDS}, NamedSharding(mesh, P("data")))
    key = jax.random.key(0)
    placed = rc.place(
        zoo("llama", True), mesh, example_call=lambda m: lm_loss(m, {"ids": IDS}, key)
    )
    optimizer = optax.sgd(0.1)
    state = optimizer.init(eqx.filter(placed, eqx.is_inexact_array))
    splits = {
        "tp": False,
        "sp": True,
        "keep": rc.SequenceParallel.of(placed, keep_gathered=True),
    }
    programs = {}
    for name, split in splits.items():
        step = rc.train_step(lm_loss, optimizer, sequence_parallel=split)
        programs[name] = step.lower(placed, state, batch, key).compile().compiled
    texts = {name: p.as_text() for name, p in programs.items()}
    found = {
        name: [c for c in collectives(t, mesh) if c.axis == "model"] for name, t in texts.items()
    }
    gathers = {name: [c for c in cs if c.op == "all-gather"] for name, cs in found.items()}
    assert gathers["sp"] and not gathers["tp"]
    # Keeping the gathered inputs saves the backward pass's second gathering of them.
    assert len(gathers["keep"]) < len(gathers["sp"])
    split_shapes = [
        x.shape
        for x in jax.tree_util.tree_leaves(placed)
        if "model" in str(getattr(x, "sharding", ""))
    ]
    assert not weight_all_gathers(found["sp"], split_shapes)
    temp = {name: p.memory_analysis().temp_size_in_bytes for name, p in programs.items()}
    assert temp["sp"] < 0.9 * temp["tp"]
    assert temp["sp"] < temp["keep"]
    # Each of tensor parallelism's all-reduces becomes a reduce-scatter and an
    # all-gather, the same ring bytes, counting the partitioner's scattered
    # all-reduces as the reduce-scatters GPU and TPU compilers make of them; the
    # default gathers the inputs again on top.
    scattered = {name: scattered_all_reduces(t) for name, t in texts.items()}
    assert scattered["sp"] and not scattered["tp"]
    ring = {name: ring_bytes(found[name], 4, scattered[name]) for name in texts}
    assert ring["keep"] <= 1.02 * ring["tp"]
    assert ring["keep"] < ring["sp"]


def test_scattered_all_reduces_are_the_ones_read_a_slice_at_a_time() -> None:
    mesh = rc.make_mesh(2)
    rows = NamedSharding(mesh, P("data", "model"))
    whole = NamedSharding(mesh, P("data", None))

    def f(x: Float[Array, "b i"], w: Float[Array, "i o"]) -> tuple[Array, Array]:
        # Two partial sums over the model axis: one read a slice at a time, one whole.
        scattered = jax.lax.with_sharding_constraint(jnp.tanh(x @ w + 1.0), rows)
        return scattered, jax.lax.with_sharding_constraint(x @ (2.0 * w), whole)

    x = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=rows)
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P("model")))
    text = jax.jit(f).lower(x, w).compile().as_text()
    reduces = [c for c in collectives(text, mesh) if c.op == "all-reduce" and c.axis == "model"]
    # XLA may combine the two into one all-reduce of a pair: half its bytes are sliced.
    scattered = scattered_all_reduces(text)
    assert sum(scattered.values()) == 2 * 64 * 4 == sum(c.nbytes for c in reduces) / 2


# ----------------------------------------------------------------------------- bad input


def test_without_a_model_axis_the_error_says_what_would_work() -> None:
    mesh = rc.make_mesh(1)
    model = rc.place(zoo("gpt2", False), mesh)
    with pytest.raises(ValueError, match=r"make_mesh\(n_model_shards\) with n_model_shards > 1"):
        rc.SequenceParallel.of(model)
    step = rc.train_step(lm_loss, optax.sgd(0.1), sequence_parallel=True)
    state = optax.sgd(0.1).init(eqx.filter(model, eqx.is_inexact_array))
    with pytest.raises(ValueError, match=r"no eqx\.nn\.Linear of this model is split"):
        step(model, state, {"ids": IDS}, jax.random.key(0))
    with pytest.raises(ValueError, match="1 model shard"):
        rc.memory_plan("gpt2", devices=2, sequence_parallel=True)


def test_under_your_own_jit_true_asks_for_the_split_itself() -> None:
    mesh = rc.make_mesh(4)
    model = rc.place(zoo("gpt2", False), mesh, example_call=lambda m: m(IDS[0]))
    optimizer = optax.sgd(0.1)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = eqx.filter_jit(rc.train_step(lm_loss, optimizer, jit=False, sequence_parallel=True))
    with pytest.raises(
        ValueError, match=r"parallelism=rc.Parallelism.of\(model, sequence_parallel"
    ):
        step(model, state, {"ids": IDS}, jax.random.key(0))


def test_options_that_cannot_split_are_refused() -> None:
    with pytest.raises(ValueError, match="data_parallel='shard_map' replicates the model"):
        rc.train_step(
            lm_loss,
            optax.sgd(0.1),
            mesh=rc.make_mesh(1),
            data_parallel="shard_map",
            sequence_parallel=True,
        )
    with pytest.raises(TypeError, match="sequence_parallel"):
        rc.predict_step(lm_loss, sequence_parallel="yes")  # type: ignore[arg-type]
    # fit's signature is checked where it is called: the error names the values it takes.
    with pytest.raises(
        TypeError, match=r"parameter 'sequence_parallel'(.|\n)*Literal\['keep gathered'\]"
    ):
        rc.fit(
            zoo("gpt2", False),
            optax.sgd(0.1),
            [{"ids": np.asarray(IDS[0])}],
            collate_fn=lambda rows: {"ids": np.stack([r["ids"] for r in rows])},
            loss_fn=lm_loss,
            per_device_batch_size=1,
            max_steps=1,
            sequence_parallel="keep",  # type: ignore[arg-type]
        )


def test_features_that_do_not_divide_are_left_and_noted() -> None:
    class Odd(eqx.Module):
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __call__(self, x: Array) -> Array:
            return self.down(jax.nn.relu(self.up(x)))

    k1, k2 = jax.random.split(jax.random.key(0))
    model = Odd(eqx.nn.Linear(12, 16, key=k1), eqx.nn.Linear(16, 6, key=k2))
    mesh = rc.make_mesh(4)
    placed = rc.place(model, mesh, example_call=lambda m: jax.vmap(m)(jnp.ones((8, 12))))
    split = rc.SequenceParallel.of(placed)
    assert split.gather == ("up",)
    assert split.scatter == ()
    assert split.notes == (
        "down: its 6 output features do not divide over 4 model shards; left as it is.",
    )
    assert "note: down: its 6 output features" in str(split)


@pytest.mark.slow  # train_step's equality above is its fast sibling
def test_fit_evaluate_and_predict_with_the_split_equal_them_without() -> None:
    examples = [{"ids": np.asarray(row)} for row in IDS] * 2

    def collate(rows: list) -> dict:
        return {"ids": np.stack([r["ids"] for r in rows])}

    def pred_fn(model: eqx.Module, batch: dict, key: PRNGKeyArray) -> Array:
        return jax.vmap(model)(batch["ids"]).argmax(-1)

    runs = {}
    for sp in (False, True, "keep gathered"):
        mesh = rc.make_mesh(4)
        result = rc.fit(
            zoo("gpt2", False),
            optax.sgd(0.5),
            examples,
            collate_fn=collate,
            loss_fn=lm_loss,
            per_device_batch_size=2,
            max_steps=2,
            log_every=1,
            mesh=mesh,
            sequence_parallel=sp,
            evaluation=rc.Evaluation(examples[:8], pred_fn=pred_fn, every=1),
            progress=False,
        )
        preds = rc.predict(
            result.model,
            examples[:8],
            collate_fn=collate,
            pred_fn=pred_fn,
            per_device_batch_size=1,
            sequence_parallel=bool(sp),
        )
        runs[sp] = (result.history, preds)
    want, want_preds = runs[False]
    for got, got_preds in (runs[True], runs["keep gathered"]):
        for key in ("train", "eval"):
            for g, w in zip(got[key], want[key], strict=True):
                np.testing.assert_allclose(
                    g["loss" if key == "train" else "eval_loss"],
                    w["loss" if key == "train" else "eval_loss"],
                    rtol=1e-5,
                )
        for g, w in zip(got_preds, want_preds, strict=True):
            np.testing.assert_array_equal(g, w)
