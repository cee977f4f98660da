"""The encoder-decoders (T5 v1.0, T5 v1.1, BART) against transformers, and split over devices.

Each architecture is a tiny random `transformers` model saved with `save_pretrained`;
redcoast must reproduce its logits, its greedy and beam-search tokens, and write
folders `transformers` reads back. The sharded tests build models from redcoast's
own configs. Needs the `hf` extra (torch, transformers).
"""

from __future__ import annotations

import functools
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

VOCAB = 96
ARCHS = ("t5", "t5-v1.1", "bart")
RNG = np.random.default_rng(0)
SRC = RNG.integers(3, VOCAB, (3, 11)).astype(np.int32)
MASK = np.ones_like(SRC)
MASK[1, 7:] = 0  # right-padded sources
MASK[2, 4:] = 0
TGT = RNG.integers(3, VOCAB, (3, 6)).astype(np.int32)


def hf_model(arch: str) -> object:
    """A transformers model with weights drawn larger than its own init (std 0.3 for the
    matrices, norms near 1) so that a wrong mapping shows and tokens vary."""
    if arch == "bart":
        config = transformers.BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=48,
            max_position_embeddings=64,
        )
        model = transformers.BartForConditionalGeneration(config)
    else:
        gated = arch == "t5-v1.1"
        config = transformers.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            feed_forward_proj="gated-gelu" if gated else "relu",
            decoder_start_token_id=0,
            tie_word_embeddings=not gated,
        )
        if gated:  # transformers 5 re-ties in __post_init__; v1.1 checkpoints are untied
            config.tie_word_embeddings = False
        model = transformers.T5ForConditionalGeneration(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.3)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
        if arch == "t5-v1.1":  # an untied T5 still shares its input embeddings
            model.encoder.embed_tokens.weight.copy_(model.shared.weight)
            model.decoder.embed_tokens.weight.copy_(model.shared.weight)
        if arch == "bart":
            model.final_logits_bias.normal_(0.0, 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """arch -> (save_pretrained folder, the transformers model), each made once."""
    made: dict[str, tuple[Path, object]] = {}

    def get(arch: str) -> tuple[Path, object]:
        if arch not in made:
            folder = tmp_path_factory.mktemp(arch)
            model = hf_model(arch)
            model.save_pretrained(folder)  # type: ignore[attr-defined]
            made[arch] = (folder, model)
        return made[arch]

    return get


def torch_logits(model: object, src: np.ndarray, mask: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(  # type: ignore[operator]
            input_ids=torch.tensor(src, dtype=torch.long),
            attention_mask=torch.tensor(mask),
            decoder_input_ids=torch.tensor(tgt, dtype=torch.long),
        ).logits.numpy()


@eqx.filter_jit
def forward(model: rc.models.AbstractSeq2SeqLM, src: jax.Array, mask: jax.Array, tgt: jax.Array):
    return jax.vmap(lambda s, a, t: model(s, t, attention_mask=a))(src, mask, tgt)


# ----------------------------------------------------------------------------- logits


@pytest.mark.parametrize("arch", ARCHS)
def test_from_hf_logits_equal_transformers(arch: str, checkpoints) -> None:
    folder, hf = checkpoints(arch)
    want = torch_logits(hf, SRC, MASK, TGT)
    model = rc.models.from_hf(folder)
    assert isinstance(model, rc.models.BART if arch == "bart" else rc.models.T5)
    assert (model.lm_head is None) == (arch != "t5-v1.1")
    got = np.asarray(forward(model, jnp.asarray(SRC), jnp.asarray(MASK), jnp.asarray(TGT)))
    assert got.shape == (3, 6, VOCAB)
    assert np.abs(got - want).max() <= 1e-4
    # Padding is masked: the padded row's logits differ from those of the unmasked row.
    unmasked = torch_logits(hf, SRC, np.ones_like(MASK), TGT)
    assert np.abs(unmasked[1] - want[1]).max() > 1e-2


def test_scanned_layers_give_the_same_logits(checkpoints) -> None:
    folder, hf = checkpoints("t5")
    model = rc.models.T5.from_hf(folder, scan_layers=True)
    assert not isinstance(model.encoder_blocks, tuple)
    got = np.asarray(forward(model, jnp.asarray(SRC), jnp.asarray(MASK), jnp.asarray(TGT)))
    assert np.abs(got - torch_logits(hf, SRC, MASK, TGT)).max() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_to_hf_round_trips_through_transformers(arch: str, checkpoints, tmp_path: Path) -> None:
    folder, hf = checkpoints(arch)
    want = torch_logits(hf, SRC, MASK, TGT)
    for scan_layers in (False, True):
        out = tmp_path / f"scan-{scan_layers}"
        rc.models.from_hf(folder, scan_layers=scan_layers).to_hf(out)
        reloaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
        assert type(reloaded) is type(hf)
        np.testing.assert_allclose(torch_logits(reloaded, SRC, MASK, TGT), want, rtol=0, atol=1e-5)
    # The embedding copies of an untied T5 are written once, as shared.weight.
    copies = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
    assert (
        set(load_file(out / "model.safetensors"))
        == set(load_file(folder / "model.safetensors")) - copies
    )


# ----------------------------------------------------------------------------- generation


def trim(row: list[int], eos: int) -> list[int]:
    """The tokens up to and including the first EOS (what follows is padding)."""
    return row[: row.index(eos) + 1] if eos in row else row


def hf_generate(hf: object, n: int, eos: int, **settings) -> list[list[int]]:
    with torch.no_grad():
        out = hf.generate(  # type: ignore[attr-defined]
            input_ids=torch.tensor(SRC, dtype=torch.long),
            attention_mask=torch.tensor(MASK),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=eos,
            **settings,
        )
    return [trim(row[1:], eos) for row in out.tolist()]  # without the decoder start token


SETTINGS = [
    {"num_beams": 1},
    {"num_beams": 4, "length_penalty": 0.6},
    {"num_beams": 4, "length_penalty": 1.7, "early_stopping": True},
    {"num_beams": 3, "length_penalty": 1.3, "early_stopping": "never"},
]


def stopping_eos(hf: object, n: int) -> int:
    """An EOS that a greedy output reaches after its first step, so stopping is exercised
    (tiny random models soon repeat one token, which then ends the sequence)."""
    free = hf_generate(hf, n, eos=VOCAB + 1)
    return next(row[i] for row in free for i in range(1, n) if row[i] not in row[:i])


def test_beam_search_equals_transformers(checkpoints) -> None:
    folder, hf = checkpoints("t5-v1.1")
    model = rc.models.from_hf(folder)
    eos = stopping_eos(hf, 10)
    settings = {"num_beams": 4, "length_penalty": 0.6}
    got = rc.models.generate_seq2seq(
        model, SRC, attention_mask=MASK, max_new_tokens=10, eos_token_id=eos, **settings
    )
    assert [trim(row, eos) for row in np.asarray(got).tolist()] == hf_generate(
        hf, 10, eos, **settings
    )


# Every setting compiles its own decoding loop (10-40 s an architecture): `nox -s slow`.
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_beam_search_equal_transformers(arch: str, checkpoints) -> None:
    folder, hf = checkpoints(arch)
    model = rc.models.from_hf(folder)
    n = 10
    eos = stopping_eos(hf, n)
    outputs = []
    for settings in SETTINGS:
        want = hf_generate(hf, n, eos, **settings)
        got = rc.models.generate_seq2seq(
            model, SRC, attention_mask=MASK, max_new_tokens=n, eos_token_id=eos, **settings
        )
        got = np.asarray(got)
        assert got.shape == (3, n)
        assert [trim(row, eos) for row in got.tolist()] == want, settings
        outputs.append(want)
        pad = model.special_token("pad_token_id")
        for row in got.tolist():  # after EOS, padding
            assert row[len(trim(row, eos)) :] == [pad] * (n - len(trim(row, eos)))
    assert any(out != outputs[0] for out in outputs[1:]), "beam search never beat greedy"
    assert any(eos in row for out in outputs for row in out)


@pytest.mark.slow
def test_forced_bos_and_eos_tokens(checkpoints) -> None:
    folder, hf = checkpoints("bart")
    model = rc.models.BART.from_hf(folder)
    for settings in ({"num_beams": 1}, {"num_beams": 2, "length_penalty": 2.0}):
        want = hf_generate(hf, 6, 2, forced_bos_token_id=7, forced_eos_token_id=2, **settings)
        got = rc.models.generate_seq2seq(
            model, SRC, attention_mask=MASK, max_new_tokens=6, forced_bos_token_id=7, **settings
        )
        rows = [trim(row, 2) for row in np.asarray(got).tolist()]
        assert rows == want
        assert all(row[0] == 7 and row[-1] == 2 for row in rows)  # forced_eos from the config


@pytest.mark.slow
def test_sampling(checkpoints) -> None:
    model = rc.models.from_hf(checkpoints("t5-v1.1")[0])
    greedy = rc.models.generate_seq2seq(model, SRC, max_new_tokens=6, eos_token_id=VOCAB - 1)
    key = jax.random.key(1)
    cold = rc.models.generate_seq2seq(
        model, SRC, max_new_tokens=6, eos_token_id=VOCAB - 1, temperature=1e-4, key=key
    )
    assert cold.tolist() == greedy.tolist()
    hot = [
        rc.models.generate_seq2seq(model, SRC, max_new_tokens=6, temperature=5.0, key=k).tolist()
        for k in (key, key, jax.random.key(2))
    ]
    assert hot[0] == hot[1] != hot[2]


def test_bad_settings_are_errors(checkpoints) -> None:
    model = rc.models.from_hf(checkpoints("t5")[0])
    with pytest.raises(ValueError, match="num_beams must be an int >= 1"):
        rc.models.generate_seq2seq(model, SRC, max_new_tokens=4, num_beams=0)
    with pytest.raises(ValueError, match=r"beam search \(num_beams=2\) does not"):
        rc.models.generate_seq2seq(model, SRC, max_new_tokens=4, num_beams=2, temperature=1.0)
    with pytest.raises(ValueError, match="eos_token_id=500 is not a token id"):
        rc.models.generate_seq2seq(model, SRC, max_new_tokens=4, eos_token_id=500)


@pytest.mark.parametrize(
    ("arch", "copy"),
    [
        ("bart", "lm_head.weight"),
        ("t5", "lm_head.weight"),
        ("t5-v1.1", "encoder.embed_tokens.weight"),
    ],
)
def test_a_stored_copy_unlike_its_tied_original_is_refused(
    arch: str, copy: str, checkpoints, tmp_path: Path
) -> None:
    # One token table serves the encoder, the decoder and a tied head: a copy stored with
    # values of its own cannot be held, and is named rather than dropped.
    src, folder = checkpoints(arch)[0], tmp_path / arch
    folder.mkdir()
    for f in src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    original = "model.shared.weight" if arch == "bart" else "shared.weight"
    tensors[copy] = tensors[original] + 1.0
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"ties '{copy}' to '{original}'.*one array for both"):
        rc.models.from_hf(folder)


# ----------------------------------------------------------------------------- sharded

CONFIGS = {
    "t5": rc.models.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4
    ),
    "t5-v1.1": rc.models.T5Config(
        vocab_size=128,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
    ),
    "bart": rc.models.BARTConfig(
        vocab_size=128,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
    ),
}
BATCH = {
    "src": jnp.asarray(RNG.integers(0, 128, (8, 12)), jnp.int32),
    "mask": jnp.asarray(np.arange(12)[None, :] < RNG.integers(4, 13, (8, 1)), jnp.int32),
    "tgt": jnp.asarray(RNG.integers(0, 128, (8, 8)), jnp.int32),
}


@functools.cache
def build(arch: str, *, scan_layers: bool = False) -> rc.models.AbstractSeq2SeqLM:
    """One model per architecture, drawn on the host (compiles nothing)."""
    cls = rc.models.BART if arch == "bart" else rc.models.T5
    return drawn(cls, CONFIGS[arch], scan_layers=scan_layers)


def loss_fn(model: rc.models.AbstractSeq2SeqLM, batch: dict, key: jax.Array) -> jax.Array:
    logits = jax.vmap(lambda s, a, t: model(s, t, attention_mask=a))(
        batch["src"], batch["mask"], batch["tgt"][:, :-1]
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tgt"][:, 1:]).mean()


def layout(model: eqx.Module, specs: object) -> dict[str, tuple]:
    """Path -> spec padded to the array's rank, so `P("model")` and `P("model", None)` agree."""
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))
    specs = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return {
        path_str(p): tuple(s) + (None,) * (a.ndim - len(s))
        for (p, a), s in zip(flat, specs, strict=True)
    }


@pytest.mark.parametrize("scan_layers", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("arch", ARCHS)
def test_sharding_rules_give_megatron_layout(arch: str, scan_layers: bool) -> None:
    model = build(arch, scan_layers=scan_layers)
    key = jax.random.key(0)
    plan = rc.sharding_plan(model, 4, example_call=lambda m: loss_fn(m, BATCH, key))
    got, want = layout(model, plan.specs), layout(model, megatron_specs(model, 4))
    assert got == want, {p: (got[p], want[p]) for p in got if got[p] != want[p]}
    stacked = (None,) if scan_layers else ()
    layer = "decoder_blocks." if scan_layers else "decoder_blocks.1."
    assert got[layer + "cross_attn.k_proj.weight"] == (*stacked, "model", None)
    assert got[layer + "cross_attn.o_proj.weight"] == (*stacked, None, "model")
    ffn_out = "mlp.down_proj.weight" if arch == "t5-v1.1" else "mlp.fc_out.weight"
    assert got[layer + ffn_out] == (*stacked, None, "model")
    assert plan.bytes_per_device < 0.75 * plan.total_bytes


# In `nox -s slow`; test_fsdp's T5 step on 8 data shards is its fast sibling.
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_sharded_train_step_equals_unsharded(arch: str) -> None:
    model = build(arch)
    key = jax.random.key(0)
    mesh = rc.make_mesh(4)  # 2 x 4
    specs = rc.sharding_plan(model, 4, example_call=lambda m: loss_fn(m, BATCH, key)).specs
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


# In `nox -s slow`; test_models_parallel's from_hf and generate under predict is its
# fast sibling.
@pytest.mark.slow
def test_from_hf_onto_a_mesh_and_beam_search_under_predict(tmp_path: Path) -> None:
    model = build("t5-v1.1", scan_layers=True)
    model.to_hf(tmp_path)
    mesh = rc.make_mesh(4)
    key = jax.random.key(0)
    # Without specs, from_hf derives them by tracing the model's own example_call.
    sharded = rc.models.T5.from_hf(tmp_path, mesh=mesh, scan_layers=True)
    specs = rc.sharding_plan(model, 4, example_call=lambda m: loss_fn(m, BATCH, key)).specs
    for a, w, spec in zip(
        jax.tree_util.tree_leaves(eqx.filter(sharded, eqx.is_array)),
        jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)),
        jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P)),
        strict=True,
    ):
        assert a.sharding == NamedSharding(mesh, spec)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
    examples = [
        {"src": np.asarray(BATCH["src"][i]), "mask": np.asarray(BATCH["mask"][i])} for i in range(6)
    ]

    def collate_fn(rows: list[dict]) -> dict[str, np.ndarray]:
        return {k: np.stack([r[k] for r in rows]) for k in ("src", "mask")}

    def pred_fn(m: rc.models.AbstractSeq2SeqLM, batch: dict, key: jax.Array) -> jax.Array:
        return rc.models.generate_seq2seq(
            m,
            batch["src"],
            attention_mask=batch["mask"],
            max_new_tokens=5,
            num_beams=3,
            length_penalty=0.7,
        )

    got = rc.predict(
        sharded,
        examples,
        collate_fn=collate_fn,
        pred_fn=pred_fn,
        mesh=mesh,
        per_device_batch_size=2,
    )
    want = pred_fn(model, {"src": BATCH["src"][:6], "mask": BATCH["mask"][:6]}, key)
    assert [np.asarray(g).tolist() for g in got] == np.asarray(want).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True], ids=["loop", "scan"])
def test_remat_and_fsdp_give_the_plain_steps_numbers(scan_layers: bool) -> None:
    config = CONFIGS["t5"]
    key = jax.random.key(0)
    make = lambda remat: rc.models.T5(config, scan_layers=scan_layers, remat=remat, key=key)  # noqa: E731
    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))
    loss, grads = grad(make("none"), BATCH, key)
    for policy in ("dots", "full"):
        loss_r, grads_r = grad(make(policy), BATCH, key)
        np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
        # Array leaves only: the models differ in a static field (their remat policy).
        chex.assert_trees_all_close(
            jax.tree.leaves(grads_r), jax.tree.leaves(grads), rtol=1e-5, atol=1e-7
        )
    # FSDP on a 4 x 2 mesh: every layer's weights gathered where it runs.
    mesh = rc.make_mesh(2)
    model = rc.place(make("none"), mesh, example_call=lambda m: loss_fn(m, BATCH, key), fsdp=True)
    optimizer = optax.sgd(0.5)
    step = rc.train_step(loss_fn, optimizer, mesh=mesh)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    _, _, metrics = step(model, state, jax.device_put(BATCH, NamedSharding(mesh, P("data"))), key)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
