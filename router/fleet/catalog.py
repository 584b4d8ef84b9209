"""What a router serves: each base model its workers run (with that model's tokenizer) and the LoRA adapters
loaded on those workers, and what a request's `model` name selects.

Workers advertise their base model's served name in WorkerInfo and their adapters there and in every change
after (StepOutputs.adapters). The first worker of a base model brings its tokenizer; another worker under
the same name must bring the same files, or it is refused. A name is a base model or an adapter; an empty
name is the one base model served, and is ambiguous when there are several.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from nanovllm.common.logging import get_logger
from nanovllm.common.v1 import worker_pb2
from nanovllm.router.fleet.tokenizer import ModelTokenizer, has_tokenizer

log = get_logger(__name__)


class UnknownModelError(LookupError):
    """The request names a model this router's workers do not serve (NOT_FOUND, HTTP 404)."""


class NoModelYet(Exception):
    """No worker has connected yet, so nothing is known to be served (UNAVAILABLE, HTTP 503)."""


class ServingWorker(Protocol):
    """What the catalog reads of a worker connection (router/fleet/workers.py)."""

    info: worker_pb2.WorkerInfo | None
    adapters: dict[str, int]  # loaded LoRA adapters: name -> cache salt


@dataclass
class BaseModel:
    info: worker_pb2.WorkerInfo  # the first worker's that served it
    tokenizer: ModelTokenizer | None  # None for a model without one: token ids only

    @property
    def name(self) -> str:
        return self.info.model


@dataclass(frozen=True)
class ModelChoice:
    """What a request's `model` selected: a base model, and maybe one of its adapters."""

    base: BaseModel
    lora_name: str = ""  # empty: the base model itself
    cache_salt: int | None = None  # the adapter's (common/block_hash.py)

    @property
    def name(self) -> str:
        return self.lora_name or self.base.name

    def served_by(self, worker: ServingWorker) -> bool:
        if worker.info is None or worker.info.model != self.base.name:
            return False
        return not self.lora_name or self.lora_name in worker.adapters


@dataclass(frozen=True)
class ServedName:
    name: str
    parent: str  # an adapter's base model; empty for a base model
    num_workers: int


class Catalog:
    def __init__(self, workers: Callable[[], Iterable[ServingWorker]]) -> None:
        """`workers`: the connections that take requests now (their adapters are what is served)."""
        self._workers = workers
        self.bases: dict[str, BaseModel] = {}
        self._lock = asyncio.Lock()

    async def admit(self, info: worker_pb2.WorkerInfo) -> bool:
        """Whether a worker with `info` may serve: a new base model (its tokenizer loaded now), or one
        already known with the same tokenizer files."""
        async with self._lock:
            known = self.bases.get(info.model)
            if known is None:
                tokenizer = None
                if has_tokenizer(info):
                    tokenizer = await asyncio.to_thread(ModelTokenizer, info)
                else:
                    log.warning(
                        "model_has_no_tokenizer",
                        model=info.model,
                        detail="only prompt token ids are served: text, chat and stop strings get "
                        "FAILED_PRECONDITION, responses carry token ids and no text",
                    )
                self.bases[info.model] = BaseModel(info, tokenizer)
                return True
        if info.tokenizer_files != known.info.tokenizer_files or info.vocab_size != known.info.vocab_size:
            log.error(
                "worker_model_mismatch",
                model=info.model,
                detail="another worker serves a model under this name with other tokenizer files or vocabulary",
            )
            return False
        return True

    def resolve(self, name: str) -> ModelChoice:
        """The base model or adapter `name` selects; '' the one base model. UnknownModelError for a name
        nothing serves, ValueError for '' among several base models, NoModelYet before any worker."""
        if not self.bases:
            raise NoModelYet("no worker has connected yet")
        if not name:
            if len(self.bases) == 1:
                return ModelChoice(next(iter(self.bases.values())))
            raise ValueError(
                f"model is required: this router serves several base models ({self._bases_text()})"
            )
        base = self.bases.get(name)
        if base is not None:
            return ModelChoice(base)
        for worker in self._workers():
            salt = worker.adapters.get(name)
            if salt is not None and worker.info is not None and worker.info.model in self.bases:
                return ModelChoice(self.bases[worker.info.model], name, salt)
        served = ", ".join(repr(s.name) for s in self.served())
        raise UnknownModelError(f"model {name!r} is not served here; served: {served}")

    def served(self) -> list[ServedName]:
        """Every base model (connected or not), then every adapter loaded on a connected worker, each part
        by name."""
        workers = [(w, w.info) for w in self._workers() if w.info is not None]
        names = [ServedName(n, "", sum(info.model == n for _, info in workers)) for n in sorted(self.bases)]
        adapters: dict[tuple[str, str], int] = {}
        for worker, info in workers:
            for adapter in worker.adapters:
                key = (adapter, info.model)
                adapters[key] = adapters.get(key, 0) + 1
        names += [ServedName(name, parent, count) for (name, parent), count in sorted(adapters.items())]
        return names

    def _bases_text(self) -> str:
        return ", ".join(repr(n) for n in sorted(self.bases))
