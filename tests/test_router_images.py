"""The router's side of images, without a model: OpenAI `image_url` parts and the Responses API's
`input_image` parsed into the public proto's image parts (base64 data: URLs, or http(s) URLs fetched from
a local HTTP server only from the hosts --image-url-hosts allows), the request limits (images per
request, bytes, pixels), every bad image refused naming it, and the prompt's block hashes
covering an image's content as the worker's block keys do (router/calls/images.py,
router/faces/openai_protocol.py, common/block_hash.py). Served end to end: tests/test_qwen3_5_vision_served.py."""

from __future__ import annotations

import base64
import http.server
import io
import json
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from nanovllm.common.block_hash import PromptImage, hash_block, prefix_hashes
from nanovllm.common.errors import ConfigError
from nanovllm.common.images import (
    ImagePatches,
    ImageProcessorConfig,
    ResizedImage,
    patches_from_rgb,
    resize_image,
)
from nanovllm.common.sampling_params import SamplingParams
from nanovllm.common.server_config import RequestLimits
from nanovllm.common.v1 import worker_pb2
from nanovllm.common.wire import image_from_wire, image_to_wire
from nanovllm.router.calls.images import ImagePart, check_image_url, decode_image, fetch_image, image_parts
from nanovllm.router.calls.tool_calls import template_message
from nanovllm.router.calls.validation import check_request
from nanovllm.router.faces.openai_protocol import ProtocolError, parse_request
from nanovllm.router.faces.responses import parse_responses_request
from nanovllm.v1 import generate_pb2
from nanovllm.worker.sequence import ImageInput, Sequence

PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "merge_size": 2,
             "temporal_patch_size": 2, "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}}  # fmt: skip
VISION = worker_pb2.WorkerInfo(
    model="vl",
    max_model_len=4096,
    vocab_size=1000,
    image_processor_config=json.dumps(PROCESSOR),
    image_token_id=7,
)
CFG = ImageProcessorConfig.from_json(json.dumps(PROCESSOR), "test")


def _file(height: int, width: int, kind: str = "PNG", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, kind)
    return out.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _chat(*datas: bytes) -> generate_pb2.GenerateRequest:
    parts = [generate_pb2.ContentPart(text="look:")]
    parts += [generate_pb2.ContentPart(image=generate_pb2.ImagePart(data=d)) for d in datas]
    message = generate_pb2.ChatMessage(role="user", parts=parts)
    return generate_pb2.GenerateRequest(chat=generate_pb2.Chat(messages=[message]))


def test_image_url_parts_become_image_parts():
    png = _file(40, 50)
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is "}, {"type": "image_url", "image_url": {"url": _data_url(png)}},
        {"type": "text", "text": "?"},
    ]}]}  # fmt: skip
    message = parse_request(body, chat=True).generate[0].chat.messages[0]
    assert message.content == ""
    assert [p.WhichOneof("part") for p in message.parts] == ["text", "image", "text"]
    assert message.parts[1].image.data == png
    texts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ]
    }
    assert parse_request(texts, chat=True).generate[0].chat.messages[0].content == "ab"  # text parts: joined


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("file:///etc/passwd", "must be a base64 data: URL"),
        ("data:image/png,rawbytes", "must be a base64 data: URL"),
        ("data:image/png;base64,@@@", "base64 payload does not decode"),
    ],
)
def test_image_urls_the_router_refuses(url: str, says: str):
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    with pytest.raises(ProtocolError, match=says) as caught:
        parse_request(body, chat=True)
    assert caught.value.param == "messages[0].content[0].image_url.url"


def test_http_urls_are_left_for_the_router_to_fetch():
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://a.b/c.png"}}]}
        ]
    }
    assert (
        parse_request(body, chat=True).generate[0].chat.messages[0].parts[0].image.url == "https://a.b/c.png"
    )


def test_responses_input_image_becomes_an_image_part():
    png = _file(40, 50)
    body = {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Describe"}, {"type": "input_image", "image_url": _data_url(png)},
    ]}]}  # fmt: skip
    message = parse_responses_request(body).chat.generate[0].chat.messages[0]
    assert [p.WhichOneof("part") for p in message.parts] == ["text", "image"]
    assert message.parts[1].image.data == png
    bad = {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}
    with pytest.raises(ProtocolError, match=r"input\[0\].content\[0\] needs an image_url"):
        parse_responses_request(bad)


def test_limits_refuse_naming_the_flag_and_the_numbers():
    limits = RequestLimits(max_images_per_request=2, max_image_bytes=2000, max_image_pixels=100 * 100)
    small = _file(8, 8)
    check_request(_chat(small, small), None, VISION, limits)
    with pytest.raises(ValueError, match=r"3 images; at most 2 .*--max-images-per-request"):
        check_request(_chat(small, small, small), None, VISION, limits)
    big = _file(40, 40)
    with pytest.raises(
        ValueError,
        match=rf"image 1 \(chat.messages\[0\].parts\[2\]\) is {len(big)} bytes; at most 2000 .*--max-image-bytes",
    ):
        check_request(_chat(small, big), None, VISION, limits)
    with pytest.raises(ValueError, match=r"image 0 .* is empty"):
        check_request(_chat(b""), None, VISION, limits)
    text_only = worker_pb2.WorkerInfo(model="text", max_model_len=4096, vocab_size=1000)
    with pytest.raises(ValueError, match="model text takes no images"):
        check_request(_chat(small), None, text_only, limits)
    flat = io.BytesIO()
    Image.new("RGB", (101, 100)).save(flat, "PNG")  # small in bytes, too many pixels
    with pytest.raises(ValueError, match=r"is 101x100 = 10100 pixels; at most 10000 .*--max-image-pixels"):
        decode_image(ImagePart(flat.getvalue(), "image 0"), CFG, limits)
    with pytest.raises(ConfigError, match="--max-images-per-request must be at least 1"):
        RequestLimits(max_images_per_request=0)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"plain text, not an image", "is not an image file"),
        (_file(40, 50)[:200], "could not be decoded"),  # a PNG cut short
        (_file(40, 50, "TIFF"), "TIFF images are not supported"),
        (_file(10, 2100), "aspect ratio exceeds 200"),
    ],
)
def test_bad_images_are_refused_naming_them(data: bytes, says: str):
    with pytest.raises(ValueError, match=says) as caught:
        decode_image(ImagePart(data, "image 3 (chat.messages[1].parts[0])"), CFG, RequestLimits())
    assert str(caught.value).startswith("image 3 (chat.messages[1].parts[0])")


def test_decoded_images_cross_the_link_as_the_offline_patches():
    """Decoded and resized by the router, sent as RGB bytes, cut on the worker: the patches and hash of
    the offline path (common/images.py patchify), for formats PIL decodes without loss."""
    for kind in ("PNG", "BMP", "WEBP"):
        data = _file(70, 100, kind, seed=1)
        resized = decode_image(ImagePart(data, "image 0"), CFG, RequestLimits())
        assert resized.rgb.shape == (64, 96, 3)
        wire = worker_pb2.Submit(images=[image_to_wire(resized, worker_pb2.Image)]).SerializeToString()
        received = image_from_wire(worker_pb2.Submit.FromString(wire).images[0], 0)
        ours = patches_from_rgb(received, CFG)
        offline = patches_from_rgb(resize_image(Image.open(io.BytesIO(data)), CFG), CFG)
        assert (
            np.array_equal(ours.pixel_values, offline.pixel_values)
            and ours.content_hash == offline.content_hash
        )
    assert len(image_parts(_chat(b"a", b"b"))) == 2


def test_prompt_block_hashes_cover_images_as_the_worker_keys_blocks():
    """The router's hashes of a prompt with two images equal the worker's chain of block keys
    (worker/sequence.py Sequence.block_key); another image of the same size changes the blocks from the
    one holding its first token on, and only those."""
    tokens = [5] * 6 + [7] * 6 + [9] * 5 + [7] * 4 + [3] * 3
    a, b, c = (ResizedImage.of(np.full((64, 96, 3), k, np.uint8)) for k in (1, 2, 3))
    spans = [PromptImage(6, 12, a.content_hash), PromptImage(17, 21, b.content_hash)]
    patches = [ImagePatches(np.zeros(1), (1, 4, 6), i.content_hash) for i in (a, b)]
    images = [ImageInput(6, 6, (2, 3), patches[0]), ImageInput(17, 4, (2, 2), patches[1])]
    seq = Sequence(0, "probe", tokens, SamplingParams(), images=images)
    block, prev, chain = 4, None, []
    for i in range(len(tokens) // block):
        prev = hash_block(prev, seq.block_key(i, block))
        chain.append(prev)
    assert prefix_hashes(tokens, block, images=spans) == chain
    other = prefix_hashes(tokens, block, images=[spans[0], PromptImage(17, 21, c.content_hash)])
    assert other[:4] == chain[:4] and all(x != y for x, y in zip(other[4:], chain[4:]))


class _Images(http.server.BaseHTTPRequestHandler):
    """A picture, a redirect to it, a 404, one too large, and one that never answers until released."""

    picture = _file(40, 50)
    release = threading.Event()

    def do_GET(self) -> None:
        if self.path == "/hang":
            self.release.wait()
            return
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        body = {"/cat.png": self.picture, "/big.png": _file(200, 200)}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        _Images.release.set()
        server.shutdown()
        server.server_close()


def _url_part(url: str) -> ImagePart:
    return ImagePart(b"", "image 0 (chat.messages[0].parts[1])", url)


def test_image_urls_need_an_allowed_host():
    with pytest.raises(ValueError, match=r"fetches no image URLs \(--image-url-hosts allows none\)"):
        check_image_url(_url_part("https://example.com/cat.png"), RequestLimits())
    limits = RequestLimits(image_url_hosts=["images.example.com", "*.cdn.example.org"])
    check_image_url(_url_part("https://images.example.com/cat.png"), limits)
    check_image_url(_url_part("https://eu.cdn.example.org/cat.png"), limits)
    with pytest.raises(
        ValueError, match=r"host 'cdn.example.org' is not among the hosts --image-url-hosts allows"
    ):
        check_image_url(_url_part("https://cdn.example.org/cat.png"), limits)
    with pytest.raises(ValueError, match="is not an http"):
        check_image_url(_url_part("ftp://images.example.com/cat.png"), limits)


def test_allowed_urls_are_fetched_and_their_failures_named(image_server: str):
    limits = RequestLimits(image_url_hosts=["127.0.0.1"], max_image_bytes=20_000, image_url_timeout_s=0.5)
    fetched = decode_image(_url_part(f"{image_server}/cat.png"), CFG, limits)
    direct = decode_image(ImagePart(_Images.picture, "image 0"), CFG, limits)
    assert np.array_equal(fetched.rgb, direct.rgb) and fetched.content_hash == direct.content_hash
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}/cat.png"
    for path, says in [
        ("/missing.png", "answered 404"),
        ("/moved", "answered 302 .*redirects are not followed"),
        ("/big.png", "holds more than 20000 bytes \\(--max-image-bytes\\)"),
        ("/hang", "took over 0.5 s \\(--image-url-timeout\\)"),
    ]:
        with pytest.raises(ValueError, match=says) as caught:
            fetch_image(_url_part(image_server + path), limits)
        assert str(caught.value).startswith("image 0 (chat.messages[0].parts[1]): "), path
    with pytest.raises(ValueError, match="failed: .*refused"):
        fetch_image(_url_part(closed), limits)


def test_text_parts_alone_render_as_one_text():
    """gRPC parts without an image reach the template as one string, as HTTP's text parts do."""
    parts = [generate_pb2.ContentPart(text="a"), generate_pb2.ContentPart(text="b")]
    assert template_message(generate_pb2.ChatMessage(role="user", parts=parts))["content"] == "ab"
    parts.append(generate_pb2.ContentPart(image=generate_pb2.ImagePart(data=b"x")))
    assert template_message(generate_pb2.ChatMessage(role="user", parts=parts))["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
        {"type": "image"},
    ]
