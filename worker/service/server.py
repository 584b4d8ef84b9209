"""The worker's gRPC service (nanovllm.worker.v1.Worker): routers stream token ids in, step outputs out."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from nanovllm.common.errors import AdapterError, DuplicateAdapterError, UnknownAdapterError
from nanovllm.common.logging import get_logger
from nanovllm.common.server_config import WorkerServerConfig
from nanovllm.common.serving import GrpcServer
from nanovllm.common.tls import server_credentials
from nanovllm.common.tracing import start_tracing
from nanovllm.common.v1 import worker_pb2, worker_pb2_grpc
from nanovllm.worker.config import EngineConfig
from nanovllm.worker.device import Placement
from nanovllm.worker.service.engine_loop import EngineLoop
from nanovllm.worker.service.metrics import WorkerMetrics

log = get_logger(__name__)

# Files a router needs to tokenize and render chats exactly as the model does.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


MAX_ROUTER_MESSAGE_BYTES = 64 * 1024 * 1024
# Updates in one coalesced StepOutputs at most: a few MB even with top logprobs, far below what a router
# takes in one message (router/fleet/workers.py, 64 MiB), however long it stalled.
MAX_COALESCED_UPDATES = 16_384


# A GGUF file name's quantization tag: SmolLM2-135M-Instruct.Q4_1, Qwen3-8B-Q4_K_M, model-f16, model.BF16.
_GGUF_TAG = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def default_served_name(model: str, gguf_file: str | None) -> str:
    """The model's own name: a GGUF file's without its quantization tag, a Hugging Face cache snapshot's
    repository (models--Qwen--Qwen3-0.6B/snapshots/<commit>: Qwen/Qwen3-0.6B), else the directory's."""
    if gguf_file is not None:
        return _GGUF_TAG.sub("", Path(gguf_file).stem)
    path = Path(model).resolve()
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name


def _converted_tokenizer(model_dir: Path) -> dict[str, bytes]:
    """A tokenizer.json made by transformers from the model's other tokenizer files (a SentencePiece
    tokenizer.model, vocab.json and merges.txt): the router reads that one format, on the tokenizers
    library alone. Nothing where transformers cannot convert them; the router then takes token ids only."""
    from transformers import AutoTokenizer

    try:
        backend = AutoTokenizer.from_pretrained(model_dir).backend_tokenizer
    except (OSError, ValueError, AttributeError, ImportError) as exc:
        log.warning("tokenizer_not_converted", model=str(model_dir), error=str(exc))
        return {}
    return {"tokenizer.json": backend.to_str().encode()}


def worker_info(
    config: EngineConfig,
    num_kv_blocks: int,
    placement: Placement,
    served_name: str,
    shared_prefix_hints: bool,
) -> worker_pb2.WorkerInfo:
    """`shared_prefix_hints`: whether the engine keeps state snapshots where prompts branch (a hybrid
    model's with snapshot rows), so it takes Submit.shared_prefix_tokens."""
    model_dir = Path(config.model)
    files = {
        name: (model_dir / name).read_bytes() for name in TOKENIZER_FILES if (model_dir / name).is_file()
    }
    if files and "tokenizer.json" not in files:
        files.update(_converted_tokenizer(model_dir))
    chat_template = model_dir / "chat_template.jinja"
    shape = config.model_config
    return worker_pb2.WorkerInfo(
        model=served_name,
        architectures=[shape.architecture],
        max_model_len=config.max_model_len,
        vocab_size=shape.vocab_size,
        eos_token_ids=list(shape.eos_token_ids),
        kvcache_block_size=config.kvcache_block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=config.max_num_seqs,
        tokenizer_files=files,
        chat_template=chat_template.read_text() if chat_template.is_file() else "",
        dtype=placement.dtype_name,
        device=str(placement.device),
        shared_prefix_hints=shared_prefix_hints,
        **_image_fields(config),
        hidden_size=shape.hidden_size,
        has_head=shape.has_head,
    )


def _image_fields(config: EngineConfig) -> dict[str, Any]:
    """A vision model's image processor configuration and placeholder token, for the router; nothing for
    a model without a tower, or one whose image processor configuration is missing (it takes no images)."""
    vision = config.model_config.vision
    path = Path(config.model) / "preprocessor_config.json"
    if vision is None or not path.is_file():
        return {}
    return {"image_processor_config": path.read_text(), "image_token_id": vision.image_token_id}


async def coalesced(
    outbox: asyncio.Queue[worker_pb2.StepOutputs | None],
) -> AsyncIterator[worker_pb2.StepOutputs]:
    """The connection's messages until None, where step outputs that wait back to back leave as one.

    They wait when the router reads slower than the engine steps (a router handles each message's
    updates one loop turn at a time). One message then carries several steps' tokens per request, which
    the router streams as one response each: it catches up instead of paying per message and per
    response for every step. Other messages (load, cache events, adapters, draining) keep their place.
    An updates-only message belongs to one connection (EngineLoop builds one per connection), so it is
    extended in place."""
    held: list[worker_pb2.StepOutputs | None] = []
    while True:
        msg = held.pop() if held else await outbox.get()
        if msg is None:
            return
        if _updates_only(msg):
            while not outbox.empty():
                following = outbox.get_nowait()
                if (
                    following is None
                    or not _updates_only(following)
                    or len(msg.updates) + len(following.updates) > MAX_COALESCED_UPDATES
                ):
                    held.append(following)
                    break
                msg.updates.extend(following.updates)
        yield msg


def _updates_only(msg: worker_pb2.StepOutputs) -> bool:
    return len(msg.ListFields()) == 1 and len(msg.updates) > 0


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """Serves once `attach` gives it a running engine loop; until then every RPC is UNAVAILABLE."""

    def __init__(self) -> None:
        self._loop: EngineLoop | None = None
        self._info: worker_pb2.WorkerInfo | None = None
        self._outboxes: set[asyncio.Queue] = set()  # one per open Connect stream
        self._closing = False

    def attach(self, engine_loop: EngineLoop, info: worker_pb2.WorkerInfo) -> None:
        self._loop, self._info = engine_loop, info

    def close_connections(self) -> None:
        """End every Connect stream with OK, as the worker stops: a stream still open when the server stops
        is cancelled, which grpc logs as an error."""
        self._closing = True
        for outbox in self._outboxes:
            outbox.put_nowait(None)

    async def _ready(self, context: grpc.aio.ServicerContext) -> EngineLoop:
        if self._loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        assert self._loop is not None  # context.abort raised otherwise
        return self._loop

    async def Connect(
        self, request_iterator: AsyncIterator[worker_pb2.RouterMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StepOutputs]:
        engine_loop = await self._ready(context)
        outbox: asyncio.Queue[worker_pb2.StepOutputs | None] = asyncio.Queue()
        event_loop = asyncio.get_running_loop()
        conn = engine_loop.open_connection(
            lambda msg: event_loop.call_soon_threadsafe(outbox.put_nowait, msg)
        )
        peer = context.peer()
        log.info("router_connected", peer=peer, connection=conn.id)
        reader = asyncio.create_task(self._read(request_iterator, engine_loop, conn, outbox))
        self._outboxes.add(outbox)
        try:
            async for msg in coalesced(outbox):
                yield msg
            if not self._closing:
                # The router's side ended: re-raise what ended it, e.g. the abort of an unparsable message.
                await reader
        finally:
            self._outboxes.discard(outbox)
            reader.cancel()
            engine_loop.close_connection(conn)
            log.info("router_disconnected", peer=peer, connection=conn.id)

    @staticmethod
    async def _read(
        request_iterator: AsyncIterator[worker_pb2.RouterMessage],
        engine_loop: EngineLoop,
        conn,
        outbox: asyncio.Queue,
    ) -> None:
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "submit":
                    engine_loop.submit(conn, msg.submit)
                elif kind == "abort":
                    engine_loop.abort(conn, list(msg.abort.request_ids))
                elif kind == "subscribe":
                    engine_loop.subscribe(conn, msg.subscribe)
        finally:
            outbox.put_nowait(None)  # the router closed its side: end ours

    async def GetInfo(
        self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        engine_loop = await self._ready(context)
        info = worker_pb2.WorkerInfo()
        info.CopyFrom(self._info)
        info.adapters.extend(engine_loop.adapters)
        return info

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerLoad:
        return (await self._ready(context)).load_message()

    async def LoadLoRAAdapter(
        self, request: worker_pb2.LoadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoRAAdapter:
        engine_loop = await self._ready(context)
        try:
            return await asyncio.wrap_future(engine_loop.load_adapter(request.name, request.path))
        except DuplicateAdapterError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except AdapterError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise AssertionError("context.abort returns only by raising")

    async def UnloadLoRAAdapter(
        self, request: worker_pb2.UnloadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.UnloadLoRAAdapterResponse:
        engine_loop = await self._ready(context)
        try:
            await asyncio.wrap_future(engine_loop.unload_adapter(request.name))
        except UnknownAdapterError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return worker_pb2.UnloadLoRAAdapterResponse()


async def serve_worker(
    engine_config: EngineConfig,
    config: WorkerServerConfig,
    stop: asyncio.Event,
    on_listening: Callable[[str, str], None],
) -> int:
    """Listen at once (health NOT_SERVING), load the model, serve until `stop` is set, then drain and
    shut down.
    Returns the process exit code: 1 when the engine died (e.g. a tensor-parallel rank exited)."""
    service = WorkerService()
    # A router forwards what it accepted (at most its own 4 MiB limit, then tokenized): the worker takes
    # anything a router can legally send, so one large request never breaks a router's whole stream.
    # With TLS files a router must present a certificate signed by the CA (mutual TLS); others are refused
    # in the handshake, before any RPC.
    server = GrpcServer(
        [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name],
        max_receive_bytes=MAX_ROUTER_MESSAGE_BYTES,
        credentials=server_credentials(config.tls, require_client_cert=True),
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server.server)
    metrics = WorkerMetrics()
    address, _ = await server.listen(
        config.host, config.port, config.health_port, metrics.registry, config.metrics_port, on_listening
    )
    tracing = start_tracing(config.tracing, "nanovllm-worker")
    tracer = tracing.tracer if tracing is not None else None
    engine_loop = EngineLoop(engine_config, config.max_queued_requests, metrics, tracer)
    try:
        await asyncio.wrap_future(engine_loop.start())  # the model loads on the engine thread
    except BaseException:  # e.g. a KV cache too small: the caller says why; the server must not outlive it
        await server.stop(0)
        raise
    num_blocks = engine_loop.engine.block_manager.num_blocks
    if engine_loop.load.kv_tiers:
        metrics.watch_kv_tiers()
    placement = engine_loop.engine.runner.placement
    served_name = config.served_model_name or default_served_name(
        engine_config.model, engine_config.gguf_file
    )
    states = engine_loop.engine.block_manager.states
    info = worker_info(
        engine_config, num_blocks, placement, served_name, states is not None and states.caching
    )
    service.attach(engine_loop, info)
    await server.set_serving(True)
    log.info(
        "worker_serving",
        address=address,
        model=engine_config.model,
        served_model_name=served_name,
        kv_blocks=num_blocks,
        dtype=placement.dtype_name,
        device=str(placement.device),
    )
    dead = asyncio.wrap_future(engine_loop.dead)
    waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait()), dead]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if dead.done() and dead.exception() is not None:
        log.error("worker_failed", address=address, error=str(dead.exception()))
        service.close_connections()  # in-flight requests already got their error
        await server.stop(config.shutdown_grace_s)
        return 1
    # Drain: new submits refused, requests in flight finish within the drain timeout; what is left then
    # is aborted.
    idle = asyncio.wrap_future(engine_loop.drain())
    await server.drain("worker", address, idle, config.drain_timeout_s)
    await asyncio.to_thread(engine_loop.stop)
    service.close_connections()
    await server.stop(config.shutdown_grace_s)
    if tracing is not None:
        await asyncio.to_thread(tracing.shutdown)  # sends the spans not yet sent
    return 0
