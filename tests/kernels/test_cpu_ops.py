"""kernels/cpu_ops.py: the CPU fast paths against their references (float32), and the dispatch choosing them."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels.activation import silu_and_mul_ref
from kernels.cpu_ops import fused_add_rms_norm_cpu, rms_norm_cpu, silu_and_mul_cpu
from kernels.norm import fused_add_rms_norm_ref, rms_norm_ref


@pytest.mark.parametrize("rows", [1, 16, 2048])
@pytest.mark.parametrize("width", [64, 576, 4096])
def test_norms_match_reference(rows, width):
    g = torch.Generator().manual_seed(rows + width)
    x, r, w = (torch.randn(rows, width, generator=g) * 3, torch.randn(rows, width, generator=g),
               torch.randn(width, generator=g))
    torch.testing.assert_close(rms_norm_cpu(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), atol=1e-6, rtol=1e-6)
    got, ref = fused_add_rms_norm_cpu(x, r, w, 1e-6), fused_add_rms_norm_ref(x, r, w, 1e-6)
    torch.testing.assert_close(got[0], ref[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(got[1], ref[1])
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_silu_and_mul_matches_reference(rows):
    x = torch.randn(rows, 2 * 96, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(silu_and_mul_cpu(x), silu_and_mul_ref(x))
    assert torch.equal(kernels.silu_and_mul(x), silu_and_mul_ref(x))


def test_other_dtypes_keep_the_reference():
    x, w = torch.randn(4, 64).bfloat16(), torch.randn(64).bfloat16()
    assert torch.equal(kernels.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
    r = torch.randn(4, 64)  # float32 residual beside bf16 activations
    out, res = kernels.fused_add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_res = fused_add_rms_norm_ref(x, r, w, 1e-5)
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
