"""Request migration: a sub-request whose instance fails mid-stream continues on another one, token-exact, on the
same client stream (NVIDIA Dynamo's `migration_limit`). The disaggregated backend (router/disaggregated.py) runs
each attempt; this module keeps the stream's state between attempts and decides whether, and when, to go again.

The life of a moved sub-request:
1. `Stream` keeps what the client was sent: the output token ids (so the completion count), with the prompt and
   the sampling parameters. Each attempt puts its deltas through `Stream.put`.
2. An attempt fails in a way another instance can make good and raises `Lost` (see `lost_or_error`): the decode
   stream broke (UNAVAILABLE; the server cancelled it; it ended before a finish), the health poll lost the decode
   instance (router/instances.py), the prefill instance failed, or the KV transfer between them failed or missed
   its deadline (ABORTED, DEADLINE_EXCEEDED, a prefill's "kv transfer" UNAVAILABLE). Not moved: INVALID_ARGUMENT,
   NOT_FOUND, INTERNAL and every other code (the request, not an instance, is at fault), and a client's cancel.
3. `Migration.serve` counts the move (`tandem:request_migrations_total{reason}`), logs it with the request id, waits
   for a healthy decode instance (up to --migration-timeout) and starts the next attempt as `<rid>.m<n>` (a new id:
   the failed attempt's calls may hold the old one for a moment) with prior_output_token_ids = the tokens sent. A
   prefill instance prefills prompt + those tokens (its prefix cache often holds the prompt) and sends their KV to
   the new decode instance; with no prefill instance healthy, the decode instance prefills them itself. The new
   attempt's first token is the stream's next one: the engines replay the rest (penalties, min_tokens, stop
   strings, the detokenizer's state, the seed's position), so the stream goes on as if it had never moved.
4. Past --migration-limit moves, or with no decode instance by the timeout, the client gets the last failure's
   error. While the moving attempt finds no decode instance with room or none healthy, it is tried again (until
   the same timeout) without counting another move.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from engine.sampling_params import SamplingParams
from protos.tandem.v1 import common_pb2
from router.backend import GenerateDelta, RequestError
from serving.convert import finish_from_proto, logprobs_from_proto, stop_reason_from_proto
from serving.hops import hop
from serving.metrics import Metrics

log = logging.getLogger("tandem.router.migration")

# While a moving attempt finds every decode instance full: how long it waits before it tries again.
_NO_ROOM_RETRY_S = 0.2


class Lost(Exception):
    """An attempt failed because of an instance, not of the request: another instance may finish the stream.
    reason: a serving.metrics.MIGRATION_REASONS label; error: what the client gets if the stream cannot move."""

    def __init__(self, reason: str, error: RequestError):
        super().__init__(error.message)
        self.reason, self.error = reason, error


def lost_or_error(e: grpc.aio.AioRpcError, role: str, where: str) -> Lost | None:
    """The Lost an instance's failed call means, or None when the code says the request itself is at fault (the
    caller raises its RequestError). where: "decode host:port: ", in front of the message."""
    code, details = e.code(), e.details() or e.code().name
    error = RequestError("unavailable", None, where + details)
    if code == grpc.StatusCode.UNAVAILABLE:
        # A prefill that says "kv transfer" lost its decode target, not itself.
        return Lost("kv_transfer" if role == "prefill" and "kv transfer" in details else f"{role}_unavailable", error)
    if code in (grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Lost("kv_transfer", error)
    if code == grpc.StatusCode.CANCELLED:  # by the server (this router's own cancels raise CancelledError)
        return Lost(f"{role}_unavailable", error)
    return None


@dataclass
class Stream:
    """One sub-request's client stream, across its attempts."""
    rid: str
    index: int
    prompt: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    sent: list[int] = field(default_factory=list)  # output token ids queued for the client, in order
    moves: int = 0
    attempts: int = 0
    moving_since: float | None = None  # the last failure, until the next attempt's first delta
    deadline: float = 0.0  # monotonic: when a moving stream gives up waiting for an instance
    cached_tokens: int | None = None  # prompt tokens the first attempt's prefill found cached
    kv_transfer_s: float | None = None  # the last attempt's KV transfer (set before its last delta is put)

    def put(self, d: common_pb2.TokenDelta, default_reason: str | None = None,
            cached_tokens: int | None = None) -> str | None:
        """Queues one delta of the current attempt for the client; returns its finish reason (default_reason when
        the delta has none). cached_tokens: a FirstToken's count (the first attempt's is the client's)."""
        tokens = list(d.token_ids)
        self.sent += tokens
        if self.cached_tokens is None and cached_tokens is not None:
            self.cached_tokens = cached_tokens
        reason = finish_from_proto(d.finish_reason) or default_reason
        self.queue.put_nowait(GenerateDelta(self.index, tokens, d.text, logprobs_from_proto(d.logprobs), reason,
                                            len(self.prompt), len(self.sent),
                                            stop_reason_from_proto(d.stop_reason, self.params) if reason else None,
                                            self.cached_tokens or 0,
                                            kv_transfer_s=self.kv_transfer_s if reason is not None else None))
        if self.moving_since is not None:
            log.info("request %s: resumed %.3f s after the failure (move %d, %d tokens sent before it)", self.rid,
                     time.monotonic() - self.moving_since, self.moves, len(self.sent) - len(tokens))
            hop(self.rid, "router.resumed")
            self.moving_since = None
        return reason


class Migration:
    """Runs a stream's attempts until one finishes it, moving it after each `Lost` (see the module docstring)."""

    def __init__(self, limit: int, timeout_s: float, metrics: Metrics, wait_for_decode: Callable[[float],
                 Awaitable[bool]], decode_ready: Callable[[], bool]):
        self.limit = limit
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.wait_for_decode = wait_for_decode  # (timeout_s) -> whether a decode instance is healthy by then
        self.decode_ready = decode_ready

    async def serve(self, s: Stream, attempt: Callable[[Stream, str], Awaitable[None]]) -> None:
        aid = s.rid
        while True:
            try:
                return await attempt(s, aid)
            except Lost as lost:
                await self._move(s, lost)
            except RequestError as e:
                if s.moving_since is None or e.code not in ("unavailable", "resource_exhausted"):
                    raise
                await self._retry(s, e)  # the moving attempt found no decode instance (with room)
            s.attempts += 1
            aid = f"{s.rid}.m{s.attempts}"

    async def _move(self, s: Stream, lost: Lost) -> None:
        err = lost.error
        if s.moves >= self.limit:
            moved = f"moved {s.moves} time(s) already" if s.moves else "not moved"
            raise RequestError(err.code, err.field, f"{err.message} (the request was {moved}: "
                                                    f"--migration-limit {self.limit})") from None
        s.moves += 1
        self.metrics.request_migrations[lost.reason].inc()
        now = time.monotonic()
        s.moving_since, s.deadline = now, now + self.timeout_s
        log.warning("request %s: %s: moving it (%s, move %d of at most %d, %d tokens sent)", s.rid, err.message,
                    lost.reason, s.moves, self.limit, len(s.sent))
        hop(s.rid, "router.migrate")
        if not await self.wait_for_decode(self.timeout_s):
            raise RequestError(err.code, err.field, f"{err.message} (moving the request: no decode instance was "
                                                    f"healthy within {self.timeout_s:g} s, --migration-timeout)")

    async def _retry(self, s: Stream, e: RequestError) -> None:
        left = s.deadline - time.monotonic()
        if left <= 0:
            raise RequestError(e.code, e.field, f"{e.message} (moving the request: none took it within "
                                                f"{self.timeout_s:g} s, --migration-timeout)") from None
        log.info("request %s: %s; trying again (%.1f s left to move it)", s.rid, e.message, left)
        if self.decode_ready():
            await asyncio.sleep(min(_NO_ROOM_RETRY_S, left))
        else:
            await self.wait_for_decode(left)
