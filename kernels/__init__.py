"""Hot-path ops for the engine's model. Each dispatches to its Triton kernel on CUDA tensors and to the plain-torch
reference elsewhere.

The `*_ref` functions are the contract (same signatures); the `*_triton` launchers are importable from the
op's module for tests and benchmarks. Each op's module holds its kernel, its launcher and its reference, and
tests/kernels/test_<op>.py compares the two.

What it may import: the standard library, torch and triton, and its own modules; nothing of the engine or above
(a kernel knows tensors, not requests).
"""
from __future__ import annotations

import torch

from kernels.activation import (silu_and_mul_quant_fp8_ref, silu_and_mul_quant_fp8_triton, silu_and_mul_ref,
                                silu_and_mul_triton)
from kernels.cpu_ops import (cpu_fast, fused_add_rms_norm_cpu, rms_norm_cpu, rotary_embedding_write_kv_cpu,
                             rotary_write_kv_cpu_ok, silu_and_mul_cpu)
from kernels.kv_write import write_kv_ref, write_kv_triton
from kernels.norm import (fused_add_rms_norm_quant_fp8_ref, fused_add_rms_norm_quant_fp8_triton, fused_add_rms_norm_ref,
                          fused_add_rms_norm_triton, rms_norm_quant_fp8_ref, rms_norm_quant_fp8_triton, rms_norm_ref,
                          rms_norm_triton)
from kernels.paged_attention import paged_attention_ref, paged_attention_torch, paged_attention_triton
from kernels.paged_attention_cpu import (decode_attention_cpu_ok, native_attention_cpu_ok, paged_attention_cpu_native,
                                        paged_decode_attention_cpu)
from kernels.rotary import (rotary_embedding_ref, rotary_embedding_triton, rotary_embedding_write_kv_ref,
                            rotary_embedding_write_kv_triton)
from kernels.token_bitmask import apply_token_bitmask_ref, apply_token_bitmask_triton


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
                    scale, k_scale=1.0, v_scale=1.0, *, k=None, v=None, k_scale_cache=None, v_scale_cache=None):
    """k/v (optional): this step's keys and values as just written to the cache; the CUDA kernel may read the
    step's own keys from them (the torch paths read the cache). k_scale_cache/v_scale_cache: an int8 cache's
    scales per slot and KV head ([num_blocks, block_size, num_kv_heads] float32)."""
    if q.is_cuda:
        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                                      max_seq_len, scale, k_scale, v_scale, k=k, v=v, k_scale_cache=k_scale_cache,
                                      v_scale_cache=v_scale_cache)
    if native_attention_cpu_ok(q, k_cache, v_cache, k_scale, v_scale, k_scale_cache):
        return paged_attention_cpu_native(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                          max_query_len, max_seq_len, scale, k=k, v=v)
    if decode_attention_cpu_ok(q, k_cache, max_query_len, seq_lens.shape[0], k_scale, v_scale, k_scale_cache):
        return paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale)
    return paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                                 max_seq_len, scale, k_scale, v_scale, k_scale_cache=k_scale_cache,
                                 v_scale_cache=v_scale_cache)


def write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0, *, k_scale_cache=None,
             v_scale_cache=None) -> None:
    fn = write_kv_triton if k.is_cuda else write_kv_ref
    fn(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_scale_cache=k_scale_cache,
       v_scale_cache=v_scale_cache)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps)
    return (rms_norm_cpu if cpu_fast(x) and weight.dtype == x.dtype else rms_norm_ref)(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    if x.is_cuda:
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    fast = cpu_fast(x) and residual.dtype == weight.dtype == x.dtype
    return (fused_add_rms_norm_cpu if fast else fused_add_rms_norm_ref)(x, residual, weight, eps)


def rms_norm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm, then per-token fp8 quantization of its rows: (x_q [..., N] float8_e4m3fn, scale [..., 1] float32),
    one launch on CUDA."""
    return (rms_norm_quant_fp8_triton if x.is_cuda else rms_norm_quant_fp8_ref)(x, weight, eps)


def fused_add_rms_norm_quant_fp8(x, residual, weight, eps):
    """fused_add_rms_norm, its normalized rows quantized per token: (x_q, scale [..., 1], residual)."""
    return (fused_add_rms_norm_quant_fp8_triton if x.is_cuda else fused_add_rms_norm_quant_fp8_ref)(
        x, residual, weight, eps)


def rotary_embedding(positions, q, k, cos_sin_cache):
    return (rotary_embedding_triton if q.is_cuda else rotary_embedding_ref)(positions, q, k, cos_sin_cache)


def rotary_embedding_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale=1.0,
                              v_scale=1.0, *, k_scale_cache=None, v_scale_cache=None):
    """rotary_embedding, then write_kv of the rotated k and v (one launch on CUDA, but for an int8 cache); returns
    the rotated (q, k)."""
    if not q.is_cuda and rotary_write_kv_cpu_ok(q, k_cache, k_scale, v_scale, k_scale_cache):
        return rotary_embedding_write_kv_cpu(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
    fn = rotary_embedding_write_kv_triton if q.is_cuda else rotary_embedding_write_kv_ref
    return fn(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
              k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return silu_and_mul_triton(x)
    return (silu_and_mul_cpu if cpu_fast(x) else silu_and_mul_ref)(x)


def silu_and_mul_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul, then per-token fp8 quantization of its rows: (x_q [..., I], scale [..., 1]), one launch on CUDA."""
    return (silu_and_mul_quant_fp8_triton if x.is_cuda else silu_and_mul_quant_fp8_ref)(x)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i]] gets -inf where bitmask[i] (int32 words, bit set: allowed) forbids a token."""
    (apply_token_bitmask_triton if logits.is_cuda else apply_token_bitmask_ref)(logits, bitmask, rows)


__all__ = [
    "paged_attention", "write_kv", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "rotary_embedding_write_kv",
    "silu_and_mul", "apply_token_bitmask", "rms_norm_quant_fp8", "fused_add_rms_norm_quant_fp8",
    "silu_and_mul_quant_fp8",
    "paged_attention_ref", "write_kv_ref", "rms_norm_ref", "fused_add_rms_norm_ref", "rotary_embedding_ref",
    "silu_and_mul_ref", "apply_token_bitmask_ref",
]
