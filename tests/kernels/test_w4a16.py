"""kernels/w4a16.py: the 4-bit layout, the reference, and the GEMV and GEMM kernels against the reference."""
from __future__ import annotations

import pytest
import torch

from kernels.split_k import counters
from kernels.w4a16 import (GEMV_MAX_M, W4GemmConfig, W4GemvConfig, default_gemm_config, default_gemv_config,
                           dequantize_w4_ref, pack_w4, unpack_w4, w4a16_gemm_triton, w4a16_gemv_triton, w4a16_ref)
from kernels.w4a16_tc import w4a16_triton

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative to the output's scale

# (N, K, G): N not a multiple of any block (37, 20), several groups of 16 / 32, one group per row (G = K = 80: the
# kernels' K step must divide 80), groups as wide as a step (128)
SHAPES = [(37, 64, 16), (20, 96, 32), (24, 80, 80), (32, 128, 128)]


def operands(M, N, K, G, zeros, perm, bias, dtype=torch.float32, scale_dtype=torch.float16, seed=0,
             device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=gen)
    scales = (torch.rand(K // G, N, generator=gen) * 0.05 + 0.01).to(scale_dtype)
    qzeros = torch.randint(0, 17, (K // G, N), generator=gen).to(torch.uint8) if zeros else None  # 16: GPTQ v1
    p = torch.randperm(K, generator=gen).to(torch.int32) if perm else None
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    x = torch.randn(M, K, generator=gen).to(dtype)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(x), pack_w4(q).to(device), scales.to(device), move(qzeros), move(b), move(p)


def assert_close(y, ref):
    scale = ref.float().abs().max().item() + 1e-6
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= TOL[ref.dtype] * scale, f"max error {err:.3g} at output scale {scale:.3g}"


def test_pack_round_trip_and_layout():
    q = torch.randint(0, 16, (24, 5))
    packed = pack_w4(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 5)
    assert torch.equal(unpack_w4(packed).long(), q)
    # nibble j of word [i, n] is row 8i + j: 0x76543210 for rows 0..7 holding 0..7, 0xF...F (-1) for all 15s
    ramp = torch.arange(8)[:, None].expand(8, 2).clone()
    ramp[:, 1] = 15
    assert pack_w4(ramp).tolist() == [[0x76543210, -1]]


def test_dequantize_reference_by_hand():
    q = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 0]] * 2)  # K = 16, N = 2
    scales = torch.tensor([[0.5, 2.0], [1.0, 0.25]], dtype=torch.float16)  # two groups of 8 inputs
    zeros = torch.tensor([[8, 0], [15, 1]], dtype=torch.uint8)
    w = dequantize_w4_ref(pack_w4(q), scales, zeros)
    assert w[0].tolist() == [(1 - 8) * 0.5, (2 - 0) * 2.0]
    assert w[15].tolist() == [(15 - 15) * 1.0, (0 - 1) * 0.25]
    sym = dequantize_w4_ref(pack_w4(q), scales, None)
    assert sym[9].tolist() == [(3 - 8) * 1.0, (4 - 8) * 0.25]
    x = torch.randn(3, 16)
    perm = torch.randperm(16).to(torch.int32)
    torch.testing.assert_close(w4a16_ref(x, pack_w4(q), scales, zeros, perm=perm), x[:, perm.long()] @ w)


@pytest.mark.parametrize("M, N, K, G", [(m, *shape) for shape in SHAPES for m in (1, 3)] + [(GEMV_MAX_M, 37, 64, 16)])
def test_gemv_matches_reference(M, N, K, G):
    """Zero points and act order, each alone and together, with and without split-K (ragged last split for 96 and
    80); rows past M and outputs past N dropped."""
    for i, (zeros, perm, bias) in enumerate([(False, False, True), (True, False, False), (True, True, True),
                                             (False, True, False)]):
        args = operands(M, N, K, G, zeros, perm, bias, seed=M * 1000 + K + i)
        ref = w4a16_ref(*args)
        for cfg in (W4GemvConfig(block_n=16, block_k=16, split_k=1), W4GemvConfig(block_n=8, block_k=16, split_k=3)):
            y = torch.full((M, N), float("nan"), device=DEVICE)
            w4a16_gemv_triton(*args, out=y, config=cfg)
            assert_close(y, ref)


@pytest.mark.parametrize("N, K, G", SHAPES)
@pytest.mark.parametrize("M", [1, 17, 40])
def test_gemm_matches_reference(M, N, K, G):
    for i, (zeros, perm, bias) in enumerate([(False, False, True), (True, True, False)]):
        args = operands(M, N, K, G, zeros, perm, bias, seed=M * 1000 + K + i)
        ref = w4a16_ref(*args)
        for unpack in ("reshape", "gather"):
            cfg = W4GemmConfig(block_m=16, block_n=16, block_k=16, unpack=unpack)
            y = torch.full((M, N), float("nan"), device=DEVICE)
            w4a16_gemm_triton(*args, out=y, config=cfg)
            assert_close(y, ref)


def test_gemm_split_k_and_swizzle_and_gemv_modes():
    """The GEMM with split-K over several row tiles in swizzle groups (ragged last group), and the GEMV forced into
    each mode: 'dot' at one row, 'fma' (the row loop) at several."""
    args = operands(40, 37, 96, 32, True, True, True, seed=11)
    ref = w4a16_ref(*args)
    for cfg in (W4GemmConfig(block_m=16, block_n=16, block_k=16, split_k=3, group_m=2),
                W4GemmConfig(block_m=16, block_n=16, block_k=32, split_k=2, group_m=1, unpack="gather")):
        y = torch.full((40, 37), float("nan"), device=DEVICE)
        w4a16_gemm_triton(*args, out=y, config=cfg)
        assert_close(y, ref)
    for M, mode in ((1, "dot"), (3, "fma"), (3, "dot")):
        args = operands(M, 37, 96, 32, True, False, True, seed=12 + M)
        cfg = W4GemvConfig(block_n=16, block_k=16, split_k=2, mode=mode)
        assert_close(w4a16_gemv_triton(*args, config=cfg), w4a16_ref(*args))


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_kernel(M, dtype):
    """The stream kernel ('auto' at one row, 'stream' up to STREAM_MAX_M rows): zero points (16 included), act
    order, bias, ragged N and splits, bfloat16 x read in pairs or not; every output written."""
    for i, (zeros, perm, bias) in enumerate([(True, False, True), (False, True, False), (True, True, True)]):
        args = operands(M, 37, 96, 32, zeros, perm, bias, dtype=dtype, seed=40 + 10 * M + i)
        ref = w4a16_ref(*args)
        for cfg in (W4GemvConfig(block_n=16, block_k=32, split_k=1, mode="stream"),
                    W4GemvConfig(block_n=32, block_k=16, split_k=3, mode="stream", x_pairs=False),
                    W4GemvConfig(block_n=8, block_k=32, split_k=2)):
            if cfg.kernel_mode(M, dtype) != 3:
                continue
            y = torch.full((M, 37), float("nan"), device=DEVICE, dtype=dtype)
            w4a16_gemv_triton(*args, out=y, config=cfg)
            assert_close(y, ref)
    assert W4GemvConfig().kernel_mode(1, torch.float16) == 3 and W4GemvConfig().kernel_mode(2) == 2


@pytest.mark.parametrize("N, K, G", [(37, 96, 32), (64, 128, 128), (24, 80, 16)])
def test_pair_kernel(N, K, G):
    """The paired-bf16 kernel ('auto' and 'pair' at one bfloat16 row; the interpreter runs its float32 twin of the
    PTX, so the bit plumbing of x's pairs and the nibble masks is what this checks): zero points (16 included), act
    order, bias; N ragged or a multiple of the tile (no masks), splits ragged or not, x read 4 inputs a load or
    (unaligned, act order) one at a time; every output written."""
    for i, (zeros, perm, bias) in enumerate([(True, False, True), (False, True, False), (True, True, True),
                                             (False, False, False)]):
        x, *w = operands(1, N, K, G, zeros, perm, bias, dtype=torch.bfloat16, seed=70 + N + i)
        xs = torch.empty(1, K + 1, dtype=torch.bfloat16, device=DEVICE)
        xs[:, 1:] = x  # 2-byte aligned, not 8: one input a load
        for xi in (x, xs[:, 1:]):
            ref = w4a16_ref(xi, *w)
            for cfg in (W4GemvConfig(block_n=16, block_k=16, split_k=1, mode="pair"),
                        W4GemvConfig(block_n=8, block_k=16, split_k=4),
                        W4GemvConfig(block_n=32, block_k=G if G <= 64 else 32, split_k=2, mode="pair")):
                assert cfg.kernel_mode(1, torch.bfloat16) == 4
                y = torch.full((1, N), float("nan"), device=DEVICE, dtype=torch.bfloat16)
                w4a16_gemv_triton(xi, *w, out=y, config=cfg)
                assert_close(y, ref)


def test_pair_kernel_x_range():
    """x enters the pair kernel scaled by 2^100 through its exponent bits: inputs from 1e-30 to 1e5 and exact zeros
    (a zero's bits become 2^-27 before the scaling, nothing after it) give the reference's sums."""
    x, q, s, z, b, p = operands(1, 32, 128, 64, True, False, False, dtype=torch.bfloat16, seed=5)
    x = x.float()
    x[0, :16] = 0.0
    x[0, 16:32] *= 1e-30
    x[0, 32:40] *= 1e5
    x = x.to(torch.bfloat16)
    ref = w4a16_ref(x, q, s, z)
    assert_close(w4a16_gemv_triton(x, q, s, z, config=W4GemvConfig(block_n=32, block_k=64, split_k=1)), ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_half_dtypes(dtype, scale_dtype):
    """16-bit x and bias, scales in each dtype the layout takes; the GEMM's tensor-core dot in x's dtype on CUDA."""
    args = operands(5, 40, 64, 32, True, False, True, dtype=dtype, scale_dtype=scale_dtype)
    ref = w4a16_ref(*args)
    assert_close(w4a16_gemv_triton(*args, config=W4GemvConfig(block_n=16, block_k=32, split_k=2)), ref)
    assert_close(w4a16_gemm_triton(*args, config=W4GemmConfig(block_m=16, block_n=16, block_k=32)), ref)


def test_default_configs_and_dispatch():
    """The default configs divide the group sizes they are picked for (Qwen2.5-7B's shapes at G = 128 and per
    channel), and w4a16_triton takes the GEMV up to GEMV_MAX_M rows, the GEMM above."""
    for n, k in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)):
        for g in (128, k):
            assert g % default_gemv_config(1, n, k, g).block_k == 0
            assert g % default_gemm_config(2048, n, k, g).block_k == 0
    assert default_gemv_config(1, 3584, 18944, 128).split_k > 1  # too few N tiles to fill the SMs alone
    for M in (GEMV_MAX_M, GEMV_MAX_M + 1):
        args = operands(M, 24, 64, 32, True, False, True, seed=M)
        assert_close(w4a16_triton(*args), w4a16_ref(*args))


def test_split_k_deterministic_and_counters_reset():
    args = operands(2, 24, 256, 32, True, True, True, seed=9)
    cfg = W4GemvConfig(block_n=8, block_k=16, split_k=5)
    y1 = w4a16_gemv_triton(*args, config=cfg)
    y2 = w4a16_gemv_triton(*args, config=cfg)  # the counters must be back at 0, else no program writes y
    assert torch.equal(y1, y2)
    assert int(counters(y1.device).abs().sum()) == 0
    assert_close(y1, w4a16_ref(*args))


def test_launchers_check_their_operands():
    x, qweight, scales, qzeros, bias, perm = operands(2, 24, 64, 32, True, True, True)
    with pytest.raises(ValueError, match=r"x: 17 rows, the GEMV takes at most GEMV_MAX_M=16"):
        w4a16_gemv_triton(torch.zeros(17, 64, device=DEVICE), qweight, scales)
    with pytest.raises(ValueError, match=r"qweight: shape \(8, 24\), expected \(4, '\*'\)"):
        w4a16_gemv_triton(x[:, :32], qweight, scales)
    with pytest.raises(ValueError, match=r"scales: 3 groups do not divide K=64"):
        w4a16_gemm_triton(x, qweight, scales.repeat(2, 1)[:3])
    with pytest.raises(ValueError, match=r"qzeros: dtype torch.int32"):
        w4a16_gemv_triton(x, qweight, scales, qzeros.int())
    with pytest.raises(ValueError, match=r"perm: shape \(63,\), expected \(64,\)"):
        w4a16_gemm_triton(x, qweight, scales, perm=perm[:63])
    with pytest.raises(ValueError, match=r"config: block_k=64 does not divide the group size 32"):
        w4a16_gemm_triton(x, qweight, scales, config=W4GemmConfig(block_k=64))
    with pytest.raises(ValueError, match=r"block_m=8: must be >= 16"):
        W4GemmConfig(block_m=8)


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 32])
def test_cuda_indices_past_32_bits(M):
    """One output tile's rows sit past 2^31 elements of qweight (K/8 * N > 2^31 int32 words: 4.3 GB; skipped where
    the GPU has less free memory): the row offsets are 64-bit."""
    free, _ = torch.cuda.mem_get_info()
    K, N = 8 * 16, (1 << 31) // 16 + 64
    if free < 2 * (K // 8) * N * 4:
        pytest.skip("not enough GPU memory")
    qweight = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device="cuda")
    scales = torch.full((1, N), 0.01, dtype=torch.float16, device="cuda")
    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    cols = slice(N - 64, N)
    ref = w4a16_ref(x, qweight[:, cols].contiguous(), scales[:, cols].contiguous(), None)
    y = w4a16_triton(x, qweight, scales)
    assert_close(y[:, cols], ref)
