"""SiLU-and-mul: the gated MLP activation, silu(x[..., :I]) * x[..., I:].

silu_and_mul_quant_fp8 hands down_proj's fp8 GEMM its input directly (engine/fp8_fusion.py): one program per row
walks the row twice in BLOCK_I chunks, first for the amax of the products (rounded to x's dtype, as the plain kernel
stores them), then recomputing them to write x_q [rows, I] float8_e4m3fn and scale [rows, 1] float32 with
kernels/quant_fp8.py's arithmetic: bit for bit what silu_and_mul and per_token_quant_fp8 write in two launches. The
row (2 * I 16-bit values, e.g. 57 KB for Llama-3-8B's I = 14336) is read twice, the second time mostly from L2 (the
second pass walks the chunks backwards, so the most recently read come first), and its I fp8 bytes written once,
where the unfused pair reads 2 * I, writes I 16-bit values and reads them twice more. The passes are serial within a
row, so a launch of few rows (decode) takes wider chunks: fewer dependent load rounds per row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import pdl
from kernels._checks import FLOAT_DTYPES, FP8_MAX, check_out, check_tensor, interpreting
from kernels.pdl import PDL_SUPPORTED
from kernels.quant_fp8 import INV_FP8_MAX, MIN_SCALE, _row_scale, _to_fp8, fp8_outputs, per_token_quant_fp8_ref

# The fused quantizer's chunk: 8 warps x 32 lanes x 8 elements (16-byte loads of bf16), or for launches of at most
# FEW_ROWS rows 16 warps x 32 x 16 (I = 14336 in 2 rounds a pass instead of 7; the machine is idle but for them).
QUANT_BLOCK_I = 2048
QUANT_BLOCK_I_FEW_ROWS = 8192
FEW_ROWS = 256


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul_ref, then per_token_quant_fp8_ref of its rows: (x_q [..., I] float8_e4m3fn, scale [..., 1])."""
    return per_token_quant_fp8_ref(silu_and_mul_ref(x))


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) * up as the reference rounds it: F.silu to gate's dtype, then the product (exact in float32 for
    16-bit operands) to gate's dtype."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (silu * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [num_rows, I]
    x_ptr,  # [num_rows, 2 * I]: gate then up
    stride_out,
    stride_x,
    I,
    BLOCK_I: tl.constexpr,
    TRIGGER: tl.constexpr,  # let a programmatic dependent (the W4A16 GEMV) start its weight loads now
):
    if TRIGGER:
        pdl.launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, _silu_mul(gate, up), mask=mask)


@triton.jit
def _silu_and_mul_quant_fp8_kernel(
    out_ptr,  # [num_rows, I] float8_e4m3fn
    scale_ptr,  # [num_rows] float32
    x_ptr,  # [num_rows, 2 * I]: gate then up
    stride_out,
    stride_x,
    I,
    BLOCK_I: tl.constexpr,
    SINGLE_PASS: tl.constexpr,  # BLOCK_I >= I: the row's products stay in registers between amax and store
    MIN_SCALE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,  # the interpreter's float -> fp8 conversion is inexact (kernels/kv_write.py)
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_I)
        mask = cols < I
        y = _silu_mul(tl.load(x_row + cols, mask=mask, other=0.0),
                      tl.load(x_row + I + cols, mask=mask, other=0.0)).to(tl.float32)  # masked lanes: silu(0)*0 = 0
        scale = _row_scale(tl.max(tl.abs(y), axis=0), MIN_SCALE, INV_FP8_MAX)
        q = _to_fp8(y, scale, FP8_MAX, ROUND_IN_FP32)
        tl.store(out_row + cols, q.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    else:
        amax = tl.zeros([BLOCK_I], dtype=tl.float32)
        for i0 in range(0, I, BLOCK_I):
            cols = i0 + tl.arange(0, BLOCK_I)
            mask = cols < I
            y = _silu_mul(tl.load(x_row + cols, mask=mask, other=0.0),
                          tl.load(x_row + I + cols, mask=mask, other=0.0)).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(y))
        scale = _row_scale(tl.max(amax, axis=0), MIN_SCALE, INV_FP8_MAX)
        num_chunks = tl.cdiv(I, BLOCK_I)
        for j in range(0, num_chunks):  # the same products again, last chunk first: their loads mostly hit L2
            cols = (num_chunks - 1 - j) * BLOCK_I + tl.arange(0, BLOCK_I)
            mask = cols < I
            y = _silu_mul(tl.load(x_row + cols, mask=mask, other=0.0),
                          tl.load(x_row + I + cols, mask=mask, other=0.0)).to(tl.float32)
            q = _to_fp8(y, scale, FP8_MAX, ROUND_IN_FP32)
            tl.store(out_row + cols, q.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(scale_ptr + row, scale)


def _halves(x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """x [..., 2 * I] -> (I, x as rows [num_rows, 2 * I])."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x: last dim {x.shape[-1] if x.dim() else None} must be even (gate and up halves)")
    inter = x.shape[-1] // 2
    return inter, x.reshape(-1, 2 * inter)


def _out_rows(out: torch.Tensor, inter: int) -> torch.Tensor:
    try:
        return out.view(-1, inter)
    except RuntimeError:
        raise ValueError(f"out: strides {out.stride()} do not let the leading dims flatten into rows") from None


def silu_and_mul_triton(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    inter, x2 = _halves(x)
    if out is None:
        out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    check_out("out", out, (*x.shape[:-1], inter), x.dtype, x.device)
    out2 = _out_rows(out, inter)
    if x2.shape[0] == 0 or inter == 0:
        return out
    block_i = min(triton.next_power_of_2(inter), 1024)
    grid = (x2.shape[0], triton.cdiv(inter, block_i))
    _silu_and_mul_kernel[grid](out2, x2, out2.stride(0), x2.stride(0), inter, BLOCK_I=block_i,
                               TRIGGER=PDL_SUPPORTED, num_warps=4)
    return out


def silu_and_mul_quant_fp8_triton(x: torch.Tensor, *, out: torch.Tensor | None = None,
                                  scale: torch.Tensor | None = None,
                                  block_i: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul_triton's rows, quantized per token: x [..., 2 * I] -> (x_q [..., I] float8_e4m3fn,
    scale [..., 1] float32). block_i (a power of two; default by row count, above): the chunk each pass walks the
    row in (tests shrink it)."""
    inter, x2 = _halves(x)
    if block_i is None:
        block_i = QUANT_BLOCK_I_FEW_ROWS if x2.shape[0] <= FEW_ROWS else QUANT_BLOCK_I
    if block_i < 16 or block_i & (block_i - 1):
        raise ValueError(f"block_i={block_i}: must be a power of two >= 16")
    out, scale = fp8_outputs((*x.shape[:-1], inter), x.device, out, scale)
    out2 = _out_rows(out, inter)
    if x2.shape[0] == 0:
        return out, scale
    if inter == 0:
        return out, scale.fill_(MIN_SCALE)  # per_token_quant_fp8's empty rows
    single = inter <= block_i
    block = triton.next_power_of_2(inter) if single else block_i
    _silu_and_mul_quant_fp8_kernel[(x2.shape[0],)](
        out2, scale, x2, out2.stride(0), x2.stride(0), inter, BLOCK_I=block, SINGLE_PASS=single,
        MIN_SCALE=MIN_SCALE, FP8_MAX=FP8_MAX, INV_FP8_MAX=INV_FP8_MAX, ROUND_IN_FP32=interpreting(),
        num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16)
    return out, scale
