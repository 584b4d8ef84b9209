"""`nanovllm client`: stream one answer from a router to the terminal."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from nanovllm.common.options import option

CLIENT_TLS_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca")


@dataclass
class ClientOptions:
    router: str = option("127.0.0.1:50051", help="router address HOST:PORT")
    completion: bool = option(
        False,
        help="send the prompt as plain text to continue, instead of a user chat message (the default, rendered "
        "with the model's chat template)",
    )
    system: str | None = option(None, help="system message of the chat")
    no_think: bool = option(
        False,
        help="ask a model that reasons before it answers (Qwen3) to answer at once (chat.enable_thinking "
        "false)",
    )
    max_tokens: int = option(256, help="most tokens to generate")
    temperature: float = option(0.0, help="0 is greedy")
    top_p: float = option(1.0, help="nucleus sampling mass")
    stop: list[str] = option(default_factory=list, help="stop string; repeatable")
    json_schema: str | None = option(
        None, help="a JSON Schema file: the answer is JSON that validates against it"
    )
    json_object: bool = option(False, help="the answer is a JSON object")
    regex: str | None = option(None, help="the answer matches this regular expression")
    grammar: str | None = option(
        None, help="a Lark grammar file (llguidance's dialect): the answer follows it"
    )
    choice: list[str] = option(default_factory=list, help="the answer is one of these; repeatable")
    image: list[str] = option(
        default_factory=list,
        help="an image file (PNG, JPEG, WebP, GIF, BMP) for a vision model, shown before the prompt in the "
        "user message; repeatable",
    )
    tls_ca: str | None = option(
        None, help="PEM CA bundle that signed the router's certificate; turns on TLS (plaintext without)"
    )
    tls_cert: str | None = option(None, help="PEM client certificate, for a router that asks for one")
    tls_key: str | None = option(None, help="PEM private key of --tls-cert")
    tls_server_name: str | None = option(
        None, help="name to check the router's certificate against instead of the host in --router"
    )
    token: str | None = option(
        None, help="bearer token for a router with auth (prefer the environment variable to the flag)"
    )


def open_channel(options: dict[str, Any]) -> Any:
    """A channel to the router: plaintext, or TLS with any of --tls-ca (the CA to trust; the system's roots
    without it), --tls-cert and --tls-key (a client certificate)."""
    import grpc

    from nanovllm.common.tls import TlsFiles, channel_credentials

    if not (options["tls_ca"] or options["tls_cert"] or options["tls_key"]):
        return grpc.insecure_channel(options["router"])
    files = TlsFiles(options["tls_cert"], options["tls_key"], options["tls_ca"], CLIENT_TLS_FLAGS)
    name = options["tls_server_name"]
    overrides = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(options["router"], channel_credentials(files), options=overrides)


def _constrain(sampling: Any, options: dict[str, Any]) -> None:
    """Set the structured-output constraint the options ask for; OSError for a file that cannot be read,
    ValueError for more than one constraint (the message's oneof would keep only the last)."""
    from pathlib import Path

    given = [name for name in ("json_schema", "json_object", "regex", "grammar", "choice") if options[name]]
    if len(given) > 1:
        raise ValueError(
            f"--{given[0].replace('_', '-')} and --{given[1].replace('_', '-')}: one constraint at most"
        )
    if options["json_schema"]:
        sampling.json_schema = Path(options["json_schema"]).read_text()
    if options["json_object"]:
        sampling.json_object = True
    if options["regex"]:
        sampling.regex = options["regex"]
    if options["grammar"]:
        sampling.grammar = Path(options["grammar"]).read_text()
    if options["choice"]:
        sampling.choice.choices.extend(options["choice"])


def _show_reasoning(text: str) -> None:
    """The model's reasoning goes to stderr, dimmed on a terminal: stdout carries the answer alone."""
    if sys.stderr.isatty():
        text = f"\x1b[2m{text}\x1b[0m"
    sys.stderr.write(text)
    sys.stderr.flush()


def run_client(options: dict[str, Any], prompt: str) -> int:
    from pathlib import Path

    import grpc

    from nanovllm.common.errors import ConfigError
    from nanovllm.v1 import generate_pb2, generate_pb2_grpc

    request = generate_pb2.GenerateRequest(
        sampling=generate_pb2.SamplingParams(
            temperature=options["temperature"],
            top_p=options["top_p"],
            max_tokens=options["max_tokens"],
            stop=options["stop"],
        )
    )
    try:
        _constrain(request.sampling, options)
    except (OSError, ValueError) as exc:
        print(f"nanovllm client: {exc}", file=sys.stderr)
        return 2
    if options["image"] and options["completion"]:
        print(
            "nanovllm client: --image goes in a chat message: it cannot be used with --completion",
            file=sys.stderr,
        )
        return 2
    if not options["completion"]:
        if options["system"]:
            request.chat.messages.add(role="system", content=options["system"])
        user = request.chat.messages.add(role="user")
        try:
            for path in options["image"]:
                user.parts.add(image=generate_pb2.ImagePart(data=Path(path).read_bytes()))
        except OSError as exc:
            print(f"nanovllm client: --image: {exc}", file=sys.stderr)
            return 2
        if options["image"]:
            user.parts.add(text=prompt)
        else:
            user.content = prompt
        if options["no_think"]:
            request.chat.enable_thinking = False
    else:
        request.text = prompt
    metadata = [("authorization", f"Bearer {options['token']}")] if options["token"] else None
    try:
        channel = open_channel(options)
    except ConfigError as exc:
        print(f"nanovllm client: {exc}", file=sys.stderr)
        return 2
    with channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        try:
            for response in stub.Generate(request, metadata=metadata):
                if response.reasoning_text:
                    _show_reasoning(response.reasoning_text)
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
