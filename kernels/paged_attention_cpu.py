"""Decode attention over the paged KV cache on the CPU: one query per sequence, a float cache (the model's dtype).

The CPU engine's decode steps spend their attention time moving K/V, not in the dot products: at SmolLM2's shape
(batch 16, ~150 cached tokens, 3 KV heads) paged_attention_torch's gather by a [num_seqs, blocks] index, the
masking of stale slots in the strided gathered copies and SDPA took ~2.5 ms a layer, this ~1 ms (bench/RESULTS.md,
"CPU: Tandem beside vLLM"). The steps:
  1. `index_select` copies each sequence's blocks, whole and in table order, into [num_seqs, blocks * block_size,
     num_kv_heads, head_dim]: one contiguous copy of block_size * num_kv_heads * head_dim values per block;
  2. the rows past each sequence's length (its last block's tail, the table's padding blocks) may hold anything, NaN
     too, and a masked weight of 0 times NaN is NaN: those rows alone are zeroed (`index_fill_` of their row ids),
     in K and in V;
  3. SDPA with grouped-query heads attends each query to its own sequence's rows under a key mask [S, 1, 1, L].
The result equals paged_attention_ref's (tests/kernels/test_paged_attention_cpu.py). Prefill chunks, mixed steps and
fp8/int8 caches take paged_attention_torch: their cost is in the GEMMs around them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._checks import FLOAT_DTYPES


def decode_attention_cpu_ok(q: torch.Tensor, k_cache: torch.Tensor, max_query_len: int, num_seqs: int,
                            k_scale: float, v_scale: float, k_scale_cache: torch.Tensor | None) -> bool:
    """Whether paged_decode_attention_cpu computes this call: a decode-only step on the CPU with a cache of q's
    float dtype and unit scales."""
    return (q.device.type == "cpu" and max_query_len == 1 and q.shape[0] == num_seqs and k_cache.dtype == q.dtype
            and q.dtype in FLOAT_DTYPES and k_scale_cache is None and k_scale == 1.0 and v_scale == 1.0)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[num_seqs, num_blocks_each * block_size, num_kv_heads, head_dim]: the blocks of `block_ids` (flat, each
    sequence's in table order), copied whole."""
    rows = cache.index_select(0, block_ids)  # [num_seqs * nb, block_size, Hkv, D], contiguous
    return rows.view(num_seqs, -1, *cache.shape[2:])


def paged_decode_attention_cpu(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one query per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (a strided view)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, block_size = q.shape[0], k_cache.shape[1]
    assert k_cache.dtype == v_cache.dtype == q.dtype, (k_cache.dtype, v_cache.dtype, q.dtype)
    num_blocks = -(-max_seq_len // block_size)
    ids = block_tables[:, :num_blocks].reshape(-1)
    k = gather_blocks(k_cache, ids, num_seqs)  # [S, Lb, Hkv, D], Lb = num_blocks * block_size
    v = gather_blocks(v_cache, ids, num_seqs)
    stale = torch.arange(k.shape[1])[None, :] >= seq_lens[:, None]  # [S, Lb]
    rows = stale.view(-1).nonzero().view(-1)
    k.view(-1, k.shape[2] * k.shape[3]).index_fill_(0, rows, 0.0)
    v.view(-1, v.shape[2] * v.shape[3]).index_fill_(0, rows, 0.0)
    # SDPA sees what paged_attention_torch hands it (max_seq_len keys, the same mask), so a sequence's decode gives
    # the same bits whether its step is decode-only (here) or mixed with prompt chunks (there).
    k, v, stale = k[:, :max_seq_len], v[:, :max_seq_len], stale[:, :max_seq_len]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=~stale[:, None, None, :], scale=scale, enable_gqa=True)
    return out[:, :, 0, :]  # [S, H, D]
