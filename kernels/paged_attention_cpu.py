"""Paged attention on the CPU: decodes read the cache in place (a C kernel), or through gathered copies (torch).

The CPU engine's decode steps spend their attention time reading K/V from memory, not in the dot products. Two paths:
- `paged_attention_cpu_native`, where kernels/csrc/paged_decode_attention.c compiles (kernels/cpu_native.py) and
  the step is float32 or bfloat16 with unit scales: each one-query row (a decode, or a one-token prompt chunk)
  attends straight from the paged cache, one sequence at a time with all its query heads together, reading each
  K/V row once and no slot past seq_len. In a mixed step only the prompt chunks go to paged_attention_torch, as a
  smaller batch: its padded [num_seqs, max_query_len] query grid then holds no decode rows. A decode row gets the
  same bits in any batch, so sync and async scheduling agree to the last bit.
- `paged_decode_attention_cpu` (no C kernel, or float16) for decode-only steps: 1. `index_select` copies each
  sequence's blocks, whole and in table order, into [num_seqs, blocks * block_size, num_kv_heads, head_dim]; 2. the
  rows past each sequence's length may hold anything, NaN too, and a masked weight of 0 times NaN is NaN: those
  rows alone are zeroed (`index_fill_` of their row ids); 3. SDPA with grouped-query heads attends each query to
  its own sequence's rows under a key mask [S, 1, 1, L]. It gives paged_attention_torch's bits, so its mixed steps
  agree with its decode-only ones.
Both equal paged_attention_ref's result (tests/kernels/test_paged_attention_cpu.py); the timings are in
bench/RESULTS.md ("CPU: decode attention read in place"). fp8/int8 caches take paged_attention_torch.

A prompt chunk that starts at position 0 attends over the step's own k/v (causal SDPA over exactly its keys); a
chunk after a prefix-cache hit, or a later chunk of a long prompt, goes through paged_attention_torch, whose bits
depend in the last place on the step's padding (its longest chunk and context). So a prompt computed whole and
the same prompt computed after a prefix hit may differ in the last bits of their logits, as in vLLM; a decode's
bits never depend on its step.
"""
from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from kernels._checks import FLOAT_DTYPES
from kernels.cpu_native import load_library
from kernels.paged_attention import paged_attention_torch

NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the C kernel's dtype codes
# The C kernel keeps a work item's queries, accumulators and scores ([heads, max(head_dim, 32)] floats each, at least
# one KV head's group) and, for bfloat16, a tile's widened rows ([32, head_dim]) on its thread's stack: its MAX_ELEMS,
# MAX_HEAD_DIM and TILE.
MAX_GROUP_ELEMS = 8192
MAX_HEAD_DIM = 256


def decode_attention_cpu_ok(q: torch.Tensor, k_cache: torch.Tensor, max_query_len: int, num_seqs: int,
                            k_scale: float, v_scale: float, k_scale_cache: torch.Tensor | None) -> bool:
    """Whether paged_decode_attention_cpu computes this call: a decode-only step on the CPU with a cache of q's
    float dtype and unit scales."""
    return (q.device.type == "cpu" and max_query_len == 1 and q.shape[0] == num_seqs and k_cache.dtype == q.dtype
            and q.dtype in FLOAT_DTYPES and k_scale_cache is None and k_scale == 1.0 and v_scale == 1.0)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[num_seqs, num_blocks_each * block_size, num_kv_heads, head_dim]: the blocks of `block_ids` (flat, each
    sequence's in table order), copied whole."""
    rows = cache.index_select(0, block_ids)  # [num_seqs * nb, block_size, Hkv, D], contiguous
    return rows.view(num_seqs, -1, *cache.shape[2:])


def paged_decode_attention_cpu(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one query per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (a strided view)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, block_size = q.shape[0], k_cache.shape[1]
    assert k_cache.dtype == v_cache.dtype == q.dtype, (k_cache.dtype, v_cache.dtype, q.dtype)
    num_blocks = -(-max_seq_len // block_size)
    ids = block_tables[:, :num_blocks].reshape(-1)
    k = gather_blocks(k_cache, ids, num_seqs)  # [S, Lb, Hkv, D], Lb = num_blocks * block_size
    v = gather_blocks(v_cache, ids, num_seqs)
    stale = torch.arange(k.shape[1])[None, :] >= seq_lens[:, None]  # [S, Lb]
    rows = stale.view(-1).nonzero().view(-1)
    k.view(-1, k.shape[2] * k.shape[3]).index_fill_(0, rows, 0.0)
    v.view(-1, v.shape[2] * v.shape[3]).index_fill_(0, rows, 0.0)
    # SDPA sees what paged_attention_torch hands it (max_seq_len keys, the same mask), so a sequence's decode gives
    # the same bits whether its step is decode-only (here) or mixed with prompt chunks (there).
    k, v, stale = k[:, :max_seq_len], v[:, :max_seq_len], stale[:, :max_seq_len]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=~stale[:, None, None, :], scale=scale, enable_gqa=True)
    return out[:, :, 0, :]  # [S, H, D]


@functools.cache
def _native_kernel():
    """The C kernel's entry point, or None (no compiler, a failed build, TANDEM_CPU_NATIVE=0)."""
    lib = load_library("paged_decode_attention")
    if lib is None:
        return None
    fn = lib.paged_decode_attention
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [p, i64, i64,  # out, its token and head strides
                   p, i64, i64,  # q
                   p, i64, i64, i64,  # k_cache, its block, slot and head strides
                   p, i64, i64, i64,  # v_cache
                   p, i64, i64, i64,  # block_tables, row stride, max_blocks, num_blocks
                   p, p,  # seq_lens, query_start_loc
                   i32, i32, i32, i32, i32,  # num_seqs, num_heads, num_kv_heads, head_dim, block_size
                   ctypes.c_float, i32, i32]  # scale, dtype code, threads
    fn.restype = i32
    return fn


def native_attention_cpu_ok(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float,
                            v_scale: float, k_scale_cache: torch.Tensor | None) -> bool:
    """Whether paged_attention_cpu_native computes this call: CPU tensors of one float32 or bfloat16 dtype, unit
    scales, rows with a contiguous last dim, and the C kernel built."""
    if not (q.device.type == "cpu" and q.dtype in NATIVE_DTYPES and k_cache.dtype == v_cache.dtype == q.dtype
            and k_scale_cache is None and k_scale == 1.0 and v_scale == 1.0):
        return False
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape or q.shape[2] != k_cache.shape[3]:
        return False
    num_heads, num_kv_heads, head_dim = q.shape[1], k_cache.shape[2], q.shape[2]
    return (num_heads % num_kv_heads == 0 and num_heads // num_kv_heads * max(head_dim, 32) <= MAX_GROUP_ELEMS
            and head_dim <= MAX_HEAD_DIM
            and q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
            and _native_kernel() is not None)


def _int32(t: torch.Tensor) -> torch.Tensor:
    """t as int32 with a contiguous last dim (the engine's tables already are: no copy)."""
    return t if t.dtype == torch.int32 and t.stride(-1) == 1 else t.to(torch.int32).contiguous()


def paged_decode_attention_native(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (a strided view)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], q's dtype, last dim contiguous
) -> torch.Tensor:
    """Writes out's row of every sequence with exactly one query (the others' rows are left as they are), by the
    C kernel; the caller has checked native_attention_cpu_ok. Raises ValueError for a seq_len or block id the
    cache or the table cannot hold (the kernel checks them: a wrong one would read outside the cache)."""
    num_seqs, (num_blocks, block_size, num_kv_heads, head_dim) = seq_lens.shape[0], k_cache.shape
    bt, sl, qsl = _int32(block_tables), _int32(seq_lens), _int32(query_start_loc)
    assert out.dtype == q.dtype and out.shape == q.shape and out.stride(2) == 1, (out.dtype, out.shape)
    bad = _native_kernel()(
        out.data_ptr(), out.stride(0), out.stride(1),
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        bt.data_ptr(), bt.stride(0), bt.shape[1], num_blocks,
        sl.data_ptr(), qsl.data_ptr(),
        num_seqs, q.shape[1], num_kv_heads, head_dim, block_size,
        scale, NATIVE_DTYPES[q.dtype], torch.get_num_threads())
    if bad:
        i = bad - 1
        raise ValueError(f"sequence {i}: seq_len={int(sl[i])} with block table {bt[i].tolist()} reads past the "
                         f"table ({bt.shape[1]} blocks of {block_size}) or the cache ({num_blocks} blocks)")
    return out


def paged_attention_cpu_native(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (a strided view)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    k: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: this step's keys, as written to the cache
    v: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """paged_attention_torch's contract: one-query rows by the C kernel; prompt chunks that start at position 0
    attend over the step's own k/v (when given); the other chunks by paged_attention_torch over those sequences
    alone."""
    out = torch.empty(q.shape, dtype=q.dtype)
    paged_decode_attention_native(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out)
    if max_query_len == 1 and q.shape[0] == seq_lens.shape[0]:  # every sequence has one query: all done
        return out
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    chunked = q_lens != 1  # [S]: the sequences the kernel left
    if k is not None and v is not None:
        whole = chunked & (q_lens == seq_lens) & (q_lens > 0)  # [S]: chunks of every token of their sequence
        if bool(whole.any()):
            _causal_over_own_kv(q, k, v, query_start_loc, q_lens, whole, scale, out)
            chunked &= ~whole
            if not bool(chunked.any()):
                return out
    chunks = chunked.nonzero().view(-1)
    rows = chunked.repeat_interleave(q_lens)  # [T]: their query rows
    chunk_qsl = torch.zeros(chunks.shape[0] + 1, dtype=torch.int32)
    chunk_qsl[1:] = q_lens[chunks].cumsum(0)
    out[rows] = paged_attention_torch(q[rows], k_cache, v_cache, block_tables[chunks], seq_lens[chunks], chunk_qsl,
                                      max_query_len, max_seq_len, scale)
    return out


def _causal_over_own_kv(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    q_lens: torch.Tensor,  # [num_seqs]
    whole: torch.Tensor,  # [num_seqs] bool: the sequences whose chunk starts at position 0
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]: their rows are written
) -> None:
    """Prompt chunks that start at position 0 see only their own keys, which this step computed: causal SDPA over
    the step's k/v, with no copy out of the paged cache, no stale rows to clear and no padded query grid (what a
    fresh prompt's prefill step spent besides SDPA's own work; bench/RESULTS.md, "CPU: colocated prompt steps").
    Chunks of one length go to SDPA together as a batch."""
    num_tokens = q.shape[0]
    lens = q_lens[whole]
    starts = query_start_loc[:-1][whole].long()
    for n in lens.unique().tolist():
        first = starts[lens == n]  # [B]: the first row of each chunk of n tokens
        if first.shape[0] * n == num_tokens:  # (every row of the step, in order: views, no copies)
            qb, kb, vb = (t.view(-1, n, *t.shape[1:]) for t in (q, k, v))
        else:
            rows = (first[:, None] + torch.arange(n)[None, :]).view(-1)  # [B * n]
            qb, kb, vb = (t.index_select(0, rows).view(-1, n, *t.shape[1:]) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                           is_causal=True, scale=scale, enable_gqa=True)  # [B, H, n, D]
        o = o.transpose(1, 2)  # [B, n, H, D]
        if first.shape[0] * n == num_tokens:
            out.copy_(o.reshape(out.shape))
        else:
            out.index_copy_(0, rows, o.reshape(-1, *out.shape[1:]))
