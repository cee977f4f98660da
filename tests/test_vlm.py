"""Vision-language models: CLIP's and SigLIP's towers and LLaVA equal `transformers` on
the same weights (logits, hidden states, greedy generation with images, checkpoints
both ways), split by the rules, and trained sharded as on one device."""

import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import redcoast as rc
from redcoast._tree_paths import path_str

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RNG = np.random.default_rng(0)
SIZES = dict(
    hidden_size=32, intermediate_size=64, num_attention_heads=4, image_size=16, patch_size=4
)
IMAGE = 99  # the image token of the decoders' 100-token vocabulary


def hf_tower(kind: str, **changes: Any) -> Any:
    """A tiny `transformers` vision config: CLIP's or SigLIP's."""
    if kind == "clip":
        return transformers.CLIPVisionConfig(num_hidden_layers=3, **SIZES, **changes)
    return transformers.SiglipVisionConfig(num_hidden_layers=3, **SIZES, **changes)


def hf_decoder(kind: str) -> Any:
    """A tiny decoder config with 100 tokens: Llama's (its own head) or Qwen 2's (tied)."""
    common = dict(
        vocab_size=100,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    return transformers.Qwen2Config(**common, tie_word_embeddings=True)


LLAVAS = {
    # LLaVA-1.5's choices: the second-to-last layer, the class token dropped.
    "clip-llama": dict(tower="clip", decoder="llama"),
    # Two feature layers concatenated, every state kept, a projector without biases.
    "siglip-qwen2": dict(
        tower="siglip",
        decoder="qwen2",
        vision_feature_layer=[-1, 1],
        vision_feature_select_strategy="full",
        multimodal_projector_bias=False,
    ),
}


def randomised(model: Any) -> Any:
    """`model` with every parameter moved off its initial value (norms are not 1 and 0)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """name -> (folder, the `transformers` model it holds), made once."""
    made: dict[str, tuple[Path, Any]] = {}

    def get(name: str) -> tuple[Path, Any]:
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            if name in ("clip", "siglip"):
                cls = (
                    transformers.CLIPVisionModel
                    if name == "clip"
                    else transformers.SiglipVisionModel
                )
                model = cls(hf_tower(name))
            else:
                spec = dict(LLAVAS[name])
                config = transformers.LlavaConfig(
                    vision_config=hf_tower(spec.pop("tower")),
                    text_config=hf_decoder(spec.pop("decoder")),
                    image_token_id=IMAGE,
                    **spec,
                )
                model = transformers.LlavaForConditionalGeneration(config)
            randomised(model).save_pretrained(folder)
            made[name] = folder, model
        return made[name]

    return get


PIXELS = RNG.normal(size=(2, 3, 16, 16)).astype(np.float32)


def torch_states(model: Any, pixels: np.ndarray) -> Any:
    with torch.no_grad():
        return model(torch.tensor(pixels), output_hidden_states=True)


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_towers_equal_transformers_at_every_layer_and_round_trip(
    checkpoints, name, tmp_path
) -> None:
    folder, theirs = checkpoints(name)
    ours = rc.models.from_hf(folder)
    assert isinstance(ours, rc.models.CLIPVision if name == "clip" else rc.models.SiglipVision)
    want = torch_states(theirs, PIXELS)
    pixels = jnp.asarray(PIXELS)
    np.testing.assert_allclose(jax.vmap(ours)(pixels), want.last_hidden_state.numpy(), atol=1e-5)
    pooled = jax.vmap(lambda p: ours.pooled(ours(p)))(pixels)  # CLIP's class token, SigLIP's head
    np.testing.assert_allclose(pooled, want.pooler_output.numpy(), atol=1e-5)
    layers = [0, 1, -2, 3]
    got = jax.vmap(lambda p: ours.hidden_states(p, layers))(pixels)
    for i, g in zip(layers, got, strict=True):
        np.testing.assert_allclose(g, want.hidden_states[i].numpy(), atol=1e-5, err_msg=str(i))
    # Written back, transformers reads the same weights; a checkpoint of transformers 4
    # (the tower under `vision_model.`) loads alike.
    ours.to_hf(tmp_path / "back")
    back = type(theirs).from_pretrained(tmp_path / "back")
    for key, value in theirs.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[key].numpy(), value.numpy(), err_msg=key)
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    save_file({f"vision_model.{k}": v for k, v in tensors.items()}, old / "model.safetensors")
    np.testing.assert_array_equal(jax.vmap(rc.models.from_hf(old))(pixels), jax.vmap(ours)(pixels))


def prompts(config: Any, rows: int = 2, length: int = 28) -> np.ndarray:
    """Token ids with one image's placeholders after two text tokens."""
    ids = RNG.integers(3, IMAGE, size=(rows, length))
    ids[:, 2 : 2 + config.image_tokens] = IMAGE
    return ids


def torch_logits(model: Any, ids: np.ndarray, pixels: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), pixel_values=torch.tensor(pixels)).logits.numpy()


@pytest.mark.parametrize("name", list(LLAVAS))
def test_llava_equals_transformers_generates_alike_and_round_trips(
    checkpoints, name, tmp_path
) -> None:
    folder, theirs = checkpoints(name)
    ours = rc.models.from_hf(folder)
    assert isinstance(ours, rc.models.Llava)
    ids = prompts(ours.config)
    pixels = PIXELS[:, None]  # one image per row
    got = jax.vmap(ours)(jnp.asarray(ids), jnp.asarray(pixels))
    np.testing.assert_allclose(got, torch_logits(theirs, ids, PIXELS), atol=1e-4)
    # Greedy generation from the images, against transformers' generate.
    with torch.no_grad():
        want = theirs.generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.ones(ids.shape, dtype=torch.long),
            pixel_values=torch.tensor(PIXELS),
            max_new_tokens=6,
            do_sample=False,
        )[:, ids.shape[1] :].numpy()
    new = rc.sampling.generate(
        ours,
        jnp.asarray(ids),
        max_new_tokens=6,
        prompt_inputs={"pixel_values": jnp.asarray(pixels)},
    )
    np.testing.assert_array_equal(np.asarray(new), want)
    ours.to_hf(tmp_path / "back")
    back = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "back")
    for key, value in theirs.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[key].numpy(), value.numpy(), err_msg=key)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "llava"


# The names a LLaVA's tensors have had: transformers 4's hub checkpoints
# (llava-hf/llava-1.5-7b-hf) and transformers 5's own modules.
RENAMES = {
    "hub": [
        ("vision_tower.", "vision_tower.vision_model."),
    ],
    "modules": [
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
    ],
}


@pytest.mark.parametrize("spelling", list(RENAMES))
def test_llava_checkpoints_of_each_spelling_load_alike(checkpoints, spelling, tmp_path) -> None:
    folder, theirs = checkpoints("clip-llama")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    renamed = {}
    for key, value in load_file(folder / "model.safetensors").items():
        for old, new in RENAMES[spelling]:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        renamed[key] = value
    save_file(renamed, tmp_path / "model.safetensors")
    ours = rc.models.from_hf(tmp_path)
    ids = prompts(ours.config)
    got = jax.vmap(ours)(jnp.asarray(ids), jnp.asarray(PIXELS[:, None]))
    np.testing.assert_allclose(got, torch_logits(theirs, ids, PIXELS), atol=1e-4)


def test_bad_images_and_image_tokens_are_clear_errors(checkpoints) -> None:
    folder, _ = checkpoints("clip-llama")
    model = rc.models.from_hf(folder)
    ids = prompts(model.config)[0]
    # (Under the tests' jaxtyping hook the annotation refuses it first.)
    with pytest.raises((ValueError, TypeError), match="pixel_values"):
        model(jnp.asarray(ids), jnp.asarray(PIXELS[0]))
    with pytest.raises(ValueError, match="floating-point pixels"):
        model(jnp.asarray(ids), jnp.zeros((1, 3, 16, 16), jnp.uint8))
    short = ids.copy()
    short[2] = 5  # one placeholder fewer than the image's 16 features
    with pytest.raises(Exception, match="16 features each"):
        jax.block_until_ready(model(jnp.asarray(short), jnp.asarray(PIXELS[:1])))
    config = model.config
    with pytest.raises(ValueError, match="image_token_index=100 is not a token"):
        rc.models.LlavaConfig(
            vision_config=config.vision_config,
            text_config=config.text_config,
            image_token_index=100,
        )
    with pytest.raises(ValueError, match="vision_feature_layer 9"):
        rc.models.LlavaConfig(
            vision_config=config.vision_config,
            text_config=config.text_config,
            image_token_index=IMAGE,
            vision_feature_layer=9,
        )


def small_llava(**changes: Any) -> rc.models.Llava:
    config = rc.models.LlavaConfig(
        vision_config=rc.models.CLIPVisionConfig(num_hidden_layers=2, **SIZES),
        text_config=rc.models.LlamaConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        image_token_index=IMAGE,
        **changes,
    )
    return rc.models.Llava(config, key=jax.random.key(0))


def layout(model: Any, specs: Any) -> dict[str, tuple]:
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))
    leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return {
        path_str(p): tuple(s) + (None,) * (a.ndim - len(s))
        for (p, a), s in zip(flat, leaves, strict=True)
    }


def test_the_rules_split_the_tower_the_projector_and_the_decoder_as_megatron_does() -> None:
    model = small_llava()
    got = layout(model, rc.sharding_plan(model, 2, example_call=rc.models.Llava.trace_call).specs)
    column, row = ("model", None), (None, "model")
    for part, names in (
        ("vision_tower.blocks.0.", ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in")),
        (
            "language_model.blocks.1.",
            ("attn.q_proj", "attn.k_proj", "mlp.gate_proj", "mlp.up_proj"),
        ),
        ("projector.", ("linear_1",)),
    ):
        for name in names:
            assert got[f"{part}{name}.weight"] == column, (part, name)
    for name in ("vision_tower.blocks.0.attn.o_proj", "vision_tower.blocks.0.mlp.fc_out"):
        assert got[f"{name}.weight"] == row, name
    assert got["projector.linear_2.weight"] == row
    assert got["language_model.blocks.1.mlp.down_proj.weight"] == row
    assert got["vision_tower.patch_embed.weight"] == (None,) * 4


def vlm_loss(model: rc.models.Llava, batch: dict, key: jax.Array) -> jax.Array:
    del key
    logits = jax.vmap(model)(batch["ids"][:, :-1], batch["pixel_values"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()


# Four compilations of the step, about 50 s here: `nox -s slow`.
@pytest.mark.slow
def test_sharded_fsdp_and_sequence_parallel_steps_with_the_tower_frozen_equal_one_device() -> None:
    model = small_llava(vision_feature_layer=-1)
    ids = np.stack([prompts(model.config, 1, 24)[0] for _ in range(8)])
    batch = {
        "ids": jnp.asarray(ids),
        "pixel_values": jnp.asarray(RNG.normal(size=(8, 1, 3, 16, 16)), jnp.float32),
    }
    key = jax.random.key(0)
    trainable = ["projector.*", "language_model.*"]
    optimizer = optax.sgd(0.5)

    def run(mesh: Any, fsdp: bool = False, sp: bool = False) -> tuple[Any, float]:
        m, b = small_llava(vision_feature_layer=-1), batch  # the step donates the model
        options = {}
        if mesh is not None:
            m = rc.place(m, mesh, example_call=lambda x: vlm_loss(x, batch, key), fsdp=fsdp)
            b = jax.device_put(batch, NamedSharding(mesh, P("data")))
            if sp:  # the decoder's activations split over the model axis between blocks
                options["sequence_parallel"] = rc.SequenceParallel.of(m)
        state = optimizer.init(eqx.filter(m, rc.trainable_mask(m, trainable)))
        step = rc.train_step(vlm_loss, optimizer, trainable=trainable, mesh=mesh, **options)
        m, _, metrics = step(m, state, b, key)
        return m, float(metrics["loss"])

    want, want_loss = run(None)
    for split in ({}, {"fsdp": True}, {"sp": True}):
        got, loss = run(rc.make_mesh(2), **split)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        for g, w in zip(
            jax.tree.leaves(eqx.filter(got, eqx.is_array)),
            jax.tree.leaves(eqx.filter(want, eqx.is_array)),
            strict=True,
        ):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    # The tower did not move; the decoder did.
    start = small_llava(vision_feature_layer=-1)
    np.testing.assert_array_equal(want.vision_tower.positions, start.vision_tower.positions)
    assert not np.allclose(want.language_model.norm.weight, start.language_model.norm.weight)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")  # PEFT's
def test_a_peft_adapter_on_the_decoder_round_trips_with_its_logits(checkpoints, tmp_path) -> None:
    peft = pytest.importorskip("peft")
    folder, theirs = checkpoints("clip-llama")
    targets = [f"language_model.blocks.*.attn.{p}" for p in ("q_proj", "v_proj")]
    ours = rc.lora.apply(rc.models.from_hf(folder), targets, rank=4, alpha=8, key=jax.random.key(1))
    ours = jax.tree.map(
        lambda x: (
            eqx.tree_at(lambda m: m.lora_b.weight, x, 0.2 * jnp.ones_like(x.lora_b.weight))
            if isinstance(x, rc.lora.LoRALinear)
            else x
        ),
        ours,
        is_leaf=lambda x: isinstance(x, rc.lora.LoRALinear),
    )
    rc.lora.save_peft(ours, tmp_path / "adapter")
    ids = prompts(ours.config)
    got = np.asarray(jax.vmap(ours)(jnp.asarray(ids), jnp.asarray(PIXELS[:, None])))
    base = torch_logits(theirs, ids, PIXELS)
    adapted = peft.PeftModel.from_pretrained(theirs, tmp_path / "adapter").eval()
    try:
        np.testing.assert_allclose(got, torch_logits(adapted, ids, PIXELS), atol=1e-4)
        assert np.abs(got - base).max() > 1e-3  # the adapters change the logits
    finally:
        adapted.unload()
    back = rc.lora.load_peft(rc.models.from_hf(folder), tmp_path / "adapter")
    np.testing.assert_allclose(
        jax.vmap(back)(jnp.asarray(ids), jnp.asarray(PIXELS[:, None])), got, atol=1e-5
    )


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "own-head"])
def test_a_decoder_given_new_tokens_keeps_its_logits_and_starts_them_at_the_mean(tied) -> None:
    config = rc.models.LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    model = rc.models.Llama(config, key=jax.random.key(0))
    grown = model.with_vocab_size(52)
    assert grown.config.vocab_size == grown.vocab_size == 52 and model.vocab_size == 50
    ids = jnp.arange(40)
    np.testing.assert_allclose(grown(ids)[:, :50], model(ids), atol=1e-5)
    table = model.embed_tokens.weight
    np.testing.assert_allclose(
        grown.embed_tokens.weight[50:], np.tile(table.mean(0), (2, 1)), atol=1e-6
    )
    assert grown(jnp.array([51, 3])).shape == (2, 52)  # the new ids are tokens now
    shrunk = model.with_vocab_size(30)
    np.testing.assert_allclose(shrunk(ids[:30]), model(ids[:30])[:, :30], atol=1e-5)
    llava = small_llava().with_vocab_size(101)
    assert llava.config.text_config.vocab_size == llava.vocab_size == 101


@pytest.mark.slow
def test_the_planner_plans_a_llava_and_refuses_rows_without_room_for_text() -> None:
    config = small_llava().config
    plan = rc.memory_plan(config, devices=8, n_model_shards=2, seq_len=24, max_batch=False)
    assert plan.fits is not False and plan.n_params == sum(
        x.size for x in jax.tree.leaves(eqx.filter(small_llava(), eqx.is_array))
    )
    with pytest.raises(ValueError, match="leaves no text beside an image's 16 tokens"):
        rc.memory_plan(config, devices=8, n_model_shards=2, seq_len=16, max_batch=False)
    with pytest.raises(ValueError, match="which reads images"):
        rc.memory_plan(config, devices=8, n_model_shards=2, seq_len=24, rl="grpo")


@pytest.mark.slow
def test_qlora_on_the_decoder_trains_the_adapters_alone(checkpoints) -> None:
    folder, _ = checkpoints("clip-llama")
    base = rc.models.from_hf(folder, quantize="int8")  # every layer's Linear, the tower's too
    targets = [f"language_model.blocks.*.attn.{p}" for p in ("q_proj", "v_proj")]
    model = rc.lora.apply(base, targets, rank=4, alpha=8, key=jax.random.key(1))
    ids = prompts(model.config, 8, 24)
    batch = {"ids": jnp.asarray(ids), "pixel_values": jnp.asarray(PIXELS[np.arange(8) % 2, None])}
    trainable = rc.lora.trainable(model)
    optimizer = optax.adam(1e-2)
    state = optimizer.init(eqx.filter(model, rc.trainable_mask(model, trainable)))
    step = rc.train_step(vlm_loss, optimizer, trainable=trainable)
    losses = []
    for i in range(3):
        model, state, metrics = step(model, state, batch, jax.random.key(i))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    merged = rc.lora.merge(model)  # the adapters folded into dequantized weights
    np.testing.assert_allclose(
        jax.vmap(merged)(batch["ids"], batch["pixel_values"]),
        jax.vmap(model)(batch["ids"], batch["pixel_values"]),
        atol=1e-4,
    )
