"""Planning for other hardware: loops counted as often as they run, a GPU's bfloat16
without the CPU's float32 copies, and the TPU compiler's own figures."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from click.testing import CliRunner
from jaxtyping import TypeCheckError

import redcoast as rc
from redcoast.cli import main
from redcoast.plan import _hlo, _targets

LLAMA = rc.models.LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=8,
    num_attention_heads=4,
    max_position_embeddings=128,
)


def _layers(x: jax.Array, w: jax.Array, scan: bool) -> jax.Array:
    if scan:
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]
    for i in range(w.shape[0]):
        x = jnp.tanh(x @ w[i])
    return x


def _compiled_text(scan: bool) -> tuple[str, float]:
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 128, 128), jnp.float32)
    grad = jax.grad(lambda x, w: _layers(x, w, scan).sum(), argnums=1)
    compiled = jax.jit(grad).lower(x, w).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return compiled.as_text() or "", float(cost["bytes accessed"])


def test_a_scanned_layer_stack_moves_the_bytes_of_the_same_layers_unrolled() -> None:
    scanned, compilers_scanned = _compiled_text(scan=True)
    unrolled, compilers_unrolled = _compiled_text(scan=False)
    # Each scan's body runs once per layer: the forward and the backward loop.
    assert (
        sorted(n for n in _hlo.multipliers(scanned, own_bodies=True).values() if n > 1) == [8] * 4
    )
    # Counting each body once, the count is the compiler's own, with loops or without.
    assert _hlo.bytes_accessed(unrolled) == pytest.approx(compilers_unrolled, rel=1e-3)
    assert _hlo.bytes_accessed(scanned, once=True) == pytest.approx(compilers_scanned, rel=1e-3)
    # Counted per run, the scanned stack moves at least what its layers unrolled move
    # (and its stacked inputs and residuals besides); counted once, far less.
    per_run = compilers_scanned * _hlo.loop_factor(scanned)
    assert per_run == pytest.approx(_hlo.bytes_accessed(scanned), rel=1e-3)
    assert compilers_scanned < 0.6 * compilers_unrolled < per_run < 2.5 * compilers_unrolled


def test_the_cpus_float32_copies_of_bfloat16_weights_and_saved_activations_are_found() -> None:
    def layers(x: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((8, 128, 128), jnp.bfloat16)
    grad = jax.grad(lambda x, w: layers(x, w).astype(jnp.float32).sum(), argnums=1)
    text = jax.jit(grad).lower(x, w).compile().as_text() or ""
    copies = _hlo.cpu_float32_copies(text)
    if "f32[8,128,128]" not in text:  # an XLA:CPU that multiplies bfloat16 (JAX 0.12)
        assert copies == 0
        return
    # The weight's float32 copy, kept through the step, and half of each float32 stack of
    # saved activations (a bfloat16 stack, converted once, that a GPU would keep instead).
    weight, half_a_stack = 4 * 8 * 128 * 128, 4 * 8 * 64 * 128 // 2
    stacks, rest = divmod(copies - weight, half_a_stack)
    assert rest == 0 and stacks >= 1


def test_a_copy_counts_whole_when_its_bfloat16_value_lives_on_and_half_when_it_dies() -> None:
    text = """
%convert_only (param_0: bf16[8,4]) -> f32[8,4] {
  %param_0 = bf16[8,4]{1,0} parameter(0)
  ROOT %convert.1 = f32[8,4]{1,0} convert(%param_0)
}

%convert_exp (param_0.1: bf16[8,4]) -> f32[8,4] {
  %param_0.1 = bf16[8,4]{1,0} parameter(0)
  %convert.2 = f32[8,4]{1,0} convert(%param_0.1)
  ROOT %exp.1 = f32[8,4]{1,0} exponential(%convert.2)
}

ENTRY %main (a: bf16[8,4]) -> f32[8,4] {
  %a = bf16[8,4]{1,0} parameter(0)
  %saved = bf16[8,4]{1,0} get-tuple-element(%loop), index=1
  %kept = bf16[8,4]{1,0} get-tuple-element(%loop), index=2
  %other = bf16[8,4]{1,0} get-tuple-element(%loop), index=3
  %weight = f32[8,4]{1,0} fusion(%a), kind=kLoop, calls=%convert_only
  %dies = f32[8,4]{1,0} fusion(%saved), kind=kLoop, calls=%convert_only
  %lives = f32[8,4]{1,0} fusion(%kept), kind=kLoop, calls=%convert_only
  %again = bf16[8,4]{1,0} add(%kept, %kept)
  %not_a_copy = f32[8,4]{1,0} fusion(%other), kind=kLoop, calls=%convert_exp
  ROOT %sum = f32[8,4]{1,0} add(%weight, %dies)
}
"""
    whole = 4 * 8 * 4
    assert _hlo.cpu_float32_copies(text) == whole + whole // 2 + whole


def test_a_gpu_plan_attends_blockwise_where_cudnn_would_run() -> None:
    from redcoast.nn._kernels import planned_for

    q, k, v = (
        jax.random.normal(key, (2, 1024, 4, 32), jnp.bfloat16)
        for key in jax.random.split(jax.random.key(0), 3)
    )

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return rc.nn.attention(q, k, v, causal=True)

    # (A new function for each trace: JAX keeps a function's trace, and the platform
    # planned for is not part of its key. The planner traces a new step each time.)
    def score_sized(jaxpr: jax.extend.core.ClosedJaxpr) -> bool:
        return any(
            var.aval.shape[-2:] == (1024, 1024)
            for eqn in jaxpr.jaxpr.eqns
            for var in eqn.outvars
            if hasattr(var.aval, "shape")
        )

    assert score_sized(jax.make_jaxpr(lambda *a: attend(*a))(q, k, v))  # the CPU's einsum
    with planned_for("gpu"):
        planned = jax.make_jaxpr(lambda *a: attend(*a))(q, k, v)
        out = attend(q, k, v)
    assert not score_sized(planned)  # flash-style blocks, as cuDNN's kernel
    want = rc.nn.attention(q, k, v, causal=True, implementation="einsum")
    assert jnp.allclose(out.astype(jnp.float32), want.astype(jnp.float32), atol=2e-2)


@pytest.mark.slow
def test_a_gpu_plan_attends_blockwise_and_leaves_out_the_cpus_float32_copies() -> None:
    options = {"devices": 1, "seq_len": 512, "lora_rank": 4, "precision": "bf16"}
    options["max_batch"] = False
    llama = dataclasses.replace(LLAMA, max_position_embeddings=512)
    cpu = rc.memory_plan(llama, **options)
    gpu = rc.memory_plan(llama, target="l4-24gb", **options)
    frozen_bf16 = sum(  # every frozen Linear's weight, stored in bfloat16
        x.size for path, x in _frozen_weights() if path.endswith("weight")
    )
    assert cpu.cpu_copies == 0
    # Each frozen bfloat16 matrix copied once to float32, 4 bytes an element, and the
    # saved activations' copies besides.
    assert gpu.cpu_copies > 0.95 * 4 * frozen_bf16
    # Blockwise attention keeps no scores for the backward pass, the CPU's einsum keeps
    # every layer's: most of this step's memory.
    assert gpu.peak < 0.5 * (cpu.peak - gpu.cpu_copies)
    assert gpu.device_memory == 23034 * 2**20  # the L4's, as nvidia-smi reports it
    assert gpu.estimate is not None and cpu.estimate is None
    assert "float32 copies" in str(gpu) and "blockwise" in str(gpu)
    assert "lower bound" in str(gpu)


@pytest.mark.slow
def test_a_dpo_plan_runs_both_answers_and_the_reference_without_its_adapters() -> None:
    options = {"devices": 2, "seq_len": 32, "lora_rank": 4, "max_batch": False}
    plain = rc.memory_plan(LLAMA, **options)
    dpo = rc.memory_plan(LLAMA, preference="dpo", **options)
    assert "1 DPO pair/device" in str(dpo)
    # The same weights and adapters; twice the sequences, and a forward pass without
    # the adapters for the reference.
    assert (dpo.params, dpo.opt_state) == (plain.params, plain.opt_state)
    assert dpo.activations > 1.5 * plain.activations
    assert dpo.estimate is None and dpo.layout.preference == "dpo"
    with pytest.raises(ValueError, match="choose one of"):
        rc.memory_plan(LLAMA, preference="kto", **options)


def _frozen_weights() -> list[tuple[str, jax.ShapeDtypeStruct]]:
    from redcoast._tree_paths import path_str

    model = jax.eval_shape(
        lambda k: rc.models.Llama(LLAMA, key=k, scan_layers=True), jax.random.key(0)
    )
    leaves = jax.tree_util.tree_leaves_with_path(model)
    return [
        (path_str(p), x)
        for p, x in leaves
        if x.ndim >= 2 and "embed" not in path_str(p) and "lm_head" not in path_str(p)
    ]


def test_the_step_estimate_is_a_roofline_of_the_targets_figures() -> None:
    h100 = _targets.target_named("h100-80gb")
    step = _targets.estimate(
        h100,
        devices=2,
        flops=2 * 989e12,  # one second of each H100's peak
        bytes_per_device=3.35e12 / 2,  # half a second of its memory bandwidth
        collective_bytes=int(450e9 / 10),  # a tenth of a second over NVLink
        tokens=4096,
        n_params=10**9,
    )
    assert step is not None
    assert (step.compute, step.memory, step.communication) == pytest.approx((1.0, 0.5, 0.1))
    assert step.seconds == pytest.approx(1.1)
    assert step.tokens_per_second == pytest.approx(4096 / 1.1)
    assert step.mfu == pytest.approx(6 * 10**9 * 4096 / (2 * 989e12 * 1.1))
    assert "compute-bound" in str(step)
    # Frozen weights need no weight gradients: 4 of the 6 FLOPs per parameter and token.
    frozen = _targets.estimate(h100, **{**_estimate_args(), "n_params": 10, "n_trainable": 0})
    whole = _targets.estimate(h100, **{**_estimate_args(), "n_params": 10})
    assert frozen is not None and whole is not None
    assert frozen.mfu == pytest.approx(whole.mfu * 4 / 6)
    assert _targets.estimate(_targets.target_named("cpu"), **_estimate_args()) is None


def _estimate_args() -> dict:
    return {
        "devices": 1,
        "flops": 1.0,
        "bytes_per_device": 1.0,
        "collective_bytes": 0,
        "tokens": 1,
        "n_params": 1,
    }


def test_sampling_is_estimated_as_a_prefill_and_a_roofline_per_decode_step() -> None:
    h100 = _targets.target_named("h100-80gb")
    sampling = _targets.decode_estimate(
        h100,
        devices=2,
        flops=(2 * 989e12 * 0.01, 2 * 989e12 * 1e-4),  # 10 ms at peak, then 0.1 ms a step
        bytes_per_device=(3.35e12 * 0.002, 3.35e12 * 1e-3),  # 2 ms, then 1 ms a step
        collective_bytes=(0, int(450e9 * 1e-5)),  # 0.01 ms a step over NVLink
        steps=100,
        tokens=6400,
        floor=int(3.35e12 * 5e-4),
    )
    assert sampling is not None
    assert sampling.prefill == pytest.approx(0.01)
    assert sampling.step == pytest.approx(1e-3 + 1e-5)
    assert sampling.seconds == pytest.approx(0.01 + 100 * 1.01e-3)
    assert sampling.tokens_per_second == pytest.approx(6400 / sampling.seconds)
    assert "100 decode steps" in str(sampling) and "memory-bound" in str(sampling)
    cpu = _targets.target_named("cpu")
    options = {"devices": 1, "flops": (1.0, 1.0), "bytes_per_device": (1.0, 1.0)}
    options |= {"collective_bytes": (0, 0), "steps": 1, "tokens": 1, "floor": 1}
    assert _targets.decode_estimate(cpu, **options) is None


def test_a_loop_that_stops_on_its_values_runs_as_often_as_it_is_counted() -> None:
    """Sampling's decode loop ends when every row has: its trip count is the caller's."""
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    loop = jax.jit(lambda x, w: jax.lax.while_loop(lambda h: h.sum() < 1e6, lambda h: h @ w, x))
    text = loop.lower(x, w).compile().as_text() or ""
    assert 7 in _hlo.multipliers(text, own_bodies=True, unbounded=7).values()
    once, twice = (_hlo.bytes_accessed(text, unbounded=n) for n in (1, 2))
    per_run = twice - once
    assert _hlo.bytes_accessed(text, unbounded=5) == once + 4 * per_run
    assert per_run >= 4 * (128 * 128 + 2 * 64 * 128)  # the weight and the rows, read and written
    assert _hlo.loop_factor(text, unbounded=5) > _hlo.loop_factor(text) == 1.0


# A layer stack's matmul as XLA:TPU fuses it: the stacked weight goes into the matmul's
# fusion, which slices one layer of it in a fusion of its own.
_NESTED_TEXT = """HloModule nested

%slice_layer (p0: bf16[8,64,64], p1: s32[]) -> bf16[64,64] {
  %p0 = bf16[8,64,64]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = bf16[1,64,64]{2,1,0} dynamic-slice(%p0, %p1, %zero, %zero), dynamic_slice_sizes={1,64,64}
  ROOT %layer = bf16[64,64]{1,0} bitcast(%ds)
}

%matmul (x: bf16[4,64], w: bf16[8,64,64], i: s32[]) -> bf16[4,64] {
  %x = bf16[4,64]{1,0} parameter(0)
  %w = bf16[8,64,64]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %layer.1 = bf16[64,64]{1,0} fusion(%w, %i), kind=kLoop, calls=%slice_layer
  ROOT %dot = bf16[4,64]{1,0} convolution(%x, %layer.1), dim_labels=bf_io->bf
}

ENTRY %main (x: bf16[4,64], w: bf16[8,64,64], i: s32[]) -> bf16[4,64] {
  %x = bf16[4,64]{1,0} parameter(0)
  %w = bf16[8,64,64]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %out = bf16[4,64]{1,0} fusion(%x, %w, %i), kind=kOutput, calls=%matmul
}
"""


def test_a_layer_sliced_in_a_nested_fusion_is_read_alone() -> None:
    rows, layer, index = 4 * 64 * 2, 64 * 64 * 2, 4
    # The rows in and out, the index, and one layer of the stack's eight.
    assert _hlo.bytes_accessed(_NESTED_TEXT) == rows + layer + index + rows


# A cache written one slot a row, as XLA:TPU runs a scatter: a loop over the rows whose
# body keeps the old slot or takes the new one, and updates the cache in place.
_SCATTER_TEXT = """HloModule scatter

%write (c: bf16[8,768,64], n: bf16[8,1,64], r: s32[], p: s32[], k: pred[]) -> bf16[8,768,64] {
  %cache = bf16[8,768,64]{2,1,0} parameter(0)
  %new = bf16[8,1,64]{2,1,0} parameter(1)
  %row = s32[] parameter(2)
  %pos = s32[] parameter(3)
  %ok = pred[] parameter(4)
  %zero = s32[] constant(0)
  %mask = pred[1,1,64]{2,1,0} broadcast(%ok), dimensions={}
  %taken = bf16[1,1,64]{2,1,0} dynamic-slice(%new, %row, %zero, %zero), dynamic_slice_sizes={1,1,64}
  %kept = bf16[1,1,64]{2,1,0} dynamic-slice(%cache, %row, %pos, %zero), dynamic_slice_sizes={1,1,64}
  %slot = bf16[1,1,64]{2,1,0} select(%mask, %taken, %kept)
  ROOT %out = bf16[8,768,64]{2,1,0} dynamic-update-slice(%cache, %slot, %row, %pos, %zero)
}

ENTRY %main (c: bf16[8,768,64], n: bf16[8,1,64], r: s32[], p: s32[], k: pred[]) -> bf16[8,768,64] {
  %cache = bf16[8,768,64]{2,1,0} parameter(0)
  %new = bf16[8,1,64]{2,1,0} parameter(1)
  %row = s32[] parameter(2)
  %pos = s32[] parameter(3)
  %ok = pred[] parameter(4)
  ROOT %out = bf16[8,768,64]{2,1,0} fusion(%cache, %new, %row, %pos, %ok), kind=kLoop, calls=%write
}
"""


def test_a_slot_updated_in_place_moves_the_slot_not_the_cache() -> None:
    slot, scalars = 64 * 2, 2 * 4 + 1  # the row and position, and the mask
    # The old slot read, the new one read (through a slice), the slot written; never
    # the 768-slot cache.
    assert _hlo.bytes_accessed(_SCATTER_TEXT) == slot + slot + scalars + slot


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target": "v9-1024"}, "unknown target 'v9-1024'; choose one of cpu, v4-8"),
        ({"target": "v5e-8", "devices": 4}, "v5e-8 has 8 devices; plan it with devices=8"),
        ({"target": "h100-80gb"}, "say how many devices"),
    ],
)
def test_a_target_that_cannot_be_planned_gets_one_clear_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rc.memory_plan(LLAMA, seq_len=32, **kwargs)


def test_a_tpu_plan_without_the_tpu_compiler_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setattr(_targets, "tpu_compiler_installed", lambda: False)
    with pytest.raises(ValueError, match=r"pip install 'redcoast\[tpu\]'"):
        rc.memory_plan(LLAMA, target="v5e-8", seq_len=32)


def test_the_cli_names_the_hardware_and_hints_at_other_targets() -> None:
    result = CliRunner().invoke(
        main, ["plan", "llama-7b", "--target", "nope"], catch_exceptions=False
    )
    assert result.exit_code == 2 and "'nope' is not one of 'cpu', 'v4-8'" in result.output


@pytest.mark.slow
def test_the_tpu_compiler_plans_a_step_for_a_v5e_8_slice() -> None:
    pytest.importorskip("libtpu", reason="the TPU compiler installs with redcoast[tpu]")
    plan = rc.memory_plan(
        LLAMA, target="v5e-8", fsdp=True, seq_len=128, precision="bf16", max_batch=False
    )
    assert plan.target == "v5e-8" and plan.layout.devices == 8
    assert plan.device_memory == 16 * 2**30 and plan.fits
    cpu = rc.memory_plan(LLAMA, devices=8, fsdp=True, seq_len=128, precision="bf16")
    # The same step, another compiler: the same parameters per device, its own temporaries.
    assert plan.params == cpu.params and plan.peak != cpu.peak
    assert plan.estimate is not None and plan.estimate.flops_per_device > 0
    assert "of v5e-8" in str(plan)
    # 128 tokens: attention runs the Pallas kernel, under a shard_map over the step's
    # mesh also where no part of the split names one (data parallelism of LoRA).
    lora = rc.memory_plan(
        LLAMA, target="v5e-8", seq_len=128, precision="bf16", lora_rank=4, max_batch=False
    )
    assert lora.fits and lora.estimate is not None


@pytest.mark.slow
def test_the_tpu_compiler_plans_a_grpo_step_with_lora() -> None:
    pytest.importorskip("libtpu", reason="the TPU compiler installs with redcoast[tpu]")
    plan = rc.memory_plan(
        LLAMA,
        target="v5e-8",
        seq_len=32,
        precision="bf16",
        lora_rank=4,
        rl="grpo",
        num_generations=4,
        max_new_tokens=32,
        beta=0.04,
        max_batch=False,
    )
    step = plan.rl_step
    assert plan.fits and step is not None and step.reference_copy == 0
    # A device's prompt, 4 times: 8 layers, keys and values, 64 slots, 4 heads of 16, bfloat16.
    assert step.cache == 4 * 8 * 2 * 64 * 4 * 16 * 2
    decode = step.sampling
    assert decode is not None and decode.steps == 31
    # The weights (whole on each device of DP 8) and the cache, read at least once a step.
    assert decode.step_floor == plan.params + step.cache <= decode.step_bytes
    assert step.reference_seconds is not None and plan.estimate is not None
    assert plan.rl_seconds == pytest.approx(
        decode.seconds + step.reference_seconds + plan.estimate.seconds
    )


@pytest.mark.slow
def test_on_the_tpu_compiler_a_scanned_stack_is_estimated_as_the_unrolled_one() -> None:
    pytest.importorskip("libtpu", reason="the TPU compiler installs with redcoast[tpu]")
    from redcoast.models.planning import planned

    scanned = planned(LLAMA)

    def unrolled_build(remat: str):
        return lambda key: rc.models.Llama(LLAMA, key=key, scan_layers=False)

    unrolled = dataclasses.replace(scanned, build=unrolled_build)
    plans = [
        rc.memory_plan(m, target="v5e-1", seq_len=64, precision="bf16", max_batch=False)
        for m in (scanned, unrolled)
    ]
    steps = [p.estimate for p in plans]
    assert steps[0] is not None and steps[1] is not None
    assert steps[0].flops_per_device == pytest.approx(steps[1].flops_per_device, rel=0.02)
    assert steps[0].bytes_per_device == pytest.approx(steps[1].bytes_per_device, rel=0.3)


# A program as XLA:TPU prints it, cut to what the counts read: a loop of 8 whose counter
# is unsigned (as in its windowed matmuls) and whose body updates one row of a table in
# place; an all-gather written as its start, a computation overlapping it and its end;
# a collective-permute started and finished; a reduce-scatter fused as an all-reduce and
# a slice.
_TPU_TEXT = """HloModule tpu

%body (p: (u32[], bf16[1000,64], bf16[64])) -> (u32[], bf16[1000,64], bf16[64]) {
  %p = (u32[], bf16[1000,64], bf16[64]) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %t = bf16[1000,64] get-tuple-element(%p), index=1
  %u = bf16[64] get-tuple-element(%p), index=2
  %row = bf16[1,64] reshape(%u)
  %zero = u32[] constant(0)
  %put = bf16[1000,64] dynamic-update-slice(%t, %row, %i, %zero)
  %one = u32[] constant(1)
  %next = u32[] add(%i, %one)
  ROOT %out = (u32[], bf16[1000,64], bf16[64]) tuple(%next, %put, %u)
}

%cond (q: (u32[], bf16[1000,64], bf16[64])) -> pred[] {
  %q = (u32[], bf16[1000,64], bf16[64]) parameter(0)
  %j = u32[] get-tuple-element(%q), index=0
  %eight = u32[] constant(8)
  ROOT %lt = pred[] compare(%j, %eight), direction=LT
}

%start (x: bf16[8,64]) -> (bf16[8,64], bf16[64,64]) {
  %x = bf16[8,64] parameter(0)
  %ag = bf16[64,64] all-gather(%x), channel_id=3, dimensions={0}
  ROOT %started = (bf16[8,64], bf16[64,64]) tuple(%x, %ag)
}

%async_collective_fusion.1 (y: bf16[8,64], z: bf16[64,64]) -> (bf16[64,64], bf16[8,64]) {
  %y = bf16[8,64] parameter(0)
  %z = bf16[64,64] parameter(1)
  %ag.1 = bf16[64,64] all-gather(%y), channel_id=3, dimensions={0}
  %twice = bf16[64,64] add(%z, %z)
  ROOT %both = (bf16[64,64], bf16[8,64]) tuple(%twice, %y)
}

%finish (w: bf16[8,64]) -> bf16[64,64] {
  %w = bf16[8,64] parameter(0)
  ROOT %ag.2 = bf16[64,64] all-gather(%w), channel_id=3, dimensions={0}
}

%sum (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %ab = bf16[] add(%a, %b)
}

%all-reduce-scatter.1 (g: bf16[64,64], k: u32[]) -> bf16[8,64] {
  %g = bf16[64,64] parameter(0)
  %k = u32[] parameter(1)
  %ar = bf16[64,64] all-reduce(%g), channel_id=4, to_apply=%sum
  %c0 = u32[] constant(0)
  ROOT %shard = bf16[8,64] dynamic-slice(%ar, %k, %c0), dynamic_slice_sizes={8,64}
}

ENTRY %main (table: bf16[1000,64], v: bf16[64], s: bf16[8,64], k: u32[]) -> bf16[8,64] {
  %table = bf16[1000,64] parameter(0)
  %v = bf16[64] parameter(1)
  %s = bf16[8,64] parameter(2)
  %k = u32[] parameter(3)
  %c = u32[] constant(0)
  %init = (u32[], bf16[1000,64], bf16[64]) tuple(%c, %table, %v)
  %loop = (u32[], bf16[1000,64], bf16[64]) while(%init), condition=%cond, body=%body
  %async-collective-start.1 = (bf16[8,64], bf16[64,64]) fusion(%s), kind=kCustom, calls=%start
  %shard0 = bf16[8,64] get-tuple-element(%async-collective-start.1), index=0
  %full0 = bf16[64,64] get-tuple-element(%async-collective-start.1), index=1
  %fusion.1 = (bf16[64,64], bf16[8,64]) fusion(%shard0, %full0), calls=%async_collective_fusion.1
  %shard1 = bf16[8,64] get-tuple-element(%fusion.1), index=1
  %async-collective-done.1 = bf16[64,64] fusion(%shard1), kind=kCustom, calls=%finish
  %cp = (bf16[8,64], bf16[8,64], u32[], u32[]) collective-permute-start(%s), channel_id=5
  %cp.done = bf16[8,64] collective-permute-done(%cp)
  ROOT %fusion.2 = bf16[8,64] fusion(%async-collective-done.1, %k), calls=%all-reduce-scatter.1
}
"""


def test_tpu_loops_updates_and_collectives_are_counted_as_they_run() -> None:
    # The loop's unsigned counter runs to 8: its body counts 8 times.
    assert _hlo.multipliers(_TPU_TEXT, own_bodies=True)["body"] == 8
    # Each run writes one row in place (128 bytes), not the 128,000-byte table.
    row, table = 64 * 2, 1000 * 64 * 2
    loop = _hlo.bytes_accessed(_TPU_TEXT) - _hlo.bytes_accessed(_TPU_TEXT, once=True)
    assert 7 * 3 * row <= loop < 7 * 6 * row < table
    # The all-gather once, where it starts (64 x 64 bfloat16), not in the computation
    # overlapping it nor where it ends; the permute by what it delivers (its start's
    # result names its operand too); the fused reduce-scatter by its 8 x 64 shard.
    assert _hlo.collective_bytes(_TPU_TEXT) == 64 * 64 * 2 + 8 * 64 * 2 + 8 * 64 * 2
    # Sampling's loop, as XLA:TPU writes it: `i < 8 and not done` stops on a value it
    # computes, so it runs as often as the caller counts it, not 8 times.
    done = "%d = pred[] constant(false)\n  %n = pred[] not(%d)\n  ROOT %go = pred[] and(%lt, %n)"
    sampling = _TPU_TEXT.replace("ROOT %lt = pred[] compare", "%lt = pred[] compare").replace(
        "direction=LT\n}", f"direction=LT\n  {done}\n}}", 1
    )
    assert "%go = pred[] and(%lt, %n)" in sampling
    assert _hlo.multipliers(sampling, own_bodies=True, unbounded=5)["body"] == 5


def test_a_pallas_kernel_counts_its_body_once_per_point_of_its_grid() -> None:
    from jax.experimental import pallas as pl

    from redcoast.train.throughput import matmul_flops

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = x_ref[...] @ w_ref[...]

    block = pl.BlockSpec((128, 64), lambda i, j: (i, 0))
    matmul = pl.pallas_call(
        kernel,
        grid=(4, 3),
        in_specs=[block, pl.BlockSpec((64, 32), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((128, 32), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((512, 96), jnp.float32),
        interpret=True,
    )
    x, w = jnp.zeros((512, 64)), jnp.zeros((64, 96))
    full, once = matmul_flops(jax.make_jaxpr(matmul)(x, w))
    assert full == once == 2 * 512 * 64 * 96  # the (512, 64) x (64, 96) product, whole


def test_the_cross_entropy_is_optaxs_in_float32_without_a_gather() -> None:
    import optax

    logits = (jax.random.normal(jax.random.key(0), (3, 7, 50)) * 4).astype(jnp.bfloat16)
    labels = jax.random.randint(jax.random.key(1), (3, 7), 0, 50)

    def reference(x: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), labels)

    ours = rc.nn.cross_entropy(logits, labels)
    assert ours.dtype == jnp.float32
    assert jnp.array_equal(ours, reference(logits))
    grad = jax.grad(lambda x: rc.nn.cross_entropy(x, labels).mean())(logits)
    assert jnp.array_equal(grad, jax.grad(lambda x: reference(x).mean())(logits))
    # The label's logit is a sum over the vocabulary, which compilers fuse with the
    # conversion to float32: no gather reads a float32 copy of the logits.
    jaxpr = jax.make_jaxpr(lambda x: rc.nn.cross_entropy(x, labels))(logits)
    assert "gather" not in {e.primitive.name for e in jaxpr.jaxpr.eqns}
    with pytest.raises(TypeCheckError, match="parameter 'labels'"):
        rc.nn.cross_entropy(logits, labels[:, :6])
