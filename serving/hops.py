"""Request timelines.

`hop(rid, event)` writes one line of a request's timeline (logger `tandem.hops` at DEBUG, off by default;
CLOCK_MONOTONIC nanoseconds, comparable across the processes of one host); the router, prefill and decode all log
through it, and bench/ttft_hops.py turns the lines into the per-hop table of a request's time to first token.
"""
from __future__ import annotations

import logging
import time

_hops = logging.getLogger("tandem.hops")


def hop(rid: str, event: str, t_ns: int | None = None) -> None:
    """Logs that request `rid` passed `event` at t_ns (default: now), when tandem.hops is at DEBUG."""
    if _hops.isEnabledFor(logging.DEBUG):
        _hops.debug("hop %s %s %d", rid, event, time.monotonic_ns() if t_ns is None else t_ns,
                    extra={"request_id": rid})  # (some are logged in the engine thread: no request context there)
