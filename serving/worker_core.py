"""What the prefill and decode cores share: the engine and its one thread, the requests they track, their load.

A role's core subclasses WorkerCore and fills in its engine-thread hooks (`_on_step`, `_after_step`), `_end(engine,
rid)` (frees what one request holds), and `_waiting(stats)` (what its queue counts). `start` starts the engine
thread, `close` ends every tracked request and stops it, `load` answers GetLoad.
"""
from __future__ import annotations

import asyncio

from protos.tandem.v1 import common_pb2
from serving.engine_thread import EngineThread
from serving.metrics import Metrics


class WorkerCore:
    role = ""  # "prefill" | "decode"

    def __init__(self, engine, metrics: Metrics, default_kv_timeout_s: float):
        self.engine = engine  # owned by the engine thread once start() ran; read-only constants below
        self.metrics = metrics
        self.default_kv_timeout_s = default_kv_timeout_s
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.block_size = engine.config.cache.block_size
        self._reqs: dict[str, object] = {}  # event loop only: the requests in flight here, by id
        self.worker: EngineThread | None = None

    async def start(self) -> None:
        self.worker = EngineThread(self.engine, asyncio.get_running_loop(), self._on_step, self._after_step,
                                   name=f"{self.role}-engine")
        self.worker.start()

    async def close(self) -> None:
        for rid in list(self._reqs):
            self.worker.submit(self._end, rid)
        self.worker.stop()

    async def load(self) -> common_pb2.InstanceLoad:
        # Read here, not queued behind the engine thread: a long step must not time out the router's health poll
        # (which would take a live instance out of rotation). These are counters and C-level copies, atomic
        # under the GIL, at most one step stale.
        st = self.engine.stats()
        return common_pb2.InstanceLoad(
            role=self.role, model=self.model_name, num_requests_running=st.num_running,
            num_requests_waiting=self._waiting(st), num_queued_tokens=self._queued_tokens(st),
            num_used_blocks=st.num_used_blocks, num_total_blocks=st.num_total_blocks,
            kv_cache_usage=st.kv_cache_usage, block_size=self.block_size, max_model_len=self.max_model_len,
            num_tracked_requests=len(self._reqs))

    # ---- what a role fills in ---------------------------------------------------------------------------------
    def _waiting(self, stats) -> int:
        return stats.num_waiting

    def _queued_tokens(self, stats) -> int:
        return 0

    def _on_step(self, outs, extra) -> None:
        raise NotImplementedError

    def _after_step(self, engine, outs):
        raise NotImplementedError

    def _end(self, engine, rid: str) -> None:
        raise NotImplementedError
