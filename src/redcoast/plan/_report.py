"""What `memory_plan` reports: the layout measured, per-device bytes and the verdict."""

from __future__ import annotations

import dataclasses
from typing import Any

from .._progress import counted, elapsed
from .._units import fmt_bytes
from ._targets import DecodeEstimate, StepEstimate

__all__ = [
    "PRECISIONS",
    "PREFERENCES",
    "REMATS",
    "RL",
    "RL_ALGORITHMS",
    "Layout",
    "LoRA",
    "MemoryPlan",
    "RLStep",
]

PRECISIONS = ("fp32", "bf16", "pure-bf16")
PREFERENCES = ("dpo", "simpo", "orpo")
REMATS = ("none", "attention", "dots", "full")
RL_ALGORITHMS = ("grpo",)


@dataclasses.dataclass(frozen=True)
class RL:
    """What each step of an RL run (`rc.rl.train`) samples and trains on.

    Attributes:
        algorithm: `"grpo"`: `rc.rl.GRPO` with these settings and TRL's defaults
            otherwise (the `dapo` loss at temperature 1, one update per batch, so the
            batch carries no `old_logps`).
        num_generations: completions sampled of each prompt.
        max_new_tokens: the longest completion: each row is the prompt and this many
            tokens, and the sampler's key/value cache holds as many.
        beta: the KL penalty's weight; above 0 each step also computes the
            reference's log-probabilities (`ref_logps`, a forward pass over the rows)
            with the model's LoRA adapters off, or without LoRA with a frozen copy of
            the model, held on every device beside it.
        reference_dtype: the dtype that copy is stored in, or None where there is
            none (`beta` 0, or LoRA).
    """

    algorithm: str = "grpo"
    num_generations: int = 8
    max_new_tokens: int = 256
    beta: float = 0.0
    reference_dtype: str | None = None

    def describe(self) -> str:
        """`GRPO (dapo loss, beta 0.04; the reference: a frozen bfloat16 copy)` and the like."""
        reference = ""
        if self.beta > 0:
            reference = (
                f"; the reference: a frozen {self.reference_dtype} copy"
                if self.reference_dtype is not None
                else "; the reference: the model with its adapters off"
            )
        return f"{self.algorithm.upper()} (dapo loss, beta {self.beta:g}{reference})"


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
        rl: to plan a step of RL (`rc.rl.train`): `per_device_batch_size` prompts of
            `seq_len` tokens a device, each sampled `rl.num_generations` times, and
            the train step on those rows of prompt and completion.
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
    rl: RL | None = None

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
        if self.rl is not None:
            prompts = counted(self.per_device_batch_size, "prompt")
            completions = f"{self.rl.num_generations} completions/device"
            batch = f"{self.rl.algorithm.upper()}: {prompts} x {completions}"
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
class RLStep:
    """What an RL step runs on each device beside its train step, and what it costs.

    Each step of `rc.rl.train` samples the completions with `rc.sampling` on the model
    being trained (placed as the step has it, no copy), computes the reference's
    log-probabilities when `beta > 0`, then runs the train step. The programs run one
    after another; each one's peak is its compiled program's (arguments,
    temporaries, outputs) and what the run holds beside it that is not its argument.

    Attributes:
        train_peak: the train step's peak, the frozen reference copy held beside it.
        sampling_peak: the sampler's: its program (the parameters, the prompts, the
            key/value cache, the logits and draws of a step) and, held beside it, the
            optimizer state and the reference copy.
        cache: bytes of the key/value cache on one device: every row's prompt and
            `max_new_tokens`, in the dtype of the model's token table.
        reference_peak: the reference's forward pass's (`beta > 0`), held beside it
            the optimizer state (and the policy, when a copy is the reference);
            None without a KL penalty.
        reference_copy: bytes of the frozen reference copy on one device (0 without).
        sampling: the sampler's time on the target (None without its figures).
        reference_seconds: the reference's forward pass's time (a roofline), or None.
        compile_seconds: time to trace and compile the sampler and the reference's pass.
        refused: the compiler's message when it refused one of them as larger than
            the device; its peak is then the arguments and the temporaries it named.
    """

    train_peak: int
    sampling_peak: int
    cache: int
    reference_peak: int | None = None
    reference_copy: int = 0
    sampling: DecodeEstimate | None = None
    reference_seconds: float | None = None
    compile_seconds: float = 0.0
    refused: str | None = None

    @property
    def peak(self) -> int:
        """The largest of the step's peaks: the run's."""
        return max(self.train_peak, self.sampling_peak, self.reference_peak or 0)


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
        rl_step: an RL plan's other programs (the sampler's, the reference's); `peak`
            is then the largest of the step's programs', the rest the train step's.
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
    rl_step: RLStep | None = None

    @property
    def activations(self) -> int:
        """Temporaries other than the gradients: activations and workspace."""
        return max(self.temporaries - self.gradients, 0)

    @property
    def fits(self) -> bool | None:
        """Whether the peak is within `device_memory` (`None` without a budget)."""
        return None if self.device_memory is None else self.peak <= self.device_memory

    @property
    def rl_seconds(self) -> float | None:
        """An RL step's estimated time: its sampling, the reference's pass and its train
        step, one after another; None where one of them is not estimated."""
        step = self.rl_step
        if step is None or step.sampling is None or self.estimate is None:
            return None
        if step.reference_peak is not None and step.reference_seconds is None:
            return None
        return step.sampling.seconds + (step.reference_seconds or 0.0) + self.estimate.seconds

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

    def _rl_lines(self) -> list[str]:
        """The RL step's programs, one line each, in the order they run."""
        rl, step = self.layout.rl, self.rl_step
        if rl is None or step is None:
            return []
        seq = self.layout.seq_len + rl.max_new_tokens
        prompts = counted(self.layout.per_device_batch_size, "prompt")
        rows = self.layout.per_device_batch_size * rl.num_generations
        beside = "the optimizer state"
        if step.reference_copy:
            beside += f" and the reference copy ({fmt_bytes(step.reference_copy)})"
        lines = [
            f"RL step: {rl.describe()}, its programs one after another on each device:",
            f"  sampling: {rl.num_generations} completions of each of {prompts}/device, a "
            f"key/value cache of {seq} tokens a row ({fmt_bytes(step.cache)}/device): peak "
            f"{fmt_bytes(step.sampling_peak)}, {beside} held beside it",
        ]
        if step.reference_peak is not None:
            held = "the policy and " if step.reference_copy else ""
            lines.append(
                f"  the reference's log-probabilities (a forward pass over the rows): peak "
                f"{fmt_bytes(step.reference_peak)}, {held}the optimizer state held beside it"
            )
        copy = ", the reference copy held beside it" if step.reference_copy else ""
        lines.append(
            f"  the train step on {rows} rows of {self.layout.seq_len} + {rl.max_new_tokens} "
            f"tokens/device: peak {fmt_bytes(step.train_peak)}{copy}"
        )
        if step.refused:
            lines.append(f"the compiler refused a program larger than the device: {step.refused}")
        return lines

    def _rl_estimate(self) -> list[str]:
        """The sampler's time and the whole RL step's, where both are known."""
        step, total = self.rl_step, self.rl_seconds
        if step is None or step.sampling is None:
            return []
        lines = [str(step.sampling)]
        if total is not None and self.estimate is not None:
            parts = [("sampling", step.sampling.seconds)]
            if step.reference_seconds is not None:
                parts.append(("the reference's pass", step.reference_seconds))
            parts.append(("the train step", self.estimate.seconds))
            each = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts)
            lines.append(f"estimated RL step: {total:.2f} s ({each})")
        return lines

    def __str__(self) -> str:
        verdict = {None: "", True: "fits", False: "does not fit"}[self.fits]
        budget = "" if self.device_memory is None else f" of {fmt_bytes(self.device_memory)}"
        where = "" if self.target == "cpu" else f" of {self.target}"
        tokens = f"{self.layout.seq_len} tokens"
        if self.layout.rl is not None:
            tokens = f"{self.layout.seq_len}-token prompts + {self.layout.rl.max_new_tokens} new"
        largest = "" if self.rl_step is None else ", the largest of the RL step's programs"
        lines = [
            f"{self.model}: {self.n_params / 1e9:.2f}B parameters, {tokens}, "
            f"{counted(self.layout.devices, 'device')}{where}",
            f"layout: {self.layout}",
            *self._lora_lines(),
            f"per device: parameters {fmt_bytes(self.params)}, optimizer state "
            f"{fmt_bytes(self.opt_state)}, gradients {fmt_bytes(self.gradients)}, "
            f"activations and workspace {fmt_bytes(self.activations)}",
            *self._rl_lines(),
            f"peak: {fmt_bytes(self.peak)}{budget}{largest}" + (f": {verdict}" if verdict else ""),
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
        lines += self._rl_estimate()
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
        noun = "train step" if self.rl_step is None else "RL step"
        if layouts + batches + lengths == 1:
            return f"compiled the {noun} in {took}"
        parts = [counted(layouts, "layout") if layouts > 1 else "the layout"]
        if batches:
            parts.append(f"{batches} more for the largest batch")
        if lengths:
            parts.append(f"{lengths} more for the longest sequence")
        steps = counted(layouts + batches + lengths, noun)
        return f"compiled {steps} in {took}: {', '.join(parts)}"
