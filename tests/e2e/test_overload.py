"""Overload, end to end (`tandem up`, real processes): 500 requests at once against a router with small admission limits
over two small decode workers. Each request is either served (its stream completes) or refused with 429 and
Retry-After, within the wait limit (plus a margin for a busy machine); a refusal for a full queue answers at once;
afterwards the router's gauges are back to 0, no worker holds a KV block or a request, and the decode workers'
admission watermark kept preemption to a few (the number is printed; bench/overload.py measures the same burst
on bigger settings)."""
from __future__ import annotations

import asyncio
import random
import re
import time
from statistics import median

import httpx
import pytest

from stack import Stack
from test_http_e2e import worker_load

NUM_REQUESTS = 500
# Prompts as long as the context, which the core refuses (400) just before admission, by the same path as a refusal
# for a full queue: when the router answered them, it had read their neighbours in the burst.
NUM_MALFORMED = 50
MAX_CONCURRENT = 64
MAX_QUEUED = 64
WAIT_S = 8.0
# The wait starts when the router reads a request, and reading 550 of them takes it seconds on a busy 2-core machine
# (20 s has been seen in CI): every bound below counts from the time the router had read the whole burst, which the
# last malformed request's 400 tells. The margin is for a prefill and a first token on that machine.
MARGIN_S = 10.0
PROMPT_TOKENS = 32  # 2 blocks of 16
MAX_TOKENS = 64  # 6 blocks at the end: 64 decode blocks hold 10 such requests, the watermark admits about 12
FLAGS = ["--model", "random:tiny", "--max-model-len", "256", "--num-gpu-blocks-override", "64",
         "--max-concurrent-requests", str(MAX_CONCURRENT), "--max-queued-requests", str(MAX_QUEUED),
         "--queue-timeout", f"{WAIT_S:g}"]


async def one(client: httpx.AsyncClient, prompt: list[int], t0: float, max_tokens: int = MAX_TOKENS) -> dict:
    out = {"start": time.perf_counter() - t0}
    body = {"model": "random:tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            out["status"], out["at"] = r.status_code, time.perf_counter() - t0
            if r.status_code != 200:
                out["retry_after"] = r.headers.get("retry-after")
                out["error"] = (await r.aread()).decode()
                return out
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    assert '"error"' not in line, line  # a started stream must not fail
                    chunks += 1
            out["chunks"], out["done"] = chunks, time.perf_counter() - t0
    except httpx.HTTPError as e:  # neither served nor refused: the asserts below name it
        out.update(status=0, at=time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
    return out


def series(text: str, name: str, role: str) -> float:
    return sum(float(v) for v in re.findall(rf'^{re.escape(name)}\{{[^}}]*role="{role}"[^}}]*\}} (\S+)$', text, re.M))


@pytest.mark.slow
def test_500_requests_at_once_are_each_served_or_refused_429_within_the_wait():
    stack = Stack(*FLAGS, prefill=1, decode=2).wait_ready()
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(260, 512) for _ in range(PROMPT_TOKENS)] for _ in range(NUM_REQUESTS)]
        decode_metrics = [f"http://127.0.0.1:{p}/metrics" for p in stack.metrics_ports[1:]]
        preempted_before = sum(series(httpx.get(u).text, "tandem:num_preemptions_total", "decode")
                               for u in decode_metrics)

        async def burst():
            n = NUM_REQUESTS + NUM_MALFORMED
            limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
            async with httpx.AsyncClient(base_url=stack.http, timeout=WAIT_S + MARGIN_S + 60, limits=limits) as c:
                # Connected first, so that the burst times the router's answers, not 550 connects at once (seconds
                # on a busy 2-core machine, whatever the server).
                await asyncio.gather(*(c.get("/health") for _ in range(n)))
                t0 = time.perf_counter()
                calls = [one(c, p, t0) for p in prompts]
                for k in range(NUM_MALFORMED - 1):  # interleaved: when the router read them, it read its neighbours
                    calls.insert(k * (NUM_REQUESTS // NUM_MALFORMED + 1), one(c, prompts[0] * 8, t0))
                calls.append(one(c, prompts[0] * 8, t0))  # and the last of all
                out = await asyncio.gather(*calls)
            return [r for r in out if r["status"] != 400], [r for r in out if r["status"] == 400]

        results, malformed = asyncio.run(burst())
        assert len(results) == NUM_REQUESTS and len(malformed) == NUM_MALFORMED
        served = [r for r in results if r["status"] == 200]
        refused = [r for r in results if r["status"] != 200]
        full = [r for r in refused if "--max-queued-requests" in r["error"]]
        late = [r for r in refused if "--queue-timeout" in r["error"]]
        last_read = max(r["at"] for r in malformed)
        print(f"\noverload: {len(served)} served, {len(full)} refused at once (queue full), {len(late)} refused at "
              f"the wait limit; a full queue's refusals p50 {median([r['at'] for r in full]):.2f} s, max "
              f"{max((r['at'] for r in full), default=0):.2f} s (the router read the burst's last malformed "
              f"request by {last_read:.2f} s); last refusal at {max((r['at'] for r in refused), default=0):.1f} s; "
              f"served: first token by {max((r['at'] for r in served), default=0):.1f} s, done by "
              f"{max((r['done'] for r in served), default=0):.1f} s")

        assert served and full, (len(served), len(full))
        assert len(full) + len(late) == len(refused), {r["error"][:120] for r in refused}
        for r in refused:
            assert r["status"] == 429 and int(r["retry_after"]) >= 1, r
            assert r["at"] <= last_read + WAIT_S + MARGIN_S, (r, last_read)
        for r in served:
            # r["at"] is the first token: the stream starts with it
            assert r["at"] <= last_read + WAIT_S + MARGIN_S, (r, last_read)
            assert r["chunks"] == MAX_TOKENS, r
        # A full queue is refused at once, never after waiting for room: the refusal names the queue bound, not the
        # wait, and each came before a queued request could have reached the wait limit (WAIT_S after it was read,
        # and the burst's last request was read by last_read). How much sooner depends on how busy the machine is,
        # so the bound is the wait itself.
        assert max(r["at"] for r in full) < last_read + WAIT_S, (median([r["at"] for r in full]), last_read)

        deadline = time.monotonic() + 30
        while True:
            router = httpx.get(f"{stack.http}/metrics").text
            gauges = [series(router, name, "router") for name in (
                "tandem:num_requests_running", "tandem:num_requests_waiting",
                "tandem:router_sub_requests_waiting_for_room")]
            loads = {name: worker_load(name, port) for name, port in stack.worker_ports.items()}
            idle = all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads.values())
            if (gauges == [0, 0, 0] and idle) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert gauges == [0, 0, 0], gauges
        assert idle, {name: (x.num_used_blocks, x.num_tracked_requests) for name, x in loads.items()}
        assert series(router, "tandem:router_admission_refusals_total", "router") == len(refused)
        preempted = sum(series(httpx.get(u).text, "tandem:num_preemptions_total", "decode")
                        for u in decode_metrics) - preempted_before
        waits = series(router, "tandem:router_room_waits_total", "router")
        print(f"overload: {preempted:.0f} preemptions on the decode workers; sub-requests waited for decode room "
              f"{waits:.0f} times")
        assert preempted <= len(served) // 4, preempted
    finally:
        stack.stop()
