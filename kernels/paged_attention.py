"""Attention over the paged KV cache: one function for prefill chunks and decodes.

Sequence i has q_len_i queries (q[query_start_loc[i]:query_start_loc[i+1]]) and seq_lens[i] tokens in the cache
after this step; its queries sit at the last q_len_i positions and attend causally. A decode is q_len_i == 1.
"""
from __future__ import annotations

import torch


def gather_kv_ref(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    max_seq_len: int,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [num_seqs, max_seq_len, num_kv_heads, head_dim]
    """Reads each sequence's first max_seq_len cached tokens through its block table (dequantized)."""
    num_seqs = block_tables.shape[0]
    block_size = cache.shape[1]
    num_blocks_needed = (max_seq_len + block_size - 1) // block_size
    ids = block_tables[:, :num_blocks_needed].long()
    out = cache[ids]  # [num_seqs, nb, block_size, Hkv, D]
    out = out.reshape(num_seqs, num_blocks_needed * block_size, *cache.shape[2:])[:, :max_seq_len]
    if dtype is not None:
        out = out.to(dtype)
    if scale != 1.0:
        out = out * scale
    return out


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Plain-torch reference: pads the batch to [num_seqs, max_query_len] and masks, in float32."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    device = q.device

    k = gather_kv_ref(k_cache, block_tables, max_seq_len, k_scale, torch.float32)  # [S, L, Hkv, D]
    v = gather_kv_ref(v_cache, block_tables, max_seq_len, v_scale, torch.float32)

    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]  # [S]
    # Scatter the flat queries into a padded [S, max_query_len] grid.
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)  # [T]
    pos_in_q = torch.arange(num_tokens, device=device) - qsl[seq_idx]  # [T]
    qp = q.new_zeros((num_seqs, max_query_len, num_heads, head_dim), dtype=torch.float32)
    qp[seq_idx, pos_in_q] = q.float()

    # Absolute position of each padded query; key j is visible iff j <= query position (and j < seq_len).
    q_pos = (seq_lens.long() - q_lens)[:, None] + torch.arange(max_query_len, device=device)[None, :]  # [S, Q]
    k_pos = torch.arange(max_seq_len, device=device)  # [L]
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, Q, L]

    qh = qp.permute(0, 2, 1, 3)  # [S, H, Q, D]
    kh = k.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)  # [S, H, L, D]
    vh = v.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [S, H, Q, L]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded query rows are all -inf
    out = torch.matmul(probs, vh)  # [S, H, Q, D]
    out = out.permute(0, 2, 1, 3)[seq_idx, pos_in_q]  # [T, H, D]
    return out.to(q.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """The decode case: each sequence's single query attends to all of its seq_lens[i] cached tokens."""
    num_seqs = q.shape[0]
    qsl = torch.arange(num_seqs + 1, device=q.device, dtype=torch.int32)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, qsl, 1, max_seq_len, scale,
                               k_scale, v_scale)
