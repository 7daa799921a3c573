"""kernels/cpu_ops.py: the CPU fast paths against their references (float32), and the dispatch choosing them."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels.activation import silu_and_mul_ref
from kernels.cpu_ops import fused_add_rms_norm_cpu, rms_norm_cpu, rotary_embedding_write_kv_cpu, silu_and_mul_cpu
from kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary import rotary_embedding_write_kv_ref


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


@pytest.mark.parametrize("num_tokens", [1, 16, 300])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 9, 3), (128, 4, 1)])
@pytest.mark.parametrize("pad", [False, True])
def test_rotary_write_kv_matches_reference_bit_for_bit(num_tokens, head_dim, num_heads, num_kv_heads, pad):
    g = torch.Generator().manual_seed(num_tokens + head_dim)
    max_pos, num_blocks, block_size = 4096, 64, 16
    freqs = torch.arange(max_pos)[:, None].float() * torch.rand(head_dim // 2, generator=g)[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_pos, D]
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g)
    # q, k and v as views of a fused qkv projection's output; the caches as strided views of one K|V buffer.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 3
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    if pad:
        slots[::3] = -1
    kv = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=g)
    caches = [(kv.clone()[:, 0], kv.clone()[:, 1]) for _ in range(3)]
    got = rotary_embedding_write_kv_cpu(positions, q, k, v, cos_sin, *caches[0], slots)
    via_dispatch = kernels.rotary_embedding_write_kv(positions, q, k, v, cos_sin, *caches[1], slots)
    ref = rotary_embedding_write_kv_ref(positions, q, k, v, cos_sin, *caches[2], slots)
    for out in (got, via_dispatch):
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
        assert out[0].is_contiguous() and out[1].is_contiguous()
    for cache in caches[:2]:
        assert torch.equal(cache[0], caches[2][0]) and torch.equal(cache[1], caches[2][1])


@pytest.mark.parametrize("rows", [1, 16, 2048])
@pytest.mark.parametrize("width", [64, 576])
def test_norms_give_the_bits_of_f_rms_norm(rows, width):
    # The decode step's greedy tokens stay those of the F.rms_norm path these replaced.
    g = torch.Generator().manual_seed(rows * width)
    x, r, w = (torch.randn(rows, width, generator=g) * 3, torch.randn(rows, width, generator=g),
               torch.randn(width, generator=g))
    assert torch.equal(rms_norm_cpu(x, w, 1e-5), torch.nn.functional.rms_norm(x, (width,), w, 1e-5))
    out, res = fused_add_rms_norm_cpu(x, r, w, 1e-6)
    assert torch.equal(out, torch.nn.functional.rms_norm(x + r, (width,), w, 1e-6)) and torch.equal(res, x + r)
