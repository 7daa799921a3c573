"""RMSNorm, alone and fused with the residual add.

One program normalizes one row: it loads the row once (BLOCK_N >= hidden), reduces the mean square in float32,
and writes the row back, rounding exactly where the reference rounds (to x.dtype before the weight multiply).

The residual of fused_add_rms_norm may be float32 beside 16-bit x: the model keeps its residual stream in float32
(rounding it to bf16 after each of the 2 x num_layers adds was the largest part of the bf16 engine's logits error),
while the normalized output stays in x's dtype for the next matmul.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels._checks import FLOAT_DTYPES, check_out, check_same_device, check_tensor
from kernels.pdl import PDL_SUPPORTED


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


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_rows, N]
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
    out: torch.Tensor | None, residual_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        return out, res_out
    num_warps = 4 if block_n <= 2048 else 8 if block_n <= 8192 else 16
    _rms_norm_kernel[(x2.shape[0],)](
        out2, res_out2, x2, r2, weight,
        out2.stride(0), res_out2.stride(0), x2.stride(0), r2.stride(0),
        n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, TRIGGER=PDL_SUPPORTED, num_warps=num_warps,
    )
    return out, res_out


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
    out, res = _launch_rms_norm(x, residual, weight, eps, out, residual_out)
    assert res is not None
    return out, res
