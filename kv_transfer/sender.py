"""The sending side of KV transfers: the path to each decode instance, and the messages of one transfer.

1. `path_to(address)`: before the first transfer to a decode instance, a KvHandshake offers this cache's CUDA IPC
   export (when the cache is on a GPU and --kv-transfer is not grpc). The decode instance checks the host identity,
   maps the cache, and answers CUDA_IPC, or GRPC with the reason. The answer is kept per address (and dropped when a
   CUDA IPC transfer fails, so the next request asks again). --kv-transfer ipc turns a GRPC answer into an error.
2. `open_message`: the KvTransferOpen; on CUDA_IPC it carries the export again (the per-request handle exchange:
   a few hundred bytes; the decode instance finds its mapping by the handle).
3. `block_messages` (engine thread, after the step that filled the blocks):
   - GRPC: the blocks' bytes in messages of about MESSAGE_BYTES (at least one block), each a `KvBlocksOut`. A
     CUDA cache's blocks are copied into pinned memory by copies queued on the current stream (one per run of
     consecutive block ids; nothing waits for them here), and the message is serialized when gRPC sends it, after
     its copy completed: the payload is copied once more, into the message's wire bytes (`kv_layout.encode_blocks`).
     A CPU cache's blocks are encoded at once, straight from the cache (one copy; a preempted request's blocks may
     be reused by the next step). Send them with `transfer_kv(channel)`, whose serializer takes KvBlocksOut as well
     as protobuf messages; with `encoded=False` they come as KvTransferMessage protos instead, for the generated
     DecodeStub (two more copies of the payload, and protobuf's large allocations: the bytes path then runs at about
     a third of the speed);
   - CUDA_IPC: only the block ids go, in one message (the engine reports a step once its device work, the KV writes
     included, is complete, so another process may read the blocks); the decode instance copies the blocks GPU to GPU and
     must finish before its ack, after which the prefill frees them.
4. `commit_message`: the first token; all blocks were sent.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
import torch

from kv_transfer.cuda_ipc import CUDA_IPC, GRPC, PATH_LABELS, PATHS, export_cache, host_identity
from kv_transfer.layout import StagedBlocks, encode_blocks, layout_of, retain_freed_memory, stage_blocks
from protos.tandem.v1 import decode_pb2, kv_transfer_pb2 as kv
from serving.errors import ServiceError

log = logging.getLogger("tandem.prefill.kv")

HANDSHAKE_TIMEOUT_S = 10.0
# Payload per KvBlocks message. gRPC Python, loopback, 2-core dev machine, a server that only counts bytes: protobuf
# messages 0.3 GB/s in 16 MiB, 0.93 in 1 MiB, 0.6 in 256 KiB; pre-serialized bytes 1.2-1.4 GB/s from 512 KiB to
# 8 MiB, 0.85 in 256 KiB. The H200 host, the service's path (`bench/kv_transfer.py --narrow --random-kv --device
# cuda --paths grpc --message-bytes N`, 0224342): 512 / 8192-token prompts at 1.03 / 0.95 GB/s in 256 KiB, 1.26 /
# 0.85 in 1 MiB, 1.34 / 1.03 in 4 MiB (four 7B blocks of 896 KiB per message).
MESSAGE_BYTES = 4 << 20
_TRANSFER_KV = "/{}/{}".format(*decode_pb2.DESCRIPTOR.services_by_name["Decode"].methods_by_name[
    "TransferKv"].full_name.rsplit(".", 1))


@dataclass
class KvBlocksOut:
    """A KvTransferMessage{blocks} of the GRPC path: its wire bytes, or the staged blocks they are made of when gRPC
    sends it (`serialize`)."""
    first_block_index: int
    num_blocks: int
    nbytes: int
    staged: StagedBlocks | None
    wire: bytes | None = None

    def encode(self) -> bytes:
        if self.wire is None:
            self.wire = encode_blocks(self.first_block_index, self.num_blocks, self.staged)
            self.staged = None  # (pinned memory back to torch's pool)
        return self.wire


def serialize(msg: kv.KvTransferMessage | KvBlocksOut) -> bytes:
    """TransferKv's request serializer: KvBlocksOut encodes itself, anything else is a protobuf message."""
    return msg.encode() if isinstance(msg, KvBlocksOut) else msg.SerializeToString()


class KvSender:
    def __init__(self, kv_cache: torch.Tensor, kv_transfer: str = "auto"):
        if kv_transfer not in PATHS:
            raise ValueError(f"kv_transfer={kv_transfer!r}: must be one of {', '.join(PATHS)}")
        if kv_transfer == "ipc" and kv_cache.device.type != "cuda":
            raise ValueError(f"kv_transfer='ipc': CUDA IPC needs the KV cache on a CUDA device, this one is on "
                             f"{kv_cache.device.type}; use auto or grpc")
        self.kv_transfer = kv_transfer
        retain_freed_memory()  # (this process sends the messages)
        self.device = kv_cache.device
        self.layout = layout_of(kv_cache)
        self.host = host_identity()
        # Exported once per process (each export takes a slot of torch's cross-process reference counter).
        self.cache = export_cache(kv_cache, self.host) if kv_transfer != "grpc" and self.device.type == "cuda" else None
        self.blocks_per_message = max(1, MESSAGE_BYTES // self.layout.block_bytes)
        self._answers: dict[str, kv.KvHandshakeResponse] = {}  # decode address -> its handshake answer

    # ---- event loop -------------------------------------------------------------------------------------------
    async def path_to(self, address: str, stub) -> int:
        """The path of transfers to the decode instance at `address` (stub: its DecodeStub)."""
        if self.cache is None:
            return GRPC
        answer = self._answers.get(address)
        if answer is None:
            req = kv.KvHandshakeRequest(host=self.host, layout=self.layout, cache=self.cache)
            try:
                answer = await stub.KvHandshake(req, timeout=HANDSHAKE_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise ServiceError(e.code(), f"kv transfer handshake with decode {address} failed: "
                                                 f"{e.details()}") from None
                answer = kv.KvHandshakeResponse(path=GRPC, reason="the decode instance has no KvHandshake")
            self._answers[address] = answer
            log.info("kv transfers to decode %s take the %s path%s", address, PATH_LABELS.get(answer.path, "grpc"),
                     f" ({answer.reason})" if answer.reason else "")
        if answer.path == CUDA_IPC:
            return CUDA_IPC
        if self.kv_transfer == "ipc":
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"--kv-transfer ipc: decode {address} cannot take CUDA IPC transfers from this "
                               f"instance: {answer.reason}")
        return GRPC

    @staticmethod
    def transfer_kv(channel: grpc.aio.Channel, serializer=serialize) -> grpc.aio.StreamUnaryMultiCallable:
        """Decode.TransferKv on `channel`, sending KvBlocksOut messages as their own bytes (`serializer`: `serialize`
        or a wrapper of it, e.g. bench/kv_profile.py's, which times it)."""
        return channel.stream_unary(_TRANSFER_KV, request_serializer=serializer,
                                    response_deserializer=kv.KvTransferAck.FromString)

    @staticmethod
    def is_commit(msg: kv.KvTransferMessage | KvBlocksOut) -> bool:
        return isinstance(msg, kv.KvTransferMessage) and msg.HasField("commit")

    def forget(self, address: str) -> None:
        """Ask again before the next transfer to `address` (a CUDA IPC transfer to it failed)."""
        self._answers.pop(address, None)

    def open_message(self, request_id: str, num_prompt_tokens: int, num_blocks: int, deadline_ms: int,
                     path: int) -> kv.KvTransferMessage:
        op = kv.KvTransferOpen(request_id=request_id, layout=self.layout, num_prompt_tokens=num_prompt_tokens,
                               num_blocks=num_blocks, deadline_ms=deadline_ms, path=path)
        if path == CUDA_IPC:
            op.cache.CopyFrom(self.cache)
        return kv.KvTransferMessage(open=op)

    @staticmethod
    def commit_message(first_token_id: int, num_cached_tokens: int) -> kv.KvTransferMessage:
        return kv.KvTransferMessage(commit=kv.KvTransferCommit(first_token_id=first_token_id,
                                                               num_cached_tokens=num_cached_tokens))

    def payload_bytes(self, msg: kv.KvTransferMessage | KvBlocksOut) -> tuple[int, int]:
        """(KV bytes, blocks) a message moves: the payload on GRPC, the blocks' size on CUDA_IPC."""
        if isinstance(msg, KvBlocksOut):
            return msg.nbytes, msg.num_blocks
        kind = msg.WhichOneof("kind")
        if kind == "blocks":
            return len(msg.blocks.data), msg.blocks.num_blocks
        if kind == "ready":
            return len(msg.ready.block_ids) * self.layout.block_bytes, len(msg.ready.block_ids)
        return 0, 0

    # ---- engine thread ----------------------------------------------------------------------------------------
    def block_messages(self, kv_cache: torch.Tensor, path: int, first_block_index: int, block_ids: list[int],
                       encoded: bool = False) -> list[kv.KvTransferMessage | KvBlocksOut]:
        """The messages that ship blocks `block_ids` (positions first_block_index.. of the request's block table),
        complete in `kv_cache` once the current stream's work is done. GRPC: KvBlocksOut when `encoded` (send them
        with transfer_kv), else KvTransferMessage protos."""
        if path == CUDA_IPC:
            # No wait: LLMEngine.step() reports only steps whose device work is complete (their KV writes
            # included); synchronizing here would also wait for the step async scheduling launched after it.
            return [kv.KvTransferMessage(ready=kv.KvBlocksReady(first_block_index=first_block_index,
                                                                block_ids=block_ids))]
        out = []
        for i in range(0, len(block_ids), self.blocks_per_message):
            run = block_ids[i:i + self.blocks_per_message]
            msg = KvBlocksOut(first_block_index + i, len(run), len(run) * self.layout.block_bytes,
                              stage_blocks(kv_cache, run))
            if not encoded:
                msg = kv.KvTransferMessage.FromString(msg.encode())
            elif kv_cache.device.type != "cuda":
                msg.encode()  # now: the views are of blocks that the next step may reuse
            out.append(msg)
        return out
