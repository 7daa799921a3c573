"""What the prefill and decode cores share: the engine and its one thread, the requests they track, their load.

A role's core subclasses WorkerCore and fills in its engine-thread hooks (`_on_step`, `_after_step`), `_end(engine,
rid)` (frees what one request holds), and `_waiting(stats)` (what its queue counts). `start` starts the engine
thread, `close` ends every tracked request and stops it, `load` answers GetLoad.
"""
from __future__ import annotations

import asyncio

from engine.tokenizer import tokenizer_fingerprint
from protos.tandem.v1 import common_pb2
from serving.config import KvTransferConfig
from serving.engine_thread import EngineThread
from serving.metrics import Metrics

MAX_ID_CHARS = 256  # request ids and addresses from callers: logged, so bounded first


class WorkerCore:
    role = ""  # "prefill" | "decode"

    def __init__(self, engine, metrics: Metrics, default_kv_timeout_s: float,
                 max_kv_timeout_s: float = KvTransferConfig.max_timeout_s):
        if not 0 < default_kv_timeout_s <= max_kv_timeout_s:
            raise ValueError(f"kv_transfer_timeout={default_kv_timeout_s}: must be > 0 and <= the maximum, "
                             f"{max_kv_timeout_s:g} s")
        self.engine = engine  # owned by the engine thread once start() ran; read-only constants below
        self.metrics = metrics
        self.default_kv_timeout_s = default_kv_timeout_s
        self.max_kv_timeout_s = max_kv_timeout_s
        self.vocab_size = engine.resolved.config.vocab_size
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.block_size = engine.config.cache.block_size
        # What the router checks against its own (router/instances.py): hashed once, here.
        self.tokenizer_fingerprint = tokenizer_fingerprint(engine.tokenizer)
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
            num_tracked_requests=len(self._reqs), vocab_size=self.vocab_size,
            tokenizer_fingerprint=self.tokenizer_fingerprint)

    # ---- checks of what a caller sends (another Tandem process is checked like a client) ---------------------
    def check_request_id(self, request_id: str) -> None:
        if not request_id:
            raise ValueError("request_id: must not be empty")
        if len(request_id) > MAX_ID_CHARS:
            raise ValueError(f"request_id: {len(request_id)} characters, must be at most {MAX_ID_CHARS}")

    def kv_timeout(self, requested_s: float | None) -> float:
        """A request's KV transfer deadline in seconds: its own (at most max_kv_timeout_s), else the default."""
        if not requested_s:
            return self.default_kv_timeout_s
        if requested_s > self.max_kv_timeout_s:
            raise ValueError(f"kv_transfer_timeout_ms={requested_s * 1000:.0f}: must be at most "
                             f"{self.max_kv_timeout_s * 1000:.0f} (this worker's --max-kv-transfer-timeout)")
        return requested_s

    def check_prior(self, prompt: list[int], prior: list[int], params) -> None:
        """A resumed request's prior_output_token_ids (the router moved its stream off a failed instance), checked on
        the loop before anything is dialled or queued: fewer than max_tokens (and the context's room after the
        prompt), each inside the vocabulary. The engine checks them again (and whether the request had already
        stopped on them)."""
        if not prior:
            return
        room = self.max_model_len - len(prompt)
        limit = room if params.max_tokens is None else min(room, params.max_tokens)
        if len(prior) >= limit:
            raise ValueError(f"prior_output_token_ids: {len(prior)} tokens, must be fewer than "
                             f"{'max_tokens' if limit == params.max_tokens else 'max_model_len - the prompt'}="
                             f"{limit} (they count towards it and the request must have a token left to generate)")
        bad = next((t for t in prior if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prior_output_token_ids: token id {bad} is outside the vocabulary [0, "
                             f"{self.vocab_size})")

    def check_token(self, field: str, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"{field}={token_id}: outside the vocabulary [0, {self.vocab_size})")

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
