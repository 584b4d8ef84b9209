"""Speculative decoding benchmark: one stream on input-grounded prompts, n-gram speculation against none.

The embedded SmolLM2-135M-Instruct in the default dtype, its chat template, greedy, 256 new tokens per
prompt. Each prompt asks the model to rewrite or annotate a text it is given, so the answer quotes the
input: where prompt lookup pays. Both engines run in this process, one after the other, after a warm-up;
the tokens must be equal (speculation never changes them), and the report gives decode tokens/s of each,
their ratio, and the acceptance rate (accepted / proposed tokens). Then W64 (bench/throughput.py's batch
workload) with both: above speculative_max_batch decoding requests a step does not speculate, so the batch
must lose nothing. With --llama-cpp-python, llama.cpp decodes the same chats from the same GGUF as it ships
(bench/llama_cpp_peer.py, under that interpreter) after the engines, in the same run.

    .venv/bin/python -m bench.speculation [--max-tokens 256] [--num-speculative-tokens 4] [--prompts 10]
        [--speculative-max-batch N] [--skip-w64] [--rounds 2] [--llama-cpp-python PATH/TO/python]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.report import machine_description
from bench.workload import Workload, greedy, make_workload
from nanovllm import LLM, SamplingParams
from nanovllm.worker.config import EngineConfig
from nanovllm.worker.models.gguf.cache import embedded_model_path, prepare_gguf

PARAGRAPHS = [
    (
        "The comittee met on tuesday to discus the new budjet. Most members agred that the libary needs more "
        "funding, but some argued that the roads should come frist."
    ),
    (
        "Our team has recieved many requests for a dark mode. We beleive it will be ready by the end of the "
        "quater, provided the designers finsh the new colour palette in time."
    ),
    (
        "Photosynthesis is the proces by which plants convert light into chemical energy. It takes place in "
        "the chloroplasts and releases oxygen as a by-product."
    ),
    (
        "The train to Edinburgh leaves at nine o'clock from platform four. Passengers should arive early, "
        "because the ticket office closes fifteen minutes before departure."
    ),
    (
        "Please remember to water the plants, feed the cat twice a day, and lock the back door before you "
        "leave the house in the morning."
    ),
]
CODE = [
    (
        "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
        "    return 2 * (width + height)\n"
    ),
    (
        "def greet(name, times):\n    for _ in range(times):\n        print('hello ' + name)\n\n\n"
        "def total(prices):\n    return sum(prices)\n"
    ),
    (
        "def parse(line):\n    key, value = line.split('=')\n    return key.strip(), value.strip()\n\n\n"
        "def load(path):\n    with open(path) as f:\n        return dict(parse(l) for l in f)\n"
    ),
    (
        "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n\n\ndef scale(values, factor):\n"
        "    return [v * factor for v in values]\n"
    ),
    (
        "def first_word(text):\n    return text.split()[0]\n\n\ndef count_words(text):\n"
        "    return len(text.split())\n"
    ),
]


def prompts() -> list[str]:
    return [f"Rewrite this paragraph, correcting the spelling:\n\n{p}" for p in PARAGRAPHS] + [
        f"Add type hints to this Python code and return the whole code:\n\n{c}" for c in CODE
    ]


def run(llm: LLM, chats: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, int, int, int]:
    """Each prompt alone (one stream): output tokens, decode tok/s over all prompts, proposed, accepted,
    decode steps."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs, decode_s, decode_tokens, proposed, accepted, steps = [], 0.0, 0, 0, 0, 0
    for chat in chats:
        engine = llm.engine
        engine.add_request("bench", chat, params)
        tokens: list[int] = []
        first_at = None
        while engine.has_unfinished_requests():
            step = engine.step()
            steps += first_at is not None
            proposed += step.stats.num_spec_proposed
            accepted += step.stats.num_spec_accepted
            for out in step.outputs:
                tokens.extend(out.new_token_ids)
            if first_at is None and tokens:
                first_at = time.perf_counter()  # prefill done: decode is timed from here
        decode_s += time.perf_counter() - first_at
        decode_tokens += len(tokens) - 1
        outputs.append(tokens)
    return outputs, decode_tokens / decode_s, proposed, accepted, steps


def run_batch(llm: LLM, workload: Workload) -> tuple[list[list[int]], float, int, int]:
    """The whole workload at once: output tokens per request, output tok/s, steps, steps that speculated."""
    engine = llm.engine
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.add_request(str(i), prompt, greedy(n))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(workload.prompts))}
    steps = speculated = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step = engine.step()
        steps += 1
        speculated += step.stats.num_spec_proposed > 0
        for out in step.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    elapsed = time.perf_counter() - start
    return list(tokens.values()), sum(map(len, tokens.values())) / elapsed, steps, speculated


def llama_cpp(
    python: str, gguf: Path, chats: list[list[int]], max_tokens: int, ignore_eos: bool = False
) -> dict:
    """llama.cpp's decode tokens and seconds on `chats`, with as many threads as the engines had."""
    job = {
        "model": str(gguf),
        "chats": chats,
        "max_tokens": max_tokens,
        "threads": torch.get_num_threads(),
        "ignore_eos": ignore_eos,
    }
    peer = Path(__file__).with_name("llama_cpp_peer.py")
    done = subprocess.run(
        [python, str(peer)], input=json.dumps(job), capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=10, help="how many of the 10 prompts")
    parser.add_argument(
        "--speculative-max-batch",
        type=int,
        default=next(
            f.default for f in dataclasses.fields(EngineConfig) if f.name == "speculative_max_batch"
        ),
        help="the engine's setting (default: its default)",
    )
    parser.add_argument("--skip-w64", action="store_true", help="skip the batch (W64) comparison")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of off and ngram")
    parser.add_argument(
        "--llama-cpp-python", help="an interpreter with llama-cpp-python: adds llama.cpp's row"
    )
    args = parser.parse_args()

    gguf = embedded_model_path()
    model = prepare_gguf(gguf)
    settings = {
        "off": {},
        "ngram": {
            "speculative_method": "ngram",
            "num_speculative_tokens": args.num_speculative_tokens,
            "speculative_max_batch": args.speculative_max_batch,
        },
    }
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts()[: args.prompts]
    ]
    chats = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    w64 = make_workload(64, tokenizer.vocab_size, (32, 256), (32, 256), seed=0)
    results: dict[str, list] = {name: [] for name in settings}
    batch: dict[str, list] = {name: [] for name in settings}
    for _ in range(args.rounds):  # alternating rounds: the machine's drift falls on both alike
        for name, extra in settings.items():  # one engine at a time: each gets the CPUs to itself
            llm = LLM(str(model), max_model_len=2048, enable_prefix_caching=False, **extra)
            dtype = llm.engine.runner.dtype
            run(llm, chats[:1], 16)  # warm-up
            results[name].append(run(llm, chats, args.max_tokens))
            if not args.skip_w64:
                batch[name].append(run_batch(llm, w64))
            llm.shutdown()
            del llm
    for name in settings:  # every round of every engine, against the first round without speculation
        changed = any(r[0] != results["off"][0][0] for r in results[name])
        if changed or any(b[0] != batch["off"][0][0] for b in batch[name]):
            raise SystemExit(f"{name}: the tokens changed between runs or with speculation: a bug")
    off, spec = results["off"][0], results["ngram"][0]  # the counts are the same in every round
    off_tps = statistics.median(r[1] for r in results["off"])
    spec_tps = statistics.median(r[1] for r in results["ngram"])
    ratio = statistics.median(s[1] / o[1] for o, s in zip(results["off"], results["ngram"]))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rate = spec[3] / spec[2] if spec[2] else 0.0
    print(f"{date}; {machine_description()}; SmolLM2-135M-Instruct, {dtype}, greedy")
    print(
        f"{len(chats)} prompts alone, up to {args.max_tokens} new tokens each, K={args.num_speculative_tokens}; "
        f"medians of {args.rounds} alternating rounds\n"
    )
    decoded = sum(len(t) - 1 for t in off[0])
    print(
        "| speculation | decode tok/s | vs off | tokens per decode step | proposed | accepted | acceptance |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| off | {off_tps:.1f} | 1.00x | {decoded / off[4]:.2f} | | | |")
    print(
        f"| ngram | {spec_tps:.1f} | {ratio:.2f}x | {decoded / spec[4]:.2f} | {spec[2]} | {spec[3]} "
        f"| {rate:.1%} |"
    )

    if args.llama_cpp_python:
        peer = llama_cpp(args.llama_cpp_python, gguf, chats, args.max_tokens)
        print(
            f"| llama.cpp (llama-cpp-python {peer['version']}, the GGUF as shipped) | "
            f"{peer['decode_tokens'] / peer['decode_s']:.1f} | "
            f"{peer['decode_tokens'] / peer['decode_s'] / off_tps:.2f}x | | | | |"
        )

    rounds = "; ".join(
        f"off {o[1]:.1f}, ngram {s[1]:.1f} ({s[1] / o[1]:.2f}x)"
        for o, s in zip(results["off"], results["ngram"])
    )
    print(f"\nrounds, decode tok/s: {rounds}")
    if batch["off"]:
        off_batch = statistics.median(b[1] for b in batch["off"])
        spec_batch = statistics.median(b[1] for b in batch["ngram"])
        batch_ratio = statistics.median(s[1] / o[1] for o, s in zip(batch["off"], batch["ngram"]))
        steps, speculated = batch["ngram"][0][2:]
        print(
            f"\nW64 (64 random-token requests at once, 32-256 in and out, greedy, ignore_eos), output tok/s: "
            f"off {off_batch:.1f}, ngram {spec_batch:.1f} ({batch_ratio:.2f}x; speculative_max_batch "
            f"{args.speculative_max_batch}: {speculated} of {steps} steps speculated)"
        )


if __name__ == "__main__":
    main()
