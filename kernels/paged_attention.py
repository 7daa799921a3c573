"""Attention over the paged KV cache: one function for prefill chunks and decodes.

Sequence i has q_len_i queries (q[query_start_loc[i]:query_start_loc[i+1]]) and seq_lens[i] tokens in the cache
after this step; its queries sit at the last q_len_i positions and attend causally. A decode is q_len_i == 1.

The Triton kernel (one launch for a mixed batch, as vLLM's unified Triton attention):
  - program (q_block, kv_head, segment) takes BLOCK_Q consecutive queries of one sequence and the QUERIES_PER_KV
    query heads that share kv_head, as one [BLOCK_M = BLOCK_Q * QUERIES_PER_KV (padded)] row tile, so each K/V
    tile is read once per KV head (GQA);
  - it walks the keys TILE_N at a time, each key's physical block looked up in the block table (TILE_N need not
    equal the cache block size), with an online softmax in float32 (exp2, scale folded with log2(e));
  - tiles every row may see run without the causal mask, the rest with it;
  - split context (flash decoding): with NUM_SEGMENTS > 1 each program covers one slice of the keys and writes an
    unnormalized partial output with its running max and sum; _reduce_segments_kernel combines them.
fp8 caches are converted to the query dtype on load; k_scale is folded into the softmax scale and v_scale into the
output. An int8 cache (k_scale_cache / v_scale_cache: a float32 scale per slot and KV head, kernels/quant_int8.py)
is converted exactly to the query dtype on load; each key's scale multiplies its column of raw scores, each
value's scale its column of probabilities before P @ V, so dequantization costs one multiply per score.
Decodes read an 8-bit cache (fp8 at large batches, int8 always) as int32 words of four values (FP8X4); with config
int8_align an int8 cache's rows are read with 16-byte loads (ALIGN16: _attend_tiles_words): rows that are only
word-aligned (the "row" layout, head_dim + 4 bytes each) from the 16-byte boundary below them, rows that are
16-byte aligned themselves (the "block" layout, kernels/quant_int8.int8_cache_views) as they are.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels._checks import (FLOAT_DTYPES, FP8_DTYPE, check_out, check_same_device, check_tensor, interpreting,
                             sm_count)
from kernels.kv_write import INT8_DTYPE, check_int8_scales
from kernels.quant_int8 import dequantize_int8_rows_ref


def gather_kv_ref(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    max_seq_len: int,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
    scale_cache: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] float32 (int8 cache)
) -> torch.Tensor:  # [num_seqs, max_seq_len, num_kv_heads, head_dim]
    """Reads each sequence's first max_seq_len cached tokens through its block table (dequantized)."""
    num_seqs = block_tables.shape[0]
    block_size = cache.shape[1]
    num_blocks_needed = triton.cdiv(max_seq_len, block_size)
    ids = block_tables[:, :num_blocks_needed].long()
    out = cache[ids]  # [num_seqs, nb, block_size, Hkv, D]
    out = out.reshape(num_seqs, num_blocks_needed * block_size, *cache.shape[2:])[:, :max_seq_len]
    if scale_cache is not None:  # stale slots' scales may be anything, NaN too: the callers clear those slots
        scales = scale_cache[ids].reshape(num_seqs, num_blocks_needed * block_size, -1)[:, :max_seq_len]
        out = dequantize_int8_rows_ref(out, scales, dtype or torch.float32)
    if dtype is not None:
        out = out.to(dtype)
    if scale != 1.0:
        out = out * scale
    return out


def _pad_queries(
    q: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatters the flat queries into a padded [S, max_query_len, H, D] grid. Returns (padded queries, seq_idx and
    pos_in_q of each flat query, causal mask [S, Q, L]: key j is visible iff j <= the query's absolute position)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    device = q.device
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]  # [S]
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)  # [T]
    pos_in_q = torch.arange(num_tokens, device=device) - qsl[seq_idx]  # [T]
    qp = q.new_zeros((num_seqs, max_query_len, num_heads, head_dim), dtype=dtype)
    qp[seq_idx, pos_in_q] = q.to(dtype)
    q_pos = (seq_lens.long() - q_lens)[:, None] + torch.arange(max_query_len, device=device)[None, :]  # [S, Q]
    k_pos = torch.arange(max_seq_len, device=device)  # [L]
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, Q, L]
    return qp, seq_idx, pos_in_q, mask


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    k_scale_cache: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] float32 (int8 cache)
    v_scale_cache: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Plain-torch reference: pads the batch to [num_seqs, max_query_len] and masks, in float32."""
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    device = q.device
    check_int8_scales(k_cache, v_cache, k_scale_cache, v_scale_cache)

    k = gather_kv_ref(k_cache, block_tables, max_seq_len, k_scale, torch.float32, k_scale_cache)  # [S, L, Hkv, D]
    v = gather_kv_ref(v_cache, block_tables, max_seq_len, v_scale, torch.float32, v_scale_cache)
    # Slots past seq_len (the tail of the last block, padding block 0) hold stale bytes, NaN among them in an fp8
    # cache: a zero probability times NaN is NaN, so they must not reach the matmuls.
    stale = torch.arange(max_seq_len, device=device)[None, :] >= seq_lens.long()[:, None]  # [S, L]
    k = k.masked_fill(stale[:, :, None, None], 0.0)
    v = v.masked_fill(stale[:, :, None, None], 0.0)

    qp, seq_idx, pos_in_q, mask = _pad_queries(q, seq_lens, query_start_loc, max_query_len, max_seq_len,
                                               torch.float32)

    qh = qp.permute(0, 2, 1, 3)  # [S, H, Q, D]
    kh = k.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)  # [S, H, L, D]
    vh = v.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [S, H, Q, L]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded query rows are all -inf
    out = torch.matmul(probs, vh)  # [S, H, Q, D]
    out = out.permute(0, 2, 1, 3)[seq_idx, pos_in_q]  # [T, H, D]
    return out.to(q.dtype)


def paged_attention_torch(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    k_scale_cache: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] float32 (int8 cache)
    v_scale_cache: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """The CPU engine's path: the reference's padding, with torch's SDPA doing grouped-query attention (no K/V
    copy per query head, no float32 copy of 16-bit inputs). Slots past seq_len are masked and cleared. An int8
    cache is dequantized into the gathered copies (in float32, then rounded to q's dtype)."""
    num_tokens, num_seqs, device = q.shape[0], seq_lens.shape[0], q.device
    k = gather_kv_ref(k_cache, block_tables, max_seq_len, k_scale, q.dtype,
                      k_scale_cache).transpose(1, 2)  # [S, Hkv, L, D]
    v = gather_kv_ref(v_cache, block_tables, max_seq_len, v_scale, q.dtype, v_scale_cache).transpose(1, 2)
    k_pos = torch.arange(max_seq_len, device=device)
    # Slots past seq_len may hold anything (NaN too), and a masked weight of 0 times NaN is NaN: clear them in the
    # gathered copies (advanced indexing copied them, so this never touches the cache).
    stale = (k_pos[None, :] >= seq_lens.long()[:, None])[:, None, :, None]  # [S, 1, L, 1]
    k.masked_fill_(stale, 0.0)
    v.masked_fill_(stale, 0.0)
    if max_query_len == 1 and num_tokens == num_seqs:  # decodes only: one query per sequence, nothing to pad
        out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=~stale.transpose(2, 3), scale=scale,
                                             enable_gqa=True)  # mask [S, 1, 1, L]
        return out[:, :, 0, :]
    qp, seq_idx, pos_in_q, mask = _pad_queries(q, seq_lens, query_start_loc, max_query_len, max_seq_len, q.dtype)
    out = F.scaled_dot_product_attention(qp.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2)[seq_idx, pos_in_q]  # [T, H, D]


# ----------------------------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence that owns global query block q_block: the last i with qsl[i] // BLOCK_Q + i <= q_block
    (sequence i's query blocks start there, so a block never straddles two sequences)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tiles(
    acc, l_i, m_i,  # [BLOCK_M, HEAD_DIM_PAD], [BLOCK_M], [BLOCK_M] running output, sum and max (log2 domain)
    q,  # [BLOCK_M, HEAD_DIM_PAD]
    q_pos,  # [BLOCK_M] position of each row's query, counted like the keys (from the source's key 0)
    bt_row_ptr,  # SOURCE 0: this sequence's block-table row
    kc_ptr, vc_ptr,  # SOURCE 0: k/v cache already offset to this KV head
    stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
    ks_ptr, vs_ptr,  # SOURCE 0, INT8: the slots' k/v scales, offset to this KV head
    stride_ks_b, stride_ks_s, stride_vs_b, stride_vs_s,
    kn_ptr, vn_ptr,  # SOURCE 1: the step's new k/v, offset to this sequence's first query row and this KV head
    stride_kn_t, stride_vn_t,
    k_desc, v_desc,  # SOURCE 2: TMA descriptors over the step's new k/v as [num_tokens, num_kv_heads * head_dim]
    desc_row, desc_col,  # SOURCE 2: this sequence's first query row, this KV head's first column
    qk_scale,
    kv_end,  # keys [0, kv_end) of the source may be read
    tile_lo, tile_hi,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    SOURCE: tl.constexpr,  # 0: the paged cache through the block table; 1: new k/v by pointers; 2: by TMA
    MASK: tl.constexpr,  # 0: every row sees every key; 1: causal (key <= q_pos); 2: keys < kv_end only
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    INT8: tl.constexpr,  # SOURCE 0 is an int8 cache: the scores times each key's scale, P times each value's
):
    """Keys past kv_end are never loaded (K and V read as 0; the stale tail of a cache block may hold NaN). With a
    causal mask a valid row sees only keys < kv_end anyway, so the score mask needs no kv_end test (it cost
    registers per thread: bench/RESULTS.md); padded rows may see junk, and are never stored."""
    MASKED: tl.constexpr = MASK != 0
    d = tl.arange(0, HEAD_DIM_PAD)
    n = tl.arange(0, TILE_N)
    for t in range(tile_lo, tile_hi):
        keys = t * TILE_N + n  # [TILE_N]
        key_ok = keys < kv_end
        if SOURCE == 0:
            if MASKED:
                blk = tl.load(bt_row_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            else:
                blk = tl.load(bt_row_ptr + keys // BLOCK_SIZE).to(tl.int64)
            off = keys % BLOCK_SIZE
            k_ptrs = kc_ptr + blk[None, :] * stride_kc_b + off[None, :] * stride_kc_s + d[:, None]  # [D_PAD, N]
            v_ptrs = vc_ptr + blk[:, None] * stride_vc_b + off[:, None] * stride_vc_s + d[None, :]  # [N, D_PAD]
        elif SOURCE == 1:
            rows = t * TILE_N + n  # 32-bit row offsets inside this sequence's chunk
            k_ptrs = kn_ptr + rows[None, :] * stride_kn_t + d[:, None]
            v_ptrs = vn_ptr + rows[:, None] * stride_vn_t + d[None, :]
        if SOURCE == 2:
            k = k_desc.load([desc_row + t * TILE_N, desc_col]).T  # [HEAD_DIM, TILE_N]; rows past the tensor read 0
            v = v_desc.load([desc_row + t * TILE_N, desc_col])
            if MASKED:  # rows of the next sequence: their scores are masked, and 0 * (their V) must not be NaN
                v = tl.where(key_ok[:, None], v, 0.0)
        elif MASKED:
            k = tl.load(k_ptrs, mask=(d[:, None] < HEAD_DIM) & key_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        elif HEAD_DIM_PAD != HEAD_DIM:
            k = tl.load(k_ptrs, mask=d[:, None] < HEAD_DIM, other=0.0)
            v = tl.load(v_ptrs, mask=d[None, :] < HEAD_DIM, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        k = k.to(q.dtype)  # fp8 (or int8, |x| <= 127) -> query dtype is exact
        v = v.to(q.dtype)

        s = tl.dot(q, k, input_precision=PRECISION)  # [BLOCK_M, TILE_N] raw scores
        if INT8:  # masked keys' scales read as 0: a stale slot's scale may be NaN
            ks_ptrs = ks_ptr + blk * stride_ks_b + off * stride_ks_s  # [TILE_N]
            vs_ptrs = vs_ptr + blk * stride_vs_b + off * stride_vs_s
            if MASKED:
                k_row_scale = tl.load(ks_ptrs, mask=key_ok, other=0.0)
                v_row_scale = tl.load(vs_ptrs, mask=key_ok, other=0.0)
            else:
                k_row_scale = tl.load(ks_ptrs)
                v_row_scale = tl.load(vs_ptrs)
            s = s * k_row_scale[None, :]
        p, alpha, l_i, m_i = _online_softmax(s, l_i, m_i, q_pos, keys, key_ok, qk_scale, MASK)
        acc = acc * alpha[:, None]
        if INT8:
            acc = tl.dot((p * v_row_scale[None, :]).to(v.dtype), v, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, l_i, m_i


@triton.jit
def _online_softmax(s, l_i, m_i, q_pos, keys, key_ok, qk_scale, MASK: tl.constexpr):
    """One tile's step of the online softmax over raw scores s [BLOCK_M, TILE_N]: the tile's probabilities (against
    the new running max), the factor that rescales what came before, and the new running sum and max."""
    if MASK == 1:
        s = tl.where(keys[None, :] <= q_pos[:, None], s, float("-inf"))
    elif MASK == 2:
        s = tl.where(key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # log2 domain (qk_scale > 0)
    if MASK != 0:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep exp2 finite
    p = tl.math.exp2(s * qk_scale - m_new[:, None])  # one FMA per score
    alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, l_i * alpha + tl.sum(p, axis=1), m_new


@triton.jit
def _fp8x4_unpack(w, dtype: tl.constexpr, ASM: tl.constexpr):
    """Four fp8 e4m3 values packed little-endian in each int32 of w -> four tensors of w's shape in dtype, byte j
    of every word in the j-th. ASM (fp16 only): two cvt.rn.f16x2.e4m3x2 per word, where the shifts, masks and
    truncations of the portable version cost ~4 instructions per value."""
    if ASM:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            """{
            .reg .b16 lo, hi;
            .reg .b32 a, b;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 a, lo;
            cvt.rn.f16x2.e4m3x2 b, hi;
            mov.b32 {$0, $1}, a;
            mov.b32 {$2, $3}, b;
            }""",
            "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        b0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dtype)
        b1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dtype)
        b2 = ((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dtype)
        b3 = ((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dtype)
    return b0, b1, b2, b3


@triton.jit
def _int8x4_unpack(w, dtype: tl.constexpr, ASM: tl.constexpr):
    """Four int8 values packed little-endian in each int32 of w -> four tensors of w's shape in dtype (exact: |x| <=
    128), byte j of every word in the j-th. ASM (fp16 only): the bytes, offset by 128, become the low mantissa bits
    of 1024.0 (prmt with 0x64 exponent bytes, two values per instruction), and 1152.0 is subtracted (sub.f16x2):
    five instructions per word; the shifts and int -> float casts of the portable version were up to 2x slower in
    decode (bench/RESULTS.md, "INT8 KV cache")."""
    if ASM:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            """{
            .reg .b32 x, e, c, a, b;
            xor.b32 x, $4, 0x80808080;
            mov.b32 e, 0x64646464;
            mov.b32 c, 0x64806480;
            prmt.b32 a, x, e, 0x4140;
            prmt.b32 b, x, e, 0x4342;
            sub.f16x2 a, a, c;
            sub.f16x2 b, b, c;
            mov.b32 {$0, $1}, a;
            mov.b32 {$2, $3}, b;
            }""",
            "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    else:  # sign-extending shifts
        b0 = ((w << 24) >> 24).to(dtype)
        b1 = ((w << 16) >> 24).to(dtype)
        b2 = ((w << 8) >> 24).to(dtype)
        b3 = (w >> 24).to(dtype)
    return b0, b1, b2, b3


@triton.jit
def _attend_tiles_words(
    acc0, acc1, acc2, acc3,  # [BLOCK_M, HEAD_DIM // 4] each: output columns 4i + j in acc_j (ALIGN: shifted)
    acc_t,  # ALIGN: [BLOCK_M, 32] the output columns of the rows' last 8 words (else unused)
    l_i, m_i,
    v_unit,  # INT8: acc holds the output over this (the last tile's largest value scale); else 1
    q0, q1, q2, q3,  # [BLOCK_M, HEAD_DIM // 4] each: query columns 4i + j in q_j (ALIGN: shifted)
    q_t,  # ALIGN: [BLOCK_M, 16] the query columns of the rows' tail words, 0 where the tail holds no value
    q_pos, bt_row_ptr,
    kc_ptr, vc_ptr,  # int32 views of the 8-bit cache, offset to this KV head (ALIGN: to the 16 bytes below it)
    stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,  # in int32 words
    ks_ptr, vs_ptr,  # INT8: the slots' k/v scales, offset to this KV head
    stride_ks_b, stride_ks_s, stride_vs_b, stride_vs_s,
    qk_scale, kv_end, tile_lo, tile_hi,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASK: tl.constexpr,
    PRECISION: tl.constexpr, ASM: tl.constexpr,
    INT8: tl.constexpr,  # int8 values with a scale per slot (else fp8 e4m3 with the launch's k/v scales)
    ALIGN: tl.constexpr,  # INT8, 16-byte loads: 1 rows read from the 16-byte boundary below them (see below); 2 rows
    #                       16-byte aligned themselves (no shift, no tail); 0 neither
):
    """_attend_tiles over an 8-bit cache (fp8 or int8) read four values per load: one 32-bit address per four keys'
    (or values') bytes instead of one per byte, which is what bounded the byte-wise fp8 walk (docs/kernels.md); an
    int8 cache's rows (head_dim + 4 bytes) are only word-aligned, so its byte walk could not even vectorize. Each
    word's byte j is column 4i + j, so q . k is the sum of four dots over the columns j mod 4, and P @ V fills the
    four column sets of the output.

    INT8: the raw scores times each key's scale; P times each value's scale over the tile's largest, so the P @ V
    operands stay in [0, 1] (fp16 dots neither overflow nor lose small products to subnormals), and the ratio of
    the previous tile's largest to this one's joins the factor that rescales acc.

    ALIGN (int8): every row of this KV head starts the same SHIFT words (0-3) past a 16-byte boundary (the launcher
    checks the strides), so each row is read as head_dim / 4 words from that boundary (16-byte loads: row words
    -SHIFT .. head_dim / 4 - 1 - SHIFT, the first SHIFT of them the row before's) and a 16-byte tail after them
    (bytes: the row's last 4 SHIFT values, its scale, the next row's first bytes). q0..q3 and q_t are loaded
    shifted to match, zero where the words hold no value of this row (int8 bytes of any kind convert to finite
    values, so q = 0 cancels them); the tail's scores are one more dot (K = 16). The values' tail dot reads 32 bytes,
    the 16 before the tail too (a dot of N = 16 made Triton lay every dot's warps along the 16 rows, 4x the
    work), and its first 16 output columns are dropped on the store.

    ALIGN 2: every row starts on a 16-byte boundary (the launcher checks the strides): the plain word walk with the
    rows' alignment asserted, so its loads are 16 bytes wide; no shift and no tail."""
    d4 = tl.arange(0, HEAD_DIM // 4)
    n = tl.arange(0, TILE_N)
    b16 = tl.arange(0, 16)
    b32 = tl.arange(0, 32)
    for t in range(tile_lo, tile_hi):
        keys = t * TILE_N + n  # [TILE_N]
        key_ok = keys < kv_end
        if MASK != 0:
            blk = tl.load(bt_row_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row_ptr + keys // BLOCK_SIZE).to(tl.int64)
        off = keys % BLOCK_SIZE
        k_rows = blk * stride_kc_b + off * stride_kc_s  # [TILE_N] in words (ALIGN: multiples of 4)
        v_rows = blk * stride_vc_b + off * stride_vc_s
        if ALIGN != 0:  # (a hint on the strides alone does not reach the loads' alignment analysis)
            k_rows = tl.multiple_of(k_rows, 4)
            v_rows = tl.multiple_of(v_rows, 4)
        k_ptrs = kc_ptr + k_rows[None, :] + d4[:, None]  # [D / 4, N]
        v_ptrs = vc_ptr + v_rows[:, None] + d4[None, :]  # [N, D / 4]
        if MASK != 0:  # words past kv_end read as 0 (four zeros): a stale cache tail may hold NaN bytes
            kw = tl.load(k_ptrs, mask=key_ok[None, :], other=0)
            vw = tl.load(v_ptrs, mask=key_ok[:, None], other=0)
        else:
            kw = tl.load(k_ptrs)
            vw = tl.load(v_ptrs)
        if ALIGN == 1:  # keys: the 16 bytes after the head_dim / 4 words [16, N]; values: the 32 ending there [N, 32]
            kt_ptrs = kc_ptr.to(tl.pointer_type(tl.int8)) + (k_rows * 4 + HEAD_DIM)[None, :] + b16[:, None]
            vt_ptrs = vc_ptr.to(tl.pointer_type(tl.int8)) + (v_rows * 4 + HEAD_DIM - 16)[:, None] + b32[None, :]
            if MASK != 0:
                kt = tl.load(kt_ptrs, mask=key_ok[None, :], other=0)
                vt = tl.load(vt_ptrs, mask=key_ok[:, None], other=0)
            else:
                kt = tl.load(kt_ptrs)
                vt = tl.load(vt_ptrs)
        if INT8:  # masked keys' scales read as 0: a stale slot's scale may be NaN
            ks_ptrs = ks_ptr + blk * stride_ks_b + off * stride_ks_s  # [TILE_N]
            vs_ptrs = vs_ptr + blk * stride_vs_b + off * stride_vs_s
            if MASK != 0:
                k_row_scale = tl.load(ks_ptrs, mask=key_ok, other=0.0)
                v_row_scale = tl.load(vs_ptrs, mask=key_ok, other=0.0)
            else:
                k_row_scale = tl.load(ks_ptrs)
                v_row_scale = tl.load(vs_ptrs)
            k0, k1, k2, k3 = _int8x4_unpack(kw, q0.dtype, ASM)
        else:
            k0, k1, k2, k3 = _fp8x4_unpack(kw, q0.dtype, ASM)
        s = tl.dot(q0, k0, input_precision=PRECISION)
        s = tl.dot(q1, k1, s, input_precision=PRECISION)
        s = tl.dot(q2, k2, s, input_precision=PRECISION)
        s = tl.dot(q3, k3, s, input_precision=PRECISION)
        if ALIGN == 1:
            s = tl.dot(q_t, kt.to(q0.dtype), s, input_precision=PRECISION)
        if INT8:
            s = s * k_row_scale[None, :]
        p, alpha, l_i, m_i = _online_softmax(s, l_i, m_i, q_pos, keys, key_ok, qk_scale, MASK)
        if INT8:
            v_top = tl.max(v_row_scale, axis=0)  # > 0: every tile walked holds a valid key
            v_top = tl.where(v_top > 0.0, v_top, v_unit)
            p = p * (v_row_scale / v_top)[None, :]
            alpha = alpha * (v_unit / v_top)
            v_unit = v_top
            v0, v1, v2, v3 = _int8x4_unpack(vw, q0.dtype, ASM)
        else:
            v0, v1, v2, v3 = _fp8x4_unpack(vw, q0.dtype, ASM)
        p = p.to(q0.dtype)
        acc0 = tl.dot(p, v0, acc0 * alpha[:, None], input_precision=PRECISION)
        acc1 = tl.dot(p, v1, acc1 * alpha[:, None], input_precision=PRECISION)
        acc2 = tl.dot(p, v2, acc2 * alpha[:, None], input_precision=PRECISION)
        acc3 = tl.dot(p, v3, acc3 * alpha[:, None], input_precision=PRECISION)
        if ALIGN == 1:
            acc_t = tl.dot(p, vt.to(q0.dtype), acc_t * alpha[:, None], input_precision=PRECISION)
    return acc0, acc1, acc2, acc3, acc_t, l_i, m_i, v_unit


@triton.jit
def _load_q(q_base, q_rows, row_ok, cols, HEAD_DIM: tl.constexpr, DOT_FP32: tl.constexpr,
            FP8_VIA_FP16: tl.constexpr):
    """The row tile's queries at columns cols (0 outside [0, HEAD_DIM)), in the dots' operand dtype."""
    col_ok = (cols >= 0) & (cols < HEAD_DIM)
    q = tl.load(q_base + q_rows[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    elif FP8_VIA_FP16:
        # fp8 -> fp16 is one instruction per pair on Hopper (-> bf16 goes through fp32): with an fp8 cache and bf16
        # queries the dots run in fp16 (float32 accumulation; |q| clamped to fp16's range).
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def _store_fp8x4_parts(ptrs, factor, a0, a1, a2, a3, a_t, shift, row_ok, HEAD_DIM: tl.constexpr,
                       ALIGN: tl.constexpr):
    """Stores the four column sets (4i + j in a_j) of a row tile, times factor, at ptrs [BLOCK_M, 1] + column.
    ALIGN: the column sets are shifted by shift words (4 (i - shift) + j in a_j; the first shift words hold no
    column) and a_t [BLOCK_M, 32] holds columns HEAD_DIM - 16 - 4 shift + b, of which b >= 16 and < HEAD_DIM are
    stored, as _attend_tiles_words' ALIGN 1 leaves them."""
    cols = tl.arange(0, HEAD_DIM // 4) * 4
    ty = ptrs.dtype.element_ty
    if ALIGN == 1:
        cols = cols - 4 * shift
        ok = row_ok[:, None] & (cols >= 0)[None, :]
        b = tl.arange(0, 32)
        cols_t = b + (HEAD_DIM - 16 - 4 * shift)
        tl.store(ptrs + cols_t[None, :], (a_t * factor).to(ty),
                 mask=row_ok[:, None] & ((b >= 16) & (cols_t < HEAD_DIM))[None, :])
    else:
        ok = row_ok[:, None]
    tl.store(ptrs + cols[None, :], (a0 * factor).to(ty), mask=ok)
    tl.store(ptrs + (cols + 1)[None, :], (a1 * factor).to(ty), mask=ok)
    tl.store(ptrs + (cols + 2)[None, :], (a2 * factor).to(ty), mask=ok)
    tl.store(ptrs + (cols + 3)[None, :], (a3 * factor).to(ty), mask=ok)


@triton.jit
def _opaque_zero(OPAQUE: tl.constexpr):
    """0, made by an instruction the compiler must keep in place: values derived from it are computed where they
    are used, not hoisted (and kept live) above a loop."""
    if OPAQUE:
        return tl.inline_asm_elementwise("mov.b32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return 0


# Per-step integers are not specialized: Triton would otherwise compile a new variant whenever num_seqs or the
# block-table width changes between 1, multiples of 16 and the rest (a compile stall in the middle of serving).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]            (NUM_SEGMENTS == 1)
    seg_out_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_DIM_PAD] f32 (NUM_SEGMENTS > 1)
    seg_max_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] f32, log2 domain
    seg_sum_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] f32
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_new_ptr,  # [num_tokens, num_kv_heads, head_dim] this step's keys (NEW_KV == 1)
    v_new_ptr,  # [num_tokens, num_kv_heads, head_dim] this step's values (NEW_KV == 1)
    k_desc,  # TMA descriptor over this step's keys as [num_tokens, num_kv_heads * head_dim] (NEW_KV == 2)
    v_desc,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale_cache_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (INT8)
    v_scale_cache_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (INT8)
    block_tables_ptr,  # [num_seqs, max_blocks]
    seq_lens_ptr,  # [num_seqs]
    qsl_ptr,  # [num_seqs + 1]
    qk_scale,  # scale * k_scale * log2(e)
    v_scale,
    num_seqs,
    num_heads,
    stride_q_t, stride_q_h,
    stride_o_t, stride_o_h,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    stride_ks_b, stride_ks_s, stride_ks_h,
    stride_vs_b, stride_vs_s, stride_vs_h,
    stride_bt,
    stride_kn_t, stride_kn_h, stride_vn_t, stride_vn_h,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q queries x QUERIES_PER_KV heads, padded to a power of 2
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,  # keys per inner iteration
    NUM_SEGMENTS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # upcast dot operands (float32 inputs; the interpreter, which multiplies bf16 wrongly)
    FP8_VIA_FP16: tl.constexpr,
    PRECISION: tl.constexpr,
    NEW_KV: tl.constexpr,  # this step's keys from k/v instead of the cache: 0 no, 1 by pointers, 2 by TMA
    OPAQUE_ZERO: tl.constexpr,  # False under the interpreter (no inline PTX there)
    FP8X4: tl.constexpr,  # an 8-bit cache (fp8, int8) read as int32 words of four values (k/v_cache_ptr, strides in
    #                       words): 0 no, 1 unpacked by shifts and casts, 2 by PTX (fp16 dots on a GPU)
    INT8: tl.constexpr,  # an int8 cache with a scale per slot and KV head
    ALIGN16: tl.constexpr,  # FP8X4 and INT8, 16-byte loads (_attend_tiles_words' ALIGN): 1 rows read from the
    #                         16-byte boundary below them, 2 rows 16-byte aligned themselves; 0 neither
):
    # Last query blocks first: under the causal mask they see the most keys, so the cheap ones fill the tail.
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    q_first = q_block_local * BLOCK_Q  # the block's first query inside the sequence
    rows = tl.arange(0, BLOCK_M)  # row = query * QUERIES_PER_KV + head in the group
    q_local = q_first + rows // QUERIES_PER_KV  # [BLOCK_M] query index inside the sequence
    row_ok = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_local < q_len)
    d = tl.arange(0, HEAD_DIM_PAD)
    # 64-bit base of the block (query q_first, the group's first head), 32-bit offsets of its rows
    q_base = q_ptr + (q_start + q_first).to(tl.int64) * stride_q_t + kv_head * QUERIES_PER_KV * stride_q_h
    q_rows = (rows // QUERIES_PER_KV) * stride_q_t + (rows % QUERIES_PER_KV) * stride_q_h  # [BLOCK_M]
    q_pos = context_len + q_local

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kc_ptr = k_cache_ptr + kv_head * stride_kc_h
    vc_ptr = v_cache_ptr + kv_head * stride_vc_h
    ks_ptr = k_scale_cache_ptr + kv_head * stride_ks_h
    vs_ptr = v_scale_cache_ptr + kv_head * stride_vs_h
    # Keys this tile needs: up to its last query's position.
    kv_end = context_len + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len)
    if NEW_KV == 0:
        # Every key from the cache. Tiles below full_tiles hold keys every row sees: no mask there.
        num_tiles = tl.cdiv(kv_end, TILE_N)
        full_tiles = (context_len + q_block_local * BLOCK_Q + 1) // TILE_N
        if NUM_SEGMENTS > 1:
            tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
            tile_lo = segment * tiles_per_segment
            tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)
        else:
            tile_lo = 0
            tile_hi = num_tiles
    if FP8X4:
        d4 = tl.arange(0, HEAD_DIM // 4) * 4
        k_shift = 0
        v_shift = 0
        if ALIGN16 == 2:  # every row 16-byte aligned (the launcher checked the strides)
            kc_ptr = k_cache_ptr + tl.multiple_of(kv_head * stride_kc_h, 4)
            vc_ptr = v_cache_ptr + tl.multiple_of(kv_head * stride_vc_h, 4)
        if ALIGN16 == 1:  # rows from the 16-byte boundary below this KV head's (the launcher checked the strides)
            k_shift = (kv_head * stride_kc_h) % 4
            v_shift = (kv_head * stride_vc_h) % 4
            kc_ptr = k_cache_ptr + tl.multiple_of(kv_head * stride_kc_h - k_shift, 4)
            vc_ptr = v_cache_ptr + tl.multiple_of(kv_head * stride_vc_h - v_shift, 4)
        q0 = _load_q(q_base, q_rows, row_ok, d4 - 4 * k_shift, HEAD_DIM, DOT_FP32, FP8_VIA_FP16)
        q1 = _load_q(q_base, q_rows, row_ok, d4 - 4 * k_shift + 1, HEAD_DIM, DOT_FP32, FP8_VIA_FP16)
        q2 = _load_q(q_base, q_rows, row_ok, d4 - 4 * k_shift + 2, HEAD_DIM, DOT_FP32, FP8_VIA_FP16)
        q3 = _load_q(q_base, q_rows, row_ok, d4 - 4 * k_shift + 3, HEAD_DIM, DOT_FP32, FP8_VIA_FP16)
        q_t = _load_q(q_base, q_rows, row_ok, tl.arange(0, 16) + (HEAD_DIM - 4 * k_shift), HEAD_DIM, DOT_FP32,
                      FP8_VIA_FP16)
        acc0 = tl.zeros([BLOCK_M, HEAD_DIM // 4], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, HEAD_DIM // 4], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_M, HEAD_DIM // 4], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_M, HEAD_DIM // 4], dtype=tl.float32)
        acc_t = tl.zeros([BLOCK_M, 32], dtype=tl.float32)
        v_unit = tl.full([], 1.0, tl.float32)
        acc0, acc1, acc2, acc3, acc_t, l_i, m_i, v_unit = _attend_tiles_words(
            acc0, acc1, acc2, acc3, acc_t, l_i, m_i, v_unit, q0, q1, q2, q3, q_t, q_pos, bt_row_ptr, kc_ptr, vc_ptr,
            stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s, ks_ptr, vs_ptr, stride_ks_b, stride_ks_s, stride_vs_b,
            stride_vs_s, qk_scale, kv_end, tile_lo, tl.minimum(tile_hi, full_tiles), HEAD_DIM, BLOCK_SIZE, TILE_N, 0,
            PRECISION, FP8X4 == 2, INT8, ALIGN16)
        acc0, acc1, acc2, acc3, acc_t, l_i, m_i, v_unit = _attend_tiles_words(
            acc0, acc1, acc2, acc3, acc_t, l_i, m_i, v_unit, q0, q1, q2, q3, q_t, q_pos, bt_row_ptr, kc_ptr, vc_ptr,
            stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s, ks_ptr, vs_ptr, stride_ks_b, stride_ks_s, stride_vs_b,
            stride_vs_s, qk_scale, kv_end, tl.maximum(tile_lo, full_tiles), tile_hi, HEAD_DIM, BLOCK_SIZE, TILE_N, 1,
            PRECISION, FP8X4 == 2, INT8, ALIGN16)
    elif NEW_KV == 0:
        q = _load_q(q_base, q_rows, row_ok, d, HEAD_DIM, DOT_FP32, FP8_VIA_FP16)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, bt_row_ptr, kc_ptr, vc_ptr, stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
            ks_ptr, vs_ptr, stride_ks_b, stride_ks_s, stride_vs_b, stride_vs_s,
            k_new_ptr, v_new_ptr, stride_kn_t, stride_vn_t, k_desc, v_desc, 0, 0,
            qk_scale, kv_end, tile_lo, tl.minimum(tile_hi, full_tiles),
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, 0, 0, DOT_FP32, PRECISION, INT8)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, bt_row_ptr, kc_ptr, vc_ptr, stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
            ks_ptr, vs_ptr, stride_ks_b, stride_ks_s, stride_vs_b, stride_vs_s,
            k_new_ptr, v_new_ptr, stride_kn_t, stride_vn_t, k_desc, v_desc, 0, 0,
            qk_scale, kv_end, tl.maximum(tile_lo, full_tiles), tile_hi,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, 0, 1, DOT_FP32, PRECISION, INT8)
    else:
        q = _load_q(q_base, q_rows, row_ok, d, HEAD_DIM, DOT_FP32, FP8_VIA_FP16)
        # The cached prefix [0, context_len) from the cache: every row sees all of it (only its last, partial tile
        # masks, against context_len). Then this step's keys, row q_start + j holding position context_len + j,
        # from k/v (one segment only): tiles below new_full are seen by every row, the rest mask causally.
        # (Positions inside the chunk, not absolute ones, in that mask: comparing against context_len + j cost
        # registers per thread: bench/RESULTS.md.)
        ctx_full = context_len // TILE_N
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, bt_row_ptr, kc_ptr, vc_ptr, stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
            ks_ptr, vs_ptr, stride_ks_b, stride_ks_s, stride_vs_b, stride_vs_s,
            k_new_ptr, v_new_ptr, stride_kn_t, stride_vn_t, k_desc, v_desc, 0, 0,
            qk_scale, context_len, 0, ctx_full,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, 0, 0, DOT_FP32, PRECISION, INT8)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, bt_row_ptr, kc_ptr, vc_ptr, stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
            ks_ptr, vs_ptr, stride_ks_b, stride_ks_s, stride_vs_b, stride_vs_s,
            k_new_ptr, v_new_ptr, stride_kn_t, stride_vn_t, k_desc, v_desc, 0, 0,
            qk_scale, context_len, ctx_full, tl.cdiv(context_len, TILE_N),
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, 0, 2, DOT_FP32, PRECISION, INT8)
        kn_ptr = k_new_ptr + q_start.to(tl.int64) * stride_kn_t + kv_head * stride_kn_h
        vn_ptr = v_new_ptr + q_start.to(tl.int64) * stride_vn_t + kv_head * stride_vn_h
        # Counted inside the chunk: key j of the new ones is visible to the query q_local >= j.
        new_end = kv_end - context_len
        new_full = (q_first + 1) // TILE_N
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_local, bt_row_ptr, kc_ptr, vc_ptr, stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
            ks_ptr, vs_ptr, stride_ks_b, stride_ks_s, stride_vs_b, stride_vs_s,
            kn_ptr, vn_ptr, stride_kn_t, stride_vn_t, k_desc, v_desc, q_start, kv_head * HEAD_DIM,
            qk_scale, new_end, 0, new_full,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, NEW_KV, 0, DOT_FP32, PRECISION, INT8)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_local, bt_row_ptr, kc_ptr, vc_ptr, stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
            ks_ptr, vs_ptr, stride_ks_b, stride_ks_s, stride_vs_b, stride_vs_s,
            kn_ptr, vn_ptr, stride_kn_t, stride_vn_t, k_desc, v_desc, q_start, kv_head * HEAD_DIM,
            qk_scale, new_end, new_full, tl.cdiv(new_end, TILE_N),
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, NEW_KV, 1, DOT_FP32, PRECISION, INT8)

    # The rows' addresses again, from a zero the compiler cannot see through: computed before the loops, they were
    # kept live through them (registers, and spills in the largest tiles: bench/RESULTS.md).
    rows = tl.arange(0, BLOCK_M) + _opaque_zero(OPAQUE_ZERO)
    q_local = q_first + rows // QUERIES_PER_KV
    row_ok = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_local < q_len)
    d_ok = d[None, :] < HEAD_DIM
    if NUM_SEGMENTS == 1:
        # l_i == 0 only for a row that sees no key: a padded sequence (seq_len 0, as CUDA-graph padding makes);
        # its acc is 0, so it gets 0 like the reference instead of 0/0.
        factor = (v_scale / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
        o_base = out_ptr + (q_start + q_first).to(tl.int64) * stride_o_t + kv_head * QUERIES_PER_KV * stride_o_h
        o_rows = (rows // QUERIES_PER_KV) * stride_o_t + (rows % QUERIES_PER_KV) * stride_o_h  # [BLOCK_M]
        if FP8X4:
            _store_fp8x4_parts(o_base + o_rows[:, None], factor * v_unit, acc0, acc1, acc2, acc3, acc_t, v_shift,
                               row_ok, HEAD_DIM, ALIGN16)
        else:
            tl.store(o_base + o_rows[:, None] + d[None, :], (acc * factor).to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok)
    else:
        tok = (q_start + q_local).to(tl.int64)  # [BLOCK_M]
        heads = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV  # [BLOCK_M]
        part = (tok * num_heads + heads) * NUM_SEGMENTS + segment  # [BLOCK_M]
        if FP8X4:
            _store_fp8x4_parts(seg_out_ptr + part[:, None] * HEAD_DIM_PAD, v_scale * v_unit, acc0, acc1, acc2, acc3,
                               acc_t, v_shift, row_ok, HEAD_DIM, ALIGN16)
        else:
            tl.store(seg_out_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], acc * v_scale, mask=row_ok[:, None])
        tl.store(seg_max_ptr + part, m_i, mask=row_ok)
        tl.store(seg_sum_ptr + part, l_i, mask=row_ok)


@triton.jit
def _reduce_segments_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    seg_out_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_DIM_PAD] f32
    seg_max_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] f32
    seg_sum_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] f32
    stride_o_t, stride_o_h,
    num_heads,
    NUM_SEGMENTS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seg = tl.arange(0, NUM_SEGMENTS)
    d = tl.arange(0, HEAD_DIM_PAD)
    part = (tok * num_heads + head) * NUM_SEGMENTS + seg  # [NUM_SEGMENTS]
    seg_max = tl.load(seg_max_ptr + part)
    top = tl.max(seg_max, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every segment empty: a padded sequence
    w = tl.math.exp2(seg_max - top)  # an empty segment (max -inf) weighs 0
    total = tl.sum(tl.load(seg_sum_ptr + part) * w, axis=0)
    acc = tl.load(seg_out_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :])  # [NUM_SEGMENTS, HEAD_DIM_PAD]
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + tok * stride_o_t + head * stride_o_h + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _tma_ok(t: torch.Tensor, head_dim: int, head_dim_pad: int) -> bool:
    """Whether [num_tokens, num_kv_heads, head_dim] t can be read as one 2-D TMA descriptor: heads adjacent, a
    power-of-2 head_dim, 16-byte aligned base and row stride."""
    return (head_dim == head_dim_pad and t.stride(2) == 1 and t.stride(1) == head_dim
            and t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0)


def _cache_words(cache: torch.Tensor) -> torch.Tensor | None:
    """An 8-bit (fp8 or int8) cache [num_blocks, block_size, num_kv_heads, head_dim] as int32 words of four
    values, where its strides and offset allow (the kernel's FP8X4 reads); None otherwise."""
    if cache.dtype not in (FP8_DTYPE, INT8_DTYPE) or cache.stride(3) != 1 or cache.shape[3] % 4:
        return None
    if any(st % 4 for st in cache.stride()[:3]) or cache.storage_offset() % 4 or cache.data_ptr() % 4:
        return None
    return cache.view(torch.int32)


def _rows16_ok(cache: torch.Tensor) -> bool:
    """Whether every row of an 8-bit cache [num_blocks, block_size, num_kv_heads, head_dim] starts on a 16-byte
    boundary (_attend_tiles_words' ALIGN 2): a 16-byte aligned start, block, slot and head strides of whole 16
    bytes (an int8 cache in the "block" layout with head_dim % 16 == 0)."""
    return cache.data_ptr() % 16 == 0 and all(st > 0 and st % 16 == 0 for st in cache.stride()[:3])


def _align16_ok(cache: torch.Tensor) -> bool:
    """Whether the word walk may read an int8 cache [num_blocks, block_size, num_kv_heads, head_dim] (whose words
    _cache_words gave) from the 16-byte boundary below each row, with a 16-byte tail after its head_dim values
    (_attend_tiles_words' ALIGN): a 16-byte aligned start, block and slot strides of whole 16 bytes (so every row of
    a KV head sits the same distance past a boundary), and the last row's tail inside the tensor's storage."""
    if cache.data_ptr() % 16 or any(st <= 0 or st % 16 for st in cache.stride()[:2]) or cache.stride(2) <= 0:
        return False
    last = sum((n - 1) * st for n, st in zip(cache.shape[:3], cache.stride()[:3]))  # bytes to the highest row
    tail_end = last - last % 16 + cache.shape[3] + 16
    return tail_end <= cache.untyped_storage().nbytes() - cache.storage_offset() * cache.element_size()


LAST_LAUNCH: dict = {}  # the last compiled attention kernel (bench/kernels.py reads its registers and spills)


# 256-row prefill tiles (16 warps) pass the CUDA tests but lost to 128-row tiles at two programs per SM in the
# H200 sweep (docs/kernels.md; bench/RESULTS.md).
PREFILL_MAX_BLOCK_M = 128
# Prefill launches read this step's keys from k/v (when the caller passes them): 0 no, 1 by pointers, 2 by TMA.
# TMA is a little faster in the kernel but costs the host more per launch (descriptors), and a short prefill's step is
# bound by the host, not the GPU: off by default (measured: bench/ttft_profile.py, bench/RESULTS.md).
PREFILL_NEW_KV = 0


# Decodes over an int8 cache, their own settings over the shared ones above, the fastest of bench/int8_attn_sweep.py
# on the H200 (bench/RESULTS.md, "INT8 KV cache"): unsplit (large batches) int8_align 1 takes the aligned word walk
# (the engine's block layout: rows 16-byte aligned, ALIGN16 2; a row-layout cache reads from the 16-byte boundary
# below each row, ALIGN16 1; else the plain word walk), 128-key tiles (64 were best in the row layout, whose
# 16-byte tails took the registers), registers capped at 168; INT8_DECODE_SPLIT, launches that split the context
# (small batches): the byte walk with three stages edged out the word walk there (timed in the row layout).
INT8_DECODE: dict[str, int] = dict(num_warps=4, num_stages=2, int8_align=1, tile_n=128, maxnreg=168)
INT8_DECODE_SPLIT: dict[str, int] = dict(num_warps=4, num_stages=3, int8_align=0, fp8x4=0)


# The longest context (keys) the decode launch counts as short: see default_config.
SHORT_DECODE_CONTEXT = 512


def decode_graph_lengths(max_model_len: int, num_seqs: int, num_kv_heads: int, queries_per_kv: int, head_dim: int,
                         num_sms: int, q_bytes: int = 2, kv_fp8: bool = False, kv_int8: bool = False
                         ) -> tuple[int, ...]:
    """The max_seq_len values a decode CUDA graph of num_seqs rows is captured for, shortest first (a step replays
    the first at least its longest context): SHORT_DECODE_CONTEXT too where its launch differs from
    max_model_len's. The launch shape is all max_seq_len steers; each row still stops at its own length."""
    if max_model_len <= SHORT_DECODE_CONTEXT:
        return (max_model_len,)
    shape = (num_seqs, num_seqs, num_kv_heads, queries_per_kv, head_dim, 1)
    flags = (num_sms, q_bytes, kv_fp8, kv_int8)
    if default_config(*shape, SHORT_DECODE_CONTEXT, *flags) == default_config(*shape, max_model_len, *flags):
        return (max_model_len,)
    return (SHORT_DECODE_CONTEXT, max_model_len)


def default_config(
    num_tokens: int, num_seqs: int, num_kv_heads: int, queries_per_kv: int, head_dim: int, max_query_len: int,
    max_seq_len: int, num_sms: int, q_bytes: int = 2, kv_fp8: bool = False, kv_int8: bool = False,
) -> dict[str, int]:
    """Tile sizes, warps, stages and context segments for one launch, from host-side shapes only (no sync).
    The choices come from the H200 sweep in docs/kernels.md."""
    min_m = max(16, triton.next_power_of_2(queries_per_kv))
    if max_query_len == 1:  # decodes only: bandwidth-bound, one row tile per sequence and KV head
        tile_n = 128 if head_dim <= 128 else 64
        num_segments = 1
        # Split the context only when there are fewer (sequence, KV head) programs than SMs: at batch 64 x 4 KV
        # heads the split costs more (reduction pass) than it gains. Split batches use 64-key tiles and may go
        # down to one tile per segment: at batch 1 and a short context a program's serial walk over its keys
        # (latency, not bandwidth) is what a step waits for (measured: bench/profile_decode.py --batch 1,
        # bench/RESULTS.md).
        if num_seqs * num_kv_heads < num_sms:
            tile_n = 64
        while (num_seqs * num_kv_heads * num_segments < num_sms and num_segments < 128
               and max_seq_len >= 2 * num_segments * tile_n):
            num_segments *= 2
        # An fp8 cache: read in 32-bit words (converted by PTX) once there are >= 4 programs per SM; at ~2 per SM
        # byte loads were as fast or faster; two stages beat three either way (docs/kernels.md, bench/RESULTS.md).
        # An int8 cache always: its rows (head_dim + 4 bytes) are only word-aligned, so its byte loads could not be
        # vectorized and the byte walk spilled (bench/RESULTS.md, "INT8 KV cache").
        fp8x4 = 2 if kv_int8 or (kv_fp8 and num_seqs * num_kv_heads * num_segments >= 4 * num_sms) else 0
        # Short contexts at full occupancy: 32-key tiles, 2 warps, 2 stages. A 128-key tile walks up to 127 masked
        # keys past a ~200-token context, and smaller programs keep more of them resident per SM (H200 and H100
        # sweeps at TensorRT-LLM's 128/128 workload, bench/RESULTS.md). The decode CUDA graphs are captured for
        # this length too (engine/cuda_graphs.py), so a step of short sequences gets this launch under a graph.
        num_warps, num_stages = 4, 2 if kv_fp8 else 3
        if num_segments == 1 and max_seq_len <= SHORT_DECODE_CONTEXT and not kv_int8:
            tile_n, num_warps, num_stages = 32, 2, 2
        cfg = dict(block_m=min_m, tile_n=tile_n, num_segments=num_segments, num_warps=num_warps,
                   num_stages=num_stages, fp8_via_fp16=1, new_kv=0, maxnreg=0, fp8x4=fp8x4, int8_align=0)
        if kv_int8:
            cfg.update(INT8_DECODE_SPLIT if num_segments > 1 else INT8_DECODE)
        return cfg
    # Prefill chunks, maybe with decodes: each sequence costs ~(its queries * queries_per_kv + BLOCK_M of padding
    # in its last tile) rows; large tiles run the tensor cores better (relative rates measured on the H200).
    efficiency = {16: 0.35, 32: 0.6, 64: 0.92, 128: 1.0, 256: 1.22}
    candidates = _prefill_block_ms(queries_per_kv, head_dim, max_query_len, q_bytes)
    block_m = min(candidates, key=lambda m: (num_tokens * queries_per_kv + num_seqs * m) / efficiency.get(m, 1.0))
    return _prefill_config(block_m, head_dim, q_bytes, kv_fp8)


def _prefill_block_ms(queries_per_kv: int, head_dim: int, max_query_len: int, q_bytes: int) -> list[int]:
    """The row-tile sizes a prefill launch may use."""
    min_m = max(16, triton.next_power_of_2(queries_per_kv))
    # 256 rows only with 16-bit operands and head_dim <= 128: fp32 tiles of 256 rows overflow shared memory.
    largest = 256 if head_dim <= 128 and q_bytes == 2 and PREFILL_MAX_BLOCK_M >= 256 else 128
    cap = max(min_m, min(largest, triton.next_power_of_2(max_query_len * queries_per_kv)))
    return [m for m in (16, 32, 64, 128, 256) if min_m <= m <= cap] or [min_m]


def _prefill_config(block_m: int, head_dim: int, q_bytes: int = 2, kv_fp8: bool = False) -> dict[str, int]:
    # 128-row tiles of 16-bit queries and cache capped at 128 registers: two programs per SM (8 warps, 96 KiB of
    # shared memory each) overlap one's softmax with the other's matmuls, for a few spilled registers (measured:
    # bench/RESULTS.md). Not measured with an fp8 cache (its compile spills too: bench/RESULTS.md).
    capped = block_m == 128 and q_bytes == 2 and not kv_fp8 and head_dim <= 128
    # An fp8 cache at 128 rows runs faster on 4 warps than on 8 (H200 and H100 sweeps at Llama-3-8B shapes,
    # bench/RESULTS.md). 64-row tiles of 128-token prompts were faster walking 32-key tiles too, but 64 rows is also
    # what a step of 2048-token chunks beside ~125 decodes chooses, where 32-key tiles were not measured to help.
    tile_n = 32 if head_dim > 128 else 64
    warps = 4 if kv_fp8 and block_m == 128 else {256: 16, 128: 8}.get(block_m, 4)
    return dict(block_m=block_m, tile_n=tile_n, num_segments=1,
                num_warps=warps, num_stages=2 if block_m >= 64 else 3, fp8_via_fp16=1,
                new_kv=PREFILL_NEW_KV, maxnreg=128 if capped else 0, fp8x4=0, int8_align=0)


# The prefill launch configurations the H200 sweep compares at Qwen2.5-7B shapes (bench/kernels.py --sweep times
# them on 4k-token chunks; tests/kernels checks each against the reference on CUDA). 16-bit queries, head_dim 128.
PREFILL_CANDIDATES: list[dict[str, int]] = [
    dict(block_m=128, tile_n=64, num_warps=8, num_stages=2, new_kv=0),  # the default before the sweep
    dict(block_m=256, tile_n=64, num_warps=16, num_stages=2, new_kv=0),
    dict(block_m=256, tile_n=64, num_warps=16, num_stages=2, new_kv=1),
    dict(block_m=256, tile_n=64, num_warps=16, num_stages=2, new_kv=2),
    dict(block_m=256, tile_n=64, num_warps=16, num_stages=3, new_kv=2),
    dict(block_m=256, tile_n=32, num_warps=16, num_stages=3, new_kv=2),
    dict(block_m=128, tile_n=64, num_warps=8, num_stages=2, new_kv=2),
    dict(block_m=128, tile_n=64, num_warps=8, num_stages=3, new_kv=2),
    dict(block_m=128, tile_n=128, num_warps=8, num_stages=2, new_kv=2),
    dict(block_m=128, tile_n=64, num_warps=8, num_stages=2, new_kv=2, maxnreg=128),  # 2 programs per SM
    dict(block_m=128, tile_n=64, num_warps=8, num_stages=2, new_kv=0, maxnreg=128),
    dict(block_m=64, tile_n=64, num_warps=4, num_stages=3, new_kv=2),
]


def prefill_configs(queries_per_kv: int, head_dim: int, q_bytes: int, kv_fp8: bool = False) -> list[dict[str, int]]:
    """Every launch configuration default_config can choose for a prefill chunk (for compiling them at start; the
    new_kv variants compile only where the launch gets k/v)."""
    return [_prefill_config(m, head_dim, q_bytes, kv_fp8)
            for m in _prefill_block_ms(queries_per_kv, head_dim, 1 << 20, q_bytes)]


def paged_attention_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides, last dim contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim] to write into (else allocated)
    config: dict[str, int] | None = None,  # overrides default_config's entries (tests, bench/kernels.py and
    #                                         bench/int8_attn_sweep.py)
    k: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim] this step's keys, as written to the cache
    v: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim] this step's values
    k_scale_cache: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] float32 (int8 cache)
    v_scale_cache: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """The device values (seq_lens, query_start_loc, block_tables) are trusted, not checked (that needs a host
    sync); max_query_len and max_seq_len only steer the launch configuration.

    k/v, when given, must hold exactly what write_kv stored for this step's tokens (row t: the key of q's row t).
    With a 16-bit cache a prefill launch may then read the step's own keys from them (contiguous rows: TMA loads,
    no block-table lookups) instead of from the cache; the result is the same."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype, FP8_DTYPE, INT8_DTYPE),
                 shape=(None, None, None, head_dim))
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape))
    int8 = check_int8_scales(k_cache, v_cache, k_scale_cache, v_scale_cache)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32, torch.int64))
    num_seqs = block_tables.shape[0]
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32, torch.int64), shape=(num_seqs,))
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32, torch.int64),
                 shape=(num_seqs + 1,))
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
                      query_start_loc=query_start_loc)
    if (k is None) != (v is None):
        raise ValueError(f"k and v: give both or neither (k is {'None' if k is None else 'set'}, v is "
                         f"{'None' if v is None else 'set'})")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t, ndim=3, dtypes=(q.dtype,), shape=(num_tokens, num_kv_heads, head_dim))
        check_same_device(q=q, k=k, v=v)
    if num_heads % num_kv_heads:
        raise ValueError(f"q: num_heads={num_heads} is not a multiple of the cache's num_kv_heads={num_kv_heads}")
    if head_dim > 256:
        raise ValueError(f"q: head_dim={head_dim} > 256, the largest the kernel supports")
    if max_query_len < 1 or max_seq_len < 1:
        raise ValueError(f"max_query_len={max_query_len}, max_seq_len={max_seq_len}: both must be >= 1")
    if block_tables.shape[1] * block_size < max_seq_len:
        raise ValueError(f"block_tables: {block_tables.shape[1]} blocks x block_size {block_size} < "
                         f"max_seq_len={max_seq_len}")
    for name, val in (("scale", scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        if not float(val) > 0:
            raise ValueError(f"{name}={val}: must be > 0")

    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    check_out("out", out, tuple(q.shape), q.dtype, q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    queries_per_kv = num_heads // num_kv_heads
    cfg = default_config(num_tokens, num_seqs, num_kv_heads, queries_per_kv, head_dim, max_query_len,
                         max_seq_len, sm_count(q.device, 4), q.element_size(), k_cache.dtype == FP8_DTYPE, int8)
    if config:
        unknown = set(config) - set(cfg)
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}, expected some of {sorted(cfg)}")
        cfg.update(config)
    block_m, num_segments, tile_n = cfg["block_m"], cfg["num_segments"], cfg["tile_n"]
    if block_m < queries_per_kv or block_m & (block_m - 1) or num_segments & (num_segments - 1):
        raise ValueError(f"config: block_m={block_m} must be a power of 2 >= queries_per_kv={queries_per_kv}, "
                         f"num_segments={num_segments} a power of 2")
    block_q = block_m // queries_per_kv
    head_dim_pad = max(triton.next_power_of_2(head_dim), 16)  # tl.dot needs every dim >= 16
    dot_fp32 = q.dtype == torch.float32 or interpreting()

    if num_segments > 1:
        seg_out = torch.empty((num_tokens, num_heads, num_segments, head_dim_pad), dtype=torch.float32,
                              device=q.device)
        seg_max = torch.empty((num_tokens, num_heads, num_segments), dtype=torch.float32, device=q.device)
        seg_sum = torch.empty_like(seg_max)
    else:
        seg_out = seg_max = seg_sum = out  # unused
    # This step's keys from k/v: only with a 16-bit cache (an fp8 cache holds rounded keys) and one segment.
    new_kv = cfg["new_kv"] if k is not None and k_cache.dtype == q.dtype and num_segments == 1 else 0
    k_desc = v_desc = None
    if new_kv == 2:
        if _tma_ok(k, head_dim, head_dim_pad) and _tma_ok(v, head_dim, head_dim_pad):
            k_desc, v_desc = (TensorDescriptor(t.as_strided((num_tokens, num_kv_heads * head_dim), (t.stride(0), 1)),
                                               [num_tokens, num_kv_heads * head_dim], [t.stride(0), 1],
                                               [tile_n, head_dim]) for t in (k, v))
        else:
            new_kv = 1
    if new_kv == 0:
        k = v = q  # unused
    via_fp16 = bool(cfg["fp8_via_fp16"]) and q.dtype == torch.bfloat16
    fp8_via_fp16 = via_fp16 and k_cache.dtype == FP8_DTYPE
    kc, vc, fp8x4, align16 = k_cache, v_cache, 0, 0
    if cfg["fp8x4"] and head_dim == head_dim_pad and head_dim % 64 == 0:  # an 8-bit cache only (_cache_words)
        k_words, v_words = _cache_words(k_cache), _cache_words(v_cache)
        if k_words is not None and v_words is not None:
            kc, vc = k_words, v_words
            # 2 (the PTX conversion) needs fp16 dot operands and a compiler (not the interpreter)
            fp8x4 = 2 if cfg["fp8x4"] == 2 and not dot_fp32 and (via_fp16 or q.dtype == torch.float16) else 1
            if int8:  # bf16 queries as fp16 for the PTX conversion's fp16 dots (the word walk keeps P in [0, 1])
                fp8_via_fp16 = fp8x4 == 2 and q.dtype == torch.bfloat16
                if cfg["int8_align"] and _rows16_ok(k_cache) and _rows16_ok(v_cache):
                    align16 = 2
                elif cfg["int8_align"] and _align16_ok(k_cache) and _align16_ok(v_cache):
                    align16 = 1
    ks, vs = (k_scale_cache, v_scale_cache) if int8 else (kc[:, :, :, 0], vc[:, :, :, 0])  # unused without int8
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    maxnreg = {} if interpreting() or not cfg["maxnreg"] else {"maxnreg": cfg["maxnreg"]}
    LAST_LAUNCH["path"] = dict(fp8x4=fp8x4, align16=align16)  # the 8-bit walk taken (bench/int8_attn_sweep.py)
    LAST_LAUNCH["kernel"] = _paged_attention_kernel[grid](
        out, seg_out, seg_max, seg_sum,
        q, k, v, k_desc, v_desc, kc, vc, ks, vs, block_tables, seq_lens, query_start_loc,
        float(scale) * float(k_scale) * math.log2(math.e), float(v_scale),
        num_seqs, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        block_tables.stride(0),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n, NUM_SEGMENTS=num_segments,
        DOT_FP32=dot_fp32, PRECISION="ieee" if dot_fp32 else "tf32",
        FP8_VIA_FP16=fp8_via_fp16,
        NEW_KV=new_kv, OPAQUE_ZERO=not interpreting(), FP8X4=fp8x4, INT8=int8, ALIGN16=align16,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **maxnreg,
    )
    if num_segments > 1:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            out, seg_out, seg_max, seg_sum, out.stride(0), out.stride(1), num_heads,
            NUM_SEGMENTS=num_segments, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, num_warps=4,
        )
    return out
