"""The settings the router and the workers share, each default written once (the flags and the cores read them
from here, as vLLM's flags read theirs from its config dataclasses)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvTransferConfig:
    timeout_s: float = 30.0
    """Deadline of one KV transfer, from the decode reservation to the commit, in seconds. The router sends its
    own with every request; a worker uses its flag's when a request names none."""
    max_timeout_s: float = 300.0
    """The longest deadline a worker accepts from a caller: a reservation holds KV blocks until its deadline, so an
    unbounded one would let any caller hold the cache."""
    transport: str = "auto"
    """How a prefill instance's KV blocks reach decode instances: auto, grpc, ipc or nixl (prefill's --kv-transfer, whose
    help says what each means; kv_transfer/registry.py lists the transports)."""


@dataclass(frozen=True)
class WorkerConfig:
    shutdown_grace_s: float = 25.0
    """On SIGTERM/SIGINT: seconds the requests in flight get to finish, with health NOT_SERVING so routers send no
    new ones (a rolling restart drops nothing); within compose's 30 s stop_grace_period."""
