"""TLS files for the gRPC ports: the public port's certificate (and optionally a CA its clients must be signed
by), and mutual TLS on the router-worker link. Everything that reads certificate, key or CA files is here:
checks at start-up that name the file, server credentials that pick up rewritten files at the next handshake,
and client channels that do the same for the next connection.

Rotation (cert-manager renews a Secret; the kubelet swaps the mounted files): a server's credentials ask
`ReloadingCertificates` before every new handshake, which re-reads the files when their stat changed and
otherwise answers "no change"; connections already open keep the certificate they shook hands with, so
streams in flight are untouched. A client's credentials are fixed per gRPC channel, so `ReloadingChannel`
opens a new channel for the next call when the files changed and leaves the old one open for the calls it
carries (see there).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc

from nanovllm.common.errors import ConfigError
from nanovllm.common.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class PemFiles:
    """Contents of one certificate chain, its private key and a CA bundle (any may be absent)."""

    cert: bytes | None
    key: bytes | None
    ca: bytes | None


@dataclass(frozen=True)
class TlsFiles:
    """Paths of a certificate chain, its key and a CA bundle, and the flags that set them (for messages).

    For a server: `cert` and `key` are its identity; with `ca`, every client must present a certificate
    signed by it. For a client: `ca` verifies the server; with `cert` and `key`, the client presents them."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    flags: tuple[str, str, str] = ("--tls-cert", "--tls-key", "--tls-ca")

    @property
    def enabled(self) -> bool:
        return any((self.cert, self.key, self.ca))

    def paths(self) -> list[str]:
        return [p for p in (self.cert, self.key, self.ca) if p]

    def check(self, need_identity: bool, need_ca: bool) -> PemFiles:
        """Read and parse every file, or raise ConfigError naming the file (or the missing flag): a
        missing, unreadable or unparsable file, or a key that does not belong to its certificate."""
        cert_flag, key_flag, ca_flag = self.flags
        if bool(self.cert) != bool(self.key):
            given, missing = (cert_flag, key_flag) if self.cert else (key_flag, cert_flag)
            raise ConfigError(f"{missing} is required with {given}")
        if need_identity and not self.cert:
            raise ConfigError(f"{cert_flag} and {key_flag} are required with {ca_flag}")
        if need_ca and not self.ca:
            raise ConfigError(f"{ca_flag} is required with {cert_flag} and {key_flag}")
        files = PemFiles(
            *(_read(path, flag) for path, flag in zip((self.cert, self.key, self.ca), self.flags))
        )
        if self.cert and self.key:  # both or neither (checked above)
            _check_pair(self.cert, self.key)
        if self.ca:
            _check_ca(self.ca, ca_flag)
        return files

    def stat(self) -> tuple[tuple[int, int, int], ...]:
        """What changes when any file is rewritten or its symlink swapped (inode, size, mtime)."""
        result = []
        for path in self.paths():
            try:
                st = os.stat(path)
                result.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                result.append((0, 0, 0))  # mid-swap: compare again next time
        return tuple(result)


def _read(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read the file ({exc.strerror or exc})") from exc
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")
    return data


def _check_pair(cert: str, key: str) -> None:
    """The certificate parses and the key is its key (the standard library's ssl does the parsing)."""
    try:
        # An encrypted key would make OpenSSL prompt for a password: an empty one fails instead.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=b"")
    except ssl.SSLError as exc:
        raise ConfigError(
            f"certificate {cert} with key {key}: unusable ({exc.reason or exc}); is the key that of the "
            "certificate?"
        ) from exc


def _check_ca(path: str, flag: str) -> None:
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError as exc:
        raise ConfigError(f"{flag} {path}: no usable CA certificate ({exc.reason or exc})") from exc


class RotatingFiles(Generic[T]):
    """What every TLS user here builds from its files (credentials, a channel's credentials, an SSL
    context), rebuilt when the files are replaced (cert-manager, a kubelet swapping a Secret). `refresh` is
    called as each connection starts: it stats the files and, when they changed, builds anew; a
    half-written or mismatched set (one file rewritten, the other not yet) keeps what was built before and
    is looked at again next time. The first build's errors are the caller's (a bad file fails the start)."""

    def __init__(self, files: TlsFiles, build: Callable[[], T]) -> None:
        self.files, self._build = files, build
        self._stat = files.stat()
        self.current = build()
        self.reloads = 0

    def refresh(self, **log_fields: str) -> bool:
        """True when the files changed and `current` was rebuilt from them."""
        stat = self.files.stat()
        if stat == self._stat:
            return False
        try:
            self.current = self._build()
        except (ConfigError, ssl.SSLError, OSError) as exc:
            log.warning("tls_reload_skipped", files=self.files.paths(), reason=str(exc), **log_fields)
            return False
        self._stat = stat
        self.reloads += 1
        log.info("tls_reloaded", files=self.files.paths(), reloads=self.reloads, **log_fields)
        return True


class ReloadingCertificates:
    """The certificate fetcher of `grpc.dynamic_ssl_server_credentials`: gRPC calls it before each new
    handshake (on one of its own threads); it returns a new configuration after the files changed."""

    def __init__(self, files: TlsFiles, require_client_cert: bool) -> None:
        self.require_client_cert = require_client_cert

        def build() -> Any:
            pem = files.check(need_identity=True, need_ca=require_client_cert)
            return grpc.ssl_server_certificate_configuration([(pem.key, pem.cert)], root_certificates=pem.ca)

        self.watch = RotatingFiles(files, build)

    def __call__(self) -> Any:
        return self.watch.current if self.watch.refresh() else None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.watch.current, self, require_client_authentication=self.require_client_cert
        )


class ReloadingSslContext(ssl.SSLContext):
    """The server context of an asyncio server (the router's HTTP face): asyncio wraps each connection
    with `wrap_bio`, which hands it to the context built from the files as they are then."""

    watch: RotatingFiles[ssl.SSLContext]

    @classmethod
    def serving(cls, files: TlsFiles, require_client_cert: bool) -> ReloadingSslContext:
        def build() -> ssl.SSLContext:
            files.check(need_identity=True, need_ca=require_client_cert)
            assert files.cert is not None  # check() raised without one
            built = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            built.load_cert_chain(files.cert, files.key)
            if require_client_cert:
                built.load_verify_locations(files.ca)
                built.verify_mode = ssl.CERT_REQUIRED
            return built

        context = cls(ssl.PROTOCOL_TLS_SERVER)
        context.watch = RotatingFiles(files, build)
        return context

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:
        self.watch.refresh()
        return self.watch.current.wrap_bio(*args, **kwargs)


def server_credentials(files: TlsFiles, require_client_cert: bool) -> grpc.ServerCredentials | None:
    """Reloading TLS credentials for a server port, or None (plaintext) when no file is configured."""
    if not files.enabled:
        return None
    return ReloadingCertificates(files, require_client_cert).credentials()


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Client credentials: verify the server with files.ca (the system roots when unset), and present
    files.cert/key when set."""
    pem = files.check(need_identity=False, need_ca=False)
    return grpc.ssl_channel_credentials(
        root_certificates=pem.ca, private_key=pem.key, certificate_chain=pem.cert
    )


class _Method:
    """A multi-callable that opens its call on the owner's current channel (see ReloadingChannel)."""

    def __init__(self, owner: ReloadingChannel, kind: str, args: tuple, kwargs: dict) -> None:
        self._owner, self._kind, self._args, self._kwargs = owner, kind, args, kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        channel = self._owner.current()
        return getattr(channel, self._kind)(*self._args, **self._kwargs)(*args, **kwargs)


class ReloadingChannel:
    """A grpc.aio channel to one address whose TLS files are read again when they change: each new call
    (a stub's method called) first stats the files, and after a change opens a new channel with the new
    credentials, so the next connection presents the new certificate. Calls already open keep running on
    the channel they started on, which stays open until `close`. Stubs take it in place of a channel.

    The router opens few calls per worker (health, info, load and one Connect stream per connection), so
    the stat per call costs nothing measurable."""

    def __init__(
        self, address: str, files: TlsFiles, options: list[tuple[str, Any]], server_name: str | None = None
    ) -> None:
        self.address = address
        self.options = [*options, *([("grpc.ssl_target_name_override", server_name)] if server_name else [])]
        self.watch = RotatingFiles(files, lambda: channel_credentials(files))
        self._channels = [grpc.aio.secure_channel(address, self.watch.current, options=self.options)]

    @property
    def reloads(self) -> int:
        return self.watch.reloads

    def current(self) -> grpc.aio.Channel:
        if self.watch.refresh(peer=self.address):
            self._channels.append(
                grpc.aio.secure_channel(self.address, self.watch.current, options=self.options)
            )
        return self._channels[-1]

    def unary_unary(self, *args: Any, **kwargs: Any) -> _Method:
        return _Method(self, "unary_unary", args, kwargs)

    def unary_stream(self, *args: Any, **kwargs: Any) -> _Method:
        return _Method(self, "unary_stream", args, kwargs)

    def stream_unary(self, *args: Any, **kwargs: Any) -> _Method:
        return _Method(self, "stream_unary", args, kwargs)

    def stream_stream(self, *args: Any, **kwargs: Any) -> _Method:
        return _Method(self, "stream_stream", args, kwargs)

    async def close(self, grace: float | None = None) -> None:
        for channel in self._channels:
            await channel.close(grace)


def open_channel(
    address: str,
    options: list[tuple[str, Any]],
    tls: TlsFiles | None = None,
    server_name: str | None = None,
) -> grpc.aio.Channel | ReloadingChannel:
    """A plaintext grpc.aio channel, or with TLS files a ReloadingChannel (mutual TLS when they include a
    certificate and key)."""
    if tls is None or not tls.enabled:
        return grpc.aio.insecure_channel(address, options=options)
    return ReloadingChannel(address, tls, options, server_name)
