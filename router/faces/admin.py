"""The router's Admin service (nanovllm.v1.Admin): operators load and unload LoRA adapters on the workers of
a base model while they serve.

Every call needs a bearer token from --admin-tokens-file (a file apart from the public tokens: a client
that may generate may not change what is served); without that file admin calls are refused. A load goes
to every available worker of the base model at once and holds only if each of them loaded it: otherwise it
is unloaded from those that did, and the call fails with the first worker's error. A load that held is
remembered, and workers of the base model that join later get it (router/fleet/adapter_registry.py).
"""

from __future__ import annotations

import asyncio

import grpc

from nanovllm.common.logging import get_logger
from nanovllm.common.v1 import worker_pb2
from nanovllm.router.faces.auth import AuthError, TokenTable
from nanovllm.router.fleet.adapter_registry import ADMIN_TIMEOUT_S
from nanovllm.router.fleet.catalog import NoModelYet, UnknownModelError
from nanovllm.router.fleet.pool import ModelRefused, WorkerPool, resolve_model
from nanovllm.router.fleet.workers import WorkerConnection
from nanovllm.v1 import generate_pb2, generate_pb2_grpc

log = get_logger(__name__)


class AdminService(generate_pb2_grpc.AdminServicer):
    def __init__(self, pool: WorkerPool, table: TokenTable | None) -> None:
        """`table`: the admin tokens (None: admin calls are off)."""
        self.pool = pool
        self.table = table

    async def _authorize(self, context: grpc.aio.ServicerContext) -> str:
        if self.table is None:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "admin calls are off on this router: start it with --admin-tokens-file",
            )
            raise AssertionError("context.abort returns only by raising")
        try:
            return self.table.identify(context.invocation_metadata())
        except AuthError as exc:
            await context.abort(exc.code, f"admin call refused: {exc}")
        raise AssertionError("context.abort returns only by raising")

    async def LoadLoRAAdapter(
        self, request: generate_pb2.LoadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.LoadLoRAAdapterResponse:
        caller = await self._authorize(context)
        if not request.name or not request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name and path are both required")
        workers = await self._base_workers(request.base_model, context)
        try:
            taken = self.pool.catalog.resolve(request.name)
        except (UnknownModelError, NoModelYet):
            taken = None
        if taken is not None:
            kind = f"a LoRA adapter of {taken.base.name!r}" if taken.lora_name else "a base model"
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"{request.name!r} is already served: {kind}")
        load = worker_pb2.LoadLoRAAdapterRequest(name=request.name, path=request.path)
        results = await asyncio.gather(
            *(w.stub.LoadLoRAAdapter(load, timeout=ADMIN_TIMEOUT_S) for w in workers), return_exceptions=True
        )
        failed = [(w, r) for w, r in zip(workers, results) if isinstance(r, BaseException)]
        loaded = [(w, r) for w, r in zip(workers, results) if not isinstance(r, BaseException)]
        if failed:
            await self._unload([w for w, _ in loaded], request.name)
            worker, error = failed[0]
            code, detail = _status(error)
            log.warning(
                "lora_load_failed", name=request.name, worker=worker.address, caller=caller, error=detail
            )
            await context.abort(code, f"worker {worker.address} could not load {request.name!r}: {detail}")
        for worker, adapter in loaded:  # before the workers' own news of it, so requests may name it now
            worker.adapters[adapter.name] = adapter.cache_salt
        info = workers[0].info
        assert info is not None  # an available worker's
        self.pool.admin_adapters.record(request.name, info.model, request.path)
        log.info("lora_loaded", name=request.name, path=request.path, workers=len(loaded), caller=caller)
        return generate_pb2.LoadLoRAAdapterResponse(workers=[w.address for w, _ in loaded])

    async def UnloadLoRAAdapter(
        self, request: generate_pb2.UnloadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.UnloadLoRAAdapterResponse:
        caller = await self._authorize(context)
        self.pool.admin_adapters.forget(request.name)
        holders = [w for w in self.pool.available if request.name in w.adapters]
        if not holders:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no worker holds a LoRA adapter named {request.name!r}"
            )
        errors = await self._unload(holders, request.name)
        if errors:
            worker, detail = errors[0]
            await context.abort(
                grpc.StatusCode.INTERNAL, f"worker {worker.address} could not unload it: {detail}"
            )
        log.info("lora_unloaded", name=request.name, workers=len(holders), caller=caller)
        return generate_pb2.UnloadLoRAAdapterResponse(workers=[w.address for w in holders])

    async def _base_workers(
        self, base_model: str, context: grpc.aio.ServicerContext
    ) -> list[WorkerConnection]:
        """The available workers of the base model named `base_model` ('' : the one served)."""
        try:
            choice = resolve_model(self.pool, base_model)
        except ModelRefused as exc:
            await context.abort(exc.code, f"base_model: {exc}")
        if choice.lora_name:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"base_model {base_model!r} is a LoRA adapter; name its base model {choice.base.name!r}",
            )
        workers = [w for w in self.pool.available if choice.served_by(w)]
        if not workers:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"no worker of {choice.base.name!r} is connected"
            )
        return workers

    @staticmethod
    async def _unload(workers: list[WorkerConnection], name: str) -> list[tuple[WorkerConnection, str]]:
        """Unload `name` from each worker (one that no longer has it counts as done); the failures."""
        unload = worker_pb2.UnloadLoRAAdapterRequest(name=name)
        results = await asyncio.gather(
            *(w.stub.UnloadLoRAAdapter(unload, timeout=ADMIN_TIMEOUT_S) for w in workers),
            return_exceptions=True,
        )
        errors = []
        for worker, result in zip(workers, results):
            if isinstance(result, BaseException) and _status(result)[0] != grpc.StatusCode.NOT_FOUND:
                errors.append((worker, _status(result)[1]))
            else:
                worker.adapters.pop(name, None)
        return errors


def _status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code(), error.details() or error.code().name
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"
