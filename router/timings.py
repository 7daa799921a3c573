"""One sub-request's timing breakdown, as the router sees it (vLLM's RequestMetrics: queue, prefill, first token,
inter-token latency), returned to a client that asks (HTTP `"return_timings": true`, gRPC `return_timings`) on the
sub-request's last delta, and put on its trace span.

    arrival --queue_s--> dispatch --prefill_s--> first token --decode_s--> last token
    '------------- first_token_s ------------'   mean_itl_s = decode_s / (tokens - 1)

kv_transfer_s comes from the prefill instance (its TransferDone), overlapping prefill_s and decode_s: the KV of a
long prompt moves while its later chunks compute.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

FIELDS = ("queue_s", "prefill_s", "kv_transfer_s", "first_token_s", "mean_itl_s", "decode_s")


@dataclass
class SubTimer:
    arrival: float  # time.monotonic() when the request reached the core
    dispatch: float | None = None  # the (last) hand-off to the backend: after admission and any wait for room
    first: float | None = None
    last: float | None = None
    tokens: int = 0

    def dispatched(self) -> None:
        self.dispatch = time.monotonic()

    def delta(self, now: float, num_tokens: int) -> None:
        if num_tokens and self.first is None:
            self.first = now
        if num_tokens:
            self.last = now
        self.tokens += num_tokens

    def result(self, kv_transfer_s: float | None) -> dict[str, float]:
        dispatch = self.arrival if self.dispatch is None else self.dispatch
        first = dispatch if self.first is None else self.first
        last = first if self.last is None else self.last
        decode = last - first
        return {"queue_s": dispatch - self.arrival, "prefill_s": first - dispatch,
                "kv_transfer_s": kv_transfer_s or 0.0, "first_token_s": first - self.arrival,
                "mean_itl_s": decode / (self.tokens - 1) if self.tokens > 1 else 0.0, "decode_s": decode}
