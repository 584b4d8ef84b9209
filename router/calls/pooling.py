"""One Embed or Score call, for the gRPC face and the HTTP face alike: its inputs checked and tokenized, one
pooling request per input sent to the workers serving the model (routed as Generate's, by load and prefix
cache), their vectors turned into embeddings or rerank scores (common/pooling.py).

An input that a worker could not take (draining, its queue full, the worker lost) is tried on another, up
to --max-attempts workers, as a Generate call before its first token is; any other failure fails the call
with its status. A call that ends early (the client gone) aborts its requests still on the workers.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from nanovllm.common.pooling import (
    EMBED_QUERY_FORMAT,
    RERANK_FORMAT,
    RERANK_TOKENS,
    PoolingParams,
    normalized,
    relevance,
)
from nanovllm.common.sampling_params import SamplingParams
from nanovllm.common.server_config import RouterConfig
from nanovllm.common.v1 import worker_pb2
from nanovllm.common.wire import floats_from_bytes
from nanovllm.router.fleet.catalog import ModelChoice
from nanovllm.router.fleet.pool import ModelRefused, WorkerPool, resolve_model
from nanovllm.router.fleet.workers import WorkerLost
from nanovllm.v1 import generate_pb2

OffLoop = Callable[..., Awaitable]  # runs a blocking function (tokenization) off the event loop

_RETRYABLE = {worker_pb2.ERROR_CODE_UNAVAILABLE, worker_pb2.ERROR_CODE_RESOURCE_EXHAUSTED}
_STATUS = {
    worker_pb2.ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    worker_pb2.ERROR_CODE_RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    worker_pb2.ERROR_CODE_INTERNAL: grpc.StatusCode.INTERNAL,
    worker_pb2.ERROR_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    worker_pb2.ERROR_CODE_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
}


class PoolingFailed(Exception):
    """The call ends with this status (INVALID_ARGUMENT for a bad input, naming the field)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> PoolingFailed:
    return PoolingFailed(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass
class Pooled:
    values: list[float]
    num_prompt_tokens: int


class PoolingCalls:
    """Embed and Score over the router's worker pool."""

    def __init__(self, pool: WorkerPool, config: RouterConfig, off_loop: OffLoop) -> None:
        self.pool, self.config, self.off_loop = pool, config, off_loop

    async def embed(self, request: generate_pb2.EmbedRequest) -> generate_pb2.EmbedResponse:
        model = self._model(request.model)
        if request.texts and request.token_ids:
            raise _invalid("give texts or token_ids, not both")
        count = len(request.texts) or len(request.token_ids)
        self._check_count(count, "input")
        hidden = model.base.info.hidden_size
        if request.dimensions > hidden:
            raise _invalid(f"dimensions is {request.dimensions}, larger than the model's {hidden}")
        if request.texts:
            texts = list(request.texts)
            if request.input_type == "query":
                texts = [
                    (self.config.embed_query_format or EMBED_QUERY_FORMAT).format(
                        instruction=self.config.embed_instruction, query=t
                    )
                    for t in texts
                ]
            elif request.input_type not in ("", "document"):
                raise _invalid(f'input_type is "query", "document" or unset, got {request.input_type!r}')
            prompts = await self._encode(model, texts, "input")
        else:
            prompts = [list(ids.ids) for ids in request.token_ids]
        results = await self._run(model, prompts, PoolingParams("embed"), "input")
        response = generate_pb2.EmbedResponse(prompt_tokens=sum(r.num_prompt_tokens for r in results))
        for r in results:
            response.embeddings.add(values=normalized(r.values, request.dimensions or None))
        return response

    async def score(self, request: generate_pb2.ScoreRequest) -> generate_pb2.ScoreResponse:
        model = self._model(request.model)
        if not model.base.info.has_head:
            raise _invalid(f"{model.name} has no output head (an embedding model): it cannot score")
        tokenizer = model.base.tokenizer
        if tokenizer is None:
            raise PoolingFailed(
                grpc.StatusCode.FAILED_PRECONDITION, f"{model.name} has no tokenizer: scores need its texts"
            )
        self._check_count(len(request.documents), "document")
        if request.queries and (request.query or len(request.queries) != len(request.documents)):
            raise _invalid(
                f"queries pairs each document with its own query: {len(request.queries)} queries for "
                f"{len(request.documents)} documents" + (", and query given too" if request.query else "")
            )
        queries = list(request.queries) or [request.query] * len(request.documents)
        try:
            yes, no = (tokenizer.single_token(word) for word in RERANK_TOKENS)
        except ValueError as exc:
            raise PoolingFailed(grpc.StatusCode.FAILED_PRECONDITION, f"{model.name}: {exc}") from None
        instruction = request.instruction or self.config.rerank_instruction
        prompts = [
            (self.config.rerank_format or RERANK_FORMAT).format(instruction=instruction, query=q, document=d)
            for q, d in zip(queries, request.documents, strict=True)
        ]
        token_ids = await self._encode(model, prompts, "document")
        results = await self._run(model, token_ids, PoolingParams("score", (yes, no)), "document")
        return generate_pb2.ScoreResponse(
            scores=[relevance(r.values) for r in results],
            prompt_tokens=sum(r.num_prompt_tokens for r in results),
        )

    def _model(self, name: str) -> ModelChoice:
        try:
            return resolve_model(self.pool, name)
        except ModelRefused as exc:
            raise PoolingFailed(exc.code, str(exc)) from None

    def _check_count(self, count: int, what: str) -> None:
        limit = self.config.limits.max_pooling_inputs
        if count == 0:
            raise _invalid(f"no {what}s: give at least one")
        if count > limit:
            raise _invalid(f"{count} {what}s, more than --max-pooling-inputs {limit}")

    async def _encode(self, model: ModelChoice, texts: list[str], what: str) -> list[list[int]]:
        tokenizer = model.base.tokenizer
        if tokenizer is None:
            raise PoolingFailed(
                grpc.StatusCode.FAILED_PRECONDITION, f"{model.name} has no tokenizer: send token ids"
            )
        limit = self.config.limits.prompt_bytes(model.base.info.max_model_len)
        for i, text in enumerate(texts):
            if len(text.encode()) > limit:
                raise _invalid(f"{what} {i} has {len(text.encode())} UTF-8 bytes, more than {limit}")
        return await self.off_loop(lambda: [tokenizer.encode(t) for t in texts])

    async def _run(
        self, model: ModelChoice, prompts: list[list[int]], params: PoolingParams, what: str
    ) -> list[Pooled]:
        info = model.base.info
        for i, ids in enumerate(prompts):
            if not ids:
                raise _invalid(f"{what} {i} is empty")
            if len(ids) > info.max_model_len:
                raise _invalid(
                    f"{what} {i} has {len(ids)} tokens, more than max_model_len {info.max_model_len}"
                )
            bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
            if bad is not None:
                raise _invalid(
                    f"{what} {i} holds token id {bad}, outside the vocabulary [0, {info.vocab_size})"
                )
        tasks = [asyncio.ensure_future(self._one(model, ids, params)) for ids in prompts]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:  # one failed, or the call was cancelled: the others' requests are aborted
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _one(self, model: ModelChoice, token_ids: list[int], params: PoolingParams) -> Pooled:
        """One input's vector, from the first worker that serves it."""
        tried: frozenset[str] = frozenset()
        failure = "no worker serving the model is reachable"
        while len(tried) < self.config.max_attempts:
            decision = self.pool.pick(model, token_ids, tried)
            if decision is None:
                break
            worker, wire_id = decision.worker, uuid.uuid4().hex
            tried |= {worker.address}
            events = worker.submit(
                wire_id, token_ids, SamplingParams(), 0, block_hashes=decision.block_hashes,
                lora_name=model.lora_name, pooling=params,
            )  # fmt: skip
            ended = False
            try:
                event = await events.get()
                ended = True
            finally:
                worker.release(wire_id, abort=not ended)
            if isinstance(event, WorkerLost):
                failure = f"worker {event.address} went away ({event.reason})"
                continue
            if event.error_code in _RETRYABLE:
                failure = event.error_message
                continue
            if event.error_code != worker_pb2.ERROR_CODE_UNSPECIFIED:
                raise PoolingFailed(_STATUS[event.error_code], event.error_message)
            return Pooled(floats_from_bytes(event.pooled), event.num_prompt_tokens)
        raise PoolingFailed(grpc.StatusCode.UNAVAILABLE, f"{model.name!r}: {failure}")
