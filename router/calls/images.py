"""A chat's images: counted and sized against the request limits (on the event loop, before any decoding),
then decoded and resized as the model's image processor resizes them (common/images.py), on the thread
that tokenizes, an image given by URL fetched there first (from the hosts --image-url-hosts allows).
Every refusal is a ValueError naming the image (its message and part) and the numbers.

The router does the costly part of preprocessing (decoding and resizing: tens of milliseconds a
megapixel) and sends workers the resized pixels (docs/architecture.md#images-through-the-router)."""

from __future__ import annotations

import functools
import io
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from nanovllm.common.errors import RequestError
from nanovllm.common.images import ImageProcessorConfig, ResizedImage, resize_image
from nanovllm.common.server_config import RequestLimits
from nanovllm.common.v1 import worker_pb2
from nanovllm.v1 import generate_pb2

# Still-image formats taken (PIL's names); a GIF's first frame is the image.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# A request's resized pixels at most: under the 64 MiB a worker takes in one message from a router
# (worker/service/server.py MAX_ROUTER_MESSAGE_BYTES), with room for the rest of the request.
LINK_IMAGE_BYTES = 60 * 1024 * 1024


@dataclass(frozen=True)
class ImagePart:
    """An image of a chat, its bytes or the URL to fetch them from, and where it was: `where` names it in
    errors."""

    data: bytes
    where: str
    url: str = ""


@dataclass(frozen=True)
class ModelImages:
    """What the router needs of a vision model: how its images are resized, and its placeholder token."""

    processor: ImageProcessorConfig
    token_id: int


@functools.lru_cache(maxsize=16)
def _processor(text: str, model: str) -> ImageProcessorConfig:
    return ImageProcessorConfig.from_json(text, f"{model}'s preprocessor_config.json")


def model_images(info: worker_pb2.WorkerInfo) -> ModelImages | None:
    """The model's image handling, None when it takes no images (no vision tower)."""
    if not info.image_processor_config:
        return None
    return ModelImages(_processor(info.image_processor_config, info.model), info.image_token_id)


def image_parts(request: generate_pb2.GenerateRequest | generate_pb2.TokenizeRequest) -> list[ImagePart]:
    """A chat's images in prompt order (other prompts have none)."""
    if request.WhichOneof("prompt") != "chat":
        return []
    return [
        ImagePart(part.image.data, f"image {n} (chat.messages[{i}].parts[{j}])", part.image.url)
        for n, (i, j, part) in enumerate(
            (i, j, part)
            for i, message in enumerate(request.chat.messages)
            for j, part in enumerate(message.parts)
            if part.WhichOneof("part") == "image"
        )
    ]


def check_images(images: list[ImagePart], info: worker_pb2.WorkerInfo, limits: RequestLimits) -> None:
    """What can be checked without decoding: the model takes images, how many, how large."""
    if not images:
        return
    if model_images(info) is None:
        raise ValueError(f"{images[0].where}: model {info.model} takes no images (it has no vision tower)")
    if len(images) > limits.max_images_per_request:
        raise ValueError(
            f"the request has {len(images)} images; at most {limits.max_images_per_request} are accepted "
            f"(--max-images-per-request)"
        )
    for image in images:
        if image.url:
            check_image_url(image, limits)
            continue
        if not image.data:
            raise ValueError(f"{image.where} is empty: it needs the bytes of an image file")
        if len(image.data) > limits.max_image_bytes:
            raise ValueError(
                f"{image.where} is {len(image.data)} bytes; at most {limits.max_image_bytes} are accepted "
                f"(--max-image-bytes)"
            )


def check_link_size(images: tuple[ResizedImage, ...]) -> None:
    """The resized images fit in one message to a worker."""
    size = sum(image.rgb.nbytes for image in images)
    if size > LINK_IMAGE_BYTES:
        raise ValueError(
            f"the request's {len(images)} images resize to {size} bytes of pixels; at most {LINK_IMAGE_BYTES} "
            "fit in one request to a worker: send fewer or smaller images"
        )


def num_tokens(image: ResizedImage, processor: ImageProcessorConfig) -> int:
    """The placeholder tokens a resized image takes: one per merged patch."""
    height, width, _ = image.rgb.shape
    return (height // processor.factor) * (width // processor.factor)


def check_image_url(image: ImagePart, limits: RequestLimits) -> None:
    """An http(s) URL on a host --image-url-hosts allows."""
    if not limits.image_url_hosts:
        raise ValueError(
            f"{image.where}: this router fetches no image URLs (--image-url-hosts allows none); send the image "
            "as a base64 data: URL or as bytes"
        )
    parts = urllib.parse.urlsplit(image.url)
    host = (parts.hostname or "").lower()
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"{image.where}: {image.url[:80]!r} is not an http(s) URL")
    if not any(_host_allowed(host, pattern.lower()) for pattern in limits.image_url_hosts):
        raise ValueError(
            f"{image.where}: host {host!r} is not among the hosts --image-url-hosts allows "
            f"({', '.join(limits.image_url_hosts)})"
        )


def _host_allowed(host: str, pattern: str) -> bool:
    if pattern.startswith("*."):
        return host.endswith(pattern[1:])
    return host == pattern


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: its target would escape the allow-list's check."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)
_CHUNK = 64 * 1024


def fetch_image(image: ImagePart, limits: RequestLimits) -> bytes:
    """The bytes at an image's URL (check_image_url passed): at most --max-image-bytes, all of it within
    --image-url-timeout seconds; a redirect, an error status, a refused connection or a timeout is a
    ValueError naming the image. Blocking: run it off the event loop."""
    timeout = limits.image_url_timeout_s
    deadline = time.monotonic() + timeout
    try:
        with _OPENER.open(image.url, timeout=timeout) as response:
            data = bytearray()
            while chunk := response.read(_CHUNK):
                data += chunk
                if len(data) > limits.max_image_bytes:
                    raise ValueError(
                        f"{image.where}: {image.url[:80]} holds more than {limits.max_image_bytes} bytes "
                        "(--max-image-bytes)"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError
    except urllib.error.HTTPError as exc:
        raise ValueError(
            f"{image.where}: fetching {image.url[:80]} answered {exc.code} {exc.reason}"
            + (" (redirects are not followed)" if 300 <= exc.code < 400 else "")
        ) from None
    except (urllib.error.URLError, OSError) as exc:  # TimeoutError is an OSError
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        timed_out = isinstance(reason, TimeoutError)
        why = f"took over {timeout:g} s (--image-url-timeout)" if timed_out else f"failed: {reason}"
        raise ValueError(f"{image.where}: fetching {image.url[:80]} {why}") from None
    return bytes(data)


def decode_image(image: ImagePart, processor: ImageProcessorConfig, limits: RequestLimits) -> ResizedImage:
    """The image (fetched first when it is a URL) decoded and resized as the model's processor resizes it.
    Its size is read from the header and checked before the pixels are decoded."""
    from PIL import Image, UnidentifiedImageError  # here: a router's start has no image to decode

    if image.url:
        image = ImagePart(fetch_image(image, limits), image.where)
    try:
        with Image.open(io.BytesIO(image.data)) as opened:
            if opened.format not in FORMATS:
                raise ValueError(
                    f"{image.where}: {opened.format} images are not supported; send one of {', '.join(FORMATS)}"
                )
            width, height = opened.size
            if width * height > limits.max_image_pixels:
                raise ValueError(
                    f"{image.where} is {width}x{height} = {width * height} pixels; at most "
                    f"{limits.max_image_pixels} are accepted (--max-image-pixels)"
                )
            opened.load()
            return resize_image(opened, processor)
    except RequestError as exc:  # the processor's own refusal (an extreme aspect ratio)
        raise ValueError(f"{image.where}: {exc}") from None
    except Image.DecompressionBombError as exc:  # PIL's own ceiling, far above any sane limit
        raise ValueError(f"{image.where} is too large: {exc}") from None
    except UnidentifiedImageError:
        raise ValueError(
            f"{image.where} is not an image file PIL can read ({len(image.data)} bytes starting "
            f"{image.data[:8]!r}); send one of {', '.join(FORMATS)}"
        ) from None
    except (OSError, SyntaxError) as exc:  # truncated or corrupt pixel data
        raise ValueError(f"{image.where} could not be decoded: {exc}") from None
