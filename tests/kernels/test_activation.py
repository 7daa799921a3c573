"""kernels/activation.py: silu_and_mul against its reference."""
from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul_ref, silu_and_mul_triton

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
