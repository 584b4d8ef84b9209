"""`nanovllm client`: stream one answer from a router to the terminal."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from nanovllm.common.options import option


@dataclass
class ClientOptions:
    router: str = option("127.0.0.1:50051", help="router address HOST:PORT")
    completion: bool = option(
        False,
        help="send the prompt as plain text to continue, instead of a user chat message (the default, rendered "
        "with the model's chat template)",
    )
    system: str | None = option(None, help="system message of the chat")
    max_tokens: int = option(256, help="most tokens to generate")
    temperature: float = option(0.0, help="0 is greedy")
    top_p: float = option(1.0, help="nucleus sampling mass")
    stop: list[str] = option(default_factory=list, help="stop string; repeatable")


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
