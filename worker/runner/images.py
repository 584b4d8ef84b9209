"""A vision model's image work in a step: each token's three RoPE positions (temporal, height, width),
and the image tokens' embeddings from the tower, kept by content hash so an image seen again (a
repeated request, the next chunk of a prompt cut through an image) skips the tower.

Positions follow transformers' `get_rope_index` for Qwen3.5: text tokens count on from the previous
token on all three axes; an image whose grid is h x w merged patches takes, at the position p the next
text token would have had, (p, p + row, p + column) for each of its tokens, and the text after it goes
on from p + max(h, w). So after the prompt's last image a token at index i has position i + delta on
every axis (delta: the sum over the images of max(h, w) - h x w), which is what decoding uses.

With tensor parallelism the tower and its cache are rank 0's alone: rank 0 sends each step's image tokens'
embeddings (ImageEmbeddings, worker/step.py) to the other ranks, which hold neither the tower nor a cache,
so no cache can disagree with another. The alternative, the tower whole on every rank and the image's
patches sent, moves more and computes more: an image's patches are 24 bytes a pixel (float32, each
16 x 16 patch twice over the temporal patch), its tokens hidden_size values per 32 x 32 pixels (4 bytes a
pixel for the 0.8B's 1024 in float32, 2 in bf16; 10 for a 5120-wide model in bf16), sent only for the rows
a step computes; and every other rank would run the tower again (on a CPU the ranks share cores) and hold
its weights. A repeated image skips the tower on rank 0 and costs the other ranks the broadcast of its
rows only (measured: docs/performance.md, measurements behind choices in the code).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from nanovllm.common.logging import get_logger
from nanovllm.worker.sequence import ImageInput
from nanovllm.worker.step import ImageEmbeddings, ImageRows

log = get_logger(__name__)


def mrope_positions(images: list[ImageInput], start: int, end: int) -> tuple[list[int], list[int], list[int]]:
    """The temporal, height and width positions of a sequence's tokens [start, end)."""
    temporal: list[int] = []
    height: list[int] = []
    width: list[int] = []
    index, position = start, start  # the next token, and its position were it text
    shift = 0  # how far text positions lag token indices after the images passed so far
    for image in images:
        if index >= end:
            break
        h, w = image.grid_hw
        if image.end <= index:  # wholly before the range: only its shift matters
            shift += image.num_tokens - max(h, w)
            continue
        position = index - shift
        text = min(image.offset, end) - index
        if text > 0:
            run = list(range(position, position + text))
            temporal += run
            height += run
            width += run
            index += text
        if index >= end:
            break
        base = image.offset - shift  # the image's first position
        for k in range(index - image.offset, min(image.num_tokens, end - image.offset)):
            temporal.append(base)
            height.append(base + k // w)
            width.append(base + k % w)
        index = min(image.end, end)
        shift += image.num_tokens - max(h, w)
    if index < end:
        run = list(range(index - shift, end - shift))
        temporal += run
        height += run
        width += run
    return temporal, height, width


class ImageEncoder:
    """The tower's output for each image by content hash, least recently used dropped first beyond
    `capacity_tokens` kept tokens. `tower_runs` and `cache_hits` count images encoded and images found."""

    def __init__(
        self,
        encode: Callable[[torch.Tensor, tuple[int, int, int]], torch.Tensor],
        device: torch.device,
        capacity_tokens: int,
    ) -> None:
        self.encode = encode
        self.device = device
        self.capacity_tokens = capacity_tokens
        self.cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.cached_tokens = 0
        self.tower_runs = 0
        self.cache_hits = 0

    def embeddings(self, image: ImageInput) -> torch.Tensor:
        """`image`'s tokens [num_tokens, hidden] from the cache, or from the tower (then kept)."""
        key = image.patches.content_hash
        found = self.cache.get(key)
        if found is not None:
            self.cache.move_to_end(key)
            self.cache_hits += 1
            return found
        pixels = torch.from_numpy(image.patches.pixel_values).to(self.device)
        tokens = self.encode(pixels, image.patches.grid_thw)
        if tokens.shape[0] != image.num_tokens:
            raise RuntimeError(
                f"the tower gave {tokens.shape[0]} tokens for an image that holds {image.num_tokens} places"
            )
        self.tower_runs += 1
        self.cache[key] = tokens
        self.cached_tokens += tokens.shape[0]
        while self.cached_tokens > self.capacity_tokens and len(self.cache) > 1:
            _, dropped = self.cache.popitem(last=False)
            self.cached_tokens -= dropped.shape[0]
        return tokens

    def splice(self, image_rows: list[ImageRows], dtype: torch.dtype) -> ImageEmbeddings:
        """The step's image tokens' rows and embeddings (in `dtype`, the model's), for the model to put in
        place of their placeholders' embeddings."""
        rows: list[int] = []
        parts = []
        for item in image_rows:
            rows += range(item.row, item.row + item.count)
            parts.append(self.embeddings(item.image)[item.first : item.first + item.count])
        return ImageEmbeddings(rows, torch.cat(parts).to(dtype))
