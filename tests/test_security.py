"""TLS, mutual TLS between router and worker, bearer-token auth and per-token limits, through real router and
worker processes on loopback, with certificates made at test time (tests/certs.py).

One worker speaks mutual TLS only (certificate from CA "a", routers must be signed by "a"); the routers trust
workers signed by "a" or "b" (a bundle), so the worker's certificate can rotate to a "b" one and a client that
trusts only "b" shows the new certificate is served. CA "x" signs nothing anyone trusts.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from nanovllm.common.errors import ConfigError
from nanovllm.common.tls import ReloadingChannel, TlsFiles
from nanovllm.common.v1 import worker_pb2, worker_pb2_grpc
from nanovllm.router.calls.limits import TokenLimits
from nanovllm.router.faces.auth import AuthError, TokenTable, parse_tokens, token_name
from nanovllm.router.fleet.workers import CHANNEL_OPTIONS
from nanovllm.server_process import ServerProcess
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.certs import CertificateAuthority, Issued
from tests.metrics import exposition, scrape, value
from tests.services import (
    CALL_TIMEOUT_S,
    library_errors,
    start_router,
    start_worker,
    wait_for_log,
    wait_idle,
    wait_serving,
)

ALICE = "alice-0123456789abcdef"  # named alice in the tokens file
BOB = "bob-token-fedcba9876543210"  # unnamed: token-<sha256 prefix>
LONG = generate_pb2.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
SHORT = generate_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SECRET_PROMPT = "the launch code is 7-4-1-9"


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def creds(ca: Path, issued: Issued | None = None) -> grpc.ChannelCredentials:
    """Trust `ca`; present `issued` as the client certificate when given."""
    if issued is None:
        return grpc.ssl_channel_credentials(ca.read_bytes())
    return grpc.ssl_channel_credentials(ca.read_bytes(), issued.key.read_bytes(), issued.cert.read_bytes())


@dataclass
class Pki:
    root: Path
    a: CertificateAuthority
    b: CertificateAuthority
    x: CertificateAuthority
    bundle: Path  # a + b: what routers and test clients trust for workers
    worker: Issued  # the worker's certificate (from a), rotated in a test
    router: Issued  # the routers' client certificate (from a)
    public: Issued  # the main router's public certificate (from a)
    tokens: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    a, b, x = (CertificateAuthority(root / n, n) for n in ("ca-a", "ca-b", "ca-x"))
    bundle = root / "bundle.crt"
    bundle.write_bytes(a.ca_path.read_bytes() + b.ca_path.read_bytes())
    tokens = root / "tokens"
    tokens.write_text(f"# comment\n\nalice:{ALICE}\n{BOB}\n")
    return Pki(root, a, b, x, bundle, a.issue("worker"), a.issue("router"), a.issue("public"), tokens)


def worker_tls(pki: Pki) -> list[str]:
    """A router's flags for mutual TLS to the worker."""
    return [
        *("--worker-tls-cert", str(pki.router.cert), "--worker-tls-key", str(pki.router.key)),
        *("--worker-tls-ca", str(pki.bundle)),
    ]


def public_tls(issued: Issued) -> list[str]:
    return ["--tls-cert", str(issued.cert), "--tls-key", str(issued.key)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Secured:
    worker: ServerProcess
    router: ServerProcess  # public TLS from a, auth with the tokens file
    health_port: int
    logs: Path


@pytest.fixture(scope="module")
def secured(pki: Pki, qwen3_dir: Path, kernels, tmp_path_factory) -> Iterator[Secured]:
    logs = tmp_path_factory.mktemp("secure-logs")
    health_port = free_port()
    worker = start_worker(
        qwen3_dir,
        *("--worker-tls-cert", str(pki.worker.cert), "--worker-tls-key", str(pki.worker.key)),
        *("--worker-tls-ca", str(pki.a.ca_path), "--health-port", str(health_port)),
        log_path=logs / "worker.log",
    )
    router = start_router(
        [worker.address],
        *worker_tls(pki),
        *public_tls(pki.public),
        *("--auth-tokens-file", str(pki.tokens)),
        log_path=logs / "router.log",
    )
    try:
        wait_serving(router.address, credentials=creds(pki.a.ca_path))
        yield Secured(worker, router, health_port, logs)
    finally:
        router.stop()
        worker.stop()


def router_stub(address: str, ca: Path) -> tuple[grpc.Channel, generate_pb2_grpc.GenerationStub]:
    channel = grpc.secure_channel(address, creds(ca))
    return channel, generate_pb2_grpc.GenerationStub(channel)


def generate(address: str, ca: Path, token: str | None, sampling=SHORT, text: str = "hello"):
    """All responses of one call, or the RpcError that ended it."""
    channel, stub = router_stub(address, ca)
    with channel:
        request = generate_pb2.GenerateRequest(text=text, sampling=sampling)
        try:
            return list(stub.Generate(request, metadata=bearer(token) if token else None, timeout=60))
        except grpc.RpcError as exc:
            return exc


def worker_get_load(address: str, credentials: grpc.ChannelCredentials) -> grpc.RpcError | None:
    with grpc.secure_channel(address, credentials) as channel:
        try:
            worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=30)
        except grpc.RpcError as exc:
            return exc
    return None


# --- TLS and mutual TLS ---------------------------------------------------------------------------------


def test_plaintext_to_a_tls_port_fails(secured: Secured, pki: Pki) -> None:
    """A plaintext client gets no answer from the router's TLS port or the worker's mTLS port, not even
    health; the same calls over TLS work."""
    for address in (secured.router.address, secured.worker.address):
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as exc:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, address
    responses = generate(secured.router.address, pki.a.ca_path, ALICE)
    assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert worker_get_load(secured.worker.address, creds(pki.bundle, pki.router)) is None


def test_worker_refuses_a_peer_without_a_client_certificate(secured: Secured, pki: Pki) -> None:
    """TLS without a client certificate fails the handshake: no RPC of the worker runs."""
    error = worker_get_load(secured.worker.address, creds(pki.bundle))
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    # The router's own connection is unaffected.
    assert generate(secured.router.address, pki.a.ca_path, ALICE)[-1].usage.completion_tokens == 8


def test_a_certificate_from_another_ca_is_refused(secured: Secured, pki: Pki) -> None:
    """A client certificate signed by an untrusted CA is refused by the worker; a client that does not trust
    the servers' CA refuses the router and the worker."""
    intruder = pki.x.issue("intruder")
    error = worker_get_load(secured.worker.address, creds(pki.bundle, intruder))
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    error = worker_get_load(secured.worker.address, creds(pki.x.ca_path, pki.router))
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    error = generate(secured.router.address, pki.x.ca_path, ALICE)
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE


def test_health_port_is_plaintext_and_serves_health_alone(secured: Secured, pki: Pki) -> None:
    """--health-port: probes that cannot speak TLS read the worker's health there; nothing else is served."""
    with grpc.insecure_channel(f"127.0.0.1:{secured.health_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        liveness = health_pb2.HealthCheckRequest(service="nanovllm.liveness")
        assert health_pb2_grpc.HealthStub(channel).Check(liveness, timeout=10).status == health.SERVING
        with pytest.raises(grpc.RpcError) as exc:
            worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_public_port_with_client_certificates(secured: Secured, pki: Pki) -> None:
    """--tls-client-ca: the public port refuses clients without a certificate from that CA."""
    router = start_router(
        [secured.worker.address],
        *worker_tls(pki),
        *public_tls(pki.public),
        "--tls-client-ca",
        str(pki.b.ca_path),
    )
    try:
        client = pki.b.issue("client")
        wait_serving(router.address, credentials=creds(pki.a.ca_path, client))
        for refused in (creds(pki.a.ca_path), creds(pki.a.ca_path, pki.x.issue("client-x"))):
            with grpc.secure_channel(router.address, refused) as channel:
                with pytest.raises(grpc.RpcError) as exc:
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        router.stop()


def test_nanovllm_client_speaks_tls_with_a_token(secured: Secured, pki: Pki) -> None:
    """`nanovllm client --tls-ca` with NANOVLLM_TOKEN streams an answer; without the token it says why."""
    command = [sys.executable, "-m", "nanovllm.cli", "client", "--router", secured.router.address]
    command += ["--tls-ca", str(pki.a.ca_path), "--completion", "--max-tokens", "5", "hello"]
    env = {**os.environ, "NANOVLLM_TOKEN": ALICE}
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert re.search(r"\[length: \d+ prompt, 5 completion tokens\]", done.stderr), done.stderr
    env.pop("NANOVLLM_TOKEN")
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1 and "UNAUTHENTICATED" in done.stderr


def test_public_certificate_rotation_mid_stream_keeps_the_stream(
    secured: Secured, pki: Pki, tmp_path: Path
) -> None:
    """The router's public certificate files are replaced by one from CA b while a stream runs: the stream
    completes with every token on its connection, new connections get the new certificate (a client that
    trusts only b connects, one that trusts only a is refused)."""
    public = pki.a.issue("rotating", cert=tmp_path / "tls.crt", key=tmp_path / "tls.key")
    router = start_router([secured.worker.address], *worker_tls(pki), *public_tls(public))
    try:
        wait_serving(router.address, credentials=creds(pki.a.ca_path))
        channel, stub = router_stub(router.address, pki.a.ca_path)
        with channel:
            stream = stub.Generate(generate_pb2.GenerateRequest(text="rotate", sampling=LONG), timeout=120)
            first = next(stream)
            pki.b.issue("rotating", cert=public.cert, key=public.key)
            wait_serving(router.address, timeout=30, credentials=creds(pki.b.ca_path))  # new handshake: b
            error = generate(router.address, pki.a.ca_path, None)
            assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(stream)
        assert rest[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert rest[-1].usage.completion_tokens == 200
        assert first.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED
    finally:
        router.stop()


def test_worker_certificate_rotation_mid_stream_keeps_the_stream(secured: Secured, pki: Pki) -> None:
    """The worker's certificate is replaced by one from CA b while a stream runs through the router: the
    stream completes; a new connection that trusts only b reaches the worker (the new certificate)."""
    channel, stub = router_stub(secured.router.address, pki.a.ca_path)
    with channel:
        request = generate_pb2.GenerateRequest(text="rotate the worker", sampling=LONG)
        stream = stub.Generate(request, metadata=bearer(ALICE), timeout=CALL_TIMEOUT_S)
        next(stream)
        before = worker_get_load(secured.worker.address, creds(pki.b.ca_path, pki.router))
        assert before is not None and before.code() == grpc.StatusCode.UNAVAILABLE  # still a's certificate
        pki.b.issue("worker", cert=pki.worker.cert, key=pki.worker.key)
        assert worker_get_load(secured.worker.address, creds(pki.b.ca_path, pki.router)) is None
        rest = list(stream)
    assert rest[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert rest[-1].usage.completion_tokens == 200
    assert wait_for_log(secured.logs / "worker.log", "tls_reloaded")["reloads"] == 1
    wait_idle(secured.worker.address, credentials=creds(pki.bundle, pki.router))


def test_router_client_certificate_rotation_reaches_new_connections(
    secured: Secured, pki: Pki, tmp_path: Path
) -> None:
    """The router's side of the link (ReloadingChannel, against the real worker): after its certificate
    files change, the next call opens a new connection with the new certificate (one from CA x is refused,
    then one from a accepted again), while a stream opened before keeps its connection."""
    client = pki.a.issue("router-rotating", cert=tmp_path / "tls.crt", key=tmp_path / "tls.key")
    files = TlsFiles(str(client.cert), str(client.key), str(pki.bundle))

    async def run() -> None:
        channel = ReloadingChannel(secured.worker.address, files, CHANNEL_OPTIONS)
        try:
            health, worker = health_pb2_grpc.HealthStub(channel), worker_pb2_grpc.WorkerStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            await worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=30)
            pki.x.issue("router-rotating", cert=client.cert, key=client.key)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=30)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert not watch.done()  # the stream opened before the rotation is still open
            pki.a.issue("router-rotating", cert=client.cert, key=client.key)
            await worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=30)
            assert channel.reloads == 2
            watch.cancel()
        finally:
            await channel.close()

    asyncio.run(run())


# --- auth -------------------------------------------------------------------------------------------------


def test_every_auth_case(secured: Secured, pki: Pki) -> None:
    """No metadata or not a bearer token: UNAUTHENTICATED; an unknown token: PERMISSION_DENIED; a named or
    unnamed token from the file: served. Tokenize and GetModelInfo need a token too."""
    address, ca = secured.router.address, pki.a.ca_path
    channel, stub = router_stub(address, ca)
    request = generate_pb2.GenerateRequest(text="hello", sampling=SHORT)
    cases = [
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ([("authorization", f"Basic {ALICE}")], grpc.StatusCode.UNAUTHENTICATED),
        ([("authorization", "Bearer ")], grpc.StatusCode.UNAUTHENTICATED),
        (bearer("not-a-valid-token-at-all"), grpc.StatusCode.PERMISSION_DENIED),
        (bearer(ALICE + "x"), grpc.StatusCode.PERMISSION_DENIED),
        (bearer(ALICE.upper()), grpc.StatusCode.PERMISSION_DENIED),
    ]
    with channel:
        for metadata, code in cases:
            for call in (
                lambda m: list(stub.Generate(request, metadata=m, timeout=30)),
                lambda m: stub.Tokenize(generate_pb2.TokenizeRequest(text="hi"), metadata=m, timeout=30),
                lambda m: stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=m, timeout=30),
            ):
                with pytest.raises(grpc.RpcError) as exc:
                    call(metadata)
                assert exc.value.code() == code, metadata
                assert ALICE not in exc.value.details()
        for token in (ALICE, BOB):
            responses = list(stub.Generate(request, metadata=bearer(token), timeout=30))
            assert responses[-1].usage.completion_tokens == 8
            assert stub.Tokenize(generate_pb2.TokenizeRequest(text="hi"), metadata=bearer(token)).token_ids
        # "bearer" in any case, surrounding spaces ignored
        info = stub.GetModelInfo(
            generate_pb2.GetModelInfoRequest(), metadata=[("authorization", f"bearer  {BOB}")]
        )
        assert info.num_workers == 1


def test_health_and_reflection_need_no_token(secured: Secured, pki: Pki) -> None:
    with grpc.secure_channel(secured.router.address, creds(pki.a.ca_path)) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert "nanovllm.v1.Generation" in services


def test_tokens_and_prompts_stay_out_of_logs_and_metrics(secured: Secured, pki: Pki) -> None:
    """The router's log names the caller (alice, token-<hash>) but holds neither token nor prompt."""
    for token in (ALICE, BOB):
        responses = generate(secured.router.address, pki.a.ca_path, token, text=SECRET_PROMPT)
        assert responses[-1].usage.completion_tokens == 8
    generate(secured.router.address, pki.a.ca_path, "wrong-token-0123456789")
    log = secured.logs / "router.log"
    wait_for_log(log, "request_finished", client="alice")
    wait_for_log(log, "request_finished", client=token_name(BOB))
    text = log.read_text() + (secured.logs / "worker.log").read_text()
    for secret in (ALICE, BOB, "wrong-token-0123456789", "launch code"):
        assert secret not in text
    metrics_text = exposition(secured.router.metrics_address)
    assert 'nanovllm:access_denied_total{reason="permission_denied"}' in metrics_text
    for secret in (ALICE, BOB, "alice", "launch code"):
        assert secret not in metrics_text


def test_prompt_logged_only_when_enabled(secured: Secured, pki: Pki, tmp_path: Path) -> None:
    router = start_router(
        [secured.worker.address], *worker_tls(pki), "--log-request-content", log_path=tmp_path / "r.log"
    )
    try:
        wait_serving(router.address)
        with grpc.insecure_channel(router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            list(stub.Generate(generate_pb2.GenerateRequest(text=SECRET_PROMPT, sampling=SHORT), timeout=60))
        line = wait_for_log(tmp_path / "r.log", "request_finished")
        assert line["prompt"] == SECRET_PROMPT and line["client"] == "anonymous"
    finally:
        router.stop()


def test_the_tokens_file_is_read_again_when_it_changes(secured: Secured, pki: Pki, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:{ALICE}\n")
    router = start_router(
        [secured.worker.address],
        *worker_tls(pki),
        "--auth-tokens-file",
        str(tokens),
        log_path=tmp_path / "r.log",
    )
    try:
        wait_serving(router.address)
        with grpc.insecure_channel(router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            info = generate_pb2.GetModelInfoRequest()
            assert stub.GetModelInfo(info, metadata=bearer(ALICE), timeout=10).num_workers == 1
            tmp = tmp_path / "tokens.new"
            tmp.write_text(f"bob:{BOB}\n")
            tmp.replace(tokens)  # as the kubelet swaps a Secret's files
            assert stub.GetModelInfo(info, metadata=bearer(BOB), timeout=10).num_workers == 1
            with pytest.raises(grpc.RpcError) as exc:
                stub.GetModelInfo(info, metadata=bearer(ALICE), timeout=10)
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        router.stop()


# --- per-token limits -------------------------------------------------------------------------------------


HELD_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


def test_concurrent_stream_limit_per_token(secured: Secured, pki: Pki, tmp_path: Path) -> None:
    """--max-streams-per-token 1: alice's second stream gets RESOURCE_EXHAUSTED with a retry-after while
    her first runs; bob's is served; once alice's first ends her next call is served."""
    router = start_router(
        [secured.worker.address],
        *worker_tls(pki),
        *("--auth-tokens-file", str(pki.tokens), "--max-streams-per-token", "1"),
        *("--stall-timeout", "600"),
    )
    try:
        wait_serving(router.address)
        # Alice's first stream stays open until she reads it, however fast the worker generates: its
        # channel's small, fixed HTTP/2 window holds the router's writes back (and the stall timeout is
        # long), where a default window would take all 200 tokens and let the stream end.
        held = grpc.insecure_channel(router.address, options=HELD_WINDOW)
        with held, grpc.insecure_channel(router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            request = generate_pb2.GenerateRequest(text="hold", sampling=LONG)
            first = generate_pb2_grpc.GenerationStub(held).Generate(
                request, metadata=bearer(ALICE), timeout=CALL_TIMEOUT_S
            )
            next(first)
            short = generate_pb2.GenerateRequest(text="again", sampling=SHORT)
            second = stub.Generate(short, metadata=bearer(ALICE), timeout=30)
            with pytest.raises(grpc.RpcError) as exc:
                list(second)
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "alice has 1 streams open (limit 1 per token)" in exc.value.details()
            assert dict(exc.value.trailing_metadata())["retry-after"] == "1"
            assert (
                list(stub.Generate(short, metadata=bearer(BOB), timeout=30))[-1].usage.completion_tokens == 8
            )
            assert list(first)[-1].usage.completion_tokens == 200
            assert list(stub.Generate(short, metadata=bearer(ALICE), timeout=30))[-1].finish_reason
        assert (
            value(scrape(router.metrics_address), "nanovllm:access_denied_total", reason="stream_limit") == 1
        )
    finally:
        router.stop()


def test_tokens_per_minute_limit_per_token(secured: Secured, pki: Pki) -> None:
    """--tokens-per-minute-per-token 40: a call of 2 prompt + 50 completion tokens is served (a stream is
    never cut off), the next gets RESOURCE_EXHAUSTED with the numbers and a retry-after of at most 60 s;
    another token is unaffected."""
    router = start_router(
        [secured.worker.address],
        *worker_tls(pki),
        *("--auth-tokens-file", str(pki.tokens), "--tokens-per-minute-per-token", "40"),
    )
    try:
        wait_serving(router.address)
        with grpc.insecure_channel(router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
            request = generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=[5, 6]), sampling=sampling
            )
            assert (
                list(stub.Generate(request, metadata=bearer(ALICE), timeout=60))[-1].usage.completion_tokens
                == 50
            )
            with pytest.raises(grpc.RpcError) as exc:
                list(stub.Generate(request, metadata=bearer(ALICE), timeout=60))
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (
                "alice used 52 tokens in the last 60 s (limit 40 per token); retry after"
                in exc.value.details()
            )
            assert 1 <= int(dict(exc.value.trailing_metadata())["retry-after"]) <= 60
            assert (
                list(stub.Generate(request, metadata=bearer(BOB), timeout=60))[-1].usage.completion_tokens
                == 50
            )
    finally:
        router.stop()


def test_token_window_slides_over_60_seconds() -> None:
    """TokenLimits on a clock the test moves: usage leaves the window 60 s after it was counted, and the
    retry hint is the time until enough of it has left."""
    now = [1000.0]
    limits = TokenLimits(max_streams=0, tokens_per_minute=100, clock=lambda: now[0])
    lease = limits.admit("a")
    lease.charge(70)
    now[0] += 30
    lease.charge(40)
    lease.close()
    with pytest.raises(Exception, match=r"used 110 tokens .* retry after 30.0 s") as exc:
        limits.admit("a")
    assert exc.value.retry_after_s == pytest.approx(30.0)
    limits.admit("b").close()  # another token has its own window
    now[0] += 30  # the 70 leave the window
    limits.admit("a").close()


# --- the HTTP face -----------------------------------------------------------------------------------------


def https_client(router: ServerProcess, ca: Path, key: str, issued: Issued | None = None) -> openai.OpenAI:
    """The openai client on the router's HTTP face over TLS, trusting `ca`, presenting `issued` if given."""
    verify = ssl.create_default_context(cafile=str(ca))
    if issued is not None:
        verify.load_cert_chain(issued.cert, issued.key)
    return openai.OpenAI(
        base_url=f"https://{router.http_address}/v1",
        api_key=key,
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=verify, timeout=CALL_TIMEOUT_S),
    )


def test_https_face_with_token_limits_and_certificate_rotation(
    secured: Secured, pki: Pki, tmp_path: Path
) -> None:
    """The HTTP face takes the gRPC port's certificate flags and per-token limits: over TLS, alice's call
    past --tokens-per-minute-per-token is a 429 (openai.RateLimitError) with the numbers and a Retry-After,
    bob is served, plaintext is refused; after the certificate files are replaced by ones from CA b, new
    connections get the new certificate."""
    public = pki.a.issue("rotating-https", cert=tmp_path / "tls.crt", key=tmp_path / "tls.key")
    router = start_router(
        [secured.worker.address],
        *worker_tls(pki),
        *public_tls(public),
        *("--http-port", "0", "--auth-tokens-file", str(pki.tokens), "--tokens-per-minute-per-token", "40"),
        log_path=tmp_path / "router.log",
    )
    try:
        wait_serving(router.address, credentials=creds(pki.a.ca_path))
        alice = https_client(router, pki.a.ca_path, ALICE)
        model = alice.models.list().data[0].id
        call = {"model": model, "prompt": [5, 6], "max_tokens": 50, "extra_body": {"ignore_eos": True}}
        assert alice.completions.create(**call).usage.completion_tokens == 50
        with pytest.raises(openai.RateLimitError) as limited:
            alice.completions.create(**call)
        assert "alice used 52 tokens in the last 60 s (limit 40 per token)" in limited.value.message
        assert 1 <= int(limited.value.response.headers["retry-after"]) <= 60
        assert (
            https_client(router, pki.a.ca_path, BOB).completions.create(**call).usage.completion_tokens == 50
        )
        with pytest.raises(OSError):  # the TLS handshake fails on plaintext, and the connection closes
            urllib.request.urlopen(f"http://{router.http_address}/health", timeout=30)

        pki.b.issue("rotating-https", cert=public.cert, key=public.key)
        assert https_client(router, pki.b.ca_path, BOB).models.list().data
        with pytest.raises(openai.APIConnectionError):
            https_client(router, pki.a.ca_path, BOB).models.list()
        assert wait_for_log(tmp_path / "router.log", "tls_reloaded")["reloads"] == 1
    finally:
        router.stop()
    assert library_errors(tmp_path / "router.log") == []


def test_https_face_asks_for_client_certificates_with_tls_client_ca(secured: Secured, pki: Pki) -> None:
    """--tls-client-ca holds for the HTTP face as for gRPC: no certificate, or one from another CA, cannot
    connect; one from that CA is served."""
    router = start_router(
        [secured.worker.address],
        *worker_tls(pki),
        *public_tls(pki.public),
        *("--tls-client-ca", str(pki.b.ca_path), "--http-port", "0"),
    )
    try:
        client = pki.b.issue("https-client")
        wait_serving(router.address, credentials=creds(pki.a.ca_path, client))
        assert https_client(router, pki.a.ca_path, "none", client).models.list().data
        for refused in (None, pki.x.issue("https-client-x")):
            with pytest.raises(openai.APIConnectionError):
                https_client(router, pki.a.ca_path, "none", refused).models.list()
    finally:
        router.stop()


# --- bad input at start-up -------------------------------------------------------------------------------


def _fails_at_start(args: list[str]) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "nanovllm.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "listening on" not in result.stdout, result
    return result.stderr


ROUTER = ["router", "--worker", "127.0.0.1:1", "--port", "0", "--metrics-port", "0"]


@pytest.mark.slow
def test_missing_or_unreadable_tls_files_fail_the_start_naming_the_file(
    pki: Pki, qwen3_dir: Path, tmp_path: Path
) -> None:
    """A router and a worker given a certificate, key or CA path that does not exist or cannot be read
    (a directory) exit before listening, naming the flag and the file."""
    worker = ["worker", "--model", str(qwen3_dir), "--port", "0", "--metrics-port", "0"]
    files = {"cert": pki.router.cert, "key": pki.router.key, "ca": pki.a.ca_path}
    for command, which, bad in [
        (ROUTER, "cert", tmp_path / "missing.pem"),
        (ROUTER, "ca", tmp_path),
        (worker, "key", tmp_path / "missing.pem"),
        (worker, "ca", tmp_path),
    ]:
        flags = [f"--worker-tls-{k}={v}" for k, v in {**files, which: bad}.items()]
        assert f"--worker-tls-{which} {bad}: cannot read the file" in _fails_at_start([*command, *flags])


def test_tls_file_checks(pki: Pki, tmp_path: Path) -> None:
    """Every file of a TLS set is read and parsed at start; a missing partner flag is named."""
    good = TlsFiles(str(pki.router.cert), str(pki.router.key), str(pki.a.ca_path))
    assert good.check(need_identity=True, need_ca=True).cert == pki.router.cert.read_bytes()
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    for files, need_ca, message in [
        (
            TlsFiles(str(tmp_path / "nope"), good.key, good.ca),
            True,
            "--tls-cert .*nope: cannot read the file",
        ),
        (
            TlsFiles(good.cert, str(tmp_path), good.ca),
            True,
            "--tls-key .*: cannot read the file .Is a directory",
        ),
        (TlsFiles(good.cert, good.key, str(not_pem)), True, "--tls-ca .*not.pem: not a PEM file"),
        (
            TlsFiles(good.cert, str(pki.public.key), None),
            False,
            "unusable .*is the key that of the certificate",
        ),
        (TlsFiles(good.cert, None, good.ca), True, "--tls-key is required with --tls-cert"),
        (TlsFiles(None, None, good.ca), True, "--tls-cert and --tls-key are required with --tls-ca"),
        (TlsFiles(good.cert, good.key, None), True, "--tls-ca is required with --tls-cert and --tls-key"),
    ]:
        with pytest.raises(ConfigError, match=message):
            files.check(need_identity=True, need_ca=need_ca)


def test_bad_public_certificate_and_tokens_files_fail_the_start_naming_the_file(
    pki: Pki, tmp_path: Path
) -> None:
    stderr = _fails_at_start([*ROUTER, "--tls-cert", str(pki.public.cert), "--tls-key", str(pki.router.key)])
    assert f"certificate {pki.public.cert} with key {pki.router.key}: unusable" in stderr
    tokens = tmp_path / "tokens"
    assert f"--auth-tokens-file {tokens}: cannot read the file" in _fails_at_start(
        [*ROUTER, "--auth-tokens-file", str(tokens)]
    )
    tokens.write_text("alice:short\n")
    stderr = _fails_at_start([*ROUTER, "--auth-tokens-file", str(tokens)])
    assert f"--auth-tokens-file {tokens} line 1: a token has at least 16 characters, got 5" in stderr


def test_tokens_file_format(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# ops\nalice:{ALICE}\n\n  {BOB}  \ncolon:{ALICE}:x\n")
    tokens = parse_tokens(str(path))
    assert tokens["alice"] == ALICE and tokens["colon"] == f"{ALICE}:x"
    (unnamed,) = [n for n in tokens if n.startswith("token-")]
    assert tokens[unnamed] == BOB and len(unnamed) == len("token-") + 8
    for text, message in [
        ("", "no token"),
        (f"a:{ALICE}\na:{BOB}\n", "line 2: the name 'a' is used twice"),
        (f"a:{ALICE}\nb:{ALICE}\n", "line 2: the same token appears twice"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            parse_tokens(str(path))


def test_a_tokens_file_of_ten_thousand_tokens(tmp_path: Path) -> None:
    """Each token finds its own name, a token one character off is refused, and a repeat is found however far
    apart the two lines are."""
    path = tmp_path / "tokens"
    tokens = {f"client{i}": f"{i:05d}-{os.urandom(12).hex()}" for i in range(10_000)}
    path.write_text("".join(f"{name}:{token}\n" for name, token in tokens.items()))
    table = TokenTable(str(path))
    for name, token in tokens.items():
        assert table.identify([("authorization", f"Bearer {token}")]) == name
    near_miss = tokens["client7"][:-1] + ("0" if tokens["client7"][-1] != "0" else "1")
    with pytest.raises(AuthError) as refused:
        table.identify([("authorization", f"Bearer {near_miss}")])
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    path.write_text(path.read_text() + f"again:{tokens['client0']}\n")
    with pytest.raises(ConfigError, match="line 10001: the same token appears twice"):
        parse_tokens(str(path))
