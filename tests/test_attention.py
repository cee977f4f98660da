"""`rc.nn.attention`: its options against attention written out by hand."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import redcoast as rc
from redcoast.nn import _kernels


def qkv(seq=12, heads=4, kv_heads=2, dim=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (seq, heads, dim)),
        jax.random.normal(keys[1], (seq, kv_heads, dim)),
        jax.random.normal(keys[2], (seq, kv_heads, dim)),
    )


def by_hand(q, k, v, visible, softcap=None):
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("thd,shd->hts", q, k) / np.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(visible[None], scores, -jnp.inf)
    return jnp.einsum("hts,shd->thd", jax.nn.softmax(scores, -1), v)


def test_causal_window_and_softcap_are_the_masks_and_cap_they_name():
    q, k, v = qkv()
    t = jnp.arange(12)
    causal = t[None, :] <= t[:, None]
    window = causal & (t[None, :] > t[:, None] - 3)
    np.testing.assert_allclose(
        rc.nn.attention(q, k, v, causal=True), by_hand(q, k, v, causal), atol=1e-6
    )
    np.testing.assert_allclose(
        rc.nn.attention(q, k, v, causal=True, window=3, softcap=2.0),
        by_hand(q, k, v, window, softcap=2.0),
        atol=1e-6,
    )


def test_packed_documents_attend_as_if_each_were_alone():
    q, k, v = qkv()
    segments = jnp.array([0] * 5 + [1] * 4 + [2] * 3)
    packed = rc.nn.attention(q, k, v, causal=True, segment_ids=segments)
    alone = [
        rc.nn.attention(q[a:b], k[a:b], v[a:b], causal=True) for a, b in ((0, 5), (5, 9), (9, 12))
    ]
    np.testing.assert_allclose(packed, jnp.concatenate(alone), atol=1e-6)


def test_bad_options_name_what_is_wrong():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="window=3 is a sliding window over the past"):
        rc.nn.attention(q, k, v, window=3)
    # Under the tests' type checking the annotation's shapes refuse it first.
    with pytest.raises((ValueError, TypeError), match="segment_ids"):
        rc.nn.attention(q, k, v, causal=True, segment_ids=jnp.zeros(5, jnp.int32))
    with pytest.raises((ValueError, TypeError), match=r"cannot share 3 key/value heads|kv_heads"):
        rc.nn.attention(q, k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1))


# Blockwise attention against the einsum: every option, values and gradients.

BLOCKS = (16, 8)  # 4 query blocks of 16 and 8 key blocks of 8 over 64 tokens


def segments_of(lengths_per_row):
    return jnp.asarray([np.repeat(np.arange(len(ls)), ls) for ls in lengths_per_row])


SEGMENTS = segments_of([[20, 30, 14], [5, 40, 19]])


def case_inputs(seq=64, kv_seq=None, batch=2, heads=4, kv_heads=2, dim=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    kv_seq = seq if kv_seq is None else kv_seq
    q = jax.random.normal(keys[0], (batch, seq, heads, dim))
    k = jax.random.normal(keys[1], (batch, kv_seq, kv_heads, dim))
    v = jax.random.normal(keys[2], (batch, kv_seq, kv_heads, dim))
    return q, k, v, jax.random.normal(keys[3], q.shape)


def mask_with_blind_rows(batch, seq, kv_seq):
    """Random visibility, with the first 7 queries of row 0 seeing no key at all."""
    visible = jax.random.bernoulli(jax.random.key(7), 0.6, (batch, seq, kv_seq))
    return visible.at[0, :7].set(False)


CASES = {
    "full": {},
    "causal": {"causal": True},
    "window": {"causal": True, "window": 10},
    "softcap": {"causal": True, "softcap": 2.0},
    "segments": {"causal": True, "segment_ids": SEGMENTS},
    "segments-not-causal": {"segment_ids": SEGMENTS},
    "window-softcap-segments-scale": {
        "causal": True,
        "window": 12,
        "softcap": 3.0,
        "segment_ids": SEGMENTS,
        "scale": 0.5,
    },
    "mask-with-blind-rows": {"mask": mask_with_blind_rows(2, 64, 64)},
    "key-padding": {
        "causal": True,
        "mask": jnp.arange(64)[None, None, :] < jnp.array([[[50]], [[64]]]),
    },
    "bias": {"causal": True, "bias": "given"},
}
FAST_CASES = {"window-softcap-segments-scale"}


def values_and_grads(attend, q, k, v, cotangent, bias=None):
    def loss(q, k, v, bias):
        return (attend(q, k, v, bias) * cotangent).sum()

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    out = jax.jit(attend)(q, k, v, bias)
    return out, jax.jit(jax.grad(loss, argnums))(q, k, v, bias)


def assert_close(got, want, tol=1e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "case", [c if c in FAST_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_blockwise_equals_the_einsum_values_and_gradients(case):
    q, k, v, cotangent = case_inputs()
    options = dict(CASES[case])
    bias = None
    if options.pop("bias", None) is not None:
        bias = jax.random.normal(jax.random.key(3), (4, 64, 64))  # (heads, seq, kv_seq)

    def attend(implementation, **extra):
        def run(q, k, v, bias):
            return rc.nn.attention(
                q, k, v, bias=bias, implementation=implementation, **options, **extra
            )

        return run

    want = values_and_grads(attend("einsum"), q, k, v, cotangent, bias)
    got = values_and_grads(attend("blockwise", block_size=BLOCKS), q, k, v, cotangent, bias)
    assert_close(got, want)


@pytest.mark.slow
def test_blockwise_cross_attention_with_key_segments_and_a_mask_under_vmap():
    # 32 queries to 48 keys, the rows one at a time under jax.vmap, as the zoo calls it.
    q, k, v, cotangent = case_inputs(seq=32, kv_seq=48)
    q_seg, kv_seg = segments_of([[10, 22], [16, 16]]), segments_of([[8, 40], [30, 18]])
    mask = mask_with_blind_rows(2, 32, 48)

    def attend(implementation):
        def run(q, k, v, bias):
            one = lambda q, k, v, qs, ks, m: rc.nn.attention(  # noqa: E731
                q,
                k,
                v,
                segment_ids=qs,
                kv_segment_ids=ks,
                mask=m,
                implementation=implementation,
                block_size=(8, 16),
            )
            return jax.vmap(one)(q, k, v, q_seg, kv_seg, mask)

        return run

    got = values_and_grads(attend("blockwise"), q, k, v, cotangent)
    assert_close(got, values_and_grads(attend("einsum"), q, k, v, cotangent))


@pytest.mark.slow
def test_blockwise_in_bfloat16_keeps_its_statistics_in_float32():
    q, k, v, _ = case_inputs(seq=128)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = rc.nn.attention(*low, causal=True, implementation="blockwise", block_size=32)
    assert got.dtype == jnp.bfloat16
    want = rc.nn.attention(q, k, v, causal=True, implementation="einsum")
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2)


def test_no_attention_weight_crosses_a_segment():
    q, k, v, _ = case_inputs()

    def row0_head0(k, v):
        out = rc.nn.attention(
            q,
            k,
            v,
            causal=True,
            segment_ids=SEGMENTS,
            implementation="blockwise",
            block_size=BLOCKS,
        )
        return out[0, :, 0, 0]

    # The weights: no query's output moves with another document's keys or values, and
    # each moves with its own document's earlier ones.
    jacobians = jax.jit(jax.jacrev(row0_head0, argnums=(0, 1)))(k, v)
    segments = np.asarray(SEGMENTS[0])
    same = segments[:, None] == segments[None, :]
    causal = np.tril(np.ones((64, 64), bool))
    for jac in jacobians:  # (query, batch, key, kv_head, dim)
        touched = np.abs(np.asarray(jac[:, 0])).sum((-1, -2)) > 0  # (query, key)
        assert not (touched & ~same).any()
        # A key of the query's own document before it (the first query sees only itself).
        assert touched[1:][(same & causal)[1:] & ~np.eye(64, dtype=bool)[1:]].all()


def test_blockwise_keeps_no_score_matrix():
    def temp(implementation, seq=2048):
        arg = jax.ShapeDtypeStruct((seq, 2, 32), jnp.float32)
        blocks = 128 if implementation == "blockwise" else None

        def train(q, k, v, cotangent):
            attend = lambda q, k, v: rc.nn.attention(  # noqa: E731
                q, k, v, causal=True, implementation=implementation, block_size=blocks
            )
            out, pullback = jax.vjp(attend, q, k, v)
            return out, pullback(cotangent)

        compiled = jax.jit(train).lower(arg, arg, arg, arg).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    scores = 2 * 2048 * 2048 * 4  # one (heads, seq, seq) float32 array
    assert temp("einsum") > scores
    # A few (heads, 128, 128) blocks and the inputs' size: 2 MiB against 32.
    assert temp("blockwise") < 0.1 * scores


def test_auto_runs_the_einsum_on_cpu_and_blockwise_on_long_sequences_a_kernel_refuses(
    monkeypatch,
):
    def jaxpr(seq):
        q = jnp.zeros((seq, 2, 8))  # float32: cuDNN's kernel refuses it
        return str(jax.make_jaxpr(lambda q: rc.nn.attention(q, q, q, causal=True))(q))

    assert "while" not in jaxpr(1024)
    monkeypatch.setattr(_kernels, "platform", lambda: "gpu")
    assert "while" in jaxpr(1024) and "while" not in jaxpr(512)


def test_a_kernel_or_block_that_does_not_fit_is_refused_naming_why():
    q = jnp.zeros((128, 2, 8))
    with pytest.raises(ValueError, match=r"'cudnn' runs on GPU, and this computation is for cpu"):
        rc.nn.attention(q, q, q, causal=True, implementation="cudnn")
    with pytest.raises(ValueError, match=r"'pallas' runs on TPU, and this computation is for cpu"):
        rc.nn.attention(q, q, q, causal=True, implementation="pallas")
    with pytest.raises(ValueError, match=r"a block of 48 queries does not divide the 128 queries"):
        rc.nn.attention(q, q, q, implementation="blockwise", block_size=48)
    with pytest.raises(ValueError, match=r"block_size=0 must be a positive int"):
        rc.nn.attention(q, q, q, implementation="blockwise", block_size=0)
    with pytest.raises(ValueError, match=r"implementation must be one of .*got 'flash'"):
        rc.nn.check_implementation("flash")  # what attention and the zoo's Attention check
    with pytest.raises(ValueError, match=r"a mask of shape \(3, 128\) does not fit"):
        rc.nn.attention(q, q, q, mask=jnp.ones((3, 128), bool), implementation="blockwise")


@pytest.mark.slow
def test_a_users_process_checks_the_shapes_of_attentions_arguments():
    """Outside the tests' jaxtyping hook: the check is the library's, not pytest's."""
    script = (
        "import jax.numpy as jnp, redcoast as rc\n"
        "q, k = jnp.ones((2, 16, 4, 8)), jnp.ones((2, 16, 2, 8))\n"
        "try:\n"
        "    rc.nn.attention(q, k, jnp.ones((2, 16, 2, 4)), causal=True)\n"
        "except TypeError as e:\n"
        "    print(type(e).__name__, str(e).splitlines()[1])\n"
        "print(rc.nn.attention(q, k, k, causal=True, scale=1).shape)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "TypeCheckError The problem arose whilst typechecking parameter 'v'."
    # An int scale passes where the annotation says float (PEP 484's numeric tower).
    assert lines[1] == "(2, 16, 4, 8)"
