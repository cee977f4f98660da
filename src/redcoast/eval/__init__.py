"""Evaluate what you trained where you trained it: the LM Evaluation Harness on the
sharded model.

`RedcoastLM` (registered in lm-eval as `redcoast` when this package is imported) and
`harness` give the harness a redcoast model, `harness_metrics` scores tasks inside
`fit` (`rc.Evaluation(model_fn=...)`); `loglikelihoods` and `continuations` are
what they run, on token ids; `TASKS` holds the tasks redcoast ships, made from the
standard library's source (`task_manager()` finds them). Needs the `eval` extra
(`pip install 'redcoast[eval]'`: `lm-eval[hf]`).

Example:
    >>> import lm_eval, redcoast as rc
    >>> lm = rc.eval.harness(model, "runs/finetune/model")
    >>> lm_eval.simple_evaluate(model=lm, tasks=["redcoast"], task_manager=rc.eval.task_manager())
"""

from pathlib import Path
from typing import Any

try:
    import lm_eval as _lm_eval  # noqa: F401
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "redcoast.eval runs the LM Evaluation Harness: pip install 'redcoast[eval]' "
        f"(lm-eval[hf]); importing it failed: {e}"
    ) from e

from ._harness import RedcoastLM as RedcoastLM
from ._harness import harness as harness
from ._harness import harness_metrics as harness_metrics
from ._score import continuations as continuations
from ._score import loglikelihoods as loglikelihoods

TASKS = Path(__file__).resolve().parent / "tasks"
"""The folder of the tasks redcoast ships (`redcoast_stdlib_choice`, `_line`,
`_source`, tagged `redcoast`): lm-eval's `--include_path` for them."""


def task_manager(*include: str | Path) -> Any:
    """lm-eval's `TaskManager` with the harness's tasks, redcoast's (`TASKS`) and the
    folders of YAML tasks in `include`."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(TASKS), *map(str, include)])
