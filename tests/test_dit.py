"""The text-conditioned DiT: its DDIM sampler is deterministic given a key, its prompt
tokens join the attention without their padding, the
sharding rules split it as a hand-written layout does (Megatron blocks, the timestep
MLP a column-row pair, adaLN modulations and the patch stem whole), images of the wrong
shape or dtype are refused, its FSDP step equals one device's, and the planner plans it."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc
from redcoast._tree_paths import path_str
from redcoast.models.dit import DiT, DiTConfig, ddim_sample, noise_prediction_loss
from redcoast.models.planning import sharding_plan_of

CONFIG = DiTConfig(
    image_size=8, patch_size=2, hidden_size=32, num_layers=2, num_heads=4, vocab_size=8
)
RNG = np.random.default_rng(0)
IMAGES = jnp.asarray(RNG.normal(size=(8, 3, 8, 8)), jnp.float32)
PROMPTS = jnp.asarray(RNG.integers(1, 8, (8, 2)), jnp.int32)


def trained_looking(config: DiTConfig = CONFIG) -> DiT:
    """A DiT whose arrays, the zero-initialised modulations and output too, are drawn on
    the host (compiling nothing), so that the predicted noise depends on the image, the
    step and the prompt."""
    skeleton = eqx.filter_eval_shape(DiT, config, key=jax.random.key(0))
    rng = np.random.default_rng(1)

    def draw(leaf: object) -> object:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        return jnp.asarray(rng.normal(0.0, 0.1, leaf.shape).astype(leaf.dtype))

    return jax.tree.map(draw, skeleton)


def test_ddim_sampler_is_deterministic_given_a_key() -> None:
    model = trained_looking()
    sample = eqx.filter_jit(lambda m, p, k: ddim_sample(m, p, k, steps=4))
    first = sample(model, PROMPTS[:3], jax.random.key(0))
    assert first.shape == (3, 3, 8, 8) and bool(jnp.all(jnp.isfinite(first)))
    np.testing.assert_array_equal(first, sample(model, PROMPTS[:3], jax.random.key(0)))
    assert float(jnp.abs(first - sample(model, PROMPTS[:3], jax.random.key(1))).max()) > 1e-3
    # The prompt steers the sample: other words, another image from the same noise.
    other = sample(model, PROMPTS[3:6], jax.random.key(0))
    assert float(jnp.abs(first - other).max()) > 1e-3


def test_prompt_tokens_join_the_attention_and_their_padding_is_never_read() -> None:
    model = trained_looking()
    in_context = trained_looking(dataclasses.replace(CONFIG, prompt_tokens=True))  # same arrays
    image, t = IMAGES[0], jnp.array(7)
    predict = eqx.filter_jit(lambda m, p: m(image, t, p))
    words = jnp.array([4, 0, 6], jnp.int32)  # padding in the middle and none at the end
    padded = jnp.array([4, 0, 6, 0, 0], jnp.int32)
    np.testing.assert_allclose(
        predict(in_context, words), predict(in_context, padded), rtol=1e-5, atol=1e-6
    )
    # Each word is read, not only their mean (which adaLN reads either way).
    assert float(jnp.abs(predict(in_context, words) - predict(model, words)).max()) > 1e-3


def test_sharding_rules_split_the_dit_as_its_hand_layout() -> None:
    model = trained_looking()
    key = jax.random.key(0)
    plan = rc.sharding_plan(
        model, 2, example_call=lambda m: noise_prediction_loss(m, IMAGES, PROMPTS, key)
    )
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))
    specs = jax.tree_util.tree_leaves(plan.specs, is_leaf=lambda x: isinstance(x, P))
    got = {path_str(p): tuple(s) for (p, _), s in zip(flat, specs, strict=True)}
    column, row = ("model", None), (None, "model")
    for layer in ("blocks.0.", "blocks.1."):
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert got[f"{layer}attn.{proj}.weight"] == column
        assert got[layer + "attn.o_proj.weight"] == row
        assert (got[layer + "mlp.fc_in.weight"], got[layer + "mlp.fc_out.weight"]) == (column, row)
        assert got[layer + "modulation.weight"] == ()  # it scales and shifts: whole
    assert (got["time_in.weight"], got["time_out.weight"]) == (column, row)
    assert got["patch_embed.weight"] == got["final_modulation.weight"] == ()


@pytest.mark.parametrize(
    ("images", "message"),
    [
        (IMAGES[:, :, :4], r"shape \(8, 3, 4, 8\).*\(batch, 3, 8, 8\)"),
        (jnp.moveaxis(IMAGES, 1, -1), r"shape \(8, 8, 8, 3\).*channels first"),
        (IMAGES[0], r"shape \(3, 8, 8\).*\(batch, 3, 8, 8\)"),
        (IMAGES.astype(jnp.int32), "dtype int32; pass floating-point pixels"),
    ],
)
def test_images_of_the_wrong_shape_or_dtype_are_refused(images, message) -> None:
    model = trained_looking()
    with pytest.raises(ValueError, match=message):
        noise_prediction_loss(model, images, PROMPTS, jax.random.key(0))
    one = images if images.ndim == 3 else images[0]
    if one.shape != (3, 8, 8) or one.dtype != jnp.float32:
        with pytest.raises(ValueError, match="DiT: images of"):
            model(one, jnp.array(3), PROMPTS[0])


def _loss_fn(model: DiT, batch: dict, key: jax.Array) -> jax.Array:
    return noise_prediction_loss(model, batch["images"], batch["prompts"], key)


# Two compilations of the step on 8 simulated devices (several seconds): `nox -s slow`.
@pytest.mark.slow
def test_fsdp_train_step_equals_one_device() -> None:
    model, key = trained_looking(), jax.random.key(0)
    batch = {"images": IMAGES, "prompts": PROMPTS}
    optimizer = optax.sgd(0.5)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    _, _, want = eqx.filter_jit(rc.train_step(_loss_fn, optimizer, jit=False))(
        model, state, batch, key
    )
    mesh = rc.make_mesh(2)  # 4 x 2
    fsdp = rc.place(model, mesh, example_call=lambda m: _loss_fn(m, batch, key), fsdp=True)
    axes = [jax.tree.leaves(tuple(leaf.sharding.spec)) for leaf in jax.tree.leaves(fsdp)]
    assert any("data" in names for names in axes) and any("model" in names for names in axes)
    state = optimizer.init(eqx.filter(fsdp, eqx.is_inexact_array))
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    _, _, got = rc.train_step(_loss_fn, optimizer, mesh=mesh)(fsdp, state, sharded, key)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-5)


# The planner compiles the step (several seconds): `nox -s slow`.
@pytest.mark.slow
def test_the_planner_plans_the_dit() -> None:
    plan = rc.memory_plan(CONFIG, devices=8, n_model_shards=2, seq_len=2, per_device_batch_size=2)
    split = sharding_plan_of(CONFIG, plan.layout)
    assert (
        split.total_bytes
        == plan.n_params * 4
        == 4
        * sum(leaf.size for leaf in jax.tree.leaves(eqx.filter(trained_looking(), eqx.is_array)))
    )
    assert plan.layout.n_model_shards == 2
    assert plan.params == split.bytes_per_device < split.total_bytes
    assert plan.activations > 0 and "DiT" in str(plan)
    with pytest.raises(ValueError, match="the DiT's sequence is its image's patches"):
        rc.memory_plan(CONFIG, devices=8, n_model_shards=2, seq_len=8, context_parallel=True)
