"""The servers' settings: a worker's, a router's and the limits a router puts on each request. Each field
declared with `option` is also a flag of `nanovllm worker` / `nanovllm router` (see common/options.py)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from nanovllm.common.errors import ConfigError
from nanovllm.common.options import flag_name, option
from nanovllm.common.pooling import EMBED_INSTRUCTION, RERANK_INSTRUCTION, check_format
from nanovllm.common.tls import TlsFiles

# --reasoning-parser's values (router/calls/reasoning.py): auto, none, or a model family's marker format.
REASONING_PARSERS = ("auto", "none", "qwen3")
# --tool-call-parser's values (router/calls/tool_calls.py).
TOOL_CALL_PARSERS = ("auto", "none", "hermes", "qwen3_coder")

HEALTH_PORT_HELP = (
    "also serve grpc.health.v1 alone, in plaintext, on this port (0 picks a free one): for Kubernetes gRPC "
    "probes, which cannot speak TLS; unset: no such port"
)


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry traces (common/tracing.py): off unless an OTLP endpoint is set here or in the standard
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT variables."""

    otlp_traces_endpoint: str | None = option(
        None,
        help="send OpenTelemetry traces to this OTLP/gRPC collector, e.g. http://otel-collector:4317 (https:// "
        "for TLS); unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing",
    )
    trace_sample_ratio: float = option(
        1.0,
        help="share of new traces recorded, in [0, 1]; a caller's traceparent decides for its own trace",
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.trace_sample_ratio <= 1.0:  # NaN fails too
            raise ConfigError(f"--trace-sample-ratio must be in [0, 1], got {self.trace_sample_ratio}")


@dataclass
class WorkerServerConfig:
    host: str = option("0.0.0.0", help="address to listen on")
    port: int = option(50061, help="port to listen on (0 picks a free one)")
    metrics_port: int = option(9091, help="port of the Prometheus /metrics endpoint (0 picks a free one)")
    max_queued_requests: int = option(1024, help="waiting requests beyond this get RESOURCE_EXHAUSTED")
    served_model_name: str | None = option(
        None,
        help="the name clients call the model by (GenerateRequest.model, OpenAI's model); default: the "
        "model's own (its directory's or Hugging Face cache entry's, or its GGUF file's without the "
        "quantization tag)",
    )
    drain_timeout_s: float = option(
        30.0, flag="--drain-timeout", help="on SIGTERM, seconds requests in flight may take to finish"
    )
    # After the drain, how long to let the final (aborted) step outputs reach the routers.
    shutdown_grace_s: float = 2.0
    worker_tls_cert: str | None = option(
        None, help="PEM certificate (chain) this worker presents to routers; turns on mutual TLS"
    )
    worker_tls_key: str | None = option(None, help="PEM private key of --worker-tls-cert")
    worker_tls_ca: str | None = option(
        None, help="PEM CA bundle: routers must present a certificate it signed (required with TLS)"
    )
    health_port: int | None = option(None, help=HEALTH_PORT_HELP)
    tracing: TracingConfig = TracingConfig()

    @property
    def tls(self) -> TlsFiles:
        """Mutual TLS on the worker's port: its identity, and the CA every router must be signed by."""
        return tls_files(self, "worker_tls_cert", "worker_tls_key", "worker_tls_ca")


def tls_files(config: object, cert: str, key: str, ca: str) -> TlsFiles:
    """The TLS files in `config`'s option fields `cert`, `key` and `ca`, named in errors by their flags."""
    names = (cert, key, ca)
    cert_path, key_path, ca_path = (getattr(config, name) for name in names)
    flags = (flag_name(type(config), cert), flag_name(type(config), key), flag_name(type(config), ca))
    return TlsFiles(cert_path, key_path, ca_path, flags)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may carry. Each bounds the work or memory one request can cost everyone else:
    stop strings and stop ids are checked against every new token, the request id is echoed in every
    response and log line, and the prompt is tokenized before its length is known."""

    max_request_id_bytes: int = option(256, help="longest request_id accepted, in bytes")
    max_stop_strings: int = option(16, help="most stop strings in one request")
    max_stop_string_bytes: int = option(1024, help="longest stop string accepted, in UTF-8 bytes")
    max_stop_token_ids: int = option(256, help="most stop_token_ids in one request")
    max_prompt_bytes: int | None = option(
        None,
        help="largest text or chat prompt accepted, in UTF-8 bytes, checked before tokenizing; default 16 "
        "bytes per token of the model's max_model_len",
    )
    max_images_per_request: int = option(8, help="most images in one request (a vision model's)")
    max_image_bytes: int = option(
        4 * 1024 * 1024,
        help="largest image file accepted, in bytes (a whole gRPC request or HTTP body is also held to 4 MiB)",
    )
    max_image_pixels: int = option(
        4096 * 4096,
        help="most pixels (width x height) an image may decode to, checked from its header before decoding",
    )
    image_url_hosts: list[str] = option(
        default_factory=list,
        help="hosts the router may fetch http(s) image URLs from: a name, or *.DOMAIN for its subdomains; "
        "repeatable; none (the default): images come as data: URLs or bytes only",
    )
    image_url_timeout_s: float = option(
        5.0,
        flag="--image-url-timeout",
        help="longest an image URL's fetch may take, connecting and reading, in seconds",
    )
    max_pooling_inputs: int = option(
        256, help="most inputs (texts, token-id lists, documents) in one embeddings, rerank or score call"
    )
    # English averages about 4 bytes per token: a prompt over 16 per token of max_model_len cannot fit.
    prompt_bytes_per_token: int = 16

    def __post_init__(self) -> None:
        for name in ("max_images_per_request", "max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"{flag_name(RequestLimits, name)} must be at least 1, got {getattr(self, name)}"
                )
        if not self.image_url_timeout_s > 0:
            raise ConfigError(
                f"--image-url-timeout must be more than 0 seconds, got {self.image_url_timeout_s:g}"
            )

    def prompt_bytes(self, max_model_len: int) -> int:
        return self.max_prompt_bytes or self.prompt_bytes_per_token * max_model_len


class RoutingPolicy(str, Enum):
    """How the router picks a worker (router/fleet/routing.py)."""

    COST = "cost"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class RoutingConfig:
    """How the router picks a worker (router/fleet/routing.py): the policy and its cost function's weights.
    `policy` is given as its name (a flag's string) and kept as the RoutingPolicy it names."""

    policy: str = option(
        "cost",
        flag="--routing",
        help="cost: expected prefix-cache hits against load (the default); least-loaded: the shortest "
        "queue; round-robin: in turn (both ignore the cache, for comparison)",
    )
    queued_request_cost: float = option(
        64.0,
        help="routing: how many prompt tokens to prefill one request queued on a worker is worth, against "
        "the tokens its prefix cache would save",
    )
    offloaded_token_cost: float = option(
        0.25,
        help="routing: what a prompt token held in a worker's host-memory or disk KV tier costs (copied "
        "up), against 1 for a token to prefill and 0 for one on the device",
    )
    hotspot_ratio: float = option(
        1.25, help="routing: a worker whose queue is over this times the fleet's mean takes nothing new"
    )
    hotspot_slack: int = option(
        4, help="routing: a worker within this many requests of the fleet's mean queue is never a hotspot"
    )

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "policy", RoutingPolicy(self.policy))
        except ValueError:
            names = ", ".join(p.value for p in RoutingPolicy)
            raise ConfigError(f"--routing must be one of {names}, got {self.policy!r}") from None
        if not 0.0 <= self.offloaded_token_cost <= 1.0:  # NaN fails too
            raise ConfigError(f"--offloaded-token-cost must be in [0, 1], got {self.offloaded_token_cost}")


@dataclass
class RouterConfig:
    workers: list[str] = option(
        flag="--worker",
        required=True,
        default_factory=list,
        help="worker HOST:PORT, where HOST may be a DNS name with one record per worker (a Kubernetes "
        "headless Service), or dns://NAMESERVER/HOST:PORT; repeat for several",
    )
    discovery_interval_s: float = option(
        5.0,
        flag="--discovery-interval",
        help="seconds between lookups of worker names (new and gone workers)",
    )
    host: str = option("0.0.0.0", help="address to listen on")
    port: int = option(50051, help="port to listen on (0 picks a free one)")
    metrics_port: int = option(9090, help="port of the Prometheus /metrics endpoint (0 picks a free one)")
    drain_timeout_s: float = option(
        30.0, flag="--drain-timeout", help="on SIGTERM, seconds streams in flight may take to finish"
    )
    shutdown_grace_s: float = 1.0
    processes: int = option(
        1,
        help="router processes sharing the public gRPC and HTTP ports (SO_REUSEPORT: the kernel deals client "
        "connections among them), for when one process's CPU bounds the tokens a second it streams; each "
        "connects to every worker; the first also serves /metrics (summed over all) and the health port "
        "(docs/serving.md)",
    )
    # Which of the `processes` this one is: 0 starts the others, which get 1, 2, ...
    process_index: int = 0
    limits: RequestLimits = RequestLimits()
    routing: RoutingConfig = RoutingConfig()
    tracing: TracingConfig = TracingConfig()

    http_port: int | None = option(
        None,
        help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, "
        "/health) on this port, with --tls-cert and --tls-key when given (0 picks a free one); unset: off",
    )
    response_store: str = option(
        "auto",
        help="where the HTTP API keeps stored responses (the Responses API's `store`, `previous_response_id`, "
        "`background`): auto (an SQLite file in the user's cache directory, which every router process on "
        "this machine shares), the path of an SQLite file, a Redis URL (redis://HOST:PORT/DB, shared by "
        "router replicas on several machines), or off",
    )
    response_store_ttl_s: float = option(
        30 * 24 * 3600.0, flag="--response-store-ttl", help="seconds a stored response is kept (30 days)"
    )
    response_store_max_bytes: int = option(
        2**30,
        help="the most bytes the response store's file may hold; past them, store true is refused (507)",
    )
    reasoning_parser: str = option(
        "auto",
        help="how responses split a model's reasoning from its answer: auto (from the model: Qwen3's "
        "and Qwen3.5's <think> markers; none for other families), qwen3, or none (the reasoning stays in text)",
    )
    tool_call_parser: str = option(
        "auto",
        help="how tool calls are parsed out of answers: auto (the format the chat template writes calls "
        "in, else by model family: Hermes-style <tool_call> JSON for Qwen2.5 and Qwen3, Qwen3.5's "
        "<function=...> markup for Qwen3.5, 3.6 and 3.8; none for other families), hermes, qwen3_coder, or "
        "none (calls stay in text)",
    )

    embed_query_format: str | None = option(
        None,
        help="how an embeddings call's query texts (input_type query) are written before they are embedded, "
        "with {instruction} and {query}; unset: Qwen3-Embedding's published format (docs/api.md)",
    )
    embed_instruction: str = option(EMBED_INSTRUCTION, help="the {instruction} of --embed-query-format")
    rerank_format: str | None = option(
        None,
        help="the judge prompt a reranker scores each document in, with {instruction}, {query} and "
        '{document}; its score is sigmoid(logit("yes") - logit("no")) at its last token; unset: '
        "Qwen3-Reranker's published prompt (docs/api.md)",
    )
    rerank_instruction: str = option(
        RERANK_INSTRUCTION, help="the {instruction} of --rerank-format when a call gives none"
    )

    def __post_init__(self) -> None:
        if self.processes < 1:
            raise ConfigError(f"--processes must be at least 1, got {self.processes}")
        if self.stall_timeout_s <= 0:
            raise ConfigError(f"--stall-timeout must be more than 0 seconds, got {self.stall_timeout_s:g}")
        if not self.resume_wait_s >= 0:
            raise ConfigError(f"--resume-wait must be 0 seconds or more, got {self.resume_wait_s:g}")
        if not self.retry_backoff_s >= 0:
            raise ConfigError(f"--retry-backoff must be 0 seconds or more, got {self.retry_backoff_s:g}")
        if not self.response_store_ttl_s > 0:
            raise ConfigError(
                f"--response-store-ttl must be more than 0 seconds, got {self.response_store_ttl_s:g}"
            )
        if self.response_store_max_bytes < 2**20:
            raise ConfigError(
                f"--response-store-max-bytes must be at least 1 MiB (1048576), got {self.response_store_max_bytes}"
            )
        for flag, value in (
            ("--max-buffered-responses", self.max_buffered_responses),
            ("--tokenizer-threads", self.tokenizer_threads),
            ("--max-pooling-inputs", self.limits.max_pooling_inputs),
        ):
            if value < 1:
                raise ConfigError(f"{flag} must be at least 1, got {value}")
        for name, fields in (
            ("embed_query_format", ("instruction", "query")),
            ("rerank_format", ("instruction", "query", "document")),
        ):
            if getattr(self, name) is not None:
                check_format(flag_name(RouterConfig, name), getattr(self, name), fields)
        for name, allowed in (
            ("reasoning_parser", REASONING_PARSERS),
            ("tool_call_parser", TOOL_CALL_PARSERS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                flag = flag_name(RouterConfig, name)
                raise ConfigError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")

    max_attempts: int = option(3, help="workers a request may be tried on before its first token")
    resume_streams: bool = option(
        True,
        flag="--no-resume-streams",
        negate=True,
        help="do not move a stream whose worker fails mid-generation to another worker (it then ends "
        "UNAVAILABLE)",
    )
    max_resumes: int = option(
        8, help="times one stream may move to another worker after its worker failed mid-generation"
    )
    resume_wait_s: float = option(
        10.0,
        flag="--resume-wait",
        help="seconds a stream whose worker failed mid-generation waits for another worker to take it "
        "before it ends UNAVAILABLE",
    )
    retry_backoff_s: float = option(
        0.02,
        flag="--retry-backoff",
        help="seconds before a request's second try on another worker, jittered and doubling with each "
        "further try",
    )
    stall_timeout_s: float = option(
        30.0,
        flag="--stall-timeout",
        help="seconds a client may take no response before its stream is cut off and its request aborted",
    )
    max_buffered_responses: int = option(
        4096,
        help="worker updates a stream may leave queued behind a response its client does not take before "
        "it is cut off",
    )
    tokenizer_threads: int = option(
        2, help="threads that tokenize prompts and render chat templates off the event loop"
    )
    keepalive_time_s: float = option(
        20.0, flag="--keepalive-time", help="seconds between HTTP/2 pings to each client connection"
    )
    keepalive_timeout_s: float = option(
        10.0,
        flag="--keepalive-timeout",
        help="seconds a ping may go unanswered before the connection is closed",
    )
    tls_cert: str | None = option(None, help="PEM certificate (chain) of the public port; turns on TLS")
    tls_key: str | None = option(None, help="PEM private key of --tls-cert")
    tls_client_ca: str | None = option(
        None, help="PEM CA bundle: clients of the public port must present a certificate it signed"
    )
    worker_tls_cert: str | None = option(
        None, help="PEM certificate (chain) the router presents to workers (mutual TLS)"
    )
    worker_tls_key: str | None = option(None, help="PEM private key of --worker-tls-cert")
    worker_tls_ca: str | None = option(
        None, help="PEM CA bundle that signed the workers' certificates; turns on TLS to the workers"
    )
    worker_tls_server_name: str | None = option(
        None, help="name to check the workers' certificates against instead of each worker's host name"
    )
    health_port: int | None = option(None, help=HEALTH_PORT_HELP)
    auth_tokens_file: str | None = option(
        None,
        help="file of bearer tokens, one per line as NAME:TOKEN (or TOKEN alone); turns on auth: calls "
        "without 'authorization: Bearer TOKEN' metadata get UNAUTHENTICATED, other tokens PERMISSION_DENIED",
    )
    admin_tokens_file: str | None = option(
        None,
        help="file of bearer tokens (as --auth-tokens-file) for the Admin service, which loads and unloads "
        "LoRA adapters on the workers; without it admin calls are refused (docs/lora.md)",
    )
    max_streams_per_token: int = option(
        0, help="Generate streams one token may have open at once (0: no limit); more: RESOURCE_EXHAUSTED"
    )
    tokens_per_minute_per_token: int = option(
        0,
        help="prompt plus completion tokens one token may use in any 60 s (0: no limit); a call arriving "
        "when they are used up gets RESOURCE_EXHAUSTED with a retry-after hint",
    )
    log_request_content: bool = option(
        False, help="log each request's prompt (text, chat or token ids) in its request_finished line"
    )

    @property
    def tls(self) -> TlsFiles:
        """TLS on the public port; with tls_client_ca, clients must present a certificate too."""
        return tls_files(self, "tls_cert", "tls_key", "tls_client_ca")

    @property
    def worker_tls(self) -> TlsFiles:
        """TLS to the workers: the CA that signed them, and this router's client certificate."""
        return tls_files(self, "worker_tls_cert", "worker_tls_key", "worker_tls_ca")
