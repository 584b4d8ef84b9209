"""Embeddings and rerank scores served: `nanovllm serve` with a random Qwen3 (float32), called by the official
`openai` client (`embeddings.create`), plain HTTP (/v1/rerank, /score) and gRPC (Embed, Score): each
answer equals the offline `LLM`'s on the same model; generation streams beside embedding calls keep their
tokens; bad inputs are 400s (INVALID_ARGUMENT) naming what is wrong."""

from __future__ import annotations

import base64
import json
import random
import signal
import struct
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest

from nanovllm import LLM
from nanovllm.common.errors import ConfigError
from nanovllm.common.server_config import RequestLimits, RouterConfig
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.helpers import greedy
from tests.metrics import scrape, value
from tests.model_factory import build_model, build_tokenizer
from tests.services import collect, serve_addresses

TEXTS = ["The quick brown fox", "Paged attention stores keys and values.", "café", "Numbers 0123456789"]
DOCUMENTS = ["The quick brown fox jumps.", "Numbers 0123456789", "Prefix caching reuses blocks."]
QUERY = "What does the fox do?"
MAX_MODEL_LEN = 512
MAX_INPUTS = 8
# The served vectors are float32 (the wire's); the offline ones the same values normalised in float64.
TOLERANCE = 1e-6


@dataclass
class Served:
    grpc: str
    http: str
    metrics: str  # the router's /metrics
    log: Path  # serve's stderr: the router's JSON log lines among others
    client: openai.OpenAI
    model: str
    offline: LLM


@pytest.fixture(scope="module")
def served(kernels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("embeddings_serving")
    model = build_model("qwen3", root / "qwen3", seed=5, tokenizer=False)
    build_tokenizer(words=("yes", "no")).save_pretrained(model)  # a reranker's "yes" and "no": one token each
    offline = LLM(str(model), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory="16MiB")
    log_path = root / "serve.log"
    with log_path.open("w") as log:
        serve = subprocess.Popen(
            [sys.executable, "-m", "nanovllm.cli", "serve", "--model", str(model), "--port", "0"]
            + ["--metrics-port", "0", "--http-port", "0", "--kv-cache-memory", "32MiB"]
            + ["--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--log-format", "json"]
            + ["--max-pooling-inputs", str(MAX_INPUTS)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        assert serve.stdout is not None
        router, http, metrics = serve_addresses(serve.stdout)
        client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="none", max_retries=0)
        yield Served(router, http, metrics, log_path, client, model.name, offline)
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
    # serve's children log JSON records into its stderr (lines may interleave); its own lines are plain text
    decoder, records = json.JSONDecoder(), []
    for line in log_path.read_text().splitlines():
        at = 0
        while line.startswith("{", at):
            record, at = decoder.raw_decode(line, at)
            records.append(record)
    assert [r for r in records if "logger" in r and r["level"] == "error"] == []


def post(served: Served, path: str, body: object) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://{served.http}{path}", data=json.dumps(body).encode(), method="POST"
    )
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and max(abs(g - w) for g, w in zip(got, want)) < TOLERANCE


def test_openai_embeddings_equal_offline(served: Served) -> None:
    want = served.offline.embed(TEXTS, use_tqdm=False)
    answer = served.client.embeddings.create(model=served.model, input=TEXTS)
    assert [d.index for d in answer.data] == list(range(len(TEXTS)))
    for got, expected in zip(answer.data, want):
        assert _close(got.embedding, expected["embedding"])
    assert answer.usage.prompt_tokens == sum(w["num_prompt_tokens"] for w in want)
    # token ids, one list or several; dimensions truncated then renormalised
    ids = [served.offline.tokenizer.encode(t) for t in TEXTS]
    one = served.client.embeddings.create(model=served.model, input=ids[1])
    assert _close(one.data[0].embedding, want[1]["embedding"])
    short = served.client.embeddings.create(model=served.model, input=ids, dimensions=16)
    for got, expected in zip(short.data, served.offline.embed(ids, dimensions=16, use_tqdm=False)):
        assert _close(got.embedding, expected["embedding"])


def test_base64_is_little_endian_float32(served: Served) -> None:
    status, body = post(served, "/v1/embeddings", {"input": TEXTS[:2], "encoding_format": "base64"})
    assert status == 200
    _, plain = post(served, "/v1/embeddings", {"input": TEXTS[:2]})
    for encoded, floats in zip(body["data"], plain["data"]):
        raw = base64.b64decode(encoded["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == floats["embedding"]
    assert body["model"] == served.model  # named though the request named none


def test_rerank_and_score_equal_offline(served: Served) -> None:
    want = [r["score"] for r in served.offline.score(QUERY, DOCUMENTS, use_tqdm=False)]
    status, body = post(served, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert status == 200
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in body["results"]] == order
    for result in body["results"]:
        assert abs(result["relevance_score"] - want[result["index"]]) < TOLERANCE
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    status, body = post(
        served,
        "/v1/rerank",
        {"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "return_documents": False},
    )
    assert status == 200 and len(body["results"]) == len(DOCUMENTS)
    assert all("document" not in r for r in body["results"])
    status, body = post(served, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    assert all(abs(d["score"] - w) < TOLERANCE for d, w in zip(body["data"], want))
    # lists of both: pairs (vLLM's N-to-N), each pair as its query alone would score it
    queries = [QUERY, "Which numbers?", QUERY]
    status, body = post(served, "/score", {"text_1": queries, "text_2": DOCUMENTS})
    assert status == 200
    for d, query, document in zip(body["data"], queries, DOCUMENTS, strict=True):
        (alone,) = served.offline.score(query, [document], use_tqdm=False)
        assert abs(d["score"] - alone["score"]) < TOLERANCE
    status, body = post(served, "/score", {"text_1": queries[:2], "text_2": DOCUMENTS})
    assert status == 400 and "text_1 and text_2 as lists are pairs: 2 and 3 texts" in body["error"]["message"]


def test_grpc_embed_and_score_equal_offline(served: Served) -> None:
    want = served.offline.embed(TEXTS, use_tqdm=False)
    want_scores = [r["score"] for r in served.offline.score(QUERY, DOCUMENTS, use_tqdm=False)]
    with grpc.insecure_channel(served.grpc) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        embedded = stub.Embed(generate_pb2.EmbedRequest(texts=TEXTS), timeout=60)
        scored = stub.Score(generate_pb2.ScoreRequest(query=QUERY, documents=DOCUMENTS), timeout=60)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Embed(generate_pb2.EmbedRequest(texts=TEXTS, dimensions=65), timeout=60)
        with pytest.raises(grpc.RpcError) as unpaired:
            stub.Score(generate_pb2.ScoreRequest(query=QUERY, queries=[QUERY], documents=["a"]), timeout=60)
    assert unpaired.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1 queries for 1 documents, and query given too" in unpaired.value.details()
    for got, expected in zip(embedded.embeddings, want):
        assert _close(list(got.values), expected["embedding"])
    assert _close(list(scored.scores), want_scores)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "dimensions is 65, larger than the model's 64" in refused.value.details()


def test_pooling_calls_are_counted_logged_and_their_outcomes_named(served: Served) -> None:
    """Each Embed or Score call moves the router's pooling metrics by kind, outcome and face, and ends with
    one pooling_finished log line; both are written before the answer goes out."""
    before = scrape(served.metrics)
    embedded = served.client.embeddings.create(model=served.model, input=TEXTS[:2])
    with grpc.insecure_channel(served.grpc) as channel:
        scored = generate_pb2_grpc.GenerationStub(channel).Score(
            generate_pb2.ScoreRequest(query=QUERY, documents=DOCUMENTS), timeout=60
        )
    status, _ = post(served, "/v1/embeddings", {"input": "a", "dimensions": 65})
    assert status == 400
    after = scrape(served.metrics)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("nanovllm:pooling_requests_total", kind="embed", status="ok", api="http") == 1
    assert delta("nanovllm:pooling_requests_total", kind="score", status="ok", api="grpc") == 1
    assert delta("nanovllm:pooling_requests_total", kind="embed", status="invalid_argument", api="http") == 1
    assert delta("nanovllm:pooling_inputs_total", kind="embed") == 2  # the refused call's input not counted
    assert delta("nanovllm:pooling_inputs_total", kind="score") == len(DOCUMENTS)
    assert delta("nanovllm:pooling_prompt_tokens_total", kind="embed") == embedded.usage.prompt_tokens
    assert delta("nanovllm:pooling_prompt_tokens_total", kind="score") == scored.prompt_tokens
    assert delta("nanovllm:pooling_request_latency_seconds_count", kind="embed") == 1
    assert delta("nanovllm:requests_total", status="stop", api="http") == 0  # not counted as Generate calls
    lines = [json.loads(line) for line in served.log.read_text().splitlines() if '"pooling_finished"' in line]
    assert {
        "kind": "score", "api": "grpc", "outcome": "ok", "inputs": len(DOCUMENTS),
        "prompt_tokens": scored.prompt_tokens,
    }.items() <= lines[-2].items()  # fmt: skip
    assert {"kind": "embed", "api": "http", "outcome": "invalid_argument", "inputs": 1}.items() <= lines[
        -1
    ].items()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": []}, "input is empty"),
        ({"input": [""]}, "input 0 is empty"),
        (
            {"input": ["a"] * (MAX_INPUTS + 1)},
            f"{MAX_INPUTS + 1} inputs, more than --max-pooling-inputs {MAX_INPUTS}",
        ),
        (
            {"input": [[5] * (MAX_MODEL_LEN + 1)]},
            f"input 0 has {MAX_MODEL_LEN + 1} tokens, more than max_model_len",
        ),
        ({"input": "a", "dimensions": 65}, "dimensions is 65, larger than the model's 64"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format must be float or base64"),
    ],
)
def test_bad_embeddings_are_400s(served: Served, body: dict, message: str) -> None:
    status, answer = post(served, "/v1/embeddings", body)
    assert status == 400, answer
    assert message in answer["error"]["message"]


def test_bad_rerank_is_400(served: Served) -> None:
    status, answer = post(served, "/v1/rerank", {"query": QUERY, "documents": []})
    assert status == 400 and "documents must be a non-empty list" in answer["error"]["message"]
    many = {"query": QUERY, "documents": ["d"] * (MAX_INPUTS + 1)}
    status, answer = post(served, "/v1/rerank", many)
    assert status == 400 and "--max-pooling-inputs" in answer["error"]["message"]


def test_generation_streams_unchanged_beside_embeddings(served: Served) -> None:
    """16 greedy streams generate while embedding calls run on the same worker: each stream's tokens are
    its offline tokens."""
    rng = random.Random(9)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randrange(4, 30))] for _ in range(16)]
    want = [o["token_ids"] for o in served.offline.generate(prompts, greedy(24), use_tqdm=False)]
    params = generate_pb2.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    requests = [
        generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=p), sampling=params, return_token_ids=True
        )
        for p in prompts
    ]
    embed_want = served.offline.embed(TEXTS, use_tqdm=False)
    with ThreadPoolExecutor(len(requests)) as threads:
        streams = [threads.submit(collect, served.grpc, r) for r in requests]
        embedded = [served.client.embeddings.create(model=served.model, input=TEXTS) for _ in range(4)]
        results = [s.result() for s in streams]
    for (responses, error), expected in zip(results, want):
        assert error is None
        assert [t for r in responses for t in r.token_ids] == expected
    for answer in embedded:
        assert all(_close(d.embedding, w["embedding"]) for d, w in zip(answer.data, embed_want))


def test_bad_prompt_formats_refused_at_start() -> None:
    with pytest.raises(
        ConfigError, match=r"--rerank-format must use exactly \{instruction\}, \{query\}, \{document\}"
    ):
        RouterConfig(workers=["127.0.0.1:1"], rerank_format="<Query>: {query}")
    with pytest.raises(ConfigError, match="--embed-query-format must use exactly"):
        RouterConfig(workers=["127.0.0.1:1"], embed_query_format="{query} {oops}")
    with pytest.raises(ConfigError, match="--max-pooling-inputs must be at least 1, got 0"):
        RouterConfig(workers=["127.0.0.1:1"], limits=RequestLimits(max_pooling_inputs=0))
