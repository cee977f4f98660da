"""The memory planner: its figures are XLA's for the real step, its verdicts follow arithmetic."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from click.testing import CliRunner
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc
from redcoast._progress import ENV_SECONDS
from redcoast.cli import main
from redcoast.plan._targets import StepEstimate

SMALL = rc.models.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)


def lm_loss(model: rc.models.AbstractCausalLM, batch: dict, key: jax.Array) -> jax.Array:
    ids = batch["input_ids"]
    logits = jax.vmap(model)(ids[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


@pytest.mark.slow
@pytest.mark.parametrize(("n_model", "use_fsdp"), [(2, False), (2, True)], ids=["tp", "tp-fsdp"])
def test_the_planners_peak_is_the_real_compiled_steps(n_model: int, use_fsdp: bool) -> None:
    planned = rc.memory_plan(
        SMALL,
        devices=8,
        n_model_shards=n_model,
        fsdp=use_fsdp,
        seq_len=32,
        per_device_batch_size=2,
        max_batch=False,
    )
    mesh = rc.make_mesh(n_model)
    model = rc.sharded_init(
        lambda k: rc.models.GPT2(SMALL, scan_layers=True, key=k),
        jax.random.key(0),
        mesh,
        fsdp=use_fsdp,
    )
    optimizer = optax.adamw(1e-4)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    ids = np.zeros((2 * mesh.shape["data"], 33), np.int32)
    batch = {"input_ids": jax.device_put(ids, NamedSharding(mesh, P("data")))}
    core = rc.train_step(
        lm_loss, optimizer, mesh=mesh, jit=False, parallelism=rc.Parallelism.of(model)
    )
    lowered = eqx.filter_jit(core, donate="all").lower(model, state, batch, jax.random.key(0))
    stats = lowered.compile().compiled.memory_analysis()  # equinox wraps jax's Compiled
    assert stats is not None
    real = (
        stats.argument_size_in_bytes
        + stats.temp_size_in_bytes
        + max(stats.output_size_in_bytes - stats.alias_size_in_bytes, 0)
    )
    assert abs(planned.peak - real) <= 0.05 * real, (planned.peak, real)
    # Parameters per device are exactly what the placed model holds.
    held = sum(
        x.addressable_shards[0].data.nbytes
        for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))
    )
    assert planned.params == held


@pytest.mark.slow
def test_verdicts_follow_arithmetic() -> None:
    # llama-1b in fp32 with AdamW needs 16 bytes a parameter: 19.8 GB on one 16 GB device.
    alone = rc.memory_plan(
        "llama-1b", devices=1, seq_len=128, device_memory="16GB", max_batch=False
    )
    assert alone.fits is False
    assert alone.params + alone.opt_state >= 12 * alone.n_params
    assert "does not fit" in str(alone)
    small = rc.memory_plan(SMALL, devices=8, n_model_shards=2, seq_len=32, device_memory="1GB")
    assert small.fits is True
    assert small.max_batch is not None and small.max_batch > 1
    bigger = rc.memory_plan(
        SMALL,
        devices=8,
        n_model_shards=2,
        seq_len=32,
        per_device_batch_size=small.max_batch,
        device_memory="1GB",
        max_batch=False,
    )
    assert bigger.fits


@pytest.mark.slow
def test_search_finds_a_layout_that_fits_where_the_given_one_does_not() -> None:
    given = rc.memory_plan(SMALL, devices=8, seq_len=32, max_batch=False)
    budget = int(given.peak * 0.6)
    found = rc.memory_plan(
        SMALL, devices=8, seq_len=32, device_memory=budget, search=True, max_batch=False
    )
    assert found.fits
    assert found.layout != given.layout
    assert found.tried  # the given layout was tried first and did not fit


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "llama-70b", "devices": 8}, "unknown model 'llama-70b'"),
        ({"model": "gpt2", "devices": 8, "n_model_shards": 3}, "do not divide 8 devices"),
        ({"model": "gpt2-large", "devices": 8, "n_model_shards": 8}, "20 attention heads"),
        ({"model": "gpt2", "devices": 64}, "this process has 8"),
        ({"model": "gpt2", "devices": 8, "precision": "fp8"}, "precision 'fp8'"),
        ({"model": "gpt2", "devices": 8, "device_memory": "lots"}, "is not a size"),
        ({"model": "gpt2", "devices": 8, "seq_len": 4096}, "longer than the model's 1024"),
        (
            {"model": "gpt2", "devices": 8, "n_model_shards": 8, "context_parallel": True},
            "has 1 data shard",
        ),
        (
            {"model": "gpt2", "devices": 8, "seq_len": 100, "context_parallel": True},
            "seq_len 100 is not a multiple of 8; plan 104 tokens",
        ),
        ({"model": "t5-large", "devices": 8, "context_parallel": True}, "encoder-decoder"),
    ],
)
def test_layouts_that_cannot_work_get_one_clear_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rc.memory_plan(**kwargs)


@pytest.mark.slow
def test_cli_plans_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        main,
        [
            *("plan", "gpt2", "-n", "2", "--seq-len", "64", "--device-memory", "4GB"),
            *("--specs", "--json", str(out)),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "blocks.attn.q_proj.weight" in result.output  # --specs: every weight's split
    assert "peak:" in result.output and "fits" in result.output
    figures = json.loads(out.read_text())
    assert figures["fits"] is True and figures["layout"]["n_model_shards"] == 2
    # fit without donate=True keeps the caller's model valid: one more copy of the parameters.
    assert figures["peak_keeping_model"] == figures["peak"] + figures["params"]
    assert "without it fit keeps the model given valid" in result.output
    bad = CliRunner().invoke(main, ["plan", "resnet"])
    assert bad.exit_code != 0 and "unknown model 'resnet'" in bad.output
    assert "Traceback" not in bad.output


WIDE = rc.models.LlamaConfig(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
)


@pytest.mark.slow
def test_a_zoo_model_is_planned_with_the_attention_asked_for() -> None:
    from redcoast.models.planning import planned

    long = dataclasses.replace(WIDE, max_position_embeddings=2048)
    plans = {
        how: rc.memory_plan(planned(long, attention=how), devices=1, seq_len=2048, max_batch=False)
        for how in ("einsum", "blockwise")
    }
    # The einsum writes out 4 heads' 2048 x 2048 float32 scores; the blockwise one does not.
    assert plans["einsum"].activations - plans["blockwise"].activations > 4 * 2048**2 * 4


@pytest.mark.slow  # the CLI's LoRA plan below is its fast sibling
def test_a_lora_plan_keeps_optimizer_state_for_the_adapters_only() -> None:
    full = rc.memory_plan(WIDE, devices=1, seq_len=16, max_batch=False)
    lora = rc.memory_plan(WIDE, devices=1, seq_len=16, max_batch=False, lora_rank=2)
    assert lora.opt_state <= 0.02 * full.opt_state, (lora.opt_state, full.opt_state)
    assert lora.gradients <= 0.02 * full.gradients
    # Frozen weights in bfloat16 by default: about half the parameter bytes of fp32.
    assert lora.params < 0.52 * full.params
    as_fp32 = rc.memory_plan(
        WIDE, devices=1, seq_len=16, max_batch=False, lora_rank=2, frozen_dtype="fp32"
    )
    assert as_fp32.params > full.params  # every fp32 weight plus the adapters
    assert lora.n_trainable == as_fp32.n_trainable < 0.02 * lora.n_params
    assert "LoRA rank 2 on the attention and MLP projections" in str(lora)
    assert f"{lora.n_trainable:,} trainable parameters" in str(lora)


def test_cli_plans_lora_and_refuses_a_target_that_matches_nothing(monkeypatch) -> None:
    """And piped to a log, `redcoast plan` says every interval that it is still
    compiling, on the clock its last line's time is read from: never less than they said."""
    monkeypatch.setenv(ENV_SECONDS, "0.5")
    ran = CliRunner().invoke(
        main,
        [
            *("plan", "gpt2", "--seq-len", "32", "--lora-rank", "4"),
            *("--lora-targets", "q_proj,v_proj", "--frozen-dtype", "bf16", "--specs"),
        ],
    )
    assert ran.exit_code == 0, ran.output
    assert "LoRA rank 4 on q_proj, v_proj, frozen weights bfloat16" in ran.output
    assert "blocks.attn.q_proj.lora_a.weight" in ran.output  # --specs shows the adapters
    beats = [int(m) for m in re.findall(r"compiling the train step: (\d+)s so far", ran.output)]
    (last,) = [line for line in ran.output.splitlines() if line.startswith("compiled ")]
    took = re.fullmatch(r"compiled the train step in ([0-9.]+) s", last)
    assert beats and took is not None and max(beats) <= float(took.group(1)) + 0.5
    bad = CliRunner().invoke(main, ["plan", "gpt2", "--lora-rank", "4", "--lora-targets", "qkv"])
    assert bad.exit_code != 0 and "match no eqx.nn.Linear" in bad.output
    assert "Traceback" not in bad.output


@pytest.mark.slow  # the planner's refusal without a model axis is its fast sibling
def test_the_cli_plans_sequence_parallelism_with_fewer_activations(tmp_path: Path) -> None:
    figures = {}
    for flags in ((), ("--sequence-parallel",)):
        out = tmp_path / f"plan{len(flags)}.json"
        result = CliRunner().invoke(
            main,
            [
                *("plan", "llama-1b", "--seq-len", "256", "--devices", "8", "-n", "4"),
                *(*flags, "--json", str(out)),
            ],
        )
        assert result.exit_code == 0, result.output
        figures[bool(flags)] = json.loads(out.read_text())
    assert "TP 4 + SP" in result.output
    assert figures[True]["layout"]["sequence_parallel"] is True
    assert figures[True]["activations"] < figures[False]["activations"]


CONTEXT = dataclasses.replace(SMALL, n_positions=512)


@pytest.mark.slow  # test_context_zoo's compiled step at a fraction is its fast sibling
def test_context_parallelism_plans_a_fraction_of_the_activations() -> None:
    one = rc.memory_plan(CONTEXT, devices=1, seq_len=512, max_batch=False)
    split = rc.memory_plan(CONTEXT, devices=8, seq_len=512, context_parallel=True, max_batch=False)
    assert str(split.layout).startswith("CP 8, fp32, remat none, batch 1, each row split 8 ways")
    # One sequence over 8 devices: 64 tokens each, and (64 x 64)-score blocks.
    assert split.activations < 0.2 * one.activations


@pytest.mark.slow  # the planner's refusals of context parallelism are its fast siblings
def test_the_cli_plans_context_parallelism(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", "gpt2", "--seq-len", "256", "--devices", "8", "--context-parallel"]
    result = CliRunner().invoke(main, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "layout: CP 8, fp32, remat none, batch 1, each row split 8 ways" in result.output
    assert json.loads(out.read_text())["layout"]["context_parallel"] is True


@pytest.fixture(scope="session")
def one_plan() -> rc.MemoryPlan:
    """One compiled plan, whose figures the search tests give every layout."""
    return rc.memory_plan(SMALL, devices=8, seq_len=32, max_batch=False)


def test_the_report_says_what_it_compiled_in_how_long_and_counts_agree(one_plan) -> None:
    assert one_plan.compiles == (1, 0, 0) and one_plan.seconds >= one_plan.compile_seconds
    assert str(one_plan).splitlines()[-1].startswith("compiled the train step in ")
    searched = dataclasses.replace(one_plan, compiles=(2, 1, 0), seconds=102.5)
    last = "compiled 3 train steps in 1m 42s: 2 layouts, 1 more for the largest batch"
    assert str(searched).splitlines()[-1] == last
    probed = dataclasses.replace(one_plan, compiles=(1, 0, 4), seconds=8.34)
    last = "compiled 5 train steps in 8.3 s: the layout, 4 more for the longest sequence"
    assert str(probed).splitlines()[-1] == last
    one = dataclasses.replace(one_plan, layout=dataclasses.replace(one_plan.layout, devices=1))
    assert str(one).splitlines()[0].endswith(", 32 tokens, 1 device")
    pair = dataclasses.replace(one.layout, preference="dpo")
    assert str(pair).endswith(", 1 DPO pair/device")


def test_the_search_tries_every_layout_without_context_parallelism_first(
    monkeypatch, one_plan
) -> None:
    """The search's order, with each layout's compiled figures replaced by one plan's
    (compiling every layout at 512 tokens takes minutes: the exhaustive test below)."""
    from redcoast.plan import planner

    one = one_plan
    measured = []

    def measure(job, layout, budget):
        measured.append(layout)
        peak = budget if layout.context_parallel else budget + 1
        return dataclasses.replace(one, layout=layout, peak=peak, device_memory=budget)

    monkeypatch.setattr(planner, "_measure", measure)
    found = rc.memory_plan(
        CONTEXT,
        devices=8,
        seq_len=512,
        context_parallel=True,
        device_memory="1GB",
        search=True,
        max_batch=False,
    )
    assert found.fits and found.layout.context_parallel
    flags = [layout.context_parallel for layout in measured]
    # Every layout without it (1, 2 or 4 shards of 4 heads, with 2 and 4 also with SP,
    # each with and without FSDP, under four remats), then the first with it, which fits.
    assert flags == [False] * (len(flags) - 1) + [True] and len(flags) == 4 * 10 + 1
    assert len({str(layout) for layout in measured}) == len(measured)
    assert [layout for layout, _ in found.tried] == [str(x) for x in measured[:-1]]


def test_a_search_by_time_returns_the_fastest_layout_that_fits(monkeypatch, one_plan) -> None:
    """Every layout is measured, and of those that fit the most tokens per second wins;
    by memory the first that fits does (figures replaced as in the test above)."""
    from redcoast.plan import planner

    estimate = StepEstimate(1.0, 1.0, 0.5, 0.1, 1.0, 0.5, 1e9, 1e9)
    measured = []

    def measure(job, layout, budget):
        measured.append(layout)
        speed = {"none": 1.0, "attention": 3.0, "dots": 2.0, "full": 5.0}[layout.remat]
        speed += layout.n_model_shards / 10 - layout.fsdp / 100
        fits = layout.remat != "full"  # the fastest by estimate does not fit
        return dataclasses.replace(
            one_plan,
            layout=layout,
            peak=budget if fits else budget + 1,
            device_memory=budget,
            estimate=dataclasses.replace(estimate, tokens_per_second=speed),
        )

    monkeypatch.setattr(planner, "_measure", measure)
    options = dict(devices=8, seq_len=32, device_memory="1GB", search=True, max_batch=False)
    first = rc.memory_plan(SMALL, **options)
    assert len(measured) == 1 and first.layout == measured[0]
    measured.clear()
    fastest = rc.memory_plan(SMALL, rank_by="time", **options)
    assert fastest.fits and fastest.layout.remat == "attention" and not fastest.layout.fsdp
    assert fastest.layout.n_model_shards == max(x.n_model_shards for x in measured)
    assert len(fastest.tried) == len(measured) - 1
    assert str(fastest.layout) not in {layout for layout, _ in fastest.tried}
    with pytest.raises(ValueError, match="pass search=True"):
        rc.memory_plan(SMALL, devices=8, seq_len=32, rank_by="time")
    with pytest.raises(ValueError, match="rank_by must be one of"):
        rc.memory_plan(SMALL, devices=8, seq_len=32, search=True, rank_by="?", device_memory="1GB")


@pytest.mark.slow
@pytest.mark.exhaustive  # its order, without the compiling, is the fast test above
def test_the_search_tries_context_parallelism_after_every_layout_without_it() -> None:
    split = rc.memory_plan(CONTEXT, devices=8, seq_len=512, context_parallel=True, max_batch=False)
    found = rc.memory_plan(
        CONTEXT,
        devices=8,
        seq_len=512,
        context_parallel=True,
        device_memory=int(split.peak * 1.05),
        search=True,
        max_batch=False,
    )
    assert found.fits and found.layout.context_parallel
    with_cp = ["CP" in layout for layout, _ in found.tried]
    assert with_cp[0] is False and with_cp == sorted(with_cp)


@pytest.mark.slow  # test_precision's attention remat without FSDP is its fast sibling
def test_attention_remat_plans_under_fsdp_and_keeps_less() -> None:
    """Remat's "attention" policy under FSDP's layer-by-layer gathering: at 512 tokens
    the scores are most of what a layer keeps."""
    config = dataclasses.replace(WIDE, hidden_size=64, intermediate_size=128)
    config = dataclasses.replace(config, max_position_embeddings=512, num_hidden_layers=2)
    plans = {
        remat: rc.memory_plan(
            config, devices=2, fsdp=True, seq_len=512, remat=remat, max_batch=False
        ).activations
        for remat in ("none", "attention")
    }
    assert plans["attention"] < plans["none"]


# ------------------------------------------------------------------------- an RL step

RL_LLAMA = rc.models.LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
# 16-token prompts, 4 completions of each, up to 32 new tokens; one prompt a device.
GRPO = {"rl": "grpo", "seq_len": 16, "num_generations": 4, "max_new_tokens": 32}


def _cache_row(tokens: int, itemsize: int = 4) -> int:
    """Bytes of one row's key/value cache of RL_LLAMA: 2 layers, keys and values, 2
    key/value heads of 16 dimensions, in the token table's dtype (float32, or the
    bfloat16 of LoRA's frozen base)."""
    return 2 * 2 * tokens * 2 * 16 * itemsize


@pytest.fixture(scope="session")
def rl_plans() -> dict[str, rc.MemoryPlan]:
    """The RL plans the tests below share (15-20 s of compiling each), both with a KL
    penalty: a full fine-tune on TP 2, and LoRA on DP 2 planned for a GPU with
    longer completions."""
    options = {**GRPO, "devices": 2, "max_batch": False, "beta": 0.04}
    return {
        "full": rc.memory_plan(RL_LLAMA, n_model_shards=2, **options),
        "lora": rc.memory_plan(
            RL_LLAMA, lora_rank=2, target="l4-24gb", **{**options, "max_new_tokens": 96}
        ),
    }


def _rollout_batch(algorithm: rc.rl.GRPO, mesh: jax.sharding.Mesh, prompts: int) -> dict:
    """The batch `rc.rl.train`'s rollout makes of `prompts` prompts of 16 tokens, for the
    step to compile on (`GroupRollout.example`)."""
    from tokenizers import Tokenizer, models

    words = Tokenizer(models.WordLevel({"<eos>": 0, "<unk>": 1}, unk_token="<unk>"))
    rollout = rc.rl.GroupRollout(
        records=[],
        tokenizer=rc.text.load_tokenizer(words, eos_id=0),
        rewards=(),
        names=(),
        algorithm=algorithm,
        eos_id=0,
    )
    ids = jax.device_put(np.zeros((prompts, 16), np.int32), NamedSharding(mesh, P("data")))
    return rollout.example({"prompt_ids": ids})


def test_a_grpo_plans_train_step_is_the_real_rl_step(rl_plans) -> None:
    """`rc.rl.policy_loss` with GRPO's defaults and a KL penalty through `rc.train_step`,
    compiled on the batch `rc.rl.train`'s rollout makes: the plan's peak (less the
    reference copy held beside it) and batch are its own."""
    from redcoast.models.planning import planned
    from redcoast.plan._step import trace_step

    plan = rl_plans["full"]
    assert plan.rl_step is not None
    mesh = rc.make_mesh(2, devices=jax.devices()[:2])
    model = rc.sharded_init(
        lambda k: rc.models.Llama(RL_LLAMA, scan_layers=True, key=k), jax.random.key(0), mesh
    )
    algorithm = rc.rl.GRPO(num_generations=4, max_new_tokens=32, beta=0.04)
    batch = _rollout_batch(algorithm, mesh, prompts=1)
    assert "ref_logps" in batch
    optimizer = optax.adamw(1e-4)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    core = rc.train_step(
        algorithm.loss_fn(), optimizer, mesh=mesh, jit=False, parallelism=rc.Parallelism.of(model)
    )
    lowered = eqx.filter_jit(core, donate="all").lower(model, state, batch, jax.random.key(0))
    stats = lowered.compile().compiled.memory_analysis()
    assert stats is not None
    real = (
        stats.argument_size_in_bytes
        + stats.temp_size_in_bytes
        + max(stats.output_size_in_bytes - stats.alias_size_in_bytes, 0)
    )
    planned_peak = plan.rl_step.train_peak - plan.rl_step.reference_copy
    assert abs(planned_peak - real) <= 0.05 * real, (planned_peak, real)
    # The planned batch is the rollout's: its arrays, dtypes and shapes (bytes a device holds).
    _, common, _ = trace_step(planned(RL_LLAMA), plan.layout)
    assert common["batch"] == sum(x.addressable_shards[0].data.nbytes for x in batch.values())
    assert common["tokens"] == 4 * (16 + 32)  # 1 prompt x 4 completions, each row whole


def test_the_sampling_plan_holds_the_key_value_cache_and_decodes_step_by_step(rl_plans) -> None:
    """The sampler's peak holds the cache of every row's prompt and completion; for a GPU
    each decode step reads every weight and the whole cache, and does a matmul per weight."""
    plan = rl_plans["lora"]  # DP 2: a device's prompt, 4 times, each up to 96 new tokens
    step = plan.rl_step
    assert step is not None
    assert step.cache == 4 * _cache_row(16 + 96, itemsize=2)  # the bfloat16 base's
    # TP 2: the heads split over the model axis, and the cache with them.
    tp = rl_plans["full"].rl_step
    assert tp is not None and tp.cache == 4 * _cache_row(16 + 32) // 2
    # Beside it: the parameters, and the optimizer state, which sampling does not read.
    assert step.sampling_peak >= plan.params + plan.opt_state + step.cache
    decode = step.sampling
    assert decode is not None and decode.steps == 95
    assert decode.seconds == pytest.approx(decode.prefill + 95 * decode.step)
    assert decode.step_bytes == decode.step_floor == plan.params + step.cache
    assert decode.step_memory > decode.step_compute  # 4 rows: memory-bound
    # Two FLOPs a weight a row (the head included, the token table not: it is a lookup),
    # and at most the rank-2 adapters' and attention over the whole cache.
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128  # q, o; k, v (2 heads of 16); MLP
    weights = 2 * per_layer + 64 * 256  # and the head
    adapters = 2 * 2 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128))
    rows = 2 * 4  # both devices' (FLOPs are counted over the slice)
    attention = 2 * 2 * rows * 4 * 16 * (16 + 96) * 2
    most = 2 * rows * (weights + adapters) + attention
    assert 2 * rows * weights <= 2 * decode.step_flops <= most
    # The step: sampling, the reference's pass (the adapters off), the train step.
    assert plan.estimate is not None and plan.rl_seconds is not None
    assert step.reference_seconds is not None and step.reference_seconds > 0
    parts = (decode.seconds, step.reference_seconds, plan.estimate.seconds)
    assert plan.rl_seconds == pytest.approx(sum(parts))
    shares = "(sampling {:.2f} s, the reference's pass {:.2f} s, the train step {:.2f} s)"
    report = str(plan)
    assert "95 decode steps" in report
    assert f"estimated RL step: {plan.rl_seconds:.2f} s {shares.format(*parts)}" in report
    # A search by time ranks an RL layout by its whole step, sampling included.
    from redcoast.plan.planner import _tokens_per_second

    tokens = plan.estimate.tokens_per_second * plan.estimate.seconds
    assert _tokens_per_second(plan) == pytest.approx(tokens / plan.rl_seconds)


def test_a_kl_penalty_holds_a_frozen_bfloat16_copy_without_lora_and_none_with_it(
    rl_plans,
) -> None:
    full, lora = rl_plans["full"], rl_plans["lora"]
    step = full.rl_step
    assert step is not None and step.reference_peak is not None
    assert step.reference_copy == full.params // 2  # float32 weights, copied in bfloat16
    # Held beside every program: the train step's arguments and temporaries, and the copy.
    assert step.train_peak >= full.params + full.opt_state + full.temporaries + step.reference_copy
    assert step.sampling_peak >= full.params + full.opt_state + step.reference_copy + step.cache
    # The reference's pass reads the copy, the policy and its optimizer state held beside it.
    assert step.reference_peak >= step.reference_copy + full.params + full.opt_state
    assert full.peak == max(step.train_peak, step.sampling_peak, step.reference_peak)
    assert full.rl_seconds is None  # the CPU has no figures to estimate with
    report = str(full)
    assert "GRPO (dapo loss, beta 0.04; the reference: a frozen bfloat16 copy)" in report
    assert "the reference copy held beside it" in report
    assert lora.rl_step is not None and lora.rl_step.reference_copy == 0
    assert lora.rl_step.reference_peak is not None  # the pass with the adapters off
    assert "the reference: the model with its adapters off" in str(lora)
    assert "the reference copy" not in str(lora)


def test_the_longest_rl_prompt_leaves_room_for_the_completion(monkeypatch, rl_plans) -> None:
    """`longest_seq` of an RL plan is of its prompts: at most the model's positions less
    `max_new_tokens` (compiling replaced by one plan's figures, all of which fit)."""
    from redcoast.plan import planner

    plan = rl_plans["lora"]
    tried = []

    def measure(job, layout, budget):
        tried.append(layout.seq_len)
        return dataclasses.replace(plan, layout=layout, device_memory=budget)

    monkeypatch.setattr(planner, "_measure", measure)
    found = rc.memory_plan(
        RL_LLAMA, devices=2, device_memory="1GB", max_batch=False, longest_seq=True, **GRPO
    )
    assert found.max_seq_len == 128 - 32 and tried == [16, 32, 64, 96]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rl": "ppo"}, "rl must be one of 'grpo'"),
        ({"rl": "grpo", "num_generations": 0}, "num_generations must be a positive int"),
        ({"rl": "grpo", "max_new_tokens": 0}, "max_new_tokens must be a positive int"),
        ({"rl": "grpo", "beta": -0.1}, "beta must be >= 0"),
        ({"num_generations": 8}, "num_generations set an RL step, which rl= asks to plan"),
        ({"rl": "grpo", "preference": "dpo"}, "preference tuning .* or an RL step, not both"),
        ({"rl": "grpo", "context_parallel": True}, "without context_parallel"),
        (
            {"rl": "grpo", "seq_len": 100, "max_new_tokens": 64},
            "100 \\+ 64 tokens, longer than the model's 128 positions",
        ),
        ({"rl": "grpo", "frozen_dtype": "fp32"}, "with rl and beta > 0"),
    ],
)
def test_an_rl_plan_that_cannot_work_gets_one_clear_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rc.memory_plan(RL_LLAMA, devices=2, **kwargs)


def test_rl_is_planned_for_a_model_that_samples() -> None:
    with pytest.raises(ValueError, match="not t5-large, an encoder-decoder"):
        rc.memory_plan("t5-large", devices=2, rl="grpo")

    class Plain(eqx.Module):  # a causal LM without a cached forward pass
        table: jax.Array

        def __call__(self, ids: jax.Array) -> jax.Array:
            return self.table[ids]

    with pytest.raises(ValueError, match="Plain has no vocab_size, max_positions, init_cache"):
        rc.memory_plan(lambda k: Plain(jnp.zeros((8, 8))), devices=2, rl="grpo")


def test_the_cli_plans_an_rl_step(monkeypatch, tmp_path: Path, rl_plans) -> None:
    """The options reach the planner, and its RL plan is printed and written whole
    (compiling replaced by a plan made above)."""
    from redcoast.models import planning

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**RL_LLAMA.to_dict(), "model_type": "llama"}))
    bad = CliRunner().invoke(main, ["plan", str(config), "--num-generations", "4"])
    assert bad.exit_code != 0 and "pass rl='grpo'" in bad.output
    assert "Traceback" not in bad.output
    zero = CliRunner().invoke(main, ["plan", str(config), "--rl", "grpo", "--max-new-tokens", "0"])
    assert zero.exit_code == 2 and "--max-new-tokens" in zero.output
    asked = {}

    def plan(model, **kwargs):
        asked.update(kwargs)
        return rl_plans["full"]

    monkeypatch.setattr(planning, "memory_plan", plan)
    out = tmp_path / "plan.json"
    ran = CliRunner().invoke(
        main,
        [
            *("plan", str(config), "--seq-len", "16", "--rl", "grpo", "--beta", "0.04"),
            *("--num-generations", "4", "--max-new-tokens", "32", "--json", str(out)),
        ],
    )
    assert ran.exit_code == 0, ran.output
    assert asked["rl"] == "grpo" and asked["beta"] == 0.04
    assert (asked["num_generations"], asked["max_new_tokens"], asked["seq_len"]) == (4, 32, 16)
    layout = "layout: TP 2 x DP 1, fp32, remat none, GRPO: 1 prompt x 4 completions/device"
    assert layout in ran.output
    assert "16-token prompts + 32 new" in ran.output
    assert "sampling: 4 completions of each of 1 prompt/device, a key/value cache" in ran.output
    assert "the train step on 4 rows of 16 + 32 tokens/device" in ran.output
    figures = json.loads(out.read_text())
    assert figures["layout"]["rl"]["num_generations"] == 4
    step = figures["rl_step"]
    assert figures["peak"] == max(step["train_peak"], step["sampling_peak"], step["reference_peak"])
