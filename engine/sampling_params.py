"""`SamplingParams`: how one request chooses its tokens and when it stops.

Names, defaults and ranges follow vLLM's `SamplingParams` so that callers can swap one import.
Every invalid value raises `ValueError` naming the field, the value and the allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM treats a temperature below this as greedy (and resets top_p/top_k/min_p to "off").
_SAMPLING_EPS = 1e-5
MAX_N = 128
MAX_LOGPROBS = 20
_INT32_MAX = 2**31 - 1


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
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
