"""Structured output benchmark: what constraining costs a batch, and the two libraries that could do it.

**Batch.** 64 chat requests at once to the embedded SmolLM2 (default dtype), half of them constrained by
the acceptance schemas of tests/test_structured_output.py (greedy), the other half free. The same batch
then runs with no constraint, each request's max_tokens set to the tokens it produced constrained and
ignore_eos on, so both runs decode the same number of tokens per request and the batch shrinks the same
way: the only difference is the masks. Rounds alternate; the report gives output tokens/s of each, the
ratio, and the engine's mask time per step (ConstraintQueue.fill_masks: llguidance's masks for the 32
constrained rows).

**Libraries** (--libraries): llguidance and, when installed, xgrammar on the same schemas: compile time
per schema, and the time to compute one step's masks at batch 1 and 64 while walking a valid answer (the
masks' application to the logits is the engine's own, the same for both), on SmolLM2's vocabulary (49,152) and, with --qwen-tiktoken FILE (Qwen's 151,643 BPE ranks, e.g.
`dashscope/resources/qwen.tiktoken` from PyPI's dashscope wheel), on Qwen's 151,936-token vocabulary.

**Whitespace** (--whitespace): 300 sampled JSON answers (the test's schemas at temperatures 0.7, 1.0 and
1.3), compact JSON against any whitespace between tokens: how many run to max_tokens.

    .venv/bin/python -m bench.structured_output [--rounds 2] [--libraries] [--qwen-tiktoken FILE] [--whitespace]
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.report import machine_description
from nanovllm import LLM, SamplingParams
from nanovllm.worker.models.gguf.cache import embedded_model_path, prepare_gguf
from tests.test_structured_output import SCHEMAS

BATCH = 64
QWEN_VOCAB = 151_936  # Qwen2/Qwen3 logits width: 151,643 BPE tokens, special tokens and padding


def batch_run(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[list[int], float, list[float]]:
    """Every request at once: tokens per request, output tok/s, mask seconds of each step with masks."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    counts = [0] * len(prompts)
    masks = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step = engine.step()
        if step.stats.mask_s:
            masks.append(step.stats.mask_s)
        for out in step.outputs:
            counts[int(out.request_id)] += len(out.new_token_ids)
    return counts, sum(counts) / (time.perf_counter() - start), masks


def engine_comparison(rounds: int) -> None:
    model = prepare_gguf(embedded_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts, constrained = [], []
    for i in range(BATCH):
        what, schema = SCHEMAS[i % len(SCHEMAS)]
        question = f"Give me {what} as JSON (example {i})." if i % 2 == 0 else f"Tell me about {what} ({i})."
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
        schema_arg = {"json_schema": schema} if i % 2 == 0 else {}
        constrained.append(SamplingParams(temperature=0.0, max_tokens=200, **schema_arg))
    llm = LLM(str(model), max_model_len=1024)
    dtype = llm.engine.runner.dtype
    batch_run(llm, prompts[:2], constrained[:2])  # warm-up: the tokenizer, the kernels
    results: dict[str, list] = {"constrained": [], "free": []}
    free: list[SamplingParams] | None = None
    for _ in range(rounds):
        counts, tps, masks = batch_run(llm, prompts, constrained)
        results["constrained"].append((tps, masks))
        if free is None:  # the same token counts, with nothing constraining them
            free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in counts]
            total = sum(counts)
        free_counts, free_tps, _ = batch_run(llm, prompts, free)
        if free_counts != counts:
            raise SystemExit(
                f"the free run decoded {sum(free_counts)} tokens, the constrained one {sum(counts)}"
            )
        results["free"].append((free_tps, []))
    llm.shutdown()
    ratios = [c[0] / f[0] for c, f in zip(results["constrained"], results["free"])]
    masks = [m * 1e3 for _, ms in results["constrained"] for m in ms]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{date}; {machine_description()}; SmolLM2-135M-Instruct, {dtype}, greedy")
    print(
        f"{BATCH} requests at once, {BATCH // 2} under a JSON schema; {total} output tokens; {rounds} alternating rounds\n"
    )
    print("| batch | output tok/s (median) | vs free |")
    print("|---|---:|---:|")
    print(f"| no constraint | {statistics.median(r[0] for r in results['free']):.1f} | 1.00x |")
    print(
        f"| half constrained | {statistics.median(r[0] for r in results['constrained']):.1f} | {statistics.median(ratios):.2f}x |"
    )
    print(
        f"\nrounds: {', '.join(f'{r:.2f}x' for r in ratios)}; mask time per step with masks: median "
        f"{statistics.median(masks):.2f} ms, p90 {statistics.quantiles(masks, n=10)[-1]:.2f} ms over {len(masks)} steps"
    )


# --------------------------------------------------------------------------- libraries


class RankedVocabulary:
    """A BPE vocabulary from tiktoken ranks (base64 token, rank per line), as llguidance's TokenizerWrapper
    reads one: the tokens' bytes, padded with special tokens to `size`. Encoding is byte by byte: the
    benchmark walks token ids it builds itself, and the masks depend only on the tokens' bytes."""

    def __init__(self, path: Path, size: int) -> None:
        ranks = [line.split() for line in path.read_text().splitlines() if line.strip()]
        self.tokens = [base64.b64decode(token) for token, _ in sorted(ranks, key=lambda r: int(r[1]))]
        self.special_token_ids = list(range(len(self.tokens), size))
        self.tokens += [f"<|special_{i}|>".encode() for i in self.special_token_ids]
        self.eos_token_id = self.special_token_ids[0]
        self.bos_token_id = None
        self._byte_ids = {t: i for i, t in enumerate(self.tokens) if len(t) == 1}

    def __call__(self, data: bytes) -> list[int]:
        return [self._byte_ids[bytes([b])] for b in data]

    def greedy_ids(self, text: str) -> list[int]:
        """Longest-match tokenization of `text` (valid ids whose bytes spell it, not BPE's own split)."""
        data, ids, index = text.encode(), [], {t: i for i, t in enumerate(self.tokens)}
        while data:
            for n in range(min(len(data), 16), 0, -1):
                if data[:n] in index:
                    ids.append(index[data[:n]])
                    data = data[n:]
                    break
        return ids


def whitespace_study() -> None:
    """300 sampled JSON-schema requests (the test's 10 schemas at temperatures 0.7, 1.0 and 1.3, ten seeds
    each, max_tokens 256), compact JSON (the default) against any whitespace between tokens: how many end
    at max_tokens, and how many answers do not validate."""
    import jsonschema

    model = prepare_gguf(embedded_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model)
    llm = LLM(str(model), max_model_len=1024)
    for free in (False, True):
        prompts, params = [], []
        for i in range(300):
            what, schema = SCHEMAS[i % len(SCHEMAS)]
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Give me {what} as JSON (example {i})."}],
                add_generation_prompt=True,
                tokenize=False,
            )
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
            temperature = (0.7, 1.0, 1.3)[i // 100]
            params.append(
                SamplingParams(
                    temperature=temperature,
                    seed=i,
                    max_tokens=256,
                    json_schema=schema,
                    json_free_whitespace=free,
                )
            )
        outputs = llm.generate(prompts, params, use_tqdm=False)
        at_limit = sum(o["finish_reason"] == "length" for o in outputs)
        invalid = 0
        for o, i in zip(outputs, range(300)):
            try:
                jsonschema.validate(json.loads(o["text"]), SCHEMAS[i % len(SCHEMAS)][1])
            except (ValueError, jsonschema.ValidationError):
                invalid += 1
        tokens = sum(len(o["token_ids"]) for o in outputs)
        label = "any whitespace" if free else "compact (default)"
        print(f"| {label} | {at_limit} | {invalid} | {tokens / 300:.1f} |", flush=True)


def median_time(f: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def libraries(qwen_tiktoken: Path | None) -> None:
    import llguidance
    import llguidance.hf

    try:
        import xgrammar
    except ImportError:
        xgrammar = None
    model = prepare_gguf(embedded_model_path())
    hf = AutoTokenizer.from_pretrained(model)
    vocabularies = [("SmolLM2", 49_152, llguidance.hf.from_tokenizer(hf, n_vocab=49_152),
                     (lambda text: hf.encode(text, add_special_tokens=False)),
                     (lambda: xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=49_152)) if xgrammar else None)]  # fmt: skip
    if qwen_tiktoken is not None:
        qwen = RankedVocabulary(qwen_tiktoken, QWEN_VOCAB)
        lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(qwen), n_vocab=QWEN_VOCAB)
        xinfo = (lambda: xgrammar.TokenizerInfo(qwen.tokens, vocab_size=QWEN_VOCAB)) if xgrammar else None
        vocabularies.append(("Qwen", QWEN_VOCAB, lltok, qwen.greedy_ids, xinfo))
    answers = [json.dumps(example) for example in EXAMPLES]
    print(
        "| vocabulary | library | compile ms (median over schemas) | mask ms per step, batch 1 | batch 64 |"
    )
    print("|---|---|---:|---:|---:|")
    for name, vocab, lltok, encode, xinfo in vocabularies:
        rows = {"llguidance": ([], [], [])}
        if xinfo is not None:
            rows["xgrammar"] = ([], [], [])
            xcompiler = xgrammar.GrammarCompiler(xinfo(), cache_enabled=False)
        for (_, schema), answer in zip(SCHEMAS, answers):
            text = json.dumps(schema)
            ids = encode(answer)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
            rows["llguidance"][0].append(median_time(lambda g=grammar, t=lltok: llguidance.LLMatcher(t, g)))
            for batch, times in ((1, rows["llguidance"][1]), (BATCH, rows["llguidance"][2])):
                matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
                times.append(_walk_llguidance(matchers, ids, vocab))
            if xinfo is not None:
                rows["xgrammar"][0].append(median_time(lambda s=text, c=xcompiler: c.compile_json_schema(s)))
                compiled = xcompiler.compile_json_schema(text)
                for batch, times in ((1, rows["xgrammar"][1]), (BATCH, rows["xgrammar"][2])):
                    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
                    times.append(_walk_xgrammar(xgrammar, matchers, ids, vocab))
        for library, (compile_s, one, many) in rows.items():
            print(f"| {name} ({vocab:,}) | {library} | {statistics.median(compile_s) * 1e3:.2f} | "
                  f"{statistics.median(one) * 1e3:.3f} | {statistics.median(many) * 1e3:.2f} |")  # fmt: skip


def _walk_llguidance(matchers: list, ids: list[int], vocab: int) -> float:
    """Seconds per step to fill every matcher's mask (llguidance's parallel executor, as the engine uses
    it), over the whole answer; the matchers then advance by the answer's next token (not timed)."""
    import llguidance

    executor = llguidance.LLExecutor(torch.get_num_threads())
    words = (vocab + 31) // 32
    bitmask = torch.empty((len(matchers), words), dtype=torch.int32)
    jobs = [(m, i) for i, m in enumerate(matchers)]
    elapsed = 0.0
    for token in ids:
        start = time.perf_counter()
        executor.unsafe_compute_mask_ptr(jobs, bitmask.data_ptr(), words * 4, len(matchers))
        elapsed += time.perf_counter() - start
        for m in matchers:
            if not m.consume_token(token):
                raise SystemExit(f"llguidance rejected token {token}: {m.get_error()}")
    return elapsed / len(ids)


def _walk_xgrammar(xgrammar, matchers: list, ids: list[int], vocab: int) -> float:
    """As _walk_llguidance, with xgrammar's matchers (filled one after another, its Python API)."""
    bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab)
    elapsed = 0.0
    for token in ids:
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        elapsed += time.perf_counter() - start
        for m in matchers:
            if not m.accept_token(token):
                raise SystemExit(f"xgrammar rejected token {token}")
    return elapsed / len(ids)


# One valid answer per acceptance schema (SCHEMAS' order), walked token by token.
EXAMPLES = [
    {"name": "Ada", "age": 36, "email": "ada@math.org"},
    {"title": "Dune", "author": "Frank Herbert", "year": 1965, "genres": ["fiction", "science"]},
    {"order_id": "ORD-123456", "items": [{"sku": "ABC123", "quantity": 2}], "express": True},
    {"city": "Oslo", "temperature_c": -3.5, "condition": "snow", "wind_kmh": 12},
    {"label": "positive", "confidence": 0.93},
    {
        "title": "Review",
        "date": "2026-03-14",
        "attendees": ["Ann", "Bo"],
        "location": {"room": "B2", "floor": 3},
    },
    {"name": "Lamp", "price": 19.99, "currency": "EUR", "in_stock": True, "tags": ["home"]},
    {"host": "api.example.com", "port": 8443, "tls": True, "replicas": 3},
    {"steps": ["Boil water", "Add pasta", "Drain"]},
    {"name": "Quito", "lat": -0.18, "lon": -78.47, "country_code": "EC"},
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the batch comparison")
    parser.add_argument("--libraries", action="store_true", help="also compare llguidance and xgrammar")
    parser.add_argument("--qwen-tiktoken", type=Path, help="Qwen's tiktoken ranks: adds the 152k vocabulary")
    parser.add_argument("--skip-batch", action="store_true", help="only the library comparison")
    parser.add_argument(
        "--whitespace",
        action="store_true",
        help="also 300 sampled JSON answers, compact against free whitespace",
    )
    args = parser.parse_args()
    if not args.skip_batch:
        engine_comparison(args.rounds)
    if args.whitespace:
        print(f"\n{datetime.datetime.now().isoformat(timespec='seconds')}, {machine_description()}")
        print("| JSON whitespace | of 300 at max_tokens | do not validate | tokens per answer |")
        print("|---|---:|---:|---:|")
        whitespace_study()
    if args.libraries:
        print()
        libraries(args.qwen_tiktoken)


if __name__ == "__main__":
    main()
