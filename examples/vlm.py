"""Visual question answering, today's image-to-text: a small LLaVA (a CLIP tower, LLaVA's
projector, the finetune example's pretrained GPT-2 given an `<image>` token) learns to
answer questions about the captioning example's drawn scenes ("What colour is on the
left?"), split over `n_model_shards` devices by redcoast's rules. A fifth of the scene
kinds are held out, never seen in training, and answered greedily from their images
before and after tuning. The tuned model is written as a LLaVA folder.
"""

import tempfile
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax
from _pretrained import base_checkpoint
from captioning import KINDS, draw
from jaxtyping import Array, PRNGKeyArray
from tokenizers import Tokenizer

import redcoast as rc
from redcoast.models import CLIPVisionConfig, Llava, LlavaConfig

# (what is asked, where the answer sits in a scene's kind), and each relation's places.
QUESTIONS = [("colour", 0), ("shape", 1), ("colour", 3), ("shape", 4)]
PLACES = {"left of": ("on the left", "on the right"), "above": ("on top", "at the bottom")}
LENGTH, ANSWER = 96, 8  # tokens of a row; generated for an answer


def ask(kind: tuple[str, ...], q: int) -> tuple[str, str]:  # question q's prompt and answer
    what, at = QUESTIONS[q]
    place = PLACES[kind[2]][at > 1]
    return f" Q: What {what} is {place}? A:", f" {kind[at]}."


def make_collate(tok: Tokenizer, tokens_per_image: int):
    image, eos = tok.token_to_id("<image>"), tok.token_to_id("<|endoftext|>")

    def collate_fn(examples: list[tuple[int, int, int]]) -> dict[str, np.ndarray]:
        # (kind, seed, q) -> a scene, its four questions from q on with the answers (the
        # loss's), question q's prompt alone (for generation)
        n = len(examples)
        ids, mask = np.full((2, n, LENGTH), eos, np.int32), np.zeros((n, LENGTH), bool)
        lengths = np.zeros(n, np.int32)
        for row, (k, _, q) in enumerate(examples):
            row_ids = [*rc.vision.expand_images([image], image, tokens_per_image)]
            for turn in range(4):
                prompt, answer = (tok.encode(t).ids for t in ask(KINDS[k], (q + turn) % 4))
                start = len(row_ids) + len(prompt)
                lengths[row], mask[row, start : start + len(answer)] = lengths[row] or start, True
                row_ids += [*prompt, *answer]
            ids[0, row, : len(row_ids)] = row_ids
            ids[1, row, : lengths[row]] = row_ids[: lengths[row]]
        pixels = np.stack([draw(KINDS[k], seed) for k, seed, _ in examples])[:, None]
        return dict(input_ids=ids[0], loss_mask=mask, prompt_ids=ids[1], prompt_lengths=lengths,
                    pixel_values=pixels)  # fmt: skip

    return collate_fn, eos


def main(
    n_model_shards: int = 2,
    per_device_batch_size: int = 16,
    max_steps: int = 1000,
    learning_rate: float = 3e-3,
    base_dir: str = "runs/finetune/base",
    workdir: str | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Tune a LLaVA on questions about drawn scenes; answer held-out kinds before and after.

    Args:
        n_model_shards: devices each model is split over; the rest split the batch.
        per_device_batch_size: questions per data-parallel device per step.
        max_steps: optimizer steps; the held-out questions are answered at the end.
        learning_rate: peak AdamW learning rate (warm-up, then cosine decay).
        base_dir: the decoder's checkpoint (the finetune example's), built there once.
        workdir: where metrics, checkpoints and the transformers folder (`hf/`) go.
        seed: initialisation, data and the held-out split.
    """
    folder = base_checkpoint(base_dir, n_model_shards=n_model_shards)
    tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    tok.add_special_tokens(["<image>"])  # id 4096, one past the decoder's vocabulary
    decoder = rc.models.from_hf(folder).with_vocab_size(tok.get_vocab_size())
    tower = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, image_size=32, patch_size=8)  # fmt: skip
    config = LlavaConfig(vision_config=tower, text_config=decoder.config, vision_feature_layer=-1,
                         image_token_index=tok.token_to_id("<image>"))  # fmt: skip
    model = Llava(config, key=jax.random.key(seed))  # a new tower and projector
    model = eqx.tree_at(lambda m: m.language_model, model, decoder)  # the pretrained decoder
    collate_fn, eos = make_collate(tok, config.image_tokens)

    kinds = np.random.default_rng(seed).permutation(len(KINDS))
    held_out, seen = np.split(kinds, [len(KINDS) // 5])
    test = [(int(k), 10**6 + i, i % 4) for i, k in enumerate(np.resize(held_out, 256))]

    def train(epoch: int) -> list[tuple[int, int, int]]:
        rng = np.random.default_rng([seed, epoch])
        draws = zip(rng.choice(seen, 4096), rng.integers(0, 4, 4096), strict=True)
        return [(int(k), epoch * 4096 + i, int(q)) for i, (k, q) in enumerate(draws)]

    def pred_fn(model: Llava, batch: dict[str, Array], key: PRNGKeyArray) -> Array:
        ids, lengths, images = batch["prompt_ids"], batch["prompt_lengths"], batch["pixel_values"]
        images = {"pixel_values": images}  # what the prompts' image tokens stand for
        return rc.sampling.generate(model, ids, max_new_tokens=ANSWER, eos_id=eos,
                                    prompt_lengths=lengths, prompt_inputs=images)  # fmt: skip

    def metrics(examples: list[tuple[int, int, int]], answers: list[str]) -> dict[str, float]:
        want = [ask(KINDS[k], q)[1] for k, _, q in examples]  # the first sentence answers
        got = [a.split(".")[0] + "." for a in answers]
        return {"accuracy": np.mean([a == w for a, w in zip(got, want, strict=True)])}

    def output_fn(ids: np.ndarray) -> str:
        return tok.decode([i for i in ids.tolist() if i != eos])

    mesh = rc.make_mesh(n_model_shards)
    placed = rc.place(model, mesh, example_call=Llava.trace_call)
    before = rc.predict(placed, test, collate_fn=collate_fn, pred_fn=pred_fn, output_fn=output_fn,
                        mesh=mesh, per_device_batch_size=per_device_batch_size)  # fmt: skip
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max_steps // 10, max_steps)
    result = rc.fit(
        model,
        optax.adamw(schedule, weight_decay=0.01),
        train,
        collate_fn=collate_fn,
        loss_fn=rc.models.lm_loss,  # the rows' pixel_values go to the model
        mesh=mesh,
        per_device_batch_size=per_device_batch_size,
        max_steps=max_steps,
        evaluation=rc.Evaluation(
            test, pred_fn=pred_fn, output_fn=output_fn, metric_fn=metrics, every=max_steps
        ),
        workdir=workdir,
        seed=seed,
    )
    out = f"{workdir or tempfile.mkdtemp()}/hf"
    result.model.to_hf(out)  # a LLaVA folder: rc.models.from_hf(out)
    print("saved in", out)
    after = result.history["eval"][-1]["eval_accuracy"]
    return {"accuracy_before": metrics(test, before)["accuracy"], "accuracy_after": after}


if __name__ == "__main__":
    print(main())
