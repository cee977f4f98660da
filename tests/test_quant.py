"""A quantized frozen base: NF4 (QLoRA) and int8 Linears, under LoRA, sharded and resumed."""

import functools
import re

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy.stats import norm

import redcoast as rc
from redcoast.checkpoint._io import checkpoint_state
from redcoast.quant._formats import quantize_blockwise

# Dettmers et al. 2023 (QLoRA), Appendix E: the NF4 data type's 16 values.
PAPER_NF4 = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]


def _linear(n_in, n_out, *, std=1.0, seed=0, bias=False, dtype=jnp.float32):
    linear = eqx.nn.Linear(n_in, n_out, use_bias=bias, key=jax.random.key(seed))
    w = std * jax.random.normal(jax.random.key(seed + 1), (n_out, n_in))
    return eqx.tree_at(lambda m: m.weight, linear, w.astype(dtype))


# ----------------------------------------------------------------------------- faithful


def test_nf4_code_book_is_the_papers_and_its_construction():
    np.testing.assert_array_equal(rc.quant.NF4_CODE, np.array(PAPER_NF4, np.float32))
    # The paper's construction (bitsandbytes' create_normal_map): quantiles of N(0, 1)
    # at 8 and 7 evenly spaced probabilities, an exact zero, normalised to [-1, 1].
    offset = 0.9677083
    positive = norm.ppf(np.linspace(offset, 0.5, 9)[:-1])
    negative = -norm.ppf(np.linspace(offset, 0.5, 8)[:-1])
    values = np.sort(np.concatenate([positive, [0.0], negative]))
    np.testing.assert_allclose(rc.quant.NF4_CODE, values / values.max(), atol=1e-6)


def test_dynamic_code_has_bitsandbytes_shape():
    code = rc.quant.DYNAMIC_CODE
    assert code.shape == (256,) and code.dtype == np.float32
    assert len(np.unique(code)) == 256 and np.all(np.diff(code) > 0)
    assert code[-1] == 1.0 and 0.0 in code and code[0] > -1.0
    # Seven exponents: the smallest magnitude is 1e-6 times a fraction in (0.1, 1).
    assert 1e-7 < np.abs(code[code != 0]).min() < 1e-6


def _nearest(x, code):
    """Index of the nearest level, by brute force (no midpoints, no search)."""
    return np.abs(x[..., None] - code).argmin(-1).astype(np.uint8)


def _reference_nf4(w):
    """bitsandbytes' quantize_4bit(nf4, blocksize=64, compress_statistics=True), in NumPy:
    the weight flattened row-major, 64-blocks, then the absmaxes minus their mean in
    256-blocks of the 8-bit dynamic code."""
    flat = np.asarray(w, np.float32).reshape(-1, 64)
    absmax = np.abs(flat).max(1)
    idx = _nearest(flat / absmax[:, None], np.array(PAPER_NF4, np.float32)).reshape(-1)
    packed = (idx[0::2] << 4) | idx[1::2]
    offset = absmax.mean()
    centred = absmax - offset
    pad = -len(centred) % 256
    blocks = np.concatenate([centred, np.zeros(pad, np.float32)]).reshape(-1, 256)
    scale = np.abs(blocks).max(1)
    q = _nearest(blocks / scale[:, None], rc.quant.DYNAMIC_CODE).reshape(-1)[: len(centred)]
    return packed, q, scale, offset


def test_nf4_layout_equals_the_reference():
    # 24 rows of 1024: 384 absmaxes, so the last 256-block is partial.
    layer = rc.quant.quantized(_linear(1024, 24, std=0.02), "nf4")
    packed, q, scale, offset = _reference_nf4(_linear(1024, 24, std=0.02).weight)
    chex.assert_shape(layer.codes, (24, 512))
    chex.assert_shape(layer.absmax_codes, (24, 16))
    chex.assert_shape(layer.absmax_scale, (2,))
    assert layer.codes.dtype == jnp.uint8 and layer.absmax_codes.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(layer.codes).reshape(-1), packed)
    np.testing.assert_array_equal(np.asarray(layer.absmax_codes).reshape(-1), q)
    np.testing.assert_allclose(layer.absmax_scale, scale, rtol=1e-6)
    np.testing.assert_allclose(layer.offset, offset, rtol=1e-6)


def _pytorch_kernel(torch, op):
    """bitsandbytes' pure-PyTorch kernel of `op` (its `default` backend, registered as
    CompositeExplicitAutograd), called past the C kernel the `cpu` backend registers."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    return functools.partial(op.default.redispatch, keys)


def test_nf4_equals_bitsandbytes():
    torch = pytest.importorskip("torch")
    functional = pytest.importorskip("bitsandbytes.functional")
    ops = torch.ops.bitsandbytes
    # On CPU, quantize_4bit runs the PyTorch kernel (there is no other); its nested
    # quantize_blockwise runs a C kernel.
    cpu = torch._C.DispatchKey.CPU
    assert not ops.quantize_4bit.default.has_kernel_for_dispatch_key(cpu)
    assert ops.quantize_blockwise.default.has_kernel_for_dispatch_key(cpu)
    code = functional.create_dynamic_map()
    np.testing.assert_array_equal(rc.quant.DYNAMIC_CODE, code.numpy())
    # 8192 absmaxes in 32 second-level blocks: enough to see the C kernel's rate.
    linear = _linear(4096, 128, std=0.02)
    w = torch.from_numpy(np.array(linear.weight))
    q, state = functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    layer = rc.quant.quantized(linear, "nf4")
    np.testing.assert_array_equal(np.asarray(layer.codes).reshape(-1), q.numpy().reshape(-1))

    # The second level of bitsandbytes' own centred absmaxes, by its PyTorch kernel.
    _, absmax = ops.quantize_4bit.default(w, 64, "nf4", torch.uint8)
    centred = absmax - state.offset
    want, want_scale = _pytorch_kernel(torch, ops.quantize_blockwise)(centred, code, 256)
    got, got_scale = quantize_blockwise(
        jnp.asarray(centred.numpy()), rc.quant.DQ_BLOCK, rc.quant.DYNAMIC_CODE
    )
    np.testing.assert_array_equal(got, want.numpy())
    np.testing.assert_array_equal(got_scale, want_scale.numpy())
    # End to end only the offset differs: a float32 mean summed in another order.
    np.testing.assert_allclose(layer.offset, float(state.offset), rtol=5e-7)
    np.testing.assert_allclose(layer.absmax_scale, want_scale.numpy(), rtol=1e-6)
    assert np.mean(np.asarray(layer.absmax_codes).reshape(-1) != want.numpy()) < 1e-3

    # bitsandbytes decodes redcoast's arrays to the very same weight.
    state.absmax = torch.from_numpy(np.array(layer.absmax_codes).reshape(-1))
    state.state2.absmax = torch.from_numpy(np.array(layer.absmax_scale))
    state.offset = torch.tensor(np.asarray(layer.offset))
    theirs = functional.dequantize_4bit(q, state).numpy()
    np.testing.assert_array_equal(layer.dequantized().weight, theirs)

    # The C kernel: the same scales, and a code one level over in about 0.2% of blocks.
    c_codes, c_scale = functional.quantize_blockwise(centred, blocksize=256)
    np.testing.assert_array_equal(c_scale.absmax.numpy(), want_scale.numpy())
    steps = c_codes.numpy().astype(int) - want.numpy().astype(int)
    assert 0.0005 < np.mean(steps != 0) < 0.005 and np.abs(steps).max() == 1, steps


def test_round_trip_error_on_normal_weights():
    std = 0.02
    linear = _linear(1024, 256, std=std)
    w = np.asarray(linear.weight)
    nf4 = np.asarray(rc.quant.quantized(linear, "nf4").dequantized().weight)
    # Measured 0.0728 std; 4-bit absmax quantization on a uniform grid gives ~0.1 std.
    mae = np.abs(nf4 - w).mean() / std
    assert 0.06 < mae < 0.08, mae
    # No value further than half the widest gap between levels (-1 to -0.696) times its
    # block's absmax, plus the absmax's own error: within 1% after the second quantization
    # (measured: 0.85%, and 0.1556 x absmax at worst against 0.1519 + 0.01).
    half_gap = np.diff(rc.quant.NF4_CODE).max() / 2
    blocks = np.abs(w).reshape(256, 16, 64).max(-1, keepdims=True)
    assert np.all(np.abs(nf4 - w).reshape(256, 16, 64) <= (half_gap + 0.01) * blocks)
    int8 = rc.quant.quantized(linear, "int8")
    half_step = np.asarray(int8.scale)[:, None] / 2
    assert np.all(np.abs(np.asarray(int8.dequantized().weight) - w) <= half_step * (1 + 1e-5))


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_quantized_forward_equals_the_dequantized_weights_forward(fmt):
    layer = rc.quant.quantized(_linear(128, 96, std=0.05, bias=True), fmt)
    plain = layer.dequantized()
    x = jax.random.normal(jax.random.key(3), (2, 7, 128))
    got = eqx.filter_jit(rc.nn.dense)(layer, x)
    want = eqx.filter_jit(rc.nn.dense)(plain, x)
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)
    chex.assert_trees_all_close(jax.vmap(jax.vmap(layer))(x), want, atol=1e-5, rtol=0)
    # In bfloat16 the weight is decoded in bfloat16 and the matmul runs there.
    half = eqx.filter_jit(rc.nn.dense)(layer, x.astype(jnp.bfloat16))
    assert half.dtype == jnp.bfloat16
    chex.assert_trees_all_close(half.astype(jnp.float32), want, atol=0.05, rtol=0.02)


# ----------------------------------------------------------------------------- composes


class MLP(eqx.Module):
    inp: eqx.nn.Linear
    hidden: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.inp = eqx.nn.Linear(64, 128, key=k1)
        self.hidden = eqx.nn.Linear(128, 128, key=k2)
        self.out = eqx.nn.Linear(128, 2, key=k3)

    def __call__(self, x, *, key=None):
        return self.out(jax.nn.gelu(self.hidden(jax.nn.gelu(self.inp(x)))))


def _nonzero_b(model):
    def fill(x):
        if isinstance(x, rc.lora.LoRALinear):
            w = x.lora_b.weight
            return eqx.tree_at(
                lambda m: m.lora_b.weight,
                x,
                0.1 * jax.random.normal(jax.random.key(w.size), w.shape),
            )
        return x

    return jax.tree.map(fill, model, is_leaf=lambda x: isinstance(x, rc.lora.LoRALinear))


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_lora_wraps_a_quantized_base_trains_only_adapters_and_merges_back(fmt):
    model = MLP(key=jax.random.key(0))
    q = rc.quantize(model, ["inp", "hidden"], fmt)
    assert isinstance(q.inp, rc.quant.NF4Linear if fmt == "nf4" else rc.quant.Int8Linear)
    assert q.out is model.out
    lora = rc.lora.apply(q, ["inp", "hidden"], rank=4, key=jax.random.key(1))
    assert lora.inp.base is q.inp
    x = jax.random.normal(jax.random.key(2), (5, 64))
    chex.assert_trees_all_close(jax.vmap(lora)(x), jax.vmap(q)(x), rtol=1e-6)
    mask = rc.lora.trainable(lora)
    trained = [p for p, on in jax.tree_util.tree_leaves_with_path(mask) if on]
    assert len(trained) == 4 and all("lora_" in jax.tree_util.keystr(p) for p in trained)
    # The step's own mask leaves the codes and scales frozen with no filter at all.
    frozen = rc.trainable_mask(lora, None)
    assert not any(jax.tree.leaves(frozen.inp.base)) and frozen.out.weight
    lora = _nonzero_b(lora)
    merged = rc.lora.merge(lora)
    assert type(merged.inp) is eqx.nn.Linear and merged.inp.weight.dtype == jnp.float32
    chex.assert_trees_all_close(jax.vmap(merged)(x), jax.vmap(lora)(x), rtol=1e-5, atol=1e-5)
    assert not np.allclose(jax.vmap(lora)(x), jax.vmap(q)(x), atol=1e-3)


def test_bad_input_is_one_clear_error_each():
    model = MLP(key=jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"out has input dimension 100 \(weight \(2, 100\)\)"
    ) as info:
        rc.quantize(
            eqx.tree_at(lambda m: m.out, model, eqx.nn.Linear(100, 2, key=jax.random.key(0))), "out"
        )
    assert "not a multiple of NF4's block of 64" in str(info.value)
    with pytest.raises(ValueError, match="unknown quantization format 'nf3'"):
        rc.quantize(model, "inp", "nf3")  # type: ignore[arg-type]
    lora = rc.lora.apply(model, "inp", rank=2, key=jax.random.key(1))
    with pytest.raises(
        ValueError, match=r"\['inp'\] are wrapped by adapters .* whose arrays train"
    ):
        rc.quantize(lora, "inp")
    with pytest.raises(ValueError, match="already quantized"):
        rc.quantize(rc.quantize(model, "inp"), "inp")
    with pytest.raises(ValueError, match=r"target\(s\) \['q_proj'\] match no eqx.nn.Linear"):
        rc.quantize(model, "q_proj")
    with pytest.raises(ValueError, match=r"quantized Linears \['inp'\].* never train"):
        rc.trainable_mask(rc.quantize(model, "inp"), "inp.*")


def test_an_input_of_100_quantizes_to_int8():
    model = eqx.tree_at(
        lambda m: m.inp, MLP(key=jax.random.key(0)), eqx.nn.Linear(100, 128, key=jax.random.key(0))
    )
    q = rc.quantize(model, "inp", "int8")
    x = jnp.ones((3, 100))
    chex.assert_trees_all_close(jax.vmap(q)(x), jax.vmap(model)(x), rtol=0.05, atol=0.05)


# ----------------------------------------------------------------------------- the zoo

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 128, (8, 16)), jnp.int32)


def _llama(layers=2, scan_layers=True):
    config = rc.models.LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return rc.models.Llama(config, scan_layers=scan_layers, key=jax.random.key(0))


def _qlora(model, fmt="nf4"):
    q = rc.quantize(model, PROJECTIONS, fmt)
    return _nonzero_b(
        rc.lora.apply(q, ["q_proj", "v_proj", "down_proj"], rank=4, key=jax.random.key(1))
    )


def _compiled_step(model):
    mask = rc.lora.trainable(model)
    opt = optax.sgd(0.1)
    step = rc.train_step(rc.models.lm_loss, opt, trainable=mask)
    state = opt.init(eqx.filter(model, rc.trainable_mask(model, mask)))
    batch = {"input_ids": IDS[:2]}
    return step.lower(model, state, batch, jax.random.key(0)).compile().compiled


@pytest.mark.slow
def test_no_full_precision_weight_lives_in_the_compiled_step():
    layers = 6
    base = _llama(layers)
    plain = _compiled_step(
        _nonzero_b(
            rc.lora.apply(base, ["q_proj", "v_proj", "down_proj"], rank=4, key=jax.random.key(1))
        )
    )
    quant = _compiled_step(_qlora(base))
    stacked = re.compile(rf"\b(?:f32|bf16)\[{layers},(?:64|128|256),(?:128|256)\]")
    # The bf16/f32 base's stacked weights are parameters of its step; the NF4 base's
    # step holds no array of that shape anywhere: each layer's weight is decoded in
    # the scan's body, for its matmul, forward and backward.
    assert stacked.search(plain.as_text())
    assert not stacked.search(quant.as_text()), stacked.findall(quant.as_text())[:4]
    per_layer = 4 * sum(
        np.prod(leaf.shape[1:])
        for path, leaf in jax.tree_util.tree_leaves_with_path(eqx.filter(base, eqx.is_array))
        if any(p in jax.tree_util.keystr(path) for p in PROJECTIONS)
    )
    # The decoding's temporaries are one layer's, whatever XLA fuses: 3 more layers add
    # to them what they add to the plain step's (the activations kept for the backward
    # pass), within one layer's float32 weights; a kept decoded stack would add 3.

    def growth(make, large):
        small = make(_llama(layers // 2))
        return (
            large.memory_analysis().temp_size_in_bytes - small.memory_analysis().temp_size_in_bytes
        )

    lora = lambda m: _compiled_step(  # noqa: E731
        _nonzero_b(
            rc.lora.apply(m, ["q_proj", "v_proj", "down_proj"], rank=4, key=jax.random.key(1))
        )
    )
    extra = growth(lambda m: _compiled_step(_qlora(m)), quant) - growth(lora, plain)
    assert abs(extra) < per_layer, (extra, per_layer)
    assert (
        quant.memory_analysis().argument_size_in_bytes
        < 0.25 * plain.memory_analysis().argument_size_in_bytes
    )


def _step_once(model, mesh, fsdp):
    mask = rc.lora.trainable(model)
    model = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, model)
    if mesh is not None:
        model = rc.place(model, mesh, example_call=lambda m: jax.vmap(m)(IDS), fsdp=fsdp)
    opt = optax.sgd(0.5)
    step = rc.train_step(rc.models.lm_loss, opt, mesh=mesh, trainable=mask)
    opt_state = opt.init(eqx.filter(model, rc.trainable_mask(model, mask)))
    model, _, metrics = step(model, opt_state, {"input_ids": IDS}, jax.random.key(0))
    return model, metrics


# In `nox -s slow`; the user's MLP below is the fast sibling.
@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True])
def test_sharded_qlora_step_equals_one_device(fsdp):
    model = _qlora(_llama())
    want, want_metrics = _step_once(model, None, False)
    got, metrics = _step_once(model, rc.make_mesh(2), fsdp)
    chex.assert_trees_all_close(metrics["loss"], want_metrics["loss"], rtol=1e-5)
    chex.assert_trees_all_close(metrics["grad_norm"], want_metrics["grad_norm"], rtol=1e-5)
    mask = rc.lora.trainable(model)
    chex.assert_trees_all_close(
        jax.tree.leaves(eqx.filter(got, rc.trainable_mask(got, mask))),
        jax.tree.leaves(eqx.filter(want, mask)),
        rtol=1e-5,
        atol=1e-6,
    )
    q = got.blocks.attn.q_proj.base
    # Codes and block scales split as the weight: by output rows for Q, by input
    # columns (two blocks of 64 per row, one per shard) for down.
    assert tuple(q.codes.sharding.spec)[:2] == (None, "model")
    assert tuple(q.absmax_codes.sharding.spec)[:2] == (None, "model")
    down = got.blocks.mlp.down_proj.base
    assert tuple(down.codes.sharding.spec)[-1] == "model"
    assert tuple(down.absmax_codes.sharding.spec)[-1] == "model"
    chex.assert_trees_all_equal(
        np.asarray(q.codes), np.asarray(model.blocks.attn.q_proj.base.codes)
    )


def test_a_block_never_straddles_shards():
    # hidden reads 128 features, split on its input by the rules: two blocks of 64,
    # whole on 2 shards, kept whole (and said so) on 4; inp's rows split either way.
    model = rc.quantize(MLP(key=jax.random.key(0)), ["inp", "hidden"], "nf4")
    x = jnp.ones((2, 64))
    for n, hidden in ((2, (None, "model")), (4, ())):
        plan = rc.sharding_plan(model, n, example_call=lambda m: jax.vmap(m)(x))
        specs = {leaf.path: tuple(leaf.spec) for leaf in plan.leaves}
        assert specs["hidden.codes"] == hidden and specs["hidden.absmax_codes"] == hidden
        assert specs["inp.codes"] == specs["inp.absmax_codes"] == ("model",)
        assert specs["inp.absmax_scale"] == specs["inp.offset"] == ()
    assert any("hidden: input dimension 128 is 2 blocks of 64" in n for n in plan.notes)


def _mlp_step(model, mesh):
    x = jax.random.normal(jax.random.key(5), (16, 64))
    y = jnp.arange(16) % 2

    def loss_fn(m, batch, key):
        logits = jax.vmap(m)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    mask = rc.lora.trainable(model)
    model = jax.tree.map(lambda a: jnp.array(a, copy=True) if eqx.is_array(a) else a, model)
    if mesh is not None:
        model = rc.place(model, mesh, example_call=lambda m: jax.vmap(m)(x))
    opt = optax.sgd(0.5)
    step = rc.train_step(loss_fn, opt, mesh=mesh, trainable=mask)
    state = opt.init(eqx.filter(model, rc.trainable_mask(model, mask)))
    return step(model, state, {"x": x, "y": y}, jax.random.key(0))


def test_sharded_qlora_step_of_a_users_mlp_equals_one_device():
    model = rc.quantize(MLP(key=jax.random.key(0)), ["inp", "hidden"], "nf4")
    model = _nonzero_b(rc.lora.apply(model, ["inp", "hidden"], rank=4, key=jax.random.key(1)))
    want, _, want_metrics = _mlp_step(model, None)
    got, _, metrics = _mlp_step(model, rc.make_mesh(2))
    chex.assert_trees_all_close(metrics["loss"], want_metrics["loss"], rtol=1e-5)
    mask = rc.lora.trainable(model)
    chex.assert_trees_all_close(
        jax.tree.leaves(eqx.filter(got, rc.trainable_mask(got, mask))),
        jax.tree.leaves(eqx.filter(want, mask)),
        rtol=1e-5,
        atol=1e-6,
    )
    # inp is column-split (rows of 64 inputs: one block each), hidden row-split on its
    # 128 inputs: two blocks, one a shard.
    assert tuple(got.inp.base.codes.sharding.spec)[:1] == ("model",)
    assert tuple(got.hidden.base.codes.sharding.spec) == (None, "model")
    assert tuple(got.hidden.base.absmax_codes.sharding.spec) == (None, "model")


# ----------------------------------------------------------------------------- checkpoints


def _toy(n):
    x = np.random.default_rng(0).normal(size=(n, 64)).astype(np.float32)
    return [{"x": a, "y": int(a[0] * a[1] > 0)} for a in x]


def _collate(examples):
    return {"x": np.stack([e["x"] for e in examples]), "y": np.array([e["y"] for e in examples])}


def _loss(model, batch, key):
    logits = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _qlora_mlp(seed=0, fmt="nf4"):
    model = rc.quantize(MLP(key=jax.random.key(seed)), ["inp", "hidden"], fmt)
    return rc.lora.apply(model, ["inp", "hidden"], rank=4, key=jax.random.key(1))


def _fit(model, **kw):
    return rc.fit(
        model,
        optax.adamw(1e-2),
        _toy(64),
        collate_fn=_collate,
        loss_fn=_loss,
        per_device_batch_size=2,
        progress=False,
        trainable=rc.lora.trainable(model),
        **kw,
    )


def test_a_qlora_run_resumes_step_exactly_and_refuses_another_base(tmp_path):
    straight = _fit(_qlora_mlp(), max_steps=6)
    _fit(_qlora_mlp(), max_steps=3, workdir=tmp_path)
    state = checkpoint_state(tmp_path / "ckpts" / "step_00000003")
    # The checkpoint holds the adapters; the quantized base only as its fingerprint,
    # codes included (2 layers x 4 arrays + 3 biases + out's weight).
    assert sorted(state["checksums"]["model"]) == sorted(
        f"{layer}.lora_{ab}.weight" for layer in ("inp", "hidden") for ab in "ab"
    )
    assert state["loop"]["frozen"]["arrays"] == 12
    resumed = _fit(_qlora_mlp(), max_steps=6, workdir=tmp_path, resume=True)
    assert resumed.step == 6
    chex.assert_trees_all_equal(
        eqx.filter(resumed.model, eqx.is_array), eqx.filter(straight.model, eqx.is_array)
    )
    for other in (_qlora_mlp(seed=2), _qlora_mlp(fmt="int8")):
        with pytest.raises(ValueError, match="trained on another frozen base"):
            _fit(other, max_steps=6, workdir=tmp_path, resume=True)


# ----------------------------------------------------------------------------- from_hf


@pytest.mark.parametrize("scan_layers", [pytest.param(True, marks=pytest.mark.slow), False])
def test_from_hf_quantizes_each_layer_weight_as_it_is_read(tmp_path, scan_layers):
    model = _llama(scan_layers=scan_layers)
    model.to_hf(tmp_path)
    loaded = rc.models.from_hf(tmp_path, quantize="nf4", scan_layers=scan_layers)
    want = rc.quantize(model, PROJECTIONS, "nf4")
    # The head and the table stay as they were; every projection of the layers is NF4.
    assert type(loaded.lm_head) is eqx.nn.Linear
    found = [
        x
        for x in jax.tree.leaves(loaded, is_leaf=lambda x: isinstance(x, rc.quant.NF4Linear))
        if isinstance(x, rc.quant.NF4Linear)
    ]
    assert len(found) == len(PROJECTIONS) * (1 if scan_layers else 2)
    # (config.json adds its dtype to the config: compare the arrays.)
    chex.assert_trees_all_equal(
        jax.tree.leaves(eqx.filter(loaded, eqx.is_array)),
        jax.tree.leaves(eqx.filter(want, eqx.is_array)),
    )
    with pytest.raises(ValueError, match="unknown quantization format 'fp4'"):
        rc.models.from_hf(tmp_path, quantize="fp4")
    with pytest.raises(ValueError, match=r"are quantized; .* rc.quant.dequantize\(model\)"):
        loaded.to_hf(tmp_path / "out")
    rc.quant.dequantize(loaded).to_hf(tmp_path / "out")
    again = rc.models.from_hf(tmp_path / "out", scan_layers=scan_layers)
    chex.assert_trees_all_equal(
        jax.tree.leaves(eqx.filter(again, eqx.is_array)),
        jax.tree.leaves(eqx.filter(rc.quant.dequantize(loaded), eqx.is_array)),
    )


@pytest.mark.slow  # test_lora_wraps_a_quantized_base_... is the fast check of adapters on it
def test_a_peft_adapter_saved_from_a_quantized_base_loads_back_onto_it(tmp_path):
    base = rc.quantize(_llama(), PROJECTIONS, "nf4")
    tuned = _nonzero_b(rc.lora.apply(base, ["q_proj", "v_proj"], rank=4, key=jax.random.key(1)))
    rc.lora.save_peft(tuned, tmp_path)
    loaded = rc.lora.load_peft(base, tmp_path)
    assert isinstance(loaded.blocks.attn.q_proj.base, rc.quant.NF4Linear)
    logits = eqx.filter_jit(lambda m: jax.vmap(m)(IDS[:2]))
    np.testing.assert_array_equal(logits(loaded), logits(tuned))


@pytest.mark.slow  # from_hf without a mesh above is the fast sibling
def test_from_hf_quantized_onto_a_mesh_is_placed_as_the_rules_say(tmp_path):
    model = _llama()
    model.to_hf(tmp_path)
    mesh = rc.make_mesh(2)
    loaded = rc.models.from_hf(tmp_path, quantize="nf4", scan_layers=True, mesh=mesh)
    plan = rc.sharding_plan(
        rc.quantize(model, PROJECTIONS, "nf4"), 2, example_call=rc.models.Llama.trace_call
    )
    specs = {leaf.path: leaf.spec for leaf in plan.leaves}
    for path, leaf in jax.tree_util.tree_leaves_with_path(eqx.filter(loaded, eqx.is_array)):
        key = ".".join(str(getattr(k, "name", getattr(k, "idx", k))) for k in path)
        assert leaf.sharding.spec == specs[key], key
    down = loaded.blocks.mlp.down_proj
    assert tuple(down.codes.sharding.spec)[-1] == "model"


# ----------------------------------------------------------------------------- the planner


@pytest.mark.slow  # the CLI's refusal below is the fast sibling
def test_a_qlora_plan_counts_the_quantized_base():
    config = rc.models.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    plan = rc.memory_plan(
        config, devices=1, seq_len=16, max_batch=False, lora_rank=2, quantize="nf4"
    )
    assert "frozen weights nf4 (projections)" in str(plan)
    table_and_head = 256 * 256
    projections = plan.n_params - plan.n_trainable - 2 * table_and_head - 256 * 3  # the norms
    # The table and head in bfloat16, the projections in 4.13 bits, the adapters in fp32.
    adapters = 4 * plan.n_trainable
    want = 2 * (2 * table_and_head + 256 * 3) + projections * 4.127 / 8 + adapters
    # The weights the codes stand for, and the adapters.
    assert plan.n_params == 787_200 + plan.n_trainable
    assert abs(plan.params - want) < 0.02 * want, (plan.params, want)


def test_cli_refuses_a_quantized_plan_without_adapters():
    from click.testing import CliRunner

    from redcoast.cli import main

    bad = CliRunner().invoke(main, ["plan", "gpt2", "--quantize", "nf4"])
    assert bad.exit_code != 0 and "quantize need lora_rank > 0" in bad.output
    assert "Traceback" not in bad.output


def _stack_loss(layers, x):
    """A scanned stack of (quantized or plain) layers, each with a LoRA adapter."""
    params, static = eqx.partition(layers, eqx.is_array)

    def body(h, p):
        return jnp.tanh(rc.nn.dense(eqx.combine(p, static), h)), None

    return jnp.sum(jax.lax.scan(body, x, params)[0] ** 2)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_a_scanned_stack_decodes_one_layer_at_a_time(fmt):
    width = 256
    x = jax.random.normal(jax.random.key(1), (4, width))

    def compiled(n_layers, quantize):
        w = 0.05 * jax.random.normal(jax.random.key(0), (n_layers, width, width))
        base = eqx.tree_at(lambda m: m.weight, _linear(width, width), w)
        base = rc.quant.quantized(base, fmt) if quantize else base
        layers = rc.lora.apply(base, lambda *_: True, rank=2, key=jax.random.key(2))
        trained, frozen = eqx.partition(layers, rc.lora.trainable(layers))
        frozen, static = eqx.partition(frozen, eqx.is_array)
        grad = jax.grad(lambda t, f: _stack_loss(eqx.combine(t, f, static), x))
        return jax.jit(grad).lower(trained, frozen).compile()

    stacked = f"f32[8,{width},{width}]"
    assert stacked in compiled(8, False).as_text()  # the plain stack's weights, as parameters
    four, eight = compiled(4, True), compiled(8, True)
    # No decoded stack anywhere: each layer's weight is decoded in the loop's body, for
    # its matmul, forward and again backward, and never kept as a residual; so the
    # temporaries do not grow with the layers (a kept stack would add 4 x 256 kB).
    assert stacked not in eight.as_text()
    grown = eight.memory_analysis().temp_size_in_bytes - four.memory_analysis().temp_size_in_bytes
    assert grown < width * width * 4, grown


def test_bf16_compute_keeps_the_quantized_format():
    model = _qlora_mlp()
    half = rc.cast(model, jnp.bfloat16)
    assert half.inp.lora_a.weight.dtype == jnp.bfloat16
    chex.assert_trees_all_equal(half.inp.base, model.inp.base)  # codes and float32 scales
    x = jax.random.normal(jax.random.key(2), (5, 64))
    got = jax.vmap(half)(x.astype(jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    chex.assert_trees_all_close(got.astype(jnp.float32), jax.vmap(model)(x), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_the_weight_decodes_tile_by_tile_forward_and_backward(fmt, monkeypatch):
    n_out, n_in = 2048, 512
    layer = rc.quant.quantized(_linear(n_in, n_out, std=0.02), fmt)
    x = jax.random.normal(jax.random.key(1), (8, n_in))
    arrays, static = eqx.partition(layer, eqx.is_array)

    def grad_x(a, x):
        return jax.grad(lambda x: jnp.sum(eqx.combine(a, static).over_tokens(x) ** 2))(x)

    def run(f):  # a new function each time: traced again, with MAX_TILES as it is now
        compiled = jax.jit(lambda a, x: f(a, x)).lower(arrays, x).compile()
        return compiled(arrays, x), compiled.memory_analysis().temp_size_in_bytes

    forward = lambda a, x: eqx.combine(a, static).over_tokens(x)  # noqa: E731
    assert rc.quant._layers.tiles(n_out) == 16 and rc.quant._layers.tiles(96) == 1
    (y, y_temp), (g, g_temp) = run(forward), run(grad_x)
    # Beside the codes reordered into tiles, at most two decoded tiles of 128 rows: no
    # buffer of the decoded weight.
    weight = n_out * n_in * 4
    codes = sum(a.nbytes for a in jax.tree.leaves(arrays))
    bound = 2 * codes + 2 * weight // 16
    assert y_temp < bound < weight and g_temp < bound, (y_temp, g_temp, bound)
    monkeypatch.setattr(rc.quant._layers, "MAX_TILES", 1)  # decode whole: same numbers
    (y_whole, y_whole_temp), (g_whole, _) = run(forward), run(grad_x)
    assert y_whole_temp >= weight, y_whole_temp
    np.testing.assert_allclose(y, y_whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, g_whole, rtol=1e-5, atol=1e-6)
