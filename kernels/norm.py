"""RMSNorm, alone and fused with the residual add.

One program normalizes one row: it loads the row once (BLOCK_N >= hidden), reduces the mean square in float32,
and writes the row back, rounding exactly where the reference rounds (to x.dtype before the weight multiply).

The residual of fused_add_rms_norm may be float32 beside 16-bit x: the model keeps its residual stream in float32
(rounding it to bf16 after each of the 2 x num_layers adds was the largest part of the bf16 engine's logits error),
while the normalized output stays in x's dtype for the next matmul.

The *_quant_fp8 variants hand an fp8 GEMM its input directly (engine/fp8_fusion.py): the row, rounded to x's dtype
exactly as the plain kernel stores it, is quantized per token in registers (kernels/quant_fp8.py's arithmetic), so
the kernel writes x_q [rows, N] float8_e4m3fn and scale [rows, 1] float32, bit for bit what the plain kernel and
per_token_quant_fp8 write in two launches, and the 16-bit row never goes to memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels._checks import FLOAT_DTYPES, FP8_MAX, check_out, check_same_device, check_tensor, interpreting
from kernels.pdl import PDL_SUPPORTED
from kernels.quant_fp8 import INV_FP8_MAX, MIN_SCALE, _row_scale, _to_fp8, fp8_outputs, per_token_quant_fp8_ref


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, act_dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
    """act_dtype (default x.dtype): the activation dtype the normalized row is rounded to before the weight."""
    act_dtype = act_dtype or x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf.to(act_dtype) * weight) if act_dtype != torch.float32 else xf * weight


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual, in residual's dtype (x.dtype, or float32 beside 16-bit x); returns
    (rms_norm(residual) rounded like x, residual)."""
    residual = x + residual if residual.dtype == x.dtype else x.to(residual.dtype) + residual
    return rms_norm_ref(residual, weight, eps, x.dtype), residual


def rms_norm_quant_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_ref, then per_token_quant_fp8_ref of its rows: (x_q [..., N] float8_e4m3fn, scale [..., 1])."""
    return per_token_quant_fp8_ref(rms_norm_ref(x, weight, eps))


def fused_add_rms_norm_quant_fp8_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm_ref, then per_token_quant_fp8_ref of the normalized rows: (x_q, scale, residual)."""
    y, residual = fused_add_rms_norm_ref(x, residual, weight, eps)
    return (*per_token_quant_fp8_ref(y), residual)


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_rows, N] x's dtype (or the weight's, if wider), float8_e4m3fn when QUANT
    scale_ptr,  # [num_rows] float32 (only when QUANT)
    res_out_ptr,  # [num_rows, N] x + residual, in the residual's dtype (only when HAS_RESIDUAL)
    x_ptr,  # [num_rows, N]
    res_ptr,  # [num_rows, N] x's dtype or float32 (only when HAS_RESIDUAL)
    w_ptr,  # [N]
    stride_out,
    stride_res_out,
    stride_x,
    stride_res,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TRIGGER: tl.constexpr,  # let a programmatic dependent (the W4A16 GEMV) start its weight loads now
    QUANT: tl.constexpr,  # write the row as fp8 with its per-token scale (weight in x's dtype)
    MIN_SCALE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,  # the interpreter's float -> fp8 conversion is inexact (kernels/kv_write.py)
):
    if TRIGGER:
        pdl.launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    act_dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # rounded like the reference's x + residual: to the residual's dtype (a float32 residual is not rounded)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=mask)
        xf = s.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * rstd).to(act_dtype).to(tl.float32)  # the reference rounds to x.dtype before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if QUANT:
        y = (y * w).to(act_dtype).to(tl.float32)  # the row as the plain kernel stores it; masked lanes are 0
        scale = _row_scale(tl.max(tl.abs(y), axis=0), MIN_SCALE, INV_FP8_MAX)
        q = _to_fp8(y, scale, FP8_MAX, ROUND_IN_FP32)
        tl.store(out_ptr + row * stride_out + cols, q.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_out + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(name: str, t: torch.Tensor, n: int, *, view: bool = False) -> torch.Tensor:
    """[..., n] -> [rows, n]: a view (inputs may be copied when the leading dims cannot be flattened)."""
    if t.shape[-1] != n:
        raise ValueError(f"{name}: last dim {t.shape[-1]}, expected hidden size {n} (weight.shape[0])")
    if not view:
        return t.reshape(-1, n)
    try:
        return t.view(-1, n)
    except RuntimeError:
        raise ValueError(f"{name}: strides {t.stride()} do not let the leading dims flatten into rows") from None


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    out: torch.Tensor | None, residual_out: torch.Tensor | None, quant: bool = False,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(out, residual_out or None, scale [..., 1] or None); with `quant`, out is x_q in float8_e4m3fn."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES)
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype, torch.float32), shape=tuple(x.shape))
        check_same_device(x=x, residual=residual, weight=weight)
    else:
        check_same_device(x=x, weight=weight)
    if not eps > 0:
        raise ValueError(f"eps={eps}: must be > 0")
    n = weight.shape[0]
    block_n = triton.next_power_of_2(n)
    if block_n > 65536:
        raise ValueError(f"weight: hidden size {n} > 65536, the largest row one program holds")
    x2 = _as_rows("x", x, n)
    if quant:
        if weight.dtype != x.dtype:
            raise ValueError(f"weight: dtype {weight.dtype}, the fp8 variant needs x's dtype {x.dtype}")
        out, scale = fp8_outputs(tuple(x.shape), x.device, out, scale)
    else:
        out_dtype = x.dtype if x.dtype == torch.float32 else torch.promote_types(x.dtype, weight.dtype)
        if out is None:
            out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        check_out("out", out, tuple(x.shape), out_dtype, x.device)
    out2 = _as_rows("out", out, n, view=True)
    if residual is not None:
        r2 = _as_rows("residual", residual, n)
        res_out = torch.empty(x.shape, dtype=residual.dtype, device=x.device) if residual_out is None else residual_out
        check_out("residual_out", res_out, tuple(x.shape), residual.dtype, x.device)
        res_out2 = _as_rows("residual_out", res_out, n, view=True)
    else:
        r2 = res_out2 = x2  # unused
        res_out = None
    if x2.shape[0] == 0:
        return out, res_out, scale
    num_warps = 4 if block_n <= 2048 else 8 if block_n <= 8192 else 16
    _rms_norm_kernel[(x2.shape[0],)](
        out2, out2 if scale is None else scale, res_out2, x2, r2, weight,
        out2.stride(0), res_out2.stride(0), x2.stride(0), r2.stride(0),
        n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, TRIGGER=PDL_SUPPORTED, QUANT=quant,
        MIN_SCALE=MIN_SCALE, FP8_MAX=FP8_MAX, INV_FP8_MAX=INV_FP8_MAX, ROUND_IN_FP32=quant and interpreting(),
        num_warps=num_warps,
    )
    return out, res_out, scale


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    return _launch_rms_norm(x, None, weight, eps, out, None)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
    out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual (in residual's dtype: x's, or float32 beside 16-bit x); returns (rms_norm(residual)
    rounded like x, residual). Out of place like the reference unless out / residual_out are given
    (residual_out=residual, out=x make it in place)."""
    out, res, _ = _launch_rms_norm(x, residual, weight, eps, out, residual_out)
    assert res is not None
    return out, res


def rms_norm_quant_fp8_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_triton's row, quantized per token: (x_q [..., N] float8_e4m3fn, scale [..., 1] float32). The weight
    has x's dtype."""
    out, _, scale = _launch_rms_norm(x, None, weight, eps, out, None, quant=True, scale=scale)
    return out, scale


def fused_add_rms_norm_quant_fp8_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
    out: torch.Tensor | None = None, scale: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm_triton with its normalized row quantized per token: (x_q, scale [..., 1], residual).
    residual_out=residual makes the add in place; the weight has x's dtype."""
    out, res, scale = _launch_rms_norm(x, residual, weight, eps, out, residual_out, quant=True, scale=scale)
    assert res is not None
    return out, scale, res
