"""Fine-tune a small GPT-2 on packed rows of one token folder, on however many processes.

Process 0 tokenizes (`rc.text.tokenize`), every process opens the same folder and
reads rows through a sequence that records which rows it was asked for. Each
process writes `DIR/rank{R}.json`: the rows it read, the folder's token count and
the losses.
"""

import argparse
import json
from pathlib import Path
from pydoc_data.topics import topics

import jax
import optax
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import redcoast as rc
from redcoast.models import GPT2, GPT2Config


class Recorded:
    """A sequence that remembers the indices it was asked for."""

    def __init__(self, rows):
        self.rows, self.read = rows, []

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        self.read.append(int(i))
        return self.rows[i]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    mesh = rc.make_mesh(2)
    texts = [topics[k] for k in sorted(topics)[:40]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(texts, trainer)
    tokens = rc.text.tokenize(texts, tok, args.out / "tokens", progress=False)
    rows = Recorded(rc.text.packed(tokens, 32))
    config = GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    result = rc.fit(
        GPT2(config, key=jax.random.key(0)),
        optax.adamw(1e-3),
        rows,
        collate_fn=rc.text.collate,
        loss_fn=rc.models.lm_loss,
        mesh=mesh,
        per_device_batch_size=2,
        max_steps=3,
        log_every=1,
        progress=False,
    )
    report = {
        "read": rows.read,
        "n_rows": len(rows),
        "n_tokens": int(tokens.meta["n_tokens"]),
        "losses": [r["loss"] for r in result.history["train"]],
    }
    (args.out / f"rank{jax.process_index()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
