"""kernels/norm.py: rms_norm and fused_add_rms_norm against their references."""
from __future__ import annotations

import pytest
import torch

from kernels.norm import fused_add_rms_norm_ref, fused_add_rms_norm_triton, rms_norm_ref, rms_norm_triton

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def rand(*shape, dtype):
    return (torch.randn(*shape) * 2 + 0.5).to(dtype).to(DEVICE)


def nan_like(t, dtype=None):
    return torch.full(t.shape, float("nan"), dtype=dtype or t.dtype, device=t.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 96), (1, 3584)] if not ON_CUDA else [(300, 3584), (2, 9, 4096)])
def test_rms_norm(dtype, shape):
    x, w = rand(*shape, dtype=dtype), rand(shape[-1], dtype=dtype)
    out = rms_norm_triton(x, w, 1e-6, out=nan_like(x))
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6), atol=ATOL[dtype], rtol=ATOL[dtype])


def test_rms_norm_mixed_weight_dtype_and_strided_rows():
    # bf16 activations with an fp32 weight promote to fp32 like the reference; rows with a gap between them.
    big = rand(6, 200, dtype=torch.bfloat16)
    x, w = big[:, :128], rand(128, dtype=torch.float32)
    out = rms_norm_triton(x, w, 1e-5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-5), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_fused_add_rms_norm(dtype, in_place):
    n = 3584 if ON_CUDA else 160
    x, r, w = rand(11, n, dtype=dtype), rand(11, n, dtype=dtype), rand(n, dtype=dtype)
    ref_out, ref_res = fused_add_rms_norm_ref(x, r, w, 1e-6)
    if in_place:
        out, res = fused_add_rms_norm_triton(x, r, w, 1e-6, out=x, residual_out=r)
        assert out.data_ptr() == x.data_ptr() and res.data_ptr() == r.data_ptr()
    else:
        out, res = fused_add_rms_norm_triton(x, r, w, 1e-6, out=nan_like(x), residual_out=nan_like(r))
    # The add rounds like torch's: exact, except that the interpreter truncates float32 -> bf16 (1 ulp).
    ulp = 2**-7 if dtype == torch.bfloat16 and not ON_CUDA else 0.0
    torch.testing.assert_close(res, ref_res, atol=0, rtol=ulp)
    torch.testing.assert_close(out, ref_out, atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_add_rms_norm_float32_residual(dtype):
    # The model's residual stream: float32 beside 16-bit x. The sum is not rounded to x's dtype (it equals the
    # float32 add exactly); the normalized output is x's dtype, rounded like the reference.
    n = 3584 if ON_CUDA else 160
    x, w = rand(13, n, dtype=dtype), rand(n, dtype=dtype)
    r = rand(13, n, dtype=torch.float32) + 1e-3 * torch.rand(13, n, device=DEVICE)  # not representable in x's dtype
    ref_out, ref_res = fused_add_rms_norm_ref(x, r, w, 1e-6)
    assert ref_res.dtype == torch.float32 and ref_out.dtype == dtype
    out, res = fused_add_rms_norm_triton(x, r, w, 1e-6, out=nan_like(x), residual_out=nan_like(r))
    torch.testing.assert_close(res, x.float() + r, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=ATOL[dtype], rtol=ATOL[dtype])
    assert not torch.equal(res, res.to(dtype).float()), "the residual was rounded to x's dtype"


def test_bad_arguments_name_the_argument():
    x, w = rand(4, 64, dtype=torch.float32), rand(64, dtype=torch.float32)
    with pytest.raises(ValueError, match="x: last dim 64, expected hidden size 32"):
        rms_norm_triton(x, w[:32], 1e-6)
    with pytest.raises(ValueError, match="eps=0"):
        rms_norm_triton(x, w, 0.0)
    with pytest.raises(ValueError, match="residual: dtype"):
        fused_add_rms_norm_triton(x, x.half(), w, 1e-6)
    with pytest.raises(ValueError, match="residual_out: dtype"):
        fused_add_rms_norm_triton(x.half(), x, w.half(), 1e-6, residual_out=x.half())
    with pytest.raises(ValueError, match="out: shape"):
        rms_norm_triton(x, w, 1e-6, out=x[:2])


@cuda_only
def test_rows_past_int32_offsets():
    x = torch.randn(600_000, 3584, dtype=torch.bfloat16, device="cuda")
    assert x.numel() > 2**31
    w = torch.randn(3584, dtype=torch.bfloat16, device="cuda")
    out = rms_norm_triton(x, w, 1e-6)
    torch.testing.assert_close(out[-5:], rms_norm_ref(x[-5:], w, 1e-6), atol=2e-2, rtol=2e-2)
