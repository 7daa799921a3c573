"""kernels/paged_attention.py: the Triton kernel against paged_attention_ref.

On the CPU these run under TRITON_INTERPRET=1 (tests/kernels/conftest.py) with small shapes; on CUDA the same grid
runs, plus full Qwen2.5-7B shapes and a cache past 2**31 elements.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from kernels import paged_attention
from kernels.paged_attention import (PREFILL_CANDIDATES, PREFILL_MAX_BLOCK_M, PREFILL_NEW_KV, SHORT_DECODE_CONTEXT,
                                     decode_graph_lengths, default_config, paged_attention_ref,
                                     paged_attention_triton)

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_batch(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, kv_fp8=False, *, seed,
               num_layers=2, layer=1, spare_blocks=3, device=DEVICE):
    """specs: [(q_len, seq_len)]. Returns the kernel's arguments with K/V in the layer view of one strided
    [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] tensor; slots no sequence owns hold NaN."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    nblk = [math.ceil(sl / block_size) for _, sl in specs]
    num_blocks = sum(nblk) + spare_blocks
    kv = torch.full((num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), float("nan"))
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(nblk) + 2
    block_tables = torch.zeros(len(specs), max_blocks, dtype=torch.int32)
    used = 0
    for i, ((_, sl), n) in enumerate(zip(specs, nblk)):
        ids = perm[used:used + n]
        used += n
        block_tables[i, :n] = ids
        flat = torch.randn(n * block_size, 2, num_kv_heads, head_dim, generator=gen)
        flat[sl:] = float("nan")  # stale tail of the last block
        kv[ids, layer] = flat.view(n, block_size, 2, num_kv_heads, head_dim).transpose(1, 2)
    k_scale = v_scale = 1.0
    if kv_fp8:
        k_scale, v_scale = 0.02, 0.03
        kv[:, :, 0] /= k_scale
        kv[:, :, 1] /= v_scale
        kv = kv.to(torch.float8_e4m3fn)
    else:
        kv = kv.to(dtype)
    kv = kv.to(device)
    q_lens = torch.tensor([ql for ql, _ in specs])
    qsl = torch.zeros(len(specs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=gen).to(dtype).to(device)
    seq_lens = torch.tensor([sl for _, sl in specs], dtype=torch.int32)
    return dict(
        q=q, k_cache=kv[:, layer, 0], v_cache=kv[:, layer, 1], block_tables=block_tables.to(device),
        seq_lens=seq_lens.to(device), query_start_loc=qsl.to(device), max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()), scale=head_dim ** -0.5, k_scale=k_scale, v_scale=v_scale,
    )


def step_kv(args, strided=True, poison=True):
    """This step's keys and values (row t: the key of q's row t), gathered from the cache as write_kv stored them;
    then (poison) the cache's slots for them are set to NaN, so a kernel that reads them there instead shows it. v comes as
    a strided view (a slice of a wider tensor, like the engine's fused qkv projection). Returns (k, v, ref): the
    reference output, computed before the poisoning."""
    ref = paged_attention_ref(**args)
    kc, vc, bt = args["k_cache"], args["v_cache"], args["block_tables"]
    bs = kc.shape[1]
    qsl, seq_lens = args["query_start_loc"].tolist(), args["seq_lens"].tolist()
    blocks, offs = [], []
    for i, sl in enumerate(seq_lens):
        for pos in range(sl - (qsl[i + 1] - qsl[i]), sl):
            blocks.append(int(bt[i, pos // bs]))
            offs.append(pos % bs)
    blocks, offs = torch.tensor(blocks, device=kc.device), torch.tensor(offs, device=kc.device)
    k, v = kc[blocks, offs].clone(), vc[blocks, offs]  # [T, Hkv, D]
    if strided:
        wide = torch.full((v.shape[0], v.shape[1] + 3, v.shape[2]), float("nan"), dtype=v.dtype, device=v.device)
        wide[:, 2:2 + v.shape[1]] = v
        v = wide[:, 2:2 + v.shape[1]]
        assert not v.is_contiguous()
    else:
        v = v.clone()
    if poison:
        kc[blocks, offs] = float("nan")
        vc[blocks, offs] = float("nan")
    return k, v, ref


def check(args, config=None, seed=None, kv=None):
    """kv: (k, v, ref) from step_kv, else the reference is computed here."""
    q = args["q"]
    out = torch.full_like(q, float("nan"))
    extra = {} if kv is None else dict(k=kv[0], v=kv[1])
    res = paged_attention_triton(**args, out=out, config=config, **extra)
    assert res is out
    ref = paged_attention_ref(**args) if kv is None else kv[2]
    assert torch.isfinite(ref).all()
    assert torch.isfinite(out).all(), f"seed {seed}: kernel left unwritten (NaN) outputs or read stale slots"
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < TOL[q.dtype], f"seed {seed}: relative error {err:.2e} >= {TOL[q.dtype]:.0e}"


def ragged_specs(seed, num_seqs, max_ctx, max_q):
    """A mixed batch: prefill chunks with a cached prefix, whole prompts and decodes, random lengths."""
    gen = torch.Generator().manual_seed(seed)
    specs = [(1, 1), (max_q, max_q)]  # a first-token decode and a whole prompt with no prefix
    for _ in range(num_seqs - 2):
        ql = 1 if torch.rand(1, generator=gen) < 0.5 else int(torch.randint(2, max_q + 1, (1,), generator=gen))
        ctx = int(torch.randint(0, max_ctx, (1,), generator=gen))
        specs.append((ql, ctx + ql))
    return [specs[i] for i in torch.randperm(len(specs), generator=gen)]


# (head_dim, num_heads, num_kv_heads, block_size, dtype, kv_fp8): covers head sizes 64/128 (+80 padded),
# GQA ratios 1, 2, 3, 4, 7, 8, block sizes 16/32, three dtypes, fp8 KV.
GRID = [
    (64, 4, 4, 16, torch.float32, False),
    (64, 8, 4, 32, torch.float16, False),
    (128, 8, 2, 16, torch.bfloat16, False),
    (128, 8, 1, 32, torch.float32, False),
    (64, 14, 2, 16, torch.bfloat16, False),
    (80, 4, 2, 16, torch.float16, False),
    (128, 6, 2, 16, torch.float16, True),
    (64, 8, 1, 32, torch.bfloat16, True),
    (64, 4, 4, 16, torch.float32, True),
]


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,block_size,dtype,kv_fp8", GRID)
@pytest.mark.parametrize("new_kv", [0, 2])
def test_mixed_prefill_and_decode(head_dim, num_heads, num_kv_heads, block_size, dtype, kv_fp8, new_kv):
    seed = int(torch.randint(2**31, (1,)))  # fresh inputs each run; a failure prints its seed
    max_ctx, max_q = (2000, 300) if ON_CUDA else (70, 20)
    specs = ragged_specs(seed, 16 if ON_CUDA else 5, max_ctx, max_q)
    args = make_batch(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, kv_fp8, seed=seed)
    # new_kv 2: this step's keys from k/v (by TMA where the layout allows). An fp8 cache holds rounded keys, so the
    # kernel reads them from the cache whatever k/v say: these get random ones.
    kv = None
    if new_kv and kv_fp8:
        other = torch.randn(args["q"].shape[0], num_kv_heads, head_dim, device=DEVICE).to(dtype)
        kv = (other, other, paged_attention_ref(**args))
    elif new_kv:
        kv = step_kv(args)
    check(args, config=dict(new_kv=new_kv), seed=seed, kv=kv)


@pytest.mark.parametrize("new_kv", [1, 2])
@pytest.mark.parametrize("dtype,tile_n,block_m", [(torch.float32, 16, 16), (torch.float16, 32, 64),
                                                  (torch.bfloat16, 16, 32)])
def test_step_keys_from_k_v(new_kv, dtype, tile_n, block_m):
    # Cached prefixes of 0, a partial tile, exactly one tile and more; chunks shorter and longer than a tile;
    # decodes; the step's own cache slots hold NaN, so every one of its keys must come from k/v.
    specs = [(1, 1), (40, 40), (9, 9 + tile_n), (33, 33 + tile_n // 2), (1, 70), (17, 17 + 3 * tile_n + 5)]
    args = make_batch(specs, 8, 2, 64, 16, dtype, seed=tile_n + block_m + new_kv)
    check(args, config=dict(new_kv=new_kv, tile_n=tile_n, block_m=block_m), kv=step_kv(args))


@pytest.mark.parametrize("num_segments", [2, 4, 8])
@pytest.mark.parametrize("kv_fp8", [False, True])
def test_split_context_decode(num_segments, kv_fp8):
    # Lengths from 1 (most segments empty) to several tiles per segment; ragged tails.
    specs = [(1, 1), (1, 17), (1, 150), (1, 63)] if not ON_CUDA else [(1, n) for n in (1, 17, 4100, 9000, 777)]
    args = make_batch(specs, 8, 2, 64, 16, torch.bfloat16, kv_fp8, seed=num_segments * 7 + kv_fp8)
    check(args, config=dict(num_segments=num_segments, tile_n=16))


@pytest.mark.parametrize("fp8x4", [0, 1, 2])
@pytest.mark.parametrize("fp8_via_fp16", [0, 1])
def test_fp8_cache_bf16_queries_both_dot_paths(fp8_via_fp16, fp8x4):
    args = make_batch([(6, 50), (1, 33), (1, 200)], 8, 2, 128, 16, torch.bfloat16, True, seed=21)
    check(args, config=dict(fp8_via_fp16=fp8_via_fp16, fp8x4=fp8x4))


@pytest.mark.parametrize("fp8x4", [1, 2])  # 2 (PTX conversion) runs as 1 under the interpreter and in fp32
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_segments,tile_n", [(1, 16), (1, 64), (4, 16)])
def test_fp8_cache_read_in_words(dtype, num_segments, tile_n, fp8x4):
    # An fp8 cache read four values per 32-bit load (fp8x4) against the reference: decodes, and with one segment
    # prefill chunks under the causal mask; contexts ending inside a tile (the stale slots past them hold NaN
    # bytes), prefixes of one block and of several tiles.
    specs = [(1, 1), (1, 17), (1, 150), (1, 63), (1, 64)]
    if num_segments == 1:
        specs += [(9, 9), (20, 20 + 33), (5, 5 + 2 * tile_n)]
    for head_dim in (64, 128):
        args = make_batch(specs, 8, 2, head_dim, 16, dtype, True, seed=head_dim + num_segments + tile_n)
        check(args, config=dict(fp8x4=fp8x4, num_segments=num_segments, tile_n=tile_n, block_m=16))


def test_cache_words_only_where_the_layout_allows():
    from kernels.paged_attention import _cache_words
    from kernels.quant_int8 import int8_cache_views
    kv = torch.zeros(3, 2, 2, 16, 4, 64, dtype=torch.float8_e4m3fn)
    assert _cache_words(kv[:, 1, 0]).shape == (3, 16, 4, 16)
    assert _cache_words(kv[:, 1, 0].to(torch.bfloat16)) is None  # not an 8-bit cache
    assert _cache_words(kv[..., 1:61]) is None  # a row that does not start on a word
    assert _cache_words(torch.zeros(3, 16, 4, 66, dtype=torch.float8_e4m3fn)) is None  # head_dim not a multiple of 4
    # The engine's int8 values ("block" layout: a block's values, then its scales) are 16-word rows at head_dim 64;
    # the "row" layout's (head_dim values + a 4-byte scale) still start on words (17-word rows)
    cache = torch.zeros(3, 2, 2, 16, 4, 64 + 4, dtype=torch.int8)
    words = _cache_words(int8_cache_views(cache[:, 1, 0])[0])
    assert words.shape == (3, 16, 4, 16) and words.stride()[1:] == (4 * 16, 16, 1)
    words = _cache_words(int8_cache_views(cache[:, 1, 0], "row")[0])
    assert words.shape == (3, 16, 4, 16) and words.stride()[1:] == (4 * 17, 17, 1)


@pytest.mark.parametrize("num_segments", [1, 4])
def test_padded_sequences_give_zeros(num_segments):
    # CUDA-graph padding: extra decode slots with seq_len 0 see no key; the reference returns 0 there.
    args = make_batch([(1, 30), (1, 5), (1, 1)], 4, 2, 64, 16, torch.float32, seed=9)
    args["seq_lens"] = torch.tensor([30, 0, 0], dtype=torch.int32, device=DEVICE)
    out = paged_attention_triton(**args, config=dict(num_segments=num_segments, tile_n=16))
    ref = paged_attention_ref(**args)
    assert (ref[1:] == 0).all() and (out[1:] == 0).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_split_context_mixed_batch():
    # The split path is general: prefill chunks in a split launch must agree too.
    args = make_batch([(9, 60), (1, 40), (20, 20)], 4, 2, 64, 16, torch.float32, seed=11)
    check(args, config=dict(num_segments=4, tile_n=16))


@pytest.mark.parametrize("tile_n,block_m", [(16, 16), (32, 64), (64, 32), (32, 256)])
def test_tile_sizes_independent_of_block_size(tile_n, block_m):
    # tile_n below, at and above the cache block size (32), several query tiles per sequence.
    args = make_batch([(40, 100), (1, 65), (33, 33)], 8, 2, 64, 32, torch.float16, seed=tile_n + block_m)
    check(args, config=dict(tile_n=tile_n, block_m=block_m))


def test_strided_query_and_unit_batch():
    # q as the middle slice of a fused qkv projection [T, (H + 2*Hkv) * D]: token stride != H * D.
    args = make_batch([(5, 12)], 4, 2, 64, 16, torch.float32, seed=3)
    qkv = torch.randn(5, 8 * 64, device=DEVICE)
    qkv[:, :4 * 64] = args["q"].reshape(5, -1)
    args["q"] = qkv[:, :4 * 64].view(5, 4, 64)
    assert not args["q"].is_contiguous()
    check(args)


def test_dispatch_matches_reference_on_cpu_tensors():
    args = make_batch([(3, 9), (1, 4)], 4, 2, 64, 16, torch.float32, seed=5, device="cpu")
    torch.testing.assert_close(paged_attention(**args), paged_attention_ref(**args))


def test_default_config_splits_only_small_long_decodes():
    # (num_tokens, num_seqs, num_kv_heads, queries_per_kv, head_dim, max_query_len, max_seq_len, num_sms)
    assert default_config(1, 1, 4, 7, 128, 1, 32768, 132)["num_segments"] > 8
    assert default_config(8, 8, 4, 7, 128, 1, 4096, 132)["num_segments"] > 1
    assert default_config(64, 64, 4, 7, 128, 1, 4096, 132)["num_segments"] == 1
    big = default_config(4096, 1, 4, 7, 128, 4096, 4096, 132)
    assert (big["block_m"], big["num_segments"], big["new_kv"]) == (PREFILL_MAX_BLOCK_M, 1, PREFILL_NEW_KV)
    # the H200 sweep's best without TMA (tests below check it on CUDA): 128 rows, 8 warps, two programs per SM
    assert {k: big[k] for k in ("tile_n", "num_warps", "num_stages", "maxnreg")} == dict(
        tile_n=64, num_warps=8, num_stages=2, maxnreg=128)
    assert {k: big[k] for k in PREFILL_CANDIDATES[10]} == PREFILL_CANDIDATES[10]
    assert default_config(4096, 1, 4, 7, 128, 4096, 4096, 132, kv_fp8=True)["maxnreg"] == 0  # not measured
    assert default_config(4096, 1, 4, 7, 128, 4096, 4096, 132, q_bytes=4)["maxnreg"] == 0
    assert default_config(4096, 1, 4, 7, 256, 4096, 4096, 132)["block_m"] == 128
    assert default_config(4096, 1, 4, 7, 128, 4096, 4096, 132, q_bytes=4)["block_m"] == 128
    assert default_config(1, 1, 4, 7, 128, 1, 64, 132)["num_segments"] == 1
    # many decodes beside one chunk: smaller row tiles waste less on the decodes
    assert default_config(2048 + 255, 256, 4, 7, 128, 2048, 6144, 132)["block_m"] == 64


def test_default_config_short_decodes_and_small_prefill_tiles():
    # Llama-3-8B's attention (8 KV heads, 4 queries each) at TensorRT-LLM's 128/128 batch: short contexts at full
    # occupancy take 32-key tiles on 2 warps; long ones, small batches (split) and an int8 cache keep theirs.
    shape = (980, 980, 8, 4, 128, 1)
    for kv_fp8 in (False, True):
        short = default_config(*shape, 512, 132, kv_fp8=kv_fp8)
        long = default_config(*shape, 2048, 132, kv_fp8=kv_fp8)
        assert (short["tile_n"], short["num_warps"], long["tile_n"], long["num_warps"]) == (32, 2, 128, 4)
        assert short["fp8x4"] == long["fp8x4"] == (2 if kv_fp8 else 0)
    assert default_config(*shape, 513, 132)["tile_n"] == 128
    assert default_config(980, 980, 8, 4, 128, 1, 512, 132, kv_int8=True)["tile_n"] == 128
    assert default_config(4, 4, 8, 4, 128, 1, 512, 132)["num_segments"] > 1
    assert default_config(4, 4, 8, 4, 128, 1, 512, 132)["tile_n"] == 64
    # prefill: an fp8 cache's 128-row tiles on 4 warps; 64-row tiles keep 64-key tiles
    fp8_chunk = default_config(8192, 4, 8, 4, 128, 2048, 2048, 132, q_bytes=4, kv_fp8=True)
    assert (fp8_chunk["block_m"], fp8_chunk["num_warps"]) == (128, 4)
    assert default_config(8192, 4, 8, 4, 128, 2048, 2048, 132, q_bytes=4)["num_warps"] == 8
    small = default_config(64 * 128, 64, 8, 4, 128, 128, 128, 132)
    assert (small["block_m"], small["tile_n"]) == (64, 64)


def test_decode_graph_lengths_add_the_short_bound_where_the_launch_differs():
    # (max_model_len, num_seqs, num_kv_heads, queries_per_kv, head_dim, num_sms, q_bytes, kv_fp8, kv_int8)
    assert decode_graph_lengths(2064, 512, 8, 4, 128, 132) == (SHORT_DECODE_CONTEXT, 2064)
    assert decode_graph_lengths(2064, 1, 8, 4, 128, 132) == (SHORT_DECODE_CONTEXT, 2064)  # fewer segments
    assert decode_graph_lengths(SHORT_DECODE_CONTEXT, 512, 8, 4, 128, 132) == (SHORT_DECODE_CONTEXT,)
    assert decode_graph_lengths(2064, 512, 8, 4, 128, 132, kv_int8=True) == (2064,)


def test_launch_for_a_longer_bound_gives_the_same_output():
    # What a decode graph relies on: max_seq_len only shapes the launch (here past the short bound: other tiles
    # and warps, so another summation order); rows stop at their own seq_len.
    args = make_batch([(1, 5), (1, 40), (1, 33), (1, 17)], 8, 2, 64, 16, torch.float32, seed=11)
    bound = 2 * SHORT_DECODE_CONTEXT
    tables = torch.nn.functional.pad(args["block_tables"], (0, bound // 16 - args["block_tables"].shape[1]))
    bigger = dict(args, max_seq_len=bound, block_tables=tables)
    shape = (4, 4, 2, 4, 64, 1)
    assert default_config(*shape, args["max_seq_len"], 4)["tile_n"] != default_config(*shape, bound, 4)["tile_n"]
    ref = paged_attention_ref(**args)
    torch.testing.assert_close(paged_attention_triton(**args), ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(paged_attention_triton(**bigger), ref, rtol=2e-5, atol=2e-5)


def test_bad_arguments_name_the_argument():
    args = make_batch([(2, 5)], 4, 2, 64, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="num_heads=3 is not a multiple"):
        paged_attention_triton(**{**args, "q": torch.randn(2, 4, 64, device=DEVICE)[:, :3]})
    with pytest.raises(ValueError, match="k_cache: dtype"):
        paged_attention_triton(**{**args, "k_cache": args["k_cache"].half()})
    with pytest.raises(ValueError, match="seq_lens: dtype"):
        paged_attention_triton(**{**args, "seq_lens": args["seq_lens"].float()})
    with pytest.raises(ValueError, match="query_start_loc: shape"):
        paged_attention_triton(**{**args, "query_start_loc": args["query_start_loc"][:1]})
    with pytest.raises(ValueError, match="max_seq_len=1000"):
        paged_attention_triton(**{**args, "max_seq_len": 1000})
    with pytest.raises(ValueError, match="scale=0"):
        paged_attention_triton(**{**args, "scale": 0.0})
    with pytest.raises(ValueError, match="q: last-dim stride"):
        paged_attention_triton(**{**args, "q": args["q"].transpose(1, 2).contiguous().transpose(1, 2)})


@cuda_only
@pytest.mark.parametrize("dtype,kv_fp8", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False)])
@pytest.mark.parametrize("max_q", [1, 1024])
def test_qwen_shapes_full(dtype, kv_fp8, max_q):
    # Qwen2.5-7B: 28 query heads, 4 KV heads, head_dim 128; decodes to 8k context, prefill chunks of 1024.
    specs = [(1, 8192), (1, 3000), (1, 1)] + ([(max_q, 4096), (max_q, max_q), (17, 5000)] if max_q > 1 else
                                              [(1, n) for n in (100, 4096, 513)])
    check(make_batch(specs, 28, 4, 128, 16, dtype, kv_fp8, seed=max_q))


@cuda_only
@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("cfg", PREFILL_CANDIDATES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_prefill_candidates(cfg, kv_fp8):
    # Every configuration the sweep may make the default, at Qwen2.5-7B shapes: a fresh prompt, a chunk after a
    # prefix that is no multiple of any tile, a short prompt, decodes. bf16: the step's keys from k/v (their cache
    # slots hold NaN); fp8: from the cache.
    specs = [(1024, 1024), (777, 4133), (300, 300), (1, 2000), (77, 900)]
    args = make_batch(specs, 28, 4, 128, 16, torch.bfloat16, kv_fp8, seed=len(str(cfg)))
    check(args, config=cfg, kv=None if kv_fp8 else step_kv(args, poison=cfg["new_kv"] > 0))


@cuda_only
def test_cache_past_int32_offsets():
    # A cache of 70000 blocks x 2 x 16 x 8 x 128 = 2.3e9 elements: block ids above 65536 need 64-bit offsets.
    num_blocks, block_size, hkv, d = 70000, 16, 8, 128
    kv = torch.empty(num_blocks, 1, 2, block_size, hkv, d, dtype=torch.bfloat16, device="cuda")
    assert kv.numel() > 2**31
    seq_lens = [700, 1, 333]
    bt = torch.zeros(3, 48, dtype=torch.int32, device="cuda")
    top = num_blocks - 1
    for i, sl in enumerate(seq_lens):
        n = math.ceil(sl / block_size)
        ids = torch.arange(top - n + 1, top + 1, device="cuda").flip(0)
        top -= n
        bt[i, :n] = ids
        kv[ids] = torch.randn(n, 1, 2, block_size, hkv, d, device="cuda", dtype=torch.bfloat16)
    qsl = torch.tensor([0, 5, 6, 9], dtype=torch.int32, device="cuda")
    args = dict(q=torch.randn(9, 32, d, device="cuda", dtype=torch.bfloat16), k_cache=kv[:, 0, 0],
                v_cache=kv[:, 0, 1], block_tables=bt, seq_lens=torch.tensor(seq_lens, dtype=torch.int32,
                device="cuda"), query_start_loc=qsl, max_query_len=5, max_seq_len=700, scale=d ** -0.5)
    check(args)
    check(args, config=dict(num_segments=4))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("decode_only", [False, True])
def test_torch_cpu_path_matches_reference(kv_dtype, gqa, decode_only):
    """The CPU engine's SDPA path (kernels.paged_attention_torch) against the reference, on the CPU."""
    from kernels.paged_attention import paged_attention_torch

    torch.manual_seed(3)
    hkv, d, bs, nb = 2, 64, 16, 40
    h = hkv * gqa
    q_dtype = torch.bfloat16 if kv_dtype != torch.float32 else torch.float32
    k_cache = torch.randn(nb, bs, hkv, d).to(kv_dtype)
    v_cache = torch.randn(nb, bs, hkv, d).to(kv_dtype)
    seq_lens = torch.tensor([1, 33, 70], dtype=torch.int32)
    q_lens = [1, 1, 1] if decode_only else [1, 20, 70]
    qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    tables = torch.randperm(nb)[:15].view(3, 5).to(torch.int32)
    q = torch.randn(sum(q_lens), h, d).to(q_dtype)
    args = (q, k_cache, v_cache, tables, seq_lens, qsl, max(q_lens), 70, d ** -0.5, 0.5, 2.0)
    got, ref = paged_attention_torch(*args), paged_attention_ref(*args)
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < tol
