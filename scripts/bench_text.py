"""Text to rows: rc.text against Hugging Face run_clm.py's recipe, on the same text and tokenizer.

The recipe is `run_clm.py`'s: `datasets.load_dataset("text", keep_linebreaks=True)`,
`.map(tokenizer, batched=True)`, then `.map(group_texts, batched=True)` into
blocks of `--seq-len` (with its `labels` column, as run_clm builds it), caches in
a fresh folder. redcoast: `rc.text.tokenize` into a token folder and
`rc.text.packed`. Both use one byte-level BPE tokenizer (4096 ids, trained on
Python's documentation, opened with `transformers.AutoTokenizer` by both) on the
standard library's source files repeated to `--mb` megabytes. Each side runs in
a fresh process (peak resident memory of that process); then random access to
rows of each result.

Usage: python scripts/bench_text.py [--mb 200] [--seq-len 1024] [--reps 3]
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from itertools import chain
from pathlib import Path

OUT = Path("bench-results/bench_text.json")


def corpus(folder: Path, mb: int) -> list[Path]:
    """The standard library's .py files, concatenated into files of ~25 MB, to `mb` MB."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [p for p in sorted(stdlib.glob("**/*.py")) if "site-packages" not in p.parts]
    texts = [p.read_bytes().decode("utf-8", errors="replace") for p in sources]
    out, size, i = [], 0, 0
    while size < mb * 10**6:
        path = folder / f"part{len(out):02d}.txt"
        with open(path, "w") as f:
            while f.tell() < 25 * 10**6 and size + f.tell() < mb * 10**6:
                f.write(texts[i % len(texts)])
                i += 1
            size += f.tell()
        out.append(path)
    return out


def tokenizer_folder(folder: Path) -> Path:
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([topics[k] for k in sorted(topics)], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def random_access(rows, n: int) -> float:
    """Rows per second reading `n` random rows, one at a time."""
    import numpy as np

    idx = np.random.default_rng(0).integers(0, len(rows), n)
    start = time.perf_counter()
    for i in idx:
        row = rows[int(i)]
        assert len(row["input_ids"]) > 0
    return n / (time.perf_counter() - start)


def run_redcoast(files: list[Path], tok: Path, work: Path, seq_len: int) -> dict:
    import redcoast as rc

    start = time.perf_counter()
    tokens = rc.text.tokenize(files, tok, work / "tokens", progress=False)
    rows = rc.text.packed(tokens, seq_len)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "tokens": int(tokens.meta["n_tokens"]),
        "rows": len(rows),
        "rows_per_s": random_access(rows, 100_000),
    }


def run_recipe(files: list[Path], tok: Path, work: Path, seq_len: int) -> dict:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(str(tok))
    start = time.perf_counter()
    raw = datasets.load_dataset(
        "text",
        data_files={"train": [str(f) for f in files]},
        keep_linebreaks=True,
        cache_dir=str(work / "cache"),
    )["train"]
    tokenized = raw.map(
        lambda batch: tokenizer(batch["text"]),
        batched=True,
        remove_columns=["text"],
        load_from_cache_file=False,
    )
    n_tokens = sum(len(x) for x in tokenized.with_format("arrow")["input_ids"].to_pylist())

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total = (len(concatenated["input_ids"]) // seq_len) * seq_len
        result = {
            k: [t[i : i + seq_len] for i in range(0, total, seq_len)]
            for k, t in concatenated.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    rows = tokenized.map(group_texts, batched=True, load_from_cache_file=False)
    seconds = time.perf_counter() - start
    rows_np = rows.with_format("numpy")
    return {
        "seconds": seconds,
        "tokens": n_tokens,
        "rows": len(rows),
        "rows_per_s": random_access(rows_np, 10_000),
    }


def child(side: str, files: list[Path], tok: Path, seq_len: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fn = run_redcoast if side == "redcoast" else run_recipe
        out = fn(files, tok, Path(tmp), seq_len)
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="megabytes of text")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", choices=("redcoast", "recipe"))
    parser.add_argument("--files", nargs="*")
    parser.add_argument("--tokenizer")
    args = parser.parse_args()
    if args.child:
        child(args.child, [Path(f) for f in args.files], Path(args.tokenizer), args.seq_len)
        return
    with tempfile.TemporaryDirectory() as tmp:
        files = corpus(Path(tmp), args.mb)
        mb = sum(f.stat().st_size for f in files) / 1e6
        tok = tokenizer_folder(Path(tmp) / "tokenizer")
        runs: dict[str, list[dict]] = {"redcoast": [], "recipe": []}
        for _ in range(args.reps):
            for side in ("recipe", "redcoast"):  # alternating, so load drifts hit both
                cmd = [sys.executable, __file__, "--child", side, "--seq-len", str(args.seq_len)]
                cmd += ["--tokenizer", str(tok), "--files", *map(str, files)]
                env = {**os.environ, "TOKENIZERS_PARALLELISM": "true", "JAX_PLATFORMS": "cpu"}
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
                if done.returncode:
                    raise SystemExit(f"{side} failed:\n{done.stderr[-3000:]}")
                runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
        shutil.rmtree(tok)
    med = {
        side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()
    }
    print(
        f"{mb:.0f} MB of text ({len(files)} files), seq_len {args.seq_len}, "
        f"{os.cpu_count()} cores; medians of {args.reps} alternating runs, each in a fresh process"
    )
    print("| | seconds | MB/s | tokens/s | rows | peak memory | random rows/s |")
    print("|---|---|---|---|---|---|---|")
    for side, name in (("recipe", "run_clm recipe (datasets)"), ("redcoast", "rc.text")):
        r = med[side]
        print(
            f"| {name} | {r['seconds']:.1f} | {mb / r['seconds']:.2f} | "
            f"{r['tokens'] / r['seconds']:,.0f} | {r['rows']:,.0f} | "
            f"{r['peak_rss'] / 2**20:,.0f} MiB | {r['rows_per_s']:,.0f} |"
        )
    ratio_speed = (med["redcoast"]["tokens"] / med["redcoast"]["seconds"]) / (
        med["recipe"]["tokens"] / med["recipe"]["seconds"]
    )
    ratio_mem = med["redcoast"]["peak_rss"] / med["recipe"]["peak_rss"]
    print(
        f"rc.text / recipe: tokens/s {ratio_speed:.2f}x (target >= 1.0), "
        f"MB/s {med['recipe']['seconds'] / med['redcoast']['seconds']:.2f}x, peak memory "
        f"{ratio_mem:.2f}x (target <= 0.25); random access "
        f"{med['redcoast']['rows_per_s']:,.0f} rows/s (target >= 100,000)"
    )
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"args": vars(args), "mb": mb, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
