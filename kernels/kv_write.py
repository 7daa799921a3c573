"""The paged KV write: each new token's key and value go to its slot (block_id * block_size + offset)."""
from __future__ import annotations

import torch


def write_kv_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 skips the token (padding)
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    kk, vv = k[valid], v[valid]
    if k_scale != 1.0:
        kk = kk.float() / k_scale
    if v_scale != 1.0:
        vv = vv.float() / v_scale
    k_cache[blocks, offsets] = kk.to(k_cache.dtype)
    v_cache[blocks, offsets] = vv.to(v_cache.dtype)
