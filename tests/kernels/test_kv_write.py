"""kernels/kv_write.py: the slot-mapped KV write (and fp8 quantization) against write_kv_ref."""
from __future__ import annotations

import pytest
import torch

from kernels.kv_write import write_kv_ref, write_kv_triton

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")


def run_both(num_tokens, num_kv_heads, head_dim, block_size, dtype, cache_dtype, k_scale, v_scale, *, num_blocks,
             padding=3, num_layers=2, strided_k=False):
    gen = torch.Generator().manual_seed(int(torch.randint(2**31, (1,))))
    # Caches are the layer-1 views of one [num_blocks, num_layers, 2, block_size, Hkv, D] tensor, pre-filled with
    # random bytes so that a slot the kernel must not touch is checked as well.
    kv = (torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, generator=gen) * 3)
    kv = kv.to(cache_dtype).to(DEVICE)
    kv_ref = kv.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:padding]] = -1
    slot_mapping = slots.to(DEVICE)
    if strided_k:  # k and v as slices of a fused qkv output
        qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen).to(dtype).to(DEVICE)
        k = qkv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, 2 * num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    else:
        k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    write_kv_triton(k, v, kv[:, 1, 0], kv[:, 1, 1], slot_mapping, k_scale, v_scale)
    write_kv_ref(k, v, kv_ref[:, 1, 0], kv_ref[:, 1, 1], slot_mapping, k_scale, v_scale)
    return kv, kv_ref


@pytest.mark.parametrize("head_dim,num_kv_heads,block_size", [(64, 1, 16), (128, 4, 32), (80, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_matches_reference_exactly(head_dim, num_kv_heads, block_size, dtype):
    kv, kv_ref = run_both(37, num_kv_heads, head_dim, block_size, dtype, dtype, 1.0, 1.0, num_blocks=5)
    assert torch.equal(kv.view(torch.uint8), kv_ref.view(torch.uint8))  # written slots and untouched ones


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.05)])
def test_fp8_quantization(dtype, scales):
    kv, kv_ref = run_both(45, 2, 64, 16, dtype, torch.float8_e4m3fn, *scales, num_blocks=6, strided_k=True)
    # Same rounding (round-to-nearest-even, saturating at 448): equal values (-0 == +0; the interpreter's fp8
    # conversion drops the sign of zero), allowing a rare 1-ulp difference on a tie.
    differ = kv.float() != kv_ref.float()
    ulps = (kv.view(torch.uint8).int() - kv_ref.view(torch.uint8).int()).abs()
    assert (ulps[differ] <= 1).all() and differ.float().mean() < 1e-3, f"{differ.sum()} values differ"


def test_fp8_saturates_instead_of_nan():
    k = torch.tensor([[[1000.0, -1000.0, 1.0, 0.5] * 4]], device=DEVICE)
    cache = torch.zeros(1, 16, 1, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    write_kv_triton(k, k, cache, cache.clone(), torch.zeros(1, dtype=torch.int64, device=DEVICE))
    assert cache[0, 0, 0, :2].float().tolist() == [448.0, -448.0]


def test_bad_arguments_name_the_argument():
    k = torch.randn(4, 2, 64, device=DEVICE)
    cache = torch.zeros(3, 16, 2, 64, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="k_cache: shape"):
        write_kv_triton(k, k, cache[:, :, :1], cache[:, :, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping: shape"):
        write_kv_triton(k, k, cache, cache, slots[:3])
    with pytest.raises(ValueError, match="v_scale=0"):
        write_kv_triton(k, k, cache, cache, slots, 1.0, 0.0)
    with pytest.raises(ValueError, match="v: dtype"):
        write_kv_triton(k, k.half(), cache, cache, slots)


@cuda_only
def test_qwen_prefill_chunk_full_shapes():
    kv, kv_ref = run_both(4096, 4, 128, 16, torch.bfloat16, torch.bfloat16, 1.0, 1.0, num_blocks=600, padding=50)
    assert torch.equal(kv.view(torch.uint8), kv_ref.view(torch.uint8))


@cuda_only
def test_cache_past_int32_offsets():
    num_blocks, block_size, hkv, d = 70000, 16, 8, 128
    kv = torch.zeros(num_blocks, 1, 2, block_size, hkv, d, dtype=torch.bfloat16, device="cuda")
    assert kv.numel() > 2**31
    slots = torch.arange(num_blocks * block_size - 40, num_blocks * block_size, device="cuda")
    k = torch.randn(40, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(40, hkv, d, device="cuda", dtype=torch.bfloat16)
    write_kv_triton(k, v, kv[:, 0, 0], kv[:, 0, 1], slots)
    assert torch.equal(kv[-3:, 0, 0].reshape(-1, hkv, d)[-40:], k)
    assert torch.equal(kv[-3:, 0, 1].reshape(-1, hkv, d)[-40:], v)
    assert kv[:-3].abs().sum() == 0  # nothing wrapped around to low addresses
