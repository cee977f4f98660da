"""The decoder zoo against transformers: logits, HF folders in and out, greedy generation.

Each architecture is a tiny random `transformers` model (hidden 32, 2 layers) saved
with `save_pretrained`; redcoast must reproduce its logits and its greedy tokens,
and write folders `transformers` reads back, of every zoo model built in code too.
Needs the `hf` extra (torch, transformers).
"""

from __future__ import annotations

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tiny import DECODERS, FAMILIES, drawn, family_config, hf_decoder_config

import redcoast as rc

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 128
ARCHS = tuple(DECODERS)
CLASSES = DECODERS
IDS = np.random.default_rng(0).integers(2, VOCAB, (2, 12)).astype(np.int32)


def hf_config(arch: str) -> object:
    return hf_decoder_config(arch, vocab=VOCAB, width=32)


def torch_logits(model: object, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()  # type: ignore[operator]


@eqx.filter_jit
def forward(model: rc.models.AbstractCausalLM, ids: jax.Array) -> jax.Array:
    return jax.vmap(model)(ids)


def random_hf_model(arch: str) -> object:
    """A transformers model with matrices drawn larger than its own init and norms near 1,
    so that greedy tokens vary instead of repeating one, and a wrong mapping shows."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(arch)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.5)
            elif name.endswith("weight"):  # a norm's scale
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """arch -> (save_pretrained folder, the transformers model), each made once."""
    made: dict[str, tuple[Path, object]] = {}

    def get(arch: str) -> tuple[Path, object]:
        if arch not in made:
            folder = tmp_path_factory.mktemp(arch)
            model = random_hf_model(arch)
            model.save_pretrained(folder)  # type: ignore[attr-defined]
            made[arch] = (folder, model)
        return made[arch]

    return get


@pytest.fixture(params=ARCHS)
def checkpoint(request: pytest.FixtureRequest, checkpoints) -> tuple[str, Path, object]:
    return (request.param, *checkpoints(request.param))


# ----------------------------------------------------------------------------- logits


def test_from_hf_logits_equal_transformers(checkpoint) -> None:
    arch, folder, hf_model = checkpoint
    want = torch_logits(hf_model, IDS)
    model = rc.models.from_hf(folder)
    assert type(model).__name__ == CLASSES[arch]
    assert isinstance(model, getattr(rc.models, CLASSES[arch]))
    got = np.asarray(forward(model, jnp.asarray(IDS)))
    assert got.shape == (2, 12, VOCAB)
    assert np.abs(got - want).max() <= 1e-4
    if arch == "llama":
        # The scanned forward pass is shared code; the stacked loading of every
        # architecture is checked by the round trip below.
        scanned = rc.models.Llama.from_hf(folder, scan_layers=True)
        assert isinstance(scanned.blocks, rc.models.DecoderBlock)
        assert np.abs(np.asarray(forward(scanned, jnp.asarray(IDS))) - want).max() <= 1e-4


def test_to_hf_round_trips_through_transformers(checkpoint, tmp_path: Path) -> None:
    arch, folder, hf_model = checkpoint
    want = torch_logits(hf_model, IDS)
    for scan_layers in (False, True):
        out = tmp_path / f"scan-{scan_layers}"
        rc.models.from_hf(folder, scan_layers=scan_layers).to_hf(out)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(reloaded) is type(hf_model)
        np.testing.assert_allclose(torch_logits(reloaded, IDS), want, rtol=0, atol=1e-5)
    assert set(load_file(out / "model.safetensors")) == set(load_file(folder / "model.safetensors"))
    assert json.loads((out / "config.json").read_text())["model_type"] == arch


# ----------------------------------------------------------------------------- generation


def hf_greedy(hf_model: object, prompt: np.ndarray, n: int, eos: int) -> list[int]:
    ids = torch.tensor(prompt[None], dtype=torch.long)
    with torch.no_grad():
        out = hf_model.generate(  # type: ignore[attr-defined]
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    new = out[0, len(prompt) :].tolist()
    return new + [eos] * (n - len(new))  # transformers stops early once every row is done


def test_greedy_generation_equals_transformers(checkpoint) -> None:
    _, folder, hf_model = checkpoint
    model = rc.models.from_hf(folder)
    # Ragged prompts: the second is 7 tokens, right-padded to 12.
    lengths = np.array([12, 7], np.int32)
    n = 8
    free = hf_greedy(hf_model, IDS[0], n, eos=1)
    assert len(set(free)) > 2, f"degenerate model: {free}"
    # An eos the first row reaches at step 3, so stopping is exercised too.
    eos = free[2]
    want = [hf_greedy(hf_model, IDS[i, : lengths[i]], n, eos) for i in range(2)]
    assert want[0][2:] == [eos] * (n - 2)
    got = rc.models.generate(
        model, jnp.asarray(IDS), prompt_lengths=lengths, max_new_tokens=n, eos_id=eos
    )
    assert np.asarray(got).tolist() == want


def test_greedy_equals_step_by_step_argmax_without_cache(checkpoints) -> None:
    # LLaMA: rotary positions and grouped K/V in the cache. Loaded rather than built:
    # loading compiles nothing, and the (2, 12) forward pass is already compiled.
    model = rc.models.from_hf(checkpoints("llama")[0])
    prompt = jnp.asarray(IDS[:, :5])
    cached = rc.models.generate(model, prompt, max_new_tokens=7)
    uncached = rc.models.generate(model, prompt, max_new_tokens=7, use_cache=False)
    assert cached.tolist() == uncached.tolist()
    # Step by step without a cache, the argmax at position t of the whole sequence is
    # token t + 1 (a causal model's logits at t see only tokens <= t): one forward pass
    # checks every step.
    logits = forward(model, jnp.concatenate([prompt, cached], axis=1))
    assert jnp.argmax(logits[:, 4:-1], axis=-1).tolist() == cached.tolist()


def test_sampling_settings(checkpoints) -> None:
    model = rc.models.from_hf(checkpoints("llama")[0])
    prompts = jnp.asarray(IDS[:, :8])
    key = jax.random.key(1)
    nucleus = rc.models.generate(
        model, prompts, max_new_tokens=4, temperature=1.0, top_p=1e-6, key=key
    )
    hot = [
        rc.models.generate(model, prompts, max_new_tokens=4, temperature=5.0, top_k=3, key=k)
        for k in (key, key, jax.random.key(2))
    ]
    assert hot[0].tolist() == hot[1].tolist() and hot[0].tolist() != hot[2].tolist()
    # Teacher-forced logits (position t sees tokens <= t) give each step's candidates.
    for sample, k in [(nucleus, 1), (hot[0], 3), (hot[2], 3)]:
        logits = forward(model, jnp.concatenate([prompts, sample], axis=1))[:, 7:-1]
        top = jax.lax.top_k(logits, k)[1]
        assert bool(jnp.all(jnp.any(top == sample[..., None], axis=-1)))
    with pytest.raises(ValueError, match="needs key="):
        rc.models.generate(model, prompts, max_new_tokens=4, temperature=1.0)
    with pytest.raises(Exception, match=r"(?i)type-check|shape \(batch, prompt_len\)"):
        rc.models.generate(model, prompts[0], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt_lengths must be in \[1, 8\]"):
        rc.models.generate(model, prompts, prompt_lengths=jnp.array([8, 9]), max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p must be in"):
        rc.models.generate(model, prompts, max_new_tokens=2, temperature=1.0, top_p=0.0, key=key)


def test_generation_beyond_the_position_table_is_an_error(checkpoints) -> None:
    model = rc.models.from_hf(checkpoints("gpt2")[0])  # 64 positions
    with pytest.raises(ValueError, match="exceed the 64 positions"):
        rc.models.generate(model, jnp.asarray(IDS), max_new_tokens=53)


# ----------------------------------------------------------------------------- folders


def test_sharded_checkpoint_index_loads(tmp_path: Path) -> None:
    hf_model = random_hf_model("llama")
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")  # type: ignore[attr-defined]
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model = rc.models.Llama.from_hf(tmp_path)
    got = np.asarray(forward(model, jnp.asarray(IDS)))
    assert np.abs(got - torch_logits(hf_model, IDS)).max() <= 1e-4


def test_llama_config_reads_both_rope_spellings() -> None:
    new = rc.models.LlamaConfig.from_dict(
        {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
    )
    old = rc.models.LlamaConfig.from_dict({"rope_theta": 500000.0, "rope_scaling": None})
    assert new.rope_theta == old.rope_theta == 500000.0
    assert new.to_dict()["rope_parameters"]["rope_theta"] == 500000.0


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def gpt2_folder(checkpoints) -> Path:
    return checkpoints("gpt2")[0]


def copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_base_model_names_without_the_prefix_load(gpt2_folder: Path, tmp_path: Path) -> None:
    # The original GPT-2 and OPT releases were saved from the bare base model.
    folder = copy_folder(gpt2_folder, tmp_path / "bare")
    tensors = load_file(folder / "model.safetensors")
    bare = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    assert "h.0.ln_1.weight" in bare
    save_file(bare, folder / "model.safetensors", metadata={"format": "pt"})
    got, want = rc.models.from_hf(folder), rc.models.from_hf(gpt2_folder)
    for a, b in zip(
        jax.tree_util.tree_leaves(eqx.filter(got, eqx.is_array)),
        jax.tree_util.tree_leaves(eqx.filter(want, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unsupported_architecture_is_named(gpt2_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(gpt2_folder, tmp_path / "bert")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="bert", architectures=["BertForMaskedLM"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"model_type='bert'.*\['bart', 'clip_vision_model', 'deepseek_v3', 'gemma2', "
        r"'gemma3', 'gemma3_text', 'gpt2', 'gptj', 'llama', 'llava', 'mistral', 'mixtral', "
        r"'opt', 'phi3', 'qwen2', 'qwen3', 'qwen3_moe', 'siglip_vision_model', 't5', "
        r"'vision-encoder-decoder', 'vit'\]",
    ):
        rc.models.from_hf(folder)
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*rc.models.from_hf picks"):
        rc.models.Llama.from_hf(gpt2_folder)


def test_unsupported_variant_is_named(gpt2_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rope_type='llama3'"):
        rc.models.LlamaConfig.from_dict({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    folder = copy_folder(gpt2_folder, tmp_path / "idx")
    config = json.loads((folder / "config.json").read_text())
    config["scale_attn_by_inverse_layer_idx"] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx=True is not supported"):
        rc.models.from_hf(folder)


def test_missing_tensor_is_named(gpt2_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(gpt2_folder, tmp_path / "missing")
    tensors = load_file(folder / "model.safetensors")
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        rc.models.MissingTensorError,
        match=r"no tensor 'transformer.h.1.mlp.c_fc.bias' \(needed for blocks.1.mlp.fc_in.bias\)",
    ):
        rc.models.from_hf(folder)


def test_shape_mismatch_is_named(gpt2_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(gpt2_folder, tmp_path / "shape")
    tensors = load_file(folder / "model.safetensors")
    tensors["transformer.h.0.mlp.c_proj.weight"] = np.zeros((100, 32), np.float32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"'transformer.h.0.mlp.c_proj.weight' has shape \(100, 32\).*"
        r"blocks.0.mlp.fc_out.weight of shape \(32, 128\)",
    ):
        rc.models.from_hf(folder)
    config = json.loads((gpt2_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_layer": 1}))
    (folder / "model.safetensors").write_bytes((gpt2_folder / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"does not use: \['transformer.h.1"):
        rc.models.from_hf(folder)


# ----------------------------------------------------------------------------- tied heads

TABLES = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight"}


def tied_with_a_stored_head(src: Path, dst: Path, arch: str, *, same: bool) -> Path:
    """A copy of `src` whose config.json ties the head, storing `lm_head.weight` equal to
    the token table (`same`) or not (a fine-tuned head; the untied Llama's own)."""
    folder = copy_folder(src, dst)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    tensors = load_file(folder / "model.safetensors")
    table = tensors[TABLES[arch]]
    if same:
        tensors["lm_head.weight"] = table.copy()
    else:
        other = table + np.random.default_rng(1).normal(0, 0.5, table.shape).astype(table.dtype)
        tensors.setdefault("lm_head.weight", other)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_stored_head_unlike_the_table_is_loaded_untied_as_transformers_does(
    arch: str, checkpoints, tmp_path: Path
) -> None:
    folder = tied_with_a_stored_head(checkpoints(arch)[0], tmp_path / "tied", arch, same=False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    want = torch_logits(theirs, IDS)
    with pytest.warns(UserWarning, match=rf"ties 'lm_head.weight' to '{TABLES[arch]}'") as caught:
        model = rc.models.from_hf(folder)
    assert str(folder) in str(caught[0].message) and "loaded untied" in str(caught[0].message)
    assert model.lm_head is not None
    assert np.abs(np.asarray(forward(model, jnp.asarray(IDS))) - want).max() <= 1e-4
    model.to_hf(tmp_path / "out")
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    )
    assert "lm_head.weight" in load_file(tmp_path / "out" / "model.safetensors")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(torch_logits(back, IDS), want, rtol=0, atol=1e-5)
    # A stored head equal to the table is the tied head: no warning (warnings are errors).
    same = tied_with_a_stored_head(checkpoints(arch)[0], tmp_path / "same", arch, same=True)
    assert rc.models.from_hf(same).lm_head is None


# ----------------------------------------------------------------------------- built in code

# Below the ids transformers' configs default to (GPT-2's 50256, Phi-3's padding 32000).
SMALL_VOCAB = 48
PIXELS = np.random.default_rng(3).normal(size=(2, 3, 16, 16)).astype(np.float32)
VIT = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    image_size=16,
    patch_size=4,
)


TOWER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=16,
    patch_size=4,
)
IMAGE = SMALL_VOCAB - 1  # the vision-language models' image token


def with_image(ids: np.ndarray, n: int) -> np.ndarray:
    """Rows of `ids` with one image's `n` tokens after the first two (no other image token)."""
    text = np.where(ids == IMAGE, 1, ids)
    return np.concatenate([text[:, :2], np.full((len(ids), n), IMAGE), text[:, 2:]], axis=1)


def built_in_code(model_type: str) -> rc.models.HFConfig:
    """A small config of the zoo's `model_type` as code writes one, without token ids."""
    m, v = rc.models, SMALL_VOCAB
    families = {getattr(m, cls).config_class.model_type: n for n, cls in FAMILIES.items()}
    if model_type in families:
        return family_config(families[model_type], vocab=v)  # type: ignore[return-value]
    gpt2 = dict(vocab_size=v, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    configs = {
        "gpt2": lambda: m.GPT2Config(**gpt2),
        "gptj": lambda: m.GPTJConfig(**gpt2, rotary_dim=4),
        "opt": lambda: m.OPTConfig(
            vocab_size=v,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=16,
        ),
        "t5": lambda: m.T5Config(
            vocab_size=v, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4
        ),
        "bart": lambda: m.BARTConfig(
            vocab_size=v,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=16,
        ),
        "deepseek_v3": lambda: m.DeepseekV3Config(
            vocab_size=v,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=4,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            max_position_embeddings=16,
        ),
        "vit": lambda: m.ViTConfig(**VIT),
        "clip_vision_model": lambda: m.CLIPVisionConfig(**TOWER),
        "siglip_vision_model": lambda: m.SiglipVisionConfig(**TOWER),
        "llava": lambda: m.LlavaConfig(
            vision_config=m.CLIPVisionConfig(**TOWER),
            text_config=family_config("llama3", vocab=v),  # type: ignore[arg-type]
            image_token_index=IMAGE,
        ),
        "gemma3": lambda: m.Gemma3Config(
            vision_config=m.SiglipVisionConfig(**TOWER, vision_use_head=False),
            text_config=family_config("gemma3", vocab=v),  # type: ignore[arg-type]
            mm_tokens_per_image=4,
            boi_token_index=IMAGE - 2,
            eoi_token_index=IMAGE - 1,
            image_token_index=IMAGE,
        ),
        "vision-encoder-decoder": lambda: m.VisionEncoderDecoderConfig(
            encoder=m.ViTConfig(**VIT), decoder=m.GPT2Config(**gpt2, add_cross_attention=True)
        ),
    }
    return configs[model_type]()


@eqx.filter_jit
def batched(model: eqx.Module, *inputs: jax.Array) -> jax.Array:
    return jax.vmap(model)(*inputs)


@pytest.mark.parametrize("model_type", sorted(rc.models.ARCHITECTURES))
def test_every_model_built_in_code_writes_a_folder_transformers_loads(
    model_type: str, tmp_path: Path
) -> None:
    config = built_in_code(model_type)
    model = drawn(rc.models.ARCHITECTURES[model_type], config)
    model.to_hf(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    special = {k: v for k, v in written.items() if k.endswith("token_id") and v is not None}
    assert all(0 <= v < SMALL_VOCAB for v in special.values()), special
    ids = torch.tensor(IDS % SMALL_VOCAB, dtype=torch.long)
    pixels = torch.tensor(PIXELS)
    with torch.no_grad():
        if isinstance(model, rc.models.AbstractCausalLM):
            theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
            inputs, want = (ids,), theirs(ids).logits
        elif isinstance(model, rc.models.VisionEncoderDecoder):
            theirs = transformers.VisionEncoderDecoderModel.from_pretrained(tmp_path).eval()
            inputs, want = (pixels, ids), theirs(pixel_values=pixels, decoder_input_ids=ids).logits
        elif hasattr(model.config, "image_tokens"):  # a vision-language model, one image a row
            ids = torch.tensor(with_image(ids.numpy(), model.config.image_tokens))
            theirs = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
            # Gemma 3's images see themselves both ways: its processor's token types say where.
            types = {"token_type_ids": (ids == IMAGE).long()} if model_type == "gemma3" else {}
            want = theirs(input_ids=ids, pixel_values=pixels, **types).logits
            inputs = (ids, pixels[:, None])
        elif isinstance(model, rc.models.AbstractSeq2SeqLM):
            theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
            inputs, want = (ids, ids), theirs(input_ids=ids, decoder_input_ids=ids).logits
        else:
            theirs = transformers.AutoModel.from_pretrained(tmp_path).eval()
            inputs, want = (pixels,), theirs(pixel_values=pixels).last_hidden_state
    got = batched(model, *(jnp.asarray(x.numpy()) for x in inputs))
    assert np.abs(np.asarray(got) - want.numpy()).max() <= 1e-4


def small_decoder(arch: str, attention: str = "auto") -> rc.models.AbstractCausalLM:
    if arch == "gpt2":
        config = rc.models.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4
        )
        return rc.models.GPT2(config, attention=attention, key=jax.random.key(1))
    config = rc.models.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return rc.models.Llama(config, attention=attention, key=jax.random.key(1))


@pytest.mark.parametrize(
    ("arch", "attention"),
    [pytest.param("gpt2", "einsum", marks=pytest.mark.slow), ("llama", "blockwise")],
)
def test_a_packed_row_loses_what_its_documents_lose_alone(arch: str, attention: str) -> None:
    # GPT-2's learned positions and LLaMA's rotary ones both restart with each document.
    model = small_decoder(arch, attention)
    lengths, seq = (5, 9, 2), 16
    ids = np.random.default_rng(1).integers(2, VOCAB, seq).astype(np.int32)
    segments = np.repeat(np.arange(3), lengths).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    # Row 0: the packed row; rows 1-3: each document alone at the start of a row, the
    # rest of it padding that is not counted; row 4: the packed row as one document.
    rows, row_segments, row_positions, masks = [ids], [segments], [positions], [np.ones(seq)]
    for a, n in zip(np.cumsum((0, *lengths[:-1])), lengths, strict=True):
        rows.append(np.concatenate([ids[a : a + n], np.full(seq - n, 2, np.int32)]))
        row_segments.append((np.arange(seq) >= n).astype(np.int32))
        row_positions.append(np.arange(seq, dtype=np.int32))
        masks.append(np.arange(seq) < n)
    rows.append(ids)
    row_segments.append(np.zeros(seq, np.int32))
    row_positions.append(positions)
    masks.append(positions > 0)  # the same targets as row 0's
    nll, count = eqx.filter_jit(rc.models.next_token_nll)(
        model,
        np.stack(rows),
        np.stack(masks).astype(bool),
        segment_ids=np.stack(row_segments),
        positions=np.stack(row_positions),
    )
    assert float(count[0]) == sum(n - 1 for n in lengths) == float(count[1:4].sum())
    assert float(count[4]) == float(count[0])
    np.testing.assert_allclose(nll[0], nll[1:4].sum(), rtol=1e-5, atol=1e-5)
    # Without the segments the row's later documents read the earlier ones.
    assert abs(float(nll[4]) - float(nll[0])) > 1e-3


@pytest.mark.slow
def test_the_zoo_attends_blockwise_as_with_the_einsum() -> None:
    ids = jnp.asarray(np.random.default_rng(2).integers(2, VOCAB, 32).astype(np.int32))
    segment_ids = jnp.asarray(np.repeat([0, 1, 2], [10, 16, 6]).astype(np.int32))
    plain, blocks = small_decoder("llama", "einsum"), small_decoder("llama", "blockwise")

    def loss(model: rc.models.AbstractCausalLM) -> jax.Array:
        return model(ids, segment_ids=segment_ids).sum()

    run = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    want, got = run(plain), run(blocks)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_positions_and_segment_ids_of_the_wrong_shape_are_named() -> None:
    model = small_decoder("gpt2")
    # jaxtyping's check (a TypeError) comes first in the tests; users get the ValueError.
    with pytest.raises(
        (ValueError, TypeError), match=r"segment_ids of shape|parameter 'segment_ids'"
    ):
        model(jnp.arange(8), segment_ids=jnp.zeros(7, jnp.int32))
    with pytest.raises((ValueError, TypeError), match=r"positions of shape|parameter 'positions'"):
        model(jnp.arange(8), positions=jnp.zeros((1, 8), jnp.int32))
