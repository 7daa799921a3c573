"""The paged KV write: each new token's key and value go to its slot (block_id * block_size + offset).

With an fp8 (float8_e4m3fn) cache the stored value is x / scale, saturated to +-448. The caches are strided views
of the engine's one tensor [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], so the kernel takes
every stride except the last (which must be 1).

With an int8 cache (k_scale_cache / v_scale_cache given: [num_blocks, block_size, num_kv_heads] float32, any
strides) each row (token, KV head) is quantized with its own scale, computed here from the row
(kernels/quant_int8.py), and the scale is stored in its slot of the scale view (the engine's: each block's scales
after its values, int8_cache_views; the kernel goes by the views' strides only).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, FP8_DTYPE, check_same_device, check_tensor, interpreting
from kernels.quant_int8 import _quantize_int8_rows, quantize_int8_rows_ref

INT8_DTYPE = torch.int8


def check_int8_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale_cache: torch.Tensor | None,
                      v_scale_cache: torch.Tensor | None) -> bool:
    """Whether the caches are int8 (then both scale caches must be given, float32 [num_blocks, block_size,
    num_kv_heads]); raises naming the argument otherwise."""
    int8 = k_cache.dtype == INT8_DTYPE
    if (k_scale_cache is None) != (v_scale_cache is None):
        raise ValueError("k_scale_cache and v_scale_cache: give both or neither")
    if int8 != (k_scale_cache is not None):
        raise ValueError(f"k_scale_cache: {'missing' if int8 else 'given'} for a {k_cache.dtype} cache (an int8 "
                         "cache needs its per-slot scales, any other cache has none)")
    if int8:
        for name, t in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
            if t.dtype != torch.float32 or tuple(t.shape) != tuple(k_cache.shape[:3]):
                raise ValueError(f"{name}: {t.dtype} {tuple(t.shape)}, expected float32 {tuple(k_cache.shape[:3])}")
            if t.device != k_cache.device:
                raise ValueError(f"{name}: on {t.device}, the cache on {k_cache.device}")
    return int8


def write_kv_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 skips the token (padding)
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    k_scale_cache: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] float32 (int8 cache)
    v_scale_cache: torch.Tensor | None = None,
) -> None:
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    kk, vv = k[valid], v[valid]
    if check_int8_scales(k_cache, v_cache, k_scale_cache, v_scale_cache):
        for x, cache, scales in ((kk, k_cache, k_scale_cache), (vv, v_cache, v_scale_cache)):
            x_q, s = quantize_int8_rows_ref(x)
            cache[blocks, offsets] = x_q
            scales[blocks, offsets] = s
        return
    if k_scale != 1.0:
        kk = kk.float() / k_scale
    if v_scale != 1.0:
        vv = vv.float() / v_scale
    k_cache[blocks, offsets] = kk.to(k_cache.dtype)
    v_cache[blocks, offsets] = vv.to(v_cache.dtype)


@triton.jit
def _round_to_e4m3_grid(x):
    """Rounds float32 x (|x| <= 448) to the nearest e4m3 value, ties to even, in float32 arithmetic: adding and
    subtracting 1.5 * 2**23 * ulp(x) makes the float32 adder do the rounding. Used under the interpreter, whose own
    float -> fp8 conversion drops the mantissa carry (0.49 -> 0.25); the GPU's cvt instruction is exact."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3: 3 mantissa bits, subnormals below 2**-6
    magic = ((exponent - 3 + 23 + 127) << 23) | 0x400000  # 1.5 * 2**(exponent - 3 + 23)
    magic_f = magic.to(tl.float32, bitcast=True)
    r = (tl.abs(x) + magic_f) - magic_f
    return tl.where(bits < 0, -r, r)  # keeps the sign of values that round to zero, and of -0


@triton.jit
def _to_cache(x, scale, QUANT: tl.constexpr, FP8: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """x (k/v dtype) as the cache stores it: / scale, saturated to +-448 and rounded to e4m3 for an fp8 cache (the
    caller converts to the cache dtype). Shared with kernels/rotary.py's fused rotary + KV write."""
    if QUANT:
        x = x.to(tl.float32) / scale
        if FP8:
            x = tl.clamp(x, -448.0, 448.0)
            if ROUND_IN_FP32:
                x = _round_to_e4m3_grid(x)
    return x


@triton.jit(do_not_specialize=["num_tokens"])  # varies every step: no recompiles on 1 / multiples of 16
def _write_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    ks_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (INT8)
    vs_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (INT8)
    stride_ks_b, stride_ks_s, stride_ks_h,
    stride_vs_b, stride_vs_s, stride_vs_h,
    stride_k_t, stride_k_h,
    stride_v_t, stride_v_h,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    num_tokens,
    k_scale,
    v_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    QUANT: tl.constexpr,  # divide by the scale (and saturate when the cache is fp8)
    FP8: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,  # the interpreter's fp8 conversion is inexact
    INT8: tl.constexpr,  # quantize each row with its own scale, stored at ks/vs
):
    head = tl.program_id(1)
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    slots = tl.load(slot_mapping_ptr + toks, mask=toks < num_tokens, other=-1).to(tl.int64)
    blocks, offs = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    mask = (slots >= 0)[:, None] & (d < HEAD_DIM)  # [BLOCK_T, BLOCK_D]

    k = tl.load(k_ptr + toks[:, None] * stride_k_t + head * stride_k_h + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + toks[:, None] * stride_v_t + head * stride_v_h + d, mask=mask, other=0.0)
    if INT8:
        k, k_row_scale = _quantize_int8_rows(k)
        v, v_row_scale = _quantize_int8_rows(v)
        row_ok = slots >= 0
        tl.store(ks_ptr + blocks * stride_ks_b + offs * stride_ks_s + head * stride_ks_h, k_row_scale, mask=row_ok)
        tl.store(vs_ptr + blocks * stride_vs_b + offs * stride_vs_s + head * stride_vs_h, v_row_scale, mask=row_ok)
    else:
        k = _to_cache(k, k_scale, QUANT, FP8, ROUND_IN_FP32)
        v = _to_cache(v, v_scale, QUANT, FP8, ROUND_IN_FP32)
    kc = k_cache_ptr + blocks[:, None] * stride_kc_b + offs[:, None] * stride_kc_s + head * stride_kc_h + d
    vc = v_cache_ptr + blocks[:, None] * stride_vc_b + offs[:, None] * stride_vc_s + head * stride_vc_h + d
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
) -> None:
    """Slots are not range-checked on the device (a host sync): each must be -1 or < num_blocks * block_size."""
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_kv_heads, head_dim = k.shape
    check_tensor("v", v, ndim=3, dtypes=(k.dtype,), shape=tuple(k.shape))
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES + (FP8_DTYPE, INT8_DTYPE),
                 shape=(None, None, num_kv_heads, head_dim))
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32),
                 shape=(num_tokens,), last_dim_contiguous=False)
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not float(s) > 0:
            raise ValueError(f"{name}={s}: must be > 0")
    fp8 = k_cache.dtype == FP8_DTYPE
    int8 = check_int8_scales(k_cache, v_cache, k_scale_cache, v_scale_cache)
    if int8 and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError(f"k_scale={k_scale}, v_scale={v_scale}: an int8 cache has per-slot scales, these must be 1")
    if num_tokens == 0:
        return
    block_t = 16
    grid = (triton.cdiv(num_tokens, block_t), num_kv_heads)
    ks, vs = (k_scale_cache, v_scale_cache) if int8 else (k_cache, v_cache)  # unused without int8
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping, ks, vs,
        *ks.stride()[:3], *vs.stride()[:3],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_tokens, float(k_scale), float(v_scale),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_T=block_t,
        BLOCK_SIZE=k_cache.shape[1], QUANT=fp8 or k_scale != 1.0 or v_scale != 1.0, FP8=fp8,
        ROUND_IN_FP32=fp8 and interpreting(), INT8=int8,
        num_warps=4,
    )
