"""router/admission.py: slots for sub-requests, the bounded FIFO queue in front of them, its wait limit, the wait for
decode room, and what gives slots back (completion, error, cancel). The event loop is driven step by step: no test
waits for one of two events to win a race, and the only sleeps are timers that nothing else competes with."""
from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import router.admission as admission_module
from engine.sampling_params import SamplingParams
from router.admission import Admission, AdmissionConfig, Ticket, add_admission_args, admission_flags
from router.backend import GenerateDelta, NoRoom, RequestError
from router.core import GenerateRequest, RouterCore
from router.http import create_app
from scripted_backend import Scripted
from serving.errors import grpc_method
from serving.metrics import Metrics


def run(coro):
    return asyncio.run(coro)


async def settle() -> None:
    """Lets every task that can run, run (a few loop turns)."""
    for _ in range(5):
        await asyncio.sleep(0)


def make(capacity=2, **cfg) -> Admission:
    return Admission(AdmissionConfig(**cfg), capacity, Metrics("tiny", "router"), "tiny")


def refusals(reason: str) -> float:
    return admission_module.REFUSALS.labels(model_name="tiny", role="router", reason=reason)._value.get()


# ---------------------------------------------------------------------------------------------------- the queue
def test_slots_are_granted_first_in_first_out():
    async def main():
        adm = make(capacity=1)
        a = await adm.acquire(1)
        order = []

        async def take(name):
            t = await adm.acquire(1)
            order.append(name)
            return t

        tasks = {name: asyncio.create_task(take(name)) for name in "bcd"}
        await settle()
        assert adm.queued == 3 and order == [] and adm.free == 0
        a.close()
        await settle()
        assert order == ["b"]
        for name in "bc":
            (await tasks[name]).close()
            await settle()
        (await tasks["d"]).close()
        assert order == ["b", "c", "d"] and adm.free == 1 and adm.queued == 0

    run(main())


def test_a_full_queue_is_refused_at_once_with_retry_after():
    async def main():
        adm = make(capacity=1, max_queued_requests=1)
        held = await adm.acquire(1)
        queued = asyncio.create_task(adm.acquire(1))
        await settle()
        before = refusals("queue_full")
        t0 = time.monotonic()
        with pytest.raises(RequestError) as ei:
            await adm.acquire(1)
        assert time.monotonic() - t0 < 0.1  # no waiting at all: refused in the call itself
        e = ei.value
        assert e.code == "resource_exhausted" and e.retry_after_s >= 1
        assert "--max-queued-requests" in e.message and f"retry after {e.retry_after_s} s" in e.message
        assert refusals("queue_full") == before + 1
        held.close()
        (await queued).close()
        assert adm.free == 1

    run(main())


def test_no_queue_refuses_whatever_does_not_fit():
    async def main():
        adm = make(capacity=2, max_queued_requests=0)
        held = await adm.acquire(2)
        with pytest.raises(RequestError, match="--max-queued-requests"):
            await adm.acquire(1)
        held.close()
        (await adm.acquire(2)).close()

    run(main())


def test_a_request_still_queued_at_its_deadline_is_refused_and_the_next_moves_up():
    # (the wait limit is a timer the checks below race: long enough that no stall of a busy machine lets it fire
    # before both requests are queued and counted)
    wait_s = 1.0

    async def main():
        adm = make(capacity=2, queue_timeout_s=wait_s)
        held = await adm.acquire(1)
        t0 = time.monotonic()
        big = asyncio.create_task(adm.acquire(2))  # waits for both slots: held never ends while it waits
        await settle()
        small = asyncio.create_task(adm.acquire(1))  # behind it, though a slot is free (first in, first out)
        await settle()
        assert adm.queued == 2 and not small.done()
        before = refusals("queue_timeout")
        with pytest.raises(RequestError) as ei:
            await big
        assert time.monotonic() - t0 >= 0.9 * wait_s  # refused at its deadline, not before
        assert "--queue-timeout" in ei.value.message and ei.value.retry_after_s >= 1
        assert refusals("queue_timeout") == before + 1
        (await small).close()  # the head gone, the free slot goes to the next at once
        held.close()
        assert adm.free == 2 and adm.queued == 0

    run(main())


def test_a_cancelled_wait_leaves_the_queue_and_a_cancel_after_the_grant_gives_the_slot_back():
    async def main():
        adm = make(capacity=1)
        held = await adm.acquire(1)
        gone = asyncio.create_task(adm.acquire(1))
        late = asyncio.create_task(adm.acquire(1))
        last = asyncio.create_task(adm.acquire(1))
        await settle()
        gone.cancel()  # a client that went away while queued
        await settle()
        assert gone.cancelled() and adm.queued == 2
        held.close()  # grants `late`...
        late.cancel()  # ...which is cancelled before it could return
        await settle()
        assert late.cancelled()
        (await last).close()  # the slot came back and went on
        assert adm.free == 1 and adm.queued == 0

    run(main())


def test_a_fan_out_larger_than_the_capacity_takes_all_of_it_and_gives_each_back_once():
    async def main():
        adm = make(capacity=4)
        big = await adm.acquire(10)
        assert big.slots == 4 and adm.free == 0
        for _ in range(6):  # 10 sub-requests: the first 6 to end keep the 4 still running going
            big.sub_done()
        assert adm.free == 0
        big.sub_done()
        assert adm.free == 1
        big.close()
        big.close()
        big.sub_done()  # late calls change nothing
        assert adm.free == 4

    run(main())


def test_the_rate_limit_spaces_starts_out():
    async def main():
        adm = make(capacity=2, rate_limit=20.0)  # a bucket of 2, one token every 50 ms
        t0 = time.monotonic()
        first = [await adm.acquire(1), await adm.acquire(1)]
        for t in first:
            t.close()
        third = await adm.acquire(1)  # slots free, the bucket empty
        assert time.monotonic() - t0 >= 0.04
        third.close()

    run(main())


def test_close_refuses_the_queued_and_every_later_request():
    async def main():
        adm = make(capacity=1)
        held = await adm.acquire(1)
        queued = asyncio.create_task(adm.acquire(1))
        await settle()
        adm.close(RequestError("unavailable", None, "shutting down"))
        with pytest.raises(RequestError, match="shutting down"):
            await queued
        with pytest.raises(RequestError, match="shutting down"):
            await adm.acquire(1)
        held.close()
        assert adm.free == 1 and adm.queued == 0

    run(main())


def test_retry_after_grows_with_the_queue_and_stays_within_the_wait():
    adm = make(capacity=2, queue_timeout_s=10)
    assert adm.retry_after_s() == 1
    adm._hold_s = 4.0
    assert adm.retry_after_s() == 2  # (nothing queued + 1) x 4 s / 2 slots
    adm._hold_s = 1000.0
    assert adm.retry_after_s() == 10


# ---------------------------------------------------------------------------------------------------- room
def test_a_sub_request_waiting_for_room_is_woken_by_a_release_or_the_tick_until_its_deadline():
    async def main():
        adm = make(capacity=3)
        adm.room_retry_s = 3600.0  # no tick for now
        other, waiter = await adm.acquire(1), await adm.acquire(1)
        woken = asyncio.create_task(adm.wait_for_room(waiter.deadline))
        await settle()
        assert adm.waiting_for_room == 1 and not woken.done()
        other.close()  # a sub-request ended: its blocks are free
        assert await woken is True
        adm.room_retry_s = 0.01
        assert await adm.wait_for_room(time.monotonic() + 3600) is True  # nothing released: the tick wakes it
        adm.room_retry_s = 3600.0
        assert await adm.wait_for_room(time.monotonic() + 0.02) is False  # the deadline came first
        assert adm._room_tick is None  # nobody waiting: no timer left behind
        waiter.close()
        assert adm.waiting_for_room == 0 and adm.free == 3

    run(main())


def test_woken_for_room_then_cancelled_passes_the_turn_on():
    async def main():
        adm = make(capacity=3)
        adm.room_retry_s = 3600.0
        t = await adm.acquire(3)
        first = asyncio.create_task(adm.wait_for_room(t.deadline))
        second = asyncio.create_task(adm.wait_for_room(t.deadline))
        await settle()
        adm._wake_room(1)  # wakes `first`...
        first.cancel()  # ...which is cancelled before it could try
        await settle()
        assert await second is True
        t.close()

    run(main())


# ---------------------------------------------------------------------------------------------------- random
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(capacity=st.integers(1, 4), max_queued=st.integers(0, 4),
       ops=st.lists(st.tuples(st.sampled_from(["acquire", "cancel", "done", "close", "handoff", "expire", "room",
                                               "wake"]),
                              st.integers(0, 7), st.integers(1, 6), st.booleans()), max_size=40))
def test_no_slot_leaks_and_grants_stay_in_order_under_any_interleaving(capacity, max_queued, ops):
    async def main():
        adm = make(capacity=capacity, max_queued_requests=max_queued, queue_timeout_s=3600)
        adm.room_retry_s = 3600.0  # (no tick: the test decides when waiters wake)
        tasks: list[asyncio.Task] = []
        rooms: list[asyncio.Task] = []
        granted: set[int] = set()  # the task numbers whose slots came

        async def take(i, n):
            ticket = await adm.acquire(n)
            granted.add(i)
            return ticket

        def tickets() -> list[Ticket]:
            return [t.result() for t in tasks if t.done() and not t.cancelled() and t.exception() is None]

        for op, pick, n, settled in ops:  # settled=False: the next op comes before the woken tasks have run
            if op == "acquire":
                tasks.append(asyncio.create_task(take(len(tasks), n)))
            elif op == "cancel" and tasks:
                tasks[pick % len(tasks)].cancel()
            elif op in ("done", "close") and tickets():
                ticket = tickets()[pick % len(tickets())]
                ticket.sub_done() if op == "done" else ticket.close()
            elif op == "handoff" and tickets() and (queued := [t for t in tasks if not t.done()]):
                tickets()[pick % len(tickets())].close()  # grants the head of the queue...
                queued[0].cancel()  # ...which is cancelled before it can return
            elif op == "expire" and adm._queue:
                adm._expire(adm._queue[pick % len(adm._queue)])  # a wait that ran out, when the test says
            elif op == "room" and tickets():
                rooms.append(asyncio.create_task(adm.wait_for_room(tickets()[0].deadline)))
            elif op == "wake":
                adm._wake_room(n)
            if not settled:
                continue
            await settle()
            held = sum(t.slots for t in tickets())
            assert adm.free + held == capacity and 0 <= adm.free <= capacity, (adm.free, held)
            assert adm.queued <= max_queued
            queued = [i for i, t in enumerate(tasks) if not t.done()]
            assert not queued or not granted or max(granted) < min(queued), (granted, queued)  # first in, first out
            assert not adm._queue or adm._queue[0].slots > adm.free  # nobody waits for slots that are free
        for t in tasks + rooms:
            t.cancel()
        await settle()
        for ticket in tickets():
            ticket.close()
        for t in rooms:
            t.cancel()
        await settle()
        assert adm.free == capacity and adm.queued == 0 and adm.waiting_for_room == 0
        assert admission_module.WAITING_FOR_ROOM.labels(model_name="tiny", role="router")._value.get() == 0

    run(main())


# ---------------------------------------------------------------------------------------------------- the core
class Gated(Scripted):
    """Scripted, but a prompt starting "wait" holds its sub-request (and its slot) until `gate` is set; "full"
    has no room until `room` is set."""

    def __init__(self):
        super().__init__()
        self.gate = asyncio.Event()
        self.room = asyncio.Event()
        self.tries: list[str] = []

    async def serve_one(self, rid, index, prompt, params, queue) -> None:
        text = self.tokenizer.decode(prompt)
        self.tries.append(rid)
        if text.startswith("wait"):
            await self.gate.wait()
        if text.startswith("full") and not self.room.is_set():
            raise NoRoom("no decode instance has room for it (tried x)")
        await super().serve_one(rid, index, prompt, params, queue)


def request(prompt: str, n: int = 1, rid: str = "r") -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="tiny", prompt=prompt, prompt_token_ids=None,
                           params=SamplingParams(n=n, max_tokens=3))


async def collect(core, req):
    return [d async for d in core.generate(req)]


def test_every_way_a_request_ends_gives_its_slots_back():
    async def main():
        core = RouterCore(Gated(), admission=AdmissionConfig(max_concurrent_requests=3))
        assert core.admission.capacity == 3
        await collect(core, request("hi", n=2))  # completion
        with pytest.raises(RequestError):
            await collect(core, request("fail", n=3))  # an error in one sub-request ends them all
        it = core.generate(request("wait", n=2))  # a client gone after its first delta
        first = asyncio.ensure_future(it.__anext__())
        await settle()
        assert core.admission.free == 1
        core.backend.gate.set()
        await first
        await it.aclose()
        assert core.admission.free == 3 and core.admission.queued == 0
        assert core.metrics.num_requests_running._value.get() == 0

    run(main())


def test_a_sub_request_without_room_waits_and_goes_again_under_a_new_id():
    async def main():
        backend = Gated()
        core = RouterCore(backend, admission=AdmissionConfig(max_concurrent_requests=4))
        core.admission.room_retry_s = 3600.0  # woken by the release alone
        other = asyncio.create_task(collect(core, request("wait", rid="other")))
        full = asyncio.create_task(collect(core, request("full", rid="full")))
        await settle()
        assert backend.tries == ["other", "full"] and core.admission.waiting_for_room == 1
        backend.room.set()
        backend.gate.set()  # `other` ends: its slot comes back and wakes the waiter
        await other
        deltas = await full
        assert backend.tries == ["other", "full", "full.r1"] and deltas[-1].finish_reason == "length"
        assert core.admission.free == 4 and core.admission.waiting_for_room == 0

    run(main())


def test_a_sub_request_without_room_until_its_deadline_is_refused():
    async def main():
        core = RouterCore(Gated(), admission=AdmissionConfig(queue_timeout_s=0.3))
        before = refusals("no_room")
        with pytest.raises(RequestError) as ei:
            await collect(core, request("full"))
        e = ei.value
        assert e.code == "resource_exhausted" and e.retry_after_s >= 1
        assert "no decode instance has room for it" in e.message and "--queue-timeout" in e.message
        assert core.admission.free == core.admission.capacity and core.admission.waiting_for_room == 0
        return before

    before = run(main())
    assert refusals("no_room") == before + 1


# ---------------------------------------------------------------------------------------------------- the fronts
@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_http_answers_a_refusal_429_with_retry_after(anyio_backend):
    backend = Gated()
    core = RouterCore(backend, admission=AdmissionConfig(max_concurrent_requests=1, max_queued_requests=0))
    app = create_app(core)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
        held = asyncio.create_task(c.post("/v1/completions", json={"prompt": "wait", "max_tokens": 3}))
        while core.admission.free:
            await asyncio.sleep(0.01)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        backend.gate.set()
        assert (await held).status_code == 200
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, (r.status_code, r.headers)
    assert r.json()["error"]["code"] == "resource_exhausted" and "--max-queued-requests" in r.json()["error"]["message"]


def test_grpc_answers_a_refusal_resource_exhausted_with_retry_after_metadata():
    class Context:
        async def abort(self, code, details, trailing_metadata=()):
            self.args = code, details, trailing_metadata
            raise grpc.aio.AbortError()

    class Servicer:
        @grpc_method
        async def Call(self, request, context):
            raise RequestError("resource_exhausted", None, "busy; retry after 3 s", retry_after_s=3)

    ctx = Context()
    with pytest.raises(grpc.aio.AbortError):
        run(Servicer().Call(None, ctx))
    assert ctx.args == (grpc.StatusCode.RESOURCE_EXHAUSTED, "busy; retry after 3 s", (("retry-after", "3"),))


def test_flags_round_trip_and_only_changed_ones_are_passed_on():
    import argparse

    p = argparse.ArgumentParser()
    add_admission_args(p)
    assert admission_flags(p.parse_args([])) == []
    ns = p.parse_args(["--max-concurrent-requests", "8", "--queue-timeout", "5", "--max-queued-requests", "0"])
    assert admission_flags(ns) == ["--max-concurrent-requests", "8", "--max-queued-requests", "0",
                                   "--queue-timeout", "5"]
    assert AdmissionConfig.from_cli_args(ns) == AdmissionConfig(8, 0, 5.0, None)
    with pytest.raises(ValueError, match="queue_timeout_s=0: must be > 0"):
        AdmissionConfig(queue_timeout_s=0)
