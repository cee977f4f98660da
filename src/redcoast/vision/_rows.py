"""Chat records with images to fixed-length rows, kept in memory; and `collate`."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from ..text._instructions import assistant_ids, read_records
from ..text._rows import _check_seq_len, row_index, slice_span
from ..text._rows import collate as text_collate
from ..text._sources import describe_keys
from ..text._tokenizer import Tokenizer, load_tokenizer
from ._image import ImageProcessor, check_array, open_image, pil
from ._tokens import ImageTokens


class ImageRows(Sequence[dict[str, np.ndarray]]):
    """Rows of chat records with images, tokenized in memory; see `chat_rows`.

    Each row's images are read and preprocessed when the row is read; slicing gives a
    view, never a copy.
    """

    def __init__(
        self,
        ids: list[np.ndarray],
        masks: list[np.ndarray],
        images: list[tuple[Any, ...]],
        wheres: list[str],
        *,
        processor: ImageProcessor,
        seq_len: int,
        pad_id: int,
    ):
        self.ids, self.masks, self.images, self.wheres = ids, masks, images, wheres
        self.processor, self.seq_len, self.pad_id = processor, seq_len, pad_id
        self.start, self.stop = 0, len(ids)

    def __len__(self) -> int:
        return self.stop - self.start

    @overload
    def __getitem__(self, i: int) -> dict[str, np.ndarray]: ...
    @overload
    def __getitem__(self, i: slice) -> ImageRows: ...
    def __getitem__(self, i: int | slice) -> dict[str, np.ndarray] | ImageRows:
        if isinstance(i, slice):
            a, b = slice_span(i, len(self))
            new = object.__new__(type(self))
            new.__dict__.update(self.__dict__, start=self.start + a, stop=self.start + b)
            return new
        return self._row(self.start + row_index(i, len(self)))

    def _row(self, i: int) -> dict[str, np.ndarray]:
        n = len(self.ids[i])
        ids = np.full(self.seq_len, self.pad_id, np.int32)
        ids[:n] = self.ids[i]
        mask = np.zeros(self.seq_len, np.bool_)
        mask[:n] = self.masks[i]
        pixels = []
        for k, image in enumerate(self.images[i]):
            try:
                pixels.append(self.processor(image))
            except (TypeError, ValueError, OSError) as err:
                raise ValueError(f"{self.wheres[i]}, image {k}: {err}") from err
        return {"input_ids": ids, "loss_mask": mask, "pixel_values": np.stack(pixels)}


def chat_rows(
    source: Any,
    tokenizer: Any,
    processor: ImageProcessor | str | os.PathLike[str],
    seq_len: int,
    *,
    image_tokens: ImageTokens | None = None,
    model: Any = None,
    images_per_row: int = 1,
    pad_id: int | None = None,
    messages_key: str = "messages",
    images_key: str = "images",
) -> ImageRows:
    """Chat records with images to rows for a vision-language model: one record a row.

    A record is `{"images": [image, ...], "messages": [{"role": ..., "content": [
    {"type": "image"}, {"type": "text", "text": ...}]}, ...]}` (a message's content may
    also be a string), each `{"type": "image"}` standing for the next of `images`. The
    messages go through the tokenizer's chat template (the checkpoint's, saved with
    its processor), each image placeholder is expanded as the model's processor
    expands it (`image_tokens`), and the result is tokenized; the loss counts the
    assistant's turns, as `rc.text.tokenize_instructions` does (never an image token).
    Rows are padded to `seq_len` as `rc.text.padded` pads them. The images are
    checked (files opened, arrays' types and shapes) here, and read and preprocessed
    each time their row is read.

    Args:
        source: a `.jsonl` file, a folder of them, a list of `Path`s, or a list (or
            iterable) of dicts. An image is the path of a file (in a `.jsonl` file,
            relative to the file's folder; else to the working directory), a PIL
            image, or a `uint8` array (see `ImageProcessor`).
        tokenizer: the checkpoint's folder, or a `transformers` tokenizer with a chat
            template.
        processor: an `ImageProcessor`, or the folder `ImageProcessor.from_folder`
            reads (the checkpoint's).
        seq_len: tokens per row; every record must fit.
        image_tokens: the placeholder and its expansion; default: from `model`'s
            config (`ImageTokens.from_config`).
        model: when given, checked: ids within its `vocab_size`, `seq_len` within
            `max_positions`, and for a LLaVA the image tokens and image size its
            config says.
        images_per_row: the images every record must have (a batch stacks them).
        pad_id: the padding id; default: the tokenizer's pad token, else its EOS.
        messages_key, images_key: the records' field names.

    Returns:
        A sequence of `{"input_ids": int32[seq_len], "loss_mask": bool[seq_len],
        "pixel_values": float32[images_per_row, 3, height, width]}`; slicing it gives
        a view.

    Raises:
        ValueError: a record without the fields, with another number of images or
            image placeholders than `images_per_row`, a bad image or message (each
            naming the record: file and line, or its index), records longer than
            `seq_len` (how many, the longest, where), a tokenizer without a chat
            template or that splits the image token, no records, or a model that
            cannot take the rows.

    Example:
        >>> rows = rc.vision.chat_rows("train.jsonl", "checkpoints/llava",
        ...     "checkpoints/llava", 1024, model=llava)
        >>> rc.fit(llava, opt, rows, collate_fn=rc.vision.collate,
        ...     loss_fn=rc.models.lm_loss, ...)
    """
    seq_len = _check_seq_len(seq_len)
    tok, processor, image_tokens = _inputs(
        tokenizer, processor, image_tokens, model, images_per_row
    )
    image_id = _image_id(tok, image_tokens)
    keys = (messages_key, images_key)
    ids, masks, images, wheres = _encode(source, tok, image_tokens, image_id, images_per_row, keys)
    _check_lengths(ids, wheres, seq_len)
    pad = pad_id if pad_id is not None else tok.pad_id if tok.pad_id is not None else tok.eos_id
    if pad is None:
        raise ValueError(f"the tokenizer {tok.name} has no pad or EOS token; pass pad_id=.")
    if model is not None:
        _check_model(model, ids, wheres, seq_len, processor, image_tokens, image_id)
    return ImageRows(ids, masks, images, wheres, processor=processor, seq_len=seq_len, pad_id=pad)


def _inputs(
    tokenizer: Any,
    processor: ImageProcessor | str | os.PathLike[str],
    image_tokens: ImageTokens | None,
    model: Any,
    images_per_row: Any,
) -> tuple[Tokenizer, ImageProcessor, ImageTokens]:
    """`chat_rows`' tokenizer, processor and image tokens, opened and checked."""
    if isinstance(images_per_row, bool) or not isinstance(images_per_row, int | np.integer):
        raise ValueError(f"images_per_row must be an int >= 1, got {images_per_row!r}.")
    if images_per_row < 1:
        raise ValueError(
            f"images_per_row={images_per_row}: rows of text alone are rc.text's "
            "(rc.text.tokenize_instructions, rc.text.padded)."
        )
    tok = load_tokenizer(tokenizer)
    if not isinstance(processor, ImageProcessor):
        processor = ImageProcessor.from_folder(processor)
    if processor.output_size is None:
        raise ValueError(
            f"{processor.name} makes images of each one's own size (it neither resizes to "
            "a size nor crops); rows of a batch need one size."
        )
    if image_tokens is None:
        if model is None:
            raise ValueError(
                "chat_rows needs image_tokens= (rc.vision.ImageTokens) or model= (whose "
                "config says them)."
            )
        image_tokens = ImageTokens.from_config(model, tok)
    return tok, processor, image_tokens


def _encode(
    source: Any,
    tok: Tokenizer,
    image_tokens: ImageTokens,
    image_id: int,
    images_per_row: int,
    keys: tuple[str, str],
) -> tuple[list[np.ndarray], list[np.ndarray], list[tuple[Any, ...]], list[str]]:
    """Each record's ids, loss mask, images and where it came from; bad records refused."""
    render = _renderer(tok, image_tokens)
    files, read = read_records(source, "strict", Path(os.devnull))
    ids, masks, images, wheres = [], [], [], []
    for record, origin, where in read([]):
        base = files[origin[0]].parent if files is not None else None
        messages, pictures = _record(record, where, *keys, images_per_row, base)
        row_ids, row_mask = assistant_ids(render, messages, where)
        found = row_ids.count(image_id)
        if found != images_per_row * image_tokens.tokens_per_image:
            raise ValueError(
                f"{where}: the chat template rendered {found} image tokens "
                f"({image_tokens.token!r}) for {images_per_row} image(s) of "
                f"{image_tokens.tokens_per_image}: it did not write one "
                f"{image_tokens.placeholder!r} per {{'type': 'image'}} (the template must be "
                "the checkpoint processor's, chat_template.jinja), or the text holds "
                "image tokens of its own."
            )
        ids.append(np.asarray(row_ids, np.int32))
        masks.append(np.asarray(row_mask, np.bool_) & (ids[-1] != image_id))
        images.append(pictures)
        wheres.append(where)
    return ids, masks, images, wheres


def _image_id(tok: Tokenizer, image_tokens: ImageTokens) -> int:
    """The image token's id; a `ValueError` unless the tokenizer keeps it one token."""
    token = image_tokens.token
    image_id = tok.fast.token_to_id(token)
    if image_id is None or tok.encode([token * 2])[0] != [image_id] * 2:
        raise ValueError(
            f"the tokenizer {tok.name} does not hold {token!r} as one token (a special "
            "token of its own); use the checkpoint's tokenizer, or the image token its "
            "processor writes."
        )
    return int(image_id)


def _renderer(tok: Tokenizer, image_tokens: ImageTokens) -> Any:
    """`(messages, generation_prompt) -> ids`: the chat template's text, its image
    placeholders expanded (as the model's processor expands them), tokenized."""
    hf = tok.hf
    if hf is None or not getattr(hf, "chat_template", None):
        raise ValueError(
            f"the tokenizer {tok.name} has no chat template; open the checkpoint's folder "
            "(its processor's chat_template.jinja comes along) with transformers "
            "(`pip install 'redcoast[hf]'`), or set tokenizer.chat_template."
        )

    def render(messages: list[Any], generation_prompt: bool) -> list[int]:
        text = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        return tok.encode([image_tokens.expand(text)])[0]

    return render


def _record(
    record: Any, where: str, messages_key: str, images_key: str, count: int, base: Path | None
) -> tuple[list[Any], tuple[Any, ...]]:
    """A record's messages and images, checked; paths resolved against `base`."""
    if not isinstance(record, Mapping) or messages_key not in record or images_key not in record:
        raise ValueError(
            f"{where} needs fields {messages_key!r} and {images_key!r}; it has "
            f"{describe_keys(record)}. Name other fields with messages_key=, images_key=."
        )
    messages, images = record[messages_key], record[images_key]
    if not isinstance(images, list | tuple):
        raise ValueError(f"{where}: {images_key!r} must be a list of images, not {images!r:.60}.")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: {messages_key!r} must be a non-empty list of messages.")
    placeholders = 0
    for j, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where}: message {j} must be a dict with a 'role' and a 'content'.")
        parts = [] if isinstance(content, str) else content
        if not isinstance(parts, list) or not all(
            isinstance(p, Mapping) and p.get("type") in ("image", "text") for p in parts
        ):
            raise ValueError(
                f"{where}: message {j}'s content must be a string or a list of "
                "{'type': 'image'} and {'type': 'text', 'text': ...} parts."
            )
        if any(p["type"] == "text" and not isinstance(p.get("text"), str) for p in parts):
            raise ValueError(f"{where}: message {j} has a text part without a 'text' string.")
        placeholders += sum(p["type"] == "image" for p in parts)
    if len(images) != count or placeholders != count:
        raise ValueError(
            f"{where} has {len(images)} image(s) and {placeholders} {{'type': 'image'}} "
            f"part(s); every row holds images_per_row={count} (a batch stacks them), one "
            "part for each image. Drop or split such records, or make rows of another "
            "count separately."
        )
    return list(messages), tuple(_image(x, where, k, base) for k, x in enumerate(images))


def _image(image: Any, where: str, k: int, base: Path | None) -> Any:
    """An image of a record, checked without decoding it: a path resolved and its file
    opened, or a PIL image, or an array of the right type and shape."""
    if isinstance(image, str | os.PathLike):
        path = Path(image)
        if base is not None and not path.is_absolute():
            path = base / path
        try:
            open_image(path).close()
        except ValueError as err:
            raise ValueError(f"{where}, image {k}: {err}") from None
        return path
    if isinstance(image, pil().Image.Image):
        return image
    try:
        return check_array(image)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}, image {k}: {err}") from None


def _check_lengths(ids: list[np.ndarray], wheres: list[str], seq_len: int) -> None:
    """Refuse no records, and records longer than `seq_len` (as `rc.text.padded` does)."""
    if not ids:
        raise ValueError("chat_rows found no records; nothing to train on.")
    lengths = np.array([len(i) for i in ids])
    over = np.flatnonzero(lengths > seq_len)
    if over.size:
        longest = int(over[np.argmax(lengths[over])])
        raise ValueError(
            f"{over.size} of {len(ids)} records are longer than seq_len={seq_len}; the "
            f"longest has {int(lengths[longest])} tokens ({wheres[longest]}). Use a larger "
            "seq_len, or drop them (a record cut short would lose image tokens)."
        )


def _check_model(
    model: Any,
    ids: list[np.ndarray],
    wheres: list[str],
    seq_len: int,
    processor: ImageProcessor,
    image_tokens: ImageTokens,
    image_id: int,
) -> None:
    """Refuse rows the model cannot take: ids past its vocabulary (the image token aside:
    its rows are replaced, and Gemma 3's lies past it), rows past its positions, another
    number of image tokens or another image size than its config's."""
    name = type(model).__name__
    vocab = getattr(model, "vocab_size", None)
    if vocab is not None:
        for row, where in zip(ids, wheres, strict=True):
            text = row[row != image_id]
            if text.size and int(text.max()) >= vocab:
                raise ValueError(
                    f"{where} holds token id {int(text.max())}, but {name} has a vocabulary of "
                    f"{vocab}: the tokenizer is not this model's. Use the checkpoint's own."
                )
    limit = getattr(model, "max_positions", None)
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"seq_len={seq_len} is longer than {name}'s position table ({limit} positions); "
            f"use seq_len <= {limit}."
        )
    config = getattr(model, "config", None)
    want = getattr(config, "image_tokens", None)
    if want is not None and want != image_tokens.tokens_per_image:
        raise ValueError(
            f"{name} reads {want} features per image (config.image_tokens), but "
            f"image_tokens expands each image to {image_tokens.tokens_per_image}; leave "
            "image_tokens= out to take the model's."
        )
    size = getattr(getattr(config, "vision_config", None), "image_size", None)
    if size is not None and processor.output_size != (size, size):
        raise ValueError(
            f"{processor.name} makes images of {processor.output_size} (height, width), but "
            f"{name}'s tower takes {size} x {size}; use the checkpoint's processor "
            "(ImageProcessor.from_folder(its folder))."
        )


def collate(rows: list[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Stack rows into a batch: a `collate_fn` for `fit` (`rc.text.collate`, and a clear
    error for rows with different numbers or sizes of images).

    Args:
        rows: items of `chat_rows`.

    Returns:
        `{"input_ids": (batch, seq_len), "loss_mask": ..., "pixel_values": (batch,
        images, 3, height, width)}`.

    Raises:
        ValueError: no rows, rows whose `pixel_values` differ in shape (naming the
            first and both shapes), or anything `rc.text.collate` refuses.

    Example:
        >>> batch = rc.vision.collate([rows[0], rows[1]])
    """
    shapes = [np.shape(r["pixel_values"]) if "pixel_values" in r else None for r in rows]
    j = next((j for j, s in enumerate(shapes) if s != shapes[0]), None)
    if j is not None and None not in (shapes[0], shapes[j]):
        raise ValueError(
            f"collate: row {j}'s pixel_values have shape {shapes[j]} (images, channels, "
            f"height, width), but row 0's {shapes[0]}; rows of a batch need as many images, "
            "of one size (rc.vision.chat_rows with one images_per_row and processor)."
        )
    return text_collate(rows)
