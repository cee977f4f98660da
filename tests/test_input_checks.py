"""Wrong input raises instead of giving a silent wrong answer; library calls leave the
process alone.

JAX clamps out-of-range indices and wraps 64-bit integers to 32 bits, so each case
here used to return finite, wrong numbers.
"""

import json
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import TypeCheckError

import redcoast as rc
from redcoast import distributed
from redcoast.models import (
    GPT2,
    GPTJ,
    OPT,
    GPT2Config,
    GPTJConfig,
    Llama,
    LlamaConfig,
    OPTConfig,
    generate,
)
from redcoast.train.data import batches, check_int_range, make_global

VOCAB = 50
POSITIONS = 16
# Raised under eqx.filter_jit and eagerly; jax.jit reports the same text in a JaxRuntimeError.
RUNTIME = (eqx.EquinoxRuntimeError, jax.errors.JaxRuntimeError)  # both RuntimeErrors
CONFIGS = {
    "gpt2": (
        GPT2,
        GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=32, n_layer=2, n_head=4),
    ),
    "llama": (
        Llama,
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=POSITIONS,
        ),
    ),
    "opt": (
        OPT,
        OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=POSITIONS,
            word_embed_proj_dim=32,
        ),
    ),
    "gptj": (
        GPTJ,
        GPTJConfig(
            vocab_size=VOCAB, n_positions=POSITIONS, n_embd=32, n_layer=2, n_head=4, rotary_dim=4
        ),
    ),
}
IDS = np.random.default_rng(0).integers(0, VOCAB, (8, 6)).astype(np.int32)


def model_of(arch: str, *, scan_layers: bool = False) -> rc.models.AbstractCausalLM:
    cls, config = CONFIGS[arch]
    return cls(config, scan_layers=scan_layers, key=jax.random.key(0))


@eqx.filter_jit
def forward(model: rc.models.AbstractCausalLM, ids: jax.Array) -> jax.Array:
    return jax.vmap(model)(ids)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("bad", [VOCAB, 999, -1])
def test_token_ids_outside_the_vocabulary_raise(arch: str, bad: int) -> None:
    model = model_of(arch)
    ids = IDS.copy()
    ids[1, 3] = VOCAB - 1  # the last valid id is fine
    assert np.isfinite(np.asarray(forward(model, jnp.asarray(ids)))).all()
    ids[1, 4] = bad
    with pytest.raises(RUNTIME, match=rf"input_ids \(token ids\) must be in \[0, {VOCAB}\)"):
        jax.block_until_ready(forward(model, jnp.asarray(ids)))


@pytest.mark.slow  # the unscanned checks above are its fast siblings
def test_token_id_check_holds_with_scanned_layers_and_the_cache() -> None:
    model = model_of("llama", scan_layers=True)
    ids = jnp.asarray(IDS).at[0, 0].set(VOCAB + 3)
    with pytest.raises(RUNTIME, match="input_ids"):
        jax.block_until_ready(forward(model, ids))
    cache = model.init_cache(8)
    with pytest.raises(RUNTIME, match="input_ids"):
        jax.block_until_ready(eqx.filter_jit(model.decode)(ids[0], cache, 0))


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_a_sequence_longer_than_the_position_table_raises(arch: str) -> None:
    model = model_of(arch)
    assert forward(model, jnp.zeros((2, POSITIONS), jnp.int32)).shape == (2, POSITIONS, VOCAB)
    with pytest.raises(
        ValueError, match=rf"17 tokens .* {POSITIONS} positions .* \[1, {POSITIONS}\]"
    ):
        forward(model, jnp.zeros((2, POSITIONS + 1), jnp.int32))


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_decode_past_the_position_table_raises(arch: str) -> None:
    model = model_of(arch)
    cache = model.init_cache(2 * POSITIONS)  # the cache has room: the table is the limit
    token = jnp.zeros((1,), jnp.int32)
    with pytest.raises(
        ValueError, match=rf"index .* must be in \[0, {POSITIONS}\); got {POSITIONS}"
    ):
        model.decode(token, cache, POSITIONS)
    decode = eqx.filter_jit(model.decode)
    jax.block_until_ready(decode(token, cache, jnp.array(POSITIONS - 1)))
    with pytest.raises(RUNTIME, match=rf"index .* must be in \[0, {POSITIONS}\)"):
        jax.block_until_ready(decode(token, cache, jnp.array(POSITIONS)))


@pytest.mark.parametrize("arch", ["llama", pytest.param("gptj", marks=pytest.mark.slow)])
def test_writing_past_the_end_of_the_cache_raises(arch: str) -> None:
    model = model_of(arch)
    cache = model.init_cache(4)
    tokens = jnp.zeros((2,), jnp.int32)
    jax.block_until_ready(model.decode(tokens, cache, 2))  # slots 2 and 3: the last two
    with pytest.raises(ValueError, match=r"index \(the cache slot .*\) must be in \[0, 3\); got 3"):
        model.decode(tokens, cache, 3)
    with pytest.raises(RUNTIME, match=r"cache has 4 slots"):
        jax.block_until_ready(eqx.filter_jit(model.decode)(tokens, cache, jnp.array(3)))


@pytest.mark.parametrize("lengths", [[0, 4], [2, 5]])
def test_prompt_lengths_outside_the_prompt_raise(lengths: list[int]) -> None:
    model = model_of("gpt2")
    prompt = jnp.asarray(IDS[:2, :4])
    with pytest.raises(ValueError, match=re.escape(f"got {lengths}")):
        generate(model, prompt, prompt_lengths=jnp.array(lengths), max_new_tokens=3)


@pytest.mark.parametrize("lengths", [[0, 4], [2, 5]])
def test_prompt_lengths_outside_the_prompt_raise_under_jit(lengths: list[int]) -> None:
    model = model_of("gpt2")
    prompt = jnp.asarray(IDS[:2, :4])

    @eqx.filter_jit
    def run(m: rc.models.AbstractCausalLM, n: jax.Array) -> jax.Array:
        return generate(m, prompt, prompt_lengths=n, max_new_tokens=3)

    assert run(model, jnp.array([1, 4])).shape == (2, 3)
    with pytest.raises(RUNTIME, match=r"prompt_lengths must be in \[1, 5\)"):
        jax.block_until_ready(run(model, jnp.array(lengths)))


def test_prompt_padding_may_be_any_integer() -> None:
    model = model_of("llama")
    prompt = jnp.asarray(IDS[:2, :5])
    lengths = jnp.array([3, 5])
    padded = prompt.at[0, 3:].set(-1)
    want = generate(model, prompt, prompt_lengths=lengths, max_new_tokens=4)
    np.testing.assert_array_equal(
        generate(model, padded, prompt_lengths=lengths, max_new_tokens=4), want
    )
    bad = prompt.at[1, 4].set(VOCAB)  # inside the prompt: a real token, so it is checked
    with pytest.raises(RUNTIME, match="input_ids"):
        jax.block_until_ready(generate(model, bad, prompt_lengths=lengths, max_new_tokens=4))


def test_checks_hold_under_grad() -> None:
    model = model_of("gpt2")

    @eqx.filter_jit
    @eqx.filter_grad
    def grad(m: rc.models.AbstractCausalLM, ids: jax.Array) -> jax.Array:
        return jax.vmap(m)(ids).mean()

    good = grad(model, jnp.asarray(IDS))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(good))
    with pytest.raises(RUNTIME, match="input_ids"):
        jax.block_until_ready(grad(model, jnp.asarray(IDS).at[3, 2].set(VOCAB)))


def test_checks_hold_on_a_sharded_model_and_batch() -> None:
    model = model_of("gpt2")
    mesh = rc.make_mesh(2)
    specs = rc.sharding_plan(model, 2, example_call=lambda m: jax.vmap(m)(jnp.asarray(IDS))).specs
    sharded = rc.place(model, mesh, specs=specs)
    place = NamedSharding(mesh, P("data"))
    want = forward(model, jnp.asarray(IDS))
    got = forward(sharded, jax.device_put(jnp.asarray(IDS), place))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # The bad id sits in the last data shard only.
    bad = jax.device_put(jnp.asarray(IDS).at[7, 0].set(VOCAB), place)
    with pytest.raises(RUNTIME, match="input_ids"):
        jax.block_until_ready(forward(sharded, bad))


def _int_collate(values: np.ndarray):
    return lambda examples: {
        "x": np.ones((len(examples), 2), np.float32),
        "ids": values[: len(examples)],
    }


@pytest.mark.parametrize(
    ("values", "shown"),
    [
        (np.array([3, 2**40 + 5] * 4, np.int64), r"\[3, 1099511627781\].*int32"),
        (np.array([-(2**31) - 1, 0] * 4, np.int64), r"\[-2147483649, 0\].*int32"),
        (np.array([1, 2**63 + 5] * 4, np.uint64), r"\[1, 9223372036854775813\].*uint32"),
    ],
)
def test_64_bit_integers_that_would_wrap_raise_naming_the_key(
    values: np.ndarray, shown: str
) -> None:
    mesh = rc.make_mesh(1)
    examples = list(range(8))
    with pytest.raises(
        ValueError, match=rf"batch key 'ids' \({values.dtype}\) has values in {shown}.*collate_fn"
    ):
        next(
            batches(
                examples, collate_fn=_int_collate(values), mesh=mesh, batch_size=8, shuffle=False
            )
        )


def test_64_bit_integers_that_fit_arrive_unchanged() -> None:
    mesh = rc.make_mesh(1)
    values = np.array([2**31 - 1, -(2**31), 0, 7] * 2, np.int64)
    batch = make_global({"ids": values}, mesh, 8)
    np.testing.assert_array_equal(np.asarray(batch["ids"]), values)
    check_int_range({"empty": np.zeros((0,), np.int64), "f": np.array([1e30])})


PROCESS_STATE = """
import atexit, sys, threading
import redcoast as rc
before = atexit._ncallbacks()
rc.make_mesh(1)
heartbeat = any(t.name == "redcoast-heartbeat" for t in threading.enumerate())
print(f"state hook={sys.excepthook is not sys.__excepthook__} thread={heartbeat} "
      f"atexit={atexit._ncallbacks() - before}", flush=True)
"""


# `redcoast launch` asks for the watchdog unless told otherwise.
@pytest.mark.parametrize(("watchdog", "changed"), [("0", False), ("1", True), (None, True)])
def test_initialize_installs_nothing_process_wide_unless_asked(
    watchdog: str | None, changed: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    code = distributed.launch(
        [sys.executable, "-c", PROCESS_STATE],
        nprocs=2,
        env=None if watchdog is None else {"REDCOAST_WATCHDOG": watchdog},
        port=distributed.free_port(),
        timeout=120,
    )
    out = capfd.readouterr().out
    assert code == 0, out
    for rank in (0, 1):
        want = f"[{rank}] state hook={changed} thread={changed} atexit={int(changed)}"
        assert want in out, out


def test_watchdog_setting_from_argument_environment_or_default() -> None:
    assert distributed.watchdog_enabled(env={}) is False
    assert distributed.watchdog_enabled(env={"REDCOAST_WATCHDOG": "1"}) is True
    assert distributed.watchdog_enabled(False, env={"REDCOAST_WATCHDOG": "1"}) is False
    assert distributed.watchdog_enabled(True, env={}) is True
    with pytest.raises(ValueError, match=r"REDCOAST_WATCHDOG='yes' must be 1"):
        distributed.watchdog_enabled(env={"REDCOAST_WATCHDOG": "yes"})


IMPORT_STATE = """
import json, logging, os, signal, sys, threading, warnings
import jax

def state():
    loggers = [logging.root, *map(logging.getLogger, sorted(logging.root.manager.loggerDict))]
    return {
        "environment": dict(os.environ),
        "jax config": {k: repr(v) for k, v in jax.config.values.items()},
        "logging handlers": {l.name: repr(l.handlers) for l in loggers if l.handlers},
        "logging levels": {l.name: l.level for l in loggers if l.level},
        "signal handlers": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals()
                            if isinstance(s, signal.Signals)},
        "excepthook": repr(sys.excepthook),
        "threads": sorted(t.name for t in threading.enumerate()),
        "warning filters": repr(warnings.filters),
    }

before = state()
import redcoast, redcoast.cli, redcoast.distributed, redcoast.lora, redcoast.models, redcoast.text
after = state()
from redcoast._jax_private import backends_are_initialized
print(json.dumps({
    "changed": {k: [before[k], after[k]] for k in before if before[k] != after[k]},
    "backend started": backends_are_initialized(),
}))
"""


def test_importing_redcoast_changes_nothing_process_wide() -> None:
    # In a fresh interpreter: this one has long imported redcoast (and started JAX).
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_STATE], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["changed"] == {}
    # So a program can still choose its devices (`jax_num_cpu_devices`) after the import.
    assert found["backend started"] is False


def test_from_hf_refuses_an_option_it_does_not_know(tmp_path) -> None:
    for load in (rc.models.from_hf, rc.models.Llama.from_hf):
        with pytest.raises(TypeError, match=r"\['mseh'\].*'mesh'"):
            load(tmp_path, mseh=None)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_an_unknown_attention_implementation_is_named(arch: str) -> None:
    cls, config = CONFIGS[arch]
    # A user gets check_implementation's ValueError; under the tests' jaxtyping hook
    # (pyproject's --jaxtyping-packages) the `Implementation` annotation refuses it first.
    with pytest.raises((ValueError, TypeCheckError), match="flash"):
        cls(config, attention="flash", key=jax.random.key(0))
