"""ViT and the captioning model (ViT + GPT-2 with cross-attention) against transformers,
and split over devices by the sharding rules.

Each model is a tiny random `transformers` model saved with `save_pretrained`; redcoast
must reproduce its hidden states, logits, greedy and beam-search captions, and write
folders `transformers` reads back. Needs the `hf` extra (torch, transformers).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file
from tiny import drawn, megatron_specs

import redcoast as rc
from redcoast._tree_paths import path_str

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 40
LABELS = 4
RNG = np.random.default_rng(0)
PIXELS = RNG.normal(size=(3, 3, 16, 16)).astype(np.float32)
CAPTIONS = RNG.integers(3, VOCAB, (3, 7)).astype(np.int32)


def vit_config(**overrides: object) -> object:
    settings = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
    )
    return transformers.ViTConfig(**{**settings, **overrides})


def randomised(model: object) -> object:
    """Weights drawn larger than transformers' init (std 0.3, norms near 1), so that a
    wrong mapping shows and generated tokens vary."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():  # type: ignore[attr-defined]
            if p.ndim > 1:
                p.normal_(0.0, 0.3)
            elif ("ln" in name or "layernorm" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return model.eval()  # type: ignore[attr-defined]


def hf_captioner(decoder_width: int) -> object:
    """ViT (width 32) + GPT-2 (`decoder_width`; not 32: with `enc_to_dec_proj`)."""
    decoder = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=decoder_width,
        n_layer=2,
        n_head=4,
        add_cross_attention=True,
    )
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(
        vit_config(), decoder
    )
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 1, 0, 2
    return randomised(transformers.VisionEncoderDecoderModel(config=config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """name -> (save_pretrained folder, the transformers model), each made once."""
    made: dict[str, tuple[Path, object]] = {}

    def get(name: str) -> tuple[Path, object]:
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            if name == "vit":
                model = randomised(transformers.ViTModel(vit_config()))
            elif name == "vit-no-pooler":
                model = randomised(transformers.ViTModel(vit_config(), add_pooling_layer=False))
            elif name == "vit-classifier":
                model = transformers.ViTForImageClassification(vit_config(num_labels=LABELS))
                model = randomised(model)
            else:
                model = hf_captioner(24 if name == "projected" else 32)
            model.save_pretrained(folder)  # type: ignore[attr-defined]
            made[name] = (folder, model)
        return made[name]

    return get


def torch_vit(model: object, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        out = model(pixel_values=torch.tensor(pixels))  # type: ignore[operator]
    return out.last_hidden_state.numpy(), out.pooler_output.numpy()


def torch_logits(model: object, pixels: np.ndarray, captions: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(  # type: ignore[operator]
            pixel_values=torch.tensor(pixels), decoder_input_ids=torch.tensor(captions)
        ).logits.numpy()


@eqx.filter_jit
def forward(model: rc.models.VisionEncoderDecoder, pixels: jax.Array, captions: jax.Array):
    return jax.vmap(model)(pixels, captions)


# ----------------------------------------------------------------------------- ViT


def test_vit_equals_transformers_and_round_trips(checkpoints, tmp_path: Path) -> None:
    # Scanned layers: the stacked arrays are read from and written to per-layer tensors
    # (the captioner's tests below run the layers as a tuple).
    folder, hf = checkpoints("vit")
    hidden, pooled = torch_vit(hf, PIXELS)
    model = rc.models.from_hf(folder, scan_layers=True)
    assert isinstance(model, rc.models.ViT)
    assert not isinstance(model.blocks, tuple)
    got = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(model, jnp.asarray(PIXELS))
    assert got.shape == (3, 17, 32)  # the CLS token and 16 patches
    assert np.abs(np.asarray(got) - hidden).max() <= 1e-4
    got_pooled = jax.vmap(model.pooled.__func__, in_axes=(None, 0))(model, got)
    assert np.abs(np.asarray(got_pooled) - pooled).max() <= 1e-4
    model.to_hf(tmp_path)
    reloaded = transformers.ViTModel.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(torch_vit(reloaded, PIXELS)[0], hidden, rtol=0, atol=1e-6)
    assert set(load_file(tmp_path / "model.safetensors")) == set(
        load_file(folder / "model.safetensors")
    )


encode = eqx.filter_jit(lambda model, pixels: jax.vmap(model)(pixels))


def torch_hidden(model: object) -> np.ndarray:
    with torch.no_grad():
        return model(pixel_values=torch.tensor(PIXELS)).last_hidden_state.numpy()  # type: ignore[operator]


def test_a_vit_saved_without_its_pooler_loads_and_writes_none(checkpoints, tmp_path: Path) -> None:
    folder, hf = checkpoints("vit-no-pooler")
    model = rc.models.from_hf(folder)
    assert isinstance(model, rc.models.ViT) and model.pooler is None
    want = torch_hidden(hf)
    assert np.abs(np.asarray(encode(model, jnp.asarray(PIXELS))) - want).max() <= 1e-4
    with pytest.raises(ValueError, match="has no pooler"):
        model.pooled(jnp.zeros((17, 32)))
    # Written as transformers writes it: the same tensors, no pooler's; read back alike.
    model.to_hf(tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == set(
        load_file(folder / "model.safetensors")
    )
    assert rc.models.from_hf(tmp_path).pooler is None  # type: ignore[union-attr]
    back = transformers.ViTModel.from_pretrained(tmp_path, add_pooling_layer=False).eval()
    np.testing.assert_allclose(torch_hidden(back), want, rtol=0, atol=1e-6)


def test_vit_classifier_equals_transformers_round_trips_and_splits(
    checkpoints, tmp_path: Path
) -> None:
    folder, hf = checkpoints("vit-classifier")
    with torch.no_grad():
        want = hf(pixel_values=torch.tensor(PIXELS)).logits.numpy()  # type: ignore[operator]
    model = rc.models.from_hf(folder)
    assert isinstance(model, rc.models.ViTClassifier) and model.vit.pooler is None
    got = np.asarray(encode(model, jnp.asarray(PIXELS)))
    assert got.shape == (3, LABELS)
    assert np.abs(got - want).max() <= 1e-4
    model.to_hf(tmp_path)
    reloaded = transformers.AutoModelForImageClassification.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(hf)
    with torch.no_grad():
        again = reloaded(pixel_values=torch.tensor(PIXELS)).logits.numpy()
    np.testing.assert_allclose(again, want, rtol=0, atol=1e-6)
    assert set(load_file(tmp_path / "model.safetensors")) == set(
        load_file(folder / "model.safetensors")
    )
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["id2label"] == json.loads((folder / "config.json").read_text())["id2label"]
    # Split as the ViT is, the head by its classes as a vocabulary head is.
    plan = rc.sharding_plan(model, 2)
    got_layout, want_layout = layout(model, plan.specs), layout(model, megatron_specs(model, 2))
    head = {"classifier.weight": ("model", None), "classifier.bias": ("model",)}
    assert got_layout == {**want_layout, **head}


# ----------------------------------------------------------------------------- captioner


@pytest.mark.parametrize("name", ["projected", "same-width"])
def test_captioner_logits_equal_transformers(name: str, checkpoints, tmp_path: Path) -> None:
    folder, hf = checkpoints(name)
    want = torch_logits(hf, PIXELS, CAPTIONS)
    model = rc.models.from_hf(folder)
    assert isinstance(model, rc.models.VisionEncoderDecoder)
    assert (model.enc_to_dec_proj is None) == (name == "same-width")
    got = np.asarray(forward(model, jnp.asarray(PIXELS), jnp.asarray(CAPTIONS)))
    assert got.shape == (3, 7, VOCAB)
    assert np.abs(got - want).max() <= 1e-4
    # The captions depend on the image: another image gives other logits.
    other = np.asarray(forward(model, jnp.asarray(PIXELS[::-1]), jnp.asarray(CAPTIONS)))
    assert np.abs(other[0] - got[0]).max() > 1e-2

    model.to_hf(tmp_path)
    reloaded = transformers.VisionEncoderDecoderModel.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(torch_logits(reloaded, PIXELS, CAPTIONS), want, rtol=0, atol=1e-5)
    assert set(load_file(tmp_path / "model.safetensors")) == set(
        load_file(folder / "model.safetensors")
    )
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["encoder"]["model_type"], written["decoder"]["model_type"]) == ("vit", "gpt2")


def trim(row: list[int], eos: int) -> list[int]:
    """The tokens up to and including the first EOS (what follows is padding)."""
    return row[: row.index(eos) + 1] if eos in row else row


def hf_generate(hf: object, n: int, eos: int, num_beams: int) -> list[list[int]]:
    with torch.no_grad():
        out = hf.generate(  # type: ignore[attr-defined]
            pixel_values=torch.tensor(PIXELS),
            max_new_tokens=n,
            num_beams=num_beams,
            do_sample=False,
            eos_token_id=eos,
        )
    return [trim(row[1:], eos) for row in out.tolist()]  # without the decoder start token


# Each setting compiles its own decoding loop (about 8 s each here): `nox -s slow`.
@pytest.mark.slow
def test_greedy_and_beam_search_equal_transformers(checkpoints) -> None:
    folder, hf = checkpoints("projected")
    model = rc.models.from_hf(folder)
    n = 10
    # An EOS that a greedy caption reaches after its first step, so stopping is exercised.
    free = hf_generate(hf, n, VOCAB + 1, 1)
    eos = next(row[i] for row in free for i in range(1, n) if row[i] not in row[:i])
    outputs = []
    for num_beams in (1, 3):
        want = hf_generate(hf, n, eos, num_beams)
        got = rc.models.generate_seq2seq(
            model, PIXELS, max_new_tokens=n, num_beams=num_beams, eos_token_id=eos
        )
        assert np.asarray(got).shape == (3, n)
        assert [trim(row, eos) for row in np.asarray(got).tolist()] == want, num_beams
        outputs.append(want)
    assert any(eos in row for out in outputs for row in out)
    assert len({tuple(map(tuple, out)) for out in [free, *outputs]}) > 1


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_one_clear_error_each(checkpoints, tmp_path: Path) -> None:
    folder, _ = checkpoints("projected")
    model = rc.models.from_hf(folder)
    assert isinstance(model, rc.models.VisionEncoderDecoder)
    ids = jnp.asarray(CAPTIONS[0])
    with pytest.raises(ValueError, match=r"shape \(3, 32, 32\).*\(3, 16, 16\)"):
        model(jnp.zeros((3, 32, 32)), ids)
    with pytest.raises(ValueError, match=r"uint8.*floating-point pixels"):
        model(jnp.zeros((3, 16, 16), jnp.uint8), ids)
    with pytest.raises(ValueError, match="batch of images"):
        rc.models.generate_seq2seq(model, PIXELS[0], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"20 tokens.*16 positions"):
        model(jnp.asarray(PIXELS[0]), jnp.ones((20,), jnp.int32))
    with pytest.raises(ValueError, match=r"max_new_tokens=17.*16"):
        rc.models.generate_seq2seq(model, PIXELS, max_new_tokens=17)
    # A config that is not a ViT: a captioner whose encoder is another model, a ViT
    # loaded from a GPT-2 folder, a config of the wrong class.
    values = json.loads((folder / "config.json").read_text())
    values["encoder"]["model_type"] = "deit"
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match=r"encoder has model_type='deit'.*'vit'"):
        rc.models.from_hf(tmp_path)
    with pytest.raises(ValueError, match=r"model_type='vision-encoder-decoder'.*'vit'"):
        rc.models.ViT.from_hf(folder)
    gpt2 = rc.models.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4)
    # (At test time jaxtyping checks the annotations first; both errors name ViTConfig.)
    with pytest.raises(TypeError, match="ViTConfig"):
        rc.models.VisionEncoderDecoderConfig(encoder=gpt2, decoder=gpt2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ViTConfig"):
        rc.models.ViT(gpt2, key=jax.random.key(0))  # type: ignore[arg-type]
    # A head of the decoder's own, which the captioner (its logits from the token table)
    # cannot hold: stored beside the table, or asked for by the config.
    stored = tmp_path / "head"
    stored.mkdir()
    for f in folder.iterdir():
        (stored / f.name).write_bytes(f.read_bytes())
    tensors = load_file(stored / "model.safetensors")
    tensors["decoder.lm_head.weight"] = tensors["decoder.transformer.wte.weight"] + 1.0
    save_file(tensors, stored / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"ties 'decoder.lm_head.weight' to 'decoder.transformer"):
        rc.models.from_hf(stored)
    untied = dataclasses.replace(CONFIG.decoder, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        dataclasses.replace(CONFIG, decoder=untied)


# ----------------------------------------------------------------------------- sharding

CONFIG = rc.models.VisionEncoderDecoderConfig(
    encoder=rc.models.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
    ),
    decoder=rc.models.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=24, n_layer=2, n_head=4, add_cross_attention=True
    ),
    decoder_start_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
BATCH = {
    "pixel_values": jnp.asarray(RNG.normal(size=(8, 3, 16, 16)), jnp.float32),
    "caption": jnp.asarray(RNG.integers(0, 64, (8, 8)), jnp.int32),
}


@functools.cache
def build(scan_layers: bool = False) -> rc.models.VisionEncoderDecoder:
    return drawn(rc.models.VisionEncoderDecoder, CONFIG, scan_layers=scan_layers)  # type: ignore[return-value]


def loss_fn(model: rc.models.VisionEncoderDecoder, batch: dict, key: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(batch["pixel_values"], batch["caption"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["caption"][:, 1:]).mean()


def layout(model: eqx.Module, specs: object) -> dict[str, tuple]:
    """Path -> spec padded to the array's rank, so `P("model")` and `P("model", None)` agree."""
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))
    specs = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return {
        path_str(p): tuple(s) + (None,) * (a.ndim - len(s))
        for (p, a), s in zip(flat, specs, strict=True)
    }


@pytest.mark.parametrize("scan_layers", [False, True], ids=["loop", "scan"])
def test_sharding_rules_give_megatron_layout(scan_layers: bool) -> None:
    model = build(scan_layers)
    key = jax.random.key(0)
    plan = rc.sharding_plan(model, 2, example_call=lambda m: loss_fn(m, BATCH, key))
    got, want = layout(model, plan.specs), layout(model, megatron_specs(model, 2))
    assert got == want, {p: (got[p], want[p]) for p in got if got[p] != want[p]}
    # What that layout is, written out: heads and MLPs split in both stacks.
    column, row = ("model", None), (None, "model")
    stacked = (None,) if scan_layers else ()
    stacks = (("encoder.blocks.", ("attn",)), ("decoder_blocks.", ("attn", "cross_attn")))
    for stack, attentions in stacks:
        layer = stack if scan_layers else stack + "1."
        for attn in attentions:
            for proj in ("q_proj", "k_proj", "v_proj"):
                assert got[f"{layer}{attn}.{proj}.weight"] == (*stacked, *column), (layer, proj)
            assert got[f"{layer}{attn}.o_proj.weight"] == (*stacked, *row)
        assert got[layer + "mlp.fc_in.weight"] == (*stacked, *column)
        assert got[layer + "mlp.fc_out.weight"] == (*stacked, *row)
    # The stem and the projection into the decoder's cross-attention stay whole.
    assert got["encoder.patch_embed.weight"] == (None,) * 4
    assert got["enc_to_dec_proj.weight"] == (None, None)
    assert plan.bytes_per_device < 0.75 * plan.total_bytes


# Three compilations of the step, sharded, FSDP and not (about 45 s here): `nox -s slow`.
@pytest.mark.slow
def test_sharded_and_fsdp_train_steps_equal_one_device() -> None:
    model = build()
    key = jax.random.key(0)
    mesh = rc.make_mesh(2)  # 4 x 2
    specs = rc.sharding_plan(model, 2, example_call=lambda m: loss_fn(m, BATCH, key)).specs
    sharded = rc.place(model, mesh, specs=specs)
    optimizer = optax.sgd(0.5)
    step = eqx.filter_jit(rc.train_step(loss_fn, optimizer, jit=False))
    results = []
    for m, b in [(sharded, jax.device_put(BATCH, NamedSharding(mesh, P("data")))), (model, BATCH)]:
        state = optimizer.init(eqx.filter(m, eqx.is_inexact_array))
        results.append(step(m, state, b, key))
    (got, _, got_metrics), (want, _, want_metrics) = results
    np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(got_metrics["grad_norm"], want_metrics["grad_norm"], rtol=1e-5)
    chex.assert_trees_all_close(
        eqx.filter(got, eqx.is_array), eqx.filter(want, eqx.is_array), rtol=1e-5, atol=1e-6
    )
    # FSDP too: every weight split over the data axis as well, gathered where it is used.
    fsdp = rc.place(model, mesh, example_call=lambda m: loss_fn(m, BATCH, key), fsdp=True)
    assert any(
        "data" in jax.tree.leaves(tuple(leaf.sharding.spec))
        for leaf in jax.tree.leaves(eqx.filter(fsdp, eqx.is_array))
    )
    fsdp_step = rc.train_step(loss_fn, optimizer, mesh=mesh)
    state = optimizer.init(eqx.filter(fsdp, eqx.is_inexact_array))
    batch = jax.device_put(BATCH, NamedSharding(mesh, P("data")))
    _, _, metrics = fsdp_step(fsdp, state, batch, key)
    np.testing.assert_allclose(metrics["loss"], want_metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], want_metrics["grad_norm"], rtol=1e-5)


# The planner compiles the step (about 30 s here): `nox -s slow`.
@pytest.mark.slow
def test_the_planner_plans_the_captioner() -> None:
    plan = rc.memory_plan(CONFIG, devices=8, n_model_shards=2, seq_len=8, per_device_batch_size=2)
    key = jax.random.key(0)
    split = rc.sharding_plan(build(True), 2, example_call=lambda m: loss_fn(m, BATCH, key))
    assert (plan.layout.n_model_shards, plan.n_params * 4) == (2, split.total_bytes)
    assert plan.params == split.bytes_per_device < split.total_bytes
    assert plan.activations > 0
