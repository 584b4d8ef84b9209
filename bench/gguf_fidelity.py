"""GGUF files of each architecture served here against llama.cpp serving the same files: greedy tokens and
the top-5 logprobs at each step, on random checkpoints written as GGUF by tests/model_factory.py's
write_gguf (the writer the tests use; this checks its conventions, and the reader's, against llama.cpp's
own reader).

    .venv/bin/python -m bench.gguf_fidelity --llama-cpp-python PATH/TO/python [--max-tokens 24]

Each file is F32 or Q8_0 and is served float32 here (the Q8_0 weights as they ship) and by llama.cpp on
its CPU backend with a float32 KV cache (its default float16 cache alone moves logprobs by about 1e-2). Prints, per file, how many prompts agree to the end, where the others part, whether each
parting keeps vLLM's top-5 rule (each engine's token in the other's top-5 there), and the largest logprob
difference of a token in both top-5s up to the parting.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
from pathlib import Path

import torch

from nanovllm import LLM, SamplingParams
from tests.model_factory import build_model, write_gguf

# Qwen3.5's: its multimodal RoPE sections sized to the 2 rotated pairs of its 16-dimension heads (llama.cpp
# asserts they fit; without any in the config the converter writes the published models' 11, 11, 10).
_QWEN35 = {
    "num_hidden_layers": 4,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
}
CASES = {  # name: (architecture, config overrides)
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "qwen3-moe top-2": ("qwen3_moe", {"head_dim": 32, "norm_topk_prob": True}),
    "qwen3-moe top-8": ("qwen3_moe", {"head_dim": 32, "norm_topk_prob": True, "num_experts_per_tok": 8}),
    # 3 Gated DeltaNet layers and 1 full-attention layer, 4 value heads over 2 key heads (tiled in the file)
    "qwen3.5": ("qwen3_5", _QWEN35),
    "qwen3.5-moe top-2": ("qwen3_5_moe", {**_QWEN35, "shared_expert_intermediate_size": 64}),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(21)
    return [[rng.randrange(2, 512) for _ in range(n)] for n in (4, 17, 60, 150)]


def _peer(python: str, gguf: Path, prompts: list[list[int]], max_tokens: int) -> dict:
    job = {
        "model": str(gguf),
        "chats": prompts,
        "max_tokens": max_tokens,
        "threads": torch.get_num_threads(),
        "ignore_eos": True,
        "logprobs": 5,
        "kv_f32": True,  # as this engine's float32 cache
    }
    peer = Path(__file__).with_name("llama_cpp_peer.py")
    done = subprocess.run(
        [python, str(peer)], input=json.dumps(job), capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def _compare(ours: list[dict], theirs: dict) -> tuple[int, list[str], bool, float]:
    """(prompts equal to the end, each other prompt's parting, top-5 rule kept, largest logprob gap)."""
    equal, partings, rule, worst = 0, [], True, 0.0
    for index, (out, tokens, tops) in enumerate(zip(ours, theirs["tokens"], theirs["top"])):
        for pos, (ta, tb, la, top_b) in enumerate(zip(out["token_ids"], tokens, out["logprobs"], tops)):
            top_a, top_b = dict(la.top), {int(t): lp for t, lp in top_b}
            worst = max([worst, *(abs(top_a[t] - top_b[t]) for t in top_a.keys() & top_b.keys())])
            if ta != tb:
                kept = ta in top_b and tb in top_a
                rule &= kept
                partings.append(f"prompt {index} at {pos}" + ("" if kept else " (outside top-5)"))
                break
        else:
            equal += 1
    return equal, partings, rule, worst


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llama-cpp-python", required=True, help="an interpreter with llama-cpp-python")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=5)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, (arch, overrides) in CASES.items():
            source = build_model(arch, root / name / "hf", seed=3, hidden=128, overrides=overrides)
            for quant in ("F32", "Q8_0"):
                gguf = write_gguf(source, root / name / f"{quant}.gguf", quant)
                llm = LLM(str(gguf), dtype="float32", max_model_len=512, kv_cache_memory="32MiB")
                ours = llm.generate(prompts, params, use_tqdm=False)
                llm.shutdown()
                theirs = _peer(args.llama_cpp_python, gguf, prompts, args.max_tokens)
                equal, partings, rule, worst = _compare(ours, theirs)
                rows.append((name, quant, f"{equal}/{len(prompts)}", ", ".join(partings) or "-", rule, worst))
                version = theirs["version"]
    print(f"llama-cpp-python {version}, {args.max_tokens} greedy tokens from {len(prompts)} prompts each")
    print("| file | type | equal to the end | partings | top-5 rule | max logprob gap |")
    print("|---|---|---:|---|---|---:|")
    for name, quant, equal, partings, rule, worst in rows:
        print(f"| {name} | {quant} | {equal} | {partings} | {'kept' if rule else 'BROKEN'} | {worst:.2e} |")


if __name__ == "__main__":
    main()
