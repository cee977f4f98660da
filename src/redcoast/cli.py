"""The `redcoast` command: the demo, example runs, sharding plans and evaluation."""

import json
import os
import shlex
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import click

from . import __version__, _examples
from ._cli_shared import DEVICES_OPTION as _DEVICES_OPTION
from ._cli_shared import devices as _DEVICES
from ._cli_shared import shards as _SHARDS
from ._cli_shared import simulate_devices as _simulate_devices
from ._eval_command import evaluate as _evaluate
from ._progress import heartbeat, while_silent
from .plan._targets import TARGETS
from .plan.planner import PRECISIONS, PREFERENCES, RANKINGS, REMATS, RL_ALGORITHMS
from .train.workdir import WorkdirInUseError


def _fresh_folder(parent: Path) -> str:
    """A folder under `parent` that does not exist yet, named by the time: `run-20261125-103000`.

    Under several processes (`redcoast launch`) every one gets process 0's name: their
    clocks can straddle a second. Call after `_simulate_devices`.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = parent / f"run-{stamp}", 1
    while path.exists():
        n += 1
        path = parent / f"run-{stamp}-{n}"
    return _agreed(str(path))


def _agreed(name: str) -> str:
    """Process 0's `name` (a short one) on every process of a job; itself in a single one."""
    from .distributed import initialize

    if not initialize().multi_process:
        return name
    import numpy as np
    from jax.experimental import multihost_utils

    data = np.frombuffer(name.encode(), np.uint8)
    raw = np.zeros(256, np.uint8)  # one size on every process, whatever its name
    raw[: data.size] = data
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(raw))).rstrip(b"\0").decode()


# ----------------------------------------------------------------------------- redcoast run


def _print_metrics(metrics: Mapping[str, Any]) -> None:
    width = max(len(k) for k in metrics)
    click.echo("metrics:")
    for k, v in metrics.items():
        click.echo(f"  {k.ljust(width)}  {v:.4g}" if isinstance(v, float) else f"  {k}  {v}")


def _run_example(
    name: str, kwargs: dict[str, Any], metrics_json: str | None = None, *, command: str
) -> dict[str, Any]:
    """Run the example's `main` (its devices already simulated) and print its metrics;
    while it prints nothing, say every interval that `command` is still working."""
    module = _examples.load_example(name)
    try:
        with while_silent(command):
            metrics = module.main(**kwargs)
    # What redcoast raises for bad options, or for a workdir that holds another run.
    except (ValueError, FloatingPointError, FileExistsError, WorkdirInUseError) as err:
        raise click.ClickException(f"{name}: {err}") from err
    _print_metrics(metrics)
    if metrics_json is not None:
        Path(metrics_json).parent.mkdir(parents=True, exist_ok=True)
        Path(metrics_json).write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def _example_command(name: str, path: Path) -> click.Command:
    doc, options = _examples.describe(path)
    params: list[click.Parameter] = [
        click.Option(["--devices"], **_DEVICES_OPTION),
        click.Option(
            ["--metrics-json"],
            type=click.Path(dir_okay=False),
            help="Also write the metrics main returns to this JSON file.",
        ),
    ]
    for opt in options:
        flag = "--" + opt.name.replace("_", "-")
        decls = [f"{flag}/--no-{flag[2:]}" if opt.type is bool else flag, opt.name]
        params.append(
            click.Option(
                decls,
                type=opt.type,
                default=opt.default,
                show_default=opt.default is not None,
                help=opt.help,
            )
        )

    def callback(devices: int | None, metrics_json: str | None, **kwargs: Any) -> None:
        _simulate_devices(devices)
        _run_example(name, kwargs, metrics_json, command=f"redcoast run {name}")

    summary = doc.split("\n\n")[0].replace("\n", " ")
    return click.Command(name, params=params, callback=callback, help=doc, short_help=summary)


class _Examples(click.Group):
    """`redcoast run`: one subcommand per file in examples/, built from its `main`."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return _examples.example_names()

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        name = cmd_name.replace("-", "_")
        path = _examples.examples_dir() / f"{name}.py"
        if name.startswith("_") or not path.is_file():
            known = ", ".join(_examples.example_names())
            raise click.UsageError(f"no example named {cmd_name!r}; choose one of {known}.", ctx)
        return _example_command(name, path)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            assert command is not None
            rows.append((name, command.get_short_help_str(limit=formatter.width)))
        with formatter.section("Examples"):
            formatter.write_dl(rows)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="redcoast")
def main() -> None:
    """Automatic tensor and data parallelism for JAX/Equinox models."""


@main.command()
@_DEVICES
@_SHARDS(2)
@click.option(
    "--max-steps",
    type=click.IntRange(min=1),
    default=300,
    show_default=True,
    help="Optimizer steps to train.",
)
@click.option(
    "--workdir",
    default=None,
    help="Logs, checkpoints and outputs  [default: a new folder under runs/demo]",
)
@click.option(
    "--resume", is_flag=True, help="Continue the stopped run in --workdir from its checkpoint."
)
def demo(
    devices: int | None, n_model_shards: int, max_steps: int, workdir: str | None, resume: bool
) -> None:
    """Train a small byte-level language model on Python's own docs, tensor parallel.

    Runs examples/language_modeling.py on simulated CPU devices: the model is split
    across `--n-model-shards` devices and the batch across the rest. Prints the
    sharding plan's summary, progress, a generated sample and the metrics, speed
    included (tokens/s, steps/s or s/step). Each run gets a folder of its own under
    runs/demo unless `--workdir` names one; a run stopped by SIGTERM or Ctrl-C saves
    a checkpoint there, and `--workdir FOLDER --resume` continues it.
    """
    if resume and workdir is None:
        raise click.UsageError("--resume continues a run: name its folder with --workdir.")
    _simulate_devices(devices)
    if workdir is None:
        workdir = _fresh_folder(Path("runs/demo"))
        click.echo(f"workdir: {workdir}")
    options = {"n_model_shards": n_model_shards, "max_steps": max_steps}
    metrics = _run_example(
        "language_modeling",
        {**options, "workdir": workdir, "resume": resume},
        command="redcoast demo",
    )
    if "stopped_after_step" in metrics:
        again = ["redcoast demo", f"--workdir {shlex.quote(workdir)}", "--resume"]
        given = {"--devices": (devices, None), "--n-model-shards": (n_model_shards, 2)}
        given["--max-steps"] = (max_steps, 300)
        again += [f"{flag} {value}" for flag, (value, default) in given.items() if value != default]
        click.echo(f"to continue: {' '.join(again)}", err=True)


@main.command()
@click.argument("folder", default="checkpoints/gpt2", required=False)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=200,
    show_default=True,
    help="Optimizer steps of pretraining.",
)
@_DEVICES
@_SHARDS(2)
def pretrained(folder: str, steps: int, devices: int | None, n_model_shards: int) -> None:
    """Make a small pretrained GPT-2 and its tokenizer in FOLDER (checkpoints/gpt2), offline.

    A byte-level BPE tokenizer (4096 ids) and a GPT-2 (4 layers, width 128, 256
    positions) trained for --steps on Python's documentation (pydoc_data.topics),
    written as a Hugging Face folder: config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json, which rc.models.from_hf, rc.text and transformers open.
    It is `redcoast run finetune`'s base (runs/finetune/base). A FOLDER that already
    holds one is kept; delete it to make another.
    """
    _simulate_devices(devices)
    base = _examples.load_example("_pretrained")
    try:
        with while_silent("redcoast pretrained"):
            path = base.base_checkpoint(folder, n_model_shards=n_model_shards, steps=steps)
    except ValueError as err:
        raise click.ClickException(str(err)) from err
    names = ", ".join(sorted(p.name for p in Path(path).iterdir()))
    click.echo(f"{path}: {names}")


@main.group(cls=_Examples, subcommand_metavar="EXAMPLE [OPTIONS]")
def run() -> None:
    """Run one of the examples; each has its own options (`redcoast run EXAMPLE --help`).

    Every option of an example is a keyword argument of its `main` function, with the
    same default; `--devices` sets how many CPU devices JAX simulates.
    """


# What `redcoast plan` adds below a plan for the CPU.
_CPU_NOTE = (
    "(the CPU compiler's figures: --target v5e-8 and other TPU slices compile with the "
    "TPU compiler (pip install 'redcoast[tpu]'); --target h100-80gb, a100-40gb, "
    "l4-24gb ... estimate a GPU)"
)


def _loss_chunks(given: str | None) -> int | Literal["auto"] | None:
    """--loss-chunks as `memory_plan` takes it: None, 'auto' or a number of tokens."""
    if given is None or given == "auto":
        return given
    if not given.isdigit() or int(given) < 1:
        raise click.BadParameter(
            f"{given!r}: give 'auto' or a number of tokens >= 1.", param_hint="--loss-chunks"
        )
    return int(given)


@main.command()
@click.argument("model")
@click.option(
    "--target",
    type=click.Choice(list(TARGETS)),
    default="cpu",
    show_default=True,
    help="The hardware: a TPU slice (compiled by the TPU compiler; needs redcoast[tpu]), "
    "a GPU (estimated from the CPU compiler's program) or the CPU.",
)
@click.option(
    "--devices",
    type=click.IntRange(min=1),
    default=None,
    help="Devices of all hosts  [default: a TPU slice's own, else 8]",
)
@click.option("-n", "--n-model-shards", default=1, show_default=True, help="Model-axis size.")
@click.option("--fsdp", is_flag=True, help="Split weights over the data axis too (ZeRO-3).")
@click.option(
    "--seq-len", default=1024, show_default=True, help="Tokens per sequence (--rl: per prompt)."
)
@click.option("--per-device-batch-size", default=1, show_default=True, help="Sequences per device.")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True)
@click.option("--remat", type=click.Choice(REMATS), default="none", show_default=True)
@click.option(
    "--sequence-parallel",
    is_flag=True,
    help="Split the activations between tensor-parallel regions over the model axis too.",
)
@click.option(
    "--context-parallel",
    is_flag=True,
    help="Split every sequence over the data axis instead of the rows (decoders).",
)
@click.option(
    "--device-memory",
    default=None,
    help="Memory per device with its unit: 32GB, 40GiB (a bare 40 is refused)  "
    "[default: the target's]",
)
@click.option("--search", is_flag=True, help="Find the cheapest layout that fits.")
@click.option(
    "--rank-by",
    type=click.Choice(RANKINGS),
    default="memory",
    show_default=True,
    help="With --search: the first layout that fits (memory), or of all that fit the one "
    "with the most estimated tokens/s (time; compiles every layout).",
)
@click.option(
    "--longest-seq", is_flag=True, help="Also find the longest sequence that fits in the memory."
)
@click.option(
    "--lora-rank",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Plan LoRA fine-tuning with adapters of this rank (0: train every weight).",
)
@click.option(
    "--lora-targets",
    default=None,
    help="Comma-separated globs of the Linears to adapt  [default: attention and MLP projections]",
)
@click.option(
    "--quantize",
    type=click.Choice(["nf4", "int8"]),
    default=None,
    help="With --lora-rank, store the frozen projections quantized (nf4: QLoRA)",
)
@click.option(
    "--frozen-dtype",
    type=click.Choice(["bf16", "fp16", "fp32"]),
    default=None,
    help="Dtype of the frozen weights with LoRA  [default: bf16]",
)
@click.option(
    "--preference",
    type=click.Choice(PREFERENCES),
    default=None,
    help="Plan preference tuning: batches of chosen and rejected pairs (rc.preference); DPO's "
    "reference is the model without its adapters under LoRA, else precomputed.",
)
@click.option(
    "--rl",
    type=click.Choice(RL_ALGORITHMS),
    default=None,
    help="Plan a step of rc.rl.train: sampling --num-generations completions of each of "
    "--per-device-batch-size prompts a device, then the train step on them.",
)
@click.option(
    "--num-generations",
    type=click.IntRange(min=1),
    default=None,
    help="With --rl, completions sampled of each prompt  [default: 8]",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="With --rl, the longest completion; the key/value cache holds the prompt and "
    "these  [default: 256]",
)
@click.option(
    "--beta",
    type=click.FloatRange(min=0.0),
    default=None,
    help="With --rl, the KL penalty's weight; above 0 the reference is the model without "
    "its adapters under LoRA, else a frozen copy in --frozen-dtype  [default: 0]",
)
@click.option(
    "--loss-chunks",
    default=None,
    help="Plan the loss with the logits a chunk of tokens at a time, as rc.models.lm_loss("
    "..., chunk_tokens=...) computes it: 'auto' or the tokens of a chunk  [default: whole]",
)
@click.option("--specs", is_flag=True, help="Also print every weight's split and why.")
@click.option("--json", "json_path", default=None, help="Also write the figures to this file.")
def plan(
    model: str,
    target: str,
    devices: int | None,
    n_model_shards: int,
    fsdp: bool,
    seq_len: int,
    per_device_batch_size: int,
    precision: str,
    remat: str,
    sequence_parallel: bool,
    context_parallel: bool,
    device_memory: str | None,
    search: bool,
    rank_by: str,
    longest_seq: bool,
    lora_rank: int,
    lora_targets: str | None,
    frozen_dtype: str | None,
    quantize: str | None,
    preference: str | None,
    rl: str | None,
    num_generations: int | None,
    max_new_tokens: int | None,
    beta: float | None,
    loss_chunks: str | None,
    specs: bool,
    json_path: str | None,
) -> None:
    """Will MODEL train on this hardware? MODEL is a zoo preset (gpt2-large, llama-7b,
    gpt-j-6b, opt-13b, opt-66b, ...) or a config.json. Compiles the AdamW train step
    on abstract shapes for the --target's devices (simulated CPU devices, or a TPU
    topology) and reports memory per device and an estimated step time. With
    --lora-rank, plans LoRA fine-tuning: only the adapters get gradients and AdamW state.
    With --rl grpo, plans a step of RL: the sampler and the train step, each compiled."""
    if json_path is not None:
        _check_writable(json_path, "--json")
    hardware = TARGETS[target]
    devices = devices or hardware.devices or 8
    # A TPU slice's devices come from its topology; the CPU's run everything else.
    _simulate_devices(devices if hardware.kind != "tpu" else 1)
    from .models import planning

    step = "train step" if rl is None else "RL step's programs"
    what = f"planning {model}: compiling the {step}" + (" for each layout tried" if search else "")
    try:
        with heartbeat(what):
            result = planning.memory_plan(
                model,
                target=target,
                devices=devices,
                n_model_shards=n_model_shards,
                fsdp=fsdp,
                seq_len=seq_len,
                per_device_batch_size=per_device_batch_size,
                precision=precision,
                remat=remat,
                sequence_parallel=sequence_parallel,
                context_parallel=context_parallel,
                device_memory=device_memory,
                search=search,
                rank_by=rank_by,
                longest_seq=longest_seq,
                lora_rank=lora_rank,
                lora_targets=lora_targets,
                frozen_dtype=frozen_dtype,
                quantize=quantize,
                preference=preference,
                rl=rl,
                num_generations=num_generations,
                max_new_tokens=max_new_tokens,
                beta=beta,
                loss_chunks=_loss_chunks(loss_chunks),
            )
        if specs:  # after the plan's clock stopped: its last line times the compiles alone
            with heartbeat(f"planning {model}: tracing every weight's split"):
                split = planning.sharding_plan_of(model, result.layout, result.lora)
            click.echo(f"{split}\n")
    except (ValueError, TypeError) as err:
        raise click.ClickException(str(err)) from err
    click.echo(str(result))
    if target == "cpu":
        click.echo(_CPU_NOTE)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result.to_dict(), indent=2) + "\n")


def _check_writable(path: str, option: str) -> None:
    """Refuse an output file that cannot be written, before minutes of work go into it."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise click.BadParameter(f"{path} is a folder; name a file in it.", param_hint=option)
    if not folder.is_dir():
        raise click.BadParameter(f"folder {folder} does not exist.", param_hint=option)
    if not os.access(target if target.exists() else folder, os.W_OK):
        raise click.BadParameter(f"{path} cannot be written (permissions).", param_hint=option)


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--nprocs", type=click.IntRange(min=1), required=True, help="Processes to start.")
@click.option(
    "--devices-per-proc",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Simulated CPU devices in each process.",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Coordinator port on 127.0.0.1  [default: a free port]",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Stop every process after this many seconds (exit code 124).",
)
@click.option(
    "--verbose", is_flag=True, help="Also show Gloo's line for every connection it makes."
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def launch(
    nprocs: int,
    devices_per_proc: int,
    port: int | None,
    timeout: float | None,
    verbose: bool,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND as NPROCS local processes that form one JAX job.

    Example: redcoast launch --nprocs 2 --devices-per-proc 4 -- redcoast demo --max-steps 20
    (or `-- python your_script.py`)

    Output is prefixed with each process's rank (Gloo's connection lines only with
    --verbose). If one fails, the launcher names it, stops the rest and returns its
    exit code (128 + N for a process killed by signal N); no process is left behind.
    """
    from .distributed import launch as run

    code = run(
        list(command),
        nprocs=nprocs,
        devices_per_proc=devices_per_proc,
        port=port,
        timeout=timeout,
        verbose=verbose,
    )
    sys.exit(128 - code if code < 0 else code)


main.add_command(_evaluate, "eval")


if __name__ == "__main__":
    main()
