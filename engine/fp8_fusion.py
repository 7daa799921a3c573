"""The kernels that produce an fp8 linear's input quantize it themselves: applied from outside the plain model.

With fp8 weights and per-token activation scales (engine/quant.py Fp8Linear), qkv_proj's and gate_up_proj's input
comes from an RMSNorm and down_proj's from SiLU-and-mul; unfused, each writes its rows in 16 bits, and the linear's
per_token_quant_fp8 reads them back to write fp8 and scales. Here the norm and the activation write the fp8 rows
and scales directly (kernels/norm.py rms_norm_quant_fp8 / fused_add_rms_norm_quant_fp8, kernels/activation.py
silu_and_mul_quant_fp8), bit for bit what the two launches write.

The life of a forward through a fused layer:
1. at build (engine/loader.py build_model, after fuse_projections), `fuse_fp8_input_quant` reads
   TANDEM_FUSED_FP8_QUANT once and, where it allows, swaps each decoder layer's input_layernorm (consumer
   qkv_proj), post_attention_layernorm (consumer gate_up_proj) and mlp (down_proj) for the classes below, wherever
   that consumer is an Fp8Linear with per-token input scales; the weights stay the same Parameters, under the same
   names;
2. each forward asks the consumer whether it would quantize this input (Fp8Linear.quantizes_input: shapes only, so
   CUDA graphs capture either branch). If so, the fused kernel runs and the consumer gets a QuantizedActivation
   (x_q, scale, dtype), which Fp8Linear multiplies as it is; if not (decode at batch <= 16, where the fp8 GEMV reads
   16-bit x), the plain kernel runs and x goes on as before.
Static input scales, 16-bit or 4-bit linears and tensor-parallel down_proj (a RowParallelLinear) are left alone.
"""
from __future__ import annotations

import os

import torch
from torch import nn

import kernels
from engine.model import MLP, RMSNorm
from engine.quant import Fp8Linear, QuantizedActivation

FUSED_FP8_QUANT_ENV = "TANDEM_FUSED_FP8_QUANT"


def fused_fp8_quant_enabled(device: torch.device) -> bool:
    """TANDEM_FUSED_FP8_QUANT=0|1: whether the fused kernels feed the fp8 linears (default 1 on CUDA, 0 elsewhere:
    the CPU keeps its own kernels unless a test forces it, then the references run). Set it to 0 for the A/B
    against the unfused pair (bench/profile_decode.py, bench/kernels.py)."""
    value = os.environ.get(FUSED_FP8_QUANT_ENV)
    if value is None:
        return device.type == "cuda"
    if value not in ("0", "1"):
        raise ValueError(f"{FUSED_FP8_QUANT_ENV}={value!r}: must be 0 or 1 (unset: 1 on CUDA)")
    return value == "1"


def _per_token(linear: nn.Module | None) -> Fp8Linear | None:
    """`linear` if it is an Fp8Linear that quantizes its input per token, else None."""
    return linear if isinstance(linear, Fp8Linear) and linear.input_scale is None else None


class Fp8InputRMSNorm(RMSNorm):
    """RMSNorm whose output feeds one Fp8Linear: a QuantizedActivation when that linear would quantize it."""

    def __init__(self, norm: RMSNorm, consumer: Fp8Linear):
        nn.Module.__init__(self)
        self.weight = norm.weight
        self.eps = norm.eps
        # A bound method, not the module: the linear stays registered once, under its own name.
        self.quantizes_input = consumer.quantizes_input

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.weight.dtype != x.dtype or not self.quantizes_input(x):
            return super().forward(x, residual)
        if residual is None:
            return QuantizedActivation(*kernels.rms_norm_quant_fp8(x, self.weight, self.eps), x.dtype)
        x_q, scale, residual = kernels.fused_add_rms_norm_quant_fp8(x, residual, self.weight, self.eps)
        return QuantizedActivation(x_q, scale, x.dtype), residual


class Fp8InputMLP(nn.Module):
    """The fused MLP whose down_proj is an Fp8Linear: SiLU-and-mul hands it a QuantizedActivation when it would
    quantize its input."""

    def __init__(self, mlp: MLP):
        super().__init__()
        assert mlp.gate_up_proj is not None and isinstance(mlp.down_proj, Fp8Linear), mlp
        self.gate_up_proj = mlp.gate_up_proj
        self.down_proj = mlp.down_proj

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * I]
        if not self.down_proj.quantizes_input(gate_up):
            return self.down_proj(kernels.silu_and_mul(gate_up))
        return self.down_proj(QuantizedActivation(*kernels.silu_and_mul_quant_fp8(gate_up), gate_up.dtype))


def fuse_fp8_input_quant(model: nn.Module, device: torch.device) -> int:
    """Step 1 above, in place, on a fused model (fuse_projections done); returns how many modules were swapped
    (0 when TANDEM_FUSED_FP8_QUANT turns it off or no linear quantizes its input per token)."""
    if not fused_fp8_quant_enabled(device):
        return 0
    swapped = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for norm_name, consumer in (("input_layernorm", _per_token(attn.qkv_proj)),
                                    ("post_attention_layernorm", _per_token(mlp.gate_up_proj))):
            norm = getattr(layer, norm_name)
            if consumer is not None and type(norm) is RMSNorm:
                setattr(layer, norm_name, Fp8InputRMSNorm(norm, consumer))
                swapped += 1
        if type(mlp) is MLP and mlp.gate_up_proj is not None and _per_token(mlp.down_proj) is not None:
            layer.mlp = Fp8InputMLP(mlp)
            swapped += 1
    return swapped
