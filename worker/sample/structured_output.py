"""Structured output: a request's constraint (SamplingParams.constraint) compiled into a grammar, and a
matcher per request that says which tokens may come next.

llguidance does the work (why it and not xgrammar: README, "Structured output"): it compiles JSON
Schema, regex and Lark grammars against the model's tokenizer in about a millisecond and computes a
step's token masks in parallel outside the GIL. Compilation runs on a thread of its own, cached by the
constraint, so the engine thread never waits on it; each request advances its own copy of the compiled
matcher with the tokens it keeps. The masks are bitmasks (one bit per token of the logits' vocabulary)
that the sampler applies to the logits before anything else (worker/sample/sampler.py).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, cast

import torch

from nanovllm.common.errors import RequestError
from nanovllm.common.logging import get_logger
from nanovllm.worker.sequence import Sequence
from nanovllm.worker.step import SamplingRow, SchedulerOutput

if TYPE_CHECKING:  # llguidance is imported where it is used
    from llguidance import LLTokenizer
    from llguidance._lib import JsonCompileOptions

log = get_logger(__name__)

# Compiled constraints kept for reuse (a few KB to a few MB each); the least recently used goes first.
CACHE_SIZE = 256
# While only constraints are compiling, a step waits this long at most for one to finish, so the thread
# that drives the engine still takes new commands promptly.
GRAMMAR_WAIT_S = 0.02


# JSON as json.dumps writes it, on one line. llguidance's default lets any whitespace stand between two
# JSON tokens, and a small model sampling at temperature 0.7-1.3 wandered into it until max_tokens (1 of
# 29 answers of the embedded SmolLM2): with only these separators every answer reaches its end. A single
# space after "," and ":" keeps the text as readable as Python's default output.
COMPACT_JSON: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
FREE_WHITESPACE_JSON: JsonCompileOptions = {"whitespace_flexible": True}

# A JSON number's digits are the other place a sampled answer can run to max_tokens (one of 300 did:
# `"wind_kmh": 5.8322179115...`), so a number the schema leaves unbounded gets the bounds RFC 8259 section 6
# gives for interoperable numbers (IEEE 754 binary64): an integer within +-(2**53 - 1), any other number
# within +-1e15 in steps of 1e-9 (15 digits before the point and 9 after, beyond binary64's 15-17
# significant digits). A schema's own minimum, maximum or multipleOf wins over each.
MAX_SAFE_INTEGER = 2**53 - 1
NUMBER_LIMIT = 1e15
NUMBER_STEP = 1e-9
# Keywords whose values are data, not subschemas: a {"type": "number"} inside them is left alone.
_DATA_KEYWORDS = frozenset({"const", "enum", "examples", "default", "required", "x-guidance"})
# json_object: an object whose values are any JSON, its numbers bounded as above.
ANY_JSON_OBJECT = {
    "$defs": {
        "value": {
            "anyOf": [
                {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}},
                {"type": "array", "items": {"$ref": "#/$defs/value"}},
                {"type": "string"},
                {"type": "number"},
                {"type": "boolean"},
                {"type": "null"},
            ]
        }
    },
    "type": "object",
    "additionalProperties": {"$ref": "#/$defs/value"},
}


def bounded_numbers(schema: Any) -> Any:
    """`schema` with bounds on every integer and number it leaves unbounded (see MAX_SAFE_INTEGER)."""
    if isinstance(schema, list):
        return [bounded_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    bounded = {k: v if k in _DATA_KEYWORDS else bounded_numbers(v) for k, v in schema.items()}
    kind = schema.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    if kinds & {"integer", "number"}:
        limit = NUMBER_LIMIT if "number" in kinds else MAX_SAFE_INTEGER
        if not schema.keys() & {"minimum", "exclusiveMinimum"}:
            bounded["minimum"] = -limit
        if not schema.keys() & {"maximum", "exclusiveMaximum"}:
            bounded["maximum"] = limit
        if "number" in kinds and "multipleOf" not in schema:
            bounded["multipleOf"] = NUMBER_STEP
    return bounded


def grammar_text(kind: str, spec: str, free_whitespace: bool = False) -> str:
    """The llguidance grammar for a constraint (kind, spec, free_whitespace) as
    SamplingParams.constraint gives it."""
    from llguidance import LLMatcher

    if kind in ("json_schema", "json_object"):
        # A schema's own "x-guidance" options come after these defaults, so they win.
        schema = bounded_numbers(json.loads(spec) if kind == "json_schema" else ANY_JSON_OBJECT)
        defaults = FREE_WHITESPACE_JSON if free_whitespace else COMPACT_JSON
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(spec)
    if kind == "choice":  # Lark string literals take JSON's escapes, so any text is one literal
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec)))
    raise ValueError(f"unknown constraint kind {kind!r}")


class GrammarCompiler:
    """Compiles constraints into fresh llguidance matchers off the calling thread, each constraint once.
    Called from one thread (the engine's); the compilations run one at a time on a thread of their own.

    The tokenizer is read from the model directory on first use (a second alone, 6 s seen on a busy 2-core
    machine), so a worker that never sees a constraint never pays for it. That read is the worker's cost,
    not a request's: `tokenizer_read_at` says when it ended, and a constraint's compile time limit counts
    from then (ConstraintQueue, LLM.generate).
    """

    def __init__(self, model: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._tokenizer: LLTokenizer | None = None  # llguidance's, built by the compile thread on first use
        self._tokenizer_error: RequestError | None = None  # why it could not be built, once it could not
        # time.monotonic() when the tokenizer's read ended (built or failed); None before. Written by the
        # compile thread, read by the engine's.
        self.tokenizer_read_at: float | None = None

    def counting_from(self, since: float) -> float | None:
        """When a constraint's time limit starts for a request that asked at `since`: then, or when the
        tokenizer's read ended if that was later; None while it is being read."""
        read_at = self.tokenizer_read_at
        return None if read_at is None else max(since, read_at)

    def compile(self, constraint: tuple[str, str] | tuple[str, str, bool]) -> Future:
        """A future of the compiled matcher (never advanced: copy it per request), or of the RequestError
        that names what is wrong with the constraint."""
        future = self._cache.get(constraint)
        if future is not None:
            self._cache.move_to_end(constraint)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        future = self._pool.submit(self._compile, *constraint)
        self._cache[constraint] = future
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, kind: str, spec: str, free_whitespace: bool = False):
        from llguidance import LLMatcher

        try:
            grammar = grammar_text(kind, spec, free_whitespace)
        except ValueError as exc:  # llguidance: the schema is not JSON
            raise RequestError(f"SamplingParams.{kind} does not compile: {exc}") from None
        matcher = LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"SamplingParams.{kind} does not compile: {matcher.get_error()}")
        return matcher

    def _llg_tokenizer(self):
        if self._tokenizer_error is not None:
            raise self._tokenizer_error
        if self._tokenizer is None:
            import llguidance.hf
            from transformers import AutoTokenizer

            try:
                hf_tokenizer = AutoTokenizer.from_pretrained(self.model)
            except (OSError, ValueError) as exc:
                self._tokenizer_error = RequestError(
                    f"structured output needs the model's tokenizer, and {self.model} has none usable: {exc}"
                )
                self.tokenizer_read_at = time.monotonic()
                raise self._tokenizer_error from None
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
            )
            self.tokenizer_read_at = time.monotonic()
            log.info("grammar_tokenizer_loaded", model=self.model, vocab_size=self.vocab_size)
        return self._tokenizer


class Grammar:
    """One request's position in its constraint: advanced by each token the request keeps."""

    def __init__(self, compiled) -> None:
        self.matcher = compiled.deep_copy()

    def consume(self, token_ids: list[int]) -> bool:
        """Advance past `token_ids`; False (the matcher then unusable) when the constraint rejects one."""
        return self.matcher.consume_tokens(token_ids)

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the constraint accepts from here (nothing is consumed)."""
        return self.matcher.validate_tokens(token_ids) if token_ids else 0

    @property
    def is_stopped(self) -> bool:
        """Complete, and nothing can follow: the request ends here."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class MaskFiller:
    """Fills one step's token bitmasks for every constrained row at once, on llguidance's threads."""

    def __init__(self, vocab_size: int, num_threads: int) -> None:
        from llguidance import LLExecutor

        self.words = (vocab_size + 31) // 32
        self._executor = LLExecutor(num_threads)

    def fill(self, entries: list[tuple[Grammar, list[int]]]) -> torch.Tensor:
        """int32 [sum of (1 + len(tokens)), words]: for each (grammar, tokens), the mask now and after each
        of `tokens` (which the grammar must accept), in the order given."""
        rows = sum(1 + len(tokens) for _, tokens in entries)
        bitmask = torch.empty((rows, self.words), dtype=torch.int32)
        plain, with_tokens, row = [], [], 0
        for grammar, tokens in entries:
            if tokens:
                with_tokens.append((grammar.matcher, row, list(tokens)))
            else:
                plain.append((grammar.matcher, row))
            row += 1 + len(tokens)
        pointer, size = bitmask.data_ptr(), self.words * 4
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, pointer, size, rows)
        if with_tokens:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(with_tokens, pointer, size, rows)
        return bitmask


def compile_timeout_message(kind: str, timeout_s: float) -> str:
    """A constraint of `kind` (json_schema, regex, ...) that did not compile in time, as its request's error."""
    return f"SamplingParams.{kind} did not compile within grammar_compile_timeout_s = {timeout_s} s"


class ConstraintQueue:
    """The engine's side of structured output: constrained requests wait here while their constraint
    compiles (never blocking the engine thread), and each step's constrained rows get their masks here."""

    def __init__(self, compiler: GrammarCompiler, vocab_size: int, timeout_s: float) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        # request id -> (sequence, its compiled matcher to come, when it was added)
        self._compiling: dict[str, tuple[Sequence, Future, float]] = {}
        self._masks: MaskFiller | None = None  # built with the first constrained step

    def __len__(self) -> int:
        """Requests still compiling."""
        return len(self._compiling)

    def add(self, seq: Sequence) -> None:
        constraint = seq.params.constraint
        assert constraint is not None  # a constrained request
        self._compiling[seq.request_id] = (seq, self.compiler.compile(constraint), time.monotonic())

    def remove(self, request_id: str) -> bool:
        """Forget a request still compiling (aborted); False when it is not here."""
        return self._compiling.pop(request_id, None) is not None

    def admit(self) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
        """The requests whose constraint compiled, each given its own matcher (advanced past the tokens a
        resumed request brought), and those refused with why: their constraint failed or ran out of time."""
        ready, refused = [], []
        now = time.monotonic()
        for request_id, (seq, future, added) in list(self._compiling.items()):
            if not future.done():
                counting_from = self.compiler.counting_from(added)  # None: the tokenizer is being read
                if counting_from is None or now < counting_from + self.timeout_s:
                    continue
            del self._compiling[request_id]
            error = None
            if not future.done():
                constraint = seq.params.constraint
                assert constraint is not None  # a constrained request
                error = compile_timeout_message(constraint[0], self.timeout_s)
            elif future.exception() is not None:
                error = str(future.exception())
            else:
                seq.grammar = Grammar(future.result())
                if not seq.grammar.consume(seq.output_token_ids):
                    error = f"output_token_ids do not match the request's constraint: {seq.grammar.error}"
            if error is None:
                ready.append(seq)
            else:
                refused.append((seq, error))
        return ready, refused

    def wait(self) -> None:
        """Wait until a constraint finishes compiling, or GRAMMAR_WAIT_S has passed."""
        wait([future for _, future, _ in self._compiling.values()], GRAMMAR_WAIT_S, FIRST_COMPLETED)

    def fill_masks(self, sched: SchedulerOutput, rows: list[SamplingRow]) -> bool:
        """Give the rows of constrained requests their token bitmasks; False when no row is constrained.
        Row j of a request with proposals is masked as if its first j proposals had been accepted. Rows
        after a proposal the constraint rejects keep no mask: their picks are never kept, since the pick at
        that proposal cannot equal it."""
        entries, offsets, offset = [], [], 0
        for item in sched.scheduled:
            if not item.samples:
                continue
            grammar = item.seq.grammar
            if grammar is not None:
                spec = item.spec_token_ids
                # the engine's grammars are Grammars (a Sequence types its own by a protocol)
                entries.append((cast(Grammar, grammar), spec[: grammar.valid_prefix(spec)]))
                offsets.append(offset)
            offset += 1 + len(item.spec_token_ids)
        if not entries:
            return False
        if self._masks is None:
            self._masks = MaskFiller(self.vocab_size, torch.get_num_threads())
        bitmask = self._masks.fill(entries)
        row = 0
        for (_, accepted), offset in zip(entries, offsets):
            for j in range(1 + len(accepted)):
                rows[offset + j].token_bitmask = bitmask[row]
                row += 1
        return True

    def shutdown(self) -> None:
        self.compiler.shutdown()
