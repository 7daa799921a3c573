"""kernels/gemv.py: the small-M GEMV (every mode, split-K, bias) against gemv_ref."""
from __future__ import annotations

import pytest
import torch

import kernels.gemv as gemv
from kernels._checks import FP8_DTYPE, FP8_MAX
from kernels.gemv import (CONFIGS_FP8, MAX_M, GemvConfig, default_config, gemv_ref, gemv_triton, linear,
                          pick_config, table_config)
from kernels.split_k import counters

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative to the output's scale

# Small configs for the interpreter: each mode, with and without split-K (odd K gives ragged last splits and
# masked columns), row tiles past N.
CONFIGS = [
    GemvConfig(block_n=8, block_k=32, split_k=1, mode="fma"),
    GemvConfig(block_n=8, block_k=32, split_k=1, num_stages=1, mode="fma"),  # no register prefetch
    GemvConfig(block_n=4, block_k=16, split_k=3, mode="fma"),
    GemvConfig(block_n=8, block_k=32, split_k=1, mode="fma_late"),
    GemvConfig(block_n=4, block_k=16, split_k=4, mode="fma_late"),
    GemvConfig(block_n=16, block_k=32, split_k=1, mode="dot"),
    GemvConfig(block_n=16, block_k=16, split_k=5, mode="dot"),
]


def data(M, N, K, dtype, bias, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype).to(device)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype).to(device)
    b = torch.randn(N, generator=gen).to(dtype).to(device) if bias else None
    return x, w, b


def assert_close(y, ref):
    scale = ref.float().abs().max().item() + 1e-6
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= TOL[ref.dtype] * scale, f"max error {err:.3g} at output scale {scale:.3g}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.short())
@pytest.mark.parametrize("M", [1, 3, 8])  # 3: padding rows (BLOCK_M 4, all four fma_late accumulators)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference_odd_shapes(cfg, M, bias):
    if cfg.mode == "fma_late" and M > 4:
        with pytest.raises(ValueError, match="mode='fma_late' takes at most 4"):
            gemv_triton(*data(M, 8, 32, torch.float32, bias), config=cfg)
        return
    # N=37, K=83: neither a multiple of any block; K=64: whole blocks (EVEN_K)
    for N, K in ((37, 83), (20, 64)):
        x, w, b = data(M, N, K, torch.float32, bias, seed=M * 100 + N)
        torch.manual_seed(0)
        y = torch.full((M, N), float("nan"), device=DEVICE)
        gemv_triton(x, w, b, out=y, config=cfg)
        assert_close(y, gemv_ref(x, w, b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2, 5])
def test_half_dtypes_split_k(dtype, M):
    x, w, b = data(M, 48, 96, dtype, True, seed=M)
    split_configs = [c for c in CONFIGS if c.split_k > 1 and (c.mode != "fma_late" or M <= 4)]
    for cfg in split_configs:
        assert_close(gemv_triton(x, w, b, config=cfg), gemv_ref(x, w, b))


def test_split_k_deterministic_and_counters_reset():
    x, w, b = data(4, 30, 200, torch.float32, True, seed=7)
    cfg = GemvConfig(block_n=8, block_k=16, split_k=6, mode="fma")
    y1 = gemv_triton(x, w, b, config=cfg)
    y2 = gemv_triton(x, w, b, config=cfg)  # the counters must be back at 0, else no program writes y
    assert torch.equal(y1, y2)
    assert int(counters(x.device).abs().sum()) == 0
    assert_close(y1, gemv_ref(x, w, b))


def test_strided_rows_and_defaults():
    # x and out as row slices of wider buffers (a fused qkv output, a padded batch); the default config
    big = torch.randn(3, 150, device=DEVICE)
    x = big[:, 10:110]  # [3, 100], row stride 150
    w = torch.randn(40, 100, device=DEVICE)
    out_buf = torch.zeros(3, 64, device=DEVICE)
    out = out_buf[:, :40]
    gemv_triton(x, w, out=out)
    assert_close(out, gemv_ref(x, w))
    assert out_buf[:, 40:].abs().sum() == 0


def test_default_config_splits_small_n_only():
    assert default_config(1, 3584, 3584).split_k * (3584 // default_config(1, 3584, 3584).block_n) >= 132
    assert default_config(1, 152064, 3584).split_k == 1
    assert default_config(8, 4608, 3584).mode == "dot"


def test_bad_arguments_name_the_argument():
    x, w, b = data(2, 8, 32, torch.float32, True)
    with pytest.raises(ValueError, match="weight: shape"):
        gemv_triton(x, w[:, :16])
    with pytest.raises(ValueError, match="bias: shape"):
        gemv_triton(x, w, b[:4])
    with pytest.raises(ValueError, match="weight: dtype"):
        gemv_triton(x, w.half())
    with pytest.raises(ValueError, match=f"MAX_M={MAX_M}"):
        gemv_triton(torch.randn(MAX_M + 1, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="out: shape"):
        gemv_triton(x, w, out=torch.empty(2, 9, device=DEVICE))
    with pytest.raises(ValueError, match="block_n=8: mode='dot'"):
        GemvConfig(block_n=8, mode="dot")
    with pytest.raises(ValueError, match="block_k=48: must be a power of two"):
        GemvConfig(block_k=48)


def test_table_lookup_by_rows(monkeypatch):
    a, b = GemvConfig(block_n=8), GemvConfig(block_n=64, mode="dot")
    monkeypatch.setattr(gemv, "CONFIGS", {(8, 32): ((1, a), (4, None), (8, b))})
    assert table_config(1, 8, 32) is a
    assert table_config(2, 8, 32) is None and table_config(4, 8, 32) is None  # cuBLAS won there
    assert table_config(5, 8, 32) is b and table_config(8, 8, 32) is b
    assert table_config(9, 8, 32) is None and table_config(1, 8, 64) is None
    assert pick_config(1, 8, 32) is a
    assert pick_config(3, 8, 32) == default_config(3, 8, 32)


def test_linear_falls_back_to_f_linear_off_cuda():
    x, w, b = data(3, 8, 32, torch.float32, True, device="cpu")
    torch.testing.assert_close(linear(x, w, b), torch.nn.functional.linear(x, w, b))


def fp8_data(M, N, K, dtype, bias, seed=0, device=DEVICE):
    """x 16-bit (or float32), W float8_e4m3fn [N, K] with per-row scales of very different sizes, as Fp8Linear
    stores them: [1, N] float32."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype).to(device)
    w = torch.randn(N, K, generator=gen) * torch.logspace(-3, 0, N)[:, None]
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [N, 1]
    w_q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(device)
    b = torch.randn(N, generator=gen).to(dtype).to(device) if bias else None
    return x, w_q, scale.reshape(1, N).contiguous().to(device), b


def test_fp8_loads_convert_exactly():
    """Every finite e4m3 byte pattern through each mode (one-hot rows of x pick single weights, scale 1): the
    kernel's fp8 -> float32 / bf16 conversion (the interpreter's too) equals torch's .float() of the same bytes."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    vals = codes[~codes.float().isnan()]  # 254 finite values (0x7f and 0xff are NaN)
    N, K = 127, 16  # W [127, 16]: each value once at (i // 2, 8 * (i % 2) + ...), the rest filled with the same
    w_q = vals.reshape(N, 2).repeat_interleave(8, dim=1).contiguous()  # [127, 16]
    expected = w_q.float().t().contiguous()  # y = x @ W^T with x the identity: row k of y = column k of W
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.eye(K, dtype=dtype)[:MAX_M].to(DEVICE)
        ones = torch.ones(N, device=DEVICE)
        for cfg in (GemvConfig(block_n=8, block_k=16, mode="fma"), GemvConfig(block_n=16, block_k=16, mode="dot")):
            y = gemv_triton(x, w_q.to(DEVICE), weight_scale=ones, config=cfg).float().cpu()
            exp = expected.to(dtype).float()  # bf16 holds every e4m3 value exactly: no rounding either way
            assert torch.equal(exp, expected)
            assert torch.equal(y, exp), (cfg.short(), dtype, (y - exp).abs().max())


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.short())
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_weight_matches_dequantized_reference(cfg, M, bias):
    """fp8 W, float32 x: the same products as the float32 reference of the dequantized weight (scale after the sum)."""
    if cfg.mode == "fma_late" and M > 4:
        return  # rejected for any weight type (test_matches_reference_odd_shapes)
    for N, K in ((37, 83), (20, 64)):
        x, w_q, s, b = fp8_data(M, N, K, torch.float32, bias, seed=M * 10 + N)
        y = torch.full((M, N), float("nan"), device=DEVICE)
        gemv_triton(x, w_q, b, weight_scale=s, out=y, config=cfg)
        ref = gemv_ref(x, w_q, b, weight_scale=s)
        assert_close(y, ref)
        # Against dequantizing first (W_q * s, then the product): the same up to float32 rounding.
        deq = x.float() @ (w_q.float() * s.reshape(N, 1)).t() + (b.float() if bias else 0)
        torch.testing.assert_close(y, deq, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 4, 7])
def test_fp8_weight_half_x_split_k(dtype, M):
    x, w_q, s, b = fp8_data(M, 48, 200, dtype, True, seed=M)
    ref = gemv_ref(x, w_q, b, weight_scale=s)
    assert ref.dtype == dtype
    for cfg in [c for c in CONFIGS if c.mode != "fma_late" or M <= 4]:
        y = gemv_triton(x, w_q, b, weight_scale=s.reshape(-1), config=cfg)  # [N] scales as well as [1, N]
        assert_close(y, ref)
    cfg = GemvConfig(block_n=8, block_k=16, split_k=6, mode="fma")
    assert torch.equal(gemv_triton(x, w_q, b, weight_scale=s, config=cfg),
                       gemv_triton(x, w_q, b, weight_scale=s, config=cfg))
    assert int(counters(x.device).abs().sum()) == 0
    assert_close(gemv_triton(x, w_q, b, weight_scale=s), ref)  # the default config for fp8


def test_fp8_bad_arguments_name_the_argument():
    x, w_q, s, b = fp8_data(2, 8, 32, torch.bfloat16, True)
    with pytest.raises(ValueError, match="weight_scale: None for a float8_e4m3fn weight"):
        gemv_triton(x, w_q, b)
    with pytest.raises(ValueError, match=r"weight_scale: shape \(1, 4\).*expected \[8\] or \[1, 8\]"):
        gemv_triton(x, w_q, b, weight_scale=s[:, :4])
    with pytest.raises(ValueError, match="weight_scale: dtype"):
        gemv_triton(x, w_q, b, weight_scale=s.bfloat16())
    with pytest.raises(ValueError, match="weight_scale: given for a torch.bfloat16 weight"):
        gemv_triton(x, w_q.bfloat16(), b, weight_scale=s)


def test_fp8_table_is_separate(monkeypatch):
    a, c = GemvConfig(block_n=8), GemvConfig(block_n=16, block_k=512)
    monkeypatch.setattr(gemv, "CONFIGS", {(8, 32): ((1, a),)})
    monkeypatch.setattr(gemv, "CONFIGS_FP8", {(8, 64): ((2, c), (4, None))})
    assert table_config(1, 8, 32) is a and table_config(1, 8, 32, fp8=True) is None
    assert table_config(2, 8, 64, fp8=True) is c and table_config(3, 8, 64, fp8=True) is None
    assert table_config(5, 8, 64, fp8=True) is None and table_config(1, 8, 64) is None
    assert default_config(1, 3584, 3584, fp8=True).block_k == 512
    for (N, K), entries in CONFIGS_FP8.items():  # the shipped table: ascending rows, configs the launcher takes
        assert [m for m, _ in entries] == sorted(m for m, _ in entries) and entries[-1][0] <= MAX_M
        assert all(cfg is None or cfg.mode != "fma_late" or m <= 4 for m, cfg in entries)


# Qwen2.5-7B's decode projections: qkv (with bias), o_proj, gate_up, down, lm_head
SHAPES_7B = [(4608, 3584, True), (3584, 3584, False), (37888, 3584, False), (3584, 18944, False),
             (152064, 3584, False)]


@cuda_only
@pytest.mark.parametrize("N,K,bias", SHAPES_7B)
@pytest.mark.parametrize("M", [1, 3, 16])
def test_qwen_7b_shapes_cuda(N, K, bias, M):
    x, w, b = data(M, N, K, torch.bfloat16, bias, seed=N + M)
    ref = gemv_ref(x, w, b)
    assert_close(gemv_triton(x, w, b), ref)  # the table's / default config
    cfgs = [GemvConfig(block_n=8, block_k=512, split_k=4, mode="fma"),
            GemvConfig(block_n=64, block_k=128, split_k=3, mode="dot", num_warps=4, num_stages=4)]
    if M <= 4:
        cfgs.append(GemvConfig(block_n=16, block_k=256, split_k=2, mode="fma_late"))
    for cfg in cfgs:
        y = gemv_triton(x, w, b, config=cfg)
        assert_close(y, ref)
        assert torch.equal(y, gemv_triton(x, w, b, config=cfg)), "split-K result changed between launches"
    assert int(counters(x.device).abs().sum()) == 0


@cuda_only
def test_cuda_graph_replay():
    x, w, b = data(1, 4608, 3584, torch.bfloat16, True)
    cfg = GemvConfig(block_n=16, block_k=256, split_k=4, mode="fma")
    y = gemv_triton(x, w, b, config=cfg)  # warm-up outside the capture (compiles, makes the counters)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = gemv_triton(x, w, b, config=cfg)
    x.copy_(torch.randn_like(x))
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert_close(y, gemv_ref(x, w, b))


@cuda_only
def test_weight_past_int32_offsets():
    N, K = 140_000, 16_384  # 2.29e9 elements (4.6 GB bf16)
    w = torch.empty(N, K, dtype=torch.bfloat16, device="cuda")
    assert w.numel() > 2**31
    w[:-8].zero_()
    w[-8:].normal_()
    x = torch.randn(2, K, dtype=torch.bfloat16, device="cuda")
    y = gemv_triton(x, w)
    assert y[:, :-8].abs().sum() == 0
    assert_close(y[:, -8:], gemv_ref(x, w[-8:]))


@cuda_only
@pytest.mark.parametrize("N,K,bias", SHAPES_7B[:4])
@pytest.mark.parametrize("M", [1, 2, 5, 16])
def test_fp8_qwen_7b_shapes_cuda(N, K, bias, M):
    x, w_q, s, b = fp8_data(M, N, K, torch.bfloat16, bias, seed=N + M)
    ref = gemv_ref(x, w_q, b, weight_scale=s)
    assert_close(gemv_triton(x, w_q, b, weight_scale=s), ref)  # CONFIGS_FP8's / default config
    cfgs = [GemvConfig(block_n=8, block_k=1024, split_k=4, mode="fma"),
            GemvConfig(block_n=64, block_k=128, split_k=3, mode="dot", num_warps=4, num_stages=4)]
    if M <= 4:
        cfgs.append(GemvConfig(block_n=16, block_k=512, split_k=2, mode="fma_late"))
    for cfg in cfgs:
        y = gemv_triton(x, w_q, b, weight_scale=s, config=cfg)
        assert_close(y, ref)
        assert torch.equal(y, gemv_triton(x, w_q, b, weight_scale=s, config=cfg))
    assert int(counters(x.device).abs().sum()) == 0
