"""Gemma 3 with images (`Gemma3VL`) against transformers' `Gemma3ForConditionalGeneration`.

A tiny random model (a SigLIP tower of 4 x 4 patches pooled to 2 x 2 soft tokens, a
Gemma 3 decoder of a local and a global layer whose window of 3 is shorter than an
image) saved with `save_pretrained`: redcoast must give its logits, the image tokens
attending to each other both ways, and its greedy tokens from images, and write back
its tensors bit for bit. Needs the `hf` extra.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tiny import drawn

import redcoast as rc
from redcoast.models.gemma3_vision import image_groups

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, IMAGE, BOI, EOI = 128, 120, 121, 122
TOKENS = 4  # soft tokens per image
WINDOW = 3  # shorter than an image's tokens and than the sequences
IMAGE_IDS = [BOI, *[IMAGE] * TOKENS, EOI]
IDS = np.array(
    [
        [2, 5, *IMAGE_IDS, 7, 8, 9, 10],
        [2, *IMAGE_IDS, 11, 12, 13, 14, 15],
    ],
    np.int32,
)
PIXELS = np.random.default_rng(0).normal(size=(2, 1, 3, 16, 16)).astype(np.float32)


def hf_config(tied: bool) -> Any:
    t = transformers
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
    }
    text = t.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        sliding_window=WINDOW,
        sliding_window_pattern=2,
        query_pre_attn_scalar=12,
        rope_parameters=rope,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    # A tower narrower than the decoder: a projection mapped the wrong way round shows.
    vision = t.SiglipVisionConfig(
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
        vision_use_head=False,
    )
    return t.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS,
        image_token_index=IMAGE,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        tie_word_embeddings=tied,
    )


def random_hf_model(tied: bool) -> Any:
    """Every weight drawn (transformers zeroes the projection): the decoder's matrices
    larger than transformers' init, so that a wrong mapping shows and greedy tokens
    vary, the tower's and projection's by their inputs; Gemma's `1 + w` norms near
    their identity, SigLIP's LayerNorms near theirs."""
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(hf_config(tied)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name:  # scaled by sqrt(hidden)
                p.normal_(0.0, 0.5 / np.sqrt(p.shape[1]))
            elif (p.ndim > 1 and "language_model" in name) or "lm_head" in name:
                p.normal_(0.0, 0.5)
            elif p.ndim > 1:
                p.normal_(0.0, 1.0 / np.sqrt(p[0].numel()))
            elif "norm" in name and "vision_tower" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "norm" in name and "vision_tower" not in name:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    made: dict[bool, tuple[Path, Any]] = {}

    def get(tied: bool) -> tuple[Path, Any]:
        if tied not in made:
            folder = tmp_path_factory.mktemp("tied" if tied else "untied")
            model = random_hf_model(tied)
            model.save_pretrained(folder)
            made[tied] = (folder, model)
        return made[tied]

    return get


@pytest.fixture
def checkpoint(checkpoints) -> tuple[Path, Any]:
    """The untied model: a tied head of small embeddings repeats one token greedily."""
    return checkpoints(False)


def hf_inputs(ids: np.ndarray, with_types: bool = True) -> dict[str, Any]:
    ids_t = torch.tensor(ids, dtype=torch.long)
    inputs = {
        "input_ids": ids_t,
        "pixel_values": torch.tensor(PIXELS[: len(ids)].reshape(-1, 3, 16, 16)),
        "attention_mask": torch.ones_like(ids_t),
    }
    if with_types:  # as Gemma3Processor gives them: 1 on the image tokens
        inputs["token_type_ids"] = (ids_t == IMAGE).long()
    return inputs


@eqx.filter_jit
def forward(model: Any, ids: jax.Array, pixels: jax.Array) -> jax.Array:
    return jax.vmap(model)(ids, pixels)


# The untied model's layers scanned: a local and a global layer picked by lax.switch.
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied-scanned"])
def test_logits_equal_transformers_with_the_images_bidirectional(checkpoints, tied: bool) -> None:
    folder, hf_model = checkpoints(tied)
    model = rc.models.from_hf(folder, scan_layers=not tied)
    assert isinstance(model, rc.models.Gemma3VL)
    assert (model.language_model.lm_head is None) == tied
    with torch.no_grad():
        want = hf_model(**hf_inputs(IDS)).logits.numpy()
        causal = hf_model(**hf_inputs(IDS, with_types=False)).logits.numpy()
    assert np.abs(want - causal).max() > 1e-2  # the image tokens' mask matters here
    got = np.asarray(forward(model, jnp.asarray(IDS), jnp.asarray(PIXELS)))
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()


def test_image_groups_number_each_run_of_image_tokens() -> None:
    ids = jnp.asarray([IMAGE, IMAGE, 5, IMAGE, 6, IMAGE, IMAGE])
    assert image_groups(ids, IMAGE).tolist() == [0, 0, -1, 1, -1, 2, 2]


def hf_greedy(hf_model: Any, n: int, eos: int) -> list[list[int]]:
    with torch.no_grad():
        out = hf_model.generate(
            **hf_inputs(IDS), do_sample=False, max_new_tokens=n, eos_token_id=eos, pad_token_id=eos
        )
    rows = [r[IDS.shape[1] :] for r in out.tolist()]
    return [r + [eos] * (n - len(r)) for r in rows]


def test_greedy_generation_from_images_equals_transformers(checkpoint) -> None:
    folder, hf_model = checkpoint
    model = rc.models.from_hf(folder)
    n = 6  # past the window, from the image tokens' cache
    want = hf_greedy(hf_model, n, eos=1)
    assert len({t for row in want for t in row}) > 2, f"degenerate model: {want}"
    got = rc.sampling.generate(
        model,
        jnp.asarray(IDS),
        max_new_tokens=n,
        eos_id=1,
        prompt_inputs={"pixel_values": jnp.asarray(PIXELS)},
    )
    assert np.asarray(got).tolist() == want


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_to_hf_writes_the_checkpoint_back_and_transformers_loads_it(
    checkpoints, tied: bool, tmp_path
) -> None:
    folder, hf_model = checkpoints(tied)
    model = rc.models.from_hf(folder)
    model.to_hf(tmp_path)
    theirs, ours = (
        load_file(folder / "model.safetensors"),
        load_file(tmp_path / "model.safetensors"),
    )
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "gemma3"
    assert written["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert written["tie_word_embeddings"] is written["text_config"]["tie_word_embeddings"] is tied
    reloaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert reloaded.config.text_config.layer_types == ["sliding_attention", "full_attention"]
    want = hf_model.state_dict()
    got = reloaded.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


def test_transformers_4_names_load_alike(checkpoint, tmp_path) -> None:
    folder, _ = checkpoint
    tensors = load_file(folder / "model.safetensors")
    old = {k.replace("vision_tower.", "vision_tower.vision_model."): v for k, v in tensors.items()}
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    save_file(old, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["image_token_id"] = config.pop("image_token_index")
    (tmp_path / "config.json").write_text(json.dumps(config))
    a, b = rc.models.from_hf(folder), rc.models.from_hf(tmp_path)
    assert b.config.image_token_index == IMAGE
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_wrong_number_of_image_tokens_is_an_error(checkpoint) -> None:
    model = rc.models.from_hf(checkpoint[0])
    ids = jnp.asarray(IDS[0]).at[3].set(5)  # one image's 4 soft tokens, 3 placeholders
    with pytest.raises(RuntimeError, match=r"image tokens \(id 120\).*give 4 features each"):
        eqx.filter_jit(model.embeddings)(ids, jnp.asarray(PIXELS[0]))
    with pytest.raises(ValueError, match=r"takes one image of shape \(3, 16, 16\)"):
        model.embeddings(jnp.asarray(IDS[0]), jnp.asarray(PIXELS[0, :, :, :8, :8]))


def test_bad_configs_and_kernels_without_masks_are_errors(checkpoint) -> None:
    folder = checkpoint[0]
    values = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=r"mm_tokens_per_image=9 must be a square whose side"):
        rc.models.Gemma3Config.from_dict({**values, "mm_tokens_per_image": 9})
    text_only = {**values["text_config"], "model_type": "gemma3"}
    with pytest.raises(ValueError, match=r"model_type='gemma3'.*'gemma3_text'"):
        rc.models.Gemma3Config.from_dict(text_only)
    config = rc.models.Gemma3Config.from_dict(values)
    build = functools.partial(rc.models.Gemma3VL, attention="pallas")
    model = eqx.filter_eval_shape(build, config, key=jax.random.key(0))
    with pytest.raises(ValueError, match="implementation='pallas' does not take"):
        eqx.filter_eval_shape(model, jnp.asarray(IDS[0]), jnp.asarray(PIXELS[0]))


def test_a_model_built_in_code_writes_a_folder_transformers_loads(tmp_path) -> None:
    # The image placeholder past the vocabulary, as transformers allows: its rows are
    # replaced, and transformers embeds id 0 there.
    hf = hf_config(tied=True)
    config = rc.models.Gemma3Config(
        vision_config=rc.models.SiglipVisionConfig.from_dict(hf.vision_config.to_dict()),
        text_config=rc.models.Gemma3TextConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=WINDOW,
            sliding_window_pattern=2,
        ),
        mm_tokens_per_image=TOKENS,
        image_token_index=VOCAB,
        boi_token_index=BOI,
        eoi_token_index=EOI,
    )
    model = drawn(rc.models.Gemma3VL, config)
    model.to_hf(tmp_path)
    theirs = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path).eval()
    ids = np.where(IDS == IMAGE, VOCAB, IDS)
    inputs = hf_inputs(ids, with_types=False)
    inputs["token_type_ids"] = (inputs["input_ids"] == VOCAB).long()
    with torch.no_grad():
        want = theirs(**inputs).logits.numpy()
    got = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(PIXELS)))
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()


def test_the_4b_preset_has_the_published_size_and_config() -> None:
    cls, config = rc.models.preset("gemma-3-4b")
    model = eqx.filter_eval_shape(cls, config, scan_layers=True, key=jax.random.key(0))
    n = sum(x.size for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct))
    assert round(n / 1e9, 2) == 4.30  # google/gemma-3-4b-it: 4.3B
    hub = {  # google/gemma-3-4b-it's config.json, as transformers 4.50 wrote it
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "image_token_index": 262144,
        "mm_tokens_per_image": 256,
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": False,
        },
    }
    read = rc.models.Gemma3Config.from_dict(hub)
    assert read.vision_config == config.vision_config
    assert read.text_config.layer_attention() == config.text_config.layer_attention()
    assert eqx.filter_eval_shape(cls, read, key=jax.random.key(0)).language_model.config == (
        model.language_model.config
    )
