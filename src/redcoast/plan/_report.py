"""What `memory_plan` reports: the layout measured, per-device bytes and the verdict."""

from __future__ import annotations

import dataclasses
from typing import Any

from .._progress import counted, elapsed
from .._units import fmt_bytes
from ._targets import StepEstimate

__all__ = ["PRECISIONS", "PREFERENCES", "REMATS", "Layout", "LoRA", "MemoryPlan"]

PRECISIONS = ("fp32", "bf16", "pure-bf16")
PREFERENCES = ("dpo", "simpo", "orpo")
REMATS = ("none", "attention", "dots", "full")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a train step is laid out over devices, and run.

    Attributes:
        devices: all devices of all hosts.
        n_model_shards: the size of the model axis (tensor parallelism).
        fsdp: split weights, gradients and optimizer state over the data axis too.
        precision: `"fp32"`, `"bf16"` (fp32 master weights, bf16 compute) or
            `"pure-bf16"`.
        remat: the zoo's per-block policy, `"none"`, `"attention"`, `"dots"` or
            `"full"` (`rc.remat`).
        per_device_batch_size: sequences per data-parallel device.
        seq_len: tokens per sequence.
        sequence_parallel: the activations between tensor-parallel regions split
            over the model axis too (`rc.SequenceParallel`).
        context_parallel: every sequence split over the data axis instead of the
            rows (`rc.ContextParallel`); `per_device_batch_size` rows then reach
            every device, each holding `1 / n_data` of every row.
        preference: `"dpo"`, `"simpo"` or `"orpo"` to plan preference tuning
            (`rc.preference`): each of `per_device_batch_size` rows is a pair, its
            chosen and rejected answers run in one pass; DPO's reference is the
            model with its adapters off under LoRA (a second forward pass, no
            gradient), otherwise log-probabilities precomputed into the batch.
    """

    devices: int
    n_model_shards: int = 1
    fsdp: bool = False
    precision: str = "fp32"
    remat: str = "none"
    per_device_batch_size: int = 1
    seq_len: int = 1024
    sequence_parallel: bool = False
    context_parallel: bool = False
    preference: str | None = None

    def __str__(self) -> str:
        parts = [f"TP {self.n_model_shards}"] if self.n_model_shards > 1 else []
        if self.sequence_parallel:
            parts = [f"TP {self.n_model_shards} + SP"]
        n_data = self.devices // self.n_model_shards
        data = f"FSDP {n_data}" if self.fsdp else f"DP {n_data}"
        batch = f"batch {self.per_device_batch_size}/device"
        if self.context_parallel:
            data = f"FSDP {n_data} + CP" if self.fsdp else f"CP {n_data}"
            batch = f"batch {self.per_device_batch_size}, each row split {n_data} ways"
        parts.append(data)
        if self.preference is not None:
            pairs = counted(self.per_device_batch_size, f"{self.preference.upper()} pair")
            batch = f"{pairs}/device"
        return " x ".join(parts) + f", {self.precision}, remat {self.remat}, {batch}"


@dataclasses.dataclass(frozen=True)
class LoRA:
    """What a LoRA plan trains: rank-`rank` adapters on `targets`, the rest frozen.

    Attributes:
        rank: the adapters' rank.
        targets: globs over the Linears' paths (`rc.lora.apply`), or `None` for
            every Linear but the output head: each block's attention and MLP
            projections. PEFT's LLaMA default is q_proj and v_proj only (Hu et al.'s
            choice under a fixed parameter budget); QLoRA (Dettmers et al. 2023)
            found adapters on every linear layer needed to match full fine-tuning.
            On LLaMA-7B at rank 8 that is 20.0M trainable parameters against 4.2M.
        frozen_dtype: the dtype frozen weights are stored in; bfloat16 by default,
            since they get no gradient or update and only have to be read.
        quantize: `"nf4"` (QLoRA) or `"int8"`: the frozen projections (every Linear
            but the head) quantized with `rc.quantize`, their weights decoded in
            `frozen_dtype` inside the step; `None` for none.
    """

    rank: int
    targets: tuple[str, ...] | None = None
    frozen_dtype: str = "bfloat16"
    quantize: str | None = None

    def describe(self) -> str:
        """`LoRA rank 8 on q_proj, v_proj, frozen weights bfloat16` and the like."""
        where = (
            "the attention and MLP projections (every Linear but the head)"
            if self.targets is None
            else ", ".join(self.targets)
        )
        frozen = self.frozen_dtype if self.quantize is None else f"{self.quantize} (projections)"
        return f"LoRA rank {self.rank} on {where}, frozen weights {frozen}"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one compiled train step, and the verdict.

    Attributes:
        model: what was planned.
        n_params: parameters of the model.
        layout: the layout compiled.
        params: bytes of parameters per device.
        opt_state: bytes of optimizer state per device.
        gradients: bytes of gradients per device (one copy of the parameters in the
            master dtype, split as they are; part of `temporaries`).
        temporaries: XLA's temporary bytes (gradients, activations, workspace).
        peak: arguments + temporaries + outputs that do not reuse donated inputs: the
            step as `fit(..., donate=True)` runs it (see `peak_keeping_model`).
        device_memory: the budget, or `None`.
        max_batch: the largest per-device batch that fits, when asked and known.
        max_seq_len: the longest sequence that fits at the layout's batch, when asked
            (a multiple of 128 tokens, or the model's positions).
        compile_seconds: time to trace and compile this layout's step.
        compiles: the train steps compiled to make the plan: layouts (the one
            planned, or each one a search compiled), per-device batches tried for
            `max_batch`, sequence lengths tried for `max_seq_len`.
        seconds: the whole plan's time, every compile in it (`memory_plan`'s clock).
        tried: other layouts compiled on the way (`--search`), with their peaks.
        lora: the LoRA settings of a LoRA plan, else `None`.
        n_trainable: parameters that train (all of them without LoRA).
        target: the hardware planned for (`"cpu"`, a TPU slice, a GPU).
        cpu_copies: for a GPU, the bytes the CPU compiler's float32 copies of bfloat16
            weights and activations add, which a GPU's program does not: left out of
            `peak` (`redcoast.plan._hlo.cpu_float32_copies`).
        estimate: the step's time on the target, where its peak figures are known.
        refused: the compiler's message when it refused the step as larger than the
            device (the TPU compiler does); `temporaries` is then the figure it gave.
    """

    model: str
    n_params: int
    layout: Layout
    params: int
    opt_state: int
    gradients: int
    temporaries: int
    peak: int
    device_memory: int | None
    max_batch: int | None = None
    max_seq_len: int | None = None
    compile_seconds: float = 0.0
    compiles: tuple[int, int, int] = (1, 0, 0)
    seconds: float = 0.0
    tried: tuple[tuple[str, int | None], ...] = ()
    lora: LoRA | None = None
    n_trainable: int | None = None
    target: str = "cpu"
    cpu_copies: int = 0
    estimate: StepEstimate | None = None
    refused: str | None = None

    @property
    def activations(self) -> int:
        """Temporaries other than the gradients: activations and workspace."""
        return max(self.temporaries - self.gradients, 0)

    @property
    def fits(self) -> bool | None:
        """Whether the peak is within `device_memory` (`None` without a budget)."""
        return None if self.device_memory is None else self.peak <= self.device_memory

    @property
    def peak_keeping_model(self) -> int:
        """The peak of `rc.fit` without `donate=True`, which keeps the model it was
        given valid: one more copy of the parameters beside the step's `peak`."""
        return self.peak + self.params

    def _verdict(self, peak: int) -> str:
        if self.device_memory is None:
            return ""
        return ", fits" if peak <= self.device_memory else ", does not fit"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary of every figure."""
        out = dataclasses.asdict(self)
        out["layout"] = dataclasses.asdict(self.layout)
        out["activations"] = self.activations
        out["fits"] = self.fits
        out["peak_keeping_model"] = self.peak_keeping_model
        out["estimate"] = None if self.estimate is None else dataclasses.asdict(self.estimate)
        return out

    def _lora_lines(self) -> list[str]:
        if self.lora is None:
            return []
        trained = self.n_trainable or 0
        return [
            f"{self.lora.describe()}: {trained:,} trainable parameters "
            f"({100 * trained / self.n_params:.2f}%); gradients and optimizer state for them only"
        ]

    def __str__(self) -> str:
        verdict = {None: "", True: "fits", False: "does not fit"}[self.fits]
        budget = "" if self.device_memory is None else f" of {fmt_bytes(self.device_memory)}"
        where = "" if self.target == "cpu" else f" of {self.target}"
        lines = [
            f"{self.model}: {self.n_params / 1e9:.2f}B parameters, {self.layout.seq_len} tokens, "
            f"{counted(self.layout.devices, 'device')}{where}",
            f"layout: {self.layout}",
            *self._lora_lines(),
            f"per device: parameters {fmt_bytes(self.params)}, optimizer state "
            f"{fmt_bytes(self.opt_state)}, gradients {fmt_bytes(self.gradients)}, "
            f"activations and workspace {fmt_bytes(self.activations)}",
            f"peak: {fmt_bytes(self.peak)}{budget}" + (f": {verdict}" if verdict else ""),
            f"rc.fit hands the model over with donate=True and runs at this peak; without it "
            f"fit keeps the model given valid: {fmt_bytes(self.peak_keeping_model)}"
            + self._verdict(self.peak_keeping_model),
        ]
        if self.refused:
            lines.append(f"the compiler refused the step as larger than the device: {self.refused}")
        if self.cpu_copies:
            lines.append(
                "estimated for the GPU from the CPU compiler's program, attending "
                "blockwise where cuDNN's fused attention would run, less the "
                f"{fmt_bytes(self.cpu_copies)} that XLA:CPU's float32 copies of bfloat16 "
                "weights and activations add"
            )
        if self.estimate is not None:
            lines.append(str(self.estimate))
        if self.max_batch is not None:
            lines.append(f"largest per-device batch that fits: {self.max_batch}")
        if self.max_seq_len is not None:
            batch = self.layout.per_device_batch_size
            lines.append(f"longest sequence that fits at batch {batch}: {self.max_seq_len} tokens")
        if self.tried:
            lines.append(
                "tried: "
                + "; ".join(
                    f"{layout}: {'skipped, parameters alone exceed' if p is None else fmt_bytes(p)}"
                    for layout, p in self.tried
                )
            )
        lines.append(self._compiled())
        return "\n".join(lines)

    def _compiled(self) -> str:
        """`compiled 3 train steps in 25.1 s: 2 layouts, 1 more for the largest batch`."""
        layouts, batches, lengths = self.compiles
        took = elapsed(self.seconds)
        if layouts + batches + lengths == 1:
            return f"compiled the train step in {took}"
        parts = [counted(layouts, "layout") if layouts > 1 else "the layout"]
        if batches:
            parts.append(f"{batches} more for the largest batch")
        if lengths:
            parts.append(f"{lengths} more for the longest sequence")
        steps = counted(layouts + batches + lengths, "train step")
        return f"compiled {steps} in {took}: {', '.join(parts)}"
