"""The KV block layout both sides of a transfer agree on, and the bytes of block runs on the GRPC path.

gRPC Python spends most of a KV transfer on copies (measured: `bench/kv_transfer.py`, notes in bench/RESULTS.md), so
the payload of a KvBlocks message is copied as few times as the API allows:
- sender: `stage_blocks` starts the copy of a run of blocks to the host (a CUDA cache: one copy per run of
  consecutive ids into pinned memory, queued on the current stream, so after the step that wrote the blocks and
  before any later step that could reuse them; a CPU cache needs none: the staged rows are views of the cache, to be
  encoded before the engine steps again); `encode_blocks` then writes the KvTransferMessage{blocks} wire bytes with
  the payload's one copy (the bytes `SerializeToString` would give: a hand-written header, then the rows);
- receiver: `parse_transfer_message` reads such bytes without copying the payload (`ReceivedBlocks.data` is a view of
  the received message; any other message goes through protobuf); `write_blocks` copies it into the cache, one copy
  per run of consecutive block ids (CUDA: through pinned memory, the copy to the device queued on the current stream).
Both sides' processes call `retain_freed_memory` (malloc keeps the messages' freed buffers for the next ones).
"""
from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass

import torch

from protos.tandem.v1 import kv_transfer_pb2

LAYOUT_NAME = "block_layer_kv_token_head_dim"
# More runs of consecutive block ids than this in one message: one gather (or scatter) on the device instead of a
# copy per run.
MAX_DIRECT_RUNS = 4

# torch.frombuffer over the received (immutable) bytes: we only read from it, to copy into the cache.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


# glibc's malloc for the transfer path's large short-lived buffers (each message's bytes, several copies per side:
# Python bytes, gRPC slices): by default it serves large blocks with mmap and gives the freed top of the heap back to
# the OS, so the buffers of every message were fresh pages, faulted in and zeroed by the kernel on first touch: about
# 150 page faults per 896 KiB message, 40% of the receiving process's CPU (gRPC loopback, a server that only counts
# the bytes, 2-core dev machine: 0.84 -> 0.51 ms of CPU per message, 147 -> 8 faults). A process that had already
# freed large blocks (a CPU engine's decode service) had raised glibc's adaptive thresholds by itself and faulted
# about once per message; these limits make that so in any process. The price: a heap keeps up to
# _TRIM_THRESHOLD_BYTES of free memory.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_MMAP_THRESHOLD_BYTES = 32 << 20  # blocks below this come from the heap (glibc's largest allowed value)
_TRIM_THRESHOLD_BYTES = 256 << 20  # free memory at the top of a heap kept, up to this much
_malloc_tuned: bool | None = None


def retain_freed_memory() -> bool:
    """Tunes this process's malloc for KV transfers (see above), once; False where malloc is not glibc's."""
    global _malloc_tuned
    if _malloc_tuned is None:
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            _malloc_tuned = False
        else:
            _malloc_tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
                                 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))
    return _malloc_tuned


def layout_of(kv_cache: torch.Tensor) -> kv_transfer_pb2.KvLayout:
    """The layout of an engine's kv_cache [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]."""
    _, num_layers, two, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert two == 2, kv_cache.shape
    block_bytes = num_layers * 2 * block_size * num_kv_heads * head_dim * kv_cache.element_size()
    return kv_transfer_pb2.KvLayout(dtype=str(kv_cache.dtype).removeprefix("torch."), layout=LAYOUT_NAME,
                                    block_size=block_size, num_layers=num_layers, num_kv_heads=num_kv_heads,
                                    head_dim=head_dim, block_bytes=block_bytes)


def layout_mismatch(mine: kv_transfer_pb2.KvLayout, theirs: kv_transfer_pb2.KvLayout) -> str | None:
    """None when the layouts agree, else a message naming the first field that differs."""
    for f in ("layout", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "block_bytes"):
        a, b = getattr(theirs, f), getattr(mine, f)
        if a != b:
            return f"layout.{f}={a!r}: this decode instance's KV cache has {f}={b!r}"
    return None


def block_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """kv_cache [num_blocks, ...] as [num_blocks, block_bytes] uint8 (a view: the engine's cache is contiguous)."""
    assert kv_cache.is_contiguous(), "the engine's KV cache is one contiguous tensor"
    return kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)


def id_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in block_ids, first id, count) of each run of consecutive ids, in order."""
    runs = []
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            runs.append((start, block_ids[start], i - start))
            start = i
    return runs


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
