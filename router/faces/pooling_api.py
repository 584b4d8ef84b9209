"""The HTTP bodies of embeddings and reranking, turned into Embed and Score requests and their answers back:
OpenAI's `POST /v1/embeddings`, the Cohere/Jina-shaped `POST /v1/rerank` vLLM serves, and vLLM's
`POST /score`. A field of the wrong type or out of range is a ProtocolError naming it (a 400); what the
call itself refuses (too many inputs, an input over max_model_len, dimensions over the model's size) comes
back from router/calls/pooling.py as a 400 too.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

from nanovllm.common.wire import floats_to_bytes
from nanovllm.router.faces.openai_protocol import ProtocolError
from nanovllm.v1 import generate_pb2

ENCODING_FORMATS = ("float", "base64")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProtocolError("body", "the request body must be a JSON object")
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model", "")
    if not isinstance(model, str):
        raise ProtocolError("model", "model must be a string")
    return model


def parse_embeddings(body: Any) -> tuple[generate_pb2.EmbedRequest, str]:
    """An embeddings body as an EmbedRequest, and its encoding_format. `input` is a string, a list of
    strings, a list of token ids, or a list of token-id lists."""
    body = _object(body)
    request = generate_pb2.EmbedRequest(model=_model(body))
    data = body.get("input")
    if isinstance(data, str):
        request.texts.append(data)
    elif isinstance(data, list) and data and all(isinstance(t, str) for t in data):
        request.texts.extend(data)
    elif isinstance(data, list) and data and all(_is_int(t) for t in data):
        request.token_ids.add(ids=_token_ids(data))
    elif isinstance(data, list) and data and all(isinstance(t, list) for t in data):
        for ids in data:
            if not all(_is_int(t) for t in ids):
                raise ProtocolError("input", "a token-id list of input holds something other than integers")
            request.token_ids.add(ids=_token_ids(ids))
    elif data == []:
        raise ProtocolError("input", "input is empty: give at least one text or token-id list")
    else:
        raise ProtocolError(
            "input",
            "input must be a string, a list of strings, a list of token ids or a list of token-id lists",
        )
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if not _is_int(dimensions) or not 1 <= dimensions < 2**32:
            raise ProtocolError("dimensions", f"dimensions must be a positive integer, got {dimensions!r}")
        request.dimensions = dimensions
    encoding = body.get("encoding_format", "float")
    if encoding not in ENCODING_FORMATS:
        raise ProtocolError("encoding_format", f"encoding_format must be float or base64, got {encoding!r}")
    input_type = body.get("input_type", "")
    if input_type not in ("", "query", "document"):
        raise ProtocolError("input_type", f"input_type must be query or document, got {input_type!r}")
    request.input_type = input_type
    return request, encoding


def _token_ids(ids: list[int]) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < 2**32), None)
    if bad is not None:
        raise ProtocolError("input", f"token id {bad} is outside [0, 2**32)")
    return ids


def embeddings_body(response: generate_pb2.EmbedResponse, model: str, encoding: str) -> dict[str, Any]:
    """OpenAI's embeddings answer; base64 is the float32 values' little-endian bytes."""
    data = []
    for i, embedding in enumerate(response.embeddings):
        values: Any = list(embedding.values)
        if encoding == "base64":
            values = base64.b64encode(floats_to_bytes(values)).decode()
        data.append({"object": "embedding", "index": i, "embedding": values})
    usage = {"prompt_tokens": response.prompt_tokens, "total_tokens": response.prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def _documents(value: Any, param: str) -> list[str]:
    """Documents as strings or {"text": ...} objects (Cohere's)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ProtocolError(param, f"{param} must be a non-empty list of strings")
    texts = []
    for doc in value:
        if isinstance(doc, dict) and isinstance(doc.get("text"), str):
            doc = doc["text"]
        if not isinstance(doc, str):
            raise ProtocolError(param, f'each of {param} must be a string or an object with "text"')
        texts.append(doc)
    return texts


def _text(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise ProtocolError(name, f"{name} must be a string")
    return value


def _instruction(body: dict[str, Any]) -> str:
    value = body.get("instruction", "")
    if not isinstance(value, str):
        raise ProtocolError("instruction", "instruction must be a string")
    return value


def parse_rerank(body: Any) -> tuple[generate_pb2.ScoreRequest, int | None, bool]:
    """A rerank body as a ScoreRequest, with top_n (None: every document) and return_documents."""
    body = _object(body)
    request = generate_pb2.ScoreRequest(
        model=_model(body), query=_text(body, "query"), instruction=_instruction(body)
    )
    request.documents.extend(_documents(body.get("documents"), "documents"))
    top_n = body.get("top_n")
    if top_n is not None and (not _is_int(top_n) or top_n < 1):
        raise ProtocolError("top_n", f"top_n must be a positive integer, got {top_n!r}")
    return_documents = body.get("return_documents", True)
    if not isinstance(return_documents, bool):
        raise ProtocolError("return_documents", "return_documents must be true or false")
    return request, top_n, return_documents


def rerank_body(
    request: generate_pb2.ScoreRequest,
    response: generate_pb2.ScoreResponse,
    model: str,
    top_n: int | None,
    return_documents: bool,
) -> dict[str, Any]:
    """The documents by relevance, most relevant first, each with its index in the request."""
    order = sorted(range(len(response.scores)), key=lambda i: -response.scores[i])[:top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": response.scores[i]}
        if return_documents:
            result["document"] = {"text": request.documents[i]}
        results.append(result)
    usage = {"prompt_tokens": response.prompt_tokens, "total_tokens": response.prompt_tokens}
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": usage, "results": results}


def parse_score(body: Any) -> generate_pb2.ScoreRequest:
    """vLLM's score body: `text_1` (the query) against `text_2` (one text or a list), or lists of both, of
    one length, scored pair by pair."""
    body = _object(body)
    request = generate_pb2.ScoreRequest(model=_model(body), instruction=_instruction(body))
    request.documents.extend(_documents(body.get("text_2"), "text_2"))
    if isinstance(body.get("text_1"), list):
        queries = _documents(body["text_1"], "text_1")
        if len(queries) != len(request.documents):
            raise ProtocolError(
                "text_1",
                f"text_1 and text_2 as lists are pairs: {len(queries)} and {len(request.documents)} texts",
            )
        request.queries.extend(queries)
    else:
        request.query = _text(body, "text_1")
    return request


def score_body(response: generate_pb2.ScoreResponse, model: str) -> dict[str, Any]:
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(response.scores)]
    usage = {"prompt_tokens": response.prompt_tokens, "total_tokens": response.prompt_tokens}
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": usage,
    }
