"""The `nanovllm` command.

  nanovllm serve  --model PATH           worker + router on this machine, for local use
  nanovllm worker --model PATH --port P  one worker (deployments)
  nanovllm router --worker HOST:PORT ... the public API in front of one or more workers
  nanovllm client "prompt"               stream an answer from a router to the terminal

Every flag can also be set through an environment variable, NANOVLLM_<FLAG> (e.g. NANOVLLM_MAX_NUM_SEQS);
a flag on the command line wins. `--help` on each subcommand lists them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The line each server prints to stdout once bound: "nanovllm <what> listening on HOST:PORT, metrics on
# HOST:PORT". LISTENING_RE finds the gRPC address in it.
LISTENING = "listening on"
LISTENING_RE = re.compile(r"listening on (\S+?),? ")


@dataclass(frozen=True)
class Flag:
    name: str  # e.g. "--max-num-seqs"
    help: str
    type: Callable[[str], Any] = str
    default: Any = None
    kind: str = "value"  # "value", "switch" (boolean), "list" (repeatable; comma-separated in the env)
    required: bool = False

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return "NANOVLLM_" + self.dest.upper()

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        shown = "" if self.default in (None, False, []) else f"; default {self.default}"
        help_text = f"{self.help} [env {self.env}{shown}]"
        if self.kind == "switch":
            parser.add_argument(self.name, action="store_true", default=None, help=help_text)
        elif self.kind == "list":
            parser.add_argument(self.name, action="append", type=self.type, help=help_text)
        else:
            parser.add_argument(self.name, type=self.type, help=help_text)

    def resolve(self, value: Any) -> Any:
        """The command line's value, else the environment's, else the default."""
        if value is not None:
            return value
        raw = os.environ.get(self.env)
        if raw is None or raw == "":
            if self.required:
                raise SystemExit(f"nanovllm: {self.name} is required (or set {self.env})")
            return self.default
        if self.kind == "switch":
            return raw.strip().lower() in ("1", "true", "yes", "on")
        try:
            if self.kind == "list":
                return [self.type(item.strip()) for item in raw.split(",") if item.strip()]
            return self.type(raw)
        except ValueError as exc:
            raise SystemExit(f"nanovllm: {self.env}={raw!r} is not a valid {self.name}: {exc}") from exc


LOG_FLAGS = [
    Flag("--log-level", "debug, info, warning or error", default="info"),
    Flag("--log-format", "json, console, or auto (json unless stderr is a terminal)", default="auto"),
]
ENGINE_FLAGS = [
    Flag(
        "--model",
        "Hugging Face model directory (config.json + safetensors) or a .gguf file; default: the embedded "
        "SmolLM2-135M-Instruct (GGUF, converted once into ~/.cache/nanovllm/gguf)",
    ),
    Flag("--max-model-len", "longest prompt + output, in tokens", int, 4096),
    Flag("--max-num-seqs", "most requests in one batch", int, 256),
    Flag(
        "--max-num-batched-tokens",
        "most tokens in one step (chunked prefill splits longer prompts)",
        int,
        8192,
    ),
    Flag(
        "--kv-cache-memory",
        "KV cache size: bytes, 2GiB, or a fraction of free RAM (CPU) or of what --gpu-memory-utilization "
        "leaves after weights and activations (CUDA); default 2GiB on CPU, all of that share on CUDA",
    ),
    Flag("--gpu-memory-utilization", "on CUDA, share of GPU memory the engine may use", float, 0.9),
    Flag("--block-size", "tokens per KV-cache block", int, 16),
    Flag("--device", "auto, cpu or cuda", default="auto"),
    Flag(
        "--dtype",
        "auto (bf16 on CUDA and on CPUs with native bf16, else float32), float32, bfloat16 or float16",
        default="auto",
    ),
    Flag("--tensor-parallel-size", "ranks to shard the model over", int, 1),
    Flag("--no-prefix-caching", "turn off reuse of cached prompt prefixes", kind="switch", default=False),
    Flag(
        "--attention-backend",
        "auto (the fastest the device runs), torch, cpu_kernel, triton (CUDA) or flash_attn (CUDA)",
        default="auto",
    ),
    Flag(
        "--num-threads",
        "CPU threads of the model's ops, shared by the tensor-parallel ranks; default: the CPUs this "
        "process may use (its affinity mask, capped by its cgroup CPU limit)",
        int,
    ),
    Flag("--seed", "seed for requests that set none", int, 0),
    Flag("--max-queued-requests", "waiting requests beyond this get RESOURCE_EXHAUSTED", int, 1024),
]
WORKER_FLAGS = [
    Flag("--host", "address to listen on", default="0.0.0.0"),
    Flag("--port", "port to listen on (0 picks a free one)", int, 50061),
    Flag("--metrics-port", "port of the Prometheus /metrics endpoint (0 picks a free one)", int, 9091),
    Flag("--drain-timeout", "on SIGTERM, seconds requests in flight may take to finish", float, 30.0),
    *ENGINE_FLAGS,
    *LOG_FLAGS,
]
ROUTER_FLAGS = [
    Flag("--worker", "worker address HOST:PORT; repeat for several workers", kind="list", required=True),
    Flag("--host", "address to listen on", default="0.0.0.0"),
    Flag("--port", "port to listen on (0 picks a free one)", int, 50051),
    Flag("--metrics-port", "port of the Prometheus /metrics endpoint (0 picks a free one)", int, 9090),
    Flag("--drain-timeout", "on SIGTERM, seconds streams in flight may take to finish", float, 30.0),
    Flag("--max-attempts", "workers a request may be tried on before its first token", int, 3),
    Flag(
        "--stall-timeout",
        "seconds a client may take no response before its stream is cut off and its request aborted",
        float,
        30.0,
    ),
    Flag("--keepalive-time", "seconds between HTTP/2 pings to each client connection", float, 20.0),
    Flag(
        "--keepalive-timeout", "seconds a ping may go unanswered before the connection is closed", float, 10.0
    ),
    Flag(
        "--max-prompt-bytes",
        "largest text or chat prompt accepted, in UTF-8 bytes, checked before tokenizing; default 16 bytes "
        "per token of the model's max_model_len",
        int,
    ),
    *LOG_FLAGS,
]
SERVE_FLAGS = [
    Flag("--host", "address the router listens on", default="127.0.0.1"),
    Flag("--port", "port the router listens on (0 picks a free one)", int, 50051),
    *ENGINE_FLAGS,
    *LOG_FLAGS,
]
CLIENT_FLAGS = [
    Flag("--router", "router address HOST:PORT", default="127.0.0.1:50051"),
    Flag(
        "--completion",
        "send the prompt as plain text to continue, instead of a user chat message (the default, rendered "
        "with the model's chat template)",
        kind="switch",
    ),
    Flag("--system", "system message of the chat"),
    Flag("--max-tokens", "most tokens to generate", int, 256),
    Flag("--temperature", "0 is greedy", float, 0.0),
    Flag("--top-p", "nucleus sampling mass", float, 1.0),
    Flag("--stop", "stop string; repeatable", kind="list", default=[]),
]


def _resolve(flags: Sequence[Flag], args: argparse.Namespace) -> dict[str, Any]:
    return {flag.dest: flag.resolve(getattr(args, flag.dest)) for flag in flags}


def _configure_logging(options: dict[str, Any]) -> None:
    from nanovllm.common.logging import configure_logging

    fmt = options["log_format"]
    configure_logging(options["log_level"], json=None if fmt == "auto" else fmt == "json")


def _announce(what: str) -> Callable[[str, str], None]:
    def announce(address: str, metrics_address: str) -> None:
        print(f"nanovllm {what} {LISTENING} {address}, metrics on {metrics_address}", flush=True)

    return announce


def resolve_model(model: str | None) -> str:
    """The model directory to load: as given, converted from GGUF (once, cached), or the embedded model."""
    if model is not None and not model.endswith(".gguf"):
        return model
    from nanovllm.worker.gguf import embedded_model_path, prepare_gguf

    return str(prepare_gguf(Path(model) if model else embedded_model_path()))


def _engine_config(options: dict[str, Any]):
    from nanovllm.common.config import EngineConfig

    return EngineConfig(
        model=resolve_model(options["model"]),
        max_model_len=options["max_model_len"],
        max_num_seqs=options["max_num_seqs"],
        max_num_batched_tokens=options["max_num_batched_tokens"],
        kvcache_block_size=options["block_size"],
        kv_cache_memory=options["kv_cache_memory"],
        gpu_memory_utilization=options["gpu_memory_utilization"],
        device=options["device"],
        dtype=options["dtype"],
        tensor_parallel_size=options["tensor_parallel_size"],
        enable_prefix_caching=not options["no_prefix_caching"],
        attention_backend=options["attention_backend"],
        seed=options["seed"],
        num_threads=options["num_threads"],
    )


def run_worker(options: dict[str, Any]) -> int:
    from nanovllm.common.serving import stop_event_on_signals
    from nanovllm.worker.server import WorkerServerConfig, serve_worker

    _configure_logging(options)
    engine_config = _engine_config(options)
    config = WorkerServerConfig(
        host=options["host"],
        port=options["port"],
        max_queued_requests=options["max_queued_requests"],
        drain_timeout_s=options["drain_timeout"],
        metrics_port=options["metrics_port"],
    )

    async def main() -> int:
        return await serve_worker(engine_config, config, stop_event_on_signals(), _announce("worker"))

    try:
        return asyncio.run(main())
    except OSError as exc:  # e.g. the port is taken: one line, not a traceback
        raise SystemExit(f"nanovllm worker: {exc}") from exc


def run_router(options: dict[str, Any]) -> int:
    from nanovllm.common.serving import stop_event_on_signals
    from nanovllm.router.server import RouterConfig, serve_router
    from nanovllm.router.validation import RequestLimits

    _configure_logging(options)
    config = RouterConfig(
        workers=options["worker"],
        host=options["host"],
        port=options["port"],
        metrics_port=options["metrics_port"],
        drain_timeout_s=options["drain_timeout"],
        limits=RequestLimits(max_prompt_bytes=options["max_prompt_bytes"]),
        max_attempts=options["max_attempts"],
        stall_timeout_s=options["stall_timeout"],
        keepalive_time_s=options["keepalive_time"],
        keepalive_timeout_s=options["keepalive_timeout"],
    )

    async def main() -> None:
        await serve_router(config, stop_event_on_signals(), _announce("router"))

    try:
        asyncio.run(main())
    except OSError as exc:
        raise SystemExit(f"nanovllm router: {exc}") from exc
    return 0


def _spawn(args: list[str]) -> tuple[subprocess.Popen, str]:
    """Start `nanovllm <args>` and return it with the address it printed once listening."""
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.cli", *args], stdout=subprocess.PIPE, text=True)
    match = LISTENING_RE.search(proc.stdout.readline())
    if match is None:
        proc.wait()
        raise SystemExit(f"nanovllm: `{' '.join(args[:1])}` exited with {proc.returncode} before listening")
    return proc, match.group(1)


def run_serve(options: dict[str, Any]) -> int:
    """A worker and a router as two processes on this machine; Ctrl-C or SIGTERM stops both."""
    worker_args = ["worker", "--host", "127.0.0.1", "--port", "0"]
    for flag in ENGINE_FLAGS + LOG_FLAGS:
        value = options[flag.dest]
        if flag.kind == "switch":
            worker_args += [flag.name] if value else []
        elif value is not None:
            worker_args += [flag.name, str(value)]
    log_args = [arg for flag in LOG_FLAGS for arg in (flag.name, str(options[flag.dest]))]

    def stop(signum: int, frame: Any) -> None:
        raise _Stop

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    procs: list[subprocess.Popen] = []
    try:
        worker, worker_address = _spawn(worker_args)
        procs.append(worker)
        router_args = ["router", "--worker", worker_address, "--host", options["host"]]
        router, router_address = _spawn([*router_args, "--port", str(options["port"]), *log_args])
        procs.append(router)
        model = options["model"] or "the embedded SmolLM2-135M-Instruct"
        print(f"nanovllm serving {model}: router at {router_address}, worker at {worker_address}")
        print(
            f'try: {_command()} client --router {router_address} "What is the capital of France?"', flush=True
        )
        pid, status = os.wait()  # returns when either child exits: then stop the other
        print(f"nanovllm: process {pid} exited ({status}); stopping", file=sys.stderr)
        return 1
    except _Stop:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _command() -> str:
    """How this command was invoked (e.g. .venv/bin/nanovllm), for the hint printed to the user."""
    invoked = Path(sys.argv[0])
    return os.path.relpath(invoked) if invoked.name == "nanovllm" else "nanovllm"


class _Stop(Exception):
    """Raised by the signal handler of `nanovllm serve` to leave its wait."""


def run_client(options: dict[str, Any], prompt: str) -> int:
    import grpc

    from nanovllm.v1 import generate_pb2, generate_pb2_grpc

    request = generate_pb2.GenerateRequest(
        sampling=generate_pb2.SamplingParams(
            temperature=options["temperature"],
            top_p=options["top_p"],
            max_tokens=options["max_tokens"],
            stop=options["stop"],
        )
    )
    if not options["completion"]:
        if options["system"]:
            request.chat.messages.add(role="system", content=options["system"])
        request.chat.messages.add(role="user", content=prompt)
    else:
        request.text = prompt
    with grpc.insecure_channel(options["router"]) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        try:
            for response in stub.Generate(request):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                if response.finish_reason:
                    print(flush=True)  # end the answer's line on stdout; the summary goes to stderr
                    usage = response.usage
                    reason = generate_pb2.FinishReason.Name(response.finish_reason)
                    print(
                        f"[{reason.removeprefix('FINISH_REASON_').lower()}: {usage.prompt_tokens} prompt, "
                        f"{usage.completion_tokens} completion tokens]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as exc:
            print(f"\nnanovllm client: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanovllm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, flags, text in [
        ("serve", SERVE_FLAGS, "run a worker and a router on this machine"),
        ("worker", WORKER_FLAGS, "run a worker: the engine behind the internal gRPC API"),
        ("router", ROUTER_FLAGS, "run a router: the public gRPC API in front of workers"),
        ("client", CLIENT_FLAGS, "stream an answer from a router"),
    ]:
        sub = commands.add_parser(name, help=text, description=text)
        for flag in flags:
            flag.add_to(sub)
        if name == "client":
            sub.add_argument("prompt", help="the user's message (the text to continue with --completion)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "worker":
        return run_worker(_resolve(WORKER_FLAGS, args))
    if args.command == "router":
        return run_router(_resolve(ROUTER_FLAGS, args))
    if args.command == "serve":
        return run_serve(_resolve(SERVE_FLAGS, args))
    return run_client(_resolve(CLIENT_FLAGS, args), args.prompt)


if __name__ == "__main__":
    sys.exit(main())
