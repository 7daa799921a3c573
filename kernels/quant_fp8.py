"""Per-token fp8 (e4m3) quantization of activations: x[m, :] = x_q[m, :] * scale[m].

scale[m] = max(amax(|x[m, :]|) * float32(1 / 448), MIN_SCALE) in float32 (a product, not a quotient: torch on CUDA
divides a tensor by a scalar as a product with its reciprocal, so a quotient would differ from the CUDA reference
by an ulp), x_q = clamp(x / scale, -448, 448) rounded to nearest
even in float8_e4m3fn. This is the activation side of the fp8 GEMM (engine/quant.py): torch._scaled_mm takes x_q
with scale_a = scale [M, 1].

One program quantizes one row. A row up to SINGLE_PASS_MAX elements (the hidden size's inputs: qkv, o, gate_up) is
loaded once and kept in registers; a longer one (down_proj's intermediate input) is read twice, the second time
mostly from L2: once for its amax, once to scale and store.

The producers of these inputs can write x_q and scale themselves, with the arithmetic of `_row_scale` and `_to_fp8`
below, so the 16-bit row never goes to memory: kernels/norm.py's rms_norm_quant_fp8 / fused_add_rms_norm_quant_fp8
and kernels/activation.py's silu_and_mul_quant_fp8, wired in by engine/fp8_fusion.py (TANDEM_FUSED_FP8_QUANT=0
turns them off, for an A/B with bench/profile_decode.py or bench/kernels.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, FP8_DTYPE, FP8_MAX, check_out, check_tensor, interpreting
from kernels.kv_write import _round_to_e4m3_grid

# A row of all zeros gets this scale instead of 0 (x / 0 would be NaN); vLLM's minimum for dynamic fp8 scales.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
INV_FP8_MAX = 1.0 / FP8_MAX
SINGLE_PASS_MAX = 8192


def per_token_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float -> (x_q [..., K] float8_e4m3fn, scale [..., 1] float32), a scale per row. Also the
    weights' rule (a scale per output row, engine/quant.py): one float32 copy of x, scaled in place (never x
    itself)."""
    xf = x.to(torch.float32, copy=True)
    scale = (xf.abs().amax(dim=-1, keepdim=True) * INV_FP8_MAX).clamp(min=MIN_SCALE)
    return xf.div_(scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@triton.jit
def _row_scale(amax, MIN_SCALE: tl.constexpr, INV_FP8_MAX: tl.constexpr):
    """A row's float32 scale from its float32 amax (a product, see the module docstring)."""
    return tl.maximum(amax * INV_FP8_MAX, MIN_SCALE)


@triton.jit
def _to_fp8(x, scale, FP8_MAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """float32 x / scale, saturated and rounded as the reference does (the caller converts to float8_e4m3fn with
    fp_downcast_rounding="rtne")."""
    q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX)
    if ROUND_IN_FP32:
        q = _round_to_e4m3_grid(q)
    return q


@triton.jit
def _per_token_quant_fp8_kernel(
    out_ptr,  # [M, K] float8_e4m3fn
    scale_ptr,  # [M] float32
    x_ptr,  # [M, K]
    stride_out,
    stride_x,
    K,
    MIN_SCALE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,  # the interpreter's float -> fp8 conversion is inexact (kernels/kv_write.py)
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    if SINGLE_PASS:  # BLOCK_K >= K: the whole row in registers
        cols = tl.arange(0, BLOCK_K)
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        scale = _row_scale(tl.max(tl.abs(x), axis=0), MIN_SCALE, INV_FP8_MAX)
        q = _to_fp8(x, scale, FP8_MAX, ROUND_IN_FP32)
        tl.store(out_row + cols, q.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = _row_scale(tl.max(amax, axis=0), MIN_SCALE, INV_FP8_MAX)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = cols < K
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            q = _to_fp8(x, scale, FP8_MAX, ROUND_IN_FP32)
            tl.store(out_row + cols, q.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(scale_ptr + row, scale)


def fp8_outputs(shape: tuple[int, ...], device: torch.device, out: torch.Tensor | None,
                scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffers a producer that quantizes its rows writes (allocated unless the caller gives them, then checked):
    x_q of `shape` in float8_e4m3fn, rows that flatten; scale [..., 1] float32 contiguous, one per row."""
    if out is None:
        out = torch.empty(shape, dtype=FP8_DTYPE, device=device)
    check_out("out", out, shape, FP8_DTYPE, device)
    if scale is None:
        scale = torch.empty((*shape[:-1], 1), dtype=torch.float32, device=device)
    check_out("scale", scale, (*shape[:-1], 1), torch.float32, device)
    if not scale.is_contiguous():
        raise ValueError(f"scale: strides {scale.stride()}, expected contiguous [..., 1]")
    return out, scale


def per_token_quant_fp8_triton(x: torch.Tensor, *, out: torch.Tensor | None = None,
                               scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows may be strided, the last dim contiguous) -> (x_q [M, K] contiguous, scale [M, 1] float32)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    M, K = x.shape
    if out is None:
        out = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    check_tensor("out", out, dtypes=(FP8_DTYPE,), shape=(M, K))
    if scale is None:
        scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    check_tensor("scale", scale, dtypes=(torch.float32,), shape=(M, 1))
    if not scale.is_contiguous():
        raise ValueError(f"scale: strides {scale.stride()}, expected contiguous [M, 1]")
    if M == 0 or K == 0:
        return out, scale.fill_(MIN_SCALE)
    single = K <= SINGLE_PASS_MAX
    block_k = triton.next_power_of_2(K) if single else 2048
    num_warps = 4 if block_k <= 1024 else 8
    _per_token_quant_fp8_kernel[(M,)](out, scale, x, out.stride(0), x.stride(0), K, MIN_SCALE=MIN_SCALE,
                                      FP8_MAX=FP8_MAX, INV_FP8_MAX=INV_FP8_MAX, SINGLE_PASS=single, BLOCK_K=block_k,
                                      ROUND_IN_FP32=interpreting(), num_warps=num_warps)
    return out, scale
