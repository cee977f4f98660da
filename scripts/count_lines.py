"""Lines of code per example, beside the corresponding example of redco 0.4.23.

A line counts when it holds code: blank lines and comment-only lines do not count;
docstrings do. redco's numbers are `wc -l` of its example scripts (every line,
headers included), as published for redco 0.4.23. fedavg.py and dp_sgd.py import the
model and data pipeline from classification.py; the "with imports" column adds
classification.py's lines to theirs.

Run: python scripts/count_lines.py  (writes bench-results/count_lines.json)
"""

import argparse
import ast
import io
import json
import tokenize
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# redco 0.4.23's examples, `wc -l`.
REDCO = {
    "mnist": 108,
    "classification/regression": 199,
    "text_to_text": 216,
    "language_modeling": 163,
    "meta_learning": 198,
    "reinforcement_learning": 653,
    "federated_learning": 353,
    "differential_privacy": 214,
}
COUNTERPART = {
    "classification": "mnist",
    "language_modeling": "language_modeling",
    "maml": "meta_learning",
    "ppo": "reinforcement_learning",
    "fedavg": "federated_learning",
    "dp_sgd": "differential_privacy",
    "seq2seq": "text_to_text",
}
LIMIT = 120
# finetune.py is the whole fine-tuning job with its variants (text or records, three
# packings, LoRA, QLoRA): its bound is its size, so that it cannot grow unnoticed.
OWN_LIMITS = {"finetune": 208}


def limit(example: str) -> int:
    """The most code lines `examples/<example>.py` may have."""
    return OWN_LIMITS.get(example, LIMIT)


_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}


def code_lines(source: str) -> int:
    """Non-blank lines that hold a token other than a comment (docstrings count)."""
    text = source.splitlines()
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    return sum(1 for i in lines if text[i - 1].strip())


def local_imports(source: str) -> list[str]:
    """The sibling examples a file imports (`from classification import ...`)."""
    names = {p.stem for p in EXAMPLES.glob("*.py")}
    return sorted(
        node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module in names
    )


def count() -> list[dict]:
    rows = []
    for path in sorted(EXAMPLES.glob("*.py")):
        if path.stem.startswith("_"):  # shared code, counted with the examples importing it
            continue
        source = path.read_text()
        own = code_lines(source)
        shared = sum(code_lines((EXAMPLES / f"{m}.py").read_text()) for m in local_imports(source))
        redco = COUNTERPART.get(path.stem)
        rows.append(
            {
                "example": path.stem,
                "lines": own,
                "lines_with_imports": own + shared,
                "wc_l": len(source.splitlines()),
                "redco_example": redco,
                "redco_wc_l": REDCO.get(redco) if redco else None,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results/count_lines.json")
    args = parser.parse_args()
    rows = count()
    head = ("example", "lines", "with imports", "wc -l", "redco example", "redco wc -l")
    table = [
        (
            r["example"],
            str(r["lines"]),
            str(r["lines_with_imports"]),
            str(r["wc_l"]),
            r["redco_example"] or "-",
            str(r["redco_wc_l"] or "-"),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(head)]
    for line in [head, *table]:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)))
    over = [r["example"] for r in rows if r["lines"] > limit(r["example"])]
    longer = [r["example"] for r in rows if r["redco_wc_l"] and r["lines"] >= r["redco_wc_l"]]
    own = ", ".join(f"{name}.py {n}" for name, n in OWN_LIMITS.items())
    print(
        f"over {LIMIT} lines ({own}): {over or 'none'}; not shorter than redco: {longer or 'none'}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    limits = {"limit": LIMIT, "own_limits": OWN_LIMITS}
    Path(args.out).write_text(json.dumps({**limits, "examples": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
