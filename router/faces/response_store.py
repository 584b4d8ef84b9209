"""Stored responses (OpenAI's Responses API, `store`): a record per response id and owner (the caller's token
name), kept for a time to live, shared by every router process of one machine (SQLite in WAL mode, one
file: `--processes N` all open it) or of a fleet (Redis: `--response-store redis://...`).

A record is JSON: the Response object, the input items the response was asked with (its conversation's
earlier turns first, for `input_items`), and the conversation as input items, outputs included, which a
later request's `previous_response_id` continues. A background response also keeps its stream's events,
which any process replays and follows (`GET /v1/responses/{id}?stream=true&starting_after=N`), and a
cancel request, which the process running it sees between two of its events.
"""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from nanovllm.common.errors import ConfigError
from nanovllm.common.server_config import RouterConfig
from nanovllm.router.faces.response_objects import ResponseEvent, StoredRecord

T = TypeVar("T")

# --response-store auto: one file per user and machine, which every router process opens.
DEFAULT_PATH = Path.home() / ".cache" / "nanovllm" / "responses.sqlite"


class StoreFull(Exception):
    """The store is at its size limit."""


class StoreUnavailable(Exception):
    """The store cannot be read or written (a Redis server down, a disk failing)."""


class ResponseStore:
    """SQLite in WAL mode: readers never wait for the writer, and each process opens its own connection.
    Calls run in a thread (sqlite3 blocks); `ttl_s` bounds a record's life, `max_bytes` the file's size."""

    def __init__(self, path: Path, ttl_s: float, max_bytes: int) -> None:
        self.path, self.ttl_s, self.max_bytes = path, ttl_s, max_bytes
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with self._connect() as db:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(
                    "CREATE TABLE IF NOT EXISTS responses (owner TEXT, id TEXT, expires REAL, record TEXT, "
                    "PRIMARY KEY (owner, id))"
                )
                db.execute(
                    "CREATE TABLE IF NOT EXISTS events (owner TEXT, id TEXT, seq INTEGER, expires REAL, "
                    "event TEXT, PRIMARY KEY (owner, id, seq))"
                )
                db.execute(
                    "CREATE TABLE IF NOT EXISTS cancels (owner TEXT, id TEXT, PRIMARY KEY (owner, id))"
                )
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(
                f"--response-store {path}: cannot open it as an SQLite database: {exc}"
            ) from None

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        # WAL with NORMAL: a commit is not synced (a background stream commits each update); the file
        # stays consistent, and a power loss may lose the last commits only.
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def _used(self, db: sqlite3.Connection) -> int:
        return db.execute("PRAGMA page_count").fetchone()[0] * db.execute("PRAGMA page_size").fetchone()[0]

    def _check_space(self) -> None:
        with self._connect() as db:
            db.execute("DELETE FROM responses WHERE expires < ?", (time.time(),))
            db.execute("DELETE FROM events WHERE expires < ?", (time.time(),))
            used = self._used(db)
        if used >= self.max_bytes:
            raise StoreFull(
                f"the response store is full: {used / 2**20:.1f} MiB of its {self.max_bytes / 2**20:.0f} MiB "
                "(--response-store-max-bytes); send store false, or delete stored responses"
            )

    def _put(self, owner: str, response_id: str, record: str) -> None:
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                (owner, response_id, time.time() + self.ttl_s, record),
            )

    def _get(self, owner: str, response_id: str) -> str | None:
        with self._connect() as db:
            row = db.execute(
                "SELECT record FROM responses WHERE owner = ? AND id = ? AND expires >= ?",
                (owner, response_id, time.time()),
            ).fetchone()
        return None if row is None else row[0]

    def _delete(self, owner: str, response_id: str) -> bool:
        with self._connect() as db:
            gone = db.execute("DELETE FROM responses WHERE owner = ? AND id = ?", (owner, response_id))
            for table in ("events", "cancels"):
                db.execute(f"DELETE FROM {table} WHERE owner = ? AND id = ?", (owner, response_id))
            return gone.rowcount > 0

    def _append(self, owner: str, response_id: str, events: list[ResponseEvent]) -> bool:
        expires = time.time() + self.ttl_s
        rows = [(owner, response_id, e["sequence_number"], expires, json.dumps(e)) for e in events]
        with self._connect() as db:
            db.executemany("INSERT OR REPLACE INTO events VALUES (?, ?, ?, ?, ?)", rows)
            cancel = "SELECT 1 FROM cancels WHERE owner = ? AND id = ?"
            return db.execute(cancel, (owner, response_id)).fetchone() is not None

    def _events_after(self, owner: str, response_id: str, after: int) -> list[str]:
        with self._connect() as db:
            rows = db.execute(
                "SELECT event FROM events WHERE owner = ? AND id = ? AND seq > ? ORDER BY seq",
                (owner, response_id, after),
            ).fetchall()
        return [row[0] for row in rows]

    def _request_cancel(self, owner: str, response_id: str) -> None:
        with self._connect() as db:
            db.execute("INSERT OR IGNORE INTO cancels VALUES (?, ?)", (owner, response_id))

    async def _run(self, method: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.to_thread(method, *args)
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the response store {self.path} failed: {exc}") from None

    async def check_space(self) -> None:
        """StoreFull when the store is at its size limit (checked before a response that will be stored
        runs, so that no answer is generated and then lost; a response may take the store a little past)."""
        await self._run(self._check_space)

    async def put(self, owner: str, response_id: str, record: StoredRecord) -> None:
        await self._run(self._put, owner, response_id, json.dumps(record))

    async def get(self, owner: str, response_id: str) -> StoredRecord | None:
        """The record, or None: unknown, deleted, past its time to live, or another owner's."""
        text = await self._run(self._get, owner, response_id)
        return None if text is None else json.loads(text)

    async def delete(self, owner: str, response_id: str) -> bool:
        return await self._run(self._delete, owner, response_id)

    async def append_events(self, owner: str, response_id: str, events: list[ResponseEvent]) -> bool:
        """Keep a background response's stream events; whether a cancel was asked for since."""
        return await self._run(self._append, owner, response_id, events)

    async def events_after(self, owner: str, response_id: str, after: int) -> list[ResponseEvent]:
        """The kept events whose sequence_number is past `after`, in order."""
        return [json.loads(e) for e in await self._run(self._events_after, owner, response_id, after)]

    async def request_cancel(self, owner: str, response_id: str) -> None:
        await self._run(self._request_cancel, owner, response_id)


class RedisResponseStore:
    """The same records in Redis, for router replicas on several machines: a string per record, a list per
    background response's events (an event's sequence number is its index), a key per cancel request,
    each expiring with the record. `max_bytes` bounds the server's used memory as this router sees it."""

    def __init__(self, url: str, ttl_s: float, max_bytes: int) -> None:
        import redis.asyncio  # only where a Redis store is configured

        self.url, self.ttl_s, self.max_bytes = url, ttl_s, max_bytes
        self._ttl = max(1, math.ceil(ttl_s))
        try:
            self._redis = redis.asyncio.from_url(url)
        except ValueError as exc:
            raise ConfigError(f"--response-store {url}: {exc}") from None
        self._errors = (redis.RedisError, OSError)

    @staticmethod
    def _key(kind: str, owner: str, response_id: str) -> str:
        return f"nanovllm:{kind}:{owner}:{response_id}"

    async def _call(self, command: Awaitable[T]) -> T:
        try:
            return await command
        except self._errors as exc:
            raise StoreUnavailable(f"the response store at {self.url} failed: {exc}") from None

    async def check_space(self) -> None:
        used = (await self._call(self._redis.info("memory")))["used_memory"]
        if used >= self.max_bytes:
            raise StoreFull(
                f"the response store is full: {used / 2**20:.1f} MiB of its {self.max_bytes / 2**20:.0f} MiB "
                "(--response-store-max-bytes); send store false, or delete stored responses"
            )

    async def put(self, owner: str, response_id: str, record: StoredRecord) -> None:
        await self._call(
            self._redis.set(self._key("response", owner, response_id), json.dumps(record), ex=self._ttl)
        )

    async def get(self, owner: str, response_id: str) -> StoredRecord | None:
        text = await self._call(self._redis.get(self._key("response", owner, response_id)))
        return None if text is None else json.loads(text)

    async def delete(self, owner: str, response_id: str) -> bool:
        keys = [self._key(kind, owner, response_id) for kind in ("events", "cancel")]
        await self._call(self._redis.delete(*keys))
        return bool(await self._call(self._redis.delete(self._key("response", owner, response_id))))

    async def append_events(self, owner: str, response_id: str, events: list[ResponseEvent]) -> bool:
        key = self._key("events", owner, response_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            if events:
                pipe.rpush(key, *(json.dumps(e) for e in events))
                pipe.expire(key, self._ttl)
            pipe.exists(self._key("cancel", owner, response_id))
            results = await self._call(pipe.execute())
        return bool(results[-1])

    async def events_after(self, owner: str, response_id: str, after: int) -> list[ResponseEvent]:
        texts = await self._call(self._redis.lrange(self._key("events", owner, response_id), after + 1, -1))
        return [json.loads(t) for t in texts]

    async def request_cancel(self, owner: str, response_id: str) -> None:
        await self._call(self._redis.set(self._key("cancel", owner, response_id), 1, ex=self._ttl))


Store = ResponseStore | RedisResponseStore


def open_response_store(config: RouterConfig) -> Store | None:
    """The store --response-store names, or None when it is off."""
    if config.response_store == "off":
        return None
    if config.response_store.startswith(("redis://", "rediss://", "unix://")):
        return RedisResponseStore(
            config.response_store, config.response_store_ttl_s, config.response_store_max_bytes
        )
    path = DEFAULT_PATH if config.response_store == "auto" else Path(config.response_store).expanduser()
    return ResponseStore(path, config.response_store_ttl_s, config.response_store_max_bytes)
