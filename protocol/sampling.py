"""Per-request sampling parameters: validated on construction and on decode from the wire."""
from __future__ import annotations

import math

import msgspec

INT32 = 2**31
INT64 = 2**63
# The most top alternatives a request may ask for, per generated or prompt token.
MAX_LOGPROBS = 20


class StructuredOutput(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A constraint on what a request generates (vLLM's structured outputs): exactly one of a
    JSON schema (JSON text, or a dict in Python), any JSON object, a regular expression, a
    choice among strings, or a grammar (Lark, llguidance's dialect, or GBNF). The scheduler
    compiles it once per distinct text and masks every sampled token to what it allows."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError("structured_output takes exactly one of json, json_object, regex, "
                             f"choice or grammar, got {', '.join(given) or 'none'}")
        if self.choice is not None and (isinstance(self.choice, str) or not self.choice or any(
                not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError(f"structured_output.choice must be a non-empty list of non-empty "
                             f"strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_output.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        """The name of the field that is set (json, json_object, regex, choice, grammar)."""
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None
                    ) if not self.json_object else "json_object"


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True,
                     forbid_unknown_fields=True):
    """How to pick each next token and when to stop.

    temperature 0 means greedy. A seed makes a sampled request reproducible regardless of
    which other requests share its batches.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    cache_salt: str | None = None
    # Neutral defaults: a request that leaves these alone is sampled exactly as before.
    repetition_penalty: float = 1.0     # transformers' meaning, over prompt and output tokens
    presence_penalty: float = 0.0       # OpenAI's meaning, over output tokens
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    # The output ends before the first of these strings; its text never holds one.
    stop: tuple[str, ...] = ()
    # Log-probabilities of the raw model distribution (before penalties, temperature and
    # filtering): with logprobs=k each generated token's own and the k likeliest; with
    # prompt_logprobs=k the same for every prompt token after the first. None: not computed.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Generation constrained to a schema, regex, choice or grammar (None: free).
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) \
                or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -INT64 <= self.seed < INT64):
            raise ValueError(f"seed must be a 64-bit integer or None, got {self.seed!r}")
        if self.max_tokens >= INT32 or self.top_k >= INT32:
            raise ValueError(f"max_tokens and top_k must be below 2**31, got {self.max_tokens}, "
                             f"{self.top_k}")
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, math.inf, "> 0")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, "
                                 f"got {value!r}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < INT64:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {token_id!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _check_range(name: str, value: object, low: float, high: float, wanted: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high or (name == "repetition_penalty" and value <= 0):
        raise ValueError(f"{name} must be a finite number {wanted}, got {value!r}")
