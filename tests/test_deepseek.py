"""DeepSeek-V3 (and Moonlight) against transformers' `DeepseekV3ForCausalLM`.

Tiny random models (hidden 32, 4 heads, latents of 16, query/key heads of 8 + 4
rotated features, value heads of 6; 3 layers, the first dense, the others 8 experts
in 2 groups, 2 per token, one shared) saved with `save_pretrained`: redcoast must give
their logits, router logits and greedy tokens, write their tensors back bit for bit
for transformers to read, keep packed documents apart, and refuse what it does not
compute. Variants: low-rank queries with interleaved RoPE, and one `q_proj` with
YaRN's `mscale_all_dim`, attention biases, a tied head and unnormalised routing
weights (and, slow, RoPE on halves). Needs the `hf` extra.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import redcoast as rc

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_families import hf_greedy, torch_logits  # noqa: E402  (after the skips: needs torch)

VOCAB = 128
IDS = np.random.default_rng(0).integers(2, VOCAB, (2, 12)).astype(np.int32)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 16,
    "mscale": 0.8,
    "mscale_all_dim": 1.0,
}


def hf_config(name: str, **changes: Any) -> Any:
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        max_position_embeddings=64,
        rope_interleave=True,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=1,
    )
    if name == "q_proj":
        common |= dict(
            q_lora_rank=None,
            rope_parameters=YARN,
            attention_bias=True,
            tie_word_embeddings=True,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
        )
    else:  # "halves": RoPE on the halves of the rotated features, not on pairs
        common |= dict(q_lora_rank=24, rope_interleave=name != "halves")
    return transformers.DeepseekV3Config(**(common | changes))


def random_hf_model(name: str) -> Any:
    """Matrices drawn larger than transformers' init, norms near one, the routing bias
    and other vectors small: a wrong mapping shows, greedy tokens vary."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name)).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.3)
            elif "norm" in key:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
        for layer in model.model.layers[1:]:  # a buffer, not a parameter
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
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


@eqx.filter_jit
def forward(model: Any, ids: jax.Array, **options: jax.Array) -> jax.Array:
    return jax.vmap(lambda ids, options: model(ids, **options))(ids, options)


@eqx.filter_jit
def with_router_logits(model: Any, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jax.vmap(model.with_router_logits)(ids)


def assert_same_tensors(folder: Path, written: Path) -> None:
    theirs, ours = load_file(folder / "model.safetensors"), load_file(written / "model.safetensors")
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)


@pytest.mark.parametrize(
    ("name", "scan_layers"), [("mla", False), ("mla", True), ("q_proj", False), ("halves", False)]
)
def test_logits_equal_transformers_and_to_hf_is_read_back(
    checkpoints, name: str, scan_layers: bool, tmp_path
) -> None:
    folder, hf_model = checkpoints(name)
    model = rc.models.from_hf(folder, scan_layers=scan_layers)
    assert isinstance(model, rc.models.DeepseekV3)
    assert len(model.blocks) == 1 if not scan_layers else model.blocks.attn_norm.weight.ndim == 2
    want = torch_logits(hf_model, IDS)
    diff = np.abs(np.asarray(forward(model, jnp.asarray(IDS))) - want)
    assert diff.max() <= 1e-4, diff.max()
    model.to_hf(tmp_path)
    assert_same_tensors(folder, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "deepseek_v3" and written["head_dim"] == 4
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(hf_model)
    np.testing.assert_array_equal(torch_logits(reloaded, IDS), want)


def test_router_logits_equal_transformers(checkpoints) -> None:
    folder, hf_model = checkpoints("mla")
    model = rc.models.from_hf(folder)
    _, router = with_router_logits(model, jnp.asarray(IDS))
    with torch.no_grad():
        theirs = hf_model(torch.tensor(IDS, dtype=torch.long), output_router_logits=True)
    want = np.stack([r.reshape(*IDS.shape, -1).numpy() for r in theirs.router_logits], axis=1)
    assert router.shape == (2, 2, 12, 8)  # batch, MoE layers, tokens, experts
    np.testing.assert_allclose(np.asarray(router), want, atol=1e-5)


def test_packed_documents_equal_separate_calls(checkpoints) -> None:
    """Two documents packed into each row, (a, b) and (b, a): each document's logits
    are those of the row that starts with it, where nothing precedes it."""
    model = rc.models.from_hf(checkpoints("mla")[0])
    a, b = IDS[0, :6], IDS[1, :6]
    rows = jnp.asarray(np.stack([np.concatenate([a, b]), np.concatenate([b, a])]))
    packed = forward(
        model,
        rows,
        positions=jnp.tile(jnp.arange(6), (2, 2)),
        segment_ids=jnp.repeat(jnp.asarray([[0, 1]]), 6, axis=1).repeat(2, axis=0),
    )
    alone = forward(model, rows)[:, :6]
    np.testing.assert_allclose(np.asarray(packed[:, :6]), np.asarray(alone), atol=1e-5)
    np.testing.assert_allclose(np.asarray(packed[:, 6:]), np.asarray(alone[::-1]), atol=1e-5)
    assert np.abs(np.asarray(packed[:, 6:] - forward(model, rows)[:, 6:])).max() > 1e-2


@pytest.mark.parametrize("scan_layers", [False, True])
def test_greedy_generation_equals_transformers(checkpoints, scan_layers: bool) -> None:
    folder, hf_model = checkpoints("mla")
    model = rc.models.from_hf(folder, scan_layers=scan_layers)
    lengths, n = np.array([12, 7], np.int32), 8
    free = hf_greedy(hf_model, IDS[0], n, eos=0)
    assert len(set(free)) > 2, f"degenerate model: {free}"
    eos = free[2]  # the first row stops at step 3
    want = [hf_greedy(hf_model, IDS[i, : lengths[i]], n, eos) for i in range(2)]
    got = rc.models.generate(
        model, jnp.asarray(IDS), prompt_lengths=lengths, max_new_tokens=n, eos_id=eos
    )
    assert np.asarray(got).tolist() == want


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")
def test_a_peft_adapter_on_both_stacks_round_trips_and_decodes(checkpoints, tmp_path) -> None:
    """Adapters on the dense and the MoE layers are named after transformers' layers
    (the MoE stack's first is layer 1), and the cached path folds an adapted
    `kv_b_proj` into its queries as the plain one."""
    peft = pytest.importorskip("peft")
    folder, hf_model = checkpoints("mla")
    targets = ["q_b_proj", "kv_b_proj", "o_proj"]
    ours = rc.lora.apply(rc.models.from_hf(folder), targets, rank=2, key=jax.random.key(1))
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
    names = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.2.self_attn.kv_b_proj.lora_A.weight" in names
    base = torch_logits(hf_model, IDS)
    theirs = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
    try:
        got = np.asarray(forward(ours, jnp.asarray(IDS)))
        assert np.abs(got - torch_logits(theirs, IDS)).max() <= 1e-4
        assert np.abs(got - base).max() > 1e-3
    finally:
        theirs.unload()
    prompt = jnp.asarray(IDS[:, :6])
    cached = rc.models.generate(ours, prompt, max_new_tokens=5)
    assert (
        cached.tolist()
        == rc.models.generate(ours, prompt, max_new_tokens=5, use_cache=False).tolist()
    )


def test_the_multi_token_prediction_layer_is_skipped_as_transformers_skips_it(
    checkpoints, tmp_path
) -> None:
    folder, hf_model = checkpoints("mla")
    tensors = load_file(folder / "model.safetensors")
    # DeepSeek-V3's release stores its MTP module as the layer after the last.
    last = "model.layers.2."
    tensors |= {k.replace(last, "model.layers.3."): v for k, v in tensors.items() if last in k}
    for n_mtp, ok in ((1, True), (0, False)):
        copy = tmp_path / str(n_mtp)
        copy.mkdir()
        save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((folder / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": n_mtp}))
        if ok:
            model = rc.models.from_hf(copy)
            got = np.asarray(forward(model, jnp.asarray(IDS)))
            assert np.abs(got - torch_logits(hf_model, IDS)).max() <= 1e-4
        else:
            with pytest.raises(ValueError, match=r"does not use: \['model.layers.3"):
                rc.models.from_hf(copy)


# ----------------------------------------------------------------------------- config


def test_the_config_reads_and_writes_transformers_config() -> None:
    theirs = hf_config("q_proj")
    ours = rc.models.DeepseekV3Config.from_dict(theirs.to_dict())
    attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(
        theirs, layer_idx=0
    )
    assert ours.softmax_scale == attention.scaling
    assert ours.softmax_scale != 12**-0.5  # YaRN's mscale_all_dim
    assert ours.rope_scaling["mscale"] == 0.8 and ours.q_lora_rank is None
    again = transformers.DeepseekV3Config(**ours.to_dict()).to_dict()
    assert again == theirs.to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_key_value_heads": 2}, "num_key_value_heads=2 differs"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax' asks for a variant"),
        ({"topk_method": "greedy"}, "topk_method='greedy' asks for a variant"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2 asks for a variant"),
        ({"n_group": 3}, "n_routed_experts=8 is not a multiple of n_group=3"),
        ({"n_group": 8, "topk_group": 4}, "each group needs at least 2 experts"),
        ({"topk_group": 3}, "topk_group cannot exceed n_group"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds the 4 experts"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"rope_parameters": {**YARN, "factor": None}}, "mscale_all_dim but no factor"),
    ],
    ids=lambda x: next(iter(x)) if isinstance(x, dict) else None,
)
def test_what_redcoast_does_not_compute_is_refused(changes: dict, message: str) -> None:
    values = hf_config("mla").to_dict() | changes
    with pytest.raises(ValueError, match=message):
        rc.models.DeepseekV3Config.from_dict(values)


PUBLISHED = {  # preset -> (parameters, billions to 2 decimals; without both vocabulary tables)
    "deepseek-v3": (671.03, 669.17),  # DeepSeek-V3's 671B, its MTP module aside
    "moonlight-16b-a3b": (15.96, 15.29),
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_presets_have_the_published_sizes(preset: str) -> None:
    cls, config = rc.models.preset(preset)
    model = eqx.filter_eval_shape(cls, config, scan_layers=True, key=jax.random.key(0))
    n = sum(x.size for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct))
    tables = 2 * config.vocab_size * config.hidden_size
    assert (round(n / 1e9, 2), round((n - tables) / 1e9, 2)) == PUBLISHED[preset]
    if preset == "deepseek-v3":  # YaRN's 40-fold context
        want = 192**-0.5 * (0.1 * math.log(40) + 1) ** 2
        assert math.isclose(config.softmax_scale, want, rel_tol=1e-12)


# ----------------------------------------------------------------------------- split


def test_a_sharded_train_step_equals_one_device() -> None:
    """Two SGD steps split over 2 model shards and FSDP, scanned stacks, attention's
    scores recomputed, equal those on one device (test_families' check)."""
    from test_families import assert_same, steps
    from tiny import drawn

    config = rc.models.DeepseekV3Config.from_dict(hf_config("mla").to_dict())
    cls = functools.partial(rc.models.DeepseekV3, remat="attention")

    def make() -> Any:
        return drawn(cls, config, scan_layers=True)

    assert_same(steps(make(), rc.make_mesh(2), fsdp=True), steps(make()))


ROWS = np.random.default_rng(1).integers(2, VOCAB, (8, 12)).astype(np.int32)


@pytest.mark.parametrize(
    ("name", "scan_layers"), [("mla", False), ("mla", True), ("q_proj", False)]
)
def test_the_rules_split_latent_attention_as_megatron_based_mla(
    name: str, scan_layers: bool
) -> None:
    """Found from the dataflow, not the names: the low-rank `q_a_proj` and
    `kv_a_proj_with_mqa` (normed whole) replicated, `q_b_proj` / `q_proj` and `kv_b_proj`,
    reshaped into the heads attention reads, split on dim 0 by whole heads, `o_proj` on
    dim 1, the routed experts on their expert axis: Megatron-based MLA's layout (MaxText,
    vLLM, SGLang), and the compiled gradient step moves the model-axis bytes of that
    hand layout."""
    from test_families import layout
    from test_sharding import model_axis_traffic
    from tiny import drawn, megatron_specs

    config = rc.models.DeepseekV3Config.from_dict(hf_config(name).to_dict())
    model = drawn(rc.models.DeepseekV3, config, scan_layers=scan_layers)
    ids = jnp.asarray(ROWS)
    for n in (2, 4):
        plan = rc.sharding_plan(model, n, example_call=lambda m: jax.vmap(m)(ids))
        got = layout(model, plan.specs)
        stacks = ("blocks", "moe_blocks")
        layers = (
            [f"{s}." for s in stacks]
            if scan_layers
            else [f"blocks.{i}." for i in range(config.dense_layers)]
            + [f"moe_blocks.{i}." for i in range(config.num_hidden_layers - config.dense_layers)]
        )
        for at in layers:
            lead = (None,) if scan_layers else ()
            whole, column, row = (*lead, None, None), (*lead, "model", None), (*lead, None, "model")
            attn = at + "attn."
            if config.q_lora_rank is None:
                assert got[attn + "q_proj.weight"] == column
            else:
                assert got[attn + "q_a_proj.weight"] == whole
                assert got[attn + "q_a_layernorm.weight"] == whole[1:]
                assert got[attn + "q_b_proj.weight"] == column
            assert got[attn + "kv_a_proj_with_mqa.weight"] == whole
            assert got[attn + "kv_a_layernorm.weight"] == whole[1:]
            assert got[attn + "kv_b_proj.weight"] == column
            assert got[attn + "o_proj.weight"] == row
            if at.startswith("moe_blocks"):
                for w in ("w1", "w2", "w3"):
                    assert got[at + "mlp." + w] == (*lead, "model", None, None)
        want = layout(model, megatron_specs(model, n))
        assert got == want, {p: (got[p], want[p]) for p in got if got[p] != want[p]}
    if scan_layers:
        return
    ours = model_axis_traffic(model, plan.specs, 2, ids)
    hand = model_axis_traffic(model, megatron_specs(model, 2), 2, ids)
    assert ours["bytes"] == hand["bytes"], (ours, hand)
