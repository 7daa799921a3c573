"""The CUDA_IPC transport, for same-host KV transfers: who we are, exporting a KV cache, mapping a peer's, copying
blocks.

The prefill instance exports its cache once (`export_cache`, torch's `UntypedStorage._share_cuda_`); every transfer's
open carries that export, and the decode instance maps it once per prefill process (`import_cache`, torch's
`UntypedStorage._new_shared_cuda`, i.e. cudaIpcOpenMemHandle) and copies blocks out of it into its own cache
(`copy_blocks`: one gather and one scatter on the GPU). Bytes never pass through host memory. `ipc_refusal` says, from
the identities alone, why two processes cannot use this path (different hosts, the same process, a GPU the importer
cannot see); mapping can still fail (separate IPC namespaces), which the handshake catches by trying.

The sending half (`CudaIpcSender`) ships a run of blocks as its ids (`KvBlocksReady`); the receiving half of a
transfer (`CudaIpcReceiver`) copies them into the reserved blocks and, before the commit, waits for the copies to
complete: the prefill instance frees its blocks on the ack. `MappedCaches` keeps the mapped caches of a decode
process, one per prefill process.

A cache is handled as a byte matrix [num_blocks, block_bytes] (viewed as int64 when the size allows): the copy is
the same for every dtype, fp8 included.
"""
from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import torch

from kv_transfer.base import CUDA_IPC, BlockReceiver, BlockRun, BlockSender, Transport
from protos.tandem.v1 import kv_transfer_pb2
from serving.errors import ServiceError, shown

log = logging.getLogger("tandem.decode.kv")

_PROCESS_ID = uuid.uuid4().hex  # one per process: pids repeat across containers of one host


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def gpu_uuids() -> list[str]:
    """UUIDs of the GPUs this process sees, in device order (CUDA_VISIBLE_DEVICES applied)."""
    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def host_identity() -> kv_transfer_pb2.HostIdentity:
    return kv_transfer_pb2.HostIdentity(boot_id=_boot_id(), hostname=socket.gethostname(), process_id=_PROCESS_ID,
                                        pid=os.getpid(), gpu_uuids=gpu_uuids())


def _rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """kv_cache [num_blocks, ...] as [num_blocks, words] of int64 (uint8 when block_bytes is not a multiple of 8)."""
    flat = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)
    return flat.view(torch.int64) if flat.shape[1] % 8 == 0 else flat


def export_cache(kv_cache: torch.Tensor, host: kv_transfer_pb2.HostIdentity) -> kv_transfer_pb2.CudaIpcCache:
    """The CUDA IPC export of an engine's KV cache (call once per process: each export takes a reference slot)."""
    if kv_cache.device.type != "cuda":
        raise ValueError(f"kv_cache.device={kv_cache.device}: CUDA IPC needs the KV cache on a CUDA device")
    assert kv_cache.is_contiguous(), "the engine's KV cache is one contiguous tensor"
    storage = kv_cache.untyped_storage()
    (_, mem_handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
     event_sync) = storage._share_cuda_()
    return kv_transfer_pb2.CudaIpcCache(
        host=host, device_uuid=host.gpu_uuids[kv_cache.device.index], mem_handle=mem_handle,
        storage_size_bytes=size_bytes, storage_offset_bytes=offset_bytes, ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset, event_handle=event_handle or b"", event_sync_required=bool(event_sync),
        tensor_offset_bytes=kv_cache.storage_offset() * kv_cache.element_size(), num_blocks=kv_cache.shape[0])


def ipc_refusal(mine: kv_transfer_pb2.HostIdentity, my_cache_device: torch.device,
                cache: kv_transfer_pb2.CudaIpcCache | None) -> str | None:
    """None when this process (identity `mine`, KV cache on `my_cache_device`) may map the exported `cache`, else
    why not, in words."""
    if my_cache_device.type != "cuda":
        return f"this instance's KV cache is on {my_cache_device.type}, not a CUDA device"
    if cache is None or not cache.mem_handle:
        return "the peer offered no CUDA IPC handle (its KV cache is not on a GPU, or it runs --kv-transfer grpc)"
    peer = cache.host
    if not peer.boot_id or not mine.boot_id:
        return "host identity unknown (no /proc/sys/kernel/random/boot_id)"
    if peer.boot_id != mine.boot_id:
        return (f"different hosts: peer {shown(peer.hostname)} boot_id={shown(peer.boot_id)}, this one "
                f"{mine.hostname!r} boot_id={mine.boot_id!r}")
    if peer.process_id == mine.process_id:
        return f"same process (pid {mine.pid}): CUDA IPC cannot open a handle in the process that exported it"
    if cache.device_uuid not in mine.gpu_uuids:
        return (f"the peer's GPU {shown(cache.device_uuid)} is not visible here (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}; visible: {', '.join(mine.gpu_uuids) or 'none'})")
    return None


def import_cache(cache: kv_transfer_pb2.CudaIpcCache, block_bytes: int,
                 mine: kv_transfer_pb2.HostIdentity) -> torch.Tensor:
    """Maps an exported cache (call after `ipc_refusal` said None); returns its rows [num_blocks, words] on this
    process's device of the same UUID. Keep the result: dropping it unmaps the cache."""
    need = cache.tensor_offset_bytes + cache.num_blocks * block_bytes
    if need > cache.storage_size_bytes:
        raise ValueError(f"cache.num_blocks={cache.num_blocks}: {cache.num_blocks} blocks of {block_bytes} bytes at "
                         f"offset {cache.tensor_offset_bytes} exceed the storage of {cache.storage_size_bytes} bytes")
    device = list(mine.gpu_uuids).index(cache.device_uuid)
    torch.cuda.init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device, cache.mem_handle, cache.storage_size_bytes, cache.storage_offset_bytes, cache.ref_counter_handle,
        cache.ref_counter_offset, cache.event_handle, cache.event_sync_required)
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    flat.set_(storage, cache.tensor_offset_bytes, (cache.num_blocks, block_bytes))
    return flat.view(torch.int64) if block_bytes % 8 == 0 else flat


def copy_blocks(dst_cache: torch.Tensor, dst_ids: list[int], src_rows: torch.Tensor, src_ids: list[int]) -> None:
    """dst_cache[dst_ids] = src_rows[src_ids], on the current streams (a gather on the source's device, a peer copy
    when the devices differ, a scatter). The caller synchronizes before anyone else may touch either side."""
    dst = _rows(dst_cache)
    assert dst.dtype == src_rows.dtype and dst.shape[1] == src_rows.shape[1], (dst.shape, src_rows.shape)
    src_index = torch.tensor(src_ids, dtype=torch.long).to(src_rows.device, non_blocking=True)
    rows = src_rows.index_select(0, src_index)  # [n, words] on the source's device
    dst_index = torch.tensor(dst_ids, dtype=torch.long).to(dst.device, non_blocking=True)
    dst.index_copy_(0, dst_index, rows.to(dst.device, non_blocking=True))


class MappedCaches:
    """The prefill caches a decode process mapped, by their handle: each mapped once per prefill process, on the
    engine thread (`on_engine`), read from the loop (a dict read is atomic)."""

    def __init__(self, block_bytes: int, host: kv_transfer_pb2.HostIdentity,
                 on_engine: Callable[[Callable[[torch.Tensor], torch.Tensor]], Awaitable[torch.Tensor]]):
        self.block_bytes = block_bytes
        self.host = host
        self.on_engine = on_engine
        self._rows: dict[bytes, torch.Tensor] = {}  # written by the engine thread

    def get(self, cache: kv_transfer_pb2.CudaIpcCache) -> torch.Tensor | None:
        return self._rows.get(cache.mem_handle)

    async def map(self, cache: kv_transfer_pb2.CudaIpcCache) -> torch.Tensor:
        """The rows of a prefill instance's cache, mapped on first use (ipc_refusal already said None)."""
        return await self.on_engine(lambda kv_cache: self._map(cache))

    def _map(self, cache: kv_transfer_pb2.CudaIpcCache) -> torch.Tensor:
        src = self._rows.get(cache.mem_handle)
        if src is None:
            src = self._rows[cache.mem_handle] = import_cache(cache, self.block_bytes, self.host)
            log.info("mapped the KV cache of prefill pid %d on %s (%d blocks) for CUDA IPC transfers",
                     cache.host.pid, shown(cache.host.hostname), cache.num_blocks)
        return src


class CudaIpcSender(BlockSender):
    def __init__(self, layout: kv_transfer_pb2.KvLayout):
        self.block_bytes = layout.block_bytes

    def block_messages(self, kv_cache: torch.Tensor, first_block_index: int, block_ids: list[int],
                       blocks_per_message: int, encoded: bool) -> list[kv_transfer_pb2.KvTransferMessage]:
        """Only the block ids, in one message (the decode instance copies the blocks GPU to GPU)."""
        # No wait: LLMEngine.step() reports only steps whose device work is complete (their KV writes
        # included); synchronizing here would also wait for the step async scheduling launched after it.
        return [kv_transfer_pb2.KvTransferMessage(ready=kv_transfer_pb2.KvBlocksReady(
            first_block_index=first_block_index, block_ids=block_ids))]

    def payload(self, msg) -> tuple[int, int] | None:
        if isinstance(msg, kv_transfer_pb2.KvTransferMessage) and msg.WhichOneof("kind") == "ready":
            return len(msg.ready.block_ids) * self.block_bytes, len(msg.ready.block_ids)
        return None


class CudaIpcReceiver(BlockReceiver):
    """One transfer's KvBlocksReady runs: copied GPU to GPU from the prefill's mapped cache into the reserved blocks,
    each copy waited for on the engine thread (window 0) but not on the GPU; the commit first waits for the last."""

    def __init__(self, side):  # side: receiver.KvReceiver
        self.side = side
        self.block_bytes = side.layout.block_bytes
        self.src: torch.Tensor | None = None  # the prefill cache's rows
        # Engine thread: the last copy. A failed transfer drops it with a copy still in flight: that copy is ordered
        # before any reuse of its blocks (one stream).
        self._copied: torch.cuda.Event | None = None

    async def open(self, op: kv_transfer_pb2.KvTransferOpen) -> None:
        refusal = ipc_refusal(self.side.host, self.side.device, op.cache if op.HasField("cache") else None)
        if refusal is not None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"open.path=CUDA_IPC: {refusal}")
        src = self.side.sources.get(op.cache)  # mapped once per prefill process (atomic read)
        try:
            if src is None:
                src = await self.side.sources.map(op.cache)
        except Exception as exc:  # noqa: BLE001
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"open.cache: mapping the prefill KV cache failed: {exc}") from None
        self.src = src

    def run(self, msg: kv_transfer_pb2.KvTransferMessage) -> BlockRun:
        r = msg.ready
        src_ids = list(r.block_ids)
        bad_id = next((i for i in src_ids if i >= self.src.shape[0]), None)
        if bad_id is not None:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"ready.block_ids: {bad_id} is past the prefill cache's {self.src.shape[0]} blocks")
        return BlockRun(r.first_block_index, len(src_ids), len(src_ids) * self.block_bytes, src_ids)

    def write(self, kv_cache: torch.Tensor, block_ids: list[int], run: BlockRun, skip: int) -> None:
        copy_blocks(kv_cache, block_ids, self.src, run.payload[skip:])  # queued on the GPU, not waited for
        event = self._copied = torch.cuda.Event()
        event.record(torch.cuda.current_stream(kv_cache.device))

    def before_commit(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the prefill instance frees the source blocks on our ack


TRANSPORT = Transport(path=CUDA_IPC, label="ipc", kind="ready", sender=CudaIpcSender, receiver=CudaIpcReceiver)
