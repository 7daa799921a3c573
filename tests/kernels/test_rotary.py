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
