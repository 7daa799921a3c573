"""The GRPC transport: block runs as bytes in KvBlocks messages on the TransferKv stream (any two hosts).

gRPC Python spends most of a KV transfer on copies (measured: `bench/kv_transfer.py`, notes in bench/RESULTS.md), so
the payload of a KvBlocks message is copied as few times as the API allows:
- sender: `stage_blocks` starts the copy of a run of blocks to the host (a CUDA cache: one copy per run of
  consecutive ids into pinned memory, queued on the current stream, so after the step that wrote the blocks and
  before any later step that could reuse them; a CPU cache needs none: the staged rows are views of the cache, to be
  encoded before the engine steps again); `encode_blocks` then writes the KvTransferMessage{blocks} wire bytes with
  the payload's one copy (the bytes `SerializeToString` would give: a hand-written header, then the rows), when gRPC
  sends the message (`KvBlocksOut`, `serialize`);
- receiver: `parse_transfer_message` reads such bytes without copying the payload (`ReceivedBlocks.data` is a view of
  the received message; any other message goes through protobuf); `write_blocks` copies it into the cache, one copy
  per run of consecutive block ids (CUDA: through pinned memory, the copy to the device queued on the current stream).
  Writes are queued on the engine thread without waiting for each, up to WRITE_WINDOW_BYTES.
Both sides' processes call `layout.retain_freed_memory` (malloc keeps the messages' freed buffers for the next ones).
"""
from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass

import grpc
import torch

from engine.sharded_kv import ShardedKvCache
from kv_transfer.base import GRPC, BlockReceiver, BlockRun, BlockSender, Transport
from kv_transfer.layout import block_rows, id_runs
from protos.tandem.v1 import kv_transfer_pb2
from serving.errors import ServiceError

# More runs of consecutive block ids than this in one message: one gather (or scatter) on the device instead of a
# copy per run.
MAX_DIRECT_RUNS = 4
# Payload per KvBlocks message. gRPC Python pays a cost per message (small messages are slow) and, for protobuf
# messages, copies that grow with the size (large ones are slow too); pre-serialized bytes keep their speed over a
# wide range of sizes, and this one was the fastest on the service's path (measured: bench/RESULTS.md).
MESSAGE_BYTES = 4 << 20
# Payload of a transfer's KvBlocks queued on the engine thread and not yet written, at most (received messages past
# it wait). Writes queue behind engine steps, so the window lets the transfer go on during a step.
WRITE_WINDOW_BYTES = 64 << 20

# torch.frombuffer over the received (immutable) bytes: we only read from it, to copy into the cache.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


# ---- sender -------------------------------------------------------------------------------------------------------
@dataclass
class StagedBlocks:
    """A run of blocks on its way to the host: `parts` are [n, block_bytes] uint8 host tensors that hold the blocks
    in order, complete once `copied` has completed (CUDA cache: one pinned tensor) or views of the cache's rows
    (CPU cache: valid while the blocks are, i.e. until the engine's next step could free and reuse them)."""
    parts: list[torch.Tensor]
    copied: torch.cuda.Event | None = None

    def buffers(self) -> list[memoryview]:
        """The blocks' bytes, in order (waits for the copy to the host)."""
        if self.copied is not None:
            self.copied.synchronize()
        return [memoryview(p.reshape(-1).numpy()) for p in self.parts]


def stage_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> StagedBlocks:
    """kv_cache[block_ids] on its way to the host. CUDA: the copy is queued on the current stream (after the step
    that wrote the blocks, before whatever is queued next: a later step may reuse a block once its request was
    preempted), not waited for. CPU: views of the rows, no copy."""
    rows = block_rows(kv_cache)
    runs = id_runs(block_ids)
    if kv_cache.device.type != "cuda":
        return StagedBlocks([rows[first:first + n] for _, first, n in runs])
    host = torch.empty((len(block_ids), rows.shape[1]), dtype=torch.uint8, pin_memory=True)
    if len(runs) <= MAX_DIRECT_RUNS:
        for pos, first, n in runs:
            host[pos:pos + n].copy_(rows[first:first + n], non_blocking=True)
    else:  # a gather of this message's blocks (about 1 MiB), then one copy
        index = torch.tensor(block_ids, dtype=torch.long).to(kv_cache.device, non_blocking=True)
        host.copy_(rows.index_select(0, index), non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(kv_cache.device))
    return StagedBlocks([host], copied)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(message, field: str, wire_type: int) -> int:
    return message.DESCRIPTOR.fields_by_name[field].number << 3 | wire_type


_VARINT, _LEN = 0, 2  # protobuf wire types
_MESSAGE_BLOCKS = _key(kv_transfer_pb2.KvTransferMessage, "blocks", _LEN)
_BLOCKS_FIRST = _key(kv_transfer_pb2.KvBlocks, "first_block_index", _VARINT)
_BLOCKS_NUM = _key(kv_transfer_pb2.KvBlocks, "num_blocks", _VARINT)
_BLOCKS_DATA = _key(kv_transfer_pb2.KvBlocks, "data", _LEN)


def encode_blocks(first_block_index: int, num_blocks: int, staged: StagedBlocks) -> bytes:
    """The wire bytes of KvTransferMessage(blocks=KvBlocks(first_block_index, num_blocks, data=<the staged blocks>)),
    equal to protobuf's serialization (zero scalars left out, fields in number order); the payload is copied once."""
    buffers = staged.buffers()
    nbytes = sum(b.nbytes for b in buffers)
    inner = bytearray()
    if first_block_index:
        inner += bytes([_BLOCKS_FIRST]) + _varint(first_block_index)
    if num_blocks:
        inner += bytes([_BLOCKS_NUM]) + _varint(num_blocks)
    inner += bytes([_BLOCKS_DATA]) + _varint(nbytes)
    return b"".join([bytes([_MESSAGE_BLOCKS]), _varint(len(inner) + nbytes), inner, *buffers])


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


def serialize(msg: kv_transfer_pb2.KvTransferMessage | KvBlocksOut) -> bytes:
    """TransferKv's request serializer: KvBlocksOut encodes itself, anything else is a protobuf message."""
    return msg.encode() if isinstance(msg, KvBlocksOut) else msg.SerializeToString()


class GrpcBytesSender(BlockSender):
    def __init__(self, layout: kv_transfer_pb2.KvLayout):
        self.block_bytes = layout.block_bytes

    def block_messages(self, kv_cache: torch.Tensor, first_block_index: int, block_ids: list[int],
                       blocks_per_message: int, encoded: bool) -> list[kv_transfer_pb2.KvTransferMessage | KvBlocksOut]:
        """The blocks' bytes in messages of blocks_per_message blocks: KvBlocksOut when `encoded` (sent by a
        TransferKv whose serializer is `serialize`), else KvTransferMessage protos (for the generated stub)."""
        if isinstance(kv_cache, ShardedKvCache):  # a tensor-parallel prefill: rank 0 gathers every head first
            kv_cache, block_ids = kv_cache.read(block_ids), list(range(len(block_ids)))
        out = []
        for i in range(0, len(block_ids), blocks_per_message):
            run = block_ids[i:i + blocks_per_message]
            msg = KvBlocksOut(first_block_index + i, len(run), len(run) * self.block_bytes,
                              stage_blocks(kv_cache, run))
            if not encoded:
                msg = kv_transfer_pb2.KvTransferMessage.FromString(msg.encode())
            elif kv_cache.device.type != "cuda":
                msg.encode()  # now: the views are of blocks that the next step may reuse
            out.append(msg)
        return out

    def payload(self, msg) -> tuple[int, int] | None:
        if isinstance(msg, KvBlocksOut):
            return msg.nbytes, msg.num_blocks
        if msg.WhichOneof("kind") == "blocks":
            return len(msg.blocks.data), msg.blocks.num_blocks
        return None


# ---- receiver -----------------------------------------------------------------------------------------------------
@dataclass
class ReceivedBlocks:
    """A KvBlocks message as the receiver uses it; `data` may be a view of the received message's bytes."""
    first_block_index: int
    num_blocks: int
    data: bytes | memoryview

    @classmethod
    def of(cls, blocks: kv_transfer_pb2.KvBlocks) -> ReceivedBlocks:
        return cls(blocks.first_block_index, blocks.num_blocks, blocks.data)


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it); (-1, pos) when raw holds no varint of at most 32 bits at pos."""
    value = shift = 0
    for i in range(pos, min(pos + 5, len(raw))):
        value |= (raw[i] & 0x7F) << shift
        if raw[i] < 0x80:
            return (value, i + 1) if value < 1 << 32 else (-1, pos)
        shift += 7
    return -1, pos


def _parse_blocks(raw: bytes) -> ReceivedBlocks | None:
    """raw as a KvTransferMessage that holds exactly one KvBlocks with the known fields, each at most once; None for
    anything else (protobuf's parser then decides)."""
    if not raw or raw[0] != _MESSAGE_BLOCKS:
        return None
    size, pos = _read_varint(raw, 1)
    if size < 0 or pos + size != len(raw):
        return None
    fields: dict[int, int | memoryview] = {}
    while pos < len(raw):
        key = raw[pos]
        if key in fields or key not in (_BLOCKS_FIRST, _BLOCKS_NUM, _BLOCKS_DATA):
            return None
        value, pos = _read_varint(raw, pos + 1)
        if value < 0:
            return None
        if key == _BLOCKS_DATA:
            if pos + value > len(raw):
                return None
            fields[key] = memoryview(raw)[pos:pos + value]
            pos += value
        else:
            fields[key] = value
    return ReceivedBlocks(fields.get(_BLOCKS_FIRST, 0), fields.get(_BLOCKS_NUM, 0), fields.get(_BLOCKS_DATA, b""))


def parse_transfer_message(raw: bytes) -> kv_transfer_pb2.KvTransferMessage | ReceivedBlocks:
    """A TransferKv request message from its wire bytes: KvBlocks as ReceivedBlocks (payload not copied), any other
    message as a KvTransferMessage."""
    blocks = _parse_blocks(raw)
    return blocks if blocks is not None else kv_transfer_pb2.KvTransferMessage.FromString(raw)


def message_kind(msg: kv_transfer_pb2.KvTransferMessage | ReceivedBlocks) -> str | None:
    """The KvTransferMessage field a received message holds (ReceivedBlocks: "blocks")."""
    return "blocks" if isinstance(msg, ReceivedBlocks) else msg.WhichOneof("kind")


def _host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for contiguous uint8 host tensors of one size: one memcpy on this thread, without the GIL. (torch's
    copy_ splits a copy this size over its intra-op threads, which then spin between messages, on a GPU host one per
    core, beside the gRPC threads that move the bytes.)"""
    assert dst.dtype == src.dtype == torch.uint8 and dst.device.type == src.device.type == "cpu", (dst, src)
    assert dst.is_contiguous() and src.is_contiguous() and dst.numel() == src.numel(), (dst.shape, src.shape)
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())


def write_blocks(kv_cache: torch.Tensor, block_ids: list[int], data: bytes | memoryview) -> None:
    """kv_cache[block_ids] = data, block after block (the inverse of stage_blocks + encode_blocks). On CUDA the copy
    to the device is queued on the current stream (from pinned memory, which stays reserved until it completes)."""
    rows = block_rows(kv_cache)
    src = torch.frombuffer(data, dtype=torch.uint8).view(len(block_ids), rows.shape[1])
    runs = id_runs(block_ids)
    if kv_cache.device.type != "cuda":
        for pos, first, n in runs:
            _host_copy(rows[first:first + n], src[pos:pos + n])
        return
    pinned = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
    _host_copy(pinned, src)
    if len(runs) > MAX_DIRECT_RUNS:
        index = torch.tensor(block_ids, dtype=torch.long).to(kv_cache.device, non_blocking=True)
        rows.index_copy_(0, index, pinned.to(kv_cache.device, non_blocking=True))
        return
    for pos, first, n in runs:
        rows[first:first + n].copy_(pinned[pos:pos + n], non_blocking=True)


class GrpcBytesReceiver(BlockReceiver):
    """One transfer's KvBlocks: each run's bytes written into its reserved blocks (`write_blocks`), the writes queued
    on the engine thread up to WRITE_WINDOW_BYTES; the commit, queued after them, needs nothing more."""

    def __init__(self, side):
        self.block_bytes = side.layout.block_bytes
        self.window_bytes = WRITE_WINDOW_BYTES  # (read at each transfer: tests narrow it)

    def run(self, msg: kv_transfer_pb2.KvTransferMessage | ReceivedBlocks) -> BlockRun:
        b = msg if isinstance(msg, ReceivedBlocks) else ReceivedBlocks.of(msg.blocks)
        size = len(b.data)
        if size != b.num_blocks * self.block_bytes:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"blocks.data: {size} bytes, must be num_blocks * block_bytes = "
                               f"{b.num_blocks * self.block_bytes}")
        return BlockRun(b.first_block_index, b.num_blocks, size, b.data)

    def write(self, kv_cache: torch.Tensor, block_ids: list[int], run: BlockRun, skip: int) -> None:
        data = memoryview(run.payload)[skip * self.block_bytes:] if skip else run.payload
        if isinstance(kv_cache, ShardedKvCache):  # a tensor-parallel decode: rank 0 scatters each rank its heads
            staged = torch.empty((len(block_ids), *kv_cache.shape[1:]), dtype=kv_cache.dtype)
            write_blocks(staged, list(range(len(block_ids))), data)
            kv_cache.write(block_ids, staged)
            return
        write_blocks(kv_cache, block_ids, data)


TRANSPORT = Transport(path=GRPC, label="grpc", kind="blocks", sender=GrpcBytesSender, receiver=GrpcBytesReceiver)
