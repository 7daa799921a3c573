"""Online fp8 quantization (`--quantization fp8`), applied from outside the plain model after loading.

What `quantize_model(model, "fp8")` does, once, after load_weights and fuse_projections:
1. every nn.Linear of the decoder layers (qkv_proj, o_proj, gate_up_proj, down_proj) becomes an Fp8Linear: its
   weight W [N, K] is stored as float8_e4m3fn with one float32 scale per output channel (W[n] ~ W_q[n] * s_w[n],
   s_w[n] = amax|W[n]| / 448), and the 16-bit weight is freed (Qwen2.5-7B's 13.1 GB of bf16 layer weights become
   6.5 GB); embeddings, lm_head and norms keep the model dtype;
2. each forward quantizes its input per token (x[m] ~ x_q[m] * s_x[m], s_x[m] = amax|x[m]| / 448, computed on the
   fly: kernels/quant_fp8.py) and runs one fp8 GEMM, torch._scaled_mm(x_q, W_q^T, s_x [M, 1], s_w [1, N]) with the
   bias and the model dtype's output fused in: Hopper's fp8 tensor cores run at twice the bf16 rate, and a decode
   step reads half the weight bytes.

At batch 1..16 (x with at most as many rows as kernels/gemv.py's CONFIGS_FP8 holds for this weight's (N, K), on
CUDA), step 2 is the fp8-weight GEMV instead: x stays 16-bit, each fp8 weight is converted exactly and multiplied in
float32, y = (x @ W_q^T) * s_w + b. There the step reads the weights (half of bf16's bytes) and little else;
_scaled_mm is poor at M=1, and the activation quantizer costs a launch per linear.

On the CPU (tests) the same quantized operands are multiplied in float32: (x_q @ W_q^T) * s_x * s_w + b, the math
of the GPU's GEMM but for its accumulation order. The forward has no host syncs, so CUDA graphs capture it.
Accuracy: docs/quantization.md.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import QUANTIZATION_METHODS
from kernels._checks import FP8_DTYPE
from kernels.gemv import MAX_M, gemv_triton, table_config
from kernels.quant_fp8 import per_token_quant_fp8_ref, per_token_quant_fp8_triton

FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with fp8 tensor cores
# Hopper's fp8 MMA accumulates in fewer than 32 bits unless the kernel promotes partial sums itself; fast accumulation
# skips that promotion (vLLM's CUTLASS fp8 kernels do the same). bench/fp8_gemm.py times both.
FP8_FAST_ACCUM = True


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (w_q [N, K] float8_e4m3fn, scale [N, 1] float32) with w ~ w_q * scale, one scale per row: the
    activations' per-token rule, applied to the weight's output channels."""
    return per_token_quant_fp8_ref(w)


def fp8_linear_ref(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(x_q @ w_q^T) * x_scale * w_scale (+ bias) in float32, rounded to out_dtype once.
    x_q [M, K], x_scale [M, 1], w_q [N, K], w_scale [1, N] -> [M, N]."""
    y = torch.mm(x_q.float(), w_q.float().t()) * x_scale * w_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def scaled_mm_fp8(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype, use_fast_accum: bool = FP8_FAST_ACCUM
                  ) -> torch.Tensor:
    """The same product through torch._scaled_mm (row-wise scaling): mat1 row-major [M, K], mat2 column-major [K, N]
    (w_q [N, K] contiguous, transposed as a view), scale_a [M, 1] and scale_b [1, N] contiguous float32, K and N
    multiples of 16; the bias has out_dtype."""
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


class Fp8Linear(nn.Module):
    """y = x W^T + b with W in float8_e4m3fn (a float32 scale per output channel), x quantized per token (or, at the
    row counts CONFIGS_FP8 holds, x unquantized through the fp8-weight GEMV)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        assert weight.dtype == FP8_DTYPE and weight.dim() == 2, (weight.dtype, weight.shape)
        self.out_features, self.in_features = weight.shape
        # [N, K] contiguous: weight.t() is the column-major [K, N] operand torch._scaled_mm wants, with no copy.
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale.float().reshape(1, self.out_features).contiguous(),
                                         requires_grad=False)  # [1, N]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)  # [N], model dtype

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        w_q, scale = quantize_weight_fp8(linear.weight)
        return cls(w_q, scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        M = x2.shape[0]
        cfg = (table_config(M, self.out_features, self.in_features, fp8=True)
               if x.is_cuda and 0 < M <= MAX_M and x.dtype != torch.float32 else None)
        if cfg is not None:  # small M: read the fp8 weights once, x unquantized (no quantizer launch)
            y = gemv_triton(x2, self.weight, self.bias, weight_scale=self.weight_scale, config=cfg)
        elif x.is_cuda:
            x_q, x_scale = per_token_quant_fp8_triton(x2)
            y = scaled_mm_fp8(x_q, x_scale, self.weight, self.weight_scale, self.bias, x.dtype)
        else:
            x_q, x_scale = per_token_quant_fp8_ref(x2)
            y = fp8_linear_ref(x_q, x_scale, self.weight, self.weight_scale, self.bias, x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)  # [..., N]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def check_fp8_support(device: torch.device, dtype: torch.dtype) -> None:
    """Raises ValueError naming what is missing when this device and model dtype cannot run the fp8 GEMM."""
    if device.type != "cuda":
        return
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"quantization='fp8' with dtype={str(dtype).removeprefix('torch.')}: on CUDA the fp8 GEMM "
                         "(torch._scaled_mm) writes bfloat16 or float16 (with their bias); use --dtype bfloat16")
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < FP8_MIN_CAPABILITY:
        raise ValueError(f"quantization='fp8': {torch.cuda.get_device_name(device)} ({device}) is sm_{cap[0]}{cap[1]}; "
                         f"fp8 GEMMs need compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} "
                         "(Ada, Hopper or newer); drop --quantization")
    if not hasattr(torch, "_scaled_mm"):
        raise ValueError(f"quantization='fp8': torch {torch.__version__} has no torch._scaled_mm")


def _check_shape(name: str, linear: nn.Linear) -> None:
    n, k = linear.weight.shape
    if n % 16 or k % 16:
        raise ValueError(f"quantization='fp8': {name} has weight [{n}, {k}]; the fp8 GEMM on CUDA needs both "
                         "dimensions to be multiples of 16")


@torch.no_grad()
def quantize_model(model: nn.Module, method: str | None) -> nn.Module:
    """Replaces every nn.Linear of model.model.layers by its quantized form, in place; None leaves the model as is."""
    if method is None:
        return model
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={method!r}: must be one of None, {', '.join(QUANTIZATION_METHODS)}")
    layers = model.model.layers
    names = [name for name, module in layers.named_modules() if isinstance(module, nn.Linear)]
    if not names:
        return model
    first = layers.get_submodule(names[0]).weight
    check_fp8_support(first.device, first.dtype)
    device = first.device
    del first
    if device.type == "cuda":  # all checked before any is replaced: an error leaves the model whole
        for name in names:
            _check_shape(f"model.layers.{name}", layers.get_submodule(name))
    for name in names:  # one layer at a time: each 16-bit weight goes back to the allocator once replaced
        parent_name, _, attr = name.rpartition(".")
        parent = layers.get_submodule(parent_name)
        setattr(parent, attr, Fp8Linear.from_linear(getattr(parent, attr)))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model
