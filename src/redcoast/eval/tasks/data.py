"""The shipped tasks' records (the `.jsonl` files beside this module), as `datasets`
splits: the task YAMLs' `custom_dataset`, which finds them from any working folder."""

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _records(name: str) -> Any:
    import datasets

    lines = (HERE / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(list(map(json.loads, lines)))})


def stdlib_choice(**_: Any) -> Any:
    return _records("stdlib_choice")


def stdlib_line(**_: Any) -> Any:
    return _records("stdlib_line")


def stdlib_source(**_: Any) -> Any:
    return _records("stdlib_source")
