"""Context parallelism: attention with its sequence split over a mesh axis equals the unsplit one.

`rc.context_parallel_attention` against the zoo's attention formula (scores over
`sqrt(head_dim)`, masked with float32's lowest value, softmax in float32, grouped-query
heads), forward and gradients, causal or not, with and without a key padding mask, on
sequence axes of 2, 4 and 8 devices; and the errors for what it cannot split.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from einops import rearrange, repeat
from hlo import collectives
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc
from redcoast.models import Attention, rotate
from redcoast.nn import dense

RTOL, ATOL = 1e-5, 1e-6


def seq_mesh(n: int, name: str = "seq") -> Mesh:
    return Mesh(np.asarray(jax.devices()[:n]), (name,), axis_types=(AxisType.Auto,))


def unsplit(q, k, v, *, causal, mask=None, scale=None):
    """The zoo's attention (`Attention._attend`) with batch dims, without the output projection."""
    group = q.shape[-2] // k.shape[-2]
    k = repeat(k, "... s h d -> ... s (h g) d", g=group)
    v = repeat(v, "... s h d -> ... s (h g) d", g=group)
    scores = jnp.einsum("...thd,...shd->...hts", q, k)
    scores = scores / math.sqrt(q.shape[-1]) if scale is None else scores * scale
    visible = jnp.ones((q.shape[-3], k.shape[-3]), dtype=bool)
    if causal:
        visible = jnp.tril(visible)
    if mask is not None:
        visible = visible & jnp.asarray(mask).astype(bool)[..., None, None, :]
    scores = jnp.where(visible, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("...hts,...shd->...thd", weights, v)


def inputs(batch=(2,), seq=32, heads=4, kv_heads=2, head_dim=8, kv_seq=None, seed=0):
    kq, kk, kv, kg = jax.random.split(jax.random.key(seed), 4)
    kv_seq = seq if kv_seq is None else kv_seq
    q = jax.random.normal(kq, (*batch, seq, heads, head_dim))
    k = jax.random.normal(kk, (*batch, kv_seq, kv_heads, head_dim))
    v = jax.random.normal(kv, (*batch, kv_seq, kv_heads, head_dim))
    cotangent = jax.random.normal(kg, q.shape)
    return q, k, v, cotangent


def padding(batch: int, seq: int) -> jax.Array:
    """Example 0 left-padded by 5 (its first queries see no key when causal), example 1
    right-padded from 20; further examples unpadded."""
    positions = np.arange(seq)
    rows = [positions >= 5, positions < 20] + [positions >= 0] * (batch - 2)
    return jnp.asarray(np.stack(rows[:batch]))


def assert_same(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=RTOL, atol=ATOL)


def value_and_grads(fn, q, k, v, cotangent):
    out = jax.jit(fn)(q, k, v)
    grads = jax.jit(jax.grad(lambda *a: (fn(*a) * cotangent).sum(), argnums=(0, 1, 2)))(q, k, v)
    return out, grads


# One case of each strategy runs with the fast tests, the grid on 4 devices with
# `nox -s slow`, and on 2 and 8 too with `nox -s exhaustive`.
_FAST = {("ring", True, True, 4), ("all_gather", True, True, 2)}


def _later(n: int) -> tuple[pytest.MarkDecorator, ...]:
    return (pytest.mark.slow,) if n == 4 else (pytest.mark.slow, pytest.mark.exhaustive)


_GRID = [
    pytest.param(
        strategy,
        padded,
        causal,
        n,
        id=f"{strategy}-{'padding' if padded else 'no-mask'}-{'causal' if causal else 'full'}-{n}",
        marks=() if (strategy, padded, causal, n) in _FAST else _later(n),
    )
    for strategy in ("ring", "all_gather")
    for padded in (False, True)
    for causal in (False, True)
    for n in (2, 4, 8)
]


@pytest.mark.parametrize(("strategy", "padded", "causal", "n"), _GRID)
def test_split_attention_and_its_gradients_equal_the_unsplit(n, causal, padded, strategy):
    q, k, v, cotangent = inputs()
    mask = padding(2, 32) if padded else None
    mesh = seq_mesh(n)

    def split(q, k, v):
        return rc.context_parallel_attention(
            q, k, v, mesh=mesh, axis="seq", causal=causal, mask=mask, strategy=strategy
        )

    def reference(q, k, v):
        return unsplit(q, k, v, causal=causal, mask=mask)

    got = value_and_grads(split, q, k, v, cotangent)
    assert_same(got, value_and_grads(reference, q, k, v, cotangent))
    assert got[0].sharding.spec == P(None, "seq")


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_vmapped_unbatched_inputs_and_several_batch_dims(causal):
    q, k, v, cotangent = inputs(batch=(2, 3), seq=16)
    mask = padding(6, 16).reshape(2, 3, 16)
    mesh = seq_mesh(4)

    def one(q, k, v, mask):
        return rc.context_parallel_attention(
            q, k, v, mesh=mesh, axis="seq", causal=causal, mask=mask
        )

    want = unsplit(q, k, v, causal=causal, mask=mask)
    assert_same(jax.jit(one)(q, k, v, mask), want)
    assert_same(jax.jit(jax.vmap(jax.vmap(one)))(q, k, v, mask), want)

    def loss(attention, q, k, v):
        return (jax.vmap(attention)(q, k, v, mask[0]) * cotangent[0]).sum()

    def zoo(q, k, v, mask):
        return unsplit(q, k, v, causal=causal, mask=mask)

    grads = jax.jit(jax.grad(loss, (1, 2, 3)), static_argnums=0)
    assert_same(grads(one, q[0], k[0], v[0]), grads(zoo, q[0], k[0], v[0]))


# In `nox -s slow`; test_context_zoo's steps on redcoast's mesh are the fast siblings.
@pytest.mark.slow
@pytest.mark.parametrize("axis", ["model", "data"])
def test_sequence_split_over_an_axis_of_redcoasts_mesh_keeps_the_batch_split_on_the_other(axis):
    mesh = rc.make_mesh(n_model_shards=2)  # data 4 x model 2
    other = "data" if axis == "model" else "model"
    batch = int(mesh.shape[other])
    q, k, v, cotangent = inputs(batch=(batch,), seq=32)
    mask = padding(batch, 32)
    spec = P(other, axis)
    q, k, v, cotangent = (
        jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, cotangent)
    )
    mask = jax.device_put(mask, NamedSharding(mesh, spec))

    def split(q, k, v):
        return rc.context_parallel_attention(q, k, v, mesh=mesh, axis=axis, causal=True, mask=mask)

    got = value_and_grads(split, q, k, v, cotangent)
    want = value_and_grads(lambda *a: unsplit(*a, causal=True, mask=mask), q, k, v, cotangent)
    assert_same(got, want)
    assert got[0].sharding.spec == spec
    assert all(g.sharding.spec == spec for g in got[1])


def test_drop_in_for_the_zoo_attention_with_rotary_positions_and_grouped_heads():
    attn = Attention(32, 4, num_kv_heads=2, rotary_dim=8, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (2, 16, 32))
    mesh = seq_mesh(4)

    def split_attention(attn: Attention, x: jax.Array) -> jax.Array:
        positions = jnp.arange(x.shape[0])
        heads = lambda proj, h: rearrange(dense(proj, x), "s (h d) -> s h d", h=h)  # noqa: E731
        q = rotate(heads(attn.q_proj, 4), positions, rotary_dim=8)
        k = rotate(heads(attn.k_proj, 2), positions, rotary_dim=8)
        v = heads(attn.v_proj, 2)
        out = rc.context_parallel_attention(q, k, v, mesh=mesh, axis="seq", causal=True)
        return dense(attn.o_proj, rearrange(out, "s h d -> s (h d)"))

    def loss(attn, attention, x):
        return (jax.vmap(lambda x: attention(attn, x))(x) ** 2).mean()

    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    got = value_and_grad(attn, split_attention, x)
    want = value_and_grad(attn, Attention.__call__, x)
    assert len(jax.tree.leaves(want[1])) == 4  # the four projections' weights
    assert_same(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_cross_attention_to_a_sequence_of_another_length_with_a_given_scale(strategy):
    q, k, v, cotangent = inputs(seq=16, kv_seq=40, heads=2, kv_heads=2)
    mask = padding(2, 40)
    mesh = seq_mesh(8)

    def split(q, k, v):
        return rc.context_parallel_attention(
            q, k, v, mesh=mesh, axis="seq", causal=False, mask=mask, scale=1.0, strategy=strategy
        )

    got = value_and_grads(split, q, k, v, cotangent)
    reference = lambda *a: unsplit(*a, causal=False, mask=mask, scale=1.0)  # noqa: E731
    assert_same(got, value_and_grads(reference, q, k, v, cotangent))


@pytest.mark.slow
def test_integer_mask_and_bfloat16_inputs():
    q, k, v, _ = inputs(seq=32)
    mask = padding(2, 32).astype(jnp.int32)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    got = rc.context_parallel_attention(
        q, k, v, mesh=seq_mesh(4), axis="seq", causal=True, mask=mask
    )
    assert got.dtype == jnp.bfloat16
    want = unsplit(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True, mask=mask)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)


def compiled_training_pass(strategy, n, seq):
    """`context_parallel_attention`'s output and gradients over `n` devices, compiled."""
    mesh = Mesh(np.asarray(jax.devices()[:n]).reshape(1, n), ("data", "model"))
    arg = jax.ShapeDtypeStruct((1, seq, 2, 8), jnp.float32)

    def train(q, k, v, cotangent):
        attention = lambda q, k, v: rc.context_parallel_attention(  # noqa: E731
            q, k, v, mesh=mesh, axis="model", causal=True, strategy=strategy
        )
        out, pullback = jax.vjp(attention, q, k, v)
        return out, pullback(cotangent)

    return mesh, jax.jit(train).lower(arg, arg, arg, arg).compile()


def test_the_ring_passes_blocks_to_its_neighbour_and_gathers_nothing():
    mesh, compiled = compiled_training_pass("ring", 8, 64)
    found = collectives(compiled.as_text(), mesh)
    assert {c.op for c in found} == {"collective-permute"}
    block = 64 // 8 * 2 * 8 * 4  # one device's keys: 8 tokens x 2 heads x 8 features, float32
    sizes = [c.nbytes for c in found if c.nbytes >= block]
    # Forward: the keys and the values, 7 hops each. Backward: keys and values stacked,
    # 7 hops, and their gradients stacked, 8 (the last takes them home). Nothing else
    # but the padding mask's blocks, and no hop of the forward reused by the backward.
    assert sorted(sizes) == [block] * 14 + [2 * block] * 15
    gathered = collectives(compiled_training_pass("all_gather", 8, 64)[1].as_text(), mesh)
    assert "all-gather" in {c.op for c in gathered}


@pytest.mark.slow
def test_the_ring_keeps_a_fraction_of_the_memory_gathering_needs():
    temp = {
        (strategy, n): compiled_training_pass(strategy, n, 1024)[1]
        .memory_analysis()
        .temp_size_in_bytes
        for strategy in ("ring", "all_gather")
        for n in (2, 8)
    }
    # Per device the ring holds blocks of (seq / n)^2 scores, gathering (seq / n) x seq.
    assert temp["ring", 8] < 0.5 * temp["all_gather", 8]
    assert temp["ring", 8] < 0.15 * temp["ring", 2]


def test_a_sequence_the_axis_does_not_divide_is_refused_naming_the_sizes():
    q, k, v, _ = inputs(seq=30)
    with pytest.raises(ValueError) as error:
        rc.context_parallel_attention(q, k, v, mesh=seq_mesh(4), axis="seq", causal=True)
    message = str(error.value)
    assert "'seq' axis of size 4" in message and "30 tokens" in message
    assert "Pad the sequence to 32 tokens" in message and "[1, 2, 3, 5, 6, 10, 15, 30]" in message


def test_an_axis_the_mesh_does_not_have_is_refused_naming_its_axes():
    q, k, v, _ = inputs()
    expected = r"axis='seq' is not an axis of this mesh.*'data', 'model'"
    with pytest.raises(ValueError, match=expected):
        rc.context_parallel_attention(q, k, v, mesh=rc.make_mesh(2), axis="seq", causal=False)


def test_a_query_key_matrix_mask_is_refused_saying_what_can_be_split():
    q, k, v, _ = inputs()
    matrix = jnp.ones((2, 32, 32), dtype=bool)
    with pytest.raises(ValueError) as error:
        rc.context_parallel_attention(
            q, k, v, mesh=seq_mesh(2), axis="seq", causal=False, mask=matrix
        )
    message = str(error.value)
    assert "cannot split a mask of shape (2, 32, 32)" in message
    assert "key padding mask of shape (*batch, kv_seq) = (2, 32)" in message
    assert "causal=True" in message


def test_other_bad_inputs_are_refused_clearly():
    q, k, v, _ = inputs(seq=16, kv_seq=32)
    mesh = seq_mesh(2)
    with pytest.raises(ValueError, match="causal attention needs as many keys as queries"):
        rc.context_parallel_attention(q, k, v, mesh=mesh, axis="seq", causal=True)
    q, k, v, _ = inputs(heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="3 heads, which is not a multiple of k and v's 2 heads"):
        rc.context_parallel_attention(q, k, v, mesh=mesh, axis="seq", causal=True)
    q, k, v, _ = inputs()
    expected = r"key padding mask of shape \(\*batch, kv_seq\) = \(2, 32\)"
    with pytest.raises(ValueError, match=expected):
        rc.context_parallel_attention(
            q, k, v, mesh=mesh, axis="seq", causal=True, mask=jnp.ones((2, 16), dtype=bool)
        )
    # Under the tests' jaxtyping hook the annotation refuses it first (a TypeError).
    with pytest.raises((ValueError, TypeError), match="strategy"):
        rc.context_parallel_attention(
            q,
            k,
            v,
            mesh=mesh,
            axis="seq",
            causal=True,
            strategy="tree",  # type: ignore[arg-type]
        )


def packed_segments(batch: int, seq: int) -> jax.Array:
    """Documents of uneven lengths packed into each row, crossing the devices' blocks."""
    rows = [[0] * 11 + [1] * 13 + [2] * (seq - 24), [0] * 3 + [1] * (seq - 9) + [2] * 6]
    rows += [[0] * seq] * (batch - 2)
    return jnp.asarray(rows[:batch], jnp.int32)


_RING_OPTIONS = {
    "segments": {"segment_ids": True},
    "window": {"window": 6},
    "softcap": {"softcap": 2.0},
    "all": {"segment_ids": True, "window": 9, "softcap": 3.0, "padding": True},
}
_RING_GRID = [
    pytest.param(
        options,
        strategy,
        n,
        block,
        id=f"{options}-{strategy}-{n}-block{block}",
        marks=() if (options, strategy, n, block) == ("all", "ring", 4, 4) else _later(n),
    )
    for options in _RING_OPTIONS
    for strategy in ("ring", "all_gather")
    for n in (2, 4, 8)
    for block in (None, 4)
    if not (strategy == "all_gather" and block is not None)
]


@pytest.mark.parametrize(("options", "strategy", "n", "block"), _RING_GRID)
def test_the_ring_with_segments_windows_and_softcaps_equals_unsplit_attention(
    options, strategy, n, block
):
    q, k, v, cotangent = inputs()
    given = dict(_RING_OPTIONS[options])
    segments = packed_segments(2, 32) if given.pop("segment_ids", False) else None
    mask = padding(2, 32) if given.pop("padding", False) else None
    mesh = seq_mesh(n)

    def split(q, k, v):
        return rc.context_parallel_attention(
            q,
            k,
            v,
            mesh=mesh,
            axis="seq",
            causal=True,
            mask=mask,
            segment_ids=segments,
            strategy=strategy,
            block_size=block,
            **given,
        )

    def reference(q, k, v):
        visible = None if mask is None else mask[:, None, :]
        return rc.nn.attention(
            q,
            k,
            v,
            causal=True,
            mask=visible,
            segment_ids=segments,
            implementation="einsum",
            **given,
        )

    assert_same(
        value_and_grads(split, q, k, v, cotangent), value_and_grads(reference, q, k, v, cotangent)
    )


def test_a_block_size_that_does_not_divide_a_share_and_bad_segments_are_refused():
    q, k, v, _ = inputs()
    mesh = seq_mesh(4)
    with pytest.raises(ValueError, match=r"block_size=3 does not divide each device's 8 queries"):
        rc.context_parallel_attention(q, k, v, mesh=mesh, axis="seq", causal=True, block_size=3)
    with pytest.raises(TypeError, match=r"parameter 'segment_ids'(.|\n)*i32\[2,30\]"):
        rc.context_parallel_attention(
            q, k, v, mesh=mesh, axis="seq", causal=True, segment_ids=jnp.zeros((2, 30), int)
        )
