"""The decode service's core: reservations, incoming KV transfers, and the continuous batch.

The life of a request inside a decode instance:
1. The router calls Decode: `decode()` validates the parameters and reserves blocks for the whole prompt
   (`engine.reserve_prefilled`). No room: RESOURCE_EXHAUSTED, and the router tries another instance. Otherwise it
   answers Reserved and arms a timer for the transfer deadline. With prefix caching, the prompt's leading full
   blocks that this engine already holds (an earlier transferred prompt's, cached at its commit) are shared, not
   reserved again: their KV is there, and the transfer's bytes for them are dropped unwritten (`num_reused`).
2. The prefill instance opens TransferKv with the same request id: `transfer()` checks the KvTransferOpen (a live
   reservation: the router sends the prompt to prefill while it asks for the reservation, so an open that comes
   first waits for its Decode call and reservation, `_reservation`; then the cache layout field by field, prompt
   length, block count), then fills the reserved blocks, in
   the engine thread, which first checks that the reservation is still live so that a late write never lands in a
   freed block:
   - gRPC path: each KvBlocks run's bytes are written (`kv_cache[block_ids] = payload`, `kv_layout.write_blocks`;
     the servicer parses KvBlocks without copying the payload). The receiving loop does not wait for each write:
     up to WRITE_WINDOW_BYTES of payload may be queued on the engine thread while the next messages arrive, and the
     commit waits for all of them;
   - CUDA IPC path (same host; the path was agreed once per prefill instance by `handshake()`, which mapped the
     prefill's KV cache): the open carries the prefill cache's handle, looked up among the mapped caches, and each
     KvBlocksReady run is copied GPU to GPU from the prefill's blocks into the reserved ones (`kv_ipc.copy_blocks`).
     Only this instance writes its cache; the prefill instance keeps its blocks until the ack.
3. On KvTransferCommit, with every block received, the engine thread waits for the copies to complete (CUDA IPC:
   the prefill frees its blocks on the ack), and `engine.commit_prefilled(first_token)` puts the request in the
   running batch (the first token was already streamed by prefill); the KvTransferAck lets prefill free its copy.
4. Each engine step's outputs go back to the loop; the Decode stream yields them as TokenDeltas until the request
   finishes. Preemption (recompute) and prefix caching happen inside this instance's engine.
5. Failures: the deadline passing before the commit, a bad or broken transfer, or the router cancelling the call
   all end the Decode stream; its `finally` aborts the request in the engine, which frees the reservation or the
   running request's blocks. Nothing else holds blocks.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

import grpc

import torch

from engine.utils import cdiv
from kv_transfer.cuda_ipc import CUDA_IPC, GRPC, copy_blocks, host_identity, import_cache, ipc_refusal
from kv_transfer.layout import ReceivedBlocks, layout_mismatch, layout_of, retain_freed_memory, write_blocks
from kv_transfer.metrics import KvPathMetrics
from protos.tandem.v1 import common_pb2, decode_pb2, kv_transfer_pb2
from serving.config import KvTransferConfig
from serving.convert import delta_to_proto, sampling_from_proto
from serving.engine_thread import EngineThread
from serving.errors import ServiceError
from serving.hops import hop
from serving.metrics import Metrics

log = logging.getLogger("tandem.decode")

# A transfer may open before the router's Decode call for its request arrives (the router sends the prompt to prefill
# while this instance reserves: router/core.py). It waits this long for the call, then for as long as the reservation
# takes; with no call by then it fails (NOT_FOUND), as it does at once when the reservation was refused.
RESERVATION_WAIT_S = 2.0

# Payload of a transfer's KvBlocks queued on the engine thread and not yet written, at most (received messages past
# it wait). Writes queue behind engine steps, so the window lets the transfer go on during a step.
WRITE_WINDOW_BYTES = 64 << 20


@dataclass
class _Dec:
    """Loop-side state of one request."""
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


class DecodeCore:
    def __init__(self, engine, metrics: Metrics, default_kv_timeout_s: float = KvTransferConfig.timeout_s):
        self.engine = engine
        self.metrics = metrics
        self.default_kv_timeout_s = default_kv_timeout_s
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.block_size = engine.config.cache.block_size
        self.layout = layout_of(engine.kv_cache)
        retain_freed_memory()  # this process receives KV: the messages' buffers are then reused, not faulted in
        self.host = host_identity()
        self.path_metrics = KvPathMetrics(metrics, self.model_name, "decode")
        self._live: set[str] = set()  # engine thread: reservations that may still be written
        self._copied: dict[str, torch.cuda.Event] = {}  # engine thread: the last CUDA IPC copy of each transfer
        self._broken: set[str] = set()  # engine thread: transfers with a failed block write (never committed)
        self._sources: dict[bytes, torch.Tensor] = {}  # written by the engine thread: mapped prefill caches
        self._reqs: dict[str, _Dec] = {}  # event loop only
        self._arrivals: dict[str, asyncio.Future] = {}  # event loop: transfers waiting for their Decode call
        self.worker: EngineThread | None = None

    async def start(self) -> None:
        self.worker = EngineThread(self.engine, asyncio.get_running_loop(), self._on_step, self._after_step,
                                   name="decode-engine")
        self.worker.start()

    async def close(self) -> None:
        for rid in list(self._reqs):
            self.worker.submit(self._end, rid)
        self.worker.stop()

    # ---- engine thread ----------------------------------------------------------------------------------------
    def _reserve(self, engine, rid: str, prompt: list[int], params) -> tuple[list[int] | None, int]:
        """The reserved block ids (None: no room) and how many leading ones already hold this prompt's KV."""
        ids = engine.reserve_prefilled(rid, prompt, params)
        hop(rid, "decode.reserved")
        if ids is None:
            return None, 0
        self._live.add(rid)
        return ids, engine.reused_prefix_blocks(rid)

    def _write(self, engine, rid: str, block_ids: list[int], data: bytes | memoryview) -> None:
        if rid not in self._live:
            raise ServiceError(grpc.StatusCode.ABORTED, f"request_id={rid!r}: the reservation was freed")
        try:
            write_blocks(engine.kv_cache, block_ids, data)
        except Exception:
            self._broken.add(rid)  # the commit, queued behind this write, refuses the request
            raise

    def _map(self, engine, cache: kv_transfer_pb2.CudaIpcCache) -> torch.Tensor:
        """The rows of a prefill instance's cache, mapped on first use (ipc_refusal already said None)."""
        src = self._sources.get(cache.mem_handle)
        if src is None:
            src = self._sources[cache.mem_handle] = import_cache(cache, self.layout.block_bytes, self.host)
            log.info("mapped the KV cache of prefill pid %d on %s (%d blocks) for CUDA IPC transfers",
                     cache.host.pid, cache.host.hostname, cache.num_blocks)
        return src

    def _copy(self, engine, rid: str, block_ids: list[int], src: torch.Tensor, src_ids: list[int]) -> None:
        if rid not in self._live:
            raise ServiceError(grpc.StatusCode.ABORTED, f"request_id={rid!r}: the reservation was freed")
        copy_blocks(engine.kv_cache, block_ids, src, src_ids)
        event = self._copied[rid] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(engine.kv_cache.device))

    def _commit(self, engine, rid: str, first_token_id: int):
        if rid not in self._live:
            raise ServiceError(grpc.StatusCode.ABORTED, f"request_id={rid!r}: the reservation was freed")
        if rid in self._broken:
            raise ServiceError(grpc.StatusCode.ABORTED, f"request_id={rid!r}: a block write failed")
        copied = self._copied.pop(rid, None)
        if copied is not None:
            copied.synchronize()  # the prefill instance frees the source blocks on our ack
        self._live.discard(rid)
        return engine.commit_prefilled(rid, first_token_id)

    def _end(self, engine, rid: str) -> None:
        self._live.discard(rid)
        self._broken.discard(rid)
        self._copied.pop(rid, None)  # a copy still in flight is ordered before any reuse of its blocks (one stream)
        engine.abort(rid)  # frees a reservation, or the running request's blocks; no-op when already finished

    def _after_step(self, engine, outs):
        st = engine.stats()
        st.num_waiting = len(self._live)  # decode's queue is its reservations awaiting KV
        return st

    def _load(self, engine) -> common_pb2.InstanceLoad:
        st = engine.stats()
        return common_pb2.InstanceLoad(
            role="decode", model=self.model_name, num_requests_running=st.num_running,
            num_requests_waiting=len(self._live) + st.num_waiting, num_used_blocks=st.num_used_blocks,
            num_total_blocks=st.num_total_blocks, kv_cache_usage=st.kv_cache_usage, block_size=self.block_size,
            max_model_len=self.max_model_len)

    # ---- event loop -------------------------------------------------------------------------------------------
    def _on_step(self, outs, stats) -> None:
        for out in outs:
            d = self._reqs.get(out.request_id)
            if d is not None:  # (the commit's future may resolve after this step's outputs arrive)
                d.out.put_nowait(out)
        if stats is not None:
            self.metrics.observe_step(stats)

    async def load(self) -> common_pb2.InstanceLoad:
        # Read here, not queued behind the engine thread: a long step must not time out the router's health poll
        # (which would take a live instance out of rotation). These are counters and C-level copies, atomic
        # under the GIL, at most one step stale.
        load = self._load(self.engine)
        load.num_tracked_requests = len(self._reqs)
        return load

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
                     kv_timeout_s: float | None):
        """Yields DecodeResponse messages: Reserved, then the deltas after the first token."""
        if not request_id:
            raise ValueError("request_id: must not be empty")
        if request_id in self._reqs:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request_id={request_id!r}: already in flight")
        hop(request_id, "decode.in")
        params = sampling_from_proto(params_msg, n=1)
        d = _Dec(request_id, len(prompt), kv_timeout_s or self.default_kv_timeout_s, time.monotonic(),
                 asyncio.get_running_loop().create_future())
        self._reqs[request_id] = d
        arrival = self._arrivals.pop(request_id, None)
        if arrival is not None and not arrival.done():
            arrival.set_result(d)
        try:
            d.block_ids, d.num_reused = await self.worker.call(self._reserve, request_id, prompt, params)
            d.reserved.set_result(d.block_ids is not None)
            if d.block_ids is None:
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"decode has no room for {len(prompt)} prompt tokens "
                                   f"({cdiv(len(prompt), self.block_size)} blocks) now; try another instance")
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

    async def handshake(self, req: kv_transfer_pb2.KvHandshakeRequest) -> kv_transfer_pb2.KvHandshakeResponse:
        """Which path transfers from this prefill instance take: CUDA_IPC once its offered cache is mapped here."""
        reason = layout_mismatch(self.layout, req.layout)
        if reason is None:
            reason = ipc_refusal(self.host, self.engine.kv_cache.device, req.cache if req.HasField("cache") else None)
        if reason is None:
            try:
                await self.worker.call(self._map, req.cache)
            except Exception as exc:  # noqa: BLE001 - e.g. separate IPC namespaces: the answer is GRPC, with why
                reason = f"mapping the prefill KV cache failed: {type(exc).__name__}: {exc}"
        if reason is not None:
            log.info("kv transfers from prefill pid %d on %s take the grpc path: %s", req.host.pid, req.host.hostname,
                     reason)
        return kv_transfer_pb2.KvHandshakeResponse(host=self.host, path=GRPC if reason else CUDA_IPC,
                                                   reason=reason or "")

    async def _reservation(self, rid: str) -> _Dec | None:
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

    async def transfer(self, messages) -> kv_transfer_pb2.KvTransferAck:
        """Receives one request's KV (see kv_transfer.proto); returns the ack once the request is in the batch."""
        t0 = time.monotonic()
        try:
            first = await anext(messages)
        except StopAsyncIteration:
            raise ValueError("TransferKv: empty stream; the first message must be `open`") from None
        if isinstance(first, ReceivedBlocks) or not first.HasField("open"):
            kind = "blocks" if isinstance(first, ReceivedBlocks) else first.WhichOneof("kind")
            raise ValueError(f"TransferKv: first message is `{kind}`; it must be `open`")
        op = first.open
        rid = op.request_id
        hop(rid, "decode.tx_open")
        d = await self._reservation(rid)
        if d is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"open.request_id={rid!r}: no reservation here (never "
                                                          "made, refused, expired, or cancelled)")
        if d.transfer_open or d.committed:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"open.request_id={rid!r}: transfer already open")
        d.transfer_open = True
        received = bytearray(len(d.block_ids))  # 1 where a block arrived
        nbytes = 0
        path = op.path or GRPC
        queued: collections.deque[tuple[asyncio.Future, int]] = collections.deque()  # block writes (bytes), commit
        queued_bytes = 0

        def check_live() -> None:  # the loop frees reservations (_end), so this holds until the next await
            if self._reqs.get(rid) is not d or d.expired:
                raise ServiceError(grpc.StatusCode.ABORTED, f"request_id={rid!r}: the reservation was freed")

        def run_of(first: int, n: int, field: str) -> tuple[list[int], int]:
            """The run's reserved block ids, and how many of its leading blocks to skip: a prefix this engine
            already held (shared with other requests, its KV already there; the prefill sends every block)."""
            if n < 1 or first + n > len(d.block_ids):
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"{field}.first_block_index={first}, {n} blocks: must lie within the "
                                   f"{len(d.block_ids)} reserved blocks")
            received[first:first + n] = b"\x01" * n
            return d.block_ids[first:first + n], min(n, max(0, d.num_reused - first))

        try:
            bad = layout_mismatch(self.layout, op.layout)
            if bad is None and op.num_prompt_tokens != d.num_prompt_tokens:
                bad = f"open.num_prompt_tokens={op.num_prompt_tokens}: the reservation is for {d.num_prompt_tokens}"
            if bad is None and op.num_blocks != len(d.block_ids):
                bad = f"open.num_blocks={op.num_blocks}: the reservation holds {len(d.block_ids)} blocks"
            if bad is None and path not in (GRPC, CUDA_IPC):
                bad = f"open.path={path}: unknown transfer path"
            if bad is not None:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, bad)
            src = None
            if path == CUDA_IPC:
                refusal = ipc_refusal(self.host, self.engine.kv_cache.device,
                                      op.cache if op.HasField("cache") else None)
                if refusal is not None:
                    raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"open.path=CUDA_IPC: {refusal}")
                src = self._sources.get(op.cache.mem_handle)  # mapped once per prefill process (atomic read)
                try:
                    if src is None:
                        src = await self.worker.call(self._map, op.cache)
                except Exception as exc:  # noqa: BLE001
                    raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                       f"open.cache: mapping the prefill KV cache failed: {exc}") from None
            block_bytes = self.layout.block_bytes
            async for msg in messages:  # KvTransferMessage, or ReceivedBlocks (servicer.parse_transfer_message)
                kind = "blocks" if isinstance(msg, ReceivedBlocks) else msg.WhichOneof("kind")
                if kind in ("blocks", "ready") and (kind == "ready") != (path == CUDA_IPC):
                    raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"{kind}: this transfer opened with path="
                                       f"{kv_transfer_pb2.KvTransferPath.Name(path)}, which sends "
                                       f"`{'ready' if path == CUDA_IPC else 'blocks'}` messages")
                if kind == "blocks":
                    b = msg if isinstance(msg, ReceivedBlocks) else ReceivedBlocks.of(msg.blocks)
                    size = len(b.data)
                    if size != b.num_blocks * block_bytes:
                        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                           f"blocks.data: {size} bytes, must be num_blocks * block_bytes = "
                                           f"{b.num_blocks * block_bytes}")
                    ids, skip = run_of(b.first_block_index, b.num_blocks, "blocks")
                    while queued and (queued[0][0].done() or queued_bytes + size > WRITE_WINDOW_BYTES):
                        done, n = queued.popleft()
                        await done  # raises the write's error
                        queued_bytes -= n
                    check_live()
                    if skip < len(ids):
                        data = memoryview(b.data)[skip * block_bytes:] if skip else b.data
                        queued.append((self.worker.queue(self._write, rid, ids[skip:], data), size))
                        queued_bytes += size
                    nbytes += size
                    self.path_metrics.add_bytes(path, size)
                elif kind == "ready":
                    r = msg.ready
                    src_ids = list(r.block_ids)
                    bad_id = next((i for i in src_ids if i >= src.shape[0]), None)
                    if bad_id is not None:
                        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                           f"ready.block_ids: {bad_id} is past the prefill cache's "
                                           f"{src.shape[0]} blocks")
                    ids, skip = run_of(r.first_block_index, len(src_ids), "ready")
                    if skip < len(ids):  # queued on the GPU, not waited for
                        await self.worker.call(self._copy, rid, ids[skip:], src, src_ids[skip:])
                    nbytes += len(src_ids) * block_bytes
                    self.path_metrics.add_bytes(path, len(src_ids) * block_bytes)
                elif kind == "commit":
                    missing = received.count(0)
                    if missing:
                        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                           f"commit: {missing} of {len(received)} blocks never arrived")
                    commit = self.worker.queue(self._commit, rid, msg.commit.first_token_id)  # runs after every write
                    queued.append((commit, 0))
                    while len(queued) > 1:
                        await queued.popleft()[0]  # a failed write raises here (and the commit refuses)
                    out = await commit
                    d.committed = True
                    if d.timer is not None:
                        d.timer.cancel()
                    if out.finished:  # the first token already ended it (the router has that token)
                        out.new_token_ids, out.new_text, out.new_logprobs = [], "", None
                        d.out.put_nowait(out)
                    self.path_metrics.observe_seconds(path, time.monotonic() - t0)
                    return kv_transfer_pb2.KvTransferAck(request_id=rid, received_bytes=nbytes,
                                                         num_blocks=len(received), path=path)
                else:
                    raise ValueError(f"TransferKv: unexpected `{kind}` message after `open`")
            raise ServiceError(grpc.StatusCode.ABORTED, "TransferKv: stream ended without `commit`")
        except BaseException as exc:
            for done, _ in queued:  # a queued write still runs, and writes only while the reservation lives
                if not done.done():
                    done.cancel()
                elif not done.cancelled():
                    done.exception()  # retrieved (this failure, or one after it)
            if not d.committed:
                self.metrics.kv_transfer_failures.inc()
                if isinstance(exc, asyncio.CancelledError):
                    err = ServiceError(grpc.StatusCode.ABORTED, f"kv transfer for request_id={rid!r} was cancelled "
                                                                "by the prefill instance")
                elif isinstance(exc, ServiceError):
                    err = exc
                else:
                    err = ServiceError(grpc.StatusCode.ABORTED, f"kv transfer for request_id={rid!r} failed: {exc}")
                self._fail(rid, err)
            raise
