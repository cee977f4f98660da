"""Write the evaluation tasks redcoast ships (`src/redcoast/eval/tasks/*.jsonl`) from the
standard library's source, for the LM Evaluation Harness.

The shipped files were written by this script under Python 3.11 (another version's
standard library gives other functions): run it with that Python to rewrite them the
same.

- `stdlib_choice.jsonl`: a documented function's signature and docstring; which of
  four lines is its body's first (three are other functions' first lines).
- `stdlib_line.jsonl`: the same prompts; the body's first line, to be generated.
- `stdlib_source.jsonl`: whole functions, scored as a rolling log-likelihood
  (perplexity).

Usage:
    python scripts/make_eval_tasks.py
"""

import ast
import json
import random
import sys
import sysconfig
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "src" / "redcoast" / "eval" / "tasks"


def functions(max_chars: int = 900) -> list[dict[str, str]]:
    """Each documented, undecorated function of at most `max_chars` in the standard
    library's modules (tests left out): its header and docstring, and its body."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(stdlib.glob("**/*.py")):
        rel = path.relative_to(stdlib)
        if {"site-packages", "test", "tests", "idlelib"} & set(rel.parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.split("\n")
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.decorator_list:
                continue
            if ast.get_docstring(node) is None or len(node.body) < 2:
                continue
            text = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno])) + "\n"
            split = node.body[0].end_lineno - node.lineno + 1  # the docstring's last line
            head, body = text.split("\n")[:split], text.split("\n")[split:]
            first = body[0]
            if len(text) <= max_chars and first.strip() and not first.strip().startswith("#"):
                found.append(
                    {
                        "module": str(rel),
                        "prompt": "\n".join(head) + "\n",
                        "first": first,
                        "text": text,
                    }
                )
    return found


def main() -> None:
    if sys.version_info[:2] != (3, 11):
        print(f"note: Python {sys.version.split()[0]}; the shipped files are 3.11's")
    rng = random.Random(0)
    pool = functions()
    rng.shuffle(pool)
    lines = sorted({f["first"] for f in pool})
    choice, line = [], []
    for f in pool[:200]:
        wrong = rng.sample([x for x in lines if x != f["first"]], 3)
        label = rng.randrange(4)
        options = [*wrong[:label], f["first"], *wrong[label:]]
        choice.append(
            {"module": f["module"], "context": f["prompt"], "choices": options, "label": label}
        )
    for f in pool[200:300]:
        line.append({"module": f["module"], "context": f["prompt"], "target": f["first"]})
    source = [{"module": f["module"], "text": f["text"]} for f in pool[300:350]]
    for name, records in (
        ("stdlib_choice", choice),
        ("stdlib_line", line),
        ("stdlib_source", source),
    ):
        path = OUT / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"{path}: {len(records)} records")


if __name__ == "__main__":
    main()
