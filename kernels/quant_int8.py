"""Symmetric int8 quantization of K/V rows for the int8 KV cache: x[..., :] = x_q[..., :] * scale[...].

One row is one token's key (or value) for one KV head, head_dim values: scale = max(amax(|x|) * float32(1 / 127),
MIN_SCALE) in float32 (a product, not a quotient: torch on CUDA divides by a scalar as a product with its
reciprocal), x_q = x / scale rounded half away from zero, in [-127, 127] (-128 is never stored, so the range is
symmetric). The scale is computed from the row itself when it is written (dynamic, no calibration), and stored
beside the row in the cache (kernels/kv_write.py writes, kernels/paged_attention.py reads; docs/kernels.md says why
per token and head rather than one static scale per head).

The engine's int8 cache tensor is [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim + INT8_ROW_PAD]
int8: 4 bytes per (slot, KV head) beyond the values, for its float32 scale. Each (block, layer, K/V) region of it
holds, in the "block" layout (INT8_LAYOUT), first the values [block_size, num_kv_heads, head_dim], then the scales
[num_kv_heads, block_size] float32: every value row 16-byte aligned (head_dim % 16 == 0), so the decode attention
reads rows with aligned 16-byte loads (kernels/paged_attention.py), and each head's block_size scales contiguous.
int8_cache_views carves the two views out of the tensor (engine/model_runner.py), so every block's bytes, scales
included, move together through prefix caching, the host tier and every KV transfer path; a tensor-parallel rank's
block holds its own heads in the same layout, and int8_split_heads / int8_join_heads convert between full-head
blocks and the ranks' (engine/collectives.py). The older "row" layout (each row's values, then its scale: rows only
4-byte aligned) remains for bench/int8_attn_sweep.py's comparison.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

INT8_MAX = 127.0
INV_INT8_MAX = 1.0 / INT8_MAX
# A row of zeros gets this scale instead of 0 (x / 0 would be NaN); any row with amax below 127 * MIN_SCALE keeps
# |x_q| < 127, so nothing overflows.
MIN_SCALE = 1e-12
INT8_ROW_PAD = 4  # bytes after each cache row's head_dim values: its float32 scale
_INT8_MAX = tl.constexpr(INT8_MAX)
_INV_INT8_MAX = tl.constexpr(INV_INT8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


def quantize_int8_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] float -> (x_q [..., head_dim] int8, scale [...] float32), the rule above."""
    xf = x.to(torch.float32)
    scale = (xf.abs().amax(dim=-1) * torch.tensor(INV_INT8_MAX, dtype=torch.float32)).clamp(min=MIN_SCALE)
    y = xf / scale[..., None]
    y = torch.sign(y) * torch.floor(y.abs() + 0.5)
    return y.clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize_int8_rows_ref(x_q: torch.Tensor, scale: torch.Tensor,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_q [..., head_dim] int8, scale [...] -> x_q * scale in dtype (computed in float32)."""
    return (x_q.to(torch.float32) * scale.to(torch.float32)[..., None]).to(dtype)


@triton.jit
def _quantize_int8_rows(x):
    """x [ROWS, COLS] (padding columns 0) -> (x_q [ROWS, COLS] float32 holding integers in [-127, 127], scale
    [ROWS] float32): quantize_int8_rows_ref's rule, bit for bit (IEEE division, exact rounding)."""
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) * _INV_INT8_MAX, _MIN_SCALE)
    y = tl.div_rn(x, scale[:, None])
    r = tl.minimum(tl.floor(tl.abs(y) + 0.5), _INT8_MAX)
    return tl.where(y < 0, -r, r), scale


INT8_LAYOUTS = ("row", "block")
# How each (block, layer, K/V) region of an int8 cache holds its values and scales (int8_cache_views).
INT8_LAYOUT = "block"


def int8_cache_views(cache: torch.Tensor, layout: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 cache tensor [..., block_size, num_kv_heads, head_dim + INT8_ROW_PAD] (last dim contiguous) as its
    two views over the tensor's storage: the values [..., block_size, num_kv_heads, head_dim] int8 and the scales
    [..., block_size, num_kv_heads] float32. layout (INT8_LAYOUT by default):
      "row": each row is head_dim values, then its float32 scale (rows 4-byte aligned);
      "block": each block's region (its last three dims, block_size * num_kv_heads * (head_dim + 4) bytes,
        contiguous) is first the values [block_size, num_kv_heads, head_dim], then the scales [num_kv_heads,
        block_size] float32 (each head's block_size scales contiguous): rows 16-byte aligned when head_dim % 16 ==
        0 (and the regions are); the scale view's last strides are (1, block_size)."""
    layout = INT8_LAYOUT if layout is None else layout
    assert cache.dtype == torch.int8 and cache.stride(-1) == 1, (cache.dtype, cache.stride())
    head_dim = cache.shape[-1] - INT8_ROW_PAD
    assert head_dim > 0 and head_dim % 4 == 0, f"head_dim={head_dim}: an int8 cache needs a multiple of 4"
    if layout == "row":
        return cache[..., :head_dim], cache.view(torch.float32)[..., head_dim // 4]
    assert layout == "block", f"int8 layout {layout!r}: one of {INT8_LAYOUTS}"
    assert cache.dim() >= 3, cache.shape
    *lead, block_size, num_kv_heads, row = cache.shape
    lead_strides = cache.stride()[:-3]
    assert cache.stride()[-3:] == (num_kv_heads * row, row, 1) or 0 in cache.shape, \
        f"strides {cache.stride()}: each block's region must be contiguous"
    assert all(st % 4 == 0 for st in lead_strides) and cache.storage_offset() % 4 == 0, cache.stride()
    values = cache.as_strided((*lead, block_size, num_kv_heads, head_dim),
                              (*lead_strides, num_kv_heads * head_dim, head_dim, 1))
    words = cache.view(torch.float32)  # the same storage in float32 elements
    scales = words.as_strided((*lead, block_size, num_kv_heads), (*(st // 4 for st in lead_strides), 1, block_size),
                              words.storage_offset() + block_size * num_kv_heads * head_dim // 4)
    return values, scales


def _int8_regions(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous "block"-layout int8 blocks [..., block_size, heads, row] as views of their regions' bytes: the
    values [..., block_size, heads, head_dim] and the scales' bytes [..., heads, block_size * 4] int8 (bytes, so
    copies are bit-exact whatever the scales hold)."""
    assert x.dtype == torch.int8 and x.is_contiguous() and x.dim() >= 3, (x.dtype, x.shape)
    *lead, block_size, heads, row = x.shape
    n = block_size * heads * (row - INT8_ROW_PAD)
    flat = x.view(*lead, block_size * heads * row)
    return (flat[..., :n].view(*lead, block_size, heads, row - INT8_ROW_PAD),
            flat[..., n:].view(*lead, heads, block_size * INT8_ROW_PAD))


def int8_split_heads(blocks: torch.Tensor, world: int, layout: str | None = None) -> list[torch.Tensor]:
    """Full-head int8 cache blocks [..., block_size, num_kv_heads, row] -> world contiguous parts [..., block_size,
    num_kv_heads / world, row], part r holding heads [r * h, (r + 1) * h) in the same layout (a tensor-parallel
    rank's blocks)."""
    layout = INT8_LAYOUT if layout is None else layout
    assert blocks.shape[-2] % world == 0, (blocks.shape, world)
    if layout == "row":
        return [p.contiguous() for p in blocks.chunk(world, dim=-2)]
    h = blocks.shape[-2] // world
    values, scales = _int8_regions(blocks.contiguous())
    parts = []
    for r in range(world):
        part = torch.empty((*blocks.shape[:-2], h, blocks.shape[-1]), dtype=blocks.dtype, device=blocks.device)
        pv, ps = _int8_regions(part)
        pv.copy_(values[..., r * h:(r + 1) * h, :])
        ps.copy_(scales[..., r * h:(r + 1) * h, :])
        parts.append(part)
    return parts


def int8_join_heads(parts: list[torch.Tensor], layout: str | None = None) -> torch.Tensor:
    """The inverse of int8_split_heads: the ranks' blocks [..., block_size, h, row], in rank order, as full-head
    blocks [..., block_size, h * len(parts), row]."""
    layout = INT8_LAYOUT if layout is None else layout
    if layout == "row":
        return torch.cat(parts, dim=-2)
    p0 = parts[0]
    h = p0.shape[-2]
    full = torch.empty((*p0.shape[:-2], h * len(parts), p0.shape[-1]), dtype=p0.dtype, device=p0.device)
    values, scales = _int8_regions(full)
    for r, part in enumerate(parts):
        pv, ps = _int8_regions(part.contiguous())
        values[..., r * h:(r + 1) * h, :].copy_(pv)
        scales[..., r * h:(r + 1) * h, :].copy_(ps)
    return full
