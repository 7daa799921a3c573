"""A request inside the engine: its tokens, how many of them have KV computed, and how it ended."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    RESERVED = enum.auto()  # decode side: blocks reserved, KV arriving from a prefill instance
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in FINISHED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self)


FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                  RequestStatus.FINISHED_ABORTED: "abort"}
# The statuses of a request that ended. A tuple: `in` finds a member by identity, where a set would hash it through
# Enum.__hash__, a Python call.
FINISHED = tuple(FINISH_REASONS)


class Request:
    """Scheduling works on token counts only: num_computed_tokens catches up with num_tokens."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 max_tokens: int, *, parent_id: str | None = None, index: int = 0, kv_hold: bool = False,
                 arrival_time: float | None = None):
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index  # which of the parent's n completions
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved against max_model_len
        self.kv_hold = kv_hold  # prefill side: keep the blocks after finishing, until released
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens a launched step will sample that the host has not read yet (async scheduling: 0, 1 or 2). They
        # count towards what the scheduler may schedule (their KV is written by the next step) but are not in
        # output_token_ids until the engine reads them.
        self.num_inflight_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first scheduling
        self.num_preemptions = 0
        self.swapped_blocks: list[int] | None = None  # preempted and swapped out: its host blocks (engine/host_kv.py)
        self.stop_reason: int | str | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_token_time: float | None = None
        # The seed of this completion's draws (each token's from this and its position: engine/sampler.py).
        self.seed = None if sampling_params.seed is None else sampling_params.seed + index
        # Detokenization state (engine/llm_engine.py).
        self.output_text = ""
        self.prefix_offset = 0  # output tokens [prefix_offset, read_offset) were decoded as context last time
        self.read_offset = 0
        self.sent_text_len = 0
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # Structured outputs: a RequestGrammar (engine/structured_output.py), set by the engine; the scheduler
        # leaves the request alone until it is active (compiled, matcher caught up with output_token_ids).
        self.grammar = None

    @property
    def grammar_pending(self) -> bool:
        return self.grammar is not None and self.grammar.matcher is None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:  # decode: no copy of the whole sequence
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
