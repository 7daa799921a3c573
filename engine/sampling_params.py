"""`SamplingParams`: how one request chooses its tokens and when it stops.

Names, defaults and ranges follow vLLM's `SamplingParams` so that callers can swap one import.
Every invalid value raises `ValueError` naming the field, the value and the allowed range.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

# vLLM treats a temperature below this as greedy (and resets top_p/top_k/min_p to "off").
_SAMPLING_EPS = 1e-5
MAX_N = 128
MAX_LOGPROBS = 20
_INT32_MAX = 2**31 - 1
# A constraint's text (a JSON schema, regex, grammar, structural tag, or the choices together) is bounded: it goes
# with every sub-request to the workers, and compiling it costs time that grows with its size.
MAX_STRUCTURED_OUTPUT_BYTES = 64 * 1024
MAX_CHOICES = 1024
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, as vLLM's: exactly one of the kinds, and options for JSON.
    The engine compiles it into a grammar (engine/structured_output.py) that masks the logits at every step."""
    json: str | dict | None = None
    """A JSON schema (text or object): the output is one JSON value that validates against it."""
    regex: str | None = None
    """The output fully matches this regular expression."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (GBNF syntax, root rule `root`) the output belongs to."""
    json_object: bool | None = None
    """True: the output is any JSON object (OpenAI's response_format json_object)."""
    structural_tag: str | None = None
    """xgrammar's structural tag (JSON text): free text in which tagged regions follow their schemas."""
    disable_any_whitespace: bool = False
    """JSON: one fixed separator between tokens (", " and ": ", as vLLM's xgrammar backend), not any whitespace."""
    disable_additional_properties: bool = False
    """JSON: objects of the schema that do not say otherwise take no properties beyond those listed."""
    whitespace_pattern: str | None = None
    """JSON: a regex for whitespace (outlines' option); the xgrammar backend does not take it."""

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: exactly one of {', '.join(_KINDS)} must be set, got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                _check_size("structured_outputs.json", self.json)
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json: a JSON schema must be an object or a boolean, got "
                                 f"{type(schema).__name__}")
            # The canonical text: one cache entry per schema whatever its spacing. Not its key order: the output
            # lists an object's properties in the schema's order.
            try:
                self.json = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
            except (TypeError, ValueError, RecursionError) as e:
                raise ValueError(f"structured_outputs.json: not a JSON value ({e})") from None
            _check_size("structured_outputs.json", self.json)
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ValueError(f"structured_outputs.{name}: must be a non-empty string")
                _check_size(f"structured_outputs.{name}", value)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice: {len(self.choice)} choices, must be at most "
                                 f"{MAX_CHOICES}")
            self.choice = list(self.choice)
            _check_size("structured_outputs.choice", "".join(self.choice))
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name}={getattr(self, name)!r}: must be true or false")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object={self.json_object!r}: must be true or unset")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern: not supported by the xgrammar backend; use "
                             "disable_any_whitespace=true for compact JSON")
        from engine.structured_output import check_constraint  # (imports xgrammar only when a request asks)

        check_constraint(self)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """The canonical constraint: equal keys compile to the same grammar."""
        value = getattr(self, self.kind)
        return (self.kind, tuple(value) if isinstance(value, list) else value, self.disable_any_whitespace,
                self.disable_additional_properties)

    @classmethod
    def from_dict(cls, d: dict) -> "StructuredOutputsParams":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {', '.join(unknown)} (known: "
                             f"{', '.join(sorted(names))})")
        return cls(**d)


def _check_size(field: str, text: str) -> None:
    n = len(text.encode())
    if n > MAX_STRUCTURED_OUTPUT_BYTES:
        raise ValueError(f"{field}: {n} bytes, must be at most {MAX_STRUCTURED_OUTPUT_BYTES}")


@dataclass
class SamplingParams:
    n: int = 1
    """Number of output sequences to generate for the prompt."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token that already appears in the output; in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per occurrence in the output; in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens seen in the prompt or output; > 0, 1 = off."""
    temperature: float = 1.0
    """Softmax temperature; >= 0, 0 = greedy."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability sum reaches top_p; in (0, 1], 1 = off."""
    top_k: int = 0
    """Keep the top_k most likely tokens; 0 or -1 = off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's; in [0, 1], 0 = off."""
    seed: int | None = None
    """Seed of this request's own random generator; None = the engine's shared one."""
    stop: str | list[str] | None = None
    """Strings that stop generation; normalized to a list."""
    stop_token_ids: list[int] | None = None
    """Token ids that stop generation (in addition to EOS unless ignore_eos)."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string in the output text."""
    ignore_eos: bool = False
    """Keep generating after the EOS token."""
    max_tokens: int | None = 16
    """Most output tokens per sequence; None = up to the model's context length."""
    min_tokens: int = 0
    """EOS and stop_token_ids are masked until this many output tokens exist."""
    logprobs: int | None = None
    """Return the log-probabilities of the top `logprobs` tokens plus the sampled one; 0 = only the sampled one."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    structured_outputs: StructuredOutputsParams | None = None
    """A constraint the output follows (JSON schema, regex, choice, grammar); None = unconstrained."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                    StructuredOutputsParams):
            raise ValueError(f"structured_outputs={self.structured_outputs!r}: must be a StructuredOutputsParams, "
                             "a dict of its fields, or None")
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # As vLLM: greedy ignores the truncation parameters.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n={self.n!r}: must be an int in [1, {MAX_N}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}={value!r}: must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r}: must be > 0 (1 = off)")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature={self.temperature!r}: must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r}: must be -1 or 0 (off) or an int >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p!r}: must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed={self.seed!r}: must be an int or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be an int >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens!r}: must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens!r}: must be <= max_tokens={self.max_tokens}")
        if self.logprobs is not None and (
                not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs={self.logprobs!r}: must be an int in [0, {MAX_LOGPROBS}] or None")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop={self.stop!r}: must be a non-empty string or a list of them")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: must be ints >= 0")
        # What the services' wire carries (tandem.v1.SamplingParams): int32 counts and ids, an int64 seed (the
        # router gives completion i of n the seed + i).
        for name in ("top_k", "max_tokens", "min_tokens"):
            value = getattr(self, name)
            if value is not None and value > _INT32_MAX:
                raise ValueError(f"{name}={value}: must be at most {_INT32_MAX}")
        if any(t > _INT32_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: must be ints <= {_INT32_MAX}")
        if self.seed is not None and not -2**63 <= self.seed <= 2**63 - self.n:
            raise ValueError(f"seed={self.seed}: must be in [-2**63, 2**63 - n] (a 64-bit seed for each of the n "
                             "completions)")

    @property
    def greedy(self) -> bool:
        """Argmax decoding (temperature below 1e-5, as vLLM)."""
        return self.temperature < _SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
