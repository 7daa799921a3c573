"""CPU fast paths of the elementwise ops, for float32 tensors: fewer torch ops than the reference, no new buffer
where one can be reused. Each gives its reference's result bit for bit (tests/kernels/test_cpu_ops.py); the
kernels/*.py references stay the contract.

What the references' passes cost, SmolLM2 on one core (bench/RESULTS.md, "CPU: Tandem beside vLLM"):
- rms_norm: rms_norm_ref took 8.9 ms over a 2,048-token prefill's [2048, 576], F.rms_norm 3.0 ms; F.rms_norm's CPU
  composite still copies its input twice, so this runs the same arithmetic into in-place temporaries (a batch-16
  decode step's 60 fused-add norms: 5-35% less time in 3 of 4 step-by-step alternations, "CPU: sampler and small
  ops");
- silu_and_mul: silu_and_mul_ref allocates the product of silu(gate) and up (28.7 ms at the prefill) where
  multiplying into silu's own output does not (7.4 ms);
- rotary_embedding_write_kv: at a batch-16 decode step the reference's ~35 small ops a layer (an advanced-index
  gather of cos/sin, eight elementwise ops and a cat per rotated tensor, three boolean-mask selections of the valid
  slots) cost more than their arithmetic; this takes ~16, with no boolean mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def cpu_fast(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm's bits (and rms_norm_ref's): its CPU composite runs the same arithmetic plus two copies of its
    input; this writes the mean, the scale and the result in place of their own temporaries."""
    rstd = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # [..., 1]
    return (x * rstd).mul_(weight)


def fused_add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual (both float32); returns (rms_norm(residual), residual)."""
    residual = x + residual
    return rms_norm_cpu(residual, weight, eps), residual


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:  # [..., 2 * I] -> [..., I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rotary_write_kv_cpu_ok(q: torch.Tensor, k_cache: torch.Tensor, k_scale: float, v_scale: float,
                           k_scale_cache: torch.Tensor | None) -> bool:
    """Whether rotary_embedding_write_kv_cpu computes this call: float32 on the CPU into a float32 cache, unit
    scales."""
    return (cpu_fast(q) and k_cache.dtype == torch.float32 and k_scale == 1.0 and v_scale == 1.0
            and k_scale_cache is None)


def rotary_embedding_write_kv_cpu(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32: cos in the first half, sin in the second
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] float32 (a strided view)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 skips the token's KV write
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding_write_kv_ref's result, bit for bit: x * [cos, cos] + [x2, x1] * [-sin, sin] is
    x1 cos - x2 sin | x2 cos + x1 sin rounded the same way (a negated product is exact, a + (-b) is a - b)."""
    if bool((slot_mapping < 0).any()):  # padding: the reference's masked write
        from kernels.rotary import rotary_embedding_write_kv_ref

        return rotary_embedding_write_kv_ref(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions)[:, None, :]  # [T, 1, D]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    cos2 = torch.cat((cos, cos), dim=-1)  # [T, 1, D]
    sin2 = torch.cat((sin.neg(), sin), dim=-1)

    def rot(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [T, H, D], contiguous
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return swapped.mul_(sin2).add_(x * cos2)

    q_rot, k_rot = rot(q), rot(k)
    slots = slot_mapping.long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache.index_put_((blocks, offsets), k_rot)
    v_cache.index_put_((blocks, offsets), v)
    return q_rot, k_rot
