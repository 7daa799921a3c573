"""The router's request-level metrics: what one client request went through, recorded once per request in the
router's core (router/core.py) whatever the backend, so a disaggregated stack and `--colocated` fill the same
series the same way (serving/metrics.py says which role records what).

The life of a request's metrics (vLLM's phases, seen from the router):
1. `RequestMetrics(...)` once the request holds its admission slots (a refused one is counted only by the
   admission's refusals): its arrival (when the core had validated it) to now is the WAITING phase
   (`request_queue_time_seconds`); `request_params_n`, `request_params_max_tokens` (the effective one: what is
   left of the context when the request gave none) and the prompt's tokens are counted.
2. `delta(item)` for each delta handed to the client: the first is the time to first token (and the end of the
   PREFILL phase), later ones with tokens are inter-token latencies (`time_per_output_token_seconds` is the same
   observation under vLLM's older name); a sub-request's finish observes its prompt and generation tokens.
3. `done()` after the last delta: e2e latency and the DECODE and RUNNING (inference) phases.
4. `finished(reason)` always, in the core's `finally`: `request_success_total{finished_reason}` ("abort" for a
   request that ended in an error or was cancelled).
"""
from __future__ import annotations

import time

from serving.metrics import Metrics


class RequestMetrics:
    """The timeline of one request in the router, recorded into the router's `Metrics`."""

    def __init__(self, metrics: Metrics, arrival: float, num_prompt_tokens: int, n: int, max_tokens: int):
        """arrival: time.monotonic() when the request was validated, before it waited for admission."""
        self.m = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = arrival
        self.admitted_at = self.first_at = self.last_at = time.monotonic()
        self.first = True
        self.tokens: dict[int, int] = {}  # sub-request index -> tokens generated
        metrics.request_queue_time_seconds.observe(self.admitted_at - arrival)
        metrics.request_params_n.observe(n)
        metrics.request_params_max_tokens.observe(max_tokens)
        metrics.prompt_tokens.inc(num_prompt_tokens)

    def delta(self, item) -> None:
        m, now = self.m, time.monotonic()
        if self.first:
            m.time_to_first_token_seconds.observe(now - self.arrival)
            self.first_at, self.first = now, False
        elif item.token_ids:
            m.inter_token_latency_seconds.observe(now - self.last_at)
            m.time_per_output_token_seconds.observe(now - self.last_at)
        self.last_at = now
        m.generation_tokens.inc(len(item.token_ids))
        count = self.tokens[item.index] = self.tokens.get(item.index, 0) + len(item.token_ids)
        if item.finish_reason is not None:  # one completion of the request (n > 1: each of them)
            m.request_prompt_tokens.observe(self.num_prompt_tokens)
            m.request_generation_tokens.observe(count)

    def done(self) -> None:
        m = self.m
        m.e2e_request_latency_seconds.observe(time.monotonic() - self.arrival)
        m.request_prefill_time_seconds.observe(self.first_at - self.admitted_at)
        m.request_decode_time_seconds.observe(self.last_at - self.first_at)
        m.request_inference_time_seconds.observe(self.last_at - self.admitted_at)

    def finished(self, reason: str | None) -> None:
        self.m.finished(reason)
