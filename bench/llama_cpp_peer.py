"""llama.cpp's one-stream decode speed on given prompts: the peer bench/speculation.py and
bench/quantization.py compare with, and its greedy tokens and logprobs for bench/gguf_fidelity.py.

Runs under an interpreter that has llama-cpp-python (not a nanovllm dependency: it builds from source in
minutes, `pip install llama-cpp-python`), so it imports nothing from nanovllm. Reads a JSON job on stdin
({"model": GGUF path, "chats": [[token ids]], "max_tokens", "threads", optional "ignore_eos",
"logprobs": k and "kv_f32": a float32 KV cache instead of llama.cpp's default float16}), decodes each chat greedily alone from a fresh context (to max_tokens regardless of EOS
with ignore_eos), and prints {"decode_tokens", "decode_s", "version", "tokens"}: tokens after the first
over the seconds from the first to the last, as bench/speculation.py times its own engines, and each
chat's tokens; with "logprobs", "top" too: per chat, per token, the k most likely [token, logprob] of the
step that chose it.
"""

from __future__ import annotations

import json
import sys
import time

import llama_cpp
import numpy as np


def _top(logits: np.ndarray, k: int) -> list[list[float]]:
    logprobs = logits.astype(np.float64) - np.logaddexp.reduce(logits.astype(np.float64))
    best = np.argsort(-logprobs, kind="stable")[:k]
    return [[int(t), float(logprobs[t])] for t in best]


def main() -> None:
    job = json.load(sys.stdin)
    k = job.get("logprobs", 0)
    llm = llama_cpp.Llama(
        model_path=job["model"],
        n_ctx=2048,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        logits_all=bool(k),  # every step's logits kept in llm.scores
        **(
            {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32}
            if job.get("kv_f32")
            else {}
        ),
        verbose=False,
    )
    eos = llm.token_eos()
    decode_tokens, decode_s = 0, 0.0
    tokens: list[list[int]] = []
    top: list[list[list[list[float]]]] = []
    for warm_up, chats in ((True, job["chats"][:1]), (False, job["chats"])):
        for chat in chats:
            count, first_at = 0, 0.0
            tokens.append([])
            top.append([])
            for token in llm.generate(chat, top_k=1, top_p=1.0, temp=0.0, reset=True):
                count += 1
                if count == 1:
                    first_at = time.perf_counter()  # prefill done
                tokens[-1].append(int(token))
                if k:  # the logits that chose `token`: those of the last position evaluated
                    top[-1].append(_top(llm.scores[llm.n_tokens - 1], k))
                if (token == eos and not job.get("ignore_eos")) or count >= job["max_tokens"]:
                    break
            if warm_up:
                tokens.pop()
                top.pop()
            else:
                decode_tokens += count - 1
                decode_s += time.perf_counter() - first_at
    result = {"decode_tokens": decode_tokens, "decode_s": decode_s, "version": llama_cpp.__version__}
    print(json.dumps({**result, "tokens": tokens, **({"top": top} if k else {})}))


if __name__ == "__main__":
    main()
