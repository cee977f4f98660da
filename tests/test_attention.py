"""`rc.nn.attention`: its options against attention written out by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import redcoast as rc


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
