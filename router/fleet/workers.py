"""The router's side of the router-worker link: one reconnecting stream per worker.

Each WorkerConnection keeps one Connect stream open and multiplexes all of this router's requests to
that worker over it. Updates for a request go to that request's asyncio.Queue; when the stream breaks,
every request in flight on it receives a WorkerLost at once, and the connection retries with backoff.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nanovllm.common.images import ResizedImage
from nanovllm.common.logging import get_logger
from nanovllm.common.pooling import PoolingParams
from nanovllm.common.sampling_params import SamplingParams
from nanovllm.common.serving import ping_ack_deadline
from nanovllm.common.tls import TlsFiles, open_channel
from nanovllm.common.v1 import worker_pb2, worker_pb2_grpc
from nanovllm.common.wire import image_to_wire, pooling_to_wire, sampling_to_wire

log = get_logger(__name__)

# Let the channel retry a dead worker quickly (gRPC's default backoff grows to two minutes), and notice
# a silently vanished peer through keepalive pings (answered within 5 s: see keepalive_options).
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    *ping_ack_deadline(5.0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),  # tokenizer files in WorkerInfo
    # A fixed 64 KiB window per stream (gRPC's probe would grow it to megabytes): a router that reads
    # slower than the engine steps then holds the worker's writes back within a few steps, and the
    # worker sends the steps that waited as one message, several tokens per request (its `coalesced`),
    # instead of a backlog of one-token messages that would keep the router at one token per response.
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 64 * 1024),
]
INITIAL_BACKOFF_S = 0.1
MAX_BACKOFF_S = 2.0
INFO_TIMEOUT_S = 10.0
# A worker message carries a step's updates for every request it runs (256 at high concurrency). Handed
# out at once, they wake as many calls, and all their response work then runs in one long event loop
# turn. gRPC's asyncio server accepts a new call only once every couple of turns, so with such turns a
# burst of new calls waits seconds for the router to take them (their TTFT). The updates go out this many
# a turn instead (docs/performance.md#measurements-behind-choices-in-the-code).
UPDATES_PER_TURN = 16


@dataclass(frozen=True)
class WorkerLost:
    """Put on a request's queue when its worker's stream broke before the request finished."""

    address: str
    reason: str


RequestEvent = worker_pb2.RequestUpdate | WorkerLost


class WorkerConnection:
    def __init__(
        self,
        address: str,
        prepare: Callable[[WorkerConnection, worker_pb2.WorkerInfo], Awaitable[bool]],
        tls: TlsFiles | None = None,
        server_name: str | None = None,
    ) -> None:
        """`prepare` is awaited with this connection and the worker's info before each (re)connect; False
        means do not use this worker (e.g. it serves another model), and the connection retries later."""
        self.address = address
        self.info: worker_pb2.WorkerInfo | None = None
        self.adapters: dict[str, int] = {}  # the LoRA adapters loaded there: name -> cache salt
        self.connected = False
        self.draining = False  # the worker said it is shutting down: send it nothing new
        self.retired = False  # its address no longer resolves: send it nothing new (see WorkerPool)
        # The worker's queue (waiting + running) as it last reported it, and what this router sent it since.
        self.reported_queue: int | None = None
        self._sent_since_report = 0
        # The block hashes the worker's prefix cache holds, exactly as it reported them.
        self.cached_blocks: set[int] = set()
        self.offloaded_blocks: set[int] = set()  # those its host-memory and disk tiers hold
        # A hybrid model's worker resumes a hit only where a block ends at a snapshot of its state: those
        # blocks' hashes (None: every cached block is a place a hit can end).
        self.resume_points: set[int] | None = None
        # The prompt blocks of this router's requests in flight there, which it is computing or has cached
        # (the reports lag): a burst sharing a prefix then finds its first request's worker at once.
        self._in_flight_blocks: Counter[int] = Counter()
        self._blocks_of: dict[str, Sequence[int]] = {}  # by request id
        # A hybrid model's worker: the blocks where those requests' shared_prefix_tokens hints make it
        # keep a state snapshot, resume points as soon as their blocks are.
        self._in_flight_resumes: Counter[int] = Counter()
        self._resume_of: dict[str, int] = {}  # by request id
        self._prepare = prepare
        self._requests: dict[str, asyncio.Queue[RequestEvent]] = {}
        self._outbound: asyncio.Queue[worker_pb2.RouterMessage | None] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        # With TLS files: mutual TLS, and a new certificate is presented from the next connection on.
        self._channel = open_channel(address, CHANNEL_OPTIONS, tls, server_name)
        self.stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    @property
    def queue_estimate(self) -> int:
        """Requests queued or running on the worker, every router's included: its last report plus what
        this router sent since, and never fewer than this router's own requests in flight there (a report
        made before the worker received what this router just sent would undercount a burst)."""
        if self.reported_queue is None:
            return self.num_in_flight
        return max(self.reported_queue + self._sent_since_report, self.num_in_flight)

    @property
    def block_size(self) -> int:
        return self.info.kvcache_block_size if self.info is not None else 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        """How many of a prompt's leading blocks (given by their hashes) the worker has cached, or has in
        a request of this router's in flight."""
        count = resumable = 0
        for block_hash in hashes:
            if block_hash not in self.cached_blocks and not self._in_flight_blocks[block_hash]:
                break
            count += 1
            if self.resume_points is not None and (
                block_hash in self.resume_points or self._in_flight_resumes[block_hash]
            ):
                resumable = count
        return count if self.resume_points is None else resumable

    def offloaded_prefix_blocks(self, hashes: Sequence[int]) -> int:
        """How many of a prompt's blocks after those `cached_prefix_blocks` counts the worker holds in its
        host-memory or disk tier (a hit there is copied up, not computed)."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self.offloaded_blocks:
                break
            count += 1
        return count

    @property
    def available(self) -> bool:
        """Whether new requests may go here."""
        return self.connected and not self.draining and not self.retired

    def start(self, on_change: Callable[[], None]) -> None:
        self._task = asyncio.create_task(self._run(on_change), name=f"worker-{self.address}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._channel.close()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        client_request_id: str = "",
        output_token_ids: list[int] | None = None,
        block_hashes: Sequence[int] = (),
        trace_context: dict[str, str] | None = None,
        lora_name: str = "",
        shared_prefix_tokens: int = 0,
        images: Sequence[ResizedImage] = (),
        pooling: PoolingParams | None = None,
    ) -> asyncio.Queue[RequestEvent]:
        """Send a request; its updates (and a WorkerLost if the worker goes away) arrive on the queue.
        `output_token_ids` resumes a stream with the tokens another worker generated for it;
        `block_hashes` are its prompt's blocks (common/block_hash.py), counted as cached there meanwhile;
        `trace_context` is the W3C carrier the worker's span continues (common/tracing.py); `lora_name`
        the adapter it runs with (empty: the base model); `shared_prefix_tokens` how many of its first
        tokens other requests likely share (Submit's), where a hybrid model's worker keeps a snapshot,
        counted as a resume point there meanwhile; `images` a vision model's, resized, in prompt order.
        `pooling`: a pooling request (common/pooling.py), whose one update brings its vector."""
        events: asyncio.Queue[RequestEvent] = asyncio.Queue()
        if not self.connected:
            events.put_nowait(WorkerLost(self.address, "the worker is not connected"))
            return events
        self._requests[request_id] = events
        self._sent_since_report += 1
        self._blocks_of[request_id] = block_hashes
        self._in_flight_blocks.update(block_hashes)
        shared_blocks = min(shared_prefix_tokens // self.block_size, len(block_hashes))
        if shared_blocks:
            self._resume_of[request_id] = block_hashes[shared_blocks - 1]
            self._in_flight_resumes[block_hashes[shared_blocks - 1]] += 1
        submit = worker_pb2.Submit(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling_to_wire(params, worker_pb2.SamplingParams),
            priority=priority,
            client_request_id=client_request_id,
            output_token_ids=output_token_ids or (),
            trace_context=trace_context or {},
            lora_name=lora_name,
            shared_prefix_tokens=shared_prefix_tokens,
            images=[image_to_wire(image, worker_pb2.Image) for image in images],
        )
        if pooling is not None:
            submit.pooling.CopyFrom(pooling_to_wire(pooling))
        self._outbound.put_nowait(worker_pb2.RouterMessage(submit=submit))
        return events

    def release(self, request_id: str, abort: bool) -> None:
        """Forget a request; with abort, also tell the worker to stop it and free its blocks."""
        for block_hash in self._blocks_of.pop(request_id, ()):
            left = self._in_flight_blocks[block_hash] - 1
            if left:
                self._in_flight_blocks[block_hash] = left
            else:
                del self._in_flight_blocks[block_hash]
        resume = self._resume_of.pop(request_id, None)
        if resume is not None:
            self._in_flight_resumes[resume] -= 1
            if not self._in_flight_resumes[resume]:
                del self._in_flight_resumes[resume]
        if self._requests.pop(request_id, None) is not None and abort and self.connected:
            abort_msg = worker_pb2.Abort(request_ids=[request_id])
            self._outbound.put_nowait(worker_pb2.RouterMessage(abort=abort_msg))

    async def _run(self, on_change: Callable[[], None]) -> None:
        backoff = INITIAL_BACKOFF_S
        while True:
            try:
                if await self._wait_until_serving():
                    info = await self.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=INFO_TIMEOUT_S)
                    if await self._prepare(self, info):
                        self.info = info
                        await self._stream(on_change)
                        backoff = INITIAL_BACKOFF_S  # it was up: retry quickly
                        reason = "the worker closed the stream"
                    else:
                        reason = "the worker was refused (see the log)"
                else:
                    reason = "the worker's health stream ended before it was SERVING"
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            except Exception as exc:  # e.g. unusable tokenizer files: log it, keep retrying
                reason = f"{type(exc).__name__}: {exc}"
                log.exception("worker_connection_failed", worker=self.address, reason=reason)
            if self.connected or self._requests:
                log.warning("worker_lost", worker=self.address, reason=reason, in_flight=len(self._requests))
            self._disconnect(reason, on_change)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, MAX_BACKOFF_S)

    async def _wait_until_serving(self) -> bool:
        """Follow the worker's health until it is SERVING (it listens before its model is loaded). With
        wait_for_ready the call also waits out a worker that is not up yet, so the router connects the
        moment the worker is ready rather than at its next backoff retry."""
        watch = self._health.Watch(health_pb2.HealthCheckRequest(service=""), wait_for_ready=True)
        async for status in watch:
            if status.status == health_pb2.HealthCheckResponse.SERVING:
                watch.cancel()
                return True
        return False

    async def _stream(self, on_change: Callable[[], None]) -> None:
        assert self.info is not None  # set by _run before it streams
        self._outbound = asyncio.Queue()
        self.cached_blocks, self.offloaded_blocks = set(), set()
        self.adapters = {a.name: a.cache_salt for a in self.info.adapters}
        subscribe = worker_pb2.Subscribe(prefix_cache=True)
        self._outbound.put_nowait(worker_pb2.RouterMessage(subscribe=subscribe))
        call = self.stub.Connect(self._outgoing(self._outbound))
        await call.wait_for_connection()
        load = await self.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=INFO_TIMEOUT_S)
        self.connected, self.draining = True, False
        self.reported_queue, self._sent_since_report = load.num_waiting + load.num_running, 0
        log.info("worker_connected", worker=self.address, model=self.info.model)
        on_change()
        async for step in call:
            if step.HasField("load"):
                self.reported_queue = step.load.num_waiting + step.load.num_running
                self._sent_since_report = 0
            if step.HasField("prefix_cache"):
                self._apply(step.prefix_cache)
            if step.HasField("adapters"):
                self.adapters = {a.name: a.cache_salt for a in step.adapters.adapters}
                on_change()
            if step.draining:
                self.draining = True
                log.info("worker_draining", worker=self.address, in_flight=len(self._requests))
                on_change()
            for i, update in enumerate(step.updates, 1):
                events = self._requests.get(update.request_id)
                if events is not None:
                    events.put_nowait(update)
                if i % UPDATES_PER_TURN == 0:
                    await asyncio.sleep(0)  # end this loop turn: the calls woken so far run in the next

    def _apply(self, events: worker_pb2.PrefixCacheEvents) -> None:
        if events.reset:
            self.cached_blocks = set(events.stored)
            self.offloaded_blocks = set(events.lower_stored)
            self.resume_points = set(events.state_stored) if events.resume_points else None
            return
        self.cached_blocks.difference_update(events.evicted)
        self.cached_blocks.update(events.stored)
        self.offloaded_blocks.difference_update(events.lower_evicted)
        self.offloaded_blocks.update(events.lower_stored)
        if self.resume_points is not None:
            self.resume_points.difference_update(events.state_evicted)
            self.resume_points.update(events.state_stored)

    @staticmethod
    async def _outgoing(
        outbound: asyncio.Queue[worker_pb2.RouterMessage | None],
    ) -> AsyncIterator[worker_pb2.RouterMessage]:
        while (msg := await outbound.get()) is not None:
            yield msg

    def _disconnect(self, reason: str, on_change: Callable[[], None]) -> None:
        was_connected, self.connected = self.connected, False
        self._outbound.put_nowait(None)  # ends the old stream's request iterator
        requests, self._requests = self._requests, {}
        self._blocks_of, self._in_flight_blocks = {}, Counter()
        self._resume_of, self._in_flight_resumes = {}, Counter()
        for events in requests.values():
            events.put_nowait(WorkerLost(self.address, reason))
        if was_connected:
            on_change()
