"""Runs the engine on its own thread, so the gRPC event loop never waits on a model step.

The event loop hands commands (submit, abort, close a connection) to the engine thread through a queue;
the engine thread executes them between steps and hands each connection one StepOutputs per step through
that connection's `deliver` callback. Only the engine thread touches the engine.

The engine is also *built* on that thread, and no other thread runs torch ops. Every thread that runs a
parallel torch op gets its own OpenMP team, and once a process holds more OpenMP threads than cores,
libgomp stops spinning between parallel regions: each of the hundreds of small ops in a decode step then
pays a futex wake-up. Measured on this 2-core CPU (batch-16 decode): engine loaded on the main thread and
run on another, 4.84 s; everything on one thread, 4.09 s, the same as offline (4.00 s).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from opentelemetry.trace import Tracer

from nanovllm.common.errors import EngineDeadError, RequestError, UnknownAdapterError
from nanovllm.common.images import ImagePatches, ImageProcessorConfig, patches_from_rgb
from nanovllm.common.logging import get_logger
from nanovllm.common.v1 import worker_pb2
from nanovllm.common.wire import (
    fields_to_message,
    floats_to_bytes,
    image_from_wire,
    pooling_from_wire,
    sampling_from_wire,
)
from nanovllm.worker.config import EngineConfig
from nanovllm.worker.core.engine import LLMEngine
from nanovllm.worker.sequence import TokenLogprobs
from nanovllm.worker.service.metrics import WorkerMetrics
from nanovllm.worker.service.request_span import record_request_span
from nanovllm.worker.step import EngineLoad, RequestOutput

log = get_logger(__name__)

LOAD_PUSH_INTERVAL_S = 0.05


@dataclass(eq=False)
class Connection:
    """One router's stream. `deliver` is called on the engine thread and must be thread-safe."""

    id: int
    deliver: Callable[[worker_pb2.StepOutputs], object]
    requests: dict[str, InFlight] = field(default_factory=dict)  # by wire id
    closed: bool = False
    prefix_cache_subscribed: bool = False  # it asked for PrefixCacheEvents


@dataclass(eq=False)
class InFlight:
    """A request in the engine, and whom it belongs to."""

    connection: Connection
    wire_id: str  # the router's id for it on this connection
    client_id: str  # the id its client chose (or its router assigned), for the logs
    trace_context: dict[str, str] = field(default_factory=dict)  # the router's span (W3C carrier)
    resumed_tokens: int = 0  # tokens it brought from a worker that failed mid-stream

    @property
    def engine_id(self) -> str:
        """Unique within the engine: two routers may choose the same wire id."""
        return f"{self.connection.id}/{self.wire_id}"


class EngineLoop:
    def __init__(
        self,
        config: EngineConfig,
        max_queued_requests: int,
        metrics: WorkerMetrics,
        tracer: Tracer | None = None,
    ) -> None:
        """`tracer`: where the spans of requests that came with a trace context go (None: tracing off)."""
        self.config = config
        self.tracer = tracer
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self._draining = False
        self._drained: Future[None] = Future()  # resolves once draining and nothing is in flight
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._in_flight: dict[str, InFlight] = {}  # by engine id
        self._connection_ids = itertools.count()
        self._connections: set[Connection] = set()
        self._pushed_queue: tuple[int, int, int] | None = None  # (waiting, running, KV blocks) last pushed
        self._pushed_at = 0.0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._ready: Future[None] = Future()
        # Resolves when the engine thread ends: with None after stop(), with EngineDeadError if the engine
        # failed for good (e.g. a tensor-parallel rank died); the process should then exit non-zero.
        self.dead: Future[None] = Future()
        # Set by the engine thread before `ready` resolves, and only read after: typed as what they are then.
        self.engine: LLMEngine = None  # type: ignore[assignment]
        self.load: EngineLoad = None  # type: ignore[assignment]
        # The LoRA adapters loaded, as the link describes them; replaced (never changed) on the engine
        # thread, so other threads may read it.
        self.adapters: list[worker_pb2.LoRAAdapter] = []
        self._image_processor: ImageProcessorConfig | None = None  # a vision model's, read at its first image

    # --- called from any thread -------------------------------------------------------------------

    def start(self) -> Future[None]:
        """Start the engine thread; the future resolves once the engine is built (or raises why not)."""
        self._thread.start()
        return self._ready

    def stop(self) -> None:
        """Abort everything in flight and join the engine thread."""
        self._commands.put(None)
        self._thread.join()

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    def open_connection(self, deliver: Callable[[worker_pb2.StepOutputs], object]) -> Connection:
        conn = Connection(next(self._connection_ids), deliver)
        self._commands.put(lambda: self._open(conn))
        return conn

    def close_connection(self, conn: Connection) -> None:
        """The router went away: abort its requests (their blocks come back on the next step)."""
        self._commands.put(lambda: self._close(conn))

    def submit(self, conn: Connection, submit: worker_pb2.Submit) -> None:
        self._commands.put(lambda: self._submit(conn, submit))

    def abort(self, conn: Connection, wire_ids: list[str]) -> None:
        self._commands.put(lambda: self._abort(conn, wire_ids))

    def subscribe(self, conn: Connection, subscribe: worker_pb2.Subscribe) -> None:
        self._commands.put(lambda: self._subscribe(conn, subscribe))

    def load_adapter(self, name: str, path: str) -> Future[worker_pb2.LoRAAdapter]:
        """Load a LoRA adapter between steps; the future raises AdapterError when it cannot be loaded."""
        done: Future[worker_pb2.LoRAAdapter] = Future()
        self._commands.put(lambda: self._change_adapters(done, lambda: self.engine.add_lora(name, path)))
        return done

    def unload_adapter(self, name: str) -> Future[None]:
        """Unload a LoRA adapter between steps; the future raises UnknownAdapterError for an unknown name."""
        done: Future[None] = Future()
        self._commands.put(lambda: self._change_adapters(done, lambda: self.engine.remove_lora(name)))
        return done

    def drain(self) -> Future[None]:
        """Refuse new requests (ERROR_CODE_UNAVAILABLE) and let the ones in flight finish; the future
        resolves when none is left."""
        self._commands.put(self._start_draining)
        return self._drained

    # --- engine thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = LLMEngine(self.config)
            self._refresh_load()
            self.adapters = self._adapter_messages()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting event loop, which re-raises
            self._ready.set_exception(exc)
            return
        self._ready.set_result(None)
        try:
            while True:
                # Block for a command only when there is nothing to step.
                for command in self._take_commands(block=not self.engine.has_unfinished_requests()):
                    if command is None:
                        self._shutdown()
                        self.dead.set_result(None)
                        return
                    command()
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._refresh_load()
                self._push_load()
                if self._draining and not self._in_flight and not self._drained.done():
                    self._drained.set_result(None)
        except EngineDeadError as exc:
            log.error("engine_dead", error=str(exc))
            self._fail_all(str(exc))
            self.engine.shutdown()
            self.dead.set_exception(exc)

    def _refresh_load(self) -> None:
        """Take the engine's load: the metrics observe it before GetLoad can return it, so a client that
        read a load never scrapes older metrics."""
        load = self.engine.load()
        self.metrics.observe_load(load)
        self.load = load

    def _take_commands(self, block: bool) -> list[Callable[[], None] | None]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _open(self, conn: Connection) -> None:
        self._connections.add(conn)
        if self._draining:
            conn.deliver(worker_pb2.StepOutputs(draining=True))

    def load_message(self) -> worker_pb2.WorkerLoad:
        return fields_to_message(self.load, worker_pb2.WorkerLoad, num_connections=len(self._connections))

    def _push_load(self) -> None:
        """Send every router the load and the prefix cache's changes once they changed; while the engine is
        busy, at most every LOAD_PUSH_INTERVAL_S (the next iteration comes soon and will send what changed
        by then: cache changes wait in the block manager until taken)."""
        queue = (self.load.num_waiting, self.load.num_running, self.load.kv_blocks_used)
        cache_changed = self.engine.block_manager.has_cache_events
        now = time.monotonic()
        busy = self.engine.has_unfinished_requests()
        if (queue == self._pushed_queue and not cache_changed) or (
            busy and now - self._pushed_at < LOAD_PUSH_INTERVAL_S
        ):
            return
        self._pushed_queue, self._pushed_at = queue, now
        load = worker_pb2.StepOutputs(load=self.load_message())
        with_cache = load
        if cache_changed:
            events = self.engine.block_manager.take_cache_events()
            cache = worker_pb2.PrefixCacheEvents(
                stored=sorted(events.stored),
                evicted=sorted(events.evicted),
                lower_stored=sorted(events.lower_stored),
                lower_evicted=sorted(events.lower_evicted),
                state_stored=sorted(events.state.stored),
                state_evicted=sorted(events.state.evicted),
            )
            with_cache = worker_pb2.StepOutputs(load=load.load, prefix_cache=cache)
        for conn in self._connections:
            conn.deliver(with_cache if conn.prefix_cache_subscribed else load)

    def _adapter_messages(self) -> list[worker_pb2.LoRAAdapter]:
        return [
            worker_pb2.LoRAAdapter(name=a.name, rank=a.rank, cache_salt=a.cache_salt)
            for a in self.engine.adapters.values()
        ]

    def _change_adapters(self, done: Future, change: Callable[[], object]) -> None:
        """Load or unload an adapter, then tell every router what is loaded now."""
        try:
            result = change()
        except Exception as exc:  # noqa: BLE001 - handed to the RPC waiting on `done`, which reports it
            done.set_exception(exc)
            return
        self.adapters = self._adapter_messages()
        message = worker_pb2.StepOutputs(adapters=worker_pb2.LoRAAdapters(adapters=self.adapters))
        for conn in self._connections:
            conn.deliver(message)
        loaded = next((m for m in self.adapters if m.name == getattr(result, "name", None)), None)
        done.set_result(loaded)

    def _subscribe(self, conn: Connection, subscribe: worker_pb2.Subscribe) -> None:
        """Start reporting the prefix cache to `conn` with the whole set of cached hashes; the changes
        that follow (some already in that set) apply on top of it."""
        if conn.closed or not subscribe.prefix_cache or conn.prefix_cache_subscribed:
            return
        conn.prefix_cache_subscribed = True
        bm = self.engine.block_manager
        cache = worker_pb2.PrefixCacheEvents(
            reset=True,
            stored=sorted(bm.cached),
            lower_stored=bm.lower_cached(),
            resume_points=bm.states is not None,
            state_stored=bm.state_cached(),
        )
        conn.deliver(worker_pb2.StepOutputs(prefix_cache=cache))

    def _start_draining(self) -> None:
        """Tell every router at once, so none sends a request only to have it refused."""
        self._draining = True
        log.info("worker_draining", in_flight=len(self._in_flight))
        for conn in self._connections:
            conn.deliver(worker_pb2.StepOutputs(draining=True))

    def _submit(self, conn: Connection, submit: worker_pb2.Submit) -> None:
        if conn.closed:
            return
        if self._draining:
            message = "the worker is draining (shutting down) and takes no new requests"
            self._fail(conn, submit.request_id, worker_pb2.ERROR_CODE_UNAVAILABLE, message)
            return
        waiting = len(self.engine.scheduler.waiting)
        if waiting >= self.max_queued_requests:
            self._fail(
                conn,
                submit.request_id,
                worker_pb2.ERROR_CODE_RESOURCE_EXHAUSTED,
                f"the worker's queue is full: {waiting} requests waiting, max_queued_requests is "
                f"{self.max_queued_requests}",
            )
            return
        request = InFlight(
            conn,
            submit.request_id,
            submit.client_request_id,
            dict(submit.trace_context),
            len(submit.output_token_ids),
        )
        try:
            params = sampling_from_wire(submit.sampling)
            self.engine.add_request(
                request.engine_id,
                list(submit.prompt_token_ids),
                params,
                submit.priority,
                output_token_ids=list(submit.output_token_ids),
                lora_name=submit.lora_name or None,
                shared_prefix_tokens=submit.shared_prefix_tokens,
                images=self._images(submit) if submit.images else None,
                pooling=pooling_from_wire(submit.pooling) if submit.HasField("pooling") else None,
            )
        except UnknownAdapterError as exc:
            self._fail(conn, submit.request_id, worker_pb2.ERROR_CODE_NOT_FOUND, str(exc))
            return
        except ValueError as exc:  # SamplingParams and RequestError both name the field and numbers
            self._fail(conn, submit.request_id, worker_pb2.ERROR_CODE_INVALID_ARGUMENT, str(exc))
            return
        self._in_flight[request.engine_id] = conn.requests[request.wire_id] = request

    def _images(self, submit: worker_pb2.Submit) -> list[ImagePatches]:
        """A submit's images cut into patches, as the offline LLM cuts them (its image processor's
        configuration read at the first image)."""
        if self._image_processor is None:
            if self.engine.model_config.vision is None:
                raise RequestError(f"{self.config.model} has no vision tower: it takes no images")
            self._image_processor = ImageProcessorConfig.from_model_dir(self.config.model)
        cfg = self._image_processor
        return [patches_from_rgb(image_from_wire(image, k), cfg) for k, image in enumerate(submit.images)]

    def _abort(self, conn: Connection, wire_ids: list[str]) -> None:
        for wire_id in wire_ids:
            request = conn.requests.get(wire_id)
            if request is not None:
                self.engine.abort_request(request.engine_id)  # its "abort" output comes from the next step

    def _forget(self, request: InFlight) -> None:
        del self._in_flight[request.engine_id]
        del request.connection.requests[request.wire_id]

    def _close(self, conn: Connection) -> None:
        conn.closed = True
        self._connections.discard(conn)
        if conn.requests:
            log.info("connection_closed", connection=conn.id, aborted=len(conn.requests))
        for request in list(conn.requests.values()):
            self.engine.abort_request(request.engine_id)
            self._forget(request)

    def _shutdown(self) -> None:
        """Abort what is in flight and tell its routers (finish reason "abort"), freeing every block."""
        for engine_id in list(self._in_flight):
            self.engine.abort_request(engine_id)
        while self.engine.has_unfinished_requests():
            self._step()
        for conn in list(self._connections):
            self._close(conn)
        self.engine.shutdown()

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            step = self.engine.step()
        except EngineDeadError:
            raise
        except Exception as exc:  # the engine's state is suspect: fail everything in flight, keep serving
            log.exception("engine_step_failed")
            self._fail_all(f"the engine step failed: {type(exc).__name__}: {exc}")
            self._refresh_load()
            return
        # Before the outputs go out: a client that has a request's token finds the request in GetLoad.
        self._refresh_load()
        outputs, stats = step.outputs, step.stats
        self.metrics.observe_step(
            stats, time.perf_counter() - start, sum(len(out.new_token_ids) for out in outputs)
        )
        log.debug(
            "engine_step",
            prefill_tokens=stats.num_prefill_tokens,
            decode_tokens=stats.num_decode_tokens,
            spec_proposed=stats.num_spec_proposed,
            spec_accepted=stats.num_spec_accepted,
            forward_ms=round(stats.forward_s * 1e3, 2),
            draft_ms=round(stats.draft_s * 1e3, 2),
            overhead_ms=round(stats.overhead_s * 1e3, 2),
        )
        by_conn: dict[Connection, list[worker_pb2.RequestUpdate]] = defaultdict(list)
        for out in outputs:
            request = self._in_flight.get(out.request_id)  # the engine's request id is our engine id
            if request is None:  # its connection closed; nobody is listening
                continue
            if out.finished:
                self._record_span(request, out)
            if out.error is not None:  # refused after it was queued (its constraint did not compile)
                self._forget(request)
                self._fail(
                    request.connection, request.wire_id, worker_pb2.ERROR_CODE_INVALID_ARGUMENT, out.error
                )
                continue
            by_conn[request.connection].append(_update(request.wire_id, out))
            if out.finished:
                self._forget(request)
                log.info(
                    "request_finished",
                    request_id=request.client_id,
                    finish_reason=out.finish_reason,
                    prompt_tokens=out.num_prompt_tokens,
                    cached_tokens=out.num_cached_tokens,
                    completion_tokens=out.num_output_tokens,
                )
        for conn, updates in by_conn.items():
            conn.deliver(worker_pb2.StepOutputs(updates=updates))

    def _record_span(self, request: InFlight, out: RequestOutput) -> None:
        if self.tracer is not None and request.trace_context:
            record_request_span(
                self.tracer, request.trace_context, request.client_id, request.resumed_tokens, out
            )

    def _fail(self, conn: Connection, wire_id: str, code: worker_pb2.ErrorCode, message: str) -> None:
        update = worker_pb2.RequestUpdate(request_id=wire_id, error_code=code, error_message=message)
        conn.deliver(worker_pb2.StepOutputs(updates=[update]))

    def _fail_all(self, message: str) -> None:
        for request in list(self._in_flight.values()):
            self.engine.abort_request(request.engine_id)
            self._forget(request)
            self._fail(request.connection, request.wire_id, worker_pb2.ERROR_CODE_INTERNAL, message)


def _update(wire_id: str, out: RequestOutput) -> worker_pb2.RequestUpdate:
    update = worker_pb2.RequestUpdate(
        request_id=wire_id,
        new_token_ids=out.new_token_ids,
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
    )
    if out.finish_reason is not None:
        update.finish_reason = worker_pb2.FinishReason.Value(f"FINISH_REASON_{out.finish_reason.name}")
    timeline = out.timeline
    if timeline is not None and timeline.scheduled_ns:
        update.timings.queue_s = (timeline.scheduled_ns - timeline.arrival_ns) / 1e9
        if timeline.first_token_ns:
            update.timings.prefill_s = (timeline.first_token_ns - timeline.scheduled_ns) / 1e9
    for lp in out.new_logprobs:
        _add_logprobs(update.logprobs, lp)
    if out.pooled is not None:
        update.pooled = floats_to_bytes(out.pooled.tolist())
    if out.prompt_logprobs is not None:
        for scored in out.prompt_logprobs[1:]:  # the first prompt token has none
            assert scored is not None
            _add_logprobs(update.prompt_logprobs, scored)
    return update


def _add_logprobs(field: RepeatedCompositeFieldContainer, lp: TokenLogprobs) -> None:
    entry = field.add(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_token_ids=[t for t, _ in lp.top],
        top_logprobs=[v for _, v in lp.top],
    )
    if lp.rank is not None:
        entry.rank = lp.rank
