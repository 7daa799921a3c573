"""The KV block layout both sides of a transfer agree on, and the byte conversions of block runs."""
from __future__ import annotations

import warnings

import torch

from protos.tandem.v1 import kv_transfer_pb2

LAYOUT_NAME = "block_layer_kv_token_head_dim"

# torch.frombuffer over the received (immutable) bytes: we only read from it, to copy into the cache.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


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


def read_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> bytes:
    """The bytes of kv_cache[block_ids], block after block (a gather, then one device -> host copy)."""
    t = kv_cache[torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)].contiguous()
    return t.cpu().view(torch.uint8).numpy().tobytes()


def write_blocks(kv_cache: torch.Tensor, block_ids: list[int], data: bytes) -> None:
    """kv_cache[block_ids] = data (the inverse of read_blocks)."""
    src = torch.frombuffer(data, dtype=torch.uint8).view(kv_cache.dtype).view(len(block_ids), *kv_cache.shape[1:])
    kv_cache[torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)] = src.to(kv_cache.device)
