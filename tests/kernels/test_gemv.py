"""kernels/gemv.py: the small-M GEMV (every mode, split-K, bias) against gemv_ref."""
from __future__ import annotations

import pytest
import torch

import kernels.gemv as gemv
from kernels.gemv import (MAX_M, GemvConfig, _counters, default_config, gemv_ref, gemv_triton, linear, pick_config,
                          table_config)

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
    assert int(_counters(x.device).abs().sum()) == 0
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
    assert int(_counters(x.device).abs().sum()) == 0


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
