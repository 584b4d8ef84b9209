"""Freed host memory kept for reuse (worker/runner/host_memory.py): an engine's per-step large tensors
reuse the last step's pages instead of faulting in fresh ones."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.model_factory import build_model

VOCAB = 151_936  # Qwen3's: a batch of 64 float32 logit rows is 39 MB, above glibc's 32 MiB cap
BATCH, STEPS = 64, 32
LOGIT_PAGES = BATCH * VOCAB * 4 // 4096

# In a fresh process (the settings are process-wide): the minor page faults of an engine's steps after a
# warm-up, every step making a batch of 64 logit rows.
SCRIPT = """
import json, resource, sys
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_model_len=256, kv_cache_memory="64MiB", num_threads=1,
          keep_freed_memory=sys.argv[2] == "keep")
prompts = [[(7 * i + j) % 1000 + 5 for j in range(8)] for i in range(64)]
llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
llm.generate(prompts, SamplingParams(max_tokens=int(sys.argv[3]), ignore_eos=True), use_tqdm=False)
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def step_faults(model: Path, mode: str) -> int:
    args = [sys.executable, "-c", SCRIPT, str(model), mode, str(STEPS)]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])["faults"]


@pytest.mark.skipif(
    not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"),
    reason="the settings are glibc's mallopt; this C library is not glibc",
)
def test_each_steps_logits_reuse_the_last_steps_pages(tmp_path: Path):
    build_model("qwen3", tmp_path, num_layers=1, tokenizer=False, overrides={"vocab_size": VOCAB})
    returned, kept = step_faults(tmp_path, "return"), step_faults(tmp_path, "keep")
    # glibc maps a block this large afresh and unmaps it when freed: every step faults its logits in.
    assert returned >= STEPS * LOGIT_PAGES // 2, (returned, kept)
    # Kept, a step's logits take the memory of the step before, already faulted in; the heap grows (new
    # pages) only when a step needs more than it ever held.
    assert kept < STEPS * LOGIT_PAGES // 4, (returned, kept)
