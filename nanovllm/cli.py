"""The `nanovllm` command.

  nanovllm serve  --model PATH           worker + router on this machine, for local use
  nanovllm worker --model PATH --port P  one worker (deployments)
  nanovllm router --worker HOST:PORT ... the public API in front of one or more workers
  nanovllm client "prompt"               stream an answer from a router to the terminal

Every flag can also be set through an environment variable, NANOVLLM_<FLAG> (e.g. NANOVLLM_MAX_NUM_SEQS);
a flag on the command line wins. `--help` on each subcommand lists them. The flags are the fields of the
config dataclasses declared with `option` (common/options.py): their names, defaults and help live there.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, NoReturn

from nanovllm.client import ClientOptions, run_client
from nanovllm.common.errors import ConfigError
from nanovllm.common.logging import LogConfig
from nanovllm.common.server_config import (
    RequestLimits,
    RouterConfig,
    RoutingConfig,
    TracingConfig,
    WorkerServerConfig,
)
from nanovllm.flags import Flag, build, flags_of, resolve_all
from nanovllm.server_process import LISTENING, ServerExited, spawn, stop_with_parent, wait_until_serving
from nanovllm.worker.config import EngineConfig

LOG_FLAGS = flags_of(LogConfig)
ENGINE_FLAGS = flags_of(EngineConfig)
WORKER_FLAGS = [*flags_of(WorkerServerConfig), *flags_of(TracingConfig), *ENGINE_FLAGS, *LOG_FLAGS]


def _router_flags(defaults: dict[str, Any] | None = None) -> list[Flag]:
    return [
        *flags_of(RouterConfig, defaults=defaults),
        *flags_of(RequestLimits),
        *flags_of(RoutingConfig),
        *flags_of(TracingConfig),
        *LOG_FLAGS,
    ]


ROUTER_FLAGS = _router_flags()
# `serve` takes every flag of both. Where both take a flag, the router's public face owns the address and
# ports (its worker listens on a free local port); the rest (drain, tracing, logs, the TLS between them)
# go to both. `--worker` adds workers beside its own, so serve requires none.
SERVE_ROUTER_ONLY = frozenset({"--host", "--port", "--metrics-port", "--health-port"})
SERVE_FLAGS = [
    dataclasses.replace(flag, required=False)
    for flag in [
        *_router_flags(defaults={"host": "127.0.0.1", "http_port": 8000}),
        *(flag for flag in WORKER_FLAGS if flag.name not in {f.name for f in ROUTER_FLAGS}),
    ]
]
CLIENT_FLAGS = flags_of(ClientOptions)
COMMANDS = [  # name, flags, what it runs
    ("serve", SERVE_FLAGS, "run a worker and a router on this machine"),
    ("worker", WORKER_FLAGS, "run a worker: the engine behind the internal gRPC API"),
    ("router", ROUTER_FLAGS, "run a router: the public gRPC API in front of workers"),
    ("client", CLIENT_FLAGS, "stream an answer from a router"),
]


def _announce(what: str) -> Callable[[str, str], None]:
    def announce(address: str, metrics_address: str) -> None:
        print(f"nanovllm {what} {LISTENING} {address}, metrics on {metrics_address}", flush=True)

    return announce


def _run_server(what: str, serve: Callable[..., Coroutine[Any, Any, int | None]], *configs: Any) -> int:
    """Run a server's coroutine until SIGTERM or Ctrl-C; a port that is taken is one line, not a traceback."""
    from nanovllm.common.serving import stop_event_on_signals

    async def main() -> int | None:
        return await serve(*configs, stop_event_on_signals(), _announce(what))

    try:
        return asyncio.run(main()) or 0
    except (OSError, ConfigError) as exc:  # a port taken; a certificate, key or tokens file unusable
        raise SystemExit(f"nanovllm {what}: {exc}") from exc


def _exit_skipping_teardown(code: int) -> NoReturn:
    """Exit a server that has drained and closed what it opened (the engine joined its threads and rank
    processes, the tracer sent its spans). The interpreter's own teardown would then free torch's and
    transformers' modules one by one: 0.3-0.5 s between the last log line and the exit, on every stop. Not
    for a router of several processes: the teardown releases their multiprocessing events and metric files."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_worker(options: dict[str, Any]) -> int:
    from nanovllm.worker.device import resolve_device
    from nanovllm.worker.models.gguf.cache import resolve_model
    from nanovllm.worker.runner.host_memory import keep_freed_memory
    from nanovllm.worker.service.server import serve_worker

    build(LogConfig, options).apply()
    model, gguf_file = resolve_model(options["model"])
    draft, draft_gguf_file = (
        resolve_model(options["speculative_model"]) if options["speculative_model"] else (None, None)
    )
    engine = build(
        EngineConfig,
        options,
        model=model,
        gguf_file=gguf_file,
        speculative_model=draft,
        draft_gguf_file=draft_gguf_file,
    )
    if engine.keep_freed_memory and resolve_device(engine.device).type == "cpu":
        keep_freed_memory()  # before any thread starts: the engine thread must share the main arena
    server = build(WorkerServerConfig, options, tracing=build(TracingConfig, options))
    _exit_skipping_teardown(_run_server("worker", serve_worker, engine, server))


def run_router(options: dict[str, Any]) -> int:
    from nanovllm.router.faces.process_group import shared_metrics

    log_config = build(LogConfig, options)
    log_config.apply()
    config = build(
        RouterConfig,
        options,
        limits=build(RequestLimits, options),
        routing=build(RoutingConfig, options),
        tracing=build(TracingConfig, options),
    )
    if config.processes == 1:
        _exit_skipping_teardown(_serve_router(config, log_config))
    with shared_metrics():  # the processes sum their metrics through files, named before any is imported
        return _serve_router(config, log_config)


def _serve_router(config: RouterConfig, log_config: LogConfig) -> int:
    from nanovllm.router.faces.server import serve_router

    return _run_server("router", serve_router, config, log_config)


def command_line(flags: Sequence[Flag], options: dict[str, Any]) -> list[str]:
    """The arguments that give a command `flags` with the values in `options` (defaults included)."""
    args: list[str] = []
    for flag in flags:
        value = options[flag.dest]
        if flag.kind == "switch":
            args += [flag.name] if value else []
        elif flag.kind == "tristate":
            args += [] if value is None else [flag.name if value else flag.off_name]
        elif flag.kind == "list":
            args += [arg for item in value or () for arg in (flag.name, str(item))]
        elif value is not None:
            args += [flag.name, str(value)]
    return args


def serve_commands(options: dict[str, Any]) -> tuple[list[str], list[str]]:
    """`serve`'s worker command, and its router's without the worker's address (known once it listens)."""
    worker_flags = [flag for flag in WORKER_FLAGS if flag.name not in SERVE_ROUTER_ONLY]
    # The worker is serve's own: its ports are picked free, so that two serves (or tests) never collide.
    worker = ["worker", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    worker += command_line(worker_flags, options)
    return worker, ["router", *command_line(ROUTER_FLAGS, options)]


def run_serve(options: dict[str, Any]) -> int:
    """A worker and a router as two processes on this machine; Ctrl-C or SIGTERM stops both, and either
    one exiting (a worker that cannot load its model) stops the other and exits non-zero."""
    worker_args, router_args = serve_commands(options)

    def stop(signum: int, frame: Any) -> None:
        raise _Stop

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    procs: dict[str, subprocess.Popen] = {}
    try:
        worker = spawn(worker_args)
        procs["worker"] = worker.proc
        router = spawn([*router_args, "--worker", worker.address])
        procs["router"] = router.proc
        model = options["model"] or "the embedded SmolLM2-135M-Instruct"
        print(
            f"nanovllm loading {model}: router at {router.address}, worker at {worker.address} "
            f"(metrics on {router.metrics_address} and {worker.metrics_address})",
            flush=True,
        )
        # Only say "try" once a request would be answered: the worker may load for a while.
        if wait_until_serving(router.address, alive=lambda: all(p.poll() is None for p in procs.values())):
            print(f"nanovllm serving {model}")
            print(
                f'try: {_command()} client --router {router.address} "What is the capital of France?"',
                flush=True,
            )
            if router.http_address:
                body = '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0, "stream": true}'
                print(
                    f"or:  curl -N http://{router.http_address}/v1/chat/completions "
                    f"-H 'Content-Type: application/json' -d '{body}'",
                    flush=True,
                )
            pid, status = os.wait()  # returns when either child exits: then stop the other
            exited = next(name for name, proc in procs.items() if proc.pid == pid)
            code = os.waitstatus_to_exitcode(status)
        else:  # one exited while the worker loaded (its own message says why)
            exited, code = next((name, p.returncode) for name, p in procs.items() if p.poll() is not None)
        print(f"nanovllm serve: the {exited} exited with {code}; stopping", file=sys.stderr)
        return 1
    except _Stop:
        return 0
    except ServerExited as exc:  # one exited before it listened: its own message on stderr says why
        print(f"nanovllm serve: {exc}; stopping", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanovllm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, flags, text in COMMANDS:
        sub = commands.add_parser(name, help=text, description=text)
        for flag in flags:
            flag.add_to(sub)
        if name == "client":
            sub.add_argument("prompt", help="the user's message (the text to continue with --completion)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    stop_with_parent()
    args = build_parser().parse_args(argv)
    try:
        if args.command == "worker":
            return run_worker(resolve_all(WORKER_FLAGS, args))
        if args.command == "router":
            return run_router(resolve_all(ROUTER_FLAGS, args))
        if args.command == "serve":
            return run_serve(resolve_all(SERVE_FLAGS, args))
        return run_client(resolve_all(CLIENT_FLAGS, args), args.prompt)
    except ConfigError as exc:  # a setting out of range: one line naming it, not a traceback
        raise SystemExit(f"nanovllm {args.command}: {exc}") from exc


if __name__ == "__main__":
    sys.exit(main())
