"""Image placeholders: where a model reads an image's features, and how many it reads."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..text._tokenizer import load_tokenizer


@dataclasses.dataclass(frozen=True)
class ImageTokens:
    """How a model's prompts hold images: the placeholder a chat template writes for each
    image, and the text the model's processor puts in its place.

    The processor replaces each `placeholder` with `before`, `image_token` repeated
    `tokens_per_image` times (the tokens whose embeddings the image's features
    replace) and `after`. LLaVA: `ImageTokens("<image>", 576)` (its processor's
    `image_seq_length`, the model's `config.image_tokens`); Gemma 3:
    `ImageTokens.gemma3()`.

    Args:
        placeholder: what the chat template writes for an image (`"<image>"`).
        tokens_per_image: the image features the model reads per image.
        image_token: the token the features replace; default: `placeholder`.
        before, after: text around each image's tokens (Gemma 3's newlines and
            `<start_of_image>` / `<end_of_image>`).

    Raises:
        ValueError: an empty placeholder or image token, or `tokens_per_image < 1`.

    Example:
        >>> tokens = rc.vision.ImageTokens("<image>", 3)
        >>> tokens.expand("USER: <image>\\nWhat is it?")
        'USER: <image><image><image>\\nWhat is it?'
    """

    placeholder: str
    tokens_per_image: int
    image_token: str | None = None
    before: str = ""
    after: str = ""

    def __post_init__(self) -> None:
        n = self.tokens_per_image
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise ValueError(f"tokens_per_image must be an int >= 1, got {n!r}.")
        if not self.placeholder or self.image_token == "":
            raise ValueError("ImageTokens: the placeholder and the image token must be non-empty.")

    @property
    def token(self) -> str:
        """The token the image features replace."""
        return self.image_token or self.placeholder

    @property
    def expansion(self) -> str:
        """What each placeholder becomes."""
        return self.before + self.token * int(self.tokens_per_image) + self.after

    def expand(self, text: str) -> str:
        """`text` with each placeholder expanded, as the model's processor expands it."""
        return text.replace(self.placeholder, self.expansion)

    @classmethod
    def gemma3(cls, tokens_per_image: int = 256) -> ImageTokens:
        """Gemma 3's: `<start_of_image>` becomes `"\\n\\n<start_of_image>"`, 256
        `<image_soft_token>`s and `"<end_of_image>\\n\\n"` (`transformers`'
        `Gemma3Processor.full_image_sequence`).

        Example:
            >>> rc.vision.ImageTokens.gemma3().token
            '<image_soft_token>'
        """
        return cls(
            "<start_of_image>",
            tokens_per_image,
            image_token="<image_soft_token>",
            before="\n\n<start_of_image>",
            after="<end_of_image>\n\n",
        )

    @classmethod
    def from_config(cls, config: Any, tokenizer: Any) -> ImageTokens:
        """A vision-language model's, from its config and tokenizer.

        Args:
            config: a LLaVA's (`image_token_index` and `image_tokens`, as
                `rc.models.LlavaConfig` has them), or a Gemma 3's (`boi_token_index`,
                `eoi_token_index`, `image_token_index`, `mm_tokens_per_image`); or a
                model with such a `config`.
            tokenizer: its tokenizer (anything `rc.text.load_tokenizer` opens), which
                names the tokens.

        Returns:
            The image tokens.

        Raises:
            TypeError: a config with neither set of fields.
            ValueError: an id the tokenizer does not have.

        Example:
            >>> tokens = rc.vision.ImageTokens.from_config(llava.config, "checkpoints/llava")
        """
        config = getattr(config, "config", config)
        fast = load_tokenizer(tokenizer).fast

        def name(field: str) -> str:
            i = int(getattr(config, field))
            token = fast.id_to_token(i)
            if token is None:
                raise ValueError(
                    f"the config's {field}={i} is not a token of the tokenizer; use the "
                    "checkpoint's own tokenizer."
                )
            return token

        fields = ("boi_token_index", "eoi_token_index", "image_token_index")
        if all(hasattr(config, f) for f in fields) and hasattr(config, "mm_tokens_per_image"):
            boi, eoi, image = (name(f) for f in fields)
            return cls(
                boi,
                int(config.mm_tokens_per_image),
                image_token=image,
                before=f"\n\n{boi}",
                after=f"{eoi}\n\n",
            )
        if hasattr(config, "image_token_index") and hasattr(config, "image_tokens"):
            return cls(name("image_token_index"), int(config.image_tokens))
        raise TypeError(
            f"{type(config).__name__} says nothing of images (no image_token_index and "
            "image_tokens, as LLaVA's config has); give rc.vision.ImageTokens(placeholder, "
            "tokens_per_image) instead."
        )


def expand_images(
    ids: Sequence[int] | np.ndarray,
    image_token_id: int,
    tokens_per_image: int,
    *,
    placeholder_id: int | None = None,
    before: Sequence[int] = (),
    after: Sequence[int] = (),
) -> np.ndarray:
    """Token ids with each image placeholder repeated to the features the model reads.

    What `transformers`' processors do to the text (`LlavaProcessor` repeats `<image>`
    `image_seq_length` times), done to ids: each `placeholder_id` (default:
    `image_token_id`) becomes `before`, `image_token_id` `tokens_per_image` times, and
    `after`. Give ids with one placeholder per image: ids already expanded would be
    expanded again. Gemma 3's processor expands text (`ImageTokens.gemma3().expand`),
    whose newlines may tokenize with their neighbours; its form in ids
    (`before=[nl, boi], after=[eoi, nl]`, `nl` the id of `"\\n\\n"`) is the same
    wherever no newline is next to the placeholder.

    Args:
        ids: one sequence's ids.
        image_token_id: the token the image features replace (LLaVA's
            `config.image_token_index`).
        tokens_per_image: features per image (LLaVA's `config.image_tokens`).
        placeholder_id: the id marking each image in `ids`, if not `image_token_id`.
        before, after: ids around each image's tokens.

    Returns:
        `int32` ids.

    Raises:
        ValueError: `ids` not one sequence of integers, or `tokens_per_image < 1`.

    Example:
        >>> rc.vision.expand_images([1, 99, 5], 99, 3)
        array([ 1, 99, 99, 99,  5], dtype=int32)
    """
    array = np.asarray(ids)
    if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise ValueError(
            f"expand_images takes one sequence of integer ids; got {array.dtype} of shape "
            f"{array.shape} (for a batch, expand each row)."
        )
    n = tokens_per_image
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"tokens_per_image must be an int >= 1, got {n!r}.")
    mark = image_token_id if placeholder_id is None else placeholder_id
    block = np.asarray([*before, *[image_token_id] * int(n), *after], np.int32)
    pieces, start = [], 0
    for at in np.flatnonzero(array == mark):
        pieces += [array[start:at].astype(np.int32), block]
        start = at + 1
    pieces.append(array[start:].astype(np.int32))
    return np.concatenate(pieces)
