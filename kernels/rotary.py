"""Rotary position embedding, NeoX style (rotate halves), as Llama, Mistral and Qwen2 use it.

The Llama-3 frequency scaling lives in how cos_sin_cache is built (engine side); the kernel only reads the row of
each token's position. One program rotates every head of one token, q and k, in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_out, check_same_device, check_tensor


def rotary_embedding_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32: cos in the first half, sin in the second
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(q), rot(k)


@triton.jit
def _rotate_heads(
    out_ptr, x_ptr, stride_out_t, stride_out_h, stride_x_t, stride_x_h, tok, num_heads, cos, sin,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    mask = (heads < num_heads) & (d < HALF)
    x_row = x_ptr + tok * stride_x_t + heads * stride_x_h + d
    x1 = tl.load(x_row, mask=mask, other=0.0)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    o_row = out_ptr + tok * stride_out_t + heads * stride_out_h + d
    tl.store(o_row, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(o_row + HALF, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    q_out_ptr,  # [num_tokens, num_heads, head_dim]
    k_out_ptr,  # [num_tokens, num_kv_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    positions_ptr,  # [num_tokens]
    cache_ptr,  # [max_position, head_dim] float32
    stride_qo_t, stride_qo_h, stride_ko_t, stride_ko_h,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h,
    stride_cache,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_cache + d, mask=d < HALF, other=0.0).to(tl.float32)  # [1, BLOCK_HALF]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_out_ptr, q_ptr, stride_qo_t, stride_qo_h, stride_q_t, stride_q_h, tok, num_heads, cos, sin,
                  HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_out_ptr, k_ptr, stride_ko_t, stride_ko_h, stride_k_t, stride_k_h, tok, num_kv_heads, cos, sin,
                  HALF, BLOCK_HK, BLOCK_HALF)


def rotary_embedding_triton(
    positions: torch.Tensor,  # [num_tokens] int32/int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], any strides with a contiguous last dim
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q, k) rotated: new tensors unless q_out / k_out are given (q_out=q, k_out=k: in place). Positions are not range-checked on the device
    (that would need a host sync): they must be < cos_sin_cache.shape[0]."""
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64), last_dim_contiguous=False)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), shape=(num_tokens, None, head_dim))
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES, shape=(None, head_dim))
    check_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions: {positions.shape[0]} entries, expected num_tokens={num_tokens}")
    if head_dim % 2:
        raise ValueError(f"q: head_dim={head_dim} must be even")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k_out is None else k_out
    check_out("q_out", q_out, tuple(q.shape), q.dtype, q.device)
    check_out("k_out", k_out, tuple(k.shape), k.dtype, k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_embedding_kernel[(num_tokens,)](
        q_out, k_out, q, k, positions, cos_sin_cache,
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos_sin_cache.stride(0),
        num_heads, k.shape[1],
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        num_warps=4,
    )
    return q_out, k_out
