"""`redcoast eval`: the LM Evaluation Harness's tasks on a checkpoint, on the sharded model."""

import json
from pathlib import Path
from typing import Any

import click

from ._cli_shared import devices, shards, simulate_devices


def _tasks(given: str, include: tuple[str, ...]) -> tuple[list[Any], list[str]]:
    """`--tasks` as lm-eval takes them: names, and YAML files read as task configs;
    folders join the include path."""
    from lm_eval.tasks._yaml_loader import load_yaml

    names: list[Any] = []
    folders = list(include)
    for item in filter(None, (t.strip() for t in given.split(","))):
        path = Path(item)
        if path.is_file() and path.suffix in (".yaml", ".yml"):
            names.append(load_yaml(str(path), resolve_func=True))
        elif path.is_dir():
            folders.append(str(path))
        else:
            names.append(item)
    if not names and not folders:
        raise click.UsageError("--tasks names no task; give task names or YAML files.")
    return names, folders


@click.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--tasks",
    default="redcoast",
    show_default=True,
    help="Comma-separated task names (lm-eval's, or redcoast's: the tag `redcoast`), YAML "
    "files or folders of them.",
)
@click.option("--include", multiple=True, help="A folder of YAML tasks (repeatable).")
@devices
@shards(1)
@click.option("--fsdp", is_flag=True, help="Split the weights over the data axis too.")
@click.option("--dtype", default=None, help="The weights' dtype (bfloat16, ...); scores are fp32.")
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Requests per data-parallel device at once.",
)
@click.option("--max-length", type=click.IntRange(min=2), default=None, help="Tokens read at once.")
@click.option("--num-fewshot", type=click.IntRange(min=0), default=None, help="Examples shown.")
@click.option("--limit", type=float, default=None, help="Documents per task (or a fraction).")
@click.option("--seed", default=0, show_default=True, help="The harness's and sampling's seed.")
@click.option("--output", default=None, help="Write the harness's results (JSON) here.")
@click.option("--log-samples", is_flag=True, help="Keep every request and answer in --output.")
def evaluate(
    folder: str,
    tasks: str,
    include: tuple[str, ...],
    devices: int | None,
    n_model_shards: int,
    fsdp: bool,
    dtype: str | None,
    batch_size: int,
    max_length: int | None,
    num_fewshot: int | None,
    limit: float | None,
    seed: int,
    output: str | None,
    log_samples: bool,
) -> None:
    """Score a checkpoint FOLDER on the LM Evaluation Harness's tasks, sharded.

    FOLDER is a transformers checkpoint with its tokenizer (what `to_hf` and the
    finetune example write). The model is split over --n-model-shards devices and the
    requests over the rest; the harness's table is printed and, with --output, its
    results written as JSON. Needs the `eval` extra: pip install 'redcoast[eval]'.

    Example: redcoast eval runs/finetune/model --tasks redcoast -n 2 --output eval.json
    """
    if log_samples and output is None:
        raise click.UsageError("--log-samples keeps the answers in --output: name a file.")
    simulate_devices(devices)
    try:
        from lm_eval.utils import handle_non_serializable, make_table

        from .eval import RedcoastLM, task_manager
        from .eval._harness import evaluate
    except ImportError as err:
        raise click.ClickException(str(err)) from err
    import jax

    names, folders = _tasks(tasks, include)
    try:
        lm = RedcoastLM(
            folder,
            n_model_shards=n_model_shards,
            fsdp=fsdp,
            dtype=dtype,
            batch_size=batch_size,
            max_length=max_length,
        )
        results = evaluate(
            lm,
            names,
            task_manager=task_manager(*folders),
            seed=seed,
            num_fewshot=num_fewshot,
            limit=int(limit) if limit is not None and limit >= 1 else limit,
            log_samples=log_samples,
        )
    except (ValueError, KeyError, OSError) as err:  # bad options, tasks or folder
        raise click.ClickException(str(err)) from err
    if jax.process_index() != 0:
        return
    click.echo(make_table(results))
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(results, indent=2, default=handle_non_serializable)
        Path(output).write_text(text + "\n")
        click.echo(f"results: {output}")
