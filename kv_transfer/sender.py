"""The sending side of KV transfers: the path to each decode instance (`KvSender`), and one request's transfer
(`OutgoingTransfer`).

The life of a transfer on the sending side (its `TransferState` goes BOOTSTRAPPING -> WAITING -> TRANSFERRING ->
SUCCESS, or FAILED from any of them):
1. BOOTSTRAPPING, `OutgoingTransfer.negotiate` -> `KvSender.path_to(address)`: before the first transfer to a decode
   instance, a KvHandshake offers this cache's layout and its CUDA IPC export (when the cache is on a GPU and
   --kv-transfer is not grpc). The decode instance refuses a cache of another layout (FAILED_PRECONDITION naming
   the field: the request fails before its prefill is computed), checks the host identity, maps the cache, and
   answers CUDA_IPC, or GRPC with the reason. The answer is kept per address (and dropped when a CUDA IPC transfer fails, so the next request asks
   again). With --kv-transfer nixl (or auto, a CUDA cache and nixl installed) it also offers this process's NIXL
   agent and registered cache (kv_transfer/nixl.py); the decode instance answers NIXL once it added the agent (between
   hosts; on one host too with --kv-transfer nixl). --kv-transfer ipc or nixl turns another answer into an error.
2. WAITING, `OutgoingTransfer.run` opens the TransferKv stream with `open_message`: the KvTransferOpen; on CUDA_IPC
   it carries the export again (the per-request handle exchange: a few hundred bytes; the decode instance finds its
   mapping by the handle).
3. TRANSFERRING: `block_messages` (engine thread, after the step that filled the blocks) asks the path's transport
   (registry.TRANSPORTS) for the messages, which `run` streams as the engine hands them over:
   - GRPC (grpc_bytes.py): the blocks' bytes in messages of about MESSAGE_BYTES (at least one block), each a
     `KvBlocksOut`. A CUDA cache's blocks are copied into pinned memory by copies queued on the current stream (one
     per run of consecutive block ids; nothing waits for them here), and the message is serialized when gRPC sends
     it, after its copy completed: the payload is copied once more, into the message's wire bytes
     (`grpc_bytes.encode_blocks`). A CPU cache's blocks are encoded at once, straight from the cache (one copy; a
     preempted request's blocks may be reused by the next step). `transfer_kv(channel)` sends them: its serializer
     takes KvBlocksOut as well as protobuf messages; with `encoded=False` they come as KvTransferMessage protos
     instead, for the generated DecodeStub (two more copies of the payload, and protobuf's large allocations: much
     slower, measured: bench/RESULTS.md);
   - CUDA_IPC (cuda_ipc.py) and NIXL (nixl.py): only the block ids go, in one message (the engine reports a step once its device work,
     the KV writes included, is complete, so another process may read the blocks); the decode instance copies the
     blocks GPU to GPU (CUDA IPC) or READs them through NIXL, and must finish before its ack, after which the
     prefill frees them.
4. SUCCESS: `commit_message` (the first token; all blocks were sent) ends the stream, and decode's ack ends `run`.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch

from engine.sharded_kv import ShardedKvCache
from engine.utils import cdiv
from kv_transfer import nixl
from kv_transfer.base import AUTO, CUDA_IPC, GRPC, NIXL, KvPoll, TransferState
from kv_transfer.cuda_ipc import export_cache, host_identity
from kv_transfer.grpc_bytes import MESSAGE_BYTES, serialize
from kv_transfer.layout import layout_of, retain_freed_memory
from kv_transfer.metrics import KvPathMetrics
from kv_transfer.registry import CHOICES, PATH_LABELS, TRANSPORTS
from protos.tandem.v1 import decode_pb2, kv_transfer_pb2 as kv
from serving.config import KvTransferConfig
from serving import tracing
from serving.errors import ServiceError
from serving.hops import hop
from serving.tracing import SpanAttributes as A

log = logging.getLogger("tandem.prefill.kv")

HANDSHAKE_TIMEOUT_S = 10.0
# What gRPC's aio client reports when one of its writes on a client-streaming call races the server's end of the
# call: INTERNAL with these words, the server's own status lost (grpc/grpc#36066). The decode instance refused or
# ended the transfer; the prefill did nothing wrong.
CLIENT_WRITE_RACE = "Internal error from Core"
_TRANSFER_KV = "/{}/{}".format(*decode_pb2.DESCRIPTOR.services_by_name["Decode"].methods_by_name[
    "TransferKv"].full_name.rsplit(".", 1))
_IPC = PATH_LABELS[CUDA_IPC]
_NIXL = PATH_LABELS[NIXL]


def tensor_parallel_refusal(kv_transfer: str, tensor_parallel_size: int) -> str | None:
    """Why a prefill of tensor_parallel_size ranks cannot send by --kv-transfer kv_transfer, or None (the prefill's
    flags are checked with it at parse time, before any engine loads)."""
    if tensor_parallel_size > 1 and kv_transfer == _IPC:
        return (f"--kv-transfer {kv_transfer} with --tensor-parallel-size {tensor_parallel_size}: CUDA IPC maps one "
                f"process's cache; a tensor-parallel prefill sends through NIXL (each rank its KV heads) or gRPC "
                f"bytes; use {AUTO}, {_NIXL} or {PATH_LABELS[GRPC]}")
    return None


class KvSender:
    """The sending side of one prefill process: its cache's layout and CUDA IPC export, the path to each decode
    instance, and the messages of a transfer."""

    def __init__(self, kv_cache: torch.Tensor, kv_transfer: str = KvTransferConfig.transport):
        if kv_transfer not in CHOICES:
            raise ValueError(f"kv_transfer={kv_transfer!r}: must be one of {', '.join(CHOICES)}")
        sharded = isinstance(kv_cache, ShardedKvCache)
        if sharded and (reason := tensor_parallel_refusal(kv_transfer, kv_cache.tensor_parallel_size)):
            raise ValueError(reason)
        if kv_transfer == _IPC and kv_cache.device.type != "cuda":
            raise ValueError(f"kv_transfer={_IPC!r}: CUDA IPC needs the KV cache on a CUDA device, this one is on "
                             f"{kv_cache.device.type}; use {AUTO} or {PATH_LABELS[GRPC]}")
        if kv_transfer == _NIXL and (reason := nixl.import_error()) is not None:
            raise ValueError(f"--kv-transfer {_NIXL}: {reason}; install it (pip install --no-deps {nixl.PACKAGE}) "
                             f"or use {AUTO} or {PATH_LABELS[GRPC]}")
        self.kv_transfer = kv_transfer
        retain_freed_memory()  # (this process sends the messages)
        self.device = kv_cache.device
        self.layout = layout_of(kv_cache)
        self.host = host_identity()
        # Exported once per process (each export takes a slot of torch's cross-process reference counter).
        self.cache = (export_cache(kv_cache, self.host) if kv_transfer != PATH_LABELS[GRPC]
                      and self.device.type == "cuda" and not sharded else None)
        # NIXL: --kv-transfer nixl, or auto with a CUDA cache and nixl installed (a CPU deployment is a test or a
        # toy: it keeps gRPC bytes unless asked). One agent per process, the whole cache registered once.
        offer_nixl = kv_transfer == _NIXL or (kv_transfer == AUTO and self.device.type == "cuda"
                                              and nixl.import_error() is None)
        self.nixl = None
        if offer_nixl:
            try:
                name = f"tandem-prefill-{self.host.process_id}"
                # (tensor-parallel: every rank registers its own cache with an agent of its own)
                self.nixl = nixl.RankCaches(kv_cache, name) if sharded else nixl.NixlCache(kv_cache, name)
            except Exception as exc:  # noqa: BLE001 - e.g. UCX without CUDA support for a GPU cache
                if kv_transfer == _NIXL:
                    raise ValueError(f"--kv-transfer {_NIXL}: registering the KV cache with NIXL failed: "
                                     f"{type(exc).__name__}: {exc}") from None
                log.warning("kv transfers will not offer NIXL: registering the KV cache failed: %s", exc)
        self.blocks_per_message = max(1, MESSAGE_BYTES // self.layout.block_bytes)
        self._senders = {path: t.sender(self.layout) for path, t in TRANSPORTS.items()}
        self._answers: dict[str, kv.KvHandshakeResponse] = {}  # decode address -> its handshake answer

    # ---- event loop -------------------------------------------------------------------------------------------
    async def path_to(self, address: str, stub) -> int:
        """The path of transfers to the decode instance at `address` (stub: its DecodeStub)."""
        answer = self._answers.get(address)
        if answer is None:
            req = kv.KvHandshakeRequest(host=self.host, layout=self.layout, cache=self.cache,
                                        nixl=self.nixl.offer() if self.nixl else None,
                                        nixl_ranks=getattr(self.nixl, "offers", ()),
                                        nixl_on_one_host=self.kv_transfer == _NIXL)
            try:
                answer = await stub.KvHandshake(req, timeout=HANDSHAKE_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                # A refusal (FAILED_PRECONDITION: the caches' layouts differ) is not kept: the next request asks
                # again, and finds a decode instance restarted with the right flags.
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise ServiceError(e.code(), f"kv transfer handshake with decode {address} failed: "
                                                 f"{e.details()}") from None
                answer = kv.KvHandshakeResponse(path=GRPC, reason="the decode instance has no KvHandshake")
            self._answers[address] = answer
            log.info("kv transfers to decode %s take the %s path%s", address,
                     PATH_LABELS.get(answer.path, PATH_LABELS[GRPC]), f" ({answer.reason})" if answer.reason else "")
        if answer.path == CUDA_IPC and self.cache is not None:
            return CUDA_IPC
        if answer.path == NIXL and self.nixl is not None:
            return NIXL
        if self.kv_transfer in (_IPC, _NIXL):
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"--kv-transfer {self.kv_transfer}: decode {address} cannot take "
                               f"{'CUDA IPC' if self.kv_transfer == _IPC else 'NIXL'} transfers from this instance: "
                               f"{answer.reason}")
        return GRPC

    @staticmethod
    def transfer_kv(channel: grpc.aio.Channel, serializer=serialize) -> grpc.aio.StreamUnaryMultiCallable:
        """Decode.TransferKv on `channel`, sending KvBlocksOut messages as their own bytes (`serializer`: `serialize`
        or a wrapper of it, e.g. bench/kv_profile.py's, which times it)."""
        return channel.stream_unary(_TRANSFER_KV, request_serializer=serializer,
                                    response_deserializer=kv.KvTransferAck.FromString)

    @staticmethod
    def is_commit(msg) -> bool:
        return isinstance(msg, kv.KvTransferMessage) and msg.HasField("commit")

    def forget(self, address: str) -> None:
        """Ask again before the next transfer to `address` (a CUDA IPC or NIXL transfer to it failed)."""
        self._answers.pop(address, None)

    def open_message(self, request_id: str, num_prompt_tokens: int, num_blocks: int, deadline_ms: int,
                     path: int) -> kv.KvTransferMessage:
        op = kv.KvTransferOpen(request_id=request_id, layout=self.layout, num_prompt_tokens=num_prompt_tokens,
                               num_blocks=num_blocks, deadline_ms=deadline_ms, path=path)
        if path == CUDA_IPC:
            op.cache.CopyFrom(self.cache)
        elif path == NIXL:
            op.nixl.CopyFrom(self.nixl.offer(with_metadata=False))
        return kv.KvTransferMessage(open=op)

    @staticmethod
    def commit_message(first_token_id: int, num_cached_tokens: int) -> kv.KvTransferMessage:
        return kv.KvTransferMessage(commit=kv.KvTransferCommit(first_token_id=first_token_id,
                                                               num_cached_tokens=num_cached_tokens))

    def payload_bytes(self, msg) -> tuple[int, int]:
        """(KV bytes, blocks) a message moves: the payload on GRPC, the blocks' size on CUDA_IPC; (0, 0) for the
        open and the commit."""
        for half in self._senders.values():
            moved = half.payload(msg)
            if moved is not None:
                return moved
        return 0, 0

    # ---- engine thread ----------------------------------------------------------------------------------------
    def block_messages(self, kv_cache: torch.Tensor, path: int, first_block_index: int, block_ids: list[int],
                       encoded: bool = False) -> list:
        """The messages that ship blocks `block_ids` (positions first_block_index.. of the request's block table),
        complete in `kv_cache` once the current stream's work is done. GRPC: KvBlocksOut when `encoded` (send them
        with transfer_kv), else KvTransferMessage protos."""
        return self._senders[path].block_messages(kv_cache, first_block_index, block_ids, self.blocks_per_message,
                                                  encoded)


def transfer_failure(e: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    """The status a failed TransferKv call passes on: its own, except gRPC's client-side INTERNAL for a write that
    raced the decode instance's end of the stream (CLIENT_WRITE_RACE), which is ABORTED."""
    if e.code() == grpc.StatusCode.INTERNAL and e.details() == CLIENT_WRITE_RACE:
        return grpc.StatusCode.ABORTED, ("the decode instance ended the stream while blocks were still being sent "
                                         "(gRPC's client lost its status: see its log)")
    return e.code(), e.details()


class OutgoingTransfer:
    """One request's transfer to its decode target, from the path negotiation to the ack (event loop)."""

    def __init__(self, sender: KvSender, request_id: str, num_prompt_tokens: int, address: str, timeout_s: float,
                 path_metrics: KvPathMetrics, trace_context=None):
        self.sender = sender
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.address = address
        self.timeout_s = timeout_s
        self.path_metrics = path_metrics
        self.path = GRPC
        self.state = TransferState(request_id, "send")
        self.sent_bytes = 0
        self.sent_blocks = 0
        self.trace_context = trace_context  # the parent of its kv_transfer.send span (the request's prefill span)

    async def negotiate(self, stub) -> int:
        """The path to the decode target (stub: its DecodeStub); the first request to an address asks it."""
        try:
            self.path = await self.sender.path_to(self.address, stub)
        except BaseException:
            self.state.advance(KvPoll.FAILED)
            raise
        return self.path

    async def run(self, channel: grpc.aio.Channel, queue: asyncio.Queue) -> float:
        """Streams the open, then the messages put in `queue` (block messages, then the commit) to the decode target;
        returns the transfer's duration in seconds once decode acknowledged."""
        transfer_kv = self.sender.transfer_kv(channel)
        t0 = time.monotonic()
        num_blocks = cdiv(self.num_prompt_tokens, self.sender.layout.block_size)

        async def messages():
            hop(self.request_id, "prefill.tx_open")
            self.state.advance(KvPoll.WAITING)
            yield self.sender.open_message(self.request_id, self.num_prompt_tokens, num_blocks,
                                           int(self.timeout_s * 1000), self.path)
            while True:
                msg = await queue.get()
                nbytes, nblocks = self.sender.payload_bytes(msg)
                if nblocks:
                    self.state.advance(KvPoll.TRANSFERRING)
                    self.sent_bytes += nbytes
                    self.sent_blocks += nblocks
                    self.path_metrics.add_bytes(self.path, nbytes)
                yield msg
                if self.sender.is_commit(msg):
                    return

        span = tracing.start_span("kv_transfer.send", self.trace_context, tracing.SpanKind.CLIENT, {
            A.ATTEMPT_ID: self.request_id, A.KV_PEER: self.address, A.KV_PATH: PATH_LABELS[self.path]})
        failure = None
        try:
            await transfer_kv(messages(), timeout=self.timeout_s, metadata=tracing.span_metadata(span))
        except grpc.aio.AioRpcError as e:
            failure = e
            failed_in = self.state.state
            self.state.advance(KvPoll.FAILED)
            self.path_metrics.failed(self.path, failed_in)
            if self.path in (CUDA_IPC, NIXL):
                self.sender.forget(self.address)  # the next request asks again (the decode instance may have restarted)
            code, details = transfer_failure(e)
            log.warning("kv transfer of %s to %s failed while %s: %s %s", self.request_id, self.address,
                        failed_in.name, code.name, details)
            raise ServiceError(code, f"kv transfer to decode {self.address} failed: {details}") from None
        except BaseException as e:  # cancelled (the request ended at its first token, or its caller went)
            failure = e
            self.state.advance(KvPoll.FAILED)
            raise
        finally:
            span.set_attributes({A.KV_BYTES: self.sent_bytes, A.KV_BLOCKS: self.sent_blocks})
            tracing.end_span(span, failure)
        self.state.advance(KvPoll.SUCCESS)
        seconds = time.monotonic() - t0
        self.path_metrics.observe_seconds(self.path, seconds)
        return seconds
