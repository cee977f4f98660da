"""The speed of one training step: redcoast against a hand-written step and against redco.

Part 1, on 8 simulated CPU devices at meshes 4x2 and 2x4 (data x model): the same
GPT (vocabulary 1024, hidden 256, 4 layers, 8 heads, 128 tokens, tied head), the same
32 sequences and `optax.adamw(1e-4)`, compiled three ways:

- redcoast: `rc.models.GPT2` split by `rc.sharding_plan`, stepped by `rc.train_step`
  (metrics, gradient norm, non-finite check, donation);
- hand: the same model with Megatron-LM's layout written by path, stepped by a plain
  `jax.jit` of `value_and_grad` + the optax update;
- redco: the same GPT in Flax, split by redco 0.4.23's rules and stepped by its
  `pjit` train step, when `redco` and `flax` are importable (a separate venv: they
  are not redcoast dependencies); otherwise the column is skipped with a note.

Part 2, on one device: forward + backward of the zoo's GPT-2 against a plain JAX
implementation of the same architecture (weights `(in, out)`, `x @ w + b`).

The machine is shared and its timings noisy, so each repeat times `--steps` steps of
every contestant back to back, in rotating order, and the figures are medians over
repeats: steps/s of each, and of the paired ratios (redcoast / other, same repeat).
Compile time is the first call's wall time.

Run: python scripts/bench_step.py            (add --reps 9 for steadier medians)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc

V, D, H, L, S = 1024, 256, 8, 4, 128
PER_DEVICE = 4
LR = 1e-4
Runner = Callable[[int], float]  # run n steps, return the last loss


def cross_entropy(logits: jax.Array, ids: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def zoo_loss(model: rc.models.GPT2, batch: dict[str, jax.Array], key: Any) -> jax.Array:
    return cross_entropy(jax.vmap(model)(batch["ids"]), batch["ids"])


def new_zoo_model() -> rc.models.GPT2:
    config = rc.models.GPT2Config(vocab_size=V, n_positions=S, n_embd=D, n_layer=L, n_head=H)
    return rc.models.GPT2(config, key=jax.random.key(0))


def timed_first_call(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


# ------------------------------------------------------------------ the three steps


def redcoast_step(mesh: Mesh, ids: np.ndarray) -> tuple[Runner, float]:
    n_model = mesh.shape["model"]
    model = new_zoo_model()
    batch = {"ids": jax.device_put(ids, NamedSharding(mesh, P("data")))}
    plan = rc.sharding_plan(model, n_model, example_call=lambda m: zoo_loss(m, batch, None))
    model = rc.shard(model, mesh, plan.specs)
    opt = optax.adamw(LR)
    state = [model, opt.init(eqx.filter(model, eqx.is_inexact_array))]
    step = rc.train_step(zoo_loss, opt)
    key = jax.random.key(0)

    def run(n: int) -> float:
        for _ in range(n):
            state[0], state[1], metrics = step(state[0], state[1], batch, key)
        return float(metrics["loss"])

    return run, timed_first_call(lambda: run(1))


MEGATRON = {  # path suffix -> spec of the zoo's (out, in) weights
    "q_proj.weight": P("model", None),
    "k_proj.weight": P("model", None),
    "v_proj.weight": P("model", None),
    "q_proj.bias": P("model"),
    "k_proj.bias": P("model"),
    "v_proj.bias": P("model"),
    "o_proj.weight": P(None, "model"),
    "fc_in.weight": P("model", None),
    "fc_in.bias": P("model"),
    "fc_out.weight": P(None, "model"),
    "embed_tokens.weight": P("model", None),
}


def megatron_specs(model: eqx.Module) -> Any:
    def spec(path: tuple, leaf: Any) -> P:
        name = rc.sharding.path_str(path)
        return next((s for k, s in MEGATRON.items() if name.endswith(k)), P())

    return jax.tree_util.tree_map_with_path(spec, eqx.filter(model, eqx.is_array))


def hand_step(mesh: Mesh, ids: np.ndarray) -> tuple[Runner, float]:
    model = new_zoo_model()
    params, static = eqx.partition(model, eqx.is_array)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), megatron_specs(model))
    params = jax.device_put(params, shardings)
    opt = optax.adamw(LR)
    opt_state = opt.init(params)
    batch = jax.device_put(ids, NamedSharding(mesh, P("data")))

    @jax.jit(donate_argnums=(0, 1))
    def step(params: Any, opt_state: Any, ids: jax.Array) -> tuple[Any, Any, jax.Array]:
        def loss(p: Any) -> jax.Array:
            return zoo_loss(eqx.combine(p, static), {"ids": ids}, None)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    state = [params, opt_state]

    def run(n: int) -> float:
        for _ in range(n):
            state[0], state[1], value = step(state[0], state[1], batch)
        return float(value)

    return run, timed_first_call(lambda: run(1))


def redco_step(mesh_shape: tuple[int, int], ids: np.ndarray) -> tuple[Runner, float]:
    """redco 0.4.23's rules and pjit train step on the same GPT written in Flax."""
    import flax.linen as nn
    from flax.core.frozen_dict import freeze
    from flax.training import train_state
    from jax.experimental.pjit import pjit
    from redco.deployers import partition_utils as pu
    from redco.trainers.utils import default_train_step

    class Attn(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            q, k, v = (nn.Dense(D, name=n)(x) for n in ("q_proj", "k_proj", "v_proj"))
            b, s, _ = x.shape
            q, k, v = (t.reshape(b, s, H, D // H) for t in (q, k, v))
            w = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D // H)
            w = jnp.where(jnp.tril(jnp.ones((s, s), bool)), w, -1e9)
            o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(w, -1), v).reshape(b, s, D)
            return nn.Dense(D, name="o_proj")(o)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = x + Attn(name="attn")(nn.LayerNorm(name="ln_1")(x))
            h = nn.Dense(4 * D, name="fc_in")(nn.LayerNorm(name="ln_2")(x))
            return x + nn.Dense(D, name="fc_out")(jax.nn.gelu(h, approximate=True))

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, ids: jax.Array) -> jax.Array:
            emb = nn.Embed(V, D, name="wte")
            pos = self.param("wpe", nn.initializers.normal(0.02), (S, D))
            x = emb(ids) + pos[: ids.shape[1]]
            for i in range(L):
                x = Block(name=f"h_{i}")(x)
            return emb.attend(nn.LayerNorm(name="ln_f")(x))

    n_model = mesh_shape[1]
    mesh = pu.get_mesh(n_model)
    model = GPT()
    params = freeze(model.init(jax.random.key(0), jnp.zeros((1, S), jnp.int32))["params"])
    rules = pu.get_sharding_rules(params, n_model)
    rules = list(rules.items()) if isinstance(rules, dict) else rules
    spec = pu.get_params_spec(params, rules)
    params = pu.shard_params(params, spec, mesh)
    opt = optax.adamw(LR)
    opt_spec = pu.get_opt_state_spec(params, spec, opt)
    opt_state = pu.shard_params(opt.init(params), opt_spec, mesh)
    state = train_state.TrainState(
        step=0, apply_fn=model.apply, params=params, tx=opt, opt_state=opt_state
    )
    state_spec = train_state.TrainState(
        step=None, apply_fn=model.apply, params=spec, tx=opt, opt_state=opt_spec
    )

    def loss_fn(rng: Any, state: Any, params: Any, batch: Any, is_training: bool) -> Any:
        return cross_entropy(state.apply_fn({"params": params}, batch["ids"]), batch["ids"])

    fn = functools.partial(
        default_train_step,
        loss_fn=loss_fn,
        lr_schedule_fn=None,
        mesh=mesh,
        compute_dtype=jnp.float32,
    )
    step = pjit(
        fn,
        in_shardings=(None, state_spec, {"ids": P("dp")}),
        out_shardings=(state_spec, None),
        donate_argnums=(1,),
    )
    with mesh:
        batch = jax.device_put(
            {"ids": ids.reshape((mesh.shape["dp"], -1, S))}, NamedSharding(mesh, P("dp"))
        )
    key = jax.random.key(0)
    holder = [state]

    def run(n: int) -> float:
        with mesh:
            for _ in range(n):
                holder[0], metrics = step(key, holder[0], batch)
        return float(metrics["loss"])

    return run, timed_first_call(lambda: run(1))


def redco_available() -> str | None:
    """None when redco and flax import; otherwise why not."""
    try:
        import flax  # noqa: F401
        import redco  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


# ------------------------------------------------------------------ one device


def plain_gpt2_params(key: jax.Array) -> dict[str, Any]:
    """GPT-2's parameters as plain arrays, weights `(in, out)`, initialised as GPT-2's."""
    keys = iter(jax.random.split(key, 4 + 4 * L))

    def normal(*shape: int, std: float = 0.02) -> jax.Array:
        return std * jax.random.normal(next(keys), shape)

    def norm() -> dict[str, jax.Array]:
        return {"scale": jnp.ones(D), "bias": jnp.zeros(D)}

    residual = 0.02 / math.sqrt(2 * L)
    layers = [
        {
            "ln_1": norm(),
            "qkv": normal(D, 3 * D),
            "qkv_b": jnp.zeros(3 * D),
            "proj": normal(D, D, std=residual),
            "proj_b": jnp.zeros(D),
            "ln_2": norm(),
            "fc": normal(D, 4 * D),
            "fc_b": jnp.zeros(4 * D),
            "out": normal(4 * D, D, std=residual),
            "out_b": jnp.zeros(D),
        }
        for _ in range(L)
    ]
    return {"wte": normal(V, D), "wpe": normal(S, D), "layers": layers, "ln_f": norm()}


def plain_gpt2(params: dict[str, Any], ids: jax.Array) -> jax.Array:
    """GPT-2's forward pass on a batch of sequences, written directly."""

    def layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]

    b, s = ids.shape
    x = params["wte"][ids] + params["wpe"][:s]
    causal = jnp.tril(jnp.ones((s, s), bool))
    for p in params["layers"]:
        q, k, v = jnp.split(layer_norm(x, p["ln_1"]) @ p["qkv"] + p["qkv_b"], 3, axis=-1)
        q, k, v = (t.reshape(b, s, H, D // H) for t in (q, k, v))
        w = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D // H)
        w = jax.nn.softmax(jnp.where(causal, w, jnp.finfo(w.dtype).min), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, D)
        x = x + o @ p["proj"] + p["proj_b"]
        h = jax.nn.gelu(layer_norm(x, p["ln_2"]) @ p["fc"] + p["fc_b"], approximate=True)
        x = x + h @ p["out"] + p["out_b"]
    return layer_norm(x, params["ln_f"]) @ params["wte"].T


def one_device_runners(ids: np.ndarray) -> dict[str, tuple[Runner, float]]:
    device = jax.devices()[0]
    batch = jax.device_put(jnp.asarray(ids[: 2 * PER_DEVICE]), device)
    zoo_params, static = eqx.partition(jax.device_put(new_zoo_model(), device), eqx.is_array)
    plain_params = jax.device_put(plain_gpt2_params(jax.random.key(0)), device)

    @jax.jit
    def zoo_grad(p: Any, ids: jax.Array) -> tuple[jax.Array, Any]:
        return jax.value_and_grad(lambda p: zoo_loss(eqx.combine(p, static), {"ids": ids}, None))(p)

    @jax.jit
    def plain_grad(p: Any, ids: jax.Array) -> tuple[jax.Array, Any]:
        return jax.value_and_grad(lambda p: cross_entropy(plain_gpt2(p, ids), ids))(p)

    def runner(fn: Callable[..., Any], params: Any) -> Runner:
        def run(n: int) -> float:
            for _ in range(n):
                value, grads = fn(params, batch)
            jax.block_until_ready(grads)
            return float(value)

        return run

    zoo, plain = runner(zoo_grad, zoo_params), runner(plain_grad, plain_params)
    return {
        "zoo GPT2": (zoo, timed_first_call(lambda: zoo(1))),
        "plain GPT-2": (plain, timed_first_call(lambda: plain(1))),
    }


# ------------------------------------------------------------------ timing


def paired(runners: dict[str, tuple[Runner, float]], steps: int, reps: int) -> dict[str, Any]:
    """Steps/s of each runner over `reps` repeats in rotating order; medians and ratios."""
    names = list(runners)
    for run, _ in runners.values():
        run(1)  # warm
    rates: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, float] = {}
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            losses[name] = runners[name][0](steps)
            rates[name].append(steps / (time.perf_counter() - start))
    first = names[0]
    out: dict[str, Any] = {
        "steps_per_s": {n: float(np.median(v)) for n, v in rates.items()},
        "compile_s": {n: runners[n][1] for n in names},
        "last_loss": losses,
    }
    out["ratio"] = {
        f"{first} / {n}": float(np.median(np.array(rates[first]) / np.array(rates[n])))
        for n in names[1:]
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per timed run")
    parser.add_argument("--reps", type=int, default=5, help="paired repeats per mesh")
    parser.add_argument("--meshes", default="4x2,2x4", help="data x model meshes")
    parser.add_argument("--out", default="bench-results/bench_step.json")
    args = parser.parse_args()

    ids = np.random.default_rng(0).integers(0, V, (8 * PER_DEVICE, S)).astype(np.int32)
    missing = redco_available()
    if missing:
        print(
            f"redco column skipped: {missing} (install redco==0.4.23 and flax in a separate venv)"
        )
    results: dict[str, Any] = {"args": vars(args), "redco_skipped": missing, "meshes": {}}
    print("| mesh | contestant | steps/s | compile s | redcoast / it (paired median) |")
    print("|---|---|---|---|---|")
    for shape in args.meshes.split(","):
        n_data, n_model = (int(x) for x in shape.split("x"))
        mesh = rc.make_mesh(n_model_shards=n_model)
        assert mesh.shape["data"] == n_data, (mesh.shape, shape)
        runners = {"redcoast": redcoast_step(mesh, ids), "hand jax.jit": hand_step(mesh, ids)}
        if not missing:
            runners["redco"] = redco_step((n_data, n_model), ids)
        res = paired(runners, args.steps, args.reps)
        results["meshes"][shape] = res
        for name in runners:
            ratio = res["ratio"].get(f"redcoast / {name}")
            cell = "" if ratio is None else f"{ratio:.2f}"
            print(
                f"| {shape} | {name} | {res['steps_per_s'][name]:.2f} | "
                f"{res['compile_s'][name]:.1f} | {cell} |",
                flush=True,
            )
    res = paired(one_device_runners(ids), args.steps * 3, args.reps)
    results["one_device"] = res
    for name in res["steps_per_s"]:
        ratio = res["ratio"].get(f"zoo GPT2 / {name}")
        cell = "" if ratio is None else f"time ratio zoo / plain {1 / ratio:.2f}"
        print(
            f"| 1 device, fwd+bwd, batch {2 * PER_DEVICE} | {name} | "
            f"{res['steps_per_s'][name]:.2f} | {res['compile_s'][name]:.1f} | {cell} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
