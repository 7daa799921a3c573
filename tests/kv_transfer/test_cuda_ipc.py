"""kv_transfer/cuda_ipc.py on the CPU: the host identity and every reason two processes cannot use CUDA IPC. The
mapping and the copy themselves need CUDA: tests/e2e/test_kv_ipc_cuda.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kv_transfer.cuda_ipc import copy_blocks, export_cache, host_identity, ipc_refusal
from protos.tandem.v1 import kv_transfer_pb2 as kv

GPU_A, GPU_B = "11111111-2222-3333-4444-555555555555", "66666666-7777-8888-9999-000000000000"
CUDA = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


def ident(boot="boot-1", process="p1", gpus=(GPU_A,), host="h1") -> kv.HostIdentity:
    return kv.HostIdentity(boot_id=boot, hostname=host, process_id=process, pid=7, gpu_uuids=list(gpus))


def export(peer: kv.HostIdentity, device_uuid=GPU_A) -> kv.CudaIpcCache:
    return kv.CudaIpcCache(host=peer, device_uuid=device_uuid, mem_handle=b"\x01" * 64, storage_size_bytes=1 << 20,
                           num_blocks=4)


def test_host_identity_is_this_process_on_this_host():
    a, b = host_identity(), host_identity()
    assert a.pid == os.getpid() and a.process_id and a.process_id == b.process_id
    boot = Path("/proc/sys/kernel/random/boot_id")
    if boot.exists():
        assert a.boot_id == boot.read_text().strip()
    assert len(a.gpu_uuids) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_same_host_other_process_visible_gpu_is_accepted():
    assert ipc_refusal(ident(process="decode"), CUDA, export(ident(process="prefill"))) is None


def test_a_second_visible_gpu_is_accepted():
    mine = ident(process="decode", gpus=(GPU_A, GPU_B))
    assert ipc_refusal(mine, CUDA, export(ident(process="prefill", gpus=(GPU_B,)), device_uuid=GPU_B)) is None


@pytest.mark.parametrize("mine,device,cache,words", [
    (ident(process="d"), torch.device("cpu"), export(ident(process="p")), "KV cache is on cpu"),
    (ident(process="d"), CUDA, None, "offered no CUDA IPC handle"),
    (ident(process="d"), CUDA, kv.CudaIpcCache(host=ident(process="p")), "offered no CUDA IPC handle"),
    (ident(process="d"), CUDA, export(ident(boot="boot-2", process="p", host="h2")),
     "different hosts: peer 'h2' boot_id='boot-2', this one 'h1' boot_id='boot-1'"),
    (ident(boot="", process="d"), CUDA, export(ident(process="p")), "host identity unknown"),
    (ident(process="same"), CUDA, export(ident(process="same")), "same process (pid 7)"),
    (ident(process="d", gpus=(GPU_B,)), CUDA, export(ident(process="p")), f"the peer's GPU '{GPU_A}' is not visible"),
])
def test_refusals_say_why(mine, device, cache, words):
    reason = ipc_refusal(mine, device, cache)
    assert reason is not None and words in reason, reason


def test_export_refuses_a_cpu_cache():
    with pytest.raises(ValueError, match=r"^kv_cache.device=cpu: CUDA IPC needs the KV cache on a CUDA device"):
        export_cache(torch.zeros(2, 1, 2, 4, 1, 8), host_identity())


@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (6, 2, 2, 16, 2, 16)),  # 4096-byte blocks: int64 rows
                                         (torch.float8_e4m3fn, (6, 1, 2, 1, 1, 3))])  # 6-byte blocks: uint8 rows
def test_copy_blocks_gathers_and_scatters_whole_blocks(dtype, shape):
    """copy_blocks on the CPU, its source built the way import_cache builds a mapped cache: a byte tensor set on
    the exporter's storage, viewed as rows."""
    src = torch.randn(shape).to(dtype)
    block_bytes = src[0].numel() * src.element_size()
    rows = torch.empty(0, dtype=torch.uint8)
    rows.set_(src.untyped_storage(), 0, (shape[0], block_bytes))
    rows = rows.view(torch.int64) if block_bytes % 8 == 0 else rows
    dst = torch.zeros(shape).to(dtype)
    copy_blocks(dst, [5, 0, 2], rows, [1, 4, 3])
    as_bytes = lambda t: t.view(torch.uint8)  # noqa: E731 (exact comparison, NaN-free for any dtype)
    for d, s in ((5, 1), (0, 4), (2, 3)):
        assert torch.equal(as_bytes(dst[d]), as_bytes(src[s]))
    for untouched in (1, 3, 4):
        assert not as_bytes(dst[untouched]).any()
