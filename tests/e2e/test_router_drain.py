"""The router's own drain, end to end (`tandem up`, real processes): SIGTERM to the router while a long stream runs.
Health turns 503 and new requests are refused at once; the stream either finishes within the grace or ends with an
error event naming the shutdown, then [DONE]: never a body cut off mid-stream. The router exits 0."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx

from stack import Stack, alive

GRACE_S = 3


def test_sigterm_to_the_router_drains_then_ends_the_stream_cleanly():
    stack = Stack("--model", "random:tiny", "--shutdown-grace", str(GRACE_S), prefill=1, decode=1).wait_ready()
    try:
        router = stack.child_pids()["router"]
        events, refused, health, t_term = [], None, None, None
        with httpx.Client(base_url=stack.http, timeout=60) as c:
            body = {"model": "random:tiny", "prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if t_term is None and len(events) == 20:
                        os.kill(router, signal.SIGTERM)
                        t_term = time.monotonic()
                    elif t_term is not None and health is None and time.monotonic() - t_term > 0.5:
                        with httpx.Client(base_url=stack.http, timeout=10) as other:
                            health = other.get("/health")
                            refused = other.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert events[-1] == "[DONE]", events[-3:]
        last = events[-2]
        finished = "choices" in last and last["choices"] and last["choices"][0]["finish_reason"] == "length"
        ended = "error" in last and "shutting down" in last["error"]["message"]
        assert finished or ended, last
        if health is not None:  # (the stream may have ended within the first half second)
            assert health.status_code == 503 and "shutting down" in health.json()["reason"], health.text
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        deadline = time.monotonic() + GRACE_S + 15
        while alive(router) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(router)
    finally:
        stack.stop()
