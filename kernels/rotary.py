"""Rotary position embedding, NeoX style (rotate halves), as Llama, Mistral and Qwen2 use it."""
from __future__ import annotations

import torch


def rotary_embedding_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32: cos in the first half, sin in the second
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(q), rot(k)
