"""Qwen3.5's MTP speculation (speculative_method=mtp) on a CPU: what a step costs against a plain decode
step, and what an oracle proposer makes of it.

An oracle proposer (`OracleProposals`, for benchmarks and tests only) lets the multi-token-prediction head
run its passes as usual, then replaces its proposals with the model's own greedy continuation, read from a
first run without speculation: every proposal is accepted (or, with `right`, as many as it says), so the
machinery's cost and gain are measured without a trained head. A random head's proposals are almost
never accepted.

    .venv/bin/python -m bench.mtp [--shape qwen3.5-0.8b] [--layers N] [--max-tokens 32] [--dtype bfloat16]
        [--draft-vocab 32768]

One stream of a random `shape` model with a random head (bench/models.py, `mtp.*` added): a 128-token
prompt, `max-tokens` new tokens, greedy, ignore_eos; per engine the mean step time of its decode steps and
its decode tokens/s: plain decoding, MTP at k = 1 and 3 with the random head, and with the oracle; then k = 3
proposing among the first `draft-vocab` token ids only (speculative_draft_vocab). The speedup a trained
head would give is modelled from the measured step costs at the published mean acceptance lengths (tokens
a step) of Qwen3.8-27B: 1.90 / 2.68 / 3.28 / 3.79 for k = 1..4 (the whole vocabulary's: how much a narrower
draft vocabulary lowers them is not measured without a trained head).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bench.models import DEFAULT_CACHE, build_random_model
from bench.report import machine_description
from nanovllm import LLM, SamplingParams
from nanovllm.worker.models.loader import safetensors_files
from nanovllm.worker.step import ScheduledSequence

PUBLISHED_ACCEPTANCE = {1: 1.90, 2: 2.68, 3: 3.28, 4: 3.79}  # Qwen3.8-27B, thinking off (issue 82)


class OracleProposals:
    """Test and bench only: the head's passes run, then each sequence's proposals become its greedy
    continuation from `continuations` (by prompt); `right(n)`, given how many proposals a step makes,
    says how many of them stay right (the rest are made wrong), by default all."""

    def __init__(
        self,
        llm: LLM,
        continuations: dict[tuple[int, ...], list[int]],
        right: Callable[[int], int] | None = None,
    ) -> None:
        mtp = llm.engine.runner.mtp
        if mtp is None:
            raise ValueError("OracleProposals needs an engine with speculative_method=mtp")
        self.head_propose = mtp.propose
        self.continuations = continuations
        self.right = right
        self.vocab_size = llm.engine.model_config.vocab_size
        mtp.propose = self  # type: ignore[method-assign]  # the instance's, for this engine only

    def __call__(self, items: list[ScheduledSequence], tensors: Callable) -> None:
        self.head_propose(items, tensors)
        for item in items:
            seq = item.seq
            made = seq.num_tokens - seq.num_prompt_tokens
            truth = self.continuations[tuple(seq.prompt_token_ids)][made : made + len(item.spec_token_ids)]
            keep = len(truth) if self.right is None else self.right(len(truth))
            wrong = [(t + 1) % self.vocab_size for t in truth[keep:]]
            item.spec_token_ids = truth[:keep] + wrong + item.spec_token_ids[len(truth) :]


def add_random_head(model_dir: Path, out_dir: Path) -> Path:
    """`model_dir`'s checkpoint (linked, not copied) with a random multi-token-prediction head in a file of
    its own (the model's first full-attention layer's shapes; norms at zero, applied as 1 + w), in out_dir."""
    if (out_dir / "config.json").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    weight_map: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    prefix = f"model.layers.{config['layer_types'].index('full_attention')}."
    for path in safetensors_files(model_dir):
        (out_dir / path.name).unlink(missing_ok=True)
        (out_dir / path.name).symlink_to(path.resolve())
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                weight_map[name] = path.name
                if name.startswith(prefix):
                    shapes["mtp.layers.0." + name.removeprefix(prefix)] = tuple(f.get_slice(name).get_shape())
    hidden = config["hidden_size"]
    shapes["mtp.fc.weight"] = (hidden, 2 * hidden)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        shapes[f"mtp.{norm}.weight"] = (hidden,)
    generator = torch.Generator().manual_seed(0)
    head = {
        name: torch.zeros(shape)
        if "norm" in name
        else torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        for name, shape in shapes.items()
    }
    save_file(head, out_dir / "mtp.safetensors", metadata={"format": "pt"})
    weight_map |= dict.fromkeys(head, "mtp.safetensors")
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    config["mtp_num_hidden_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def one_stream(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], float, int, float]:
    """The tokens, the decode time (first token to last), the decode steps of `prompt` alone, and the time
    those steps spent in the head's proposal passes."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.engine
    engine.add_request("bench", prompt, params)
    tokens: list[int] = []
    first_at, steps, draft_s = 0.0, 0, 0.0
    while engine.has_unfinished_requests():
        result = engine.step()
        for out in result.outputs:
            if out.new_token_ids and not tokens:
                first_at = time.perf_counter()
            elif out.new_token_ids:
                steps += 1
                draft_s += result.stats.draft_s
            tokens += out.new_token_ids
    return tokens, time.perf_counter() - first_at, steps, draft_s


def _measure(
    model_dir: str, options: dict, prompt: list[int], oracle: list[int] | None, max_tokens: int, repeats: int
) -> tuple[list[int], tuple[float, float, float, float]]:
    """One engine's tokens and fastest run: (seconds a decode step, of them proposing, decode tokens/s,
    tokens a step); with `oracle`, the oracle proposer on that continuation."""
    llm = LLM(model_dir, **options)
    if oracle is not None:
        OracleProposals(llm, {tuple(prompt): oracle})
    one_stream(llm, prompt, 4)  # warm-up
    best: tuple[float, float, float, float] | None = None
    tokens: list[int] = []
    for _ in range(repeats):
        tokens, seconds, steps, draft_s = one_stream(llm, prompt, max_tokens)
        run = (seconds / steps, draft_s / steps, (len(tokens) - 1) / seconds, (len(tokens) - 1) / steps)
        best = run if best is None or run[0] < best[0] else best
    assert best is not None  # repeats >= 1
    llm.shutdown()
    return tokens, best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3.5-0.8b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2, help="runs per engine; the fastest steps kept")
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=32768,
        help="also k=3 with speculative_draft_vocab at this many token ids (0: not)",
    )
    args = parser.parse_args()
    base = build_random_model(args.shape, layers=args.layers)
    name = f"{args.shape}-{args.layers}-layers" if args.layers else args.shape
    model_dir = add_random_head(base, DEFAULT_CACHE / f"{name}-mtp")
    prompt = [random.Random(0).randrange(1000, 100_000) for _ in range(128)]
    common = {"dtype": args.dtype, "max_model_len": 512, "kv_cache_memory": "1GiB", "max_num_seqs": 4}
    # name: (seconds a decode step, of which proposing, decode tokens/s, tokens a step)
    runs: dict[str, tuple[float, float, float, float]] = {}
    continuation: list[int] = []
    engines: list[tuple[str, dict, bool]] = [
        ("plain decode", {}, False),
        ("mtp k=1, random head", {"speculative_method": "mtp", "num_speculative_tokens": 1}, False),
        ("mtp k=3, random head", {"speculative_method": "mtp", "num_speculative_tokens": 3}, False),
        ("mtp k=1, oracle", {"speculative_method": "mtp", "num_speculative_tokens": 1}, True),
        ("mtp k=3, oracle", {"speculative_method": "mtp", "num_speculative_tokens": 3}, True),
    ]
    if args.draft_vocab:
        narrow = {
            "speculative_method": "mtp",
            "num_speculative_tokens": 3,
            "speculative_draft_vocab": args.draft_vocab,
        }
        engines += [
            (f"mtp k=3, random head, draft vocab {args.draft_vocab}", narrow, False),
            (f"mtp k=3, oracle, draft vocab {args.draft_vocab}", narrow, True),
        ]
    # Each engine in a process of its own: an engine's memory is not all back when it is dropped, and two
    # of the larger shapes do not fit a small machine's RAM at once.
    spawn = multiprocessing.get_context("spawn")
    for label, options, oracle in engines:
        args_of_run = (str(model_dir), {**common, **options}, prompt, continuation if oracle else None)
        with spawn.Pool(1) as pool:
            tokens, runs[label] = pool.apply(_measure, (*args_of_run, args.max_tokens, args.repeats))
        continuation = continuation or tokens
        print(f"{label}: {runs[label]}", file=sys.stderr, flush=True)
    decode_s, _, decode_rate, _ = runs["plain decode"]
    print(f"{datetime.date.today()} {machine_description()}")
    print(f"random {name}, {args.dtype}, one stream: 128-token prompt, {args.max_tokens} new tokens, greedy")
    print(
        "| engine | ms a step | proposing | verifying | step (x plain) | verifying (x plain) | tokens a step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, (step_s, draft_s, rate, per_step) in runs.items():
        verify_s = step_s - draft_s
        print(
            f"| {label} | {step_s * 1e3:.1f} | {draft_s * 1e3:.1f} | {verify_s * 1e3:.1f} | "
            f"{step_s / decode_s:.2f} | {verify_s / decode_s:.2f} | {per_step:.2f} |"
        )
    print("| engine | decode tok/s | x plain |")
    print("|---|---:|---:|")
    for label, (_, _, rate, _) in runs.items():
        print(f"| {label} | {rate:.2f} | {rate / decode_rate:.2f} |")
    modelled = [(k, f"mtp k={k}, random head") for k in (1, 3)]
    if args.draft_vocab:  # the published lengths are the whole vocabulary's: a narrower one may accept less
        modelled.append((3, f"mtp k=3, random head, draft vocab {args.draft_vocab}"))
    for k, label in modelled:
        cost, length = runs[label][0] / decode_s, PUBLISHED_ACCEPTANCE[k]
        print(
            f"modelled at the published {length} tokens a step, {label}: {length / cost:.2f}x plain decoding"
        )


if __name__ == "__main__":
    main()
