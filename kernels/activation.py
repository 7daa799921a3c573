"""SiLU-and-mul: the gated MLP activation, silu(x[..., :I]) * x[..., I:]."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import pdl
from kernels._checks import FLOAT_DTYPES, check_out, check_tensor
from kernels.pdl import PDL_SUPPORTED


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


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
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu rounds to x.dtype
    tl.store(out_ptr + row * stride_out + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x: last dim {x.shape[-1] if x.dim() else None} must be even (gate and up halves)")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if out is None:
        out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    check_out("out", out, (*x.shape[:-1], inter), x.dtype, x.device)
    try:
        out2 = out.view(-1, inter)
    except RuntimeError:
        raise ValueError(f"out: strides {out.stride()} do not let the leading dims flatten into rows") from None
    if x2.shape[0] == 0 or inter == 0:
        return out
    block_i = min(triton.next_power_of_2(inter), 1024)
    grid = (x2.shape[0], triton.cdiv(inter, block_i))
    _silu_and_mul_kernel[grid](out2, x2, out2.stride(0), x2.stride(0), inter, BLOCK_I=block_i,
                               TRIGGER=PDL_SUPPORTED, num_warps=4)
    return out
