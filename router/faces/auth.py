"""Bearer-token auth and per-token limits on the router's public API.

Tokens file (`--auth-tokens-file`, e.g. a mounted Secret): one token per line, either `NAME:TOKEN` (split at
the first colon; NAME is what logs and errors show) or `TOKEN` alone (then named `token-` plus the first 8 hex
digits of its SHA-256). Blank lines and lines starting with `#` are skipped; a token has at least 16
characters. The file is read again when it changes (a rotated Secret), at the next call.

A client sends `authorization: Bearer TOKEN` metadata. `AuthInterceptor` answers every method except the
health service, the Admin service (which checks its own tokens) and reflection (unless asked otherwise) with UNAUTHENTICATED when the metadata is missing
or not a bearer token, and PERMISSION_DENIED when the token is not in the file. Tokens are looked up by
their SHA-256 digest (`TokenTable`), and never logged: logs and metrics see the name only.

`Access` puts the two together for the service: who the caller is, and whether its limits (router/calls/limits.py)
allow one more stream.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from nanovllm.common.errors import ConfigError
from nanovllm.common.logging import get_logger
from nanovllm.router.calls.limits import Lease, LimitExceeded, TokenLimits, retry_metadata

log = get_logger(__name__)

MIN_TOKEN_CHARS = 16
ANONYMOUS = "anonymous"  # every caller's name when auth is off (limits then apply to all callers together)
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."
ADMIN_PREFIX = "/nanovllm.v1.Admin/"  # checked against the admin tokens instead (router/faces/admin.py)


class AuthError(Exception):
    """A call that may not proceed: the status code and a message that never contains the token."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def token_name(token: str) -> str:
    return "token-" + hashlib.sha256(token.encode()).hexdigest()[:8]


def token_digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def parse_tokens(path: str) -> dict[str, str]:
    """NAME -> TOKEN from a tokens file, or ConfigError naming the file (and the line)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--auth-tokens-file {path}: cannot read the file ({exc})") from exc
    tokens: dict[str, str] = {}
    digests: set[bytes] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, token = line.partition(":")
        name, token = (name.strip(), token.strip()) if sep else (token_name(line), line)
        where = f"--auth-tokens-file {path} line {number}"
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(f"{where}: a token has at least {MIN_TOKEN_CHARS} characters, got {len(token)}")
        if name in tokens:
            raise ConfigError(f"{where}: the name {name!r} is used twice")
        digest = token_digest(token.encode())
        if digest in digests:
            raise ConfigError(f"{where}: the same token appears twice")
        digests.add(digest)
        tokens[name] = token
    if not tokens:
        raise ConfigError(f"--auth-tokens-file {path}: no token in the file")
    return tokens


class TokenTable:
    """The known tokens, read from the file at start (errors are ConfigError) and again when it changes
    (errors then keep the tokens in use and are logged).

    Names are kept by their token's SHA-256 digest, so a call costs one hash and one dict lookup whatever the
    number of tokens (comparing with each token in turn grows with their number, twice per call).
    The lookup's timing depends on the digest of what the caller sent, which tells nothing about any valid
    token: finding a token from it would take a SHA-256 preimage."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stat = self._file_stat()
        self._names = _names_by_digest(parse_tokens(path))

    def _file_stat(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.path)
        except OSError:
            return (0, 0, 0)
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _reload_if_changed(self) -> None:
        stat = self._file_stat()
        if stat == self._stat:
            return
        try:
            tokens = parse_tokens(self.path)
        except ConfigError as exc:
            log.warning("auth_tokens_reload_skipped", reason=str(exc))
            return
        self._stat = stat
        self._names = _names_by_digest(tokens)
        log.info("auth_tokens_reloaded", path=self.path, tokens=len(self._names))

    def identify(self, metadata: Any) -> str:
        """The name of the bearer token in the call's metadata, or AuthError."""
        self._reload_if_changed()
        header = next((value for key, value in metadata or () if key == "authorization"), None)
        if header is None:
            raise AuthError(
                grpc.StatusCode.UNAUTHENTICATED,
                "this router needs a token: send the metadata 'authorization: Bearer <token>'",
            )
        scheme, _, presented = str(header).strip().partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise AuthError(
                grpc.StatusCode.UNAUTHENTICATED,
                "the authorization metadata is not 'Bearer <token>'",
            )
        found = self._names.get(token_digest(presented.strip().encode()))
        if found is None:
            raise AuthError(grpc.StatusCode.PERMISSION_DENIED, "the token is not valid for this router")
        return found


def _names_by_digest(tokens: dict[str, str]) -> dict[bytes, str]:
    return {token_digest(token.encode()): name for name, token in tokens.items()}


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without a valid token before their handler runs; health (and reflection, when
    `open_reflection`) stay open for probes and tools."""

    def __init__(
        self, table: TokenTable, on_reject: Callable[[str], None], open_reflection: bool = True
    ) -> None:
        """`on_reject(reason)` counts each refusal (unauthenticated, permission_denied)."""
        self.table = table
        self.open_reflection = open_reflection
        self._on_reject = on_reject

    def _exempt(self, method: str) -> bool:
        return method.startswith((HEALTH_PREFIX, ADMIN_PREFIX)) or (
            self.open_reflection and method.startswith(REFLECTION_PREFIX)
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or self._exempt(details.method):
            return handler
        try:
            self.table.identify(details.invocation_metadata)
            return handler
        except AuthError as exc:
            self._on_reject(exc.code.name.lower())
            return _refusal(handler, exc)


def _refusal(handler: grpc.RpcMethodHandler, error: AuthError) -> grpc.RpcMethodHandler:
    """The same kind of handler, ending the call with the error before reading the request."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(error.code, str(error))

    kind = "_".join(
        "stream" if s else "unary" for s in (handler.request_streaming, handler.response_streaming)
    )
    return handler._replace(**{kind: refuse})


class Access:
    """What the router's service asks before a call: who it is (auth on or off) and whether its limits
    allow one more stream."""

    def __init__(
        self, table: TokenTable | None, limits: TokenLimits, on_reject: Callable[[str], None]
    ) -> None:
        """`on_reject(reason)` counts each call refused by a limit (stream_limit, token_rate_limit)."""
        self.table = table
        self.limits = limits
        self._on_reject = on_reject

    def identify(self, metadata: Sequence[tuple[str, str]]) -> str:
        """The caller's token name from its metadata, or AuthError (counted) for no token or an unknown
        one; for the HTTP face, whose calls pass no interceptor."""
        if self.table is None:
            return ANONYMOUS
        try:
            return self.table.identify(metadata)
        except AuthError as exc:
            self._on_reject(exc.code.name.lower())
            raise

    def name(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's token name (the interceptor already refused calls without a valid token)."""
        if self.table is None:
            return ANONYMOUS
        return self.table.identify(context.invocation_metadata())

    async def admit(self, context: grpc.aio.ServicerContext) -> Lease:
        """A lease, or the call ended with RESOURCE_EXHAUSTED and a retry-after hint."""
        try:
            return self.limits.admit(self.name(context))
        except LimitExceeded as exc:
            self._on_reject(exc.limit)
            context.set_trailing_metadata(retry_metadata(exc.retry_after_s))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except AuthError as exc:  # the tokens file changed since the interceptor looked
            self._on_reject(exc.code.name.lower())
            await context.abort(exc.code, str(exc))
        raise AssertionError("context.abort returns only by raising")
