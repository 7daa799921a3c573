"""The receiving side of KV transfers: the handshake that picks a prefill instance's path (`KvReceiver.handshake`),
and one request's incoming transfer (`IncomingTransfer`).

The life of a transfer on the receiving side (its `TransferState` goes BOOTSTRAPPING -> WAITING -> TRANSFERRING ->
SUCCESS, or FAILED from any of them):
1. BOOTSTRAPPING: the first message must be the KvTransferOpen. Its request id (at most MAX_ID_CHARS characters) names
   a reservation, which may not exist yet (the router sends the prompt to prefill while it asks for it): the open
   waits for it (`Reservations.reservation`), and fails NOT_FOUND when there is none; a second open is ALREADY_EXISTS.
2. WAITING: the open is checked against this cache and the reservation (layout field by field, prompt length, block
   count, a known path), then by the path's transport (registry.TRANSPORTS; CUDA IPC: the host identity and the
   mapping of the prefill's cache; NIXL: the prefill cache named must be the one its handshake registered).
3. TRANSFERRING: each block run is checked by the transport (`BlockReceiver.run`), then against the reservation
   (its positions must lie within the reserved blocks), and lands in the reserved block ids on the engine thread
   (`Reservations.write`, which first checks that the reservation is still live so that a late write never lands
   in a freed block). The leading blocks the engine already held (a reused prefix, `num_reused`) are not written.
   gRPC bytes: the receiving loop does not wait for each write: up to the transport's window of payload may be
   queued on the engine thread while the next messages arrive. CUDA IPC: each copy is queued on the GPU and waited
   for on the engine thread only. NIXL: each READ is waited for on the engine thread (where frees happen too).
4. SUCCESS: on the commit, with every block received, the commit is queued behind the writes; it refuses if one
   failed, waits for what the transport left in flight (CUDA IPC: the copies: the prefill frees its blocks on the
   ack), and puts the request in the batch; the KvTransferAck goes back.
5. FAILED: any error (a bad message, a freed reservation, a broken stream, the prefill cancelling) cancels the
   queued writes, counts the failure by path and state, and fails the request's Decode call (`Reservations.failed`),
   whose end frees the blocks.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time

import grpc
import torch

from engine.sharded_kv import ShardedKvCache
from kv_transfer import nixl
from kv_transfer.base import CUDA_IPC, GRPC, NIXL, BlockRun, KvPoll, Reservation, Reservations, TransferState
from kv_transfer.cuda_ipc import MappedCaches, host_identity, ipc_refusal
from kv_transfer.grpc_bytes import message_kind, parse_transfer_message
from kv_transfer.layout import layout_mismatch, layout_of, retain_freed_memory
from kv_transfer.metrics import KvPathMetrics
from kv_transfer.registry import TRANSPORTS
from protos.tandem.v1 import kv_transfer_pb2
from serving.errors import ServiceError, shown
from serving.hops import hop
from serving.logs import tag_request
from serving.worker_core import MAX_ID_CHARS

log = logging.getLogger("tandem.decode.kv")

_BLOCK_KINDS = {t.kind for t in TRANSPORTS.values()}  # the KvTransferMessage fields that carry block runs


class KvReceiver:
    """The receiving side of one decode process: its cache's layout and host identity, the prefill caches it mapped,
    and the reservations it is handed (`Reservations`: the decode service owns them and the engine thread)."""

    def __init__(self, kv_cache: torch.Tensor, reservations: Reservations, path_metrics: KvPathMetrics):
        self.layout = layout_of(kv_cache)
        # A tensor-parallel decode instance (engine/sharded_kv.py) takes its KV as bytes through rank 0, or by NIXL
        # rank to rank from a prefill of as many ranks (_sharded_handshake); never by CUDA IPC.
        self.num_ranks = kv_cache.tensor_parallel_size if isinstance(kv_cache, ShardedKvCache) else 1
        self.sharded = (f"this decode instance is tensor-parallel (tensor_parallel_size={self.num_ranks}): its "
                        "ranks take CUDA IPC from no peer" if self.num_ranks > 1 else None)
        retain_freed_memory()  # this process receives KV: the messages' buffers are then reused, not faulted in
        self.host = host_identity()
        self.device = kv_cache.device
        self.reservations = reservations
        self.path_metrics = path_metrics
        self.sources = MappedCaches(self.layout.block_bytes, self.host, reservations.on_engine)
        self.nixl = nixl.NixlPeers(f"tandem-decode-{self.host.process_id}", reservations.on_engine)

    @staticmethod
    def deserialize(raw: bytes):
        """TransferKv's request deserializer: KvBlocks as grpc_bytes.ReceivedBlocks, whose payload is a view of the
        received bytes (protobuf's parser would copy it twice), anything else as a KvTransferMessage."""
        return parse_transfer_message(raw)

    async def handshake(self, req: kv_transfer_pb2.KvHandshakeRequest) -> kv_transfer_pb2.KvHandshakeResponse:
        """Which path transfers from this prefill instance take: CUDA_IPC once its offered cache is mapped here,
        else NIXL once its offered agent is added (another host, or the prefill asks for NIXL on one host too), else
        GRPC. A prefill cache of another layout is refused (FAILED_PRECONDITION naming the field): no path carries
        its blocks."""
        bad = layout_mismatch(self.layout, req.layout)
        if bad is not None:
            # No path carries blocks between caches of two layouts (another dtype, block size or model): refused
            # here, once, so that the prefill fails its requests before computing them, not at each open.
            log.warning("kv handshake from prefill pid %d on %s refused: %s", req.host.pid, shown(req.host.hostname),
                        bad)
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"{bad}: no KV transfer path carries blocks between caches of two layouts (the "
                               "prefill and decode instances need the same model, --block-size and --kv-cache-dtype)")
        if self.sharded:
            return await self._sharded_handshake(req)
        reason = ipc_refusal(self.host, self.device, req.cache if req.HasField("cache") else None)
        if reason is None:
            try:
                await self.sources.map(req.cache)
            except Exception as exc:  # noqa: BLE001 - e.g. separate IPC namespaces: the answer is another path
                reason = f"mapping the prefill KV cache failed: {type(exc).__name__}: {exc}"
        if reason is None:
            return kv_transfer_pb2.KvHandshakeResponse(host=self.host, path=CUDA_IPC)
        if req.HasField("nixl"):
            if len(req.nixl_ranks) > 1:
                return self._grpc(req, f"{reason}; and the prefill is tensor-parallel ({len(req.nixl_ranks)} ranks), "
                                       "this decode instance is not: NIXL reads each rank's KV heads rank to rank, "
                                       "which needs equal tensor-parallel sizes")
            if req.host.boot_id == self.host.boot_id and not req.nixl_on_one_host:
                return self._grpc(req, f"{reason}; and NIXL is for transfers between hosts (--kv-transfer nixl on "
                                       "the prefill takes it on one host too)")
            reason = nixl.import_error()
            if reason is None:
                try:
                    await self.nixl.add(req.nixl, self.layout.block_bytes)
                except Exception as exc:  # noqa: BLE001 - bad metadata, or UCX failing here: the answer is GRPC
                    reason = f"adding the prefill's NIXL agent failed: {type(exc).__name__}: {exc}"
            if reason is None:
                return kv_transfer_pb2.KvHandshakeResponse(host=self.host, path=NIXL)
        return self._grpc(req, reason)

    async def _sharded_handshake(self, req: kv_transfer_pb2.KvHandshakeRequest) -> kv_transfer_pb2.KvHandshakeResponse:
        """A tensor-parallel decode: NIXL rank to rank when the prefill offers as many ranks' caches, else GRPC."""
        if not req.nixl_ranks:
            reason = f"{self.sharded}, and the prefill offers no NIXL cache per rank"
        elif req.host.boot_id == self.host.boot_id and not req.nixl_on_one_host:
            reason = ("NIXL is for transfers between hosts (--kv-transfer nixl on the prefill takes it on one host "
                      "too)")
        else:
            reason = nixl.import_error() or nixl.check_rank_offers(req.nixl_ranks, self.num_ranks)
        if reason is None:
            try:
                await self.nixl.add_ranks(req.nixl_ranks, self.num_ranks)
            except Exception as exc:  # noqa: BLE001 - bad metadata, or UCX failing on a rank: the answer is GRPC
                reason = f"adding the prefill ranks' NIXL agents failed: {type(exc).__name__}: {exc}"
        if reason is None:
            return kv_transfer_pb2.KvHandshakeResponse(host=self.host, path=NIXL)
        return self._grpc(req, reason)

    def _grpc(self, req: kv_transfer_pb2.KvHandshakeRequest, reason: str) -> kv_transfer_pb2.KvHandshakeResponse:
        log.info("kv transfers from prefill pid %d on %s take the grpc path: %s", req.host.pid,
                 shown(req.host.hostname), reason)
        return kv_transfer_pb2.KvHandshakeResponse(host=self.host, path=GRPC, reason=reason)

    async def transfer(self, messages) -> kv_transfer_pb2.KvTransferAck:
        """Receives one request's KV (see kv_transfer.proto); returns the ack once the request is in the batch."""
        return await IncomingTransfer(self).run(messages)


class IncomingTransfer:
    """One request's transfer, from its open to its ack (event loop). `messages`: KvTransferMessage, or
    grpc_bytes.ReceivedBlocks (the servicer's parse_transfer_message)."""

    def __init__(self, side: KvReceiver):
        self.side = side
        self.reservations = side.reservations
        self.state = TransferState("", "receive")
        self.t0 = time.monotonic()
        self.rid = ""
        self.r: Reservation | None = None
        self.path = GRPC
        self.transport = None  # the path's BlockReceiver, once the open was checked
        self.received = bytearray()  # 1 where a block arrived
        self.nbytes = 0
        self.queued: collections.deque[tuple[asyncio.Future, int]] = collections.deque()  # writes (bytes), commit
        self.queued_bytes = 0

    async def run(self, messages) -> kv_transfer_pb2.KvTransferAck:
        try:
            op = await self._first(messages)
        except BaseException:
            self.state.advance(KvPoll.FAILED)
            raise
        try:
            await self._open(op)
            async for msg in messages:
                kind = message_kind(msg)
                if kind in _BLOCK_KINDS:
                    await self._blocks(kind, msg)
                elif kind == "commit":
                    return await self._commit(msg.commit)
                else:
                    raise ValueError(f"TransferKv: unexpected `{kind}` message after `open`")
            raise ServiceError(grpc.StatusCode.ABORTED, "TransferKv: stream ended without `commit`")
        except BaseException as exc:
            self._abandon(exc)
            raise

    # ---- open ---------------------------------------------------------------------------------------------------
    async def _first(self, messages) -> kv_transfer_pb2.KvTransferOpen:
        """The open, and its live reservation, claimed for this transfer."""
        try:
            first = await anext(messages)
        except StopAsyncIteration:
            raise ValueError("TransferKv: empty stream; the first message must be `open`") from None
        kind = message_kind(first)
        if kind != "open":
            raise ValueError(f"TransferKv: first message is `{kind}`; it must be `open`")
        op = first.open
        if not 0 < len(op.request_id) <= MAX_ID_CHARS:  # (logged and looked up: bounded first, as a Decode call's)
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"open.request_id: {len(op.request_id)} characters, "
                                                                 f"must be 1 to {MAX_ID_CHARS}")
        rid = self.rid = self.state.request_id = op.request_id
        tag_request(rid)  # (this call's task: its log lines carry the id)
        hop(rid, "decode.tx_open")
        r = await self.reservations.reservation(rid)
        if r is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"open.request_id={rid!r}: no reservation here (never "
                                                          "made, refused, expired, or cancelled)")
        if r.transfer_open or r.committed:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"open.request_id={rid!r}: transfer already open")
        r.transfer_open = True
        self.r = r
        self.received = bytearray(len(r.block_ids))
        self.path = op.path or GRPC
        return op

    async def _open(self, op: kv_transfer_pb2.KvTransferOpen) -> None:
        """The open's checks against this cache and the reservation, then its transport's."""
        r = self.r
        bad = layout_mismatch(self.side.layout, op.layout)
        if bad is None and op.num_prompt_tokens != r.num_prompt_tokens:
            bad = f"open.num_prompt_tokens={op.num_prompt_tokens}: the reservation is for {r.num_prompt_tokens}"
        if bad is None and op.num_blocks != len(r.block_ids):
            bad = f"open.num_blocks={op.num_blocks}: the reservation holds {len(r.block_ids)} blocks"
        if bad is None and self.path not in TRANSPORTS:
            bad = f"open.path={self.path}: unknown transfer path"
        if bad is None and self.path == CUDA_IPC and self.side.sharded:
            bad = f"open.path=KV_TRANSFER_PATH_CUDA_IPC: {self.side.sharded}"
        if bad is not None:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, bad)
        transport = TRANSPORTS[self.path].receiver(self.side)
        await transport.open(op)
        self.transport = transport
        self.state.advance(KvPoll.WAITING)

    # ---- block runs ---------------------------------------------------------------------------------------------
    async def _blocks(self, kind: str, msg) -> None:
        expected = TRANSPORTS[self.path].kind
        if kind != expected:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{kind}: this transfer opened with path="
                               f"{kv_transfer_pb2.KvTransferPath.Name(self.path)}, which sends `{expected}` messages")
        run = self.transport.run(msg)
        ids, skip = self._positions(run, kind)
        self.state.advance(KvPoll.TRANSFERRING)
        while self.queued and (self.queued[0][0].done()
                               or self.queued_bytes + run.nbytes > self.transport.window_bytes):
            done, n = self.queued.popleft()
            await done  # raises the write's error
            self.queued_bytes -= n
        self._check_live()
        if skip < len(ids):
            transport, rest = self.transport, ids[skip:]
            write = self.reservations.write(self.rid, lambda kv_cache: transport.write(kv_cache, rest, run, skip))
            self.queued.append((write, run.nbytes))
            self.queued_bytes += run.nbytes
            if not transport.window_bytes:
                await self._settle()
        self.nbytes += run.nbytes
        self.side.path_metrics.add_bytes(self.path, run.nbytes)

    def _positions(self, run: BlockRun, field: str) -> tuple[list[int], int]:
        """The run's reserved block ids, and how many of its leading blocks to skip: a prefix this engine already
        held (shared with other requests, its KV already there; the prefill sends every block)."""
        first, n, block_ids = run.first_block_index, run.num_blocks, self.r.block_ids
        if n < 1 or first + n > len(block_ids):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{field}.first_block_index={first}, {n} blocks: must lie within the "
                               f"{len(block_ids)} reserved blocks")
        self.received[first:first + n] = b"\x01" * n
        return block_ids[first:first + n], min(n, max(0, self.r.num_reused - first))

    def _check_live(self) -> None:
        """The decode service frees reservations on the loop, so this holds until the next await."""
        if not self.reservations.is_live(self.rid, self.r):
            raise ServiceError(grpc.StatusCode.ABORTED, f"request_id={self.rid!r}: the reservation was freed")

    async def _settle(self) -> None:
        """Waits for every queued write (a failed one raises here)."""
        while self.queued:
            done, n = self.queued.popleft()
            await done
            self.queued_bytes -= n

    # ---- commit -------------------------------------------------------------------------------------------------
    async def _commit(self, commit: kv_transfer_pb2.KvTransferCommit) -> kv_transfer_pb2.KvTransferAck:
        missing = self.received.count(0)
        if missing:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"commit: {missing} of {len(self.received)} blocks never arrived")
        # Runs after every write (and refuses when one failed), the transport's in-flight work completed first.
        done = self.reservations.commit(self.rid, commit.first_token_id, self.transport.before_commit)
        self.queued.append((done, 0))
        while len(self.queued) > 1:
            await self.queued.popleft()[0]  # a failed write raises here (and the commit refuses)
        out = await done
        self.reservations.committed(self.r, out)
        self.side.path_metrics.observe_seconds(self.path, time.monotonic() - self.t0)
        self.state.advance(KvPoll.SUCCESS)
        return kv_transfer_pb2.KvTransferAck(request_id=self.rid, received_bytes=self.nbytes,
                                             num_blocks=len(self.received), path=self.path)

    # ---- failure ------------------------------------------------------------------------------------------------
    def _abandon(self, exc: BaseException) -> None:
        for done, _ in self.queued:  # a queued write still runs, and writes only while the reservation lives
            if not done.done():
                done.cancel()
            elif not done.cancelled():
                done.exception()  # retrieved (this failure, or one after it)
        if self.r.committed:
            return
        failed_in = self.state.state
        self.state.advance(KvPoll.FAILED)
        self.side.path_metrics.failed(self.path, failed_in)
        if isinstance(exc, asyncio.CancelledError):
            err = ServiceError(grpc.StatusCode.ABORTED, f"kv transfer for request_id={self.rid!r} was cancelled "
                                                        "by the prefill instance")
        elif isinstance(exc, ServiceError):
            err = exc
        else:
            err = ServiceError(grpc.StatusCode.ABORTED, f"kv transfer for request_id={self.rid!r} failed: {exc}")
        log.info("kv transfer for %s failed while %s: %s", self.rid, failed_in.name, err.message)
        self.reservations.failed(self.rid, err)
