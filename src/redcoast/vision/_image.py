"""`ImageProcessor`: images to the pixels a vision tower reads, as `transformers` makes them."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Pillow's filters by the numbers `transformers` writes (`PILImageResampling`).
RESAMPLE = ("nearest", "lanczos", "bilinear", "bicubic", "box", "hamming")
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)

# `transformers`' defaults for each image processor class: what a config's missing or
# null keys mean. `square`: whether a bare int `size` is (size, size) (else the
# shortest edge).
DEFAULTS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": {
        "size": {"shortest_edge": 224},
        "crop_size": {"height": 224, "width": 224},
        "do_center_crop": True,
        "resample": 3,
        "image_mean": OPENAI_CLIP_MEAN,
        "image_std": OPENAI_CLIP_STD,
        "square": False,
    },
    "SiglipImageProcessor": {
        "size": {"height": 224, "width": 224},
        "resample": 3,
        "image_mean": HALF,
        "image_std": HALF,
        "square": False,
    },
    "Gemma3ImageProcessor": {
        "size": {"height": 224, "width": 224},
        "resample": 2,
        "image_mean": HALF,
        "image_std": HALF,
        "square": True,
        "crops": False,  # its processor never crops, whatever do_center_crop says
    },
}
COMMON = {"do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True}


def pil() -> Any:
    """The `PIL` package, with `PIL.Image` and `PIL.ImageOps` imported; a clear `ImportError`
    when Pillow is not installed."""
    try:
        import PIL.Image
        import PIL.ImageOps
    except ImportError as err:
        raise ImportError(
            "rc.vision reads images with Pillow, which is not installed; install it with "
            "`pip install 'redcoast[vision]'`."
        ) from err
    return PIL


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageProcessor:
    """Images to `float32 (3, height, width)` pixels, as `transformers`' image processors
    make them (the Pillow ones: `CLIPImageProcessorPil`, `SiglipImageProcessorPil`,
    `Gemma3ImageProcessorPil`, the classes `AutoImageProcessor` gives where torchvision
    is not installed).

    In order: the image made RGB; resized with Pillow to `size`, or its shorter side
    to `shortest_edge` (the longer one in proportion, rounded down); centre-cropped to
    `crop` (padded with black where the image is smaller); multiplied by
    `rescale_factor`; normalised by `image_mean` and `image_std` per channel. A step
    whose field is None is skipped. The result equals the processor's to the bit.

    Args:
        size: resize to `(height, width)`; or None.
        shortest_edge: or resize the shorter side to this; None for neither.
        crop: centre-crop to `(height, width)`; None: no crop.
        resample: Pillow's filter: `"bicubic"` (CLIP, SigLIP), `"bilinear"` (Gemma 3),
            `"nearest"`, `"lanczos"`, `"box"` or `"hamming"`.
        rescale_factor: the factor from 0-255 to the model's range; None: none.
        image_mean, image_std: per channel (RGB); None: not normalised.
        name: what it came from (for messages), e.g. `"CLIPImageProcessor"`.

    Raises:
        ValueError: both `size` and `shortest_edge`, sizes that are not positive, a
            filter not named above, or a mean or std that is not 3 numbers.

    Example:
        >>> processor = rc.vision.ImageProcessor.from_folder("checkpoints/llava")
        >>> processor("cat.png").shape
        (3, 336, 336)
    """

    size: tuple[int, int] | None = None
    shortest_edge: int | None = None
    crop: tuple[int, int] | None = None
    resample: str = "bicubic"
    rescale_factor: float | None = 1 / 255
    image_mean: tuple[float, float, float] | None = HALF
    image_std: tuple[float, float, float] | None = HALF
    name: str = "ImageProcessor"

    def __post_init__(self) -> None:
        if self.size is not None and self.shortest_edge is not None:
            raise ValueError(f"{self.name}: give size=(height, width) or shortest_edge=, not both.")
        for field, value in (("size", self.size), ("crop", self.crop)):
            if value is not None and (len(value) != 2 or min(value) < 1):
                raise ValueError(f"{self.name}: {field} must be (height, width) > 0, got {value}.")
        if self.shortest_edge is not None and self.shortest_edge < 1:
            raise ValueError(f"{self.name}: shortest_edge must be > 0, got {self.shortest_edge}.")
        if self.resample not in RESAMPLE:
            raise ValueError(
                f"{self.name}: resample={self.resample!r} is none of Pillow's filters "
                f"{list(RESAMPLE)}."
            )
        if (self.image_mean is None) != (self.image_std is None):
            raise ValueError(f"{self.name}: give both image_mean and image_std, or neither.")
        for field, value in (("image_mean", self.image_mean), ("image_std", self.image_std)):
            if value is not None and len(value) != 3:
                raise ValueError(f"{self.name}: {field} must be 3 numbers (RGB), got {value}.")

    @property
    def output_size(self) -> tuple[int, int] | None:
        """`(height, width)` of every image out, or None when it depends on the image."""
        return self.crop or self.size

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ImageProcessor:
        """The processor a `preprocessor_config.json` describes.

        Keys missing or null take the defaults of `transformers`' class named by
        `image_processor_type` (or the older `feature_extractor_type`), as
        `transformers` reads them; keys that do not change the pixels (the processor
        class, `image_seq_length`, ...) are ignored.

        Args:
            config: the JSON's contents.

        Returns:
            The processor.

        Raises:
            ValueError: a type other than `CLIPImageProcessor`, `SiglipImageProcessor`
                and `Gemma3ImageProcessor` (their fast and Pil variants too), or a step
                redcoast does not do (Gemma 3's pan and scan, padding).

        Example:
            >>> ImageProcessor.from_dict({"image_processor_type": "SiglipImageProcessor",
            ...     "size": {"height": 384, "width": 384}}).output_size
            (384, 384)
        """
        kind = config.get("image_processor_type") or config.get("feature_extractor_type")
        name = str(kind).replace("FeatureExtractor", "ImageProcessor").removesuffix("Fast")
        name = name.removesuffix("Pil")
        if name not in DEFAULTS:
            said = "no image_processor_type" if kind is None else f"image_processor_type {kind!r}"
            raise ValueError(
                f"{said}: not an image processor rc.vision knows; it makes the "
                f"pixels of {sorted(DEFAULTS)} (and their Fast and Pil variants). For another "
                "model, build rc.vision.ImageProcessor(size=..., crop=..., image_mean=..., "
                "image_std=...) to match its processor."
            )
        defaults = {**COMMON, **DEFAULTS[name]}

        def get(key: str) -> Any:
            value = config.get(key)
            return defaults.get(key) if value is None else value

        for step in ("do_pan_and_scan", "do_pad"):
            if get(step):
                raise ValueError(
                    f"{name} with {step}=true: rc.vision does not do that step; set it "
                    "false (the processors' default) in preprocessor_config.json."
                )
        square = config.get("default_to_square")
        square = defaults["square"] if square is None else bool(square)
        size = _size(get("size"), square, "size") if get("do_resize") else None
        crops = get("do_center_crop") and defaults.get("crops", True)
        crop = _size(get("crop_size"), True, "crop_size") if crops else None
        if crop is not None and "shortest_edge" in crop:
            raise ValueError(f"{name}: crop_size must be a height and width, got {crop}.")
        resample = get("resample")
        if isinstance(resample, int) and 0 <= resample < len(RESAMPLE):
            resample = RESAMPLE[resample]
        normalise = bool(get("do_normalize"))
        return cls(
            size=None if size is None else size.get("hw"),
            shortest_edge=None if size is None else size.get("shortest_edge"),
            crop=None if crop is None else crop["hw"],
            resample=str(resample),
            rescale_factor=float(get("rescale_factor")) if get("do_rescale") else None,
            image_mean=_three(get("image_mean")) if normalise else None,
            image_std=_three(get("image_std")) if normalise else None,
            name=name,
        )

    @classmethod
    def from_folder(cls, path: str | os.PathLike[str]) -> ImageProcessor:
        """The image processor saved in a folder (or a JSON file of one).

        Reads `preprocessor_config.json` (what `save_pretrained` writes for an image
        processor, and checkpoints on the hub hold), else the `image_processor` of
        `processor_config.json` (what `transformers` 5 writes for a whole processor).

        Args:
            path: a checkpoint or processor folder, or the JSON file itself.

        Returns:
            The processor (see `from_dict`).

        Raises:
            ValueError: no such file, invalid JSON, or a processor `from_dict` refuses.

        Example:
            >>> processor = ImageProcessor.from_folder("checkpoints/llava-1.5-7b-hf")
        """
        path = Path(path)
        candidates = [path] if path.is_file() else []
        candidates += [path / "preprocessor_config.json", path / "processor_config.json"]
        for file in candidates:
            if not file.is_file():
                continue
            try:
                config = json.loads(file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{file} is not valid JSON ({err}).") from None
            if isinstance(config, dict) and isinstance(config.get("image_processor"), dict):
                config = config["image_processor"]
            if isinstance(config, dict) and (
                "image_processor_type" in config or "feature_extractor_type" in config
            ):
                return cls.from_dict(config)
        raise ValueError(
            f"{path} holds no image processor: no preprocessor_config.json (what "
            "save_pretrained writes for an image processor), nor a processor_config.json "
            "with an image_processor. Give the folder the checkpoint's processor was saved "
            "in, or build one: rc.vision.ImageProcessor.clip(...), .siglip(...), .gemma3(...)."
        )

    @classmethod
    def clip(cls, **kwargs: Any) -> ImageProcessor:
        """`transformers.CLIPImageProcessor(**kwargs)`'s processing (LLaVA's towers).

        Example:
            >>> ImageProcessor.clip(size={"shortest_edge": 336}, crop_size=336).output_size
            (336, 336)
        """
        return cls.from_dict({"image_processor_type": "CLIPImageProcessor", **kwargs})

    @classmethod
    def siglip(cls, **kwargs: Any) -> ImageProcessor:
        """`transformers.SiglipImageProcessor(**kwargs)`'s processing.

        Example:
            >>> ImageProcessor.siglip(size={"height": 384, "width": 384}).output_size
            (384, 384)
        """
        return cls.from_dict({"image_processor_type": "SiglipImageProcessor", **kwargs})

    @classmethod
    def gemma3(cls, **kwargs: Any) -> ImageProcessor:
        """`transformers.Gemma3ImageProcessor(**kwargs)`'s processing, without pan and scan
        (Gemma 3's checkpoints use `size={"height": 896, "width": 896}`).

        Example:
            >>> ImageProcessor.gemma3(size={"height": 896, "width": 896}).output_size
            (896, 896)
        """
        return cls.from_dict({"image_processor_type": "Gemma3ImageProcessor", **kwargs})

    def __call__(self, image: Any) -> np.ndarray:
        """One image's pixels.

        Args:
            image: a PIL image (made RGB as the processor does: transparency laid on
                white), a `uint8` array `(height, width)`, `(height, width, 1)`, `(...,
                3)` or `(..., 4)` (RGBA, laid on white), or the path of an image file
                (read as `transformers.image_utils.load_image` reads one: turned upright
                by its EXIF orientation, then `convert("RGB")`).

        Returns:
            `float32 (3, height, width)`.

        Raises:
            TypeError: an input of another type or dtype.
            ValueError: an array of another shape, or a file that is missing or is
                not an image Pillow reads.
        """
        rgb = as_rgb(image)
        PIL = pil()
        if self.size is not None or self.shortest_edge is not None:
            height, width = self.size or _shortest_edge(rgb.shape[:2], self.shortest_edge or 0)
            filter_ = PIL.Image.Resampling(RESAMPLE.index(self.resample))
            rgb = np.asarray(PIL.Image.fromarray(rgb).resize((width, height), filter_))
        pixels = np.moveaxis(rgb, -1, 0)
        if self.crop is not None:
            pixels = _center_crop(pixels, self.crop)
        if self.rescale_factor is None:
            x = pixels.astype(np.float32)
        else:  # as transformers: in float64, then float32
            x = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.image_mean is not None and self.image_std is not None:
            mean = np.asarray(self.image_mean, np.float32)[:, None, None]
            x = (x - mean) / np.asarray(self.image_std, np.float32)[:, None, None]
        return np.ascontiguousarray(x, np.float32)


def preprocess(images: Any, processor: ImageProcessor | str | os.PathLike[str]) -> np.ndarray:
    """Images to the `pixel_values` of one sequence: `float32 (images, 3, height, width)`.

    Args:
        images: one image or a list of them, each as `ImageProcessor.__call__` takes.
        processor: an `ImageProcessor`, or a folder `ImageProcessor.from_folder` reads.

    Returns:
        The images' pixels, stacked.

    Raises:
        TypeError, ValueError: a bad image (see `ImageProcessor.__call__`), naming
            which.
        ValueError: no images, or images the processor makes of different sizes (it
            neither resizes to a fixed size nor crops).

    Example:
        >>> pixels = rc.vision.preprocess(["a.png", "b.png"], "checkpoints/llava")
        >>> logits = model(ids, pixels)
    """
    if not isinstance(processor, ImageProcessor):
        processor = ImageProcessor.from_folder(processor)
    one = not isinstance(images, list | tuple)
    out = []
    for i, image in enumerate([images] if one else images):
        try:
            out.append(processor(image))
        except (TypeError, ValueError) as err:
            raise type(err)(f"image {i}: {err}") from err
    if len({x.shape for x in out}) > 1:
        raise ValueError(
            f"the images come out of {processor.name} in different sizes "
            f"({sorted({x.shape for x in out})}); give it a size or a crop."
        )
    if not out:
        raise ValueError("preprocess got no images.")
    return np.stack(out)


def as_rgb(image: Any) -> np.ndarray:
    """`image` as `uint8 (height, width, 3)`, made RGB as `transformers`' processors do."""
    PIL = pil()
    if isinstance(image, str | os.PathLike):
        return np.asarray(PIL.ImageOps.exif_transpose(open_image(image)).convert("RGB"))
    if isinstance(image, PIL.Image.Image):
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return np.asarray(PIL.Image.alpha_composite(white, rgba).convert("RGB"))
        return np.asarray(image.convert("RGB"))
    array = check_array(image)
    if array.ndim == 2:
        array = array[..., None]
    if array.shape[-1] == 1:
        return np.repeat(array, 3, axis=-1)
    if array.shape[-1] == 4:  # transformers' blend onto white, in float64
        alpha = array[..., 3:] / 255
        return np.round(alpha * array[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return array


def check_array(image: Any) -> np.ndarray:
    """`image` if it is a `uint8` array of an image; else a `TypeError` or `ValueError`."""
    if not isinstance(image, np.ndarray):
        raise TypeError(
            f"an image must be a PIL image, a uint8 numpy array (height, width[, channels]) "
            f"or the path of an image file; got {type(image).__name__}"
            + (" (np.asarray(x) makes an array of it)." if hasattr(image, "__array__") else ".")
        )
    if image.dtype != np.uint8:
        raise TypeError(
            f"an image array must be uint8 (0-255), as decoded from a file; got {image.dtype}. "
            "Convert it (`(x * 255).round().astype(np.uint8)` for floats in 0-1), or pass "
            "a PIL image."
        )
    if not (image.ndim == 2 or (image.ndim == 3 and image.shape[-1] in (1, 3, 4))) or (
        0 in image.shape
    ):
        raise ValueError(
            f"an image array must be (height, width) or (height, width, channels) with 1, 3 "
            f"or 4 channels (last); got shape {image.shape}. A (channels, height, width) "
            "array: np.moveaxis(x, 0, -1)."
        )
    return image


def open_image(path: str | os.PathLike[str]) -> Any:
    """The image file at `path`, opened (its header read); a `ValueError` naming the file
    when it is missing or not an image."""
    PIL = pil()
    if not os.path.isfile(path):
        raise ValueError(f"no image file at {os.fspath(path)!r}; give an existing file's path.")
    try:
        return PIL.Image.open(path)
    except (OSError, PIL.UnidentifiedImageError) as err:
        raise ValueError(
            f"{os.fspath(path)!r} is not an image Pillow can read ({err}); give a PNG, JPEG, "
            "WebP, ... file."
        ) from None


def _size(value: Any, square: bool, what: str) -> dict[str, Any]:
    """A size of a config (`transformers`' `get_size_dict`): `{"hw": (height, width)}` or
    `{"shortest_edge": n}`."""
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 1:
        value = value[0]
    if isinstance(value, int) and not isinstance(value, bool):
        return {"hw": (value, value)} if square else {"shortest_edge": value}
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2:
        return {"hw": (int(value[0]), int(value[1]))}
    if isinstance(value, Mapping):
        if set(value) == {"height", "width"}:
            return {"hw": (int(value["height"]), int(value["width"]))}
        if set(value) == {"shortest_edge"}:
            return {"shortest_edge": int(value["shortest_edge"])}
    raise ValueError(
        f"{what}={value!r}: rc.vision resizes to a height and width ({{'height': h, "
        "'width': w}) or a shortest edge ({'shortest_edge': n}), the sizes of CLIP's, "
        "SigLIP's and Gemma 3's processors."
    )


def _three(value: Any) -> tuple[float, float, float]:
    """A mean or std of a config: one number for all channels, or one per channel."""
    if isinstance(value, int | float):
        return float(value), float(value), float(value)
    values = [float(v) for v in value]
    if len(values) != 3:
        raise ValueError(f"image_mean and image_std must be 3 numbers (RGB), got {value}.")
    return values[0], values[1], values[2]


def _shortest_edge(shape: tuple[int, ...], edge: int) -> tuple[int, int]:
    """The size with the shorter side `edge` and the longer in proportion, rounded down
    (`transformers`' `get_resize_output_image_size`)."""
    height, width = shape
    short, long = (width, height) if width <= height else (height, width)
    long = int(edge * long / short)
    return (long, edge) if width <= height else (edge, long)


def _center_crop(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The centre `size` of `(channels, height, width)` pixels, padded with zeros where the
    image is smaller (`transformers`' `center_crop`)."""
    _, height, width = pixels.shape
    h, w = size
    top, left = (height - h) // 2, (width - w) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top : top + h, left : left + w]
    new_h, new_w = max(h, height), max(w, width)
    padded = np.zeros((pixels.shape[0], new_h, new_w), pixels.dtype)
    pad_top, pad_left = -(-(new_h - height) // 2), -(-(new_w - width) // 2)
    padded[:, pad_top : pad_top + height, pad_left : pad_left + width] = pixels
    top, left = top + pad_top, left + pad_left
    return padded[:, max(0, top) : min(new_h, top + h), max(0, left) : min(new_w, left + w)]
