"""The hardware a plan is for: TPU slices compiled for by the TPU compiler, GPUs estimated.

With `libtpu` installed (`pip install 'redcoast[tpu]'`), JAX compiles for a TPU
topology on a machine without a TPU: `memory_plan(target="v5e-8")` compiles the
real step with the TPU compiler and reads its memory. No GPU compiler runs here:
a GPU plan is the CPU compiler's program, attending blockwise where a GPU would run
cuDNN's fused attention and without what the float32 copies of bfloat16 weights and
activations that only XLA:CPU makes add (`_hlo.cpu_float32_copies`). Each target's
peak bfloat16 FLOP/s, memory bandwidth and interconnect (per device, dense, as
published) give a step-time estimate (`StepEstimate`).

Published figures: Cloud TPU system architecture pages (v4, v5e, v5p, v6e:
bfloat16 TFLOP/s, HBM capacity and bandwidth, ICI bandwidth per chip); NVIDIA's
H100 SXM, A100 and L4 datasheets (dense bfloat16 tensor TFLOP/s without
sparsity, memory bandwidth, NVLink); a GPU's memory is what `nvidia-smi` reports
as its total (H100 80 GB: 81,559 MiB; L4: 23,034 MiB).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from .._units import fmt_bytes

__all__ = [
    "TARGETS",
    "DecodeEstimate",
    "StepEstimate",
    "Target",
    "decode_estimate",
    "estimate",
    "target_devices",
    "target_named",
]

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Target:
    """A device kind and how many of them make a slice.

    Attributes:
        name: what `--target` calls it (`"v5e-8"`, `"h100-80gb"`, `"cpu"`).
        kind: `"tpu"` (compiled for by the TPU compiler), `"gpu"` (estimated from the
            CPU compiler's program) or `"cpu"`.
        devices: devices in the slice (TPU); None where the plan says how many.
        memory: bytes of memory per device, or None.
        flops: peak dense bfloat16 FLOP/s per device, or None.
        bandwidth: memory bandwidth per device, bytes/s, or None.
        interconnect: bytes/s a device sends to its peers (ICI, NVLink), or None.
        topology: the TPU topology name JAX takes (`"v5e:2x4"`).
    """

    name: str
    kind: str
    devices: int | None = None
    memory: int | None = None
    flops: float | None = None
    bandwidth: float | None = None
    interconnect: float | None = None
    topology: str | None = None


def _tpu(name: str, topology: str, chips: int, memory: int, tflops: float, hbm: float,
         ici_gbps: float) -> Target:  # fmt: skip
    return Target(
        name, "tpu", chips, memory, tflops * 1e12, hbm * 1e9, ici_gbps * 1e9 / 8, topology
    )


def _gpu(
    name: str, memory_mib: int, tflops: float, bandwidth_gbs: float, link_gbs: float
) -> Target:
    return Target(
        name, "gpu", None, memory_mib * 2**20, tflops * 1e12, bandwidth_gbs * 1e9, link_gbs * 1e9
    )


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("cpu", "cpu"),
        # v4: 275 bf16 TFLOP/s, 32 GiB HBM2 at 1200 GB/s, 2400 Gbps ICI; a v4-8 is 4 chips,
        # which JAX's topology shows as 8 devices (one per TensorCore).
        _tpu("v4-8", "v4:2x2x1", 8, 16 * GiB, 137.5, 600.0, 1200.0),
        # v5e: 197 bf16 TFLOP/s, 16 GB HBM2 at 819 GB/s, 1600 Gbps ICI per chip. HBM is in
        # GiB, as the TPU compiler counts it (it offers a v5e program 15.75 of its 16 GiB).
        _tpu("v5e-1", "v5e:1x1", 1, 16 * GiB, 197.0, 819.0, 1600.0),
        _tpu("v5e-4", "v5e:2x2", 4, 16 * GiB, 197.0, 819.0, 1600.0),
        _tpu("v5e-8", "v5e:2x4", 8, 16 * GiB, 197.0, 819.0, 1600.0),
        # v5p: 459 bf16 TFLOP/s, 95 GB HBM2e at 2765 GB/s, 4800 Gbps ICI; v5p-8 is 4 chips.
        _tpu("v5p-8", "v5p:2x2x1", 4, 95 * GiB, 459.0, 2765.0, 4800.0),
        # v6e (Trillium): 918 bf16 TFLOP/s, 32 GB HBM at 1640 GB/s, 3584 Gbps ICI.
        _tpu("v6e-1", "v6e:1x1", 1, 32 * GiB, 918.0, 1640.0, 3584.0),
        _tpu("v6e-4", "v6e:2x2", 4, 32 * GiB, 918.0, 1640.0, 3584.0),
        _tpu("v6e-8", "v6e:2x4", 8, 32 * GiB, 918.0, 1640.0, 3584.0),
        # H100 SXM 80 GB: 989 dense bf16 TFLOP/s, 3.35 TB/s HBM3, NVLink 900 GB/s (450 a way).
        _gpu("h100-80gb", 81559, 989.0, 3350.0, 450.0),
        # A100 SXM: 312 dense bf16 TFLOP/s; 40 GB at 1555 GB/s, 80 GB at 2039 GB/s; 600 GB/s.
        _gpu("a100-40gb", 40960, 312.0, 1555.0, 300.0),
        _gpu("a100-80gb", 81920, 312.0, 2039.0, 300.0),
        # L4: 121 dense bf16 TFLOP/s (242 with sparsity), 24 GB GDDR6 at 300 GB/s, PCIe 64 GB/s.
        _gpu("l4-24gb", 23034, 121.0, 300.0, 32.0),
    )
}


def target_named(name: str) -> Target:
    """The target `name` names.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}.")
    return TARGETS[name]


def tpu_compiler_installed() -> bool:
    """Whether `libtpu` (the TPU compiler) is installed here."""
    return importlib.util.find_spec("libtpu") is not None


def target_devices(target: Target, n: int) -> list[Any] | None:
    """The devices to compile for: a TPU topology's, or None (this process's own).

    Raises:
        ValueError: a TPU target without `libtpu`, or `n` other than the slice's size.
    """
    if target.kind != "tpu":
        return None
    if n != target.devices:
        raise ValueError(
            f"{target.name} has {target.devices} devices; plan it with devices="
            f"{target.devices} (--devices {target.devices}), or choose another slice."
        )
    if not tpu_compiler_installed():
        raise ValueError(
            f"planning for {target.name} compiles with the TPU compiler, libtpu, which is not "
            "installed here: pip install 'redcoast[tpu]' (it runs on a machine without a "
            "TPU), or plan for --target cpu or a GPU."
        )
    import os

    from jax.experimental import topologies

    # libtpu asks the environment for the hosts of a slice (there is none here), and
    # without leave takes a machine-wide lock that a second planning process would fail on.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    bounds = {"chips_per_host_bounds": (1, 1, 1)} if target.devices == 1 else {}
    assert target.topology is not None
    return list(topologies.get_topology_desc(target.topology, "tpu", **bounds).devices)


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """How long a step takes on a target: an estimate from the compiled program.

    A roofline at the target's published peak: the step's FLOPs at its peak FLOP/s
    or its bytes at its memory bandwidth, whichever takes longer, plus its
    collectives' bytes over the interconnect (as if none overlapped compute). Both
    counts are per layer: FLOPs from the traced program (every matmul, a scanned
    layer as often as it runs, recomputation included), bytes from the compiler's
    cost analysis multiplied out over the loops it counts once
    (`_hlo.loop_factor`). Real steps take longer (kernels reach a part of the peak,
    collectives and compute overlap only partly): read it as a lower bound to
    compare layouts and hardware by, not a promise.

    Attributes:
        seconds: the estimate for one step.
        compute: seconds of FLOPs at peak.
        memory: seconds of memory traffic at full bandwidth.
        communication: seconds of collectives over the interconnect.
        tokens_per_second: tokens of the global batch over `seconds`.
        mfu: model FLOPs utilisation at `seconds`: the FLOPs the model itself needs
            (2 x parameters x tokens forward, as much again for the inputs'
            gradients, and 2 x trainable parameters x tokens for the weights'; 6NT
            for a full fine-tune, less with frozen weights; no recomputation or
            attention) over the slice's peak FLOP/s.
        flops_per_device: FLOPs of one device's step, recomputation included.
        bytes_per_device: bytes one device reads and writes in a step.
    """

    seconds: float
    compute: float
    memory: float
    communication: float
    tokens_per_second: float
    mfu: float
    flops_per_device: float
    bytes_per_device: float

    def __str__(self) -> str:
        bound = max(("compute", self.compute), ("memory", self.memory), key=lambda kv: kv[1])[0]
        return (
            f"estimated step (a roofline at the hardware's peak, a lower bound): "
            f"{self.seconds * 1e3:.1f} ms, {bound}-bound (compute {self.compute * 1e3:.1f} ms, "
            f"memory {self.memory * 1e3:.1f} ms, collectives {self.communication * 1e3:.1f} "
            f"ms); {self.tokens_per_second:,.0f} tokens/s, MFU {self.mfu:.0%}"
        )


def estimate(
    target: Target,
    *,
    devices: int,
    flops: float,
    bytes_per_device: float,
    collective_bytes: int,
    tokens: int,
    n_params: int,
    n_trainable: int | None = None,
) -> StepEstimate | None:
    """The step-time estimate of a compiled step on `target`, or None without its figures.

    Args:
        target: the hardware.
        devices: devices the step runs on.
        flops: the step's FLOPs on all devices, each loop counted as often as it runs.
        bytes_per_device: bytes one device moves, loops counted.
        collective_bytes: bytes collectives produce on one device, loops counted.
        tokens: tokens of the global batch.
        n_params: the model's parameters.
        n_trainable: those that get gradients (default: all).
    """
    if target.flops is None or target.bandwidth is None:
        return None
    per_device = flops / devices
    compute, memory, communication = _roofline(
        target, per_device, bytes_per_device, collective_bytes
    )
    seconds = max(compute, memory) + communication
    trainable = n_params if n_trainable is None else n_trainable
    model_flops = (4 * n_params + 2 * trainable) * tokens
    return StepEstimate(
        seconds=seconds,
        compute=compute,
        memory=memory,
        communication=communication,
        tokens_per_second=tokens / seconds,
        mfu=model_flops / (devices * target.flops * seconds),
        flops_per_device=per_device,
        bytes_per_device=bytes_per_device,
    )


def _roofline(
    target: Target, flops: float, bytes_moved: float, collective_bytes: int
) -> tuple[float, float, float]:
    """Seconds of one device's FLOPs at the target's peak, of its bytes at its memory
    bandwidth, and of its collectives over the interconnect."""
    assert target.flops is not None and target.bandwidth is not None
    communication = collective_bytes / target.interconnect if target.interconnect else 0.0
    return flops / target.flops, bytes_moved / target.bandwidth, communication


@dataclasses.dataclass(frozen=True)
class DecodeEstimate:
    """How long sampling takes on a target: the prompts' prefill, then a decode step per token.

    The sampler's program is the prompts through the model (the prefill, filling the
    key/value cache) and a loop that feeds one token of every row through the model
    and reads the whole cache at each step. Each part is a roofline as in
    `StepEstimate`: FLOPs at the peak or bytes at the bandwidth, whichever takes
    longer, plus collectives over the interconnect, the prefill's once and a decode
    step's once per new token. FLOPs are counted on the traced program (the decode
    loop's body once per step), bytes and collectives on the compiled one (the
    loop's body per run). A decode step reads every weight and the cache for about
    2 FLOPs a weight a row, so at small batches it is memory-bound: its time is what
    it reads over the bandwidth. The loop stops when every row has produced its
    end-of-sequence token; it is counted to `max_new_tokens`, the longest sampling
    takes. A lower bound of that longest time, as `StepEstimate` is of a step's.

    Attributes:
        seconds: the prefill and every decode step.
        prefill: seconds of the program outside the decode loop (prefill, first draw).
        step: seconds of one decode step.
        steps: decode steps counted (`max_new_tokens - 1`: the prefill draws the first).
        step_compute: seconds of a decode step's FLOPs at peak.
        step_memory: seconds of a decode step's bytes at full bandwidth.
        step_communication: seconds of a decode step's collectives.
        step_flops: FLOPs of one decode step on one device.
        step_bytes: bytes one device reads and writes in a decode step.
        step_floor: what a decode step reads at least: every weight one device
            computes with (its shards, FSDP's gathered) and its part of the cache,
            once. The compiled step moves more: it reads a layer's cache into the
            attention and writes it back, and copies between layouts.
        tokens_per_second: tokens the slice samples (every row to `max_new_tokens`)
            over `seconds`.
    """

    seconds: float
    prefill: float
    step: float
    steps: int
    step_compute: float
    step_memory: float
    step_communication: float
    step_flops: float
    step_bytes: float
    step_floor: float
    tokens_per_second: float

    def __str__(self) -> str:
        bound = "memory" if self.step_memory >= self.step_compute else "compute"
        return (
            f"estimated sampling (the same roofline): {self.seconds:.2f} s = prefill "
            f"{self.prefill * 1e3:.1f} ms + {self.steps:,} decode steps x "
            f"{self.step * 1e3:.2f} ms, each {bound}-bound (moves {fmt_bytes(self.step_bytes)}, "
            f"the weights and cache once {fmt_bytes(self.step_floor)}: "
            f"{self.step_memory * 1e3:.2f} ms; {self.step_flops / 1e9:.1f} GFLOP: "
            f"{self.step_compute * 1e3:.2f} ms; collectives {self.step_communication * 1e3:.2f} "
            f"ms); {self.tokens_per_second:,.0f} sampled tokens/s"
        )


def decode_estimate(
    target: Target,
    *,
    devices: int,
    flops: tuple[float, float],
    bytes_per_device: tuple[float, float],
    collective_bytes: tuple[int, int],
    steps: int,
    tokens: int,
    floor: int,
) -> DecodeEstimate | None:
    """The time of a sampling program on `target`, or None without its figures.

    Args:
        target: the hardware.
        devices: devices the program runs on.
        flops: (outside the decode loop, one decode step), on all devices.
        bytes_per_device: (outside the loop, one step), bytes one device moves.
        collective_bytes: (outside the loop, one step), bytes collectives produce on
            one device.
        steps: decode steps.
        tokens: tokens the slice samples.
        floor: bytes a decode step reads at least on one device (the weights it
            computes with and its part of the cache).
    """
    if target.flops is None or target.bandwidth is None:
        return None
    outside = _roofline(target, flops[0] / devices, bytes_per_device[0], collective_bytes[0])
    compute, memory, communication = _roofline(
        target, flops[1] / devices, bytes_per_device[1], collective_bytes[1]
    )
    prefill = max(outside[:2]) + outside[2]
    step = max(compute, memory) + communication
    seconds = prefill + steps * step
    return DecodeEstimate(
        seconds=seconds,
        prefill=prefill,
        step=step,
        steps=steps,
        step_compute=compute,
        step_memory=memory,
        step_communication=communication,
        step_flops=flops[1] / devices,
        step_bytes=bytes_per_device[1],
        step_floor=float(floor),
        tokens_per_second=tokens / seconds,
    )
