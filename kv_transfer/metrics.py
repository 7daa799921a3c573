"""KV transfer metrics labelled by path ("grpc" | "ipc" | "nixl"), for prefill and decode.

`serving/metrics.py`'s `tandem:kv_transfer_bytes` and `tandem:kv_transfer_seconds` count every transfer whatever its
path (both keep doing so); these families add the `path` label beside `model_name` and `role`:
`tandem:kv_transfer_path_bytes_total`, `tandem:kv_transfer_path_seconds` (open to ack on prefill, open to commit
on decode), and `tandem:kv_transfer_path_failures_total`, which also names the KvPoll state a failed transfer was in
(`state`: bootstrapping, waiting or transferring). They live here because the engine's metric module is shared by all
roles and owned elsewhere; folding the label into the engine's families later is a rename on dashboards.
"""
from __future__ import annotations

from prometheus_client import Counter, Histogram

from kv_transfer.base import KvPoll
from kv_transfer.registry import PATH_LABELS
from serving.metrics import _TRANSFER_BUCKETS, LABELS, Family, Metrics

_path_bytes = Family(Counter, "kv_transfer_path_bytes",
                     "KV bytes sent (prefill) or received (decode), by transfer path.", LABELS + ("path",))
_path_seconds = Family(Histogram, "kv_transfer_path_seconds",
                       "KV transfer time by path, seconds (prefill: open to ack; decode: open to commit).",
                       LABELS + ("path",), buckets=_TRANSFER_BUCKETS)
_path_failures = Family(Counter, "kv_transfer_path_failures",
                        "KV transfers that failed, by path and by the state they were in (KvPoll).",
                        LABELS + ("path", "state"))


class KvPathMetrics:
    """The path-labelled children of one process, next to its `Metrics`."""

    def __init__(self, metrics: Metrics, model: str, role: str):
        self.metrics = metrics
        self.model, self.role = model, role
        self._bytes = {p: _path_bytes.labels(model_name=model, role=role, path=name) for p, name in PATH_LABELS.items()}
        self._seconds = {p: _path_seconds.labels(model_name=model, role=role, path=name)
                         for p, name in PATH_LABELS.items()}

    def add_bytes(self, path: int, n: int) -> None:
        self.metrics.kv_transfer_bytes.inc(n)
        self._bytes[path].inc(n)

    def observe_seconds(self, path: int, seconds: float) -> None:
        self.metrics.kv_transfer_seconds.observe(seconds)
        self._seconds[path].observe(seconds)

    def failed(self, path: int, state: KvPoll) -> None:
        """A transfer on `path` failed while in `state` (counted in serving's kv_transfer_failures too)."""
        self.metrics.kv_transfer_failures.inc()
        _path_failures.labels(model_name=self.model, role=self.role, path=PATH_LABELS.get(path, "unknown"),
                              state=state.name.lower()).inc()
