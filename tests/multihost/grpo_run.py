"""Train a small LLaMA by GRPO with `rc.rl.train` on however many processes started this.

The mesh is 2 x 4 either way (one process of 8 devices, or `redcoast launch` of 2 x
4), so every run must give the same numbers. Each process writes `DIR/rank{R}.json`:
the logged rewards and losses, the evaluation, and the prompts its reward function
scored (each process scores the completions of its own rows only).
"""

import argparse
import json
from pathlib import Path

import jax
import optax
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import redcoast as rc

scored: list[str] = []


def correct(prompts, completions, answer, **_):
    scored.extend(prompts)
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    mesh = rc.make_mesh(2)  # first: it starts the distributed runtime
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + 1, special_tokens=["<eos>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator([], trainer)
    config = rc.models.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    tasks = [
        {"prompt": f"{a}{b}:", "answer": f"{min(a, b)}{max(a, b)}"}
        for a in range(8)
        for b in range(8)
    ]
    result = rc.rl.train(
        rc.models.Llama(config, key=jax.random.key(0)),
        optax.adam(3e-3),
        tasks[:48],
        rewards=correct,
        tokenizer=rc.text.load_tokenizer(tok, eos_id=tok.token_to_id("<eos>")),
        per_device_batch_size=2,
        algorithm=rc.rl.GRPO(num_generations=4, max_new_tokens=3, beta=0.05, num_iterations=2),
        eval_prompts=tasks[48:],
        mesh=mesh,
        max_steps=3,
        log_every=1,
        progress=False,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "train": result.history["train"],
        "eval": result.history["eval"],
        "scored": scored,
    }
    (args.out / f"rank{jax.process_index()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
