"""A model of the user's own, built from `eqx.nn` pieces in this file, gets every
parallelism on the same terms as the zoo: the split, sequence and context
parallelism, LoRA, and the planner."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from einops import rearrange
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

import redcoast as rc

VOCAB, WIDTH, HEADS, LAYERS = 64, 32, 4, 2


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        keys = jax.random.split(key, 6)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(WIDTH), eqx.nn.LayerNorm(WIDTH)
        self.q, self.k, self.v, self.o = (eqx.nn.Linear(WIDTH, WIDTH, key=k) for k in keys[:4])
        self.up = eqx.nn.Linear(WIDTH, 4 * WIDTH, key=keys[4])
        self.down = eqx.nn.Linear(4 * WIDTH, WIDTH, key=keys[5])

    def __call__(self, x: Float[Array, "seq width"]) -> Float[Array, "seq width"]:
        h = jax.vmap(self.norm1)(x)

        def heads(proj: eqx.nn.Linear) -> Float[Array, "seq heads dim"]:
            return rearrange(jax.vmap(proj)(h), "s (h d) -> s h d", h=HEADS)

        attended = rc.nn.attention(heads(self.q), heads(self.k), heads(self.v), causal=True)
        x = x + jax.vmap(self.o)(rearrange(attended, "s h d -> s (h d)"))
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


class UserLM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: tuple[Block, ...]
    head: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        keys = jax.random.split(key, LAYERS + 2)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=keys[0])
        self.blocks = tuple(Block(key=k) for k in keys[1:-1])
        self.head = eqx.nn.Linear(WIDTH, VOCAB, key=keys[-1])

    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(ids)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(x)


def loss_fn(model: UserLM, batch: dict, key: jax.Array) -> jax.Array:
    ids = batch["ids"]
    logits = jax.vmap(model)(ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


ROWS = np.asarray(
    [(a + b * np.arange(17)) % VOCAB for a, b in zip(range(0, 32, 4), range(1, 9), strict=True)],
    np.int32,
)


def whole_rows_loss(model: UserLM, batch: dict, key: jax.Array) -> jax.Array:
    """The model runs on whole rows (a length the data axis divides); the last position
    predicts nothing."""
    ids = batch["ids"]
    logits = jax.vmap(model)(ids)[:, :-1]
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def two_steps(model, mesh=None, *, loss=loss_fn, lengths=17, **options):
    """Two SGD steps on the rows (the first `lengths` tokens), on one device or `mesh`."""
    batch = {"ids": jnp.asarray(ROWS[:, :lengths])}
    trainable = options.pop("trainable", None)
    # The step donates what it is given: train a copy, so the caller's model stays.
    model = jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, model)
    if mesh is not None:
        model = rc.place(model, mesh, example_call=lambda m: loss(m, batch, None))
        spec = P() if options.get("context_parallel") else P("data")
        batch = jax.device_put(batch, NamedSharding(mesh, spec))
    optimizer = optax.sgd(0.5)
    mask = rc.trainable_mask(model, trainable)
    state = optimizer.init(eqx.filter(model, mask))
    step = rc.train_step(loss, optimizer, mesh=mesh, trainable=trainable, **options)
    losses = []
    for i in range(2):
        model, state, metrics = step(model, state, batch, jax.random.key(i))
        losses.append(float(metrics["loss"]))
    return model, losses


def assert_same(got, want):
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    for g, w in zip(
        jax.tree.leaves(eqx.filter(got[0], eqx.is_array)),
        jax.tree.leaves(eqx.filter(want[0], eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_the_rules_split_it_as_megatron_does():
    model = UserLM(key=jax.random.key(0))
    plan = rc.sharding_plan(model, 2, example_call=lambda m: m(jnp.arange(8)))
    block = plan.specs.blocks[0]
    assert [block.q.weight, block.k.weight, block.v.weight] == [P("model", None)] * 3
    assert block.o.weight == P(None, "model")
    assert (block.up.weight, block.down.weight) == (P("model", None), P(None, "model"))


def test_sequence_parallelism_on_it_equals_one_device():
    want = two_steps(UserLM(key=jax.random.key(0)))
    got = two_steps(UserLM(key=jax.random.key(0)), rc.make_mesh(4), sequence_parallel=True)
    assert_same(got, want)


@pytest.mark.slow
def test_context_parallelism_on_it_equals_one_device():
    # Rows of 16 tokens, each split over the 4 data shards of a 4 x 2 mesh.
    want = two_steps(UserLM(key=jax.random.key(0)), loss=whole_rows_loss, lengths=16)
    got = two_steps(
        UserLM(key=jax.random.key(0)),
        rc.make_mesh(2),
        loss=whole_rows_loss,
        lengths=16,
        context_parallel=True,
    )
    assert_same(got, want)


def test_lora_on_it_trains_the_adapters_alike_on_a_mesh():
    model = rc.lora.apply(UserLM(key=jax.random.key(0)), ["q", "v"], rank=2, key=jax.random.key(1))
    trainable = rc.lora.trainable(model)
    want = two_steps(model, trainable=trainable)
    got = two_steps(model, rc.make_mesh(2), trainable=trainable, sequence_parallel=True)
    assert_same(got, want)
    base = eqx.filter(want[0], trainable, inverse=True)
    for a, b in zip(
        jax.tree.leaves(base),
        jax.tree.leaves(eqx.filter(model, trainable, inverse=True)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "how",
    [
        {},
        pytest.param({"fsdp": True}, marks=pytest.mark.slow),
        pytest.param({"context_parallel": True}, marks=pytest.mark.slow),
    ],
)
def test_the_planner_plans_it(how):
    plan = rc.memory_plan(
        lambda key: UserLM(key=key),
        devices=8,
        n_model_shards=2,
        seq_len=32,
        max_batch=False,
        **how,
    )
    assert plan.n_params == sum(
        x.size for x in jax.tree.leaves(eqx.filter(UserLM(key=jax.random.key(0)), eqx.is_array))
    )
    assert plan.peak > 0 and plan.params < plan.peak
