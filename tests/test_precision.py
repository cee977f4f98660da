"""Precision and rematerialisation policies: same numbers, less memory, clear errors.

Remat must not change a single gradient beyond float32 rounding, and must shrink the
compiled step's temporaries; bf16 must track fp32 within bfloat16's rounding while
keeping float32 master weights, and pure-bf16 must store and train in bfloat16.
"""

import contextlib
import io
import re

import chex
import equinox as eqx
import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redcoast as rc
from redcoast.models import GPT2, GPT2Config, Llama, LlamaConfig

VOCAB = 128
TINY = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4)
TINY_LLAMA = LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def lm_loss(model, batch, key):
    logits = jax.vmap(model)(batch["ids"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1], batch["ids"][:, 1:]
    ).mean()


def _counting(n, seq=16, seed=0):
    """Sequences counting up from a random start: learnable in a few steps."""
    starts = np.random.default_rng(seed).integers(0, VOCAB, n)
    return ((starts[:, None] + np.arange(seq)[None]) % VOCAB).astype(np.int32)


def _value_and_grad(model, ids):
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def f(p):
        return lm_loss(eqx.combine(p, static), {"ids": ids}, None)

    return jax.jit(jax.value_and_grad(f))(params)


def _assert_trees_close(a, b, rtol, atol=0.0):
    # Array leaves only: the models differ in a static field (their remat policy).
    chex.assert_trees_all_close(jax.tree.leaves(a), jax.tree.leaves(b), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- remat


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True])
def test_remat_gives_the_loss_and_gradients_of_no_remat(scan_layers):
    ids = jnp.asarray(_counting(4))
    results = {
        policy: _value_and_grad(
            GPT2(TINY, scan_layers=scan_layers, remat=policy, key=jax.random.key(0)), ids
        )
        for policy in ("none", "dots", "full")
    }
    for policy in ("dots", "full"):
        _assert_trees_close(results[policy], results["none"], rtol=1e-6, atol=1e-7)


def test_remat_on_a_users_function_and_bad_names():
    mlp = eqx.nn.MLP(8, 8, 32, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 8))

    def block(m, h):
        return jax.vmap(m)(h)

    def loss(m, fn):
        return (fn(m, x) ** 2).mean()

    assert rc.remat(block, "none") is block
    want = eqx.filter_value_and_grad(loss)(mlp, block)
    for policy in ("dots", "full"):
        got = eqx.filter_value_and_grad(loss)(mlp, rc.remat(block, policy))
        _assert_trees_close(got, want, rtol=1e-6)

    with pytest.raises(ValueError, match=r"'none', 'dots', 'full'.*got 'some'"):
        rc.remat(block, "some")
    with pytest.raises(ValueError, match="remat must be one of"):
        GPT2(TINY, remat="everything", key=jax.random.key(0))


def _seq2seq_loss(model, batch, key):
    src, tgt = batch["ids"][:, :8], batch["ids"][:, 8:]
    logits = jax.vmap(lambda s, t: model(s, t))(src, tgt[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tgt[:, 1:]).mean()


@pytest.mark.parametrize("arch", ["llama", pytest.param("t5", marks=pytest.mark.slow)])
def test_attention_remat_keeps_the_gradients_and_drops_the_scores(arch):
    """Remat's "attention" policy recomputes each layer's score region: the same
    gradients as no remat, and fewer bytes kept (at 64 tokens the heads x seq x seq
    scores are most of them)."""
    t5 = rc.models.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_heads=4)
    cls, config, loss = (
        (Llama, TINY_LLAMA, lm_loss) if arch == "llama" else (rc.models.T5, t5, _seq2seq_loss)
    )
    batch = {"ids": jnp.asarray(_counting(2, seq=65 if arch == "llama" else 128))}
    grads, temp = {}, {}
    for policy in ("none", "attention"):
        model = cls(config, remat=policy, scan_layers=True, key=jax.random.key(0))
        fn = eqx.filter_jit(eqx.filter_grad(lambda m: loss(m, batch, None)))
        grads[policy] = fn(model)
        temp[policy] = fn.lower(model).compile().compiled.memory_analysis().temp_size_in_bytes
    _assert_trees_close(grads["attention"], grads["none"], rtol=1e-5, atol=1e-7)
    assert temp["attention"] < 0.8 * temp["none"]


def test_from_hf_takes_the_remat_policy(tmp_path):
    GPT2(TINY, key=jax.random.key(0)).to_hf(tmp_path)
    ids = jnp.asarray(_counting(1)[0])
    plain = GPT2.from_hf(tmp_path)
    full = GPT2.from_hf(tmp_path, scan_layers=True, remat="full")
    dots = rc.models.from_hf(tmp_path, remat="dots")
    assert (plain.remat, full.remat, dots.remat) == ("none", "full", "dots")
    np.testing.assert_allclose(full(ids), plain(ids), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(dots(ids), plain(ids))
    with pytest.raises(ValueError, match="remat must be one of"):
        rc.models.from_hf(tmp_path, remat="yes")


def _saved_residuals(policy, batch=2, seq=16):
    """The shapes `jax.grad` keeps from the forward pass of a one-layer GPT-2, vmapped."""
    config = GPT2Config(vocab_size=64, n_positions=seq, n_embd=32, n_layer=1, n_head=4)
    model = GPT2(config, remat=policy, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    ids = jnp.zeros((batch, seq), jnp.int32)

    def f(p):
        return jax.vmap(eqx.combine(p, static))(ids).sum()

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(f, params)
    lines = [ln for ln in out.getvalue().splitlines() if "from the argument" not in ln]
    return [
        tuple(int(d) for d in m.group(1).split(","))
        for ln in lines
        if (m := re.match(r"\w+\[([\d,]+)\]", ln))
    ]


def test_policies_under_vmap_save_what_their_names_say():
    # A batch of 2 sequences of 16 tokens, 4 heads of 8, MLP width 128.
    scores = (2, 4, 16, 16)
    none, dots, full = (_saved_residuals(p) for p in ("none", "dots", "full"))
    assert scores in none and (2, 16, 128) in none
    # dots: beyond what full keeps, the five projections' outputs (q, k, v, o of width
    # 32; the MLP's input projection of width 128), nothing with a batch dimension in
    # its matmul (the attention scores), nothing elementwise (the GELU's output).
    extra = list(dots)
    for shape in full:
        extra.remove(shape)
    assert sorted(extra) == sorted([(2, 16, 32)] * 4 + [(2, 16, 128)])
    assert scores not in dots
    # full: nothing of the block's insides, only its input and what follows it.
    assert not [s for s in full if s in (scores, (2, 16, 128), (32, 2, 16), (128, 2, 16))]
    assert len(full) < len(dots) < len(none)


def _temp_bytes(model, precision="fp32", batch=8, seq=128):
    optimizer = optax.adamw(1e-3)
    if precision == "pure-bf16":
        model = rc.cast(model, jnp.bfloat16)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = rc.train_step(lm_loss, optimizer, precision=precision, jit=False)
    ids = jnp.zeros((batch, seq), jnp.int32)
    compiled = jax.jit(step).lower(model, opt_state, {"ids": ids}, jax.random.key(0)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_full_remat_at_least_halves_the_compiled_steps_temporaries():
    # 8 scanned layers, 256 wide, sequences of 128: activations dominate the temporaries.
    config = GPT2Config(vocab_size=512, n_positions=128, n_embd=256, n_layer=8, n_head=8)
    temp = {
        policy: _temp_bytes(GPT2(config, scan_layers=True, remat=policy, key=jax.random.key(0)))
        for policy in ("none", "dots", "full")
    }
    print({k: f"{v / 2**20:.1f} MiB" for k, v in temp.items()})
    assert temp["full"] <= 0.5 * temp["none"]
    assert temp["full"] < temp["dots"] < temp["none"]


def test_remat_model_is_split_like_the_plain_one():
    ids = jnp.asarray(_counting(2))
    specs = {
        policy: rc.sharding_plan(
            GPT2(TINY, scan_layers=True, remat=policy, key=jax.random.key(0)),
            n_model_shards=2,
            example_call=lambda m: jax.vmap(m)(ids),
        ).specs
        for policy in ("none", "full")
    }
    assert jax.tree.leaves(specs["full"]) == jax.tree.leaves(specs["none"])


# ----------------------------------------------------------------------------- precision


def _train(model, precision, n_steps, *, lr=1e-3, seed=0):
    optimizer = optax.adamw(lr)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = rc.train_step(lm_loss, optimizer, precision=precision)
    losses = []
    for i in range(n_steps):
        batch = {"ids": jnp.asarray(_counting(8, seed=seed + i))}
        model, opt_state, metrics = step(model, opt_state, batch, jax.random.key(i))
        assert metrics["loss"].dtype == jnp.float32
        losses.append(float(metrics["loss"]))
    return model, opt_state, np.array(losses)


def _float_dtypes(tree):
    return {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


@pytest.mark.parametrize(
    "make",
    [
        lambda k: GPT2(TINY, key=k),
        pytest.param(lambda k: Llama(TINY_LLAMA, key=k), marks=pytest.mark.slow),
    ],
)
def test_bf16_tracks_fp32_with_float32_master_weights(make):
    # bfloat16 keeps 8 bits of mantissa, a relative rounding of 2**-9 ~ 2e-3 per
    # operation. Measured over 5 Adam steps at 1e-2 (GPT-2): losses within 5e-4
    # relative of float32's. 1e-2 allows a few roundings more, and stays below the
    # loss's own change over those steps (8% from ln V), which it must track.
    _, _, fp32 = _train(make(jax.random.key(0)), "fp32", 5, lr=1e-2)
    model, opt_state, bf16 = _train(make(jax.random.key(0)), "bf16", 5, lr=1e-2)
    np.testing.assert_allclose(bf16, fp32, rtol=1e-2)
    assert abs(fp32[-1] - fp32[0]) / fp32[0] > 5e-2
    assert _float_dtypes(model) == {jnp.dtype(jnp.float32)}
    assert _float_dtypes(opt_state) == {jnp.dtype(jnp.float32)}


@pytest.mark.slow
def test_bf16_step_hands_float32_gradients_close_to_fp32_ones_to_the_master_weights():
    # With SGD at learning rate 1 the update is minus the gradient, read off the params.
    model = GPT2(TINY, key=jax.random.key(0))
    params = eqx.filter(model, eqx.is_inexact_array)
    batch = {"ids": jnp.asarray(_counting(4))}

    def gradient(precision):
        optimizer = optax.sgd(1.0)
        step = rc.train_step(lm_loss, optimizer, precision=precision, jit=False)
        new, _, metrics = step(model, optimizer.init(params), batch, jax.random.key(0))
        return jax.tree.map(jnp.subtract, params, eqx.filter(new, eqx.is_inexact_array)), metrics

    (g32, m32), (g16, m16) = gradient("fp32"), gradient("bf16")
    assert _float_dtypes(g16) == {jnp.dtype(jnp.float32)}
    cos = float(optax.tree.vdot(g32, g16) / (optax.tree.norm(g32) * optax.tree.norm(g16)))
    assert cos > 0.999
    np.testing.assert_allclose(m16["grad_norm"], m32["grad_norm"], rtol=1e-2)
    assert m16["grad_norm"].dtype == jnp.float32


def test_pure_bf16_stores_and_trains_in_bfloat16():
    model = rc.cast(GPT2(TINY, key=jax.random.key(0)), jnp.bfloat16)
    assert _float_dtypes(model) == {jnp.dtype(jnp.bfloat16)}
    model, opt_state, losses = _train(model, "pure-bf16", 30, lr=1e-2)
    assert _float_dtypes(model) == {jnp.dtype(jnp.bfloat16)}
    assert _float_dtypes(opt_state) == {jnp.dtype(jnp.bfloat16)}
    assert losses[-3:].mean() < 0.5 * losses[:3].mean()


@pytest.mark.slow
def test_bf16_under_accumulation_and_shard_map_gives_the_jit_steps_numbers():
    # Accumulation and the shard_map path sum the bfloat16 gradients in other orders;
    # the float32 loss after two steps agrees to bfloat16 rounding.
    mesh = rc.make_mesh(1)
    optimizer = optax.adamw(3e-3)

    def run(**kwargs):
        model = GPT2(TINY, key=jax.random.key(0))
        opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        step = rc.train_step(lm_loss, optimizer, mesh=mesh, precision="bf16", **kwargs)
        for i in range(2):
            batch = {"ids": jnp.asarray(_counting(16, seed=i))}
            model, opt_state, metrics = step(model, opt_state, batch, jax.random.key(i))
        assert _float_dtypes(model) == {jnp.dtype(jnp.float32)}
        return float(metrics["loss"])

    plain = run()
    np.testing.assert_allclose(run(accumulate_grad_batches=2), plain, rtol=1e-2)
    np.testing.assert_allclose(run(data_parallel="shard_map"), plain, rtol=1e-2)


def test_policies_reject_parameters_of_the_wrong_dtype_and_unknown_names():
    model = GPT2(TINY, key=jax.random.key(0))
    batch = {"ids": jnp.asarray(_counting(2))}
    optimizer = optax.sgd(1e-3)
    key = jax.random.key(0)

    def run(m, precision):
        opt_state = optimizer.init(eqx.filter(m, eqx.is_inexact_array))
        rc.train_step(lm_loss, optimizer, precision=precision)(m, opt_state, batch, key)

    with pytest.raises(ValueError, match=r"pure-bf16.*embed_tokens\.weight is float32.*rc\.cast"):
        run(model, "pure-bf16")
    with pytest.raises(ValueError, match="precision='bf16' stores parameters in float32"):
        run(rc.cast(model, jnp.bfloat16), "bf16")
    unknown = r"'fp32', 'bf16', 'pure-bf16'.*got 'fp16'"
    with pytest.raises(ValueError, match=unknown):
        rc.train_step(lm_loss, optimizer, precision="fp16")
    with pytest.raises(ValueError, match=unknown):
        rc.eval_step(lm_loss, precision="fp16")
    with pytest.raises(ValueError, match=unknown):
        rc.predict_step(lm_loss, precision="fp16")


@pytest.mark.slow
def test_zoo_computes_norms_and_softmax_in_float32_and_returns_float32_logits():
    for model in (GPT2(TINY, key=jax.random.key(0)), Llama(TINY_LLAMA, key=jax.random.key(0))):
        half = rc.cast(model, jnp.bfloat16)
        ids = jnp.asarray(_counting(1)[0])
        logits = half(ids)
        assert logits.dtype == jnp.float32
        np.testing.assert_allclose(logits, model(ids), atol=0.1, rtol=0.1)
        # A norm of a bfloat16 input returns bfloat16, computed in float32: the same
        # numbers as the float32 norm of that input, rounded once.
        norm = half.norm
        x = jax.random.normal(jax.random.key(1), (32,)).astype(jnp.bfloat16)
        want = rc.cast(norm, jnp.float32)(x.astype(jnp.float32)).astype(jnp.bfloat16)
        assert norm(x).dtype == jnp.bfloat16
        np.testing.assert_array_equal(norm(x), want)


def test_eval_and_predict_steps_run_in_the_policy():
    model = GPT2(TINY, key=jax.random.key(0))
    batch = {"ids": jnp.asarray(_counting(4))}
    key = jax.random.key(0)
    fp32 = rc.eval_step(lm_loss)(model, batch, key)
    bf16 = rc.eval_step(lm_loss, precision="bf16")(model, batch, key)
    assert bf16["loss"].dtype == jnp.float32
    np.testing.assert_allclose(bf16["loss"], fp32["loss"], rtol=1e-2)
    assert float(bf16["loss"]) != float(fp32["loss"])  # it did compute in bfloat16

    def pred_fn(m, b, k):
        return jax.vmap(m)(b["ids"]), m.embed_tokens.weight[None].repeat(4, 0)

    logits, weight = rc.predict_step(pred_fn, precision="bf16")(model, batch, key)
    assert logits.dtype == jnp.float32 and weight.dtype == jnp.bfloat16


def _fit(precision, mesh, n_steps=4):
    examples = [{"ids": row} for row in _counting(64)]
    return rc.fit(
        GPT2(TINY, key=jax.random.key(0)),
        optax.adamw(1e-3),
        examples,
        collate_fn=lambda ex: {"ids": np.stack([e["ids"] for e in ex])},
        loss_fn=lm_loss,
        mesh=mesh,
        per_device_batch_size=4,
        max_steps=n_steps,
        log_every=1,
        progress=False,
        precision=precision,
        evaluation=rc.Evaluation(examples[:8]),
    )


@pytest.mark.slow
def test_fit_in_bf16_on_a_2x4_mesh_tracks_fp32():
    mesh = rc.make_mesh(4)
    fp32, bf16 = _fit("fp32", mesh), _fit("bf16", mesh)
    np.testing.assert_allclose(
        [r["loss"] for r in bf16.history["train"]],
        [r["loss"] for r in fp32.history["train"]],
        rtol=1e-2,
    )
    np.testing.assert_allclose(
        bf16.history["eval"][-1]["eval_loss"], fp32.history["eval"][-1]["eval_loss"], rtol=1e-2
    )
    assert _float_dtypes((bf16.model, bf16.opt_state)) == {jnp.dtype(jnp.float32)}
    logits = rc.predict(
        bf16.model,
        [{"ids": row} for row in _counting(8)],
        collate_fn=lambda ex: {"ids": np.stack([e["ids"] for e in ex])},
        pred_fn=lambda m, b, k: (
            jax.vmap(m)(b["ids"]),
            jnp.full(len(b["ids"]), m.blocks[0].attn.q_proj.weight[0, 0]),
        ),
        mesh=mesh,
        per_device_batch_size=2,
        precision="bf16",
    )
    assert logits[0][0].dtype == np.float32 and logits[0][1].dtype == jnp.bfloat16
    # The model is still split over the model axis.
    q = bf16.model.blocks[0].attn.q_proj.weight
    assert q.sharding.shard_shape(q.shape)[0] == q.shape[0] // 4


@pytest.mark.slow
def test_fit_in_pure_bf16_casts_the_model_once():
    result = _fit("pure-bf16", rc.make_mesh(2), n_steps=2)
    assert _float_dtypes((result.model, result.opt_state)) == {jnp.dtype(jnp.bfloat16)}
    assert np.isfinite([r["loss"] for r in result.history["train"]]).all()
