"""kernels/w4a16_tc.py: the accumulating W4A16 GEMM (both operand orders, both unpackings, split-K) and the
dequantize-then-matmul path against kernels.w4a16.w4a16_ref."""
from __future__ import annotations

import pytest
import torch

from kernels.w4a16 import dequantize_w4_ref, w4a16_ref
from kernels.w4a16_tc import (W4TcConfig, default_tc_config, w4_dequantize_triton, w4a16_dequant_mm,
                              w4a16_tc_triton)
from tests.kernels.test_w4a16 import DEVICE, assert_close, operands

# N past the block (37), two groups of 32, and one group the width of a step
CASES = [(5, 37, 64, 32), (33, 24, 64, 64)]


@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("unpack", ["reshape", "gather"])
@pytest.mark.parametrize("M,N,K,G", CASES)
def test_tc_matches_reference(swap, unpack, M, N, K, G):
    x, qw, s, z, b, p = operands(M, N, K, G, zeros=True, perm=False, bias=True)
    cfg = W4TcConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1, swap=swap, unpack=unpack)
    assert_close(w4a16_tc_triton(x, qw, s, z, b, p, config=cfg), w4a16_ref(x, qw, s, z, b, p))


@pytest.mark.parametrize("zeros,perm", [(False, False), (True, True)])
def test_tc_split_k_symmetric_and_act_order(zeros, perm):
    x, qw, s, z, b, p = operands(17, 37, 128, 32, zeros=zeros, perm=perm, bias=False)
    cfg = W4TcConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1, split_k=3)
    y = w4a16_tc_triton(x, qw, s, z, b, p, config=cfg)
    assert_close(y, w4a16_ref(x, qw, s, z, b, p))
    again = w4a16_tc_triton(x, qw, s, z, b, p, config=cfg)  # the tickets were reset: the same sums, bit for bit
    assert torch.equal(y, again)


def test_tc_bf16_rounds_weights_once():
    x, qw, s, z, b, p = operands(9, 24, 64, 32, zeros=True, perm=False, bias=False, dtype=torch.bfloat16)
    cfg = W4TcConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=1)
    assert_close(w4a16_tc_triton(x, qw, s, z, b, p, config=cfg), w4a16_ref(x, qw, s, z, b, p))


def test_tc_refuses_a_step_across_groups():
    x, qw, s, z, b, p = operands(4, 16, 64, 16, zeros=True, perm=False, bias=False)
    with pytest.raises(ValueError, match="block_k=32 does not divide the group size 16"):
        w4a16_tc_triton(x, qw, s, z, b, p, config=W4TcConfig(block_k=32))


def test_default_config_fills_the_sms():
    cfg = default_tc_config(256, 3584, 3584, 128, num_sms=132)
    tiles = (256 // cfg.block_m) * (3584 // cfg.block_n)
    assert cfg.swap and tiles * cfg.split_k >= 132
    assert default_tc_config(4096, 37888, 3584, 128, num_sms=132).split_k == 1


@pytest.mark.parametrize("zeros,perm", [(True, False), (False, True)])
def test_dequantize_and_matmul(zeros, perm):
    x, qw, s, z, b, p = operands(6, 37, 256, 32, zeros=zeros, perm=perm, bias=True)  # 32 packed rows: 2 steps
    w = w4_dequantize_triton(qw, s, z, torch.float32)
    assert torch.equal(w, dequantize_w4_ref(qw, s, z).t())  # float32: exact, nn.Linear's layout
    assert_close(w4a16_dequant_mm(x, qw, s, z, b, p), w4a16_ref(x, qw, s, z, b, p))


@pytest.mark.parametrize("M,N", [(17, 24), (20, 16384)])
def test_batch_path_matches_reference(M, N):
    """Both of the batch path's choices (narrow: dequantize + matmul; wide at few rows: the fused GEMM)."""
    from kernels.w4a16_tc import w4a16_triton
    from kernels.w4a16_tc import batch_path
    K = 64
    assert batch_path(M, N, K, 64) == ("tc" if N >= 16384 else "dequant")
    x, qw, s, z, b, p = operands(M, N, K, 64, zeros=True, perm=False, bias=True)
    assert_close(w4a16_triton(x, qw, s, z, b, p), w4a16_ref(x, qw, s, z, b, p))


@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("dtype,zeros", [(torch.bfloat16, True), (torch.float16, False)])
def test_tc_pairs_matches_reference(swap, dtype, zeros):
    """The paired 16-bit dequantization (PTX on the GPU; under the interpreter its float32 emulation, which checks
    the nibble order of _stack_nibbles and the packed zero points and scales)."""
    x, qw, s, z, b, p = operands(19, 40, 128, 64, zeros=zeros, perm=True, bias=True, dtype=dtype)
    cfg = W4TcConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=1, swap=swap, pairs=True)
    assert_close(w4a16_tc_triton(x, qw, s, z, b, p, config=cfg), w4a16_ref(x, qw, s, z, b, p))


def test_a_loaded_plan_decides_by_rows():
    from kernels import w4a16_tc as tc
    cfg = dict(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=1, swap=False, unpack="reshape",
               split_k=1, group_m=8, pairs=True)
    try:
        tc.load_tc_plan({"24x64": [[32, {"kind": "dequant"}], [64, {"kind": "tc", "config": cfg}]]})
        assert [tc.batch_path(m, 24, 64, 32) for m in (17, 32, 33, 64, 65)] == \
            ["dequant", "dequant", "tc", "tc", "dequant"]
        assert tc.batch_path(40, 24, 128, 32) == "dequant"  # another shape: the rule
        x, qw, s, z, b, p = operands(40, 24, 64, 32, zeros=True, perm=False, bias=False)
        assert_close(tc.w4a16_batch_triton(x, qw, s, z, b, p), w4a16_ref(x, qw, s, z, b, p))
    finally:
        tc.TC_PLAN.clear()
