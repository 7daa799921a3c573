"""Rotary position embedding, NeoX style (rotate halves), as Llama, Mistral and Qwen2 use it.

The Llama-3 frequency scaling lives in how cos_sin_cache is built (engine side); the kernel only reads the row of
each token's position. One program rotates every head of one token, q and k, in float32.
rotary_embedding_write_kv_triton also writes the rotated k and v to the paged KV cache in the same program (one
launch per layer instead of rotary + write_kv).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, FP8_DTYPE, check_out, check_same_device, check_tensor, interpreting
from kernels.kv_write import _to_cache, write_kv_ref, write_kv_triton


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
    r1 = (x1f * cos - x2f * sin).to(x1.dtype)
    r2 = (x2f * cos + x1f * sin).to(x1.dtype)
    o_row = out_ptr + tok * stride_out_t + heads * stride_out_h + d
    tl.store(o_row, r1, mask=mask)
    tl.store(o_row + HALF, r2, mask=mask)
    return r1, r2  # [BLOCK_H, BLOCK_HALF] each, in x's dtype, as stored


@triton.jit
def _cos_sin(cache_ptr, pos, stride_cache, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Position pos's cos and sin, [1, BLOCK_HALF] float32 each (the cache holds cos | sin)."""
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_cache + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    return cos, sin


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
    cos, sin = _cos_sin(cache_ptr, pos, stride_cache, HALF, BLOCK_HALF)
    _rotate_heads(q_out_ptr, q_ptr, stride_qo_t, stride_qo_h, stride_q_t, stride_q_h, tok, num_heads, cos, sin,
                  HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_out_ptr, k_ptr, stride_ko_t, stride_ko_h, stride_k_t, stride_k_h, tok, num_kv_heads, cos, sin,
                  HALF, BLOCK_HK, BLOCK_HALF)


def _check_positions_and_head_dim(positions: torch.Tensor, num_tokens: int, head_dim: int) -> None:
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions: {positions.shape[0]} entries, expected num_tokens={num_tokens}")
    if head_dim % 2:
        raise ValueError(f"q: head_dim={head_dim} must be even")


def _outputs(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor | None,
             k_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated q and k's buffers: the caller's (checked) or new ones."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k_out is None else k_out
    check_out("q_out", q_out, tuple(q.shape), q.dtype, q.device)
    check_out("k_out", k_out, tuple(k.shape), k.dtype, k.device)
    return q_out, k_out


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
    _check_positions_and_head_dim(positions, num_tokens, head_dim)
    q_out, k_out = _outputs(q, k, q_out, k_out)
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


# ------------------------------------------------------------------------------------------------------------------
# Rotary embedding fused with the paged KV write: one launch per layer instead of two (decode runs 28 of each per
# token at 7B). Same arithmetic as rotary_embedding_triton followed by write_kv_triton, so the cache holds the same
# bytes: k is rotated in float32, rounded to k's dtype (what k_out holds), then quantized for the cache.

def rotary_embedding_write_kv_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 skips the token's KV write
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    k_scale_cache: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] float32 (int8 cache)
    v_scale_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding_ref, then write_kv_ref of the rotated k and v; returns the rotated (q, k)."""
    q_rot, k_rot = rotary_embedding_ref(positions, q, k, cos_sin_cache)
    write_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_scale_cache=k_scale_cache,
                 v_scale_cache=v_scale_cache)
    return q_rot, k_rot


@triton.jit
def _rotary_write_kv_kernel(
    q_out_ptr,  # [num_tokens, num_heads, head_dim]
    k_out_ptr,  # [num_tokens, num_kv_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    positions_ptr,  # [num_tokens]
    cache_ptr,  # [max_position, head_dim] float32: cos | sin
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens], -1 = no KV write
    stride_qo_t, stride_qo_h, stride_ko_t, stride_ko_h,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_cache,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    num_heads,
    num_kv_heads,
    k_scale,
    v_scale,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    QUANT: tl.constexpr,
    FP8: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    cos, sin = _cos_sin(cache_ptr, pos, stride_cache, HALF, BLOCK_HALF)
    _rotate_heads(q_out_ptr, q_ptr, stride_qo_t, stride_qo_h, stride_q_t, stride_q_h, tok, num_heads, cos, sin,
                  HALF, BLOCK_HQ, BLOCK_HALF)
    # k rotated and stored as rotary_embedding does; its halves (so rounded) go to the cache below
    r1, r2 = _rotate_heads(k_out_ptr, k_ptr, stride_ko_t, stride_ko_h, stride_k_t, stride_k_h, tok, num_kv_heads,
                           cos, sin, HALF, BLOCK_HK, BLOCK_HALF)

    d = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    heads = tl.arange(0, BLOCK_HK)[:, None]  # [BLOCK_HK, 1]
    mask = (heads < num_kv_heads) & (d < HALF)  # [BLOCK_HK, BLOCK_HALF]
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    block, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    # (slot >= 0 as a tensor: Triton >= 3.9's interpreter turns a tensor & scalar-bool mask into int32 and rejects it)
    wmask = mask & ((tl.zeros_like(heads + d) + slot) >= 0)
    kc_row = k_cache_ptr + block * stride_kc_b + off * stride_kc_s + heads * stride_kc_h + d
    tl.store(kc_row, _to_cache(r1, k_scale, QUANT, FP8, ROUND_IN_FP32).to(k_cache_ptr.dtype.element_ty), mask=wmask)
    tl.store(kc_row + HALF, _to_cache(r2, k_scale, QUANT, FP8, ROUND_IN_FP32).to(k_cache_ptr.dtype.element_ty),
             mask=wmask)
    v_row = v_ptr + tok * stride_v_t + heads * stride_v_h + d
    vc_row = v_cache_ptr + block * stride_vc_b + off * stride_vc_s + heads * stride_vc_h + d
    v1 = tl.load(v_row, mask=wmask, other=0.0)
    v2 = tl.load(v_row + HALF, mask=wmask, other=0.0)
    tl.store(vc_row, _to_cache(v1, v_scale, QUANT, FP8, ROUND_IN_FP32).to(v_cache_ptr.dtype.element_ty), mask=wmask)
    tl.store(vc_row + HALF, _to_cache(v2, v_scale, QUANT, FP8, ROUND_IN_FP32).to(v_cache_ptr.dtype.element_ty),
             mask=wmask)


def rotary_embedding_write_kv_triton(
    positions: torch.Tensor,  # [num_tokens] int32/int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], any strides with a contiguous last dim
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (a strided view of the engine's cache)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64/int32, -1 = padding
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    k_scale_cache: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] float32 (int8 cache)
    v_scale_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding_triton + write_kv_triton in one launch: returns the rotated (q, k) (new tensors unless
    q_out / k_out are given; q_out=q, k_out=k rotates in place) and writes rotated k and v to their slots.
    Positions and slots are not range-checked on the device (a host sync), as in the two kernels.

    An int8 cache takes the two launches: its write reduces each row to its scale first, which the fused kernel's
    half-row layout does not do (not measured as a cost; docs/kernels.md)."""
    if k_cache.dtype == torch.int8 or k_scale_cache is not None:
        q_out, k_out = rotary_embedding_triton(positions, q, k, cos_sin_cache, q_out=q_out, k_out=k_out)
        write_kv_triton(k_out, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_scale_cache=k_scale_cache,
                        v_scale_cache=v_scale_cache)
        return q_out, k_out
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64), last_dim_contiguous=False)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), shape=(num_tokens, None, head_dim))
    num_kv_heads = k.shape[1]
    check_tensor("v", v, ndim=3, dtypes=(q.dtype,), shape=tuple(k.shape))
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES, shape=(None, head_dim))
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES + (FP8_DTYPE,),
                 shape=(None, None, num_kv_heads, head_dim))
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32), shape=(num_tokens,),
                 last_dim_contiguous=False)
    check_same_device(positions=positions, q=q, k=k, v=v, cos_sin_cache=cos_sin_cache, k_cache=k_cache,
                      v_cache=v_cache, slot_mapping=slot_mapping)
    _check_positions_and_head_dim(positions, num_tokens, head_dim)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not float(s) > 0:
            raise ValueError(f"{name}={s}: must be > 0")
    q_out, k_out = _outputs(q, k, q_out, k_out)
    if num_tokens == 0:
        return q_out, k_out
    fp8 = k_cache.dtype == FP8_DTYPE
    half = head_dim // 2
    _rotary_write_kv_kernel[(num_tokens,)](
        q_out, k_out, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_heads, num_kv_heads, float(k_scale), float(v_scale),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_SIZE=k_cache.shape[1], QUANT=fp8 or k_scale != 1.0 or v_scale != 1.0, FP8=fp8,
        ROUND_IN_FP32=fp8 and interpreting(),
        num_warps=4,
    )
    return q_out, k_out
