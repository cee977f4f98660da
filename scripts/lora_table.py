"""LoRA against full fine-tuning in examples/finetune.py: perplexity gain and AdamW state.

Each row runs the fine-tuning example in its own process (8 simulated CPU devices,
its default 150 steps, the base checkpoint built once and shared): full
fine-tuning, LoRA on the projections (`--lora-rank`), on the token table that
GPT-2's head is tied to (`--lora-table-rank`) and on both, and two wider filters
(LoRA plus every norm and bias; the token table alone, no adapters), which swap
the example's `rc.lora.trainable` for the filter named. "gain / full's" is the
held-out log-perplexity gain over full fine-tuning's; "state / full's" the AdamW
state over full fine-tuning's.

Run: python scripts/lora_table.py   (writes bench-results/lora_table.json; minutes)
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name, rank on the projections, rank on the token table, learning rate, filter
# (None: the example's own)
ROWS = [
    ("full fine-tuning, lr 1e-3", 0, 0, 1e-3, None),
    ("LoRA rank 8 on the projections, lr 1e-2", 8, 0, 1e-2, None),
    ("LoRA rank 2 on the projections, lr 1e-2", 2, 0, 1e-2, None),
    ("LoRA rank 8 on the projections + norms and biases trainable, lr 1e-2", 8, 0, 1e-2, "norms"),
    ("the token table alone trainable (no LoRA), lr 1e-2", 8, 0, 1e-2, "table"),
    ("LoRA rank 2 on the token table, lr 1e-2", 0, 2, 1e-2, None),
    ("LoRA rank 6 on the token table, lr 1e-2", 0, 6, 1e-2, None),
    ("LoRA rank 1 on the projections, 2 on the token table, lr 1e-2", 1, 2, 1e-2, None),
    ("LoRA rank 2 on the projections and the token table, lr 1e-2", 2, 2, 1e-2, None),
]

FILTERS = {
    "norms": """
plain = rc.lora.trainable
rc.lora.trainable = lambda net: jax.tree.map(
    lambda a, b: a or b, plain(net), rc.trainable_mask(net, ["*norm*", "*.bias"]))
""",
    "table": """
rc.lora.apply = rc.lora.merge = lambda net, *args, **kwargs: net
rc.lora.trainable = lambda net: rc.trainable_mask(net, ["*embed_tokens*"])
""",
}


def run(
    rank: int, table_rank: int, lr: float, name: str | None, base: Path
) -> tuple[float, float, float]:
    """(perplexity before, after, AdamW state / full fine-tuning's) of one run."""
    code = (
        "import jax, sys\n"
        "jax.config.update('jax_num_cpu_devices', 8)\n"
        "import redcoast as rc\n"
        + FILTERS.get(name or "", "")
        + "sys.path.insert(0, 'examples')\n"
        + "import finetune\n"
        + f"finetune.main(lora_rank={rank}, lora_table_rank={table_rank}, learning_rate={lr}, "
        + f"base_dir={str(base)!r})\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=os.environ
    )
    text = out.stdout + out.stderr
    ppl = re.search(r"held-out perplexity: ([\d.]+) before, ([\d.]+) after", text)
    state = re.search(r"optimizer state: ([\d.]+) MB; full fine-tuning's ([\d.]+) MB", text)
    if out.returncode or ppl is None or state is None:
        sys.exit(f"the run failed:\n{text[-3000:]}")
    return float(ppl[1]), float(ppl[2]), float(state[1]) / float(state[2])


def main() -> None:
    base = ROOT / "runs" / "lora_table" / "base"
    results = []
    for label, rank, table_rank, lr, name in ROWS:
        before, after, state = run(rank, table_rank, lr, name, base)
        results.append({"run": label, "before": before, "after": after, "state": state})
        print(f"{label}: {before:.0f} -> {after:.0f}", flush=True)
    full = math.log(results[0]["before"] / results[0]["after"])
    print(f"\nheld-out perplexity {results[0]['before']:.0f} before\n")
    print("| run | perplexity after | log-perplexity gain / full's | AdamW state / full's |")
    print("|---|---|---|---|")
    for r in results:
        r["gain"] = math.log(r["before"] / r["after"]) / full
        print(f"| {r['run']} | {r['after']:.0f} | {r['gain']:.2f} | {r['state']:.1%} |")
    out = ROOT / "bench-results" / "lora_table.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
