"""Per-request sampling options, validated at construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from nanovllm.common.logging import get_logger

# The structured-output constraints, SamplingParams fields of these names (at most one set per request).
CONSTRAINTS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 disable those filters.
    logprobs: None returns none; 0 returns the chosen token's logprob; N > 0 also
    returns the N most likely tokens. Logprobs come from the model's raw
    distribution (before penalties and temperature), as in vLLM; under a constraint,
    from that distribution restricted to the tokens the constraint allows.
    prompt_logprobs: the same for each prompt token after the first (the logprob of
    the actual token given those before it, and the N most likely), from the raw
    distribution; the prompt is then computed whole, prefix-cache hits or not.

    Structured output: at most one of json_schema (a JSON Schema, as text or a dict),
    json_object (any JSON object), regex, grammar (a Lark grammar in llguidance's
    dialect) or choice (one of these strings). The output then matches it; EOS is
    allowed exactly when it is complete, and a constrained request ends ("stop") as
    soon as nothing can follow. Reaching max_tokens first ends it with "length".
    JSON (json_schema, json_object) is compact by default: ", " and ": " between its
    tokens and no other whitespace, so a sampled answer cannot wander into blank space
    until max_tokens; json_free_whitespace allows any whitespace between tokens
    (pretty-printed output). A schema's own "x-guidance" options (llguidance's) win.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 64
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_free_whitespace: bool = False

    MAX_LOGPROBS = 20
    # Logits are divided by these: below MIN_DIVISOR a logit of ~30 overflows float32 to inf (1e-45 made
    # every token inf and the sampler picked token 0), and far outside [MIN, MAX] nothing is gained.
    MIN_DIVISOR = 0.01
    MAX_DIVISOR = 100.0

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.json_schema, dict):  # offline convenience; the wire carries text
            self.json_schema = json.dumps(self.json_schema)  # type: ignore[unreachable]  # typed as the wire's str
        if self.choice is not None:
            self.choice = list(self.choice)
        lo, hi = self.MIN_DIVISOR, self.MAX_DIVISOR
        if 0.0 < self.temperature < lo:
            # OpenAI's API takes any temperature in [0, 2], and clients send 0.001 for "almost greedy": as
            # vLLM does, such a temperature is raised to the smallest divisor that cannot overflow (a
            # warning once per process), rather than refused or turned into greedy sampling.
            _warn_raised_temperature(self.temperature, lo)
            self.temperature = lo
        self._check(
            self.temperature == 0.0 or lo <= self.temperature <= hi,
            "temperature",
            f"must be 0 (greedy) or in (0, {hi}], got {self.temperature}",
        )
        self._check(self.top_k >= -1, "top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        self._check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        self._check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        self._check(
            lo <= self.repetition_penalty <= hi,
            "repetition_penalty",
            f"must be in [{lo}, {hi}], got {self.repetition_penalty}",
        )
        self._check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        self._check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        self._check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        self._check(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        self._check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be non-negative integers, got {self.stop_token_ids}",
        )
        if self.logprobs is not None:
            self._check(
                0 <= self.logprobs <= self.MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}",
            )
        if self.prompt_logprobs is not None:
            self._check(
                0 <= self.prompt_logprobs <= self.MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs}",
            )
        if self.seed is not None:
            self._check(0 <= self.seed < 2**63, "seed", f"must be in [0, 2**63), got {self.seed}")
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) > 1:
            raise ValueError(
                f"SamplingParams.{given[1]} cannot be combined with {given[0]}: one constraint at most"
            )
        if self.choice is not None:
            self._check(
                bool(self.choice) and all(isinstance(c, str) and c for c in self.choice),
                "choice",
                f"must be a non-empty list of non-empty strings, got {self.choice!r}",
            )
        for name in ("json_schema", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                self._check(isinstance(value, str) and value.strip() != "", name, "must be non-empty text")
        self._check(
            not self.json_free_whitespace or self.json_schema is not None or self.json_object,
            "json_free_whitespace",
            "applies to json_schema and json_object only",
        )

    @staticmethod
    def _check(ok: bool, name: str, message: str) -> None:
        if not ok:
            raise ValueError(f"SamplingParams.{name} {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constraint(self) -> tuple[str, str, bool] | None:
        """(kind, spec, free whitespace) of the structured-output constraint, or None: kind is a
        CONSTRAINTS name and spec its text (choice as a JSON list), so the triple identifies the
        constraint for a cache."""
        free = self.json_free_whitespace
        if self.json_object:
            return "json_object", "", free
        if self.choice is not None:
            return "choice", json.dumps(self.choice, ensure_ascii=False), False
        for name in ("json_schema", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                return name, value, free
        return None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


_temperature_warning = {"logged": False}


def _warn_raised_temperature(asked: float, used: float) -> None:
    """A warning the first time a temperature is raised in this process, not once per request."""
    if not _temperature_warning["logged"]:
        _temperature_warning["logged"] = True
        get_logger(__name__).warning(
            "temperature_raised",
            asked=asked,
            used=used,
            detail=f"temperatures in (0, {used}) are raised to {used}: logits divided by less overflow",
        )
