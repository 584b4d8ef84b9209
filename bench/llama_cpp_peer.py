"""llama.cpp's one-stream decode speed on given prompts: the peer bench/speculation.py compares with.

Runs under an interpreter that has llama-cpp-python (not a nanovllm dependency: it builds from source in
minutes, `pip install llama-cpp-python`), so it imports nothing from nanovllm. Reads a JSON job on stdin
({"model": GGUF path, "chats": [[token ids]], "max_tokens", "threads", optional "ignore_eos"}), decodes
each chat greedily alone from a fresh context (to max_tokens regardless of EOS with ignore_eos), and prints {"decode_tokens", "decode_s", "version"}: tokens after the first over the
seconds from the first to the last, as bench/speculation.py times its own engines.
"""

from __future__ import annotations

import json
import sys
import time

import llama_cpp


def main() -> None:
    job = json.load(sys.stdin)
    llm = llama_cpp.Llama(
        model_path=job["model"],
        n_ctx=2048,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        verbose=False,
    )
    eos = llm.token_eos()
    decode_tokens, decode_s = 0, 0.0
    for warm_up, chats in ((True, job["chats"][:1]), (False, job["chats"])):
        for chat in chats:
            count, first_at = 0, 0.0
            for token in llm.generate(chat, top_k=1, top_p=1.0, temp=0.0, reset=True):
                count += 1
                if count == 1:
                    first_at = time.perf_counter()  # prefill done
                if (token == eos and not job.get("ignore_eos")) or count >= job["max_tokens"]:
                    break
            if not warm_up:
                decode_tokens += count - 1
                decode_s += time.perf_counter() - first_at
    print(
        json.dumps({"decode_tokens": decode_tokens, "decode_s": decode_s, "version": llama_cpp.__version__})
    )


if __name__ == "__main__":
    main()
