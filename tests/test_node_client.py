"""A Node.js client (@grpc/grpc-js loading protos/ at runtime, no generated code) streams a completion from
the router and gets exactly what the Python stubs get: the public proto works across languages."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from nanovllm.v1 import generate_pb2, generate_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
NODE_DIR = REPO / "tests" / "node"
PROTO_ROOT = REPO / "protos"
PROMPT = "The quick brown fox"
# Enough tokens that the router would have to stall for the whole generation (hundreds of ms even on a fast
# host) to merge them into one response (router/calls/call.py joins updates that wait behind a write).
MAX_TOKENS = 128
TIMEOUT_S = 120.0

NODE = shutil.which("node")
pytestmark = [
    pytest.mark.skipif(
        NODE is None,
        reason="node is not installed on this machine; the Node.js client test needs it "
        "(CI installs it with make test)",
    ),
    pytest.mark.skipif(
        not (NODE_DIR / "node_modules").is_dir(),
        reason="tests/node/node_modules is missing; `make test` installs it with npm ci where npm exists "
        "(or run `npm ci --prefix tests/node`)",
    ),
]


def generate_with_python(address: str) -> dict:
    """The request generate_client.js sends, made with the Python stubs, summarized the same way."""
    request = generate_pb2.GenerateRequest(
        text=PROMPT,
        sampling=generate_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        return_token_ids=True,
    )
    with grpc.insecure_channel(address) as channel:
        responses = list(generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=TIMEOUT_S))
    last = responses[-1]
    return {
        "text": "".join(r.text for r in responses),
        "token_ids": [t for r in responses for t in r.token_ids],
        "finish_reason": generate_pb2.FinishReason.Name(last.finish_reason),
        "usage": {
            "prompt_tokens": last.usage.prompt_tokens,
            "completion_tokens": last.usage.completion_tokens,
            "cached_prompt_tokens": last.usage.cached_prompt_tokens,
        },
        "responses": len(responses),
    }


def generate_with_node(address: str) -> dict:
    proc = subprocess.run(
        [NODE, str(NODE_DIR / "generate_client.js"), address, str(PROTO_ROOT)],
        check=False,  # the assertion below reports the exit status with node's stderr
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=NODE_DIR,
    )
    assert proc.returncode == 0, f"node client exited {proc.returncode}: {proc.stderr.strip()}"
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"expected one line of JSON on stdout, got {proc.stdout!r}"
    return json.loads(lines[0])


def test_node_client_streams_the_same_completion_as_python(service) -> None:
    address = service.router.address
    node = generate_with_node(address)
    python = generate_with_python(address)

    assert node["finish_reason"] == "FINISH_REASON_LENGTH"
    assert node["usage"]["completion_tokens"] == MAX_TOKENS
    assert len(node["token_ids"]) == MAX_TOKENS
    assert node["responses"] > 1, "the completion should arrive as a stream of several responses"
    # Greedy decoding of the same prompt: the same tokens and text whichever client asked.
    assert node["token_ids"] == python["token_ids"]
    assert node["text"] == python["text"]
    assert node["finish_reason"] == python["finish_reason"]
    assert node["usage"]["prompt_tokens"] == python["usage"]["prompt_tokens"]
    assert node["usage"]["completion_tokens"] == python["usage"]["completion_tokens"]
