"""RMSNorm, alone and fused with the residual add."""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf.to(x.dtype) * weight) if x.dtype != torch.float32 else xf * weight


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual; returns (rms_norm(residual), residual)."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual
