"""What serves the router's sub-requests, behind RouterCore: the interface, and the types both sides speak.

RouterCore (router/core.py) validates a request, tokenizes it and fans it out into sub-requests; a Backend serves one
sub-request at a time and puts its GenerateDeltas on the queue the core merges. Two implementations:
- router/disaggregated.py: prefill and decode instances over gRPC (the KV goes from one to the other);
- router/colocated.py: one engine in this process runs both phases (`tandem router --colocated`).
"""
from __future__ import annotations

import asyncio
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

from engine.config import SchedulerConfig
from engine.sampling_params import SamplingParams


@dataclass
class GenerateDelta:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    stop_reason: int | str | None = None
    """With finish_reason "stop": the stop token id or stop string that ended it (None: end of sequence)."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    kv_transfer_s: float | None = None
    """On a sub-request's last delta: its KV transfer's seconds, as the prefill instance measured them (None: no
    transfer)."""
    timings: dict[str, float] | None = None
    """On a sub-request's last delta, when its request asked for them: RouterCore's timing breakdown."""


class RequestError(Exception):
    """A request that cannot be served; code in {"invalid_argument", "not_found", "resource_exhausted",
    "unavailable", "internal"}, field names the offending request field (or None); retry_after_s: when a refusal
    under load may be retried (HTTP Retry-After, gRPC trailing metadata retry-after)."""

    def __init__(self, code: str, field: str | None, message: str, *, retry_after_s: int | None = None):
        super().__init__(message)
        self.code, self.field, self.message = code, field, message
        self.retry_after_s = retry_after_s


class NoRoom(RequestError):
    """Every instance that could serve the sub-request refused it for lack of room now, before anything was queued
    for the client: the core may try it again later (router/admission.py), under a new sub-request id."""

    def __init__(self, message: str):
        super().__init__("resource_exhausted", None, message)


# An engine's ValueError names the field first ("max_tokens=0: must be >= 1"), maybe behind a service's "name: ".
_FIELD_IN_MESSAGE = re.compile(r"^(?:[\w.]+: )?(\w+)[=:.]")  # (a nested field: its top-level name)


def field_in_message(message: str) -> str | None:
    """The field an engine's ValueError message names (SamplingParams' and the engine's checks name it first)."""
    m = _FIELD_IN_MESSAGE.match(message)
    return m.group(1) if m else None


def invalid_argument(message: str, where: str = "") -> RequestError:
    """An engine's ValueError message (raised here, or sent back by an instance) as a RequestError naming its field;
    `where` goes in front of the message ("decode host:port: ")."""
    return RequestError("invalid_argument", field_in_message(message), where + message)


class Backend(ABC):
    """Serves sub-requests for a RouterCore. The model constants below are set by the constructor and never change;
    `start` runs once before the first `serve_one`, `close` once after the last."""

    def __init__(self, tokenizer, served_name: str, max_model_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.served_name = served_name
        """The model name clients use."""
        self.max_model_len = max_model_len
        """Context length: prompt + output tokens."""
        self.vocab_size = vocab_size

    def default_max_concurrent(self) -> int:
        """Sub-requests in flight that fill what serves them: --max-concurrent-requests' default (one engine's
        max_num_seqs here)."""
        return SchedulerConfig.max_num_seqs

    @abstractmethod
    async def start(self) -> None:
        """Connects to (or starts) what serves the requests."""

    @abstractmethod
    async def close(self) -> None:
        """Cancels what is still running and frees what start() took."""

    @abstractmethod
    def ready(self) -> bool:
        """Whether a request sent now can be served (the HTTP /health and gRPC health answer)."""

    @abstractmethod
    async def serve_one(self, rid: str, index: int, prompt: list[int], params: SamplingParams,
                        queue: asyncio.Queue) -> None:
        """Serves sub-request `rid` (choice `index`) of a validated prompt: puts its GenerateDeltas on `queue`, the
        first token first, and returns after the one with a finish reason. Failures raise (RequestError names what
        went wrong). Cancelled when the consumer goes away: everything the request holds is freed by then or soon."""
