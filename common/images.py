"""An image as a Qwen-VL vision tower takes it: resized to a multiple of the merged patch, rescaled and
normalised, cut into flat patches in the tower's order, and its content hash (what the encoder cache and
the prefix cache key an image by). The checkpoint's `preprocessor_config.json` says how
(transformers' Qwen2VLImageProcessor: patch, merge and temporal patch sizes, min and max pixels, mean and
std); the arithmetic is the PIL path's of that processor, so the patches equal transformers'.

Two stages, so the router can do the costly one: `resize_image` (decode, convert and resize: PIL, tens of
milliseconds a megapixel) gives the 8-bit RGB pixels and the content hash, which are what crosses the link
to a worker (3 bytes a pixel, where the patches are 24: float32, every patch twice over the temporal
patch); `patches_from_rgb` (rescale, normalise, cut: numpy, a few milliseconds) runs on the worker. The
offline API runs both (`patchify`). docs/architecture.md#images-through-the-router says why."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from nanovllm.common.errors import ConfigError, RequestError

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

# numpy is imported where a function needs it: a router process imports this module at its start, and numpy
# costs that start 0.1-0.15 s when no request has an image (tests/test_router_tokenizer.py).

# The image processors whose arithmetic this module reproduces (the torchvision, PIL and older names).
PROCESSOR_TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
MAX_ASPECT_RATIO = 200  # the processor refuses longer sides beyond this multiple of the shorter


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The fields of `preprocessor_config.json` that decide an image's patches."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL's BICUBIC

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ImageProcessorConfig:
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise ConfigError(f"{path} not found: a vision model needs its image processor's configuration")
        return cls.from_json(path.read_text(), str(path))

    @classmethod
    def from_json(cls, text: str, path: str) -> ImageProcessorConfig:
        """From the text of a `preprocessor_config.json` (`path`: where it came from, for errors)."""
        cfg = json.loads(text)
        kind = cfg.get("image_processor_type", PROCESSOR_TYPES[0])
        if kind not in PROCESSOR_TYPES:
            raise ConfigError(f"{path}: image_processor_type {kind!r} is not one of {list(PROCESSOR_TYPES)}")
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if cfg.get(flag, True) is not True:
                raise ConfigError(f"{path}: {flag}=false is not supported")
        size = cfg.get("size") or {}
        default = cls()
        return cls(
            patch_size=int(cfg.get("patch_size", default.patch_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", default.temporal_patch_size)),
            merge_size=int(cfg.get("merge_size", default.merge_size)),
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge", default.min_pixels)),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge", default.max_pixels)),
            image_mean=tuple(cfg.get("image_mean", default.image_mean)),
            image_std=tuple(cfg.get("image_std", default.image_std)),
            rescale_factor=float(cfg.get("rescale_factor", default.rescale_factor)),
            resample=int(cfg.get("resample", default.resample)),
        )

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this: a merged patch's side in pixels."""
        return self.patch_size * self.merge_size

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) rounded to multiples of `factor`, scaled into [min_pixels, max_pixels] at
        about the same aspect ratio."""
        if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
            raise RequestError(
                f"image of {width}x{height} pixels: its aspect ratio exceeds {MAX_ASPECT_RATIO}"
            )
        f = self.factor
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            scale = math.sqrt(height * width / self.max_pixels)
            h = max(f, math.floor(height / scale / f) * f)
            w = max(f, math.floor(width / scale / f) * f)
        elif h * w < self.min_pixels:
            scale = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * scale / f) * f, math.ceil(width * scale / f) * f
        return h, w

    def num_tokens(self, height: int, width: int) -> int:
        """The placeholder tokens an image of this size takes in the prompt (one per merged patch)."""
        h, w = self.resized_size(height, width)
        return (h // self.factor) * (w // self.factor)


@dataclass(frozen=True)
class ResizedImage:
    """An image resized to its patch grid: `rgb` [height, width, 3] uint8, and its content hash (of its
    size and pixels: equal hashes, equal patches)."""

    rgb: np.ndarray
    content_hash: int

    @staticmethod
    def of(rgb: np.ndarray) -> ResizedImage:
        """`rgb` with its hash computed."""
        import numpy as np

        digest = xxhash.xxh3_64(np.asarray(rgb.shape, np.int64).tobytes())
        digest.update(np.ascontiguousarray(rgb).tobytes())
        return ResizedImage(rgb, digest.intdigest())


@dataclass(frozen=True)
class ImagePatches:
    """One image as the tower takes it: `pixel_values` [patches, channels x temporal x patch x patch]
    (float32), its grid of patches (temporal, height, width), and its content hash (ResizedImage's)."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    content_hash: int

    def num_tokens(self, merge_size: int) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)


def resize_image(image: Image.Image, cfg: ImageProcessorConfig) -> ResizedImage:
    """`image` converted to RGB and resized (PIL, `cfg.resample`) to both sides multiples of `cfg.factor`."""
    rgb = to_rgb(image)
    height, width = cfg.resized_size(rgb.height, rgb.width)
    if (height, width) != (rgb.height, rgb.width):
        rgb = rgb.resize((width, height), resample=cfg.resample)
    import numpy as np

    return ResizedImage.of(np.asarray(rgb))


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as the processor converts (`do_convert_rgb`): an image with transparency (an alpha band, or a
    palette's transparent colour) composited onto white, others converted as PIL converts."""
    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    from PIL import Image

    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def patches_from_rgb(image: ResizedImage, cfg: ImageProcessorConfig) -> ImagePatches:
    """A resized image rescaled, normalised and cut into patches ordered merge block by merge block (each
    block's patches row-major), every patch repeated over the temporal patch (a still image is a clip of
    identical frames)."""
    height, width, channels = image.rgb.shape
    if channels != 3 or height % cfg.factor or width % cfg.factor:
        raise RequestError(
            f"a resized image of {width}x{height} pixels and {channels} channels: an image takes 3 channels "
            f"and sides that are multiples of {cfg.factor} pixels"
        )
    import numpy as np

    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    # [block row, block column, row in block, column in block, channel, pixel row, pixel column]
    blocks = image.rgb.reshape(grid_h // m, m, p, grid_w // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    patches = np.empty((grid_h // m, grid_w // m, m, m, 3, t, p, p), np.float32)
    values = _normalised_values(cfg)
    for channel in range(3):  # each 8-bit value's normalised float32, looked up: the same arithmetic
        patches[:, :, :, :, channel] = values[channel][blocks[:, :, :, :, channel]][:, :, :, :, None]
    return ImagePatches(
        patches.reshape(grid_h * grid_w, 3 * t * p * p), (1, grid_h, grid_w), image.content_hash
    )


def _normalised_values(cfg: ImageProcessorConfig) -> np.ndarray:
    """[channel, 8-bit value] -> the value rescaled (in float64, rounded to float32) and normalised (in
    float32), as the processor computes each pixel."""
    import numpy as np

    levels = (np.arange(256, dtype=np.float64) * cfg.rescale_factor).astype(np.float32)
    mean, std = np.asarray(cfg.image_mean, np.float32), np.asarray(cfg.image_std, np.float32)
    return (levels[None, :] - mean[:, None]) / std[:, None]


def patchify(image: Image.Image, cfg: ImageProcessorConfig) -> ImagePatches:
    """Both stages: `image` resized, then cut into patches."""
    return patches_from_rgb(resize_image(image, cfg), cfg)


def expand_placeholders(token_ids: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """`token_ids` with its k-th image placeholder token repeated `counts[k]` times: a prompt names one
    placeholder per image (as a chat template writes it), the model reads one per image token."""
    places = [i for i, token in enumerate(token_ids) if token == image_token_id]
    if len(places) != len(counts):
        raise RequestError(
            f"the prompt has {len(places)} image placeholder token(s) (id {image_token_id}) for {len(counts)} "
            "image(s): give one placeholder per image"
        )
    expanded: list[int] = []
    begin = 0
    for place, count in zip(places, counts):
        expanded += token_ids[begin:place]
        expanded += [image_token_id] * count
        begin = place + 1
    return expanded + token_ids[begin:]
