"""CUDA IPC for same-host KV transfers: who we are, exporting a KV cache, mapping a peer's, copying blocks.

The prefill instance exports its cache once (`export_cache`, torch's `UntypedStorage._share_cuda_`); every transfer's
open carries that export, and the decode instance maps it once per prefill process (`import_cache`, torch's
`UntypedStorage._new_shared_cuda`, i.e. cudaIpcOpenMemHandle) and copies blocks out of it into its own cache
(`copy_blocks`: one gather and one scatter on the GPU). Bytes never pass through host memory. `ipc_refusal` says, from
the identities alone, why two processes cannot use this path (different hosts, the same process, a GPU the importer
cannot see); mapping can still fail (separate IPC namespaces), which the handshake catches by trying.

A cache is handled as a byte matrix [num_blocks, block_bytes] (viewed as int64 when the size allows): the copy is
the same for every dtype, fp8 included.
"""
from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import torch

from protos.tandem.v1 import kv_transfer_pb2

PATHS = ("auto", "grpc", "ipc")  # --kv-transfer values
GRPC = kv_transfer_pb2.KV_TRANSFER_PATH_GRPC
CUDA_IPC = kv_transfer_pb2.KV_TRANSFER_PATH_CUDA_IPC
PATH_LABELS = {GRPC: "grpc", CUDA_IPC: "ipc"}

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
        return (f"different hosts: peer {peer.hostname} boot_id={peer.boot_id}, this one {mine.hostname} "
                f"boot_id={mine.boot_id}")
    if peer.process_id == mine.process_id:
        return f"same process (pid {mine.pid}): CUDA IPC cannot open a handle in the process that exported it"
    if cache.device_uuid not in mine.gpu_uuids:
        return (f"the peer's GPU {cache.device_uuid} is not visible here (CUDA_VISIBLE_DEVICES="
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
