"""The LoRA adapters operators loaded through this router's Admin service, so that a worker of their base
model that connects later gets them too: a restarted pod, a replica added by scale-out or found by DNS.

Before a worker (re)joins, the router loads onto it each adapter it lacks from this record, one at a time,
and only then sends it requests; an adapter that fails to load there is logged and the worker serves
without it. The record is this router's memory: adapters loaded through another router come back through
that one, and a router that restarts has forgotten them (adapters every worker must always hold belong in
the workers' own --lora flag).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from nanovllm.common.logging import get_logger
from nanovllm.common.v1 import worker_pb2
from nanovllm.router.fleet.workers import WorkerConnection

log = get_logger(__name__)

# Reading and checking an adapter's files on a worker; a large adapter on a slow disk takes seconds.
ADMIN_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    base_model: str  # the served name of its base model
    path: str  # on the workers' disks


class AdapterRegistry:
    def __init__(self) -> None:
        self._loaded: dict[str, LoadedAdapter] = {}

    def record(self, name: str, base_model: str, path: str) -> None:
        """An Admin load that held on every worker of `base_model`."""
        self._loaded[name] = LoadedAdapter(name, base_model, path)

    def forget(self, name: str) -> None:
        """An Admin unload: workers that join later do not get it."""
        self._loaded.pop(name, None)

    async def restore(self, worker: WorkerConnection, info: worker_pb2.WorkerInfo) -> None:
        """Load onto `worker`, about to join with `info`, every recorded adapter of its base model that it
        does not hold; each one loaded joins info.adapters, which the router reads as the worker's."""
        held = {adapter.name for adapter in info.adapters}
        for adapter in list(self._loaded.values()):
            if adapter.base_model != info.model or adapter.name in held:
                continue
            request = worker_pb2.LoadLoRAAdapterRequest(name=adapter.name, path=adapter.path)
            try:
                loaded = await worker.stub.LoadLoRAAdapter(request, timeout=ADMIN_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "lora_restore_failed",
                    name=adapter.name,
                    path=adapter.path,
                    worker=worker.address,
                    error=f"{exc.code().name}: {exc.details()}",
                )
                continue
            info.adapters.append(loaded)
            log.info("lora_restored", name=adapter.name, path=adapter.path, worker=worker.address)
