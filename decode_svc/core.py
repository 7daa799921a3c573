"""The decode service's core: reservations, incoming KV transfers, and the continuous batch.

The life of a request inside a decode instance:
1. The router calls Decode: `decode()` validates the parameters and reserves blocks for the whole prompt
   (`engine.reserve_prefilled`). No room: RESOURCE_EXHAUSTED, and the router tries another instance. Otherwise it
   answers Reserved and arms a timer for the transfer deadline. With prefix caching, the prompt's leading full
   blocks that this engine already holds (an earlier transferred prompt's, cached at its commit) are shared, not
   reserved again: their KV is there, and the transfer's bytes for them are dropped unwritten (`num_reused`).
2. The prefill instance opens TransferKv with the same request id: the receiver (`kv_transfer/receiver.py`, handed
   this core as its `Reservations`) checks the KvTransferOpen (a live reservation: the router sends the prompt to
   prefill while it asks for the reservation, so an open that comes first waits for its Decode call and reservation,
   `reservation`; then the cache layout field by field, prompt length, block count), then fills the reserved blocks
   in the engine thread (`write`), which first checks that the reservation is still live so that a late write never
   lands in a freed block:
   - gRPC path (`kv_transfer/grpc_bytes.py`): each KvBlocks run's bytes are written (`kv_cache[block_ids] =
     payload`, `write_blocks`; the servicer parses KvBlocks without copying the payload). The receiving loop does not
     wait for each write: up to WRITE_WINDOW_BYTES of payload may be queued on the engine thread while the next
     messages arrive, and the commit waits for all of them;
   - CUDA IPC path (`kv_transfer/cuda_ipc.py`; same host; the path was agreed once per prefill instance by
     `handshake()`, which mapped the prefill's KV cache): the open carries the prefill cache's handle, looked up among
     the mapped caches, and each KvBlocksReady run is copied GPU to GPU from the prefill's blocks into the reserved
     ones (`copy_blocks`). Only this instance writes its cache; the prefill instance keeps its blocks until the ack.
3. On KvTransferCommit, with every block received, the engine thread (`commit`) waits for the copies to complete
   (CUDA IPC: the prefill frees its blocks on the ack), and `engine.commit_prefilled(first_token)` puts the request
   in the running batch (the first token was already streamed by prefill); the KvTransferAck lets prefill free its
   copy.
4. Each engine step's outputs go back to the loop; the Decode stream yields them as TokenDeltas until the request
   finishes. Preemption (recompute) and prefix caching happen inside this instance's engine.
5. Failures: the deadline passing before the commit, a bad or broken transfer, or the router cancelling the call
   all end the Decode stream; its `finally` aborts the request in the engine, which frees the reservation or the
   running request's blocks. Nothing else holds blocks.

A resumed request (the router moved its stream off a failed instance) carries the output tokens it already sent
(`prior_output_token_ids`): the reservation and the transfer cover prompt + those tokens, and the committed token is
the one after them. With `prefill_locally` (the router's fallback when no prefill instance is reachable) there is no
reservation: the request goes straight into this engine (`engine.add_request`, the prior tokens too), which computes
its prompt itself, and the stream carries every token from the first one; a transfer for it is refused.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from engine.utils import cdiv
from kv_transfer.metrics import KvPathMetrics
from kv_transfer.receiver import KvReceiver
from protos.tandem.v1 import common_pb2, decode_pb2, kv_transfer_pb2
from serving.config import KvTransferConfig
from serving.convert import delta_to_proto, sampling_from_proto_off_loop
from serving.errors import ServiceError
from serving.hops import hop
from serving.metrics import Metrics
from serving.worker_core import WorkerCore

log = logging.getLogger("tandem.decode")

# A transfer may open before the router's Decode call for its request arrives (the router sends the prompt to prefill
# while this instance reserves: router/disaggregated.py). It waits this long for the call, then for as long as the reservation
# takes; with no call by then it fails (NOT_FOUND), as it does at once when the reservation was refused.
RESERVATION_WAIT_S = 2.0


@dataclass
class _Dec:
    """Loop-side state of one request (a kv_transfer.base.Reservation to the receiver of its transfer)."""
    request_id: str
    num_prompt_tokens: int
    timeout_s: float
    arrival: float
    reserved: asyncio.Future  # True once block_ids are reserved, False if refused or the call ended first
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # StepOutput | Exception
    block_ids: list[int] | None = None
    num_reused: int = 0  # leading block_ids this engine already held for this prefix: their KV is not written
    transfer_open: bool = False
    committed: bool = False
    expired: bool = False  # the transfer deadline passed: the reservation is being freed
    timer: asyncio.TimerHandle | None = None
    last_token_time: float | None = None


class DecodeCore(WorkerCore):
    role = "decode"

    def __init__(self, engine, metrics: Metrics, default_kv_timeout_s: float = KvTransferConfig.timeout_s,
                 max_kv_timeout_s: float = KvTransferConfig.max_timeout_s):
        super().__init__(engine, metrics, default_kv_timeout_s, max_kv_timeout_s)
        self.receiver = KvReceiver(engine.transfer_kv, self, KvPathMetrics(metrics, self.model_name, "decode"))
        self._live: set[str] = set()  # engine thread: reservations that may still be written
        self._broken: set[str] = set()  # engine thread: transfers with a failed block write (never committed)
        self._reqs: dict[str, _Dec] = {}  # event loop only
        self._arrivals: dict[str, asyncio.Future] = {}  # event loop: transfers waiting for their Decode call

    # ---- engine thread ----------------------------------------------------------------------------------------
    def _reserve(self, engine, rid: str, prompt: list[int], params, prior: list[int]) -> tuple[list[int] | None, int]:
        """The reserved block ids (None: no room) and how many leading ones already hold this prompt's KV."""
        ids = engine.reserve_prefilled(rid, prompt, params, prior_output_token_ids=prior)
        hop(rid, "decode.reserved")
        if ids is None:
            return None, 0
        self._live.add(rid)
        return ids, engine.reused_prefix_blocks(rid)

    def _add_local(self, engine, rid: str, prompt: list[int], params, prior: list[int]) -> None:
        hop(rid, "decode.added_locally")
        engine.add_request(rid, prompt, params, prior_output_token_ids=prior)

    def _write(self, engine, rid: str, fn: Callable[[torch.Tensor], None]) -> None:
        if rid not in self._live:
            raise ServiceError(grpc.StatusCode.ABORTED, f"request_id={rid!r}: the reservation was freed")
        try:
            fn(engine.transfer_kv)
        except Exception:
            self._broken.add(rid)  # the commit, queued behind this write, refuses the request
            raise

    def _commit(self, engine, rid: str, first_token_id: int, before: Callable[[], None]):
        if rid not in self._live:
            raise ServiceError(grpc.StatusCode.ABORTED, f"request_id={rid!r}: the reservation was freed")
        if rid in self._broken:
            raise ServiceError(grpc.StatusCode.ABORTED, f"request_id={rid!r}: a block write failed")
        before()  # (CUDA IPC: the copies complete; the prefill instance frees the source blocks on our ack)
        self._live.discard(rid)
        return engine.commit_prefilled(rid, first_token_id)

    def _end(self, engine, rid: str) -> None:
        self._live.discard(rid)
        self._broken.discard(rid)
        engine.abort(rid)  # frees a reservation, or the running request's blocks; no-op when already finished

    def _after_step(self, engine, outs):
        st = engine.stats()
        st.num_waiting = len(self._live)  # decode's queue is its reservations awaiting KV
        return st

    def _waiting(self, stats) -> int:
        return len(self._live) + stats.num_waiting  # reservations awaiting their KV, and the engine's queue

    # ---- event loop -------------------------------------------------------------------------------------------
    def _on_step(self, outs, stats) -> None:
        for out in outs:
            d = self._reqs.get(out.request_id)
            if d is not None:  # (the commit's future may resolve after this step's outputs arrive)
                d.out.put_nowait(out)
        if stats is not None:
            self.metrics.observe_step(stats)

    def _fail(self, rid: str, exc: Exception) -> None:
        d = self._reqs.get(rid)
        if d is not None and not d.committed:
            d.out.put_nowait(exc)

    def _expire(self, rid: str) -> None:
        d = self._reqs.get(rid)
        if d is None or d.committed:
            return
        d.expired = True
        self.metrics.kv_transfer_failures.inc()
        log.warning("kv transfer for %s missed its %.1fs deadline; freeing the reservation", rid, d.timeout_s)
        self._fail(rid, ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"kv transfer for request_id={rid!r} not complete after {d.timeout_s:g}s; "
                                     "the reservation was freed"))
        self.worker.submit(self._end, rid)

    async def decode(self, request_id: str, prompt: list[int], params_msg: common_pb2.SamplingParams,
                     kv_timeout_s: float | None, prior: list[int] = (), prefill_locally: bool = False):
        """Yields DecodeResponse messages: Reserved, then the deltas after the first token (prefill_locally: every
        delta, no Reserved). prior: the output tokens a resumed request already sent."""
        self.check_request_id(request_id)
        kv_timeout_s = self.kv_timeout(kv_timeout_s)
        if request_id in self._reqs:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request_id={request_id!r}: already in flight")
        hop(request_id, "decode.in")
        params = await sampling_from_proto_off_loop(params_msg, n=1)
        prior = list(prior)
        self.check_prior(prompt, prior, params)
        kv_tokens = len(prompt) + len(prior)  # what the transfer covers: prompt and prior outputs
        d = _Dec(request_id, kv_tokens, kv_timeout_s, time.monotonic(), asyncio.get_running_loop().create_future())
        self._reqs[request_id] = d
        arrival = self._arrivals.pop(request_id, None)
        if arrival is not None and not arrival.done():
            arrival.set_result(d)
        try:
            if prefill_locally:
                d.reserved.set_result(False)  # a transfer for this id finds no reservation
                d.committed = True
                await self.worker.call(self._add_local, request_id, prompt, params, prior)
            else:
                d.block_ids, d.num_reused = await self.worker.call(self._reserve, request_id, prompt, params, prior)
                d.reserved.set_result(d.block_ids is not None)
                if d.block_ids is None:
                    raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       f"decode has no room for {kv_tokens} prompt tokens "
                                       f"({cdiv(kv_tokens, self.block_size)} blocks) now; try another instance")
                d.timer = asyncio.get_running_loop().call_later(d.timeout_s, self._expire, request_id)
                hop(request_id, "decode.yield")
                yield decode_pb2.DecodeResponse(reserved=decode_pb2.Reserved(num_blocks=len(d.block_ids)))
            while True:
                item = await d.out.get()
                if isinstance(item, Exception):
                    raise item
                now = time.monotonic()
                if item.new_token_ids and d.last_token_time is not None:
                    self.metrics.inter_token_latency_seconds.observe(now - d.last_token_time)
                d.last_token_time = now
                self.metrics.generation_tokens.inc(len(item.new_token_ids))
                yield decode_pb2.DecodeResponse(delta=delta_to_proto(item))
                if item.finished:
                    self.metrics.e2e_request_latency_seconds.observe(now - d.arrival)
                    self.metrics.finished(item.finish_reason)
                    return
        finally:
            if not d.reserved.done():
                d.reserved.set_result(False)
            if d.timer is not None:
                d.timer.cancel()
            self._reqs.pop(request_id, None)
            self.worker.submit(self._end, request_id)

    # ---- the receiver's Reservations (kv_transfer/base.py) ---------------------------------------------------
    async def handshake(self, req: kv_transfer_pb2.KvHandshakeRequest) -> kv_transfer_pb2.KvHandshakeResponse:
        """Which path transfers from this prefill instance take (kv_transfer/receiver.py)."""
        return await self.receiver.handshake(req)

    async def transfer(self, messages) -> kv_transfer_pb2.KvTransferAck:
        """Receives one request's KV (kv_transfer/receiver.py); returns the ack once the request is in the batch."""
        return await self.receiver.transfer(messages)

    async def reservation(self, rid: str) -> _Dec | None:
        """rid's live reservation, once made: a transfer can open while its Decode call is on the way or reserving
        (see RESERVATION_WAIT_S). None if there is none."""
        d = self._reqs.get(rid)
        if d is None:
            arrival = self._arrivals.get(rid)
            if arrival is None:
                arrival = self._arrivals[rid] = asyncio.get_running_loop().create_future()
            try:
                d = await asyncio.wait_for(asyncio.shield(arrival), RESERVATION_WAIT_S)
            except TimeoutError:
                return None
            finally:
                if self._arrivals.get(rid) is arrival:
                    del self._arrivals[rid]
        if not await asyncio.shield(d.reserved) or self._reqs.get(rid) is not d or d.expired:
            return None
        return d

    def is_live(self, rid: str, d: _Dec) -> bool:
        return self._reqs.get(rid) is d and not d.expired  # the loop frees reservations (_end)

    def write(self, rid: str, fn: Callable[[torch.Tensor], None]) -> asyncio.Future:
        return self.worker.queue(self._write, rid, fn)

    def commit(self, rid: str, first_token_id: int, before: Callable[[], None]) -> asyncio.Future:
        try:  # a token the model cannot embed would fail the next step of every request in the batch
            self.check_token("commit.first_token_id", first_token_id)
        except ValueError as e:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return self.worker.queue(self._commit, rid, first_token_id, before)  # runs after every write

    def on_engine(self, fn):
        return self.worker.call(lambda engine: fn(engine.transfer_kv))

    def committed(self, d: _Dec, out) -> None:
        d.committed = True
        if d.timer is not None:
            d.timer.cancel()
        if out.finished:  # the first token already ended it (the router has that token)
            out.new_token_ids, out.new_text, out.new_logprobs = [], "", None
            d.out.put_nowait(out)

    def failed(self, rid: str, err: Exception) -> None:
        self._fail(rid, err)
