"""The KV block layout both sides of a transfer agree on: the layout of a cache and its check, a cache as rows of
bytes, runs of consecutive block ids, and the malloc setting of every process that moves block bytes.

The bytes of block runs on the GRPC path are kv_transfer/grpc_bytes.py; the CUDA IPC path is kv_transfer/cuda_ipc.py.
"""
from __future__ import annotations

import ctypes

import torch

from protos.tandem.v1 import kv_transfer_pb2
from serving.errors import shown

LAYOUT_NAME = "block_layer_kv_token_head_dim"
# An int8 cache's (block, layer, K/V) regions hold their values [block_size, num_kv_heads, head_dim], then their
# float32 scales [num_kv_heads, block_size] (kernels/quant_int8.py, the "block" layout): a block's bytes are its
# values and its scales, and both sides must agree on that as on the rest. (The earlier layout, each row's values
# followed by its scale, was "block_layer_kv_token_head_dim_scale": a process of either refuses the other's name.)
LAYOUT_NAME_INT8 = "block_layer_kv_token_head_dim_then_scales_head_token"
INT8_ROW_PAD = 4  # bytes per (slot, KV head) of an int8 cache beyond its values (kernels/quant_int8.INT8_ROW_PAD)


# glibc's malloc for the transfer path's large short-lived buffers (each message's bytes, several copies per side:
# Python bytes, gRPC slices): by default it serves large blocks with mmap and gives the freed top of the heap back to
# the OS, so the buffers of every message were fresh pages, faulted in and zeroed by the kernel on first touch: a
# large share of the receiving process's CPU (measured: bench/RESULTS.md). A process that had already freed large
# blocks (a CPU engine's decode service) had raised glibc's adaptive thresholds by itself and rarely faulted; these
# limits make that so in any process. The price: a heap keeps up to _TRIM_THRESHOLD_BYTES of free memory.
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
    """The layout of an engine's kv_cache [num_blocks, num_layers, 2, block_size, num_kv_heads, row]: row = head_dim
    values, or for an int8 cache head_dim + 4 bytes (each region's values, then its float32 scales)."""
    _, num_layers, two, block_size, num_kv_heads, row = kv_cache.shape
    assert two == 2, kv_cache.shape
    int8 = kv_cache.dtype == torch.int8
    block_bytes = num_layers * 2 * block_size * num_kv_heads * row * kv_cache.element_size()
    return kv_transfer_pb2.KvLayout(dtype=str(kv_cache.dtype).removeprefix("torch."),
                                    layout=LAYOUT_NAME_INT8 if int8 else LAYOUT_NAME, block_size=block_size,
                                    num_layers=num_layers, num_kv_heads=num_kv_heads,
                                    head_dim=row - INT8_ROW_PAD if int8 else row, block_bytes=block_bytes)


def layout_mismatch(mine: kv_transfer_pb2.KvLayout, theirs: kv_transfer_pb2.KvLayout) -> str | None:
    """None when the layouts agree, else a message naming the first field that differs (the dtype first: caches of
    two dtypes also differ in layout name and block bytes, and the dtype is what the operator set)."""
    for f in ("dtype", "layout", "block_size", "num_layers", "num_kv_heads", "head_dim", "block_bytes"):
        a, b = getattr(theirs, f), getattr(mine, f)
        if a != b:
            return f"layout.{f}={shown(a)}: this decode instance's KV cache has {f}={b!r}"
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
