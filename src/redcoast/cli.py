"""The `redcoast` command: the demo, example runs, and sharding plans."""

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import click

from . import __version__

_TINY = ("gpt", "llama", "gptj", "mlp")


def _simulate_devices(n: int) -> None:
    """Ask for `n` simulated CPU devices; only possible before JAX's backend starts."""
    import jax

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as err:  # the backend already started
        raise click.ClickException(f"cannot simulate {n} devices: {err}") from err


def _examples_dir() -> Path:
    """`examples/` next to the package (installed wheel) or at the source tree's root."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "examples", here.parents[1] / "examples"):
        if candidate.is_dir():
            return candidate
    raise click.ClickException(
        "cannot find the examples folder; run from a redcoast source tree or install the wheel."
    )


def _load_example(name: str) -> ModuleType:
    path = _examples_dir() / f"{name}.py"
    if not path.is_file():
        known = sorted(p.stem for p in _examples_dir().glob("*.py") if not p.stem.startswith("_"))
        raise click.ClickException(f"no example named {name!r}; choose one of {known}.")
    spec = importlib.util.spec_from_file_location(f"redcoast_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="redcoast")
def main() -> None:
    """Automatic tensor and data parallelism for JAX/Equinox models."""


@main.command()
@click.option("--devices", default=8, show_default=True, help="Simulated CPU devices.")
@click.option("--n-model-shards", default=2, show_default=True, help="Tensor-parallel shards.")
@click.option("--max-steps", default=300, show_default=True, help="Optimizer steps to train.")
@click.option("--workdir", default="runs/demo", show_default=True, help="Logs and outputs.")
def demo(devices: int, n_model_shards: int, max_steps: int, workdir: str) -> None:
    """Train a small byte-level language model on Python's own docs, tensor parallel.

    Runs examples/language_modeling.py on simulated CPU devices: the model is split
    across `--n-model-shards` devices and the batch across the rest.
    """
    _simulate_devices(devices)
    example = _load_example("language_modeling")
    example.main(n_model_shards=n_model_shards, max_steps=max_steps, workdir=workdir)


@main.command()
@click.argument("model", type=click.Choice(_TINY))
@click.option("-n", "--n-model-shards", default=2, show_default=True, help="Model-axis size.")
@click.option("--no-trace", is_flag=True, help="Alternate by declaration order instead.")
def plan(model: str, n_model_shards: int, no_trace: bool) -> None:
    """Print the sharding plan of a built-in reference MODEL: every weight's split and why."""
    import jax
    import jax.numpy as jnp

    from .models import DeepMLP, TinyGPT, TinyGPTJ, TinyLlama
    from .sharding import sharding_plan

    key = jax.random.key(0)
    built = {
        "gpt": lambda: TinyGPT(key=key),
        "llama": lambda: TinyLlama(key=key),
        "gptj": lambda: TinyGPTJ(key=key),
        "mlp": lambda: DeepMLP(key=key),
    }[model]()
    x = jnp.ones((2, 64)) if model == "mlp" else jnp.zeros((2, 16), jnp.int32)
    call = None if no_trace else (lambda m: jax.vmap(m)(x))
    try:
        click.echo(str(sharding_plan(built, n_model_shards, example_call=call)))
    except (ValueError, TypeError) as err:
        raise click.ClickException(str(err)) from err


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
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def launch(
    nprocs: int,
    devices_per_proc: int,
    port: int | None,
    timeout: float | None,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND as NPROCS local processes that form one JAX job.

    Example: redcoast launch --nprocs 2 --devices-per-proc 4 -- python train.py

    Output is prefixed with each process's rank. If one fails, the launcher names
    it, stops the rest and returns its exit code (128 + N for a process killed by
    signal N); no process is left behind.
    """
    from .distributed import launch as run

    code = run(
        list(command),
        nprocs=nprocs,
        devices_per_proc=devices_per_proc,
        port=port,
        timeout=timeout,
    )
    sys.exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main()
