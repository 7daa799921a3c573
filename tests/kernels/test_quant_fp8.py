"""kernels/quant_fp8.py: per-token fp8 quantization against its reference (equal bytes and scales)."""
from __future__ import annotations

import pytest
import torch

from kernels._checks import FP8_MAX
from kernels.quant_fp8 import MIN_SCALE, SINGLE_PASS_MAX, per_token_quant_fp8_ref, per_token_quant_fp8_triton

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
# Both passes on the CPU (the interpreter is slow); on the GPU Qwen2.5-7B's four input widths and odd ones.
SHAPES = ([(3, 100), (2, SINGLE_PASS_MAX + 37)] if not ON_CUDA else
          [(1, 3584), (257, 3584), (300, 18944), (5, SINGLE_PASS_MAX), (7, SINGLE_PASS_MAX + 1), (33, 77)])


def assert_same(x: torch.Tensor) -> None:
    q, s = per_token_quant_fp8_triton(x)
    q_ref, s_ref = per_token_quant_fp8_ref(x)
    assert q.shape == x.shape and s.shape == (x.shape[0], 1)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    # Equal values (compare as floats: -0 and +0 may differ in sign bit only where the input rounds to zero).
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(dtype, shape):
    g = torch.Generator().manual_seed(0)
    # Rows of very different magnitudes: each gets its own scale.
    x = torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[0])[:, None]
    assert_same(x.to(dtype).to(DEVICE))


def test_scale_maps_row_amax_to_448_and_zero_rows_stay_finite():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [3e-3, 1e4, -1e4, 7.0]], device=DEVICE)
    q, s = per_token_quant_fp8_triton(x)
    assert s[0, 0].item() == pytest.approx(2.0 / FP8_MAX) and q[0, 1].float().item() == -FP8_MAX
    assert s[1, 0].item() == pytest.approx(MIN_SCALE) and (q[1].float() == 0).all()
    assert q[2, 1].float().item() == FP8_MAX and q[2, 2].float().item() == -FP8_MAX
    assert torch.isfinite(q.float()).all()
    # Round trip: relative error of each row at most half an e4m3 ulp (2**-4) of its largest element.
    err = (q.float() * s - x).abs().amax(dim=1)
    assert (err <= 2.0 ** -4 * x.abs().amax(dim=1) + 1e-30).all(), err


def test_strided_rows_and_caller_buffers():
    big = torch.randn(4, 300, device=DEVICE)
    x = big[:, :256]
    out = torch.empty(4, 256, dtype=torch.float8_e4m3fn, device=DEVICE)
    scale = torch.empty(4, 1, device=DEVICE)
    q, s = per_token_quant_fp8_triton(x, out=out, scale=scale)
    assert q is out and s is scale
    assert_same(x)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="x: has 3 dims"):
        per_token_quant_fp8_triton(torch.randn(2, 3, 16, device=DEVICE))
    with pytest.raises(ValueError, match="x: dtype"):
        per_token_quant_fp8_triton(torch.ones(2, 16, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="out: dtype"):
        per_token_quant_fp8_triton(torch.randn(2, 16, device=DEVICE), out=torch.empty(2, 16, device=DEVICE))
    with pytest.raises(ValueError, match=r"scale: shape \(2,\)"):
        per_token_quant_fp8_triton(torch.randn(2, 16, device=DEVICE), scale=torch.empty(2, device=DEVICE))


@cuda_only
def test_rows_past_int32_offsets():
    x = torch.randn(120_000, 18944, dtype=torch.bfloat16, device="cuda")
    assert x.numel() > 2**31
    q, s = per_token_quant_fp8_triton(x)
    q_ref, s_ref = per_token_quant_fp8_ref(x[-3:])
    torch.testing.assert_close(s[-3:], s_ref, rtol=0, atol=0)
    torch.testing.assert_close(q[-3:].float(), q_ref.float(), rtol=0, atol=0)
