"""What one router process costs: start to listening, resident memory after serving, whether torch is
mapped, and the short chat calls per second it relays, for this checkout's router beside another
interpreter's or checkout's (a router-only venv, an older commit) in the same run, against one worker.

The worker serves the embedded SmolLM2 (its real tokenizer and chat template) unless --model. Each router
runs with --processes 2, timed from its second start (the first writes the bytecode that an installed
package has); the calls are chat completions of one token (greedy), on --clients concurrent
connections for --seconds, over gRPC's Generate (chat messages) and HTTP's /v1/chat/completions, so the
router's own work per call (tokenizing, the chat template, relaying, detokenizing) is most of each call.

    .venv/bin/python -m bench.router_footprint \\
        --other "router-only venv=/tmp/routervenv/bin/python" \\
        --other "before=.venv/bin/python:/work/wt-before"      # PYTHON[:PYTHONPATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil

from bench.report import machine_description
from nanovllm.server_process import LISTENING_RE, spawn, wait_until_serving
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from nanovllm.worker.models.gguf.cache import embedded_model_path

QUESTION = "What is the capital of France?"


@dataclass
class Variant:
    name: str
    python: str
    pythonpath: str | None


@dataclass
class Router:
    proc: subprocess.Popen
    address: str
    http_address: str
    start_s: float


def start_router(variant: Variant, worker: str) -> Router:
    # Bytecode as an installed router has it (pip compiles the package at install; the Dockerfile's router
    # image so): a shell that sets PYTHONDONTWRITEBYTECODE would make every start compile the sources again.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONUNBUFFERED"] = "1"
    if variant.pythonpath:
        env["PYTHONPATH"] = variant.pythonpath
    args = ["router", "--worker", worker, "--host", "127.0.0.1", "--port", "0", "--http-port", "0"]
    args += ["--metrics-port", "0", "--processes", "2", "--response-store", "off"]
    began = time.perf_counter()
    proc = subprocess.Popen(  # `-m` puts the working directory first on the path: the variant's own
        [variant.python, "-m", "nanovllm.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=variant.pythonpath or tempfile.gettempdir(),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    start_s = time.perf_counter() - began
    match, http = LISTENING_RE.search(line), re.search(r"http on ([^,\s]+)", line)
    if match is None or http is None:
        proc.kill()
        raise RuntimeError(f"router {variant.name} did not start: {line!r}")
    return Router(proc, match.group(1), http.group(1), start_s)


def grpc_calls(address: str, stop_at: float, counts: list[int], index: int) -> None:
    chat = generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="user", content=QUESTION)])
    request = generate_pb2.GenerateRequest(chat=chat, sampling=generate_pb2.SamplingParams(max_tokens=1))
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        while time.perf_counter() < stop_at:
            for _ in stub.Generate(request):
                pass
            counts[index] += 1


def http_calls(address: str, stop_at: float, counts: list[int], index: int) -> None:
    body = json.dumps(
        {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 1, "temperature": 0}
    ).encode()
    while time.perf_counter() < stop_at:
        request = urllib.request.Request(
            f"http://{address}/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
        counts[index] += 1


def calls_per_second(target, address: str, clients: int, seconds: float) -> float:
    counts, stop_at = [0] * clients, time.perf_counter() + seconds
    threads = [threading.Thread(target=target, args=(address, stop_at, counts, i)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / seconds


def measure(variant: Variant, worker: str, clients: int, seconds: float) -> dict[str, object]:
    warm_up = start_router(variant, worker)  # writes the bytecode a first start lacks
    warm_up.proc.terminate()
    warm_up.proc.wait(timeout=60)
    router = start_router(variant, worker)
    try:
        if not wait_until_serving(router.address, lambda: router.proc.poll() is None):
            raise RuntimeError(f"router {variant.name} exited")
        calls_per_second(grpc_calls, router.address, 2, 2.0)  # warm-up: the tokenizer, the connections
        grpc_rate = calls_per_second(grpc_calls, router.address, clients, seconds)
        http_rate = calls_per_second(http_calls, router.http_address, clients, seconds)
        processes = [psutil.Process(router.proc.pid), *psutil.Process(router.proc.pid).children()]
        rss = [p.memory_info().rss for p in processes]
        torch_mapped = any("/torch/" in Path(f"/proc/{p.pid}/maps").read_text() for p in processes)
    finally:
        router.proc.terminate()
        router.proc.wait(timeout=60)
    return {
        "start_s": router.start_s,
        "rss_mb": [r / 2**20 for r in rss],
        "torch": torch_mapped,
        "grpc": grpc_rate,
        "http": http_rate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="the worker's model (default: the embedded SmolLM2)")
    parser.add_argument("--other", action="append", default=[], help="NAME=PYTHON[:PYTHONPATH]")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    variants = [Variant("this checkout", sys.executable, None)]
    for other in args.other:
        name, _, where = other.partition("=")
        python, _, path = where.partition(":")
        variants.append(Variant(name, python, path or None))
    model = args.model or str(embedded_model_path())
    worker = spawn(["worker", "--model", model, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"])
    try:
        wait_until_serving(worker.address, lambda: worker.proc.poll() is None)
        print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {machine_description()}")
        print(
            f"router --processes 2; {args.clients} clients for {args.seconds:.0f} s each; chats of 1 token\n"
        )
        print(
            "| router | start to listening s | RSS per process MB | torch mapped | gRPC calls/s | HTTP calls/s |"
        )
        print("|---|---:|---:|---|---:|---:|")
        for variant in variants:
            result = measure(variant, worker.address, args.clients, args.seconds)
            rss = " / ".join(f"{r:.0f}" for r in result["rss_mb"])  # type: ignore[attr-defined]
            print(
                f"| {variant.name} | {result['start_s']:.2f} | {rss} | {result['torch']} | "
                f"{result['grpc']:.1f} | {result['http']:.1f} |"
            )
    finally:
        worker.stop()


if __name__ == "__main__":
    main()
