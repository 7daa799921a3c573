"""kernels/rotary.py: NeoX rotary embedding against its reference, with a Llama-3-scaled cos/sin cache."""
from __future__ import annotations

import math

import pytest
import torch

from kernels.rotary import rotary_embedding_ref, rotary_embedding_triton

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def cos_sin_cache(head_dim, max_pos, base=500000.0, llama3=True):
    """[max_pos, head_dim]: cos then sin, with Llama-3's frequency scaling (factor 8, low/high 1/4, orig 8192)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if llama3:
        factor, low, high, orig = 8.0, 1.0, 4.0, 8192
        wavelen = 2 * math.pi / inv_freq
        smooth = ((orig / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= orig / low) & (wavelen >= orig / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 4, 1), (128, 6, 2), (128, 28, 4)])
def test_rotary_fused_qkv_views(dtype, head_dim, num_heads, num_kv_heads):
    num_tokens = 300 if ON_CUDA else 9
    cache = cos_sin_cache(head_dim, 40000).to(DEVICE)
    positions = torch.randint(0, 40000, (num_tokens,), device=DEVICE)
    # q and k as views of a fused qkv projection output (token stride != heads * head_dim)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype).to(DEVICE)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cache)
    q_out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    k_out = torch.full(k.shape, float("nan"), dtype=dtype, device=DEVICE)
    rotary_embedding_triton(positions, q, k, cache, q_out=q_out, k_out=k_out)
    torch.testing.assert_close(q_out, q_ref, atol=ATOL[dtype], rtol=ATOL[dtype])
    torch.testing.assert_close(k_out, k_ref, atol=ATOL[dtype], rtol=ATOL[dtype])
    # in place, into the qkv buffer itself
    rotary_embedding_triton(positions.int(), q, k, cache, q_out=q, k_out=k)
    torch.testing.assert_close(q, q_ref, atol=ATOL[dtype], rtol=ATOL[dtype])
    torch.testing.assert_close(k, k_ref, atol=ATOL[dtype], rtol=ATOL[dtype])


def test_bad_arguments_name_the_argument():
    cache = cos_sin_cache(64, 100).to(DEVICE)
    q, k = torch.randn(3, 4, 64, device=DEVICE), torch.randn(3, 2, 64, device=DEVICE)
    pos = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="cos_sin_cache: shape"):
        rotary_embedding_triton(pos, q, k, cache[:, :32])
    with pytest.raises(ValueError, match="positions: 2 entries"):
        rotary_embedding_triton(pos[:2], q, k, cache)
    with pytest.raises(ValueError, match="k: shape"):
        rotary_embedding_triton(pos, q, k[:, :, :32], cache)


@cuda_only
def test_tokens_past_int32_offsets():
    num_tokens = 620_000
    q = torch.randn(num_tokens, 28, 128, dtype=torch.bfloat16, device="cuda")
    assert q.numel() > 2**31
    k = torch.randn(num_tokens, 4, 128, dtype=torch.bfloat16, device="cuda")
    cache = cos_sin_cache(128, 32768).cuda()
    pos = torch.randint(0, 32768, (num_tokens,), device="cuda")
    q_out, k_out = rotary_embedding_triton(pos, q, k, cache)
    q_ref, k_ref = rotary_embedding_ref(pos[-4:], q[-4:], k[-4:], cache)
    torch.testing.assert_close(q_out[-4:], q_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k_out[-4:], k_ref, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------- rotary + KV write, fused
from kernels.kv_write import write_kv_triton  # noqa: E402
from kernels.rotary import rotary_embedding_write_kv_ref, rotary_embedding_write_kv_triton  # noqa: E402


def fused_case(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, cache_dtype, seed=0):
    """q/k/v as views of one fused qkv output; caches as layer-1 views of one engine-layout tensor filled with
    random bytes; a few padding slots (-1)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = num_tokens // block_size + 3
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    kv = (torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=gen) * 3).to(cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:2]] = -1
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen)
    return positions.to(DEVICE), q, k, v, kv.to(DEVICE), slots.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache,scales", [("same", (1.0, 1.0)), ("same", (0.5, 2.0)), ("fp8", (1.0, 1.0)),
                                          ("fp8", (0.02, 0.05))])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 4, 1), (128, 7, 2), (80, 6, 3)])
def test_rotary_write_kv_equals_the_two_kernels(dtype, cache, scales, head_dim, num_heads, num_kv_heads):
    cache_dtype = torch.float8_e4m3fn if cache == "fp8" else dtype
    num_tokens = 200 if ON_CUDA else 7
    cs = cos_sin_cache(head_dim, 4000).to(DEVICE)
    positions, q, k, v, kv, slots = fused_case(num_tokens, num_heads, num_kv_heads, head_dim, 16, dtype, cache_dtype)
    kv_two = kv.clone()
    # two launches: rotary, then the KV write of the rotated k
    q_two, k_two = rotary_embedding_triton(positions, q, k, cs)
    write_kv_triton(k_two, v, kv_two[:, 1, 0], kv_two[:, 1, 1], slots, *scales)
    # one launch
    q_one, k_one = rotary_embedding_write_kv_triton(positions, q, k, v, cs, kv[:, 1, 0], kv[:, 1, 1], slots, *scales)
    assert torch.equal(q_one, q_two) and torch.equal(k_one, k_two)
    assert torch.equal(kv.view(torch.uint8), kv_two.view(torch.uint8))  # written slots and untouched bytes
    # and against the plain-torch reference
    kv_ref = fused_case(num_tokens, num_heads, num_kv_heads, head_dim, 16, dtype, cache_dtype)[4]  # fresh bytes
    q_ref, k_ref = rotary_embedding_write_kv_ref(positions, q, k, v, cs, kv_ref[:, 1, 0], kv_ref[:, 1, 1], slots,
                                                 *scales)
    torch.testing.assert_close(q_one, q_ref, atol=ATOL[dtype], rtol=ATOL[dtype])
    torch.testing.assert_close(k_one, k_ref, atol=ATOL[dtype], rtol=ATOL[dtype])
    if cache != "fp8":  # (fp8: exact against the two kernels above, which test_kv_write holds to its reference)
        tol = 4 * ATOL[dtype]
        torch.testing.assert_close(kv.float(), kv_ref.float(), atol=tol, rtol=tol)


def test_rotary_write_kv_reference_writes_the_cache():
    """The reference itself against an independent loop (the contract the two kernels are held to)."""
    cs = cos_sin_cache(64, 4000).to(DEVICE)
    positions, q, k, v, kv, slots = fused_case(9, 4, 2, 64, 16, torch.float32, torch.float32, seed=3)
    before = kv.clone()
    q_ref, k_ref = rotary_embedding_write_kv_ref(positions, q, k, v, cs, kv[:, 1, 0], kv[:, 1, 1], slots)
    expect = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect[s // 16, 1, 0, s % 16] = k_ref[t]
            expect[s // 16, 1, 1, s % 16] = v[t]
    assert torch.equal(kv, expect)
    torch.testing.assert_close(q_ref, rotary_embedding_ref(positions, q, k, cs)[0])


def test_rotary_write_kv_in_place_and_bad_arguments():
    cs = cos_sin_cache(64, 4000).to(DEVICE)
    positions, q, k, v, kv, slots = fused_case(5, 4, 2, 64, 16, torch.float32, torch.float32, seed=4)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cs)
    rotary_embedding_write_kv_triton(positions, q, k, v, cs, kv[:, 1, 0], kv[:, 1, 1], slots, q_out=q, k_out=k)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="v: shape"):
        rotary_embedding_write_kv_triton(positions, q, k, v[:, :1], cs, kv[:, 1, 0], kv[:, 1, 1], slots)
    with pytest.raises(ValueError, match="slot_mapping: shape"):
        rotary_embedding_write_kv_triton(positions, q, k, v, cs, kv[:, 1, 0], kv[:, 1, 1], slots[:3])
    with pytest.raises(ValueError, match="k_cache: shape"):
        rotary_embedding_write_kv_triton(positions, q, k, v, cs, kv[:, 1, 0, :, :1], kv[:, 1, 1, :, :1], slots)
    with pytest.raises(ValueError, match="k_scale=0"):
        rotary_embedding_write_kv_triton(positions, q, k, v, cs, kv[:, 1, 0], kv[:, 1, 1], slots, 0.0)
