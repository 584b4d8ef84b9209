"""An image as a Qwen-VL vision tower takes it: resized to a multiple of the merged patch, rescaled and
normalised, cut into flat patches in the tower's order, and its content hash (what the encoder cache and
the prefix cache key an image by). The checkpoint's `preprocessor_config.json` says how
(transformers' Qwen2VLImageProcessor: patch, merge and temporal patch sizes, min and max pixels, mean and
std); the arithmetic is the PIL path's of that processor, so the patches equal transformers'. Used by
the offline API and the router (both decode images; the worker receives patches)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from nanovllm.common.errors import ConfigError, RequestError

if TYPE_CHECKING:
    from PIL import Image

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
        cfg = json.loads(path.read_text())
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
class ImagePatches:
    """One image as the tower takes it: `pixel_values` [patches, channels x temporal x patch x patch]
    (float32), its grid of patches (temporal, height, width), and a hash of both."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    content_hash: int

    def num_tokens(self, merge_size: int) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)


def patchify(image: Image.Image, cfg: ImageProcessorConfig) -> ImagePatches:
    """`image` converted to RGB, resized (PIL, `cfg.resample`), rescaled, normalised and cut into patches
    ordered merge block by merge block (each block's patches row-major), every patch repeated over the
    temporal patch (a still image is a clip of identical frames)."""
    rgb = image.convert("RGB")
    height, width = cfg.resized_size(rgb.height, rgb.width)
    if (height, width) != (rgb.height, rgb.width):
        rgb = rgb.resize((width, height), resample=cfg.resample)
    pixels = (np.asarray(rgb).astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    mean, std = np.asarray(cfg.image_mean, np.float32), np.asarray(cfg.image_std, np.float32)
    pixels = ((pixels - mean) / std).transpose(2, 0, 1)  # [channels, height, width]
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    blocks = pixels.reshape(3, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    patches = np.ascontiguousarray(frames.reshape(grid_h * grid_w, 3 * t * p * p))
    grid = (1, grid_h, grid_w)
    digest = xxhash.xxh3_64(np.asarray(grid, np.int64).tobytes())
    digest.update(patches.tobytes())
    return ImagePatches(patches, grid, digest.intdigest())


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
