"""Collective bytes of a compiled train step under four layouts, on 8 simulated devices.

For each model and each n_model_shards in (2, 4, 8) a train step (loss, gradients,
SGD update) is compiled for the mesh (8/n, n) and the collectives XLA inserted are
read back from the partitioned HLO. Models: the tiny reference architectures and the
zoo (`rc.models.GPT2`, `Llama`, `OPT`, `GPTJ`, the encoder-decoders `T5` and `BART`,
whose cross-attention and two FFNs are split too, and the ViT + GPT-2 captioner
`VisionEncoderDecoder`) at the same size, and the
architectures of `tests/architectures.py` (MoE, DiT, ViT, BERT, encoder-decoder,
scan-over-layers, raw-array MLP) and the zoo's text-conditioned `DiT`, each with its
own hand layout, LoRA GPT-2 and
LLaMA (rank 8 on every projection) against Megatron-LM's layout with its LoRA, and
today's families on the shared decoder (`--models family`: Llama 3, Qwen 2/3,
Mistral, Mixtral against expert parallelism, Gemma 2/3, Phi-3). Layouts:

- ours:        redcoast.sharding_plan with example_call (the dataflow rules)
- megatron:    the hand-written layout: Megatron-LM's (tests/tiny.py `megatron_specs`)
               for the decoders, the best of the architecture's hand layouts otherwise
- decl-order:  redcoast.sharding_plan without example_call (alternate by declaration)
- naive:       every weight split on dim 0

Targets: ours/megatron model-axis bytes <= 1.02, no all-gather of a split weight, and
per-device parameter bytes <= 1.05 x total / n_model_shards.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/bench_comm.py
     (`--models zoo` measures only the models whose name contains "zoo")
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc
from redcoast._tree_paths import path_str

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import architectures as arch
from hlo import collectives, summarize, weight_all_gathers
from tiny import FAMILIES, DeepMLP, TinyGPT, TinyGPTJ, TinyLlama, family_config, megatron_specs

KEY = jax.random.key(0)
MODELS: dict[str, Callable[[], eqx.Module]] = {
    "gpt (MHA+MLP, tied)": lambda: TinyGPT(512, 256, 4, 8, 64, key=KEY),
    "llama (SwiGLU down,gate,up)": lambda: TinyLlama(512, 256, 4, 8, 8, 688, key=KEY),
    "llama-gqa (2 KV heads)": lambda: TinyLlama(512, 256, 4, 8, 2, 688, key=KEY),
    "gptj (parallel block)": lambda: TinyGPTJ(512, 256, 4, 8, key=KEY),
    "deep mlp": lambda: DeepMLP((256, 1024, 1024, 1024, 1024, 256), key=KEY),
    "zoo gpt2": lambda: rc.models.GPT2(
        rc.models.GPT2Config(vocab_size=512, n_positions=64, n_embd=256, n_layer=4, n_head=8),
        key=KEY,
    ),
    "zoo llama (2 KV heads)": lambda: rc.models.Llama(
        rc.models.LlamaConfig(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
        ),
        key=KEY,
    ),
    "zoo opt": lambda: rc.models.OPT(
        rc.models.OPTConfig(
            vocab_size=512,
            hidden_size=256,
            ffn_dim=1024,
            num_hidden_layers=4,
            num_attention_heads=8,
            max_position_embeddings=64,
        ),
        key=KEY,
    ),
    "zoo t5 v1.1 (gated, cross)": lambda: rc.models.T5(
        rc.models.T5Config(
            vocab_size=512,
            d_model=256,
            d_kv=32,
            d_ff=688,
            num_layers=4,
            num_heads=8,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
        ),
        key=KEY,
    ),
    "zoo bart (post-LN, cross)": lambda: rc.models.BART(
        rc.models.BARTConfig(
            vocab_size=512,
            max_position_embeddings=64,
            d_model=256,
            encoder_layers=4,
            decoder_layers=4,
            encoder_attention_heads=8,
            decoder_attention_heads=8,
            encoder_ffn_dim=1024,
            decoder_ffn_dim=1024,
        ),
        key=KEY,
    ),
    "zoo vit + gpt2 captioner (cross)": lambda: rc.models.VisionEncoderDecoder(
        rc.models.VisionEncoderDecoderConfig(
            encoder=rc.models.ViTConfig(
                hidden_size=256,
                num_hidden_layers=4,
                num_attention_heads=8,
                intermediate_size=1024,
                image_size=32,
                patch_size=4,
            ),
            decoder=rc.models.GPT2Config(
                vocab_size=512,
                n_positions=64,
                n_embd=256,
                n_layer=4,
                n_head=8,
                add_cross_attention=True,
            ),
        ),
        key=KEY,
    ),
    "zoo gptj": lambda: rc.models.GPTJ(
        rc.models.GPTJConfig(
            vocab_size=512, n_positions=64, n_embd=256, n_layer=4, n_head=8, rotary_dim=16
        ),
        key=KEY,
    ),
}


# Today's families on the shared decoder (tests/tiny.py `family_config`: every variant on,
# windows of 16 of the 64 tokens), against Megatron-LM's layout; Mixtral's 8 experts
# against expert parallelism written by hand (whole experts per shard).
FAMILY_ROWS = {
    "llama3": "family llama3 (rope llama3, tied)",
    "qwen2": "family qwen2 (qkv bias, windows)",
    "qwen3": "family qwen3 (q/k norms)",
    "mistral": "family mistral (window)",
    "mixtral": "family mixtral (8 experts, top-2)",
    "gemma2": "family gemma2 (caps, local/global)",
    "gemma3": "family gemma3 (q/k norms, local)",
    "phi3": "family phi3 (fused qkv, gate_up)",
}


def family(name: str) -> eqx.Module:
    config = family_config(
        name, vocab=512, width=256, layers=4, heads=8, kv_heads=8, ffn=688, window=16, experts=8
    )
    return getattr(rc.models, FAMILIES[name])(config, key=KEY)


MODELS.update({row: (lambda name=name: family(name)) for name, row in FAMILY_ROWS.items()})


# Architectures beyond the zoo: (model, hand layouts by path); the best hand layout counts.
ARCHS: dict[str, tuple[Callable[[], eqx.Module], tuple[dict[str, P], ...]]] = {
    "moe top-2 (4 experts, einsum)": (
        lambda: arch.MoELM(512, 256, 4, 8, 512, 4, 64, key=KEY),
        (arch.MOE_EXPERT_PARALLEL, arch.MOE_MEGATRON),
    ),
    "dit (adaLN-Zero)": (
        lambda: arch.DiT(4, 32, 4, 256, 4, 8, key=KEY),
        (arch.DIT_LAYOUT,),
    ),
    "zoo dit (text-conditioned, adaLN-Zero)": (
        lambda: rc.models.DiT(
            rc.models.DiTConfig(
                image_size=32,
                patch_size=4,
                hidden_size=256,
                num_layers=4,
                num_heads=8,
                vocab_size=512,
            ),
            key=KEY,
        ),
        (arch.ZOO_DIT_LAYOUT,),
    ),
    "vit (conv stem, 10 classes)": (
        lambda: arch.ViT(3, 32, 4, 256, 4, 8, 10, key=KEY),
        (arch.VIT_LAYOUT,),
    ),
    "bert (pooler, 3 classes)": (
        lambda: arch.BertClassifier(512, 256, 4, 8, 64, 3, key=KEY),
        (arch.BERT_LAYOUT,),
    ),
    "encoder-decoder": (
        lambda: arch.EncoderDecoder(512, 256, 2, 8, key=KEY),
        (arch.ENC_DEC_LAYOUT,),
    ),
    "scan-over-layers decoder": (
        lambda: arch.ScanDecoder(512, 256, 4, 8, key=KEY),
        (arch.SCAN_LAYOUT,),
    ),
    "raw-array mlp (einsum)": (
        lambda: arch.RawMLP((256, 1024, 256, 1024, 256), key=KEY),
        (arch.RAW_MLP_LAYOUT,),
    ),
}
MODELS.update({name: make for name, (make, _) in ARCHS.items()})


def gpt2_50257(vocab_multiple: int) -> eqx.Module:
    config = rc.models.GPT2Config(vocab_size=50257, n_positions=64, n_embd=256, n_layer=4, n_head=8)
    return rc.models.GPT2(dataclasses.replace(config, vocab_multiple=vocab_multiple), key=KEY)


# GPT-2's real vocabulary divides no shard count: as is, and padded to a multiple of
# 512 (= 128 x 4 shards, Megatron-LM's make-vocab-size-divisible-by); both against
# Megatron's layout of the padded model.
PADDED = {
    "zoo gpt2 vocab 50257": lambda: gpt2_50257(1),
    "zoo gpt2 vocab 50257 padded": lambda: gpt2_50257(512),
}
MODELS.update(PADDED)


def lora(model: eqx.Module) -> eqx.Module:
    """`model` with rank-8 LoRA on every projection, B nonzero (as after training)."""
    wrapped = rc.lora.apply(model, lambda *_: True, rank=8, key=jax.random.key(2))
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.full_like(x, 0.01) if "lora_b" in path_str(p) else x,
        wrapped,
    )


# LoRA models against Megatron-LM's layout with its LoRA (tests/tiny.py `_lora_spec`).
LORA = {
    "lora zoo gpt2": lambda: lora(MODELS["zoo gpt2"]()),
    "lora zoo llama (8 KV heads)": lambda: lora(
        rc.models.Llama(
            rc.models.LlamaConfig(
                vocab_size=512,
                hidden_size=256,
                intermediate_size=688,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=8,
            ),
            key=KEY,
        )
    ),
    "lora zoo llama (2 KV heads)": lambda: lora(MODELS["zoo llama (2 KV heads)"]()),
}
MODELS.update(LORA)


def batch_for(name: str) -> object:
    key = jax.random.key(1)
    if name in ("deep mlp", "raw-array mlp (einsum)"):
        return jax.random.normal(key, (16, 256))
    if name.startswith("dit"):
        return {"img": jax.random.normal(key, (16, 4, 32, 32)), "t": jnp.arange(16.0)}
    if name.startswith("vit"):
        return jax.random.normal(key, (16, 3, 32, 32))
    if name.startswith("zoo dit"):
        images = jax.random.normal(key, (16, 3, 32, 32))
        return {"images": images, "prompts": jax.random.randint(key, (16, 8), 0, 512)}
    if "captioner" in name:
        pixels = jax.random.normal(key, (16, 3, 32, 32))
        return {"pixels": pixels, "ids": jax.random.randint(key, (16, 64), 0, 512)}
    return jax.random.randint(key, (16, 64), 0, 512)


def forward(model: eqx.Module, x: object) -> jax.Array:
    """The model on a batch; an encoder-decoder reads the ids as source and target, a
    captioner images and ids, the zoo's DiT noised images at steps 0, 1, ... and prompts."""
    if isinstance(model, rc.models.DiT):
        assert isinstance(x, dict)
        steps = jnp.arange(x["images"].shape[0])
        return jax.vmap(model)(x["images"], steps, x["prompts"])
    if isinstance(model, rc.models.VisionEncoderDecoder):
        assert isinstance(x, dict)
        return jax.vmap(model)(x["pixels"], x["ids"])
    if isinstance(model, rc.models.AbstractSeq2SeqLM):
        return jax.vmap(lambda ids: model(ids, ids))(x)
    return jax.vmap(model)(x)


def loss(model: eqx.Module, x: object) -> jax.Array:
    out = forward(model, x)
    if not isinstance(x, jax.Array) or out.ndim != 3 or x.dtype != jnp.int32:
        return jnp.mean(out**2)
    logp = jax.nn.log_softmax(out, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp[:, :-1], x[:, 1:, None], axis=-1))


def naive_specs(model: eqx.Module, n: int) -> object:
    def spec(leaf: jax.Array) -> P:
        return P("model", None) if leaf.ndim >= 2 and leaf.shape[0] % n == 0 else P()

    return jax.tree_util.tree_map(spec, eqx.filter(model, eqx.is_array))


def hand_layout(name: str, model: eqx.Module, n: int, x: object) -> object:
    """Megatron-LM's layout for the decoders; the cheapest hand layout otherwise."""
    if name in PADDED:
        return megatron_specs(PADDED["zoo gpt2 vocab 50257 padded"](), n)
    if name not in ARCHS:
        return megatron_specs(model, n)
    layouts = [arch.layout(model, table) for table in ARCHS[name][1]]
    if len(layouts) == 1:
        return layouts[0]

    def model_bytes(specs: object) -> float:
        try:
            return measure(model, specs, n, x)["model_bytes"]
        except ValueError:  # rc.place refuses it: more shards than experts to split, say
            return math.inf

    return min(layouts, key=model_bytes)


def measure(model: eqx.Module, specs: object, n: int, x: object) -> dict[str, float]:
    mesh = rc.make_mesh(n)
    sharded = rc.place(model, mesh, specs=specs)
    params, static = eqx.partition(sharded, eqx.is_inexact_array)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))

    def step(p: object, x: jax.Array) -> tuple[object, jax.Array]:
        value, grads = jax.value_and_grad(lambda p: loss(eqx.combine(p, static), x))(p)
        return jax.tree_util.tree_map(lambda a, g: a - 1e-3 * g, p, grads), value

    compiled = jax.jit(step, donate_argnums=0).lower(params, xs).compile()
    found = collectives(compiled.as_text(), mesh)
    by_axis = summarize(found)
    flat_specs = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))
    flat = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
    split = [tuple(a.shape) for a, s in zip(flat, flat_specs, strict=True) if any(s)]
    total = sum(a.nbytes for a in jax.tree_util.tree_leaves(params))
    memory = compiled.memory_analysis()
    batch_per_device = sum(a.nbytes for a in jax.tree_util.tree_leaves(x)) / mesh.shape["data"]
    args = memory.argument_size_in_bytes - batch_per_device if memory else float("nan")
    return {
        "model_bytes": by_axis.get("model", {}).get("bytes", 0),
        "data_bytes": by_axis.get("data", {}).get("bytes", 0),
        "both_bytes": by_axis.get("both", {}).get("bytes", 0),
        "weight_all_gathers": len(weight_all_gathers(found, split)),
        "param_bytes_per_device": args,
        "param_ratio": args / (total / n),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument(
        "--models",
        default="",
        help="measure only the models whose name contains one of these (comma-separated)",
    )
    parser.add_argument("--out", default="bench-results/bench_comm.json")
    args = parser.parse_args()
    layouts: dict[str, Callable[[str, eqx.Module, int, object], object]] = {
        "ours": lambda _, m, n, x: (
            rc.sharding_plan(m, n, example_call=lambda mm: forward(mm, x)).specs
        ),
        "megatron": hand_layout,
        "decl-order": lambda _, m, n, x: rc.sharding_plan(m, n).specs,
        "naive": lambda _, m, n, x: naive_specs(m, n),
    }
    rows = []
    start = time.perf_counter()
    wanted = args.models.split(",")
    chosen = {name: make for name, make in MODELS.items() if any(w in name for w in wanted)}
    if not chosen:
        parser.error(f"--models {args.models!r} matches none of {list(MODELS)}")
    for name, make in chosen.items():
        model = make()
        x = batch_for(name)
        for n in args.shards:
            # Beyond the zoo only ours and the hand layout are compiled (time).
            chosen_layouts = (
                ("ours", "megatron") if name in {**ARCHS, **PADDED, **LORA} else layouts
            )
            result = {
                name_: measure(
                    PADDED["zoo gpt2 vocab 50257 padded"]()
                    if name in PADDED and name_ == "megatron"
                    else model,
                    layouts[name_](name, model, n, x),
                    n,
                    x,
                )
                for name_ in chosen_layouts
            }
            nan = {"model_bytes": float("nan")}
            ref = max(result["megatron"]["model_bytes"], 1)
            rows.append(
                {
                    "model": name,
                    "n_model_shards": n,
                    **{f"{k}.{field}": v for k, r in result.items() for field, v in r.items()},
                    "ratio_ours": result["ours"]["model_bytes"] / ref,
                    "ratio_decl": result.get("decl-order", nan)["model_bytes"] / ref,
                    "ratio_naive": result.get("naive", nan)["model_bytes"] / ref,
                }
            )
            print(f"  measured {name} at n={n}", flush=True)

    header = (
        f"{'model':29} {'n':>2} {'ours MB':>8} {'megatron':>8} {'ours/meg':>8} {'decl/meg':>8} "
        f"{'naive/meg':>9} {'W-gathers':>9} {'data MB':>8} {'param/ideal':>11}"
    )
    print(
        "\nmodel-axis collective bytes of one train step (MB per device, summed over instructions)"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['model']:29} {r['n_model_shards']:>2} {r['ours.model_bytes'] / 1e6:8.3f} "
            f"{r['megatron.model_bytes'] / 1e6:8.3f} {r['ratio_ours']:8.3f} {r['ratio_decl']:8.3f} "
            f"{r['ratio_naive']:9.3f} {r['ours.weight_all_gathers']:>9} "
            f"{r['ours.data_bytes'] / 1e6:8.3f} {r['ours.param_ratio']:11.3f}"
        )
    worst = max(r["ratio_ours"] for r in rows)
    print(
        f"\nworst ours/megatron: {worst:.3f} (target <= 1.02); "
        f"weight all-gathers: {sum(r['ours.weight_all_gathers'] for r in rows)} (target 0); "
        f"{time.perf_counter() - start:.0f} s"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "worst_ratio": worst}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
