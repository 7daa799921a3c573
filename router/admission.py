"""The router's admission control: a bound on the sub-requests in flight, a bounded FIFO queue with a wait limit in
front of it, and the wait of sub-requests for which no decode instance has room (the controls of SGLang's gateway:
--max-concurrent-requests, --queue-size, --queue-timeout-secs, --rate-limit-tokens-per-second).

The life of a request in here:
1. `RouterCore.generate` asks `acquire(n)` for one slot per sub-request (prompts x n), at most the capacity, so that a
   large fan-out is not refused for good. With the slots free (and, under --rate-limit, start tokens in the bucket)
   and nobody queued, they are granted at once.
2. Otherwise the request queues, first in first out, unless --max-queued-requests are queued already: it is then
   refused at once. A refusal is a RequestError "resource_exhausted" carrying `retry_after_s` (HTTP 429 with
   Retry-After, gRPC RESOURCE_EXHAUSTED with trailing metadata retry-after).
3. A released slot goes to the head of the queue as soon as the head's slots are all free. A request still queued at
   its deadline (--queue-timeout after it arrived) is refused the same way: 429, not SGLang's 408, since the server is
   busy, not the client slow, and one status lets a client back off on one code. Cancelling the wait (the client went
   away) takes it out of the queue.
4. A sub-request that every decode instance refused for lack of room (`router.backend.NoRoom`) keeps its slot and waits
   in a second FIFO queue (`wait_for_room`): each released slot wakes one of those waiters (a sub-request ended, its
   blocks are free), and every ROOM_RETRY_S the head is woken anyway (other routers' requests end too, and the
   instances' admission watermark relaxes with time). A woken sub-request tries again; at its deadline it is refused
   (429). New sub-requests queue behind the waiters rather than overtake them.
5. The request's `Ticket` gives back its slots as its sub-requests end (`sub_done`, on every exit path: completion,
   error, cancel) and the rest when the request ends (`close`, idempotent): no slot outlives its request.
`close(error)` (the router draining) refuses everything still queued or waiting for room with that error.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from engine.config import SchedulerConfig
from router.backend import RequestError
from serving.metrics import LABELS, Family, Metrics

# How often the head of the room queue is woken to try again without any slot released here.
ROOM_RETRY_S = 0.25
# How long a slot is held, as Retry-After's estimate assumes it before any request has ended.
_INITIAL_HOLD_S = 1.0
_HOLD_EWMA = 0.1  # the weight of each ended request in that estimate

REASONS = ("queue_full", "queue_timeout", "no_room")
REFUSALS = Family(Counter, "router_admission_refusals",
                  "Requests the router refused under load, by reason: queue_full (at once: the queue was full), "
                  "queue_timeout (no slot within --queue-timeout), no_room (no decode instance had room within it).",
                  LABELS + ("reason",))
QUEUE_TIME = Family(Histogram, "router_queue_time_seconds", "Time requests waited for an admission slot, seconds.",
                    LABELS, buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
ROOM_WAITS = Family(Counter, "router_room_waits",
                    "Times a sub-request waited for a decode instance with room (every instance had refused it, or "
                    "others were waiting already).", LABELS)
WAITING_FOR_ROOM = Family(Gauge, "router_sub_requests_waiting_for_room",
                          "Admitted sub-requests waiting for a decode instance with room (all refused them, or others "
                          "were waiting already).", LABELS)


@dataclass(frozen=True)
class AdmissionConfig:
    """How much the router takes on at once, and how long a request may wait for it."""
    max_concurrent_requests: int | None = None
    """Sub-requests in flight at once (a request takes one per prompt x n); default: max_num_seqs (256) per decode
    instance (or the colocated engine's): the most that their batches run at once."""
    max_queued_requests: int = 1024
    """Requests that may wait for slots; one more is refused at once (429)."""
    queue_timeout_s: float = 30.0
    """Seconds a request may wait, for slots and then for a decode instance with room, before it is refused (429)."""
    rate_limit: float | None = None
    """Sub-requests started per second, at most (a token bucket as deep as max_concurrent_requests); default: none."""

    def __post_init__(self) -> None:
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ValueError(f"max_concurrent_requests={self.max_concurrent_requests}: must be >= 1")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests={self.max_queued_requests}: must be >= 0 (0: no queue)")
        if not self.queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s={self.queue_timeout_s}: must be > 0")
        if self.rate_limit is not None and not self.rate_limit > 0:
            raise ValueError(f"rate_limit={self.rate_limit}: must be > 0")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "AdmissionConfig":
        return cls(**{name: getattr(ns, name) for name in _FLAGS})


# AdmissionConfig's fields, which are also the flags' dests, and the flags.
_FLAGS = {"max_concurrent_requests": "--max-concurrent-requests", "max_queued_requests": "--max-queued-requests",
          "queue_timeout_s": "--queue-timeout", "rate_limit": "--rate-limit"}


def add_admission_args(p: argparse.ArgumentParser) -> None:
    """The router's admission flags (router/server.py; `tandem up` passes them on)."""
    d = AdmissionConfig()
    p.add_argument(_FLAGS["max_concurrent_requests"], type=int, default=d.max_concurrent_requests,
                   help="sub-requests (prompts x n) in flight at once; more wait in the queue (default: "
                        f"{SchedulerConfig.max_num_seqs}, the engines' max_num_seqs, per decode instance)")
    p.add_argument(_FLAGS["max_queued_requests"], type=int, default=d.max_queued_requests,
                   help="requests that may wait for a slot; one more is refused at once with 429 and Retry-After "
                        f"(default: {d.max_queued_requests}; 0: no queue)")
    p.add_argument(_FLAGS["queue_timeout_s"], dest="queue_timeout_s", type=float, default=d.queue_timeout_s,
                   help="seconds a request may wait, for a slot and then for a decode instance with room, before it "
                        f"is refused with 429 and Retry-After (default: {d.queue_timeout_s:g})")
    p.add_argument(_FLAGS["rate_limit"], type=float, default=d.rate_limit,
                   help="sub-requests started per second, at most (a token bucket as deep as "
                        "--max-concurrent-requests; default: no limit)")


def admission_flags(ns: argparse.Namespace) -> list[str]:
    """The admission flags of `ns` that differ from their defaults, as a command line (`tandem up` -> router)."""
    out, d = [], AdmissionConfig()
    for name, flag in _FLAGS.items():
        value = getattr(ns, name)
        if value != getattr(d, name):
            out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return out


class _Waiter:
    __slots__ = ("slots", "future", "since", "timer")

    def __init__(self, slots: int, future: asyncio.Future, since: float):
        self.slots, self.future, self.since, self.timer = slots, future, since, None


class Ticket:
    """The slots one request holds: one per sub-request still running (at most what it was granted)."""

    def __init__(self, admission: "Admission", slots: int, subs: int, since: float):
        self._admission = admission
        self.slots = slots
        self._unfinished = subs
        self.since = since
        """time.monotonic() at which the request asked for its slots."""
        self.deadline = since + admission.config.queue_timeout_s
        """time.monotonic() at which a sub-request still waiting for room is refused."""

    def sub_done(self) -> None:
        """One sub-request ended (served, failed or cancelled): the slots beyond those still running go back."""
        self._unfinished = max(0, self._unfinished - 1)
        self._give_back(self.slots - self._unfinished)

    def close(self) -> None:
        """The request ended: every slot it still holds goes back (twice is harmless)."""
        self._unfinished = 0
        self._give_back(self.slots)

    def _give_back(self, k: int) -> None:
        if k > 0:
            self.slots -= k
            self._admission._release(k, time.monotonic() - self.since)


class Admission:
    """Slots for sub-requests, a FIFO queue for them, and the wait for decode room (the module docstring)."""

    def __init__(self, config: AdmissionConfig, capacity: int, metrics: Metrics | None = None, model: str = ""):
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: must be >= 1")
        self.config = config
        self.capacity = capacity
        self.free = capacity
        self._queue: deque[_Waiter] = deque()
        self._room: deque[asyncio.Future] = deque()
        self._room_tick: asyncio.TimerHandle | None = None
        self.room_retry_s = ROOM_RETRY_S
        self._refill: asyncio.TimerHandle | None = None
        self._tokens = float(capacity)  # --rate-limit's bucket
        self._tokens_at = time.monotonic()
        self._hold_s = _INITIAL_HOLD_S
        self.closed: RequestError | None = None
        self._waiting_gauge = metrics.num_requests_waiting if metrics is not None else None
        lv = dict(model_name=model, role="router")
        self._refusals = {r: REFUSALS.labels(reason=r, **lv) for r in REASONS}
        self._queue_time = QUEUE_TIME.labels(**lv)
        self._room_gauge = WAITING_FOR_ROOM.labels(**lv)
        self._room_waits = ROOM_WAITS.labels(**lv)

    # ---- what the core asks -----------------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Requests waiting for slots."""
        return len(self._queue)

    @property
    def waiting_for_room(self) -> int:
        """Sub-requests waiting for a decode instance with room."""
        return len(self._room)

    async def acquire(self, n: int) -> Ticket:
        """Slots for a request of n sub-requests (at most the capacity), once they are free; raises RequestError
        resource_exhausted when the queue is full (at once) or the wait runs out."""
        if self.closed is not None:
            raise self.closed
        k, now = min(n, self.capacity), time.monotonic()
        if not self._queue and self._can_start(k, now):
            self._start(k)
            return Ticket(self, k, n, now)
        if len(self._queue) >= self.config.max_queued_requests:
            raise self._refuse("queue_full", (
                f"the router is at capacity: {self.capacity - self.free} of {self.capacity} sub-requests in flight "
                f"(--max-concurrent-requests) and {len(self._queue)} requests queued, the most "
                f"--max-queued-requests allows"))
        loop = asyncio.get_running_loop()
        w = _Waiter(k, loop.create_future(), now)
        self._queue.append(w)
        w.timer = loop.call_later(self.config.queue_timeout_s, self._expire, w)
        self._pump()  # (short of start tokens only: arms the refill)
        try:
            await w.future
        except BaseException:
            if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
            # granted, then cancelled before it could return: give the slots back
                self._release(k, 0.0)
            elif w in self._queue:  # cancelled while queued: leave the queue (the head may have been blocking)
                self._queue.remove(w)
                w.timer.cancel()
                self._pump()
            raise
        finally:
            self._gauges()
        self._queue_time.observe(time.monotonic() - now)
        return Ticket(self, k, n, now)

    async def wait_for_room(self, deadline: float, front: bool = False) -> bool:
        """After every decode instance refused a sub-request for room: waits until it may try again (True) or
        `deadline` (time.monotonic()) passes first (False). front: it was woken from the head and goes back there."""
        if self.closed is not None:
            raise self.closed
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        (self._room.appendleft if front else self._room.append)(fut)
        self._room_waits.inc()
        timer = loop.call_later(max(0.0, deadline - time.monotonic()), _settle, fut, False)
        self._arm_room_tick(loop)
        self._gauges()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None and fut.result():
                self._wake_room(1)  # woken, then cancelled: the next one gets the try
            raise
        finally:
            timer.cancel()
            if fut in self._room:
                self._room.remove(fut)
            if not self._room and self._room_tick is not None:
                self._room_tick.cancel()
                self._room_tick = None
            self._gauges()

    def no_room(self, error: RequestError, since: float) -> RequestError:
        """The refusal of a sub-request that waited for room since `since` until its deadline (error: the last
        refusal, naming the instances)."""
        return self._refuse("no_room", f"{error.message}; waited {time.monotonic() - since:.1f} s for room, the "
                                       "most --queue-timeout allows")

    def retry_after_s(self) -> int:
        """Seconds after which a refused request may find a slot: the slots queued ahead and in use over the
        capacity, times how long a request holds its slots (Little's law), within [1, --queue-timeout]."""
        ahead = sum(w.slots for w in self._queue) + 1
        estimate = self._hold_s * ahead / self.capacity
        return max(1, min(math.ceil(self.config.queue_timeout_s), math.ceil(estimate)))

    def close(self, error: RequestError) -> None:
        """Refuses everything queued or waiting for room, and every later request, with `error`."""
        self.closed = error
        while self._queue:
            w = self._queue.popleft()
            w.timer.cancel()
            if not w.future.done():
                w.future.set_exception(error)
        while self._room:
            fut = self._room.popleft()
            if not fut.done():
                fut.set_exception(error)
        self._gauges()

    # ---- inside -----------------------------------------------------------------------------------------------
    def _refuse(self, reason: str, message: str) -> RequestError:
        self._refusals[reason].inc()
        retry = self.retry_after_s()
        return RequestError("resource_exhausted", None, f"{message}; retry after {retry} s", retry_after_s=retry)

    def _can_start(self, k: int, now: float) -> bool:
        if self.free < k:
            return False
        if self.config.rate_limit is None:
            return True
        self._tokens = min(self.capacity, self._tokens + (now - self._tokens_at) * self.config.rate_limit)
        self._tokens_at = now
        return self._tokens >= k

    def _start(self, k: int) -> None:
        self.free -= k
        if self.config.rate_limit is not None:
            self._tokens -= k

    def _release(self, k: int, held_s: float) -> None:
        self.free += k
        assert self.free <= self.capacity, (self.free, self.capacity)
        if held_s > 0:
            self._hold_s += _HOLD_EWMA * (held_s - self._hold_s)
        self._pump()
        self._wake_room(k)

    def _pump(self) -> None:
        """Grants the head of the queue while its slots (and start tokens) are there."""
        now = time.monotonic()
        while self._queue:
            w = self._queue[0]
            if w.future.done():  # cancelled (its task is yet to run and leave the queue)
                self._queue.popleft()
                w.timer.cancel()
                continue
            if not self._can_start(w.slots, now):
                if self.free >= w.slots and self._refill is None:  # only tokens short: come back when they are in
                    wait = (w.slots - self._tokens) / self.config.rate_limit
                    self._refill = asyncio.get_running_loop().call_later(wait, self._refilled)
                break
            self._queue.popleft()
            w.timer.cancel()
            self._start(w.slots)
            w.future.set_result(None)
        self._gauges()

    def _refilled(self) -> None:
        self._refill = None
        self._pump()

    def _expire(self, w: _Waiter) -> None:
        if w.future.done() or w not in self._queue:
            return
        self._queue.remove(w)
        w.future.set_exception(self._refuse("queue_timeout", (
            f"waited {time.monotonic() - w.since:.1f} s for {w.slots} of the {self.capacity} slots "
            "(--max-concurrent-requests), the most --queue-timeout allows")))
        self._pump()  # the head may have been the one that did not fit

    def _wake_room(self, k: int) -> None:
        while k > 0 and self._room:
            fut = self._room.popleft()
            if not fut.done():
                fut.set_result(True)
                k -= 1

    def _arm_room_tick(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._room_tick is None and self._room:
            self._room_tick = loop.call_later(self.room_retry_s, self._on_room_tick, loop)

    def _on_room_tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._room_tick = None
        self._wake_room(1)
        self._arm_room_tick(loop)

    def _gauges(self) -> None:
        if self._waiting_gauge is not None:
            self._waiting_gauge.set(len(self._queue))
        self._room_gauge.set(len(self._room))


def _settle(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
