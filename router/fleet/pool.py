"""All workers of one router: found through the --worker targets (router/fleet/discovery.py), one
WorkerConnection each, and the choice of one for each request (router/fleet/routing.py).

Workers may serve several base models, each with its LoRA adapters (router/fleet/catalog.py); a request goes to
a worker that serves the model it names. A worker whose address stops resolving is retired: it takes
nothing new, its streams finish, and then its connection closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc

from nanovllm.common.block_hash import PromptImage
from nanovllm.common.logging import get_logger
from nanovllm.common.server_config import RoutingConfig
from nanovllm.common.tls import TlsFiles
from nanovllm.common.v1 import worker_pb2
from nanovllm.router.fleet.adapter_registry import AdapterRegistry
from nanovllm.router.fleet.catalog import Catalog, ModelChoice, NoModelYet, UnknownModelError
from nanovllm.router.fleet.discovery import RESOLVE_ERRORS, WorkerTarget, resolve
from nanovllm.router.fleet.routing import Decision, choose
from nanovllm.router.fleet.workers import WorkerConnection

log = get_logger(__name__)


class WorkerPool:
    def __init__(
        self,
        targets: list[str],
        on_change: Callable[[bool], None],
        routing: RoutingConfig,
        discovery_interval_s: float = 5.0,
        tls: TlsFiles | None = None,
        server_name: str | None = None,
    ) -> None:
        """on_change(serving) is called whenever the set of connected workers changes; `routing` says how
        to pick a worker; `tls` the router's files for mutual TLS to workers, whose certificates
        are checked against `server_name`, or else the name the worker was found under."""
        if not targets:
            raise ValueError("a router needs at least one worker address (--worker HOST:PORT)")
        self.targets = [WorkerTarget.parse(t) for t in targets]
        self.catalog = Catalog(lambda: self.available)
        self.admin_adapters = AdapterRegistry()  # what the Admin service loaded, for workers that join later
        self.routing = routing
        self._turn = 0  # requests picked for so far: round-robin's position
        self.discovery_interval_s = discovery_interval_s
        self._on_change = on_change
        self._tls, self._server_name = tls, server_name
        self._workers: dict[str, WorkerConnection] = {}
        self._resolved: dict[WorkerTarget, set[str]] = {}  # each target's addresses at its last lookup
        self._change = asyncio.Event()  # set (and replaced) whenever a worker connects, drains or goes
        self._started = False
        self._discovery: asyncio.Task | None = None
        for target in self.targets:
            if target.is_address:  # nothing to look up: its connection starts with the pool
                self._resolved[target] = {str(target)}
                self._add(str(target), target)

    @property
    def workers(self) -> list[WorkerConnection]:
        return list(self._workers.values())

    def start(self) -> None:
        self._started = True
        for worker in self.workers:
            worker.start(self._changed)
        if not all(target.is_address for target in self.targets):
            self._discovery = asyncio.create_task(self._discover(), name="worker-discovery")

    async def close(self) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
            await asyncio.gather(self._discovery, return_exceptions=True)
        await asyncio.gather(*(worker.close() for worker in self.workers))

    @property
    def addresses(self) -> str:
        """The configured targets and the workers found through them, for error messages."""
        found = ", ".join(self._workers) or "none found yet"
        return f"{', '.join(map(str, self.targets))}; workers: {found}"

    @property
    def available(self) -> list[WorkerConnection]:
        """Connected workers that take new requests (not draining, not retired)."""
        return [w for w in self.workers if w.available]

    def pick(
        self,
        model: ModelChoice,
        token_ids: Sequence[int],
        exclude: frozenset[str] = frozenset(),
        images: Sequence[PromptImage] = (),
    ) -> Decision[WorkerConnection] | None:
        """Where a request for `model` whose tokens are `token_ids` (with `images` in them) costs least
        (router/fleet/routing.py), among the available workers that serve the model, other than the
        addresses in `exclude` (those it already failed on); None if there is none."""
        candidates = [w for w in self.available if w.address not in exclude and model.served_by(w)]
        self._turn += 1
        return choose(candidates, token_ids, self.routing, self._turn, model.cache_salt, images)

    async def wait_for_worker(
        self,
        model: ModelChoice,
        token_ids: Sequence[int],
        exclude: frozenset[str],
        timeout: float,
        images: Sequence[PromptImage] = (),
    ) -> Decision[WorkerConnection] | None:
        """pick(model, token_ids, exclude, images), or else any available worker of the model, waiting up
        to `timeout` seconds for one to connect (a worker restarting after a crash)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (
            decision := self.pick(model, token_ids, exclude, images)
            or self.pick(model, token_ids, images=images)
        ) is None:
            change = self._change
            try:
                await asyncio.wait_for(change.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                return None
        return decision

    # --- discovery ------------------------------------------------------------------------------------

    async def _discover(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.discovery_interval_s)

    async def refresh(self) -> None:
        """Look every name up again: connect to new addresses, retire vanished ones, close retired ones
        whose streams have all ended. A failed lookup keeps that target's previous addresses."""
        for target in self.targets:
            if target.is_address:
                continue
            try:
                found = await resolve(target)
            except RESOLVE_ERRORS as exc:
                log.warning("worker_lookup_failed", target=str(target), reason=f"{type(exc).__name__}: {exc}")
                continue
            if found != self._resolved.get(target):
                log.info("workers_resolved", target=str(target), addresses=sorted(found))
            self._resolved[target] = found
        wanted = {address: t for t, addresses in self._resolved.items() for address in addresses}
        for address, target in wanted.items():
            worker = self._workers.get(address)
            if worker is None:
                self._add(address, target)
            elif worker.retired:
                worker.retired = False
                log.info("worker_restored", worker=address)
                self._changed()
        for address, worker in list(self._workers.items()):
            if address in wanted:
                continue
            if not worker.retired:
                worker.retired = True
                log.info("worker_retired", worker=address, in_flight=worker.num_in_flight)
                self._changed()
            if worker.num_in_flight == 0:
                del self._workers[address]
                await worker.close()

    def _add(self, address: str, target: WorkerTarget) -> None:
        server_name = self._server_name or (None if target.is_address else target.host)
        worker = WorkerConnection(address, self._prepare, self._tls, server_name)
        self._workers[address] = worker
        if self._started:
            log.info("worker_found", worker=address, target=str(target))
            worker.start(self._changed)

    # --- connections ----------------------------------------------------------------------------------

    async def _prepare(self, worker: WorkerConnection, info: worker_pb2.WorkerInfo) -> bool:
        if not await self.catalog.admit(info):
            return False
        await self.admin_adapters.restore(worker, info)
        return True

    def _changed(self) -> None:
        self._change.set()
        self._change = asyncio.Event()
        self._on_change(bool(self.available))


def never_reached(pool: WorkerPool) -> str:
    return f"no worker has been reachable yet ({pool.addresses})"


class ModelRefused(Exception):
    """A request's model name selects nothing: the status that says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def resolve_model(pool: WorkerPool, name: str) -> ModelChoice:
    """What `name` selects (router/fleet/catalog.py), or ModelRefused: UNAVAILABLE before any worker connected,
    NOT_FOUND for a name nothing serves, INVALID_ARGUMENT for no name among several base models."""
    try:
        return pool.catalog.resolve(name)
    except NoModelYet:
        raise ModelRefused(grpc.StatusCode.UNAVAILABLE, never_reached(pool)) from None
    except UnknownModelError as exc:
        raise ModelRefused(grpc.StatusCode.NOT_FOUND, str(exc)) from None
    except ValueError as exc:
        raise ModelRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
