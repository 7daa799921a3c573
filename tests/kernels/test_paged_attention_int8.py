"""kernels/paged_attention.py over an int8 cache (a float32 scale per slot and KV head): the Triton kernel against
paged_attention_ref, and the CPU engine's paged_attention_torch against the same reference; prefill chunks and
decodes in one launch, split-context decodes, stale slots holding NaN scales. On the CPU under TRITON_INTERPRET=1."""
from __future__ import annotations

import math

import pytest
import torch

from kernels.paged_attention import paged_attention_ref, paged_attention_torch, paged_attention_triton
from kernels.quant_int8 import INT8_ROW_PAD, dequantize_int8_rows_ref, int8_cache_views, quantize_int8_rows_ref

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def int8_batch(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, *, seed, num_layers=2, layer=1,
               layout=None):
    """specs: [(q_len, seq_len)]. The kernel's arguments over the layer views of one engine-layout int8 cache
    [num_blocks, num_layers, 2, block_size, Hkv, head_dim + 4] (int8_cache_views' layout, the engine's by
    default), filled through quantize_int8_rows_ref; slots past
    a sequence's length and unowned blocks hold random bytes and NaN scales."""
    gen = torch.Generator().manual_seed(seed)
    nblk = [math.ceil(sl / block_size) for _, sl in specs]
    num_blocks = sum(nblk) + 3
    kv = torch.randint(-128, 128, (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim + INT8_ROW_PAD),
                       generator=gen, dtype=torch.int8)
    data, scales = int8_cache_views(kv, layout)
    scales.fill_(float("nan"))
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(specs), max(nblk) + 2, dtype=torch.int32)
    used = 0
    for i, ((_, sl), n) in enumerate(zip(specs, nblk)):
        ids = perm[used:used + n]
        used += n
        block_tables[i, :n] = ids
        x = torch.randn(n * block_size, 2, num_kv_heads, head_dim, generator=gen)
        x *= torch.rand(n * block_size, 2, num_kv_heads, 1, generator=gen) * 4  # rows of different ranges
        x_q, s = quantize_int8_rows_ref(x[:sl])
        for t in range(sl):
            b, o = ids[t // block_size], t % block_size
            data[b, layer, :, o] = x_q[t]
            scales[b, layer, :, o] = s[t]
    kv = kv.to(DEVICE)
    (kc, ks), (vc, vs) = int8_cache_views(kv[:, layer, 0], layout), int8_cache_views(kv[:, layer, 1], layout)
    q_lens = torch.tensor([ql for ql, _ in specs])
    qsl = torch.zeros(len(specs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    seq_lens = torch.tensor([sl for _, sl in specs], dtype=torch.int32)
    return dict(q=q, k_cache=kc, v_cache=vc, block_tables=block_tables.to(DEVICE), seq_lens=seq_lens.to(DEVICE),
                query_start_loc=qsl.to(DEVICE), max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()),
                scale=head_dim ** -0.5, k_scale_cache=ks, v_scale_cache=vs)


def check(args, config=None, tol=None):
    q = args["q"]
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(**args, out=out, config=config)
    ref = paged_attention_ref(**args)
    assert torch.isfinite(ref).all()
    assert torch.isfinite(out).all(), "kernel left outputs unwritten or read a stale slot's scale"
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < (tol or TOL[q.dtype]), f"relative error {err:.2e}"


MIXED = [(1, 1), (12, 12), (1, 40), (7, 7 + 21), (1, 17), (5, 5 + 33)]


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,block_size,dtype", [
    (64, 4, 4, 16, torch.float32), (64, 8, 2, 8, torch.float16), (128, 8, 2, 16, torch.bfloat16),
    (80, 6, 2, 16, torch.bfloat16)])
def test_mixed_prefill_and_decode(head_dim, num_heads, num_kv_heads, block_size, dtype):
    args = int8_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=head_dim + block_size)
    check(args)
    check(args, config=dict(new_kv=2))  # an int8 cache holds rounded keys: always read from the cache


@pytest.mark.parametrize("num_segments", [1, 4])
@pytest.mark.parametrize("tile_n", [16, 32])
def test_decodes_split_context(num_segments, tile_n):
    args = int8_batch([(1, 1), (1, 17), (1, 150), (1, 63)], 8, 2, 64, 16, torch.bfloat16, seed=num_segments + tile_n)
    check(args, config=dict(num_segments=num_segments, tile_n=tile_n, block_m=16))


def test_reference_is_attention_over_the_dequantized_cache():
    """The int8 reference equals the float reference over a float cache holding the dequantized values."""
    args = int8_batch(MIXED, 4, 2, 64, 16, torch.float32, seed=3)
    deq_k = dequantize_int8_rows_ref(args["k_cache"], args["k_scale_cache"].nan_to_num(0.0))
    deq_v = dequantize_int8_rows_ref(args["v_cache"], args["v_scale_cache"].nan_to_num(0.0))
    plain = {k: v for k, v in args.items() if not k.endswith("scale_cache")}
    want = paged_attention_ref(**{**plain, "k_cache": deq_k, "v_cache": deq_v})
    torch.testing.assert_close(paged_attention_ref(**args), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_engine_path_matches_reference(dtype):
    for specs in (MIXED, [(1, 30), (1, 5), (1, 64)]):  # mixed, then decodes only (SDPA's other branch)
        args = int8_batch(specs, 4, 2, 64, 16, dtype, seed=len(specs))
        out, ref = paged_attention_torch(**args), paged_attention_ref(**args)
        assert torch.isfinite(out).all()
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < TOL[dtype], err


def test_scales_required_and_checked():
    args = int8_batch([(1, 5)], 4, 2, 64, 16, torch.float32, seed=1)
    bare = {k: v for k, v in args.items() if not k.endswith("scale_cache")}
    with pytest.raises(ValueError, match="k_scale_cache: missing"):
        paged_attention_triton(**bare)
    with pytest.raises(ValueError, match="k_scale_cache: missing"):
        paged_attention_ref(**bare)
    with pytest.raises(ValueError, match="v_scale_cache: torch.float16"):
        paged_attention_triton(**{**args, "v_scale_cache": args["v_scale_cache"].half()})


@pytest.mark.parametrize("fp8x4", [1, 2])  # 2 (PTX conversion) runs as 1 under the interpreter and in fp32
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_segments,tile_n", [(1, 16), (1, 64), (4, 16)])
def test_int8_cache_read_in_words(dtype, num_segments, tile_n, fp8x4):
    # The engine-layout int8 cache read four values per 32-bit load (fp8x4) against the reference: decodes, and with
    # one segment prefill chunks under the causal mask; contexts ending inside a tile (stale slots hold NaN scales).
    # Value scales spread over nine decades, so that the word walk's rescaling (P over each tile's largest value
    # scale) meets tiles whose largest scale rises and falls.
    specs = [(1, 1), (1, 17), (1, 150), (1, 63), (1, 64)]
    if num_segments == 1:
        specs += [(9, 9), (20, 20 + 33), (5, 5 + 2 * tile_n)]
    for head_dim in (64, 128):
        args = int8_batch(specs, 8, 2, head_dim, 16, dtype, seed=head_dim + num_segments + tile_n)
        gen = torch.Generator().manual_seed(head_dim)
        spread = 10.0 ** torch.empty(args["v_scale_cache"].shape).uniform_(-6, 3, generator=gen)
        args["v_scale_cache"].mul_(spread.to(DEVICE))
        check(args, config=dict(fp8x4=fp8x4, num_segments=num_segments, tile_n=tile_n, block_m=16))


def test_int8_decode_configs_are_the_sweeps():
    """Unsplit decodes (large batches) read an int8 cache in 16-byte aligned words; split ones (small batches) byte
    by byte with three stages: INT8_DECODE and INT8_DECODE_SPLIT, the H200 sweep's winners."""
    from kernels.paged_attention import default_config
    for batch, seq_len in ((256, 640), (64, 4096)):
        cfg = default_config(batch, batch, 4, 7, 128, 1, seq_len, 132, kv_int8=True)
        assert cfg["num_segments"] == 1 and cfg["fp8x4"] == 2 and cfg["int8_align"] == 1, cfg
        assert cfg["num_stages"] == 2 and cfg["tile_n"] == 128 and cfg["maxnreg"] == 168, cfg
    cfg = default_config(1, 1, 4, 7, 128, 1, 640, 132, kv_int8=True)
    assert cfg["num_segments"] > 1 and cfg["fp8x4"] == 0 and cfg["num_stages"] == 3, cfg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # on CUDA: the PTX conversion, the shifts
@pytest.mark.parametrize("num_segments,tile_n", [(1, 16), (1, 64), (4, 16)])
def test_int8_cache_read_from_16_byte_boundaries(dtype, num_segments, tile_n):
    # int8_align: the word walk reads each row from the 16-byte boundary below it plus a 16-byte tail. Four KV heads
    # of the "row" layout (132-byte rows at head_dim 128, 68 at 64) start 0, 1, 2 and 3 words past a boundary, so
    # every shift of the queries, the tails and the output columns is met; value scales spread as above.
    from kernels.paged_attention import _align16_ok
    specs = [(1, 1), (1, 17), (1, 150), (1, 63), (1, 64)]
    if num_segments == 1:
        specs += [(9, 9), (20, 20 + 33), (5, 5 + 2 * tile_n)]
    for head_dim in (64, 128):
        args = int8_batch(specs, 16, 4, head_dim, 16, dtype, seed=head_dim + num_segments + tile_n, layout="row")
        assert _align16_ok(args["k_cache"]) and _align16_ok(args["v_cache"])
        gen = torch.Generator().manual_seed(head_dim)
        spread = 10.0 ** torch.empty(args["v_scale_cache"].shape).uniform_(-6, 3, generator=gen)
        args["v_scale_cache"].mul_(spread.to(DEVICE))
        check(args, config=dict(fp8x4=2, num_segments=num_segments, tile_n=tile_n, block_m=16, int8_align=1))


@pytest.mark.parametrize("int8_align", [0, 1])
@pytest.mark.parametrize("num_segments,tile_n", [(1, 16), (1, 64), (4, 16)])
def test_int8_block_layout_rows_are_16_byte_aligned(int8_align, num_segments, tile_n):
    # The "block" layout: a block's values [block_size, Hkv, head_dim], then its scales [Hkv, block_size]. Every
    # row starts on a 16-byte boundary, so int8_align takes ALIGN 2 (no shift, no tail) and 0 the plain word walk;
    # both against the reference, value scales spread as above.
    from kernels.paged_attention import LAST_LAUNCH, _align16_ok, _rows16_ok
    specs = [(1, 1), (1, 17), (1, 150), (1, 63), (1, 64)]
    if num_segments == 1:
        specs += [(9, 9), (20, 20 + 33), (5, 5 + 2 * tile_n)]
    for head_dim, num_kv_heads in ((64, 4), (128, 2)):
        args = int8_batch(specs, 4 * num_kv_heads, num_kv_heads, head_dim, 16, torch.float32, layout="block",
                          seed=head_dim + num_segments + tile_n)
        assert _rows16_ok(args["k_cache"]) and _rows16_ok(args["v_cache"]) and _align16_ok(args["k_cache"])
        assert args["k_scale_cache"].stride()[1:] == (1, 16), args["k_scale_cache"].stride()
        gen = torch.Generator().manual_seed(head_dim)
        spread = 10.0 ** torch.empty(args["v_scale_cache"].shape).uniform_(-6, 3, generator=gen)
        args["v_scale_cache"].mul_(spread.to(DEVICE))
        check(args, config=dict(fp8x4=2, num_segments=num_segments, tile_n=tile_n, block_m=16, int8_align=int8_align))
        assert LAST_LAUNCH["path"]["align16"] == (2 if int8_align else 0), LAST_LAUNCH["path"]
        check(args, config=dict(fp8x4=0, num_segments=num_segments, tile_n=tile_n, block_m=16))  # the byte walk


def test_int8_row_layout_rows_are_not_16_byte_aligned():
    from kernels.paged_attention import _rows16_ok
    args = int8_batch([(1, 40)], 8, 4, 128, 16, torch.float32, layout="row", seed=6)
    assert not _rows16_ok(args["k_cache"])


def test_int8_align_falls_back_where_the_layout_does_not_allow_it():
    # The "row" layout, two KV heads: 264-byte slots, so a head's rows sit at different distances past a
    # boundary; the launch takes the plain word walk instead (same result).
    from kernels.paged_attention import _align16_ok
    args = int8_batch([(1, 40), (3, 3 + 20)], 8, 2, 128, 16, torch.float32, seed=5, layout="row")
    assert not _align16_ok(args["k_cache"])
    check(args, config=dict(fp8x4=1, tile_n=16, block_m=16, int8_align=1))


def test_align16_ok_keeps_the_last_tail_inside_the_storage():
    # [2 blocks, 16 slots, 2 heads, 128 values] in 132-byte rows, a 528-byte slot pitch: the last row (head 1)
    # starts 4 bytes past a boundary, so its tail ends 8 bytes past its scale; a storage that ends at the scale is
    # refused.
    shape, stride = (2, 16, 2, 128), (16 * 528, 528, 132, 1)
    last_end = 8448 + 15 * 528 + 132 + 132
    tight = torch.empty(last_end, dtype=torch.int8).as_strided(shape, stride)
    roomy = torch.empty(last_end + 8, dtype=torch.int8).as_strided(shape, stride)
    from kernels.paged_attention import _align16_ok
    assert not _align16_ok(tight) and _align16_ok(roomy)
    assert not _align16_ok(roomy.as_strided(shape, (16 * 528, 520, 132, 1)))  # slot pitch not whole 16 bytes
