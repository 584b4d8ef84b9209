"""The public Generation service (nanovllm.v1.Generation): Generate, Tokenize, GetModelInfo, ListModels,
Embed and Score, for the gRPC face and the HTTP face alike."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from opentelemetry.trace import Tracer

from nanovllm.common.server_config import RouterConfig
from nanovllm.common.wire import fields_to_message
from nanovllm.router.calls.accounting import PoolingTrace
from nanovllm.router.calls.call import GenerateCall, reject
from nanovllm.router.calls.metrics import RouterMetrics
from nanovllm.router.calls.pooling import PoolingCalls, PoolingFailed
from nanovllm.router.calls.spans import call_spans
from nanovllm.router.calls.validation import NoTokenizerError, check_prompt_size, tokenize_request
from nanovllm.router.faces.auth import Access
from nanovllm.router.fleet.catalog import ModelChoice
from nanovllm.router.fleet.pool import ModelRefused, WorkerPool, resolve_model
from nanovllm.v1 import generate_pb2, generate_pb2_grpc

T = TypeVar("T")
P = TypeVar("P", generate_pb2.EmbedResponse, generate_pb2.ScoreResponse)


class GenerationService(generate_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        pool: WorkerPool,
        metrics: RouterMetrics,
        config: RouterConfig,
        access: Access,
        tracer: Tracer | None = None,
    ) -> None:
        """`tracer`: the calls' spans go there (None: tracing is off)."""
        self.pool = pool
        self.tracer = tracer
        self.metrics = metrics
        self.config = config
        self.access = access  # who calls (auth) and whether their limits allow another stream
        self.draining = False
        self._in_flight = 0
        self.idle = asyncio.Event()  # set while no Generate call is in flight
        self.idle.set()
        self._tokenizers = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
        self.pooling = PoolingCalls(pool, config, self._off_loop)

    def close(self) -> None:
        self._tokenizers.shutdown(wait=False, cancel_futures=True)

    async def _model(self, name: str, context: grpc.aio.ServicerContext) -> ModelChoice:
        """What `name` selects, or the call ended with the status that says why (router/calls/call.py)."""
        try:
            return resolve_model(self.pool, name)
        except ModelRefused as exc:
            await context.abort(exc.code, str(exc))
        raise AssertionError("context.abort returns only by raising")

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def _off_loop(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizers, fn, *args)

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await self.generate(request, context, "grpc")

    async def generate(self, request: generate_pb2.GenerateRequest, context: Any, api: str) -> None:
        """One Generate call, for either face: `context` is the gRPC call's, or the HTTP face's stand-in
        (router/faces/http_calls.py CallContext); `api` names the face (grpc, http) in metrics and logs."""
        if self.draining:
            message = "the router is shutting down; retry"
            await reject(context, self.metrics, api, grpc.StatusCode.UNAVAILABLE, message)
        lease = await self.access.admit(context)
        self._in_flight += 1
        self.idle.clear()
        try:
            call = GenerateCall(
                request,
                context,
                lease,
                self.pool,
                self.metrics,
                self.config,
                self._off_loop,
                api,
                self.tracer,
            )
            await call.run()
        finally:
            lease.close()
            self._in_flight -= 1
            if self._in_flight == 0:
                self.idle.set()

    async def Embed(
        self, request: generate_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.EmbedResponse:
        return await self.embed(request, context, "grpc")

    async def Score(
        self, request: generate_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.ScoreResponse:
        return await self.score(request, context, "grpc")

    async def embed(
        self, request: generate_pb2.EmbedRequest, context: Any, api: str
    ) -> generate_pb2.EmbedResponse:
        """One Embed call, for either face (`context` and `api` as generate's)."""
        inputs = len(request.texts) or len(request.token_ids)
        return await self._pooling(self.pooling.embed(request), context, "embed", api, inputs)

    async def score(
        self, request: generate_pb2.ScoreRequest, context: Any, api: str
    ) -> generate_pb2.ScoreResponse:
        inputs = len(request.documents)
        return await self._pooling(self.pooling.score(request), context, "score", api, inputs)

    async def _pooling(
        self, call: Coroutine[Any, Any, P], context: Any, kind: str, api: str, inputs: int
    ) -> P:
        """Run an Embed or Score call under the caller's lease (auth and limits, as a stream; its prompt
        tokens charged), ending it with the status it failed with; counted, logged and traced once admitted
        (router/calls/accounting.py PoolingTrace)."""
        try:
            if self.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is shutting down; retry")
            lease = await self.access.admit(context)
        except BaseException:
            call.close()  # never started
            raise
        self._in_flight += 1  # a drain waits for it as for a stream
        self.idle.clear()
        trace = PoolingTrace(
            self.metrics,
            kind,
            api,
            lease.name,
            call_spans(self.tracer, context, api, f"nanovllm.router.{kind}"),
        )
        outcome, prompt_tokens = "internal", 0
        try:
            result = await call
            lease.charge(result.prompt_tokens)
            outcome, prompt_tokens = "ok", result.prompt_tokens
            return result
        except PoolingFailed as exc:
            outcome = exc.code.name.lower()
            await context.abort(exc.code, str(exc))
        except asyncio.CancelledError:
            outcome = "client_cancelled"
            raise
        finally:
            trace.finish(outcome, inputs, prompt_tokens)
            lease.close()
            self._in_flight -= 1
            if self._in_flight == 0:
                self.idle.set()
        raise AssertionError("context.abort returns only by raising")

    async def Tokenize(
        self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.TokenizeResponse:
        model = await self._model(request.model, context)
        tokenizer, info = model.base.tokenizer, model.base.info
        try:
            check_prompt_size(request, self.config.limits, info.max_model_len)
            ids = await self._off_loop(tokenize_request, request, tokenizer, info, self.config.limits)
        except NoTokenizerError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return generate_pb2.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(
        self, request: generate_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.ModelInfo:
        model = await self._model(request.model, context)
        workers = sum(model.served_by(w) for w in self.pool.available)
        return fields_to_message(
            model.base.info, generate_pb2.ModelInfo, num_workers=workers, model=model.name
        )

    async def ListModels(
        self, request: generate_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.ModelList:
        return generate_pb2.ModelList(
            models=[
                generate_pb2.ServedModel(name=s.name, parent=s.parent, num_workers=s.num_workers)
                for s in self.pool.catalog.served()
            ]
        )
