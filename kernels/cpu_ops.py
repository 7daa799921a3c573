"""CPU fast paths of the elementwise ops, for float32 tensors: one fused torch op where the reference takes several
passes, no new buffer where one can be reused. Each gives its reference's result (tests/kernels/test_cpu_ops.py).

On one core at a 2,048-token prefill step of SmolLM2 (bench/RESULTS.md, "CPU: Tandem beside vLLM"): rms_norm_ref
takes six passes over [2048, 576] (8.9 ms) where F.rms_norm takes one (3.0 ms); silu_and_mul_ref allocates the
product of silu(gate) and up (28.7 ms) where multiplying into silu's own output does not (7.4 ms). 61 norms and 30
MLPs a step: ~1 s of a ~9 s step. The kernels/*.py references stay the contract.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def cpu_fast(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fused_add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual (both float32); returns (rms_norm(residual), residual)."""
    residual = x + residual
    return F.rms_norm(residual, (residual.shape[-1],), weight, eps), residual


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:  # [..., 2 * I] -> [..., I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
