"""kernels/activation.py: silu_and_mul against its reference."""
from __future__ import annotations

import pytest
import torch

from kernels.activation import (QUANT_BLOCK_I, silu_and_mul_quant_fp8_ref, silu_and_mul_quant_fp8_triton,
                                silu_and_mul_ref, silu_and_mul_triton)
from kernels.quant_fp8 import MIN_SCALE, per_token_quant_fp8_ref
from tests.kernels.test_norm import assert_same_fp8

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 2 * 96), (2, 3, 2 * 1100)] if not ON_CUDA else [(256, 2 * 18944), (3, 2 * 77)])
def test_silu_and_mul(dtype, shape):
    x = (torch.randn(*shape) * 4).to(dtype).to(DEVICE)
    out = torch.full((*shape[:-1], shape[-1] // 2), float("nan"), dtype=dtype, device=DEVICE)
    silu_and_mul_triton(x, out=out)
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=ATOL[dtype], rtol=ATOL[dtype])


def test_strided_rows():
    big = torch.randn(4, 300, device=DEVICE)
    x = big[:, :256]
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), atol=1e-5, rtol=1e-5)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="x: last dim 7 must be even"):
        silu_and_mul_triton(torch.randn(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="x: dtype"):
        silu_and_mul_triton(torch.ones(2, 8, dtype=torch.int32, device=DEVICE))


@cuda_only
def test_rows_past_int32_offsets():
    x = torch.randn(80_000, 2 * 14336, dtype=torch.bfloat16, device="cuda")
    assert x.numel() > 2**31
    out = silu_and_mul_triton(x)
    torch.testing.assert_close(out[-3:], silu_and_mul_ref(x[-3:]), atol=2e-2, rtol=2e-2)


# --- silu_and_mul, then per-token fp8 quantization, in one launch ------------------------------------------------

# (shape, block_i): one chunk (the row in registers), and rows walked in chunks, the last one partial; None: the
# launcher's choice by row count. On the GPU Llama-3-8B's and Qwen2.5-7B's intermediate sizes at decode-like and
# prefill-like row counts, each chunk width.
QUANT_CASES = ([((5, 2 * 96), None), ((2, 3, 2 * 1100), 256), ((3, 2 * 100), 16), ((4, 2 * 128), 32)]
               if not ON_CUDA else
               [((17, 2 * 14336), None), ((17, 2 * 14336), QUANT_BLOCK_I), ((300, 2 * 14336), None),
                ((256, 2 * 18944), None), ((257, 2 * 18944), None), ((64, 2 * 18944), 1024), ((3, 2 * 77), None),
                ((9, 2 * 1536), None)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,block_i", QUANT_CASES)
def test_silu_and_mul_quant_fp8(dtype, shape, block_i):
    # Bit for bit the unfused pair (silu_and_mul_triton, then per_token_quant_fp8); rows of different magnitudes.
    x = (torch.randn(*shape) * 4 * torch.logspace(-2, 0.5, shape[-2])[:, None]).to(dtype).to(DEVICE)  # fp16: no inf
    q, scale = silu_and_mul_quant_fp8_triton(x, block_i=block_i)
    assert_same_fp8(q, scale, *per_token_quant_fp8_ref(silu_and_mul_triton(x)))
    # Against the plain-torch composition: within half an e4m3 ulp of each row's amax plus the 16-bit products' own
    # tolerance (the kernel's exp and its rounding to x's dtype may differ from torch's by an ulp).
    y_ref = silu_and_mul_ref(x).float()
    amax = y_ref.abs().amax(-1)
    err = (q.float() * scale - y_ref).abs().amax(-1)
    assert (err <= (2.0**-4 + ATOL[dtype]) * amax + 1e-30).all(), (err / amax).max()


def test_silu_and_mul_quant_fp8_zero_rows_strided_rows_and_caller_buffers():
    # A zero row has amax 0: scale MIN_SCALE and zeros, exactly as the composition of references has it.
    big = torch.randn(4, 300, dtype=torch.bfloat16, device=DEVICE)
    x = big[:, :200]
    x[2] = 0
    out = torch.empty(4, 100, dtype=torch.float8_e4m3fn, device=DEVICE)
    scale = torch.empty(4, 1, device=DEVICE)
    q, s = silu_and_mul_quant_fp8_triton(x, out=out, scale=scale, block_i=32)
    assert q is out and s is scale
    assert_same_fp8(q, s, *per_token_quant_fp8_ref(silu_and_mul_triton(x)))
    assert s[2, 0].item() == torch.tensor(MIN_SCALE).item() and (q[2].float() == 0).all()
    q_ref, s_ref = silu_and_mul_quant_fp8_ref(x)
    assert_same_fp8(q[2:3], s[2:3], q_ref[2:3], s_ref[2:3])


def test_silu_and_mul_quant_fp8_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="x: last dim 7 must be even"):
        silu_and_mul_quant_fp8_triton(torch.randn(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="block_i=48: must be a power of two"):
        silu_and_mul_quant_fp8_triton(torch.randn(2, 8, device=DEVICE), block_i=48)
    with pytest.raises(ValueError, match="out: dtype"):
        silu_and_mul_quant_fp8_triton(torch.randn(2, 8, device=DEVICE), out=torch.empty(2, 4, device=DEVICE))


@cuda_only
def test_silu_and_mul_quant_fp8_rows_past_int32_offsets():
    x = torch.randn(80_000, 2 * 14336, dtype=torch.bfloat16, device="cuda")
    assert x.numel() > 2**31
    q, s = silu_and_mul_quant_fp8_triton(x)
    assert_same_fp8(q[-3:], s[-3:], *per_token_quant_fp8_ref(silu_and_mul_triton(x[-3:])))
