"""kernels/kv_write.py with an int8 cache (per-slot, per-KV-head scales, kernels/quant_int8.py) against
write_kv_ref, and the fused rotary + KV write's int8 path; on the CPU under TRITON_INTERPRET=1."""
from __future__ import annotations

import pytest
import torch

from kernels.kv_write import write_kv_ref, write_kv_triton
from kernels.quant_int8 import INT8_ROW_PAD, dequantize_int8_rows_ref, int8_cache_views, quantize_int8_rows_ref
from kernels.rotary import rotary_embedding_write_kv_ref, rotary_embedding_write_kv_triton

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"


def int8_cache(num_blocks, num_layers, block_size, num_kv_heads, head_dim, gen):
    """An engine-layout int8 cache [num_blocks, num_layers, 2, block_size, Hkv, head_dim + 4] of random bytes (so
    that a slot the kernel must not touch is checked too)."""
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim + INT8_ROW_PAD)
    return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8).to(DEVICE)


def layer_views(kv, layer=1):
    (kc, ks), (vc, vs) = int8_cache_views(kv[:, layer, 0]), int8_cache_views(kv[:, layer, 1])
    return kc, vc, dict(k_scale_cache=ks, v_scale_cache=vs)


def test_reference_rule():
    x = torch.tensor([[0.5, -1.27, 0.004, 0.0], [0.0, 0.0, 0.0, 0.0], [300.0, -2.0, 1.0, 0.0]])
    x_q, scale = quantize_int8_rows_ref(x)
    assert x_q.dtype == torch.int8 and scale.dtype == torch.float32
    assert x_q[0].tolist() == [50, -127, 0, 0] and x_q[1].tolist() == [0, 0, 0, 0]
    assert scale[0].item() == pytest.approx(1.27 / 127) and scale[1].item() > 0
    assert x_q[2, 0].item() == 127 and x_q.min() >= -127  # symmetric: -128 never stored
    err = (dequantize_int8_rows_ref(x_q, scale) - x).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()  # rounding to nearest


@pytest.mark.parametrize("head_dim,num_kv_heads,block_size", [(64, 1, 16), (128, 4, 8), (80, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("strided_k", [False, True])
def test_write_matches_reference_exactly(head_dim, num_kv_heads, block_size, dtype, strided_k):
    gen = torch.Generator().manual_seed(head_dim + block_size + int(strided_k))
    num_tokens, num_blocks = 37, 6
    kv = int8_cache(num_blocks, 2, block_size, num_kv_heads, head_dim, gen)
    kv_ref = kv.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:3]] = -1
    if strided_k:  # k and v as slices of a fused qkv output
        qkv = (torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen) * 4).to(dtype).to(DEVICE)
        k = qkv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, 2 * num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    else:
        k = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 4).to(dtype).to(DEVICE)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k[0, 0] = 0.0  # a row of zeros: a positive scale, zeros stored
    kc, vc, scales = layer_views(kv)
    write_kv_triton(k, v, kc, vc, slots.to(DEVICE), **scales)
    kc_ref, vc_ref, scales_ref = layer_views(kv_ref)
    write_kv_ref(k, v, kc_ref, vc_ref, slots.to(DEVICE), **scales_ref)
    assert torch.equal(kv, kv_ref)  # values and scales, written slots and untouched ones, bit for bit
    # What was stored dequantizes to within half a step of the input.
    valid = slots >= 0
    b, o = slots[valid] // block_size, slots[valid] % block_size
    back = dequantize_int8_rows_ref(kc[b, o], scales["k_scale_cache"][b, o])
    assert ((back - k[valid].float()).abs() <= scales["k_scale_cache"][b, o][..., None] / 2 * 1.0001).all()


def test_fused_rotary_write_int8_matches_reference():
    gen = torch.Generator().manual_seed(5)
    num_tokens, hq, hkv, d, bs = 9, 4, 2, 64, 16
    half = d // 2
    pos = torch.randint(0, 100, (num_tokens,), generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(half) / half))
    ang = torch.arange(128)[:, None] * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1).to(DEVICE)  # [max_position, head_dim]
    q = torch.randn(num_tokens, hq, d, generator=gen).to(DEVICE)
    k = torch.randn(num_tokens, hkv, d, generator=gen).to(DEVICE)
    v = torch.randn(num_tokens, hkv, d, generator=gen).to(DEVICE)
    slots = torch.randperm(3 * bs, generator=gen)[:num_tokens].to(DEVICE)
    kv = int8_cache(3, 1, bs, hkv, d, gen)
    kv_ref = kv.clone()
    kc, vc, scales = layer_views(kv, 0)
    q1, k1 = rotary_embedding_write_kv_triton(pos.to(DEVICE), q, k, v, cos_sin, kc, vc, slots, **scales)
    kc, vc, scales = layer_views(kv_ref, 0)
    q2, k2 = rotary_embedding_write_kv_ref(pos.to(DEVICE), q, k, v, cos_sin, kc, vc, slots, **scales)
    assert torch.allclose(q1, q2, atol=1e-5) and torch.allclose(k1, k2, atol=1e-5)
    # The same rotated k (to float32 rounding) quantized the same way: the stored values agree to one step.
    assert (kv.int() - kv_ref.int())[..., :d].abs().max() <= 1


def test_bad_arguments_name_the_argument():
    gen = torch.Generator().manual_seed(0)
    kv = int8_cache(3, 1, 16, 2, 64, gen)
    kc, vc, scales = layer_views(kv, 0)
    k = torch.randn(4, 2, 64, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale_cache: missing"):
        write_kv_triton(k, k, kc, vc, slots)
    with pytest.raises(ValueError, match="give both or neither"):
        write_kv_triton(k, k, kc, vc, slots, k_scale_cache=scales["k_scale_cache"])
    with pytest.raises(ValueError, match="v_scale_cache: torch.float32 \\(3, 16, 1\\)"):
        write_kv_triton(k, k, kc, vc, slots, k_scale_cache=scales["k_scale_cache"],
                        v_scale_cache=scales["v_scale_cache"][:, :, :1])
    with pytest.raises(ValueError, match="k_scale=2.0"):
        write_kv_triton(k, k, kc, vc, slots, 2.0, 1.0, **scales)
    with pytest.raises(ValueError, match="k_scale_cache: given"):
        write_kv_triton(k, k, torch.zeros(3, 16, 2, 64, device=DEVICE), torch.zeros(3, 16, 2, 64, device=DEVICE),
                        slots, **scales)
