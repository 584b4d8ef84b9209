"""Speculative decoding benchmark: one stream on input-grounded prompts, n-gram speculation against none.

The embedded SmolLM2-135M-Instruct in the default dtype, its chat template, greedy, 256 new tokens per
prompt. Each prompt asks the model to rewrite or annotate a text it is given, so the answer quotes the
input: where prompt lookup pays. Both engines run in this process, one after the other, after a warm-up;
the tokens must be equal (speculation never changes them), and the report gives decode tokens/s of each,
their ratio, and the acceptance rate (accepted / proposed tokens). Then W64 (bench/throughput.py's batch
workload) with both: above speculative_max_batch decoding requests a step does not speculate, so the batch
must lose nothing.

    .venv/bin/python -m bench.speculation [--max-tokens 256] [--num-speculative-tokens 4] [--prompts 10]
"""

from __future__ import annotations

import argparse
import datetime
import time

from transformers import AutoTokenizer

from bench.report import machine_description
from bench.workload import greedy, make_workload
from nanovllm import LLM, SamplingParams
from nanovllm.worker.gguf import embedded_model_path, prepare_gguf

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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=10, help="how many of the 10 prompts")
    parser.add_argument("--skip-w64", action="store_true", help="skip the batch (W64) comparison")
    args = parser.parse_args()

    model = prepare_gguf(embedded_model_path())
    settings = {
        "off": {},
        "ngram": {"speculative_method": "ngram", "num_speculative_tokens": args.num_speculative_tokens},
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
    results, batch = {}, {}
    for name, extra in settings.items():  # one engine at a time: each gets the CPUs to itself
        llm = LLM(str(model), max_model_len=2048, enable_prefix_caching=False, **extra)
        dtype = llm.engine.runner.dtype
        run(llm, chats[:1], 16)  # warm-up
        results[name] = run(llm, chats, args.max_tokens)
        if not args.skip_w64:
            start = time.perf_counter()
            outs = llm.generate(w64.prompts, [greedy(n) for n in w64.output_lens], use_tqdm=False)
            batch[name] = (sum(len(o["token_ids"]) for o in outs) / (time.perf_counter() - start), outs)
        llm.shutdown()
        del llm
    off, spec = results["off"], results["ngram"]
    if off[0] != spec[0]:
        raise SystemExit("speculation changed the tokens: a bug")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rate = spec[3] / spec[2] if spec[2] else 0.0
    print(f"{date}; {machine_description()}; SmolLM2-135M-Instruct, {dtype}, greedy")
    print(
        f"{len(chats)} prompts alone, up to {args.max_tokens} new tokens each, K={args.num_speculative_tokens}\n"
    )
    decoded = sum(len(t) - 1 for t in off[0])
    print(
        "| speculation | decode tok/s | vs off | tokens per decode step | proposed | accepted | acceptance |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| off | {off[1]:.1f} | 1.00x | {decoded / off[4]:.2f} | | | |")
    print(
        f"| ngram | {spec[1]:.1f} | {spec[1] / off[1]:.2f}x | {decoded / spec[4]:.2f} | {spec[2]} | {spec[3]} "
        f"| {rate:.1%} |"
    )

    if batch:
        (off_tps, off_outs), (spec_tps, spec_outs) = batch["off"], batch["ngram"]
        if [o["token_ids"] for o in off_outs] != [o["token_ids"] for o in spec_outs]:
            raise SystemExit("speculation changed the tokens of W64: a bug")
        print(
            f"\nW64 (64 random-token requests at once, 32-256 in and out, greedy, ignore_eos), output tok/s: "
            f"off {off_tps:.1f}, ngram {spec_tps:.1f} ({spec_tps / off_tps:.2f}x; speculative_max_batch 8)"
        )


if __name__ == "__main__":
    main()
