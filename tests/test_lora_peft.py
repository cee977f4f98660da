"""LoRA adapters through Hugging Face PEFT's folder format, both ways, on logits.

Needs the `hf` extra (torch, transformers, peft).
"""

from __future__ import annotations

import json

import chex
import equinox as eqx
import jax
import numpy as np
import pytest
from tiny import hf_decoder_config

import redcoast as rc

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
# peft 0.21 reads an attribute transformers 5 has deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

VOCAB = 128
IDS = np.random.default_rng(0).integers(2, VOCAB, (2, 12)).astype(np.int32)
TARGETS = {
    "llama": ["q_proj", "v_proj", "o_proj", "down_proj"],
    # GPT-2's Q, K and V are one fused c_attn in transformers: its own Linears only.
    "gpt2": ["o_proj", "fc_in", "fc_out"],
}


def _base(arch, folder):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_decoder_config(arch, vocab=VOCAB, width=32)
    )
    model.eval().save_pretrained(folder)
    return model


def _torch_logits(model):
    with torch.no_grad():
        return model(torch.tensor(IDS, dtype=torch.long)).logits.numpy()


@eqx.filter_jit
def _logits(model):
    return jax.vmap(model)(IDS)


def _nonzero_b(model):
    def fill(x):
        if isinstance(x, rc.lora.LoRALinear):
            w = x.lora_b.weight
            return eqx.tree_at(
                lambda m: m.lora_b.weight,
                x,
                0.2 * jax.random.normal(jax.random.key(w.size), w.shape),
            )
        return x

    return jax.tree.map(fill, model, is_leaf=lambda x: isinstance(x, rc.lora.LoRALinear))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_an_adapter_saved_here_runs_in_peft_with_our_logits(arch, tmp_path):
    hf_model = _base(arch, tmp_path / "base")
    base_logits = _torch_logits(hf_model)
    ours = rc.lora.apply(
        rc.models.from_hf(tmp_path / "base", scan_layers=arch == "llama"),
        TARGETS[arch],
        rank=4,
        alpha=8,
        key=jax.random.key(1),
    )
    ours = _nonzero_b(ours)
    rc.lora.save_peft(ours, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["fan_in_fan_out"]) == (4, 8.0, arch == "gpt2")
    theirs = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
    got = np.asarray(_logits(ours))
    assert np.abs(got - _torch_logits(theirs)).max() <= 1e-4
    assert np.abs(got - base_logits).max() > 1e-3  # the adapter changes the logits


def test_a_peft_adapter_loads_here_with_its_logits(tmp_path):
    hf_model = _base("llama", tmp_path / "base")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["k_proj", "up_proj"], init_lora_weights=False
    )
    theirs = peft.get_peft_model(hf_model, config).eval()
    theirs.save_pretrained(tmp_path / "adapter")
    ours = rc.lora.load_peft(rc.models.from_hf(tmp_path / "base"), tmp_path / "adapter")
    assert isinstance(ours.blocks[1].mlp.up_proj, rc.lora.LoRALinear)
    assert isinstance(ours.blocks[1].mlp.down_proj, eqx.nn.Linear)
    assert np.abs(np.asarray(_logits(ours)) - _torch_logits(theirs)).max() <= 1e-4
    # Saved again, the tensors are PEFT's own.
    rc.lora.save_peft(ours, tmp_path / "again")
    from safetensors.numpy import load_file

    chex.assert_trees_all_close(
        load_file(str(tmp_path / "again" / "adapter_model.safetensors")),
        load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")),
    )


def test_peft_bad_input(tmp_path):
    _base("gpt2", tmp_path / "base")
    gpt2 = rc.models.from_hf(tmp_path / "base")
    fused = rc.lora.apply(gpt2, ["q_proj"], rank=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="into one c_attn"):
        rc.lora.save_peft(fused, tmp_path / "x")
    with pytest.raises(ValueError, match="no LoRA layers"):
        rc.lora.save_peft(gpt2, tmp_path / "x")
    table = rc.lora.apply(gpt2, ["embed_tokens", "fc_in"], rank=2, key=jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"\['embed_tokens'\] adapt an embedding table.*rc.lora.merge"
    ):
        rc.lora.save_peft(table, tmp_path / "x")
    ok = rc.lora.apply(gpt2, ["fc_in"], rank=2, key=jax.random.key(0))
    rc.lora.save_peft(ok, tmp_path / "dora")
    path = tmp_path / "dora" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "use_dora": True}))
    with pytest.raises(ValueError, match=r"PEFT options \{'use_dora': True\} are not supported"):
        rc.lora.load_peft(gpt2, tmp_path / "dora")
    with pytest.raises(TypeError, match="need a model with a Hugging Face tensor map"):
        rc.lora.save_peft(
            rc.lora.apply(
                eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0)),
                "layers.0",
                rank=2,
                key=jax.random.key(0),
            ),
            tmp_path / "y",
        )


def _llama_base(folder, layers):
    torch.manual_seed(0)
    config = hf_decoder_config("llama", vocab=VOCAB, width=32)
    config.num_hidden_layers = layers
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.eval().save_pretrained(folder)
    return model


def _peft_adapter(hf_model, folder, **kw):
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **kw)
    peft.get_peft_model(hf_model, config).save_pretrained(folder)


@pytest.mark.parametrize("scan_layers", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize(
    "targets", [["q_proj", "v_proj"], r".*\.self_attn\.(q|v)_proj"], ids=["names", "regex"]
)
def test_a_peft_adapter_of_a_shallower_model_is_refused(tmp_path, targets, scan_layers):
    _peft_adapter(_llama_base(tmp_path / "two", 2), tmp_path / "adapter", target_modules=targets)
    _llama_base(tmp_path / "three", 3)
    deeper = rc.models.from_hf(tmp_path / "three", scan_layers=scan_layers)
    with pytest.raises(ValueError, match="selects 2 module") as err:
        rc.lora.load_peft(deeper, tmp_path / "adapter")
    message = str(err.value)
    assert "['model.layers.2.self_attn.q_proj', 'model.layers.2.self_attn.v_proj']" in message
    assert "load it onto the model it was trained on" in message.lower()
    # Onto its own 2-layer base it loads.
    two = rc.lora.load_peft(rc.models.from_hf(tmp_path / "two"), tmp_path / "adapter")
    assert isinstance(two.blocks[1].attn.v_proj, rc.lora.LoRALinear)


def test_a_peft_adapter_on_some_layers_loads_onto_those_layers(tmp_path):
    """What the config does not select may lack tensors: `layers_to_transform` and a
    regular expression naming layers leave the others plain, as in PEFT."""
    _llama_base(tmp_path / "base", 3)

    def fresh():
        return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()

    kinds = {
        "layers_to_transform": {
            "target_modules": ["q_proj", "v_proj"],
            "layers_to_transform": [0, 2],
        },
        "regex": {"target_modules": r"model\.layers\.[02]\.self_attn\.(q|v)_proj"},
    }
    for name, kw in kinds.items():
        _peft_adapter(fresh(), tmp_path / name, **kw)
        theirs = peft.PeftModel.from_pretrained(fresh(), tmp_path / name).eval()
        ours = rc.lora.load_peft(rc.models.from_hf(tmp_path / "base"), tmp_path / name)
        adapted = [isinstance(b.attn.q_proj, rc.lora.LoRALinear) for b in ours.blocks]
        assert adapted == [True, False, True], name
        got = np.asarray(_logits(ours))
        assert np.abs(got - _torch_logits(theirs)).max() <= 1e-4
        assert np.abs(got - _torch_logits(fresh())).max() > 1e-3  # the adapter is used
    # Scanned layers hold one adapter for all of them: a clear error, not a plain layer.
    scanned = rc.models.from_hf(tmp_path / "base", scan_layers=True)
    with pytest.raises(ValueError, match=r"missing for layer\(s\) \[1\].*scan_layers=False"):
        rc.lora.load_peft(scanned, tmp_path / "regex")


@pytest.mark.parametrize("alpha", [0, -8, "NaN", "Infinity"])
def test_peft_lora_alpha_must_be_a_finite_number_above_zero(tmp_path, alpha):
    _base("gpt2", tmp_path / "base")
    gpt2 = rc.models.from_hf(tmp_path / "base")
    rc.lora.save_peft(rc.lora.apply(gpt2, ["fc_in"], rank=2, key=jax.random.key(0)), tmp_path / "a")
    path = tmp_path / "a" / "adapter_config.json"
    # JSON's own text for them: Python's json reads NaN and Infinity as floats.
    text = path.read_text().replace('"lora_alpha": 16.0', f'"lora_alpha": {alpha}')
    path.write_text(text)
    shown = {"NaN": "nan", "Infinity": "inf"}.get(alpha, alpha)
    with pytest.raises(
        ValueError,
        match=rf"adapter_config.json: lora_alpha must be a finite number > 0.*got {shown}",
    ):
        rc.lora.load_peft(gpt2, tmp_path / "a")


def test_load_peft_onto_an_adapted_model_says_it_is_adapted(tmp_path):
    hf_model = _base("llama", tmp_path / "base")
    _peft_adapter(hf_model, tmp_path / "adapter", target_modules=["q_proj"])
    base = rc.models.from_hf(tmp_path / "base")
    loaded = rc.lora.load_peft(base, tmp_path / "adapter")
    for adapted in (loaded, rc.lora.apply(base, ["v_proj"], rank=2, key=jax.random.key(0))):
        with pytest.raises(
            ValueError, match=r"already has LoRA adapters at \['blocks\.0\.attn"
        ) as err:
            rc.lora.load_peft(adapted, tmp_path / "adapter")
        assert "rc.lora.merge" in str(err.value) and "select no" not in str(err.value)
    # Merged, it is a base model again.
    merged = rc.lora.load_peft(rc.lora.merge(loaded), tmp_path / "adapter")
    assert isinstance(merged.blocks[0].attn.q_proj, rc.lora.LoRALinear)
