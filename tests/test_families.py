"""Today's checkpoints -- Llama 3, Qwen 2/3, Qwen3-MoE, Mistral, Mixtral, Gemma 2/3,
Phi-3 -- against transformers, and split over devices.

Each family is a tiny random `transformers` model (hidden 32, 2 layers, 4 heads over 2
key/value heads) saved with `save_pretrained`, every variant of the family on: scaled
RoPE, tied heads, Q/K/V biases, query/key norms, sliding windows shorter than the
sequences (on some layers only, for Qwen 2 and Gemma), soft caps, experts, fused
projections. redcoast must give its logits and greedy tokens, write back its tensors
bit for bit, and train the same split over devices as on one. Needs the `hf` extra.
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
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file
from tiny import FAMILIES, drawn, family_config, megatron_specs

import redcoast as rc
from redcoast._tree_paths import path_str

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 128
SLOW = pytest.mark.slow
WINDOW = 5
IDS = np.random.default_rng(0).integers(2, VOCAB, (2, 12)).astype(np.int32)  # 12 > WINDOW
NAMES = tuple(FAMILIES)
# The slow checks run on three families in `nox -s slow` (both routers of experts;
# local/global layers with query/key norms) and on every family in `nox -s exhaustive`.
EXHAUSTIVE = pytest.mark.exhaustive
MOST = ("mixtral", "qwen3_moe", "gemma3")
EACH = [n if n in MOST else pytest.param(n, marks=EXHAUSTIVE) for n in NAMES]


def hf_config(name: str) -> Any:
    """The family's transformers config, written in transformers' own terms."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=1,
    )
    t = transformers
    if name == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        return t.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=True)
    if name == "qwen2":  # a window on layer 1, Q/K/V biases, tied head
        return t.Qwen2Config(
            **common,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
            tie_word_embeddings=True,
        )
    if name == "qwen3":
        return t.Qwen3Config(**common, head_dim=16, attention_bias=True)
    if name == "mistral":
        return t.MistralConfig(**common, sliding_window=WINDOW)
    if name == "mixtral":
        return t.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if name == "qwen3_moe":  # more experts than Mixtral, narrower, top-k weights as drawn
        return t.Qwen3MoeConfig(
            **common,
            head_dim=16,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
        )
    if name == "gemma2":
        return t.Gemma2Config(
            **common,
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=12,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=1.0,
        )
    if name == "gemma3":  # local, global; the global layer's RoPE scaled
        rope = {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        }
        return t.Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=WINDOW,
            sliding_window_pattern=2,
            query_pre_attn_scalar=12,
            rope_parameters=rope,
            final_logit_softcapping=1.0,
        )
    if name == "phi3":
        return t.Phi3Config(**common, sliding_window=WINDOW)
    if name == "phi3-longrope":  # sequences past 8 positions take the long factors
        rope = {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(4)],
            "long_factor": [2.0 + 0.5 * i for i in range(4)],
            "attention_factor": 1.2,  # below the default's sqrt(2), which sharpens rounding
        }
        return t.Phi3Config(**common, rope_parameters=rope, original_max_position_embeddings=8)
    raise KeyError(name)


def random_hf_model(name: str) -> Any:
    """Matrices drawn larger than transformers' init, norms near their identity, so
    that a wrong mapping shows and greedy tokens vary."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name)).eval()
    offset = 0.0 if name.startswith("gemma") else 1.0  # Gemma's norms scale by 1 + w
    with torch.no_grad():
        for key, p in model.named_parameters():
            if p.ndim > 1:
                # Gemma's embeddings are scaled by sqrt(hidden) and tied to its head: drawn
                # smaller, so that the residual is not one token's embedding.
                small = name.startswith("gemma") and "embed" in key
                p.normal_(0.0, 0.5 / np.sqrt(p.shape[1]) if small else 0.5)
            elif "norm" in key:
                p.copy_(offset + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, tuple[Path, Any]] = {}

    def get(name: str) -> tuple[Path, Any]:
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            model = random_hf_model(name)
            model.save_pretrained(folder)
            made[name] = (folder, model)
        return made[name]

    return get


def torch_logits(model: Any, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()


@eqx.filter_jit
def forward(model: Any, ids: jax.Array) -> jax.Array:
    return jax.vmap(model)(ids)


# ----------------------------------------------------------------------------- transformers


# Fast: four families that between them have every option but the query/key norms
# (experts, windows on some layers, soft caps, 1 + w norms, biases, fused projections,
# tied heads). The others, and LongRoPE's long factors (Phi-3 128k) past 8 positions,
# are slow; the frequencies of every RoPE type are checked in the fast tests below.
FAST = ("qwen2", "mixtral", "qwen3_moe", "gemma2", "phi3")


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=SLOW) for n in (*NAMES, "phi3-longrope")]
)
def test_logits_and_to_hf_equal_transformers(checkpoints, name: str, tmp_path) -> None:
    folder, hf_model = checkpoints(name)
    model = rc.models.from_hf(folder)
    assert type(model).__name__ == FAMILIES.get(name, "Phi3")
    want = torch_logits(hf_model, IDS)
    diff = np.abs(np.asarray(forward(model, jnp.asarray(IDS))) - want)
    assert diff.max() <= 1e-4, diff.max()
    # Written back: the checkpoint's tensors bit for bit, read by transformers as its own.
    model.to_hf(tmp_path)
    theirs, ours = (
        load_file(folder / "model.safetensors"),
        load_file(tmp_path / "model.safetensors"),
    )
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == hf_config(name).model_type
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(hf_model)
    np.testing.assert_array_equal(torch_logits(reloaded, IDS), want)


# Scanned layers of two kinds pick theirs with lax.switch (Qwen 2 and Gemma); their
# stacked arrays are written back as the checkpoint's one tensor per layer.
@pytest.mark.slow
@pytest.mark.parametrize("name", EACH)
def test_scanned_layers_equal_transformers_and_write_back(checkpoints, name: str, tmp_path) -> None:
    folder, hf_model = checkpoints(name)
    model = rc.models.from_hf(folder, scan_layers=True)
    assert isinstance(model.blocks, rc.models.DecoderBlock)
    got = np.asarray(forward(model, jnp.asarray(IDS)))
    assert np.abs(got - torch_logits(hf_model, IDS)).max() <= 1e-4
    model.to_hf(tmp_path)
    theirs, ours = (
        load_file(folder / "model.safetensors"),
        load_file(tmp_path / "model.safetensors"),
    )
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)


def hf_greedy(hf_model: Any, prompt: np.ndarray, n: int, eos: int) -> list[int]:
    ids = torch.tensor(prompt[None], dtype=torch.long)
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    new = out[0, len(prompt) :].tolist()
    return new + [eos] * (n - len(new))


@pytest.mark.slow
@pytest.mark.parametrize("name", EACH)
def test_greedy_generation_equals_transformers(checkpoints, name: str) -> None:
    folder, hf_model = checkpoints(name)
    model = rc.models.from_hf(folder)
    # Ragged prompts (12 and 7 tokens) and 8 new tokens: past the window of 5.
    lengths, n = np.array([12, 7], np.int32), 8
    free = hf_greedy(hf_model, IDS[0], n, eos=0)
    assert len(set(free)) > 2, f"degenerate model: {free}"
    eos = free[2]  # the first row stops at step 3
    want = [hf_greedy(hf_model, IDS[i, : lengths[i]], n, eos) for i in range(2)]
    got = rc.models.generate(
        model, jnp.asarray(IDS), prompt_lengths=lengths, max_new_tokens=n, eos_id=eos
    )
    assert np.asarray(got).tolist() == want


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "qwen2", "mistral"])
def test_cached_generation_equals_the_uncached_and_sampling_keeps_to_the_top_k(
    checkpoints, name: str
) -> None:
    # Windows and soft caps on the cached path: the cache holds every position, the
    # mask keeps each query to its window. Scanned layers of two kinds, too.
    model = rc.models.from_hf(checkpoints(name)[0], scan_layers=True)
    prompt = jnp.asarray(IDS[:, :6])
    cached = rc.models.generate(model, prompt, max_new_tokens=7)
    uncached = rc.models.generate(model, prompt, max_new_tokens=7, use_cache=False)
    assert cached.tolist() == uncached.tolist()
    hot = rc.models.generate(
        model, prompt, max_new_tokens=7, temperature=3.0, top_k=3, key=jax.random.key(1)
    )
    logits = forward(model, jnp.concatenate([prompt, hot], axis=1))[:, 5:-1]
    assert bool(jnp.all(jnp.any(jax.lax.top_k(logits, 3)[1] == hot[..., None], axis=-1)))


def test_rope_frequencies_equal_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from redcoast.models.rope import rope_from_parameters

    cases = {
        "linear": {"factor": 4.0},
        "dynamic": {"factor": 4.0},
        "yarn": {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16},
        "llama3": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        "longrope": {
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.3 * i for i in range(8)],
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    }
    for kind, settings in cases.items():
        params = {"rope_type": kind, "rope_theta": 5000.0, **settings}
        config = transformers.LlamaConfig(
            hidden_size=64,
            num_attention_heads=4,
            max_position_embeddings=64,
            rope_parameters=dict(params),
        )
        ours = rope_from_parameters(
            params, rope_theta=5000.0, rotary_dim=16, max_position_embeddings=64
        )
        for length in (10, 100):  # dynamic and longrope change past 64 and 16 positions
            theirs, scaling = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=length)
            got = np.asarray(ours.frequencies(jnp.arange(length)))
            np.testing.assert_allclose(got, theirs.numpy(), rtol=2e-7, err_msg=kind)
            assert ours.attention_scaling == pytest.approx(scaling, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_loss_with_the_balancing_term_equals_transformers(checkpoints, name: str) -> None:
    folder, hf_model = checkpoints(name)
    ids = torch.tensor(IDS, dtype=torch.long)
    with torch.no_grad():
        out = hf_model(ids, labels=ids, output_router_logits=True)
    model = rc.models.from_hf(folder)
    loss, metrics = rc.models.moe_lm_loss(model, {"input_ids": jnp.asarray(IDS)})
    np.testing.assert_allclose(float(metrics["aux_loss"]), float(out.aux_loss), rtol=1e-5)
    np.testing.assert_allclose(float(loss), float(out.loss), rtol=1e-5)
    # With a padding mask, as transformers' attention_mask.
    mask = np.ones_like(IDS)
    mask[1, 8:] = 0
    with torch.no_grad():
        masked = hf_model(ids, attention_mask=torch.tensor(mask), output_router_logits=True)
    _, router = jax.vmap(model.with_router_logits)(jnp.asarray(IDS))
    experts, top_k = model.config.experts
    assert router.shape == (2, 2, 12, experts)  # batch, layers, tokens, experts
    aux = rc.models.load_balancing_loss(router, top_k, jnp.asarray(mask, bool))
    np.testing.assert_allclose(float(aux), float(masked.aux_loss), rtol=1e-5)


# ----------------------------------------------------------------------------- split


def layout(model: eqx.Module, specs: object) -> dict[str, tuple]:
    flat = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]
    leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))
    return {
        path_str(p): tuple(s) + (None,) * (a.ndim - len(s))
        for (p, a), s in zip(flat, leaves, strict=True)
    }


def build(name: str, *, scan_layers: bool = False, remat: str = "none", **options: Any) -> Any:
    cls = functools.partial(getattr(rc.models, FAMILIES[name]), remat=remat)
    return drawn(cls, family_config(name, **options), scan_layers=scan_layers)


ROWS = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (8, 16)), jnp.int32)


def lm_loss(model: Any, batch: dict, key: jax.Array) -> jax.Array:
    return rc.models.lm_loss(model, {"input_ids": batch["ids"]})[0]


@pytest.mark.parametrize(
    ("name", "scan_layers"),
    [
        pytest.param(n, scan, marks=() if (n, scan) == ("mixtral", False) else pytest.mark.slow)
        for n in NAMES
        for scan in (False, True)
    ],
)
def test_the_rules_give_megatrons_layout(name: str, scan_layers: bool) -> None:
    """Column Q/K/V, gate and up, row O and down, whole experts per shard (Mixtral),
    Phi-3's fused projections split as LLaMA's separate ones, norms replicated."""
    model = build(name, scan_layers=scan_layers, kv_heads=4)
    for n in (2, 4):
        plan = rc.sharding_plan(model, n, example_call=lambda m: jax.vmap(m)(ROWS))
        got, want = layout(model, plan.specs), layout(model, megatron_specs(model, n))
        assert got == want, {p: (got[p], want[p]) for p in got if got[p] != want[p]}
    if name == "mixtral":
        assert "expert" in str(plan)


def steps(model: Any, mesh: Any = None, *, loss_fn: Any = lm_loss, **options: Any) -> tuple:
    """Two SGD steps on `ROWS`, the model placed on `mesh` (None: one device)."""
    batch = {"ids": ROWS}
    key = jax.random.key(0)
    fsdp = options.pop("fsdp", False)
    if mesh is not None:
        model = rc.place(model, mesh, example_call=lambda m: loss_fn(m, batch, key), fsdp=fsdp)
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        if options.pop("sequence_parallel", False):
            options["sequence_parallel"] = rc.SequenceParallel.of(model)
        if options.pop("context_parallel", False):
            options["context_parallel"] = rc.ContextParallel(mesh)
            batch = jax.device_put({"ids": ROWS}, NamedSharding(mesh, P()))
    optimizer = optax.sgd(0.5)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = eqx.filter_jit(rc.train_step(loss_fn, optimizer, jit=False, **options))
    losses = []
    for i in range(2):
        model, state, metrics = step(model, state, batch, jax.random.fold_in(key, i))
        losses.append(float(metrics["loss"]))
    return model, losses


def assert_same(got: tuple, want: tuple, rtol: float = 1e-5) -> None:
    np.testing.assert_allclose(got[1], want[1], rtol=rtol)
    got_leaves = jax.tree.leaves(eqx.filter(got[0], eqx.is_array))
    want_leaves = jax.tree.leaves(eqx.filter(want[0], eqx.is_array))
    for g, w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=1e-6)


SPLITS = {
    "tp": dict(n_model=2),
    "tp-fsdp": dict(n_model=2, fsdp=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("name", EACH)
def test_a_sharded_train_step_equals_one_device(name: str, split: str) -> None:
    options = dict(SPLITS[split])
    scan = split == "tp-fsdp"
    mesh = rc.make_mesh(options.pop("n_model"))
    want = steps(build(name, scan_layers=scan))
    assert_same(steps(build(name, scan_layers=scan), mesh, **options), want)


# Each option of `train_step` beside the split, on the families it concerns most.
OPTIONS = {
    "sequence-parallel": ("gemma2", dict(sequence_parallel=True), 2),
    "sequence-parallel-moe": ("mixtral", dict(sequence_parallel=True, fsdp=True), 2),
    "remat-full": ("qwen2", dict(), 2),
    "context-parallel": ("llama3", dict(context_parallel=True), 2),
    "context-parallel-moe": ("mixtral", dict(context_parallel=True), 2),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", [c if "moe" not in c else pytest.param(c, marks=EXHAUSTIVE) for c in OPTIONS]
)
def test_each_option_beside_the_split_equals_one_device(case: str) -> None:
    name, options, n_model = OPTIONS[case]
    remat = "full" if case.startswith("remat") else "none"

    def make() -> Any:
        return build(name, scan_layers=True, remat=remat)

    assert_same(steps(make(), rc.make_mesh(n_model), **options), steps(make()))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "mistral"])
def test_context_parallelism_splits_windows_and_soft_caps(name: str) -> None:
    # The ring runs each layer's window and soft cap on the blocks it holds.
    def make() -> Any:
        return build(name, scan_layers=True)

    assert_same(steps(make(), rc.make_mesh(2), context_parallel=True), steps(make()))


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("name", NAMES)
def test_bf16_remat_and_every_option_run_for_every_family(name: str) -> None:
    for remat in ("dots", "attention"):
        _, losses = steps(build(name, scan_layers=True, remat=remat), precision="bf16")
        _, want = steps(build(name, scan_layers=True))
        np.testing.assert_allclose(losses, want, rtol=3e-2)


# ----------------------------------------------------------------------------- PEFT


TARGETS = {
    "phi3": ["o_proj", "down_proj"],  # PEFT's qkv_proj and gate_up_proj are fused
    "mixtral": ["q_proj", "v_proj", "o_proj"],  # experts are arrays, not Linears
    "qwen3_moe": ["q_proj", "v_proj", "o_proj"],
}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")
@pytest.mark.parametrize("name", EACH)
def test_a_peft_adapter_round_trips_with_its_logits(checkpoints, name: str, tmp_path) -> None:
    peft = pytest.importorskip("peft")
    folder, hf_model = checkpoints(name)
    targets = TARGETS.get(name, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
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
    base = torch_logits(hf_model, IDS)
    # PEFT adapts the module in place: unloaded after, for the other tests.
    theirs = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
    try:
        got = np.asarray(forward(ours, jnp.asarray(IDS)))
        assert np.abs(got - torch_logits(theirs, IDS)).max() <= 1e-4
        assert np.abs(got - base).max() > 1e-3  # the adapters change the logits
    finally:
        theirs.unload()
    back = rc.lora.load_peft(rc.models.from_hf(folder), tmp_path / "adapter")
    np.testing.assert_allclose(np.asarray(forward(back, jnp.asarray(IDS))), got, atol=1e-5)


@pytest.mark.slow
def test_phi3s_fused_projections_have_no_peft_module_of_their_own(checkpoints, tmp_path) -> None:
    model = rc.models.from_hf(checkpoints("phi3")[0])
    fused = rc.lora.apply(model, ["q_proj"], rank=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"\['blocks.0.attn.q_proj'.*no transformers module"):
        rc.lora.save_peft(fused, tmp_path / "x")


# ----------------------------------------------------------------------------- presets


PUBLISHED = {  # preset -> (parameters in billions, to 2 decimals)
    "llama-3.1-8b": 8.03,
    "llama-3.2-1b": 1.24,
    "llama-3.2-3b": 3.21,
    "qwen2.5-7b": 7.62,
    "qwen3-8b": 8.19,
    "mistral-7b": 7.24,
    "mixtral-8x7b": 46.70,
    "gemma-2-9b": 9.24,
    "phi-3-mini": 3.82,
}
FAST_PRESETS = ("llama-3.2-1b", "llama-3.2-3b", "mixtral-8x7b", "phi-3-mini")


@pytest.mark.parametrize(
    "preset",
    [p if p in FAST_PRESETS else pytest.param(p, marks=SLOW) for p in PUBLISHED],
)
def test_presets_have_the_published_sizes(preset: str) -> None:
    cls, config = rc.models.preset(preset)
    model = eqx.filter_eval_shape(cls, config, scan_layers=True, key=jax.random.key(0))
    n = sum(x.size for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct))
    assert round(n / 1e9, 2) == PUBLISHED[preset]


# ----------------------------------------------------------------------------- bad input


def edited(src: Path, dst: Path, **changes: Any) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        (
            "llama3",
            {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1.0}},
            "rope_type='proportional' is not implemented",
        ),
        (
            "llama3",
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1.0}},
            "rope_type='llama3' needs 'low_freq_factor'",
        ),
        (
            "llama3",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "mscale": 1.0}},
            r"rope_type='linear' does not take \['mscale'\]",
        ),
        ("gemma2", {"hidden_activation": "gelu_fancy"}, "unsupported activation 'gelu_fancy'"),
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ("mistral", {"mlp_bias": True}, "mlp_bias=True asks for a variant of mistral"),
        ("qwen2", {"attention_bias": True}, "attention_bias=True asks for a variant"),
        ("qwen2", {"use_sliding_window": False}, "sliding_attention layers but sliding_window"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
        (
            "phi3",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            "transformers' Phi-3 takes 'longrope'",
        ),
        ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not implemented"),
        ("gemma3", {"model_type": "gemma3"}, r"model_type='gemma3'.*'gemma3_text'"),
    ],
    ids=lambda x: x if isinstance(x, str) and len(x) < 12 else None,
)
def test_a_setting_redcoast_would_ignore_is_an_error_naming_it(
    checkpoints, tmp_path, name: str, changes: dict, message: str
) -> None:
    folder = edited(checkpoints(name)[0], tmp_path / "edited", **changes)
    with pytest.raises((ValueError, KeyError), match=message):
        rc.models.from_hf(folder)


def test_tensors_that_do_not_match_the_config_are_named(checkpoints, tmp_path) -> None:
    folder = edited(checkpoints("mixtral")[0], tmp_path / "mixtral")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        rc.models.MissingTensorError,
        match=r"'model.layers.1.block_sparse_moe.experts.3.w2.weight' \(needed for blocks.1.mlp.w2",
    ):
        rc.models.from_hf(folder)
    folder = edited(checkpoints("phi3")[0], tmp_path / "phi3")
    tensors = load_file(folder / "model.safetensors")
    key = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[key] = tensors[key][:40]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"'{key}' has shape \(40, 32\).*expected 64 rows"):
        rc.models.from_hf(folder)
    folder = edited(checkpoints("qwen3")[0], tmp_path / "qwen3", attention_bias=False)
    with pytest.raises(ValueError, match=r"does not use: \['model.layers.0.self_attn.k_proj.bias"):
        rc.models.from_hf(folder)
