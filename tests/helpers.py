"""Shared test utilities: a teacher-forcing driver, the transformers reference, the quantization and
tensor-parallel comparisons, and the tokenizer tests' texts."""

from __future__ import annotations

import collections
import itertools
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import psutil
import structlog
import torch
from structlog.testing import capture_logs
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.cpu_kernels import load_cpu_kernels
from nanovllm.worker.llm import load_tokenizer
from nanovllm.worker.sequence import Sequence
from nanovllm.worker.step import ScheduledSequence, SchedulerOutput

# The chats the real-model tests ask (SmolLM2-135M-Instruct): short questions of different kinds.
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying healthy.",
    "Explain what a neural network is in one sentence.",
]


@lru_cache(maxsize=4)
def chat_prompts(model_dir: Path) -> list[list[int]]:
    """QUESTIONS as the model's chat template renders them, tokenized."""
    tokenizer = load_tokenizer(model_dir)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    return [tokenizer.encode(t) for t in texts]


@lru_cache(maxsize=16)
def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' model for `model_dir` in `dtype` (the weights cast as transformers casts them)."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(model_dir)
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=None,  # like ignore_eos: run to max_new_tokens without banning EOS
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def hf_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    return hf_model(model_dir)(torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def float32_references(model_dir: Path, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """transformers' logits in float32 and in float64 (the exact logits, for float32's purposes; its
    experts one by one, as its grouped matmul takes no float64), and how far float32's rounding can move
    them: the most the float64 logits moved when the embeddings were rounded as float32 rounds (a
    relative 2^-24 of noise, 8 draws)."""
    ids = torch.tensor([prompt])
    hf32 = hf_model(model_dir)(ids).logits[0].double()
    hf64 = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, experts_implementation="eager"
    )
    embeddings = hf64.eval().model.embed_tokens(ids)
    exact = hf64(inputs_embeds=embeddings).logits[0]
    gen = torch.Generator().manual_seed(0)
    moved = 0.0
    for _ in range(8):
        noise = 1 + 2**-24 * torch.randn(embeddings.shape, generator=gen, dtype=torch.float64)
        moved = max(moved, (hf64(inputs_embeds=embeddings * noise).logits[0] - exact).abs().max().item())
    return hf32, exact, moved


def assert_within_float32_rounding(
    ours: torch.Tensor, hf32: torch.Tensor, exact: torch.Tensor, moved: float, where: str
) -> None:
    """Within 1e-4 of transformers' float32 logits (the bound every dense model here meets), or, at a
    position where the model amplifies rounding beyond that, within 4x what float32 rounding does to
    the exact logits: the larger of transformers' own float32 error and the logits' move under float32
    rounding of the embeddings alone (every layer rounds as well, so a correct float32 computation
    lands a few times that away). A linear layer's gated norm divides each head's output by its RMS, which
    some tokens' heads bring near zero (0.001 against a median of 0.3 on these weights): there the logits
    move by up to 8e-5 under the embeddings' rounding alone (1e-5 at the other positions), and the engine's
    logits were up to 1.6e-4 from the exact ones while transformers' happened to be 8e-6 (Qwen3.5's random
    models, tests/test_qwen3_5.py). `hf32`, `exact`, `moved`: float32_references."""
    ours = ours.double()
    if (ours - hf32).abs().max() <= 1e-4:
        return
    own_error = (hf32 - exact).abs().max().item()
    error = (ours - exact).abs().max().item()
    assert error <= 4 * max(own_error, moved), (
        f"{where}: {(ours - hf32).abs().max():.2e} from transformers' float32 logits, {error:.2e} from the "
        f"float64 ones (transformers' float32: {own_error:.2e}; float32 rounding of the embeddings moves "
        f"them {moved:.2e})"
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def teacher_forced_logits(
    llm: LLM, batch: list[list[int]], chunk: int, lora_names: list[str | None] | None = None
) -> list[torch.Tensor]:
    """Feed each sequence through the engine's own runner `chunk` tokens per step, all sequences in the
    same step, and collect the logits of every position. chunk=1 exercises the decode path. `lora_names`:
    each sequence's LoRA adapter (None: the base model)."""
    engine = llm.engine
    seqs = [Sequence(-1 - i, f"tf{i}", list(ids), greedy(1)) for i, ids in enumerate(batch)]
    for seq, name in zip(seqs, lora_names or []):
        seq.adapter = engine.adapters[name] if name is not None else None
    rows: list[list[torch.Tensor]] = [[] for _ in batch]
    while any(s.num_computed_tokens < s.num_tokens for s in seqs):
        items = []
        for seq in seqs:
            n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
            if n == 0:
                continue
            if not engine.block_manager.allocate_slots(seq, n):
                raise RuntimeError("test KV cache too small")
            items.append(ScheduledSequence(seq, seq.num_computed_tokens, n))
        items.sort(key=lambda s: s.num_new_tokens != 1)
        sched = SchedulerOutput(items, num_decodes=sum(s.num_new_tokens == 1 for s in items))
        with torch.inference_mode():  # every scheduled token's logits (teacher forcing)
            logits = engine.runner.forward(engine.runner.step_inputs(sched, all_logits=True))
        offset = 0
        for item in sched.scheduled:
            index = seqs.index(item.seq)
            rows[index].append(logits[offset : offset + item.num_new_tokens])
            offset += item.num_new_tokens
            item.seq.num_computed_tokens += item.num_new_tokens
    for seq in seqs:
        engine.block_manager.free(seq)
    return [torch.cat(r) for r in rows]


def cuts(text: str, count: int) -> list[list[str]]:
    """Every way to cut text into count + 1 pieces at distinct positions (empty pieces included)."""
    return [
        [text[a:b] for a, b in zip((0, *points), (*points, len(text)))]
        for points in itertools.combinations_with_replacement(range(len(text) + 1), count)
    ]


def top5_rule(name: str, ours: list[dict], theirs: list[dict], within: float = math.inf) -> float:
    """vLLM's rule for 16-bit (or quantized) outputs against a reference run of the same prompts, both
    greedy with logprobs=5: each prompt's two token sequences are walked side by side, and at the first
    position where they part (same context up to there) each token must be in the other's top-5; the walk
    of that prompt stops there. Returns the largest |logprob difference| of a token in both top-5s, up to
    and at the parting, for the caller to hold to its dtype's bound; `within`: only of the tokens that both
    engines put within that many nats of their most likely one (QUANTIZED_TOP_GAP says why)."""
    worst = 0.0
    for index, (a, b) in enumerate(zip(ours, theirs)):
        for pos, (ta, tb, la, lb) in enumerate(
            zip(a["token_ids"], b["token_ids"], a["logprobs"], b["logprobs"])
        ):
            top_a, top_b = dict(la.top), dict(lb.top)
            near = {t for t in top_a.keys() & top_b.keys()
                    if top_a[t] >= max(top_a.values()) - within and top_b[t] >= max(top_b.values()) - within}  # fmt: skip
            worst = max([worst, *(abs(top_a[t] - top_b[t]) for t in near)])
            if ta != tb:
                assert ta in top_b and tb in top_a, (
                    f"{name} prompt {index} position {pos}: {ta} (top-5 {la.top}) against {tb} (top-5 {lb.top})"
                )
                break
    return worst


def recorded_proposals(llm: LLM) -> list[list[int]]:
    """The multi-token-prediction head's proposals from here on, as the runner hands them to the
    verification (speculative_method=mtp)."""
    proposals: list[list[int]] = []
    head = llm.engine.runner.mtp
    propose = head.propose

    def recording(items, tensors) -> None:
        propose(items, tensors)
        proposals.extend(list(item.spec_token_ids) for item in items)

    head.propose = recording
    return proposals


@contextmanager
def counting_proposals(llm: LLM) -> Iterator[list[int]]:
    """[proposed, accepted]: the speculative tokens of the steps `llm` runs inside the block."""
    counts = [0, 0]
    step = llm.engine.step

    def counting_step():
        result = step()
        counts[0] += result.stats.num_spec_proposed
        counts[1] += result.stats.num_spec_accepted
        return result

    llm.engine.step = counting_step
    try:
        yield counts
    finally:
        del llm.engine.step  # back to the class's method


def vision_reference(model_dir: Path) -> tuple:
    """transformers' float32 image-text model saved in model_dir, its image processor and its tokenizer."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoImageProcessor.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)


def two_sample_chi_square(
    a: collections.Counter, b: collections.Counter, z: float = 3.719
) -> tuple[float, float, int]:
    """Whether two runs' counts of the same draws differ: the two-sample chi-square statistic over the values
    seen at least 10 times in both together (the rest pooled into one cell), its critical value at the
    normal quantile z (3.719: a false-failure rate of 1e-4; Wilson-Hilferty's quantile, within 1% for 30
    cells and more) and the number of cells."""
    cells = [(a[t], b[t]) for t in set(a) | set(b)]
    kept = [(x, y) for x, y in cells if x + y >= 10]
    pooled = (sum(x for x, y in cells if x + y < 10), sum(y for x, y in cells if x + y < 10))
    if sum(pooled):
        kept.append(pooled)
    statistic = sum((x - y) ** 2 / (x + y) for x, y in kept)
    df = len(kept) - 1
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic, critical, len(kept)


def decode_layers_on_and_off(
    model_dir: Path, batch: list[list[int]], params: SamplingParams, **llm_kwargs: object
) -> list[list[tuple[list[int], list[dict]]]]:
    """Tokens and top logprobs of batch[0] alone, then of the whole batch, from an engine whose decode
    steps run the layers as one C++ call (worker/models/decode_layers.py) and from one that runs them
    module by module: [on, off], on the CPU (the C++ layers exist only there, also on a GPU machine). Every
    KV block comes back in both. Two threads, so that the one call runs on a team
    (kernels/csrc/decode_team.h), which it must have: on two CPUs its threads spin between jobs and warm the
    next weights, on the one CPU of a suite's worker they take turns asleep."""
    kernels = load_cpu_kernels()
    assert kernels is not None
    runs = []
    for fused in (True, False):
        teams_before = kernels.decode_teams_led()
        llm = LLM(str(model_dir), device="cpu", num_threads=2, **llm_kwargs)
        model = llm.engine.runner.model.model
        assert model.decode_layers is not None
        if not fused:
            model.decode_layers = None
        outs = [
            llm.generate([batch[0]], params, use_tqdm=False)[0],
            *llm.generate(batch, params, use_tqdm=False),
        ]
        runs.append([(out["token_ids"], [dict(lp.top) for lp in out["logprobs"]]) for out in outs])
        assert (kernels.decode_teams_led() > teams_before) == fused
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    return runs


# Largest |quantized - float| logprob (nats) over tokens in both engines' top-5 while both saw the same
# context, by the engines' dtype, of the tokens both put within QUANTIZED_TOP_GAP nats of their most likely
# one. int8 with one scale per output channel rounds each weight by up to amax/254: on SmolLM2's
# projections (a row's largest weight ~5.6x its median) that is ~0.9% relative error per matmul, and the
# median top-5 gap is 0.08 nats. In bfloat16 a CPU with AVX512-VNNI or AVX2 also rounds each decode row of
# x to int8 in blocks of 32 (linear_int8_dots.h, as llama.cpp's Q8_1 activations), coarser than bf16's own
# rounding where a block holds one of SmolLM2's outlier channels: teacher-forced on SmolLM2's float32 chats
# (2026-12-01, Intel Xeon, AVX-512 with VNNI), the GGUF's Q4_1 in bfloat16 against its dequantized copy in
# float32 moved top-5 tokens by 0.19-0.26 nats on average and up to 2.1 (either weight layout), where the
# dequantized copy in bfloat16 moved them 0.06 and up to 0.43. The gap: a token far below a confident top
# one carries the difference of two logits' errors (its own and the top's, which grows with the top
# logit), not the error of the distribution's mass; teacher-forced, int8 bfloat16 against bfloat16 moved
# tokens above -1 nats up to 0.62 (median 0.02), -6 to -3 up to 0.68, below -6 up to 1.50 (median 0.19-
# 0.25). Seen in the greedy walks: float32 SmolLM2 int8 0.51 (1.05 with the tail), the random models
# 0.08-0.34 (near-flat: the gap changed none of their figures); bfloat16 (Intel Xeon) int8 0.62
# (2.12 with the tail), Q4_1 2.45 (a token at -5.63 against -3.18 nats; the rows' layout 1.04 on the same
# machine; the AMD EPYCs 1.00-1.37 with the tail). What the bounds catch, measured by planting scales 3%
# too large (every dequantized weight 3% off, under a rounding step's worth only at int4): qwen2 1.48-1.58
# nats in float32; on SmolLM2 (its norms absorb a
# common scale) neither bound does, 0.65 in float32 and 0.79 in bfloat16, and the per-weight rounding
# tests fail first.
QUANTIZED_LOGPROB_TOL = {"float32": 1.2, "bfloat16": 3.0}
QUANTIZED_TOP_GAP = 6.0


def greedy_with_logprobs(llm: LLM, prompts: list[list[int]], max_new: int) -> list[dict]:
    params = SamplingParams(temperature=0.0, logprobs=5, ignore_eos=True, max_tokens=max_new)
    return llm.generate(prompts, params, use_tqdm=False)


TP_PROMPTS = [[5, 9, 33, 2, 71, 100, 4], [300, 12], list(range(40, 97)), [7] * 20, [250, 251, 252]]
# float32: TP=2 logits are compared with TP=1 within 1e-4. On CPU (gloo), also on a CUDA machine: these
# tests start two ranks, and a machine with one GPU has no device for the second.
TP_ENGINE = {"kv_cache_memory": "32MiB", "max_model_len": 512, "dtype": "float32", "device": "cpu"}


def rank_processes(parent: psutil.Process) -> list[psutil.Process]:
    """The tensor-parallel ranks among a process's children: multiprocessing spawn children other than
    its resource tracker (the session's service processes are children of pytest too)."""
    ranks = []
    for child in parent.children():
        try:
            cmdline = " ".join(child.cmdline())
        except (psutil.ZombieProcess, psutil.NoSuchProcess):  # exited; not running anything
            continue
        if "multiprocessing" in cmdline and "resource_tracker" not in cmdline:
            ranks.append(child)
    return ranks


def compare_tp(model_dir: Path, **options: object) -> None:
    """TP=2 against TP=1: the same tokens, logits within 1e-4. Packed weights take the exact kernel: with the
    integer dots, the all-reduce's rounding-level difference moves some of x's values across a boundary of
    their int8 rounding (a whole step, 1/254 of their block's largest), so the two differ by the dots' own
    error (0.1-0.3 in these logits), not float32's."""
    options = {"exact_quantized_matmuls": True, **options}
    single = LLM(str(model_dir), **TP_ENGINE, **options)
    sharded = LLM(str(model_dir), tensor_parallel_size=2, **TP_ENGINE, **options)
    try:
        assert len(rank_processes(psutil.Process())) == 1
        want = single.generate(TP_PROMPTS, greedy(24), use_tqdm=False)
        got = sharded.generate(TP_PROMPTS, greedy(24), use_tqdm=False)
        assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
        for chunk in (1, 6):  # decode path and chunked prefill
            for ours, ref in zip(
                teacher_forced_logits(sharded, TP_PROMPTS, chunk),
                teacher_forced_logits(single, TP_PROMPTS, chunk),
            ):
                torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    finally:
        sharded.shutdown()
    assert rank_processes(psutil.Process()) == []


# Texts the tokenizer tests encode and decode (tests/test_gguf.py, tests/test_gguf_architectures.py).
# No digits here: on digits the two tokenizers differ on purpose (see test_tokenizer_digits).
TEXTS = [
    "Hello world",
    "  leading and trailing  ",
    "multiple   internal    spaces",
    "tabs\tand\nnewlines\r\n\n\nend",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "Café naïve résumé façade Ångström",
    "你好，世界！日本語のテキスト 한국어 Россия مرحبا",
    "Emoji: 😀👍🏽🇺🇸 and ❤️",
    "def foo(x):\n    return x ** y  # comment\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><jupyter_code>print(x)<empty_output>",
    "Punctuation!!! ??? ... --- (parens) [brackets] {braces}",
    "",
    " ",
    "\n\n",
]
TEXTS_WITH_DIGITS = [
    "Numbers 12345 and 3.14159 and 1,000,000",
    "a  5 x 12",
    "x =   42\n    y = 7",
    "In 2024, 50% of ½ is ¼; ٣ and Ⅻ are numerals too.",
]


class ReferencePasses:
    """An engine's teacher-forced log-probs (float32) per group of sequences, each group computed once
    however many kv_fidelity calls score against it: tests that compare other engines with the same
    reference on the same windows share its passes (and build it only if a pass is missing)."""

    def __init__(self, build: Callable[[], LLM], chunk: int) -> None:
        self.build, self.chunk = build, chunk
        self.llm: LLM | None = None
        self.passes: dict[tuple[tuple[int, ...], ...], list[torch.Tensor]] = {}

    def logprobs(self, part: list[list[int]]) -> list[torch.Tensor]:
        key = tuple(tuple(ids) for ids in part)
        if key not in self.passes:
            if self.llm is None:
                self.llm = self.build()
            logits = teacher_forced_logits(self.llm, part, self.chunk)
            self.passes[key] = [ref.float().log_softmax(-1) for ref in logits]
        return self.passes[key]


def kv_fidelity(
    reference: LLM | ReferencePasses, others: list[LLM], batch: list[list[int]], chunk: int, pair: int = 2
) -> list[tuple[float, float, int]]:
    """Teacher-forced over every position of `batch` (`chunk` tokens a step, `pair` sequences at a time, so
    that no more than their logits are held), for each of `others` against one pass of `reference`: the
    share of positions whose top-1 token it agrees with `reference` on, the mean KL(reference || it) per
    position in nats, and the number of positions. A ReferencePasses reference (its own chunk) holds its
    passes for later calls on the same pairs."""
    agree, kl, positions = [0] * len(others), [0.0] * len(others), 0
    for i in range(0, len(batch), pair):
        part = batch[i : i + pair]
        if isinstance(reference, ReferencePasses):
            refs = reference.logprobs(part)
        else:
            refs = [ref.float().log_softmax(-1) for ref in teacher_forced_logits(reference, part, chunk)]
        positions += sum(ref.shape[0] for ref in refs)
        for k, other in enumerate(others):
            for ref, got in zip(refs, teacher_forced_logits(other, part, chunk)):
                got = got.float().log_softmax(-1)
                agree[k] += int((ref.argmax(-1) == got.argmax(-1)).sum())
                kl[k] += float((ref.exp() * (ref - got)).sum(-1).sum())
    return [(a / positions, d / positions, positions) for a, d in zip(agree, kl)]


def text_windows(model_dir: Path, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens of English prose (this repository's docs, tokenized by the
    model's tokenizer), for measurements on real weights that random token ids would not exercise."""
    from transformers import AutoTokenizer

    root = Path(__file__).parent.parent
    text = "\n\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    if len(ids) < count * length:
        raise ValueError(f"the docs hold {len(ids)} tokens, fewer than {count} windows of {length}")
    return [ids[i * length : (i + 1) * length] for i in range(count)]


@contextmanager
def info_logs() -> Iterator[list[dict]]:
    """The log lines at info and above emitted inside (a process that configured no logging keeps its
    warnings and errors only)."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(**saved)
