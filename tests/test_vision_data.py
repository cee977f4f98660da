"""rc.vision: images preprocessed as transformers' processors make them (to the bit),
image placeholders expanded as LlavaProcessor and Gemma3Processor expand them, and chat
records with images made into rows whose loss counts the assistant's turns alone."""

import functools
import json
import subprocess
import sys
from pathlib import Path
from pydoc_data.topics import topics

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import redcoast as rc

PIL_Image = pytest.importorskip("PIL.Image")
transformers = pytest.importorskip("transformers")

RNG = np.random.default_rng(0)
SPECIAL = ["<eos>", "<pad>", "<image>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
# llava-hf/llava-1.5-7b-hf's chat template (its processor's chat_template.json).
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# Gemma 3's, shortened: images as <start_of_image>, turns between <start_of_turn> and
# <end_of_turn>, the assistant's role called "model".
GEMMA3_TEMPLATE = (
    "{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PATCH = 4  # the LLaVA tower's patches: (16 / 4) ** 2 = 16 features per image


@pytest.fixture(scope="module")
def backend():
    """A byte-level BPE of 400 ids with LLaVA's and Gemma 3's image tokens (a fraction of
    a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    t.train_from_iterator([topics[k] for k in sorted(topics)][:100], trainer)
    return t


def hf_tokenizer(backend, image_token: str):
    """`backend` as a `transformers` tokenizer whose image token (the one the features
    replace, which the processors read) is `image_token`."""
    names = {"image_token": image_token, "boi_token": "<start_of_image>"}
    names |= {"eoi_token": "<end_of_image>"}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", extra_special_tokens=names
    )


@pytest.fixture(scope="module")
def tok(backend):
    """LLaVA's tokenizer: its image token is `<image>`."""
    return hf_tokenizer(backend, "<image>")


@pytest.fixture(scope="module")
def llava(tok, tmp_path_factory):
    """A LLaVA processor (CLIP's image processor at 16 x 16, 16 image tokens) saved as
    `transformers` saves one, and the processor."""
    folder = tmp_path_factory.mktemp("llava")
    images = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}
    )
    processor = transformers.LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_TEMPLATE,
    )
    processor.save_pretrained(folder)
    return folder, processor


def noise(height: int, width: int, channels: int = 3) -> np.ndarray:
    shape = (height, width) if channels == 1 else (height, width, channels)
    return RNG.integers(0, 256, shape, dtype=np.uint8)


def images_of_every_kind(tmp_path: Path) -> list:
    """Non-square images smaller and larger than the processors' sizes, RGBA, greyscale,
    a palette with a transparent colour, and files (one turned by its EXIF tag)."""
    rgba_file, turned = tmp_path / "rgba.png", tmp_path / "turned.jpg"
    PIL_Image.fromarray(noise(21, 34, 4), "RGBA").save(rgba_file)
    exif = PIL_Image.Exif()
    exif[0x0112] = 6  # orientation: rotated 90 degrees
    PIL_Image.fromarray(noise(30, 45)).save(turned, exif=exif)
    palette = PIL_Image.fromarray(noise(19, 26, 1), "L").convert("P")
    palette.info["transparency"] = 7
    return [
        PIL_Image.fromarray(noise(13, 29)),
        PIL_Image.fromarray(noise(97, 41)),
        PIL_Image.fromarray(noise(300, 224)),
        PIL_Image.fromarray(noise(45, 31, 4), "RGBA"),
        PIL_Image.fromarray(noise(40, 23, 1), "L"),
        palette,
        noise(33, 17),
        noise(18, 61, 4),
        str(rgba_file),
        str(turned),
    ]


PROCESSORS = {
    "clip": (
        "CLIPImageProcessorPil",
        dict(size={"shortest_edge": 24}, crop_size={"height": 20, "width": 22}),
    ),
    # A crop larger than the resized image: padded with black.
    "clip-padded": ("CLIPImageProcessorPil", dict(size=12, crop_size=16)),
    "siglip": ("SiglipImageProcessorPil", dict(size={"height": 17, "width": 40})),
    "gemma3": (
        "Gemma3ImageProcessorPil",
        dict(size={"height": 28, "width": 28}, image_mean=[0.5] * 3, image_std=[0.5] * 3),
    ),
}


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_pixels_equal_transformers_image_processors(name, tmp_path) -> None:
    cls, kwargs = PROCESSORS[name]
    theirs = getattr(transformers, cls)(**kwargs)
    theirs.save_pretrained(tmp_path)
    ours = rc.vision.ImageProcessor.from_folder(tmp_path)
    assert ours.output_size is not None
    for i, image in enumerate(images_of_every_kind(tmp_path)):
        # transformers takes no (height, width) array: the same as one channel.
        given = image[..., None] if isinstance(image, np.ndarray) and image.ndim == 2 else image
        want = np.asarray(theirs(given, return_tensors="np")["pixel_values"][0])
        got = ours(image)
        assert got.dtype == np.float32 and got.shape == (3, *ours.output_size), i
        # Measured equal to the bit; the bound leaves room for float32 rounding.
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=f"image {i}")
    pixels = rc.vision.preprocess([image, image], tmp_path)
    assert pixels.shape == (2, 3, *ours.output_size)


def test_processors_read_from_processor_folders_and_old_configs(llava, tmp_path) -> None:
    folder, processor = llava
    # transformers 5 writes a processor's image processor into processor_config.json.
    assert not (folder / "preprocessor_config.json").exists()
    ours = rc.vision.ImageProcessor.from_folder(folder)
    assert ours == rc.vision.ImageProcessor.clip(size={"shortest_edge": 16}, crop_size=16)
    image = noise(40, 25)
    want = processor.image_processor(image, return_tensors="np")["pixel_values"][0]
    np.testing.assert_array_equal(ours(image), want)
    # Older checkpoints: feature_extractor_type and sizes as bare ints.
    old = {"feature_extractor_type": "CLIPFeatureExtractor", "size": 20, "crop_size": 18}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(old))
    theirs = transformers.CLIPImageProcessorPil(size=20, crop_size=18)
    np.testing.assert_array_equal(
        rc.vision.ImageProcessor.from_folder(tmp_path)(image),
        theirs(image, return_tensors="np")["pixel_values"][0],
    )


def test_bad_images_and_processors_are_clear_errors(tmp_path) -> None:
    processor = rc.vision.ImageProcessor.siglip(size={"height": 8, "width": 8})
    with pytest.raises(TypeError, match=r"uint8.*float32"):
        processor(noise(8, 8).astype(np.float32) / 255)
    with pytest.raises(ValueError, match=r"shape \(3, 10, 12\).*moveaxis"):
        processor(noise(3, 10, 12))
    with pytest.raises(TypeError, match="PIL image, a uint8 numpy array"):
        processor([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match=r"no image file at .*missing\.png"):
        processor(str(tmp_path / "missing.png"))
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(ValueError, match=r"notes\.png' is not an image Pillow can read"):
        processor(tmp_path / "notes.png")
    with pytest.raises(TypeError, match=r"image 1: .*uint8"):
        rc.vision.preprocess([noise(8, 8), noise(8, 8).astype(np.int64)], processor)
    with pytest.raises(
        ValueError, match=r"'LlavaNextImageProcessor': not an image processor rc\.vision knows"
    ):
        rc.vision.ImageProcessor.from_dict({"image_processor_type": "LlavaNextImageProcessor"})
    with pytest.raises(ValueError, match="do_pan_and_scan=true"):
        rc.vision.ImageProcessor.gemma3(do_pan_and_scan=True)
    with pytest.raises(ValueError, match="holds no image processor"):
        rc.vision.ImageProcessor.from_folder(tmp_path)


def test_pillow_is_imported_on_first_use_only() -> None:
    code = (
        "import sys; sys.modules['PIL'] = None\n"
        "import redcoast as rc\n"
        "try:\n    rc.vision.ImageProcessor.clip()(b'')\n"
        "except ImportError as err:\n    print(err)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert "pip install 'redcoast[vision]'" in out.stdout


def test_expand_images_as_the_processors_do(tok, llava) -> None:
    image = tok.convert_tokens_to_ids("<image>")
    np.testing.assert_array_equal(
        rc.vision.expand_images([5, image, 6, image], image, 3),
        [5, image, image, image, 6, image, image, image],
    )
    _, processor = llava
    text = "USER: <image>\nWhat is it? ASSISTANT:"
    want = processor(text=text, images=[noise(20, 20)])["input_ids"][0]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    np.testing.assert_array_equal(rc.vision.expand_images(ids, image, 16), want)
    # Gemma 3: <start_of_image> becomes \n\n<start_of_image>, the soft tokens, <end_of_image>\n\n.
    gemma = rc.vision.ImageTokens.gemma3(4)
    text = "Look: <start_of_image> now"
    boi, eoi, soft = (tok.convert_tokens_to_ids(t) for t in SPECIAL[3:])
    newlines = tok("\n\n", add_special_tokens=False)["input_ids"]
    got = rc.vision.expand_images(
        tok(text, add_special_tokens=False)["input_ids"],
        soft,
        4,
        placeholder_id=boi,
        before=[*newlines, boi],
        after=[eoi, *newlines],
    )
    np.testing.assert_array_equal(
        got, tok(gemma.expand(text), add_special_tokens=False)["input_ids"]
    )
    with pytest.raises(ValueError, match="one sequence of integer ids"):
        rc.vision.expand_images(np.zeros((2, 3), np.int32), image, 3)
    with pytest.raises(ValueError, match="tokens_per_image must be an int >= 1"):
        rc.vision.expand_images([1], image, 0)


def record(*images, question="What colour is the square?", answer="red"):
    """A record of a user turn with `images` and an assistant's answer."""
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    return {
        "images": list(images),
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
    }


def test_llava_rows_equal_the_processor_and_count_the_assistant_alone(tok, llava) -> None:
    folder, processor = llava
    first, second = noise(20, 31), noise(64, 48)
    two_turns = record(first, answer="red")
    two_turns["messages"] += [
        {"role": "user", "content": [{"type": "text", "text": "And the circle?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "blue"}]},
    ]
    records = [two_turns, record(second, question="Colour?", answer="green")]
    tokens = rc.vision.ImageTokens("<image>", 16)
    rows = rc.vision.chat_rows(records, folder, folder, 96, image_tokens=tokens)
    assert len(rows) == 2 and len(rows[:1]) == 1
    image, pad = tok.convert_tokens_to_ids("<image>"), tok.pad_token_id
    for r, row in zip(records, rows, strict=True):
        text = processor.apply_chat_template(r["messages"])
        want = processor(text=text, images=r["images"], return_tensors="np")
        n = want["input_ids"].shape[1]
        ids, mask = row["input_ids"], row["loss_mask"]
        assert ids.dtype == np.int32 and mask.dtype == np.bool_ and ids.shape == (96,)
        np.testing.assert_array_equal(ids[:n], want["input_ids"][0])
        np.testing.assert_array_equal(row["pixel_values"], want["pixel_values"])
        assert (ids[n:] == pad).all() and not mask[n:].any()
        assert (ids == image).sum() == 1 * 16 and not mask[ids == image].any()
        answers = [m["content"][0]["text"] for m in r["messages"] if m["role"] == "assistant"]
        # The template writes "ASSISTANT: " and the answer and a space after it; the
        # loss counts all after "ASSISTANT:", the generation prompt.
        assert tok.decode(ids[mask]) == "".join(f" {a} " for a in answers)
        prompt = tok.decode(ids[:n][~mask[:n]])
        assert prompt.count("ASSISTANT:") == len(answers) and "red" not in prompt
    batch = rc.vision.collate([rows[0], rows[1]])
    assert batch["pixel_values"].shape == (2, 1, 3, 16, 16)


def test_gemma3_rows_equal_the_processor(backend, tmp_path) -> None:
    tok = hf_tokenizer(backend, "<image_soft_token>")
    images = transformers.Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
    processor = transformers.Gemma3Processor(
        image_processor=images, tokenizer=tok, chat_template=GEMMA3_TEMPLATE, image_seq_length=4
    )
    processor.save_pretrained(tmp_path)
    r = record(noise(30, 20), noise(12, 40), question="Which is larger?", answer="the first")
    rows = rc.vision.chat_rows(
        [r], tmp_path, tmp_path, 128, image_tokens=rc.vision.ImageTokens.gemma3(4), images_per_row=2
    )
    want = processor(
        text=processor.apply_chat_template(r["messages"]), images=r["images"], return_tensors="np"
    )
    n = want["input_ids"].shape[1]
    np.testing.assert_array_equal(rows[0]["input_ids"][:n], want["input_ids"][0])
    np.testing.assert_array_equal(rows[0]["pixel_values"], want["pixel_values"])
    assert tok.decode(rows[0]["input_ids"][rows[0]["loss_mask"]]) == "the first<end_of_turn>\n"


@pytest.fixture(scope="module")
def small_llava(tok):
    """A LLaVA of one layer a part reading 16 x 16 images as 16 features, whose image
    token is the tokenizer's `<image>`."""
    from redcoast.models import CLIPVisionConfig, LlamaConfig, LlavaConfig

    tower = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=PATCH,
    )
    decoder = LlamaConfig(
        vocab_size=400,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    image_token = tok.convert_tokens_to_ids("<image>")
    config = LlavaConfig(vision_config=tower, text_config=decoder, image_token_index=image_token)
    return eqx.filter_jit(lambda k: rc.models.Llava(config, key=k))(jax.random.key(0))


def masked_nll(model, batch) -> tuple[jax.Array, jax.Array]:
    """The loss over the counted tokens, computed directly."""
    logits = jax.vmap(model)(batch["input_ids"], batch["pixel_values"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["input_ids"][:, 1:])
    counted = batch["loss_mask"][:, 1:]
    return (nll * counted).sum() / counted.sum(), counted.sum()


def test_rows_from_a_jsonl_file_give_a_llava_its_loss(small_llava, llava, tmp_path) -> None:
    folder, _ = llava
    data = tmp_path / "data" / "train.jsonl"
    (tmp_path / "data" / "images").mkdir(parents=True)
    for name, shape in (("a.png", (20, 30)), ("b.png", (33, 16))):
        PIL_Image.fromarray(noise(*shape)).save(tmp_path / "data" / "images" / name)
    records = [record("images/a.png"), record("images/b.png", answer="a long answer")]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    # The image tokens come from the model's config; image paths from the file's folder.
    rows = rc.vision.chat_rows(data, folder, folder, 64, model=small_llava)
    given = [record(str(data.parent / "images" / p)) for p in ("a.png", "b.png")]
    given[1]["messages"][1]["content"][0]["text"] = "a long answer"
    same = rc.vision.chat_rows(
        given, folder, folder, 64, image_tokens=rc.vision.ImageTokens("<image>", 16)
    )
    for a, b in zip(rows, same, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    batch = rc.vision.collate(list(rows))
    loss, aux = eqx.filter_jit(rc.models.lm_loss)(small_llava, batch)
    want, count = eqx.filter_jit(masked_nll)(small_llava, batch)
    assert float(aux["tokens"]) == float(count) > 0
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    chunked = functools.partial(rc.models.lm_loss, chunk_tokens=16)  # four chunks a row
    np.testing.assert_allclose(
        float(eqx.filter_jit(chunked)(small_llava, batch)[0]), float(want), rtol=1e-5
    )


def test_bad_records_are_refused_naming_them(llava, small_llava, tmp_path) -> None:
    folder, _ = llava
    tokens = rc.vision.ImageTokens("<image>", 16)

    def rows(records, **kwargs):
        kwargs = {"image_tokens": tokens, **kwargs}
        return rc.vision.chat_rows(records, folder, folder, kwargs.pop("seq_len", 96), **kwargs)

    good = record(noise(20, 20))
    with pytest.raises(ValueError, match=r"record #1 needs fields 'messages' and 'images'"):
        rows([good, {"messages": good["messages"]}])
    with pytest.raises(ValueError, match=r"record #0 has 2 image\(s\) and 2 .*images_per_row=1"):
        rows([record(noise(20, 20), noise(20, 20))])
    no_part = record(noise(20, 20))
    no_part["messages"][0]["content"] = "What colour?"
    with pytest.raises(ValueError, match=r"record #0 has 1 image\(s\) and 0 \{'type': 'image'\}"):
        rows([no_part])
    with pytest.raises(ValueError, match=r"record #0, image 0: .*uint8"):
        rows([record(noise(20, 20).astype(np.float64))])
    with pytest.raises(ValueError, match=r"record #0, image 0: no image file at .*gone.png"):
        rows([record(str(tmp_path / "gone.png"))])
    bad_part = record(noise(20, 20))
    bad_part["messages"][0]["content"].append({"type": "text"})
    with pytest.raises(ValueError, match="message 0 has a text part without a 'text' string"):
        rows([bad_part])
    unanswered = record(noise(20, 20))
    unanswered["messages"].pop()
    with pytest.raises(ValueError, match="record #0 has no assistant message"):
        rows([unanswered])
    n = len(rows([good]).ids[0])
    with pytest.raises(ValueError, match=rf"1 of 3 records are longer than seq_len={n}.*record #1"):
        rows([good, record(noise(20, 20), answer="x " * 40), good], seq_len=n)
    with pytest.raises(ValueError, match=r"images_per_row=0: rows of text alone are rc\.text's"):
        rows([good], images_per_row=0)
    with pytest.raises(ValueError, match="does not hold '<img>' as one token"):
        rows([good], image_tokens=rc.vision.ImageTokens("<img>", 16))
    with pytest.raises(ValueError, match="rendered 0 image tokens"):
        rows([good], image_tokens=rc.vision.ImageTokens("<start_of_image>", 16))
    with pytest.raises(ValueError, match=r"image_tokens= .* or model="):
        rc.vision.chat_rows([good], folder, folder, 96)
    with pytest.raises(ValueError, match="reads 16 features per image"):
        rows([good], image_tokens=rc.vision.ImageTokens("<image>", 8), model=small_llava)
    one, two = rows([good])[0], rows([record(noise(9, 9), noise(9, 9))], images_per_row=2)[0]
    with pytest.raises(ValueError, match=r"row 1's pixel_values have shape \(2, 3, 16, 16\)"):
        rc.vision.collate([one, two])
