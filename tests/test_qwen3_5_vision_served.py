"""Images through `nanovllm serve`: a tiny random Qwen3_5ForConditionalGeneration saved with transformers'
image processor (tests/model_factory.py build_vision_model), its chat template writing an image part as
`<|vision_start|><|image_pad|><|vision_end|>` (tests/chat_templates.py QWEN3_5), driven by the official
`openai` client (chat `image_url` parts with base64 data: URLs or URLs on a host --image-url-hosts allows,
the Responses API's `input_image`) and by
gRPC (`ImagePart` bytes), whose Tokenize gives transformers' prompt ids, placeholders expanded.

The reference is transformers itself, not the offline LLM: its tokenizer's `apply_chat_template` on the
same messages, the placeholders expanded by its image processor's grids, then a greedy loop of full
forward passes in float32 (no cache, no `generate` stopping rules). gRPC's tokens equal its tokens; the
chat's per-token logprobs are within 2e-4 of its logprobs of its tokens (each a logit less a log-sum-exp,
both within float32's 1e-4 bound), which holds only where the tokens agree. Every bad image is a 400 /
INVALID_ARGUMENT naming it, and the server answers the next request."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from nanovllm.cli import CLIENT_FLAGS, build_parser
from nanovllm.client import run_client
from nanovllm.common.images import expand_placeholders
from nanovllm.flags import resolve_all
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.helpers import vision_reference
from tests.model_factory import IMAGE_TOKEN_ID, build_vision_model
from tests.services import collect, serve_addresses

MAX_NEW = 8
OFF = {"enable_thinking": False}
LIMITS = {
    "--max-images-per-request": "3",
    "--max-image-bytes": "40000",
    "--max-image-pixels": str(300 * 300),
    "--image-url-hosts": "127.0.0.1",
}


@dataclass
class Served:
    grpc: str
    client: openai.OpenAI
    model: str
    log_path: Path


def _image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vision_model(tmp_path_factory.mktemp("qwen3_5_vision_served") / "vl")


@contextlib.contextmanager
def _serve(model: Path) -> Iterator[Served]:
    """`nanovllm serve` of `model` (router and worker in one command) with LIMITS, until the block ends."""
    log_path = model.parent / "serve.log"
    limits = [word for flag, value in LIMITS.items() for word in (flag, value)]
    with log_path.open("w") as log:
        serve = subprocess.Popen(
            [sys.executable, "-m", "nanovllm.cli", "serve", "--model", str(model), "--port", "0"]
            + [
                "--metrics-port",
                "0",
                "--http-port",
                "0",
                "--kv-cache-memory",
                "32MiB",
                "--max-model-len",
                "512",
            ]
            + ["--dtype", "float32", "--log-format", "json", *limits],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        assert serve.stdout is not None
        router, http, _ = serve_addresses(serve.stdout)
        client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="none", max_retries=0)
        yield Served(router, client, model.name, log_path)
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def served(kernels, vision_model: Path) -> Iterator[Served]:
    with _serve(vision_model) as served:
        yield served


@pytest.fixture(scope="module")
def reference(vision_model: Path):
    return vision_reference(vision_model)


def _hf_prompt(reference, parts: list) -> tuple[list[int], dict]:
    """transformers' prompt for one user message of `parts` (strings and PIL images): its tokenizer's chat
    template, the placeholders expanded by its image processor's grids; and the processor's features."""
    _, processor, tokenizer = reference
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True, **OFF
    )
    features = processor(images=[p for p in parts if not isinstance(p, str)], return_tensors="pt")
    counts = (features["image_grid_thw"].prod(-1) // 4).tolist()
    return expand_placeholders(tokenizer.encode(text), IMAGE_TOKEN_ID, counts), features


_GREEDY: dict[int, tuple[list[int], list[float]]] = {}  # by id(parts): ONE is asked for by several tests


def _hf_greedy(reference, parts: list) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for `parts` and each token's logprob, by full forward passes."""
    if id(parts) not in _GREEDY:
        _GREEDY[id(parts)] = _hf_forward_greedy(reference, parts)
    return _GREEDY[id(parts)]


def _hf_forward_greedy(reference, parts: list) -> tuple[list[int], list[float]]:
    model = reference[0]
    ids, features = _hf_prompt(reference, parts)
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.inference_mode():
        for _ in range(MAX_NEW):
            input_ids = torch.tensor([ids + tokens])
            logits = model(
                input_ids=input_ids,
                mm_token_type_ids=(input_ids == IMAGE_TOKEN_ID).int(),
                pixel_values=features["pixel_values"],
                image_grid_thw=features["image_grid_thw"],
            ).logits[0, -1]
            step = torch.log_softmax(logits.double(), dim=-1)
            tokens.append(int(step.argmax()))
            logprobs.append(float(step[tokens[-1]]))
    return tokens, logprobs


def _openai_content(parts: list) -> list[dict]:
    return [
        {"type": "text", "text": p}
        if isinstance(p, str)
        else {"type": "image_url", "image_url": {"url": _url(_png(p))}}
        for p in parts
    ]


def _chat(served: Served, content: object, **extra):
    return served.client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": content}],  # type: ignore[misc, list-item]
        temperature=0,
        max_tokens=MAX_NEW,
        logprobs=True,
        extra_body={"ignore_eos": True, "chat_template_kwargs": OFF, **extra},
    )


def _grpc_chat(parts: list) -> generate_pb2.Chat:
    content = [
        generate_pb2.ContentPart(text=p)
        if isinstance(p, str)
        else generate_pb2.ContentPart(
            image=generate_pb2.ImagePart(data=p if isinstance(p, bytes) else _png(p))
        )
        for p in parts
    ]
    return generate_pb2.Chat(
        messages=[generate_pb2.ChatMessage(role="user", parts=content)], enable_thinking=False
    )


def _grpc_tokens(served: Served, parts: list) -> tuple[list[int], grpc.RpcError | None]:
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    request = generate_pb2.GenerateRequest(chat=_grpc_chat(parts), sampling=sampling, return_token_ids=True)
    responses, error = collect(served.grpc, request)
    return [t for r in responses for t in r.token_ids], error


def _grpc_tokenize(served: Served, parts: list) -> list[int]:
    with grpc.insecure_channel(served.grpc) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        return list(stub.Tokenize(generate_pb2.TokenizeRequest(chat=_grpc_chat(parts)), timeout=30).token_ids)


# One image 70x100 (resized to 64x96, not a multiple of 32 px as sent); two images, 64x96 (a multiple)
# and 40x150 (resized to 32x160), with text before, between and after.
ONE = ["What is in ", _image(70, 100, 1), " this picture?"]
TWO = ["Compare ", _image(64, 96, 2), " with ", _image(40, 150, 3), " please."]


@pytest.mark.parametrize(("name", "parts"), [("one image", ONE), ("two images", TWO)])
def test_chat_with_images_equals_transformers(served: Served, reference, name: str, parts: list) -> None:
    assert _grpc_tokenize(served, parts) == _hf_prompt(reference, parts)[0]
    tokens, logprobs = _hf_greedy(reference, parts)
    grpc_tokens, error = _grpc_tokens(served, parts)
    assert error is None and grpc_tokens == tokens, name
    answer = _chat(served, _openai_content(parts))
    entries = answer.choices[0].logprobs.content
    assert len(entries) == MAX_NEW
    for step, (entry, theirs) in enumerate(zip(entries, logprobs)):
        assert abs(entry.logprob - theirs) <= 2e-4, (name, step)
    assert answer.usage.prompt_tokens == len(_hf_prompt(reference, parts)[0])


def test_the_moe_checkpoint_serves_images_as_transformers(kernels, tmp_path: Path) -> None:
    """A Qwen3_5MoeForConditionalGeneration served the same way: two images through gRPC and the openai
    client, tokens equal transformers' and logprobs within 2e-4."""
    model = build_vision_model(tmp_path / "vl-moe", arch="qwen3_5_moe")
    reference = vision_reference(model)
    tokens, logprobs = _hf_forward_greedy(reference, TWO)
    with _serve(model) as served:
        assert _grpc_tokens(served, TWO) == (tokens, None)
        entries = _chat(served, _openai_content(TWO)).choices[0].logprobs.content
        assert [entry.logprob for entry in entries] == pytest.approx(logprobs, abs=2e-4)


def test_responses_input_image_answers_as_the_chat(served: Served) -> None:
    chat = _chat(served, _openai_content(ONE), ignore_eos=False)  # the Responses API has no ignore_eos
    response = served.client.responses.create(
        model=served.model,
        input=[{"role": "user", "content": [  # type: ignore[list-item]
            {"type": "input_text", "text": ONE[0]},
            {"type": "input_image", "image_url": _url(_png(ONE[1])), "detail": "auto"},
            {"type": "input_text", "text": ONE[2]},
        ]}],
        temperature=0,
        max_output_tokens=MAX_NEW,
        reasoning={"effort": "none"},
        store=False,
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and response.usage.input_tokens == chat.usage.prompt_tokens


def _bad_images() -> list[tuple[str, str, str]]:
    """(kind, data URL, what the 400 says) for each bad image a chat may carry."""
    noise = _png(_image(120, 120, 4))  # 43 kB of noise: over --max-image-bytes
    huge = io.BytesIO()
    Image.new("RGB", (301, 300)).save(huge, "PNG")  # a few kB, over --max-image-pixels
    tiff = io.BytesIO()
    _image(20, 20, 5).save(tiff, "TIFF")
    small = _png(_image(20, 20, 6))
    return [
        ("not an image", _url(b"GIF89a? no, just text"), "is not an image file"),
        ("undecodable", _url(small[: len(small) // 2]), "could not be decoded"),
        ("too many bytes", _url(noise), f"is {len(noise)} bytes; at most 40000"),
        ("too many pixels", _url(huge.getvalue()), "is 301x300 = 90300 pixels; at most 90000"),
        ("unsupported format", _url(tiff.getvalue()), "TIFF images are not supported"),
        (
            "a host not allowed",
            "https://example.com/cat.png",
            "host 'example.com' is not among the hosts --image-url-hosts allows",
        ),
        ("not base64", "data:image/png;base64,%%%", "base64 payload does not decode"),
    ]


def test_each_bad_image_is_a_400_naming_it_and_the_next_request_is_served(served: Served, reference) -> None:
    for kind, url, says in _bad_images():
        content = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]
        with pytest.raises(openai.BadRequestError, match=says) as caught:
            _chat(served, content)
        assert caught.value.status_code == 400, kind
        assert "image" in str(caught.value), kind
    small = {"type": "image_url", "image_url": {"url": _url(_png(_image(20, 20, 6)))}}
    with pytest.raises(openai.BadRequestError, match=r"4 images; at most 3 .*--max-images-per-request"):
        _chat(served, [small] * 4)
    _, logprobs = _hf_greedy(reference, ONE)
    entries = _chat(served, _openai_content(ONE)).choices[0].logprobs.content
    assert len(entries) == MAX_NEW
    assert all(abs(e.logprob - v) <= 2e-4 for e, v in zip(entries, logprobs))


def test_grpc_bad_image_is_invalid_argument(served: Served, reference) -> None:
    _, error = _grpc_tokens(served, ["look ", b"not an image at all"])
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "image 0 (chat.messages[0].parts[1]) is not an image file" in error.details()
    tokens, _ = _grpc_tokens(served, ONE)
    assert tokens == _hf_greedy(reference, ONE)[0]


def test_no_errors_logged(served: Served) -> None:
    """Bad images are the client's errors: none is logged as the server's."""
    decoder, records = json.JSONDecoder(), []
    for line in served.log_path.read_text().splitlines():
        at = 0
        while line.startswith("{", at):
            record, at = decoder.raw_decode(line, at)
            records.append(record)
    assert [r for r in records if "logger" in r and r["level"] == "error"] == []


def test_client_sends_image_files(served: Served, reference, tmp_path: Path, capsys) -> None:
    """`nanovllm client --image FILE` (run in this process): the image before the prompt in the user
    message, its tokens counted as transformers' processor counts them; a file it cannot read is named."""
    image = _image(70, 100, 1)
    path = tmp_path / "picture.png"
    path.write_bytes(_png(image))

    def client(*argv: str) -> int:
        args = build_parser().parse_args(["client", "--router", served.grpc, *argv])
        return run_client(resolve_all(CLIENT_FLAGS, args), args.prompt)

    assert client("--image", str(path), "--no-think", "--max-tokens", "4", "What is this?") == 0
    prompt = len(_hf_prompt(reference, [image, "What is this?"])[0])
    assert f": {prompt} prompt, " in capsys.readouterr().err
    assert client("--image", str(tmp_path / "no.png"), "x") == 2
    assert "--image" in (err := capsys.readouterr().err) and "no.png" in err


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    """A local HTTP server with ONE's picture at /one.png."""
    picture = _png(ONE[1])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/one.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(picture)))
            self.end_headers()
            self.wfile.write(picture)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_image_url_on_an_allowed_host_is_fetched(served: Served, reference, image_server: str) -> None:
    """--image-url-hosts 127.0.0.1: the picture fetched by URL answers as the same picture sent inline; a
    path the server does not have is a 400 naming its status."""
    content = [
        {"type": "text", "text": ONE[0]},
        {"type": "image_url", "image_url": {"url": f"{image_server}/one.png"}},
        {"type": "text", "text": ONE[2]},
    ]
    entries = _chat(served, content).choices[0].logprobs.content
    _, logprobs = _hf_greedy(reference, ONE)
    assert len(entries) == MAX_NEW
    assert all(abs(e.logprob - v) <= 2e-4 for e, v in zip(entries, logprobs))
    content[1] = {"type": "image_url", "image_url": {"url": f"{image_server}/other.png"}}
    with pytest.raises(
        openai.BadRequestError, match=r"image 0 \(chat.messages\[0\].parts\[1\]\): fetching .* answered 404"
    ):
        _chat(served, content)
